"""The Triton kernel computes ``mask_mod(b, h, q_idx, kv_idx) -> bool`` masks: values and every
gradient against the float64 reference (interpret mode, 16-row tiles at odd lengths), tile
skipping from the mask's tile classes, functions of the batch element and the query head under
GQA, a function closing over traced values (every tile PARTIAL), NaN in keys and values the
mask excludes, and the refusals (functions the kernel cannot lower, the split-KV forward).

Interpret mode compiles each call's kernels anew (at most a few seconds of CPU a case, at these
shapes): every case runs in the default selection.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from probjax.ops.attention import dot_product_attention, explain_dispatch
from probjax.ops.attention import masks as M
from probjax.ops.attention.backends import triton as pt
from probjax.ops.attention.backends.triton import tiles
from probjax.ops.attention.call import AttentionCall
from probjax.ops.attention.dispatch import Device
from probjax.ops.attention.masks import CausalMask, KVLenMask, MaskMod
from probjax.ops.attention.reference import reference_vjp
from probjax.ops.attention.tolerances import max_error, tolerance
from probjax.testing import make_inputs

pytestmark = pytest.mark.timeout(300, method="thread")

B, TQ, TK, H, HKV, D = 2, 37, 45, 4, 2, 16  # odd lengths (partial last tiles), GQA: 2 query heads a KV head
FC16 = pt.ForwardConfig(16, 16, 4, 1)
BC16 = pt.BackwardConfig(16, 16, 16, 16, 4, 1)


def sliding(b, h, q, k):  # causal window of 20 keys: EMPTY, FULL and PARTIAL 16 x 16 tiles
  return (k <= q) & (q - k < 20)


def per_head(b, h, q, k):  # a window growing with the query head; head 1 sees no key at all
  return (k <= q + 2) & (q - k < 6 + 4 * h) & (h != 1)


def per_batch(b, h, q, k):  # batch element 1 sees a wider window, and never key 3
  return (k <= q) & (q - k < 8 + 16 * b) & ((b == 0) | (k != 3))


MASKS = {"sliding": lambda: MaskMod(sliding), "per_head": lambda: MaskMod(per_head, heads=H),
         "per_batch": lambda: MaskMod(per_batch, batch=B),
         "per_head_causal_kvlen": lambda: MaskMod(per_head, heads=H) & CausalMask(4) & KVLenMask(jnp.array([TK, 30])),
         "sliding_and_per_batch": lambda: MaskMod(sliding) & MaskMod(per_batch, batch=B)}


def _check(mask, x, *, impl="triton_split", scale=0.3, k=None, v=None, score_mod=None):
  """Triton's output and gradients on ``x`` (keys/values ``k``/``v`` where given) against the
  float64 reference on ``x``; every result finite."""
  f = lambda q, k, v: pt.attention(q, k, v, mask=mask, scale=scale, score_mod=score_mod, backward_pass_impl=impl,
                                   forward_config=FC16, backward_config=BC16, interpret=True)
  out, vjp = jax.vjp(f, x.q, x.k if k is None else k, x.v if v is None else v)
  got = (out,) + vjp(x.do)
  ref = reference_vjp(x.q, x.k, x.v, x.do, mask=mask, scale=scale, score_mod=score_mod)
  for name, g, r in zip(("out", "dq", "dk", "dv"), got, ref):
    assert np.all(np.isfinite(np.asarray(g))), f"{name} has NaN/inf"
    err, tol = max_error(g, r), tolerance(x.q.dtype, grad=name != "out")
    assert err <= tol, f"{name}: max error {err:.3g} > {tol:.3g} ({impl})"
  return got


def test_empty_tiles_between_live_ones():
  """EMPTY tiles between a global key tile and a window (skipped), at odd lengths, GQA."""
  _check(MaskMod(_global_and_window) & KVLenMask(jnp.array([TK, 33])), make_inputs(9, B, TQ + 30, TK, H, HKV, D))


@pytest.mark.parametrize("name,impl", [
    ("sliding", "triton_split"), ("per_head", "triton_fused"), ("per_batch", "triton_onepass"),
    ("per_head_causal_kvlen", "triton_split"), ("sliding_and_per_batch", "triton_fused"),
    ("per_head", "triton_onepass"),
])
def test_values_and_gradients(name, impl):
  _check(MASKS[name](), make_inputs(1, B, TQ, TK, H, HKV, D), impl=impl)


def test_with_score_mod():
  """A mask_mod and a score_mod of the same indices in one call."""
  distance = lambda s, b, h, q, k: s - 0.1 * (h + 1) * jnp.abs(q - k).astype(jnp.float32)
  _check(MASKS["per_head"](), make_inputs(11, B, TQ, TK, H, HKV, D), score_mod=distance)


def test_bfloat16():
  _check(MASKS["per_head"](), make_inputs(2, B, TQ, TK, H, HKV, D, dtype=jnp.bfloat16))


def _global_and_window(b, h, q, k):  # key tile 0 global; a causal window of 32: EMPTY tiles between
  return (k < 16) | ((k <= q) & (q - k < 32))


def test_tile_lists_skip_empty_tiles_and_full_tiles_skip_the_function():
  """The kernels loop over lists of the mask's tile classes (per batch element, per outer tile
  of each kernel's orientation): EMPTY tiles are never loaded, wherever they lie, FULL ones run
  without the predicate, PARTIAL ones evaluate it."""
  m = MaskMod(_global_and_window)
  cls = np.asarray(m.classify_tiles(1, 80, 80, 16, 16))[0]  # EMPTY 0, PARTIAL 1, FULL 2
  assert cls.tolist() == [[2, 0, 0, 0, 0], [2, 1, 0, 0, 0], [2, 2, 1, 0, 0], [2, 1, 2, 1, 0], [2, 0, 1, 2, 1]]
  for by_q, want in ((True, cls), (False, cls.T)):
    tm, ops = tiles.mask_operands(m, 1, 80, 80, 80, 80, 16, 16, by_q=by_q)
    assert tm.fn is not None and len(ops) == 1  # the tile lists; nothing closed over
    lists = np.asarray(ops[0])[0]  # [n_outer, 2, 1 + n_inner]
    for i, row in enumerate(want):
      for r, c in ((0, 1), (1, 2)):
        n = lists[i, r, 0]
        assert lists[i, r, 1:1 + n].tolist() == np.flatnonzero(row == c).tolist(), (by_q, i, c)
  # The traced function is the mask's element function on the kernel's tile index shapes.
  q, k = jnp.arange(16, 32)[:, None], jnp.arange(0, 16)[None, :]
  got = tm.fn([], jnp.int32(0), jnp.int32(0), q, k)
  assert np.array_equal(np.asarray(got), np.asarray(m.element(q, k, 0)))
  tm_t, _ = tiles.mask_operands(m, 1, 64, 64, 64, 64, 16, 32, by_q=False)  # the dK/dV kernels' transposed tiles
  assert tm_t.fn.jaxpr.invars[2].aval.shape == (1, 16) and tm_t.fn.jaxpr.invars[3].aval.shape == (32, 1)


def test_traced_closure_every_tile_partial():
  """A function closing over values passed to jax.jit (a window, a flag, a one-element array):
  classified as every tile PARTIAL, read by the kernel as operands, exact."""
  x = make_inputs(3, B, TQ, TK, H, HKV, D)
  window, flag, shift = jnp.int32(11), jnp.array(True), jnp.array([[2]], jnp.int32)

  def mask(window, flag, shift):
    return MaskMod(lambda b, h, q, k: (k <= q + shift) & (q - k < window) & (flag | (k > 0)))

  seen = {}

  def run(q, k, v, window, flag, shift):
    m = mask(window, flag, shift)
    seen["classes"] = m.get("mask_mod").classify(M.TileGrid(B, TQ, TK, 16, 16))
    seen["consts"] = len(m.tile_function((16, 1), (1, 16)).consts)
    return pt.attention(q, k, v, mask=m, scale=0.3, forward_config=FC16, backward_config=BC16, interpret=True)

  # The vjp inside the jit: the function's closure holds that trace's values (as on the XLA path).
  @jax.jit
  def out_and_grads(q, k, v, do, window, flag, shift):
    out, vjp = jax.vjp(lambda q, k, v: run(q, k, v, window, flag, shift), q, k, v)
    return (out,) + vjp(do)

  got = out_and_grads(x.q, x.k, x.v, x.do, window, flag, shift)
  assert seen["classes"] == (True, False) and seen["consts"] == 3  # every tile PARTIAL; three operands
  ref = reference_vjp(x.q, x.k, x.v, x.do, mask=mask(window, flag, shift), scale=0.3)
  for name, g, r in zip(("out", "dq", "dk", "dv"), got, ref):
    assert max_error(g, r) <= tolerance(jnp.float32, grad=name != "out"), name


@pytest.mark.parametrize("impl", ["triton_split", "triton_onepass"])
def test_nan_in_excluded_keys_never_reaches_results(impl):
  """Keys and values the mask excludes for every query (key 5; keys 40 and after) may hold NaN:
  the output and every gradient are those of the clean inputs, and the excluded keys' dK, dV
  are zero."""
  x = make_inputs(4, B, TQ, TK, H, HKV, D)
  m = MaskMod(lambda b, h, q, k: (k <= q + 8) & (k != 5) & (k < 40)) & MaskMod(per_head, heads=H)
  bad = jnp.zeros(TK, bool).at[5].set(True).at[40:].set(True)[None, :, None, None]
  k, v = jnp.where(bad, jnp.nan, x.k), jnp.where(bad, jnp.nan, x.v)
  _, _, dk, dv = _check(m, x, impl=impl, k=k, v=v)
  assert not np.any(np.asarray(dk)[:, np.asarray(bad[0, :, 0, 0])])
  assert not np.any(np.asarray(dv)[:, np.asarray(bad[0, :, 0, 0])])


def test_forward_mode():
  """jax.jvp through the kernel (its fused forward + tangent kernel) against the XLA path's."""
  x = make_inputs(5, B, TQ, TK, H, HKV, D)
  m = MaskMod(per_head, heads=H)
  t = make_inputs(6, B, TQ, TK, H, HKV, D)
  f = lambda impl: lambda q, k, v: dot_product_attention(q, k, v, mask=m, scale=0.3, implementation=impl,
                                                         interpret=True)
  got = jax.jvp(f("triton"), (x.q, x.k, x.v), (t.q, t.k, t.v))
  want = jax.jvp(f("xla"), (x.q, x.k, x.v), (t.q, t.k, t.v))
  for g, w in zip(got, want):
    assert max_error(g, w) <= tolerance(jnp.float32, grad=True)


