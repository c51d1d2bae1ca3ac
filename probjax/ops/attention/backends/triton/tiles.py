"""Pieces shared by the forward and backward kernels: the mask arrays a
pallas_call receives, the in-kernel tile predicate and the score computation.

All kernels take whole-array refs (``[batch, seq, heads, head_dim]`` etc.) and
index their tile with ``ref.at[b, pl.ds(start, block), h, cols]`` (:func:`load_head`,
:func:`store_head`): Triton only sees pointers, and one layout serves every grid (split, fused,
onepass). No axis is padded to the tile: the sequence axes' last, partial tile is loaded and
stored with a row mask, a head_dim off the power-of-two tile width (40, 96, 192) with a column
mask (:func:`load_rows`, :func:`store_rows`), so a call at an odd length or width copies no
array around the kernel.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from probjax.ops.attention.base import first_unlowerable
from probjax.ops.attention.call import TRITON_MASK_KINDS
from probjax.ops.attention.masks import (EMPTY, FULL, Mask, TileFunction, heavy_first_program,  # noqa: F401
                                        lists_from_classes, num_tiles, pad_axis, ranges_from_classes,
                                        round_up)  # (re-exported)

LOG2E = math.log2(math.e)


@dataclasses.dataclass(frozen=True)
class TileMask:
  """Static mask description a kernel is traced with.

  ``band``: the mask's static band (:attr:`Mask.band`). ``q_len``/``kv_len`` are the true
  lengths (arrays are padded beyond them). The optional refs follow the main operands in the
  order ``tile_range, q_lengths, kv_lengths, q_segment_ids, kv_segment_ids`` and then the
  arrays ``fn`` closes over (``fn.consts``, each as one element).
  ``fn``: a mask_mod traced on this kernel's tile index shapes (:meth:`Mask.tile_function`),
  evaluated on PARTIAL tiles; None without one. With one, ``tile_range`` holds tile lists
  (:func:`~probjax.ops.attention.masks.lists_from_classes`) instead of ranges.
  """
  band: Mask
  q_len: int
  kv_len: int
  has_range: bool       # a mask: per-tile loop bounds (without one, only odd lengths' last tile is masked)
  has_q_lengths: bool
  has_kv_lengths: bool
  has_segments: bool    # segment ids: per-batch tile ranges from the tile classes
  fn: TileFunction | None = None  # a mask_mod: per-batch tile lists from the tile classes


@dataclasses.dataclass
class MaskRefs:
  """The mask refs of one kernel, unpacked from its positional refs."""
  tile_range: Any = None   # [4, n] (or [batch, 4, n] with segments) int32: lo, hi, full_lo, full_hi;
                           # with a mask_mod, [batch, n, 2, 1 + n_inner]: lists_from_classes
  q_lens: Any = None       # [batch] int32
  kv_lens: Any = None      # [batch] int32
  q_seg: Any = None        # [batch, q_pad] int32
  kv_seg: Any = None       # [batch, kv_pad] int32
  fn_consts: tuple = ()    # [1] each: the scalars tm.fn closes over

  @staticmethod
  def count(tm: TileMask) -> int:
    n_fn = 0 if tm.fn is None else len(tm.fn.consts)
    return tm.has_range + tm.has_q_lengths + tm.has_kv_lengths + 2 * tm.has_segments + n_fn

  def valid(self, b, *, keys: bool):
    """Batch element ``b``'s key (``keys``) or query length, or None without one."""
    lengths = self.kv_lens if keys else self.q_lens
    return None if lengths is None else lengths[b]

  @classmethod
  def unpack(cls, tm: TileMask, refs) -> "MaskRefs":
    refs = list(refs)
    pop = lambda flag: refs.pop(0) if flag else None
    out = cls(pop(tm.has_range))
    out.q_lens, out.kv_lens = pop(tm.has_q_lengths), pop(tm.has_kv_lengths)
    out.q_seg, out.kv_seg = pop(tm.has_segments), pop(tm.has_segments)
    out.fn_consts = tuple(refs[:0 if tm.fn is None else len(tm.fn.consts)])
    return out

  def fn_args(self, tm: TileMask) -> list:
    """The arrays ``tm.fn`` closes over, read from their refs (one element each: a value of any
    shape, broadcast back to it)."""
    out = []
    for ref, c in zip(self.fn_consts, tm.fn.consts):
      x = ref[0]
      x = x != 0 if c.dtype == jnp.bool_ else x.astype(c.dtype)
      out.append(jnp.broadcast_to(x, c.shape) if c.shape else x)
    return out


