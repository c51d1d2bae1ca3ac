"""bench/linear_cross_entropy.py runs end to end on a tiny case (memory and times; the Triton
kernels in interpret mode)."""

import json

import pytest

from bench import linear_cross_entropy as lce


def test_smoke(tmp_path):
  out = tmp_path / "lce.json"
  assert lce.main(["--smoke", "--repeats", "2", "--output", str(out)]) == 0
  rows = [json.loads(l) for l in out.read_text().splitlines()]
  assert {r["impl"] for r in rows} == {"fused", "triton", "unfused"}  # triton in interpret mode
  assert all(r["temp_bytes"] is not None and r["ms"] > 0 and r["commit"] for r in rows)


def test_tiles_add_rows(tmp_path):
  out = tmp_path / "lce.json"
  assert lce.main(["--smoke", "--memory-only", "--tiles", "64x256,128x1000", "--output", str(out)]) == 0
  rows = {r["impl"]: r for r in map(json.loads, out.read_text().splitlines())}
  assert {"fused", "fused_64x256", "fused_128x1000", "unfused"} <= set(rows)
  # a smaller tile needs less temporary memory than the whole-vocabulary one
  assert rows["fused_64x256"]["temp_bytes"] < rows["fused_128x1000"]["temp_bytes"]
  with pytest.raises(ValueError, match="--tiles"):
    lce.parse_tiles("4096")
