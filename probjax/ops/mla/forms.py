"""The two forms of multi-head latent attention, each one attention call.

Both call probjax's public ``dot_product_attention`` (masks, GQA/MQA and whatever kernels
attention dispatches to are reused); nothing here imports attention's backends.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from probjax.core.eager import compile_once
from probjax.ops.attention import dot_product_attention


def _acc(dtype):
  return jnp.float64 if jnp.dtype(dtype) == jnp.float64 else jnp.float32


def _proj(spec, x, w, dtype):
  """``einsum(spec, x, w)`` accumulated in float32 (float64 for float64), cast to ``dtype``."""
  return jnp.einsum(spec, x, w.astype(x.dtype), preferred_element_type=_acc(dtype)).astype(dtype)


def expanded(q_nope, q_rope, kv_latent, k_rope, w_uk, w_uv, *, mask, scale, implementation):
  """K ``[B, S, H, d_nope + d_rope]`` and V ``[B, S, H, d_v]`` from the latent, then attention
  with H KV heads; ``[B, Tq, H, d_v]``."""
  dt = q_nope.dtype
  b, s, _ = kv_latent.shape
  h = q_nope.shape[2]
  k_nope = _proj("bsc,chd->bshd", kv_latent, w_uk, dt)
  k = jnp.concatenate([k_nope, jnp.broadcast_to(k_rope[:, :, None, :], (b, s, h, k_rope.shape[-1]))], -1)
  v = _proj("bsc,chd->bshd", kv_latent, w_uv, dt)
  q = jnp.concatenate([q_nope, q_rope], -1)
  return dot_product_attention(q, k, v, mask=mask, scale=scale, implementation=implementation)


def absorbed(q_nope, q_rope, kv_latent, k_rope, w_uk, w_uv, *, mask, scale, implementation):
  """q_nope absorbed into the latent (``q_nope @ w_uk^T``, ``[B, Tq, H, d_c]``), multi-query
  attention of the H heads over the one latent head (keys ``[latent, k_rope]``, values the
  latent), then the output projected by ``w_uv``; ``[B, Tq, H, d_v]``."""
  dt = q_nope.dtype
  q_lat = _proj("bthd,chd->bthc", q_nope, w_uk, dt)
  q = jnp.concatenate([q_lat, q_rope], -1)
  k = jnp.concatenate([kv_latent, k_rope], -1)[:, :, None, :]
  v = kv_latent[:, :, None, :]
  o_lat = dot_product_attention(q, k, v, mask=mask, scale=scale, implementation=implementation)
  return _proj("bthc,chd->bthd", o_lat, w_uv, dt)


@compile_once  # eager calls: its scan compiled once per call description
def log_sum_exp(q_nope, q_rope, kv_latent, k_rope, w_uk, *, mask, scale, block: int = 512):
  """The softmax's log-sum-exp ``[B, Tq, H]`` (float32; float64 for float64 inputs), ``-inf``
  for rows with no valid key, in XLA over key blocks of ``block`` (one block's scores at a time;
  differentiable, though reverse mode keeps every block's scores).

  attention's public function does not return it, so it is recomputed from the absorbed scores
  ``scale * ([q_nope @ w_uk^T, q_rope] . [latent, k_rope])``, which equal the expanded ones.
  """
  acc = _acc(q_nope.dtype)
  b, tq, h, _ = q_nope.shape
  s = kv_latent.shape[1]
  if s == 0:
    return jnp.full((b, tq, h), -jnp.inf, acc)
  q = jnp.concatenate([_proj("bthd,chd->bthc", q_nope, w_uk, acc), q_rope.astype(acc)], -1)
  k = jnp.concatenate([kv_latent, k_rope], -1).astype(acc)
  block = min(block, s)
  n = -(-s // block)
  k = jnp.pad(k, ((0, 0), (0, n * block - s), (0, 0)))
  qi = jnp.arange(tq)[:, None]

  def step(carry, i):
    m, l = carry
    sc = jnp.einsum("bthc,bkc->bhtk", q, lax.dynamic_slice_in_dim(k, i * block, block, 1)) * scale
    ki = i * block + jnp.arange(block)[None, :]
    ok = ki < s
    if mask is not None:
      ok = ok & mask.element(qi, ki)
    ok = ok if ok.ndim == 2 else ok[:, None]          # [tq, k], or [b, 1, tq, k] with lengths
    sc = jnp.where(ok, sc, -jnp.inf)
    # The running maximum only stabilises the exponentials; the lse does not depend on it.
    m_new = lax.stop_gradient(jnp.maximum(m, sc.max(-1)))
    safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
    l = l * jnp.exp(m - safe) + jnp.where(ok, jnp.exp(sc - safe[..., None]), 0.0).sum(-1)
    return (m_new, l), None

  init = (jnp.full((b, h, tq), -jnp.inf, acc), jnp.zeros((b, h, tq), acc))
  (m, l), _ = lax.scan(step, init, jnp.arange(n))
  pos = l > 0
  lse = jnp.where(pos, jnp.where(jnp.isfinite(m), m, 0.0) + jnp.log(jnp.where(pos, l, 1.0)), -jnp.inf)
  return jnp.transpose(lse, (0, 2, 1))


def valid_positions(lengths, n):
  """``[B, n, 1]`` bool: position ``i`` of element ``b`` is below ``lengths[b]``."""
  return (jnp.arange(n)[None, :] < jnp.asarray(lengths)[:, None])[:, :, None]


def gather_pages(pool, page_table):
  """A paged cache ``pool [num_pages, page_size, d]`` read through ``page_table [B, pages]``
  (int32) as a contiguous ``[B, pages * page_size, d]``; entries are clamped into the pool
  (below 0: page 0, past it: the last page), as the decode kernel reads them."""
  b, n = page_table.shape
  pages = jnp.clip(page_table.reshape(-1), 0, pool.shape[0] - 1)
  return jnp.take(pool, pages, axis=0, mode="clip").reshape(b, n * pool.shape[1], pool.shape[2])


def _attend_xla(q_lat, q_rope, kv_latent, k_rope, lengths, page_table, scale):
  """The absorbed form's attention alone on XLA: ``[B, Tq, H, d_c]``."""
  from probjax.ops.attention import KVLenMask
  if page_table is not None:
    kv_latent, k_rope = gather_pages(kv_latent, page_table), gather_pages(k_rope, page_table)
  ok = valid_positions(lengths, kv_latent.shape[1])
  kv_latent, k_rope = jnp.where(ok, kv_latent, 0), jnp.where(ok, k_rope, 0)
  q = jnp.concatenate([q_lat, q_rope], -1)
  k = jnp.concatenate([kv_latent, k_rope], -1)[:, :, None, :]
  return dot_product_attention(q, k, kv_latent[:, :, None, :], mask=KVLenMask(lengths), scale=scale,
                               implementation="xla")


@compile_once  # eager calls: the kernel compiled once per call description
def absorbed_decode(q_nope, q_rope, kv_latent, k_rope, w_uk, w_uv, *, lengths, page_table, scale,
                    interpret: bool = False):
  """The absorbed form with MLA's Triton decode kernel as its attention (forward only: the
  gradient is the XLA form's, through a custom_vjp); caches contiguous or paged (see
  :func:`probjax.ops.mla.backends.triton.decode`); ``[B, Tq, H, d_v]``."""
  import jax
  from probjax.ops.mla.backends.triton import decode

  @jax.custom_vjp
  def attend(q_lat, q_rope, kv_latent, k_rope, lengths, page_table):
    return decode(q_lat, q_rope, kv_latent, k_rope, lengths, scale=scale, page_table=page_table,
                  interpret=interpret)[0]

  def fwd(*args):
    return attend(*args), args

  def bwd(args, g):
    xla = lambda a, b, c, d: _attend_xla(a, b, c, d, args[4], args[5], scale)
    return (*jax.vjp(xla, *args[:4])[1](g), None, None)

  attend.defvjp(fwd, bwd)
  dt = q_nope.dtype
  q_lat = _proj("bthd,chd->bthc", q_nope, w_uk, dt)
  o_lat = attend(q_lat, q_rope, kv_latent, k_rope, jnp.asarray(lengths, jnp.int32), page_table)
  return _proj("bthc,chd->bthd", o_lat, w_uv, dt)
