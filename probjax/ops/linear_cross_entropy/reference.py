"""The float64 reference of :func:`~probjax.ops.linear_cross_entropy.linear_cross_entropy`:
the logits materialised, every test's yardstick."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def linear_cross_entropy64(x, w, labels, *, bias=None, w_layout="d_vocab", ignore_index=-100, z_loss=0.0,
                           label_smoothing=0.0, reduction="mean"):
  """numpy float64 loss of the call (per token for ``reduction="none"``)."""
  with jax.enable_x64(True):
    x = jnp.asarray(np.asarray(x, np.float64))
    w = jnp.asarray(np.asarray(w, np.float64))
    w = w if w_layout == "d_vocab" else w.T
    logits = x @ w + (0.0 if bias is None else jnp.asarray(np.asarray(bias, np.float64)))
    return np.asarray(_loss(logits, jnp.asarray(labels), ignore_index, z_loss, label_smoothing, reduction))


def loss_from_logits64(logits, labels, *, ignore_index=-100, z_loss=0.0, label_smoothing=0.0, reduction="mean"):
  """The same from given logits (float64), e.g. a model's unfused head."""
  with jax.enable_x64(True):
    return np.asarray(_loss(jnp.asarray(np.asarray(logits, np.float64)), jnp.asarray(labels), ignore_index,
                            z_loss, label_smoothing, reduction))


def _loss(logits, labels, ignore_index, z_loss, label_smoothing, reduction):
  vocab = logits.shape[-1]
  valid = (labels >= 0) & (labels < vocab)
  if ignore_index is not None:
    valid &= labels != ignore_index
  lse = jax.nn.logsumexp(logits, axis=-1)
  label_logit = jnp.take_along_axis(logits, jnp.clip(labels, 0, vocab - 1)[..., None], axis=-1)[..., 0]
  per = (lse - (1 - label_smoothing) * label_logit - label_smoothing * jnp.mean(logits, axis=-1)
         + z_loss * lse ** 2)
  per = jnp.where(valid, per, 0.0)
  if reduction == "none":
    return per
  if reduction == "sum":
    return jnp.sum(per)
  return jnp.sum(per) / jnp.maximum(jnp.sum(valid), 1)


def linear_cross_entropy_grads64(x, w, labels, *, bias=None, w_layout="d_vocab", ignore_index=-100, z_loss=0.0,
                                 label_smoothing=0.0, reduction="mean", cotangent=1.0):
  """numpy float64 ``(dx, dw, dbias or None)`` of the loss times ``cotangent`` (an array of the
  loss's shape for ``reduction="none"``)."""
  with jax.enable_x64(True):
    up = lambda a: jnp.asarray(np.asarray(a, np.float64))
    args = (up(x), up(w), None if bias is None else up(bias))

    def f(x, w, b):
      ww = w if w_layout == "d_vocab" else w.T
      logits = x @ ww + (0.0 if b is None else b)
      return jnp.sum(_loss(logits, jnp.asarray(labels), ignore_index, z_loss, label_smoothing, reduction)
                     * up(cotangent))
    return tuple(None if g is None else np.asarray(g) for g in jax.grad(f, argnums=(0, 1, 2))(*args))
