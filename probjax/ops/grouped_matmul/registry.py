"""The grouped matmul's backends, in the order the default prefers them on a GPU.

The MoE expert block's strategies (dense, sorted, the fused gather-sum) are registered in
their own registry, :data:`probjax.ops.grouped_matmul.strategies.STRATEGIES`: they compose
these products with the routing rather than compute one, and the MoE dispatch
(:mod:`probjax.ops.grouped_matmul.moe_dispatch`) names them.
"""

from __future__ import annotations

from probjax.core.backend import Registry
from probjax.ops.grouped_matmul.backends.mosaic_gpu import MosaicBackend
from probjax.ops.grouped_matmul.backends.triton import TritonBackend
from probjax.ops.grouped_matmul.backends.xla import XlaBackend
from probjax.ops.grouped_matmul.call import GroupedMatmulCall

REGISTRY: Registry[GroupedMatmulCall] = Registry("grouped_matmul")
REGISTRY.register(XlaBackend())
REGISTRY.register(TritonBackend())
REGISTRY.register(MosaicBackend())
