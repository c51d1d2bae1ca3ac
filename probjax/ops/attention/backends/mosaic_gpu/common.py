"""Pieces shared by the Mosaic GPU kernels: tile ranges of a mask, the producer warpgroup's
TMA ring, the element predicate and the wgmma helpers."""

from __future__ import annotations

import math
from typing import Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from probjax.ops.attention.base import score_mod_pullback
from probjax.ops.attention.call import KERNEL_MASK_KINDS
from probjax.ops.attention.masks import Mask, band as band_mask, pad_axis, ranges_from_classes, round_up

LOG2E = math.log2(math.e)
REGISTERS_PER_SM = 65536
ROWS = 64  # rows of one wgmma (M) per warpgroup
TMA_ROWS = 8  # Mosaic GPU's TMA copies need a copied array's second-minor axis in multiples of 8
TILED = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))


def tma_rows(n: int, *windows: int) -> int:
  """The sequence length a kernel's operand of ``n`` rows is padded to: a multiple of
  :data:`TMA_ROWS` and at least every copy window (a window cannot exceed its array). Tiles
  past the end are otherwise read as zeros (TMA's out-of-bounds fill) and stored clipped."""
  return max(round_up(n, TMA_ROWS), *windows)


def first_rows(x, n: int):
  """``x[:, :n]`` of a ``[batch, rows, ...]`` kernel output, without a slice when it has ``n``."""
  return x if x.shape[1] == n else x[:, :n]


