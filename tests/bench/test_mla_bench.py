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
    if r["impl"] in ("jaxnn_cudnn_padded_v", "attention_triton", "attention_mosaic", "attention_mosaic_bwd",
                     "attention_cudnn"):
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
    assert r["compiled_total_bytes"] >= r["argument_bytes"] > 0 and r["temp_bytes"] >= 0, r   # the program's memory
  assert all(r["mode"] in ("fwd", "fwd_bwd") for r in rows)
  decode = [r for r in rows if r["suite"] == "decode"]
  assert {r["impl"] for r in decode} >= {"mla_absorbed", "mla_expanded"} and all(r["read_floor_ms"] > 0 for r in decode)
  assert "absorbed" in by[next(k for k in by if k[3] == "mla_absorbed")]["dispatch"]
  bench_mla.main(argv)
  assert len(load_rows(out)) == len(rows)  # every case already measured


def test_issue_decode_command_on_cpu(tmp_path):
  """The issue's decode command (shapes, 1/2/4 queries, the kernels alone, the default and the
  absorbed XLA form) at tiny sizes: every row, TB/s and FLOPs by the stated convention."""
  out = str(tmp_path / "mla.json")
  bench_mla.main(["--cpu-smoke", "--suite", "decode", "--decode-shapes", "2x40,3x64", "--decode-queries", "1,2,4",
                  "--impl", "mosaic_kernel,triton_kernel,attention_mqa_xla,mla_absorbed", "--repeats", "1",
                  "--output", out])
  rows = load_rows(out)
  z = bench_mla.SMOKE
  assert len(rows) == 2 * 3 * 4
  for r in rows:
    if r["impl"] in ("mosaic_kernel", "triton_kernel"):
      assert r["status"] == "unsupported", r   # GPU kernels
      continue
    assert r["status"] == "ok", r
    b, tq, s = (int(r["case"].split()[i].lstrip("BTqcache")) for i in (0, 2, 3))
    width = z.d_c + z.d_rope
    assert r["read_bytes"] == b * s * width * 4   # float32 smoke: latent + rope read once
    assert r["flops"] == 2.0 * b * z.dec_heads * tq * s * (width + z.d_c)
    assert abs(r["tb_per_s"] - r["read_bytes"] / (r["ms"] * 1e-3) / 1e12) < 1e-12
    assert r["compiled_total_bytes"] > 0
