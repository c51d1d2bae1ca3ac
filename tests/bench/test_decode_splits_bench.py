"""bench/decode_splits.py: its paths, its rows on CPU (the kernels refused, XLA timed) and resuming."""

import json

import pytest

from bench import decode_splits as ds
from probjax.ops.attention.backends.triton.config import SplitKVConfig


def test_paths_map_to_the_launch_they_name():
  assert ds.attention_kwargs("default") == {}
  assert ds.attention_kwargs("triton_nosplit") == {"implementation": "triton", "split_kv": False}
  assert ds.attention_kwargs("triton_s4")["split_kv"] == SplitKVConfig(num_splits=4)
  assert ds.attention_kwargs("triton_st3")["split_kv"] == SplitKVConfig(num_stages=3)
  assert ds.attention_kwargs("triton_k32")["split_kv"] == SplitKVConfig(block_k=32)
  assert len(set(ds.paths())) == len(ds.paths())
  with pytest.raises(ValueError, match="unknown path"):
    ds.attention_kwargs("triton_x1")


def test_rows_on_cpu_and_resume(tmp_path, capsys):
  out = tmp_path / "rows.json"
  assert ds.main(["--calls", "s4101#94", "--out", str(out), "--rounds", "1"]) == 0
  rows = [json.loads(line) for line in out.read_text().splitlines()]
  by = {r["impl"]: r for r in rows}
  assert set(by) == set(ds.paths()) and {r["call_id"] for r in rows} == {"s4101#94"}
  assert by["xla"]["status"] == "ok" and by["xla"]["ms"] > 0 and by["xla"]["tb_s"] > 0
  assert by["triton_s2"]["status"] == "unsupported" and "num_splits=2" in by["triton_s2"]["plan"]
  assert ds.main(["--calls", "s4101#94", "--out", str(out), "--rounds", "1"]) == 0  # resumes: nothing new
  assert len(out.read_text().splitlines()) == len(rows)
  with pytest.raises(SystemExit, match="not decoding"):
    ds.main(["--calls", "s4101#2", "--out", str(out)])
