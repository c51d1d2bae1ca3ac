"""Split-KV forward for decoding (Pallas, Triton backend).

For few queries against a long KV cache the regular forward has only
``batch * heads * query tiles`` programs. This kernel also splits the keys:
one program per (key split, batch element, KV head, packed row tile). The
queries of all ``G`` heads of a GQA group are packed into the rows of one tile
(row ``r`` is query ``r // G`` of head ``hkv * G + r % G``), so each K/V tile is
loaded once per group. Each program writes its normalised partial output and
base-2 log-sum-exp; :func:`combine` merges the splits in XLA.

K/V are contiguous ``[batch, kv_len, kv_heads, d]`` or page pools ``[num_pages, page_size,
kv_heads, d]`` read in place through a page table (:mod:`probjax.ops.attention.paged`): a key
block lies inside one page (the block divides the page), so one table entry per block gives its
address. Positions are logical either way, so the masks, the lengths and the splits are the
same; an entry outside the pool reads page 0 and its positions get zero weight.

Forward only: under ``jax.grad`` the regular kernel runs (it saves the residuals
the backward needs), see :func:`probjax.ops.attention.backends.triton.attention`.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from probjax.ops.attention.call import KERNEL_MASK_KINDS
from probjax.ops.attention.masks import Mask
from probjax.ops.attention.backends.triton import config as config_lib
from probjax.ops.attention.backends.triton import tiles
from probjax.ops.attention.backends.triton.config import SplitKVConfig

MAX_QUERIES = 64        # auto: at most this many queries per sequence
MIN_KEYS = 1024         # auto: at least this many keys
MIN_SPLIT_KEYS = 256    # no split gets fewer keys (each program's loop amortises its setup)


def why_not(q_shape, kv_shape, *, score_mod, mask: Mask | None = None) -> str | None:
  """Why the split-KV kernel cannot compute a call (None if it can)."""
  if score_mod is not None:
    return "score_mod (the packed rows mix heads)"
  if mask is not None and "mask_mod" in mask.kinds:
    return "mask_mod (the packed rows mix heads; the regular forward computes it)"
  if q_shape[1] > MAX_QUERIES:
    return f"{q_shape[1]} queries > {MAX_QUERIES}"
  return None


def page_why_not(page_size: int) -> str | None:
  """Why the kernel cannot read pages of ``page_size`` positions (None if it can): a key block,
  at least ``MIN_BLOCK`` positions, must lie inside one page."""
  if page_size % config_lib.MIN_BLOCK:
    return (f"page_size {page_size} is not a multiple of {config_lib.MIN_BLOCK} (a key block, at least "
            f"{config_lib.MIN_BLOCK} positions, must lie inside one page)")
  return None


def page_block(block_k: int, page_size: int) -> int:
  """The largest key block at most ``block_k`` (a power of two) that divides ``page_size``:
  ``block_k`` itself for a power-of-two page at least that long."""
  return min(block_k, page_size & -page_size)  # the largest power of two dividing page_size


def plan(q_shape, kv_shape, dtype, *, mask: Mask | None, score_mod, split_kv,
         device: str, v_head_dim: int | None = None, page_size: int | None = None) -> SplitKVConfig | None:
  """The split-KV launch for a forward call, or None for the regular kernel.

  ``split_kv``: None (automatic: at most ``MAX_QUERIES`` queries, at least ``MIN_KEYS`` keys,
  and two or more splits or GQA's packed rows), False (never), True (whenever the kernel can
  take the call; ValueError otherwise) or a :class:`SplitKVConfig`
  (likewise, with its tiles, which must fit the device's shared memory). Default
  tiles are shrunk -- stages, then keys, then rows -- until they fit. ``v_head_dim``: the
  values' head_dim (None: the keys'). ``page_size``: a paged call (``kv_shape`` the contiguous
  shape it stands for), which only this kernel reads: it always gets a launch (one split where
  the keys are few), a key block dividing the page (:func:`page_block`); ValueError for
  ``split_kv=False`` or a call the kernel cannot take.
  """
  if page_size is not None:
    why = page_why_not(page_size)
    if split_kv is False or why:
      raise ValueError(f"a paged KV cache (page_table) is read only by the split-KV decode kernel: "
                       f"{why or 'split_kv=False'}; pass implementation='xla' to gather the pages")
    split_kv = True if split_kv is None else split_kv
  if split_kv is False:
    return None
  explicit = isinstance(split_kv, SplitKVConfig)
  if split_kv is not None and split_kv is not True and not explicit:
    raise TypeError(f"split_kv must be None, a bool or a SplitKVConfig, got {type(split_kv).__name__}")
  reason = why_not(q_shape, kv_shape, score_mod=score_mod, mask=mask)
  if split_kv is None and (reason is not None or kv_shape[1] < MIN_KEYS):
    return None
  if reason is not None:
    raise ValueError(f"split_kv={split_kv!r} cannot compute this call: {reason}")
  group_rows = q_shape[1] * (q_shape[2] // kv_shape[2])
  cfg = split_kv if explicit else SplitKVConfig()
  cfg = dataclasses.replace(cfg, block_rows=_block_rows(cfg, group_rows))
  if page_size is not None:
    cfg = dataclasses.replace(cfg, block_k=page_block(cfg.block_k, page_size))
  itemsize, d = np.dtype(dtype).itemsize, tiles.padded_head_dim(q_shape[-1])
  dv = tiles.padded_head_dim(q_shape[-1] if v_head_dim is None else v_head_dim)
  limit = config_lib.smem_limit(device)
  need = lambda c: c.smem_bytes(itemsize, d, c.block_rows, v_head_dim=dv)
  fits = lambda c: limit is None or need(c) <= limit
  if explicit and not fits(cfg):
    raise ValueError(f"split_kv config {cfg} needs {need(cfg)} bytes of shared memory per block "
                     f"(head_dim {d}, value head_dim {dv}) but {device} has {limit}")
  while not fits(cfg):
    if cfg.num_stages > 1:
      cfg = dataclasses.replace(cfg, num_stages=cfg.num_stages - 1)
    elif cfg.block_k > config_lib.MIN_BLOCK:
      cfg = dataclasses.replace(cfg, block_k=cfg.block_k // 2)
    elif cfg.block_rows > config_lib.MIN_BLOCK:
      cfg = dataclasses.replace(cfg, block_rows=cfg.block_rows // 2)
    elif split_kv is None:
      return None
    else:
      raise ValueError(f"no split_kv tiles fit {limit} bytes of shared memory (head_dim {d})")
  if cfg.num_splits is None:
    lo, hi = _band_keys(mask, q_shape[1], kv_shape[1])
    n_rows = math.ceil(group_rows / cfg.block_rows)
    by_len = max(1, (hi - lo) // MIN_SPLIT_KEYS)
    by_device = math.ceil(config_lib.num_programs_target(device) / (q_shape[0] * kv_shape[2] * n_rows))
    cfg = dataclasses.replace(cfg, num_splits=max(1, min(by_len, by_device)))
  pow2 = d == q_shape[-1] and dv == (q_shape[-1] if v_head_dim is None else v_head_dim)
  if split_kv is None and cfg.num_splits < 2 and group_rows == q_shape[1] and pow2:
    # One split and one head per K/V head: the regular forward's grid is as full and reads the
    # same bytes. Under GQA the packed rows still read each K/V tile once per group where the
    # regular forward reads it once per query head: at B56 H48/12 with 13 queries against 4722
    # keys (one split fills the device) that is 4x the cache's bytes. Nor at a head_dim that is
    # not a power of two, where both kernels compute at the padded width and read in place, yet
    # one split of this kernel was measured ahead: at B53 H40 D192 with 3 queries against 3187
    # keys (docs/dev/decisions.md, "Decode at widths that are not a power of two").
    return None
  return config_lib.with_fast_exp2(cfg, device)


def _block_rows(cfg: SplitKVConfig, rows: int) -> int:
  if cfg.block_rows is not None:
    return cfg.block_rows
  return max(config_lib.MIN_BLOCK, min(128, 1 << max(0, (rows - 1).bit_length())))


def _band_keys(mask: Mask | None, q_len: int, kv_len: int) -> tuple[int, int]:
  """Static key range ``[lo, hi)`` the mask's band allows for all ``q_len`` queries."""
  if mask is None:
    return 0, kv_len
  return mask.band.kv_range(0, q_len, kv_len)


