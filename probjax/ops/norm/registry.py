"""The one list of the norm op's backends."""

from __future__ import annotations

from probjax.core.backend import Registry
from probjax.ops.norm.call import NormCall

REGISTRY: Registry[NormCall] = Registry("norm")
REGISTRY.add("xla", "probjax.ops.norm.backends.xla:Xla", aliases=("jnp",))
REGISTRY.add("triton", "probjax.ops.norm.backends.triton:Triton", aliases=("pallas",))
