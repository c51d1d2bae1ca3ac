"""Batching and JVP rules for ``jax.custom_derivatives.linear_call``.

JAX 0.11.2 ships ``linear_call`` without a batching rule, so ``jax.vmap`` over the flash
path's reverse or forward derivative would fail, and with a JVP rule that asserts the
residuals have no tangent, so any second derivative (``jax.jvp(jax.grad(f))``,
``jax.hessian``, ``jax.grad(jax.grad(f))``) failed with a bare AssertionError. This module is
the one place that patches JAX internals.
"""

from __future__ import annotations

import jax
from jax._src import ad_util
from jax._src import core
from jax._src.custom_derivatives import linear_call, linear_call_p
from jax._src.interpreters import ad
from jax._src.interpreters import batching


def _linear_call_batch(axis_data, args, dims, *, callee, transpose_thunk, num_callee_consts, num_res):
  """Every batch axis moved to the front (unbatched operands broadcast), and a ``linear_call``
  of the vmapped function and transpose re-bound, so the batched call is still transposable."""
  if all(d is None for d in dims):  # e.g. the primal of a vmapped jvp: it stays unbatched
    out = linear_call_p.bind(*args, callee=callee, transpose_thunk=transpose_thunk,
                             num_callee_consts=num_callee_consts, num_res=num_res)
    return out, [None] * len(out)
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


def _linear_call_jvp(primals, tangents, *, callee, transpose_thunk, num_callee_consts, num_res):
  """``f(res, lin)`` is linear in ``lin`` only, so its tangent is ``f(res, lin_dot)`` (the same
  ``linear_call``, still transposed by the given transpose) plus the jvp of ``f`` in the
  residuals at fixed ``lin`` (JAX's own rule asserts the residuals have no tangent).

  The same call is re-bound only when every linear input has a tangent: a zero one would be a
  constant linear input, which ``linear_call``'s transpose rule rejects. Otherwise the linear
  term joins the plain jvp (symbolic zeros, no zero arrays). The jvp terms are ordinary
  operations of ``f``: transposing them (reverse over reverse) needs ``f`` to be
  reverse-differentiable.
  """
  params = dict(callee=callee, transpose_thunk=transpose_thunk, num_callee_consts=num_callee_consts,
                num_res=num_res)
  out = linear_call_p.bind(*primals, **params)
  n = num_callee_consts + num_res
  nonzero = [type(t) is not ad_util.Zero for t in tangents]
  terms = []
  if all(nonzero[n:]):
    terms.append(linear_call_p.bind(*primals[:n], *tangents[n:], **params))
    nonzero[n:] = [False] * (len(primals) - n)
  if any(nonzero):
    f = core.jaxpr_as_fun(callee)

    def sub(*xs):
      it = iter(xs)
      return f(*(next(it) if k else x for x, k in zip(primals, nonzero)))
    pick = lambda xs: tuple(x for x, k in zip(xs, nonzero) if k)
    terms.append(jax.jvp(sub, pick(primals), pick(tangents))[1])
  if not terms:
    return out, [ad_util.Zero(a.to_tangent_aval()) for a in callee.out_avals]
  return out, [sum(ts[1:], ts[0]) for ts in zip(*terms)]


if linear_call_p not in batching.fancy_primitive_batchers:
  batching.fancy_primitive_batchers[linear_call_p] = _linear_call_batch
ad.primitive_jvps[linear_call_p] = _linear_call_jvp
