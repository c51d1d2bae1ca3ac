"""MLA's absorbed-form decode kernel in Pallas Mosaic GPU (``implementation="mosaic"``): the
conformance suite (tests/ops/mla/conformance.py) in interpret mode on CPU, the kernel's own
paths (two compute warpgroups, row tiles holding several queries, split-KV against one split),
its refusals and dispatch, the sm_90 lowering at full size, and full-size GPU checks.

Interpret mode (``plgpu.InterpretGPUParams``: simulated warpgroups, TMA and barriers) compiles
every call anew, about a second of CPU each: make test keeps one case of each path (several key
tiles over two splits with NaN past ragged lengths, a causal band over three queries, float16, a
paged cache, the refusals); the other masks and shapes are slow.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from probjax.core.device import Device
from probjax.core.tolerances import max_error, tolerance
from probjax.ops.attention import masks as M
from probjax.ops.mla import REGISTRY, explain_dispatch, mla
from probjax.ops.mla.backends.mosaic_gpu import decode
from probjax.ops.mla.backends.mosaic_gpu.decode import combine
from probjax.ops.mla.reference import reference_mla
from tests.ops.mla.conformance import MLAConformance, inputs, to_pages

# A stalled interpret run fails loudly ("thread": it sits in XLA, where no signal reaches Python).
pytestmark = pytest.mark.timeout(300, method="thread")

H200 = Device("gpu", (9, 0), 140 << 30)
A100 = Device("gpu", (8, 0), 80 << 30)
CPU = Device("cpu")
# The smallest widths the kernel tiles: d_c and d_rope multiples of 64 (one warpgroup at d_c 128).
DIMS = dict(heads=4, d_nope=8, d_rope=64, d_c=128, d_v=8)
FULL = dict(heads=128, d_nope=128, d_rope=64, d_c=512, d_v=128)


def _queries(n):
  def edit(args):
    args[0], args[1] = (jnp.concatenate([x] * n, axis=1) for x in args[:2])
    return {}
  return edit


def _float32(args):
  args[:] = [x.astype(jnp.float32) for x in args]
  return {}


def _narrow_rope(args):
  args[1], args[3] = args[1][..., :32], args[3][..., :32]
  return {}


def _pages_of_32(args):
  args[2], args[3] = (x.reshape(-1, 32, x.shape[-1]) for x in args[2:4])
  return dict(mask=M.KVLenMask(jnp.array([20, 32], jnp.int32)), page_table=jnp.arange(2, dtype=jnp.int32).reshape(2, 1))


class TestMosaicConformance(MLAConformance):
  """The conformance suite on the Mosaic GPU decode kernel (interpret mode): the absorbed form
  in bfloat16 (float16 in test_low_precision), KVLenMask and a causal band; at kv_len 200 and
  batch 2 the interpret-mode grid (4 SMs) takes two key splits of two 64-position tiles. Its
  gradient is the XLA absorbed form's (a custom_vjp)."""

  implementation = "mosaic"
  forms = ("absorbed",)
  dims = DIMS
  dtype = jnp.bfloat16
  low_precision = (jnp.float16, 3, 130)
  masks = ("none", "kv_len", "causal", "causal&kv_len")
  shapes = ((1, 200), (3, 130), (1, 1))
  page = (256, 64)
  refusals = (("float32", "absorbed", _float32, "dtype float32"),
              ("five_queries", "absorbed", _queries(5), "5 queries"),
              ("query_lengths", "absorbed", lambda args: dict(mask=M.LengthMask(jnp.array([1, 1]), jnp.array([32, 32]))),
               "q_lengths"),
              ("segments", "absorbed", lambda args: dict(mask=M.SegmentMask(jnp.zeros((2, 1), jnp.int32), jnp.zeros((2, 32), jnp.int32))),
               "segments"),
              ("d_rope_32", "absorbed", _narrow_rope, "d_rope 32"),
              ("page_size_32", "absorbed", _pages_of_32, "page_size 32"))
  slow_cases = frozenset({"test_values_and_grads[*]", "test_low_precision[*]", "test_jvp[*]", "test_bad_inputs[*]"})
  fast_cases = frozenset({"test_values_and_grads[absorbed-kv_len-1x200]",
                          "test_values_and_grads[absorbed-causal&kv_len-3x130]", "test_low_precision[*]"})

  @pytest.mark.xfail(strict=True, raises=TypeError,
                     reason="forward mode missing: the kernel's gradient is a custom_vjp (backends/mosaic_gpu/backend.py)")
  def test_jvp(self, case):
    super().test_jvp(case)


