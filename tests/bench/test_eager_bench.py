"""bench.eager: rows of eager and jitted calls, keyed by (case, impl), replaced on a re-run."""

import json

import pytest

from bench import eager


def test_rows_and_replacement(tmp_path):
  out = tmp_path / "eager.json"
  rows = eager.main(["--cases", "grouped_matmul", "--rounds", "2", "--output", str(out)])
  assert [(r["case"], r["impl"]) for r in rows] == [("grouped_matmul", "eager"), ("grouped_matmul", "jit")]
  e, j = rows
  assert e["ms"] > 0 and j["ms"] > 0 and e["ratio"] == pytest.approx(e["ms"] / j["ms"], rel=1e-2)
  assert e["goal_ratio"] == eager.GOAL_RATIO and "device" in e and "commit" in e
  eager.main(["--cases", "grouped_matmul", "--rounds", "2", "--output", str(out)])
  assert len([json.loads(line) for line in out.read_text().splitlines()]) == 2


def test_unknown_case_is_refused():
  with pytest.raises(SystemExit):
    eager.main(["--cases", "nope"])
