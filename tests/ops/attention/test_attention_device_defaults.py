"""On the GPU: the default dispatch and the cuDNN route agree with the Triton kernel.

The cuDNN path is not bitwise identical to the Triton kernels; outputs and
gradients must agree to bf16 precision: max |difference| <= 0.004 relative to
the larger of 1 and the values' magnitude. Inputs are scaled so that outputs
stay below 0.5, where one bf16 ulp is at most 2**-9 ~ 0.002: with unit-normal
values and causal masking the first rows copy single values of |v| ~ 4, where
one ulp of rounding difference alone is 0.016 (that is what failed on the
H200 with unscaled inputs).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from probjax.nn.layers.attention import dot_product_attention, explain_dispatch
from probjax.ops.attention import masks as M
from probjax.testing import check_against_reference, make_inputs

pytestmark = pytest.mark.gpu
AGREE = 0.004


def _out_and_grads(impl, x, mask):
  f = lambda q, k, v: dot_product_attention(q, k, v, mask=mask, implementation=impl)
  out, vjp = jax.vjp(f, x.q, x.k, x.v)
  return (out,) + vjp(x.do)


def _assert_agree(impl, x, mask):
  """``impl``'s output and gradients agree with the Triton kernel's to bf16 precision."""
  a = _out_and_grads(impl, x, mask)
  b = _out_and_grads("triton", x, mask)
  for name, u, w in zip(("out", "dq", "dk", "dv"), a, b):
    u, w = np.asarray(u, np.float32), np.asarray(w, np.float32)
    assert np.all(np.isfinite(u)), name
    diff = np.max(np.abs(u - w))
    assert diff <= AGREE * max(1.0, np.max(np.abs(w))), f"{name}: max |{impl} - triton| = {diff}"


@pytest.mark.parametrize("mask_name", ["none", "causal", "kv_len", "kv_len_zero"])
@pytest.mark.parametrize("t,heads,kv_heads", [(1024, 8, 8), (2048, 16, 4)])
def test_cudnn_agrees_with_triton(mask_name, t, heads, kv_heads):
  x = make_inputs(t + heads, 2, t, t, heads, kv_heads, 128, jnp.bfloat16)
  x.q, x.k = x.q * 0.5, x.k * 0.5
  x.v, x.do = x.v * 0.1, x.do * 0.1
  rng = np.random.default_rng(t)
  mask = {"none": None, "causal": M.CausalMask(),
          "kv_len": M.KVLenMask(jnp.asarray(rng.integers(1, t + 1, 2), jnp.int32)),
          "kv_len_zero": M.KVLenMask(jnp.array([0, t // 3], jnp.int32))}[mask_name]
  _assert_agree("cudnn", x, mask)


@pytest.mark.quick  # the few-minute GPU selection (MARK='gpu and quick')
def test_default_routes_to_cudnn_on_sm90_and_is_exact():
  # Above the sm_90 table's cuDNN work threshold (B4 H8 T1024 is below it: Triton there), a
  # mask the table's Mosaic forward rule does not take.
  x = make_inputs(0, 4, 2048, 2048, 16, 16, 128, jnp.bfloat16)
  mask = M.KVLenMask(jnp.array([2048, 1000, 1, 1537], jnp.int32))
  d = explain_dispatch(x.q.shape, x.k.shape, x.q.dtype, mask=mask)
  cc = jax.devices()[0].compute_capability
  if str(cc) == "9.0":
    assert d.implementation == "cudnn", d
  check_against_reference(lambda q, k, v, b: dot_product_attention(q, k, v, mask=mask), x, mask=mask)


@pytest.mark.parametrize("t", [600, 4096])
def test_default_fp32_is_exact(t):
  x = make_inputs(1, 2, t, t, 8, 8, 128, jnp.float32)
  check_against_reference(lambda q, k, v, b: dot_product_attention(q, k, v, is_causal=True), x,
                          mask=M.CausalMask(), tf32=True)


@pytest.mark.quick  # the few-minute GPU selection (MARK='gpu and quick')
@pytest.mark.parametrize("mask_name", ["window", "segments", "lengths"])
def test_default_masked_bf16_is_exact(mask_name):
  from probjax.testing import make_mask
  x = make_inputs(2, 2, 1500, 1500, 8, 2, 64, jnp.bfloat16)
  mask = make_mask(mask_name, 2, 1500, 1500)
  check_against_reference(lambda q, k, v, b: dot_product_attention(q, k, v, mask=mask), x, mask=mask)


@pytest.mark.parametrize("causal", [False, True])
def test_default_ragged_forward_runs_mosaic_and_is_exact(causal):
  # sm_90, B4 H8 T3000 (off the 128-row tiles, work in mosaic_primal.ragged_work, rule 3): the Mosaic
  # forward, reading the partial last tile with TMA's zero fill.
  x = make_inputs(7, 4, 3000, 3000, 8, 8, 64, jnp.bfloat16)
  mask = M.CausalMask() if causal else None
  d = explain_dispatch(x.q.shape, x.k.shape, x.q.dtype, mask=mask)
  if str(jax.devices()[0].compute_capability) == "9.0":
    assert d.implementation == "mosaic", d
  check_against_reference(lambda q, k, v, b: dot_product_attention(q, k, v, mask=mask), x, mask=mask)


@pytest.mark.quick  # the few-minute GPU selection (MARK='gpu and quick')
def test_cudnn_causal_window_is_exact():
  """The sm_90 default routes LocalWindowMask(left, 0) to cuDNN's sliding window."""
  x = make_inputs(5, 2, 2048, 2048, 8, 8, 128, jnp.bfloat16)
  mask = M.LocalWindowMask(left=300, right=0)
  check_against_reference(lambda q, k, v, b: dot_product_attention(q, k, v, mask=mask, implementation="cudnn"),
                          x, mask=mask)


