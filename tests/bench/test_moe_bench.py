"""bench/moe.py runs end to end on CPU (``--cpu-smoke``: tiny sizes, interpret mode) and resumes."""

import pytest

from bench import moe
from bench.harness import load_rows


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_cpu_smoke_and_resume(tmp_path):
  out = str(tmp_path / "moe.json")
  argv = ["--cpu-smoke", "--output", out, "--no-progress", "--suite", "moe_train,gmm", "--dist", "zipf",
          "--impl", "sorted,fused_gsum,triton,jax_ragged_dot,tokamax_mosaic"]
  moe.main(argv)
  rows = load_rows(out)
  by = {(r["suite"], r["mode"], r["impl"]): r for r in rows}
  for key in [("moe_train", "train_step", i) for i in ("sorted", "fused_gsum", "triton", "jax_ragged_dot")] + [
      ("gmm", m, i) for m in ("fwd", "d_lhs", "d_rhs") for i in ("triton", "jax_ragged_dot")]:
    r = by[key]
    assert r["status"] == "ok" and r["ms"] > 0 and len(r["round_ms"]) == r["rounds"], r
    assert r["device"] and r["versions"]["jax"] and "bench.moe" in r["command"]
  assert by[("gmm", "fwd", "tokamax_mosaic")]["status"] in ("ok", "missing")
  moe.main(argv + ["--append"])
  assert len(load_rows(out)) == len(rows)  # every case already measured
