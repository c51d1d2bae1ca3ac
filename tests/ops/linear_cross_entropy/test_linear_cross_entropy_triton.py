"""The Triton backend of linear_cross_entropy in Pallas interpret mode against the float64
reference: every option and gradient at odd sizes whose last token and vocabulary tiles are
partial (and the width padded to a power of two), bf16, all tokens ignored, traced
out-of-range labels, and what it refuses. Full size on the GPU: the ``gpu`` test."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from probjax.core.device import Device
from probjax.ops.linear_cross_entropy import LinearCrossEntropyCall, explain_dispatch, linear_cross_entropy
from probjax.ops.linear_cross_entropy.reference import linear_cross_entropy64, linear_cross_entropy_grads64
from tests.ops.linear_cross_entropy.test_linear_cross_entropy import OPTIONS, _close, _inputs

TRITON = dict(implementation="triton", interpret=True)


@pytest.mark.parametrize("opts", OPTIONS, ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()) or "plain")
@pytest.mark.parametrize("layout,bias", [("d_vocab", False), ("vocab_d", True)])
def test_values_and_gradients(opts, layout, bias):
  # 2 x 11 tokens in tiles of 16 (two tiles, the last partial), vocab 37 in tiles of 16 (the
  # third partial), width 12 padded to 16.
  share = 0.0 if "ignore_index" in opts else 0.2
  x, w, labels, b = _inputs(0, (2, 11), 12, 37, layout=layout, bias=bias, ignore_share=share)
  kw = dict(bias=b, w_layout=layout, **opts)
  f = lambda x, w, b: linear_cross_entropy(x, w, labels, **{**kw, "bias": b}, chunk_tokens=16, chunk_vocab=16,
                                           **TRITON)
  out, pull = jax.vjp(f, x, w, b)
  ct = np.random.default_rng(1).standard_normal(np.shape(out)) if opts.get("reduction") == "none" else 1.0
  _close(out, linear_cross_entropy64(x, w, labels, **kw), jnp.float32, "loss")
  got = pull(jnp.asarray(ct, out.dtype))
  want = linear_cross_entropy_grads64(x, w, labels, **kw, cotangent=ct)
  for name, g, r in zip(("dx", "dw", "dbias"), got, want):
    if r is not None:
      _close(g, r, jnp.float32, name)


def test_bfloat16_default_tiles():
  x, w, labels, _ = _inputs(2, (3, 7), 16, 70, dtype=jnp.bfloat16)
  loss, (dx, dw) = jax.jit(jax.value_and_grad(lambda x, w: linear_cross_entropy(x, w, labels, **TRITON),
                                              argnums=(0, 1)))(x, w)
  assert loss.dtype == jnp.float32 and dx.dtype == jnp.bfloat16 and dw.dtype == jnp.bfloat16
  _close(loss, linear_cross_entropy64(x, w, labels), jnp.bfloat16, "loss")
  for g, r, n in zip((dx, dw), linear_cross_entropy_grads64(x, w, labels), ("dx", "dw")):
    _close(g, r, jnp.bfloat16, n)


def test_every_label_ignored_and_traced_out_of_range():
  x, w, labels, _ = _inputs(3, (5,), 8, 20, ignore_share=0.0)
  none = jnp.full((5,), -100, jnp.int32)
  loss, (dx, dw) = jax.value_and_grad(lambda x, w: linear_cross_entropy(x, w, none, **TRITON), argnums=(0, 1))(x, w)
  assert float(loss) == 0.0 and not np.any(dx) and not np.any(dw)
  got = jax.jit(lambda l: linear_cross_entropy(x, w, l, reduction="none", **TRITON))(labels.at[2].set(99))
  want = linear_cross_entropy(x, w, labels.at[2].set(-100), reduction="none", **TRITON)
  np.testing.assert_allclose(got, want, rtol=1e-6)
  assert float(got[2]) == 0.0


def test_refusals_and_dispatch():
  s = jax.ShapeDtypeStruct
  call = LinearCrossEntropyCall.of(s((4, 100, 16), jnp.float32), s((16, 50), jnp.float32), s((4, 100), jnp.int32))
  with pytest.raises(ValueError, match="Pallas Triton needs an NVIDIA GPU"):
    explain_dispatch(call, implementation="triton", device=Device("cpu"))
  call64 = LinearCrossEntropyCall.of(s((4, 16), jnp.float64), s((16, 50), jnp.float64), s((4,), jnp.int32))
  with pytest.raises(ValueError, match="float64"):
    explain_dispatch(call64, implementation="triton", device=Device("gpu", (9, 0), 140 << 30))
  d = explain_dispatch(call, implementation="pallas_triton", device=Device.interpreter())
  assert d.implementation == "triton" and d.get("chunk_tokens") == 64 and d.get("chunk_vocab") == 64
  h200 = explain_dispatch(call, device=Device("gpu", (9, 0), 140 << 30))
  assert h200.implementation == "xla" and "no measurement" in h200.rule


@pytest.mark.gpu
def test_full_size_on_the_gpu():
  x, w, labels, _ = _inputs(4, (4, 1000), 768, 32003, dtype=jnp.bfloat16)
  f = lambda impl: jax.jit(jax.value_and_grad(lambda x, w: linear_cross_entropy(x, w, labels, implementation=impl),
                                              argnums=(0, 1)))(x, w)
  (loss, (dx, dw)), (want, (rx, rw)) = f("triton"), f("xla")
  _close(loss, want, jnp.bfloat16, "loss")
  _close(dx, rx, jnp.bfloat16, "dx")
  _close(dw, rw, jnp.bfloat16, "dw")