def load_rows(view, start, length: int, masked: bool = True, valid=None, width: int | None = None):
  """``view[...]`` of a ``[block, ...]`` ref view whose first axis starts at row ``start`` of
  an axis of ``length`` rows. Rows at or past ``length`` read as zeros and are not touched in
  memory, so arrays need no padding to a multiple of the tile. ``masked=False`` (the caller
  knows the tile lies inside ``length``) or ``length`` a multiple of the block: a plain load
  (unless the block is longer than the axis: the loop body is traced even where it never runs).

  ``valid`` (traced; only where ``masked``): this batch element's length of the axis
  (:meth:`MaskRefs.valid`). Rows at or past it read as zeros too: they may hold anything (a KV
  cache's unwritten tail: NaN, inf), and a probability of zero does not cancel them in a
  product (``0 * nan`` is NaN).

  ``width``: the array's last axis when the view's is wider (a head_dim of 96 read as a
  128-column tile): columns at or past it read as zeros and are not touched either."""
  block = view.shape[0]
  rows = lambda: start + jax.lax.broadcasted_iota(jnp.int32, view.shape, 0)
  cols_ok = None
  if width is not None and width < view.shape[-1]:
    cols_ok = jax.lax.broadcasted_iota(jnp.int32, view.shape, view.ndim - 1) < width
  both = lambda ok: ok if cols_ok is None else ok & cols_ok
  if masked and valid is not None:
    ok = rows() < valid
    return plgpu.load(view, mask=both(ok if length % block == 0 else ok & (rows() < length)), other=0)
  if length % block == 0 or (not masked and length >= block):
    return view[...] if cols_ok is None else plgpu.load(view, mask=cols_ok, other=0)
  return plgpu.load(view, mask=both(rows() < length), other=0)


def store_rows(view, val, start, length: int, width: int | None = None):
  """``view[...] = val`` for the rows of ``view`` (see :func:`load_rows`) before ``length``
  and, with ``width`` (the array's last axis, where the view's is wider), the columns before
  ``width``."""
  cols_ok = None
  if width is not None and width < view.shape[-1]:
    cols_ok = jax.lax.broadcasted_iota(jnp.int32, view.shape, view.ndim - 1) < width
  if length % view.shape[0] == 0:
    if cols_ok is None:
      view[...] = val
    else:
      plgpu.store(view, val, mask=cols_ok)
    return
  rows_ok = start + jax.lax.broadcasted_iota(jnp.int32, view.shape, 0) < length
  plgpu.store(view, val, mask=rows_ok if cols_ok is None else rows_ok & cols_ok)


def padded_head_dim(d: int) -> int:
  """Head dim the kernels load: next power of two, at least 32."""
  return max(32, 1 << (d - 1).bit_length())


def _head_view(ref, idx: tuple, start):
  """``ref.at[*idx, cols]``: the tile of ``ref``'s last axis (a head_dim) at the kernels' width,
  :func:`padded_head_dim`. An array of another width (40, 96, 192) is read and written in place
  through a wider view, whose columns past the array are masked: padding it in XLA instead
  would copy all of it on every call, for a decoding step's long KV cache more bytes than the
  kernel itself reads. The column slice starts at a traced zero, ``start * 0`` (``start``: the
  tile's first row, a program or loop index): a static slice wider than the array is refused
  at trace time, a dynamic one is the masked load's (Triton folds the zero away), and
  ``pl.program_id`` is not available inside the tile loops in interpret mode."""
  d = ref.shape[-1]
  width = padded_head_dim(d)
  return ref.at[(*idx, slice(None) if width == d else pl.ds(start * 0, width))]


