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
  assert lce.main(["--smoke", "--memory-only", "--tiles", "64x256,128xall,32x4096", "--output", str(out)]) == 0
  rows = {r["impl"]: r for r in map(json.loads, out.read_text().splitlines())}
  assert {"fused", "fused_64x256", "fused_128xall", "fused_32xall", "unfused"} <= set(rows)
  # a vocabulary part covering the vocabulary (all, or 4096 >= 1000) runs the gradients in the
  # forward sweep, and the row says so; a smaller one the per-token scheme
  assert rows["fused_128xall"]["grad_in_forward"] and rows["fused_32xall"]["grad_in_forward"]
  assert rows["fused_64x256"]["grad_in_forward"] is False and rows["unfused"]["grad_in_forward"] is None
  # a smaller tile needs less temporary memory than the whole-vocabulary one
  assert rows["fused_64x256"]["temp_bytes"] < rows["fused_128xall"]["temp_bytes"]
  assert lce.parse_tiles("1024xall, 64x256") == [(1024, None), (64, 256)]
  for bad in ("4096", "allx64", "0xall"):
    with pytest.raises(ValueError, match="--tiles"):
      lce.parse_tiles(bad)
