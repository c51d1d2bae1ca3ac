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

Under ``jax.jvp`` (and ``jax.jacfwd``, ``jax.vmap`` of either) a backend with a fused forward
+ JVP kernel computes the primal and the tangent in that one kernel: the rule binds
:data:`primal_and_tangent_p`, which runs the fused kernel as it is evaluated or lowered, and
becomes the formulation above (the forward kernel for the primal, the ``linear_call`` for the
tangent) wherever JAX splits it into a known primal and an unknown tangent (``jax.grad``,
``jax.linearize``, ``jax.checkpoint``, control flow) or differentiates it again. An opaque
kernel's tangent can be neither partially evaluated apart from its primal nor transposed, so
reverse mode must never see the fused call; the primitive's partial-evaluation rules are where
the two formulations part.

``linear_call`` needs rules JAX 0.11.2 lacks (its callee's ordered effects under ``jax.jit``,
batching, JVP in its residuals): :mod:`probjax.core.jax_patches`, applied on import here.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
from jax.custom_derivatives import SymbolicZero, linear_call
from jax.extend import core as jex_core
from jax.interpreters import ad, batching, mlir
from jax.interpreters import partial_eval as pe

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
      None: ``exact``'s jvp. With a ``primal_and_tangent`` attribute (a :class:`FusedTangent`), a
      jvp takes its primal from the same kernel call (:func:`primal_and_tangent`) and runs no
      forward kernel.
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

  def split(q, k, v, aux, dots):
    """``(out, J dots)``: the kernel's forward (with residuals) and the ``linear_call``, the
    formulation reverse mode partially evaluates and transposes."""
    stopped = tuple(map(jax.lax.stop_gradient, (q, k, v)))
    out, vjp_fn = jax.vjp(lambda q, k, v: differentiated(q, k, v, aux), *stopped)
    return tie(out, vjp_fn, q, k, v, aux), linearized(q, k, v, aux, vjp_fn, dots)

  pair = getattr(fused_tangent, "primal_and_tangent", None)

  @jax.custom_jvp
  def f(q, k, v, aux):
    return fast(q, k, v, aux)

  def f_jvp(primals, tangents):
    q, k, v, aux = primals
    if pair is None:
      return split(q, k, v, aux, tangents[:3])
    return primal_and_tangent(pair, split, q, k, v, aux, tangents[:3])

  f.defjvp(f_jvp, symbolic_zeros=True)
  return f


# --- One fused kernel for a jvp's primal and tangent -------------------------------------------

@dataclasses.dataclass(frozen=True, eq=False)
class _Flat:
  """A function of the flat operands ``q, k, v, *aux leaves, *present tangents`` (a primitive
  parameter: compared by identity)."""

  fn: Callable
  name: str

  def __call__(self, *args):
    return self.fn(*args)

  def __repr__(self):
    return self.name


primal_and_tangent_p = jex_core.Primitive("attention_primal_and_tangent")
primal_and_tangent_p.multiple_results = True


def primal_and_tangent(pair: Callable, split: Callable, q, k, v, aux, dots):
  """``(out, J dots)`` of attention, one fused kernel call where it is evaluated or lowered.

  ``pair(q, k, v, aux, q_dot, k_dot, v_dot) -> (out, out_dot)`` is the fused kernel and
  ``split(q, k, v, aux, dots) -> (out, out_dot)`` the same values from the forward kernel and the
  ``linear_call`` (a None or symbolic-zero dot: zero). Symbolic zeros stay symbolic (they are not
  operands), so reverse mode's ``split`` sees the same tangents as without the fused kernel."""
  leaves, treedef = jax.tree.flatten(aux)
  present = tuple(not _zero(d) for d in dots)
  n = 3 + len(leaves)

  def unflat(args):
    it = iter(args[n:])
    full = tuple(next(it) if p else None for p in present)
    return args[0], args[1], args[2], jax.tree.unflatten(treedef, args[3:n]), full

  def fused_fn(*args):
    q, k, v, aux, full = unflat(args)
    full = tuple(jnp.zeros(x.shape, x.dtype) if d is None else d for d, x in zip(full, (q, k, v)))
    return tuple(pair(q, k, v, aux, *full))

  def split_fn(*args):
    q, k, v, aux, full = unflat(args)
    return tuple(split(q, k, v, aux, full))

  args = (q, k, v, *leaves, *(d for d in dots if not _zero(d)))
  out, out_dot = _bind(args, _Flat(fused_fn, "fused"), _Flat(split_fn, "split"), n)
  return out, out_dot


def _bind(args, fused: _Flat, split: _Flat, num_primals: int):
  avals = [_spec(x) for x in args]
  jaxpr = jax.make_jaxpr(fused)(*avals)
  return primal_and_tangent_p.bind(*args, jaxpr=jaxpr, fused=fused, split=split,
                                   num_primals=num_primals)


def _spec(x):
  return _spec_aval(jax.typeof(x))


def _impl(*args, jaxpr, **_):
  return jex_core.jaxpr_as_fun(jaxpr)(*args)


