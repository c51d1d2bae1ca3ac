"""Benchmark harness (bench/), row schema, results layout, tuning evidence, page generator and
--quick suites (CPU). The repository root is on sys.path (``python -m pytest`` from it)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import subprocess
import sys

import pytest

from bench import benchmark_figures as bf
from bench import cpu_readme_numbers as crn
from bench import harness

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# ---------------------------------------------------------------------------
# harness
# ---------------------------------------------------------------------------
def test_flops_convention():
  f = harness.attention_flops(4, 8, 1024, 1024, 64, False, "fwd")
  assert f == 4 * 4 * 8 * 1024 * 1024 * 64
  assert harness.attention_flops(4, 8, 1024, 1024, 64, True, "fwd") == f / 2
  assert harness.attention_flops(4, 8, 1024, 1024, 64, False, "fwd_bwd") == 3.5 * f
  assert harness.attention_flops(4, 8, 1024, 1024, 64, True, "fwd_bwd") == 3.5 * f / 2
  assert harness.tflops(1e12, 1000.0) == pytest.approx(1.0)
  assert harness.tflops(1e12, None) is None
  with pytest.raises(ValueError):
    harness.attention_flops(1, 1, 1, 1, 1, False, "bwd")


def test_percentile_and_summary():
  from probjax.core.timing import percentile
  assert percentile([1, 2, 3, 4, 5], 50) == 3
  assert percentile([1, 2, 3, 4, 5], 0) == 1
  assert percentile([1, 2, 3, 4, 5], 100) == 5
  assert percentile([0, 10], 10) == pytest.approx(1.0)
  s = harness.summarize([5.0, 1.0, 3.0, 100.0, 2.0])
  assert s["ms"] == 3.0 and s["n_repeats"] == 5
  assert s["p10_ms"] <= s["ms"] <= s["p90_ms"]


class FakeClock:
  """Each fn() call advances time by `cost`; sync is free."""

  def __init__(self, cost):
    self.t, self.cost, self.calls = 0.0, cost, 0

  def clock(self):
    return self.t

  def fn(self):
    self.calls += 1
    self.t += self.cost
    return self.calls


def test_time_fn_loops_and_median():
  fc = FakeClock(0.002)  # 2 ms per call
  synced = []
  res = harness.time_fn(fc.fn, synced.append, warmup=2, repeats=5, min_repeat_s=0.01,
                        clock=fc.clock)
  assert res["ms"] == pytest.approx(2.0)
  assert res["calls_per_repeat"] == 5  # 10 ms / 2 ms
  assert res["n_repeats"] == 5
  # first call + 2 warm-up + 1 probe + 5 repeats (one sync each)
  assert len(synced) == 1 + 2 + 1 + 5
  assert fc.calls == 1 + 2 + 1 + 5 * 5


def test_time_fn_long_calls_get_more_repeats():
  fc = FakeClock(0.007)  # 7 ms per call: 2 calls per 10 ms repeat
  res = harness.time_fn(fc.fn, lambda x: None, warmup=0, repeats=5, min_repeat_s=0.01, min_total_s=0.2,
                        clock=fc.clock)
  assert res["calls_per_repeat"] == 2 and res["n_repeats"] == 15  # ceil(200 / 14)
  capped = harness.time_fn(fc.fn, lambda x: None, warmup=0, repeats=5, min_repeat_s=0.01, min_total_s=10.0,
                           max_repeats=20, clock=fc.clock)
  assert capped["n_repeats"] == 20
  fast = FakeClock(0.001)
  short = harness.time_fn(fast.fn, lambda x: None, warmup=0, repeats=5, min_repeat_s=0.05, min_total_s=0.2,
                          clock=fast.clock)
  assert short["n_repeats"] == 5  # already 5 x 50 ms


def test_time_fn_differenced_cancels_per_repeat_costs():
  fc = FakeClock(0.002)  # 2 ms per call, and each sync costs 3 ms (dispatch latency + wait)

  def sync(_x):
    fc.t += 0.003
  plain = harness.time_fn(fc.fn, sync, warmup=0, repeats=3, min_repeat_s=0.02, clock=fc.clock)
  n = plain["calls_per_repeat"]
  assert plain["ms"] == pytest.approx(2.0 + 3.0 / n) and "timing" not in plain
  diff = harness.time_fn(fc.fn, sync, warmup=0, repeats=3, min_repeat_s=0.02, clock=fc.clock, differenced=True)
  assert diff["ms"] == pytest.approx(2.0) and diff["timing"] == "differenced"


def test_time_fn_spread_reported():
  costs = iter([0.001] * 4 + [0.001, 0.002, 0.003, 0.004, 0.005])
  t = [0.0]

  def fn():
    t[0] += next(costs)
  res = harness.time_fn(fn, lambda x: None, warmup=2, repeats=5, min_repeat_s=0.0,
                        clock=lambda: t[0])
  assert res["ms"] == pytest.approx(3.0)
  assert res["p10_ms"] == pytest.approx(1.4)
  assert res["p90_ms"] == pytest.approx(4.6)


@pytest.mark.parametrize("exc,status", [
    (RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate"), "oom"),
    (RuntimeError("NOT_FOUND: autotuning failed: no valid config"), "fail"),
    (NotImplementedError("nope"), "unsupported"),
    (harness.Unsupported("no fp32"), "unsupported"),
    (RuntimeError("No available kernel. Aborting execution."), "unsupported"),
    (ValueError("implementation='cudnn' cannot compute this call"), "unsupported"),
    (ZeroDivisionError("boom"), "error"),
])
def test_classify_error(exc, status):
  st, msg = harness.classify_error(exc)
  assert st == status
  assert type(exc).__name__ in msg


def _row(**kw):
  r = {"suite": "grid", "impl": "probjax_default", "dtype": "bfloat16", "batch": 4, "q_heads": 8,
       "kv_heads": 8, "q_len": 1024, "kv_len": 1024, "head_dim": 64, "causal": False,
       "mask": "none", "mode": "fwd_bwd", "ms": 1.0, "status": "ok", "device": "NVIDIA H200",
       "platform": "gpu"}
  r.update(kw)
  return r


def test_validate_row():
  assert harness.validate_row(_row()) == []
  assert any("missing" in e for e in harness.validate_row({k: v for k, v in _row().items() if k != "impl"}))
  assert harness.validate_row(_row(status="weird"))
  assert harness.validate_row(_row(mode="bwd"))
  assert harness.validate_row(_row(causal=1))  # must be bool
  assert harness.validate_row(_row(batch=True))  # bool is not an int here
  assert harness.validate_row(_row(status="oom", ms=3.0))
  assert harness.validate_row(_row(status="oom", ms=None)) == []
  assert harness.validate_row(_row(ms=None))  # ok without any measurement
  assert harness.validate_row(_row(ms=None, peak_bytes=10)) == []


def _args(tmp_path, **kw):
  ns = argparse.Namespace(output=str(tmp_path / "out.json"), append=False, rerun_failed=False,
                          quick=True, max_minutes=None, impl="*", skip_impl="", repeats=3,
                          warmup=1, min_repeat_ms=0.0, no_progress=True)
  for k, v in kw.items():
    setattr(ns, k, v)
  return ns


def _case(impl, t=64, run=None, counter=None):
  def default_run():
    if counter is not None:
      counter.append(impl)
    return {"ms": 1.5, "p10_ms": 1.0, "p90_ms": 2.0, "n_repeats": 3}
  return harness.Case(suite="grid", impl=impl, dtype="float32", batch=1, q_heads=2, kv_heads=2,
                      q_len=t, kv_len=t, head_dim=16, causal=False, mode="fwd",
                      run=run or default_run)


def test_rounds_time_a_shapes_implementations_in_rotation(tmp_path):
  calls, built = [], []

  def prepared(impl, ms_by_round, fail_round=None):
    def prepare():
      built.append(impl)
      it = iter(range(len(ms_by_round)))

      def timer():
        r = next(it)
        calls.append(impl)
        if r == fail_round:
          raise RuntimeError("RESOURCE_EXHAUSTED: out of memory")
        return {"ms": ms_by_round[r], "p10_ms": ms_by_round[r], "p90_ms": ms_by_round[r], "n_repeats": 3}
      return timer, lambda res: dict(res, checked=True)
    c = _case(impl)
    return dataclasses.replace(c, prepare=prepare)
  cases = [prepared("a", [3.0, 1.0, 2.0]), prepared("b", [5.0, 5.0, 5.0], fail_round=1),
           _case("c"), prepared("d", [1.0, 1.0, 1.0]), dataclasses.replace(prepared("e", [7.0] * 3), q_len=128)]
  rows = harness.run_cases(cases, _args(tmp_path, rounds=3))
  by = {r["impl"]: r for r in rows}
  assert [r["impl"] for r in rows] == ["a", "b", "c", "d", "e"]  # the cases' order, not the rounds'
  assert built[:3] == ["a", "b", "d"] and by["c"]["ms"] == 1.5 and "round_ms" not in by["c"]  # c: no prepare
  assert by["a"]["round_ms"] == [3.0, 1.0, 2.0] and by["a"]["ms"] == 2.0 and by["a"]["checked"]
  assert by["b"]["status"] == "oom" and by["b"]["ms"] is None
  # round r starts at the r-th prepared case of the shape; b is not timed after it failed
  assert calls[:8] == ["a", "b", "d", "b", "d", "a", "d", "a"]
  assert by["e"]["rounds"] == 3 and by["e"]["ms"] == 7.0  # its own shape


def test_run_cases_statuses_never_abort(tmp_path):
  def oom():
    raise RuntimeError("RESOURCE_EXHAUSTED: out of memory")

  def boom():
    raise KeyError("x")
  cases = [_case("a"), _case("b", run=oom), _case("c", run=boom),
           harness.Case(suite="grid", impl="d", dtype="float32", batch=1, q_heads=2, kv_heads=2,
                        q_len=64, kv_len=64, head_dim=16, causal=False, mode="fwd", run=None,
                        extra={"note": "peer absent"}),
           _case("e")]
  rows = harness.run_cases(cases, _args(tmp_path))
  assert [r["status"] for r in rows] == ["ok", "oom", "error", "unsupported", "ok"]
  stored = harness.load_rows(str(tmp_path / "out.json"))
  assert len(stored) == 5
  for r in stored:
    assert harness.validate_row(r) == [], r
    assert r["versions"]["jax"] and r["command"] and r["device"]
  assert stored[0]["tflops"] == pytest.approx(
      harness.attention_flops(1, 2, 64, 64, 16, False, "fwd") / 1.5e-3 / 1e12)
  assert stored[1]["ms"] is None and "RESOURCE_EXHAUSTED" in stored[1]["error"]
  assert "KeyError" in stored[2]["error"]


def test_append_resume_and_overwrite(tmp_path):
  seen = []
  harness.run_cases([_case("a", counter=seen), _case("b", counter=seen)], _args(tmp_path))
  assert seen == ["a", "b"]
  seen.clear()
  harness.run_cases([_case("a", counter=seen), _case("b", counter=seen), _case("c", counter=seen)],
                    _args(tmp_path, append=True))
  assert seen == ["c"]  # a and b resumed from the file
  assert len(harness.load_rows(str(tmp_path / "out.json"))) == 3
  seen.clear()
  harness.run_cases([_case("a", counter=seen)], _args(tmp_path))  # no --append: start over
  assert seen == ["a"]
  assert len(harness.load_rows(str(tmp_path / "out.json"))) == 1


def test_rerun_failed_and_impl_filter(tmp_path):
  def oom():
    raise RuntimeError("out of memory")
  harness.run_cases([_case("a", run=oom), _case("b")], _args(tmp_path))
  seen = []
  harness.run_cases([_case("a", counter=seen), _case("b", counter=seen)],
                    _args(tmp_path, append=True, rerun_failed=True))
  assert seen == ["a"]
  seen.clear()
  harness.run_cases([_case("torch_x", counter=seen), _case("probjax_y", counter=seen)],
                    _args(tmp_path, impl="probjax_*"))
  assert seen == ["probjax_y"]


def test_max_minutes_stops(tmp_path):
  seen = []
  harness.run_cases([_case("a", counter=seen), _case("b", counter=seen)],
                    _args(tmp_path, max_minutes=-1))
  assert seen == []


def test_load_rows_tolerates_cut_line(tmp_path):
  p = tmp_path / "x.json"
  p.write_text(json.dumps(_row()) + "\n" + '{"suite": "gr')
  assert len(harness.load_rows(str(p))) == 1
  p.write_text(json.dumps([_row(), _row(impl="jaxnn_xla")]))
  assert len(harness.load_rows(str(p))) == 2


# ---------------------------------------------------------------------------
# "where an alternative is faster"
# ---------------------------------------------------------------------------
def _synthetic_grid():
  rows = []
  for t, base, flash, cudnn in [(256, 1.0, 0.5, 0.5), (1024, 2.0, 1.6, 2.05), (4096, 10.0, 8.0, 9.0),
                                (8192, 40.0, 41.0, 30.0)]:
    rows.append(_row(q_len=t, kv_len=t, ms=base))
    rows.append(_row(q_len=t, kv_len=t, ms=flash, impl="torch_sdpa_flash"))
    rows.append(_row(q_len=t, kv_len=t, ms=cudnn, impl="jaxnn_cudnn"))
    rows.append(_row(q_len=t, kv_len=t, ms=base / 2, impl="probjax_triton"))  # not a peer
    rows.append(_row(q_len=t, kv_len=t, ms=None, status="oom", impl="jaxnn_xla"))
  # fp32 group: no peer faster
  rows.append(_row(dtype="float32", q_len=4096, kv_len=4096, ms=5.0))
  rows.append(_row(dtype="float32", q_len=4096, kv_len=4096, ms=5.1, impl="jaxnn_xla"))
  # a forward group
  rows.append(_row(mode="fwd", q_len=2048, kv_len=2048, ms=1.0))
  rows.append(_row(mode="fwd", q_len=2048, kv_len=2048, ms=0.8, impl="tokamax_mosaic"))
  return rows


def test_faster_alternatives():
  groups = bf.faster_alternatives(_synthetic_grid())
  assert len(groups) == 2
  g = groups[0]
  assert (g["dtype"], g["head_dim"], g["causal"], g["mode"]) == ("bfloat16", 64, False, "fwd_bwd")
  # T=256 is below 512; cudnn at 1024 is slower; flash 1.6 vs 2.0 counts; 8192 flash slower.
  assert g["impls"] == {"jaxnn_cudnn": [4096, 8192], "torch_sdpa_flash": [1024, 4096]}
  impl, ratio, t = g["largest"]
  assert (impl, t) == ("jaxnn_cudnn", 8192) and ratio == pytest.approx(40 / 30)
  assert groups[1]["mode"] == "fwd" and groups[1]["largest"][0] == "tokamax_mosaic"
  bullets = bf.faster_bullets(groups)
  assert "bf16, head_dim 64, non-causal, forward + backward" in bullets[0]
  assert "1.33× faster at T=8192" in bullets[0]
  # 5% threshold is strict: a 4% gap does not count
  rows = [_row(ms=1.04), _row(impl="torch_sdpa_flash", ms=1.0)]
  assert bf.faster_alternatives(rows) == []


def test_target_section_counts_same_run_peers_only():
  rows = [_row(ms=1.015, commit="a", timing="differenced"),
          _row(impl="torch_sdpa_cudnn", ms=1.0, commit="a"),
          _row(impl="torch_sdpa_flash", ms=0.5, commit="old"),  # another run: not a peer here
          _row(mode="fwd", ms=1.05, commit="a"), _row(mode="fwd", impl="jaxnn_cudnn", ms=1.0, commit="a"),
          _row(mode="fwd", impl="tokamax_mosaic", ms=0.9, commit="b"),
          _row(q_len=2048, kv_len=2048, ms=2.0, commit="a"),  # not a target length
          _row(q_len=2048, kv_len=2048, impl="jaxnn_cudnn", ms=1.0, commit="a")]
  text = bf.target_section(rows)
  assert "**1 of 2 rows within 1.02**" in text
  assert "D64 T1024 fwd (jax.nn cuDNN, 1.050)" in text and "D64 T1024 fwd_bwd (torch SDPA cuDNN, 1.015)" in text
  assert "D64 T1024 fwd (0.900 vs 1.05 ms, tokamax at b)" in text
  alt = [_row(ms=0.9, commit="c"), _row(impl="torch_flex", ms=1.0, commit="c")]
  assert "the same session (`other_timing/*.json`): 1 of 1 within 1.02" in bf.target_section(rows, alt)
  assert bf.target_section([]) == bf.NOT_MEASURED


# ---------------------------------------------------------------------------
# page generator
# ---------------------------------------------------------------------------
def _write_jsonl(path, rows):
  with open(path, "w") as f:
    for r in rows:
      f.write(json.dumps(r) + "\n")


def test_pages_from_synthetic_json(tmp_path):
  results = tmp_path / "results"
  (results / "h200").mkdir(parents=True)
  (results / "cpu").mkdir()
  grid = _synthetic_grid()
  _write_jsonl(results / "h200" / "grid.json", grid)
  _write_jsonl(results / "cpu" / "cpu.json", [
      _row(suite="cpu", impl=i, dtype="float32", batch=1, q_len=4096, kv_len=4096, ms=ms,
           platform="cpu", device="CPU (test)")
      for i, ms in (("probjax_default", 700.0), ("jaxnn_xla", 780.0), ("torch_cpu", 170.0))])
  _write_jsonl(results / "h200" / "max_len.json", [_row(suite="max_len", ms=None, max_len=65536, search_max=131072)])
  _write_jsonl(results / "h200" / "peak.json", [_row(suite="peak", ms=None, peak_bytes=2**30, q_len=1024, kv_len=1024)])
  info = bf.build(str(results), str(tmp_path), str(tmp_path / "figures"))
  page = (tmp_path / "attention-performance.md").read_text()
  h200 = (tmp_path / "h200.md").read_text()
  assert "## Where an alternative is faster" in page
  assert "jax.nn cuDNN is 1.33× faster at T=8192" in page and "computed from h200/grid.json" in page
  assert "probjax default 700 ms" in page and "torch CPU SDPA 170 ms" in page
  assert "65,536" in page and "(h200/peak.json)" in page
  # suites without data say so instead of failing
  assert "## Tile selection\n\n" + bf.NOT_MEASURED in page
  assert bf.NOT_MEASURED in page.split("## Grouped-query")[1]
  assert "# probjax on the NVIDIA H200" in h200 and "NVIDIA H200" in h200
  assert "evidence" not in h200.split("## Device-specific defaults")[1].split("## Why")[0].split("```")[1]
  assert any(f.endswith(".png") for f in info["figures"])


def test_generated_pages_live_in_the_developer_docs(monkeypatch):
  # The generated pages are benchmark evidence: docs/dev/ (the site's Developers section, beside
  # decisions.md, which they link), not the user docs.
  import re
  dev = os.path.join(ROOT, "docs", "dev")
  called = []
  monkeypatch.setattr(bf, "build", lambda results, docs, figs: called.append((docs, figs)) or {})
  assert bf.main([]) == 0
  assert [tuple(map(os.path.normpath, c)) for c in called] == [(dev, os.path.join(dev, "figures"))]
  for page in ("attention-performance.md", "h200.md"):
    assert os.path.isfile(os.path.join(dev, page)), page
    assert not os.path.exists(os.path.join(ROOT, "docs", page)), page
    with open(os.path.join(dev, page)) as f:
      text = f.read()
    assert "[decisions.md](decisions.md)" in text and os.path.isfile(os.path.join(dev, "decisions.md"))
    for fig in set(re.findall(r"\]\((figures/[^)]+)\)", text)):
      assert os.path.isfile(os.path.join(dev, fig)), (page, fig)
  assert not os.path.exists(os.path.join(ROOT, "docs", "figures"))
  nav = open(os.path.join(ROOT, "mkdocs.yml")).read()
  assert "dev/attention-performance.md" in nav and "dev/h200.md" in nav


def test_interleaved_tables_rate_probjax_against_the_fastest_peer():
  rows = [_row(suite="interleaved", impl=i, q_len=4096, kv_len=4096, head_dim=128, mode="fwd", ms=ms,
               commit="abc", command="cmd", timing="plain")
          for i, ms in (("probjax_triton", 2.0), ("torch_flex", 2.5), ("torch_sdpa_flash", 1.6))]
  text = bf.interleaved_section(rows)
  assert "`cmd` at abc, NVIDIA H200." in text
  assert "| B4 H8 | 4096 | 128 | no | fwd | none | plain | 2.00 | 2.50 | 1.60 | 1.250 |" in text
  failed = dict(rows[0], impl="probjax_cudnn_unified", ms=None, status="error", error="needs cuDNN 9.21")
  text = bf.interleaved_section(rows + [failed])
  assert "| B4 H8 | 4096 | 128 | no | fwd | none | plain | 2.00 | 2.50 | 1.60 | — | 1.250 | — |" in text
  other_run = [dict(r, commit="def") for r in rows]
  assert bf.interleaved_section(rows + other_run).count("`cmd` at") == 2  # one table per run
  assert bf.interleaved_section([_row()]) == bf.NOT_MEASURED


def test_pages_with_no_data(tmp_path):
  results = tmp_path / "r"
  results.mkdir()
  bf.build(str(results), str(tmp_path), str(tmp_path / "figures"))
  page = (tmp_path / "attention-performance.md").read_text()
  assert page.count(bf.NOT_MEASURED) >= 8
  assert "## How to reproduce" in page


def test_readme_section(tmp_path):
  rows = [_row(suite="cpu", impl=i, dtype="float32", batch=1, q_len=4096, kv_len=4096, ms=ms,
               platform="cpu", device="CPU (test)")
          for i, ms in (("probjax_default", 700.0), ("jaxnn_xla", 770.0), ("torch_cpu", 175.0))]
  js = tmp_path / "cpu.json"
  _write_jsonl(js, rows)
  readme = tmp_path / "README.md"
  readme.write_text("# x\n\n<!-- perf:begin -->\nold\n<!-- perf:end -->\n\nrest\n")
  assert crn.main(["--json", str(js), "--readme", str(readme)]) == 0
  text = readme.read_text()
  assert "old" not in text and "rest" in text
  assert "| probjax default | 700 |" in text
  assert "jax.nn XLA 770 ms (1.10× the probjax time)" in text and "torch 175 ms (0.25×)" in text
  assert "Faster than jax.nn XLA: yes; within 2× of torch: no." in text
  assert crn.main(["--json", str(js), "--readme", str(readme), "--check"]) == 0
  readme.write_text("no markers")
  assert crn.main(["--json", str(js), "--readme", str(readme)]) == 2


# ---------------------------------------------------------------------------
# --quick of every suite on CPU
# ---------------------------------------------------------------------------
QUICK = [
    ("benchmark_gpu_attention", []),
    ("benchmark_gpu_attention_tiles", []),
    ("benchmark_gpu_attention_tiles", ["--kernel", "mosaic"]),
    ("benchmark_gpu_attention_tiles", ["--kernel", "mosaic_bwd"]),
    ("benchmark_kernel_attn_gpu", ["--suite", "dispatch,residuals,peak"]),
    ("benchmark_kernel_attn_ext", ["--suite", "gqa,decode"]),
    ("benchmark_kernel_attn_cpu", ["--torch-python", "/nonexistent/python"]),
    ("interleaved", []),
]


@pytest.mark.slow  # a fresh interpreter per suite: tens of seconds each
@pytest.mark.parametrize("module,extra", QUICK, ids=[" ".join([q[0], *q[1]]) for q in QUICK])
def test_quick_suite(tmp_path, module, extra):
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
  p = subprocess.run([sys.executable, "-m", f"bench.{module}", "--quick", "--no-progress",
                      "--results-dir", str(tmp_path)] + extra, cwd=ROOT, env=env, capture_output=True,
                     text=True, timeout=240)
  assert p.returncode == 0, p.stderr[-3000:]
  files = sorted((tmp_path / "cpu").glob("*.json"))
  rows = [r for f in files for r in harness.load_rows(str(f))]
  assert rows, p.stderr[-2000:]
  for f in files:  # one file per suite, on this device
    assert {r["suite"] for r in harness.load_rows(str(f))} == {f.stem}
  for r in rows:
    assert harness.validate_row(r) == [], r
    assert r["status"] != "error", r.get("error")
  assert any(r["status"] == "ok" for r in rows) or module == "benchmark_gpu_attention_tiles"
  if module == "benchmark_kernel_attn_cpu":
    torch_rows = [r for r in rows if r["impl"] == "torch_cpu"]
    assert torch_rows and all(r["status"] in ("unsupported", "error") for r in torch_rows)


def test_interleaved_suite_in_process(tmp_path):
  from bench import interleaved
  out = tmp_path / "rows.json"
  assert interleaved.main(["--quick", "--no-progress", "--output", str(out)]) == 0
  rows = harness.load_rows(str(out))
  assert [r["impl"] for r in rows] == ["probjax_default", "jaxnn_xla"]
  for r in rows:
    assert harness.validate_row(r) == [] and r["suite"] == "interleaved" and r["status"] == "ok", r
    assert r["rounds"] == 3 and len(r["round_ms"]) == 3  # rotating rounds by default


def test_select_cases_rejects_unknown_suites():
  from bench import harness
  built = harness.select_cases("b,a", {"a": lambda: ["a1"], "b": lambda: ["b1", "b2"]})
  assert built == ["a1", "b1", "b2"]
  with pytest.raises(SystemExit, match="known: a, b"):
    harness.select_cases("a,typo", {"a": lambda: [], "b": lambda: []})


def test_tiles_section_counts_auto_within_five_percent():
  from bench import benchmark_figures as bf
  base = dict(suite="tiles", impl="probjax_triton", dtype="bfloat16", batch=4, q_heads=8, kv_heads=8,
              q_len=4096, kv_len=4096, head_dim=64, causal=False, mask="none", status="ok", device="GPU")
  cfg = {"forward": {"block_q": 64, "fast_exp2": False}, "backward": "B"}
  rows = [dict(base, mode="fwd", variant="auto", ms=1.0, auto_config=cfg),
          dict(base, mode="fwd", variant="bq64_bk64_s2_w4", ms=0.9),
          dict(base, mode="fwd_bwd", variant="auto", ms=3.0, auto_config=cfg),
          dict(base, mode="fwd_bwd", variant="dkv64x64_dq64x64_s2_w4", ms=3.1),
          dict(base, mode="fwd_bwd", variant="too_big", ms=None, status="unsupported"),
          # run with other forward tiles than auto's: not comparable, left out
          dict(base, mode="fwd_bwd", variant="dkv32x128_dq128x64_s2_w4", ms=1.0,
               forward_config={"block_q": 128}),
          # recorded before the fast_exp2 field existed: the same forward tiles
          dict(base, mode="fwd_bwd", variant="dkv64x128_dq128x64_s2_w4", ms=3.05,
               forward_config={"block_q": 64})]
  text = bf.tiles_section(rows)
  assert "best in 1 of 2 shapes with an auto row." in text
  assert "| 1.11 |" in text and "2 ran / 1 rejected" in text and "| wall |" in text
  # With kernel times on every row of a shape, they decide (the wall clock of short calls is
  # host-bound): auto is 1.11x the best by wall clock but 1.02x by kernel time.
  rows[0]["device_ms"], rows[1]["device_ms"] = 0.51, 0.50
  text = bf.tiles_section(rows)
  assert "best in 2 of 2 shapes" in text and "| 1.02 |" in text and "| kernel |" in text
  # A shape whose auto row was dropped (its default changed after the sweep) is not counted.
  text = bf.tiles_section(rows + [dict(base, mode="fwd", q_len=8192, variant="bq64_bk64_s2_w4", ms=2.0)])
  assert "best in 2 of 2 shapes with an auto row (1 without one" in text


def test_drop_rows(tmp_path, capsys):
  from bench import drop_rows
  path = tmp_path / "rows.json"
  rows = [dict(impl="probjax_triton", variant="auto"), dict(impl="probjax_default"),
          dict(impl="torch_flex", variant="auto")]
  path.write_text("".join(json.dumps(r) + "\n" for r in rows))
  drop_rows.main([str(path), "--impl", "probjax_*", "--variant", "auto", "--dry-run"])
  assert len(path.read_text().splitlines()) == 3 and "1 of 3 rows match" in capsys.readouterr().out
  drop_rows.main([str(path), "--impl", "probjax_*,torch_*", "--variant", "auto*"])
  assert [json.loads(l)["impl"] for l in path.read_text().splitlines()] == ["probjax_default"]
  with pytest.raises(SystemExit):
    drop_rows.main([str(path)])
  drop_rows.main([str(path), "--q_len", "1024"])  # a numeric field matches its text


def test_merge_rows_keeps_measured_rows(tmp_path):
  from bench import merge_rows
  base = dict(suite="grid", impl="probjax_triton", dtype="bfloat16", batch=1, q_heads=2, kv_heads=2,
              q_len=64, kv_len=64, head_dim=16, causal=False, mask="none", mode="fwd", device="GPU")
  a, b = tmp_path / "a" / "h200", tmp_path / "b" / "h200"
  for d in (a, b):
    d.mkdir(parents=True)
  (a / "grid.json").write_text(json.dumps(dict(base, ms=1.0, status="ok")) + "\n"
                               + json.dumps(dict(base, q_len=128, ms=None, status="oom")) + "\n")
  (b / "grid.json").write_text(json.dumps(dict(base, ms=None, status="error")) + "\n"
                               + json.dumps(dict(base, q_len=128, ms=2.0, status="ok")) + "\n"
                               + json.dumps(dict(base, impl="torch_flex", ms=3.0, status="ok")) + "\n")
  out = tmp_path / "out1"
  assert merge_rows.main([str(out), str(tmp_path / "a"), str(tmp_path / "b")]) == 0
  rows = {(r["impl"], r["q_len"]): r for r in harness.load_rows(str(out / "h200" / "grid.json"))}
  assert len(rows) == 3
  assert rows[("probjax_triton", 64)]["ms"] == 1.0      # an error never replaces a measurement
  assert rows[("probjax_triton", 128)]["ms"] == 2.0     # a measurement replaces a failure
  assert rows[("torch_flex", 64)]["ms"] == 3.0
  # Of two measurements the more recent is kept, whichever folder holds it; the output
  # folder's own rows take part (merging a device run into bench/results).
  (a / "grid.json").write_text(json.dumps(dict(base, ms=1.0, status="ok", time="2026-11-30T10:00:00")) + "\n")
  (b / "grid.json").write_text(json.dumps(dict(base, ms=5.0, status="ok", time="2026-11-29T10:00:00")) + "\n")
  out = tmp_path / "out2"
  assert merge_rows.main([str(out), str(tmp_path / "a"), str(tmp_path / "b")]) == 0
  assert [r["ms"] for r in harness.load_rows(str(out / "h200" / "grid.json"))] == [1.0]
  (out / "h200" / "grid.json").write_text(json.dumps(dict(base, ms=0.5, status="ok", time="2026-12-01T10:00:00")) + "\n")
  assert merge_rows.main([str(out), str(tmp_path / "b")]) == 0
  assert [r["ms"] for r in harness.load_rows(str(out / "h200" / "grid.json"))] == [0.5]


def test_compare_runs(tmp_path, capsys):
  from bench import compare_runs
  base = dict(suite="grid", dtype="bfloat16", batch=1, q_heads=2, kv_heads=2, q_len=64, kv_len=64,
              head_dim=16, causal=False, mask="none", mode="fwd", device="GPU", status="ok")
  old = [dict(base, impl="probjax_triton", ms=2.0), dict(base, impl="torch_flex", ms=1.0),
         dict(base, impl="probjax_default", ms=1.0, status="error")]
  new = [dict(base, impl="probjax_triton", ms=1.0), dict(base, impl="torch_flex", ms=1.1),
         dict(base, impl="probjax_default", ms=1.0)]
  pairs = compare_runs.ratios(old, new, "probjax_*")
  assert [(r["impl"], x) for r, x in pairs] == [("probjax_triton", 0.5)]  # failed rows do not count
  a, b = tmp_path / "a.json", tmp_path / "b.json"
  a.write_text("".join(json.dumps(r) + "\n" for r in old))
  b.write_text("".join(json.dumps(r) + "\n" for r in new))
  compare_runs.main([str(a), str(b)])
  out = capsys.readouterr().out
  assert "new/old 0.500" in out and "other rows (noise): 1 rows, median 1.100" in out


def test_jax_kernel_times_fall_back_to_torch_profiler(monkeypatch):
  """Once torch's profiler holds CUPTI, JAX's trace has no GPU streams: JAX calls are then
  profiled by torch's profiler; other failures, or no torch in the process, still raise."""
  def no_streams(*a):
    raise RuntimeError("no GPU stream threads in the trace (threads: [])")
  monkeypatch.setattr(harness, "_jax_intervals", no_streams)
  monkeypatch.setattr(harness, "_torch_intervals", lambda fn, sync, n: [(0.0, 5.0 * n, "k")])
  monkeypatch.setitem(sys.modules, "torch", sys.modules.get("torch") or object())
  assert harness.kernel_ms(None, None, 4, "jax") == 5e-3
  monkeypatch.delitem(sys.modules, "torch")
  with pytest.raises(RuntimeError, match="no GPU stream"):
    harness.kernel_ms(None, None, 4, "jax")