def test_refusals_name_the_reason():
  """A function the kernel cannot compute is refused by supports with the reason, and an
  explicit request raises it: one indexing an array per position (a gather), one using an
  operation Pallas Triton has no lowering for. The split-KV forward refuses every mask_mod."""
  doc = jnp.array([[0] * 20 + [1] * 25] * B, jnp.int32)
  shape, kv = (B, TQ, H, D), (B, TK, HKV, D)
  docs = MaskMod(lambda b, h, q, k: doc[b, q] == doc[b, k], batch=B)
  why = pt.supports(shape, kv, jnp.float32, mask=docs, interpret=True)
  assert why and "closes over an array of shape (2, 45)" in why and "SegmentMask" in why
  rounded = MaskMod(lambda b, h, q, k: jnp.round(q * 0.5) >= k * 0.5)
  why = pt.supports(shape, kv, jnp.float32, mask=rounded, interpret=True)
  assert why and "round" in why and "cannot lower" in why
  assert pt.supports(shape, kv, jnp.float32, mask=MaskMod(sliding) & CausalMask(), interpret=True) is None
  x = make_inputs(7, B, TQ, TK, H, HKV, D)
  for m, match in ((docs, "closes over an array"), (rounded, "round")):
    with pytest.raises(ValueError, match=match):
      dot_product_attention(x.q, x.k, x.v, mask=m, implementation="triton", interpret=True)
    with pytest.raises(ValueError, match=match):
      pt.attention(x.q, x.k, x.v, mask=m, interpret=True)
  with pytest.raises(ValueError, match="split_kv=True cannot compute this call: mask_mod"):
    pt.attention(x.q, x.k, x.v, mask=MaskMod(sliding), split_kv=True, interpret=True)


