"""The GPU paths lower for sm_90 on CPU (no GPU needed).

Interpret mode checks the Triton kernels' arithmetic; this checks that Pallas
can lower them for a Hopper GPU (dynamic loop bounds, scalar loads of the tile
ranges, atomics), and that the default's cuDNN route lowers to one cuDNN
forward and one backward call, so a lowering regression fails in CI rather
than on the device. Triton's and cuDNN's own compilation still need the GPU.
"""

import dataclasses
import re

import jax
import jax.numpy as jnp
import pytest

import probjax.ops.attention.backends.triton as pt
from probjax.ops.attention import gpu, masks as M
from probjax.ops.attention.backends.triton.config import BackwardConfig, ForwardConfig
from probjax.testing import h200_gpu_info, make_mask, pretend_h200, verify_triton_lowering

H200 = h200_gpu_info()
MASKS = {
    "none": None,
    "causal": M.CausalMask(),
    "window&kv_len": M.LocalWindowMask(100, 0) & M.KVLenMask(jnp.array([300, 70])),
    "segments": M.SegmentMask(jnp.sort(jax.random.randint(jax.random.key(0), (2, 300), 0, 3), axis=1)),
}


def _fake_triton_sm90(monkeypatch, device_kind: bool = False):
  """Pallas lowers for an H200; the Triton backend's platform check (it sees the CPU) passes;
  ``device_kind``: the kernels' config tables (Triton and Mosaic GPU) read sm_90."""
  pretend_h200(monkeypatch)
  monkeypatch.setattr(pt, "supports", lambda *a, **kw: None)
  verify_triton_lowering(monkeypatch)
  if device_kind:
    monkeypatch.setattr(gpu, "device_kind", lambda device=None: "sm_90")


def _fake_dispatch_sm90(monkeypatch):
  """The dispatch sees an H200 (compute capability 9.0, 140 GiB)."""
  from probjax.ops.attention import dispatch
  monkeypatch.setattr(dispatch.Device, "current", classmethod(lambda cls: dispatch.Device("gpu", (9, 0), 140 << 30)))


def _fake_cudnn(monkeypatch, route="jaxnn"):
  """The cuDNN route: jax.nn's call, with its availability checks passing (cuDNN 9.10, any
  compute capability), or ("ffi") probjax's FFI call, which needs the built extension."""
  from jax._src.cudnn import fused_attention_stablehlo as fa
  from probjax.ops.attention.backends.cudnn import ffi
  monkeypatch.setattr(fa, "check_cudnn_version", lambda: 91000)
  monkeypatch.setattr(fa, "check_compute_capability", lambda c: True)
  monkeypatch.setattr(fa, "is_cuda_compute_capability_equal", lambda c: False)
  if route == "jaxnn":
    monkeypatch.setenv(ffi.ENV, "0")
  elif ffi.unavailable() is not None:
    pytest.skip(f"cuDNN FFI extension: {ffi.unavailable()}")


# The cuDNN calls of each route: forward (with statistics under grad) and backward.
CUDNN_CALLS = {"jaxnn": {"fwd": "__cudnn$fmhaSoftmax", "fwd_stats": "__cudnn$fmhaSoftmax",
                         "bwd": "__cudnn$fmhaSoftmaxBackward"},
               "ffi": {"fwd": "probjax_cudnn_sdpa_fwd", "fwd_stats": "probjax_cudnn_sdpa_fwd_stats",
                       "bwd": "probjax_cudnn_sdpa_bwd"}}
ROUTES = list(CUDNN_CALLS)


def _cudnn_calls(text: str) -> list[str]:
  """The cuDNN custom calls of lowered text, of either route, sorted."""
  import re
  return sorted(re.findall(r"custom_call @(__cudnn\$fmha\w*|probjax_cudnn_sdpa_\w*)", text))