def test_gpu_stream_intervals_keep_stream_kernels_only():
  events = [
      {"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/device:GPU:0"}},
      {"ph": "M", "name": "process_name", "pid": 2, "args": {"name": "/host:CPU"}},
      {"ph": "M", "name": "thread_name", "pid": 1, "tid": 7, "args": {"name": "Stream #7(Compute)"}},
      {"ph": "M", "name": "thread_name", "pid": 1, "tid": 8, "args": {"name": "XLA Ops"}},
      {"ph": "M", "name": "thread_name", "pid": 2, "tid": 7, "args": {"name": "Stream on host"}},
      {"ph": "X", "pid": 1, "tid": 7, "dur": 10.0}, {"ph": "X", "pid": 1, "tid": 7, "dur": 5.0},
      {"ph": "X", "pid": 1, "tid": 8, "dur": 15.0},   # derived line: not counted twice
      {"ph": "X", "pid": 2, "tid": 7, "dur": 100.0}]  # host thread
  assert sum(k[1] for k in harness.gpu_stream_intervals(events)) == 15.0
  with pytest.raises(RuntimeError, match="no GPU stream threads.*XLA Ops"):
    harness.gpu_stream_intervals(events[:2] + events[3:4])


def test_device_time_is_optional_and_never_fails_a_row():
  import jax
  import jax.numpy as jnp
  f = jax.jit(lambda x: jnp.sin(x) @ x)
  # small enough to stay under DEVICE_TIME_MAX_MS on a loaded 2-core machine, where device time
  # is attempted at all
  x = jnp.ones((16, 16))
  jax.block_until_ready(f(x))  # compiled first: a compile among the timed calls can exceed the bound
  res = harness.time_fn(lambda: f(x), jax.block_until_ready, warmup=0, repeats=3, min_repeat_s=0.0,
                        max_calls=3, device_time=True)
  assert res["ms"] > 0
  if jax.devices()[0].platform == "cpu":  # no GPU kernels to read: said, not raised
    assert "device_ms" not in res and "no GPU stream threads" in res["device_ms_error"]
  assert "device_ms" not in harness.time_fn(lambda: f(x), jax.block_until_ready, warmup=0,
                                            repeats=1, min_repeat_s=0.0, max_calls=1)