def test_dispatch_takes_triton_only_when_asked():
  """The Triton backend takes a mask_mod (the registry's supports); the other kernels refuse it
  by name, and the default keeps it on the XLA path on every device."""
  from probjax.ops.attention.registry import REGISTRY
  m = MaskMod(per_head, heads=8) & CausalMask()
  call = AttentionCall((2, 256, 8, 64), (2, 256, 4, 64), jnp.bfloat16, mask=m, interpret=True)
  assert REGISTRY.get("triton").supports(call, Device("gpu", (9, 0), 140 << 30)) is None
  assert "'mask_mod'" in REGISTRY.get("mosaic").supports(call, Device("gpu", (9, 0), 140 << 30))
  for device in (Device("gpu", (9, 0), 140 << 30), Device.interpreter()):
    assert explain_dispatch((2, 256, 8, 64), (2, 256, 4, 64), jnp.bfloat16, mask=m,
                            device=device).implementation == "xla"
  rule = explain_dispatch((2, 256, 8, 64), (2, 256, 4, 64), jnp.bfloat16, mask=m,
                          device=Device("gpu", (9, 0), 140 << 30)).rule
  assert "mask_mod" in rule and "implementation='triton'" in rule


# -- GPU (--gpu): full size, default tiles ------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["triton_split", "triton_fused", "triton_onepass"])
def test_gpu_full_size(impl):
  b, tq, tk, h, hkv, d = 2, 1000, 1500, 8, 2, 128
  x = make_inputs(8, b, tq, tk, h, hkv, d, dtype=jnp.bfloat16)
  m = _full_size_mask(h, tk)
  f = lambda q, k, v: pt.attention(q, k, v, mask=m, backward_pass_impl=impl)
  out, vjp = jax.vjp(f, x.q, x.k, x.v)
  ref = reference_vjp(x.q, x.k, x.v, x.do, mask=m)
  for name, g, r in zip(("out", "dq", "dk", "dv"), (out,) + vjp(x.do), ref):
    assert max_error(g, r) <= tolerance(jnp.bfloat16, grad=name != "out"), name


