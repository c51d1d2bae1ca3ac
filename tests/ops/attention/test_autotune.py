"""Autotuning attention (opt-in): the key of a call, its candidates, the explain_dispatch hook
(measured with autotuning on, the rules with it off), the cache read on a faked GPU, and the
pre-tune command's cache read by a later process. On CPU the candidates are XLA's two
formulations; the selection is tested with injected measurements."""

import json
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

import probjax
from probjax.core import autotune as core
from probjax.core import config
from probjax.core.device import Device
from probjax.ops.attention import autotune as at
from probjax.ops.attention import dispatch
from probjax.ops.attention.call import AttentionCall
from probjax.ops.attention.masks import CausalMask, KVLenMask, LocalWindowMask, Mask, SegmentMask

H200 = Device("gpu", (9, 0), 140 << 30)
CPU = Device("cpu")
Q, KV = (1, 64, 2, 16), (1, 64, 2, 16)


@pytest.fixture(autouse=True)
def _isolated(monkeypatch, tmp_path):
  monkeypatch.setenv(config.AUTOTUNE_CACHE.name, str(tmp_path / "default.json"))
  monkeypatch.delenv(config.AUTOTUNE.name, raising=False)
  core.clear_process_caches()
  yield
  core.clear_process_caches()


@pytest.fixture
def fake_measure(monkeypatch):
  """Replaces the measurement by fixed times (XLA's flash formulation fastest); records calls."""
  calls = []

  def measure(call, names, differentiated):
    calls.append((at.key(call, Device.current(), differentiated), tuple(names)))
    return {n: (1.0 if n == "xla:flash" else 2.0) for n in names}, {}

  monkeypatch.setattr(at, "measure", measure)
  return calls


def test_key_of_a_call_is_stable():
  call = AttentionCall((2, 64, 4, 16), (2, 64, 2, 16), jnp.bfloat16, mask=CausalMask())
  assert at.key(call, H200, False) == "attention|sm_90|2x64x4x16,2x64x2x16,2x64x2x16|bfloat16|causal|forward"
  mla = AttentionCall((2, 64, 4, 192), (2, 80, 4, 192), jnp.float32, v_head_dim=128,
                      mask=LocalWindowMask(16, 0) & KVLenMask(jnp.array([3, 5])))
  assert at.key(mla, CPU, True) == (
      "attention|cpu|2x64x4x192,2x80x4x192,2x80x4x128|float32|band:-16:0&kv_lengths|grad")


@pytest.mark.parametrize("mask, spec", [
    (None, "none"), (CausalMask(), "causal"), (LocalWindowMask(16, 0), "band:-16:0"),
    (LocalWindowMask(8, 8), "band:-8:8"), (CausalMask() & KVLenMask(jnp.array([40])), "causal&kv_lengths"),
    (SegmentMask(jnp.zeros((1, 64), jnp.int32)), "segments"), (Mask(prefix_lengths=jnp.array([4])), "prefix_lm")])
def test_mask_spec_round_trips(mask, spec):
  assert at.mask_spec(mask) == spec
  assert at.mask_spec(at.mask_from_spec(spec, 1, 64, 64)) == spec


def test_candidates():
  call = AttentionCall((4, 2048, 8, 128), (4, 2048, 8, 128), jnp.bfloat16, mask=CausalMask())
  assert at.candidates(call, CPU, False) == at.candidates(call, CPU, True) == ["xla:flash"]  # dense too big
  assert at.candidates(AttentionCall(Q, KV, jnp.float32), CPU, True) == ["xla:dense", "xla:flash"]
  fwd = at.candidates(call, H200, False)
  assert fwd == ["xla:dense", "xla:flash", "triton", "cudnn", "mosaic"]
  grad = at.candidates(call, H200, True)
  assert {"triton:triton_fused", "triton:triton_split", "triton:triton_onepass", "cudnn", "mosaic:mosaic",
          "mosaic:triton_fused"} <= set(grad) and "triton" not in grad and "mosaic:auto" not in grad
  # The Mosaic backward refuses widths past 320 (192 + 192): no candidate of it, the Triton backwards stay.
  wide = AttentionCall((4, 2048, 8, 192), (4, 2048, 8, 192), jnp.bfloat16, mask=CausalMask())
  wide_grad = at.candidates(wide, H200, True)
  assert "mosaic:mosaic" not in wide_grad and {"mosaic:triton_fused", "triton:triton_fused"} <= set(wide_grad)
  # A mask the kernels refuse leaves XLA's; calls autotuning cannot reproduce are left to the rules.
  prefix = AttentionCall(Q, KV, jnp.bfloat16, mask=Mask(prefix_lengths=jnp.array([4])))
  assert at.candidates(prefix, H200, False) == ["xla:dense", "xla:flash"]
  assert at.measurable(AttentionCall(Q, KV, jnp.float32, bias=True), CPU) == "additive bias"
  assert at.measurable(AttentionCall(Q, KV, jnp.float32, score_mod=lambda s, *_: s), CPU) == "a score_mod"
  assert at.measurable(AttentionCall(Q, KV, jnp.float32), Device.interpreter()) == "interpret mode"
  assert at.measurable(AttentionCall(Q, KV, jnp.float32, backward_pass_impl="triton_fused"), H200)
  assert at.measurable(call, H200) is None


