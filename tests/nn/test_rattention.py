"""RAttention: token-by-token decoding (window ring buffer + linear state) and prefill +
decoding equal the full pass; the linear branch is the op's, the window branch attention's."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from probjax.core.tolerances import max_error, tolerance
from probjax.nn.layers.attention import LocalWindowMask, dot_product_attention
from probjax.nn.layers.rattention import RAttention
from probjax.ops.scan import residual_linear_attention
from probjax.testing import decode_steps

LENGTH = 13


def _layer(**kw):
  kw = {"num_heads": 4, "num_kv_heads": 2, "in_features": 16, "window_size": 3, **kw}
  return RAttention(**kw, rngs=nnx.Rngs(0))


def _x():
  return jax.random.normal(jax.random.key(1), (2, LENGTH, 16))


with_state = nnx.jit(lambda layer, x: layer(x, return_state=True))


# Decoding step by step (a jitted step per position and full passes): make test keeps one
# configuration; the default and the GQA window are slow.
@pytest.mark.parametrize("kw", [pytest.param({}, marks=pytest.mark.slow), {"window_size": 0, "feature_map": "relu"},
                                pytest.param({"window_size": 20, "num_kv_heads": 1}, marks=pytest.mark.slow)])
def test_decoding_equals_the_full_pass(kw):
  layer, x = _layer(**kw), _x()
  full, end = with_state(layer, x)
  tol = tolerance(jnp.float32)
  steps, state = decode_steps(layer, x, layer.init_state(2), 0)
  assert max_error(steps, full) <= tol
  np.testing.assert_allclose(state.linear, end.linear, rtol=1e-5, atol=1e-5)
  prefix, state = with_state(layer, x[:, :5])
  assert max_error(jnp.concatenate([prefix, decode_steps(layer, x, state, 5)[0]], 1), full) <= tol


def test_branches():
  """The layer is RMSNorm(window attention) + RMSNorm(linear branch), then the out-projection."""
  layer, x = _layer(), _x()

  @nnx.jit
  def by_hand(layer, x):
    q, k, v = layer._project(x)
    window = dot_product_attention(q, k, v, mask=LocalWindowMask(3, 0))
    linear = residual_linear_attention(q, k, v, window_size=3)
    o = layer.window_norm(window) + layer.linear_norm(linear)
    return layer.out(o.reshape(2, LENGTH, -1))

  np.testing.assert_allclose(with_state(layer, x)[0], by_hand(layer, x), rtol=1e-5, atol=1e-5)


def test_gradients_flow():
  layer, x = _layer(), _x()
  grads = nnx.jit(nnx.grad(lambda layer: jnp.sum(layer(x) ** 2)))(layer)
  for g in jax.tree.leaves(grads):
    assert np.all(np.isfinite(g)) and np.any(g != 0)


@pytest.mark.parametrize("kw, match", [({"window_size": -1}, "window_size"),
                                        ({"num_kv_heads": 3}, "num_kv_heads"),
                                        ({"feature_map": "elu"}, "feature_map"),
                                        ({"in_features": 18}, "in_features")])
def test_bad_arguments(kw, match):
  with pytest.raises(ValueError, match=match):
    _layer(**kw)
