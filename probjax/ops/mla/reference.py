"""The one reference of multi-head latent attention: K and V materialised from the latent in
float64, then :func:`probjax.ops.attention.reference`'s float64 attention semantics (rows with
no valid key are zero; positions past the mask's lengths are ignored, NaN included).

Every test of the op compares against :func:`reference_mla` (values) and :func:`reference_mla_vjp`
(gradients of all six inputs), with tolerances from :mod:`probjax.core.tolerances`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

NAMES = ("q_nope", "q_rope", "kv_latent", "k_rope", "w_uk", "w_uv")


def _mla64(q_nope, q_rope, kv_latent, k_rope, w_uk, w_uv, mask, scale):
  b, tq, h, dn = q_nope.shape
  s = kv_latent.shape[1]
  q_lens, kv_lens = (None, None) if mask is None else mask.lengths(b)
  if kv_lens is not None:
    ok = (jnp.arange(s)[None, :] < kv_lens[:, None])[:, :, None]
    kv_latent, k_rope = jnp.where(ok, kv_latent, 0.0), jnp.where(ok, k_rope, 0.0)
  q_ok = None
  if q_lens is not None:
    q_ok = (jnp.arange(tq)[None, :] < q_lens[:, None])[:, :, None, None]
    q_nope, q_rope = jnp.where(q_ok, q_nope, 0.0), jnp.where(q_ok, q_rope, 0.0)
  k = jnp.concatenate([jnp.einsum("bsc,chd->bshd", kv_latent, w_uk),
                       jnp.broadcast_to(k_rope[:, :, None], (b, s, h, k_rope.shape[-1]))], -1)
  v = jnp.einsum("bsc,chd->bshd", kv_latent, w_uv)
  q = jnp.concatenate([q_nope, q_rope], -1)
  sc = jnp.einsum("bqhd,bkhd->bhqk", q, k) * scale
  valid = jnp.ones(sc.shape, bool) if mask is None else jnp.broadcast_to(mask.dense(b, tq, s), sc.shape)
  sc = jnp.where(valid, sc, 0.0)
  m = jax.lax.stop_gradient(jnp.max(jnp.where(valid, sc, -jnp.inf), -1, keepdims=True, initial=-jnp.inf))
  m = jnp.where(jnp.isfinite(m), m, 0.0)
  p = jnp.where(valid, jnp.exp(sc - m), 0.0)
  l = p.sum(-1, keepdims=True)
  lse = jnp.where(l[..., 0] > 0, m[..., 0] + jnp.log(jnp.where(l[..., 0] > 0, l[..., 0], 1.0)), -jnp.inf)
  out = jnp.einsum("bhqk,bkhd->bqhd", p / jnp.where(l == 0, 1.0, l), v)
  if q_ok is not None:
    out = jnp.where(q_ok, out, 0.0)
  return out, jnp.transpose(lse, (0, 2, 1))


def _up(args):
  return tuple(jnp.asarray(np.asarray(a, np.float64)) for a in args)


def _scale(q_nope, q_rope, scale):
  return float((q_nope.shape[-1] + q_rope.shape[-1]) ** -0.5 if scale is None else scale)


def reference_mla(q_nope, q_rope, kv_latent, k_rope, w_uk, w_uv, *, mask=None, scale=None,
                  return_lse: bool = False):
  """float64 ``[B, Tq, H, d_v]`` (and the log-sum-exp ``[B, Tq, H]``, -inf for empty rows)."""
  args = (q_nope, q_rope, kv_latent, k_rope, w_uk, w_uv)
  with jax.enable_x64(True):
    out, lse = _mla64(*_up(args), mask, _scale(q_nope, q_rope, scale))
    return (np.asarray(out), np.asarray(lse)) if return_lse else np.asarray(out)


def reference_mla_vjp(q_nope, q_rope, kv_latent, k_rope, w_uk, w_uv, d_out, *, mask=None, scale=None):
  """float64 ``(out, grads)`` for the output cotangent ``d_out``; ``grads`` maps each input's
  name (:data:`NAMES`) to its gradient."""
  args = (q_nope, q_rope, kv_latent, k_rope, w_uk, w_uv)
  with jax.enable_x64(True):
    sc = _scale(q_nope, q_rope, scale)
    out, pull = jax.vjp(lambda *a: _mla64(*a, mask, sc)[0], *_up(args))
    grads = pull(jnp.asarray(np.asarray(d_out, np.float64)))
    return np.asarray(out), {n: np.asarray(g) for n, g in zip(NAMES, grads)}