primal_and_tangent_p.def_impl(_impl)
primal_and_tangent_p.def_effectful_abstract_eval(lambda *_, jaxpr, **__: (jaxpr.out_avals, jaxpr.effects))
mlir.register_lowering(primal_and_tangent_p, mlir.lower_fun(_impl, multiple_results=True))


def _jvp_rule(primals, tangents, *, split, num_primals, **_):
  """A derivative of the pair (jvp of a jvp, reverse over forward): ``split``'s, whose tangent
  is the ``linear_call`` of the first derivative, differentiable in its residuals."""
  some = [type(t) is not ad.Zero for t in tangents]
  some[3:num_primals] = [False] * (num_primals - 3)  # the mask's arrays: not differentiated
  idx = [i for i, s in enumerate(some) if s]

  def g(*xs):
    full = list(primals)
    for i, x in zip(idx, xs):
      full[i] = x
    return split(*full)
  return jax.jvp(g, tuple(primals[i] for i in idx), tuple(tangents[i] for i in idx))


ad.primitive_jvps[primal_and_tangent_p] = _jvp_rule


def _batch_rule(args, dims, *, fused, split, num_primals, **_):
  in_axes = tuple(dims)  # None: not batched
  vmapped = lambda f: _Flat(jax.vmap(f.fn, in_axes=in_axes), f.name)
  out, out_dot = _bind(args, vmapped(fused), vmapped(split), num_primals)
  if all(d is None for d in in_axes[:num_primals]):
    # Only tangents batched (jax.jacfwd): the primal is the same in every row, and unbatched.
    return [out[0], out_dot], [None, 0]
  return [out, out_dot], [0, 0]


batching.primitive_batchers[primal_and_tangent_p] = _batch_rule


def _partial_eval(trace, *tracers, jaxpr, fused, split, num_primals):
  """Known primals and unknown tangents (linearization): ``split`` on the trace, so the primal is
  known (the forward kernel) and the tangent the ``linear_call`` reverse mode transposes."""
  known = [t.pval.is_known() for t in tracers]
  if all(known) or not all(known[:num_primals]):
    return trace.default_process_primitive(
        primal_and_tangent_p, tracers, dict(jaxpr=jaxpr, fused=fused, split=split, num_primals=num_primals))
  with jex_core.set_current_trace(trace):
    outs = split(*tracers)
  return [trace.to_jaxpr_tracer(o) for o in outs]


pe.custom_partial_eval_rules[primal_and_tangent_p] = _partial_eval


def _partial_eval_jaxpr_custom(saveable, unks_in, inst_in, eqn):
  """The same split for partial evaluation of jaxprs (``jax.checkpoint``): the eqn becomes a call
  of ``split`` (known primals) or of the fused kernel's jaxpr, which that rule splits."""
  n_out = len(eqn.outvars)
  if not any(unks_in):
    return eqn, None, [False] * n_out, [False] * n_out, []
  params = eqn.params
  if any(unks_in[:params["num_primals"]]):
    call = params["jaxpr"]
  else:
    call = jax.make_jaxpr(params["split"])(*[_spec_aval(v.aval) for v in eqn.invars])
  closed_call_p = jex_core.primitives.closed_call_p
  new = eqn.replace(primitive=closed_call_p, params=dict(call_jaxpr=call), effects=call.effects)
  return pe.partial_eval_jaxpr_custom_rules[closed_call_p](saveable, unks_in, inst_in, new)


def _spec_aval(a):
  return jax.ShapeDtypeStruct(a.shape, a.dtype, weak_type=getattr(a, "weak_type", False))


pe.partial_eval_jaxpr_custom_rules[primal_and_tangent_p] = _partial_eval_jaxpr_custom


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
  def both(q, k, v, mask, qd, kd, vd):
    return masked_call(kernel.fn, kernel.static, (q, k, v, qd, kd, vd), (Q, KV, KV, Q, KV, KV), mask,
                       (Q, Q, STATS, STATS), partition=kernel.partitioned)[:2]

  def fused(q, k, v, mask, qd, kd, vd):
    return both(q, k, v, mask, qd, kd, vd)[1]

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
  return FusedTangent(f, both)


@dataclasses.dataclass(frozen=True, eq=False)
class FusedTangent:
  """A fused forward + jvp kernel, as :func:`kernel_tangent` returns it: called, the tangent
  ``out_dot`` (differentiable in all six arrays); ``primal_and_tangent(q, k, v, mask, q_dot, k_dot,
  v_dot) -> (out, out_dot)``, the kernel's two outputs, which :func:`with_forward_mode` takes as a
  jvp's primal and tangent (:func:`primal_and_tangent`)."""

  tangent: Callable
  primal_and_tangent: Callable

  def __call__(self, q, k, v, mask, qd, kd, vd):
    return self.tangent(q, k, v, mask, qd, kd, vd)


def _zero(t) -> bool:
  return t is None or isinstance(t, SymbolicZero)
