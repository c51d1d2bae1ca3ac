"""bench/dispatch_ops.py (issue 41: measured dispatch for MLA, the grouped matmul and the scans)
on CPU: each op's sampler (determinism, bounds, the budget), its plan on a faked H200, the
runner with a fake measurer (rows, resume, the budget), the command line, and the real JAX
measurer on tiny calls of every op."""

from __future__ import annotations

import dataclasses
import json

import pytest

from bench import dispatch_core as core
from bench import dispatch_ops as do


def h200():
  from probjax.core.device import Device
  return Device("gpu", (9, 0), 140 << 30)


@pytest.mark.parametrize("op", do.OPS)
def test_each_sampler_is_seeded_and_stays_in_the_budget(op):
  spec = do.SPECS[op]
  calls = spec.sample(do.FIT_SEEDS[op], 120)
  assert spec.sample(do.FIT_SEEDS[op], 40) == calls[:40]  # call i does not depend on n
  assert spec.draw_call(do.FIT_SEEDS[op], 77) == calls[77]
  assert spec.sample(do.FIT_SEEDS[op], 120, (1, 3)) == [c for c in calls if c.index % 3 == 1]
  assert [c.as_dict() for c in spec.sample(do.FIT_SEEDS[op] + 1, 5)] != [c.as_dict() for c in calls[:5]]
  for c in calls:
    assert c.op == op and set(spec.fields) <= set(c.as_dict())
    assert core.EST_MS_RANGE[0] <= c.est_ms <= core.EST_MS_RANGE[1]
    assert c.est_ms == pytest.approx(spec.estimate_ms(c), abs=1e-6) and spec.array_bytes(c) <= core.MAX_BYTES
  assert {c.mode for c in calls} == set(do.MODES) and len({c.dtype for c in calls}) >= 2


def test_the_distributions_cover_what_users_run():
  mla = do.SPECS["mla"].sample(do.FIT_SEEDS["mla"], 200)
  assert {c.kind for c in mla} == {"decode", "prefill", "chunk"} and {c.p["widths"] for c in mla} == {"deepseek", "minicpm3"}
  for c in mla:
    p = c.p
    if c.kind == "decode":
      assert c.mode == "fwd" and 1 <= p["q_len"] <= 4 and len(p["kv_lengths"]) == p["batch"]
      assert p["kv_lengths"][0] == p["kv_len"] and min(p["kv_lengths"]) >= p["kv_len"] // 4
    else:
      assert p["kv_lengths"] is None and p["q_len"] <= p["kv_len"]
      assert c.kind == "chunk" or p["q_len"] == p["kv_len"]
  gmm = do.SPECS["grouped_matmul"].sample(do.FIT_SEEDS["grouped_matmul"], 200)
  for c in gmm:
    p = c.p
    assert sum(p["group_sizes"]) == p["m"] == p["tokens"] * p["top_k"] and len(p["group_sizes"]) == p["experts"]
    assert (p["k"], p["n"]) == ((p["d_model"], p["d_ff"]) if p["projection"] == "up" else (p["d_ff"], p["d_model"]))
    assert p["empty_groups"] == sum(s == 0 for s in p["group_sizes"]) and p["max_group"] == max(p["group_sizes"])
  assert any(c.p["empty_groups"] for c in gmm) and any(not c.p["empty_groups"] for c in gmm)
  assert {c.p["projection"] for c in gmm} == {"up", "down"}
  ssd = do.SPECS["ssd_scan"].sample(do.FIT_SEEDS["ssd_scan"], 100)
  assert all(c.p["heads"] % c.p["groups"] == 0 for c in ssd)
  rla = do.SPECS["residual_linear_attention"].sample(do.FIT_SEEDS["residual_linear_attention"], 100)
  assert {c.p["feature_map"] for c in rla} == {"softmax", "relu"} and all(c.p["heads"] % c.p["kv_heads"] == 0 for c in rla)
  assert {c.dtype for c in rla} == set(do.SCAN_DTYPES)


def test_the_plans_on_an_h200():
  mla = do.SPECS["mla"]
  decode = next(c for c in mla.sample(do.FIT_SEEDS["mla"], 50) if c.kind == "decode" and c.p["widths"] == "deepseek")
  plan = mla.plan(decode, h200())
  assert list(plan) == [None, "expanded", "expanded:xla", "expanded:triton", "expanded:cudnn", "expanded:mosaic",
                        "absorbed", "absorbed:xla", "absorbed:triton", "absorbed:cudnn", "absorbed:mosaic"]
  assert plan["absorbed:triton"].implementation == "triton" and plan["expanded:triton"].implementation == "xla"
  assert mla.pick(plan[None], decode, grad=False) in plan
  gmm = do.SPECS["grouped_matmul"]
  c = gmm.sample(do.FIT_SEEDS["grouped_matmul"], 1)[0]
  plan = gmm.plan(c, h200())
  assert list(plan) == [None, "xla", "triton", "mosaic"] and gmm.pick(plan[None], c, grad=False) in plan
  for op in ("mamba_scan", "ssd_scan", "residual_linear_attention"):
    spec = do.SPECS[op]
    c = spec.sample(do.FIT_SEEDS[op], 1)[0]
    plan = spec.plan(c, h200())
    assert "triton" in plan and "chunked" in plan and "scan" in plan
    assert spec.pick(plan[None], c, grad=True) in plan