@pytest.mark.quick  # the few-minute GPU selection (MARK='gpu and quick')
@pytest.mark.gpu
def test_gpu_device_time_reads_kernel_durations():
  import jax
  import jax.numpy as jnp
  f = jax.jit(lambda x: jnp.sin(x @ x) @ x)
  x = jnp.ones((2048, 2048), jnp.bfloat16)
  res = harness.time_fn(lambda: f(x), jax.block_until_ready, warmup=1, repeats=3, device_time=True)
  assert 0 < res["device_ms"] <= 1.5 * res["ms"], res
  try:
    import torch
  except ImportError:
    return
  a = torch.ones((2048, 2048), dtype=torch.bfloat16, device="cuda")
  res = harness.time_fn(lambda: torch.sin(a @ a) @ a, lambda _: torch.cuda.synchronize(), warmup=1,
                        repeats=3, device_time=True, backend="torch")
  assert 0 < res["device_ms"] <= 1.5 * res["ms"], res


def test_device_time_section():
  base = dict(suite="grid", impl="torch_sdpa_cudnn", dtype="bfloat16", batch=4, q_heads=8, kv_heads=8,
              q_len=1024, kv_len=1024, head_dim=64, causal=False, mask="none", mode="fwd_bwd",
              status="ok", device="GPU")
  assert "No row records" in bf.device_time_section([dict(base, ms=1.0)])
  text = bf.device_time_section([dict(base, ms=0.6, device_ms=0.2), dict(base, impl="x", ms=1.0)])
  assert "| 3.00 |" in text and text.count("| grid |") == 1


