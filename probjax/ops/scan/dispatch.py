"""Which implementation computes a scan-room call: pure rules over ``(call, Device)``, each
decision (:class:`probjax.core.dispatch.Decision`) with its reason, so tests run them on CPU
with fake devices.

Rules for ``implementation=None``:
  1. A GPU (or Pallas interpret mode): ``"triton"`` where its kernels compute the call
     exactly, else ``"chunked"`` (the reason says why the kernels cannot). A differentiated
     call runs ``tuning/gpu.json`` "grad"'s form instead, forward and backward.
  2. Elsewhere the fastest exact XLA form measured on CPU (``tuning/cpu.json`` "default").
An explicit ``implementation`` is checked, never replaced: where it cannot run on the device or
compute the call exactly, ValueError says why.

A decision's ``config`` is ``(("chunk_size", n),)`` where the implementation runs the call in
chunks of ``n``; its ``grad`` is the decision a differentiated call runs instead (forward with
residuals, then backward), where that is another implementation.
"""

from __future__ import annotations

import functools
import os

import jax

from probjax.core.backend import Registry
from probjax.core import tuning
from probjax.core.device import Device
from probjax.core.dispatch import REQUESTED, Decision
from probjax.ops.scan import registry

# The default backend per op, read from ``tuning/`` (values only; :mod:`probjax.core.tuning`):
#
# ``cpu.json`` "default": measured on a two-core CPU (float32, lengths 256 and 2048), forward and
# forward+backward. Mamba-1's sequential scan is the fastest in both (its chunked form does the
# elementwise state work about twice, which a CPU does not hide; the associative form log(L)
# times). For SSD and RLA the chunked form (matmuls inside a chunk) is the fastest
# differentiated, by far, and near the sequential scan's forward.
#
# ``gpu.json`` "forward": what an undifferentiated call runs on a GPU, the fastest exact forward
# measured (docs/dev/decisions.md, "Forward GPU calls" and the entries after it). Mamba-1's
# per-(channel, state) decay has no matmul form, so the sequential Triton kernel, reading each
# input once, wins; SSD's forward kernel fuses the chunk's matmuls and state pass that the
# chunked XLA form runs as separate programs with [chunk, chunk] intermediates in memory.
#
# ``gpu.json`` "grad": what a differentiated call runs on a GPU (forward with residuals and
# backward), the fastest exact forward+backward measured (docs/dev/decisions.md,
# "Differentiated GPU calls"). Mamba-1's Triton kernels read each input once per pass and keep
# only chunk-boundary states, where the associative form materialises every position's state;
# calls those kernels cannot take run the associative form (memory permitting). SSD's chunked
# form at chunk 64 beat the forward kernel differentiated through the chunked form at the
# kernels' chunk of 32, and beats the SSD backward kernel too (run where
# ``implementation="triton"`` asks for it), which walks the chunks in reverse one after another
# in a grid of about one wave of SMs.
#
# A value is a backend name; or ``{dtype: value, ..., "other": value}`` where the fastest form
# depends on the inputs' dtype; or ``{"attr": a, "below": n, "then": value, "else": value}``
# where it depends on one size of the call (``call.a < n``). E.g. RLA: in bfloat16 and float16
# the Triton kernels beat the chunked form about twice, forward and differentiated; in float32
# they were ahead at feature width 128 but 5x behind at 256 (their tiles hold a [features,
# v_head_dim] float32 state), so float32 runs them below feature width 256 (docs/dev/decisions.md,
# "RLA by dtype").
TUNING = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tuning")


def tuned(device: Device) -> dict:
  """The scan room's tuned values for ``device`` (``"default"`` off the GPU; ``"forward"`` and
  ``"grad"`` on one), each ``{op: backend}``."""
  return tuning.values(TUNING, device)


# The associative form keeps the state at every position for its backward, with the scan's
# temporaries about three float32 copies of ``[batch, length, channels, state]``; past this
# share of the device's memory the chunked form (inputs and chunk-boundary states only) runs.
# E.g. B2 L1024 D1536 N512 (a state the kernels refuse): 3 x 6.4 GB of 140 GB, associative.
ASSOCIATIVE_MEMORY_SHARE = 0.25

# Why a differentiated call runs another implementation than its forward (a decision's
# ``grad.rule``).
GRAD_RULE_GPU = ("GPU, differentiated: the fastest exact forward+backward measured; where the Triton "
                 "kernels cannot take the call, the associative form (memory permitting)")


def registry_of(call) -> Registry:
  """The registry of ``call``'s op."""
  return registry.of(call)


def device_of(call) -> Device:
  """The device a call is decided for by default: the interpreter's for ``interpret=True``,
  else the current one."""
  return Device.interpreter() if call.interpret else Device.current()