class FakeMeasure:
  """No JAX: each timed round advances a fake clock by one second; the default is 1.2 ms, every
  path its length in tenths of a ms (so the best is the shortest name)."""

  def __init__(self):
    self.now = 0.0
    self.compiled = []

  def clock(self):
    return self.now

  def compile(self, spec, c, path):
    self.compiled.append((c.call_id, path))
    return path, 0.0

  def inputs(self, spec, c):
    return None

  def prepare(self, compiled, arrays):
    path, _ = compiled

    def timer():
      self.now += 1.0
      return {"ms": 1.2 if path is None else len(path) / 10, "n_repeats": 3}
    return timer, (lambda res: dict(res, compile_s=0.0))


@pytest.mark.parametrize("op", do.OPS)
def test_the_runner_writes_rows_and_resumes(tmp_path, op):
  spec = do.SPECS[op]
  calls = spec.sample(do.FIT_SEEDS[op], 3)
  out = str(tmp_path / "rows.json")
  fake = FakeMeasure()
  st = core.run_calls(spec, calls, out, measure=fake, device=h200(), rounds=2, clock=fake.clock, log=lambda s: None,
                      workers=2)
  rows = do.load_rows(out, spec)
  assert st["calls_done"] == 3 and st["rows_written"] == len(rows)
  for r in rows:
    assert r["suite"] == f"dispatch_{op}" and r["op"] == op and r["sampler"] == do.SAMPLER_VERSION
    assert r["device"] and r["command"] and r["jax_version"] and "versions" in r and r["time"]
    assert r["default_decision"] and r["default_impl"] and (r["default_grad_impl"] is None) == (r["mode"] == "fwd")
    if r["status"] == "ok":
      assert r["ms"] == (1.2 if r["impl"] == "default" else len(r["impl"]) / 10) and len(r["round_ms"]) == 2
      assert r["decision"]
    elif r["status"] == "oom":  # Mamba-1's XLA forms past the memory guard, never compiled
      assert op == "mamba_scan" and "(estimated)" in r["error"] and r["ms"] is None
      assert (r["call_id"], r["impl"]) not in fake.compiled
    else:
      assert r["status"] == "unsupported" and r["ms"] is None and r["error"]
  again = FakeMeasure()
  st = core.run_calls(spec, calls, out, measure=again, device=h200(), log=lambda s: None)
  assert st["calls_skipped"] == 3 and again.compiled == []
  stored = rows[0]
  with pytest.raises(SystemExit, match="sampler changed"):
    spec.check(dataclasses.replace(calls[0], mode="fwd" if calls[0].mode == "fwd_bwd" else "fwd_bwd"), stored)
  recs = spec.calls_of(rows)
  assert len(recs) == 3 and all(r["group"] and r["best_ms"] for r in recs)


def test_command_line_run_budget_report_and_seed(tmp_path, capsys):
  fit, prefix = str(tmp_path / "fit.json"), str(tmp_path / "rep")
  fake = FakeMeasure()
  assert do.main(["sample", "--op", "ssd_scan", "--seed", "3", "--n", "2"]) == 0
  assert [json.loads(x)["call_id"] for x in capsys.readouterr().out.splitlines()] == ["s3#0", "s3#1"]
  # calls 0 and 1 are fwd_bwd, 5 cases each at the prior (1.5 x (8 s / 2 workers + 1 s)): 37.5 s a call, so
  # the budget of 40 s admits call 0 alone, and the run stops after its batch
  argv = ["run", "--op", "ssd_scan", "--seed", "3", "--n", "6", "--out", fit, "--rounds", "1", "--budget-s", "40",
          "--compile-workers", "2"]
  assert do.main(argv, measure=fake, clock=fake.clock, device=h200()) == 0
  st = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
  assert st["stopped"] and st["calls_done"] == 1 and st["batches"] == 1
  rest = FakeMeasure()
  assert do.main(argv[:-4] + ["--compile-workers", "2"], measure=rest, clock=rest.clock, device=h200()) == 0
  assert len({r["call_id"] for r in do.load_rows(fit, do.SPECS["ssd_scan"])}) == 6
  seed_file = str(tmp_path / "seed.json")
  assert do.main(["draw-seed", "--op", "ssd_scan", "--fit", fit, "--out", seed_file]) == 0
  rec = json.load(open(seed_file))
  assert rec["seed"] != do.FIT_SEEDS["ssd_scan"] and rec["after"][0]["rows"] == 30
  val = str(tmp_path / "val.json")
  fake2 = FakeMeasure()
  assert do.main(["run", "--op", "ssd_scan", "--seed-file", seed_file, "--n", "2", "--out", val, "--rounds", "1"],
                 measure=fake2, clock=fake2.clock, device=h200()) == 0
  capsys.readouterr()
  assert do.main(["report", "--op", "ssd_scan", "--fit", fit, "--validate", val, "--out", prefix]) == 0
  report = json.load(open(prefix + ".json"))
  assert report["op"] == "ssd_scan" and "warning" not in report
  fit_summary = report["samples"]["fit"]["summary"]
  # the fake's best path is the shortest name ("scan", 0.4 ms); the default 1.2 ms
  assert fit_summary["compared"] == 6 and fit_summary["geomean"] == pytest.approx(3.0)
  assert fit_summary["best_impl_counts"] == {"scan": 6} and report["samples"]["validate"]["seeds"] == [rec["seed"]]
  md = open(prefix + ".md").read()
  assert "| fit |" in md and "| validate |" in md and "Measured dispatch (ssd_scan)" in md


