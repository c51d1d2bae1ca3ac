"""The benchmark grid's calls as dispatch sees them, and the default's decision for each:
``python -m tests.ops.attention.dispatch_grid --reason "..."`` rewrites
``tests/ops/attention/data/dispatch_grid.json``, which ``test_dispatch_grid.py`` compares against,
so a restructure cannot move a decision silently, and appends to ``dispatch_grid_changes.json``
what moved (counts of old -> new implementation, a few examples) with the reason given: the
measurement behind the change (an entry of docs/dev/decisions.md and its results rows). The
test checks that the grid file is the one the last change recorded."""

from __future__ import annotations

import argparse
import collections
import hashlib
import itertools
import json
import pathlib
from unittest import mock

import jax.numpy as jnp

from probjax.ops.attention import masks as M
from probjax.ops.attention.dispatch import Device, explain_dispatch

PATH = pathlib.Path(__file__).parent / "data" / "dispatch_grid.json"
CHANGES = pathlib.Path(__file__).parent / "data" / "dispatch_grid_changes.json"
DEVICES = {"h200": Device("gpu", (9, 0), 140 << 30), "rtx3090": Device("gpu", (8, 6), 24 << 30)}
DTYPES = ("bfloat16", "float16", "float32")
HEAD_DIMS = (32, 64, 128, 256)
# (batch, q_len, kv_len, heads, kv_heads): the grid, odd lengths, GQA, decoding.
SHAPES = ((4, 1024, 1024, 8, 8), (4, 2048, 2048, 8, 8), (4, 3000, 3000, 8, 8), (4, 4096, 4096, 8, 8),
          (2, 8192, 8192, 8, 8), (1, 16384, 16384, 8, 8), (4, 600, 600, 8, 8), (64, 128, 128, 8, 8),
          (1, 4096, 4096, 32, 8), (1, 16384, 16384, 32, 8), (8, 1, 4096, 32, 8), (8, 16, 65536, 32, 8),
          (1, 256, 16384, 8, 8))
MASKS = ("none", "causal", "causal_offset", "window", "window_right", "kv_len", "segments", "causal&kv_len")


def _mask(name, b, tq, tk):
  lens = jnp.full((b,), tk, jnp.int32)
  ids = lambda n: jnp.zeros((b, n), jnp.int32)
  return {"none": None, "causal": M.CausalMask(), "causal_offset": M.CausalMask(tk - tq),
          "window": M.LocalWindowMask(256, 0), "window_right": M.LocalWindowMask(256, 64),
          "kv_len": M.KVLenMask(lens), "segments": M.SegmentMask(ids(tq), ids(tk)),
          "causal&kv_len": M.CausalMask() & M.KVLenMask(lens)}[name]


def decisions() -> dict[str, dict]:
  """Every grid call's decision, as on a machine where probjax's cuDNN FFI extension is built (the
  GPU machines the table was measured on): whether it is built here must not move a decision
  (head_dims above 128 reach cuDNN only through it)."""
  from probjax.ops.attention.backends.cudnn import ffi
  with mock.patch.object(ffi, "unavailable", lambda env=None: None):
    return _decisions()


def _decisions() -> dict[str, dict]:
  out = {}
  for (dev, device), dtype, d, (b, tq, tk, h, hk), mask in itertools.product(
      DEVICES.items(), DTYPES, HEAD_DIMS, SHAPES, MASKS):
    decision = explain_dispatch((b, tq, h, d), (b, tk, hk, d), jnp.dtype(dtype),
                                mask=_mask(mask, b, tq, tk), device=device, env={})
    row = decision.as_dict()
    row["config"].pop("route", None)  # which cuDNN call runs depends on whether the FFI extension is built
    out[f"{dev} {dtype} D{d} B{b} Tq{tq} Tkv{tk} H{h}/{hk} {mask}"] = row
  return out


def grid_text(rows: dict[str, dict]) -> str:
  return "{\n" + ",\n".join(f"{json.dumps(k)}: {json.dumps(rows[k], sort_keys=True)}" for k in sorted(rows)) + "\n}\n"


def digest(text: str) -> str:
  return hashlib.sha256(text.encode()).hexdigest()


def moved(old: dict[str, dict], new: dict[str, dict]) -> dict:
  """What changed between two grids: counts of ``old -> new`` implementation (``=`` where only
  the rule, backward or config moved), keys added or removed, and up to five examples."""
  keys = sorted(k for k in old.keys() & new.keys() if old[k] != new[k])
  counts = collections.Counter(
      f"{old[k]['implementation']} -> {new[k]['implementation']}"
      if old[k]["implementation"] != new[k]["implementation"] else f"= {new[k]['implementation']}" for k in keys)
  return {"moved": len(keys), "by_implementation": dict(sorted(counts.items())),
          "added": len(new.keys() - old.keys()), "removed": len(old.keys() - new.keys()), "examples": keys[:5]}


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--reason", required=True,
                 help="why the decisions moved: the measurement (docs/dev/decisions.md entry, results rows)")
  args = p.parse_args(argv)
  old = json.loads(PATH.read_text()) if PATH.exists() else {}
  rows = decisions()
  text = grid_text(rows)
  changes = json.loads(CHANGES.read_text()) if CHANGES.exists() else []
  changes.append({"sha256": digest(text), "reason": args.reason, **moved(old, rows)})
  PATH.parent.mkdir(exist_ok=True)
  PATH.write_text(text)
  CHANGES.write_text(json.dumps(changes, indent=1) + "\n")
  print(f"wrote {PATH} ({changes[-1]['moved']} decisions moved) and {CHANGES}")
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
