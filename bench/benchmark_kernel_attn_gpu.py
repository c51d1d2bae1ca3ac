"""Short-sequence dispatch sweep, device memory peak / largest length, residuals.

  python -m bench.benchmark_kernel_attn_gpu --device gpu --suite dispatch    # -> bench/results/<device>/dispatch.json
  python -m bench.benchmark_kernel_attn_gpu --device gpu --suite peak        # -> max_len.json, peak.json
  python -m bench.benchmark_kernel_attn_gpu --device gpu --suite residuals   # -> residuals.json

dispatch: bf16, batch 64, 8 heads, non-causal fwd_bwd, T = 64..1024, head_dim
  32 and 64: probjax default (with its explain_dispatch) vs xla vs triton vs
  jax.nn cuDNN / XLA.
peak: per implementation, ONE FRESH SUBPROCESS runs fwd_bwd (bf16, head_dim 64,
  batch 4, 8 heads, non-causal) at T = 1024, 2048, ... doubling up to
  --max-len (default 131072) until it fails; each T gives a "peak" row (true
  device peak: jax memory_stats()['peak_bytes_in_use'] — monotone in T, so the
  ascending order gives each T's own peak — or torch.cuda.max_memory_allocated
  after a reset), and the impl gets one "max_len" row (largest T that ran).
residuals: bytes of the jax.vjp residuals and XLA's compile-time temporaries
  of one fwd_bwd (batch 2, 8 heads, head_dim 64).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time

from bench import harness, impls

DISPATCH_IMPLS = ("probjax_default", "probjax_xla", "probjax_triton", "jaxnn_cudnn", "jaxnn_xla")
PEAK_IMPLS = ("probjax_default", "probjax_xla", "jaxnn_xla", "jaxnn_cudnn", "tokamax_mosaic",
              "torch_sdpa_flash", "torch_sdpa_math")
RESIDUAL_IMPLS = ("probjax_default", "probjax_xla", "probjax_triton", "jaxnn_xla", "jaxnn_cudnn",
                  "tokamax_mosaic")


def explain(q_shape, kv_shape, dtype, causal):
  try:
    _, mod = impls.probjax_api()
    f = getattr(mod, "explain_dispatch")
  except Exception:  # noqa: BLE001
    return None
  try:
    kw = {"is_causal": True} if causal else {}
    try:
      r = f(q_shape, kv_shape, impls.jnp_dtype(dtype), **kw)
    except TypeError:
      import jax.numpy as jnp
      q = jnp.zeros(q_shape, impls.jnp_dtype(dtype))
      k = jnp.zeros(kv_shape, impls.jnp_dtype(dtype))
      r = f(q, k, k, **kw)
    return r if isinstance(r, (str, dict, list)) else str(r)
  except Exception as e:  # noqa: BLE001
    return f"explain_dispatch failed: {type(e).__name__}: {e}"[:300]


def dispatch_cases(args):
  timing = harness.timing_kwargs(args)
  if args.quick:
    dtype, b, h, lengths, dims = "float32", 2, 2, (64,), (16,)
    impl_list = ("probjax_default", "probjax_xla", "jaxnn_xla")
  else:
    dtype, b, h = harness.DTYPE_NAMES[args.dtype], 64, 8
    lengths, dims = (64, 128, 192, 256, 384, 512, 768, 1024), (32, 64)
    impl_list = DISPATCH_IMPLS
  shapes = [impls.shape(dtype, b, h, h, t, t, d, False, "fwd_bwd") for d in dims for t in lengths]

  def with_dispatch(c):  # the default's row also says what it picked (explain_dispatch)
    if c.impl != "probjax_default":
      return c
    run0, t, d = c.run, c.q_len, c.head_dim

    def run():
      res = run0()
      e = explain((b, t, h, d), (b, t, h, d), dtype, False)
      if e is not None:
        res["dispatch"] = e
      return res
    return dataclasses.replace(c, run=run)
  return [with_dispatch(c) for c in impls.timed_cases("dispatch", impl_list, shapes, timing)]


def residual_cases(args):
  dtype = "float32" if (args.quick or args.device == "cpu") else "bfloat16"
  b, h, d = (1, 2, 16) if args.quick else (2, 8, 64)
  lengths = (64,) if args.quick else (1024, 2048, 4096, 8192, 16384)
  impl_list = ("probjax_default", "probjax_xla", "jaxnn_xla") if args.quick else RESIDUAL_IMPLS
  cases = []
  for t in lengths:
    for impl in impl_list:
      cases.append(impls.memory_case("residuals", impl, dtype, b, h, h, t, d, _residuals))
  return cases


def _residuals(impl, arrays, dtype) -> dict:
  out = impls.residual_bytes(impl, arrays, dtype, False)
  try:
    out.update(impls.fwd_bwd_memory(impl, arrays, dtype))
  except Exception as e:  # noqa: BLE001 (the residual bytes stand without it)
    out["memory_analysis_error"] = str(e)[:300]
  return out


# ---------------------------------------------------------------------------
# peak: fresh subprocess per implementation
# ---------------------------------------------------------------------------
def _cheap_inputs(b, t, h, d):
  """Random [B, T, H, D] inputs made from one [1, T, 1, D] draw (fast at T = 131072)."""
  import numpy as np
  one = impls.inputs(1, t, t, 1, 1, d)
  return tuple(np.ascontiguousarray(np.broadcast_to(a, (b, t, h, d))) for a in one)


def _child_peak(spec: dict) -> None:
  """Runs in a fresh process; prints one JSON line per T."""
  impl, dtype, b, h, d = spec["impl"], spec["dtype"], spec["batch"], spec["heads"], spec["head_dim"]
  t = spec["start"]
  while t <= spec["max_len"]:
    rec = {"q_len": t}
    t0 = time.perf_counter()
    try:
      arrays = _cheap_inputs(b, t, h, d)
      if impl.startswith("torch"):
        import torch
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        fn, sync = impls.build(impl, arrays, dtype, False, "fwd_bwd")
        sync(fn())
        rec["peak_bytes"] = int(torch.cuda.max_memory_allocated())
        rec["peak_source"] = "torch.cuda.max_memory_allocated"
      else:
        import jax
        fn, sync = impls.build(impl, arrays, dtype, False, "fwd_bwd")
        sync(fn())
        stats = jax.devices()[0].memory_stats() or {}
        if "peak_bytes_in_use" in stats:
          rec["peak_bytes"] = int(stats["peak_bytes_in_use"])
          rec["peak_source"] = "jax memory_stats peak_bytes_in_use"
      rec["status"] = "ok"
    except Exception as e:  # noqa: BLE001
      rec["status"], rec["error"] = harness.classify_error(e)
    rec["wall_s"] = time.perf_counter() - t0
    fn = sync = arrays = None
    impls.free_memory()
    print("PEAKROW " + json.dumps(rec), flush=True)
    if rec["status"] != "ok":
      break
    t *= 2


def peak_cases(args):
  if args.quick:
    spec0 = {"dtype": "float32", "batch": 1, "heads": 2, "head_dim": 16, "start": 64, "max_len": 128}
    impl_list = ("probjax_default", "jaxnn_xla")
  else:
    spec0 = {"dtype": harness.DTYPE_NAMES[args.dtype], "batch": 4, "heads": 8, "head_dim": 64,
             "start": 1024, "max_len": args.max_len}
    impl_list = PEAK_IMPLS
  cases = []
  for impl in impl_list:
    spec = dict(spec0, impl=impl)

    def run(spec=spec):
      env = dict(os.environ)
      env.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
      if spec["impl"].startswith("torch"):  # JAX only draws the inputs there: none of the GPU
        env["JAX_PLATFORMS"] = "cpu"
      cmd = [sys.executable, "-m", "bench.benchmark_kernel_attn_gpu", "--child-peak",
             json.dumps(spec)]
      try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=args.child_timeout, env=env,
                           cwd=os.getcwd())
        out, err, timed_out = p.stdout, p.stderr, False
      except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        err, timed_out = "timeout", True
      recs = [json.loads(l[8:]) for l in out.splitlines() if l.startswith("PEAKROW ")]
      if not recs:
        return {"status": "error", "error": f"child produced no rows: {err[-1500:]}"}
      sub = []
      for r in recs:
        sub.append(dict(r))
      ok = [r["q_len"] for r in recs if r["status"] == "ok"]
      res = {"max_len": max(ok) if ok else None, "search_max": spec["max_len"],
             "per_length": sub, "timed_out": timed_out}
      res["status"] = "ok" if ok else recs[0]["status"]
      if not ok:
        res["error"] = recs[0].get("error")
      if recs[-1]["status"] != "ok":
        res["stopped_by"] = {"q_len": recs[-1]["q_len"], "status": recs[-1]["status"],
                             "error": (recs[-1].get("error") or "")[:500]}
      return res
    cases.append(harness.Case(suite="max_len", impl=impl, dtype=spec["dtype"], batch=spec["batch"],
                              q_heads=spec["heads"], kv_heads=spec["heads"], q_len=spec["start"],
                              kv_len=spec["start"], head_dim=spec["head_dim"], causal=False,
                              mode="fwd_bwd", run=run, flops=False))
  return cases


def expand_peak_rows(row: dict, output: str) -> None:
  """Writes one 'peak' row per length from a max_len row's per_length list (replacing the
  rows of those keys in ``output``)."""
  rows = []
  for r in row.get("per_length", []) or []:
    pr = {k: v for k, v in row.items() if k not in ("per_length", "max_len", "search_max",
                                                    "stopped_by", "timed_out", "error")}
    pr.update(suite="peak", q_len=r["q_len"], kv_len=r["q_len"], status=r["status"], ms=None,
              wall_s=r.get("wall_s"))
    for k in ("peak_bytes", "peak_source", "error"):
      if k in r:
        pr[k] = r[k]
    if pr["status"] == "ok" and "peak_bytes" not in pr:
      pr["status"], pr["error"] = "unsupported", "device reports no peak memory statistics"
    rows.append(pr)
  harness.replace_rows(output, rows)


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--child-peak", default=None, help=argparse.SUPPRESS)
  if argv is None and "--child-peak" in sys.argv:
    a, _ = p.parse_known_args()
    _child_peak(json.loads(a.child_peak))
    return 0
  harness.add_common_args(p)
  p.add_argument("--device", default="gpu", choices=("gpu", "cpu"))
  p.add_argument("--suite", default="dispatch", help="dispatch, peak, residuals (comma-separated)")
  p.add_argument("--dtype", default="bf16")
  p.add_argument("--max-len", type=int, default=131072)
  p.add_argument("--child-timeout", type=float, default=400)
  args = p.parse_args(argv)
  cases = harness.select_cases(args.suite, {"dispatch": lambda: dispatch_cases(args),
                                            "residuals": lambda: residual_cases(args),
                                            "peak": lambda: peak_cases(args)})
  peak_out = lambda: args.output or harness.results_file("peak", args.results_dir)
  harness.run_cases(cases, args, on_row=lambda r: expand_peak_rows(r, peak_out())
                    if r["suite"] == "max_len" else None)
  return 0


if __name__ == "__main__":
  sys.exit(main())
