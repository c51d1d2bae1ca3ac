"""The grouped matmul's backends, in the order the default prefers them on a GPU."""

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