def load_head(ref, idx: tuple, start, length: int, masked: bool = True, valid=None):
  """:func:`load_rows` of the tile ``ref[*idx, :]`` (``idx``'s ``pl.ds``: its rows, from row
  ``start`` of ``length``) at the kernels' head_dim width (:func:`_head_view`): columns past
  ``ref``'s head_dim read as zeros and are not touched in memory."""
  return load_rows(_head_view(ref, idx, start), start, length, masked, valid, width=ref.shape[-1])


def store_head(ref, idx: tuple, val, start, length: int):
  """:func:`store_rows` of ``val`` into the tile ``ref[*idx, :]`` (see :func:`load_head`): its
  columns past ``ref``'s head_dim are not written."""
  store_rows(_head_view(ref, idx, start), val, start, length, width=ref.shape[-1])


def mask_operands(mask: Mask | None, batch: int, q_len: int, kv_len: int, q_pad: int,
                  kv_pad: int, block_q: int, block_k: int, *, by_q: bool):
  """The static :class:`TileMask` and the array operands of one kernel.

  ``by_q``: the kernel loops over key tiles per query tile (forward, dQ); else
  over query tiles per key tile (dK/dV). Per outer tile the loop runs over
  ``[lo, hi)`` (:meth:`Mask.kv_range` / :meth:`Mask.q_range` of the band), and
  ``[full_lo, full_hi)`` are the tiles the band and the true lengths fill
  completely (:meth:`Mask.classify_tiles` of the band), which skip the element
  predicate. Per-batch lengths narrow both ranges in-kernel. With segment ids
  the ranges are per batch element, from the classes of the whole mask
  (:func:`~probjax.ops.attention.masks.ranges_from_classes`): no per-tile branch in the loop, which would
  keep Triton from pipelining it.
  """
  m = mask if mask is not None else Mask()
  why = m.refusal(TRITON_MASK_KINDS, "the Triton kernel") or mask_function_reason(m)
  if why:
    raise ValueError(why)
  arrays = m.operands(batch, q_pad, kv_pad)
  tm = TileMask(m.band, q_len, kv_len,
                has_range=mask is not None,
                has_q_lengths="q_lengths" in arrays,
                has_kv_lengths="kv_lengths" in arrays,
                has_segments="segments" in arrays,
                fn=m.tile_function(*fn_index_shapes(block_q, block_k, by_q=by_q)))
  ops = []
  if tm.fn is not None:
    # The tiles a mask_mod leaves EMPTY or FULL can lie anywhere (a global column and a
    # window): lists skip each EMPTY tile and run each FULL one without the function.
    with jax.ensure_compile_time_eval():  # constants of the program where the classes are
      classes = m.classify_tiles(batch, q_len, kv_len, block_q, block_k)
      ops.append(lists_from_classes(classes if by_q else jnp.swapaxes(classes, 1, 2)))
  elif tm.has_range:
    band = m.band
    # Query rows past q_len are zeros whose results are never stored: the last query tile
    # may count as FULL (classified at the whole tile). Not so for key rows past kv_len,
    # whose dQ contributions the onepass backward adds.
    q_cls = round_up(q_len, block_q) if by_q else q_len
    with jax.ensure_compile_time_eval():  # static: the band has no arrays
      full = np.asarray(band.classify_tiles(1, q_cls, kv_len, block_q, block_k)[0]) == FULL
    if not by_q:
      full = full.T
    rows = []
    for t, row in enumerate(full):
      if by_q:
        a, b = band.kv_range(t * block_q, min((t + 1) * block_q, q_len), kv_len)
        lo, hi = a // block_k, num_tiles(b, block_k)
      else:
        a, b = band.q_range(t * block_k, min((t + 1) * block_k, kv_len), q_len)
        lo, hi = a // block_q, num_tiles(b, block_q)
      idx = np.flatnonzero(row)
      flo, fhi = (int(idx[0]), int(idx[-1]) + 1) if idx.size else (hi, hi)
      rows.append((lo, hi, flo, fhi))
    band_range = np.array(rows, np.int32).T
    if tm.has_segments:
      classes = m.classify_tiles(batch, q_len, kv_len, block_q, block_k)
      ops.append(ranges_from_classes(classes if by_q else jnp.swapaxes(classes, 1, 2)))
    else:
      ops.append(jnp.asarray(band_range))
  for kind in ("q_lengths", "kv_lengths", "segments"):
    ops.extend(arrays.get(kind, ()))
  if tm.fn is not None:
    ops.extend(jnp.reshape(jnp.asarray(c, jnp.int32 if c.dtype == jnp.bool_ else c.dtype), (1,))
               for c in tm.fn.consts)
  return tm, ops


