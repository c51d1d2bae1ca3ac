"""Dense attention for short sequences: one einsum, plain autodiff (T x T scores)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from probjax.ops.attention.masks import Mask
from probjax.ops.attention.padding import zero_padding, zero_rows
from probjax.ops.attention.backends.xla.common import compute_dtype


def dense_attention(q, k, v, *, bias=None, mask: Mask | None = None, dense_mask=None,
                    score_mod=None, scale: float, dropout_rate: float = 0.0, dropout_rng=None,
                    broadcast_dropout: bool = True, precision=None, module=None):
  """q ``[B, Tq, H, D]``, k ``[B, Tkv, Hkv, D]``, v ``[B, Tkv, Hkv, Dv]`` → ``[B, Tq, H, Dv]``;
  differentiable in all modes.

  Scores and softmax are float32 (float64 for float64 inputs). A row with no valid key (masked,
  or at -inf from ``bias`` or ``score_mod``) is zero, with zero gradients. Positions past the
  mask's lengths may hold NaN or inf (:func:`~probjax.ops.attention.padding.zero_padding`);
  those excluded only by the band, segment ids or ``dense_mask`` must be finite. With ``module``
  given, the attention weights ``[B, H, Tq, Tkv]`` are sown into it as Flax's
  ``dot_product_attention`` does.
  """
  bsz, tq, h, d = q.shape
  tk, hkv, dv = k.shape[1], k.shape[2], v.shape[3]
  g = h // hkv
  cdt = compute_dtype(q.dtype)
  q, k, v, q_ok = zero_padding(mask, q, k, v)
  # Batched-matmul layout: [b, hkv, g*tq, d] x [b, hkv, tk, d]; the g query heads of a KV
  # head share its keys without a repeat, and the dots need no transposes inside.
  qi = jnp.transpose(q.reshape(bsz, tq, hkv, g, d), (0, 2, 3, 1, 4)).reshape(bsz, hkv, g * tq, d)
  ki = jnp.transpose(k, (0, 2, 1, 3))
  vi = jnp.transpose(v, (0, 2, 1, 3))
  s = jnp.einsum("bhmd,bhkd->bhmk", qi, ki, precision=precision, preferred_element_type=cdt) * scale
  s = s.reshape(bsz, h, tq, tk)
  if bias is not None:
    s = s + bias.astype(cdt)
  if score_mod is not None:
    s = score_mod(s, jnp.arange(bsz)[:, None, None, None], jnp.arange(h)[None, :, None, None],
                  jnp.arange(tq)[None, None, :, None], jnp.arange(tk)[None, None, None, :]).astype(cdt)
  ok = None if mask is None else mask.dense(bsz, tq, tk)
  if dense_mask is not None:
    ok = dense_mask if ok is None else ok & dense_mask
  if ok is not None:
    s = jnp.where(ok, s, -jnp.inf)
  # A row with no valid key has maximum -inf: subtracting 0 instead makes its weights
  # exp(-inf) = 0, so the row and its gradient are zero, not NaN (as jax.nn.softmax gives).
  m = jax.lax.stop_gradient(s.max(-1, keepdims=True, initial=-jnp.inf))
  p = jnp.exp(s - jnp.where(jnp.isfinite(m), m, 0.0))
  l = p.sum(-1, keepdims=True)
  p = p / jnp.where(l > 0, l, 1.0)
  if module is not None and hasattr(module, "sow"):
    import flax.nnx as nnx
    module.sow(nnx.Intermediate, "attention_weights", p)
  if dropout_rate > 0.0:
    shape = (1, 1, tq, tk) if broadcast_dropout else p.shape
    keep = jax.random.bernoulli(dropout_rng, 1.0 - dropout_rate, shape)
    p = p * keep.astype(p.dtype) / (1.0 - dropout_rate)
  # As the fused kernels do: probabilities in the value dtype, accumulation in the compute dtype.
  p = p.reshape(bsz, hkv, g * tq, tk).astype(v.dtype)
  out = jnp.einsum("bhmk,bhkd->bhmd", p, vi, precision=precision, preferred_element_type=cdt)
  out = jnp.transpose(out.reshape(bsz, hkv, g, tq, dv), (0, 3, 1, 2, 4))
  return zero_rows(out.reshape(bsz, tq, h, dv).astype(q.dtype), q_ok)
