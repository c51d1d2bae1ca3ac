"""The scan room's ops against the float64 sequential references: the conformance suite
(tests/ops/scan/conformance.py) on every backend of the registries (values and the gradients of
every floating input, the initial and final state included, odd lengths, bfloat16, bad inputs),
and what only one backend has: the Mamba-1 kernels' channel blocks, RLA's window, and what a
differentiated call saves."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from probjax.ops.scan import feature_map, residual_linear_attention
from probjax.testing import float32_is_tf32
from tests.ops.scan.conformance import ScanConformance, check, inputs

TF32 = float32_is_tf32()  # on a GPU, float32 matmuls run as TF32 (tolerances bound that)

# Each case compiles the op's forward and backward (the Triton kernels in interpret mode on
# CPU) and runs the float64 reference in NumPy: 1-4 s of CPU a case. make test runs every op
# and backend once at a length past a partial last chunk, and the bf16, optional-input and
# kernel checks once; the other lengths, chunk sizes and ops are slow, and the chunk sizes
# beyond the default and 16 are thorough (CI leaves them to make test-slow).
KERNEL_LENGTHS = ((65, 16), (63, 16), (64, 16), (1, None), (63, None), (64, None), (1000, None))
# The bad inputs are refused by the ops' shared validation: make test asks the sequential scan's.
FAST = frozenset({"test_values_and_grads[*-65*]", "test_refusals[*]"})


class TestScanConformance(ScanConformance):
  """The sequential scan (lax.scan over positions)."""

  implementation = "scan"
  tf32 = TF32
  slow_cases = frozenset({"*"})
  fast_cases = FAST | {"test_bad_inputs[*]"}


class TestAssociativeConformance(ScanConformance):
  """The associative scan (Mamba-1 and SSD only)."""

  implementation = "associative"
  tf32 = TF32
  ops = ("mamba", "ssd")
  refusals = (("rla", "rla", {}, "associative"),)
  slow_cases = frozenset({"*"})
  fast_cases = FAST


class TestChunkedConformance(ScanConformance):
  """The chunked XLA form, at chunk 16 (chunk boundaries and a partial last chunk inside short
  sequences) and at its default."""

  implementation = "chunked"
  tf32 = TF32
  lengths = KERNEL_LENGTHS
  bf16_chunks = (None, 8, 16, 32, 64, 128)
  slow_cases = frozenset({"*"})
  fast_cases = FAST | {"test_without_optional_inputs[mamba]", "test_bfloat16[ssd]"}
  thorough_cases = frozenset({"test_bfloat16[*-c8]", "test_bfloat16[*-c32]", "test_bfloat16[*-c64]",
                              "test_bfloat16[*-c128]"})


class TestTritonConformance(ScanConformance):
  """The Pallas Triton kernels (interpret mode off the GPU); their chunks start at 16."""

  implementation = "triton"
  tf32 = TF32
  lengths = KERNEL_LENGTHS
  bf16_chunks = (None, 16, 32, 64, 128)
  refusals = (("mamba-chunk_24", "mamba", {"chunk_size": 24}, "chunk_size"),
              ("ssd-chunk_24", "ssd", {"chunk_size": 24}, "chunk_size"),
              ("rla-chunk_24", "rla", {"chunk_size": 24}, "chunk_size"))
  slow_cases = frozenset({"*"})
  fast_cases = FAST
  thorough_cases = frozenset({"test_bfloat16[*-c32]", "test_bfloat16[*-c64]", "test_bfloat16[*-c128]"})


@pytest.mark.timeout(300)
@pytest.mark.parametrize("length, channels, chunk, optional", [(101, 40, None, True), (97, 37, 16, False)])
def test_mamba_kernels_forward_and_backward(length, channels, chunk, optional):
  """The Mamba-1 kernels, differentiated: lengths past a partial last chunk (default chunk 32,
  or 16), channels past a partial block of the kernels' 32, with and without the optional
  inputs (the initial state's gradient is the backward's carry out of position 0)."""
  a = inputs("mamba", length, seed=length + channels, optional=optional, channels=channels, state=8)
  if not optional:
    a["dt"] = np.abs(a["dt"])  # without softplus, a positive dt keeps the decay below one
  check("mamba", "triton", a, tf32=TF32, chunk_size=chunk, **({} if optional else {"dt_softplus": False}))


def test_rla_window_covers_everything():
  """With the window over the whole sequence the linear branch reads the initial state only."""
  a = {k: jnp.asarray(v) for k, v in inputs("rla", 20).items()}
  rla = jax.jit(functools.partial(residual_linear_attention, window_size=50, return_final_state=True))
  o, s = rla(**a)
  expect = jnp.einsum("blhf,bhfd->blhd", feature_map(a["q"], "softmax"),
                      jnp.repeat(a["initial_state"], 2, axis=1))
  np.testing.assert_allclose(o, expect, rtol=1e-5, atol=1e-5)
  np.testing.assert_array_equal(s, a["initial_state"])


def _rla_inputs(b, length, h, hk, d, dv, dtype, seed=0):
  rng = np.random.default_rng(seed)
  f = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32).astype(dtype)
  return dict(q=f(b, length, h, d), k=f(b, length, hk, d), v=f(b, length, hk, dv),
              initial_state=f(b, hk, 2 * d, dv).astype(jnp.float32))


@pytest.mark.parametrize("impl", ["triton", "chunked"])
def test_rla_state_blocks_and_groups(impl):
  """RLA with features 80 and v_head_dim 72 (the kernels' state passes in 3 x 3 blocks of 32),
  two query heads on one key/value head (the gradient kernels sum the group's), three chunks
  of 16 with a partial last one; bfloat16 (the matmuls read bfloat16)."""
  check("rla", impl, _rla_inputs(1, 37, 2, 1, 40, 72, jnp.bfloat16), dtype=jnp.bfloat16, chunk_size=16)


_DERIVATIVES = {
    "jvp": lambda f, q, k, dq: jax.jvp(f, (q, k), (dq, jnp.zeros_like(k)))[1],
    "vmap_grad": lambda f, q, k, dq: jax.vmap(lambda q: jax.grad(f)(q, k))(jnp.stack([q, dq])),
    "jvp_of_grad": lambda f, q, k, dq: jax.jvp(lambda q: jax.grad(f)(q, k), (q,), (dq,))[1],
    "grad_of_grad": lambda f, q, k, dq: jax.grad(lambda q: jnp.sum(jax.grad(f)(q, k) ** 2))(q),
}


@pytest.mark.parametrize("derivative", list(_DERIVATIVES))
def test_rla_chunked_forward_mode_and_second_order(derivative):
  """The chunked form's backward is the transpose of its jvp: ``jax.jvp``, ``vmap`` of the
  gradient and second derivatives match the sequential scan's (plain JAX), with tangents in
  only some inputs (no initial state given)."""
  a = {k: jnp.asarray(v) for k, v in inputs("rla", 20, optional=False).items()}
  got = {}
  for impl in ("chunked", "scan"):
    f = lambda q, k: jnp.sum(jnp.sin(residual_linear_attention(q, k, a["v"], window_size=3, chunk_size=8,
                                                               implementation=impl)))
    got[impl] = jax.jit(_DERIVATIVES[derivative], static_argnums=0)(f, a["q"], a["k"], jnp.cos(a["q"]))
  scale = float(jnp.max(jnp.abs(got["scan"])))
  np.testing.assert_allclose(got["chunked"], got["scan"], rtol=2e-4, atol=2e-4 * scale)


@pytest.mark.gpu
@pytest.mark.timeout(300)
@pytest.mark.parametrize("impl", ["chunked", "triton"])
def test_rla_full_size_bfloat16(impl):
  """The benchmark's RLA call, B4 H8 T4096 D64 bfloat16, window 512, at each form's default
  chunk: values and every gradient against the float64 reference."""
  check("rla", impl, _rla_inputs(4, 4096, 8, 8, 64, 64, jnp.bfloat16), dtype=jnp.bfloat16, window_size=512)


@pytest.mark.timeout(300)
def test_saved_for_the_backward():
  """A differentiated chunked or Triton Mamba-1 call saves no state per position: the
  sequential scan saves ``length × channels × state`` floats, the chunked form its inputs,
  cumulative decays and chunk-boundary states, the kernels their inputs and chunk-boundary
  states."""
  from probjax.ops.scan import dispatch
  from probjax.ops.scan.calls import MambaCall
  b, length, d, n = 1, 512, 8, 64
  call = MambaCall(b, length, d, n, "float32", chunk_size=16, interpret=True)
  rng = np.random.default_rng(0)
  args = [jnp.asarray(rng.standard_normal(s), jnp.float32) for s in
          [(b, length, d), (b, length, d), (d, n), (b, length, n), (b, length, n), (b, d, n)]]
  saved = {}
  for name in ("scan", "chunked", "triton"):
    _, vjp = jax.vjp(dispatch.resolve(call, name), *args)
    saved[name] = sum(leaf.size for leaf in jax.tree.leaves(vjp))
  states, given = length * d * n, sum(x.size for x in args)
  assert saved["scan"] >= states
  assert saved["chunked"] <= 2 * given + 4 * (length // 16) * d * n < states
  assert saved["triton"] <= given + (length // 16) * d * n < states