def test_config_key_ignores_switched_off_options():
  assert bf._config_key({"block_q": 128, "fast_exp2": False, "prefetch_scores": False}) == bf._config_key(
      {"block_q": 128})
  assert bf._config_key({"block_q": 128, "fast_exp2": True}) != bf._config_key({"block_q": 128})


# ---------------------------------------------------------------------------
# results layout, tuning evidence, one timing module
# ---------------------------------------------------------------------------
RESULTS = os.path.join(ROOT, "bench", "results")


def _result_files():
  out = []
  for dirpath, _, names in os.walk(RESULTS):
    out += [os.path.join(dirpath, n) for n in names]
  return sorted(out)


# Suites with their own row schema (not the attention harness's): the fields of a row's key.
def test_results_are_one_file_per_device_and_suite_with_the_commit_in_each_row():
  files = _result_files()
  assert files
  for path in files:
    rel = os.path.relpath(path, RESULTS).split(os.sep)
    assert path.endswith(".json") and len(rel) in (2, 3), rel  # <device>/[other_timing/]<suite>.json
    suite = rel[-1][:-len(".json")]
    rows = harness.load_rows(path)
    assert rows, path
    own = harness.OWN_SCHEMA_KEYS.get(suite)
    key = harness.key_function(path)
    keys = [key(r) for r in rows]
    assert len(keys) == len(set(keys)), f"{path}: one row per key"
    for r in rows:
      if own is None:
        assert r["suite"] == suite, (path, r["suite"])
        assert harness.validate_row(r) == [], (path, r)
      assert r.get("commit"), (path, key(r))
      assert harness.device_slug(r["device"]) == rel[0], (path, r["device"])


