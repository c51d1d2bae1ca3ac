"""``qk_norm_rotary`` (attention's per-head q/k RMS norm + RoPE) on the XLA backend and the
Pallas-Triton kernels in interpret mode against the float64 reference: values, the gradients
of x and scale, XLA's jvp; odd seq, a partial row block, each dtype; bad inputs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from probjax.core.tolerances import max_error, tolerance
from probjax.nn.layers.rotary import apply_rotary
from probjax.ops.norm import qk_norm_rotary
from probjax.ops.norm.reference import (reference_qk_norm_rotary, reference_qk_norm_rotary_grads,
                                        reference_qk_norm_rotary_jvp)

# [batch, seq, heads, head_dim]: odd seq; 70 rows of 64 (rows per block 64 for the kernels:
# the second block partial); an odd head_dim (7) for the norm alone.
# Positions below 50: the angles are float32 by definition (as apply_rotary), the reference
# float64; at large positions their rounding, not the op, dominates the difference.
SHAPES = {"small": (2, 5, 3, 10), "blocks": (2, 5, 7, 64)}
ODD_D = (1, 3, 2, 7)
MODES = {"both": (True, True), "norm": (True, False), "rotary": (False, True)}
IMPLS = {"xla": dict(implementation="xla"), "triton": dict(implementation="triton", interpret=True)}


def inputs(shape, mode, dtype, seed=0):
  r = np.random.default_rng(seed)
  norm, rotary = MODES[mode]
  x = jnp.asarray(r.standard_normal(shape), dtype)
  scale = jnp.asarray(1 + 0.2 * r.standard_normal(shape[-1]), dtype) if norm else None
  positions = jnp.asarray(r.integers(0, 50, shape[:2]), jnp.int32) if rotary else None
  return x, scale, positions


CASES = ([("xla", s, m, dt) for s in SHAPES for m in MODES for dt in ("float32", "bfloat16", "float16")] +
         [("triton", s, m, "float32") for s in SHAPES for m in MODES] + [("triton", "blocks", "both", "bfloat16")] +
         [(impl, "odd_d", "norm", "float32") for impl in IMPLS])


@pytest.mark.parametrize("impl, shape, mode, dt", CASES)
def test_values_and_grads_match_the_float64_reference(impl, shape, mode, dt):
  x, scale, positions = inputs(SHAPES.get(shape, ODD_D), mode, dt)
  y = qk_norm_rotary(x, scale, positions, **IMPLS[impl])
  assert y.shape == x.shape and y.dtype == x.dtype
  assert max_error(y, reference_qk_norm_rotary(x, scale, positions)) <= tolerance(dt)
  dy = jnp.asarray(np.random.default_rng(1).standard_normal(x.shape), dt)
  arrays = dict(x=x) if scale is None else dict(x=x, scale=scale)
  loss = lambda a: jnp.sum(qk_norm_rotary(a["x"], a.get("scale"), positions, **IMPLS[impl]).astype(jnp.float32) *
                           dy.astype(jnp.float32))
  got = jax.grad(loss)(arrays)
  want = reference_qk_norm_rotary_grads(dy, x, scale, positions)
  assert set(got) == set(want)
  for name in want:
    assert got[name].dtype == arrays[name].dtype
    assert max_error(got[name], want[name]) <= tolerance(dt, grad=True), name


@pytest.mark.parametrize("mode", list(MODES))
def test_xla_jvp_matches_the_reference(mode):
  x, scale, positions = inputs(SHAPES["small"], mode, "float32", seed=3)
  primals = dict(x=x) if scale is None else dict(x=x, scale=scale)
  r = np.random.default_rng(4)
  t = {k: jnp.asarray(r.standard_normal(v.shape), v.dtype) for k, v in primals.items()}
  _, ty = jax.jvp(lambda a: qk_norm_rotary(a["x"], a.get("scale"), positions, implementation="xla"), (primals,), (t,))
  want = reference_qk_norm_rotary_jvp(t, x, scale, positions)
  assert max_error(ty, want) <= tolerance("float32", grad=True)


def test_rotation_is_a_complex_turn_of_feature_pairs_and_apply_rotary_agrees():
  """Independent of ``formula.rotate`` (which the reference, the XLA backend and apply_rotary
  share): the pair ``(x_i, x_{i + d/2})`` as ``x_i + 1j x_{i + d/2}``, times ``exp(1j p base **
  (-2i / d))``, in numpy complex128."""
  x, _, positions = inputs(SHAPES["small"], "rotary", "float32")
  xd, half = np.asarray(x, np.float64), x.shape[-1] // 2
  theta = np.asarray(positions, np.float64)[..., None, None] * 500.0 ** (-2.0 * np.arange(half) / x.shape[-1])
  z = (xd[..., :half] + 1j * xd[..., half:]) * np.exp(1j * theta)
  want = np.concatenate([z.real, z.imag], axis=-1)
  for impl in IMPLS:
    np.testing.assert_allclose(qk_norm_rotary(x, None, positions, base=500.0, **IMPLS[impl]), want, atol=2e-5)
  np.testing.assert_allclose(apply_rotary(x, positions, base=500.0), want, atol=2e-5)


def test_norm_alone_is_flax_rmsnorm():
  from flax import nnx
  x, scale, _ = inputs(SHAPES["small"], "norm", "float32")
  norm = nnx.RMSNorm(x.shape[-1], epsilon=1e-5, rngs=nnx.Rngs(0))
  norm.scale[...] = scale
  for impl in IMPLS:
    np.testing.assert_allclose(qk_norm_rotary(x, scale, None, eps=1e-5, **IMPLS[impl]), norm(x), atol=2e-5)


X = jnp.ones((2, 3, 2, 4), jnp.float32)
S = jnp.ones(4, jnp.float32)
P = jnp.zeros((2, 3), jnp.int32)


@pytest.mark.parametrize("fn, err, match", [
    (lambda: qk_norm_rotary(X), ValueError, "needs scale .* or positions"),
    (lambda: qk_norm_rotary(X[0], S), ValueError, r"x must be \[batch, seq, heads, head_dim\]"),
    (lambda: qk_norm_rotary(X.astype(jnp.int32), S), TypeError, "x must be floating"),
    (lambda: qk_norm_rotary(X, S[:3]), ValueError, r"scale must be \[d\]"),
    (lambda: qk_norm_rotary(X, None, P[:, :2]), ValueError, r"positions must be \[batch, seq\]"),
    (lambda: qk_norm_rotary(X, None, P.astype(jnp.float32)), TypeError, "positions must be integers"),
    (lambda: qk_norm_rotary(X, None, [[0]]), TypeError, "positions must be an integer array"),
    (lambda: qk_norm_rotary(jnp.ones((2, 3, 2, 5)), None, P), ValueError, "head_dim must be even"),
    (lambda: qk_norm_rotary(X, S, eps=-1.0), ValueError, "eps must be"),
    (lambda: qk_norm_rotary(X, None, P, base=0.0), ValueError, "base must be"),
    (lambda: qk_norm_rotary(X, S, implementation="nope"), ValueError, "unknown implementation"),
    (lambda: qk_norm_rotary(X, S, implementation="triton"), ValueError, "NVIDIA GPU"),
])
def test_bad_inputs_name_the_argument(fn, err, match):
  with pytest.raises(err, match=match):
    fn()


# -- on the GPU ---------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("dt", ["bfloat16", "float32"])
def test_gpu_lm_shape_matches_the_xla_backend(dt):
  """The LM step's q, [8, 2048, 12, 64], norm and RoPE at positions up to 2047: the kernels'
  values and gradients against the XLA backend's, whose angles are rounded alike (float32), so
  the difference is the kernels' own."""
  x, scale, _ = inputs((8, 2048, 12, 64), "both", dt, seed=5)
  positions = jnp.broadcast_to(jnp.arange(2048, dtype=jnp.int32), (8, 2048))
  dy = jnp.asarray(np.random.default_rng(6).standard_normal(x.shape), dt)

  def run(impl):
    f = lambda x, s: qk_norm_rotary(x, s, positions, implementation=impl)
    y, vjp = jax.vjp(f, x, scale)
    return (y, *vjp(dy))

  for got, want, grad in zip(run("triton"), run("xla"), (False, True, True)):
    assert got.dtype == want.dtype
    assert max_error(got, want) <= tolerance(dt, grad=grad)
