"""The Mosaic GPU forward (with the Triton backward) against the float64 reference: the
conformance suite (tests/ops/attention/conformance.py) with either backward, and the kernels'
own paths (persistent, overlapped and clustered forwards, the Mosaic backward's fused dQ).

Interpret mode (``plgpu.InterpretGPUParams``: simulated warpgroups, TMA and barriers on
CPU) at small shapes in CI; the full-size cases are marked ``gpu``.
"""

import os

# Interpret mode's warpgroup threads block XLA:CPU's thread pool (one thread per core by
# default) in their barrier waits and can hang on a small machine: see
# probjax.ops.attention.backends.mosaic_gpu.config.INTERPRET_WGS. Read when JAX creates its CPU client.
os.environ.setdefault("PJRT_NPROC", "8")

import dataclasses  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import pytest  # noqa: E402

from probjax.ops.attention import masks as M  # noqa: E402
from probjax.ops.attention.backends import mosaic_gpu as pm  # noqa: E402
from probjax.ops.attention.backends.mosaic_gpu import config as mcfg  # noqa: E402
from probjax.ops.attention.backends.mosaic_gpu.common import kv_tiles, q_tiles  # noqa: E402
from probjax.testing import check_against_reference, make_inputs, make_mask  # noqa: E402
from tests.ops.attention.conformance import AttentionConformance  # noqa: E402

# A stalled interpret run fails loudly ("thread": it sits in XLA, where no signal reaches Python).
pytestmark = pytest.mark.timeout(300, method="thread")

# One compute warpgroup on CPU (the fewest interpreted threads: faster, and the least pool
# pressure; see above). The two-warpgroup kernels are covered by the sm_90 lowering tests, the
# GPU tests and test_mosaic_backward_fused_dq_two_warpgroups.
SMALL = pm.MosaicForwardConfig(block_q=64, block_k=64, num_stages=2, compute_wgs=1)


BSMALL = pm.MosaicBackwardConfig(block_q=64, block_k=64, num_stages=2, compute_wgs=1)


def _attn(mask, cfg=SMALL, interpret=True, **kw):
  return lambda q, k, v, _: pm.attention(q, k, v, mask=mask, forward_config=cfg, interpret=interpret, **kw)


def _mosaic_bwd(mask, bcfg=BSMALL):
  return _attn(mask, backward_pass_impl="mosaic", backward_config=bcfg)


# Interpret-mode Mosaic GPU compiles every call anew (its kernels hold host callbacks: no cache)
# and runs each warpgroup as a thread: a forward takes about 2 s of CPU, with gradients 4-14 s,
# whatever the (already small) shapes. make test keeps one case of each kernel path (the
# forward under a band, persistent, overlapped and clustered; the Mosaic backward and its fused
# dQ); the other masks, configs and dtypes of each path are slow.
SLOW = pytest.mark.slow


def _slow_except(values, *fast):
  """``values`` as parameters, all but those in ``fast`` marked slow."""
  return [v if v in fast else pytest.param(*(v if isinstance(v, tuple) else (v,)), marks=SLOW) for v in values]


class TestMosaicConformance(AttentionConformance):
  """The conformance suite in interpret mode at the SMALL forward config (one compute
  warpgroup), with the Triton backward ("auto") and the Mosaic backward at BSMALL."""

  implementation = "mosaic"
  dtype = jnp.bfloat16  # the kernel takes bfloat16 and float16
  head_dim = 64
  heads = (2, 1)
  variants = {"auto": {}, "mosaic": dict(backward_pass_impl="mosaic", backward_config=BSMALL)}
  mask_shapes = ((150, 200),)  # odd lengths: partial last tiles on both axes
  odd_lengths = ((1, 1), (7, 7), (64, 64), (130, 65), (200, 7))
  gqa = ((2, 2), (4, 1), (4, 2))
  shape = (150, 200)
  left_out = frozenset({"test_odd_lengths[mosaic-*]"})
  # make test keeps one mask for each backward (the Mosaic backward's: a batch element with no
  # key tile) and the argument checks; every other case is slow (see above).
  slow_cases = frozenset({"*"})
  fast_cases = frozenset({"test_values_and_grads[auto-causal_offset-150x200]",
                          "test_values_and_grads[mosaic-kv_len_zero-150x200]", "test_bad_inputs[*]"})

  def run(self, q, k, v, mask=None, **kw):
    return pm.attention(q, k, v, mask=mask, forward_config=SMALL, interpret=True, **kw)


@pytest.mark.parametrize("mask_name", _slow_except(("none", "causal", "kv_len_zero", "window&segments"),
                                                   "kv_len_zero", "window&segments"))
def test_persistent_forward(mask_name):
  # Two CTAs in interpret mode, each looping over several tiles: the K/V ring's slots and
  # barrier phases carry over from one tile to the next.
  x = make_inputs(2, 2, 150, 200, 2, 1, 64, jnp.bfloat16)
  mask = make_mask(mask_name, 2, 150, 200)
  cfg = dataclasses.replace(SMALL, num_stages=3, persistent=True)
  check_against_reference(_attn(mask, cfg), x, mask=mask, grads=False)


@pytest.mark.parametrize("mask_name,persistent", _slow_except(  # make test: each mask once, either way
    [(m, p) for m in ("none", "causal_offset", "window_right", "kv_len_zero", "lengths", "window&segments")
     for p in (False, True)],
    ("none", False), ("causal_offset", True), ("window_right", False), ("kv_len_zero", True), ("lengths", False),
    ("window&segments", True)))
def test_overlap_forward(mask_name, persistent):
  # overlap=True: the first tile's softmax, then per tile its Q K^T with the last tile's P V,
  # then the last P V; the three loops split at the first and last full tile (kv_len_zero: a
  # batch element with no tile at all). Interpret mode runs the two products in order.
  x = make_inputs(11, 2, 150, 200, 2, 1, 64, jnp.bfloat16)
  mask = make_mask(mask_name, 2, 150, 200)
  cfg = dataclasses.replace(SMALL, persistent=persistent, overlap=True)
  check_against_reference(_attn(mask, cfg), x, mask=mask, grads=False)