def test_tuning_evidence_points_at_result_rows_of_that_commit():
  from bench import tuning_table
  from probjax.ops.attention import tuning
  with open(os.path.join(ROOT, "bench", "tuning", "sm_90.json")) as f:
    entries = json.load(f)["entries"]  # the shipped table's evidence (bench/tuning_table.py)
  assert set(entries) == set(tuning.entry_names())
  assert tuning_table.stale() == []
  cache = {}
  for name, e in entries.items():
    assert e["evidence"], name
    for path, rid, commit in e["evidence"]:
      rows = cache.setdefault(path, harness.load_rows(os.path.join(ROOT, path)))
      row = harness.find_row(rows, rid)
      assert row is not None, (name, path, rid)
      assert row["commit"] == commit and row["status"] == "ok", (name, rid)


def test_row_id_names_every_key_field():
  r = _row(causal=True, variant="bq64")
  assert harness.row_id(r) == "grid probjax_default bfloat16 B4 H8/8 T1024/1024 D64 causal none fwd_bwd bq64"
  assert harness.find_row([_row(ms=1.0), _row(ms=2.0)], harness.row_id(_row())) ["ms"] == 2.0
  assert harness.find_row([_row()], "nothing") is None


def test_device_slug_and_results_file():
  assert harness.device_slug("NVIDIA H200") == "h200"
  assert harness.device_slug("NVIDIA H100 80GB HBM3") == "h100_80gb_hbm3"
  assert harness.device_slug("CPU (AMD EPYC, 2 threads)") == "cpu"
  assert harness.results_file("grid", "/r", "NVIDIA H200") == os.path.join("/r", "h200", "grid.json")


