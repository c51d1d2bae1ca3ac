"""The default's rule for ``linear_cross_entropy``: small pure functions of the call and a
:class:`~probjax.core.device.Device`, returning a :class:`~probjax.core.dispatch.Decision`."""

from __future__ import annotations

from probjax.core.device import Device
from probjax.core.dispatch import REQUESTED, Decision
from probjax.ops.linear_cross_entropy.backends.xla import chunks
from probjax.ops.linear_cross_entropy.call import LinearCrossEntropyCall
from probjax.ops.linear_cross_entropy.registry import REGISTRY


def decide(call: LinearCrossEntropyCall, device: Device, implementation: str | None = None) -> Decision:
  """The backend for ``call``: an explicit ``implementation`` is checked (ValueError with the
  reason if it cannot compute the call), else the tiled XLA form, the only backend so far."""
  name = REGISTRY.canonical(implementation)
  if name is None:
    name, rule = "xla", "the tiled XLA form (logits never materialised), the only backend"
  else:
    rule = REQUESTED
  why = REGISTRY.get(name).available(device) or REGISTRY.get(name).supports(call, device)
  if why:
    raise ValueError(f"linear_cross_entropy implementation={implementation!r} cannot compute this call: {why}")
  tc, vc = chunks(call)
  return Decision(name, rule, config=(("chunk_tokens", tc), ("chunk_vocab", vc)))