def test_explain_dispatch_measures_with_autotuning_on_and_runs_the_rules_off(tmp_path, fake_measure):
  rules = dispatch.explain_dispatch(Q, KV, jnp.float32, mask=CausalMask(), device=CPU)
  assert rules.rule.startswith("platform cpu") and rules.get("autotuned") is None
  with probjax.autotune(cache_path=tmp_path / "c.json"):
    d = dispatch.explain_dispatch(Q, KV, jnp.float32, mask=CausalMask(), device=CPU)
    assert d.implementation == "xla" and d.get("formulation") == "flash" and d.get("autotuned") is True
    assert d.rule == "measured: xla:flash fastest of 2 candidates (1 ms vs next 2 ms)"
    assert len(fake_measure) == 1
    # The second call hits the cache: no measurement, the same decision (eager calls before and
    # after share their compiled computation).
    assert dispatch.explain_dispatch(Q, KV, jnp.float32, mask=CausalMask(), device=CPU) == d
    assert len(fake_measure) == 1
    # The public explain_dispatch reports it too; an explicit implementation is never replaced.
    assert probjax.explain_dispatch(Q, KV, jnp.float32, mask=CausalMask()) == d
    assert dispatch.explain_dispatch(Q, KV, jnp.float32, mask=CausalMask(), implementation="xla",
                                     device=CPU).rule == "requested"
    with probjax.autotune(False):
      assert dispatch.explain_dispatch(Q, KV, jnp.float32, mask=CausalMask(), device=CPU) == rules
  assert dispatch.explain_dispatch(Q, KV, jnp.float32, mask=CausalMask(), device=CPU) == rules
  entries = json.loads((tmp_path / "c.json").read_text())["entries"]
  assert list(entries) == ["attention|cpu|1x64x2x16,1x64x2x16,1x64x2x16|float32|causal|forward"]
  # The environment switch, and the cache path from the environment.
  env = {config.AUTOTUNE.name: "1", config.AUTOTUNE_CACHE.name: str(tmp_path / "c.json")}
  assert dispatch.explain_dispatch(Q, KV, jnp.float32, mask=CausalMask(), device=CPU, env=env) == d
  assert len(fake_measure) == 1


