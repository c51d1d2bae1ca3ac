"""Forward-mode AD for reverse-mode-only kernels.

The GPU kernels (Triton, cuDNN) define a ``custom_vjp``, which ``jax.jvp``
cannot differentiate. :func:`with_forward_mode` wraps such a kernel in a
``jax.custom_jvp`` whose tangent is a ``linear_call``: its forward function is
the jvp of an exact reference formulation (the XLA path), and its transpose is
the kernel's own vjp. So ``jax.grad`` still runs the kernel's backward (same
residuals, same cost) and ``jax.jvp`` becomes exact instead of an error.

``linear_call`` needs rules JAX 0.11.2 lacks (its callee's ordered effects under ``jax.jit``,
batching, JVP in its residuals): :mod:`probjax.core.jax_patches`, applied on import here.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from jax.custom_derivatives import SymbolicZero, linear_call

from probjax.core import jax_patches

jax_patches.apply()  # linear_call: the callee's ordered effects under jit, vmap, jvp in residuals


def with_forward_mode(fast: Callable, exact: Callable, grad: Callable | None = None,
                      fused_tangent: Callable | None = None) -> Callable:
  """``f(q, k, v, aux)`` computed by ``fast``, differentiable in both modes.

  Args:
    fast: ``fast(q, k, v, aux) -> out``, differentiable in reverse mode (its vjp is
      used for ``jax.grad``).
    exact: ``exact(q, k, v, aux) -> out``, the same function, differentiable in
      forward mode (its jvp gives the tangent).
    grad: another exact implementation of the same function that differentiated calls
      run instead of ``fast`` (forward with residuals and its vjp), where its
      forward + backward is faster than ``fast``'s; None: ``fast``.
    fused_tangent: ``fused_tangent(q, k, v, aux, q_dot, k_dot, v_dot) -> out_dot``, a fused kernel for the
      jvp of ``exact`` (reverse-differentiable in all six arrays, for reverse over forward);
      None: ``exact``'s jvp.
  ``aux`` is a pytree of non-differentiable arrays (e.g. a :class:`Mask`).
  """
  differentiated = fast if grad is None else grad

  @jax.custom_jvp
  def f(q, k, v, aux):
    return fast(q, k, v, aux)

  def f_jvp(primals, tangents):
    q, k, v, aux = primals
    # Under an outer jax.grad (reverse over forward) the kernel's forward must not be
    # differentiated (it has no jvp): its residuals come from stopped inputs, and the output's
    # outer gradient is the kernel's own vjp (_tie).
    stopped = tuple(map(jax.lax.stop_gradient, (q, k, v)))
    out, vjp_fn = jax.vjp(lambda q, k, v: differentiated(q, k, v, aux), *stopped)
    out = _tie(out, vjp_fn, q, k, v)
    # Only non-zero tangents are linear inputs (linear_call's transpose takes no constants).
    lin = tuple(None if isinstance(t, SymbolicZero) else t for t in tangents[:3])
    present = tuple(t is not None for t in lin)

    def tangent(res, lin):
      (q, k, v, aux), _ = res
      lin = tuple(jnp.zeros(x.shape, x.dtype) if t is None else t for t, x in zip(lin, (q, k, v)))
      if fused_tangent is not None:
        return fused_tangent(q, k, v, aux, *lin)
      return jax.jvp(lambda q, k, v: exact(q, k, v, aux), (q, k, v), lin)[1]

    def transpose(res, ct):
      _, vjp_fn = res
      return tuple(g if keep else None for g, keep in zip(vjp_fn(ct), present))

    return out, linear_call(tangent, transpose, ((q, k, v, aux), vjp_fn), lin)

  f.defjvp(f_jvp, symbolic_zeros=True)
  return f


@jax.custom_vjp
def _tie(out, vjp_fn, q, k, v):
  """``out`` (computed from stopped ``q, k, v``) with the gradient ``vjp_fn`` gives it in them."""
  return out


def _tie_fwd(out, vjp_fn, q, k, v):
  return out, vjp_fn


def _tie_bwd(vjp_fn, ct):
  none = lambda tree: jax.tree.map(lambda _: None, tree)
  return (None, none(vjp_fn), *vjp_fn(ct))


_tie.defvjp(_tie_fwd, _tie_bwd)
