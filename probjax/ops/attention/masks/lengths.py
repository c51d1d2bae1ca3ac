"""Per-batch lengths: queries ``q < q_lengths[b]``, keys ``k < kv_lengths[b]``.

Lengths are clamped to ``[0, q_len]`` / ``[0, kv_len]``. Positions at or past them may hold
anything (a KV cache's unwritten tail): backends zero them (``padding.zero_padding``), and the
kernels read the lengths as per-batch scalars (:meth:`Mask.lengths`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

from probjax.ops.attention.masks.base import Mask, Predicate, TileGrid, check_array, int_array, per_batch, per_tile


@dataclasses.dataclass(frozen=True)
class QLengths(Predicate):
  """Valid queries ``q < q_lengths[b]``; ``q_lengths`` ``[batch]`` int32."""

  q_lengths: Any = None

  kind = "q_lengths"
  fields = ("q_lengths",)
  roles = {"q_lengths": "b"}

  def combine(self, other):
    return QLengths(jnp.minimum(self.q_lengths, other.q_lengths))

  def element(self, q_idx, k_idx, b):
    return q_idx < per_batch(self.q_lengths, b)

  def classify(self, grid: TileGrid):
    ql = per_tile(self.q_lengths, grid.batch)
    return grid.qs[None] < ql, grid.qe[None] <= ql

  def validate(self, batch, q_len, kv_len):
    check_array("q_lengths", self.q_lengths, (batch,), q_len)

  def clamped(self, q_len, kv_len):
    return QLengths(jnp.clip(self.q_lengths, 0, q_len).astype(jnp.int32))

  def operands(self, batch, q_pad, kv_pad):
    return (jnp.broadcast_to(jnp.asarray(self.q_lengths, jnp.int32), (batch,)),)


@dataclasses.dataclass(frozen=True)
class KVLengths(Predicate):
  """Valid keys ``k < kv_lengths[b]``; ``kv_lengths`` ``[batch]`` int32."""

  kv_lengths: Any = None

  kind = "kv_lengths"
  fields = ("kv_lengths",)
  roles = {"kv_lengths": "b"}

  def combine(self, other):
    return KVLengths(jnp.minimum(self.kv_lengths, other.kv_lengths))

  def element(self, q_idx, k_idx, b):
    return k_idx < per_batch(self.kv_lengths, b)

  def classify(self, grid: TileGrid):
    kl = per_tile(self.kv_lengths, grid.batch)
    return grid.ks[None] < kl, grid.ke[None] <= kl

  def validate(self, batch, q_len, kv_len):
    check_array("kv_lengths", self.kv_lengths, (batch,), kv_len)

  def clamped(self, q_len, kv_len):
    return KVLengths(jnp.clip(self.kv_lengths, 0, kv_len).astype(jnp.int32))

  def operands(self, batch, q_pad, kv_pad):
    return (jnp.broadcast_to(jnp.asarray(self.kv_lengths, jnp.int32), (batch,)),)


def KVLenMask(kv_lengths) -> Mask:  # noqa: N802 (mask types read as classes)
  """Per-batch key lengths: key ``k`` is valid iff ``k < kv_lengths[b]``; ``[batch]`` ints."""
  return Mask(KVLengths(int_array("kv_lengths", kv_lengths, 1)))


def LengthMask(q_lengths, kv_lengths) -> Mask:  # noqa: N802
  """Per-batch query and key lengths (``[batch]`` ints each); padded queries return zeros."""
  return Mask(QLengths(int_array("q_lengths", q_lengths, 1)), KVLengths(int_array("kv_lengths", kv_lengths, 1)))
