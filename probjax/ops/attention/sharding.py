"""Batch- and head-parallel SPMD partitioning, and ``vmap`` folded into the batch, for a
kernel's custom call.

XLA's SPMD partitioner cannot see into a custom call: under automatic sharding it gathers
the operands and runs the whole call on every device; and an FFI call under ``vmap`` runs
once per element. Attention is independent per batch element and per head, so
:func:`batch_head_parallel` wraps a call so that each device runs it on its shard of the
batch and head dimensions (query/key positions and head_dim are gathered where a caller
shards them), and ``vmap``'s axis becomes part of the batch dimension.

Operands and results are described by role strings, one letter per dimension, batch first:
``b`` batch, ``h`` query heads, ``g`` key/value heads (query head ``i`` reads key/value
head ``i // (h / g)``, so a shard of ``g`` heads serves the matching shard of ``h``),
``t`` query positions, ``s`` key positions, ``d`` head_dim.
"""

from __future__ import annotations

import functools
import math
from typing import Callable, Hashable

import jax
import jax.numpy as jnp
from jax.custom_batching import custom_vmap
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding, PartitionSpec

from probjax.core.compat import ir  # the types a Shardy rule callback receives

Q, KV, STATS, BATCH = "bthd", "bsgd", "bht", "b"
_REPLICATED = "tsd"


def batch_head_parallel(fn: Callable, static: Hashable, roles_in: tuple[str, ...],
                        roles_out: tuple[str, ...]) -> Callable:
  """``fn(static, *operands) -> tuple of results`` as a function of the operands that is
  partitioned over the mesh axes sharding the batch and head dimensions and folds ``vmap``
  into the batch dimension (``fn`` sees rank-``len(role)`` operands, always).

  ``static``: hashable, passed through (one wrapped function per value)."""
  for roles in (*roles_in, *roles_out):
    if not roles.startswith("b") or set(roles) - set("bhgtsd"):
      raise ValueError(f"role {roles!r}: expected letters of 'bhgtsd', batch ('b') first")
  return _wrapped(fn, static, tuple(roles_in), tuple(roles_out))


@functools.cache
def _wrapped(fn, static, roles_in, roles_out):
  # jit: the kernel's constants (e.g. tile tables) stay inside its own jaxpr; custom_partitioning
  # takes a function without constants
  per_shard = jax.jit(lambda *xs: tuple(fn(static, *xs)))
  cp = custom_partitioning(per_shard)

  def axes(mesh, arg_shapes):
    """(mesh axes of the batch, of the heads) that the call is partitioned over."""
    specs = [_padded_spec(a) for a in arg_shapes]
    b_axes = specs[0][0]
    h_axes = next((spec[r.index(c)] for c in "hg" for spec, r in zip(specs, roles_in) if c in r), None)
    if h_axes is not None:
      n = _size(mesh, h_axes)
      heads = [a.shape[r.index(c)] for a, r in zip(arg_shapes, roles_in) for c in "hg" if c in r]
      if any(x % n for x in heads):
        h_axes = None  # e.g. fewer key/value heads than head shards: every device takes all heads
    return b_axes, h_axes

  def shardings(mesh, arg_shapes, roles):
    b_axes, h_axes = axes(mesh, arg_shapes)
    pick = lambda r: b_axes if r == "b" else h_axes if r in "hg" else None
    return tuple(NamedSharding(mesh, PartitionSpec(*map(pick, rs))) for rs in roles)

  def partition(mesh, arg_shapes, result_shape):
    del result_shape
    return (mesh, per_shard, shardings(mesh, arg_shapes, roles_out),
            shardings(mesh, arg_shapes, roles_in))

  def infer(mesh, arg_shapes, result_shape):
    del result_shape
    return shardings(mesh, arg_shapes, roles_out)

  def rule(mesh, value_types, result_types):
    del mesh, result_types
    dims = {c: ir.RankedTensorType(t).shape[r.index(c)]
            for t, r in zip(value_types, roles_in) for c in "hg" if c in r}
    group = dims["h"] // dims["g"] if "h" in dims and "g" in dims else 1
    # one key/value head is not a factor of the query heads (Shardy takes no size-1 factor
    # in a compound one); the partition keeps heads whole then
    heads = "h" if "g" not in dims or dims["g"] == 1 else "(g r)" if group > 1 else "g"
    spell = lambda rs: " ".join(heads if c == "h" else c for c in rs)
    text = ", ".join(map(spell, roles_in)) + " -> " + ", ".join(map(spell, roles_out))
    # in order of first appearance, as Shardy numbers the factors (it needs them sorted)
    order = list(dict.fromkeys("".join(roles_in + roles_out)))
    opts = {"need_replication_factors": tuple(c for c in order if c in _REPLICATED)}
    if "(" in heads:
      opts["r"] = group
    return text, opts

  cp.def_partition(partition, infer_sharding_from_operands=infer, sharding_rule=rule)

  @custom_vmap
  def call(*xs):
    return cp(*xs)

  @call.def_vmap
  def _fold(axis_size, in_batched, *xs):
    xs = [x if batched else jnp.broadcast_to(x, (axis_size, *x.shape))
          for x, batched in zip(xs, in_batched)]
    outs = call(*(x.reshape(axis_size * x.shape[1], *x.shape[2:]) for x in xs))
    return tuple(o.reshape(axis_size, -1, *o.shape[1:]) for o in outs), (True,) * len(outs)

  return call


