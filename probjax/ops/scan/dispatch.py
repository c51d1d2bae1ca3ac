"""Which implementation computes a scan-room call: pure rules over ``(call, Device)``, each
decision with its reason, so tests run them on CPU with fake devices.

Rules for ``implementation=None``:
  1. A GPU (or Pallas interpret mode): ``"triton"`` where its kernels compute the call
     exactly, else ``"chunked"`` (the reason says why the kernels cannot). A differentiated
     call runs :data:`GPU_GRAD_DEFAULT`'s form instead, forward and backward.
  2. Elsewhere the fastest exact XLA form measured on CPU (:data:`CPU_DEFAULT`).
An explicit ``implementation`` is checked, never replaced: where it cannot run on the device or
compute the call exactly, ValueError says why.
"""

from __future__ import annotations

import dataclasses
import functools

import jax

from probjax.core.backend import Registry
from probjax.core.device import Device
from probjax.ops.scan import registry
from probjax.ops.scan.calls import MambaCall, RLACall, SSDCall

# Measured on a two-core CPU (float32, lengths 256 and 2048), forward and forward+backward:
# Mamba-1's sequential scan is the fastest in both (its chunked form does the elementwise
# state work about twice, which a CPU does not hide; the associative form log(L) times). For
# SSD and RLA the chunked form (matmuls inside a chunk) is the fastest differentiated, by
# far, and near the sequential scan's forward.
CPU_DEFAULT = {"mamba_scan": "scan", "ssd_scan": "chunked", "residual_linear_attention": "chunked"}

# What an undifferentiated call runs on a GPU: the fastest exact forward measured on the H200
# (docs/decisions.md, "Forward GPU calls"). Mamba-1's per-(channel, state) decay has no matmul
# form, so the sequential Triton kernel, reading each input once, wins; SSD's and RLA's chunked
# XLA forms run their intra-chunk work as large tensor-core matmuls, which the Triton kernels'
# smaller tiles do not match.
GPU_FORWARD_DEFAULT = {"mamba_scan": "triton", "ssd_scan": "chunked", "residual_linear_attention": "chunked"}

# What a differentiated call runs on a GPU (forward with residuals and backward): the fastest
# exact form of forward+backward measured on the H200 (docs/decisions.md, "Differentiated GPU
# calls"). Mamba-1's Triton kernels read each input once per pass and keep only chunk-boundary
# states, where the associative form materialises every position's state; calls those kernels
# cannot take run the associative form (memory permitting). RLA's chunked XLA form keeps its
# state updates on tensor cores, which the Triton backward kernels do not; SSD's chunked form
# at chunk 64 beats the kernels' chunk of 32.
GPU_GRAD_DEFAULT = {"mamba_scan": "triton", "ssd_scan": "chunked", "residual_linear_attention": "chunked"}
# The associative form keeps the state at every position for its backward, with the scan's
# temporaries about three float32 copies of ``[batch, length, channels, state]``; past this
# share of the device's memory the chunked form (inputs and chunk-boundary states only) runs.
# E.g. B2 L1024 D1536 N512 (a state the kernels refuse): 3 x 6.4 GB of 140 GB, associative.
ASSOCIATIVE_MEMORY_SHARE = 0.25


def _gpu_grad(call, device: Device, kernel_ok: bool) -> str:
  """What a differentiated call runs on a GPU (:data:`GPU_GRAD_DEFAULT`; the associative form
  where the kernels cannot take it, memory permitting)."""
  grad = GPU_GRAD_DEFAULT[registry_of(call).op]
  if grad == "triton" and not kernel_ok:
    grad = "associative"
  if grad == "associative" and device.memory_bytes:
    states = 3 * 4 * call.batch * call.length * call.channels * call.state
    if states > ASSOCIATIVE_MEMORY_SHARE * device.memory_bytes:
      return "chunked"
  return grad


@dataclasses.dataclass(frozen=True)
class Decision:
  """The implementation chosen for a call, the rule that chose it, its chunk (None: it has
  none) and, where a differentiated call runs another implementation forward and backward,
  that one (``grad_implementation``, a registry name) and its chunk."""

  implementation: str
  rule: str
  chunk_size: int | None = None
  grad_implementation: str | None = None
  grad_chunk_size: int | None = None

  def __str__(self):
    extra = f", chunk {self.chunk_size}" if self.chunk_size else ""
    if self.grad_implementation:
      extra += f"; differentiated: {self.grad_implementation}"
      extra += f", chunk {self.grad_chunk_size}" if self.grad_chunk_size else ""
    return f"{self.implementation}{extra} ({self.rule})"


def registry_of(call) -> Registry:
  """The registry of ``call``'s op."""
  for kind, reg in ((MambaCall, registry.MAMBA), (SSDCall, registry.SSD), (RLACall, registry.RLA)):
    if isinstance(call, kind):
      return reg
  raise TypeError(f"not a scan-room call: {type(call).__name__}")


def _decision(call, name: str, rule: str, grad: str | None = None) -> Decision:
  """``name`` runs the call; differentiated, ``grad`` does (None: ``name`` itself, or for the
  SSD kernel, which has no backward, ``"chunked"``)."""
  reg = registry_of(call)
  if grad is None and name == "triton" and isinstance(call, SSDCall):
    grad = "chunked"
  if grad == name:
    grad = None
  return Decision(name, rule, reg.get(name).chunk_size(call), grad,
                  None if grad is None else reg.get(grad).chunk_size(call))


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
    grad = _gpu_grad(call, device, why is None)
    if GPU_FORWARD_DEFAULT[reg.op] == "chunked":
      return _decision(call, "chunked", "GPU: the chunked XLA form, the fastest forward measured; "
                       "differentiated, the fastest forward+backward measured", grad)
    if why is None:
      return _decision(call, "triton", "GPU: the Triton kernels compute the call exactly; differentiated, "
                       "the fastest forward+backward measured", grad)
    return _decision(call, "chunked", f"GPU: the Triton kernels cannot take it ({why})", grad)
  return _decision(call, CPU_DEFAULT[reg.op], f"platform {device.platform}: the fastest exact XLA form measured on CPU")


def with_grad_of(primal, grad):
  """``primal(*arrays)``, differentiated as ``grad(*arrays)`` (its forward with residuals and its
  backward): how a decision's ``grad_implementation`` runs beside a forward-only kernel."""
  f = jax.custom_vjp(primal)
  f.defvjp(lambda *arrays: jax.vjp(grad, *arrays), lambda vjp, ct: vjp(ct))
  return f


def resolve(call, implementation: str | None = None):
  """The function ``f(*arrays)`` that computes ``call`` as :func:`explain_dispatch` decides."""
  decision = explain_dispatch(call, implementation=implementation)
  reg = registry_of(call)
  primal = functools.partial(reg.get(decision.implementation), call=call)
  if decision.grad_implementation is None:
    return primal
  return with_grad_of(primal, functools.partial(reg.get(decision.grad_implementation), call=call))


def available_implementations(call, device: Device | None = None) -> list[str]:
  """The implementations of ``call``'s op that can run on ``device`` (default: the current one)."""
  return registry_of(call).available(device or Device.current())