def tuned_choice(call, device: Device, table: str) -> tuple[str, str]:
  """The backend ``tuning``'s ``table`` ("forward", "grad" or "default") names for ``call``, and
  the conditions that chose it (e.g. ``"float32, features 128 < 256"``; empty for a plain name).
  A value is a name, ``{dtype: value, "other": value}`` or ``{"attr", "below", "then",
  "else"}`` (the comment above :data:`TUNING`)."""
  value, why = tuned(device)[table][registry_of(call).op], []
  while isinstance(value, dict):
    if "attr" in value:
      size, bound = getattr(call, value["attr"]), value["below"]
      below = size < bound
      why.append(f"{value['attr']} {size} {'<' if below else '>='} {bound}")
      value = value["then" if below else "else"]
    else:
      why.append(call.dtype)
      value = value.get(call.dtype, value["other"])
  return value, ", ".join(why)


def tuned_form(call, device: Device, table: str) -> str:
  """The backend ``tuning``'s ``table`` names for ``call`` (:func:`tuned_choice` without the
  conditions)."""
  return tuned_choice(call, device, table)[0]


def _gpu_grad(call, device: Device, kernel_ok: bool) -> str:
  """What a differentiated call runs on a GPU (``tuning/gpu.json`` "grad"; where the kernels
  cannot take it, the associative form, memory permitting, or the chunked one for ops without
  an associative form)."""
  reg = registry_of(call)
  grad = tuned_form(call, device, "grad")
  if grad == "triton" and not kernel_ok:
    grad = "associative" if "associative" in reg.names() else "chunked"
  if grad == "associative" and device.memory_bytes:
    states = 3 * 4 * call.batch * call.length * call.channels * call.state
    if states > ASSOCIATIVE_MEMORY_SHARE * device.memory_bytes:
      return "chunked"
  return grad


def _config(reg: Registry, name: str, call) -> tuple:
  """``(("chunk_size", n),)`` where ``name`` runs ``call`` in chunks of ``n``, else empty."""
  chunk = reg.get(name).chunk_size(call)
  return () if chunk is None else (("chunk_size", chunk),)


def _decision(call, name: str, rule: str, grad: str | None = None) -> Decision:
  """``name`` runs the call; differentiated, ``grad`` does (None: ``name`` itself, its own
  backward: every implementation has one, the Triton kernels' included)."""
  reg = registry_of(call)
  if grad == name:
    grad = None
  return Decision(name, rule, config=_config(reg, name, call),
                  grad=None if grad is None else Decision(grad, GRAD_RULE_GPU, config=_config(reg, grad, call)))


def decide(call, implementation: str | None, device: Device) -> Decision:
  """The :class:`~probjax.core.dispatch.Decision` for ``call`` on ``device``
  (:func:`probjax.ops.scan.explain_dispatch` with the device given)."""
  reg = registry_of(call)
  name = reg.canonical(implementation)
  if name is not None:
    why = registry.refusal(reg, name, call, device)
    if why:
      raise ValueError(f"{reg.op}: implementation={name!r} cannot compute this call: {why}")
    return _decision(call, name, REQUESTED)
  if device.platform == "gpu":
    why = registry.refusal(reg, "triton", call, device)
    grad = _gpu_grad(call, device, why is None)
    form, conditions = tuned_choice(call, device, "forward")
    measured = f" ({conditions})" if conditions else ""
    if form == "chunked":
      return _decision(call, "chunked", f"GPU: the chunked XLA form, the fastest forward measured{measured}; "
                       "differentiated, the fastest forward+backward measured", grad)
    if why is None:
      return _decision(call, "triton", f"GPU: the Triton kernels, the fastest forward measured{measured}, compute "
                       "the call exactly; differentiated, the fastest forward+backward measured", grad)
    return _decision(call, "chunked", f"GPU: the Triton kernels cannot take it ({why})", grad)
  return _decision(call, tuned_form(call, device, "default"), f"platform {device.platform}: the fastest exact XLA form measured on CPU")


def with_grad_of(primal, grad):
  """``primal(*arrays)``, differentiated as ``grad(*arrays)`` (its forward with residuals and its
  backward): how a decision's ``grad`` runs beside its forward's implementation (e.g. SSD's
  tuned GPU default: the Triton forward kernel, differentiated through the chunked form)."""
  f = jax.custom_vjp(primal)
  f.defvjp(lambda *arrays: jax.vjp(grad, *arrays), lambda vjp, ct: vjp(ct))
  return f


def runner(call, decision: Decision):
  """The function ``f(*arrays)`` that computes ``call`` as ``decision`` says: its
  implementation, differentiated as its ``grad`` where it has one."""
  reg = registry_of(call)
  primal = functools.partial(reg.get(decision.implementation), call=call)
  if decision.grad is None:
    return primal
  return with_grad_of(primal, functools.partial(reg.get(decision.grad.implementation), call=call))


def resolve(call, implementation: str | None = None, device: Device | None = None):
  """The function ``f(*arrays)`` that computes ``call`` as dispatch decides on ``device``
  (default: :func:`device_of`)."""
  return runner(call, decide(call, implementation, device or device_of(call)))


def available_implementations(call, device: Device | None = None) -> list[str]:
  """The implementations of ``call``'s op that can run on ``device`` (default: the current one)."""
  return registry_of(call).available(device or Device.current())