def test_rows_go_to_their_suites_file_and_replace_their_keys(tmp_path, monkeypatch):
  monkeypatch.setattr(harness, "device_slug", lambda device=None: "dev")
  args = _args(tmp_path, output=None, results_dir=str(tmp_path))
  a = _case("a")
  b = dataclasses.replace(_case("b"), suite="masked")
  harness.run_cases([a, b], args)
  grid, masked = tmp_path / "dev" / "grid.json", tmp_path / "dev" / "masked.json"
  assert [r["impl"] for r in harness.load_rows(str(grid))] == ["a"]
  assert [r["impl"] for r in harness.load_rows(str(masked))] == ["b"]
  harness.run_cases([_case("c")], args)  # no --append: other rows stay
  harness.run_cases([_case("a", run=lambda: {"ms": 9.0})], args)  # the key's row is replaced
  rows = harness.load_rows(str(grid))
  assert sorted(r["impl"] for r in rows) == ["a", "c"] and [r["ms"] for r in rows if r["impl"] == "a"] == [9.0]


def test_one_timing_module():
  from probjax import attention_report
  from probjax.core import timing
  assert harness.classify_error is timing.classify_error is attention_report.classify_error
  assert harness.Unsupported is timing.Unsupported and harness.summarize is timing.summarize
  info = timing.device_info()
  assert {"device", "platform", "compute_capability", "versions", "commit"} <= set(info)
  assert info["versions"]["jax"]