@pytest.mark.quick  # the few-minute GPU selection (MARK='gpu and quick')
def test_default_d64_differentiated_runs_kernels_and_is_exact():
  # An odd length where the sm_90 table differentiates on a kernel. Which kernels it pairs is
  # the table's to say (the golden dispatch grid pins it on fake devices); here the default
  # must run kernels both ways, never the XLA path, and be exact.
  x = make_inputs(1, 16, 1500, 1500, 8, 8, 64, jnp.bfloat16)
  d = explain_dispatch(x.q.shape, x.k.shape, x.q.dtype)
  if str(jax.devices()[0].compute_capability) == "9.0":
    assert d.implementation != "xla" and d.under_grad.implementation != "xla", d
  check_against_reference(lambda q, k, v, b: dot_product_attention(q, k, v), x)
  f = lambda q: dot_product_attention(q, x.k, x.v)
  primal = np.asarray(f(x.q), np.float32)
  under_grad = np.asarray(jax.vjp(f, x.q)[0], np.float32)
  assert np.max(np.abs(primal - under_grad)) <= AGREE * max(1.0, np.max(np.abs(primal)))


@pytest.mark.parametrize("d", [64, 128])
def test_default_causal_differentiated_runs_mosaic_and_is_exact(d):
  # sm_90, B4 H8 T2048: the gradient from the Mosaic forward and the Triton backward; the
  # primal on the Mosaic forward (the forward rule).
  x = make_inputs(d, 4, 2048, 2048, 8, 8, d, jnp.bfloat16)
  x.q, x.k, x.v, x.do = x.q * 0.5, x.k * 0.5, x.v * 0.1, x.do * 0.1  # see the module docstring
  mask = M.CausalMask()
  dec = explain_dispatch(x.q.shape, x.k.shape, x.q.dtype, mask=mask)
  if str(jax.devices()[0].compute_capability) == "9.0":
    assert dec.implementation == "mosaic", dec
    assert dec.under_grad.implementation == "mosaic", dec
  check_against_reference(lambda q, k, v, b: dot_product_attention(q, k, v, mask=mask), x, mask=mask)
  f = lambda q: dot_product_attention(q, x.k, x.v, mask=mask)
  primal = np.asarray(f(x.q), np.float32)
  under_grad = np.asarray(jax.vjp(f, x.q)[0], np.float32)
  assert np.max(np.abs(primal - under_grad)) <= AGREE * max(1.0, np.max(np.abs(primal)))


def test_default_long_segments_d128_runs_mosaic_both_ways_and_agrees():
  # sm_90, segments on a long D128 call (work 2^29, the table's Mosaic-backward limit): the
  # Mosaic forward and backward. A float64 reference of this size crowds the shared GPU
  # (it failed with OOM there): it agrees with the Triton kernel instead, as cuDNN above.
  from probjax.testing import make_mask
  x = make_inputs(7, 4, 4096, 4096, 8, 8, 128, jnp.bfloat16)
  x.q, x.k, x.v, x.do = x.q * 0.5, x.k * 0.5, x.v * 0.1, x.do * 0.1  # see the module docstring
  mask = make_mask("segments", 4, 4096, 4096)
  dec = explain_dispatch(x.q.shape, x.k.shape, x.q.dtype, mask=mask)
  if str(jax.devices()[0].compute_capability) == "9.0":
    assert dec.implementation == "mosaic" and dec.under_grad.backward == "mosaic", dec
  _assert_agree(None, x, mask)


