"""MLA's backends: ``xla`` (the forms through attention's face) and ``triton`` (the absorbed form
with MLA's own decode kernel). :mod:`probjax.ops.mla.dispatch` picks one per call."""

from __future__ import annotations

from probjax.core.backend import Registry
from probjax.ops.mla.backends.triton import TritonBackend
from probjax.ops.mla.backends.xla import XlaBackend
from probjax.ops.mla.call import MLACall

REGISTRY: Registry[MLACall] = Registry("mla")
REGISTRY.register(XlaBackend())
REGISTRY.register(TritonBackend())
REGISTRY.add("mosaic", "probjax.ops.mla.backends.mosaic_gpu.backend:MosaicBackend", aliases=("mosaic_gpu",))
