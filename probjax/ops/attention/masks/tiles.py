"""Grid scheduling helpers of the tiled kernels: tile counts, padding, the inner tile ranges
from a mask's tile classes, and heaviest-first program orders. They are not mask logic; the
package re-exports them (``from probjax.ops.attention.masks import round_up``)."""

from __future__ import annotations

import math

import jax.numpy as jnp

from probjax.ops.attention.masks.base import EMPTY, FULL, PARTIAL


def ranges_from_classes(classes):
  """Per-batch inner tile ranges ``[batch, 4, n_outer]`` (lo, hi, full_lo, full_hi) from
  tile classes ``[batch, n_outer, n_inner]``.

  ``[lo, hi)`` spans every non-EMPTY tile (EMPTY ones inside it are computed with
  the element predicate, which is exact); ``[full_lo, full_hi)`` is the run of
  FULL tiles when they are contiguous (packed documents with sorted ids), else empty.
  """
  n = classes.shape[-1]
  first = lambda x: jnp.where(x.any(-1), jnp.argmax(x, -1), n)
  last = lambda x: jnp.where(x.any(-1), n - jnp.argmax(x[..., ::-1], -1), 0)
  live, full = classes != EMPTY, classes == FULL
  lo, hi = first(live), last(live)
  hi = jnp.maximum(lo, hi)
  flo, fhi = first(full), last(full)
  contiguous = full.sum(-1) == fhi - flo
  flo, fhi = jnp.where(contiguous, flo, lo), jnp.where(contiguous, fhi, lo)
  return jnp.stack([lo, hi, flo, fhi], axis=1).astype(jnp.int32)


def lists_from_classes(classes):
  """Per-batch inner tile lists ``[batch, n_outer, 2, 1 + n_inner]`` int32 from tile classes
  ``[batch, n_outer, n_inner]``: row 0 lists the PARTIAL tiles, row 1 the FULL ones, each as
  its count followed by the tiles' indices in increasing order (the rest padding). A loop over
  them skips every EMPTY tile and runs every FULL one without the element predicate, wherever
  they lie (flex_attention's block mask), with no per-tile branch."""
  rows = []
  for cls in (PARTIAL, FULL):
    sel = classes == cls
    order = jnp.argsort(~sel, axis=-1, stable=True)  # the selected tiles first, in order
    rows.append(jnp.concatenate([sel.sum(-1, keepdims=True), order], axis=-1))
  return jnp.stack(rows, axis=-2).astype(jnp.int32)


def num_tiles(n: int, block: int) -> int:
  return math.ceil(n / block)


def round_up(n: int, m: int) -> int:
  """``n`` rounded up to a multiple of ``m``."""
  return num_tiles(n, m) * m


def pad_axis(x, axis: int, size: int, value=0, *, broadcast: bool = False):
  """Pads ``x`` along ``axis`` to ``size`` with ``value`` (no-op when already there); with
  ``broadcast``, a size-1 (broadcast) axis stays as it is."""
  n = x.shape[axis]
  if n == size or (broadcast and n == 1):
    return x
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, size - n)
  return jnp.pad(x, widths, constant_values=value)


def heavy_first_program(x, y, z, n_tiles: int, ny: int, nz: int, group: int):
  """``(tile, y, z)`` of the program at grid position ``(x, y, z)`` of an ``(n_tiles, ny, nz)``
  grid whose later tiles are heavier. The hardware starts programs in grid order (axis 0
  fastest): :func:`heavy_first_order` of the linear index runs the heaviest tiles of a group
  of (y, z) pairs first, so the grid ends on light programs while a group's streamed operands
  stay in L2; where that index arithmetic could overflow int32, heaviest first within each
  pair only."""
  pairs = ny * nz
  if max(n_tiles, -(-pairs // group)) * pairs >= 2**31:
    return n_tiles - 1 - x, y, z
  return heavy_first_order(x + n_tiles * (y + ny * z), n_tiles, ny, nz, group)


def heavy_first_order(n, n_tiles: int, ny: int, nz: int, group: int):
  """``(tile, y, z)`` of the ``n``-th program: the (y, z) pairs (y fastest) in
  ``ceil(pairs / group)`` groups of near-equal size (a small last group would end the kernel
  on a few heavy programs), in turn, each taking tile ``n_tiles - 1`` of every pair, then
  ``n_tiles - 2``, ..."""
  pairs = ny * nz
  n_groups = -(-pairs // group)
  first = lambda c: c * pairs // n_groups  # the group's first pair
  done = n // n_tiles  # whole pairs' worth of programs before this one
  c = ((done + 1) * n_groups + pairs - 1) // pairs - 1
  start, size = first(c), first(c + 1) - first(c)
  r = n - start * n_tiles
  pair = start + r % size
  return n_tiles - 1 - r // size, pair % ny, pair // ny
