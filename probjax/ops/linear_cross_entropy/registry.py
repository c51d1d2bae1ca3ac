"""The one list of ``linear_cross_entropy``'s backends."""

from __future__ import annotations

from probjax.core.backend import Registry
from probjax.ops.linear_cross_entropy.backends.xla import Xla
from probjax.ops.linear_cross_entropy.call import LinearCrossEntropyCall

REGISTRY: Registry[LinearCrossEntropyCall] = Registry("linear_cross_entropy")
REGISTRY.register(Xla())
REGISTRY.add("triton", "probjax.ops.linear_cross_entropy.backends.triton:Triton", aliases=("pallas_triton",))