def _kernel(q_ref, k_ref, v_ref, *refs, tm: tiles.TileMask, scale: float, groups: int,
            block_rows: int, block_k: int, tile_lo: int, tiles_per_split: int, num_splits: int, tile_hi: int,
            n_row_tiles: int, masked: bool, fast_exp2: bool, page_size: int | None = None):
  # refs: the mask's, then with pages the table and its validity ([batch, pages] int32), then the outputs.
  n_page_refs = 0 if page_size is None else 2
  mr = tiles.MaskRefs.unpack(tm, refs[:len(refs) - 2 - n_page_refs])
  pages_ref, page_ok_ref = refs[-4:-2] if page_size is not None else (None, None)
  o_ref, lse_ref = refs[-2:]
  split, b, p = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  hkv, rt = p // n_row_tiles, p % n_row_tiles
  row0 = rt * block_rows
  q = q_ref.at[b, hkv, pl.ds(row0, block_rows), :][...]
  rows = row0 + jax.lax.broadcasted_iota(jnp.int32, (block_rows, 1), 0)
  qi = rows // groups
  qs = mr.q_seg.at[b, pl.ds(row0, block_rows)][...][:, None] if mr.q_seg is not None else None

  if mr.kv_lens is None:
    start = tile_lo + split * tiles_per_split
    end = jnp.minimum(start + tiles_per_split, tile_hi)
  else:
    # The splits share this element's valid tiles, not the cache's: a cache of 8192 keys holding
    # 1100 in 9 splits would otherwise leave 7 programs of every (batch, head) idle and two
    # with 910 keys each; shared, each takes about 128.
    valid_hi = jnp.minimum((mr.kv_lens[b] + block_k - 1) // block_k, tile_hi)
    per_split = (jnp.maximum(valid_hi - tile_lo, 0) + num_splits - 1) // num_splits
    start = tile_lo + split * per_split
    end = jnp.minimum(start + per_split, valid_hi)

  kv_valid = mr.valid(b, keys=True)

  def body(j, carry):
    # The cache keeps its own head_dim: a width off the power-of-two tile (96, 192) is read in
    # place, the tile's columns past it masked (tiles.load_head), as the rows past the keys are.
    k_start = j * block_k
    if page_size is None:
      idx = (b, pl.ds(k_start, block_k), hkv)
      limit = kv_valid
    else:  # the block lies inside page k_start // page_size (the block divides the page)
      page_idx = k_start // page_size
      page, off = pages_ref[b, page_idx], k_start % page_size
      idx = (page, pl.ds(off, block_k), hkv)
      # An entry outside the pool (read as page 0) gets zero weight: its length limit is 0.
      limit = kv_valid * page_ok_ref[b, page_idx]
    k, v = (tiles.load_head(ref, idx, k_start, tm.kv_len, valid=limit) for ref in (k_ref, v_ref))
    t, c, _ = tiles.scores(q, k, scale=scale, score_mod=None, b=b, h=None, q_start=None,
                           k_start=k_start)
    if masked:
      ki = k_start + jax.lax.broadcasted_iota(jnp.int32, (1, block_k), 1)
      ks = mr.kv_seg.at[b, pl.ds(k_start, block_k)][...][None, :] if qs is not None else None
      t = jnp.where(tiles.valid(tm, mr, b, qi, ki, qs, ks), t, -jnp.inf)
      if page_size is not None:
        t = jnp.where(ki < limit, t, -jnp.inf)
    return tiles.online_softmax_step(carry, t, c, v, fast_exp2)

  carry = jax.lax.fori_loop(start, jnp.maximum(start, end), body,
                            tiles.online_softmax_init(block_rows, o_ref.shape[-1]))
  out, lse2, empty = tiles.online_softmax_finish(carry)
  o_ref.at[b, hkv, split, pl.ds(row0, block_rows), :][...] = out
  lse_ref.at[b, hkv, split, pl.ds(row0, block_rows)][...] = jnp.where(empty, -jnp.inf, lse2)


def forward(q, k, v, mask: Mask | None, *, scale: float, config: SplitKVConfig, interpret: bool,
            page_table=None):
  """Attention output ``[batch, q_len, heads, v_head_dim]`` by split-KV (no residuals).

  Args:
    q: ``[batch, q_len, heads, head_dim]``; k: ``[batch, kv_len, kv_heads, head_dim]``;
    v: ``[batch, kv_len, kv_heads, v_head_dim]``.
    config: from :func:`plan` (fitted to the device; ``num_splits`` and ``block_rows`` set).
    page_table: ``[batch, pages_per_seq]`` integers: k and v are then page pools ``[num_pages,
      page_size, kv_heads, d]`` (``kv_len`` is ``pages_per_seq * page_size``; ``config.block_k``
      divides ``page_size``) and ``mask`` must hold the key lengths. An entry outside the pool
      reads page 0 and its positions get zero weight.
  """
  batch, q_len, heads, d = q.shape
  kv_len, kv_heads = k.shape[1], k.shape[2]
  page_size, page_ops = None, []
  if page_table is not None:
    page_size, kv_len = k.shape[1], page_table.shape[1] * k.shape[1]
    if page_size % config.block_k or mask is None or "kv_lengths" not in mask.kinds:
      raise ValueError(f"a paged call needs key blocks ({config.block_k}) dividing page_size {page_size} and "
                       "a mask with the key lengths (KVLenMask)")
    from probjax.ops.attention import paged  # the entries' clamp and validity, shared with the XLA path
    page_ops = [paged.clamped(page_table, k.shape[0]), paged.page_ok(page_table, k.shape[0]).astype(jnp.int32)]
  groups = heads // kv_heads
  c = config
  dv = v.shape[-1]
  dp, dvp = tiles.padded_head_dim(d), tiles.padded_head_dim(dv)
  bk, br = c.block_k, c.block_rows
  n_rows = q_len * groups
  rows_pad = tiles.round_up(n_rows, br)
  kv_pad = tiles.round_up(kv_len, bk)
  lo, hi = _band_keys(mask, q_len, kv_len)
  tile_lo, tile_hi = lo // bk, max(lo // bk, tiles.num_tiles(hi, bk))
  tiles_per_split = max(1, math.ceil((tile_hi - tile_lo) / c.num_splits))
  splits = max(1, math.ceil((tile_hi - tile_lo) / tiles_per_split))

  # [b, q, hkv*G, d] -> [b, hkv, q*G, d]: row r is query r // G of head hkv*G + r % G.
  qp = q.reshape(batch, q_len, kv_heads, groups, d).transpose(0, 2, 1, 3, 4)
  qp = qp.reshape(batch, kv_heads, n_rows, d)
  qp = tiles.pad_axis(tiles.pad_axis(qp, 3, dp), 2, rows_pad)  # small: the packed queries
  # k and v are read in place, at their own head_dims (the kernel masks the tile's extra columns)

  m = mask if mask is not None else Mask()
  why = m.refusal(KERNEL_MASK_KINDS, "the Triton kernel")
  if why:
    raise ValueError(why)
  arrays = m.operands(batch, q_len, kv_pad)
  tm = tiles.TileMask(m.band, q_len, kv_len, has_range=False, has_q_lengths="q_lengths" in arrays,
                      has_kv_lengths="kv_lengths" in arrays, has_segments="segments" in arrays)
  mask_ops = [*arrays.get("q_lengths", ()), *arrays.get("kv_lengths", ())]
  if tm.has_segments:
    q_seg, kv_seg = arrays["segments"]
    row_seg = jnp.repeat(q_seg, groups, axis=1)  # the query of each packed row
    mask_ops += [tiles.pad_axis(row_seg, 1, rows_pad, -1), kv_seg]
  masked = mask is not None or kv_pad != kv_len
  n_row_tiles = rows_pad // br
  kernel = functools.partial(
      _kernel, tm=tm, scale=scale, groups=groups, block_rows=br, block_k=bk, tile_lo=tile_lo,
      tiles_per_split=tiles_per_split, num_splits=splits, tile_hi=tile_hi, n_row_tiles=n_row_tiles, masked=masked,
      fast_exp2=c.fast_exp2 and not interpret, page_size=page_size)
  o, lse2 = pl.pallas_call(
      kernel,
      grid=(splits, batch, kv_heads * n_row_tiles),
      out_shape=(jax.ShapeDtypeStruct((batch, kv_heads, splits, rows_pad, dvp), jnp.float32),
                 jax.ShapeDtypeStruct((batch, kv_heads, splits, rows_pad), jnp.float32)),
      compiler_params=plgpu.CompilerParams(num_warps=c.num_warps, num_stages=c.num_stages),
      interpret=interpret,
      name="probjax_attention_fwd_split_kv",
  )(qp, k, v, *mask_ops, *page_ops)
  out = combine(o, lse2)[:, :, :n_rows, :dv]
  out = out.reshape(batch, kv_heads, q_len, groups, dv).transpose(0, 2, 1, 3, 4)
  return out.reshape(batch, q_len, heads, dv).astype(q.dtype)


def combine(o, lse2):
  """Merges split partials: ``o [..., splits, rows, d]`` (each normalised), ``lse2
  [..., splits, rows]`` (base 2, -inf where a split saw no valid key) -> ``[..., rows, d]``;
  rows no split saw are 0."""
  m = jnp.max(lse2, axis=-2, keepdims=True)
  w = jnp.exp2(lse2 - jnp.where(jnp.isfinite(m), m, 0.0))
  total = jnp.sum(w, axis=-2, keepdims=True)
  w = w / jnp.where(total == 0.0, 1.0, total)
  return jnp.sum(w[..., None] * o, axis=-3)
