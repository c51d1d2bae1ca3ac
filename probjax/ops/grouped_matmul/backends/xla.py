"""XLA: the grouped products as a loop over row tiles, each multiplied by its own group's matrix.

The rows are cut into the tiles of :func:`~probjax.ops.grouped_matmul.tiles.tile_table` (a tile
on a boundary between groups is visited once per group), so the work is about ``m * k * n``
plus one tile per group, where ``jax.lax.ragged_dot`` off the GPU multiplies every row by every
group's matrix (``num_groups`` times the work) and sums masked products. That sum is also why
it is not used here: a masked product ``0 * inf`` is NaN, so one non-finite weight in a group
(even an empty one, whose weights are never read) would turn every output row NaN. Here a row
only ever meets its own group's matrix, and rows are kept or dropped by selection, never by
multiplying with zero.

Every product accumulates in float32 (float64 for float64 operands) and rounds once to the
output dtype, as the kernels do.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from probjax.core.device import Device
from probjax.ops.grouped_matmul.base import GroupedMatmulBackend
from probjax.ops.grouped_matmul.call import GroupedMatmulCall
from probjax.ops.grouped_matmul.tiles import num_row_tiles, tile_table


def _acc(dtype):
  return jnp.float64 if np.dtype(dtype) == np.float64 else jnp.float32


def block_rows(m: int, num_groups: int) -> int:
  """Rows per tile: about ``m / num_groups`` (a power of two in ``[8, 256]``), so the extra
  work of the tiles a group only partly fills (one tile per group) stays near one pass over
  the rows. E.g. 4096 rows over 64 groups: 64-row tiles, 128 loop steps, at most 2x the
  ideal work; 100 rows over 2 groups: 32-row tiles."""
  per_group = max(1, m // max(1, num_groups))
  return int(min(256, max(8, 1 << (per_group.bit_length() - 1))))


def _tiles(group_sizes, m: int, block: int):
  """The tile table and the rows padded to whole tiles (``ceil(m / block) * block``)."""
  return tile_table(group_sizes, m, block), -(-m // block) * block


def _pad_rows(x, rows: int):
  return jnp.pad(x, ((0, rows - x.shape[0]), (0, 0)))


class XlaBackend(GroupedMatmulBackend):
  name = "xla"

  def supports(self, call: GroupedMatmulCall, device: Device) -> str | None:
    return None

  def gmm(self, lhs, rhs, group_sizes, *, call: GroupedMatmulCall):
    m, g = call.m, call.num_groups
    block = block_rows(m, g)
    table, rows = _tiles(group_sizes, m, block)
    lhs = _pad_rows(lhs, rows)
    contract = ((1,), (1,)) if call.transpose_rhs else ((1,), (0,))
    row_ids = jnp.arange(block)

    def step(t, out):
      grp, row0, lo, hi = table[0, t], table[1, t], table[2, t], table[3, t]

      def run(out):
        tile = jax.lax.dynamic_slice_in_dim(lhs, row0, block)
        w = jax.lax.dynamic_index_in_dim(rhs, jnp.minimum(grp, g - 1), keepdims=False)
        prod = jax.lax.dot_general(tile, w, (contract, ((), ())), preferred_element_type=_acc(call.out_dtype))
        keep = ((row_ids + row0 >= lo) & (row_ids + row0 < hi))[:, None]
        old = jax.lax.dynamic_slice_in_dim(out, row0, block)
        return jax.lax.dynamic_update_slice_in_dim(out, jnp.where(keep, prod, old), row0, 0)

      # Rows past the groups (``grp == g``) and unused entries keep the zeros they start with.
      return jax.lax.cond((grp < g) & (lo < hi), run, lambda out: out, out)

    out = jnp.zeros((rows, call.n), _acc(call.out_dtype))
    out = jax.lax.fori_loop(0, num_row_tiles(m, block, g), step, out)
    return out[:m].astype(call.out_dtype)

  def tgmm(self, a, b, group_sizes, *, call: GroupedMatmulCall):
    m, g = call.m, call.num_groups
    block = block_rows(m, g)
    table, rows = _tiles(group_sizes, m, block)
    a, b = _pad_rows(a, rows), _pad_rows(b, rows)
    row_ids = jnp.arange(block)

    def step(t, out):
      grp, row0, lo, hi = table[0, t], table[1, t], table[2, t], table[3, t]

      def run(out):
        keep = ((row_ids + row0 >= lo) & (row_ids + row0 < hi))[:, None]
        ta = jnp.where(keep, jax.lax.dynamic_slice_in_dim(a, row0, block), 0)
        tb = jnp.where(keep, jax.lax.dynamic_slice_in_dim(b, row0, block), 0)
        part = jax.lax.dot_general(ta, tb, (((0,), (0,)), ((), ())), preferred_element_type=_acc(call.dtype))
        return out.at[grp].add(part)

      return jax.lax.cond((grp < g) & (lo < hi), run, lambda out: out, out)

    out = jnp.zeros((g, a.shape[1], b.shape[1]), _acc(call.dtype))
    out = jax.lax.fori_loop(0, num_row_tiles(m, block, g), step, out)
    return out.astype(call.dtype)
