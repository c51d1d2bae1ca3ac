"""Which implementation computes a scan-room call: pure rules over ``(call, Device)``, each
decision with its reason, so tests run them on CPU with fake devices.

Rules for ``implementation=None``:
  1. A GPU (or Pallas interpret mode): ``"triton"`` where its kernels compute the call
     exactly, else ``"chunked"`` (the reason says why the kernels cannot).
  2. Elsewhere the fastest exact XLA form measured on CPU (:data:`CPU_DEFAULT`).
An explicit ``implementation`` is checked, never replaced: where it cannot run on the device or
compute the call exactly, ValueError says why.
"""

from __future__ import annotations

import dataclasses

from probjax.core.backend import Registry
from probjax.core.device import Device
from probjax.ops.scan import chunked_math, registry
from probjax.ops.scan.calls import MambaCall, RLACall, SSDCall

# Measured on a two-core CPU (float32, lengths 256 and 2048), forward and forward+backward:
# Mamba-1's sequential scan is the fastest in both (its chunked form does the elementwise
# state work about twice, which a CPU does not hide; the associative form log(L) times). For
# SSD and RLA the chunked form (matmuls inside a chunk) is the fastest differentiated, by
# far, and near the sequential scan's forward.
CPU_DEFAULT = {"mamba_scan": "scan", "ssd_scan": "chunked", "residual_linear_attention": "chunked"}


@dataclasses.dataclass(frozen=True)
class Decision:
  """The implementation chosen for a call, the rule that chose it, its chunk (None: it has
  none) and, where it differs from the implementation, what a differentiated call runs."""

  implementation: str
  rule: str
  chunk_size: int | None = None
  grad: str | None = None

  def __str__(self):
    extra = f", chunk {self.chunk_size}" if self.chunk_size else ""
    if self.grad:
      extra += f"; differentiated: {self.grad}"
    return f"{self.implementation}{extra} ({self.rule})"


def registry_of(call) -> Registry:
  """The registry of ``call``'s op."""
  for kind, reg in ((MambaCall, registry.MAMBA), (SSDCall, registry.SSD), (RLACall, registry.RLA)):
    if isinstance(call, kind):
      return reg
  raise TypeError(f"not a scan-room call: {type(call).__name__}")


def _decision(call, name: str, rule: str) -> Decision:
  backend = registry_of(call).get(name)
  chunk = backend.chunk_size(call)
  grad = None
  if name == "triton" and not isinstance(call, RLACall):
    xla_chunk = chunk if isinstance(call, SSDCall) else chunked_math.default_chunk(call)
    grad = f"the chunked XLA formulation, chunk {xla_chunk}"
  return Decision(name, rule, chunk, grad)


def explain_dispatch(call, *, implementation: str | None = None, device: Device | None = None) -> Decision:
  """The :class:`Decision` for ``call`` (a :class:`MambaCall`, :class:`SSDCall` or
  :class:`RLACall`) on ``device`` (default: the current one, or the interpreter's for a call
  with ``interpret=True``)."""
  reg = registry_of(call)
  if device is None:
    device = Device.interpreter() if call.interpret else Device.current()
  name = reg.canonical(implementation)
  if name is not None:
    backend = reg.get(name)
    why = backend.available(device) or backend.supports(call, device)
    if why:
      raise ValueError(f"{reg.op}: implementation={name!r} cannot compute this call: {why}")
    return _decision(call, name, "requested")
  if device.platform == "gpu":
    kernel = reg.get("triton")
    why = kernel.available(device) or kernel.supports(call, device)
    if why is None:
      return _decision(call, "triton", "GPU: the Triton kernels compute the call exactly")
    return _decision(call, "chunked", f"GPU: the Triton kernels cannot take it ({why})")
  return _decision(call, CPU_DEFAULT[reg.op], f"platform {device.platform}: the fastest exact XLA form measured on CPU")


def available_implementations(call, device: Device | None = None) -> list[str]:
  """The implementations of ``call``'s op that can run on ``device`` (default: the current one)."""
  return registry_of(call).available(device or Device.current())