def test_default_long_window_d64_runs_mosaic_and_is_exact():
  # sm_90, a window with a right side (cuDNN cannot take it) at T2048: the Mosaic forward,
  # the Triton backward.
  x = make_inputs(11, 2, 2048, 2048, 8, 8, 64, jnp.bfloat16)
  mask = M.LocalWindowMask(300, 5)
  dec = explain_dispatch(x.q.shape, x.k.shape, x.q.dtype, mask=mask)
  if str(jax.devices()[0].compute_capability) == "9.0":
    assert dec.implementation == "mosaic" and dec.under_grad.backward != "mosaic", dec
  check_against_reference(lambda q, k, v, b: dot_product_attention(q, k, v, mask=mask), x, mask=mask)


@pytest.mark.quick  # the few-minute GPU selection (MARK='gpu and quick')
def test_default_causal_forward_runs_mosaic_and_agrees():
  # sm_90, a causal forward in the table's Mosaic forward range (B1 H32 T8192 D128: 2^31): the
  # Mosaic forward; under grad (above grad_mosaic.causal_max_work, rule 5) cuDNN. Both agree with Triton.
  x = make_inputs(9, 1, 8192, 8192, 32, 32, 128, jnp.bfloat16)
  x.q, x.k, x.v = x.q * 0.5, x.k * 0.5, x.v * 0.1  # see the module docstring
  mask = M.CausalMask()
  dec = explain_dispatch(x.q.shape, x.k.shape, x.q.dtype, mask=mask)
  if str(jax.devices()[0].compute_capability) == "9.0":
    assert dec.implementation == "mosaic" and dec.under_grad.implementation == "cudnn", dec
  f = lambda q: dot_product_attention(q, x.k, x.v, mask=mask)
  want = np.asarray(dot_product_attention(x.q, x.k, x.v, mask=mask, implementation="triton"), np.float32)
  for got in (f(x.q), jax.vjp(f, x.q)[0]):
    got = np.asarray(got, np.float32)
    assert np.all(np.isfinite(got))
    assert np.max(np.abs(got - want)) <= AGREE * max(1.0, np.max(np.abs(want)))


# (head_dim, length, causal, what the sm_90 table runs: forward, differentiated)
SMALL_HEAD_DIMS = [(16, 2048, False, "triton", "triton"), (40, 2048, True, "cudnn", "cudnn"),
                   (48, 2048, False, "cudnn", "cudnn"), (80, 1024, True, "cudnn", "cudnn"),
                   (96, 1024, False, "cudnn", "cudnn"), (64, 1500, False, "triton", "cudnn"),
                   (192, 1024, True, "cudnn", "cudnn"), (256, 512, False, "cudnn", "cudnn")]


@pytest.mark.parametrize("d,t,causal,fwd,grad", SMALL_HEAD_DIMS)
def test_default_at_head_dims_the_triton_kernel_pads_is_exact(d, t, causal, fwd, grad):
  # B4 H8 bf16: head_dims 40/48 and 80/96 run cuDNN (the Triton kernel pads them to 64 and 128),
  # as do 192 and 256 (values as wide); unmasked D64 at T1500 the Triton forward with cuDNN under
  # grad; values and gradients exact.
  x = make_inputs(d + t, 4, t, t, 8, 8, d, jnp.bfloat16)
  mask = M.CausalMask() if causal else None
  dec = explain_dispatch(x.q.shape, x.k.shape, x.q.dtype, mask=mask)
  if str(jax.devices()[0].compute_capability) == "9.0":
    assert (dec.implementation, dec.under_grad.implementation) == (fwd, grad), dec
  check_against_reference(lambda q, k, v, b: dot_product_attention(q, k, v, mask=mask), x, mask=mask)
  # The forward alone (no vjp) runs the primal implementation.
  out = jax.jit(lambda q, k, v: dot_product_attention(q, k, v, mask=mask))(x.q, x.k, x.v)
  check_against_reference(lambda q, k, v, b: out, x, mask=mask, grads=False)