def _attend64(q_lat, q_rope, lat, rope, lengths, scale, band=(None, None)):
  """float64 ``(out [B, Tq, H, d_c], lse [B, Tq, H])`` of the absorbed attention, NaN past the
  lengths ignored."""
  f = lambda x: np.nan_to_num(np.asarray(x, np.float64))
  dot = lambda *a: np.einsum(*a, optimize=True)
  s = (dot("bthc,bsc->bths", f(q_lat), f(lat)) + dot("bthc,bsc->bths", f(q_rope), f(rope))) * scale
  k = np.arange(lat.shape[1])[None, None, None, :]
  t = np.arange(q_lat.shape[1])[None, :, None, None]
  ok = k < np.asarray(lengths)[:, None, None, None]
  if band[1] is not None:
    ok = ok & (k - t <= band[1])
  s = np.where(ok, s, -np.inf)
  m = s.max(-1, keepdims=True)
  m = np.where(np.isfinite(m), m, 0.0)
  p = np.where(ok, np.exp(s - m), 0.0)
  l = p.sum(-1, keepdims=True)
  out = dot("bths,bsc->bthc", p / np.where(l == 0, 1.0, l), f(lat))
  return out, np.where(l[..., 0] > 0, (m + np.log(np.where(l > 0, l, 1.0)))[..., 0], -np.inf)


def _latent_inputs(seed, b, tq, h, s, lengths, *, d_c=128, d_rope=64, dtype=jnp.bfloat16):
  """``q_lat, q_rope, latent, rope`` with NaN/inf planted past ``lengths``."""
  rng = np.random.default_rng(seed)
  x = [jnp.asarray(rng.standard_normal(sh), dtype) for sh in ((b, tq, h, d_c), (b, tq, h, d_rope), (b, s, d_c), (b, s, d_rope))]
  ok = (jnp.arange(s)[None, :] < lengths[:, None])[:, :, None]
  x[2], x[3] = (jnp.where(ok, v, jnp.asarray(np.nan, dtype)) for v in x[2:])
  return x


def _check_kernel(got, want, dtype):
  (out, lse), (w_out, w_lse) = got, want
  assert max_error(out, w_out) <= tolerance(dtype)
  assert np.array_equal(np.isinf(np.asarray(lse)), np.isinf(w_lse))
  fin = np.isfinite(w_lse)   # float32 arithmetic on the inputs' values
  assert max_error(np.asarray(lse)[fin], w_lse[fin]) <= tolerance(jnp.float32)


@pytest.mark.parametrize("paged,share", [(False, True), (True, True), pytest.param(False, False, marks=pytest.mark.slow)])
def test_two_warpgroups_and_row_tiles_of_several_queries(paged, share):
  """Two compute warpgroups (each half of the value width; ``share``: the first hands its P to
  the second, else each computes the scores), 40 heads x 3 queries = two row tiles whose rows
  belong to different queries of a causal band, two key splits, NaN past ragged lengths and an
  element without keys; contiguous and paged (pages of 128)."""
  lengths = jnp.array([250, 0, 70], jnp.int32)
  q_lat, q_rope, lat, rope = _latent_inputs(1, 3, 3, 40, 256, lengths)
  band = (None, 249)
  want = _attend64(q_lat, q_rope, lat, rope, lengths, 0.1, band)
  table = None
  if paged:
    (lat, table), (rope, _) = to_pages(lat, 128, 2), to_pages(rope, 128, 2)
    table = jnp.asarray(table, jnp.int32)
  got = decode(q_lat, q_rope, lat, rope, lengths, scale=0.1, band=band, page_table=table, wgs=2, num_splits=2,
               share_scores=share, interpret=True)
  _check_kernel(got, want, jnp.bfloat16)


