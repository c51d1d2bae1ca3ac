"""The Triton backend of linear_cross_entropy in Pallas interpret mode against the float64
reference: every option and gradient at odd sizes whose last token and vocabulary tiles are
partial (and the width padded to whole chunks), widths of several chunks with a partial last
one, bf16, all tokens ignored, traced out-of-range labels, and what it refuses; the
shared-memory estimate and the tiles chosen per device; the full-size call lowered for sm_90
on CPU (MLIR-verified: Triton's own compilation, where shared memory is allocated, still needs
the GPU). Full size on the GPU: the ``gpu`` test."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest


from probjax.core.device import Device
from probjax.ops.linear_cross_entropy import LinearCrossEntropyCall, explain_dispatch, linear_cross_entropy
from probjax.ops.linear_cross_entropy.backends.triton import kernels
from probjax.ops.linear_cross_entropy.reference import linear_cross_entropy64, linear_cross_entropy_grads64
from probjax.testing import pretend_h200, verify_triton_lowering
from tests.ops.linear_cross_entropy.test_linear_cross_entropy import OPTIONS, _close, _inputs

TRITON = dict(implementation="triton", interpret=True)
H200 = Device("gpu", (9, 0), 140 << 30)
RTX3090 = Device("gpu", (8, 6), 24 << 30)
S = jax.ShapeDtypeStruct


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


@pytest.mark.parametrize("dtype, d, opts", [
    (jnp.float32, 150, dict(z_loss=1e-3, label_smoothing=0.1)),  # 32-wide chunks: 5, the last 22 wide
    (jnp.bfloat16, 100, dict(reduction="sum", ignore_index=None)),  # 64-wide chunks: 2, the last 36 wide
])
def test_width_in_several_chunks(dtype, d, opts):
  """The logits summed over width chunks, and dx / dw accumulated chunk by chunk, with a bias
  and a [vocab, d] head: 13 tokens (tiles of 16), vocab 37 (tiles of 16)."""
  share = 0.0 if "ignore_index" in opts else 0.2
  x, w, labels, b = _inputs(4, (13,), d, 37, dtype=dtype, layout="vocab_d", bias=True, ignore_share=share)
  kw = dict(bias=b, w_layout="vocab_d", **opts)
  call = LinearCrossEntropyCall.of(x, w, labels, **kw, chunk_tokens=16, chunk_vocab=16, interpret=True)
  tiles = kernels.choose_tiles(call, Device.interpreter())
  assert d > tiles.block_d and d % tiles.block_d
  f = lambda x, w, b: linear_cross_entropy(x, w, labels, **{**kw, "bias": b}, chunk_tokens=16, chunk_vocab=16,
                                           **TRITON)
  out, pull = jax.vjp(f, x, w, b)
  _close(out, linear_cross_entropy64(x, w, labels, **kw), dtype, "loss")
  for name, g, r in zip(("dx", "dw", "dbias"), pull(jnp.asarray(1.0, out.dtype)),
                        linear_cross_entropy_grads64(x, w, labels, **kw)):
    assert g.dtype == dtype
    _close(g, r, dtype, name)


def test_shared_memory_estimate_and_tiles():
  """The estimate does not grow with the width; the default tiles fit sm_90 with 3 stages and
  sm_86 with 32-wide chunks and 2 stages, at every width; tiles that fit nowhere are refused."""
  assert kernels.smem_bytes(64, 128, 64, 2, 3) == 155_648
  assert kernels.smem_bytes(64, 128, 32, 2, 2) == 65_536
  for d in (64, 768, 4096, 16384):
    for dtype in (jnp.bfloat16, jnp.float32):
      call = LinearCrossEntropyCall.of(S((4000, d), dtype), S((d, 32003), dtype), S((4000,), jnp.int32))
      for device in (H200, RTX3090):
        t = kernels.choose_tiles(call, device)
        assert (t.block_t, t.block_v) == (64, 128)
        assert t.smem_bytes(jnp.dtype(dtype).itemsize) <= 0.8 * device.smem_per_block, (d, dtype, device, t)
        assert explain_dispatch(call, implementation="triton", device=device).implementation == "triton"
      assert kernels.choose_tiles(call, H200) == kernels.Tiles(64, 128, 64 if dtype == jnp.bfloat16 else 32, 3)
  bf16 = LinearCrossEntropyCall.of(S((4000, 768), jnp.bfloat16), S((768, 32003), jnp.bfloat16), S((4000,), jnp.int32))
  assert kernels.choose_tiles(bf16, RTX3090) == kernels.Tiles(64, 128, 32, 2)
  assert kernels.choose_tiles(bf16, Device.interpreter()).num_stages == 1
  huge = LinearCrossEntropyCall.of(S((4000, 768), jnp.float32), S((768, 32003), jnp.float32), S((4000,), jnp.int32),
                                   chunk_tokens=512, chunk_vocab=1024)
  for device in (H200, RTX3090):  # dz [512, 1024] float32 alone is 2 MiB
    with pytest.raises(ValueError, match="shared memory.*chunk_tokens or chunk_vocab"):
      explain_dispatch(huge, implementation="triton", device=device)


def test_full_size_lowers_for_sm90(monkeypatch):
  """x [4, 1000, 768] bf16 against a [768, 32003] head, value and both gradients: the three
  kernels lower for an H200 (tiles chosen for it: 64-wide chunks, 3 stages) and nothing else."""
  monkeypatch.setattr(Device, "current", classmethod(lambda cls: H200))
  pretend_h200(monkeypatch)
  verify_triton_lowering(monkeypatch)
  x, w, labels = S((4, 1000, 768), jnp.bfloat16), S((768, 32003), jnp.bfloat16), S((4, 1000), jnp.int32)
  call = LinearCrossEntropyCall.of(x, w, labels)
  assert kernels.choose_tiles(call, Device.current()) == kernels.Tiles(64, 128, 64, 3)
  loss = lambda x, w, l: linear_cross_entropy(x, w, l, implementation="triton")
  text = jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).trace(x, w, labels).lower(
      lowering_platforms=("cuda",)).as_text()
  calls = re.findall(r"custom_call @([\w$.]+)", text)
  assert calls == ["__gpu$xla.gpu.triton"] * 3, calls


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
  assert h200.implementation == "xla" and "ahead of the Triton kernels" in h200.rule


@pytest.mark.gpu
def test_full_size_on_the_gpu():
  x, w, labels, _ = _inputs(4, (4, 1000), 768, 32003, dtype=jnp.bfloat16)
  f = lambda impl: jax.jit(jax.value_and_grad(lambda x, w: linear_cross_entropy(x, w, labels, implementation=impl),
                                              argnums=(0, 1)))(x, w)
  (loss, (dx, dw)), (want, (rx, rw)) = f("triton"), f("xla")
  _close(loss, want, jnp.bfloat16, "loss")
  _close(dx, rx, jnp.bfloat16, "dx")
  _close(dw, rw, jnp.bfloat16, "dw")