def test_explain_dispatch_reports_a_cached_decision_on_a_gpu(tmp_path, fake_measure):
  # A cache shipped for sm_90, read on a faked H200: the forward's fastest kernel, and what
  # jax.grad runs from the differentiated key (kernels only: they pair by residuals).
  call = AttentionCall((4, 2048, 8, 128), (4, 2048, 8, 128), jnp.bfloat16, mask=CausalMask())
  cache = core.get_cache(tmp_path / "c.json")
  cache.put(at.key(call, H200, False), core.entry_of({"xla:flash": 9.0, "triton": 1.0, "cudnn": 1.5, "bogus": 0.1}))
  cache.put(at.key(call, H200, True), core.entry_of(
      {"xla:flash": 0.5, "triton:triton_fused": 6.0, "cudnn": 4.0, "mosaic:mosaic": None}))
  with probjax.autotune(cache_path=tmp_path / "c.json"):
    d = dispatch.explain_dispatch(call.q_shape, call.kv_shape, call.dtype, mask=CausalMask(), device=H200)
    assert d.implementation == "triton" and d.get("autotuned") and d.backward == "auto"
    assert d.rule == "measured: triton fastest of 3 candidates (1 ms vs next 1.5 ms)"
    assert d.grad.implementation == "cudnn" and d.grad.get("autotuned")
    assert d.grad.rule == "measured: cudnn fastest of 2 candidates (4 ms vs next 6 ms)"
    assert str(d) == ("triton, autotuned=True, backward=auto (measured: triton fastest of 3 candidates (1 ms vs "
                      "next 1.5 ms)); under grad cudnn, autotuned=True (measured: cudnn fastest of 2 "
                      "candidates (4 ms vs next 6 ms))")
    # Another shape is a miss that this CPU process cannot measure for the GPU: the rules decide.
    other = dispatch.explain_dispatch((4, 1024, 8, 128), (4, 1024, 8, 128), jnp.bfloat16, mask=CausalMask(),
                                      device=H200)
    assert "measured" not in other.rule and other.get("autotuned") is None
  assert not fake_measure


def test_same_kernel_under_grad_keeps_one_decision(tmp_path):
  call = AttentionCall((4, 2048, 8, 64), (4, 2048, 8, 64), jnp.bfloat16)
  cache = core.get_cache(tmp_path / "c.json")
  cache.put(at.key(call, H200, False), core.entry_of({"triton": 1.0, "cudnn": 2.0}))
  cache.put(at.key(call, H200, True), core.entry_of({"triton:triton_split": 3.0, "triton:triton_fused": 4.0}))
  with probjax.autotune(cache_path=tmp_path / "c.json"):
    d = dispatch.explain_dispatch(call.q_shape, call.kv_shape, call.dtype, device=H200)
  assert d.implementation == "triton" and d.backward == "triton_split" and d.grad is None
  assert "; under grad measured: triton:triton_split fastest of 2" in d.rule


def test_a_real_measurement_inside_jit_never_touches_the_callers_arrays(tmp_path):
  q = jax.random.normal(jax.random.key(1), (1, 40, 2, 8))
  lengths = jnp.array([25])
  f = jax.jit(lambda q, n: probjax.dot_product_attention(q, q, q, mask=CausalMask() & KVLenMask(n)))
  with probjax.autotune(cache_path=tmp_path / "c.json"):
    out = f(q, lengths)  # traced: the lengths are a tracer when dispatch measures
  ref = probjax.dot_product_attention(q, q, q, mask=CausalMask() & KVLenMask(lengths), implementation="xla")
  assert jnp.allclose(out, ref, atol=1e-5)
  (k, entry), = json.loads((tmp_path / "c.json").read_text())["entries"].items()
  assert k == "attention|cpu|1x40x2x8,1x40x2x8,1x40x2x8|float32|causal&kv_lengths|forward"
  assert set(entry["ms"]) == {"xla:dense", "xla:flash"} and all(t > 0 for t in entry["ms"].values())
  assert entry["choice"] in entry["ms"] and not entry["errors"]


def test_a_measurement_inside_a_trace_runs_pallas_candidates_as_programs(monkeypatch):
  """A kernel body's operand-less primitives (``program_id``) have no eager rule: measured
  under the caller's trace (or ``ensure_compile_time_eval``) every Pallas candidate failed."""
  from jax.experimental import pallas as pl

  def kernel(q_ref, o_ref):
    o_ref[...] = q_ref[...] * (pl.program_id(0) + 1).astype(q_ref.dtype)

  def runner(name, call, mask):
    return lambda q, k, v: pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
                                          grid=(1,), interpret=True)(q)

  monkeypatch.setattr(at, "_runner", runner)
  call = AttentionCall(Q, KV, jnp.float32)
  seen = []

  def step(x):
    seen.append(at.measure(call, ["pallas_a", "pallas_b"], differentiated=False))
    return x

  jax.jit(step)(jnp.ones(2))
  (ms, errors), = seen
  assert not errors and all(t is not None and t > 0 for t in ms.values())


