"""Dispatch rules and the device table as pure functions, with faked devices."""

import math
import dataclasses
import pathlib
import re

import jax
import jax.numpy as jnp
import pytest

from probjax.nn.layers import attention_device
from probjax.nn.layers.attention import explain_dispatch
from probjax.ops.attention import dispatch
from probjax.ops.attention import masks as M
from probjax.ops.attention.dispatch import MIN_KERNEL_KV_LEN, Device

H200 = Device("gpu", (9, 0), 140 << 30)
RTX3090 = Device("gpu", (8, 6), 24 << 30)
CPU = Device("cpu")
BIG = ((4, 4096, 8, 128), (4, 4096, 8, 128))
SMALL = ((1, 128, 8, 64), (1, 128, 8, 64))


def decide(shapes=BIG, dtype=jnp.bfloat16, device=H200, env=None, **kw):
  return explain_dispatch(*shapes, dtype, device=device, env=env or {}, **kw)


def test_cpu_always_xla():
  d = decide(device=CPU)
  assert d.implementation == "xla" and "platform cpu" in d.rule


@pytest.mark.parametrize("flag", ["bias", "dense_mask", "dropout", "module"])
def test_generic_rules_send_non_kernel_arguments_to_xla(flag):
  mid = ((4, 2048, 8, 128), (4, 2048, 8, 128))
  d = decide(mid, device=RTX3090, **{flag: True})
  assert d.implementation == "xla"
  assert d.get("formulation") == "dense"  # fits in a quarter of 24 GiB: dense XLA is the fast XLA form on GPUs
  assert decide(device=RTX3090, **{flag: True}).get("formulation") == "auto"  # 8.6 GB of scores: tiled


def test_score_mod_the_kernels_cannot_lower_goes_to_xla():
  # jnp.round has no Pallas Triton lowering: the default takes XLA; asked for, the kernels refuse.
  rounded = lambda s, *idx: jnp.round(s)
  d = decide(device=RTX3090, score_mod=rounded)
  assert d.implementation == "xla" and "round" in d.rule
  assert decide(score_mod=rounded).implementation == "xla"
  for impl in ("triton", "mosaic"):
    with pytest.raises(ValueError, match="round, which Pallas"):
      decide(implementation=impl, score_mod=rounded)
  assert decide(device=RTX3090, score_mod=lambda s, b, h, qi, ki: jnp.where(qi >= ki, s, -jnp.inf)).implementation == "triton"


def test_precision_goes_to_xla():
  assert decide(device=RTX3090, precision="highest").implementation == "xla"


def test_short_kv_goes_to_xla():
  shapes = ((8, 100, 8, 64), (8, MIN_KERNEL_KV_LEN - 1, 8, 64))
  d = decide(shapes, device=RTX3090)
  assert d.implementation == "xla" and "keys" in d.rule
  shapes = ((8, 100, 8, 64), (8, MIN_KERNEL_KV_LEN, 8, 64))
  assert decide(shapes, device=RTX3090).implementation == "triton"


@pytest.mark.parametrize("mask", [None, M.CausalMask(), M.LocalWindowMask(512, 0),
                                  M.SegmentMask(jnp.zeros((4, 4096), jnp.int32)),
                                  M.KVLenMask(jnp.full((4,), 100))])
def test_position_masks_and_gqa_go_to_the_kernel_without_a_table(mask):
  shapes = ((4, 4096, 32, 128), (4, 4096, 8, 128))
  d = decide(shapes, device=RTX3090, mask=mask)
  assert d.implementation == "triton" and d.under_grad.backward == "auto"


@pytest.mark.parametrize("mask", [None, M.CausalMask(), M.KVLenMask(jnp.full((4,), 100))])
def test_sm90_table_routes_to_cudnn(mask):
  d = decide(mask=mask, env={"PROBJAX_ATTENTION_MOSAIC": "0"})  # (its forward rule: below)
  assert d.implementation == "cudnn" and "sm_90 device table" in d.rule


@pytest.mark.parametrize("mask,shapes", [
    (M.LocalWindowMask(512, 2), BIG),
    (M.SegmentMask(jnp.zeros((4, 4096), jnp.int32)), BIG),
    (M.CausalMask(), ((4, 2048, 8, 128), (4, 4096, 8, 128))),  # causal but unequal lengths
    (M.CausalMask(offset=3), BIG),
    (None, ((4, 4096, 8, 32 + 4), (4, 4096, 8, 36))),  # head_dim not a multiple of 8
])
def test_sm90_table_falls_back_to_triton_where_cudnn_cannot(mask, shapes):
  entry = attention_device.DEVICE_DEFAULTS[(9, 0)]
  want = entry.backward.band_impl if mask is not None and mask.has_band else entry.backward.impl
  d = decide(shapes, mask=mask, env={"PROBJAX_ATTENTION_MOSAIC": "0"})
  assert d.implementation == "triton" and d.under_grad.backward == want
  d = decide(shapes, mask=mask)  # long calls: the Mosaic kernel where it takes the call (below)
  assert d.implementation == ("triton" if shapes[0][-1] == 36 else "mosaic"), d


