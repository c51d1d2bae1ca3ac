"""The default's rule for ``linear_cross_entropy``: small pure functions of the call and a
:class:`~probjax.core.device.Device`, returning a :class:`~probjax.core.dispatch.Decision`.

The default is the tiled XLA form on every device: off the GPU it is the only compiled form,
and on an NVIDIA GPU ``bench/linear_cross_entropy.py`` times the Triton kernels behind it at
every tile it measured (``docs/dev/lce-performance.md``), so they run only when asked for
(``implementation="triton"``).

The XLA backend's scheme (``grad_in_forward`` in the decision's config) follows from the call
and its tile: a reduced loss whose vocabulary tile is the whole vocabulary has its gradients
computed in the forward sweep; every other call runs the per-token form with its backward
sweep. The XLA backend's default tile is 1024 tokens by the whole vocabulary for a reduced loss
(so it takes that scheme) and by 4096 entries for per-token losses; a caller's ``chunk_vocab``
below the vocabulary keeps a reduced loss on the per-token form.
"""

from __future__ import annotations

from probjax.core.device import Device
from probjax.core.dispatch import REQUESTED, Decision
from probjax.ops.linear_cross_entropy.call import LinearCrossEntropyCall
from probjax.ops.linear_cross_entropy.registry import REGISTRY


def default_rule(call: LinearCrossEntropyCall, device: Device) -> tuple[str, str]:
  """The default backend and why."""
  if device.platform == "gpu" and not device.interpret:
    return "xla", ("the tiled XLA form: ahead of the Triton kernels on the GPU "
                   "(bench/linear_cross_entropy.py), which run when asked for")
  return "xla", "the tiled XLA form (logits never materialised): the compiled form off the GPU"


def grad_in_forward(call: LinearCrossEntropyCall, chunk_vocab: int) -> bool:
  """Whether the XLA backend computes the gradients in its forward sweep: only for a scalar
  loss (``"mean"``/``"sum"``: per-token losses' cotangents differ per token and arrive only in
  the backward) whose vocabulary tile ``chunk_vocab`` is the whole vocabulary (each token
  tile's softmax, hence its ``dz``, is then known after its one product)."""
  return call.reduction != "none" and chunk_vocab >= call.vocab


def decide(call: LinearCrossEntropyCall, device: Device, implementation: str | None = None) -> Decision:
  """The backend for ``call``: an explicit ``implementation`` is checked (ValueError with the
  reason if it cannot compute the call), else :func:`default_rule`'s; its tile, and for XLA
  the scheme (:func:`grad_in_forward`)."""
  name = REGISTRY.canonical(implementation)
  if name is None:
    name, rule = default_rule(call, device)
  else:
    rule = REQUESTED
  backend = REGISTRY.get(name)
  why = backend.available(device) or backend.supports(call, device)
  if why:
    raise ValueError(f"linear_cross_entropy implementation={implementation!r} cannot compute this call: {why}")
  tc, vc = backend.tile(call)
  config = (("chunk_tokens", tc), ("chunk_vocab", vc))
  if name == "xla":
    config += (("grad_in_forward", grad_in_forward(call, vc)),)
  return Decision(name, rule, config=config)
