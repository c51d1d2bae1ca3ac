"""Grouped matmul: ``out[i] = lhs[i] @ rhs[g]`` for the rows ``i`` of group ``g``.

``lhs [M, K]``, ``rhs [G, K, N]`` (``[G, N, K]`` with ``transpose_rhs``), ``group_sizes [G]``
integer: group ``g`` owns the ``group_sizes[g]`` consecutive rows after those of the groups
before it; rows past ``sum(group_sizes)`` give zero output and zero ``lhs`` gradient. Both
gradients are exact (:mod:`.base`); an empty group's weight gradient is exactly zero.

The op's face is :mod:`probjax.ops.grouped_matmul.api` (the product, its dispatch, and the MoE
expert block built on it), whose names this package exports.

>>> import jax, jax.numpy as jnp
>>> from probjax.ops.grouped_matmul import grouped_matmul
>>> lhs = jnp.ones((5, 3)); rhs = jnp.stack([jnp.eye(3), 2 * jnp.eye(3)])
>>> grouped_matmul(lhs, rhs, jnp.array([2, 2], jnp.int32))[:, 0].tolist()
[1.0, 1.0, 2.0, 2.0, 0.0]
"""

from __future__ import annotations

from probjax.ops.grouped_matmul.api import (ACTIVATIONS, DISPATCHES, REGISTRY, STRATEGIES, Decision,
                                            GroupedMatmulCall, MoECall, available_implementations,
                                            explain_dispatch, explain_moe_dispatch, grouped_matmul,
                                            make_call, moe_experts)

__all__ = ["grouped_matmul", "explain_dispatch", "available_implementations", "Decision",
           "GroupedMatmulCall", "make_call", "REGISTRY",
           "moe_experts", "explain_moe_dispatch", "MoECall", "STRATEGIES", "DISPATCHES", "ACTIVATIONS"]