def _full_size_mask(h, tk):  # test_gpu_full_size's: PARTIAL tiles evaluate the function
  return MaskMod(lambda b_, h_, q, k: (k <= q + 500) & (q + 500 - k < 256 + 64 * h_), heads=h) & KVLenMask(
      jnp.array([tk, 1200]))


@pytest.mark.parametrize("impl", ["triton_split", "triton_fused", "triton_onepass"])
def test_full_size_configs_fit_sm90_shared_memory(monkeypatch, impl):
  """The tiles chosen on an H100/H200 for test_gpu_full_size's call (bf16, head_dim 128) fit
  232,448 bytes with the shared memory a mask_mod costs (config.mask_mod_smem_bytes: a zeroed
  copy of the K and V tiles). The model reproduces the request the one-pass backward made on
  an H100 with the table's 64 x 128 tiles at 3 stages, 280,600 bytes."""
  from probjax.ops.attention.backends.triton import config as cfg
  b, tq, tk, h, hkv, d = 2, 1000, 1500, 8, 2, 128
  table = cfg.BACKWARD_TABLE[("sm_90", "bfloat16", 128)]
  assert table.smem_bytes(2, d, onepass=True, mask_mod=True) == 280600
  assert table.smem_bytes(2, d, onepass=True) == 214528  # without the mask_mod's copies
  monkeypatch.setattr(cfg, "kernel_device", lambda interpret: "sm_90")
  q = jax.ShapeDtypeStruct((b, tq, h, d), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((b, tk, hkv, d), jnp.bfloat16)
  m = _full_size_mask(h, tk)
  device, fc, got_impl, bc = pt._configs(q, kv, kv, None, None, impl, False, pt._has_mask_mod(m))
  assert device == "sm_90" and got_impl == impl
  limit = cfg.SMEM_LIMIT["sm_90"]
  assert limit == 232448
  assert bc.smem_bytes(2, d, onepass=impl == "triton_onepass", mask_mod=True) <= limit
  assert fc.smem_bytes(2, d, mask_mod=True) <= limit
  if impl == "triton_onepass":  # stages shrink first: 247,320 bytes at 2 stages, 214,040 at 1
    assert bc == dataclasses.replace(table, num_stages=1, fast_exp2=True)
  else:  # the two-pass kernels keep the table's tiles: 229,912 bytes
    assert bc == dataclasses.replace(table, fast_exp2=True)
  # An explicit config the mask_mod pushes over the device's shared memory is refused.
  with pytest.raises(ValueError, match="shared memory"):
    pt._configs(q, kv, kv, None, table, "triton_onepass", False, True)


@pytest.mark.parametrize("d", [128, 256])
def test_mask_mod_forward_and_backward_fit_sm90(d):
  """Every default config a mask_mod call gets on sm_90, forward and the three backwards, at
  head_dim 128 and 256 in bf16 and fp32, fits the device with the mask_mod's copies."""
  from probjax.ops.attention.backends.triton import config as cfg
  limit = cfg.SMEM_LIMIT["sm_90"]
  for dtype in (jnp.bfloat16, jnp.float32):
    isz = jnp.dtype(dtype).itemsize
    assert cfg.fit_forward_config(None, dtype, d, 4096, 4096, "sm_90", mask_mod=True).smem_bytes(
        isz, d, mask_mod=True) <= limit
    for impl in cfg.BACKWARD_IMPLS:
      bc = cfg.fit_backward_config(None, dtype, d, 4096, 4096, "sm_90", impl, mask_mod=True)
      assert bc.smem_bytes(isz, d, onepass=impl == "triton_onepass", mask_mod=True) <= limit, (dtype, impl)


# -- lowering for sm_90 on CPU (no GPU): interpret mode checks the arithmetic, this that Pallas
# lowers the traced function, its scalar operands and the tile-list loops for a Hopper GPU.
@pytest.mark.parametrize("impl", ["triton_split", "triton_fused", "triton_onepass"])
def test_lowers_for_sm90(monkeypatch, impl):
  from probjax.testing import pretend_h200, verify_triton_lowering
  pretend_h200(monkeypatch)
  monkeypatch.setattr(pt, "supports", lambda *a, **kw: None)
  verify_triton_lowering(monkeypatch)
  q = jax.ShapeDtypeStruct((2, 300, 8, 128), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((2, 300, 2, 128), jnp.bfloat16)

  def loss(q, k, v, window, flag):
    m = MaskMod(lambda b, h, i, j: _global_and_window(b, h, i, j) & ((i - j < window + 8 * h) | flag), heads=8)
    out = pt.attention(q, k, v, mask=m & KVLenMask(jnp.array([300, 170])), backward_pass_impl=impl,
                       forward_config=pt.ForwardConfig(128, 64, 8, 3),
                       backward_config=pt.BackwardConfig(64, 128, 128, 64, 8, 2))
    return jnp.sum(out.astype(jnp.float32))

  s = lambda dtype: jax.ShapeDtypeStruct((), dtype)
  text = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(q, kv, kv, s(jnp.int32), s(jnp.bool_)).lower(
      lowering_platforms=("cuda",)).as_text()
  assert "probjax_attention_fwd" in text and "probjax_attention_bwd" in text
  assert text.count("custom_call @__gpu$xla.gpu.triton") >= 2


def test_public_api():
  """``mask=fn`` through flex_attention / dot_product_attention (batch axes flattened) with
  ``implementation="triton"``, equal to the XLA path's; under jit with a traced window, grads too."""
  from probjax.ops.attention import flex_attention
  x = make_inputs(10, B, TQ, TK, H, HKV, D)
  fn = lambda b, h, q, k: (k <= q + 2) & (q - k < 6 + 4 * h) & (b >= 0)
  run = lambda f, impl, *a, **kw: f(*a, mask=fn, implementation=impl, interpret=True, **kw)
  assert max_error(run(flex_attention, "triton", x.q, x.k, x.v),
                   run(flex_attention, "xla", x.q, x.k, x.v)) <= tolerance(jnp.float32)
  q4, k4, v4 = x.q[:, None], x.k[:, None], x.v[:, None]
  assert max_error(run(dot_product_attention, "triton", q4, k4, v4),
                   run(dot_product_attention, "xla", q4, k4, v4)) <= tolerance(jnp.float32)
  grad = lambda impl: jax.jit(lambda q, w: jax.grad(lambda q: jnp.sum(flex_attention(
      q, x.k, x.v, mask=lambda b, h, i, j: (j <= i) & (i - j < w), implementation=impl, interpret=True) * x.do))(q))
  want = grad("xla")(x.q, jnp.int32(7))
  assert max_error(grad("triton")(x.q, jnp.int32(7)), want) <= tolerance(jnp.float32, grad=True)
