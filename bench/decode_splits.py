"""The Triton split-KV decode kernel's launch on drawn decoding calls: the default, cuDNN, XLA and
the Triton kernel under each forced split count and tile, timed in one process.

The measured dispatch found few-query decoding calls where the split-KV kernel reads the cache
at a fraction of the bandwidth the same calls reach through cuDNN or XLA (docs/dev/decisions.md,
"Measured dispatch"); this sweep says whether its launch (splits, key tile, stages) or the kernel
is the limit, call by call:

  python -m bench.decode_splits --calls s4101#10,s4101#48 --out PATH [--budget-s S]

``--calls``: call ids of :mod:`bench.dispatch_sample`'s sampler (``s<seed>#<index>``), decoding
calls (at most 64 queries). Paths (:func:`paths`): ``default``, ``cudnn``, ``xla``, ``triton``
(its automatic plan), ``triton_nosplit`` (``split_kv=False``, the regular forward),
``triton_s<N>`` (``SplitKVConfig(num_splits=N)``), ``triton_k<K>`` (``block_k=K``) and
``triton_st<S>`` (``num_stages=S``). The runner is :func:`bench.dispatch_core.run_calls`, as for
the dispatch samples: a batch's (call, path) cases compiled on worker threads, then each call
timed alone, its paths in rotating rounds; resumes from ``--out``; no batch started past the
budget. Rows (JSON lines, ``suite`` "decode_splits", key ``(call_id, impl)``):
``bench.harness.make_row``'s fields with ``impl`` the path, the call's draw, ``tb_s`` (the
visible cache's K and V bytes read once over the time, the decode pages' convention) and
``launch`` (the split-KV config the Triton path ran; None: the regular forward).
"""

from __future__ import annotations

import argparse

from bench import dispatch_core as core
from bench import dispatch_sample as ds

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


def cache_bytes(c: ds.SampledCall) -> float:
  """K and V bytes the call must read once: the visible keys of each sequence (16-bit)."""
  keys = ds.visible_keys(c.q_len, c.kv_len, c.mask, c.window, c.kv_lengths)
  return c.batch * keys * c.kv_heads * 2 * c.head_dim * 2


def launch(c: ds.SampledCall, path: str) -> str | None:
  """The split-KV config a Triton path runs on an sm_90 device (None: the regular forward);
  ValueError where the forced config cannot take the call."""
  from probjax.ops.attention.backends.triton import decode
  cfg = decode.plan(ds.shapes(c)[0], ds.shapes(c)[1], ds.jnp_dtype(c.dtype), mask=ds.make_mask(c), score_mod=None,
                    split_kv=attention_kwargs(path).get("split_kv"), device="sm_90")
  return None if cfg is None else str(cfg)


class DecodeSplitsSpec(ds.AttentionSpec):
  """:class:`bench.dispatch_sample.AttentionSpec` over :func:`paths` instead of the exact
  implementations."""
  suite = SUITE

  def plan(self, c, device) -> dict:
    from probjax.ops.attention import explain_dispatch
    out = {}
    for p in paths():
      kw = attention_kwargs(p)
      try:
        if p.startswith("triton"):
          launch(c, p)
        out[p] = explain_dispatch(*ds.shapes(c)[:2], ds.jnp_dtype(c.dtype), mask=ds.make_mask(c),
                                  implementation=kw.get("implementation"), device=device)
      except Exception as e:  # noqa: BLE001 (refused: the row's status)
        out[p] = core.refusal(e)
    return out

  def function(self, c, path):
    from probjax.ops.attention import dot_product_attention
    mask, kw = ds.make_mask(c), attention_kwargs(path)
    return (lambda q, k, v: dot_product_attention(q, k, v, mask=mask, **kw)), (0, 1, 2)

  def row_name(self, path) -> str:
    return path

  def row(self, c, plan, path, result, status, error) -> dict:
    from bench import harness
    row = harness.make_row(ds.row_case(c, path, SUITE), result, status, error)
    ms = row.get("ms")
    own = plan.get(path)
    row.update(call_id=c.call_id, seed=c.seed, index=c.index, kind=c.kind, window=c.window,
               kv_lengths=None if c.kv_lengths is None else list(c.kv_lengths),
               tb_s=None if not ms else cache_bytes(c) / ms / 1e9,
               launch=launch(c, path) if path.startswith("triton") and status == "ok" else None,
               decision=None if isinstance(own, core.Refused) else str(own),
               default_impl=core.impl_of(plan.get("default")),
               jax_version=row.get("versions", {}).get("jax"))
    return row

  def summary_line(self, rows: list[dict]) -> str:
    return core.summary_line(rows, "default")


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--calls", required=True, help="comma-separated call ids, s<seed>#<index>")
  p.add_argument("--out", required=True)
  p.add_argument("--rounds", type=int, default=3)
  p.add_argument("--budget-s", type=float, default=None)
  p.add_argument("--compile-workers", type=int, default=core.DEFAULT_WORKERS)
  args = p.parse_args(argv)
  calls = [ds.draw_call(*parse_call_id(cid)) for cid in args.calls.split(",")]
  bad = [c.call_id for c in calls if c.q_len > 64]
  if bad:
    raise SystemExit(f"--calls: not decoding calls (more than 64 queries): {bad}")
  stats = core.run_calls(DecodeSplitsSpec(), calls, args.out, rounds=args.rounds, budget_s=args.budget_s,
                         workers=args.compile_workers)
  print(stats)
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