def fn_index_shapes(block_q: int, block_k: int, *, by_q: bool) -> tuple[tuple, tuple]:
  """The query and key index shapes of a kernel's tiles (:func:`tile_indices`): ``[block_q, 1]``
  and ``[1, block_k]`` for a loop over key tiles (``by_q``), transposed for the dK/dV kernels."""
  return ((block_q, 1), (1, block_k)) if by_q else ((1, block_q), (block_k, 1))


def mask_function_reason(mask: Mask | None) -> str | None:
  """Why the kernels cannot evaluate the mask's mask_mod (:meth:`Mask.tile_function`) in their
  body, or None (also without one): it does not trace on a tile, it closes over an array of more
  than one element (reading it per position is a gather), or it uses an operation Pallas Triton
  cannot lower. Checked before any kernel is traced, so the call is refused rather than failing
  to compile, or running a different computation."""
  if mask is None or "mask_mod" not in mask.kinds:
    return None
  try:
    fn = mask.tile_function(*fn_index_shapes(64, 128, by_q=True))
  except Exception as e:  # noqa: BLE001 -- any tracing failure means "not this kernel"
    return f"mask_mod not traceable on a tile of indices ({type(e).__name__}: {e})"
  for c in fn.consts:
    if math.prod(jnp.shape(c)) != 1:
      return (f"mask_mod closes over an array of shape {tuple(jnp.shape(c))}: the Triton kernel reads "
              "scalars from a mask_mod's closure, not arrays (indexing one per position is a gather, "
              "which Pallas Triton cannot lower); SegmentMask computes document ids in the kernel, or "
              "use implementation='xla'")
  from probjax.core import compat
  name = first_unlowerable(fn.jaxpr, compat.triton_lowering_rules())
  if name is not None:
    return f"mask_mod uses {name}, which Pallas Triton cannot lower (use implementation='xla')"
  return None


# -- in-kernel helpers ----------------------------------------------------------
def longest_first(tm: TileMask, tile, n_tiles: int, *, by_q: bool):
  """Program ``tile`` -> outer tile index such that the programs with the most inner tiles
  start first (a causal band gives the last query tiles the most keys); the wave that ends
  the kernel then holds short programs, not long ones."""
  grows = tm.band.work_grows(by_q=by_q)
  return n_tiles - 1 - tile if grows else tile


def program_tile(tm: TileMask, n_tiles: int, ny: int, nz: int, group: int, *, by_q: bool):
  """``(outer tile, y, z)`` of this program of a ``(n_tiles, ny, nz)`` grid: where the band
  makes the outer tiles' work grow (causal-like), heaviest first across groups of ``group``
  (y, z) pairs (:func:`~probjax.ops.attention.masks.heavy_first_program`); otherwise in grid
  order, one pair's tiles side by side."""
  x, y, z = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  if not tm.band.work_grows(by_q=by_q):
    return x, y, z
  return heavy_first_program(x, y, z, n_tiles, ny, nz, group)


