"""The two forms of multi-head latent attention, each one attention call, and what MLA's
backends share (projections, the log-sum-exp, paged caches, the valid positions).

Both forms call probjax's public ``dot_product_attention`` (masks, GQA/MQA and whatever kernels
attention dispatches to are reused); nothing here imports attention's backends, or MLA's.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from probjax.core.eager import compile_once
from probjax.ops.attention import KVLenMask, Mask, dot_product_attention


def _acc(dtype):
  return jnp.float64 if jnp.dtype(dtype) == jnp.float64 else jnp.float32


def project(spec, x, w, dtype):
  """``einsum(spec, x, w)`` accumulated in float32 (float64 for float64), cast to ``dtype``."""
  return jnp.einsum(spec, x, w.astype(x.dtype), preferred_element_type=_acc(dtype)).astype(dtype)


def expanded(q_nope, q_rope, kv_latent, k_rope, w_uk, w_uv, *, mask, scale, implementation):
  """K ``[B, S, H, d_nope + d_rope]`` and V ``[B, S, H, d_v]`` from the latent, then attention
  with H KV heads; ``[B, Tq, H, d_v]``."""
  dt = q_nope.dtype
  b, s, _ = kv_latent.shape
  h = q_nope.shape[2]
  k_nope = project("bsc,chd->bshd", kv_latent, w_uk, dt)
  k = jnp.concatenate([k_nope, jnp.broadcast_to(k_rope[:, :, None, :], (b, s, h, k_rope.shape[-1]))], -1)
  v = project("bsc,chd->bshd", kv_latent, w_uv, dt)
  q = jnp.concatenate([q_nope, q_rope], -1)
  return dot_product_attention(q, k, v, mask=mask, scale=scale, implementation=implementation)


def absorbed(q_nope, q_rope, kv_latent, k_rope, w_uk, w_uv, *, mask, scale, implementation):
  """q_nope absorbed into the latent (``q_nope @ w_uk^T``, ``[B, Tq, H, d_c]``), multi-query
  attention of the H heads over the one latent head (keys ``[latent, k_rope]``, values the
  latent), then the output projected by ``w_uv``; ``[B, Tq, H, d_v]``."""
  dt = q_nope.dtype
  q_lat = project("bthd,chd->bthc", q_nope, w_uk, dt)
  q = jnp.concatenate([q_lat, q_rope], -1)
  k = jnp.concatenate([kv_latent, k_rope], -1)[:, :, None, :]
  v = kv_latent[:, :, None, :]
  o_lat = dot_product_attention(q, k, v, mask=mask, scale=scale, implementation=implementation)
  return project("bthc,chd->bthd", o_lat, w_uv, dt)


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
  q = jnp.concatenate([project("bthd,chd->bthc", q_nope, w_uk, acc), q_rope.astype(acc)], -1)
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


def valid_inputs(q_nope, q_rope, kv_latent, k_rope, *, call, mask, page_table):
  """The inputs as the XLA forms and the log-sum-exp read them: a paged cache gathered to a
  contiguous ``[B, S, d]``, and positions past the mask's lengths zeroed; with ``q_ok``
  (``[B, Tq, 1, 1]`` bool: the valid query rows, None without query lengths).

  Positions past the lengths may hold NaN (a cache's unwritten tail). Attention zeroes its own
  inputs there, but the projections around it would still meet them (dw_uk = latent^T dk with
  a zero dk is NaN where the latent is), so they are zeroed before any projection."""
  if page_table is not None:
    kv_latent, k_rope = gather_pages(kv_latent, page_table), gather_pages(k_rope, page_table)
  q_ok = None
  q_lens, kv_lens = (None, None) if mask is None else mask.lengths(call.batch)
  if kv_lens is not None:
    k_ok = valid_positions(kv_lens, call.kv_len)
    kv_latent, k_rope = jnp.where(k_ok, kv_latent, 0), jnp.where(k_ok, k_rope, 0)
  if q_lens is not None:
    q_ok = valid_positions(q_lens, call.q_len)[..., None]
    q_nope, q_rope = jnp.where(q_ok, q_nope, 0), jnp.where(q_ok, q_rope, 0)
  return q_nope, q_rope, kv_latent, k_rope, q_ok


def combine_splits(o, lse):
  """Merges split-KV partials ``o [B, splits, rows, d]`` (each normalised) by their natural-log
  ``lse [B, splits, rows]`` (-inf where a split saw no valid key): ``([B, rows, d], [B, rows])``;
  rows no split saw give zeros and ``-inf``. Every decode kernel's splits merge here."""
  m = jnp.max(lse, axis=1, keepdims=True)
  w = jnp.exp(lse - jnp.where(jnp.isfinite(m), m, 0.0))
  total = jnp.sum(w, axis=1)
  out = jnp.sum((w / jnp.where(total == 0.0, 1.0, total)[:, None])[..., None] * o, axis=1)
  m = jnp.where(jnp.isfinite(m[:, 0]), m[:, 0], 0.0)
  return out, jnp.where(total > 0, m + jnp.log(jnp.where(total > 0, total, 1.0)), -jnp.inf)


def attend_absorbed_xla(q_lat, q_rope, kv_latent, k_rope, lengths, page_table, scale, band=None):
  """The absorbed form's attention alone on XLA (the decode kernels' gradient): ``[B, Tq, H, d_c]``;
  ``band`` (lower, upper) among the queries, or None for key lengths alone."""
  if page_table is not None:
    kv_latent, k_rope = gather_pages(kv_latent, page_table), gather_pages(k_rope, page_table)
  ok = valid_positions(lengths, kv_latent.shape[1])
  kv_latent, k_rope = jnp.where(ok, kv_latent, 0), jnp.where(ok, k_rope, 0)
  q = jnp.concatenate([q_lat, q_rope], -1)
  k = jnp.concatenate([kv_latent, k_rope], -1)[:, :, None, :]
  mask = KVLenMask(lengths) if band is None else KVLenMask(lengths) & Mask(lower=band[0], upper=band[1])
  return dot_product_attention(q, k, kv_latent[:, :, None, :], mask=mask, scale=scale, implementation="xla")


def absorbed_with_kernel(kernel, q_nope, q_rope, kv_latent, k_rope, w_uk, w_uv, *, lengths, page_table, scale,
                         band=None):
  """The absorbed form with ``kernel(q_lat, q_rope, kv_latent, k_rope, lengths, page_table) -> o_lat
  [B, Tq, H, d_c]`` as its attention, forward only: the gradient is :func:`attend_absorbed_xla`'s,
  through a custom_vjp. ``[B, Tq, H, d_v]``."""

  @jax.custom_vjp
  def attend(q_lat, q_rope, kv_latent, k_rope, lengths, page_table):
    return kernel(q_lat, q_rope, kv_latent, k_rope, lengths, page_table)

  def fwd(*args):
    return attend(*args), args

  def bwd(args, g):
    xla = lambda a, b, c, d: attend_absorbed_xla(a, b, c, d, args[4], args[5], scale, band)
    return (*jax.vjp(xla, *args[:4])[1](g), None, None)

  attend.defvjp(fwd, bwd)
  dt = q_nope.dtype
  q_lat = project("bthd,chd->bthc", q_nope, w_uk, dt)
  o_lat = attend(q_lat, q_rope, kv_latent, k_rope, jnp.asarray(lengths, jnp.int32), page_table)
  return project("bthc,chd->bthd", o_lat, w_uv, dt)
