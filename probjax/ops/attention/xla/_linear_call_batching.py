"""A batching rule for ``jax.custom_derivatives.linear_call``.

JAX 0.11.2 ships ``linear_call`` without one, so ``jax.vmap`` over the flash
path's reverse or forward derivative would fail. The rule moves every batch
axis to the front (broadcasting unbatched operands) and re-binds a
``linear_call`` whose function and transpose are the vmapped originals, so
the batched call is still transposable.
"""

from __future__ import annotations

import jax
from jax._src import core
from jax._src.custom_derivatives import linear_call, linear_call_p
from jax._src.interpreters import batching


def _linear_call_batch(axis_data, args, dims, *, callee, transpose_thunk, num_callee_consts, num_res):
  args = [batching.bdim_at_front(a, d, axis_data.size) for a, d in zip(args, dims)]
  n_res = num_callee_consts + num_res
  res, lin = list(args[:n_res]), list(args[n_res:])
  f = core.jaxpr_as_fun(callee)

  def fun(res, lin):
    return jax.vmap(lambda r, l: f(*r, *l))(res, lin)

  def fun_t(res, cts):
    t, t_consts = transpose_thunk()
    ft = core.jaxpr_as_fun(t)
    return jax.vmap(lambda r, c: ft(*t_consts, *r[num_callee_consts:], *c))(res, cts)

  out = linear_call(fun, fun_t, res, lin)
  return out, [0] * len(out)


if linear_call_p not in batching.fancy_primitive_batchers:
  batching.fancy_primitive_batchers[linear_call_p] = _linear_call_batch
