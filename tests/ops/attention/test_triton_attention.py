"""Triton-Pallas attention kernels against the float64 reference.

CPU: Pallas interpret mode at small, odd shapes with 16/32 tiles: the conformance suite
(tests/ops/attention/conformance.py) on each backward pass, and the kernel's own features
(group splits, head groups, split-KV decoding, configs and shared-memory models). GPU (``--gpu``):
the same checks at full size with the default (tuned, smem-fitted) tiles.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from probjax.ops.attention.backends import triton as pt
from probjax.ops.attention.masks import (CausalMask, KVLenMask, LengthMask, LocalWindowMask,
                                         SegmentMask)
from probjax.ops.attention import masks as M
from probjax.ops.attention.reference import reference_attention, reference_vjp
from probjax.ops.attention.tolerances import max_error, tolerance
from probjax.ops.attention.backends.triton import config as cfg
from probjax.testing import float32_is_tf32
from tests.ops.attention.conformance import AttentionConformance

TF32 = float32_is_tf32()  # on a GPU, float32 matmuls run as TF32 (tolerances bound that)

# Interpret-mode runs that crawl on a loaded machine fail loudly rather than stall CI.
pytestmark = pytest.mark.timeout(300, method="thread")
# Interpret mode: each new shape, config or mask compiles the forward and backward kernels
# (2-9 s of CPU a case, most of it XLA compiling; the shapes run in milliseconds). make test
# keeps one or two cases of each kernel feature and backward variant; the rest of each grid is
# slow.
SLOW = pytest.mark.slow


def _slow_except(values, *fast):
  """``values`` as parameters, all but those in ``fast`` marked slow."""
  return [v if v in fast else pytest.param(*(v if isinstance(v, tuple) else (v,)), marks=SLOW) for v in values]

IMPLS = ("triton_split", "triton_fused", "triton_onepass")
FC16 = pt.ForwardConfig(16, 16, 4, 1)
BC16 = pt.BackwardConfig(16, 16, 16, 16, 4, 1)
BC_MIXED = pt.BackwardConfig(32, 16, 16, 32, 4, 1)


def _inputs(seed, b, tq, tk, h, hkv, d, dtype):
  ks = jax.random.split(jax.random.key(seed), 4)
  q = jax.random.normal(ks[0], (b, tq, h, d), jnp.float32).astype(dtype)
  k = jax.random.normal(ks[1], (b, tk, hkv, d), jnp.float32).astype(dtype)
  v = jax.random.normal(ks[2], (b, tk, hkv, d), jnp.float32).astype(dtype)
  do = jax.random.normal(ks[3], (b, tq, h, d), jnp.float32).astype(dtype)
  return q, k, v, do


def _segments(seed, b, n, docs=3):
  return jnp.asarray(np.sort(np.random.RandomState(seed).randint(0, docs, (b, n)), axis=1), jnp.int32)


def _mask(name, b, tq, tk):
  lens = lambda n, seed: jnp.asarray(np.random.RandomState(seed).randint(1, n + 1, b), jnp.int32)
  return {
      "none": None,
      "causal": CausalMask(),
      "causal_offset": CausalMask(tk - tq),
      "causal_neg": CausalMask(-3),
      "window": LocalWindowMask(9, 4),
      "window_causal": LocalWindowMask(20, 0, offset=tk - tq),
      "kv_lengths": KVLenMask(lens(tk, 1)),
      "lengths": LengthMask(lens(tq, 2), lens(tk, 3)),
      "segments": SegmentMask(_segments(4, b, tq), _segments(5, b, tk)),
      "segments_causal": SegmentMask(_segments(6, b, tq), _segments(7, b, tk)) & CausalMask(tk - tq),
      "window_kvlen": LocalWindowMask(30, 30) & KVLenMask(lens(tk, 8)),
  }[name]


def _check(q, k, v, do, *, mask=None, score_mod=None, impl="triton_split", fc=FC16, bc=BC16,
           interpret=True, tf32=False, scale=None):
  f = lambda q, k, v: pt.attention(q, k, v, mask=mask, score_mod=score_mod, scale=scale,
                                   backward_pass_impl=impl, forward_config=fc, backward_config=bc,
                                   interpret=interpret)
  out, vjp = jax.vjp(f, q, k, v)
  assert out.dtype == q.dtype and out.shape == q.shape
  grads = vjp(do)
  ref = reference_vjp(q, k, v, do, mask=mask, score_mod=score_mod, scale=scale)
  dtype = q.dtype
  for name, x, r, grad in zip(("out", "dq", "dk", "dv"), (out, *grads), ref[:4], (False, True, True, True)):
    err, tol = max_error(x, r), tolerance(dtype, grad=grad, tf32=tf32)
    assert err <= tol, f"{name}: max error {err:.3g} > {tol:.3g} ({jnp.dtype(dtype).name}, {impl})"
  return out, grads


# -- interpret mode (CPU) ---------------------------------------------------------
class TestTritonConformance(AttentionConformance):
  """The conformance suite in interpret mode at 16/32 tiles, on each backward pass."""

  implementation = "triton"
  tf32 = TF32
  variants = {"split": dict(backward_pass_impl="triton_split"), "fused": dict(backward_pass_impl="triton_fused"),
              "onepass": dict(backward_pass_impl="triton_onepass")}
  mask_shapes = ((63, 100), (100, 63))
  odd_lengths = ((1, 1, 32), (1, 200, 64), (7, 7, 32), (200, 7, 32), (63, 63, 64), (200, 200, 32), (7, 100, 96))
  left_out = frozenset({"test_values_and_grads[fused-*-100x63]", "test_values_and_grads[onepass-*-100x63]"})
  # make test keeps one or two cases of each kernel feature and backward pass; the rest is slow.
  slow_cases = frozenset({"*"})
  fast_cases = frozenset({
      "test_values_and_grads[split-causal_offset-100x63]", "test_values_and_grads[split-lengths-63x100]",
      "test_values_and_grads[split-segments&causal-63x100]", "test_values_and_grads[fused-causal_offset-63x100]",
      "test_values_and_grads[onepass-causal_offset-63x100]", "test_odd_lengths[split-7x100-d96]",
      "test_gqa[onepass-4x1]", "test_rows_without_keys[onepass]", "test_never_read[onepass-lengths]",
      "test_score_mod[onepass]", "test_same_precision[onepass-bfloat16]", "test_bad_inputs[*]"})

  def run(self, q, k, v, mask=None, **kw):
    return pt.attention(q, k, v, mask=mask, forward_config=FC16, backward_config=BC_MIXED, interpret=True, **kw)


def _alibi_softcap(s, b, h, q_idx, kv_idx):
  return 20.0 * jnp.tanh((s - 0.25 * (h + 1) * jnp.abs(q_idx - kv_idx).astype(jnp.float32) / 8) / 20.0)


@pytest.mark.parametrize("impl,dtype", _slow_except([(i, jnp.bfloat16) for i in IMPLS] + [("triton_split", jnp.float16)],
                                                    ("triton_onepass", jnp.bfloat16)))
def test_half_precision(impl, dtype):
  q, k, v, do = _inputs(14, 2, 100, 63, 4, 2, 64, dtype)
  _check(q, k, v, do, mask=_mask("segments_causal", 2, 100, 63), impl=impl,
         fc=pt.ForwardConfig(32, 16, 4, 1), bc=pt.BackwardConfig(16, 32, 32, 16, 4, 1))


@pytest.mark.parametrize("splits,impl", _slow_except([(s, i) for s in (1, 2, 4) for i in IMPLS],
                                                    (2, "triton_fused"), (4, "triton_onepass")))
def test_gqa_group_splits(impl, splits):
  """dK/dV summed by one program per group, or by 2/4 programs whose partials XLA adds."""
  q, k, v, do = _inputs(60 + splits, 2, 50, 70, 8, 2, 32, jnp.float32)
  bc = pt.BackwardConfig(16, 16, 16, 16, 4, 1, group_splits=splits)
  _check(q, k, v, do, mask=_mask("window_causal", 2, 50, 70), impl=impl, bc=bc)


@pytest.mark.parametrize("n_tiles,ny,nz,group", [(5, 3, 2, 4), (4, 2, 3, 1), (3, 2, 2, 10), (6, 1, 7, 3),
                                                 (16, 4, 8, 6)])
def test_heavy_first_order_is_a_permutation(n_tiles, ny, nz, group):
  """Every (tile, y, z) once; within each group of pairs, the heaviest (last) tiles first; the
  groups at most ``group`` pairs and within one pair of each other in size."""
  from probjax.ops.attention.masks import heavy_first_order
  n = jnp.arange(n_tiles * ny * nz)
  tile, y, z = (np.asarray(a) for a in heavy_first_order(n, n_tiles, ny, nz, group))
  assert len({(int(t), int(a), int(b)) for t, a, b in zip(tile, y, z)}) == n.size
  assert tile.min() == 0 and tile.max() == n_tiles - 1 and y.max() == ny - 1 and z.max() == nz - 1
  # A group's programs are contiguous and cover whole pairs: split where the tile jumps back up.
  starts = np.flatnonzero(np.diff(tile) > 0) + 1
  sizes = set()
  for g in np.split(np.arange(n.size), starts):
    assert np.all(np.diff(tile[g]) <= 0)  # heaviest first inside each
    pairs = {(int(a), int(b)) for a, b in zip(y[g], z[g])}
    assert len(g) == n_tiles * len(pairs)
    sizes.add(len(pairs))
  assert max(sizes) <= group and max(sizes) - min(sizes) <= 1
  assert cfg.order_group("sm_90", 8 << 20) == 3 and cfg.order_group("sm_86", 1 << 30) == 1


@pytest.mark.parametrize("impl,mask_name", _slow_except([("triton_split", "causal"), ("triton_onepass", "causal"),
                                                       ("triton_split", "segments_causal")], ("triton_onepass", "causal")))
def test_causal_grids_in_groups_of_heads(monkeypatch, impl, mask_name):
  # Groups of at most 1 and 3 (batch, head) pairs (the forward's 8 pairs: 2, 3, 3): each program still
  # computes its own tile exactly.
  q, k, v, do = _inputs(13, 2, 70, 70, 4, 2, 32, jnp.float32)
  for group in (1, 3):
    monkeypatch.setattr(cfg, "order_group", lambda device, nbytes, g=group: g)
    _check(q, k, v, do, mask=_mask(mask_name, 2, 70, 70), impl=impl)


def test_group_splits_choice():
  bc = pt.BackwardConfig()
  assert bc.splits_for(1, 10, "sm_90") == 1                # plain MHA: nothing to split
  assert bc.splits_for(8, 1000, "sm_90") == 1              # the device is already full
  assert bc.splits_for(8, 100, "sm_90") == 4               # 264 programs fill an H200 twice
  assert bc.splits_for(6, 10, "sm_90") == 6                # never more than the group
  assert pt.BackwardConfig(group_splits=2).splits_for(8, 1, "sm_90") == 2
  with pytest.raises(ValueError, match="must divide"):
    pt.BackwardConfig(group_splits=3).splits_for(8, 1, "sm_90")
  with pytest.raises(ValueError, match="group_splits"):
    pt.BackwardConfig(group_splits=0)


@pytest.mark.parametrize("impl", _slow_except(IMPLS, "triton_onepass"))
def test_skipped_tiles_are_not_loaded(impl):
  """Keys in tiles that the segment ids empty hold NaN: skipped tiles never touch them (NaN past
  key lengths: the conformance suite's test_never_read)."""
  q, k, v, do = _inputs(16, 2, 48, 64, 4, 2, 32, jnp.float32)
  bad = jnp.arange(64)[None, :, None, None] >= 32
  k, v = jnp.where(bad, jnp.nan, k), jnp.where(bad, jnp.nan, v)
  kv_seg = jnp.broadcast_to(jnp.where(jnp.arange(64) < 32, jnp.arange(64) // 16, 9), (2, 64))
  masks = [SegmentMask(jnp.broadcast_to(jnp.arange(48) // 16, (2, 48)).astype(jnp.int32), kv_seg)]
  for mask in masks:
    f = lambda q, k, v: pt.attention(q, k, v, mask=mask, backward_pass_impl=impl, forward_config=FC16,
                                     backward_config=BC16, interpret=True)
    out, vjp = jax.vjp(f, q, k, v)
    dq, dk, dv = vjp(do)
    for x in (out, dq, dk[:, :32], dv[:, :32]):
      assert np.all(np.isfinite(np.asarray(x)))
    ref = reference_vjp(q, jnp.where(bad, 0, k), jnp.where(bad, 0, v), do, mask=mask)
    assert max_error(out, ref[0]) <= tolerance(jnp.float32)
    assert max_error(dq, ref[1]) <= tolerance(jnp.float32, grad=True)


@pytest.mark.parametrize("impl", _slow_except(("triton_split", "triton_fused"), "triton_fused"))
def test_two_pass_backward_is_deterministic(impl):
  q, k, v, do = _inputs(17, 2, 100, 63, 4, 2, 32, jnp.float32)
  f = lambda q, k, v: pt.attention(q, k, v, mask=CausalMask(5), backward_pass_impl=impl,
                                   forward_config=FC16, backward_config=BC_MIXED, interpret=True)
  g1 = jax.grad(lambda *a: jnp.sum(f(*a) * do), argnums=(0, 1, 2))(q, k, v)
  g2 = jax.grad(lambda *a: jnp.sum(f(*a) * do), argnums=(0, 1, 2))(q, k, v)
  for a, b in zip(g1, g2):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@SLOW
def test_jit_with_traced_mask_arrays():
  q, k, v, do = _inputs(18, 2, 30, 45, 4, 2, 32, jnp.float32)

  @jax.jit
  def loss(q, k, v, kv_len):
    out = pt.attention(q, k, v, mask=KVLenMask(kv_len) & CausalMask(15), forward_config=FC16,
                       backward_config=BC16, interpret=True)
    return jnp.sum(out * do)

  kv_len = jnp.array([45, 20], jnp.int32)
  dq = jax.grad(loss)(q, k, v, kv_len)
  ref = reference_vjp(q, k, v, do, mask=KVLenMask(kv_len) & CausalMask(15))
  assert max_error(dq, ref[1]) <= tolerance(jnp.float32, grad=True)


# -- configs, shared-memory model, dispatch helpers ---------------------------------
@pytest.mark.parametrize("kwargs", [dict(block_q=8), dict(block_k=24), dict(num_warps=3),
                                    dict(num_stages=0), dict(block_q=128.0)])
def test_forward_config_validation(kwargs):
  with pytest.raises(ValueError):
    pt.ForwardConfig(**kwargs)


@pytest.mark.parametrize("kwargs", [dict(block_q_dkv=8), dict(block_kv_dq=48), dict(num_warps=16)])
def test_backward_config_validation(kwargs):
  with pytest.raises(ValueError):
    pt.BackwardConfig(**kwargs)


def test_smem_model_reproduces_spec_failures():
  # H100 page: head_dim 256 forward at 128x64, 4 stages = 327,680 bytes; fp32 head_dim 128
  # single-pass backward at 64x128, 2 stages = 262,144 bytes; both over 232,448.
  assert pt.ForwardConfig(128, 64, 8, 4).smem_bytes(2, 256) == 327680
  assert pt.BackwardConfig(64, 128, 64, 64, 8, 2).smem_bytes(4, 128) == 262144
  with pytest.raises(ValueError, match=r"327680 bytes.*232448"):
    cfg.fit_forward_config(pt.ForwardConfig(128, 64, 8, 4), jnp.bfloat16, 256, 4096, 4096, "sm_90")
  with pytest.raises(ValueError, match="262144 bytes"):
    cfg.fit_backward_config(pt.BackwardConfig(64, 128, 64, 64, 8, 2), jnp.float32, 128, 4096, 4096, "sm_90")


def test_onepass_smem_model():
  # The single-pass dK/dV kernel's measured request on the H200 (fp32 head_dim 128,
  # 32 x 128 tiles, 2 stages): 246,272 bytes > 232,448. The fitted table config shrinks.
  onepass = pt.BackwardConfig(32, 128, 128, 32, 8, 2)
  assert onepass.smem_bytes(4, 128, onepass=True) == 246272
  assert onepass.smem_bytes(4, 128) <= 232448
  with pytest.raises(ValueError, match="246272 bytes"):
    cfg.fit_backward_config(onepass, jnp.float32, 128, 4096, 4096, "sm_90", "triton_onepass")
  fitted = cfg.fit_backward_config(None, jnp.float32, 128, 4096, 4096, "sm_90", "triton_onepass")
  assert fitted.smem_bytes(4, 128, onepass=True) <= 232448


def test_fast_exp2_resolves_per_device():
  assert cfg.fit_forward_config(None, jnp.bfloat16, 64, 4096, 4096, "sm_90").fast_exp2 is True
  assert cfg.fit_forward_config(None, jnp.bfloat16, 64, 4096, 4096, "sm_80").fast_exp2 is False
  explicit = pt.BackwardConfig(fast_exp2=False)
  assert cfg.fit_backward_config(explicit, jnp.bfloat16, 64, 4096, 4096, "sm_90").fast_exp2 is False
  assert cfg.fit_backward_config(pt.BackwardConfig(), jnp.bfloat16, 64, 4096, 4096, "sm_90").fast_exp2


@pytest.mark.parametrize("device", ["sm_90", "sm_80", "sm_86", "sm_89", "sm_75"])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("d", [32, 64, 128, 256])
def test_default_configs_fit(device, dtype, d):
  limit = cfg.smem_limit(device)
  f = cfg.fit_forward_config(None, dtype, d, 4096, 4096, device)
  b = cfg.fit_backward_config(None, dtype, d, 4096, 4096, device)
  isz = jnp.dtype(dtype).itemsize
  assert f.smem_bytes(isz, d) <= limit and b.smem_bytes(isz, d) <= limit


def test_shrink_and_clamp():
  big = cfg.ForwardConfig(256, 256, 8, 4)
  cfg.FORWARD_TABLE[("sm_test", "bfloat16", 128)] = big
  try:
    f = cfg.fit_forward_config(None, jnp.bfloat16, 128, 8192, 8192, "sm_test")
    assert f.num_stages == 1 and f.smem_bytes(2, 128) <= cfg.DEFAULT_SMEM_LIMIT
  finally:
    del cfg.FORWARD_TABLE[("sm_test", "bfloat16", 128)]
  # Tiny lengths never go below 16 rows; asymmetric lengths keep legal tiles.
  b = cfg.fit_backward_config(None, jnp.bfloat16, 64, 1, 16384, "sm_90")
  assert min(b.block_q_dkv, b.block_q_dq) == 16 and b.block_kv_dkv >= 16


def test_auto_backward_impl():
  # sm_90's choice lives in the device table (probjax.nn.layers.attention_device); the
  # backend's own rules are the generic ones there (fused within 4x, as the spec's "generic auto").
  assert cfg.resolve_backward_impl("auto", "sm_90", jnp.bfloat16, 128, 4096, 4096) == "triton_fused"
  assert cfg.resolve_backward_impl("auto", "sm_86", jnp.bfloat16, 64, 4096, 4096) == "triton_onepass"
  assert cfg.resolve_backward_impl("auto", "sm_80", jnp.float32, 128, 4096, 4096) == "triton_fused"
  assert cfg.resolve_backward_impl("auto", "sm_80", jnp.float32, 128, 256, 16384) == "triton_split"
  assert cfg.resolve_backward_impl("triton_fused", "sm_90", jnp.float32, 128, 1, 1) == "triton_fused"
  with pytest.raises(ValueError):
    cfg.resolve_backward_impl("triton", "sm_90", jnp.float32, 128, 1, 1)


def test_supports_reasons():
  s = lambda **kw: pt.supports((2, 64, 4, 64), (2, 64, 2, 64), jnp.bfloat16, interpret=True, **kw)
  assert s() is None and s(mask=CausalMask()) is None
  assert s(score_mod=_alibi_softcap) is None
  assert s(score_mod=lambda sc, *idx: jnp.round(sc)) == "score_mod (its gradient) uses round, which Pallas Triton cannot lower"
  assert s(bias=True) == "additive bias"
  assert s(dropout=True) == "dropout"
  assert s(dense_mask=True) == "dense boolean mask"
  assert pt.supports((2, 64, 4, 512), (2, 64, 2, 512), jnp.bfloat16, interpret=True) == "head_dim 512 > 256"
  assert pt.supports((2, 64, 4, 64), (2, 64, 3, 64), jnp.bfloat16, interpret=True).startswith("heads")
  assert "float64" in pt.supports((2, 64, 4, 64), (2, 64, 2, 64), jnp.float64, interpret=True)
  if jax.devices()[0].platform == "cpu":
    assert pt.supports((2, 64, 4, 64), (2, 64, 2, 64), jnp.bfloat16) == "platform cpu without interpret"

  reasons = []

  @jax.jit
  def traced(bias):
    reasons.append(s(score_mod=lambda sc, b, h, qi, ki: sc + bias[h]))
    return bias

  traced(jnp.ones(4))
  assert reasons == ["score_mod closes over traced arrays"]


def test_attention_rejects_unsupported():
  q, k, v, _ = _inputs(19, 1, 16, 16, 2, 2, 32, jnp.float32)
  if jax.devices()[0].platform == "cpu":
    with pytest.raises(ValueError, match="platform cpu"):
      pt.attention(q, k, v)
  with pytest.raises(ValueError, match="mask.kv_lengths must have shape"):
    pt.attention(q, k, v, mask=KVLenMask(jnp.array([1, 2, 3])), interpret=True)


# -- GPU, full size -------------------------------------------------------------------
GPU_CASES = [
    # dtype, d, tq, tk, mask, impl
    ("bfloat16", 64, 1024, 1024, "none", "triton_split"),
    ("bfloat16", 128, 2048, 2048, "causal", "triton_split"),
    ("bfloat16", 128, 3000, 3000, "causal", "triton_fused"),
    ("bfloat16", 64, 3000, 1024, "window_causal", "triton_onepass"),
    ("bfloat16", 128, 2048, 3000, "kv_lengths", "auto"),
    ("bfloat16", 64, 2048, 2048, "segments_causal", "triton_split"),
    ("bfloat16", 128, 1024, 3000, "lengths", "triton_onepass"),
    ("float16", 128, 2048, 2048, "none", "triton_fused"),
    ("float16", 64, 3000, 3000, "window", "triton_split"),
    ("float32", 64, 1024, 1024, "causal", "triton_split"),
    ("float32", 128, 2048, 2048, "segments", "triton_fused"),
    ("float32", 128, 1024, 2048, "none", "triton_onepass"),
    ("bfloat16", 64, 1500, 3000, "none", "triton_onepass"),   # no mask, partial tiles on both axes
    ("bfloat16", 128, 3000, 600, "none", "triton_fused"),
    ("bfloat16", 32, 2048, 2048, "causal", "auto"),
    ("bfloat16", 96, 1024, 1024, "causal", "auto"),
    ("bfloat16", 256, 1024, 1024, "causal", "auto"),
    ("bfloat16", 128, 64, 3000, "kv_lengths", "triton_fused"),
]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,d,tq,tk,mask_name,impl", GPU_CASES)
def test_gpu_full_size(dtype, d, tq, tk, mask_name, impl):
  q, k, v, do = _inputs(tq + tk + d, 2, tq, tk, 4, 2, d, jnp.dtype(dtype))
  _check(q, k, v, do, mask=_mask(mask_name, 2, tq, tk), impl=impl, fc=None, bc=None, interpret=False,
         tf32=dtype == "float32")


@pytest.mark.quick  # the few-minute GPU selection (MARK='gpu and quick')
@pytest.mark.gpu
def test_gpu_score_mod_and_determinism():
  q, k, v, do = _inputs(20, 2, 2048, 2048, 4, 2, 128, jnp.bfloat16)
  _check(q, k, v, do, mask=CausalMask(), score_mod=_alibi_softcap, impl="triton_split", fc=None,
         bc=None, interpret=False)
  for impl in ("triton_split", "triton_fused"):
    f = lambda q, k, v: pt.attention(q, k, v, mask=CausalMask(), backward_pass_impl=impl)
    g = jax.jit(jax.grad(lambda *a: jnp.sum(f(*a).astype(jnp.float32) * do), argnums=(0, 1, 2)))
    g1, g2 = g(q, k, v), g(q, k, v)
    for a, b in zip(g1, g2):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.gpu
@pytest.mark.parametrize("mask_name", ["none", "causal", "segments_causal"])
def test_gpu_fast_exp2(mask_name):
  q, k, v, do = _inputs(30, 2, 2048, 2048, 4, 2, 64, jnp.bfloat16)
  _check(q, k, v, do, mask=_mask(mask_name, 2, 2048, 2048), impl="triton_split",
         fc=pt.ForwardConfig(128, 64, 4, 2, fast_exp2=True),
         bc=pt.BackwardConfig(32, 128, 128, 64, 4, 3, fast_exp2=True), interpret=False)


@pytest.mark.parametrize("scale", _slow_except((-0.3, 0.0, 2.0), 0.0))
def test_any_scale(scale):
  q, k, v, do = _inputs(11, 2, 40, 70, 2, 1, 32, jnp.float32)
  _check(q, k, v, do, mask=CausalMask(30), scale=scale)


@pytest.mark.parametrize("impl", _slow_except(IMPLS, "triton_onepass"))
def test_odd_lengths_with_very_negative_scores(impl):
  # Every score near -150: a key row past kv_len (zeros, score 0) would get p = exp(150) =
  # inf, and inf * 0 = NaN in the onepass dQ, unless its tile is masked.
  q, k, v, do = _inputs(12, 2, 40, 40, 2, 2, 32, jnp.float32)
  q, k = jnp.abs(q) + 4.0, -(jnp.abs(k) + 4.0)
  out, grads = _check(q, k, v, do, impl=impl)
  assert all(bool(jnp.isfinite(x).all()) for x in (out, *grads))


# -- split-KV decoding -------------------------------------------------------------
SKV = pt.SplitKVConfig(block_k=16, num_splits=3)


@pytest.mark.parametrize("tq,h,hkv,tk,d,mask_name", _slow_except([
    (1, 8, 2, 300, 64, "none"), (3, 4, 4, 517, 32, "kv_lengths"), (5, 6, 2, 700, 64, "causal_offset"),
    (2, 4, 1, 400, 64, "window_causal"), (4, 4, 2, 333, 32, "segments"), (7, 4, 2, 260, 96, "lengths"),
    (33, 2, 1, 200, 32, "none")],  # 66 packed rows: two row tiles of 64
    (33, 2, 1, 200, 32, "none")))
def test_split_kv_matches_reference(tq, h, hkv, tk, d, mask_name):
  q, k, v, _ = _inputs(tq * tk, 2, tq, tk, h, hkv, d, jnp.float32)
  mask = _mask(mask_name, 2, tq, tk)
  cfg = SKV if tq * h // hkv <= 64 else pt.SplitKVConfig(block_k=16, num_splits=3, block_rows=64)
  out = pt.attention(q, k, v, mask=mask, split_kv=cfg, interpret=True)
  assert max_error(out, reference_attention(q, k, v, mask=mask)) <= tolerance(jnp.float32)


def test_split_kv_one_split_packs_gqa_rows():
  """One split (what the automatic plan gives a GQA decode that fills the device): the packed
  rows of each K/V head, one program per (batch, K/V head), against the reference."""
  q, k, v, _ = _inputs(7, 3, 5, 300, 8, 2, 64, jnp.float32)
  mask = _mask("causal_offset", 3, 5, 300)
  out = pt.attention(q, k, v, mask=mask, split_kv=pt.SplitKVConfig(block_k=16, num_splits=1), interpret=True)
  assert max_error(out, reference_attention(q, k, v, mask=mask)) <= tolerance(jnp.float32)


def test_split_kv_combine():
  """Merging per-split softmax results equals one softmax over all keys; splits that saw no
  key (lse -inf) have no weight; rows no split saw are 0."""
  from probjax.ops.attention.backends.triton.decode import combine
  rng = np.random.RandomState(0)
  s = rng.randn(3, 5, 24) * 3  # [splits, rows, keys per split] scores (base 2)
  s[1, 2] = -np.inf           # split 1 saw no key for row 2
  s[:, 4] = -np.inf           # row 4: no key anywhere
  v = rng.randn(3, 24, 8)
  with np.errstate(invalid="ignore", divide="ignore"):
    m = s.max(-1, keepdims=True)
    p = np.where(np.isfinite(s), np.exp2(s - np.where(np.isfinite(m), m, 0)), 0)
    l = p.sum(-1)
    o = np.einsum("srk,skd->srd", p, v) / np.where(l == 0, 1, l)[..., None]
    lse2 = np.where(l > 0, m[..., 0] + np.log2(np.where(l == 0, 1, l)), -np.inf)
  got = np.asarray(combine(jnp.asarray(o, jnp.float32), jnp.asarray(lse2, jnp.float32)))
  flat = np.moveaxis(s, 0, 1).reshape(5, -1)   # [rows, all keys]
  pw = np.where(np.isfinite(flat), np.exp2(flat - np.max(np.where(np.isfinite(flat), flat, -1e9), -1,
                                                         keepdims=True)), 0)
  want = np.einsum("rk,rkd->rd", pw, np.broadcast_to(v.reshape(-1, 8), (5, 72, 8)))
  want = want / np.where(pw.sum(-1) == 0, 1, pw.sum(-1))[:, None]
  np.testing.assert_allclose(got, want, atol=1e-5)
  assert np.all(got[4] == 0)


@SLOW
def test_split_kv_rows_without_keys_are_zero():
  q, k, v, _ = _inputs(3, 3, 2, 300, 4, 2, 32, jnp.float32)
  mask = KVLenMask(jnp.array([0, 5, 300]))  # batch 0 has no key; batch 1's keys are in split 0
  out = pt.attention(q, k, v, mask=mask, split_kv=SKV, interpret=True)
  assert np.all(np.asarray(out[0]) == 0) and np.all(np.isfinite(np.asarray(out)))
  assert max_error(out, reference_attention(q, k, v, mask=mask)) <= tolerance(jnp.float32)


@pytest.mark.parametrize("band", [pytest.param(None, marks=SLOW), LocalWindowMask(100, 0)])
def test_split_kv_shares_the_valid_keys(band):
  """Key lengths far below the cache: the splits divide each element's valid tiles (a split
  may get none: its lse is -inf), also inside a band."""
  q, k, v, _ = _inputs(11, 2, 2, 700, 4, 2, 32, jnp.float32)
  mask = KVLenMask(jnp.array([37, 690]))
  mask = mask if band is None else band & mask
  out = pt.attention(q, k, v, mask=mask, split_kv=pt.SplitKVConfig(block_k=16, num_splits=5), interpret=True)
  assert max_error(out, reference_attention(q, k, v, mask=mask)) <= tolerance(jnp.float32)


@SLOW  # the split-KV forward, the regular kernels and their backward
def test_split_kv_bf16_and_grad_runs_the_regular_kernel():
  q, k, v, do = _inputs(4, 2, 2, 400, 8, 2, 64, jnp.bfloat16)
  f = lambda q, k, v: pt.attention(q, k, v, split_kv=SKV, forward_config=FC16, backward_config=BC16,
                                   interpret=True)
  out = f(q, k, v)
  assert max_error(out, reference_attention(q, k, v)) <= tolerance(jnp.bfloat16)
  jaxpr = str(jax.make_jaxpr(lambda *a: jax.vjp(f, *a)[0])(q, k, v))
  assert "probjax_attention_fwd_split_kv" not in jaxpr and "probjax_attention_fwd" in jaxpr
  _check(q, k, v, do, impl="triton_split")  # gradients as without split_kv


def test_split_kv_plan():
  from probjax.ops.attention.backends.triton import decode
  plan = lambda q, kv, split_kv=None, dtype=jnp.bfloat16, **kw: decode.plan(
      q, kv, dtype, split_kv=split_kv, device="sm_90", **{"mask": None, "score_mod": None, **kw})
  dec = ((1, 1, 32, 128), (1, 32768, 8, 128))
  cfg = plan(*dec)
  assert cfg is not None and cfg.num_splits >= 2 and cfg.block_rows == 16  # 1 query x 4 heads
  assert plan((1, 64, 32, 128), (1, 32768, 8, 128)).block_rows == 128      # 256 rows: 2 tiles
  assert plan((1, 65, 32, 128), (1, 32768, 8, 128)) is None                # too many queries
  assert plan((1, 1, 32, 128), (1, 1023, 8, 128)) is None                  # too few keys
  assert plan((64, 1, 32, 128), (64, 4096, 32, 128)) is None  # device full, no GQA
  # ... but at a head_dim that is not a power of two one split of this kernel, whose tiles suit
  # few rows, where the regular forward's are sized for prefill
  for d in (80, 96, 192):
    assert plan((53, 3, 40, d), (53, 3187, 40, d)).num_splits == 1, d
  assert plan((53, 3, 40, 128), (53, 3187, 40, 128)) is None
  full_gqa = plan((64, 1, 32, 128), (64, 4096, 8, 128))  # one split, each K/V tile read once per group
  assert full_gqa.num_splits == 1 and full_gqa.block_rows == 16
  assert plan(*dec, split_kv=False) is None
  assert plan(*dec, score_mod=lambda s, *_: s) is None
  with pytest.raises(ValueError, match="split_kv=True cannot compute this call: score_mod"):
    plan(*dec, split_kv=True, score_mod=lambda s, *_: s)
  with pytest.raises(ValueError, match="65 queries > 64"):
    plan((1, 65, 8, 64), (1, 100, 8, 64), split_kv=True)
  with pytest.raises(TypeError, match="split_kv must be"):
    plan(*dec, split_kv="yes")
  window = M.LocalWindowMask(511, 0, offset=32767)  # the splits cover only the window's keys
  assert plan(*dec, mask=window).num_splits == 2 and plan(*dec).num_splits > 2
  assert plan(*dec, split_kv=pt.SplitKVConfig(num_splits=5)).num_splits == 5
  # fp32 head_dim 256 with 128 rows: default tiles shrink to fit; an explicit config that
  # does not fit raises.
  big = ((1, 32, 32, 256), (1, 32768, 8, 256))
  cfg = plan(*big, dtype=jnp.float32)
  assert cfg.smem_bytes(4, 256, cfg.block_rows) <= 232448 and cfg.block_rows == 128
  with pytest.raises(ValueError, match="bytes of shared memory"):
    plan(*big, dtype=jnp.float32, split_kv=pt.SplitKVConfig(block_k=128, num_stages=3))


@pytest.mark.parametrize("kwargs", [dict(block_k=24), dict(num_splits=0), dict(block_rows=8)])
def test_split_kv_config_validation(kwargs):
  with pytest.raises(ValueError):
    pt.SplitKVConfig(**kwargs)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,tq,h,hkv,tk,mask_name", [
    ("bfloat16", 1, 32, 8, 32768, "kv_lengths"), ("bfloat16", 16, 32, 8, 8192, "causal_offset"),
    ("float16", 1, 32, 32, 4096, "none"), ("float32", 4, 16, 4, 3000, "window_causal"),
    ("bfloat16", 1, 32, 8, 32767, "none")])  # a cache of odd length: masked last tile
def test_gpu_split_kv(dtype, tq, h, hkv, tk, mask_name):
  q, k, v, _ = _inputs(tk + tq, 2, tq, tk, h, hkv, 128, jnp.dtype(dtype))
  mask = _mask(mask_name, 2, tq, tk)
  out = pt.attention(q, k, v, mask=mask, split_kv=True)
  err = max_error(out, reference_attention(q, k, v, mask=mask))
  assert err <= tolerance(jnp.dtype(dtype), tf32=dtype == "float32")


@pytest.mark.gpu
def test_gpu_split_kv_device_full_gqa():
  """A GQA decode whose K/V heads fill the device: the automatic plan packs each group's rows in
  one split rather than running the regular forward once per query head."""
  from probjax.ops.attention.backends.triton import decode
  b, tq, h, hkv, tk, d = 48, 13, 48, 12, 1500, 192
  assert decode.plan((b, tq, h, d), (b, tk, hkv, d), jnp.bfloat16, mask=None, score_mod=None,
                     split_kv=None, device="sm_90").num_splits == 1
  q, k, v, _ = _inputs(5, b, tq, tk, h, hkv, d, jnp.bfloat16)
  out = pt.attention(q, k, v)
  assert max_error(out, reference_attention(q, k, v)) <= tolerance(jnp.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("d", [80, 192])
def test_gpu_split_kv_one_split_at_widths_not_a_power_of_two(d):
  """A few-query decode without GQA at a head_dim that is not a power of two: the automatic plan
  keeps one split of the split-KV kernel (reading the cache in place), exact."""
  from probjax.ops.attention.backends.triton import decode
  b, tq, h, tk = 16, 3, 40, 3187
  assert decode.plan((b, tq, h, d), (b, tk, h, d), jnp.float16, mask=None, score_mod=None,
                     split_kv=None, device="sm_90").num_splits == 1
  q, k, v, _ = _inputs(d, b, tq, tk, h, h, d, jnp.float16)
  out = pt.attention(q, k, v)
  assert max_error(out, reference_attention(q, k, v)) <= tolerance(jnp.float16)


def test_longest_programs_first():
  from probjax.ops.attention.backends.triton.tiles import TileMask, longest_first
  tm = lambda lower, upper: TileMask(M.band(lower, upper), 64, 64, True, False, False, False)
  causal, anti, window, none = tm(None, 0), tm(0, None), tm(-8, 0), tm(None, None)
  assert longest_first(causal, 0, 4, by_q=True) == 3   # last query tile sees the most keys
  assert longest_first(causal, 0, 4, by_q=False) == 0  # first key tile is seen by the most queries
  assert longest_first(anti, 0, 4, by_q=False) == 3 and longest_first(anti, 0, 4, by_q=True) == 0
  assert longest_first(window, 1, 4, by_q=True) == 1 and longest_first(none, 1, 4, by_q=True) == 1


def test_ranges_from_classes():
  """Per-batch tile ranges: span of non-EMPTY tiles; FULL run only when contiguous."""
  from probjax.ops.attention.masks import ranges_from_classes
  E, P, F = 0, 1, 2
  classes = jnp.array([[[E, P, F, F, P, E], [F, E, F, P, E, E], [E, E, E, E, E, E]]], jnp.int32)
  r = np.asarray(ranges_from_classes(classes))[0]
  assert r[:, 0].tolist() == [1, 5, 2, 4]   # lo, hi, full_lo, full_hi
  assert r[:, 1].tolist() == [0, 4, 0, 0]   # FULL tiles not contiguous: no full run
  assert r[:, 2].tolist() == [6, 6, 6, 6]   # nothing to visit


@pytest.mark.parametrize("backend", ["triton", pytest.param("mosaic", marks=SLOW)])  # mosaic: interpret-mode Mosaic GPU
def test_score_mod_with_non_finite_values_under_the_mask(backend):
  # The modifier and its derivative are NaN exactly where the causal mask hides the key (the
  # log of a negative number): the kernels' outputs and gradients stay finite.
  from probjax.ops.attention.backends import mosaic_gpu as pm
  mod = lambda s, b, h, qi, ki: s * (1.0 + jnp.log((qi - ki + 1).astype(jnp.float32)))
  q, k, v, do = _inputs(21, 1, 64, 64, 2, 1, 64, jnp.bfloat16)
  if backend == "triton":
    f = lambda q, k, v: pt.attention(q, k, v, mask=CausalMask(), score_mod=mod, forward_config=FC16,
                                     backward_config=BC16, interpret=True)
  else:
    f = lambda q, k, v: pm.attention(q, k, v, mask=CausalMask(), score_mod=mod, backward_pass_impl="mosaic",
                                     forward_config=pm.MosaicForwardConfig(64, 64, 2, 1),
                                     backward_config=pm.MosaicBackwardConfig(64, 64, 2, 1), interpret=True)
  out, vjp = jax.vjp(f, q, k, v)
  for x in (out, *vjp(do)):
    assert bool(jnp.isfinite(x.astype(jnp.float32)).all())


# -- value head_dim != query/key head_dim (multi-head latent attention) -------------------
WIDTHS = [(48, 32), (32, 64)]  # (q/k head_dim, value head_dim): narrower and wider values


def _mla_mask():
  return CausalMask(8) & KVLenMask(jnp.array([20, 27]))


def _attention_v(mask, impl="triton_split", **kw):
  return lambda q, k, v, _: pt.attention(q, k, v, mask=mask, backward_pass_impl=impl,
                                         forward_config=FC16, backward_config=BC16, **kw)


@pytest.mark.parametrize("impl,d,dv", [(i, *w) if (i, w) in (("triton_fused", WIDTHS[0]), ("triton_onepass", WIDTHS[1]))
                                        else pytest.param(i, *w, marks=SLOW) for i in IMPLS for w in WIDTHS])
def test_value_head_dim_matches_reference(impl, d, dv):
  """Odd lengths, GQA, causal with key lengths: output at the value width, dQ/dK at the
  query/key width, dV at the value width, all against the float64 reference."""
  from probjax.testing import check_against_reference, make_inputs
  x = make_inputs(d + dv, 2, 19, 27, 4, 2, d, v_head_dim=dv)
  mask = _mla_mask()
  out = _attention_v(mask, impl, interpret=True)(x.q, x.k, x.v, None)
  assert out.shape == (2, 19, 4, dv)
  check_against_reference(_attention_v(mask, impl, interpret=True), x, mask=mask, tf32=TF32)


@SLOW
@pytest.mark.parametrize("d,dv", WIDTHS)
def test_value_head_dim_group_splits(d, dv):
  """dV partials of split GQA groups summed at the value width."""
  from probjax.testing import check_against_reference, make_inputs
  x = make_inputs(3 * d + dv, 1, 20, 33, 4, 1, d, v_head_dim=dv)
  mask = CausalMask(13)
  attn = lambda q, k, v, _: pt.attention(q, k, v, mask=mask, forward_config=FC16, interpret=True,
                                         backward_config=pt.BackwardConfig(16, 16, 16, 16, 4, 1, group_splits=2))
  check_against_reference(attn, x, mask=mask, tf32=TF32)


@pytest.mark.parametrize("impl", [pytest.param("triton_split", marks=SLOW), pytest.param("triton_fused", marks=SLOW),
                                  "triton_onepass"])
def test_value_head_dim_fully_masked_rows_are_zero(impl):
  from probjax.testing import check_against_reference, make_inputs
  x = make_inputs(16, 2, 20, 20, 2, 1, 48, v_head_dim=32)
  # As the conformance suite's test_rows_without_keys: batch 0 has no keys, rows 0..2 none under causal(-3).
  mask = LengthMask(jnp.array([20, 15]), jnp.array([0, 20])) & CausalMask(-3)
  check_against_reference(_attention_v(mask, impl, interpret=True), x, mask=mask, tf32=TF32)
  out, vjp = jax.vjp(lambda q, k, v: _attention_v(mask, impl, interpret=True)(q, k, v, None), x.q, x.k, x.v)
  dq, dk, dv = vjp(x.do)
  assert not np.any(np.asarray(out[0])) and not np.any(np.asarray(out[1, :3])) and not np.any(np.asarray(out[1, 15:]))
  assert not np.any(np.asarray(dq[0])) and not np.any(np.asarray(dk[0])) and not np.any(np.asarray(dv[0]))


# (q/k head_dim, value head_dim) off the kernels' power-of-two tile width, with the backward pass
HEAD_DIMS = [("triton_split", 40, 40), ("triton_fused", 48, 48), ("triton_onepass", 80, 80), ("triton_split", 96, 96),
             ("triton_fused", 192, 192), ("triton_onepass", 192, 96), ("triton_split", 80, 48)]


@pytest.mark.parametrize("impl,d,dv", _slow_except(HEAD_DIMS, ("triton_split", 40, 40), ("triton_onepass", 192, 96)))
def test_head_dims_off_the_tile(impl, d, dv):
  """Q, K, V and dO read in place through tiles wider than their head_dims (the extra columns
  masked to zeros), the output and the gradients written at their own widths: odd lengths,
  GQA, causal with key lengths, against the float64 reference."""
  from probjax.testing import check_against_reference, make_inputs
  x = make_inputs(d * dv + 1, 2, 19, 27, 4, 2, d, v_head_dim=dv)
  mask = _mla_mask()
  check_against_reference(_attention_v(mask, impl, interpret=True), x, mask=mask, tf32=TF32)


@pytest.mark.parametrize("d,dv,mask_name", _slow_except([(48, 32, "causal_offset"), (32, 64, "kv_lengths"),
                                                         (48, 32, "kv_lengths")], (48, 32, "causal_offset")))
def test_split_kv_value_head_dim(d, dv, mask_name):
  from probjax.testing import make_inputs
  x = make_inputs(d * dv, 2, 3, 100, 4, 2, d, v_head_dim=dv)
  mask = _mask(mask_name, 2, 3, 100)
  f = lambda q, k, v: pt.attention(q, k, v, mask=mask, split_kv=SKV, interpret=True)
  assert "probjax_attention_fwd_split_kv" in str(jax.make_jaxpr(f)(x.q, x.k, x.v))
  out = f(x.q, x.k, x.v)
  assert out.shape == (2, 3, 4, dv)
  assert max_error(out, reference_attention(x.q, x.k, x.v, mask=mask)) <= tolerance(jnp.float32, tf32=TF32)


def test_value_head_dim_supports_and_tiles():
  s = lambda dv, d=192: pt.supports((2, 64, 4, d), (2, 64, 2, d), jnp.bfloat16, interpret=True, v_head_dim=dv)
  assert s(128) is None and s(256) is None and s(8, 32) is None
  assert s(300) == "value head_dim 300 not in [1, 256]"
  q = jnp.ones((1, 16, 2, 32))
  with pytest.raises(ValueError, match="value head_dim 300"):
    pt.attention(q, q, jnp.ones((1, 16, 2, 300)), interpret=True)
  # One width: the model as before; two: each operand at its own width.
  f, b = pt.ForwardConfig(128, 64, 8, 2), pt.BackwardConfig(64, 128, 128, 64, 8, 3)
  assert f.smem_bytes(2, 128, 128) == f.smem_bytes(2, 128)
  assert f.smem_bytes(2, 256, 128) == (2 * 64 * (256 + 128) + 128 * 256) * 2
  assert b.smem_bytes(2, 256, v_head_dim=128) == (3 * 64 + 128) * (256 + 128) * 2
  for dtype, isz in ((jnp.bfloat16, 2), (jnp.float32, 4)):
    fc = cfg.fit_forward_config(None, dtype, 256, 4096, 4096, "sm_90", 128)
    assert fc.smem_bytes(isz, 256, 128) <= cfg.SMEM_LIMIT["sm_90"]
    for impl in IMPLS:
      bc = cfg.fit_backward_config(None, dtype, 256, 4096, 4096, "sm_90", impl, 128)
      assert bc.smem_bytes(isz, 256, impl == "triton_onepass", 128) <= cfg.SMEM_LIMIT["sm_90"]
  wide = pt.ForwardConfig(128, 128, 8, 3)  # fits at one width 128, not with values of 256
  assert cfg.fit_forward_config(wide, jnp.bfloat16, 128, 4096, 4096, "sm_90") == dataclasses.replace(wide, fast_exp2=True)
  with pytest.raises(ValueError, match="shared memory"):
    cfg.fit_forward_config(wide, jnp.bfloat16, 128, 4096, 4096, "sm_90", 256)


@pytest.mark.quick  # the few-minute GPU selection (MARK='gpu and quick')
@pytest.mark.gpu
def test_gpu_value_head_dim_mla_widths():
  """MLA's widths, q/k 192 and v 128, causal, with the tuned tiles, every backward variant."""
  from probjax.testing import check_against_reference, make_inputs
  x = make_inputs(192, 1, 512, 512, 2, 2, 192, jnp.bfloat16, v_head_dim=128)
  for impl in IMPLS:
    attn = lambda q, k, v, _: pt.attention(q, k, v, mask=CausalMask(), backward_pass_impl=impl)
    check_against_reference(attn, x, mask=CausalMask())
