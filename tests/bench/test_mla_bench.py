"""bench/mla.py runs end to end on CPU (``--cpu-smoke``: tiny sizes) and resumes."""

import pytest

from bench import mla as bench_mla
from bench.harness import load_rows


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_cpu_smoke_and_resume(tmp_path):
  out = str(tmp_path / "mla.json")
  argv = ["--cpu-smoke", "--output", out]
  bench_mla.main(argv)
  rows = load_rows(out)
  by = {(r["suite"], r["case"], r["mode"], r["impl"]): r for r in rows}
  assert {r["suite"] for r in rows} == {"expanded", "decode"}
  assert len({r["case"] for r in rows if r["suite"] == "expanded"}) == 2   # causal and not
  for key, r in by.items():
    if r["impl"] in ("jaxnn_cudnn_padded_v", "attention_triton", "attention_mosaic", "attention_cudnn"):
      assert r["status"] in ("ok", "unsupported", "error"), r   # the kernels need a GPU
      continue
    if r["impl"] in ("mla_triton", "triton_paged", "triton_kernel"):
      assert r["status"] in ("ok", "unsupported"), r   # the smoke sizes' d_rope is no multiple of 16
      continue
    if r["impl"] in ("mla_mosaic", "mosaic_paged", "mosaic_kernel", "mosaic_kernel_own_scores"):
      assert r["status"] == "unsupported", r   # float32 smoke sizes: the Mosaic kernel takes 16-bit, d_rope 64
      continue
    assert r["status"] == "ok" and r["ms"] > 0 and r["tflops"] > 0, r
    assert r["device"] and r["versions"]["jax"] and "bench.mla" in r["command"]
  assert all(r["mode"] in ("fwd", "fwd_bwd") for r in rows)
  decode = [r for r in rows if r["suite"] == "decode"]
  assert {r["impl"] for r in decode} >= {"mla_absorbed", "mla_expanded"} and all(r["read_floor_ms"] > 0 for r in decode)
  assert "absorbed" in by[next(k for k in by if k[3] == "mla_absorbed")]["dispatch"]
  bench_mla.main(argv)
  assert len(load_rows(out)) == len(rows)  # every case already measured