@pytest.mark.parametrize("mask_name", list(MASKS))
@pytest.mark.parametrize("impl", ["triton_split", "triton_fused", "triton_onepass"])
def test_lowers_for_sm90(monkeypatch, mask_name, impl):
  _fake_triton_sm90(monkeypatch)
  mask = MASKS[mask_name]
  q = jax.ShapeDtypeStruct((2, 300, 8, 128), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((2, 300, 2, 128), jnp.bfloat16)

  def loss(q, k, v):
    out = pt.attention(q, k, v, mask=mask, backward_pass_impl=impl,
                       forward_config=ForwardConfig(128, 64, 8, 3),
                       backward_config=BackwardConfig(64, 128, 128, 64, 8, 2))
    return jnp.sum(out.astype(jnp.float32))

  lowered = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(q, kv, kv).lower(lowering_platforms=("cuda",))
  text = lowered.as_text()
  assert "probjax_attention_fwd" in text
  assert text.count("custom_call @__gpu$xla.gpu.triton") >= 2  # the forward and the backward kernel(s)


def test_api_grad_lowers_for_sm90(monkeypatch):
  """Through dot_product_attention: the forward-mode wrapper keeps the kernels' backward."""
  from probjax.nn.layers.attention import dot_product_attention
  _fake_triton_sm90(monkeypatch)
  _fake_dispatch_sm90(monkeypatch)
  q = jax.ShapeDtypeStruct((2, 300, 8, 64), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((2, 300, 2, 64), jnp.bfloat16)
  loss = lambda q, k, v: jnp.sum(dot_product_attention(q, k, v, mask=M.CausalMask(),
                                                       implementation="triton").astype(jnp.float32))
  lower = lambda f: jax.jit(f).trace(q, kv, kv).lower(lowering_platforms=("cuda",)).as_text()
  grad_text, fwd_text = lower(jax.grad(loss, argnums=(0, 1, 2))), lower(loss)
  assert "probjax_attention_bwd" in grad_text
  # The forward kernel runs once under grad, as without it (no recomputation by the wrapper).
  assert grad_text.count("probjax_attention_fwd") == fwd_text.count("probjax_attention_fwd") > 0


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("mask", [None, M.CausalMask(), M.LocalWindowMask(512, 0),
                                  M.KVLenMask(jnp.array([4096, 100, 5, 0]))])
def test_default_cudnn_route_lowers_for_sm90(monkeypatch, mask, route):
  """The sm_90 default's cuDNN route (forward-mode wrapper included) lowers to one cuDNN
  forward and one backward call under grad, and to one forward call without."""
  from probjax.nn.layers.attention import dot_product_attention
  _fake_cudnn(monkeypatch, route)
  _fake_dispatch_sm90(monkeypatch)
  monkeypatch.setenv("PROBJAX_ATTENTION_MOSAIC", "0")  # the causal grad rule: see below
  q = jax.ShapeDtypeStruct((4, 4096, 8, 64), jnp.bfloat16)
  loss = lambda q: jnp.sum(dot_product_attention(q, q, q, mask=mask).astype(jnp.float32))
  lower = lambda fn: jax.jit(fn).trace(q).lower(lowering_platforms=("cuda",)).as_text()
  calls = CUDNN_CALLS[route]
  assert _cudnn_calls(lower(jax.grad(loss))) == sorted([calls["fwd_stats"], calls["bwd"]])
  assert _cudnn_calls(lower(loss)) == [calls["fwd"]]


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("mask", [None, M.CausalMask()])
def test_default_d64_grad_runs_triton_for_sm90(monkeypatch, mask, route):
  """sm_90, D64 below the table's grad work and key limits: the primal lowers to cuDNN alone,
  the gradient to the Triton forward and backward alone."""
  from probjax.nn.layers.attention import dot_product_attention
  _fake_cudnn(monkeypatch, route)
  _fake_triton_sm90(monkeypatch, device_kind=True)
  _fake_dispatch_sm90(monkeypatch)
  monkeypatch.setenv("PROBJAX_ATTENTION_MOSAIC", "0")  # causal: the Mosaic rule (below) goes first
  q = jax.ShapeDtypeStruct((16, 1024, 8, 64), jnp.bfloat16)
  f = lambda q: jnp.sum(dot_product_attention(q, q, q, mask=mask).astype(jnp.float32))
  lower = lambda fn: jax.jit(fn).trace(q).lower(lowering_platforms=("cuda",)).as_text()
  primal, grad = lower(f), lower(jax.grad(f))
  assert _cudnn_calls(primal) == [CUDNN_CALLS[route]["fwd"]]
  assert "probjax_attention" not in primal
  assert _cudnn_calls(grad) == []
  assert "probjax_attention_fwd" in grad and "probjax_attention_bwd" in grad
  # split (no band): forward, dK/dV, dQ; fused (causal band): forward, one backward.
  assert grad.count("custom_call @__gpu$xla.gpu.triton") == (3 if mask is None else 2)


@pytest.mark.parametrize("d", [64, 128])
def test_default_causal_grad_runs_mosaic_for_sm90(monkeypatch, d):
  """sm_90, causal within the table's Mosaic work limits (B4 H8 T2048): the gradient lowers
  to the Mosaic forward and the Triton (fused, band) backward; the primal to the Mosaic
  forward alone (the table's forward rule)."""
  import re
  from probjax.nn.layers.attention import dot_product_attention
  _fake_cudnn(monkeypatch)
  _fake_triton_sm90(monkeypatch, device_kind=True)
  _fake_dispatch_sm90(monkeypatch)
  q = jax.ShapeDtypeStruct((4, 2048, 8, d), jnp.bfloat16)
  f = lambda q: jnp.sum(dot_product_attention(q, q, q, mask=M.CausalMask()).astype(jnp.float32))
  lower = lambda fn: jax.jit(fn).trace(q).lower(lowering_platforms=("cuda",)).as_text()
  primal, grad = lower(f), lower(jax.grad(f))
  assert set(re.findall(r"custom_call @([\w$.]+)", primal)) == {"mosaic_gpu_v2"}
  assert _cudnn_calls(grad) == []
  assert grad.count("custom_call @mosaic_gpu_v2") == 1 and "probjax_attention_fwd_mosaic" in grad
  assert grad.count("custom_call @__gpu$xla.gpu.triton") == 1 and "probjax_attention_bwd" in grad


@pytest.mark.parametrize("d,t", [(64, 2048), (128, 4096)])
def test_default_long_segments_run_mosaic_for_sm90(monkeypatch, d, t):
  """sm_90, a mask cuDNN cannot take on a long call: the Mosaic forward; its backward at
  D128 from the table's work limit (three Mosaic kernels), else the Triton backward."""
  import re
  from probjax.nn.layers import attention_device
  from probjax.nn.layers.attention import dot_product_attention
  _fake_triton_sm90(monkeypatch, device_kind=True)
  _fake_dispatch_sm90(monkeypatch)
  q = jax.ShapeDtypeStruct((4, t, 8, d), jnp.bfloat16)
  mask = M.SegmentMask(jnp.repeat(jnp.arange(4, dtype=jnp.int32), t // 4)[None].repeat(4, 0))
  f = lambda q: jnp.sum(dot_product_attention(q, q, q, mask=mask).astype(jnp.float32))
  grad = jax.jit(jax.grad(f)).trace(q).lower(lowering_platforms=("cuda",)).as_text()
  kernels = set(re.findall(r"probjax_attention_\w+", grad))
  mosaic_bwd = 4 * 8 * t * t >= dict(attention_device.DEVICE_DEFAULTS[(9, 0)].mosaic_backward_min_work).get(d, 2**62)
  assert mosaic_bwd == (d == 128)
  if mosaic_bwd:
    assert set(re.findall(r"custom_call @([\w$.]+)", grad)) == {"mosaic_gpu_v2"}
    assert set(re.findall(r"probjax_attention_\w+_mosaic\b", grad)) == {
        "probjax_attention_fwd_mosaic", "probjax_attention_bwd_dkv_mosaic", "probjax_attention_bwd_dq_mosaic"}
  else:
    assert "probjax_attention_fwd_mosaic" in kernels and "probjax_attention_fwd" not in kernels, kernels
    assert grad.count("custom_call @__gpu$xla.gpu.triton") == 2  # split backward: dK/dV, dQ


@pytest.mark.parametrize("route", ROUTES)
def test_default_causal_forward_runs_mosaic_for_sm90(monkeypatch, route):
  """sm_90, a causal forward-only call at the top of the table's Mosaic forward range (D128,
  2^31) lowers to the Mosaic forward alone; its gradient (above the Mosaic grad rule) to
  cuDNN's forward and backward alone."""
  import re
  from probjax.nn.layers import attention_device
  from probjax.nn.layers.attention import dot_product_attention
  _fake_cudnn(monkeypatch, route)
  _fake_triton_sm90(monkeypatch, device_kind=True)
  _fake_dispatch_sm90(monkeypatch)
  [work] = [hi for kind, d, lo, hi in attention_device.DEVICE_DEFAULTS[(9, 0)].mosaic_forward_work
            if kind == "causal" and d == 128]
  q = jax.ShapeDtypeStruct((4, int((work // 32) ** 0.5), 8, 128), jnp.bfloat16)
  f = lambda q: jnp.sum(dot_product_attention(q, q, q, mask=M.CausalMask()).astype(jnp.float32))
  lower = lambda fn: jax.jit(fn).trace(q).lower(lowering_platforms=("cuda",)).as_text()
  primal, grad = lower(f), lower(jax.grad(f))
  assert set(re.findall(r"custom_call @([\w$.]+)", primal)) == {"mosaic_gpu_v2"}
  assert "probjax_attention_fwd_mosaic" in primal
  calls = CUDNN_CALLS[route]
  assert _cudnn_calls(grad) == sorted([calls["fwd_stats"], calls["bwd"]])
  assert "mosaic_gpu" not in grad


@pytest.mark.parametrize("fast", [False, True])
def test_fast_exp2_lowers_to_one_instruction(monkeypatch, fast):
  """``fast_exp2`` swaps libdevice's exp2f for ``ex2.approx.ftz.f32`` in every kernel."""
  _fake_triton_sm90(monkeypatch)
  q = jax.ShapeDtypeStruct((2, 300, 8, 64), jnp.bfloat16)
  loss = lambda q, k, v: jnp.sum(pt.attention(
      q, k, v, backward_pass_impl="triton_split", forward_config=ForwardConfig(fast_exp2=fast),
      backward_config=BackwardConfig(fast_exp2=fast)).astype(jnp.float32))
  text = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(q, q, q).lower(lowering_platforms=("cuda",)).as_text()
  kernels = text.count("custom_call @__gpu$xla.gpu.triton")
  assert kernels == 3  # forward, dK/dV, dQ
  # Each kernel's scores in one fma.rn.f32 + ex2.approx (tiles.exp2_affine); the forward's
  # rescale factor in one more ex2.approx.
  assert text.count("fma.rn.f32 $0, $1, $2, $3") == (kernels if fast else 0)
  assert text.count("ex2.approx.ftz.f32") == (kernels + 1 if fast else 0)
  assert text.count("__nv_exp2f") == (0 if fast else kernels)


@pytest.mark.parametrize("mask", [
    None, M.KVLenMask(jnp.array([4096, 7])), M.CausalMask(4095), M.LocalWindowMask(1000, 0, offset=4095),
    M.SegmentMask(jnp.ones((2, 1), jnp.int32), jnp.sort(jax.random.randint(jax.random.key(1), (2, 4096), 0, 3)))])
def test_split_kv_lowers_for_sm90(monkeypatch, mask):
  """The decoding default (split-KV forward) lowers for sm_90 with GQA packing."""
  _fake_triton_sm90(monkeypatch, device_kind=True)
  q = jax.ShapeDtypeStruct((2, 1, 32, 128), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((2, 4096, 8, 128), jnp.bfloat16)
  text = jax.jit(lambda q, k, v: pt.attention(q, k, v, mask=mask)).trace(q, kv, kv).lower(
      lowering_platforms=("cuda",)).as_text()
  assert "probjax_attention_fwd_split_kv" in text


@pytest.mark.parametrize("d", [96, 192])
def test_split_kv_reads_a_padded_head_dim_cache_in_place(monkeypatch, d):
  """At a head_dim off the power-of-two tile the split-KV forward reads K/V as they are (the
  tile's extra columns masked), with no padded copy of the cache in the program."""
  _fake_triton_sm90(monkeypatch, device_kind=True)
  q = jax.ShapeDtypeStruct((2, 1, 32, d), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((2, 4096, 8, d), jnp.bfloat16)
  text = jax.jit(lambda q, k, v: pt.attention(q, k, v)).trace(q, kv, kv).lower(
      lowering_platforms=("cuda",)).as_text()
  assert "probjax_attention_fwd_split_kv" in text
  padded = 1 << (d - 1).bit_length()
  assert f"tensor<2x4096x8x{padded}xbf16>" not in text


@pytest.mark.parametrize("impl", ["triton_split", "triton_fused", "triton_onepass"])
def test_regular_kernels_read_a_padded_head_dim_in_place(monkeypatch, impl):
  """At head_dim 192 (tiles of 256 columns) the regular forward, its jvp and the backward read
  Q, K, V and dO as they are and write the output and the gradients at 192 (the tiles' extra
  columns masked): no array of the tile's width is in the program, but the onepass backward's
  float32 dQ accumulator."""
  _fake_triton_sm90(monkeypatch)
  q = jax.ShapeDtypeStruct((2, 300, 8, 192), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((2, 300, 2, 192), jnp.bfloat16)
  attn = lambda q, k, v: pt.attention(q, k, v, mask=M.CausalMask(), backward_pass_impl=impl,
                                      forward_config=ForwardConfig(128, 64, 8, 3),
                                      backward_config=BackwardConfig(64, 128, 128, 64, 8, 2))
  loss = lambda q, k, v: jnp.sum(attn(q, k, v).astype(jnp.float32))
  lower = lambda f, *a: jax.jit(f).trace(*a).lower(lowering_platforms=("cuda",)).as_text()
  text = lower(jax.grad(loss, argnums=(0, 1, 2)), q, kv, kv)
  assert "probjax_attention_fwd" in text and "probjax_attention_bwd" in text
  wide = set(re.findall(r"tensor<[\dx]*x256x(\w+)>", text))
  assert wide == ({"f32"} if impl == "triton_onepass" else set()), wide
  from probjax.ops.attention.backends.triton import jvp as jvp_lib
  jvp = lower(lambda q, k, v: jvp_lib.forward_jvp(q, k, v, q, k, v, M.CausalMask(), scale=0.1,
                                                  config=ForwardConfig(128, 64, 8, 3), interpret=False), q, kv, kv)
  assert "probjax_attention_fwd_jvp" in jvp and not re.search(r"x256x\w+>", jvp)
  # A decoding-like call on the regular forward: the cache is not copied to the tile's width.
  decode = lower(lambda q, k, v: pt.attention(q, k, v, split_kv=False), jax.ShapeDtypeStruct((53, 3, 40, 192), jnp.bfloat16),
                 *(jax.ShapeDtypeStruct((53, 3187, 40, 192), jnp.bfloat16),) * 2)
  assert "probjax_attention_fwd" in decode and not re.search(r"x256x\w+>", decode)


@pytest.mark.parametrize("mask_name,d,wgs,persistent", [("none", 64, None, None), ("causal", 128, None, None),
                                                         ("window&lengths", 256, None, None), ("causal", 64, 3, False),
                                                         ("none", 128, 2, False), ("causal", 64, 2, False),
                                                         ("none", 128, 2, True), ("segments", 64, 3, True)])
def test_mosaic_forward_and_triton_backward_lower_for_sm90(monkeypatch, mask_name, d, wgs, persistent):
  """The Mosaic GPU forward (registers as wgmma's P operand, in-place accumulation: the
  paths interpret mode cannot run) lowers to a Mosaic GPU kernel, and its gradient to the
  Triton backward."""
  from probjax.ops.attention.backends import mosaic_gpu as pm
  _fake_triton_sm90(monkeypatch, device_kind=True)
  mask = {"none": None, "causal": M.CausalMask(),
          "window&lengths": M.LocalWindowMask(100, 20) & M.LengthMask(jnp.array([300, 250]), jnp.array([300, 70])),
          "segments": make_mask("segments", 2, 300, 300)}[mask_name]
  q = jax.ShapeDtypeStruct((2, 300, 8, d), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((2, 300, 2, d), jnp.bfloat16)
  # wgs None: the default config; no band or static lengths make every loop bound a constant.
  cfg = None if wgs is None else pm.MosaicForwardConfig(64, 128, 2, wgs, persistent)
  loss = lambda q, k, v: jnp.sum(pm.attention(q, k, v, mask=mask, forward_config=cfg).astype(jnp.float32))
  text = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(q, kv, kv).lower(lowering_platforms=("cuda",)).as_text()
  calls = set(re.findall(r"custom_call @([\w$.]+)", text))
  kernels = set(re.findall(r"probjax_attention_\w+", text))
  assert calls == {"mosaic_gpu_v2", "__gpu$xla.gpu.triton"}, calls
  assert "probjax_attention_fwd_mosaic" in kernels and "probjax_attention_fwd" not in kernels, kernels
  assert any(k.startswith("probjax_attention_bwd") for k in kernels), kernels


@pytest.mark.parametrize("mask_name,d,wgs,persistent,cluster", [
    ("none", 128, 2, True, 2), ("causal", 64, 2, True, 1), ("segments", 64, 1, False, 1),
    ("window&lengths", 128, 2, False, 1)])
def test_mosaic_forward_overlap_lowers_for_sm90(monkeypatch, mask_name, d, wgs, persistent, cluster):
  """``overlap=True`` (Q K^T of the next tile issued with P V of this one, register P as the
  second wgmma's operand: the path interpret mode runs one product after the other) lowers."""
  from probjax.ops.attention.backends import mosaic_gpu as pm
  _fake_triton_sm90(monkeypatch, device_kind=True)
  mask = {"none": None, "causal": M.CausalMask(),
          "window&lengths": M.LocalWindowMask(100, 20) & M.LengthMask(jnp.array([256, 250]), jnp.array([256, 70])),
          "segments": make_mask("segments", 2, 256, 256)}[mask_name]
  cfg = pm.MosaicForwardConfig(64, 128, 2, wgs, persistent, cluster=cluster, overlap=True)
  x = jax.ShapeDtypeStruct((2, 256, 4, d), jnp.bfloat16)
  text = jax.jit(lambda q, k, v: pm.attention(q, k, v, mask=mask, forward_config=cfg)).trace(
      x, x, x).lower(lowering_platforms=("cuda",)).as_text()
  assert "probjax_attention_fwd_mosaic" in text and "mosaic_gpu_v2" in text


@pytest.mark.parametrize("persistent", [False, True])
def test_mosaic_forward_clusters_lower_for_sm90(monkeypatch, persistent):
  """CTA pairs sharing K/V tiles by TMA multicast (``cluster=2``) lower to one Mosaic GPU
  kernel launched in clusters, with a band too; segment ids or an odd number of query tiles
  are refused."""
  from probjax.ops.attention.backends import mosaic_gpu as pm
  _fake_triton_sm90(monkeypatch, device_kind=True)
  cfg = pm.MosaicForwardConfig(64, 128, 2, 2, persistent, cluster=2)
  kv = jax.ShapeDtypeStruct((2, 700, 2, 128), jnp.bfloat16)
  lower = lambda t, mask=None: jax.jit(lambda q, k, v: pm.attention(q, k, v, mask=mask, forward_config=cfg)).trace(
      jax.ShapeDtypeStruct((2, t, 8, 128), jnp.bfloat16), kv, kv).lower(lowering_platforms=("cuda",)).as_text()
  for mask in (None, M.CausalMask()):
    text = lower(500, mask)  # 4 query tiles of 128 rows: 2 clusters per head
    assert "probjax_attention_fwd_mosaic" in text and "mosaic_gpu_v2" in text
  with pytest.raises(ValueError, match="not a multiple of the cluster size"):
    lower(300)
  with pytest.raises(ValueError, match="segment ids"):
    lower(500, make_mask("segments", 2, 500, 700))


@pytest.mark.parametrize("t", [3000, 1500])
def test_mosaic_forward_copies_no_inputs_at_odd_lengths(monkeypatch, t):
  """Lengths off the 128-row tiles: the Mosaic forward reads q, k, v where they are (TMA fills
  the overhang with zeros) and writes the output in place; only lengths off Mosaic's 8-row
  TMA granule (1500) pad q, k and v (by 4 rows) and slice the output."""
  import re
  from probjax.ops.attention.backends import mosaic_gpu as pm
  _fake_triton_sm90(monkeypatch, device_kind=True)
  q = jax.ShapeDtypeStruct((4, t, 8, 128), jnp.bfloat16)
  text = jax.jit(lambda q, k, v: pm.attention(q, k, v, mask=M.CausalMask())).trace(q, q, q).lower(
      lowering_platforms=("cuda",)).as_text()
  in_place = re.search(r"custom_call @mosaic_gpu_v2\(%arg0, %arg1, %arg2,", text) is not None
  assert in_place == (t % 8 == 0)
  sliced = re.search(r"stablehlo.slice[^\n]*-> tensor<4x\d+x8x128xbf16>", text) is not None
  assert sliced == (t % 8 != 0)  # (only the statistics, unused here, are sliced at 3000)
  # The all-Mosaic gradient: every [batch, seq, heads, head_dim] array keeps T (or T's 8-row
  # granule) rows; only the [batch, heads, seq] statistics are padded to whole tiles.
  loss = lambda q, k, v: jnp.sum(pm.attention(q, k, v, mask=M.CausalMask(),
                                              backward_pass_impl="mosaic").astype(jnp.float32))
  grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(q, q, q).lower(lowering_platforms=("cuda",)).as_text()
  assert "mosaic_gpu_v2" in grad
  lengths = {int(n) for n in re.findall(r"tensor<4x(\d+)x8x128xbf16>", grad)}
  assert lengths == {t, -(-t // 8) * 8}, lengths


@pytest.mark.parametrize("mask_name,d,wgs", [("none", 64, 2), ("causal&lengths", 128, 2), ("none", 128, 1),
                                              ("segments", 64, 2)])
def test_mosaic_backward_lowers_for_sm90(monkeypatch, mask_name, d, wgs):
  """The all-Mosaic path: forward, dK/dV and dQ kernels, each one Mosaic GPU call."""
  from probjax.ops.attention.backends import mosaic_gpu as pm
  _fake_triton_sm90(monkeypatch, device_kind=True)
  mask = {"none": None, "segments": MASKS["segments"],
          "causal&lengths": M.CausalMask() & M.LengthMask(jnp.array([300, 250]), jnp.array([300, 70]))}[mask_name]
  q = jax.ShapeDtypeStruct((2, 300, 8, d), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((2, 300, 2, d), jnp.bfloat16)
  cfgs = {} if wgs == 2 else dict(forward_config=pm.MosaicForwardConfig(64, 128, 3, 1),
                                  backward_config=pm.MosaicBackwardConfig(128, 128, 2, 1))
  loss = lambda q, k, v: jnp.sum(pm.attention(q, k, v, mask=mask, backward_pass_impl="mosaic",
                                              **cfgs).astype(jnp.float32))
  text = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(q, kv, kv).lower(lowering_platforms=("cuda",)).as_text()
  assert set(re.findall(r"custom_call @([\w$.]+)", text)) == {"mosaic_gpu_v2"}
  kernels = set(re.findall(r"probjax_attention_\w+_mosaic\b", text))
  assert kernels == {"probjax_attention_fwd_mosaic", "probjax_attention_bwd_dkv_mosaic",
                     "probjax_attention_bwd_dq_mosaic"}, kernels


@pytest.mark.parametrize("d,shared", [(64, False), (128, False), (128, True)])
def test_mosaic_fused_dq_backward_lowers_for_sm90(monkeypatch, d, shared):
  """``fused_dq``: forward and one dK/dV kernel that adds dQ into a float32 buffer in place
  (TMA reduce-add); no dQ kernel. ``shared_dq``: one dQ partial per CTA, the two warpgroups
  each taking 64 of the 128 columns."""
  from probjax.ops.attention.backends import mosaic_gpu as pm
  _fake_triton_sm90(monkeypatch, device_kind=True)
  q = jax.ShapeDtypeStruct((2, 300, 8, d), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((2, 300, 2, d), jnp.bfloat16)
  bcfg = dataclasses.replace(pm.backward.DEFAULTS[d], fused_dq=True, shared_dq=shared)
  loss = lambda q, k, v: jnp.sum(pm.attention(q, k, v, mask=M.CausalMask(), backward_pass_impl="mosaic",
                                              backward_config=bcfg).astype(jnp.float32))
  text = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(q, kv, kv).lower(lowering_platforms=("cuda",)).as_text()
  kernels = set(re.findall(r"probjax_attention_\w+_mosaic\b", text))
  assert kernels == {"probjax_attention_fwd_mosaic", "probjax_attention_bwd_dkv_mosaic"}, kernels


@pytest.mark.parametrize("d,dv,mask_name,bwd", [(192, 128, "causal", None), (192, 128, "none", None),
                                                (128, 64, "causal", None), (128, 64, "window&kv_len", None),
                                                (128, 64, "causal", dict(fused_dq=True, shared_dq=True))])
def test_mosaic_backward_value_head_dim_lowers_for_sm90(monkeypatch, d, dv, mask_name, bwd):
  """Values of their own width (MLA's 192/128, and 128/64) at full size, B2 H16 T4096: the
  Mosaic forward and both backward kernels at the default configs (192/128: 64-row key tiles
  in three slots, :func:`~probjax.ops.attention.backends.mosaic_gpu.backward.default_config`),
  dV and the V/dO tiles at the values' width; or the fused and shared dQ."""
  from probjax.ops.attention.backends import mosaic_gpu as pm
  _fake_triton_sm90(monkeypatch, device_kind=True)
  mask = MASKS[mask_name]
  q = jax.ShapeDtypeStruct((2, 4096, 16, d), jnp.bfloat16)
  v = jax.ShapeDtypeStruct((2, 4096, 16, dv), jnp.bfloat16)
  kw = {} if bwd is None else dict(backward_config=dataclasses.replace(pm.backward.DEFAULTS[d], **bwd))
  loss = lambda q, k, v: jnp.sum(pm.attention(q, k, v, mask=mask, backward_pass_impl="mosaic", **kw).astype(jnp.float32))
  text = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(q, q, v).lower(lowering_platforms=("cuda",)).as_text()
  assert set(re.findall(r"custom_call @([\w$.]+)", text)) == {"mosaic_gpu_v2"}
  kernels = set(re.findall(r"probjax_attention_\w+_mosaic\b", text))
  assert kernels == {"probjax_attention_fwd_mosaic", "probjax_attention_bwd_dkv_mosaic",
                     *(() if bwd else ("probjax_attention_bwd_dq_mosaic",))}, kernels


@pytest.mark.parametrize("mask_name,backward", [("none", "auto"), ("causal", "auto"), ("segments", "mosaic"),
                                               ("causal", "mosaic")])
def test_mosaic_forward_with_score_mod_lowers_for_sm90(monkeypatch, mask_name, backward):
  """A score modifier (tanh soft-cap of an ALiBi-like bias: int32 abs, convert, tanh) inside
  the Mosaic forward lowers for sm_90, and its gradient in the Triton backward ("auto") or
  in the Mosaic backward (its vjp inside both Mosaic backward kernels)."""
  from probjax.ops.attention.backends import mosaic_gpu as pm
  _fake_triton_sm90(monkeypatch, device_kind=True)
  mod = lambda s, b, h, qi, ki: 20.0 * jnp.tanh((s - 0.25 * (h + 1) * jnp.abs(qi - ki).astype(jnp.float32)) / 20.0)
  q = jax.ShapeDtypeStruct((2, 300, 8, 128), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((2, 300, 2, 128), jnp.bfloat16)
  mask = MASKS[mask_name] if mask_name != "segments" else make_mask("segments", 2, 300, 300)
  loss = lambda q, k, v: jnp.sum(pm.attention(q, k, v, mask=mask, score_mod=mod,
                                              backward_pass_impl=backward).astype(jnp.float32))
  text = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(q, kv, kv).lower(lowering_platforms=("cuda",)).as_text()
  assert "probjax_attention_fwd_mosaic" in text and "probjax_attention_bwd" in text
  if backward == "mosaic":
    assert "probjax_attention_bwd_dkv_mosaic" in text and "probjax_attention_bwd_dq_mosaic" in text



@pytest.mark.parametrize("impl", ["triton_split", "triton_fused", "triton_onepass"])
def test_triton_kernels_with_lengths_lower_for_sm90(monkeypatch, impl):
  """Query and key lengths: the loads of the tile a length cuts are row-masked against this
  batch element's length (the rows past it may hold NaN), in the forward, the backward and
  the split-KV forward."""
  _fake_triton_sm90(monkeypatch, device_kind=True)
  q = jax.ShapeDtypeStruct((2, 300, 8, 128), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((2, 300, 2, 128), jnp.bfloat16)
  mask = M.LengthMask(jnp.array([300, 141]), jnp.array([250, 77]))
  loss = lambda q, k, v: jnp.sum(pt.attention(q, k, v, mask=mask, backward_pass_impl=impl).astype(jnp.float32))
  text = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(q, kv, kv).lower(lowering_platforms=("cuda",)).as_text()
  assert "probjax_attention_fwd" in text and "probjax_attention_bwd" in text
  decode = M.LengthMask(jnp.array([1, 0]), jnp.array([4096, 7]))
  text = jax.jit(lambda q, k, v: pt.attention(q, k, v, mask=decode, split_kv=True)).trace(
      jax.ShapeDtypeStruct((2, 1, 32, 128), jnp.bfloat16), *(jax.ShapeDtypeStruct((2, 4096, 8, 128), jnp.bfloat16),) * 2
  ).lower(lowering_platforms=("cuda",)).as_text()
  assert "probjax_attention_fwd_split_kv" in text


@pytest.mark.parametrize("fwd,bwd", [
    (dict(persistent=True, cluster=2), None), (dict(compute_wgs=3), None),
    (dict(persistent=True, overlap=True), dict(fused_dq=True)), ({}, dict(fused_dq=True, shared_dq=True))])
def test_mosaic_kernels_with_lengths_lower_for_sm90(monkeypatch, fwd, bwd):
  """Query and key lengths in the Mosaic kernels' variants (CTA pairs, three warpgroups,
  overlap, the fused and shared dQ): the shared-memory tiles a length cuts are zeroed past it
  (common.zero_rows_past) before the products."""
  from probjax.ops.attention.backends import mosaic_gpu as pm
  _fake_triton_sm90(monkeypatch, device_kind=True)
  q = jax.ShapeDtypeStruct((2, 256, 8, 128), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((2, 300, 2, 128), jnp.bfloat16)
  mask = M.LengthMask(jnp.array([256, 141]), jnp.array([250, 77]))
  cfg = pm.MosaicForwardConfig(**{"block_k": 128, **fwd})
  kw = {} if bwd is None else dict(backward_pass_impl="mosaic",
                                   backward_config=dataclasses.replace(pm.backward.DEFAULTS[128], **bwd))
  loss = lambda q, k, v: jnp.sum(pm.attention(q, k, v, mask=mask, forward_config=cfg, **kw).astype(jnp.float32))
  text = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(q, kv, kv).lower(lowering_platforms=("cuda",)).as_text()
  assert "probjax_attention_fwd_mosaic" in text and "probjax_attention_bwd" in text


def test_value_head_dim_other_than_keys_lowers_a_kernel_for_sm90(monkeypatch):
  """d_v != d_qk (MLA's 192/128): the default lowers to a kernel (cuDNN where probjax's extension
  is there, else the Mosaic forward with the Triton backward), primal and gradient."""
  from probjax.nn.layers.attention import dot_product_attention
  _fake_cudnn(monkeypatch)
  _fake_triton_sm90(monkeypatch, device_kind=True)
  _fake_dispatch_sm90(monkeypatch)
  q = jax.ShapeDtypeStruct((2, 1024, 4, 192), jnp.bfloat16)
  v = jax.ShapeDtypeStruct((2, 1024, 4, 128), jnp.bfloat16)
  f = lambda q, v: jnp.sum(dot_product_attention(q, q, v, mask=M.CausalMask()).astype(jnp.float32))
  for fn in (f, jax.grad(f, argnums=(0, 1))):
    text = jax.jit(fn).trace(q, v).lower(lowering_platforms=("cuda",)).as_text()
    assert "probjax_attention" in text or _cudnn_calls(text)
