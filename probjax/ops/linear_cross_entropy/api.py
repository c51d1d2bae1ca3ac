"""The face of ``linear_cross_entropy``: the cross-entropy of a linear head's logits, computed
without the ``[tokens, vocab]`` logits, and its ``explain_dispatch``.

>>> import jax, jax.numpy as jnp
>>> k = jax.random.split(jax.random.key(0), 3)
>>> x = jax.random.normal(k[0], (2, 5, 8))            # [batch, seq, d]
>>> w = jax.random.normal(k[1], (8, 300)) * 0.1       # [d, vocab]
>>> labels = jax.random.randint(k[2], (2, 5), 0, 300)
>>> loss = linear_cross_entropy(x, w, labels)
>>> logits = x @ w
>>> want = jnp.mean(jax.nn.logsumexp(logits, -1) - jnp.take_along_axis(logits, labels[..., None], -1)[..., 0])
>>> bool(jnp.allclose(loss, want, rtol=1e-5))
True
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from probjax.core.device import Device
from probjax.core.dispatch import Decision
from probjax.core.eager import compile_once
from probjax.core.values import concrete_values
from probjax.ops.linear_cross_entropy.call import LinearCrossEntropyCall
from probjax.ops.linear_cross_entropy.dispatch import decide
from probjax.ops.linear_cross_entropy.registry import REGISTRY

__all__ = ["linear_cross_entropy", "explain_dispatch", "available_implementations", "LinearCrossEntropyCall",
           "Decision", "REGISTRY"]


def linear_cross_entropy(x, w, labels, *, bias=None, w_layout: str = "d_vocab", ignore_index: int | None = -100,
                         z_loss: float = 0.0, label_smoothing: float = 0.0, reduction: str = "mean",
                         chunk_tokens: int | None = None, chunk_vocab: int | None = None,
                         implementation: str | None = None, interpret: bool = False):
  """Cross-entropy of ``logits = x @ w (+ bias)`` against ``labels``, exact in value and
  gradients, computed in tiles so that the ``[tokens, vocab]`` logits never exist (forward or
  backward): memory ``O(chunk_tokens * chunk_vocab)`` beyond the inputs and their gradients.

  Per counted token, ``lse - (1 - eps) * logit[label] - eps * mean(logits) + z_loss * lse**2``
  (``lse = logsumexp(logits)``, ``eps = label_smoothing``): the softmax cross-entropy, with
  label smoothing's uniform target share and PaLM's z-loss when asked.

  Args:
    x: hidden states ``[..., d]``, floating point.
    w: the head, ``[d, vocab]`` (``w_layout="d_vocab"``, a Linear's kernel) or ``[vocab, d]``
      (``"vocab_d"``, a tied embedding table, as ``nnx.Embed.attend`` reads it).
    labels: ``[...]`` integers (x's leading shape). A label equal to ``ignore_index`` counts for
      nothing (zero loss, zero gradient, not in the mean's count). A concrete label outside
      ``[0, vocab)`` (other than ``ignore_index``) raises ValueError; a traced one counts as
      ignored, never read out of the head.
    bias: optional ``[vocab]`` added to the logits.
    w_layout: see ``w``.
    ignore_index: the label to skip (None: none).
    z_loss: weight of ``lse ** 2`` per token (0: off).
    label_smoothing: ``eps`` in ``[0, 1]``.
    reduction: ``"mean"`` over counted tokens (0 when none counts, never NaN), ``"sum"``, or
      ``"none"``: the per-token losses, ``labels``' shape.
    chunk_tokens, chunk_vocab: the tile (None: the backend's; for XLA 1024 tokens by the whole
      vocabulary for ``"mean"``/``"sum"`` and by 4096 entries for ``"none"``; 64 x 128 for
      Triton, whose tiles are these rounded up to powers of two). On XLA, a ``"mean"`` or
      ``"sum"`` loss whose ``chunk_vocab`` covers the vocabulary (``>= vocab``, as the default
      does) computes its gradients in the forward sweep, each token tile's logits formed once
      (three products per tile instead of four; ``explain_dispatch``'s ``grad_in_forward``);
      memory ``O(chunk_tokens * vocab)`` for the tile's logits. A smaller ``chunk_vocab`` caps
      that memory at ``O(chunk_tokens * chunk_vocab)`` on the per-token form.
    implementation: None (the default, :func:`explain_dispatch` says which) or a backend name
      (:func:`available_implementations`); one that cannot compute the call raises ValueError.
    interpret: run the Triton kernels in Pallas interpret mode (any platform, for tests).

  Returns:
    The loss: a float32 scalar (float64 for float64 inputs), or per token for ``"none"``.
  """
  call = LinearCrossEntropyCall.of(x, w, labels, bias=bias, w_layout=w_layout, ignore_index=ignore_index,
                                   z_loss=z_loss, label_smoothing=label_smoothing, reduction=reduction,
                                   chunk_tokens=chunk_tokens, chunk_vocab=chunk_vocab, interpret=interpret)
  values = concrete_values(labels)
  if values is not None:
    bad = (values < 0) | (values >= call.vocab)
    if call.ignore_index is not None:
      bad &= values != call.ignore_index
    if bad.any():
      raise ValueError(f"labels must lie in [0, {call.vocab}) or equal ignore_index={call.ignore_index}; "
                       f"found {values[bad].flat[0]}")
  decision = decide(call, _device(call, None), implementation)
  call = dataclasses.replace(call, chunk_tokens=decision.get("chunk_tokens"), chunk_vocab=decision.get("chunk_vocab"))
  return _compute(decision.implementation, call, decision.get("grad_in_forward", False), x, w, bias, labels)


@compile_once
def _compute(name: str, call: LinearCrossEntropyCall, grad_in_forward: bool, x, w, bias, labels):
  backend = REGISTRY.get(name)
  xs, ys = x.reshape(call.tokens, call.d), labels.reshape(call.tokens)
  if grad_in_forward:  # the backend reduces, its gradients computed in the forward sweep
    acc = jnp.promote_types(call.dtype, jnp.float32)
    scale = jnp.ones((), acc) if call.reduction == "sum" else 1 / jnp.maximum(_count(ys, call), 1).astype(acc)
    return backend(xs, w, bias, ys, call=call, scale=scale)
  per = backend(xs, w, bias, ys, call=call)
  if call.reduction == "none":
    return per.reshape(labels.shape)
  if call.reduction == "sum":
    return jnp.sum(per)
  return jnp.sum(per) / jnp.maximum(_count(labels, call), 1).astype(per.dtype)


def _count(labels, call: LinearCrossEntropyCall):
  """The number of counted tokens: labels in ``[0, vocab)`` other than ``ignore_index``."""
  valid = (labels >= 0) & (labels < call.vocab)
  if call.ignore_index is not None:
    valid &= labels != call.ignore_index
  return jnp.sum(valid)


def explain_dispatch(call: LinearCrossEntropyCall, *, implementation: str | None = None,
                     device: Device | None = None) -> Decision:
  """The backend :func:`linear_cross_entropy` runs ``call`` on (``LinearCrossEntropyCall.of``
  builds one from arrays or ``jax.ShapeDtypeStruct``), with its tile, and why; for XLA, whether
  the gradients are computed in the forward sweep (``grad_in_forward``).

  >>> import jax, jax.numpy as jnp
  >>> s = jax.ShapeDtypeStruct
  >>> call = LinearCrossEntropyCall.of(s((8, 2048, 768), jnp.bfloat16), s((768, 32768), jnp.bfloat16),
  ...                                  s((8, 2048), jnp.int32))
  >>> explain_dispatch(call, device=Device("cpu")).summary()  # a mean loss: the vocabulary in one tile
  'xla, chunk_tokens=1024, chunk_vocab=32768, grad_in_forward=True'
  >>> per_token = dataclasses.replace(call, reduction="none")
  >>> explain_dispatch(per_token, device=Device("cpu")).summary()
  'xla, chunk_tokens=1024, chunk_vocab=4096, grad_in_forward=False'
  >>> capped = dataclasses.replace(call, chunk_vocab=8192)  # less memory, the per-token form
  >>> explain_dispatch(capped, device=Device("cpu")).summary()
  'xla, chunk_tokens=1024, chunk_vocab=8192, grad_in_forward=False'
  """
  return decide(call, _device(call, device), implementation)


def _device(call: LinearCrossEntropyCall, device: Device | None) -> Device:
  """The device a call is decided for: ``device``, else the interpreter for an ``interpret``
  call, else the current one."""
  return device or (Device.interpreter() if call.interpret else Device.current())


def available_implementations(device: Device | None = None) -> list[str]:
  """Backend names that can run on ``device`` (default: the current one)."""
  return REGISTRY.available(device or Device.current())
