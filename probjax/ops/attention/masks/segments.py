"""Packed documents: ``q`` sees ``k`` iff ``q_segment_ids[b, q] == kv_segment_ids[b, k]``.

Kernels read the ids as blocks of the padded ``[batch, q_pad]`` / ``[batch, kv_pad]`` arrays
(:meth:`Mask.padded_segment_ids`) and take their per-batch tile ranges from the classes.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

from probjax.ops.attention.masks.base import Mask, Predicate, TileGrid, check_array, int_array
from probjax.ops.attention.masks.tiles import pad_axis


@dataclasses.dataclass(frozen=True)
class Segments(Predicate):
  """Document ids ``q_segment_ids`` ``[batch, q_len]`` and ``kv_segment_ids`` ``[batch, kv_len]``."""

  q_segment_ids: Any = None
  kv_segment_ids: Any = None

  kind = "segments"
  fields = ("q_segment_ids", "kv_segment_ids")
  roles = {"q_segment_ids": "bt", "kv_segment_ids": "bs"}

  @classmethod
  def from_fields(cls, q_segment_ids=None, kv_segment_ids=None):
    if (q_segment_ids is None) != (kv_segment_ids is None):
      raise ValueError("Mask: q_segment_ids and kv_segment_ids must be given together")
    return None if q_segment_ids is None else cls(q_segment_ids, kv_segment_ids)

  def combine(self, other):
    raise ValueError(
        "cannot combine two SegmentMasks: combine the segment ids into one "
        "pair of id arrays (e.g. id_a * num_ids_b + id_b) and pass one SegmentMask")

  def element(self, q_idx, k_idx, b):
    # Each index array gathers its own ids and the comparison broadcasts: a [bq, 1] x [1, bk]
    # tile gathers bq + bk ids, not 2 * bq * bk.
    qs, ks = jnp.asarray(self.q_segment_ids), jnp.asarray(self.kv_segment_ids)
    shape = jnp.broadcast_shapes(jnp.shape(q_idx), jnp.shape(k_idx))
    qi, ki = (jnp.reshape(i, (1,) * (len(shape) - jnp.ndim(i)) + jnp.shape(i)) for i in (q_idx, k_idx))
    if b is not None:
      return jnp.broadcast_to(jnp.take(qs[b], qi, mode="clip") == jnp.take(ks[b], ki, mode="clip"), shape)
    ids = lambda x, i: jnp.take(x, i.reshape(-1), axis=1, mode="clip").reshape((x.shape[0],) + i.shape)
    return jnp.broadcast_to(ids(qs, qi) == ids(ks, ki), (max(qs.shape[0], ks.shape[0]),) + shape)

  def classify(self, grid: TileGrid):
    qmin, qmax = _block_min_max(jnp.broadcast_to(self.q_segment_ids, (grid.batch, grid.q_len)), grid.block_q)
    kmin, kmax = _block_min_max(jnp.broadcast_to(self.kv_segment_ids, (grid.batch, grid.kv_len)), grid.block_k)
    qmin, qmax = qmin[:, :, None], qmax[:, :, None]
    kmin, kmax = kmin[:, None, :], kmax[:, None, :]
    return (qmin <= kmax) & (kmin <= qmax), (qmin == qmax) & (kmin == kmax) & (qmin == kmin)

  def validate(self, batch, q_len, kv_len):
    check_array("q_segment_ids", self.q_segment_ids, (batch, q_len))
    check_array("kv_segment_ids", self.kv_segment_ids, (batch, kv_len))

  def padded(self, batch, q_pad, kv_pad):
    return Segments(*self.operands(batch, q_pad, kv_pad))

  def operands(self, batch, q_pad, kv_pad):
    # Padded positions get ids that match nothing: -1 for queries, -2 for keys.
    q_len, kv_len = self.q_segment_ids.shape[-1], self.kv_segment_ids.shape[-1]
    ids = lambda x, n: jnp.broadcast_to(jnp.asarray(x, jnp.int32), (batch, n))
    return (pad_axis(ids(self.q_segment_ids, q_len), 1, q_len if q_pad is None else q_pad, -1),
            pad_axis(ids(self.kv_segment_ids, kv_len), 1, kv_len if kv_pad is None else kv_pad, -2))


def _block_min_max(ids, block):
  """Per-block min and max of ``[batch, n]`` ids (padding ignored)."""
  b, n = ids.shape
  nb = -(-n // block)
  pad = nb * block - n
  lo = jnp.pad(ids, ((0, 0), (0, pad)), constant_values=jnp.iinfo(jnp.int32).max)
  hi = jnp.pad(ids, ((0, 0), (0, pad)), constant_values=jnp.iinfo(jnp.int32).min)
  return (lo.reshape(b, nb, block).min(-1), hi.reshape(b, nb, block).max(-1))


def SegmentMask(q_segment_ids, kv_segment_ids=None) -> Mask:  # noqa: N802 (mask types read as classes)
  """Packed documents: ``q`` sees ``k`` iff their segment ids are equal.

  Args:
    q_segment_ids: ``[batch, q_len]`` ints.
    kv_segment_ids: ``[batch, kv_len]`` ints; defaults to ``q_segment_ids``.
  """
  q = int_array("q_segment_ids", q_segment_ids, 2)
  k = q if kv_segment_ids is None else int_array("kv_segment_ids", kv_segment_ids, 2)
  return Mask(Segments(q, k))
