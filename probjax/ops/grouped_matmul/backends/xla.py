"""XLA: ``jax.lax.ragged_dot_general`` for both products.

The forward and ``d_lhs`` are the ragged-rows mode (``d_lhs`` contracts rhs's last axis, so
the weights are not transposed in memory); ``tgmm`` is the ragged-contracting mode, which
returns one ``[p, q]`` block per group. Every product accumulates in float32 (or float64) and
rounds once to the output dtype, as the kernels do. ``ragged_dot``'s batching rule does not
cover these dimension numbers; under ``vmap`` the batch runs as a loop (:func:`_vmap_as_loop`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from probjax.core.device import Device
from probjax.ops.grouped_matmul.base import GroupedMatmulBackend
from probjax.ops.grouped_matmul.call import GroupedMatmulCall


def _acc(dtype):
  return jnp.float64 if np.dtype(dtype) == np.float64 else jnp.float32


def _vmap_as_loop(fn):
  """``fn(a, b, group_sizes)`` whose vmap is ``lax.map`` over the batch."""

  @jax.custom_batching.custom_vmap
  def f(a, b, group_sizes):
    return fn(a, b, group_sizes)

  @f.def_vmap
  def _(axis_size, in_batched, *args):
    full = [x if bt else jnp.broadcast_to(x, (axis_size, *x.shape)) for x, bt in zip(args, in_batched)]
    return jax.lax.map(lambda xs: fn(*xs), tuple(full)), True

  return f


class XlaBackend(GroupedMatmulBackend):
  name = "xla"

  def supports(self, call: GroupedMatmulCall, device: Device) -> str | None:
    return None

  def gmm(self, lhs, rhs, group_sizes, *, call: GroupedMatmulCall):
    return _vmap_as_loop(lambda *a: self._gmm(*a, call=call))(lhs, rhs, group_sizes)

  def tgmm(self, a, b, group_sizes, *, call: GroupedMatmulCall):
    return _vmap_as_loop(lambda *x: self._tgmm(*x, call=call))(a, b, group_sizes)

  def _gmm(self, lhs, rhs, group_sizes, *, call: GroupedMatmulCall):
    contract = 2 if call.transpose_rhs else 1
    dn = jax.lax.RaggedDotDimensionNumbers(dot_dimension_numbers=(([1], [contract]), ([], [])),
                                           lhs_ragged_dimensions=[0], rhs_group_dimensions=[0])
    out = jax.lax.ragged_dot_general(lhs, rhs, group_sizes, dn, preferred_element_type=_acc(call.out_dtype))
    return out.astype(call.out_dtype)

  def _tgmm(self, a, b, group_sizes, *, call: GroupedMatmulCall):
    dn = jax.lax.RaggedDotDimensionNumbers(dot_dimension_numbers=(([0], [0]), ([], [])),
                                           lhs_ragged_dimensions=[0], rhs_group_dimensions=[])
    out = jax.lax.ragged_dot_general(a, b, group_sizes, dn, preferred_element_type=_acc(call.dtype))
    return out.astype(call.dtype)
