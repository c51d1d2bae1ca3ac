"""The Triton split-KV decode kernel's launch on drawn decoding calls: the default, cuDNN, XLA and
the Triton kernel under each forced split count and tile, timed in one process.

The measured dispatch found few-query decoding calls where the split-KV kernel reads the cache
at a fraction of the bandwidth the same calls reach through cuDNN or XLA (docs/dev/decisions.md,
"Measured dispatch"); this sweep says whether its launch (splits, key tile, stages) or the kernel
is the limit, call by call:

  python -m bench.decode_splits --calls s4101#10,s4101#48 --out PATH [--budget-s S]

``--calls``: call ids of :mod:`bench.dispatch_sample`'s sampler (``s<seed>#<index>``), decoding
calls (at most 64 queries). Paths: ``default``, ``cudnn``, ``xla``, ``triton`` (its automatic
plan), ``triton_s<N>`` (``SplitKVConfig(num_splits=N)``), ``triton_k<K>`` (``block_k=K``),
``triton_st<S>`` (``num_stages=S``) and ``triton_nosplit`` (``split_kv=False``, the regular
forward). Every path of a call is compiled first, then timed in ``--rounds`` rotating rounds
(:func:`probjax.core.timing.time_fn` each); the row's ``ms`` is the median of its rounds'
medians. Rows (JSON lines, ``suite`` "decode_splits", key ``(call_id, impl)``): the call's
draw, ``ms``, ``round_ms``, ``tb_s`` (bytes of the visible cache read once, K and V, over the
time: the convention of the decode pages), ``plan`` (the launch the Triton path ran), status,
device, versions, commit, command. A resumed run skips the rows already in ``--out``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import time

SUITE = "decode_splits"
SPLITS = (1, 2, 4, 8, 16)
BLOCK_K = (32, 128)
STAGES = (1, 3)


def paths() -> list[str]:
  """Every path a call is timed on, in timing order."""
  return (["default", "cudnn", "xla", "triton", "triton_nosplit"] + [f"triton_s{n}" for n in SPLITS]
          + [f"triton_k{k}" for k in BLOCK_K] + [f"triton_st{s}" for s in STAGES])


def attention_kwargs(path: str) -> dict:
  """``dot_product_attention``'s keyword arguments for a path."""
  from probjax.ops.attention.backends.triton.config import SplitKVConfig
  if path == "default":
    return {}
  if path in ("cudnn", "xla", "triton"):
    return {"implementation": path}
  if path == "triton_nosplit":
    return {"implementation": "triton", "split_kv": False}
  for prefix, field in (("triton_st", "num_stages"), ("triton_s", "num_splits"), ("triton_k", "block_k")):
    if path.startswith(prefix):
      return {"implementation": "triton", "split_kv": SplitKVConfig(**{field: int(path[len(prefix):])})}
  raise ValueError(f"unknown path {path!r}")


def parse_call_id(cid: str) -> tuple[int, int]:
  seed, index = cid.lstrip("s").split("#")
  return int(seed), int(index)


def cache_bytes(c) -> float:
  """K and V bytes the call must read once: the visible keys of each sequence."""
  from bench.dispatch_sample import visible_keys
  itemsize = 2
  keys = visible_keys(c.q_len, c.kv_len, c.mask, c.window, c.kv_lengths)
  return c.batch * keys * c.kv_heads * 2 * c.head_dim * itemsize


def triton_plan(c, path: str) -> str | None:
  """The split-KV launch a Triton path runs (None: the regular forward)."""
  from probjax.ops.attention.backends.triton import decode
  from bench.dispatch_sample import _dtype, make_mask
  kw = attention_kwargs(path)
  try:
    cfg = decode.plan((c.batch, c.q_len, c.q_heads, c.head_dim), (c.batch, c.kv_len, c.kv_heads, c.head_dim),
                      _dtype(c.dtype), mask=make_mask(c), score_mod=None, split_kv=kw.get("split_kv"),
                      device="sm_90")
  except ValueError as e:
    return f"refused: {e}"
  return None if cfg is None else str(cfg)


def measure(calls, out: str, *, rounds: int, budget_s: float) -> int:
  import jax
  from bench import harness
  from bench.dispatch_core import environment
  from bench.dispatch_sample import make_inputs, make_mask
  from probjax.core import timing
  from probjax.ops.attention import dot_product_attention
  done = set()
  if os.path.exists(out):
    done = {(r.get("call_id"), r.get("impl")) for r in harness.load_rows(out) if isinstance(r, dict)}
  env = environment()
  t_start, written = time.monotonic(), 0
  for c in calls:
    if time.monotonic() - t_start > budget_s:
      print(f"[decode_splits] budget spent; stopping before {c.call_id}", flush=True)
      break
    todo = [p for p in paths() if (c.call_id, p) not in done]
    if not todo:
      continue
    q, k, v = make_inputs(c)
    mask = make_mask(c)
    fns, status = {}, {}
    for p in todo:
      f = jax.jit(lambda q, k, v, kw=attention_kwargs(p): dot_product_attention(q, k, v, mask=mask, **kw))
      try:
        jax.block_until_ready(f(q, k, v))
        fns[p] = f
      except Exception as e:  # noqa: BLE001 (a refused or failing path is its row's status)
        status[p] = timing.classify_error(e)
    round_ms = {p: [] for p in fns}
    for _ in range(rounds):
      for p, f in fns.items():
        res = timing.time_fn(lambda f=f: f(q, k, v), jax.block_until_ready)
        round_ms[p].append(res["ms"])
    nbytes = cache_bytes(c)
    with open(out, "a") as fh:
      for p in todo:
        ms = statistics.median(round_ms[p]) if p in round_ms else None
        row = {"suite": SUITE, "call_id": c.call_id, "impl": p, **dataclasses.asdict(c),
               "ms": ms, "round_ms": round_ms.get(p), "tb_s": None if ms is None else nbytes / ms / 1e9,
               "plan": triton_plan(c, p) if p.startswith("triton") else None,
               "status": "ok" if p in fns else status[p][0], "error": None if p in fns else status[p][1],
               **env, "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        fh.write(json.dumps(row) + "\n")
        written += 1
    best = min(((round_ms[p] and statistics.median(round_ms[p])), p) for p in round_ms) if round_ms else None
    print(f"[decode_splits] {c.call_id} B{c.batch} H{c.q_heads}/{c.kv_heads} T{c.q_len}/{c.kv_len} "
          f"D{c.head_dim} {c.mask}: " + " ".join(f"{p}={statistics.median(round_ms[p]):.3f}" for p in round_ms)
          + (f" best {best[1]}" if best else "") + f" [{time.monotonic() - t_start:.0f} s]", flush=True)
  return written


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--calls", required=True, help="comma-separated call ids, s<seed>#<index>")
  p.add_argument("--out", required=True)
  p.add_argument("--rounds", type=int, default=3)
  p.add_argument("--budget-s", type=float, default=300.0)
  args = p.parse_args(argv)
  from bench.dispatch_sample import draw_call
  calls = [draw_call(*parse_call_id(cid)) for cid in args.calls.split(",")]
  bad = [c.call_id for c in calls if c.q_len > 64]
  if bad:
    raise SystemExit(f"--calls: not decoding calls (more than 64 queries): {bad}")
  n = measure(calls, args.out, rounds=args.rounds, budget_s=args.budget_s)
  print(f"[decode_splits] {n} rows -> {args.out}")
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
