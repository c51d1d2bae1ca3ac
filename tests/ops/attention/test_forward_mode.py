"""jax.jvp through the reverse-mode-only kernels (with_forward_mode), in interpret mode."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from probjax.nn.layers.attention import dot_product_attention, flex_attention
from probjax.ops.attention import masks as M
from probjax.ops.attention.autodiff import FusedTangent, with_forward_mode
from probjax.ops.attention.reference import _attention64
from probjax.ops.attention.tolerances import max_error, tolerance
from probjax.ops.attention.backends.triton.config import BackwardConfig, ForwardConfig
from probjax.testing import check_against_reference, make_inputs

CFG = dict(forward_config=ForwardConfig(16, 16, 4, 1), backward_config=BackwardConfig(16, 16, 16, 16, 4, 1))
# Interpret-mode kernels: a stalled run fails loudly (see tests/ops/attention/test_kernel_regressions.py).
pytestmark = pytest.mark.timeout(300, method="thread")


def _triton(mask):
  return lambda q, k, v: flex_attention(q, k, v, mask=mask, implementation="triton", interpret=True,
                                        backward_pass_impl="triton_split", **CFG)


# None: interpret-mode Triton again (about 5 s of CPU), its mask a subset of the other case's.
@pytest.mark.parametrize("mask", [pytest.param(None, marks=pytest.mark.slow),
                                  M.CausalMask() & M.KVLenMask(jnp.array([40, 0]))])
def test_jvp_through_triton_kernel_matches_reference(mask):
  x = make_inputs(0, 2, 40, 40, 4, 2, 16)
  tans = tuple(jax.random.normal(jax.random.key(i), a.shape) for i, a in enumerate((x.q, x.k, x.v)))
  out, got = jax.jvp(_triton(mask), (x.q, x.k, x.v), tans)
  with jax.enable_x64(True):
    up = lambda a: jnp.asarray(np.asarray(a, np.float64))
    ref = lambda q, k, v: _attention64(q, k, v, None, mask, None, None, 16 ** -0.5)
    want_out, want = jax.jvp(ref, tuple(map(up, (x.q, x.k, x.v))), tuple(map(up, tans)))
  assert max_error(out, np.asarray(want_out)) <= tolerance(jnp.float32)
  assert max_error(got, np.asarray(want)) <= tolerance(jnp.float32, grad=True)


def test_grad_still_runs_the_kernel_backward():
  x = make_inputs(1, 2, 40, 40, 4, 2, 16)
  mask = M.LocalWindowMask(7, 0)
  check_against_reference(lambda q, k, v, b: _triton(mask)(q, k, v), x, mask=mask)
  # The transpose is the kernel's own vjp: with an explicit backward the gradient is bitwise
  # the direct kernel's.
  import probjax.ops.attention.backends.triton as pt
  direct = lambda q: pt.attention(q, x.k, x.v, mask=mask, interpret=True, backward_pass_impl="triton_split",
                                  scale=16 ** -0.5, **CFG)
  g1 = jax.grad(lambda q: jnp.sum(_triton(mask)(q, x.k, x.v) * x.do))(x.q)
  g2 = jax.grad(lambda q: jnp.sum(direct(q) * x.do))(x.q)
  np.testing.assert_array_equal(g1, g2)


def test_with_forward_mode_partial_tangents_and_vmap():
  calls = []

  @jax.custom_vjp
  def fast(q, k, v, aux):
    return jnp.tanh(q) * k + v

  def fwd(q, k, v, aux):
    calls.append("fwd")
    return fast(q, k, v, aux), (q, k)

  def bwd(res, ct):
    q, k = res
    return ct * k * (1 - jnp.tanh(q) ** 2), ct * jnp.tanh(q), ct, None

  fast.defvjp(fwd, bwd)
  exact = lambda q, k, v, aux: jnp.tanh(q) * k + v
  f = with_forward_mode(fast, exact)
  q, k, v = (jnp.linspace(-1, 1, 6).reshape(2, 3) + i for i in range(3))
  # reverse mode uses fast's vjp
  g = jax.grad(lambda q: jnp.sum(f(q, k, v, None)))(q)
  np.testing.assert_allclose(g, k * (1 - jnp.tanh(q) ** 2), rtol=1e-6)
  assert "fwd" in calls
  # forward mode in one argument only
  _, t = jax.jvp(lambda k: f(q, k, v, None), (k,), (jnp.ones_like(k),))
  np.testing.assert_allclose(t, jnp.tanh(q), rtol=1e-6)
  # vmap of grad
  gv = jax.vmap(jax.grad(lambda q, k: jnp.sum(f(q, k, v[0], None))))(q, k)
  np.testing.assert_allclose(gv, k * (1 - jnp.tanh(q) ** 2), rtol=1e-6)


def test_with_forward_mode_grad_implementation():
  """``grad``: differentiated calls run it (value and vjp), plain calls run ``fast``, jvp's
  tangent comes from ``exact``. The three differ here by a factor only to tell them apart."""
  fast = lambda q, k, v, aux: q * k + v
  grad = lambda q, k, v, aux: 2.0 * (q * k + v)
  exact = lambda q, k, v, aux: 3.0 * (q * k + v)
  f = with_forward_mode(fast, exact, grad)
  q, k, v = (jnp.linspace(-1, 1, 6).reshape(2, 3) + i for i in range(3))
  np.testing.assert_allclose(f(q, k, v, None), q * k + v)
  value, g = jax.value_and_grad(lambda q: jnp.sum(f(q, k, v, None)))(q)
  np.testing.assert_allclose(value, jnp.sum(2.0 * (q * k + v)), rtol=1e-6)
  np.testing.assert_allclose(g, 2.0 * k, rtol=1e-6)
  _, t = jax.jvp(lambda q: f(q, k, v, None), (q,), (jnp.ones_like(q),))
  np.testing.assert_allclose(t, 3.0 * k, rtol=1e-6)


def _tanh_kernel(bwd_extra):
  """``f = tanh(q) * k + v`` as a custom_vjp "kernel" whose backward also runs
  ``bwd_extra(dq)`` (returning dq), wrapped by with_forward_mode."""
  @jax.custom_vjp
  def fast(q, k, v, aux):
    return jnp.tanh(q) * k + v

  def bwd(res, ct):
    q, k = res
    return bwd_extra(ct * k * (1 - jnp.tanh(q) ** 2)), ct * jnp.tanh(q), ct, None

  fast.defvjp(lambda q, k, v, aux: (fast(q, k, v, aux), (q, k)), bwd)
  return with_forward_mode(fast, lambda q, k, v, aux: jnp.tanh(q) * k + v)


def test_jit_grad_threads_the_backward_s_ordered_effects():
  """A backward with an ordered effect (Pallas Mosaic GPU interpret mode's kernels have one)
  becomes linear_call's transposed callee under jax.grad: linear_call must report the effect,
  or jax.jit lowers the callback without its token (KeyError: OrderedIOEffect)."""
  from jax.experimental import io_callback
  seen = []
  f = _tanh_kernel(lambda dq: io_callback(lambda x: seen.append(1) or x, jax.ShapeDtypeStruct(dq.shape, dq.dtype),
                                          dq, ordered=True))
  q, k, v = (jnp.linspace(-1, 1, 6).reshape(2, 3) + i for i in range(3))
  grad = jax.grad(lambda q: jnp.sum(f(q, k, v, None)))
  np.testing.assert_allclose(jax.jit(grad)(q), k * (1 - jnp.tanh(q) ** 2), rtol=1e-6)
  assert seen == [1]
  assert jax.make_jaxpr(grad)(q).effects  # reported up to the top-level jaxpr


def test_jit_grad_with_a_local_mutable_array_in_the_backward():
  """An array ref created and frozen inside the backward (the fused-dQ Mosaic backward's float32
  accumulator) stays local to linear_call's callee: reporting its effect would ask for a state
  discharge rule that linear_call does not have."""
  def accumulate(dq):
    acc = jax.new_ref(jnp.zeros_like(dq))
    acc[...] += dq
    return jax.freeze(acc)
  f = _tanh_kernel(accumulate)
  q, k, v = (jnp.linspace(-1, 1, 6).reshape(2, 3) + i for i in range(3))
  g = jax.jit(jax.grad(lambda q: jnp.sum(f(q, k, v, None))))(q)
  np.testing.assert_allclose(g, k * (1 - jnp.tanh(q) ** 2), rtol=1e-6)


def _fused_tanh():
  """``f = tanh(q) * k + v`` through with_forward_mode with a fused "kernel" for the primal and
  tangent; each "kernel" is a jit call named as it (``fwd_kernel``, ``pair_kernel``,
  ``tangent_kernel``), which the jaxprs show."""
  exact = lambda q, k, v, aux: jnp.tanh(q) * k + v

  @jax.jit
  def fwd_kernel(q, k, v):
    return exact(q, k, v, None)

  @jax.jit
  def pair_kernel(q, k, v, qd, kd, vd):
    return jax.jvp(lambda q, k, v: exact(q, k, v, None), (q, k, v), (qd, kd, vd))

  @jax.jit
  def tangent_kernel(q, k, v, qd, kd, vd):
    return pair_kernel(q, k, v, qd, kd, vd)[1]

  @jax.custom_vjp
  def fast(q, k, v, aux):
    return fwd_kernel(q, k, v)

  def bwd(res, ct):
    q, k = res
    return ct * k * (1 - jnp.tanh(q) ** 2), ct * jnp.tanh(q), ct, None

  fast.defvjp(lambda q, k, v, aux: (fwd_kernel(q, k, v), (q, k)), bwd)
  pair = lambda q, k, v, aux, *dots: pair_kernel(q, k, v, *dots)
  tangent = lambda q, k, v, aux, *dots: tangent_kernel(q, k, v, *dots)
  return with_forward_mode(fast, exact, None, FusedTangent(tangent, pair)), exact


def _args(n=0):
  q, k, v = (jnp.linspace(-1, 1, 6).reshape(2, 3) + i + n for i in range(3))
  return (q, k, v), tuple(jnp.cos(3 * x) for x in (q, k, v))


def test_fused_pair_computes_a_jvp_alone():
  """A jvp's primal and tangent are the fused call's (no forward kernel, no tangent-only call),
  eager, under jit, vmap and jacfwd; jax.grad never runs it."""
  f, exact = _fused_tanh()
  (q, k, v), tans = _args()
  close = lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
  want = jax.jvp(lambda q, k, v: exact(q, k, v, None), (q, k, v), tans)
  fj = lambda p, t: jax.jvp(lambda q, k, v: f(q, k, v, None), p, t)
  for run in (fj, jax.jit(fj)):
    jax.tree.map(close, run((q, k, v), tans), want)
  kernels = lambda fn, *a: re.findall(r"name=(\w+_kernel)", str(jax.make_jaxpr(fn)(*a)))
  assert kernels(fj, (q, k, v), tans) == ["pair_kernel"]
  # only q's tangent: the others are symbolic zeros, not operands
  _, t = jax.jvp(lambda q: f(q, k, v, None), (q,), (tans[0],))
  close(t, tans[0] * k * (1 - jnp.tanh(q) ** 2))
  both = lambda a: jnp.stack([a, a + 0.5])
  got = jax.vmap(fj)(jax.tree.map(both, (q, k, v)), jax.tree.map(both, tans))
  jax.tree.map(close, got, jax.vmap(lambda p, t: jax.jvp(lambda q, k, v: exact(q, k, v, None), p, t))(
      jax.tree.map(both, (q, k, v)), jax.tree.map(both, tans)))
  # jacfwd: only the tangents batched, the primal unbatched
  close(jax.jacfwd(lambda q: f(q, k, v, None))(q), jax.jacfwd(lambda q: exact(q, k, v, None))(q))
  assert kernels(jax.vmap(fj), *jax.tree.map(both, ((q, k, v), tans))) == ["pair_kernel"]
  assert kernels(jax.jacfwd(lambda q: f(q, k, v, None)), q) == ["pair_kernel"]
  loss = lambda attn: lambda q, k: jnp.sum(jnp.sin(attn(q, k, v, None)))
  g = jax.grad(loss(f), argnums=(0, 1))(q, k)
  jax.tree.map(close, g, jax.grad(loss(exact), argnums=(0, 1))(q, k))
  assert kernels(jax.grad(loss(f), argnums=(0, 1)), q, k) == ["fwd_kernel"]


def test_fused_pair_splits_for_reverse_mode():
  """Wherever JAX splits a jvp into a known primal and an unknown tangent (linearize, grad under
  jit, checkpoint, scan, cond) or differentiates it again (jvp of jvp, grad of jvp, jvp of grad),
  the fused call becomes the forward + linear_call formulation: values are exact's."""
  f, exact = _fused_tanh()
  (q, k, v), tans = _args(1)
  close = lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)

  def cases(attn):
    a = lambda q, k: attn(q, k, v, None)
    loss = lambda q, k: jnp.sum(jnp.sin(a(q, k)))
    out = {}
    out["linearize"] = jax.linearize(lambda q: a(q, k), q)[1](tans[0])
    out["jit_grad"] = jax.jit(jax.grad(loss, argnums=(0, 1)))(q, k)
    out["remat_grad"] = jax.grad(lambda q: jnp.sum(jnp.sin(jax.checkpoint(lambda q: a(q, k))(q))))(q)

    def body(c, _):
      return jnp.tanh(a(c, k)), None
    out["scan_grad"] = jax.grad(lambda q: jnp.sum(jax.lax.scan(body, q, length=2)[0]))(q)
    out["cond_grad"] = jax.grad(lambda q: jnp.sum(jax.lax.cond(True, lambda q: a(q, k), lambda q: q, q)))(q)
    inner = lambda q, k: jax.jvp(a, (q, k), tans[:2])
    out["jvp_of_jvp"] = jax.jvp(lambda q: inner(q, k), (q,), (tans[2],))
    meanflow = lambda q, k: jnp.sum(jnp.tanh(inner(q, k)[0]) * inner(q, k)[1]) + jnp.sum(inner(q, k)[1] ** 2)
    out["grad_of_jvp"] = jax.grad(meanflow, argnums=(0, 1))(q, k)
    out["jit_grad_of_jvp"] = jax.jit(jax.grad(meanflow, argnums=(0, 1)))(q, k)
    out["grad_of_jit_jvp"] = jax.grad(jax.jit(meanflow), argnums=(0, 1))(q, k)
    out["grad_of_remat_jvp"] = jax.grad(lambda q: jnp.sum(jax.checkpoint(lambda q: inner(q, k)[1])(q) ** 2))(q)
    out["jvp_of_grad"] = jax.jvp(jax.grad(lambda q: loss(q, k)), (q,), (tans[0],))
    out["vmap_grad_of_jvp"] = jax.vmap(jax.grad(lambda q: jnp.sum(inner(q, k)[1] ** 2)))(jnp.stack([q, q + 1]))
    return out

  got, want = cases(f), cases(exact)
  for name in want:
    jax.tree.map(close, got[name], want[name])


def test_fused_pair_inside_checkpoint_stays_fused():
  """A jvp inside jax.checkpoint, differentiated in an argument it does not depend on, keeps the
  fused call: the rule for partially evaluating jaxprs leaves known calls whole."""
  f, exact = _fused_tanh()
  (q, k, v), tans = _args(2)

  def loss(attn, w):
    o, t = jax.checkpoint(lambda q: jax.jvp(lambda q: attn(q, k, v, None), (q,), (tans[0],)))(q)
    return jnp.sum(w * o * t)
  g = jax.grad(lambda w: loss(f, w))(jnp.ones_like(q))
  np.testing.assert_allclose(g, jax.grad(lambda w: loss(exact, w))(jnp.ones_like(q)), rtol=1e-5)
