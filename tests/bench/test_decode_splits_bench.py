"""bench/decode_splits.py: its paths and launches, its rows on CPU (the kernels refused, XLA
timed) and resuming."""

import json

import pytest

from bench import decode_splits as ds
from bench.dispatch_sample import draw_call
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
  c = draw_call(4101, 10)  # one query, 48 heads over 6 K/V heads, 7661 keys
  assert "num_splits=2" in ds.launch(c, "triton_s2") and "block_k=32" in ds.launch(c, "triton_k32")
  assert ds.launch(c, "triton_nosplit") is None


def test_rows_on_cpu_and_resume(tmp_path):
  out = tmp_path / "rows.json"
  argv = ["--calls", "s4101#94", "--out", str(out), "--rounds", "1", "--compile-workers", "1"]
  assert ds.main(argv) == 0
  rows = [json.loads(line) for line in out.read_text().splitlines()]
  by = {r["impl"]: r for r in rows}
  assert set(by) == set(ds.paths()) and {r["call_id"] for r in rows} == {"s4101#94"}
  assert by["xla"]["status"] == "ok" and by["xla"]["ms"] > 0 and by["xla"]["tb_s"] > 0
  assert by["default"]["status"] == "ok" and by["default"]["suite"] == "decode_splits"
  assert {r["default_impl"] for r in rows} == {"xla"}  # what the default runs, on every row
  assert by["triton_s2"]["status"] == "unsupported" and by["triton_s2"]["launch"] is None
  assert ds.main(argv) == 0  # resumes: nothing new
  assert len(out.read_text().splitlines()) == len(rows)
  with pytest.raises(SystemExit, match="not decoding"):
    ds.main(["--calls", "s4101#2", "--out", str(out)])
