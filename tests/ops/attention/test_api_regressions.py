"""Regressions of the public API's argument handling: the softmax scale, cuDNN under
interpret mode, and out-of-range mask lengths under ``jax.jit``."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from probjax.nn.layers.attention import KVLenMask, LengthMask, dot_product_attention, flex_attention
from probjax.ops.attention.reference import reference_attention, reference_vjp
from probjax.ops.attention.tolerances import max_error, tolerance
from probjax.testing import make_inputs


@pytest.mark.parametrize("bad, error", [(float("nan"), ValueError), (float("inf"), ValueError),
                                        (-float("inf"), ValueError), ("0.5", TypeError), (True, TypeError),
                                        (np.ones(2), TypeError), (1 + 2j, TypeError)])
def test_scale_rejects_non_finite_and_non_real(bad, error):
  x = make_inputs(0, 1, 16, 16, 2, 1, 8)
  with pytest.raises(error, match="scale"):
    dot_product_attention(x.q, x.k, x.v, scale=bad)


# t: dense, single-tile flash, multi-tile flash; each case compiles its forward and gradient
# (2-3 s of CPU): make test keeps each length once.
@pytest.mark.parametrize("with_bias,t", [
    (b, t) if (b, t) in ((False, 64), (True, 300), (False, 600)) else pytest.param(b, t, marks=pytest.mark.slow)
    for b in (False, True) for t in (64, 300, 600)])
def test_traced_scale_values_and_gradient(t, with_bias):
  x = make_inputs(1, 1, t, t, 2, 1, 16)
  bias = jax.random.normal(jax.random.key(2), (1, 2, t, t)) if with_bias else None
  f = jax.jit(lambda s: dot_product_attention(x.q, x.k, x.v, bias=bias, scale=s))
  out = f(jnp.float32(0.3))
  ref = reference_attention(x.q, x.k, x.v, bias=bias, scale=0.3)
  assert max_error(out, ref) <= tolerance(jnp.float32)
  # d/dscale of <out, do> against central differences of the float64 reference.
  g = jax.grad(lambda s: jnp.vdot(f(s), x.do))(jnp.float32(0.3))
  loss = lambda s: float(np.vdot(reference_attention(x.q, x.k, x.v, bias=bias, scale=s), np.asarray(x.do)))
  fd = (loss(0.3 + 1e-4) - loss(0.3 - 1e-4)) / 2e-4
  assert abs(float(g) - fd) <= 1e-3 * max(1.0, abs(fd))


def test_traced_scale_refused_by_an_explicit_kernel():
  x = make_inputs(0, 1, 128, 128, 2, 1, 16)
  with pytest.raises(ValueError, match="traced scale"):
    jax.jit(lambda s: dot_product_attention(x.q, x.k, x.v, scale=s, implementation="triton",
                                            interpret=True))(0.3)


def test_cudnn_in_interpret_mode_is_a_value_error():
  x = make_inputs(0, 1, 64, 64, 2, 1, 64, jnp.bfloat16)
  with pytest.raises(ValueError, match="cuDNN has no interpret mode"):
    dot_product_attention(x.q, x.k, x.v, implementation="cudnn", interpret=True)


@pytest.mark.parametrize("t", [pytest.param(40, marks=pytest.mark.slow), 300,  # 3-6 s of CPU each
                               pytest.param(600, marks=pytest.mark.slow)])
def test_traced_out_of_range_lengths_are_clamped(t):
  x = make_inputs(3, 2, t, t, 2, 1, 16)
  got = jax.jit(lambda lens: dot_product_attention(x.q, x.k, x.v, mask=KVLenMask(lens)))(jnp.array([-3, t + 25]))
  ref = reference_attention(x.q, x.k, x.v, mask=KVLenMask(jnp.array([0, t])))
  assert max_error(got, ref) <= tolerance(jnp.float32)
  f = jax.jit(lambda q, ql, kl: flex_attention(q, x.k, x.v, mask=LengthMask(ql, kl)))
  out, vjp = jax.vjp(lambda q: f(q, jnp.array([t + 1, -1]), jnp.array([5, t + 7])), x.q)
  ref = reference_vjp(x.q, x.k, x.v, x.do, mask=LengthMask(jnp.array([t, 0]), jnp.array([5, t])))
  assert max_error(out, ref[0]) <= tolerance(jnp.float32)
  assert max_error(vjp(x.do)[0], ref[1]) <= tolerance(jnp.float32, grad=True)


def test_concrete_out_of_range_lengths_raise():
  x = make_inputs(0, 2, 16, 16, 2, 1, 8)
  with pytest.raises(ValueError, match="kv_lengths"):
    dot_product_attention(x.q, x.k, x.v, mask=KVLenMask(jnp.array([-3, 25])))