def _tiny(op, kind, dtype, mode, index, **shape):
  return do.OpCall(op, 9, index, kind, dtype, mode, tuple(shape.items()))


TINY_MLA = dict(widths="tiny", d_c=16, d_nope=8, d_rope=4, d_v=8)
TINY = {
    "mla": _tiny("mla", "prefill", "float16", "fwd_bwd", 0, batch=1, q_len=24, kv_len=24, heads=2, **TINY_MLA,
                 kv_lengths=None),
    "grouped_matmul": _tiny("grouped_matmul", "up", "bfloat16", "fwd_bwd", 1, tokens=12, experts=4, top_k=2, d_model=16,
                            d_ff=8, projection="up", m=24, k=16, n=8, alpha=0.1, empty_groups=2, max_group=14,
                            group_sizes=(10, 0, 14, 0)),
    "mamba_scan": _tiny("mamba_scan", "mamba_scan", "float32", "fwd_bwd", 2, batch=1, length=16, channels=8, state=4),
    "ssd_scan": _tiny("ssd_scan", "ssd_scan", "bfloat16", "fwd", 3, batch=1, length=16, heads=4, head_dim=8, groups=2,
                      state=4),
    "residual_linear_attention": _tiny("residual_linear_attention", "residual_linear_attention", "float16", "fwd_bwd", 4,
                                       batch=1, length=16, heads=2, kv_heads=1, head_dim=8, v_head_dim=8, window_size=3,
                                       feature_map="softmax"),
}


@pytest.mark.parametrize("op", do.OPS)
def test_the_real_measurer_on_a_tiny_call_of_each_op(tmp_path, op):
  """The JAX measurer end to end on CPU (two compile threads): the default and every path the op
  lists on CPU run, or are refused with the reason."""
  spec = do.SPECS[op]
  out = str(tmp_path / "rows.json")
  st = core.run_calls(spec, [TINY[op]], out, rounds=2, workers=2, log=lambda s: None,
                      measure=core.JaxMeasure(dict(warmup=0, repeats=1, min_repeat_s=0.0, max_calls=1)))
  rows = {r["impl"]: r for r in do.load_rows(out, spec)}
  assert st["calls_done"] == 1 and st["compile_sum_s"] > 0 and rows["default"]["status"] == "ok"
  assert set(rows) == {"default", *spec.paths(TINY[op], None)}
  ran = [r for r in rows.values() if r["status"] == "ok"]
  assert len(ran) >= 2 and all(r["ms"] > 0 and r["compile_s"] > 0 and len(r["round_ms"]) == 2 for r in ran)
  assert all(r["status"] == "unsupported" and r["error"] for r in rows.values() if r["status"] != "ok")
  assert rows["default"]["default_impl"] in rows


def test_mamba_paths_past_the_memory_guard_are_refused_without_compiling():
  """The associative form keeps about three float32 copies of [B, L, D, N]: at B64 L16384 D5120
  N16 that is over a terabyte, recorded as out of memory from the estimate; the kernels keep
  chunk-boundary states only and are planned as usual."""
  spec = do.SPECS["mamba_scan"]
  big = do.OpCall("mamba_scan", 1, 0, "mamba_scan", "bfloat16", "fwd_bwd",
                  (("batch", 64), ("length", 16384), ("channels", 5120), ("state", 16)))
  plan = spec.plan(big, h200())
  assert isinstance(plan["associative"], core.Refused) and plan["associative"][0] == "oom", plan
  assert "estimated" in plan["associative"][1]
  assert not isinstance(plan["triton"], core.Refused) and not isinstance(plan[None], core.Refused)
  small = do.OpCall("mamba_scan", 1, 0, "mamba_scan", "bfloat16", "fwd_bwd",
                    (("batch", 2), ("length", 512), ("channels", 256), ("state", 16)))
  assert not any(isinstance(d, core.Refused) for d in spec.plan(small, h200()).values())