@SLOW
@pytest.mark.parametrize("tq,tk,d,dtype,cfg", [
    (64, 64, 64, jnp.float16, SMALL),                                      # one key tile: no loop step
    (70, 300, 128, jnp.bfloat16, pm.MosaicForwardConfig(64, 128, 3, 1)),  # 3 slots, a partial last tile
    (130, 65, 64, jnp.bfloat16, pm.MosaicForwardConfig(64, 64, 4, 1)),    # fewer tiles than slots
])
def test_overlap_shapes_dtypes_configs(tq, tk, d, dtype, cfg):
  x = make_inputs(13, 2, tq, tk, 4, 2, d, dtype)
  check_against_reference(_attn(None, dataclasses.replace(cfg, overlap=True)), x, grads=False)


@pytest.mark.parametrize("mask_name", _slow_except(("none", "causal", "window", "causal&kv_len", "lengths"),
                                                   "causal&kv_len"))
def test_clusters_share_kv_tiles(mask_name):
  # CTA pairs on adjacent query tiles of a head (GQA 2:1), each loading half of every K/V
  # tile for both (interpret mode copies whole tiles; the pair's release barriers are real);
  # under a band or lengths the pair visits the union of its ranges. Persistent pairs are
  # covered by the lowering test and the GPU tests only: interpret mode hangs on them in a
  # barrier wait (the H200 runs them).
  x = make_inputs(3, 2, 256, 200, 2, 1, 64, jnp.bfloat16)
  mask = make_mask(mask_name, 2, 256, 200)
  cfg = dataclasses.replace(SMALL, cluster=2)
  check_against_reference(_attn(mask, cfg), x, mask=mask, grads=False)


@SLOW  # two interpret-mode forwards
def test_one_cta_per_tile_in_groups_of_heads(monkeypatch):
  # One CTA per tile under a causal band: heaviest first across groups of 1 and 3 of the
  # 4 (batch, head) pairs; each CTA still computes its own tile.
  from probjax.ops.attention.backends.mosaic_gpu import forward as F
  x = make_inputs(10, 2, 150, 200, 2, 1, 64, jnp.bfloat16)
  for group in (1, 3):
    monkeypatch.setattr(F, "order_group", lambda device, nbytes, g=group: g)
    check_against_reference(_attn(M.CausalMask(50)), x, mask=M.CausalMask(50), grads=False)


@pytest.mark.parametrize("mask_name,shared", _slow_except(
    [(m, s) for m in ("none", "causal_offset", "window&segments", "kv_len_zero") for s in (False, True)],
    ("window&segments", True)))
def test_mosaic_backward_fused_dq(mask_name, shared):
  # One kernel: dK/dV, and dQ added tile by tile into a float32 buffer (in interpret mode by
  # read-add-write, the CTAs running one at a time; on the GPU by TMA reduce-add). shared:
  # through the shared dS^T buffers and their barriers (one warpgroup: one slice of head_dim).
  x = make_inputs(8, 2, 150, 200, 4, 2, 64, jnp.bfloat16)
  mask = make_mask(mask_name, 2, 150, 200)
  bcfg = dataclasses.replace(BSMALL, fused_dq=True, shared_dq=shared)
  check_against_reference(_mosaic_bwd(mask, bcfg), x, mask=mask)


@SLOW
@pytest.mark.parametrize("mask_name", ["none", "causal_offset"])
def test_mosaic_backward_fused_dq_head_dim_128(mask_name):
  # head_dim 128, where each warpgroup's dQ partial is 64 accumulator registers per thread.
  x = make_inputs(10, 1, 150, 200, 4, 2, 128, jnp.bfloat16)
  mask = make_mask(mask_name, 1, 150, 200)
  check_against_reference(_mosaic_bwd(mask, dataclasses.replace(BSMALL, fused_dq=True)), x, mask=mask)


@SLOW  # two interpreted compute warpgroups: the slowest interpret runs (the sm_90 lowering tests cover the path)
@pytest.mark.parametrize("shared,mask_name", [(True, "none"), (False, "causal"), (True, "causal"),
                                              (True, "window&segments"), (False, "window&segments")])
def test_mosaic_backward_fused_dq_two_warpgroups(shared, mask_name):
  # Two compute warpgroups add their dS K products into one dQ: interpret mode's read, add and
  # write of a tile takes one partial per warpgroup (two of the same rows lost sums). shared_dq's
  # point: the warpgroups exchange dS^T tiles and each adds 64 of the 128 columns of the CTA's
  # dQ partial.
  x = make_inputs(9, 1, 150, 200, 2, 1, 128, jnp.bfloat16)
  mask = make_mask(mask_name, 1, 150, 200)
  bcfg = dataclasses.replace(BSMALL, compute_wgs=2, fused_dq=True, shared_dq=shared)
  check_against_reference(_mosaic_bwd(mask, bcfg), x, mask=mask)


def test_shared_dq_config_is_validated():
  with pytest.raises(ValueError, match="needs fused_dq"):
    pm.MosaicBackwardConfig(shared_dq=True)
  with pytest.raises(ValueError, match="multiple of 128"):
    pm.backward.fit(pm.MosaicBackwardConfig(fused_dq=True, shared_dq=True), 2, 64, "interpret")