@pytest.mark.slow  # three interpret-mode calls
def test_splits_agree_with_one():
  """One split (its output taken as is) and three (merged by :func:`combine`) equal the float64
  attention; a split that sees no valid key gives lse -inf and drops out of the combine."""
  lengths = jnp.array([300, 40], jnp.int32)
  x = _latent_inputs(2, 2, 2, 4, 320, lengths, d_c=256)
  want = _attend64(*x, lengths, 0.2)
  for splits in (1, 3, 5):
    _check_kernel(decode(*x, lengths, scale=0.2, num_splits=splits, interpret=True), want, jnp.bfloat16)


def test_combine_of_empty_splits():
  o = jnp.arange(2 * 3 * 4 * 2, dtype=jnp.float32).reshape(2, 3, 4, 2)
  lse = jnp.array([[[0.0] * 4, [-jnp.inf] * 4, [1.0] * 4], [[-jnp.inf] * 4] * 3])
  out, total = combine(o, lse)
  w = np.exp([0.0, 1.0]) / np.exp([0.0, 1.0]).sum()
  np.testing.assert_allclose(out[0], w[0] * o[0, 0] + w[1] * o[0, 2], rtol=1e-6)
  assert not np.asarray(out[1]).any() and np.all(np.asarray(total[1]) == -np.inf)
  np.testing.assert_allclose(total[0], np.log(np.exp(0.0) + np.exp(1.0)), rtol=1e-6)


def _shapes(tq=1, s=4096, b=4, dtype=jnp.bfloat16, **dims):
  d = FULL | dims
  sd = lambda *shape: jax.ShapeDtypeStruct(shape, dtype)
  return (sd(b, tq, d["heads"], d["d_nope"]), sd(b, tq, d["heads"], d["d_rope"]), sd(b, s, d["d_c"]), sd(b, s, d["d_rope"]),
          sd(d["d_c"], d["heads"], d["d_nope"]), sd(d["d_c"], d["heads"], d["d_v"]))


def test_default_requested_and_listed():
  """The default picks the kernel for one-query decoding on sm_90 (``tuning/sm_90.json``) and
  the Triton one on an A100; ``implementation="mosaic"`` (or ``"mosaic_gpu"``) with the absorbed
  form asks for it, on sm_90 and in interpret mode off the GPU; it is listed where it runs."""
  assert explain_dispatch(*_shapes(), device=H200).implementation == "mosaic"
  assert explain_dispatch(*_shapes(), device=A100).implementation == "triton"
  assert explain_dispatch(*_shapes(2), device=H200).implementation == "mosaic"   # 256 rows
  assert explain_dispatch(*_shapes(5), device=H200).implementation == "xla"      # 5 queries: no kernel
  assert explain_dispatch(*_shapes(4, heads=16), device=H200).implementation == "triton"   # 64 rows
  for name in ("mosaic", "mosaic_gpu"):
    d = explain_dispatch(*_shapes(), device=H200, implementation=name, form="absorbed")
    assert (d.implementation, d.rule, d.get("form")) == ("mosaic", "requested", "absorbed")
  d = explain_dispatch(*_shapes(), device=CPU, implementation="mosaic", form="absorbed")
  assert d.implementation == "mosaic" and "interpret" in d.rule
  d = explain_dispatch(*_shapes(), device=H200, implementation="mosaic", form="expanded")
  assert d.implementation == "xla" and d.get("attention").implementation == "mosaic"   # attention's kernel
  assert "mosaic" in REGISTRY.names() and "mosaic" in REGISTRY.available(H200)
  assert "mosaic" not in REGISTRY.available(A100)


