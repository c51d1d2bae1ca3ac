"""Prefix-LM: bidirectional within each batch element's prefix, causal after it.

Query ``q`` sees key ``k`` iff ``k <= q`` or ``k < prefix_lengths[b]``: the first
``prefix_lengths[b]`` positions (a prompt, an image's patches) see each other, later ones see
the prefix and their causal past. The fused kernels do not compute it (their ``supports``
refuse it: :meth:`Mask.refusal`); the XLA path evaluates the element function per tile and
skips the tiles :meth:`PrefixLM.classify` proves EMPTY.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

from probjax.ops.attention.masks.base import Mask, Predicate, TileGrid, check_array, int_array, per_batch, per_tile


@dataclasses.dataclass(frozen=True)
class PrefixLM(Predicate):
  """``k <= q or k < prefix_lengths[b]``; ``prefix_lengths`` ``[batch]`` int32."""

  prefix_lengths: Any = None

  kind = "prefix_lm"
  fields = ("prefix_lengths",)
  roles = {"prefix_lengths": "b"}

  def combine(self, other):
    # (k <= q or k < p1) and (k <= q or k < p2) is k <= q or k < min(p1, p2).
    return PrefixLM(jnp.minimum(self.prefix_lengths, other.prefix_lengths))

  def element(self, q_idx, k_idx, b):
    return (k_idx <= q_idx) | (k_idx < per_batch(self.prefix_lengths, b))

  def classify(self, grid: TileGrid):
    # k is allowed from every query of [qs, qe) iff k < max(p, qs + 1), from some iff k < max(p, qe).
    p = per_tile(self.prefix_lengths, grid.batch)
    return grid.ks[None] < jnp.maximum(p, grid.qe[None]), grid.ke[None] <= jnp.maximum(p, grid.qs[None] + 1)

  def validate(self, batch, q_len, kv_len):
    check_array("prefix_lengths", self.prefix_lengths, (batch,), kv_len)

  def clamped(self, q_len, kv_len):
    return PrefixLM(jnp.clip(self.prefix_lengths, 0, kv_len).astype(jnp.int32))

  def operands(self, batch, q_pad, kv_pad):
    return (jnp.broadcast_to(jnp.asarray(self.prefix_lengths, jnp.int32), (batch,)),)


def PrefixLMMask(prefix_lengths) -> Mask:  # noqa: N802 (mask types read as classes)
  """Prefix-LM: ``q`` sees ``k`` iff ``k <= q`` or ``k < prefix_lengths[b]``; ``[batch]`` ints
  in ``[0, kv_len]`` (0: causal)."""
  return Mask(PrefixLM(int_array("prefix_lengths", prefix_lengths, 1)))
