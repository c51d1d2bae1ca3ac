"""bench/isab.py: the FLOP convention and the rows' schema, on CPU (``--cpu-smoke``: tiny sizes);
the torch_flex rows measured where torch imports, ``missing`` where it does not."""

import importlib.util

import numpy as np
import pytest

from bench import harness
from bench import isab as bench_isab
from bench.torch_isab_worker import pool_rounds

TIMED = ("ms", "p10_ms", "p90_ms", "round_ms", "rounds", "n_repeats", "tflops", "first_call_s")
HAS_TORCH = importlib.util.find_spec("torch") is not None


def test_flops_are_two_attentions_of_the_padded_sizes():
  c = bench_isab.Config()
  d = c.features // c.heads
  one = 4 * c.batch * c.heads * c.inducing * 1024 * d          # 4 B H Tq Tk d
  assert bench_isab.attention_flops(c, 1024, "fwd") == 2 * one
  assert bench_isab.attention_flops(c, 1024, "fwd_bwd") == 2 * one * bench_isab.FWD_BWD_FLOP_FACTOR
  assert str(bench_isab.FWD_BWD_FLOP_FACTOR) in bench_isab.FLOP_CONVENTION
  assert bench_isab.KEY == harness.OWN_SCHEMA_KEYS["isab"]


def test_pooled_rounds_and_agreement():
  rounds = [dict(ms=m, p10_ms=m - 1, p90_ms=m + 1, n_repeats=5, calls_per_repeat=2, first_call_s=0.5)
            for m in (3.0, 1.0, 2.0)]
  pooled = pool_rounds(rounds)
  assert (pooled["ms"], pooled["p10_ms"], pooled["p90_ms"], pooled["rounds"]) == (2.0, 1.0, 3.0, 3)
  assert pooled["round_ms"] == [3.0, 1.0, 2.0] and pooled["n_repeats"] == 15
  rng = np.random.default_rng(0)
  ref = {"y": rng.standard_normal((2, 3)), "x": rng.standard_normal(4)}
  assert bench_isab.agreement(ref, ref, "fwd")["check"] == "ok"
  off = dict(ref, x=ref["x"] + 1.0)
  got = bench_isab.agreement(off, ref, "fwd_bwd")
  assert got["agree_ref"] == bench_isab.REF and got["max_error"] > 0.1 and got["check"].startswith("FAILED")


def _check_rows(rows, impls):
  by = {bench_isab.row_key(r): r for r in rows}
  case = bench_isab.case_name(bench_isab.SMOKE, bench_isab.SMOKE_SIZES[0])
  assert set(by) == {(case, i, m) for i in impls for m in bench_isab.MODES}
  for r in rows:
    assert r["device"] and r["versions"]["jax"] and "bench.isab" in r["command"] and "commit" in r
    assert r["flop_convention"] == bench_isab.FLOP_CONVENTION and r["flops"] > 0 and r["dtype"] == "bfloat16"
    assert r["set_size"] == 16 and r["valid_per_set"] == 12
    if r["status"] == "ok":
      assert all(r[k] is not None for k in TIMED), r
      assert r["p10_ms"] <= r["ms"] <= r["p90_ms"] and r["agree_ref"] == bench_isab.REF
      assert r["check"] == "ok", r
    else:
      assert r["status"] in ("unsupported", "missing") and r["error"], r
  return by


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_cpu_smoke_rows_and_resume(tmp_path):
  out = str(tmp_path / "isab.json")
  impls = ("jaxnn_xla", "probjax_default", "probjax_triton", "jaxnn_cudnn", "torch_flex")
  argv = ["--cpu-smoke", "--no-progress", "--output", out, "--impl", ",".join(impls)]
  bench_isab.main(argv)
  rows = harness.load_rows(out)
  by = _check_rows(rows, impls)
  for m in bench_isab.MODES:
    assert by[rows[0]["case"], "probjax_default", m]["status"] == "ok"
    assert "xla" in by[rows[0]["case"], "probjax_default", m]["dispatch"][0]
    assert by[rows[0]["case"], "probjax_triton", m]["status"] == "unsupported"   # needs a GPU
    # flex_attention has no backward on CPU
    assert by[rows[0]["case"], "torch_flex", m]["status"] in (("ok", "unsupported") if HAS_TORCH else ("missing",))
  bench_isab.main(argv + ["--append"])
  assert harness.load_rows(out) == rows   # every key already measured


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_cpu_smoke_torch_flex_agrees(tmp_path):
  pytest.importorskip("torch")
  out = str(tmp_path / "isab.json")
  impls = ("jaxnn_xla", "torch_flex")
  bench_isab.main(["--cpu-smoke", "--no-progress", "--output", out, "--impl", ",".join(impls)])
  by = _check_rows(harness.load_rows(out), impls)
  torch_fwd, torch_fwd_bwd = (by[bench_isab.case_name(bench_isab.SMOKE, 16), "torch_flex", m] for m in bench_isab.MODES)
  assert torch_fwd["status"] == "ok" and torch_fwd["torch_version"], torch_fwd
  assert torch_fwd_bwd["status"] in ("ok", "unsupported"), torch_fwd_bwd   # flex has no backward on CPU


@pytest.mark.gpu
def test_gpu_rows_agree(tmp_path):
  out = str(tmp_path / "isab.json")
  rows = bench_isab.main(["--sizes", "256", "--rounds", "1", "--repeats", "2", "--no-progress", "--output", out])
  for r in rows:
    assert r["status"] in ("ok", "unsupported"), r
    if r["status"] == "ok":
      assert r["check"] == "ok", r
  assert {r["impl"] for r in rows if r["status"] == "ok"} >= {"probjax_default", "jaxnn_cudnn", "jaxnn_xla",
                                                               "torch_flex"}
