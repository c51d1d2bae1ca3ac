"""jax.jvp through the reverse-mode-only kernels (with_forward_mode), in interpret mode."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from probjax.nn.layers.attention import dot_product_attention, flex_attention
from probjax.ops.attention import masks as M
from probjax.ops.attention.autodiff import with_forward_mode
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