def tile_loop(tm: TileMask, mr: MaskRefs, b, tile, n_static: int, body, carry, *, by_q: bool,
              block_outer: int, block_inner: int):
  """Runs ``carry = body(j, carry, masked)`` over the inner tiles of outer tile ``tile``.

  Three loops: masked tiles below the full range, the full range (no element
  predicate), masked tiles above it. Tiles outside ``[lo, hi)`` -- out of the
  band, past this batch element's lengths, or (with segment ids) before the
  first and after the last non-EMPTY tile -- are never loaded.

  With a mask_mod, two loops over this batch element's tile lists (the classes of the whole
  mask, lengths included): the PARTIAL tiles with the element predicate, the FULL ones without.
  """
  if mr.tile_range is None:
    return _unmasked_loop(tm, tile, n_static, body, carry, by_q=by_q, block_outer=block_outer,
                          block_inner=block_inner)
  if tm.fn is not None:
    lists = mr.tile_range
    for r, masked in ((0, True), (1, False)):
      step = lambda n, c, r=r, masked=masked: body(lists[b, tile, r, 1 + n], c, masked)
      carry = jax.lax.fori_loop(0, lists[b, tile, r, 0], step, carry)
    return carry
  if tm.has_segments:
    lo, hi, flo, fhi = (mr.tile_range[b, r, tile] for r in range(4))
  else:
    lo, hi, flo, fhi = (mr.tile_range[r, tile] for r in range(4))
  inner_len = mr.kv_lens if by_q else mr.q_lens
  outer_len = mr.q_lens if by_q else mr.kv_lens
  if inner_len is not None:
    hi = jnp.minimum(hi, (inner_len[b] + block_inner - 1) // block_inner)
    fhi = jnp.minimum(fhi, inner_len[b] // block_inner)
  if outer_len is not None:
    fhi = jnp.where((tile + 1) * block_outer <= outer_len[b], fhi, flo)
    hi = jnp.where(tile * block_outer < outer_len[b], hi, lo)
  b1 = jnp.clip(flo, lo, hi)
  b2 = jnp.clip(fhi, b1, hi)
  carry = jax.lax.fori_loop(lo, b1, lambda j, c: body(j, c, True), carry)
  carry = jax.lax.fori_loop(b1, b2, lambda j, c: body(j, c, False), carry)
  return jax.lax.fori_loop(b2, hi, lambda j, c: body(j, c, True), carry)


def _unmasked_loop(tm: TileMask, tile, n_static: int, body, carry, *, by_q: bool,
                   block_outer: int, block_inner: int):
  """:func:`tile_loop` without a mask: static bounds (which Triton pipelines best), the
  element predicate only on a partial last inner tile and, for the key tiles of the dK/dV
  kernels, on every tile of a partial outer key tile (its zero rows could otherwise reach
  the onepass dQ as ``inf * 0``)."""
  inner_len, outer_len = (tm.kv_len, tm.q_len) if by_q else (tm.q_len, tm.kv_len)
  n_full, n_all = inner_len // block_inner, min(n_static, num_tiles(inner_len, block_inner))
  unmasked = lambda j, c: body(j, c, False)
  masked = lambda j, c: body(j, c, True)
  if not by_q and outer_len % block_outer:
    n_free = n_full * ((tile + 1) * block_outer <= outer_len).astype(jnp.int32)  # no scalar select in Pallas-Triton
    carry = jax.lax.fori_loop(0, n_free, unmasked, carry)
    return jax.lax.fori_loop(n_free, n_all, masked, carry)
  carry = jax.lax.fori_loop(0, n_full, unmasked, carry)
  # A loop of one step, not a call: a traced index, as the partial tile overhangs the array.
  return jax.lax.fori_loop(n_full, n_all, masked, carry)


def exp2(x, fast: bool):
  """``2**x`` of a float32 tile; ``fast``: one ``ex2.approx.ftz.f32`` per element (GPU only)."""
  if not fast:
    return jnp.exp2(x)
  [y] = plgpu.elementwise_inline_asm("ex2.approx.ftz.f32 $0, $1;", args=[x], constraints="=f,f",
                                     pack=1, result_shape_dtypes=[jax.ShapeDtypeStruct(x.shape, x.dtype)])
  return y


def exp2_affine(t, c: float, shift, fast: bool):
  """``2**(t * c - shift)`` of a float32 tile ``t``, ``shift`` broadcasting against it (a row or
  column of offsets). ``fast``: one ``fma.rn.f32`` and one ``ex2.approx.ftz.f32`` per element,
  written out because XLA's Triton leaves the multiply and the subtraction apart (its LLVM
  IR of the forward has an ``fmul`` and an ``fsub`` per exponent, torch flex's PTX one ``fma``)."""
  if not fast:
    return jnp.exp2(t * c - shift)
  full = lambda x: jnp.broadcast_to(jnp.asarray(x, t.dtype), t.shape)
  [y] = plgpu.elementwise_inline_asm("fma.rn.f32 $0, $1, $2, $3;\n\tex2.approx.ftz.f32 $0, $0;",
                                     args=[t, full(c), full(-shift)], constraints="=f,f,f,f", pack=1,
                                     result_shape_dtypes=[jax.ShapeDtypeStruct(t.shape, t.dtype)])
  return y


def tile_indices(q_start, k_start, block_q: int, block_k: int, *, transposed: bool = False):
  """Query and key positions of a tile, ``[block_q, 1]`` and ``[1, block_k]``
  (``transposed``: ``[1, block_q]`` and ``[block_k, 1]``, for ``[block_k, block_q]`` tiles)."""
  qa, ka = (1, 0) if transposed else (0, 1)
  qshape = (1, block_q) if transposed else (block_q, 1)
  kshape = (block_k, 1) if transposed else (1, block_k)
  qi = q_start + jax.lax.broadcasted_iota(jnp.int32, qshape, qa)
  ki = k_start + jax.lax.broadcasted_iota(jnp.int32, kshape, ka)
  return qi, ki


def tile_valid(tm: TileMask, mr: MaskRefs, b, q_start, k_start, block_q: int, block_k: int, *,
               transposed: bool = False, h=None):
  """Boolean element predicate of one PARTIAL tile: ``[block_q, block_k]``, or
  ``[block_k, block_q]`` when ``transposed`` (``h``: the query head, which a mask_mod reads)."""
  qi, ki = tile_indices(q_start, k_start, block_q, block_k, transposed=transposed)
  qs = ks = None
  if mr.q_seg is not None:
    qs = mr.q_seg.at[b, pl.ds(q_start, block_q)][...]
    ks = mr.kv_seg.at[b, pl.ds(k_start, block_k)][...]
    qs, ks = (qs[None, :], ks[:, None]) if transposed else (qs[:, None], ks[None, :])
  return valid(tm, mr, b, qi, ki, qs, ks, h=h)


def unseen_keys_zeroed(tm: TileMask, ok, *xs, transposed: bool = False):
  """``xs`` (key-row tiles ``[block_k, ...]``) with the rows that no query of the tile may see
  (``ok``: :func:`tile_valid`) zeroed, under a mask_mod: they may hold anything (NaN, inf), and
  a probability of zero does not cancel them in a product (``0 * nan`` is NaN). The other
  predicates exclude such rows before they are loaded (:func:`load_rows`); a mask_mod's are
  known only from its values on the tile."""
  if tm.fn is None:
    return xs
  seen = jnp.max(ok.astype(jnp.int32), axis=1 if transposed else 0) > 0  # [block_k]
  return tuple(jnp.where(seen[:, None], x, jnp.zeros_like(x)) for x in xs)


def valid(tm: TileMask, mr: MaskRefs, b, qi, ki, qs=None, ks=None, *, h=None):
  """The mask predicate on broadcastable query/key positions ``qi``/``ki`` of batch
  element ``b`` (``qs``/``ks``: their segment ids, when the mask has them; ``h``: the query
  head, for a mask_mod, traced on exactly these index shapes)."""
  ok = tm.band.element(qi, ki) & (qi < tm.q_len) & (ki < tm.kv_len)
  if mr.q_lens is not None:
    ok &= qi < mr.q_lens[b]
  if mr.kv_lens is not None:
    ok &= ki < mr.kv_lens[b]
  if qs is not None:
    ok &= qs == ks
  if tm.fn is not None:
    ok &= tm.fn(mr.fn_args(tm), b, h, qi, ki)
  return ok


def scores(q, k, *, scale: float, score_mod: Callable | None, b, h, q_start, k_start,
           transposed: bool = False):
  """Scores of one tile, ``[block_q, block_k]`` (``transposed``: ``k @ q^T``, ``[block_k, block_q]``).

  Returns ``(t, c, s_nat)``: the base-2 score ``log2(e) * score_mod(scale * q @ k^T)`` is
  ``t * c`` (without ``score_mod``, ``t`` is the raw product and ``c = scale * log2(e)``, so
  callers fold the scale into the exponent's fused multiply-add); ``s_nat`` (the
  pre-``score_mod`` scaled score) is only needed for the backward of ``score_mod`` (None
  without one).
  """
  a, b2 = (k, q) if transposed else (q, k)
  qk = jax.lax.dot_general(a, b2, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
  if score_mod is None:  # c > 0, so that masking t with -inf and max(t) * c stay valid
    if scale == 0:
      return qk * 0.0, 1.0, None
    return (qk, scale * LOG2E, None) if scale > 0 else (-qk, -scale * LOG2E, None)
  s_nat = qk * scale
  idx = tile_indices(q_start, k_start, q.shape[0], k.shape[0], transposed=transposed)
  return score_mod(s_nat, b, h, *idx), LOG2E, s_nat


def online_softmax_init(rows: int, d: int):
  """The carry of :func:`online_softmax_step` before the first key tile."""
  return (jnp.zeros((rows, d), jnp.float32), jnp.full((rows,), -jnp.inf, jnp.float32),
          jnp.zeros((rows,), jnp.float32))


def online_softmax_finish(carry):
  """``(out [rows, d], lse2 [rows], empty [rows])``: the normalised output (0 in rows that saw
  no valid key, ``empty``) and the base-2 log-sum-exp (meaningless where ``empty``)."""
  acc, m, l = carry
  empty = l == 0.0
  l = jnp.where(empty, 1.0, l)
  return acc / l[:, None], m + jnp.log2(l), empty


def online_softmax_step(carry, t, c: float, v, fast_exp2: bool):
  """One key tile of the online softmax: ``carry = (acc [rows, d], m [rows], l [rows])``
  with ``m`` the running max of the base-2 scores ``t * c`` (-inf where a row has seen no
  valid key: masked entries of ``t`` are -inf)."""
  acc, m, l = carry
  m_new = jnp.maximum(m, jnp.max(t, axis=1) * c)
  m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
  alpha = exp2(m - m_safe, fast_exp2)
  p = exp2_affine(t, c, m_safe[:, None], fast_exp2)
  l = l * alpha + jnp.sum(p, axis=1)
  acc = acc * alpha[:, None] + jax.lax.dot_general(
      p.astype(v.dtype), v, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)
  return acc, m_new, l


def score_mod_grad(score_mod: Callable, s_nat, ds, *, b, h, q_start, k_start,
                   transposed: bool = False):
  """``ds`` (w.r.t. the modified score) pulled back through ``score_mod``."""
  bq, bk = s_nat.shape[::-1] if transposed else s_nat.shape
  qi, ki = tile_indices(q_start, k_start, bq, bk, transposed=transposed)
  _, vjp = jax.vjp(lambda s: score_mod(s, b, h, qi, ki), s_nat)
  return vjp(ds)[0]