def test_probjax_and_docs_import_nothing_from_bench():
  import ast
  for base in ("probjax", "docs"):
    for dirpath, _, names in os.walk(os.path.join(ROOT, base)):
      for n in names:
        if n.endswith(".py"):
          path = os.path.join(dirpath, n)
          assert base != "docs", f"{path}: docs/ holds no Python"
          for node in ast.walk(ast.parse(open(path).read())):
            mods = ([a.name for a in node.names] if isinstance(node, ast.Import)
                    else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            assert not any(m.split(".")[0] in ("bench", "docs") for m in mods), (path, mods)


def test_quickstart_times_the_readme_quick_start_as_written():
  from bench import quickstart
  code = quickstart.quick_start_code((pathlib.Path(__file__).resolve().parents[2] / "README.md").read_text())
  compile(code, "quick_start.py", "exec")
  assert "dot_product_attention(q, k, v" in code and "```" not in code


def test_torch_worker_loads_the_timing_module_without_jax(tmp_path):
  # The torch worker runs in an interpreter without JAX (.torchenv): its timing module, and what
  # that imports, must not need JAX (a probjax import there once left every torch row an error).
  root = pathlib.Path(__file__).resolve().parents[2]
  code = ("import sys; sys.modules['jax'] = None; sys.modules['jaxlib'] = None\n"
          f"sys.path.insert(0, {str(root / 'bench')!r}); import torch_cpu_worker as w\n"
          "t = w._timing(); assert callable(t.time_fn) and 'jax' not in {m.split('.')[0] for m in sys.modules if sys.modules[m]}\n")
  # Run from elsewhere and without site-packages (-S: no editable install of probjax), as in
  # the torch interpreter: the checkout is not on the path by accident.
  env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
  run = subprocess.run([sys.executable, "-S", "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=120)
  assert run.returncode == 0, run.stderr
