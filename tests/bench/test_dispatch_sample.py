"""bench/dispatch_sample.py (issue 41, measured dispatch) on CPU: the sampler's determinism and
bounds, the runner with a fake measurer (rows, resume, budget, the batches' parallel compile) on
a faked H200's dispatch, the real JAX measurer on tiny CPU calls, and the report's arithmetic on
synthetic rows. The repository root is on sys.path (``python -m pytest``)."""

from __future__ import annotations

import dataclasses
import json
import random
import threading
import time

import pytest

from bench import dispatch_sample as ds


def h200():
  from probjax.core.device import Device
  return Device("gpu", (9, 0), 140 << 30)


# ---------------------------------------------------------------------------
# sampler
# ---------------------------------------------------------------------------
def test_sampler_is_deterministic_per_seed_and_extends_by_index():
  a, b = ds.sample(11, 30), ds.sample(11, 30)
  assert a == b
  assert ds.sample(11, 12) == a[:12]  # call i does not depend on n
  assert ds.draw_call(11, 17) == a[17]
  other = ds.sample(12, 30)
  assert [c.as_dict() | {"seed": 0} for c in other] != [c.as_dict() | {"seed": 0} for c in a]
  shards = ds.sample(11, 30, (0, 3)) + ds.sample(11, 30, (1, 3)) + ds.sample(11, 30, (2, 3))
  assert sorted(shards, key=lambda c: c.index) == a
  assert len({c.call_id for c in a}) == 30


