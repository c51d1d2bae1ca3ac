"""Forward-mode AD for reverse-mode-only kernels.

The GPU kernels (Triton, cuDNN) define a ``custom_vjp``, which ``jax.jvp``
cannot differentiate. :func:`with_forward_mode` wraps such a kernel in a
``jax.custom_jvp`` whose tangent is a ``linear_call``: its forward function is
the jvp of an exact reference formulation (the XLA path), and its transpose is
the kernel's own vjp. So ``jax.grad`` still runs the kernel's backward (same
residuals, same cost) and ``jax.jvp`` becomes exact instead of an error.
Second derivatives (``jax.jvp`` of ``jax.grad``, ``jax.grad`` of ``jax.grad`` or of ``jax.jvp``)
are exact too: the kernel's output and vjp, computed at stopped inputs, get their derivatives
in the inputs from the tangent and from the exact formulation.

``linear_call`` needs rules JAX 0.11.2 lacks (its callee's ordered effects under ``jax.jit``,
batching, JVP in its residuals): :mod:`probjax.core.jax_patches`, applied on import here.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from jax.custom_derivatives import SymbolicZero, linear_call

from probjax.core import jax_patches
from probjax.ops.attention.sharding import KV, Q, STATS, masked_call

jax_patches.apply()  # linear_call: the callee's ordered effects under jit, vmap, jvp in residuals


def with_forward_mode(fast: Callable, exact: Callable, grad: Callable | None = None,
                      fused_tangent: Callable | None = None) -> Callable:
  """``f(q, k, v, aux)`` computed by ``fast``, differentiable in both modes and to second order.

  Args:
    fast: ``fast(q, k, v, aux) -> out``, differentiable in reverse mode (its vjp is
      used for ``jax.grad``).
    exact: ``exact(q, k, v, aux) -> out``, the same function, differentiable in
      forward and reverse mode to any order (its jvp gives the tangent, and its derivatives
      those of the kernels' vjp in their inputs).
    grad: another exact implementation of the same function that differentiated calls
      run instead of ``fast`` (forward with residuals and its vjp), where its
      forward + backward is faster than ``fast``'s; None: ``fast``.
    fused_tangent: ``fused_tangent(q, k, v, aux, q_dot, k_dot, v_dot) -> out_dot``, a fused kernel for the
      jvp of ``exact`` (reverse-differentiable in all six arrays, for reverse over forward);
      None: ``exact``'s jvp.
  ``aux`` is a pytree of non-differentiable arrays (e.g. a :class:`Mask`).
  """
  differentiated = fast if grad is None else grad

  def jvp_(q, k, v, aux, dots):
    """``J(q, k, v) dots`` (a None dot: zero)."""
    dots = tuple(jnp.zeros(x.shape, x.dtype) if d is None else d for d, x in zip(dots, (q, k, v)))
    if fused_tangent is not None:
      return fused_tangent(q, k, v, aux, *dots)
    return jax.jvp(lambda q, k, v: exact(q, k, v, aux), (q, k, v), dots)[1]

  def linearized(q, k, v, aux, vjp_fn, dots):
    """``J(q, k, v) dots`` as a ``linear_call``: computed by ``jvp_``, transposed by the kernel's
    vjp (:func:`pullback`). Only non-zero tangents are linear inputs (``linear_call``'s transpose
    takes no constants)."""
    lin = tuple(None if _zero(d) else d for d in dots)
    present = tuple(d is not None for d in lin)

    def tangent(res, lin):
      (q, k, v, aux), _ = res
      return jvp_(q, k, v, aux, lin)

    def transpose(res, ct):
      (q, k, v, aux), vjp_fn = res
      return tuple(g if keep else None for g, keep in zip(pullback(vjp_fn, q, k, v, aux, ct), present))

    return linear_call(tangent, transpose, ((q, k, v, aux), vjp_fn), lin)

  # The kernel's output and vjp are computed from stopped inputs (the kernel's forward and backward
  # have no jvp); these two custom_jvps give them their derivatives in the real inputs: the output's
  # is the linear_call above (a jvp, transposed by the kernel's vjp), the vjp's is the exact
  # formulation's in (q, k, v) and the kernel's vjp (transposed by the jvp) in the cotangent. So
  # jvp of grad, grad of jvp and grad of grad are exact, and each first derivative keeps its kernel.
  @jax.custom_jvp
  def tie(out, vjp_fn, q, k, v, aux):
    """``out``, computed from stopped ``q, k, v``, differentiable in them."""
    return out

  def tie_jvp(primals, tangents):
    out, vjp_fn, q, k, v, aux = primals
    return out, linearized(q, k, v, aux, vjp_fn, tangents[2:5])

  @jax.custom_jvp
  def pullback(vjp_fn, q, k, v, aux, ct):
    """``vjp_fn(ct)``, the kernel's vjp at stopped ``q, k, v``, differentiable in them and ``ct``."""
    return vjp_fn(ct)

  def pullback_jvp(primals, tangents):
    vjp_fn, q, k, v, aux, ct = primals
    dots, ct_dot = tangents[1:4], tangents[5]
    grads = vjp_fn(ct)
    terms = []
    if not _zero(ct_dot):
      # Linear in the cotangent: the kernel's vjp again, whose transpose is the jvp.
      terms.append(linear_call(lambda res, c: res[1](c), lambda res, g: jvp_(*res[0], g),
                               ((q, k, v, aux), vjp_fn), ct_dot))
    some = tuple(not _zero(d) for d in dots)
    if any(some):
      def exact_vjp(*xs):
        it = iter(xs)
        full = tuple(next(it) if s else x for x, s in zip((q, k, v), some))
        return jax.vjp(lambda q, k, v: exact(q, k, v, aux), *full)[1](ct)
      pick = lambda xs: tuple(x for x, s in zip(xs, some) if s)
      terms.append(jax.jvp(exact_vjp, pick((q, k, v)), pick(dots))[1])
    if not terms:
      return grads, tuple(jnp.zeros(g.shape, g.dtype) for g in grads)
    return grads, tuple(sum(ts[1:], ts[0]) for ts in zip(*terms))

  tie.defjvp(tie_jvp, symbolic_zeros=True)
  pullback.defjvp(pullback_jvp, symbolic_zeros=True)

  @jax.custom_jvp
  def f(q, k, v, aux):
    return fast(q, k, v, aux)

  def f_jvp(primals, tangents):
    q, k, v, aux = primals
    stopped = tuple(map(jax.lax.stop_gradient, (q, k, v)))
    out, vjp_fn = jax.vjp(lambda q, k, v: differentiated(q, k, v, aux), *stopped)
    return tie(out, vjp_fn, q, k, v, aux), linearized(q, k, v, aux, vjp_fn, tangents[:3])

  f.defjvp(f_jvp, symbolic_zeros=True)
  return f


def kernel_tangent(kernel, exact: Callable) -> Callable:
  """``f(q, k, v, mask, q_dot, k_dot, v_dot) -> out_dot`` computed by a backend's fused forward +
  jvp pass, for :func:`with_forward_mode`'s ``fused_tangent``.

  Args:
    kernel: a :class:`probjax.ops.attention.vjp.Kernel` whose ``fn(static, q, k, v, q_dot, k_dot,
      v_dot, mask)`` returns ``(out, out_dot [batch, q_len, heads, v_head_dim], lse, lse_dot
      [batch, heads, q_len])`` (``q_dot, k_dot, v_dot`` shaped as ``q [batch, q_len, heads, d]``,
      ``k [batch, kv_len, kv_heads, d]``, ``v [batch, kv_len, kv_heads, v_head_dim]``), run per
      shard of batch and heads where ``kernel.partitioned``.
    exact: ``exact(q, k, v, mask)``, the exact XLA formulation of the same attention.

  ``f`` is linear in the tangents, and differentiable in all six arrays in both modes (reverse
  over forward: MeanFlow, consistency models; forward over forward: the jvp of a jvp) through
  the jvp of ``exact``'s jvp. It is a ``custom_jvp``, not a ``custom_vjp``: JAX cannot take the
  jvp of a ``custom_vjp``, which a jvp of a jvp (or of a Hessian-vector product) through
  :func:`with_forward_mode` needs (its ``linear_call`` differentiates the tangent in its
  residuals). That derivative runs under ``jax.checkpoint``, so reverse mode keeps the six arrays
  as its residuals and recomputes the XLA formulation's intermediates in the backward pass
  (what a ``custom_vjp`` over the same vjp would keep).
  """
  def fused(q, k, v, mask, qd, kd, vd):
    return masked_call(kernel.fn, kernel.static, (q, k, v, qd, kd, vd), (Q, KV, KV, Q, KV, KV), mask,
                       (Q, Q, STATS, STATS), partition=kernel.partitioned)[1]

  @jax.custom_jvp
  def f(q, k, v, mask, qd, kd, vd):
    return fused(q, k, v, mask, qd, kd, vd)

  def f_jvp(primals, tangents):
    q, k, v, mask, qd, kd, vd = primals
    xs, dots = (q, k, v, qd, kd, vd), tangents[:3] + tangents[4:]
    out = fused(*primals)
    some = tuple(not _zero(d) for d in dots)
    if not any(some):
      return out, jnp.zeros(out.shape, out.dtype)
    pick = lambda ys: tuple(y for y, s in zip(ys, some) if s)

    def second(mask, xs, picked):
      """The jvp in the picked arrays of ``(q, k, v, qd, kd, vd) -> exact's tangent``."""
      def tangent(*sel):
        it = iter(sel)
        q, k, v, qd, kd, vd = (next(it) if s else x for x, s in zip(xs, some))
        return jax.jvp(lambda q, k, v: exact(q, k, v, mask), (q, k, v), (qd, kd, vd))[1]
      return jax.jvp(tangent, pick(xs), picked)[1]
    return out, jax.checkpoint(second)(mask, xs, pick(dots))

  f.defjvp(f_jvp, symbolic_zeros=True)
  return f


def _zero(t) -> bool:
  return t is None or isinstance(t, SymbolicZero)