@SLOW
@pytest.mark.parametrize("tq,tk,d,dtype,bcfg", [
    (70, 130, 128, jnp.float16, pm.MosaicBackwardConfig(128, 64, 3, 1)),
    (200, 64, 64, jnp.bfloat16, pm.MosaicBackwardConfig(64, 128, 2, 1)),
])
def test_mosaic_backward_shapes_configs(tq, tk, d, dtype, bcfg):
  x = make_inputs(6, 1, tq, tk, 2, 1, d, dtype)
  check_against_reference(_mosaic_bwd(M.CausalMask(tk - tq), bcfg), x, mask=M.CausalMask(tk - tq))


@SLOW
@pytest.mark.parametrize("tq,tk,d,dtype,cfg", [
    (64, 64, 64, jnp.float16, SMALL),
    (70, 300, 128, jnp.bfloat16, pm.MosaicForwardConfig(64, 128, 3, 1)),  # 1 compute warpgroup, 3 slots
    (130, 65, 64, jnp.bfloat16, pm.MosaicForwardConfig(64, 64, 4, 1)),    # fewer tiles than slots
])
def test_shapes_dtypes_configs(tq, tk, d, dtype, cfg):
  x = make_inputs(2, 2, tq, tk, 2, 2, d, dtype)
  check_against_reference(_attn(None, cfg), x, grads=False)


def _alibi_softcap(s, b, h, q_idx, kv_idx):
  return 20.0 * jnp.tanh((s - 0.25 * (h + 1) * jnp.abs(q_idx - kv_idx).astype(jnp.float32) / 8) / 20.0)


@SLOW
@pytest.mark.parametrize("mask_name,scale", [("none", 0.3), ("causal", -0.3)])  # and TestMosaicConformance's
def test_score_mod(mask_name, scale):
  # The score modifier in the Mosaic forward (before the mask; a negative scale is fine with
  # one), its gradient from the Triton backward.
  x = make_inputs(8, 2, 150, 200, 4, 2, 64, jnp.bfloat16)
  mask = make_mask(mask_name, 2, 150, 200)
  f = lambda q, k, v, _: pm.attention(q, k, v, mask=mask, score_mod=_alibi_softcap, scale=scale,
                                      forward_config=SMALL, interpret=True)
  check_against_reference(f, x, mask=mask, score_mod=_alibi_softcap, scale=scale)


@SLOW
@pytest.mark.parametrize("mask_name", ["none", "causal_offset", "window&segments"])
def test_score_mod_mosaic_backward(mask_name):
  # dK/dV summed over the GQA group: score_mod sees each query head's own h.
  x = make_inputs(9, 2, 150, 200, 4, 2, 64, jnp.bfloat16)
  mask = make_mask(mask_name, 2, 150, 200)
  f = lambda q, k, v, _: pm.attention(q, k, v, mask=mask, score_mod=_alibi_softcap, forward_config=SMALL,
                                      backward_pass_impl="mosaic", backward_config=BSMALL, interpret=True)
  check_against_reference(f, x, mask=mask, score_mod=_alibi_softcap)
  # A modifier whose gradient Mosaic GPU cannot lower (none of jnp's elementwise functions
  # with a lowerable forward, once add_any is rewritten) is refused, not lowered.
  checker = pm._lowerable
  with pytest.MonkeyPatch.context() as mp:
    mp.setattr(pm, "_lowerable", lambda f, mosaic_grad=False: "its gradient uses X" if mosaic_grad else checker(f))
    with pytest.raises(ValueError, match="backward_pass_impl='mosaic' cannot compute this call: its gradient"):
      pm.attention(x.q, x.k, x.v, score_mod=_alibi_softcap, backward_pass_impl="mosaic", interpret=True)
  assert "its gradient) uses sinh" in checker(lambda s, *a: jnp.sinh(s), mosaic_grad=True)


