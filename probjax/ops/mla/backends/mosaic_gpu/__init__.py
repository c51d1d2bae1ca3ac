"""MLA's ``mosaic`` backend (:mod:`.backend`): the absorbed form with its own decode kernel in
Pallas Mosaic GPU for Hopper (sm_90: TMA loads, wgmma; :mod:`.decode`)."""

from probjax.ops.mla.backends.mosaic_gpu.backend import MosaicBackend
from probjax.ops.mla.backends.mosaic_gpu.decode import combine, decode, why_not

__all__ = ["MosaicBackend", "decode", "combine", "why_not"]
