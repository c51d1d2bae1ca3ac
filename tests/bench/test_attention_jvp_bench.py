"""bench/attention_jvp.py on CPU (``--cpu-smoke``: tiny shapes, kernels in interpret mode): its modes
(jvp, grad_jvp) and implementations write rows, skip by length, resume; the grad_jvp loss is the
same function on every path."""

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bench import attention_jvp as bench

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _rows(path):
  return [json.loads(line) for line in path.read_text().splitlines()]


def test_smoke_modes_skips_and_resume(tmp_path):
  out = tmp_path / "attention_jvp.json"
  argv = ["--cpu-smoke", "--impls", "default,one_fwd,jax_nn", "--modes", "jvp,grad_jvp", "--output", str(out)]
  bench.main(argv + ["--max-xla-len", "32"])
  rows = _rows(out)
  # per causal flag: jvp rows for the three, grad_jvp for default and jax_nn (one_fwd has no tangent)
  assert [(r["impl"], r["mode"]) for r in rows] == 2 * [("default", "jvp"), ("one_fwd", "jvp"), ("jax_nn", "jvp"),
                                                      ("default", "grad_jvp"), ("jax_nn", "grad_jvp")]
  for r in rows:
    if r["impl"] == "jax_nn":  # T40 > --max-xla-len 32
      assert r["status"] == "skipped" and "--max-xla-len" in r["error"] and r.get("ms") is None
    else:
      assert r["status"] == "ok" and r["ms"] > 0 and r["compiled_total_bytes"] >= r["temp_bytes"] > 0
      assert r["compile_s"] >= 0 and r["command"] and r["interpret"] is True
      assert r["dispatch"].startswith("triton")  # interpret mode dispatches as on a GPU
  assert {r["tangent"] for r in rows if r["impl"] == "default"} == {"fused kernel of the first of triton, mosaic"}
  # resume: the measured rows stay, the skipped ones are measured now that no limit applies
  before = {bench.row_key(r): r["timestamp"] for r in rows if r["status"] == "ok"}
  bench.main(argv + ["--append"])
  again = _rows(out)
  assert len(again) == len(rows)
  assert all(r["status"] == "ok" for r in again)
  assert {bench.row_key(r): r["timestamp"] for r in again if r["impl"] != "jax_nn"} == before
  # rows from before the mode field are jvp rows
  assert bench.row_key({"impl": "fused", "seq": 1})[1] == "jvp"


@pytest.mark.parametrize("impl", ["default", "fused", "xla_tangent"])
def test_grad_jvp_matches_jax_nn(impl):
  """The grad_jvp rows time the same gradient: through the kernels (interpret mode) and XLA."""
  keys = jax.random.split(jax.random.key(1), 8)
  args = [jax.random.normal(k, (1, 40, 2, 16), jnp.bfloat16) for k in keys]
  for causal in (False, True):
    got = bench.build(impl, "grad_jvp", causal, True)[0](*args)
    want = bench.build("jax_nn", "grad_jvp", causal, True)[0](*args)
    for g, w in zip(got, want):
      g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
      assert np.linalg.norm(g - w) <= 0.03 * np.linalg.norm(w), (impl, causal)


def test_plan_grad_rows_and_skips():
  args = bench.parser().parse_args(["--impls", "one_fwd,fused", "--grad-impls", "fused,jax_nn", "--lengths", "4096",
                                    "--grad-lengths", "2048", "--head-dims", "128", "--causal", "noncausal",
                                    "--max-xla-len", "1024"])
  rows = bench.plan(args)
  assert rows == [("fused", "grad_jvp", 2048, 128, False), ("jax_nn", "grad_jvp", 2048, 128, False),
                  ("one_fwd", "jvp", 4096, 128, False), ("fused", "jvp", 4096, 128, False)]
  assert [bench.skip_reason(i, m, t, args) is not None for i, m, t, _, _ in rows] == [False, True, False, False]
  full = bench.plan(bench.parser().parse_args([]))  # default: every impl, both modes, 5 lengths, 2 dims, causal both
  assert len(full) == 5 * 2 * 2 * (len(bench.IMPLS) + len(bench.IMPLS) - len(bench.FORWARD_ONLY))
  with pytest.raises(SystemExit):
    bench.plan(bench.parser().parse_args(["--grad-impls", "two_fwd"]))


def test_forward_only_impls_have_no_grad_jvp():
  with pytest.raises(ValueError):
    bench.build("two_fwd", "grad_jvp", False, True)


# Slow: every implementation (Mosaic's interpreted warpgroups take seconds a call) in both modes,
# about a minute; a subprocess, so that PJRT_NPROC is set before JAX starts its CPU client.
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_cpu_smoke_runs_every_impl_and_mode(tmp_path):
  out = tmp_path / "attention_jvp.json"
  env = {k: v for k, v in os.environ.items() if k != "PJRT_NPROC"}
  subprocess.run([sys.executable, "-m", "bench.attention_jvp", "--cpu-smoke", "--output", str(out)],
                 cwd=ROOT, env=env, check=True, timeout=540)
  rows = _rows(out)
  want = {(i, m) for i in bench.IMPLS for m in bench.MODES if not (m == "grad_jvp" and i in bench.FORWARD_ONLY)}
  assert {(r["impl"], r["mode"]) for r in rows} == want
  assert len(rows) == 2 * len(want)
  bad = [(r["impl"], r["mode"], r.get("error")) for r in rows if r["status"] != "ok"]
  assert not bad, bad