def registers(compute_wgs: int) -> tuple[int, int]:
  """``(compute, producer)`` registers per thread after reallocation (``setmaxnreg``, per
  warpgroup of 128 threads): the producer keeps 40 (24 beside three compute warpgroups) and
  the compute warpgroups share the rest of the SM's file, at most 232 each (multiples of 8);
  two at 232 and the producer take 128 * 504 = 64,512 of 65,536."""
  producer = 40 if compute_wgs < 3 else 24
  compute = (REGISTERS_PER_SM // 128 - producer) // compute_wgs // 8 * 8
  return min(compute, 232), producer


def split_mask(mask: Mask | None, batch: int, q_len: int, kv_len: int):
  """``(band, has_lengths, lengths)``: the static band (None without one), whether the mask
  has per-batch lengths, and the ``[2, batch]`` int32 operand of query and key lengths the
  kernels read their scalars from (the full lengths where the mask has none)."""
  m = mask if mask is not None else Mask()
  why = m.refusal(KERNEL_MASK_KINDS, "the Mosaic GPU kernel")
  if why:
    raise ValueError(why)
  band = m.band if m.has_band else None
  q_lens, kv_lens = m.lengths(batch)
  full = lambda x, n: jnp.full((batch,), n, jnp.int32) if x is None else x
  lens = jnp.stack([full(q_lens, q_len), full(kv_lens, kv_len)])
  return band, q_lens is not None or kv_lens is not None, lens


def segment_operands(mask: Mask | None, batch: int, q_len: int, kv_len: int, q_pad: int, kv_pad: int,
                     block_q: int, block_k: int, *, by_q: bool, n_outer: int):
  """``(ranges, q_ids, kv_ids)`` for a mask with segment ids, else small placeholders the
  kernel never reads. ``ranges [batch, 4, n_outer]``: per batch element and outer tile
  (query tiles of ``block_q`` rows when ``by_q``, else key tiles of ``block_k``) the inner
  tile range and its run of FULL tiles, from the whole mask's tile classes
  (:func:`~probjax.ops.attention.masks.ranges_from_classes`); ids padded to whole tiles with
  values that match nothing. ``n_outer``: the outer tiles of the kernel's grid, whose
  position every CTA indexes the ranges by: grid tiles past the mask's get empty ranges, so
  that no CTA reads past the array; a grid of fewer tiles than the mask raises."""
  if not has_segments(mask):
    return jnp.zeros((1, 4, 1), jnp.int32), jnp.zeros((1, 64), jnp.int32), jnp.zeros((1, 64), jnp.int32)
  classes = mask.classify_tiles(batch, q_len, kv_len, block_q, block_k)
  ranges = ranges_from_classes(classes if by_q else jnp.swapaxes(classes, 1, 2))
  if ranges.shape[2] > n_outer:
    raise ValueError(f"the grid's {n_outer} outer tiles do not cover the mask's {ranges.shape[2]}")
  return (pad_axis(ranges, 2, n_outer), *mask.padded_segment_ids(batch, q_pad, kv_pad))


def has_segments(mask: Mask | None) -> bool:
  return mask is not None and "segments" in mask.kinds


def same_segment(q_ids_smem, kv_ids_smem, rows: int, cols: int, *, transposed: bool = False):
  """``[rows, cols]`` boolean tile (wgmma layout): query and key of the same segment.
  ``q_ids_smem``/``kv_ids_smem``: the tile's ids in shared memory (``transposed``: rows are
  keys, columns queries)."""
  row_ids, col_ids = (kv_ids_smem, q_ids_smem) if transposed else (q_ids_smem, kv_ids_smem)
  r = plgpu.load(row_ids, layout=plgpu.Layout.WGMMA.reduce(1))
  c = plgpu.load(col_ids, layout=plgpu.Layout.WGMMA.reduce(0))
  return lax.broadcast_in_dim(r, (rows, cols), [0]) == lax.broadcast_in_dim(c, (rows, cols), [1])


def _clip(lo, hi, flo, fhi):
  flo = jnp.clip(flo, lo, hi)
  return lo, hi, flo, jnp.clip(fhi, flo, hi)


def kv_tiles(band: Mask | None, q_start, rows: int, kv_len: int, block_k: int, q_valid=None,
             kv_valid=None):
  """``(lo, hi, full_lo, full_hi)`` (traced ints): the key tiles that query rows
  ``[q_start, q_start + rows)`` may see, and the run of them every row sees completely (no
  element predicate). ``q_valid``/``kv_valid``: this batch element's lengths (None: all);
  keys past ``kv_valid`` are never loaded and a block with rows past ``q_valid`` has no
  full tile (those rows must come out zero)."""
  lower, upper = (None, None) if band is None else band.band_bounds
  q_last = q_start + rows - 1
  lo = (jnp.int32(0) if lower is None else jnp.maximum(0, q_start + lower)) // block_k
  hi_k = jnp.int32(kv_len) if upper is None else jnp.minimum(kv_len, q_last + upper + 1)
  hi = jnp.maximum(lo, (hi_k + block_k - 1) // block_k)
  # Tile j is full when j*bk - q_last >= lower, (j+1)*bk - 1 - q_start <= upper, (j+1)*bk <= kv_len.
  flo = lo if lower is None else (q_last + lower + block_k - 1) // block_k
  fhi = jnp.int32(kv_len // block_k)
  if upper is not None:
    fhi = jnp.minimum(fhi, jnp.maximum(0, q_start + upper + 1) // block_k)
  if kv_valid is not None:
    hi = jnp.maximum(lo, jnp.minimum(hi, (kv_valid + block_k - 1) // block_k))
    fhi = jnp.minimum(fhi, kv_valid // block_k)
  if q_valid is not None:
    hi = jnp.where(q_start < q_valid, hi, lo)
    fhi = jnp.where(q_start + rows <= q_valid, fhi, flo)
  return _clip(lo, hi, flo, fhi)


def q_tiles(band: Mask | None, k_start, rows: int, q_len: int, block_q: int, q_valid=None,
            kv_valid=None):
  """:func:`kv_tiles` with the roles swapped: the query tiles that key rows
  ``[k_start, k_start + rows)`` are seen by, and the run that sees every one of them
  (``lower <= k - q <= upper`` is ``-upper <= q - k <= -lower``)."""
  lower, upper = (None, None) if band is None else band.band_bounds
  mirrored = None if band is None else band_mask(None if upper is None else -upper,
                                                 None if lower is None else -lower)
  return kv_tiles(mirrored, k_start, rows, q_len, block_q, q_valid=kv_valid, kv_valid=q_valid)


def element_ok(band: Mask | None, qi, ki, q_len: int, kv_len: int, q_valid=None, kv_valid=None):
  """The mask predicate on query/key position tiles (any broadcastable layout)."""
  ok = (qi < q_len) & (ki < kv_len)
  if band is not None:
    ok &= band.element(qi, ki)
  if q_valid is not None:
    ok &= (qi < q_valid) & (ki < kv_valid)
  return ok


def zero_rows_past(tile, start, valid):
  """Zeroes the rows of a shared-memory tile ``[rows, cols]`` (TMA-loaded, wgmma-tiled) whose
  first row is row ``start`` of a sequence and that lie at or past ``valid``, this batch
  element's length (a traced int32; None: nothing to do); only the 64-row slices holding such
  rows are rewritten, and nothing where the tile lies inside the length. Those rows may hold
  anything (a KV cache's unwritten tail: NaN, inf), and a probability of zero does not cancel
  them in a product (``0 * nan`` is NaN). Where several warpgroups read the tile (a ring
  slot), each zeroes it before its own products: every write stores the value already there
  (rows before the length) or zero (rows past it), so what another warpgroup reads meanwhile
  is the same."""
  if valid is None:
    return
  rows, cols = tile.shape
  n = valid - start  # the tile's rows before the length

  @pl.when(n < rows)
  def _():
    for r in range(0, rows, ROWS):
      @pl.when(n < r + ROWS)
      def _():
        part = tile.at[pl.ds(r, ROWS)]
        row = plgpu.broadcasted_iota(jnp.int32, (ROWS,), 0, layout=plgpu.Layout.WGMMA.reduce(1))
        keep = lax.broadcast_in_dim(r + row < n, (ROWS, cols), [0])
        part[...] = jnp.where(keep, part[...], jnp.zeros((), part.dtype))
    plgpu.commit_smem()  # the generic-proxy writes before the wgmmas (and TMA copies) that follow


def exponent(t, scale: float, score_mod: Callable | None, b, h, qi, ki):
  """``(x, pull)`` for a backward kernel's score tile ``t = q k^T`` (or its transpose, with
  ``qi``/``ki`` laid out to match): P is ``exp2(x - lse2)``, and ``pull(ds)`` takes dS (with
  respect to the modified score) back to the scaled score ``scale * q k^T`` through
  ``score_mod`` (the identity without one)."""
  if score_mod is None:
    return t * (scale * LOG2E), lambda ds: ds
  s_nat = t * scale
  return score_mod(s_nat, b, h, qi, ki) * LOG2E, lambda ds: score_mod_pullback(score_mod, s_nat, ds, b, h, qi, ki)


def iotas(rows: int, cols: int, row0, col0):
  """Row and column positions of a ``[rows, cols]`` tile in the wgmma accumulator layout."""
  it = lambda dim: plgpu.broadcasted_iota(jnp.int32, (rows, cols), dim, layout=plgpu.Layout.WGMMA)
  return row0 + it(0), col0 + it(1)


def block_tiles(rng_ref, len_ref, b, i, *, segments: bool, lengths: bool, ranges: Callable):
  """``((lo, hi, full_lo, full_hi), (q_valid, kv_valid))`` of block ``i`` of batch element
  ``b``: from the precomputed ranges with segment ids (:func:`segment_operands`), else
  ``ranges(q_valid, kv_valid)`` (:func:`kv_tiles` or :func:`q_tiles` of the block)."""
  valid = (len_ref[0, b], len_ref[1, b]) if lengths else (None, None)
  if segments:
    return tuple(rng_ref[b, r, i] for r in range(4)), valid
  return ranges(*valid), valid


def kv_issuer(b, hkv, block_k: int, k_ref, v_ref, kid_ref, k_smem, v_smem, kid_smem, k_ready, v_ready,
              kid_ready, *, segments: bool, multicast: bool = False):
  """``(issue_k, issue_v)`` for :func:`produce`: ``issue_k(j, slot)`` starts the TMA copy of key
  tile ``j`` of K (and its segment ids), ``issue_v(j, slot)`` that of V, into ring slot
  ``slot``, each completing its own barrier. ``multicast``: every CTA of the ``"cluster"``
  axis issues the same tiles, loads its share of them and multicasts it to all."""
  tile = lambda j: (b, pl.ds(j * block_k, block_k), hkv)
  axes = "cluster" if multicast else None

  def issue_k(j, slot):
    plgpu.copy_gmem_to_smem(k_ref.at[tile(j)], k_smem.at[slot], k_ready.at[slot], collective_axes=axes)
    if segments:
      plgpu.copy_gmem_to_smem(kid_ref.at[b, pl.ds(j * block_k, block_k)], kid_smem.at[slot], kid_ready.at[slot])

  def issue_v(j, slot):
    plgpu.copy_gmem_to_smem(v_ref.at[tile(j)], v_smem.at[slot], v_ready.at[slot], collective_axes=axes)
  return issue_k, issue_v


def produce(lo, hi, stages: int, copies: tuple, base=None, drain: bool = True):
  """The producer warpgroup's loop over steps ``j`` in ``[lo, hi)``, each into ring slot
  ``(base + j - lo) % stages`` (``base``: ring steps issued before, by earlier tiles of a
  persistent kernel). ``copies``: ``((free, issue), ...)`` in issue order; ``issue(j, slot)``
  starts its copies once every consumer released the slot on each barrier in ``free`` (one
  arrival each), so a buffer released early (K after Q K^T) refills before a later one (V
  after P V). Returns ``base + hi - lo``; with ``drain`` it then waits for the last releases
  too (:func:`drain_ring`)."""
  base = 0 if base is None else base

  @pl.loop(lo, hi)
  def _issue(j):
    g = base + j - lo
    slot = lax.rem(g, jnp.int32(stages))
    for free, issue in copies:
      if free:
        @pl.when(g >= stages)
        def _():
          for bar in free:
            plgpu.barrier_wait(bar.at[slot])
      issue(j, slot)

  total = base + jnp.maximum(hi - lo, 0)
  if drain:
    drain_ring(total, stages, tuple(bar for free, _ in copies for bar in free))
  return total


def drain_ring(total, stages: int, free: tuple):
  """Waits for the consumers' releases of the last ``stages`` of ``total`` ring steps, so
  that every barrier phase is observed before the block ends."""
  @pl.loop(jnp.maximum(total - stages, 0), total)
  def _(g):
    for bar in free:
      plgpu.barrier_wait(bar.at[lax.rem(g, jnp.int32(stages))])


def mma(a, b, shape, during: Callable | None = None):
  """``a @ b`` (float32 ``shape``) with ``a``, ``b`` shared-memory refs (``.T`` views allowed);
  ``during()`` runs while the wgmma is in flight."""
  return mma_sum(((a, b),), shape, during)


def mma_sum(pairs, shape, during: Callable | None = None):
  """``sum(a @ b for a, b in pairs)`` (float32 ``shape``), as :func:`mma`: one accumulator,
  a wgmma per pair."""
  def run(acc_ref):
    for a, b in pairs:
      plgpu.wgmma(acc_ref, a, b)
    if during is not None:
      during()
    return acc_ref[...]
  return pl.run_scoped(run, plgpu.ACC(shape, jnp.float32))


def mma_overlap(acc, a, b, s_operands, s_shape, consume: Callable, init, staging=None,
                during: Callable | None = None):
  """``(acc + a @ b, consume(s))`` with ``s = s_operands[0] @ s_operands[1]`` (float32
  ``s_shape``, shared-memory refs) and ``a @ b`` as in :func:`mma_acc`: both wgmmas are issued
  together (``during()`` runs while they are in flight) and ``consume(s)`` runs as soon as
  ``s`` is complete, while ``a @ b`` may still be. ``consume`` returns a pytree shaped as
  ``init``. Interpret mode (``staging``): one product after the other."""
  if staging is not None:
    s = mma(*s_operands, s_shape, during)
    return mma_acc(acc, a, b, staging), consume(s)
  leaves, tree = jax.tree.flatten(init)

  def body(refs):
    acc_ref, *out_refs = refs

    def issue(s_ref):
      plgpu.wgmma(s_ref, *s_operands)
      plgpu.wgmma(acc_ref, a, b)
      if during is not None:
        during()
      return plgpu.wgmma_accumulator_load(s_ref, wait_n=1)  # the first group only
    for ref, v in zip(out_refs, jax.tree.leaves(consume(pl.run_scoped(issue, plgpu.ACC(s_shape, jnp.float32))))):
      ref[...] = v
  acc, *outs = pl.run_state(body)((plgpu.ACC.init(acc), *leaves))
  return acc, jax.tree.unflatten(tree, outs)


def mma_acc(acc, a, b, staging=None, during: Callable | None = None):
  """``acc + a @ b`` with ``a`` in registers (16-bit, wgmma layout) and ``b`` a shared-memory
  ref, accumulated in place by wgmma; ``during()`` runs while it is in flight. ``staging``
  (interpret mode, whose wgmma reads only shared memory and cannot accumulate in place): a
  shared-memory buffer for ``a``; the product is then added."""
  if staging is None:
    def run(acc_ref):
      plgpu.wgmma(acc_ref, a, b)
      if during is not None:
        during()
    return pl.run_state(run)(plgpu.ACC.init(acc))
  staging[...] = a
  plgpu.commit_smem()
  return acc + mma(staging, b, acc.shape, during)