def masked_call(fn: Callable, static: Hashable, operands: tuple, roles: tuple[str, ...], mask,
                roles_out: tuple[str, ...], *, partition: bool = True) -> tuple:
  """``fn(static, *operands, mask) -> tuple of results`` through :func:`batch_head_parallel`,
  with the mask's arrays (lengths ``[batch]``, segment ids ``[batch, len]``) as operands;
  ``operands[0]`` is q-shaped and ``operands[1]`` k-shaped. ``partition=False``: ``fn``
  directly (a ``score_mod`` sees global batch and head indices, which a shard does not have)."""
  if not partition:
    return tuple(fn(static, *operands, mask))
  found = () if mask is None else mask.arrays()
  b, tq, tk = operands[0].shape[0], operands[0].shape[1], operands[1].shape[1]
  shapes = {"b": (b,), "bt": (b, tq), "bs": (b, tk)}
  mask_roles = tuple(r for r, _ in found)
  arrays = tuple(jnp.broadcast_to(x, shapes[r]) for r, x in found)
  skeleton = None if mask is None else mask.with_arrays((None,) * len(found))  # static: hashable
  call = batch_head_parallel(_with_mask, (fn, static, skeleton, len(found)), (*roles, *mask_roles), roles_out)
  return call(*operands, *arrays)


def attention_vjp(forward_shard: Callable, backward_shard: Callable, partitioned: Callable) -> tuple:
  """``(fwd, bwd)`` for ``defvjp`` of a ``custom_vjp`` ``f(static, q, k, v, mask)`` (static
  non-differentiable) whose kernels run through :func:`masked_call`:
  ``forward_shard(static, q, k, v, mask) -> (out, lse)`` and
  ``backward_shard(static, q, k, v, out, lse, do, mask) -> (dq, dk, dv)``, per shard where
  ``partitioned(static)``. The residuals are ``(q, k, v, out, lse, mask)``."""
  def fwd(st, q, k, v, mask):
    out, lse = masked_call(forward_shard, st, (q, k, v), (Q, KV, KV), mask, (Q, STATS),
                           partition=partitioned(st))
    return out, (q, k, v, out, lse, mask)

  def bwd(st, res, do):
    q, k, v, out, lse, mask = res
    dq, dk, dv = masked_call(backward_shard, st, (q, k, v, out, lse, do), (Q, KV, KV, Q, STATS, Q),
                             mask, (Q, KV, KV), partition=partitioned(st))
    return dq, dk, dv, jax.tree.map(lambda _: None, mask)

  return fwd, bwd


def _with_mask(static, *xs):
  fn, st, skeleton, n = static
  operands, arrays = xs[:len(xs) - n], xs[len(xs) - n:]
  mask = None if skeleton is None else skeleton.with_arrays(arrays)
  return fn(st, *operands, mask)


def _padded_spec(arg_shape) -> tuple:
  spec = () if arg_shape.sharding is None else tuple(arg_shape.sharding.spec)
  return spec + (None,) * (arg_shape.ndim - len(spec))


def _size(mesh, axes) -> int:
  names = axes if isinstance(axes, tuple) else (axes,)
  return math.prod(mesh.shape[a] for a in names)
