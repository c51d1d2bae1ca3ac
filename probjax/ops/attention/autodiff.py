"""Forward-mode AD for reverse-mode-only kernels.

The GPU kernels (Triton, cuDNN) define a ``custom_vjp``, which ``jax.jvp``
cannot differentiate. :func:`with_forward_mode` wraps such a kernel in a
``jax.custom_jvp`` whose tangent is a ``linear_call``: its forward function is
the jvp of an exact reference formulation (the XLA path), and its transpose is
the kernel's own vjp. So ``jax.grad`` still runs the kernel's backward (same
residuals, same cost) and ``jax.jvp`` becomes exact instead of an error.

JAX 0.11.2's ``linear_call`` reports none of its callee's effects. The transpose (the
kernel's vjp) becomes a ``linear_call`` callee under ``jax.grad``, and in Pallas Mosaic GPU
interpret mode the kernels carry an ordered effect (the interpreter serialises kernels through
ordered host callbacks): under ``jax.jit`` no token was threaded to them and lowering failed
(``KeyError: OrderedIOEffect``). :func:`_linear_call_abstract_eval` reports the callee's
ordered effects, so ``jit`` threads their token through the call.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from jax._src import effects
from jax._src.custom_derivatives import linear_call_p
from jax.custom_derivatives import SymbolicZero, linear_call

from probjax.ops.attention.xla import _linear_call_batching  # noqa: F401  (vmap of linear_call)


def _linear_call_abstract_eval(*args, callee, **params):
  """``linear_call``'s output types and its callee's ordered effects, which need a token
  wherever the call is lowered. Not the others: an internal mutable array's effect is local
  to the callee (its lowering discharges it), and ``linear_call`` has no state discharge rule
  that reporting it would call for."""
  del args, params
  return callee.out_avals, set(effects.ordered_effects.filter_in(callee.effects))


linear_call_p.def_effectful_abstract_eval(_linear_call_abstract_eval)


def with_forward_mode(fast: Callable, exact: Callable, grad: Callable | None = None) -> Callable:
  """``f(q, k, v, aux)`` computed by ``fast``, differentiable in both modes.

  Args:
    fast: ``fast(q, k, v, aux) -> out``, differentiable in reverse mode (its vjp is
      used for ``jax.grad``).
    exact: ``exact(q, k, v, aux) -> out``, the same function, differentiable in
      forward mode (its jvp gives the tangent).
    grad: another exact implementation of the same function that differentiated calls
      run instead of ``fast`` (forward with residuals and its vjp), where its
      forward + backward is faster than ``fast``'s; None: ``fast``.
  ``aux`` is a pytree of non-differentiable arrays (e.g. a :class:`Mask`).
  """
  differentiated = fast if grad is None else grad

  @jax.custom_jvp
  def f(q, k, v, aux):
    return fast(q, k, v, aux)

  def f_jvp(primals, tangents):
    q, k, v, aux = primals
    out, vjp_fn = jax.vjp(lambda q, k, v: differentiated(q, k, v, aux), q, k, v)
    # Only non-zero tangents are linear inputs (linear_call's transpose takes no constants).
    lin = tuple(None if isinstance(t, SymbolicZero) else t for t in tangents[:3])
    present = tuple(t is not None for t in lin)

    def tangent(res, lin):
      (q, k, v, aux), _ = res
      lin = tuple(jnp.zeros(x.shape, x.dtype) if t is None else t for t, x in zip(lin, (q, k, v)))
      return jax.jvp(lambda q, k, v: exact(q, k, v, aux), (q, k, v), lin)[1]

    def transpose(res, ct):
      _, vjp_fn = res
      return tuple(g if keep else None for g, keep in zip(vjp_fn(ct), present))

    return out, linear_call(tangent, transpose, ((q, k, v, aux), vjp_fn), lin)

  f.defjvp(f_jvp, symbolic_zeros=True)
  return f
