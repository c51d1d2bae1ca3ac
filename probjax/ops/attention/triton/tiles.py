"""Pieces shared by the forward and backward kernels: the mask arrays a
pallas_call receives, the in-kernel tile predicate and the score computation.

All kernels take whole-array refs (``[batch, seq, heads, head_dim]`` etc.) and
index their tile with ``ref.at[b, pl.ds(start, block), h, :]``: Triton only sees
pointers, and one layout serves every grid (split, fused, onepass).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from probjax.ops.attention.masks import EMPTY, FULL, PARTIAL, Mask, num_tiles

LOG2E = math.log2(math.e)


@dataclasses.dataclass(frozen=True)
class TileMask:
  """Static mask description a kernel is traced with.

  ``q_len``/``kv_len`` are the true lengths (arrays are padded beyond them);
  the ``has_*`` flags say which optional refs follow the main operands, in the
  order ``classes, kv_tile_range | q_tile_range, q_lengths, kv_lengths,
  q_segment_ids, kv_segment_ids``.
  """
  lower: int | None
  upper: int | None
  q_len: int
  kv_len: int
  has_classes: bool
  has_q_lengths: bool
  has_kv_lengths: bool
  has_segments: bool

  @property
  def has_band(self) -> bool:
    return self.lower is not None or self.upper is not None


@dataclasses.dataclass
class MaskRefs:
  """The mask refs of one kernel, unpacked from its positional refs."""
  classes: Any = None      # [batch, nq, nk] int32
  tile_range: Any = None   # [2, n] int32: static loop bounds per tile (band)
  q_lengths: Any = None    # [batch] int32
  kv_lengths: Any = None   # [batch] int32
  q_seg: Any = None        # [batch, q_pad] int32
  kv_seg: Any = None       # [batch, kv_pad] int32

  @staticmethod
  def count(tm: TileMask) -> int:
    return tm.has_classes + tm.has_band + tm.has_q_lengths + tm.has_kv_lengths + 2 * tm.has_segments

  @classmethod
  def unpack(cls, tm: TileMask, refs) -> "MaskRefs":
    refs = list(refs)
    pop = lambda flag: refs.pop(0) if flag else None
    out = cls(pop(tm.has_classes), pop(tm.has_band), pop(tm.has_q_lengths), pop(tm.has_kv_lengths))
    out.q_seg, out.kv_seg = pop(tm.has_segments), pop(tm.has_segments)
    return out


def pad_axis(x, axis: int, size: int, value=0):
  """Pads ``x`` along ``axis`` to ``size`` with ``value`` (no-op when already there)."""
  extra = size - x.shape[axis]
  if extra == 0:
    return x
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, extra)
  return jnp.pad(x, widths, constant_values=value)


def round_up(n: int, m: int) -> int:
  return -(-n // m) * m


def padded_head_dim(d: int) -> int:
  """Head dim the kernels load: next power of two, at least 32."""
  return max(32, 1 << (d - 1).bit_length())


def mask_operands(mask: Mask | None, batch: int, q_len: int, kv_len: int, q_pad: int,
                  kv_pad: int, block_q: int, block_k: int, *, by_q: bool):
  """The static :class:`TileMask` and the array operands of one kernel.

  ``by_q``: the kernel loops over keys per query tile (forward, dQ), so the band
  bounds become a per-query-tile key-tile range (:meth:`Mask.kv_range`); else it
  loops over queries per key tile (dK/dV, :meth:`Mask.q_range`).
  """
  m = mask if mask is not None else Mask()
  padded = q_pad != q_len or kv_pad != kv_len
  tm = TileMask(m.lower, m.upper, q_len, kv_len,
                has_classes=mask is not None or padded,
                has_q_lengths=m.q_lengths is not None,
                has_kv_lengths=m.kv_lengths is not None,
                has_segments=m.q_segment_ids is not None)
  ops = []
  if tm.has_classes:
    ops.append(m.classify_tiles(batch, q_len, kv_len, block_q, block_k))
  if tm.has_band:
    if by_q:
      r = [m.kv_range(i * block_q, min((i + 1) * block_q, q_len), kv_len)
           for i in range(num_tiles(q_len, block_q))]
      lo, hi = zip(*((a // block_k, num_tiles(b, block_k)) for a, b in r))
    else:
      r = [m.q_range(j * block_k, min((j + 1) * block_k, kv_len), q_len)
           for j in range(num_tiles(kv_len, block_k))]
      lo, hi = zip(*((a // block_q, num_tiles(b, block_q)) for a, b in r))
    ops.append(jnp.asarray(np.array([lo, hi], np.int32)))
  bcast = lambda x, shape: jnp.broadcast_to(jnp.asarray(x, jnp.int32), shape)
  if tm.has_q_lengths:
    ops.append(bcast(m.q_lengths, (batch,)))
  if tm.has_kv_lengths:
    ops.append(bcast(m.kv_lengths, (batch,)))
  if tm.has_segments:
    ops.append(pad_axis(bcast(m.q_segment_ids, (batch, q_len)), 1, q_pad, -1))
    ops.append(pad_axis(bcast(m.kv_segment_ids, (batch, kv_len)), 1, kv_pad, -2))
  return tm, ops


# -- in-kernel helpers ----------------------------------------------------------
def loop_bounds(tm: TileMask, mr: MaskRefs, b, tile, n_static: int, *, by_q: bool,
                block_outer: int, block_inner: int):
  """``[lo, hi)`` of inner tiles for outer tile ``tile``: band range, cut at this
  batch element's lengths (no tile past a length is loaded); empty when the
  outer tile lies past its own length."""
  lo, hi = jnp.int32(0), jnp.int32(n_static)
  if mr.tile_range is not None:
    lo, hi = mr.tile_range[0, tile], mr.tile_range[1, tile]
  inner_len = mr.kv_lengths if by_q else mr.q_lengths
  outer_len = mr.q_lengths if by_q else mr.kv_lengths
  if inner_len is not None:
    hi = jnp.minimum(hi, (inner_len[b] + block_inner - 1) // block_inner)
  if outer_len is not None:
    hi = jnp.where(tile * block_outer < outer_len[b], hi, lo)
  return lo, hi


def tile_valid(tm: TileMask, mr: MaskRefs, b, q_start, k_start, block_q: int, block_k: int):
  """Boolean ``[block_q, block_k]`` element predicate of one PARTIAL tile."""
  qi = q_start + jax.lax.broadcasted_iota(jnp.int32, (block_q, block_k), 0)
  ki = k_start + jax.lax.broadcasted_iota(jnp.int32, (block_q, block_k), 1)
  ok = Mask(lower=tm.lower, upper=tm.upper).element(qi, ki) & (qi < tm.q_len) & (ki < tm.kv_len)
  if mr.q_lengths is not None:
    ok &= qi < mr.q_lengths[b]
  if mr.kv_lengths is not None:
    ok &= ki < mr.kv_lengths[b]
  if mr.q_seg is not None:
    qs = mr.q_seg.at[b, pl.ds(q_start, block_q)][...]
    ks = mr.kv_seg.at[b, pl.ds(k_start, block_k)][...]
    ok &= qs[:, None] == ks[None, :]
  return ok


def scores(q, k, *, scale: float, score_mod: Callable | None, b, h, q_start, k_start):
  """Scores of one tile in base-2 units: ``log2(e) * score_mod(scale * q @ k^T)``.

  Returns ``(s2, s_nat)`` where ``s_nat`` (the pre-``score_mod`` scaled score)
  is only needed for the backward of ``score_mod`` (None without one).
  """
  qk = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
  if score_mod is None:
    return qk * (scale * LOG2E), None
  s_nat = qk * scale
  return score_mod(s_nat, b, h, *tile_indices(q_start, k_start, *qk.shape)) * LOG2E, s_nat


def tile_indices(q_start, k_start, block_q: int, block_k: int):
  """Query ``[block_q, 1]`` and key ``[1, block_k]`` positions of a tile."""
  qi = q_start + jax.lax.broadcasted_iota(jnp.int32, (block_q, 1), 0)
  ki = k_start + jax.lax.broadcasted_iota(jnp.int32, (1, block_k), 1)
  return qi, ki


def score_mod_grad(score_mod: Callable, s_nat, ds, *, b, h, q_start, k_start):
  """``ds`` (w.r.t. the modified score) pulled back through ``score_mod``."""
  qi, ki = tile_indices(q_start, k_start, *s_nat.shape)
  _, vjp = jax.vjp(lambda s: score_mod(s, b, h, qi, ki), s_nat)
  return vjp(ds)[0]


def dispatch_tile(tm: TileMask, mr: MaskRefs, b, i, j, carry, body):
  """Runs ``body(carry, masked)`` per the tile's class: EMPTY skipped, PARTIAL
  masked, FULL unmasked. Without classes every tile is FULL."""
  if mr.classes is None:
    return body(carry, False)
  cls = mr.classes[b, i, j]
  assert (EMPTY, PARTIAL, FULL) == (0, 1, 2)
  return jax.lax.switch(cls, [lambda: carry, lambda: body(carry, True), lambda: body(carry, False)])
