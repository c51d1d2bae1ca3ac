"""Pallas-Triton grouped matmuls: ``gmm`` (ragged rows) and ``tgmm`` (ragged contraction).

``gmm`` runs one program per (row tile, column tile). Row tiles come from a table computed
from the group sizes (:func:`~probjax.ops.grouped_matmul.tiles.tile_table`): each group covers the ``block_m``-aligned row blocks
it touches, so a block on a group boundary is visited once per group, each visit storing only
its group's rows, and every tile multiplies by one group's matrix. Rows past the groups form a
last pseudo-group whose tiles store zeros. No operand is padded or copied: partial row,
column and contraction tiles are loaded and stored with masks, and a contraction of any
length runs ``ceil(k / block_k)`` masked steps.

``tgmm`` runs one program per (group, lhs-column tile, rhs-column tile), looping over the
group's rows in steps of ``block_m`` from the group's first row; an empty group runs no step
and stores zeros.

Both take the fused MoE dispatch's options (static flags): rows of ``lhs`` (and, for
``tgmm``, of ``b``) read through an index vector, ``b``'s rows scaled, and ``gmm``'s output
rows scattered with a per-row weight, added atomically into a zeroed float32 buffer.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from probjax.ops.grouped_matmul.backends.triton.config import TileConfig
from probjax.ops.grouped_matmul.tiles import group_bounds, tile_table


# dot_general dimension numbers: a @ b, a @ b^T, a^T @ b.
_NN = (((1,), (0,)), ((), ()))
_NT = (((1,), (1,)), ((), ()))
_TN = (((0,), (0,)), ((), ()))


def _dot(a, b, dims):
  return jax.lax.dot_general(a, b.astype(a.dtype), dims, preferred_element_type=jnp.float32)


def _iota(n):
  return jax.lax.broadcasted_iota(jnp.int32, (n,), 0)


def _load(view, mask):
  return view[...] if mask is None else plgpu.load(view, mask=mask, other=0)


def _and(*masks):
  masks = [m for m in masks if m is not None]
  return functools.reduce(jnp.logical_and, masks) if masks else None


def _gmm_kernel(tbl_ref, lhs_ref, rhs_ref, *refs, cfg: TileConfig, k: int, n: int, groups: int,
                transpose_rhs: bool, gather: bool, scatter: bool, interpret: bool):
  refs = list(refs)
  lhs_rows_ref = refs.pop(0) if gather else None
  dst_ref, scale_ref = (refs.pop(0), refs.pop(0)) if scatter else (None, None)
  out_ref, = refs[-1:]
  bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
  i, j = pl.program_id(0), pl.program_id(1)
  g, row0, lo, hi = tbl_ref[0, i], tbl_ref[1, i], tbl_ref[2, i], tbl_ref[3, i]
  rows = row0 + _iota(bm)
  row_ok = (rows >= lo) & (rows < hi)
  cols = j * bn + _iota(bn)
  col_ok = cols < n if n % bn else None
  gw = jnp.minimum(g, groups - 1)  # the zero pseudo-group runs no step; any valid index
  # An int32 product, not jnp.where(live, steps, 0): Pallas Triton lowers the literals 1 and 0
  # of that select as the booleans true and false (they compare equal), and the loop bound
  # then has the wrong type whenever k fits one block.
  steps = ((g < groups) & (hi > lo)).astype(jnp.int32) * pl.cdiv(k, bk)
  src = plgpu.load(lhs_rows_ref.at[pl.ds(row0, bm)], mask=row_ok, other=0) if gather else None

  def step(s, acc):
    ks = s * bk + _iota(bk)
    k_ok = ks < k if k % bk else None
    a_mask = _and(row_ok[:, None], None if k_ok is None else k_ok[None, :])
    if gather:
      a = plgpu.load(lhs_ref.at[src[:, None], ks[None, :]], mask=a_mask, other=0)
    else:
      a = plgpu.load(lhs_ref.at[pl.ds(row0, bm), pl.ds(s * bk, bk)], mask=a_mask, other=0)
    if transpose_rhs:
      b_mask = _and(None if col_ok is None else col_ok[:, None], None if k_ok is None else k_ok[None, :])
      b = _load(rhs_ref.at[gw, pl.ds(j * bn, bn), pl.ds(s * bk, bk)], b_mask)
      return acc + _dot(a, b, _NT)
    b_mask = _and(None if k_ok is None else k_ok[:, None], None if col_ok is None else col_ok[None, :])
    b = _load(rhs_ref.at[gw, pl.ds(s * bk, bk), pl.ds(j * bn, bn)], b_mask)
    return acc + _dot(a, b, _NN)

  acc = jax.lax.fori_loop(0, steps, step, jnp.zeros((bm, bn), jnp.float32))
  if not scatter:
    out_mask = _and(row_ok[:, None], None if col_ok is None else col_ok[None, :])
    plgpu.store(out_ref.at[pl.ds(row0, bm), pl.ds(j * bn, bn)], acc.astype(out_ref.dtype), mask=out_mask)
    return
  # Weighted scatter-add into the float32 buffer, which has a dummy last row and whole column
  # tiles: the rows outside this tile's group add zero there, so every index is in bounds
  # (interpret mode's atomics take no mask; on the GPU the mask skips them).
  dummy = out_ref.shape[0] - 1
  row_ok = row_ok & (g < groups)
  dst = jnp.where(row_ok, plgpu.load(dst_ref.at[pl.ds(row0, bm)], mask=row_ok, other=0), dummy)
  w = plgpu.load(scale_ref.at[pl.ds(row0, bm)], mask=row_ok, other=0).astype(jnp.float32)
  val = jnp.where(row_ok[:, None], acc * w[:, None], 0.0)
  # Triton's atomic takes a mask of the value's shape (no broadcasting of a [bm, 1] row mask).
  mask = None if interpret else jnp.broadcast_to(
      _and(row_ok[:, None], None if col_ok is None else col_ok[None, :]), val.shape)
  plgpu.atomic_add(out_ref, (dst[:, None], cols[None, :]), val, mask=mask)


def gmm(lhs, rhs, group_sizes, *, cfg: TileConfig, out_dtype, transpose_rhs: bool = False,
        interpret: bool = False, lhs_rows=None, rows: int | None = None, scatter_rows=None,
        scatter_scale=None, scatter_len: int | None = None):
  """``[rows, n]``: row ``r`` of group ``g`` is ``lhs[r] @ rhs[g]`` (``lhs[lhs_rows[r]]`` with
  an index vector of ``rows`` entries), rows past the groups zero.

  With ``scatter_rows`` (int32 ``[rows]``) and ``scatter_scale`` (``[rows]``) the result is
  instead ``[scatter_len, n]`` float32: the sum over grouped rows ``r`` of
  ``scatter_scale[r] * (lhs @ rhs[g])[r]`` added into row ``scatter_rows[r]`` (rows past the
  groups add nothing)."""
  gather, scatter = lhs_rows is not None, scatter_rows is not None
  m = rows if gather else lhs.shape[0]
  groups = rhs.shape[0]
  n, k = (rhs.shape[1], rhs.shape[2]) if transpose_rhs else (rhs.shape[2], rhs.shape[1])
  bm, bn = cfg.block_m, cfg.block_n
  tbl = tile_table(group_sizes, m, bm)
  grid = (tbl.shape[1], pl.cdiv(n, bn))
  operands = [tbl, lhs, rhs] + ([lhs_rows.astype(jnp.int32)] if gather else [])
  aliases = {}
  if scatter:
    operands += [scatter_rows.astype(jnp.int32), scatter_scale]
    aliases = {len(operands): 0}
    operands.append(jnp.zeros((scatter_len + 1, grid[1] * bn), jnp.float32))
    out_shape = jax.ShapeDtypeStruct(operands[-1].shape, jnp.float32)
  else:
    out_shape = jax.ShapeDtypeStruct((m, n), out_dtype)
  kernel = functools.partial(_gmm_kernel, cfg=cfg, k=k, n=n, groups=groups, transpose_rhs=transpose_rhs,
                             gather=gather, scatter=scatter, interpret=interpret)
  out = pl.pallas_call(
      kernel, grid=grid, out_shape=out_shape, input_output_aliases=aliases,
      compiler_params=plgpu.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
      interpret=interpret, name="probjax_gmm_scatter" if scatter else "probjax_gmm",
  )(*operands)
  return out[:scatter_len, :n] if scatter else out


def _tgmm_kernel(bounds_ref, a_ref, b_ref, *refs, cfg: TileConfig, p: int, q: int, gather_a: bool,
                 gather_b: bool, scale_b: bool):
  refs = list(refs)
  a_rows_ref = refs.pop(0) if gather_a else None
  b_rows_ref = refs.pop(0) if gather_b else None
  b_scale_ref = refs.pop(0) if scale_b else None
  out_ref, = refs
  bm, bp, bq = cfg.block_m, cfg.block_k, cfg.block_n
  g, pi, qi = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  start, end = bounds_ref[0, g], bounds_ref[1, g]
  ps, qs = pi * bp + _iota(bp), qi * bq + _iota(bq)
  p_ok = ps < p if p % bp else None
  q_ok = qs < q if q % bq else None

  def step(s, acc):
    r0 = start + s * bm
    rows = r0 + _iota(bm)
    ok = rows < end
    a_mask = _and(ok[:, None], None if p_ok is None else p_ok[None, :])
    b_mask = _and(ok[:, None], None if q_ok is None else q_ok[None, :])
    if gather_a:
      src = plgpu.load(a_rows_ref.at[pl.ds(r0, bm)], mask=ok, other=0)
      a = plgpu.load(a_ref.at[src[:, None], ps[None, :]], mask=a_mask, other=0)
    else:
      a = plgpu.load(a_ref.at[pl.ds(r0, bm), pl.ds(pi * bp, bp)], mask=a_mask, other=0)
    if gather_b:
      src = plgpu.load(b_rows_ref.at[pl.ds(r0, bm)], mask=ok, other=0)
      b = plgpu.load(b_ref.at[src[:, None], qs[None, :]], mask=b_mask, other=0)
    else:
      b = plgpu.load(b_ref.at[pl.ds(r0, bm), pl.ds(qi * bq, bq)], mask=b_mask, other=0)
    if scale_b:
      w = plgpu.load(b_scale_ref.at[pl.ds(r0, bm)], mask=ok, other=0)
      b = (b.astype(jnp.float32) * w.astype(jnp.float32)[:, None])
    return acc + _dot(a, b, _TN)

  steps = pl.cdiv(end - start, bm)
  acc = jax.lax.fori_loop(0, steps, step, jnp.zeros((bp, bq), jnp.float32))
  out_mask = _and(None if p_ok is None else p_ok[:, None], None if q_ok is None else q_ok[None, :])
  plgpu.store(out_ref.at[g, pl.ds(pi * bp, bp), pl.ds(qi * bq, bq)], acc.astype(out_ref.dtype), mask=out_mask)


def tgmm(a, b, group_sizes, *, cfg: TileConfig, out_dtype, interpret: bool = False, a_rows=None,
         b_rows=None, b_scale=None):
  """``[G, p, q]``: ``a[rows of g]^T @ b[rows of g]`` per group for ``a [m, p]``, ``b [m, q]``
  (or the rows of ``a`` / ``b`` read through the int32 index vectors ``a_rows`` / ``b_rows``
  of the grouped rows, and ``b``'s rows multiplied by ``b_scale`` first); zeros for an empty
  group. ``cfg.block_k`` tiles ``p``, ``cfg.block_n`` tiles ``q``, ``cfg.block_m`` rows are
  contracted per step."""
  groups = group_sizes.shape[0]
  p, q = a.shape[1], b.shape[1]
  bounds = group_bounds(group_sizes)
  extra = [x.astype(jnp.int32) for x in (a_rows, b_rows) if x is not None]
  extra += [b_scale] if b_scale is not None else []
  kernel = functools.partial(_tgmm_kernel, cfg=cfg, p=p, q=q, gather_a=a_rows is not None,
                             gather_b=b_rows is not None, scale_b=b_scale is not None)
  return pl.pallas_call(
      kernel, grid=(groups, pl.cdiv(p, cfg.block_k), pl.cdiv(q, cfg.block_n)),
      out_shape=jax.ShapeDtypeStruct((groups, p, q), out_dtype),
      compiler_params=plgpu.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
      interpret=interpret, name="probjax_tgmm",
  )(bounds, a, b, *extra)
