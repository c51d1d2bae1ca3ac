"""Token-to-expert permutations for a sorted MoE dispatch: the ``T * top_k`` assignments sorted
by expert, and row gathers whose gradients are gathers by the inverse permutation (no
scatter-add anywhere).

An assignment ``a = t * top_k + j`` is token ``t``'s ``j``-th choice. :func:`sort_assignments`
orders them by expert (stable: by token, then choice, within an expert); dropped assignments
(``keep`` false, over an expert's capacity) go after every group, where the grouped matmuls
compute nothing and output zeros.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SortedAssignments:
  """``order [A]``: the assignment at each sorted position; ``inverse [A]``: the sorted
  position of each assignment; ``group_sizes [E]`` int32: kept assignments per expert."""

  order: jax.Array
  inverse: jax.Array
  group_sizes: jax.Array


def sort_assignments(expert_ids, num_experts: int, keep=None) -> SortedAssignments:
  """Sorts ``expert_ids [A]`` (int) by expert; ``keep [A]`` bool: drop the others to the tail."""
  key = expert_ids.astype(jnp.int32)
  if keep is not None:
    key = jnp.where(keep, key, num_experts)
  order = jnp.argsort(key, stable=True).astype(jnp.int32)
  inverse = jnp.argsort(order).astype(jnp.int32)
  bounds = jnp.searchsorted(key[order], jnp.arange(num_experts + 1, dtype=jnp.int32), side="left")
  return SortedAssignments(order, inverse, jnp.diff(bounds).astype(jnp.int32))


@jax.custom_vjp
def permute_rows(x, perm, inverse):
  """``x[perm]`` for a permutation ``perm`` of ``x``'s rows (``inverse`` its inverse); the
  gradient is ``ct[inverse]``."""
  return x[perm]


def _permute_fwd(x, perm, inverse):
  return x[perm], inverse


def _permute_bwd(inverse, ct):
  return ct[inverse], None, None


permute_rows.defvjp(_permute_fwd, _permute_bwd)


def expand_sorted(x, s: SortedAssignments, top_k: int):
  """``[A, D]``: token ``t``'s row at each of its ``top_k`` sorted positions (``x [T, D]``).
  The gradient gathers the cotangent back to assignment order and sums each token's
  ``top_k`` rows."""
  return _expand(x, s.order, s.inverse, top_k)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _expand(x, order, inverse, top_k):
  return x[order // top_k]


def _expand_fwd(x, order, inverse, top_k):
  return x[order // top_k], inverse


def _expand_bwd(top_k, inverse, ct):
  rows = ct[inverse].reshape(-1, top_k, *ct.shape[1:])
  return rows.sum(1, dtype=jnp.promote_types(ct.dtype, jnp.float32)).astype(ct.dtype), None, None


_expand.defvjp(_expand_fwd, _expand_bwd)
