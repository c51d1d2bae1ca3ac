"""The one reference implementation: dense attention in float64.

Every test and the attention report compare against :func:`reference_attention`
(values) and :func:`reference_vjp` (gradients). Inputs are upcast to float64
under ``jax.enable_x64``; the result is returned as float64 numpy arrays.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from probjax.ops.attention.masks import Mask


def _attention64(q, k, v, bias, mask: Mask | None, dense_mask, score_mod, scale):
  b, tq, h, d = q.shape
  hkv = k.shape[2]
  g = h // hkv
  # Positions past the mask's lengths may hold anything (NaN included): they are zeroed, and
  # so are the output rows of padded queries, so no NaN reaches a value or a gradient.
  lengths = lambda n, lens: None if lens is None else (jnp.arange(n)[None, :] < lens[:, None])[:, :, None, None]
  q_lens, kv_lens = (None, None) if mask is None else mask.lengths(b)
  k_ok = lengths(k.shape[1], kv_lens)
  q_ok = lengths(tq, q_lens)
  if k_ok is not None:
    k, v = jnp.where(k_ok, k, 0.0), jnp.where(k_ok, v, 0.0)
  if q_ok is not None:
    q = jnp.where(q_ok, q, 0.0)
  k = jnp.repeat(k, g, axis=2)
  v = jnp.repeat(v, g, axis=2)
  s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * scale
  if bias is not None:
    s = s + bias
  if score_mod is not None:
    bi = jnp.arange(b)[:, None, None, None]
    hi = jnp.arange(h)[None, :, None, None]
    qi = jnp.arange(tq)[None, None, :, None]
    ki = jnp.arange(k.shape[1])[None, None, None, :]
    s = score_mod(s, bi, hi, qi, ki)
  valid = jnp.ones(s.shape, bool)
  if mask is not None:
    valid = valid & mask.dense(b, tq, k.shape[1])
  if dense_mask is not None:
    valid = valid & dense_mask
  # Weight only where allowed and above -inf: a row with none (masked, or -inf from the bias
  # or score_mod) is zero, with zero gradients.
  valid = valid & (s != -jnp.inf)
  s = jnp.where(valid, s, 0.0)
  m = jax.lax.stop_gradient(jnp.max(jnp.where(valid, s, -jnp.inf), axis=-1, keepdims=True, initial=-jnp.inf))
  m = jnp.where(jnp.isfinite(m), m, 0.0)
  p = jnp.where(valid, jnp.exp(s - m), 0.0)
  l = p.sum(-1, keepdims=True)
  p = p / jnp.where(l == 0, 1.0, l)
  out = jnp.einsum("bhqk,bkhd->bqhd", p, v)
  return out if q_ok is None else jnp.where(q_ok, out, 0.0)


def _prep(q, k, v, bias, dense_mask, scale):
  up = lambda x: None if x is None else jnp.asarray(np.asarray(x, np.float64))
  q, k, v, bias = up(q), up(k), up(v), up(bias)
  if scale is None:
    scale = 1.0 / np.sqrt(q.shape[-1])
  if dense_mask is not None:
    dense_mask = jnp.asarray(np.asarray(dense_mask, bool))
  return q, k, v, bias, dense_mask, float(scale)


def reference_attention(q, k, v, *, bias=None, mask: Mask | None = None, dense_mask=None,
                        score_mod=None, scale=None) -> np.ndarray:
  """float64 attention output ``[batch, q_len, heads, v_head_dim]``.

  Args:
    q: ``[batch, q_len, heads, head_dim]``; k: ``[batch, kv_len, kv_heads, head_dim]``;
      v: ``[batch, kv_len, kv_heads, v_head_dim]`` (``v_head_dim`` may differ from ``head_dim``).
    scale: default ``head_dim ** -0.5`` (the query/key width).
    bias: additive bias broadcastable to ``[batch, heads, q_len, kv_len]``.
    mask: a :class:`Mask`; dense_mask: boolean, broadcastable like ``bias``.
    score_mod: ``f(score, b, h, q_idx, kv_idx)`` applied after scaling and bias.
  Rows with no valid key (masked, or at -inf from ``bias`` or ``score_mod``) are zero.
  Positions past ``mask``'s lengths may hold NaN or inf: they reach no value or gradient.
  """
  with jax.enable_x64(True):
    q, k, v, bias, dense_mask, scale = _prep(q, k, v, bias, dense_mask, scale)
    return np.asarray(_attention64(q, k, v, bias, mask, dense_mask, score_mod, scale))


def reference_vjp(q, k, v, do, *, bias=None, mask: Mask | None = None, dense_mask=None,
                  score_mod=None, scale=None):
  """float64 ``(out, dq, dk, dv, dbias)`` for output cotangent ``do`` (dbias None without bias)."""
  with jax.enable_x64(True):
    q, k, v, bias, dense_mask, scale = _prep(q, k, v, bias, dense_mask, scale)
    do = jnp.asarray(np.asarray(do, np.float64))
    f = lambda q, k, v, bias: _attention64(q, k, v, bias, mask, dense_mask, score_mod, scale)
    out, vjp = jax.vjp(f, q, k, v, bias)
    dq, dk, dv, db = vjp(do)
    conv = lambda x: None if x is None else np.asarray(x)
    return np.asarray(out), conv(dq), conv(dk), conv(dv), conv(db)