def test_sm90_long_calls_run_mosaic_where_triton_would():
  entry = attention_device.DEVICE_DEFAULTS[(9, 0)]
  n, docs = entry.mosaic_long.min_len, M.SegmentMask(jnp.zeros((4, 8192), jnp.int32))
  bwd_min = dict(entry.mosaic_long.backward_min_work)
  for d in (64, 128, 256):
    shapes = ((4, n, 8, d), (4, n, 8, d))
    dec = decide(shapes, mask=M.SegmentMask(jnp.zeros((4, n), jnp.int32)))
    assert dec.implementation == "mosaic" and "Mosaic forward" in dec.rule, dec
    assert dec.under_grad.backward == entry.backward.impl  # below every Mosaic-backward limit
    for env in ({"PROBJAX_ATTENTION_MOSAIC": "0"}, {"PROBJAX_ATTENTION_DEVICE_DEFAULTS": "0"}):
      assert decide(shapes, mask=M.SegmentMask(jnp.zeros((4, n), jnp.int32)), env=env).implementation == "triton"
    short = ((4, n - 1, 8, d), (4, n, 8, d))
    assert decide(short, mask=M.SegmentMask(jnp.zeros((4, n - 1), jnp.int32))).implementation == "triton"
    long = decide(((4, 8192, 8, d), (4, 8192, 8, d)), mask=docs)
    assert long.under_grad.backward == ("mosaic" if d in bwd_min and 4 * 8 * 8192**2 >= bwd_min[d]
                                       else entry.backward.impl), long
    # float32 (the Mosaic kernel does not take it) keeps the Triton kernel; a score modifier
    # takes the Mosaic forward too (measured: softcap30), unless it cannot lower there.
    assert decide(shapes, dtype=jnp.float32, mask=M.CausalMask()).implementation == "triton"
    assert decide(shapes, score_mod=lambda s, *idx: 30 * jnp.tanh(s / 30)).implementation == "mosaic"
    assert decide(shapes, score_mod=lambda s, *idx: jnp.round(s)).implementation == "xla"
  assert decide(((4, 8192, 8, 128), (4, 8192, 8, 128)), mask=docs).under_grad.backward == "mosaic"
  # The table is keyed by head_dim; the Mosaic backward's own limits still apply: 256-wide
  # values beside 128-wide keys overflow its dK/dV registers, so the Triton backward runs.
  wide_v = decide(((4, 8192, 8, 128), (4, 8192, 8, 128)), mask=docs, v_head_dim=256)
  assert (wide_v.implementation, wide_v.under_grad.backward) == ("mosaic", entry.backward.impl), wide_v
  assert decide(((4, 8192, 8, 128), (4, 8192, 8, 128)), mask=M.LocalWindowMask(256, 0),
                env={"PROBJAX_ATTENTION_CUDNN": "0"}).under_grad.backward == "mosaic"
  # Lengths off the Mosaic tiles too (the kernel reads the partial tile with TMA's zero fill).
  for d in (64, 128):
    odd = decide(((4, 3000, 8, d), (4, 3000, 8, d)), mask=M.SegmentMask(jnp.zeros((4, 3000), jnp.int32)))
    assert odd.implementation == "mosaic", odd
  # ... and the unmasked forward at 3000 keys (differentiated: cuDNN, above the D64 grad rule's keys).
  odd = decide(((4, 3000, 8, 64), (4, 3000, 8, 64)))
  assert (odd.implementation, odd.under_grad.implementation, odd.under_grad.backward) == ("mosaic", "cudnn", None), odd
  # Decoding keeps the split-KV Triton forward (its queries are far below the limit).
  assert decide(((8, 16, 32, 128), (8, 65536, 8, 128))).implementation == "triton"
  assert 2048 <= n and all(d <= 128 for d in bwd_min)  # the Mosaic backward's head_dims


