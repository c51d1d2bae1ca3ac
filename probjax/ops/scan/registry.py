"""The one list of the scan room's backends: a :class:`~probjax.core.backend.Registry` per op,
in the order ``explain_dispatch`` reports them."""

from __future__ import annotations

from probjax.core.backend import Registry
from probjax.ops.scan.backends import associative, chunked, scan, triton

MAMBA = Registry("mamba_scan")
SSD = Registry("ssd_scan")
RLA = Registry("residual_linear_attention")

for _backend in (scan.MambaScan(), associative.MambaAssociative(), chunked.MambaChunked(),
                 triton.MambaTriton()):
  MAMBA.register(_backend)
for _backend in (scan.SSDScan(), associative.SSDAssociative(), chunked.SSDChunked(),
                 triton.SSDTriton()):
  SSD.register(_backend)
for _backend in (scan.RLAScan(), chunked.RLAChunked(), triton.RLATriton()):
  RLA.register(_backend)