def test_sampler_respects_the_distribution_and_the_budget():
  calls = ds.sample(ds.FIT_SEED, 300)
  seen = {f: set() for f in ("kind", "mask", "head_dim", "dtype", "mode")}
  for c in calls:
    for f in seen:
      seen[f].add(getattr(c, f))
    assert ds.BATCH_RANGE[0] <= c.batch <= ds.BATCH_RANGE[1]
    assert c.q_heads in ds.Q_HEADS and c.q_heads // c.kv_heads in ds.GQA_RATIOS
    assert c.q_heads % c.kv_heads == 0
    assert c.head_dim in ds.HEAD_DIMS and c.dtype in ds.DTYPES and c.mask in ds.MASKS
    assert ds.LEN_RANGE[0] <= c.kv_len <= ds.LEN_RANGE[1]
    if c.kind == "decode":
      assert ds.DECODE_Q_RANGE[0] <= c.q_len <= ds.DECODE_Q_RANGE[1] and c.mode == "fwd"
    else:
      assert ds.LEN_RANGE[0] <= c.q_len <= ds.LEN_RANGE[1]
    if c.kind == "self":
      assert c.q_len == c.kv_len
    if c.kind == "cross" and c.mask in ("causal", "window", "causal&kv_lengths"):
      assert c.q_len <= c.kv_len  # the queries: a chunk at the end of the keys
    assert (c.window is not None) == (c.mask == "window")
    if c.window is not None:
      assert ds.WINDOW_RANGE[0] <= c.window <= ds.WINDOW_RANGE[1]
    assert (c.kv_lengths is not None) == ("kv_lengths" in c.mask)
    if c.kv_lengths is not None:
      assert len(c.kv_lengths) == c.batch and c.kv_lengths[0] == c.kv_len
      assert all(c.kv_len // 4 <= n <= c.kv_len for n in c.kv_lengths)
    assert ds.EST_MS_RANGE[0] <= c.est_ms <= ds.EST_MS_RANGE[1]
    assert c.est_ms == pytest.approx(ds.estimate_ms(c), abs=1e-6)
    assert ds.array_bytes(c) <= ds.MAX_BYTES and c.draws >= 1
  assert seen["kind"] == {"self", "cross", "decode"} and seen["mask"] == set(ds.MASKS)
  assert seen["head_dim"] == set(ds.HEAD_DIMS) and seen["dtype"] == set(ds.DTYPES)
  assert seen["mode"] == set(ds.MODES)
  assert any(c.q_len % 2 for c in calls)  # odd lengths are drawn
  lens = [c.kv_len for c in calls]
  assert min(lens) < 512 and max(lens) > 8192


def test_visible_keys_and_estimate():
  assert ds.visible_keys(4, 4, "none") == 4
  assert ds.visible_keys(4, 4, "causal") == pytest.approx((1 + 2 + 3 + 4) / 4)
  assert ds.visible_keys(2, 6, "causal") == pytest.approx((5 + 6) / 2)  # bottom-right
  assert ds.visible_keys(4, 4, "window", window=1) == pytest.approx((1 + 2 + 2 + 2) / 4)
  assert ds.visible_keys(3, 8, "kv_lengths", kv_lengths=(8, 4)) == 6
  assert ds.visible_keys(1, 8, "causal&kv_lengths", kv_lengths=(8, 4)) == 6
  c = ds.SampledCall(0, 0, "self", 2, 8, 8, 1024, 1024, 128, "none", "bfloat16", "fwd")
  flops = 4 * 2 * 8 * 1024 * 1024 * 128
  assert ds.estimate_ms(c) == pytest.approx(1e3 * flops / ds.H200_FLOPS)
  assert ds.estimate_ms(dataclasses.replace(c, mode="fwd_bwd")) == pytest.approx(3.5e3 * flops / ds.H200_FLOPS)
  d = ds.SampledCall(0, 0, "decode", 8, 8, 8, 1, 32768, 128, "none", "bfloat16", "fwd")
  assert ds.estimate_ms(d) == pytest.approx(1e3 * 2 * 128 * 8 * (2 * 8 + 2 * 32768 * 8) / ds.H200_BYTES)


# ---------------------------------------------------------------------------
# runner (fake timing on a faked H200's dispatch)
# ---------------------------------------------------------------------------
FAKE_MS = {None: 1.1, "xla": 3.0, "triton": 1.0, "cudnn": 0.5, "mosaic": 0.8, "autotuned": 0.52}


class FakeMeasure:
  """``measure`` for run_sample: no JAX; each timed round advances a fake clock by one second.
  ``fail``: {(call id, impl): exception} raised by that case's compile; ``jitter``: each compile
  sleeps up to this many seconds (at random), so that the compiles of a batch end in any order."""

  def __init__(self, fail=None, jitter=0.0, seed=0):
    self.now = 0.0
    self.built = []
    self.compiled = []
    self.fail = fail or {}
    self.jitter = jitter
    self.rng = random.Random(seed)
    self.lock = threading.Lock()

  def clock(self):
    return self.now

  def compile(self, spec, c, impl):
    with self.lock:
      self.compiled.append((c.call_id, impl))
      pause = self.rng.uniform(0, self.jitter)
    time.sleep(pause)
    if (c.call_id, impl) in self.fail:
      raise self.fail[(c.call_id, impl)]
    return (c.call_id, impl), 0.0

  def inputs(self, spec, c):
    return None

  def prepare(self, compiled, arrays):
    (call_id, impl), _ = compiled
    self.built.append((call_id, impl))

    def timer():
      self.now += 1.0
      return {"ms": FAKE_MS[impl], "n_repeats": 3}
    return timer, (lambda res: dict(res, compile_s=0.0))


@pytest.fixture(scope="module")
def calls():
  return ds.sample(5, 4)


def test_runner_writes_rows_and_resumes(tmp_path, calls):
  from bench import harness
  out = str(tmp_path / "rows.json")
  fake = FakeMeasure()
  st = ds.run_sample(calls, out, measure=fake, device=h200(), rounds=2, clock=fake.clock, log=lambda s: None)
  rows = ds.load_rows(out)
  assert st["calls_done"] == 4 and not st["stopped"] and st["rows_written"] == len(rows) == 4 * 5
  assert {r["call_id"] for r in rows} == {c.call_id for c in calls}
  for r in rows:
    assert not harness.validate_row(r), harness.validate_row(r)
    assert r["suite"] == ds.SUITE and r["variant"] == r["call_id"] and r["sampler"] == ds.SAMPLER_VERSION
    assert r["default_decision"] and r["default_impl"] in ds.EXACT_IMPLS and r["device"] and r["command"]
    assert "jax" in r["versions"] and r["jax_version"] == r["versions"]["jax"]
    impl = None if r["impl"] == ds.DEFAULT else r["impl"].removeprefix("probjax_")
    if r["status"] == "ok":
      assert r["ms"] == FAKE_MS[impl] and r["round_ms"] == [FAKE_MS[impl]] * 2 and r["decision"]
    else:
      assert r["status"] == "unsupported" and "cannot compute this call exactly" in r["error"]
  timed = [(r["call_id"], None if r["impl"] == ds.DEFAULT else r["impl"][8:]) for r in rows if r["status"] == "ok"]
  assert sorted(fake.built, key=str) == sorted(timed, key=str)
  # every call's default and its XLA path ran; unsupported rows were never built
  assert {(c.call_id, None) for c in calls} | {(c.call_id, "xla") for c in calls} <= set(fake.built)

  # resume: nothing again
  again = FakeMeasure()
  st = ds.run_sample(calls, out, measure=again, device=h200(), rounds=2, clock=again.clock, log=lambda s: None)
  assert again.built == [] and st["calls_skipped"] == 4 and st["rows_written"] == 0
  # resume after losing rows (and a line cut by a killed run): only those are measured
  keep = [r for r in rows if not (r["call_id"] == calls[1].call_id and r["impl"] == "probjax_xla")]
  with open(out, "w") as f:
    f.writelines(json.dumps(r) + "\n" for r in keep)
    f.write('{"suite": "dispatch_sa')
  third = FakeMeasure()
  st = ds.run_sample(calls, out, measure=third, device=h200(), rounds=2, clock=third.clock, log=lambda s: None)
  assert third.built == [(calls[1].call_id, "xla")] and st["rows_written"] == 1
  assert len(ds.load_rows(out)) == 20

  # a stored row whose shape the sampler no longer draws is refused
  with pytest.raises(SystemExit, match="sampler changed"):
    ds.run_sample([dataclasses.replace(calls[0], batch=calls[0].batch + 1)], out, measure=FakeMeasure(),
                  device=h200(), log=lambda s: None)


def test_runner_honours_the_budget(tmp_path, calls):
  out = str(tmp_path / "rows.json")
  fake = FakeMeasure()
  budget = 45.0
  st = ds.run_sample(calls, out, measure=fake, device=h200(), rounds=3, budget_s=budget, clock=fake.clock,
                     log=lambda s: None)
  assert st["stopped"] and 0 < st["calls_done"] < len(calls)
  assert fake.now <= budget
  rows = ds.load_rows(out)
  by_call = {}
  for r in rows:
    by_call.setdefault(r["call_id"], []).append(r)
  assert len(by_call) == st["calls_done"] and all(len(v) == 5 for v in by_call.values())  # whole calls only
  rest = FakeMeasure()
  st = ds.run_sample(calls, out, measure=rest, device=h200(), rounds=3, clock=rest.clock, log=lambda s: None)
  assert st["calls_skipped"] == len(by_call) and not st["stopped"]
  assert not {cid for cid, _ in rest.built} & set(by_call)
  assert len(ds.load_rows(out)) == 5 * len(calls)


VOLATILE = ("time", "loadavg_1m", "command")


def _stable(rows):
  return [{k: v for k, v in r.items() if k not in VOLATILE} for r in rows]


def test_parallel_compile_gives_the_serial_rows_in_order(tmp_path):
  """The rows of a run whose compiles end in random order on 4 threads are the rows (fields,
  values, order) of one compiling serially."""
  calls = ds.sample(7, 6)
  outs = {}
  for workers, batch, seed in ((1, 1, 0), (4, 3, 1), (4, 6, 2)):
    out = str(tmp_path / f"rows{workers}_{batch}.json")
    fake = FakeMeasure(jitter=0.02, seed=seed)
    st = ds.run_sample(calls, out, measure=fake, device=h200(), rounds=2, clock=fake.clock, log=lambda s: None,
                       workers=workers, batch_calls=batch)
    assert st["calls_done"] == 6 and st["batches"] == -(-6 // batch)
    assert sorted(fake.compiled, key=str) == sorted(fake.built, key=str)  # each case compiled once, then timed
    outs[(workers, batch)] = _stable(ds.load_rows(out))
  serial = outs.pop((1, 1))
  assert [r["call_id"] for r in serial] == [c.call_id for c in calls for _ in range(5)]
  for rows in outs.values():
    assert rows == serial


def test_a_failed_compile_is_its_case_status(tmp_path):
  calls = ds.sample(5, 3)
  fail = {(calls[0].call_id, "xla"): RuntimeError("lowering crashed"),
          (calls[1].call_id, None): ValueError("cannot lower this")}
  fake = FakeMeasure(fail=fail)
  out = str(tmp_path / "rows.json")
  st = ds.run_sample(calls, out, measure=fake, device=h200(), rounds=2, clock=fake.clock, log=lambda s: None,
                     workers=2, batch_calls=3)
  assert st["calls_done"] == 3 and st["batches"] == 1
  rows = {(r["call_id"], r["impl"]): r for r in ds.load_rows(out)}
  bad = rows[(calls[0].call_id, "probjax_xla")]
  assert bad["status"] == "error" and "lowering crashed" in bad["error"] and bad["ms"] is None
  assert rows[(calls[1].call_id, ds.DEFAULT)]["status"] == "unsupported"
  ok = [r for k, r in rows.items() if k not in {(calls[0].call_id, "probjax_xla"), (calls[1].call_id, ds.DEFAULT)}
        and r["status"] != "unsupported"]
  assert ok and all(r["status"] == "ok" and r["ms"] == FAKE_MS[None if r["impl"] == ds.DEFAULT else r["impl"][8:]]
                    for r in ok)
  assert set(fake.built) == {(cid, impl) for cid, impl in fake.compiled} - set(fail)
  # a resumed run keeps the failed rows (a case's status is its result)
  again = FakeMeasure()
  assert ds.run_sample(calls, out, measure=again, device=h200(), log=lambda s: None)["calls_skipped"] == 3
  assert again.compiled == []


def test_the_budget_stops_between_batches(tmp_path):
  calls = ds.sample(5, 8)
  fake = FakeMeasure()
  out = str(tmp_path / "rows.json")
  # batch 1: calls 0 and 1 (4 cases each), expected at the prior (1.5 x (4 s / 2 workers + 1 s) a fwd case:
  # 18 s a call), fit in 45 s; they take 24 s (one second a round); batch 2 takes call 2 (expected at the
  # measured 3 s a case: 24 + 18 s) but not call 3 (fwd_bwd, at the prior of 8 s / 2 + 1 s a case): the run
  # stops after batch 2
  st = ds.run_sample(calls, out, measure=fake, device=h200(), rounds=3, budget_s=45.0, clock=fake.clock,
                     log=lambda s: None, workers=2, batch_calls=2)
  assert st["stopped"] and st["batches"] == 2 and st["calls_done"] == 3 and fake.now <= 45.0
  done = {r["call_id"] for r in ds.load_rows(out)}
  assert len(done) == st["calls_done"]
  assert {cid for cid, _ in fake.compiled} == done  # nothing compiled for a batch not started
  assert done == {c.call_id for c in calls[:len(done)]}  # no later (cheaper) call was taken
  # the same command without the budget measures the rest
  rest = FakeMeasure()
  st2 = ds.run_sample(calls, out, measure=rest, device=h200(), rounds=3, clock=rest.clock, log=lambda s: None,
                      workers=2, batch_calls=2)
  assert st2["calls_skipped"] == len(done) and st2["calls_done"] == len(calls) - len(done)


def test_runner_times_the_real_calls_on_cpu(tmp_path):
  """The JAX measurer end to end on two tiny calls compiled on two threads (one differentiated):
  on CPU the default and XLA run, the kernels are refused."""
  c = ds.SampledCall(9, 0, "self", 1, 2, 1, 40, 40, 32, "causal&kv_lengths", "bfloat16", "fwd",
                     kv_lengths=(40,))
  g = ds.SampledCall(9, 1, "cross", 2, 2, 2, 24, 56, 16, "window", "float16", "fwd_bwd", window=8)
  out = str(tmp_path / "rows.json")
  st = ds.run_sample([c, g], out, rounds=2, log=lambda s: None, workers=2,
                     timing_kw=dict(warmup=0, repeats=1, min_repeat_s=0.0, max_calls=1))
  assert st["rows_written"] == 10 and st["batches"] == 1 and st["compile_sum_s"] > 0
  for call in (c, g):
    rows = {r["impl"]: r for r in ds.load_rows(out) if r["call_id"] == call.call_id}
    assert set(rows) == {ds.ROW_IMPL[i] for i in (None, *ds.EXACT_IMPLS)}
    for name in (ds.DEFAULT, "probjax_xla"):
      r = rows[name]
      assert r["status"] == "ok" and r["ms"] > 0 and len(r["round_ms"]) == 2 and r["compile_s"] > 0
      assert r["probe_ms"] > 0 and r["mode"] == call.mode
    assert rows[ds.DEFAULT]["default_impl"] == "xla" and rows["probjax_xla"]["decision"].startswith("xla")
    assert {rows[n]["status"] for n in ("probjax_triton", "probjax_cudnn", "probjax_mosaic")} == {"unsupported"}


def test_command_line_run_report_and_seed(tmp_path, capsys):
  out, prefix = str(tmp_path / "fit.json"), str(tmp_path / "rep")
  fake = FakeMeasure()
  assert ds.main(["sample", "--seed", "5", "--n", "3"]) == 0
  lines = capsys.readouterr().out.strip().splitlines()
  assert [json.loads(x)["call_id"] for x in lines] == ["s5#0", "s5#1", "s5#2"]
  assert ds.main(["run", "--seed", "5", "--n", "3", "--out", out, "--rounds", "1"], measure=fake,
                 clock=fake.clock, device=h200()) == 0
  assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["calls_done"] == 3
  seed_file = str(tmp_path / "seed.json")
  assert ds.main(["draw-seed", "--fit", out, "--out", seed_file]) == 0
  rec = json.load(open(seed_file))
  assert rec["seed"] != ds.FIT_SEED and rec["after"][0]["rows"] == 15 and len(rec["after"][0]["sha256"]) == 64
  val = str(tmp_path / "val.json")
  fake2 = FakeMeasure()
  assert ds.main(["run", "--seed-file", seed_file, "--n", "2", "--out", val, "--rounds", "1"], measure=fake2,
                 clock=fake2.clock, device=h200()) == 0
  assert {r["seed"] for r in ds.load_rows(val)} == {rec["seed"]}
  capsys.readouterr()
  assert ds.main(["report", "--fit", out, "--validate", val, "--out", prefix]) == 0
  report = json.load(open(prefix + ".json"))
  assert set(report["samples"]) == {"fit", "validate"} and "warning" not in report
  assert report["samples"]["fit"]["summary"]["calls"] == 3
  md = open(prefix + ".md").read()
  assert "| fit |" in md and "| validate |" in md and "by head_dim, mask, mode, decode" in md


# ---------------------------------------------------------------------------
# report arithmetic on synthetic rows
# ---------------------------------------------------------------------------
def _rows(call_id, ms_by_impl, *, head_dim=128, mask="none", mode="fwd", kind="self", default_impl="triton",
          seed=1, index=0, default_grad_impl=None):
  base = dict(suite=ds.SUITE, call_id=call_id, seed=seed, index=index, kind=kind, dtype="bfloat16", batch=2,
              q_heads=8, kv_heads=8, q_len=1024, kv_len=1024, head_dim=head_dim, mask=mask, window=None,
              mode=mode, default_impl=default_impl, default_decision=f"{default_impl} (rule)",
              default_grad_impl=default_grad_impl)
  out = []
  for impl, ms in ms_by_impl.items():
    status = ms if isinstance(ms, str) else "ok"
    out.append(dict(base, impl=ds.DEFAULT if impl == "default" else f"probjax_{impl}", status=status,
                    ms=None if isinstance(ms, str) else ms))
  return out


def test_report_arithmetic():
  rows = (_rows("a", {"default": 1.2, "xla": 1.0, "triton": 2.0}, index=0)
          + _rows("b", {"default": 1.0, "cudnn": 1.0, "mosaic": "unsupported"}, index=1, mask="causal")
          + _rows("c", {"default": 1.04, "triton": 1.0}, index=2, head_dim=96, kind="decode")
          + _rows("d", {"default": "error", "triton": 1.0}, index=3)
          + _rows("e", {"default": 5.0, "xla": "oom"}, index=4))
  calls = {c["call_id"]: c for c in ds.calls_of(rows)}
  assert calls["a"]["ratio"] == pytest.approx(1.2) and calls["a"]["best_impl"] == "xla"
  assert calls["b"]["ratio"] == 1.0 and calls["b"]["status"]["mosaic"] == "unsupported"
  assert calls["d"]["ratio"] is None and calls["e"]["best_ms"] is None
  assert calls["c"]["group"] == "D80/96 none fwd decode" and calls["a"]["group"] == "D128 none fwd prefill"
  s = ds.summarize_calls(list(calls.values()))
  assert s["calls"] == 5 and s["compared"] == 3 and s["misses"] == 1
  assert s["geomean"] == pytest.approx((1.2 * 1.0 * 1.04) ** (1 / 3))
  assert s["worst"]["call_id"] == "a" and s["worst"]["ratio"] == pytest.approx(1.2)
  assert s["default_failed"] == ["d"]
  assert s["default_ms_sum"] == pytest.approx(3.24) and s["best_ms_sum"] == pytest.approx(3.0)
  assert s["best_impl_counts"] == {"cudnn": 1, "triton": 1, "xla": 1}
  assert s["p50"] == pytest.approx(1.04) and s["p90"] == pytest.approx(1.04 + 0.8 * 0.16)
  # the default (its pick: triton) against triton requested: a 2.0/1.2, c 1.04/1.0
  assert calls["a"]["pick_ratio"] == pytest.approx(0.6) and calls["c"]["pick_ratio"] == pytest.approx(1.04)
  assert s["pick_spread_p90"] == pytest.approx(1.04 + 0.9 * (1 / 0.6 - 1.04))
  # the decision alone (triton requested against the best): a 2.0/1.0, c and d 1.0/1.0 (d: the
  # default failed, its pick ran); b's pick did not run
  assert calls["a"]["decision_ratio"] == pytest.approx(2.0) and calls["b"]["decision_ratio"] is None
  assert s["decision_geomean"] == pytest.approx(2 ** (1 / 3)) and s["decision_worst"] == pytest.approx(2.0)
  assert s["decision_misses"] == 1
  groups = ds.group_calls(list(calls.values()))
  assert list(groups)[0] == "D128 none fwd prefill"  # the worst geometric mean first
  assert groups["D128 none fwd prefill"]["compared"] == 1 and groups["D128 causal fwd prefill"]["misses"] == 0
  ev = ds.evaluate(list(calls.values()), lambda c: "triton")
  assert ev["compared"] == 3 and ev["not_run"] == ["b"] and ev["worst"] == pytest.approx(2.0)
  assert ev["geomean"] == pytest.approx(2.0 ** (1 / 3))
  # a later row of a call and implementation replaces the earlier one
  again = ds.calls_of(rows + _rows("a", {"default": 0.9}, index=0))
  assert next(c for c in again if c["call_id"] == "a")["ratio"] == pytest.approx(0.9)
  # under grad the default's pick is what the differentiated call runs
  g = ds.calls_of(_rows("g", {"default": 2.0, "cudnn": 1.0}, mode="fwd_bwd", default_impl="mosaic",
                        default_grad_impl="cudnn"))
  assert g[0]["default_pick"] == "cudnn" and g[0]["group"] == "D128 none fwd_bwd prefill"
  assert ds.summarize_calls(g)["default_impl_counts"] == {"cudnn": 1}
  rep = ds.build_report(rows, _rows("z", {"default": 2.0, "xla": 1.0}, seed=1))
  assert "share seeds [1]" in rep["warning"]
  md = ds.markdown(rep)
  assert "| fit | 1 | 5 | 3 | 1 (0) | 1.077 | 1.168 | 1.20 |" in md and "**Warning" in md
  # a miss counts as apart only where every round of the default is slower than every round of
  # the best; rows without rounds say nothing
  def with_rounds(call_id, rounds):
    out = _rows(call_id, {k: sorted(v)[1] for k, v in rounds.items()}, index=9)
    for r in out:
      r["round_ms"] = rounds[r["impl"].removeprefix("probjax_") if r["impl"] != ds.DEFAULT else "default"]
    return out
  apart = ds.calls_of(with_rounds("p", {"default": [1.3, 1.4, 1.5], "xla": [1.0, 1.1, 1.2]}))[0]
  overlap = ds.calls_of(with_rounds("q", {"default": [1.0, 1.4, 1.5], "xla": [1.0, 1.1, 1.2]}))[0]
  assert apart["apart"] is True and overlap["apart"] is False and calls["a"]["apart"] is None
  assert ds.summarize_calls([apart, overlap, calls["a"]])["misses_apart"] == 1


def test_the_autotuned_path_is_timed_and_reported_apart(tmp_path, calls):
  """``run --autotune-cache``: each call also gets a ``probjax_autotuned`` row (the default
  autotuned), which is never the best exact path; the report gives its ratio to the best."""
  out = str(tmp_path / "rows.json")
  fake = FakeMeasure()
  ds.run_sample(calls, out, measure=fake, device=h200(), rounds=2, clock=fake.clock, log=lambda s: None,
                autotune_cache=str(tmp_path / "cache.json"))
  rows = ds.load_rows(out)
  assert {r["call_id"] for r in rows if r["impl"] == "probjax_autotuned" and r["status"] == "ok"} == \
      {c.call_id for c in calls}
  assert all(r["decision"].startswith("autotuned: the choice cached in ") for r in rows
             if r["impl"] == "probjax_autotuned")
  report = ds.build_report(rows)
  summary = report["samples"]["fit"]["summary"]
  assert summary["autotuned_compared"] == 4 and summary["best_impl_counts"].get("autotuned") is None
  best = [c["best_ms"] for c in report["samples"]["fit"]["calls"]]
  assert summary["autotuned_worst"] == pytest.approx(max(0.52 / b for b in best))
  assert "probjax.autotune()" in ds.markdown(report)
  assert "autotuned_geomean" not in ds.build_report([r for r in rows if r["impl"] != "probjax_autotuned"]
                                                    )["samples"]["fit"]["summary"]


def test_the_autotuned_function_measures_once_and_caches(tmp_path, calls):
  """The autotuned path's function traces the default under ``probjax.autotune``: the first
  trace writes the call's entry to the cache, with the choice among the exact candidates."""
  import jax
  import jax.numpy as jnp
  c = dataclasses.replace(calls[0], batch=1, q_heads=2, kv_heads=1, q_len=24, kv_len=24, head_dim=16, mask="causal",
                          window=None, kv_lengths=None, dtype="bfloat16", mode="fwd", kind="self")
  cache = tmp_path / "cache.json"
  spec = ds.AttentionSpec(str(cache))
  assert spec.plan(c, None)["autotuned"] == spec.plan(c, None)[None]
  fn, _ = spec.function(c, "autotuned")
  q, k, v = ds.make_inputs(c)
  got = jax.jit(fn)(q, k, v)
  want = jax.jit(spec.function(c, None)[0])(q, k, v)
  assert jnp.allclose(got.astype(jnp.float32), want.astype(jnp.float32), atol=2e-2)
  entries = json.loads(cache.read_text())["entries"]
  assert len(entries) == 1 and next(iter(entries.values()))["choice"]