def test_sm90_decoding_skips_cudnn():
  entry = attention_device.DEVICE_DEFAULTS[(9, 0)]
  n, long = entry.decode.max_q_len, 65536
  decoding = ((8, n, 32, 128), (8, long, 8, 128))
  assert 8 * 32 * n * long >= entry.cudnn.min_work
  d = decide(decoding)
  assert d.implementation == "triton" and d.get("split_kv", 0) and d.get("split_kv", 0) >= 2
  assert decide(((8, n + 1, 32, 128), (8, long, 8, 128))).implementation == "cudnn"
  short_cache = ((64, n, 32, 128), (64, entry.decode.min_kv_len - 1, 8, 128))
  assert decide(short_cache).implementation == "cudnn"


def _under_grad(dec) -> str:
  """What a differentiated call runs."""
  return dec.under_grad.implementation


def test_sm90_differentiated_d64_runs_triton():
  entry = attention_device.DEVICE_DEFAULTS[(9, 0)]
  # Below mosaic_min_len, above cudnn.triton_forward_work: cuDNN's forward.
  d64 = ((4, 1024, 32, 64), (4, 1024, 32, 64))
  d = decide(d64)
  assert d.implementation == "cudnn" and d.under_grad.implementation == "triton"
  assert d.under_grad.backward == entry.backward.impl and "under grad triton" in str(d)
  assert decide(d64, mask=M.CausalMask()).under_grad.backward == entry.backward.band_impl
  # At the work limit, above the key limit, at head_dim 128, or without the table: cuDNN's own backward.
  n = int((entry.grad_triton.max_work // (4 * 8)) ** 0.5)
  assert decide(((4, n, 8, 64), (4, n, 8, 64))).grad is None
  t = entry.grad_triton.max_kv_len
  assert _under_grad(decide(((4, t, 32, 64), (4, t, 32, 64)))) == "triton"
  assert _under_grad(decide(((4, t + 1, 32, 64), (4, t + 1, 32, 64)))) == "cudnn"
  assert _under_grad(decide(((4, 2048, 8, 128), (4, 2048, 8, 128)))) == "cudnn"
  assert decide(d64, implementation="cudnn").grad is None
  assert decide(d64, kernel_args_default=False).implementation == "triton"


def test_sm90_small_work_uses_triton():
  d = decide(SMALL)
  assert d.implementation == "triton"


def test_sm90_fp32_rule():
  d = decide(dtype=jnp.float32)
  assert d.implementation == "xla" and d.get("formulation") == "dense" and "float32" in d.rule
  long = ((1, 32768, 8, 128), (1, 32768, 8, 128))
  assert decide(long, dtype=jnp.float32).implementation == "triton"
  tiny_mem = Device("gpu", (9, 0), 1 << 30)
  assert decide(dtype=jnp.float32, device=tiny_mem).implementation == "triton"
  # A band (causal, window) halves the kernel's work but not the dense formulation's.
  entry = attention_device.DEVICE_DEFAULTS[(9, 0)]
  for mask in (M.CausalMask(), M.LocalWindowMask(512, 0)):
    assert decide(dtype=jnp.float32, mask=mask).implementation == "triton"
    n = entry.fp32_dense.band_max_len
    short = ((4, n, 8, 128), (4, n, 8, 128))
    assert decide(short, dtype=jnp.float32, mask=mask).get("formulation") == "dense"
  assert decide(dtype=jnp.float32, mask=M.KVLenMask(jnp.full((4,), 100))).get("formulation") == "dense"
  # At small head_dims the kernel's TF32 tiles win at every length.
  for d in (32, entry.fp32_dense.kernel_max_head_dim):
    assert decide(((4, 1024, 8, d), (4, 1024, 8, d)), dtype=jnp.float32).implementation == "triton"
  d = entry.fp32_dense.kernel_max_head_dim + 32
  assert decide(((4, 1024, 8, d), (4, 1024, 8, d)), dtype=jnp.float32).get("formulation") == "dense"


@pytest.mark.parametrize("var", ["PROBJAX_ATTENTION_CUDNN", "PROBJAX_ATTENTION_DEVICE_DEFAULTS"])
def test_env_opt_outs(var):
  d = decide(env={var: "0", "PROBJAX_ATTENTION_MOSAIC": "0"})
  assert d.implementation == "triton"
  if var == "PROBJAX_ATTENTION_DEVICE_DEFAULTS":
    assert d.under_grad.backward == "auto"  # generic rules
  else:
    assert d.under_grad.backward == "triton_split"  # still the sm_90 table
  assert decide(env={var: "1", "PROBJAX_ATTENTION_MOSAIC": "0"}).implementation == "cudnn"


def test_mosaic_only_when_requested():
  d = decide(implementation="mosaic", mask=M.CausalMask())
  assert d.implementation == "mosaic" and d.under_grad.backward == "auto"  # the Triton backward's own rules
  big64 = ((4, 4096, 8, 64), (4, 4096, 8, 64))  # unmasked D64: cuDNN's forward (the table)
  assert "mosaic" not in {decide(s).implementation for s in (big64, SMALL)}
  with pytest.raises(ValueError, match="mosaic.*float32"):
    decide(implementation="mosaic", dtype=jnp.float32)
  with pytest.raises(ValueError, match="sm_90"):
    decide(implementation="mosaic", device=Device("gpu", (8, 0), 80 << 30))
  assert decide(implementation="mosaic", score_mod=lambda s, *idx: s).implementation == "mosaic"
  slopes = jnp.ones(8)
  with pytest.raises(ValueError, match="score_mod closes over arrays"):
    decide(implementation="mosaic", score_mod=lambda s, b, h, qi, ki: s - slopes[h] * (qi - ki))
  assert decide(implementation="mosaic", mask=M.SegmentMask(jnp.zeros((4, 4096), jnp.int32))).implementation == "mosaic"
  assert decide(implementation="mosaic", backward_pass_impl="mosaic").under_grad.backward == "mosaic"
  for impl in (None, "triton"):
    with pytest.raises(ValueError, match="needs implementation='mosaic'"):
      decide(implementation=impl, backward_pass_impl="mosaic")
  # Its opt-out changes only the rule that picks it (below).
  assert decide(big64, env={"PROBJAX_ATTENTION_MOSAIC": "0"}) == decide(big64)


def test_sm90_differentiated_causal_runs_mosaic():
  entry = attention_device.DEVICE_DEFAULTS[(9, 0)]
  limits = dict(entry.grad_mosaic.causal_max_work)
  causal = M.CausalMask()
  for d, work in limits.items():
    n = int((work // (4 * 8)) ** 0.5)  # B4 H8 T n: at the limit
    dec = decide(((4, n, 8, d), (4, n, 8, d)), mask=causal)
    assert _under_grad(dec) == "mosaic", dec  # (its primal: the forward rule, below)
    assert dec.under_grad.backward == entry.backward.band_impl and "Triton backward" in dec.rule
    over = decide(((4, 2 * n, 8, d), (4, 2 * n, 8, d)), mask=causal)
    assert _under_grad(over) in ("cudnn", "triton"), over
    nomask = decide(((4, n, 8, d), (4, n, 8, d)))
    assert nomask.grad is None or nomask.grad.implementation != "mosaic", nomask  # no mask
    off = decide(((4, n, 8, d), (4, n, 8, d)), mask=causal, env={"PROBJAX_ATTENTION_MOSAIC": "0"})
    assert off.grad is None or off.grad.implementation != "mosaic", off
    window = decide(((4, n, 8, d), (4, n, 8, d)), mask=M.LocalWindowMask(256, 0))
    assert window.grad is None or window.grad.implementation != "mosaic", window  # unmeasured
  assert 256 not in limits and 2**29 >= limits[64] >= limits[128]


def test_sm90_cross_attention_of_few_queries_over_many_keys_runs_mosaic():
  m = attention_device.DEVICE_DEFAULTS[(9, 0)].mosaic_long
  d, q = m.cross_min_head_dim, max(m.cross_min_q_len, 300)
  kv = m.cross_min_kv_per_q * q
  shapes = lambda q, kv, d: ((1, q, 8, d), (1, kv, 8, d))
  bottom_right = M.CausalMask(kv - q)
  for mask in (None, bottom_right):
    dec = decide(shapes(q, kv, d), mask=mask, dtype=jnp.float16)
    assert dec.implementation == "mosaic" and dec.backward.startswith("triton"), dec
    assert "more keys than queries" in dec.rule
  # below each threshold, and with a window, key lengths or a causal band ending before the
  # bottom-right diagonal, the Triton kernel keeps the call
  lens = M.KVLenMask(jnp.full((1,), kv // 2))
  for sh, mask in ((shapes(q, kv - 8, d), None), (shapes(q, kv, d // 2), None),
                   (shapes(m.cross_min_q_len - 8, m.cross_min_kv_per_q * m.cross_min_q_len, d), None),
                   (shapes(q, kv, d), M.CausalMask()), (shapes(q, kv, d), M.LocalWindowMask(600, 0, kv - q)),
                   (shapes(q, kv, d), bottom_right & lens), (shapes(q, kv, d), lens)):
    assert decide(sh, mask=mask, dtype=jnp.float16).implementation != "mosaic", (sh, mask)
  assert decide(shapes(q, kv, d), mask=bottom_right, dtype=jnp.float32).implementation != "mosaic"
  assert decide(shapes(q, kv, d), mask=bottom_right, env={"PROBJAX_ATTENTION_MOSAIC": "0"}).implementation != "mosaic"


def test_sm90_forward_rule_runs_mosaic():
  entry = attention_device.DEVICE_DEFAULTS[(9, 0)]
  grad_limits = dict(entry.grad_mosaic.causal_max_work)
  side = lambda work: int(round((work // (4 * 8)) ** 0.5))  # B4 H8 T side: that work
  masks = {"none": None, "causal": M.CausalMask(), "window": M.LocalWindowMask(512, 0)}

  def covers(ranges, kind, d, n):  # a table range holds B4 H8 T=n at this mask and head_dim
    return any(k == kind and dd == d and lo_ <= 32 * n * n and (hi_ is None or 32 * n * n <= hi_)
               for k, dd, lo_, hi_ in ranges)
  for kind, d, lo, hi in entry.mosaic_primal.work:
    mask = masks[kind]
    first = -(-side(lo) // 128) * 128  # the range's ends in whole 128-row tiles
    for n in (first, 4 * first if hi is None else side(hi) // 128 * 128):
      shapes = ((4, n, 8, d), (4, n, 8, d))
      dec = decide(shapes, mask=mask)
      assert dec.implementation == "mosaic", (kind, d, n, dec)
      grad_mosaic = kind == "causal" and 32 * n * n <= grad_limits.get(d, -1)
      assert (dec.grad and dec.grad.implementation) == (None if grad_mosaic else "cudnn"), dec
      if grad_mosaic:  # the Mosaic forward with the Triton backward under grad
        assert dec.under_grad.backward == entry.backward.band_impl, dec
      assert decide(shapes, mask=mask, env={"PROBJAX_ATTENTION_MOSAIC": "0"}).implementation == "cudnn"
      assert decide(shapes, mask=mask, dtype=jnp.float32).implementation != "mosaic"
      # Unmeasured masks that cuDNN takes keep its forward.
      assert decide(shapes, mask=M.KVLenMask(jnp.full((4,), n // 2))).implementation == "cudnn"
      odd = ((4, n + 3, 8, d), (4, n + 3, 8, d))  # lengths off the 128-row tiles: their own ranges
      assert decide(odd, mask=mask).implementation == (
          "mosaic" if covers(entry.mosaic_primal.ragged_work, kind, d, n + 3) else "cudnn"), odd
    below = side(lo) // 2
    assert decide(((4, below, 8, d), (4, below, 8, d)), mask=mask).implementation != "mosaic"
    if hi is not None:
      above = 2 * side(hi)
      assert decide(((4, above, 8, d), (4, above, 8, d)), mask=mask).implementation != "mosaic"
  # D64 without a mask: cuDNN's forward is faster at every measured length in whole tiles.
  assert not any(kind == "none" and d == 64 for kind, d, _, _ in entry.mosaic_primal.work)
  for kind, d, lo, hi in entry.mosaic_primal.ragged_work:
    for n in (side(lo) + 1, side(hi) - 1):
      n += 0 if n % 128 else 1  # off the tiles
      shapes = ((4, n, 8, d), (4, n, 8, d))
      assert decide(shapes, mask=masks[kind]).implementation == "mosaic", (kind, d, n)
      whole = ((4, n // 128 * 128, 8, d),) * 2
      assert decide(whole, mask=masks[kind]).implementation == (
          "mosaic" if covers(entry.mosaic_primal.work, kind, d, n // 128 * 128) else "cudnn"), (kind, d, n)
    assert decide(((4, 2 * side(hi) + 1, 8, d),) * 2, mask=masks[kind]).implementation == "cudnn"


def test_kernel_arguments_disable_the_table():
  d = decide(kernel_args_default=False, backward_pass_impl="triton_onepass")
  assert d.implementation == "triton" and d.under_grad.backward == "triton_onepass"


def test_explicit_implementations_are_checked_not_replaced():
  assert decide(implementation="triton").implementation == "triton"
  assert decide(implementation="pallas").implementation == "triton"
  assert decide(implementation="xla").implementation == "xla"
  assert decide(implementation="xla").get("formulation") == "dense"  # GPU, fits: the einsum
  assert decide(implementation="xla", device=CPU).get("formulation") == "auto"  # CPU: linear memory
  assert decide(implementation="cudnn", dtype=jnp.float16).implementation == "cudnn"
  with pytest.raises(ValueError, match="cudnn.*float32"):
    decide(implementation="cudnn", dtype=jnp.float32)
  with pytest.raises(ValueError, match="cudnn.*mask"):
    decide(implementation="cudnn", mask=M.LocalWindowMask(4, 2))
  with pytest.raises(ValueError, match="triton.*bias"):
    decide(implementation="triton", bias=True)
  with pytest.raises(ValueError, match="triton.*NVIDIA GPU"):
    decide(implementation="triton", device=CPU)
  with pytest.raises(ValueError, match="unknown implementation"):
    decide(implementation="flash")


def _evidence(cc) -> dict:
  """The entries of compute capability ``cc``'s evidence file in bench/tuning/ (name -> value and
  evidence rows); the shipped table holds the values only."""
  from bench import tuning_table
  path = pathlib.Path(tuning_table.EVIDENCE_DIR) / ("sm_%d%d.json" % cc)
  return tuning_table.load_evidence(str(path))["entries"]


def test_table_entries_cite_evidence():
  for cc, entry in attention_device.DEVICE_DEFAULTS.items():
    evidence = _evidence(cc)
    assert all(e["evidence"] for e in evidence.values()), cc
    for impl in (entry.backward.impl, entry.backward.band_impl):
      assert impl in ("triton_onepass", "triton_fused", "triton_split")


def test_shipped_tables_are_generated_from_the_evidence():
  """probjax/ops/attention/tuning/sm_*.json is what ``python -m bench.tuning_table --write``
  makes of bench/tuning/sm_*.json: values only, the same values, one table per evidence file."""
  import json
  from bench import tuning_table
  from probjax.ops.attention import tuning
  assert tuning_table.evidence_files() and tuning_table.stale() == []
  for path, text in tuning_table.generated().items():
    doc = json.loads(text)
    assert set(doc) == {"compute_capability", "measured_on", "entries"}
    assert "evidence" not in text
    cc, entry = tuning.load(path)
    assert entry == attention_device.DEVICE_DEFAULTS[cc]
    for name, e in _evidence(cc).items():
      group, field = name.split(".")
      assert getattr(getattr(entry, group), field) == tuning._frozen(e["value"]), name


def test_decision_str_mentions_rule():
  assert "device table" in str(decide())


@pytest.mark.parametrize("mask", [None, M.CausalMask(), M.LocalWindowMask(37, 0),
                                  M.KVLenMask(jnp.array([90, 3]))])
def test_cudnn_argument_mapping_matches_reference(mask):
  """The mask → jax.nn arguments mapping, checked through jax.nn's XLA implementation."""
  from probjax.ops.attention.backends import cudnn
  from probjax.ops.attention.reference import reference_attention
  from probjax.ops.attention.tolerances import max_error, tolerance
  from probjax.testing import make_inputs
  x = make_inputs(0, 2, 90, 90, 4, 2, 16)
  assert cudnn.supports(x.q.shape, x.k.shape, jnp.bfloat16, mask=mask, platform="gpu") is None
  out = jax.nn.dot_product_attention(x.q, x.k, x.v, scale=0.25, implementation="xla",
                                     **cudnn.jaxnn_arguments(mask, 2))
  assert max_error(out, reference_attention(x.q, x.k, x.v, mask=mask, scale=0.25)) <= tolerance(jnp.float32)


def test_sm90_table_routes_causal_windows_to_cudnn():
  d = decide(mask=M.LocalWindowMask(512, 0))
  assert d.implementation == "cudnn"
  assert decide(mask=M.LocalWindowMask(512, 3)).implementation == "mosaic"  # right window: no cuDNN


def test_split_kv_decision():
  """Decoding shapes run the split-KV forward; explain_dispatch says so."""
  dec = ((1, 1, 32, 128), (1, 32768, 8, 128))
  d = decide(dec)
  assert d.implementation == "triton" and d.get("split_kv", 0) >= 2 and "split_kv=" in str(d)
  assert decide(dec, split_kv=False).get("split_kv", 0) == 0
  assert decide(BIG, device=RTX3090).get("split_kv", 0) == 0  # 4096 queries: the regular forward
  with pytest.raises(ValueError, match="split_kv=True configures the Triton kernel"):
    decide(dec, implementation="xla", split_kv=True)
  with pytest.raises(ValueError, match="split_kv=True configures the Triton kernel"):
    decide(dec, device=CPU, split_kv=True)


def test_table_groups_read_as_the_flat_names_too():
  from probjax.ops.attention import tuning
  entry = attention_device.DEVICE_DEFAULTS[(9, 0)]
  assert set(_evidence((9, 0))) == set(tuning.entry_names())
  for flat, name in tuning._FLAT_NAMES.items():
    group, field = name.split(".")
    assert getattr(entry, flat) == getattr(getattr(entry, group), field), flat
  with pytest.raises(dataclasses.FrozenInstanceError):
    entry.mosaic_min_len = 1
  with pytest.raises(AttributeError, match="no attribute 'mosaic_min_length'"):
    entry.mosaic_min_length


def test_opt_outs_switch_off_their_rules_groups():
  off = dispatch.defaults_in_effect(H200, {"PROBJAX_ATTENTION_CUDNN": "0", "PROBJAX_ATTENTION_MOSAIC": "0"})
  assert (off.cudnn, off.mosaic_primal, off.grad_mosaic, off.mosaic_long) == (None,) * 4
  assert off.backward == attention_device.DEVICE_DEFAULTS[(9, 0)].backward
  assert dispatch.defaults_in_effect(H200, {"PROBJAX_ATTENTION_DEVICE_DEFAULTS": "0"}) is None
  assert dispatch.defaults_in_effect(RTX3090, {}) is None


def _rule_numbers():
  """``{rule function: its number}``, from the "Rule N" each docstring starts with."""
  rules = dispatch.RULES + dispatch.GRAD_RULES
  numbers = {r: int(re.match(r"Rule (\d+)\b", r.__doc__).group(1)) for r in rules}
  assert sorted(numbers.values()) == list(range(1, len(rules) + 1))
  return numbers


def test_rules_are_numbered_in_order_in_the_code_readme_and_decisions():
  numbers = _rule_numbers()
  assert [numbers[r] for r in dispatch.RULES] == sorted(numbers[r] for r in dispatch.RULES)
  root = pathlib.Path(__file__).resolve().parents[3]
  readme = (root / "README.md").read_text().split("## Implementations and dispatch")[1].split("\n## ")[0]
  decisions = (root / "docs" / "dev" / "decisions.md").read_text()
  for rule, n in numbers.items():
    assert re.search(rf"^ *{n}\. `{rule.__name__}`", readme, re.M), (n, rule.__name__)
    assert re.search(rf"^ *{n}\. `{rule.__name__}`", decisions, re.M), (n, rule.__name__)
    assert re.search(rf"^ *{n}\. :func:`{rule.__name__}`", dispatch.__doc__, re.M), (n, rule.__name__)


def test_every_rule_decision_has_a_reason():
  calls = [((4, 2048, 8, d), (4, 2048, 8, d), dt, mask) for d in (64, 128) for dt in (jnp.bfloat16, jnp.float32)
           for mask in (None, M.CausalMask(), M.LocalWindowMask(256, 3))]
  for q, kv, dt, mask in calls:
    for device in (H200, RTX3090, CPU):
      assert decide((q, kv), dtype=dt, mask=mask, device=device).rule


def test_mosaic_sees_the_scale():
  # Without a score_mod the Mosaic kernel takes a positive scale only: a long call with
  # documents then keeps the Triton kernel, and asking for Mosaic says why.
  shapes = ((4, 4096, 8, 128), (4, 4096, 8, 128))
  docs = M.SegmentMask(jnp.zeros((4, 4096), jnp.int32))
  assert decide(shapes, mask=docs, scale=0.1).implementation == "mosaic"
  assert decide(shapes, mask=docs, scale=-0.1).implementation == "triton"
  with pytest.raises(ValueError, match="positive scale"):
    decide(shapes, mask=docs, scale=-0.1, implementation="mosaic")


def test_sm90_cudnn_threshold_per_mask_and_head_dim(monkeypatch):
  # min_work_at replaces min_work for its mask kind and head_dim only. Head_dims above 128 reach
  # cuDNN through probjax's FFI extension only: as where it is built (the table's machines).
  from probjax.ops.attention.backends.cudnn import ffi
  monkeypatch.setattr(ffi, "unavailable", lambda env=None: None)
  cud = attention_device.DEVICE_DEFAULTS[(9, 0)].cudnn
  for kind, d, work in cud.min_work_at:
    mask = M.CausalMask() if kind == "causal" else None
    n = int(math.ceil((work / 32) ** 0.5))   # B4 H8: the least length at or above that work
    below, at = ((4, n - 1, 8, d),) * 2, ((4, n, 8, d),) * 2
    assert decide(below, mask=mask).implementation != "cudnn"
    assert decide(at, mask=mask).implementation in ("cudnn", "mosaic")
    assert cud.threshold(kind, d) == work
    assert cud.threshold("window", d) == (work if kind == "any" else cud.min_work)  # "any": every mask
    assert cud.threshold(None, d) == (work if kind == "any" else cud.min_work)      # key lengths


def test_sm90_wide_head_dims_take_cudnn_only_through_the_ffi_extension(monkeypatch):
  # Without the extension (jax.nn's route takes head_dims up to 128) a D256 call keeps the
  # kernels' rules: the default never picks a path that cannot compute the call.
  from probjax.ops.attention.backends.cudnn import ffi
  shapes = ((4, 4096, 8, 256),) * 2
  monkeypatch.setattr(ffi, "unavailable", lambda env=None: None)
  assert decide(shapes).implementation == "cudnn"
  monkeypatch.setattr(ffi, "unavailable", lambda env=None: "not built")
  assert decide(shapes).implementation in ("triton", "mosaic")


def test_sm90_triton_forward_ranges_keep_cudnn_under_grad():
  # In a triton_forward_work range rule 4 runs the Triton forward; differentiated calls keep
  # what rule 4 gives them (here cuDNN's forward and backward). Past either end: cuDNN.
  cud = attention_device.DEVICE_DEFAULTS[(9, 0)].cudnn
  assert cud.triton_forward_work
  for kind, d, lo, hi in cud.triton_forward_work:
    mask = M.CausalMask() if kind == "causal" else None
    first = int(math.ceil((max(lo, cud.threshold(kind, d)) / 32) ** 0.5))  # B4 H8
    last = int(math.floor((hi / 32) ** 0.5))
    for n in (first, last):
      got = decide(((4, n, 8, d),) * 2, mask=mask)
      assert (got.implementation, got.under_grad.implementation) == ("triton", "cudnn"), (n, got)
      assert "forward: the Triton kernel is faster" in got.rule
    assert decide(((4, last + 1, 8, d),) * 2, mask=mask).implementation == "cudnn"
    assert decide(((4, first, 8, d),) * 2, mask=mask, env={"PROBJAX_ATTENTION_CUDNN": "0"}).grad is None


@pytest.mark.parametrize("d,impl", [(32, "triton"), (40, "cudnn"), (48, "cudnn"), (80, "cudnn"), (96, "cudnn")])
def test_sm90_head_dims_the_triton_kernel_pads_run_cudnn(d, impl):
  # The Triton kernel pads 40/48 to 64 and 80/96 to 128; from head_dim 40 cuDNN is ahead above
  # the work threshold (B4 H8 T4096), at 80 and 96 already from B4 H8 T725 (2^24), key lengths too.
  assert decide(((4, 4096, 8, d),) * 2).implementation == impl
  assert decide(((4, 4096, 8, d),) * 2, mask=M.CausalMask()).implementation == impl
  assert decide(((4, 1024, 8, d),) * 2).implementation == ("cudnn" if d >= 80 else "triton")
  assert decide(((4, 725, 8, d),) * 2).implementation == ("cudnn" if d >= 80 else "triton")
  lengths = M.KVLenMask(jnp.full((4,), 700, jnp.int32))
  assert decide(((4, 725, 8, d),) * 2, mask=lengths).implementation == ("cudnn" if d >= 80 else "triton")
  assert decide(((4, 724, 8, d),) * 2).implementation == "triton"


def test_sm90_short_unmasked_backward_is_fused():
  b = attention_device.DEVICE_DEFAULTS[(9, 0)].backward
  for d, t in b.short_impl_max_kv_len:
    assert decide(((4, t, 4, d),) * 2).under_grad.backward == b.band_impl
    assert decide(((4, t + 1, 4, d),) * 2).under_grad.backward == b.impl
  assert decide(((4, 600, 4, 64),) * 2).under_grad.backward == b.impl      # another head_dim


@pytest.mark.parametrize("head_dim, want", [(128, ("cudnn", "mosaic", "triton")), (96, ("cudnn", "triton"))])
def test_jvp_of_a_cudnn_call_asks_the_kernels_for_a_fused_tangent(head_dim, want):
  """cuDNN has no forward-mode kernel: a jvp of a call it runs takes the fused forward + JVP
  kernel of the first kernel backend that computes the call (Mosaic on sm_90 where it takes the
  width, else Triton), before falling back to the XLA formulation's jvp."""
  from probjax.ops.attention.call import AttentionCall
  shapes = tuple(s[:3] + (head_dim,) for s in BIG)
  d = decide(shapes)
  assert d.implementation == "cudnn", d
  call = AttentionCall(*shapes, jnp.bfloat16)
  assert dispatch.tangent_candidates(d, call, H200) == want
  own = dispatch.tangent_candidates(dispatch.Decision("triton", "requested"), call, H200)
  assert own[0] == "triton" and own.count("triton") == 1
