"""Pallas Mosaic GPU grouped matmuls for sm_90: TMA loads into a pipeline of shared-memory
slots, wgmma on 16-bit operands, persistent CTAs (one per SM) looping over the output tiles.

``gmm``: the output tiles are (row tile, column tile) pairs over the same row-tile table as
the Triton kernel (:func:`~probjax.ops.grouped_matmul.tiles.tile_table`): each row tile
belongs to one group, rows past the groups form a pseudo-group that stores zeros. rhs is
read in either layout (``transpose_rhs``: the ``[n, k]`` tiles are fed to wgmma transposed),
so ``d_lhs`` needs no transposed copy of the weights. Operands are not padded to whole tiles:
TMA fills the tiles past an array's end with zeros (rows, contraction) and drops stores past
its end (columns); the rows of a tile that belong to its group are stored through a ladder of
power-of-two TMA windows, as in JAX's ``ragged_dot_mgpu``.

``tgmm``: one output tile per (group, lhs-column tile, rhs-column tile); the group's row
blocks stream through the pipeline and the rows of its first and last block that belong to
neighbouring groups are zeroed in shared memory before the wgmma, as in JAX's
``transposed_ragged_dot_mgpu``. An empty group runs no step and stores zeros.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from probjax.ops.grouped_matmul.tiles import group_bounds, tile_table


@dataclasses.dataclass(frozen=True)
class MosaicConfig:
  """Tiles: ``block_m`` rows (64 or 128: wgmma's row granule per warpgroup), ``block_n``
  output columns, ``block_k`` contracted per pipeline step; ``stages`` shared-memory slots;
  ``grid_block_n`` column tiles visited together in the snake order of the persistent loop
  (reuse of an lhs row tile from L2)."""

  block_m: int = 128
  block_n: int = 128
  block_k: int = 64
  stages: int = 4
  grid_block_n: int = 1


def _params(interpret: bool):
  return plgpu.InterpretGPUParams() if interpret else False


def _compiler_params():
  return plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup)


def _store_rows(o_smem, o_gmem, start, size, row0, col0, block_rows: int):
  """TMA-stores rows ``[start, start + size)`` of ``o_smem`` to rows ``row0 + start ...`` of
  ``o_gmem`` (from column ``col0``): a TMA window has a static height, so the rows go out as
  the binary digits of ``size``, one window of each power of two that ``size`` contains."""
  h = 1 << int(math.log2(block_rows))
  while h:
    @pl.when(size & h != 0)
    def _():
      plgpu.copy_smem_to_gmem(o_smem.at[pl.ds(start, h)],
                              o_gmem.at[pl.ds(row0 + start, h), pl.ds(col0, o_smem.shape[1])])
    start += size & h
    h //= 2
  plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def gmm(lhs, rhs, group_sizes, *, cfg: MosaicConfig, out_dtype, transpose_rhs: bool, num_sms: int,
        interpret: bool = False):
  """``[m, n]``: ``lhs[r] @ rhs[g]`` for the rows ``r`` of group ``g`` (rhs ``[G, k, n]``, or
  ``[G, n, k]`` read transposed), zero rows past the groups. Needs ``m >= block_m``,
  ``k >= block_k`` and ``n >= block_n`` (a TMA window cannot exceed its array)."""
  m, k = lhs.shape
  groups = rhs.shape[0]
  n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
  bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
  tbl = tile_table(group_sizes, m, bm)
  row_tiles, col_tiles, steps = tbl.shape[1], pl.cdiv(n, bn), pl.cdiv(k, bk)

  def body(tbl_gmem, lhs_gmem, rhs_gmem, o_gmem):
    @plgpu.nd_loop((row_tiles * col_tiles,), collective_axes="sm")
    def _(info: plgpu.NDLoopInfo):
      ti, ni = plgpu.planar_snake(info.index[0], (row_tiles, col_tiles), 1, cfg.grid_block_n)
      g, row0, lo, hi = tbl_gmem[0, ti], tbl_gmem[1, ti], tbl_gmem[2, ti], tbl_gmem[3, ti]

      @pl.when(hi > lo)
      def _():
        def acc_scope(acc_ref):
          @pl.when(g < groups)  # the pseudo-group past the groups stores the zero accumulator
          def _():
            plgpu.emit_pipeline(
                lambda _, a, b: plgpu.wgmma(acc_ref, a, b.transpose((1, 0)) if transpose_rhs else b),
                grid=(steps,),
                in_specs=[
                    plgpu.BlockSpec((bm, bk), lambda s: (row0 // bm, s), delay_release=1),
                    plgpu.BlockSpec((bn, bk) if transpose_rhs else (bk, bn),
                                    (lambda s: (ni, s)) if transpose_rhs else (lambda s: (s, ni)),
                                    delay_release=1),
                ],
                max_concurrent_steps=cfg.stages,
            )(lhs_gmem, rhs_gmem.at[jnp.minimum(g, groups - 1)])
          return acc_ref[...]

        acc = pl.run_scoped(acc_scope, plgpu.ACC((bm, bn)))

        @functools.partial(pl.run_scoped, o_smem=plgpu.SMEM((bm, bn), dtype=o_gmem.dtype))
        def _(o_smem):
          o_smem[...] = acc.astype(o_smem.dtype)
          plgpu.commit_smem()
          _store_rows(o_smem, o_gmem, lo - row0, hi - lo, row0, ni * bn, bm)

  kernel = plgpu.kernel(
      body, out_type=jax.ShapeDtypeStruct((m, n), out_dtype), grid=(num_sms,), grid_names=("sm",),
      compiler_params=_compiler_params(), interpret=_params(interpret), kernel_name="probjax_gmm_mosaic")
  return kernel(tbl, lhs, rhs)


def _zero_rows_outside(smem, lo, hi):
  """Zeroes the rows of a ``[rows, cols]`` shared-memory tile outside ``[lo, hi)``."""
  rows = plgpu.layout_cast(jax.lax.broadcasted_iota(jnp.int32, smem.shape, 0), plgpu.Layout.WGMMA)
  smem[...] = jnp.where((rows >= lo) & (rows < hi), smem[...], jnp.zeros((), smem.dtype))
  plgpu.commit_smem()


def tgmm(a, b, group_sizes, *, cfg: MosaicConfig, out_dtype, num_sms: int, interpret: bool = False):
  """``[G, p, q]``: ``a[rows of g]^T @ b[rows of g]`` for ``a [m, p]``, ``b [m, q]``, zeros for
  an empty group. ``block_m`` tiles ``p`` (the wgmma rows), ``block_n`` tiles ``q`` and
  ``block_k`` rows are contracted per step; needs ``p >= block_m``, ``q >= block_n`` and
  ``m >= block_k``."""
  m, p = a.shape
  q = b.shape[1]
  groups = group_sizes.shape[0]
  bp, bq, br = cfg.block_m, cfg.block_n, cfg.block_k
  bounds = group_bounds(group_sizes)
  p_tiles, q_tiles = pl.cdiv(p, bp), pl.cdiv(q, bq)

  def body(bounds_gmem, a_gmem, b_gmem, o_gmem):
    @plgpu.nd_loop((groups, p_tiles * q_tiles), collective_axes="sm")
    def _(info: plgpu.NDLoopInfo):
      g = info.index[0]
      pi, qi = plgpu.planar_snake(info.index[1], (p_tiles, q_tiles), 1, cfg.grid_block_n)
      start, end = bounds_gmem[0, g], bounds_gmem[1, g]
      first = start // br
      blocks = (end + br - 1) // br - first

      def acc_scope(acc_ref):
        def step(idx, a_smem, b_smem):
          r0 = (first + idx[0]) * br

          @pl.when((r0 < start) | (r0 + br > end))  # a block shared with a neighbouring group
          def _():
            _zero_rows_outside(a_smem, start - r0, end - r0)
            _zero_rows_outside(b_smem, start - r0, end - r0)

          plgpu.wgmma(acc_ref, a_smem.transpose((1, 0)), b_smem)

        @pl.when(end > start)
        def _():
          plgpu.emit_pipeline(
              step, grid=(blocks,),
              in_specs=[plgpu.BlockSpec((br, bp), lambda r: (first + r, pi), delay_release=1),
                        plgpu.BlockSpec((br, bq), lambda r: (first + r, qi), delay_release=1)],
              max_concurrent_steps=cfg.stages,
          )(a_gmem, b_gmem)
        return acc_ref[...]

      acc = pl.run_scoped(acc_scope, plgpu.ACC((bp, bq)))

      @functools.partial(pl.run_scoped, o_smem=plgpu.SMEM((bp, bq), dtype=o_gmem.dtype))
      def _(o_smem):
        o_smem[...] = acc.astype(o_smem.dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem, o_gmem.at[g, pl.ds(pi * bp, bp), pl.ds(qi * bq, bq)])
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

  kernel = plgpu.kernel(
      body, out_type=jax.ShapeDtypeStruct((groups, p, q), out_dtype), grid=(num_sms,), grid_names=("sm",),
      compiler_params=_compiler_params(), interpret=_params(interpret), kernel_name="probjax_tgmm_mosaic")
  return kernel(bounds, a, b)
