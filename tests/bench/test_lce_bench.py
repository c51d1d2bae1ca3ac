"""bench/linear_cross_entropy.py runs end to end on a tiny case (memory and times; the Triton
kernels in interpret mode)."""

import json

from bench import linear_cross_entropy as lce


def test_smoke(tmp_path):
  out = tmp_path / "lce.json"
  assert lce.main(["--smoke", "--repeats", "2", "--output", str(out)]) == 0
  rows = [json.loads(l) for l in out.read_text().splitlines()]
  assert {r["impl"] for r in rows} == {"fused", "triton", "unfused"}  # triton in interpret mode
  assert all(r["temp_bytes"] is not None and r["ms"] > 0 and r["commit"] for r in rows)
