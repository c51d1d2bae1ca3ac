"""The one list of the scan room's backends: a :class:`~probjax.core.backend.Registry` per op,
in the order ``explain_dispatch`` reports them; each backend owns its checks (``available``,
``supports``), which :func:`refusal` asks."""

from __future__ import annotations

from probjax.core.backend import Registry
from probjax.core.device import Device
from probjax.ops.scan.backends import associative, chunked, scan, triton
from probjax.ops.scan.calls import MambaCall, RLACall, SSDCall

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

_BY_CALL = ((MambaCall, MAMBA), (SSDCall, SSD), (RLACall, RLA))


def of(call) -> Registry:
  """The registry of ``call``'s op."""
  for kind, reg in _BY_CALL:
    if isinstance(call, kind):
      return reg
  raise TypeError(f"not a scan-room call: {type(call).__name__}")


def refusal(reg: Registry, name: str, call, device: Device) -> str | None:
  """Why backend ``name`` of ``reg`` cannot compute ``call`` on ``device`` (its own
  ``available``, then its own ``supports``), or None."""
  backend = reg.get(name)
  return backend.available(device) or backend.supports(call, device)
