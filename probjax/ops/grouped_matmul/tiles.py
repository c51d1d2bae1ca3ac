"""Row tiles of the ragged axis, computed in XLA from the group sizes and read by the kernels
of every backend as scalars."""

from __future__ import annotations

import jax.numpy as jnp


def num_row_tiles(m: int, block_m: int, num_groups: int) -> int:
  """Entries of :func:`tile_table`: a group touches every block its rows meet, so the groups
  (and the rows past them) cover at most ``ceil(m / block_m)`` blocks plus one more per
  boundary between them."""
  return -(-m // block_m) + num_groups


def tile_table(group_sizes, m: int, block_m: int):
  """``[4, num_row_tiles]`` int32: per row tile its group (``G`` for the rows past the
  groups), first row (a multiple of ``block_m``) and its group's rows ``[lo, hi)`` in the tile;
  unused entries, at the end, have ``lo == hi``. A block on a boundary between groups appears
  once per group."""
  g = group_sizes.shape[0]
  sizes = jnp.concatenate([group_sizes, (m - jnp.sum(group_sizes))[None]]).astype(jnp.int32)
  ends = jnp.cumsum(sizes)
  starts = ends - sizes
  first = starts // block_m
  tiles = jnp.where(sizes > 0, (ends + block_m - 1) // block_m - first, 0)
  tiles_end = jnp.cumsum(tiles)
  t = jnp.arange(num_row_tiles(m, block_m, g), dtype=jnp.int32)
  grp = jnp.minimum(jnp.searchsorted(tiles_end, t, side="right"), g + 1).astype(jnp.int32)
  used = grp <= g
  grp = jnp.minimum(grp, g)
  row0 = (first[grp] + t - (tiles_end - tiles)[grp]) * block_m
  lo = jnp.where(used, jnp.maximum(starts[grp], row0), 0)
  hi = jnp.where(used, jnp.minimum(ends[grp], row0 + block_m), 0)
  return jnp.stack([grp, jnp.where(used, row0, 0), lo, hi])


def group_bounds(group_sizes):
  """``[2, G]`` int32: each group's first row and the row after its last."""
  ends = jnp.cumsum(group_sizes.astype(jnp.int32))
  return jnp.stack([ends - group_sizes.astype(jnp.int32), ends])
