"""Rules probjax registers on JAX's ``linear_call`` primitive, applied by :func:`apply`.

JAX 0.11.2 and 0.12 ship ``jax.custom_derivatives.linear_call`` with

* an abstract eval that reports none of its callee's effects. A kernel's vjp becomes a
  ``linear_call`` callee under ``jax.grad`` (:mod:`probjax.ops.attention.autodiff`), and in
  Pallas Mosaic GPU interpret mode the kernels carry an ordered effect (the interpreter
  serialises kernels through ordered host callbacks): under ``jax.jit`` no token was threaded
  to them and lowering failed (``KeyError: OrderedIOEffect``);
* no batching rule, so ``jax.vmap`` over the XLA flash path's reverse or forward derivative
  failed;
* a JVP rule that asserts the residuals have no tangent, so any second derivative
  (``jax.jvp(jax.grad(f))``, ``jax.hessian``, ``jax.grad(jax.grad(f))``) failed with a bare
  AssertionError, and that fails on a tangent in only some of the linear inputs.

:func:`apply` registers the three rules once (a second call does nothing); the modules whose
calls need them (the attention autodiff wrapper, the XLA flash path, RLA's chunked form in
``ops/scan/chunked_math.py``) call it on import.

Scope: the rules are JAX's primitive's, so they hold for every ``linear_call`` in the process
once probjax's attention or scan room is imported, not only probjax's. They change no call that
JAX computes without them: where JAX's rules apply (no ordered effect in the callee, no batching, every
linear input with a tangent and none in the residuals) the abstract eval, the JVP and the
transpose are JAX's own, and the values, jvp, transposes and gradients are the same with and
without the import (``tests/core/test_jax_patches.py`` runs a plain ``linear_call`` both ways). The
calls JAX rejects (``vmap``; a tangent in the residuals; a jvp or gradient in only some linear
inputs; an ordered effect under ``jax.jit``) compute instead, with the user's ``fun_transpose``
as the transpose of the linear part.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.custom_derivatives import linear_call

from probjax.core.compat import ad, ad_util, batching, core, effects, linear_call_p

_applied = False


def apply() -> None:
  """Registers ``linear_call``'s abstract eval (callee's ordered effects), batching rule
  (unless JAX has one) and JVP rule. Idempotent."""
  global _applied
  if _applied:
    return
  linear_call_p.def_effectful_abstract_eval(_linear_call_abstract_eval)
  if linear_call_p not in batching.fancy_primitive_batchers:
    batching.fancy_primitive_batchers[linear_call_p] = _linear_call_batch
  ad.primitive_jvps[linear_call_p] = _linear_call_jvp
  _applied = True


def _linear_call_abstract_eval(*args, callee, **params):
  """``linear_call``'s output types and its callee's ordered effects, which need a token
  wherever the call is lowered. Not the others: an internal mutable array's effect is local
  to the callee (its lowering discharges it), and ``linear_call`` has no state discharge rule
  that reporting it would call for."""
  del args, params
  return callee.out_avals, set(effects.ordered_effects.filter_in(callee.effects))


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

  The same call is re-bound when every linear input has a tangent (JAX's rule). Where some have
  none (a symbolic zero), a zero would be a constant linear input, which ``linear_call``'s
  transpose rule rejects: the linear term is then a ``linear_call`` of ``f`` restricted to the
  inputs that have one (zeros in the others), transposed by the given transpose's cotangents
  for those inputs (:func:`_linear_call_of_some`), so the given transpose stays the transpose,
  whichever inputs are differentiated. The residuals' term is an ordinary jvp of ``f``:
  transposing it (reverse over reverse) needs ``f`` to be reverse-differentiable.
  """
  params = dict(callee=callee, transpose_thunk=transpose_thunk, num_callee_consts=num_callee_consts,
                num_res=num_res)
  out = linear_call_p.bind(*primals, **params)
  n = num_callee_consts + num_res
  nonzero = [type(t) is not ad_util.Zero for t in tangents]
  terms = []
  if all(nonzero[n:]):  # JAX's own rule, where it applies
    terms.append(linear_call_p.bind(*primals[:n], *tangents[n:], **params))
  elif any(nonzero[n:]):
    terms.append(_linear_call_of_some(primals[:n], tangents[n:], nonzero[n:], callee, transpose_thunk,
                                      num_callee_consts))
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


def _linear_call_of_some(res, lin_dots, some, callee, transpose_thunk, num_callee_consts):
  """``f(res, lin_dots)`` with zeros for the linear inputs not in ``some``, as a ``linear_call``
  in the others, whose transpose is the given transpose's cotangents for them."""
  f = core.jaxpr_as_fun(callee)
  avals = callee.in_avals[len(res):]

  def full(lin):
    it = iter(lin)
    return [next(it) if k else jnp.zeros(a.shape, a.dtype) for a, k in zip(avals, some)]

  def fun(res, lin):
    return f(*res, *full(lin))

  def fun_t(res, cts):
    t, t_consts = transpose_thunk()
    outs = core.jaxpr_as_fun(t)(*t_consts, *res[num_callee_consts:], *cts)
    return [o for o, k in zip(outs, some) if k]

  return linear_call(fun, fun_t, list(res), [t for t, k in zip(lin_dots, some) if k])
