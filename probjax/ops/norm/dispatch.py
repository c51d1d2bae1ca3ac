"""The default's rules for the norm op: small pure functions of the call and a
:class:`~probjax.core.device.Device`, returning a :class:`~probjax.core.dispatch.Decision`.

Off a GPU the XLA form. On an NVIDIA GPU too: measured against the Triton row kernels
(``python -m bench.norm``), XLA's fusion of the same formula is level or ahead on RMS norm and
adaLN, the norms the models run; the kernels are ahead only on layer norm with a residual or
under grad, a rule not yet validated on other shapes (docs/dev/decisions.md, "## Open"). So the
kernels run only when asked for (``implementation="triton"``)."""

from __future__ import annotations

from probjax.core.device import Device
from probjax.core.dispatch import REQUESTED, Decision
from probjax.ops.norm.call import NormCall
from probjax.ops.norm.registry import REGISTRY


def off_gpu(call: NormCall, device: Device) -> Decision | None:
  if device.platform != "gpu":
    return Decision("xla", f"not a GPU ({device.platform}): the XLA form")
  return None


def gpu_xla(call: NormCall, device: Device) -> Decision:
  return Decision("xla", "GPU: XLA's fusion, level with the Triton row kernels or ahead on RMS norm and adaLN; "
                         "no validated rule for the kernels yet; implementation='triton' opts in")


RULES = (off_gpu,)


def device_of(call: NormCall) -> Device:
  """The device a call is decided for by default: the interpreter's for ``interpret=True``."""
  return Device.interpreter() if call.interpret else Device.current()


def decide(call: NormCall, device: Device, implementation: str | None = None) -> Decision:
  """The backend for ``call``: an explicit ``implementation`` is checked (ValueError with the
  reason if it cannot compute the call) and kept, else the first rule that applies."""
  name = REGISTRY.canonical(implementation)
  if name is None:
    for rule in RULES:
      decision = rule(call, device)
      if decision is not None:
        return decision
    return gpu_xla(call, device)
  backend = REGISTRY.get(name)
  why = backend.available(device) or backend.supports(call, device)
  if why:
    raise ValueError(f"norm implementation={implementation!r} cannot compute this call: {why}")
  return Decision(name, REQUESTED)