def test_a_candidate_that_fails_to_compile_has_its_error_and_the_others_their_times(monkeypatch):
  """The candidates are compiled side by side before they are timed: one whose compilation
  fails is recorded with its error (never raised) and takes no time; the others are timed."""
  def runner(name, call, mask):
    if name == "broken":
      def fails(q, k, v):
        raise NotImplementedError("this candidate cannot lower")
      return fails
    return lambda q, k, v: q * 2.0

  monkeypatch.setattr(at, "_runner", runner)
  ms, errors = at.measure(AttentionCall(Q, KV, jnp.float32), ["fine", "broken", "also_fine"], differentiated=True)
  assert list(ms) == ["fine", "broken", "also_fine"]
  assert ms["broken"] is None and "cannot lower" in errors["broken"]
  assert ms["fine"] > 0 and ms["also_fine"] > 0 and set(errors) == {"broken"}


def test_recording_a_traced_step_gives_the_pretune_shapes(tmp_path, fake_measure):
  def step(q):
    return jax.grad(lambda q: probjax.dot_product_attention(q, q, q, mask=CausalMask()).sum())(q)

  with at.recording() as shapes:
    jax.jit(step).lower(jnp.zeros((1, 48, 2, 8), jnp.bfloat16))
  assert shapes == [{"op": "attention", "q_shape": [1, 48, 2, 8], "kv_shape": [1, 48, 2, 8],
                     "dtype": "bfloat16", "mask": "causal", "differentiated": True}]
  assert not (tmp_path / "default.json").exists()  # recording alone does not autotune
  done = at.pretune(shapes, str(tmp_path / "ship.json"), log=lambda _: None)
  # On CPU the forward decides (XLA's forward runs under grad too), but a shipped cache holds both.
  assert sorted(k.rsplit("|", 1)[1] for k in done) == ["forward", "grad"]
  assert len(fake_measure) == 2


def test_the_pretune_commands_cache_is_read_by_a_later_process(tmp_path, monkeypatch):
  shapes = tmp_path / "shapes.json"
  shapes.write_text(json.dumps([{"q_shape": [1, 32, 2, 8], "kv_shape": [1, 32, 2, 8], "dtype": "float32",
                                 "mask": "causal", "differentiated": False}]))
  out = tmp_path / "ship.json"
  run = subprocess.run([sys.executable, "-m", "probjax.ops.attention.autotune", "--shapes", str(shapes),
                        "--out", str(out)], capture_output=True, text=True, timeout=120)
  assert run.returncode == 0, run.stderr
  assert "attention|cpu|1x32x2x8,1x32x2x8,1x32x2x8|float32|causal|forward: xla:" in run.stdout
  monkeypatch.setattr(at, "measure", lambda *a: pytest.fail("a shipped key is not measured again"))
  with probjax.autotune(cache_path=out):
    d = probjax.explain_dispatch((1, 32, 2, 8), (1, 32, 2, 8), jnp.float32, mask=CausalMask())
  entry, = json.loads(out.read_text())["entries"].values()
  assert d.rule.startswith(f"measured: {entry['choice']} fastest of 2 candidates ({entry['ms'][entry['choice']]:.4g} ms")


@pytest.mark.gpu
@pytest.mark.parametrize("differentiated", [False, True])
def test_gpu_measurement_inside_jit_times_every_candidate(tmp_path, differentiated):
  """On the GPU, measured while the caller's step is traced: every candidate (the Triton and
  Mosaic kernels included) gets a time, none an error, and the call runs the fastest."""
  shape = (2, 1024, 8, 64)
  q = jax.random.normal(jax.random.key(2), shape, jnp.bfloat16)
  f = lambda q: probjax.dot_product_attention(q, q, q, mask=CausalMask()).astype(jnp.float32).sum()
  step = jax.jit(jax.grad(f) if differentiated else f)
  with probjax.autotune(cache_path=tmp_path / "c.json"):
    jax.block_until_ready(step(q))
  entries = json.loads((tmp_path / "c.json").read_text())["entries"]
  names = at.candidates(AttentionCall(shape, shape, jnp.bfloat16, mask=CausalMask()), Device.current(), False)
  assert any(n.startswith(("triton", "mosaic")) for n in names), names
  forward = next(e for k, e in entries.items() if k.endswith("|forward"))
  assert not forward["errors"] and set(forward["ms"]) == set(names)
  assert all(t is not None and t > 0 for e in entries.values() for t in e["ms"].values())