@pytest.mark.parametrize("device,shapes,kw,pattern", [
    (A100, {}, {}, "sm_90"),
    (Device("tpu"), {}, {}, "tpu"),
    (H200, dict(dtype=jnp.float32), {}, "dtype float32"),
    (H200, dict(tq=5), {}, "5 queries"),
    (H200, dict(d_c=320), {}, "d_c 320"),
    (H200, dict(d_c=1024), {}, "d_c 1024"),
    (H200, dict(d_rope=48), {}, "d_rope 48"),
    (H200, {}, dict(mask=M.LocalWindowMask(8, 0) & M.SegmentMask(jnp.zeros((4, 1), jnp.int32), jnp.zeros((4, 4096), jnp.int32))),
     "segments"),
])
def test_refusals_name_the_reason(device, shapes, kw, pattern):
  with pytest.raises(ValueError, match=pattern):
    explain_dispatch(*_shapes(**shapes), device=device, implementation="mosaic", form="absorbed", **kw)


def test_supports_paged_shapes():
  backend = REGISTRY.get("mosaic")
  from probjax.ops.mla.call import make_call
  call = lambda **kw: make_call(*_shapes(), **kw)
  for page in (64, 128, 4096):
    assert backend.supports(call(page_size=page), H200) is None
  for page in (32, 96):
    assert f"page_size {page}" in backend.supports(call(page_size=page), H200)
  assert backend.supports(call(mask_kinds=("band", "kv_lengths")), H200) is None


def _on_h200(monkeypatch):
  """MLA's dispatch and the backend see an H200: the kernel lowers for sm_90, not interpret mode."""
  from probjax.ops.mla import api
  monkeypatch.setattr(api.Device, "current", classmethod(lambda cls: Device("gpu", (9, 0), 140 << 30, sm_count=132)))


