"""The benchmark grid's calls as dispatch sees them, and the default's decision for each:
``python -m tests.ops.attention.dispatch_grid`` rewrites ``tests/ops/attention/data/dispatch_grid.json``, which
``test_dispatch_grid.py`` compares against, so a restructure cannot move a decision silently."""

from __future__ import annotations

import itertools
import json
import pathlib

import jax.numpy as jnp

from probjax.ops.attention import masks as M
from probjax.ops.attention.dispatch import Device, explain_dispatch

PATH = pathlib.Path(__file__).parent / "data" / "dispatch_grid.json"
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
  out = {}
  for (dev, device), dtype, d, (b, tq, tk, h, hk), mask in itertools.product(
      DEVICES.items(), DTYPES, HEAD_DIMS, SHAPES, MASKS):
    decision = explain_dispatch((b, tq, h, d), (b, tk, hk, d), jnp.dtype(dtype),
                                mask=_mask(mask, b, tq, tk), device=device, env={})
    row = decision.as_dict()
    row["config"].pop("route", None)  # which cuDNN call runs depends on whether the FFI extension is built
    out[f"{dev} {dtype} D{d} B{b} Tq{tq} Tkv{tk} H{h}/{hk} {mask}"] = row
  return out


if __name__ == "__main__":
  PATH.parent.mkdir(exist_ok=True)
  rows = decisions()
  PATH.write_text("{\n" + ",\n".join(f"{json.dumps(k)}: {json.dumps(rows[k], sort_keys=True)}"
                                      for k in sorted(rows)) + "\n}\n")
  print(f"wrote {PATH}")
