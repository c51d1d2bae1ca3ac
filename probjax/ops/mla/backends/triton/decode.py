"""Split-KV decode of the absorbed form (Pallas, Triton backend).

Multi-query attention of all ``H`` heads over the one shared latent: rows ``r = t * H + h`` of
``q_lat [B, Tq * H, d_c]`` / ``q_rope [B, Tq * H, d_rope]`` attend over keys ``[latent, k_rope]``
with values the latent. One program per (batch element, key split, row tile, value tile) streams
its split of the cache once; each writes a normalised partial output and its natural-log LSE, and
:func:`combine` merges the splits in XLA. Caches are contiguous (``[B, S, d]``) or paged (pools
``[num_pages, page_size, d]`` read through ``page_table [B, pages_per_seq]``).

Rows are tiled (``block_rows``, default 64) and the value width too (``block_v``, default 256):
a 128-row x 512-wide float32 accumulator is 256 KiB, more than a program's registers; 64 x 256
(64 KiB over 8 warps) fits beside the key tile. Each value tile re-reads its split's latent for
the scores, which then comes mostly from L2 (the tiles of one split run side by side).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
from probjax.ops.mla import forms

MIN_BLOCK = 16          # Triton's dots take tiles of at least 16 on each side
MAX_QUERIES = 16        # auto dispatch: at most this many queries per step
TARGET_PROGRAMS = 264   # two waves of an H200's 132 SMs


def why_not(*, q_len: int, heads: int, d_c: int, d_rope: int, mask_kinds: tuple[str, ...],
            page_size: int | None = None) -> str | None:
  """Why the kernel cannot compute a call (None if it can)."""
  if any(k != "kv_lengths" for k in mask_kinds):
    return f"mask predicates {mask_kinds}: the decode kernel takes KVLenMask only"
  for name, n in (("d_c", d_c), ("d_rope", d_rope)):
    if n % MIN_BLOCK:
      return f"{name} {n} is not a multiple of {MIN_BLOCK}"
  if page_size is not None and (page_size < MIN_BLOCK or page_size % MIN_BLOCK):
    return f"page_size {page_size} must be a multiple of {MIN_BLOCK} (>= {MIN_BLOCK})"
  return None


def _pow2(n: int) -> int:
  return 1 << max(0, (n - 1).bit_length())


def _kernel(lens_ref, table_ref, ql_ref, qr_ref, lat_ref, rope_ref, o_ref, lse_ref, *, scale: float,
            block_k: int, block_rows: int, block_v: int, num_splits: int, page_size: int | None):
  b, split, rt, vt = pl.program_id(0), pl.program_id(1), pl.program_id(2), pl.program_id(3)
  row0, v0 = rt * block_rows, vt * block_v
  ql = ql_ref.at[b, pl.ds(row0, block_rows), :][...]
  qr = qr_ref.at[b, pl.ds(row0, block_rows), :][...]
  length = lens_ref[b]
  # The splits share this element's valid blocks, not the cache's (lengths differ per element).
  n_blocks = (length + block_k - 1) // block_k
  per_split = (n_blocks + num_splits - 1) // num_splits
  start = split * per_split
  end = jnp.minimum(start + per_split, n_blocks)

  def body(j, carry):
    m, l, acc = carry
    pos = j * block_k
    ki = pos + jax.lax.broadcasted_iota(jnp.int32, (block_k, 1), 0)
    ok = ki < length      # positions past the length are never loaded: they may hold NaN
    if page_size is None:
      at = lambda ref, lo, w: ref.at[b, pl.ds(pos, block_k), pl.ds(lo, w)]
    else:
      page = table_ref[b, pos // page_size]
      off = pos % page_size
      at = lambda ref, lo, w: ref.at[page, pl.ds(off, block_k), pl.ds(lo, w)]
    load = lambda view: plgpu.load(view, mask=jnp.broadcast_to(ok, view.shape), other=0)
    lat = load(at(lat_ref, 0, lat_ref.shape[-1]))
    rope = load(at(rope_ref, 0, rope_ref.shape[-1]))
    val = lat if block_v == lat_ref.shape[-1] else load(at(lat_ref, v0, block_v))
    s = (jax.lax.dot_general(ql, lat, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
         + jax.lax.dot_general(qr, rope, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32))
    s = jnp.where(ok.reshape(1, block_k), s * scale, -jnp.inf)
    m_new = jnp.maximum(m, s.max(axis=1))
    safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    p = jnp.exp(s - safe[:, None])
    alpha = jnp.exp(m - safe)
    l = l * alpha + p.sum(axis=1)
    acc = acc * alpha[:, None] + jax.lax.dot(p.astype(val.dtype), val, preferred_element_type=jnp.float32)
    return m_new, l, acc

  init = (jnp.full((block_rows,), -jnp.inf, jnp.float32), jnp.zeros((block_rows,), jnp.float32),
          jnp.zeros((block_rows, block_v), jnp.float32))
  m, l, acc = jax.lax.fori_loop(start, jnp.maximum(start, end), body, init)
  empty = l == 0.0
  o_ref.at[b, split, pl.ds(row0, block_rows), pl.ds(v0, block_v)][...] = acc / jnp.where(empty, 1.0, l)[:, None]
  lse_ref.at[b, split, pl.ds(row0, block_rows)][...] = jnp.where(empty, -jnp.inf, m + jnp.log(jnp.where(empty, 1.0, l)))


combine = forms.combine_splits


# Shared memory at the default tiles, d_c 512, bf16: the query tile (64 rows x 512) is 64 KiB and
# each pipeline stage holds a key block of latent and rope plus its value slice, 68 KiB at 32
# positions and the whole 512-wide value; two stages make 200 KiB of sm_90's 227 KiB (64
# positions would not fit). The whole value width in one tile reads each latent block once per
# row tile; 256-wide value tiles read it twice (measured slower: docs/dev/decisions.md).
DEFAULT_BLOCK_K = 32
DEFAULT_BLOCK_V = 512


def decode(q_lat, q_rope, kv_latent, k_rope, lengths, *, scale: float, page_table=None,
           num_splits: int | None = None, block_k: int | None = None, block_rows: int | None = None,
           block_v: int | None = None, num_warps: int = 8, num_stages: int = 2, sm_count: int = 132,
           interpret: bool = False):
  """Absorbed-form attention over a latent cache: ``(out [B, Tq, H, d_c], lse [B, Tq, H])``.

  Args:
    q_lat: ``[B, Tq, H, d_c]`` (q_nope absorbed through w_uk); q_rope: ``[B, Tq, H, d_rope]``.
    kv_latent, k_rope: ``[B, S, d_c]`` / ``[B, S, d_rope]``, or with ``page_table``
      (``[B, pages_per_seq]`` int32) the page pools ``[num_pages, page_size, d]``.
    lengths: ``[B]`` int32 valid positions per element (clamped to the cache); positions at or
      past it are never read. Rows of length 0 give zeros and lse ``-inf``.
    scale: the softmax scale. The output is in q_lat's dtype, the lse float32.
  """
  batch, tq, heads, d_c = q_lat.shape
  d_rope = q_rope.shape[-1]
  paged = page_table is not None
  page_size = kv_latent.shape[1] if paged else None
  kv_len = page_table.shape[1] * page_size if paged else kv_latent.shape[1]
  why = why_not(q_len=tq, heads=heads, d_c=d_c, d_rope=d_rope, mask_kinds=(), page_size=page_size)
  if why:
    raise ValueError(why)
  rows = tq * heads
  block_rows = block_rows or max(MIN_BLOCK, min(64, _pow2(rows)))
  block_v = block_v or min(d_c, DEFAULT_BLOCK_V)
  if d_c % block_v or block_v % MIN_BLOCK:
    raise ValueError(f"block_v {block_v} must divide d_c {d_c} and be a multiple of {MIN_BLOCK}")
  block_k = block_k or min(DEFAULT_BLOCK_K, page_size or DEFAULT_BLOCK_K)
  if paged and page_size % block_k:
    raise ValueError(f"block_k {block_k} must divide page_size {page_size}")
  rows_pad = -(-rows // block_rows) * block_rows
  n_rt, n_vt = rows_pad // block_rows, d_c // block_v
  max_blocks = max(1, -(-kv_len // block_k))
  if num_splits is None:
    num_splits = min(max_blocks, max(1, -(-2 * sm_count // (batch * n_rt * n_vt))))
  # Loads are masked by the length (clamped to the cache), so the cache needs no padding.
  lengths = jnp.clip(jnp.asarray(lengths, jnp.int32), 0, kv_len)
  table = (jnp.clip(page_table.astype(jnp.int32), 0, kv_latent.shape[0] - 1) if paged
           else jnp.zeros((batch, 1), jnp.int32))
  pad = lambda x: jnp.pad(x.reshape(batch, rows, -1), ((0, 0), (0, rows_pad - rows), (0, 0)))
  kernel = functools.partial(_kernel, scale=float(scale), block_k=block_k, block_rows=block_rows,
                             block_v=block_v, num_splits=num_splits, page_size=page_size)
  o, lse = pl.pallas_call(
      kernel,
      grid=(batch, num_splits, n_rt, n_vt),
      out_shape=(jax.ShapeDtypeStruct((batch, num_splits, rows_pad, d_c), jnp.float32),
                 jax.ShapeDtypeStruct((batch, num_splits, rows_pad), jnp.float32)),
      compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
      interpret=interpret,
      name="probjax_mla_decode",
  )(lengths, table, pad(q_lat), pad(q_rope), kv_latent, k_rope)
  out, lse = combine(o, lse)
  out = out[:, :rows].reshape(batch, tq, heads, d_c).astype(q_lat.dtype)
  return out, lse[:, :rows].reshape(batch, tq, heads)
