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


def _same_params(a, b):
  sa, sb = nnx.state(a, nnx.Param), nnx.state(b, nnx.Param)
  assert jax.tree.structure(sa) == jax.tree.structure(sb)
  for u, v in zip(jax.tree.leaves(sa), jax.tree.leaves(sb)):
    np.testing.assert_array_equal(u, v)


@pytest.mark.parametrize("mamba_ssm, probjax", [
    (lambda: Mamba(16, d_state=4, d_conv=3, expand=2, dt_rank="auto", bias=True, conv_bias=False,
                   use_fast_path=False, layer_idx=3, device=None, rngs=nnx.Rngs(0)),
     lambda: Mamba(d_model=16, d_state=4, d_conv=3, expand=2, dt_rank=None, use_bias=True,
                   conv_bias=False, rngs=nnx.Rngs(0))),
    (lambda: Mamba2(16, d_state=8, d_conv=4, expand=2, headdim=8, ngroups=2, bias=True,
                    rmsnorm=True, norm_before_gate=False, D_has_hdim=False, d_ssm=None,
                    dt_limit=(0.0, float("inf")), use_mem_eff_path=True, layer_idx=0, rngs=nnx.Rngs(0)),
     lambda: Mamba2(d_model=16, d_state=8, d_conv=4, expand=2, head_dim=8, n_groups=2,
                    use_bias=True, rngs=nnx.Rngs(0))),
])
def test_mamba_ssm_spellings_map_to_probjax_names(mamba_ssm, probjax):
  """mamba_ssm's constructor spellings build the layer that probjax's names build: the same
  configuration and the same parameters (values, from the same rngs)."""
  a, b = mamba_ssm(), probjax()
  for name in ("d_model", "d_inner", "d_conv", "dt_rank", "head_dim", "n_groups", "heads"):
    assert getattr(a, name, None) == getattr(b, name, None), name
  assert (a.in_proj.bias is None) == (b.in_proj.bias is None) == False  # noqa: E712 (bias=True)
  _same_params(a, b)
  np.testing.assert_array_equal(full_pass(a, _x()), full_pass(b, _x()))


@pytest.mark.parametrize("make, error, match", [
    (lambda: Mamba2(d_model=16, head_dim=8, headdim=8, rngs=nnx.Rngs(0)), TypeError, "head_dim.*headdim"),
    (lambda: Mamba2(d_model=16, n_groups=1, ngroups=1, rngs=nnx.Rngs(0)), TypeError, "n_groups.*ngroups"),
    (lambda: Mamba(d_model=16, use_bias=False, bias=True, rngs=nnx.Rngs(0)), TypeError, "use_bias.*bias"),
    (lambda: Mamba(d_model=16, headdim=8, rngs=nnx.Rngs(0)), TypeError, "headdim"),
    (lambda: Mamba(d_model=16, dt_rank="full", rngs=nnx.Rngs(0)), ValueError, "dt_rank"),
    (lambda: Mamba(rngs=nnx.Rngs(0)), TypeError, "d_model"),
    (lambda: Mamba2(d_model=16, head_dim=8, rmsnorm=False, rngs=nnx.Rngs(0)), ValueError, "rmsnorm"),
    (lambda: Mamba2(d_model=16, head_dim=8, norm_before_gate=True, rngs=nnx.Rngs(0)), ValueError,
     "norm_before_gate"),
])
def test_mamba_ssm_spelling_errors(make, error, match):
  with pytest.raises(error, match=match):
    make()
