"""bench/norm.py runs end to end on tiny cases (the Triton kernels in interpret mode), resumes by
row key, and its rows make the norm page (bench/ops_pages.py) once they exist."""

import json

from bench import harness, ops_pages
from bench import norm as bench_norm

CASES = "lm/rms_residual,dit/adaln,lm/qk"


def test_smoke_rows_and_resume(tmp_path):
  out = tmp_path / "norm.json"
  argv = ["--smoke", "--no-progress", "--cases", CASES, "--output", str(out)]
  bench_norm.main(argv)
  rows = [json.loads(l) for l in out.read_text().splitlines()]
  assert {bench_norm.row_key(r) for r in rows} == {(c, i, m, "bfloat16") for c in CASES.split(",")
                                                     for i in bench_norm.IMPLS for m in bench_norm.MODES}
  for r in rows:
    assert r["status"] == "ok" and r["ms"] > 0 and r["gb_s"] > 0 and r["commit"] and r["versions"]["jax"], r
    assert r["interpret"] and "bench.norm" in r["command"] and r["bytes_convention"] == bench_norm.BYTES_CONVENTION
    assert r["implementation"] == ("xla" if r["impl"] == "default" else r["impl"])  # XLA: no validated rule for the kernels
    assert r["impl"] == bench_norm.REF or r["check"] == "ok", r
  by = {bench_norm.row_key(r): r for r in rows}
  res = by["lm/rms_residual", "xla", "fwd", "bfloat16"]
  x = 2 * 16 * 48 * 2                        # bf16 [2, 16, 48]
  assert res["bytes"] == 4 * x + 48 * 4      # x, residual, scale [d] float32 read; y, h written
  # fwd_bwd: also the cotangents of y and h read, the gradients of x, residual and scale written
  assert by["lm/rms_residual", "xla", "fwd_bwd", "bfloat16"]["bytes"] == 2 * res["bytes"]
  qk = by["lm/qk", "xla", "fwd", "bfloat16"]
  assert qk["rows"] == 2 * 9 * 3 and qk["heads"] == 3
  xq = 2 * 9 * 3 * 24 * 2                    # bf16 [2, 9, 3, 24]
  assert qk["bytes"] == 2 * xq + 24 * 4 + 2 * 9 * 4   # x, scale, int32 positions read; y written
  # fwd_bwd differentiates x and scale (not the positions): y's cotangent read, dx and dscale written
  assert by["lm/qk", "xla", "fwd_bwd", "bfloat16"]["bytes"] == 4 * xq + 2 * 24 * 4
  bench_norm.main(argv + ["--append"])
  assert harness.load_rows(str(out)) == rows   # every key already measured
  assert harness.OWN_SCHEMA_KEYS.get("norm", bench_norm.KEY) == bench_norm.KEY


def test_the_norm_page_only_once_measured(tmp_path):
  results, docs = tmp_path / "results", tmp_path / "docs"
  docs.mkdir()
  ops_pages.build(str(results), str(docs))
  assert not (docs / "norm-performance.md").exists()
  base = dict(suite="norm", case="lm/rms", mode="fwd", dtype="bfloat16", device="Some GPU",
              command="python -m bench.norm", commit="abc1234", bytes=100)
  (results / "some_gpu").mkdir(parents=True)
  (results / "some_gpu" / "norm.json").write_text("".join(json.dumps(r) + "\n" for r in (
      dict(base, impl="default", status="ok", ms=2.0, gb_s=50.0),
      dict(base, impl="triton", status="ok", ms=1.0, gb_s=100.0),
      dict(base, impl="xla", status="ok", ms=2.0, gb_s=50.0))))
  ops_pages.build(str(results), str(docs))
  text = (docs / "norm-performance.md").read_text()
  assert "### fwd · bf16" in text and "| lm/rms | 2.00 | 1.00 | 2.00 | 2.00 | 50 |" in text, text