@pytest.mark.parametrize("paged,tq", [(True, 1), (False, 1), (False, 2)])
def test_lowers_for_sm90_at_full_size(monkeypatch, paged, tq):
  """128 heads, d_c 512 + d_rope 64 (two compute warpgroups of 256 value columns, wgmma from
  registers: the paths interpret mode does not run), pages of 64, a causal band over two
  queries: the forward lowers to the Mosaic GPU kernel and its gradient to XLA around it."""
  _on_h200(monkeypatch)
  b, s = 8, 4096
  args = list(_shapes(tq, s, b))
  kw = dict(mask=M.KVLenMask(jnp.full((b,), s - 5, jnp.int32)))
  if tq > 1:
    kw["mask"] = kw["mask"] & M.CausalMask(s - tq)
  table = None
  if paged:
    args[2], args[3] = (jax.ShapeDtypeStruct((b * s // 64 + 1, 64, x.shape[-1]), x.dtype) for x in args[2:4])
    table = jax.ShapeDtypeStruct((b, s // 64), jnp.int32)
  f = lambda qn, qr, lat, rope, wuk, wuv, t: mla(qn, qr, lat, rope, wuk, wuv, form="absorbed", implementation="mosaic",
                                                  page_table=t, **kw)
  text = jax.jit(f).trace(*args, table).lower(lowering_platforms=("cuda",)).as_text()
  assert set(re.findall(r"custom_call @([\w$.]+)", text)) == {"mosaic_gpu_v2"} and "probjax_mla_decode_mosaic" in text
  loss = lambda *a: jnp.sum(f(*a).astype(jnp.float32))
  grad = jax.jit(jax.grad(loss, argnums=(0, 1, 4, 5))).trace(*args, table).lower(lowering_platforms=("cuda",)).as_text()
  assert grad.count("probjax_mla_decode_mosaic") >= 1


@pytest.mark.parametrize("share", [True, False])
def test_kernel_lowers_for_sm90_with_and_without_shared_scores(share):
  """At d_c 512 both ways of the two compute warpgroups lower: one score tile handed over
  (rope queries in registers) or each warpgroup's own."""
  sd = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.bfloat16)
  f = lambda ql, qr, lat, rope: decode(ql, qr, lat, rope, jnp.full((8,), 1000, jnp.int32), scale=0.1,
                                       share_scores=share)
  text = jax.jit(f).trace(sd(8, 1, 128, 512), sd(8, 1, 128, 64), sd(8, 4096, 512), sd(8, 4096, 64)).lower(
      lowering_platforms=("cuda",)).as_text()
  assert "probjax_mla_decode_mosaic" in text


def _full_inputs(b, tq, s, lengths, dtype, seed=6):
  args = inputs(seed, b, tq, s, dtype=dtype, **FULL)[0]
  ok = (jnp.arange(s)[None, :] < lengths[:, None])[:, :, None]
  args[2], args[3] = (jnp.where(ok, x, jnp.nan) for x in args[2:4])
  return args


@pytest.mark.quick  # the few-minute GPU selection (MARK='gpu and quick')
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_gpu_full_size(dtype):
  """128 heads, d_c 512 + d_rope 64, B4 x 4096 with ragged lengths (NaN past them, one element
  without keys): contiguous and paged (pages of 64) against the float64 reference."""
  b, s = 4, 4096
  lengths = jnp.array([4096, 1000, 1, 0], jnp.int32)
  args = _full_inputs(b, 1, s, lengths, dtype)
  mask = M.KVLenMask(lengths)
  out = mla(*args, mask=mask, form="absorbed", implementation="mosaic")
  assert max_error(out, reference_mla(*args, mask=mask)) <= tolerance(dtype)
  (lat, table), (rope, _) = to_pages(args[2], 64, 0), to_pages(args[3], 64, 0)
  paged = mla(*args[:2], lat, rope, *args[4:], mask=mask, form="absorbed", implementation="mosaic",
              page_table=jnp.asarray(table, jnp.int32))
  assert max_error(paged, out) <= tolerance(dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("tq", [2, 4])
def test_gpu_queries_under_a_causal_band(tq):
  """Several queries per sequence (their rows in tiles of 64 heads), causal among them, with
  ragged lengths and pages of 128, against the float64 reference."""
  b, s = 2, 2048
  lengths = jnp.array([2048, 777], jnp.int32)
  args = _full_inputs(b, tq, s, lengths, jnp.bfloat16, seed=tq)
  mask = M.CausalMask(s - tq) & M.KVLenMask(lengths)
  (lat, table), (rope, _) = to_pages(args[2], 128, 1), to_pages(args[3], 128, 1)
  out = mla(*args[:2], lat, rope, *args[4:], mask=mask, form="absorbed", implementation="mosaic",
            page_table=jnp.asarray(table, jnp.int32))
  assert max_error(out, reference_mla(*args, mask=mask)) <= tolerance(jnp.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("share,splits", [(True, 1), (True, None), (False, 1), (False, None)])
def test_gpu_kernel_score_modes_and_splits(share, splits):
  """The kernel alone at d_c 512 + 64, 128 heads, pages of 64, NaN past ragged lengths: the
  leader/follower hand-over and each warpgroup's own scores, one split (output taken as is) and
  the default's (merged), against the float64 attention."""
  lengths = jnp.array([4096, 2500, 63, 0], jnp.int32)
  x = _latent_inputs(7, 4, 1, 128, 4096, lengths, d_c=512)
  want = _attend64(*x, lengths, 0.07)
  (lat, table), (rope, _) = to_pages(x[2], 64, 5), to_pages(x[3], 64, 5)
  got = decode(x[0], x[1], lat, rope, lengths, scale=0.07, page_table=jnp.asarray(table, jnp.int32),
               share_scores=share, num_splits=splits)
  _check_kernel(got, want, jnp.bfloat16)
