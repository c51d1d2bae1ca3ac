"""Mamba and Mamba2 blocks: token-by-token decoding, prefill + decoding and a continuation from
a state all equal the full pass; gradients flow into every parameter."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from probjax.core.tolerances import max_error, tolerance
from probjax.nn.layers.mamba import Mamba, Mamba2
from probjax.testing import decode_steps

LENGTH = 11


def layers():
  return {"mamba": lambda **kw: Mamba(d_model=16, d_state=4, rngs=nnx.Rngs(0), **kw),
          "mamba2": lambda **kw: Mamba2(d_model=16, d_state=8, head_dim=8, n_groups=2,
                                        rngs=nnx.Rngs(0), **kw)}


def _x(dtype=jnp.float32):
  return jax.random.normal(jax.random.key(1), (2, LENGTH, 16)).astype(dtype)


full_pass = nnx.jit(lambda layer, x, state=None: layer(x, state))
with_state = nnx.jit(lambda layer, x: layer(x, return_state=True))


# Decoding step by step: one jitted step per position and two full passes (3-5 s of CPU a
# layer); Mamba-1's is slow, Mamba-2's stays in make test.
@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n == "mamba" else n for n in layers()])
def test_decoding_equals_the_full_pass(name):
  layer, x = layers()[name](), _x()
  full = full_pass(layer, x)
  tol = tolerance(jnp.float32)
  assert max_error(decode_steps(layer, x, layer.init_state(2), 0)[0], full) <= tol
  prefix, state = with_state(layer, x[:, :6])
  assert max_error(jnp.concatenate([prefix, decode_steps(layer, x, state, 6)[0]], 1), full) <= tol
  # A continuation from a state runs the scan with an initial state.
  rest = full_pass(layer, x[:, 6:], state)
  assert max_error(jnp.concatenate([prefix, rest], 1), full) <= tol


@pytest.mark.parametrize("name", list(layers()))
def test_gradients_flow(name):
  """Into every parameter, through the chunked scan (the op's tests check its gradients)."""
  layer, x = layers()[name](implementation="chunked", chunk_size=4), _x()
  grads = nnx.jit(nnx.grad(lambda layer: jnp.sum(layer(x) ** 2)))(layer)
  for g in jax.tree.leaves(grads):
    assert np.all(np.isfinite(g)) and np.any(g != 0)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(layers()))
def test_bfloat16_layer(name):
  layer = layers()[name](dtype=jnp.bfloat16)
  x = _x(jnp.bfloat16)
  y = full_pass(layer, x)
  assert y.dtype == jnp.bfloat16 and np.all(np.isfinite(np.asarray(y, np.float32)))
  ref = full_pass(layers()[name](), x.astype(jnp.float32))
  assert max_error(y, ref) <= 5 * tolerance(jnp.bfloat16)  # bf16 projections as well as the scan


@pytest.mark.parametrize("make, match", [
    (lambda: Mamba(d_model=16, d_state=0, rngs=nnx.Rngs(0)), "d_state"),
    (lambda: Mamba(d_model=16, dt_min=0.2, dt_max=0.1, rngs=nnx.Rngs(0)), "dt_min"),
    (lambda: Mamba2(d_model=16, head_dim=12, rngs=nnx.Rngs(0)), "head_dim"),
    (lambda: Mamba2(d_model=16, head_dim=8, n_groups=3, rngs=nnx.Rngs(0)), "n_groups"),
])
def test_bad_arguments(make, match):
  with pytest.raises(ValueError, match=match):
    make()