def test_score_mod_pullback_is_the_vjp():
  # Fan-out (cotangent sums, add_any) and nested jit: the rewritten pullback equals jax.vjp.
  from probjax.ops.attention.base import score_mod_pullback
  mod = lambda s, b, h, qi, ki: jnp.sqrt(jnp.abs(s) + 1.0) * jnp.tanh(s) + jnp.clip(s, -1.0, 1.0) * (qi - ki)
  s, ds = jax.random.normal(jax.random.key(0), (2, 8, 16))
  qi, ki = jnp.arange(8)[:, None], jnp.arange(16)[None, :]
  want = jax.vjp(lambda s: mod(s, 0, 1, qi, ki), s)[1](ds)[0]
  np.testing.assert_allclose(score_mod_pullback(mod, s, ds, 0, 1, qi, ki), want, rtol=1e-6, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("mask_name,d,backward", [("none", 128, "auto"), ("causal", 64, "auto"),
                                                  ("segments", 128, "mosaic"), ("causal", 64, "mosaic")])
def test_gpu_score_mod(mask_name, d, backward):
  x = make_inputs(d + 1, 2, 2048, 2048, 8, 2, d, jnp.bfloat16)
  mask = make_mask(mask_name, 2, 2048, 2048)
  f = lambda q, k, v, _: pm.attention(q, k, v, mask=mask, score_mod=_alibi_softcap, backward_pass_impl=backward)
  check_against_reference(f, x, mask=mask, score_mod=_alibi_softcap)


def test_band_tiles_match_classification():
  """The kernel's per-CTA ranges agree with Mask.classify_tiles: every non-EMPTY tile is in
  [lo, hi), and tiles called full are FULL for every row of the CTA."""
  rows, bk, kv_len = 128, 64, 500
  for mask in (None, M.CausalMask(), M.CausalMask(-70), M.LocalWindowMask(100, 30), M.Mask(lower=5, upper=200),
               M.LengthMask(jnp.array([300]), jnp.array([170])) & M.CausalMask()):
    full = mask or M.Mask()
    cls = full.classify_tiles(1, 640, kv_len, rows, bk)[0]
    lens = {} if mask is None or mask.q_lengths is None else dict(q_valid=300, kv_valid=170)
    for t in range(cls.shape[0]):
      lo, hi, flo, fhi = (int(v) for v in kv_tiles(mask, t * rows, rows, kv_len, bk, **lens))
      live = [j for j in range(cls.shape[1]) if int(cls[t, j]) != M.EMPTY]
      assert all(lo <= j < hi for j in live), (mask, t, lo, hi, live)
      assert all(int(cls[t, j]) == M.FULL for j in range(flo, fhi)), (mask, t, flo, fhi)
    # The dK/dV kernel's ranges: query tiles (500 queries) per block of key rows.
    cls_t = full.classify_tiles(1, 500, 640, bk, rows)[0].T
    for t in range(cls_t.shape[0]):
      lo, hi, flo, fhi = (int(v) for v in q_tiles(mask, t * rows, rows, 500, bk, **lens))
      live = [j for j in range(cls_t.shape[1]) if int(cls_t[t, j]) != M.EMPTY]
      assert all(lo <= j < hi for j in live), (mask, t, lo, hi, live)
      assert all(int(cls_t[t, j]) == M.FULL for j in range(flo, fhi)), (mask, t, flo, fhi)


def test_supports_reasons():
  s = lambda **kw: pm.supports((1, 128, 4, kw.pop("d", 64)), (1, 128, 2, 64), kw.pop("dtype", jnp.bfloat16),
                               interpret=True, **kw)
  assert s() is None and s(mask=M.CausalMask()) is None
  assert "float32" in s(dtype=jnp.float32)
  assert "head_dim" in s(d=96)
  assert s(mask=M.KVLenMask(jnp.array([5])) & M.CausalMask()) is None
  assert s(mask=M.SegmentMask(jnp.zeros((1, 128), jnp.int32))) is None
  assert s(score_mod=lambda x, *a: x) is None and s(score_mod=lambda x, *a: x, scale=-1.0) is None
  table = jnp.ones(4)
  assert "closes over arrays" in s(score_mod=lambda x, b, h, qi, ki: x * table[h])
  assert "cumsum, which Pallas Mosaic GPU cannot lower" in s(score_mod=lambda x, *a: jnp.cumsum(x, axis=1))
  assert s(score_mod=lambda x, b, h, qi, ki: jnp.where(qi >= ki, x, -jnp.inf) + jnp.log(h + 1.0)) is None
  assert "log1p" in s(score_mod=lambda x, *a: jnp.log1p(x))
  assert "scale" in s(scale=-1.0)
  assert "sm_90" in pm.supports((1, 128, 4, 64), (1, 128, 4, 64), jnp.bfloat16, device_kind="sm_80")
  x = make_inputs(0, 1, 64, 64, 1, 1, 64, jnp.float32)
  with pytest.raises(ValueError, match="mosaic attention cannot compute this call: dtype float32"):
    pm.attention(x.q, x.k, x.v, interpret=True)


def test_config_validation_and_fit():
  for kw in (dict(block_q=128), dict(block_k=96), dict(num_stages=1), dict(compute_wgs=4), dict(cluster=3),
             dict(cluster=True), dict(overlap=1)):
    with pytest.raises(ValueError):
      pm.MosaicForwardConfig(**kw)
  for kw in (dict(block_q=32), dict(block_k=96), dict(num_stages=1), dict(compute_wgs=0), dict(compute_wgs=3),
             dict(fused_dq=1)):
    with pytest.raises(ValueError):
      pm.MosaicBackwardConfig(**kw)
  from probjax.ops.attention.backends.mosaic_gpu import backward as mb
  for d in mb.DEFAULTS:
    assert mb.fit(None, 2, d, "sm_90").smem_bytes(2, d) <= 232448
  with pytest.raises(ValueError, match="shared memory"):
    mb.fit(pm.MosaicBackwardConfig(256, 256, 4, 2), 2, 128, "sm_90")
  with pytest.raises(ValueError, match="widths summing to at most 320, got head_dim 256 and value head_dim 256"):
    mb.fit(None, 2, 256, "sm_90")
  x = make_inputs(0, 1, 64, 64, 1, 1, 64, jnp.bfloat16)
  with pytest.raises(TypeError, match="MosaicBackwardConfig goes with 'mosaic'"):
    pm.attention(x.q, x.k, x.v, backward_config=BSMALL, interpret=True)
  for d, cfg in mcfg.DEFAULTS.items():
    assert mcfg.fit(None, 2, d, "sm_90").smem_bytes(2, d) <= 232448
  with pytest.raises(ValueError, match="shared memory"):
    mcfg.fit(pm.MosaicForwardConfig(64, 256, 8, 2), 2, 128, "sm_90")


def test_register_split_fits_the_sm():
  from probjax.ops.attention.backends.mosaic_gpu.common import registers
  assert registers(2) == (232, 40) and registers(3) == (160, 24)
  for wgs in (1, 2, 3):
    compute, producer = registers(wgs)
    assert compute % 8 == 0 and 128 * (wgs * compute + producer) <= 65536


def test_smem_model_covers_the_compilers_counts():
  # Bytes the Mosaic compiler reported on an H200 for two forward configs (bf16, head_dim 128)
  # before the schedule barrier (8 bytes) was added: the model must not count fewer.
  for (bk, st), reported in (((128, 3), 235672), ((192, 2), 235632)):
    model = pm.MosaicForwardConfig(64, bk, st, 2).smem_bytes(2, 128)
    assert reported <= model <= reported + 64
    with pytest.raises(ValueError, match="shared memory"):
      mcfg.fit(pm.MosaicForwardConfig(64, bk, st, 2), 2, 128, "sm_90")


def test_tile_sweep_records_the_auto_config():
  from bench.benchmark_gpu_attention_tiles import mosaic_auto_config
  for d in mcfg.DEFAULTS:
    for dtype in ("bfloat16", "float16"):
      for t in (3000, 4096):
        auto = mosaic_auto_config(dtype, d, t, "sm_90")["forward"]
        assert auto == dataclasses.asdict(mcfg.fit(None, 2, d, "sm_90", q_len=t, kv_len=t))
  # CTA pairs by default at head_dim 128, where the call can take them.
  assert mcfg.fit(None, 2, 128, "sm_90", q_len=4096).cluster == 2
  for kw in (dict(q_len=3000 - 128), dict(q_len=4096, mask=M.CausalMask()), {}):  # 23 tiles; a mask; unknown
    assert mcfg.fit(None, 2, 128, "sm_90", **kw).cluster == 1, kw
  assert mcfg.fit(None, 2, 128, "interpret", q_len=4096).cluster == 1
  assert mcfg.fit(None, 2, 64, "sm_90", q_len=4096).cluster == 1
  # overlap by default only where the kernel has no masked tile (measured slower there).
  for d in (64, 128):
    assert mcfg.fit(None, 2, d, "sm_90", q_len=4096, kv_len=4096).overlap
    for kw in (dict(kv_len=3000), dict(kv_len=4096, mask=M.CausalMask()), dict(kv_len=4096, score_mod=True), {}):
      assert not mcfg.fit(None, 2, d, "sm_90", q_len=4096, **kw).overlap, kw
  explicit = pm.MosaicForwardConfig(overlap=True)
  assert mcfg.fit(explicit, 2, 64, "sm_90", mask=M.CausalMask()) == explicit  # exact, if slower


@pytest.mark.quick  # the few-minute GPU selection (MARK='gpu and quick')
@pytest.mark.gpu
@pytest.mark.parametrize("mask_name,tq,tk,d", [("none", 4096, 4096, 128), ("causal", 3000, 3000, 64),
                                               ("causal&kv_len", 2048, 3000, 128)])
def test_gpu_mosaic_backward_is_exact_and_deterministic(mask_name, tq, tk, d):
  x = make_inputs(tq + d + 1, 2, tq, tk, 8, 2, d, jnp.bfloat16)
  mask = make_mask(mask_name, 2, tq, tk)
  f = lambda q, k, v, _: pm.attention(q, k, v, mask=mask, backward_pass_impl="mosaic")
  check_against_reference(f, x, mask=mask)
  grads = lambda: jax.grad(lambda q, k, v: jnp.sum(f(q, k, v, None).astype(jnp.float32) * x.do),
                           argnums=(0, 1, 2))(x.q, x.k, x.v)
  for a, b in zip(grads(), grads()):  # no atomics: bitwise equal across runs
    assert bool(jnp.all(a == b))


@pytest.mark.gpu
@pytest.mark.parametrize("mask_name,tq,tk,d", [("none", 4096, 4096, 128), ("causal", 3000, 3000, 64),
                                               ("causal&kv_len", 2048, 3000, 128), ("window&segments", 3000, 3000, 64)])
def test_gpu_mosaic_backward_fused_dq(mask_name, tq, tk, d):
  x = make_inputs(tq + d + 2, 2, tq, tk, 8, 2, d, jnp.bfloat16)
  mask = make_mask(mask_name, 2, tq, tk)
  for shared in (False, True) if d % 128 == 0 else (False,):
    bcfg = dataclasses.replace(pm.backward.DEFAULTS[d], fused_dq=True, shared_dq=shared)
    check_against_reference(lambda q, k, v, _: pm.attention(q, k, v, mask=mask, backward_pass_impl="mosaic",
                                                            backward_config=bcfg), x, mask=mask)


@pytest.mark.gpu
@pytest.mark.parametrize("mask_name,tq,tk,d", [("none", 4096, 4096, 128), ("causal", 3000, 3000, 64),
                                               ("window", 2048, 3000, 128), ("none", 1024, 2048, 256),
                                               ("causal&kv_len", 3000, 3000, 128), ("lengths", 1500, 600, 64)])
def test_gpu_full_size(mask_name, tq, tk, d):
  x = make_inputs(tq + d, 2, tq, tk, 8, 2, d, jnp.bfloat16)
  mask = make_mask(mask_name, 2, tq, tk)
  check_against_reference(lambda q, k, v, _: pm.attention(q, k, v, mask=mask), x, mask=mask)


@pytest.mark.gpu
@pytest.mark.parametrize("mask_name,d,wgs", [("none", 128, 2), ("causal&kv_len", 64, 3), ("window&segments", 64, 2)])
def test_gpu_persistent_and_three_warpgroups(mask_name, d, wgs):
  x = make_inputs(d + wgs, 2, 3000, 3000, 8, 2, d, jnp.bfloat16)
  mask = make_mask(mask_name, 2, 3000, 3000)
  cfg = pm.MosaicForwardConfig(64, 128, 2, wgs, persistent=True)
  check_against_reference(lambda q, k, v, _: pm.attention(q, k, v, mask=mask, forward_config=cfg), x,
                          mask=mask, grads=False)


@pytest.mark.gpu
@pytest.mark.parametrize("mask_name,d,persistent,t", [("none", 64, True, 4096), ("none", 128, True, 3000),
                                                      ("none", 128, False, 4096), ("causal", 128, True, 3000),
                                                      ("causal&kv_len", 64, True, 4096), ("window", 128, False, 4096)])
def test_gpu_clusters(mask_name, d, persistent, t):
  x = make_inputs(d + t, 2, t, t, 8, 2, d, jnp.bfloat16)
  mask = make_mask(mask_name, 2, t, t)
  cfg = pm.MosaicForwardConfig(64, 128, 2, 2, persistent=persistent, cluster=2)
  check_against_reference(lambda q, k, v, _: pm.attention(q, k, v, mask=mask, forward_config=cfg), x, mask=mask,
                          grads=False)


@pytest.mark.gpu
@pytest.mark.parametrize("mask_name,d,persistent,cluster,t", [
    ("none", 64, True, 1, 4096), ("none", 128, True, 2, 4096), ("causal", 64, True, 1, 3000),
    ("causal&kv_len", 128, False, 1, 3000), ("window&segments", 64, True, 1, 3000), ("lengths", 128, True, 1, 1500)])
def test_gpu_overlap(mask_name, d, persistent, cluster, t):
  x = make_inputs(d + t + 1, 2, t, t, 8, 2, d, jnp.bfloat16)
  mask = make_mask(mask_name, 2, t, t)
  cfg = pm.MosaicForwardConfig(64, 128, 2, 2, persistent=persistent, cluster=cluster, overlap=True)
  check_against_reference(lambda q, k, v, _: pm.attention(q, k, v, mask=mask, forward_config=cfg), x, mask=mask,
                          grads=False)


def test_available_on_sm90_only():
  # Through dot_product_attention (and its jvp): TestMosaicConformance's test_jvp and test_bad_inputs.
  from probjax.nn.layers.attention import available_implementations
  from probjax.ops.attention.dispatch import Device
  assert "mosaic" in available_implementations(Device("gpu", (9, 0), 1 << 30))
  assert "mosaic" not in available_implementations(Device("gpu", (8, 0), 1 << 30))


def _persistent_loads(grid, ctas, work, order):
  """Every tile's (query tile, batch, head) in CTA order, and each CTA's summed work."""
  from probjax.ops.attention.backends.mosaic_gpu.forward import persistent_tile
  total = grid[0] * grid[1] * grid[2]
  seen, loads = [], []
  for cta in range(ctas):
    steps = total // ctas + (cta < total % ctas)
    tiles = [tuple(int(x) for x in persistent_tile(s, cta, ctas, grid, order)) for s in range(steps)]
    seen += tiles
    loads.append(sum(int(work[b, i]) for i, b, _ in tiles))
  return seen, np.asarray(loads, np.float64)


@pytest.mark.parametrize("by_work", [False, True])
def test_persistent_schedule_covers_every_tile_once(by_work):
  # B4 H8 T16384, causal, 128 rows per CTA on 132 SMs: the causal grid row of the benchmarks.
  from probjax.ops.attention.backends.mosaic_gpu import forward as F
  grid, ctas = (128, 4, 8), 132
  lens = jnp.full((2, 4), 16384, jnp.int32)
  work = np.asarray(F.tile_work(M.CausalMask(), lens, None, lengths=False, segments=False, n_q=128, rows=128,
                                kv_len=16384, block_k=128))
  assert (work == np.arange(1, 129)[None]).all()  # query tile i sees i + 1 key tiles
  order = np.asarray(F.work_order(jnp.asarray(work))) if by_work else None
  seen, loads = _persistent_loads(grid, ctas, work, order)
  assert sorted(seen) == [(i, b, h) for i in range(128) for b in range(4) for h in range(8)]
  if by_work:  # every SM within 1% of the mean (the natural order's busiest SM: 5.5% above it)
    assert loads.max() / loads.mean() < 1.01 and loads.min() / loads.mean() > 0.99
    first = [F.persistent_tile(0, c, ctas, grid, order)[0] for c in range(ctas)]
    assert min(int(i) for i in first) >= 123  # the first wave takes the heaviest tiles
  else:
    assert loads.max() / loads.mean() > 1.05


def test_persistent_schedule_by_work_balances_causal_documents():
  # The masked suite's causal documents (B1 H16 T16384, 4 documents): a tile's work is a
  # sawtooth in its position. Ordered by query tile, the busiest SM did 1.31x the mean (the
  # run that measured 0.744 ms against 0.614 in query-tile order, 1.125x); by work, 1.01x.
  from probjax.ops.attention.backends.mosaic_gpu import common as C
  from probjax.ops.attention.backends.mosaic_gpu import forward as F
  t, rows = 16384, 128
  ids = jnp.asarray(np.arange(t) * 4 // t, jnp.int32)[None]
  mask = M.SegmentMask(ids, ids) & M.CausalMask()
  band, lengths, lens = C.split_mask(mask, 1, t, t)
  rng = C.segment_operands(mask, 1, t, t, t, t, rows, 128, by_q=True, n_outer=t // rows)[0]
  work = np.asarray(F.tile_work(band, lens, rng, lengths=lengths, segments=True, n_q=t // rows, rows=rows,
                                kv_len=t, block_k=128))
  assert (work[0] == np.arange(128) % 32 + 1).all()
  grid, ctas = (t // rows, 1, 16), 132
  _, natural = _persistent_loads(grid, ctas, work, None)
  seen, ordered = _persistent_loads(grid, ctas, work, np.asarray(F.work_order(jnp.asarray(work))))
  assert len(set(seen)) == 128 * 16
  assert natural.max() / natural.mean() > 1.1 and ordered.max() / ordered.mean() < 1.02


# Values of their own head_dim (MLA: q/k 192, v 128): the V ring, the P V wgmma, the
# accumulator and the output at the values' width; Q K^T at the queries'.
@SLOW
@pytest.mark.parametrize("d,dv,mask_name,persistent", [(128, 64, "causal", False), (192, 128, "causal&kv_len", True),
                                                       (64, 128, "none", False)])
def test_value_head_dim_of_its_own(d, dv, mask_name, persistent):
  # The gradients from the Triton backward (dV at the values' width, dQ/dK at the queries').
  x = make_inputs(d + dv, 1, 100, 130, 2, 1, d, jnp.bfloat16, v_head_dim=dv)  # GQA 2:1, odd lengths
  mask = make_mask(mask_name, 1, 100, 130)
  cfg = dataclasses.replace(SMALL, persistent=persistent)
  check_against_reference(_attn(mask, cfg), x, mask=mask)


@SLOW
def test_value_head_dim_leaves_the_lse_unchanged():
  # The lse depends on q and k only: with values 128 wide it is the one of values 192 wide
  # whose first 128 columns they are, and so is the output's first 128 columns.
  from probjax.ops.attention.backends.mosaic_gpu import forward as F
  from probjax.core.tolerances import tolerance
  x = make_inputs(21, 1, 100, 130, 2, 1, 192, jnp.bfloat16)
  mask = M.CausalMask(30)
  run = lambda v: F.forward(x.q, x.k, v, mask, scale=0.1, config=SMALL, interpret=True)
  out, lse = run(x.v[..., :128])
  out_wide, lse_wide = run(x.v)
  assert out.shape == (1, 100, 2, 128) and lse.shape == (1, 2, 100)
  np.testing.assert_array_equal(np.asarray(lse), np.asarray(lse_wide))
  np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(out_wide[..., :128], np.float32),
                             atol=tolerance(jnp.bfloat16), rtol=0)


def test_value_head_dim_supports_and_fit():
  s = lambda d, dv, **kw: pm.supports((1, 128, 4, d), (1, 128, 2, d), jnp.bfloat16, interpret=True,
                                      v_head_dim=dv, **kw)
  assert s(192, 128) is None and s(128, 64) is None and s(192, 192) is None and s(64, 256) is None
  assert "value head_dim 96" in s(128, 96)
  assert "head_dim 96" in s(96, 64)
  x = make_inputs(0, 1, 64, 64, 1, 1, 192, jnp.bfloat16, v_head_dim=192)
  with pytest.raises(ValueError, match="cannot compute this call: the Mosaic backward takes widths summing to at most "
                                       "320, got head_dim 192 and value head_dim 192"):
    pm.attention(x.q, x.k, x.v, backward_pass_impl="mosaic", interpret=True)
  widths = (64, 128, 192, 256)
  for d, dv in ((d, dv) for d in widths for dv in widths):  # every pair supports takes has a default
    if s(d, dv) is not None:
      assert "sum at most 384" in s(d, dv) and d + dv > 384
      continue
    assert mcfg.fit(None, 2, d, "sm_90", v_head_dim=dv).smem_bytes(2, d, dv) <= 232448, (d, dv)
  # Not persistent, values narrower than queries: the output has a buffer of its own.
  cfg = pm.MosaicForwardConfig(64, 64, 2, 2)
  assert cfg.smem_bytes(2, 192, 128) == cfg.smem_bytes(2, 192) - 2 * 64 * 64 * 2 + 2 * 64 * 128 * 2
  with pytest.raises(ValueError, match="head_dim 192, value head_dim 128"):
    mcfg.fit(pm.MosaicForwardConfig(64, 128, 2, 2), 2, 192, "sm_90", v_head_dim=128)


@pytest.mark.quick  # the few-minute GPU selection (MARK='gpu and quick')
@pytest.mark.gpu
@pytest.mark.parametrize("grads", [False, True])
def test_gpu_value_head_dim_of_its_own(grads):
  # MLA's widths at the default configs; the gradients from the Triton backward.
  x = make_inputs(192 + grads, 1, 1024, 1024, 2, 2, 192, jnp.bfloat16, v_head_dim=128)
  mask = M.CausalMask()
  check_against_reference(lambda q, k, v, _: pm.attention(q, k, v, mask=mask), x, mask=mask, grads=grads)


@pytest.mark.parametrize("d,dv,mask,cfg", [  # lowering only, no interpret run: fast
    (192, 128, M.CausalMask(), None), (192, 128, None, None),
    (192, 128, None, pm.MosaicForwardConfig(64, 64, 2, 2, overlap=True)),  # not persistent: an output buffer of its own
    (128, 64, None, pm.MosaicForwardConfig(64, 128, 2, 2, True, cluster=2, overlap=True))])
def test_value_head_dim_of_its_own_lowers_for_sm90(monkeypatch, d, dv, mask, cfg):
  # The paths interpret mode cannot run (registers as wgmma's P operand, in-place accumulation).
  import re
  from probjax.ops.attention import gpu
  monkeypatch.setattr(gpu, "device_kind", lambda device=None: "sm_90")
  q = jax.ShapeDtypeStruct((1, 1024, 2, d), jnp.bfloat16)
  v = jax.ShapeDtypeStruct((1, 1024, 2, dv), jnp.bfloat16)
  text = jax.jit(lambda q, k, v: pm.attention(q, k, v, mask=mask, forward_config=cfg)).trace(q, q, v).lower(
      lowering_platforms=("cuda",)).as_text()
  assert set(re.findall(r"custom_call @([\w$.]+)", text)) == {"mosaic_gpu_v2"}


# The Mosaic backward at values of their own width: dV and the V / dO tiles at the values'
# width, dK, dQ and the Q / K tiles at the queries'; widths summing to at most 320.
@pytest.mark.parametrize("d,dv,mask_name,heads,tq,tk", _slow_except(
    [(192, 128, "causal", (2, 1), 100, 130), (192, 128, "none", (4, 2), 150, 200), (128, 64, "causal_offset", (2, 2), 7, 200),
     (64, 128, "lengths", (4, 1), 130, 65), (192, 128, "window&segments", (2, 1), 150, 200)],
    (192, 128, "causal", (2, 1), 100, 130)))
def test_mosaic_backward_value_head_dim_of_its_own(d, dv, mask_name, heads, tq, tk):
  x = make_inputs(d + dv + tq, 1, tq, tk, *heads, d, jnp.bfloat16, v_head_dim=dv)  # odd lengths, GQA
  mask = make_mask(mask_name, 1, tq, tk)
  check_against_reference(_mosaic_bwd(mask), x, mask=mask)


@SLOW
def test_mosaic_backward_value_head_dim_through_the_api():
  # dot_product_attention(implementation="mosaic", backward_pass_impl="mosaic") at the default
  # tiles (backward.default_config's 64-row key tiles in three slots, one compute warpgroup here).
  from probjax import dot_product_attention
  x = make_inputs(4, 1, 100, 130, 2, 1, 192, jnp.bfloat16, v_head_dim=128)
  f = lambda q, k, v, _: dot_product_attention(q, k, v, mask=M.CausalMask(30), implementation="mosaic",
                                               backward_pass_impl="mosaic", interpret=True)
  check_against_reference(f, x, mask=M.CausalMask(30))


@SLOW
def test_mosaic_backward_value_head_dim_is_deterministic():
  # No atomics: two runs' gradients are bitwise equal (interpret mode runs one CTA at a time;
  # test_gpu_mosaic_backward_value_head_dim runs them at once).
  x = make_inputs(3, 1, 100, 130, 2, 1, 192, jnp.bfloat16, v_head_dim=128)
  f = _mosaic_bwd(M.CausalMask(30))
  grads = lambda: jax.vjp(lambda q, k, v: f(q, k, v, None), x.q, x.k, x.v)[1](x.do)
  for a, b in zip(grads(), grads()):
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


def test_mosaic_backward_value_head_dim_supports_and_fit():
  from probjax.ops.attention.backends.mosaic_gpu import backward as mb
  s = lambda d, dv, **kw: pm.supports((1, 128, 4, d), (1, 128, 2, d), jnp.bfloat16, interpret=True,
                                      v_head_dim=dv, backward_pass_impl="mosaic", **kw)
  widths = (64, 128, 192, 256)
  for d, dv in ((d, dv) for d in widths for dv in widths):
    if d + dv > 384 and d != dv:  # the forward refuses these
      continue
    why = s(d, dv)
    if d + dv > 320:  # dK/dV accumulators over the registers
      assert "backward_pass_impl='mosaic' cannot compute this call: the Mosaic backward takes widths summing to at " \
             f"most 320, got head_dim {d} and value head_dim {dv}" in why, (d, dv, why)
      with pytest.raises(ValueError, match="widths summing to at most 320"):
        mb.fit(None, 2, d, "sm_90", v_head_dim=dv)
      continue
    assert why is None, (d, dv, why)
    assert mb.fit(None, 2, d, "sm_90", v_head_dim=dv).smem_bytes(2, d, dv) <= 232448, (d, dv)
    assert mb.fit(None, 2, d, "interpret", v_head_dim=dv).compute_wgs == 1
  assert pm.supports((1, 128, 4, 192), (1, 128, 2, 192), jnp.bfloat16, interpret=True, v_head_dim=192) is None
  # default_config's example: 192/128 drops to 64-row key tiles in three slots; 128/64 keeps head_dim 128's.
  assert mb.fit(None, 2, 192, "sm_90", v_head_dim=128) == pm.MosaicBackwardConfig(64, 64, 3, 2)
  assert pm.MosaicBackwardConfig(64, 128, 2, 2).smem_bytes(2, 192, 128) == 251008
  assert pm.MosaicBackwardConfig(64, 64, 3, 2).smem_bytes(2, 192, 128) == 211112
  assert pm.MosaicBackwardConfig(64, 64, 4, 2).smem_bytes(2, 192, 128) > 232448
  assert mb.fit(None, 2, 128, "sm_90", v_head_dim=64) == mb.DEFAULTS[128]
  assert pm.MosaicBackwardConfig(64, 128, 2, 2).smem_bytes(2, 128, 64) == 152704
  # The V and dO tiles at the values' width: equal widths count as before.
  cfg = pm.MosaicBackwardConfig(64, 128, 2, 2)
  assert cfg.smem_bytes(2, 128, 128) == cfg.smem_bytes(2, 128)
  with pytest.raises(ValueError, match="needs 251008 bytes of shared memory at head_dim 192, value head_dim 128"):
    mb.fit(cfg, 2, 192, "sm_90", v_head_dim=128)
  # Through the registry: an explicit request is refused with the reason, the one it takes is reported.
  from probjax.ops.attention.dispatch import Device, explain_dispatch
  h200 = Device("gpu", (9, 0), 140 << 30)
  kw = dict(implementation="mosaic", backward_pass_impl="mosaic", device=h200)
  d = explain_dispatch((2, 4096, 16, 192), (2, 4096, 16, 192), jnp.bfloat16, mask=M.CausalMask(), v_head_dim=128, **kw)
  assert (d.implementation, d.backward) == ("mosaic", "mosaic")
  with pytest.raises(ValueError, match="widths summing to at most 320, got head_dim 192 and value head_dim 192"):
    explain_dispatch((2, 4096, 16, 192), (2, 4096, 16, 192), jnp.bfloat16, **kw)


@pytest.mark.gpu
@pytest.mark.parametrize("mask_name,tq,tk,d,dv", [("causal", 4096, 4096, 192, 128), ("causal&kv_len", 2048, 3000, 128, 64),
                                                  ("none", 3000, 3000, 192, 128)])
def test_gpu_mosaic_backward_value_head_dim(mask_name, tq, tk, d, dv):
  # MLA's widths (and 128/64) at the default configs: values and every gradient against the
  # reference, and bitwise-equal gradients across runs (no atomics).
  x = make_inputs(tq + d + dv, 2, tq, tk, 8, 2, d, jnp.bfloat16, v_head_dim=dv)
  mask = make_mask(mask_name, 2, tq, tk)
  f = lambda q, k, v, _: pm.attention(q, k, v, mask=mask, backward_pass_impl="mosaic")
  check_against_reference(f, x, mask=mask)
  grads = lambda: jax.grad(lambda q, k, v: jnp.sum(f(q, k, v, None).astype(jnp.float32) * x.do),
                           argnums=(0, 1, 2))(x.q, x.k, x.v)
  for a, b in zip(grads(), grads()):
    assert bool(jnp.all(a == b))
