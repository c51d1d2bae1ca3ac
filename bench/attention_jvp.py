"""GPU benchmark of forward-mode AD through attention: ``jax.jvp`` and ``jax.grad`` of a ``jax.jvp``.

Modes (``--modes``, default both):
  jvp       the primal and tangent of one call, ``jax.jvp(f, (q, k, v), (q', k', v'))``
  grad_jvp  ``jax.grad`` in ``(q, k, v)`` of a MeanFlow / consistency-model style loss that contains
            the jvp: ``sum((o - y)^2) + sum((o' - y')^2)`` with ``(o, o') = jax.jvp(f, ...)`` at fixed
            tangents and targets (reverse over forward: the gradient flows through the primal output
            and through the tangent)

Implementations (``--impls``, default all), each ``f`` above:
  default      ``flex_attention`` with no ``implementation``: what a user's ``jax.jvp`` runs today (on
               sm_90 the device table routes it to Triton, Mosaic or cuDNN by shape; the row's
               ``dispatch`` is the decision and ``tangent`` where its tangent comes from: cuDNN has no
               fused tangent, so a cuDNN-routed call takes a kernel backend's)
  one_fwd      one forward call of ``default`` (jvp mode only): the denominator of "fused jvp within
               2.2x of a forward"
  two_fwd      two Triton forward calls (jvp mode only), the floor a fused jvp can approach
  mosaic       the Mosaic GPU backend's fused forward + JVP kernel (backends/mosaic_gpu/jvp.py),
               ``implementation="mosaic"`` (sm_90; head_dim 64 and 128)
  fused        the Triton backend's fused forward + JVP kernel (backends/triton/jvp.py),
               ``implementation="triton"``
  xla_tangent  the Triton forward with the tangent from the exact XLA formulation's jvp (the path
               before the fused kernels; also what a ``score_mod`` call takes)
  jax_nn       ``jax.nn.dot_product_attention(implementation="xla")``
Cases: B4 H8, D64 and D128 (``--head-dims``), T 1024 to 16384 (``--lengths``), causal and not,
bfloat16. A jvp through a kernel with a fused forward + JVP kernel (``with_forward_mode``) runs that
one kernel: its primal output is the jvp's primal (``autodiff.primal_and_tangent_p``), so ``fused``
and ``mosaic`` cost their kernel alone.

Reverse over forward (grad_jvp), as implemented today (probjax/ops/attention/autodiff.py): no kernel
backward of the fused JVP kernel exists. The output's cotangent goes through the forward kernel's
own backward (the ``linear_call`` of ``with_forward_mode`` is transposed by the kernel's vjp). The
tangent ``o'`` is the fused kernel's output inside ``autodiff.kernel_tangent``, a ``custom_jvp``
whose derivative in ``(q, k, v, q', k', v')`` is the jvp of the exact XLA formulation's jvp, run
under ``jax.checkpoint``; ``jax.grad`` transposes that. So the backward of the tangent is XLA: the
dense formulation on a GPU while ``B H T^2 16`` bytes fit a quarter of the device memory
(``dispatch.xla_formulation``; on an 80 GB H100 through T4096 at B4 H8), quadratic in memory there,
else XLA's tiled (flash) loop, linear in memory but far slower than a kernel. The forward still
runs the fused kernels (the primal and the tangent of the jvp).

Rows: one JSON object per line in ``bench/results/<device>/attention_jvp.json`` (``--output``),
keyed by impl, mode, batch, heads, seq, head_dim, causal, dtype: the median/p10/p90 milliseconds per
call (``probjax.core.timing.time_fn``), the compile seconds, and memory. ``compiled_total_bytes`` (the
compiled program's arguments + outputs + temporaries less aliased bytes,
:func:`bench.impls.memory_of`) and ``temp_bytes`` are deterministic and belong to the row alone: the
per-row memory to plot against T. ``peak_bytes_in_use`` is the device allocator's high-water mark of
the process after the row (JAX cannot reset it); ``row_peak_bytes`` is that mark where this row
raised it (then it is this row's peak, ``bytes_in_use_before`` of it live before the row), else
null. A failure (out of memory, a refusal) is a row with its status and error; a row left out by
``--max-xla-len`` / ``--max-grad-len`` is a row with status ``skipped`` (measured by a later
``--append`` run without the limit).

GPU: ``python -m bench.attention_jvp`` (``--append`` resumes, ``--max-minutes`` stops between rows;
``--grad-impls``, ``--grad-lengths`` and ``--causal`` pick a subset; ``--list`` prints the plan);
CPU smoke (tiny shapes, kernels in interpret mode):
``python -m bench.attention_jvp --cpu-smoke --output /tmp/attention_jvp_smoke.json``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time

import jax
import jax.numpy as jnp

from bench import harness, impls
from probjax.core import timing
from probjax.core.device import Device
from probjax.ops import attention
from probjax.ops.attention import dispatch, masks
from probjax.ops.attention.autodiff import with_forward_mode

IMPLS = ("default", "one_fwd", "two_fwd", "mosaic", "fused", "xla_tangent", "jax_nn")
MODES = ("jvp", "grad_jvp")
FORWARD_ONLY = ("one_fwd", "two_fwd")    # no grad_jvp row: they compute no tangent
XLA_IMPLS = ("xla_tangent", "jax_nn")    # quadratic-memory tangents, capped by --max-xla-len
KEY = ("impl", "mode", "batch", "heads", "seq", "head_dim", "causal", "dtype")
SLOW_CALL_S = 0.5                        # a call slower than this is timed with fewer calls


def row_key(row: dict) -> tuple:
  """A row's key; rows written before ``mode`` existed are jvp rows."""
  return tuple(row.get(k, "jvp") if k == "mode" else row.get(k) for k in KEY)


def attention_fn(impl: str, causal: bool, interpret: bool):
  """``f(q, k, v) -> out`` of an implementation (``two_fwd`` and ``one_fwd``: the Triton and default
  forwards)."""
  mask = masks.CausalMask() if causal else None
  if impl in ("default", "one_fwd"):
    return lambda q, k, v: attention.flex_attention(q, k, v, mask=mask, interpret=interpret)
  if impl == "mosaic":
    return lambda q, k, v: attention.flex_attention(q, k, v, mask=mask, implementation="mosaic",
                                                    interpret=interpret)
  triton = lambda q, k, v: attention.flex_attention(q, k, v, mask=mask, implementation="triton",
                                                    interpret=interpret)
  if impl in ("fused", "two_fwd"):
    return triton
  if impl == "xla_tangent":
    exact = lambda q, k, v, m: attention.flex_attention(q, k, v, mask=m, implementation="xla")
    f = with_forward_mode(lambda q, k, v, m: triton(q, k, v), exact)
    return lambda q, k, v: f(q, k, v, mask)
  if impl == "jax_nn":
    return lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="xla")
  raise ValueError(f"unknown impl {impl!r}; known: {', '.join(IMPLS)}")


def build(impl: str, mode: str, causal: bool, interpret: bool):
  """``(jitted fn, number of its array arguments)``: jvp mode ``fn(q, k, v, qd, kd, vd) -> (out,
  out_dot)``; grad_jvp mode ``fn(q, k, v, qd, kd, vd, y, yd) -> (dq, dk, dv)``."""
  f = attention_fn(impl, causal, interpret)
  if mode == "jvp":
    if impl == "one_fwd":
      return jax.jit(f), 3
    if impl == "two_fwd":
      return jax.jit(lambda q, k, v, qd, kd, vd: (f(q, k, v), f(qd, kd, vd))), 6
    return jax.jit(lambda q, k, v, qd, kd, vd: jax.jvp(f, (q, k, v), (qd, kd, vd))), 6
  if mode != "grad_jvp":
    raise ValueError(f"unknown mode {mode!r}; known: {', '.join(MODES)}")
  if impl in FORWARD_ONLY:
    raise ValueError(f"{impl} has no grad_jvp row")

  def loss(q, k, v, qd, kd, vd, y, yd):
    o, od = jax.jvp(f, (q, k, v), (qd, kd, vd))
    sq = lambda a, b: jnp.sum(jnp.square(a.astype(jnp.float32) - b.astype(jnp.float32)))
    return sq(o, y) + sq(od, yd)
  return jax.jit(jax.grad(loss, argnums=(0, 1, 2))), 8


def routing(impl: str, shape: tuple, causal: bool, interpret: bool) -> dict:
  """For ``default`` / ``one_fwd``: the dispatch decision and where a jvp's tangent comes from."""
  if impl not in ("default", "one_fwd"):
    return {}
  device = Device.interpreter() if interpret else Device.current()
  mask = masks.CausalMask() if causal else None
  d = attention.explain_dispatch(shape, shape, "bfloat16", mask=mask, device=device)
  out = {"dispatch": str(d)}
  if impl == "default":
    if d.implementation == "xla":
      out["tangent"] = "xla jvp"
    else:  # the first of these with a fused kernel for the call (cuDNN has none)
      from probjax.ops.attention.call import AttentionCall
      call = AttentionCall(shape, shape, "bfloat16", mask=mask)
      out["tangent"] = "fused kernel of the first of " + ", ".join(dispatch.tangent_candidates(d, call, device))
  return out


def measure(impl, mode, b, h, t, d, causal, interpret, meta) -> dict:
  row = dict(meta, suite="attention_jvp", impl=impl, mode=mode, batch=b, heads=h, seq=t, head_dim=d,
             causal=causal, dtype="bfloat16")
  device = jax.devices()[0]
  before = device.memory_stats() or {}
  row["bytes_in_use_before"] = before.get("bytes_in_use")
  try:
    row.update(routing(impl, (b, t, h, d), causal, interpret))
    fn, n = build(impl, mode, causal, interpret)
    keys = jax.random.split(jax.random.key(0), n)
    args = [jax.random.normal(kk, (b, t, h, d), jnp.bfloat16) for kk in keys]
    t0 = time.perf_counter()
    compiled = fn.lower(*args).compile()
    row["compile_s"] = round(time.perf_counter() - t0, 3)
    try:
      row.update(impls.memory_of(compiled))
    except impls.Unsupported:  # a backend without XLA's memory analysis: the timing stands
      pass
    t0 = time.perf_counter()
    jax.block_until_ready(compiled(*args))
    first = time.perf_counter() - t0
    kw = dict(warmup=0, repeats=3) if first > SLOW_CALL_S else {}
    res = harness.time_fn(lambda: compiled(*args), jax.block_until_ready, **kw)
    row.update(status="ok", ms=res["ms"], p10_ms=res.get("p10_ms"), p90_ms=res.get("p90_ms"),
               n_repeats=res.get("n_repeats"), calls_per_repeat=res.get("calls_per_repeat"))
  except Exception as e:  # noqa: BLE001 (a failure is a row)
    row.update(status=timing.classify_error(e)[0], error=f"{type(e).__name__}: {e}"[:2000])
  finally:
    args = compiled = fn = None  # noqa: F841 (free the row's buffers before the next)
    gc.collect()
  after = device.memory_stats() or {}
  row["peak_bytes_in_use"] = after.get("peak_bytes_in_use")
  peak0 = before.get("peak_bytes_in_use")
  raised = row["peak_bytes_in_use"] is not None and (peak0 is None or row["peak_bytes_in_use"] > peak0)
  row["row_peak_bytes"] = row["peak_bytes_in_use"] if raised else None
  return row


def skip_reason(impl, mode, t, args) -> str | None:
  if mode == "grad_jvp" and args.max_grad_len is not None and t > args.max_grad_len:
    return f"grad_jvp at T{t} > --max-grad-len {args.max_grad_len}"
  if impl in XLA_IMPLS and args.max_xla_len is not None and t > args.max_xla_len:
    return f"{impl} at T{t} > --max-xla-len {args.max_xla_len}"
  return None


def _list(text: str, cast=str) -> list:
  return [cast(x) for x in text.split(",") if x]


def plan(args) -> list[tuple]:
  """The rows to run, ``(impl, mode, t, d, causal)``, in order: head_dim, length, causal, mode, impl
  (so a case's grad_jvp rows follow its jvp rows, whose kernels they share)."""
  impls, modes = _list(args.impls), _list(args.modes)
  grad_impls = [i for i in impls if i not in FORWARD_ONLY] if args.grad_impls is None else _list(args.grad_impls)
  bad = ([s for s in impls + grad_impls if s not in IMPLS] + [s for s in modes if s not in MODES]
         + [s for s in grad_impls if s in FORWARD_ONLY])
  if bad:
    raise SystemExit(f"unknown impl or mode {bad}; impls: {', '.join(IMPLS)} (grad_jvp: not "
                     f"{', '.join(FORWARD_ONLY)}); modes: {', '.join(MODES)}")
  if args.cpu_smoke:
    lengths, dims = _list(args.smoke_lengths, int), _list(args.smoke_head_dims, int)
    grad_lengths = lengths
  else:
    lengths, dims = _list(args.lengths, int), _list(args.head_dims, int)
    grad_lengths = lengths if args.grad_lengths is None else _list(args.grad_lengths, int)
  causals = {"both": (False, True), "causal": (True,), "noncausal": (False,)}[args.causal]
  rows = []
  for d in dims:
    for t in sorted(set(lengths) | (set(grad_lengths) if "grad_jvp" in modes else set())):
      for causal in causals:
        if "jvp" in modes and t in lengths:
          rows += [(impl, "jvp", t, d, causal) for impl in impls]
        if "grad_jvp" in modes and t in grad_lengths:
          rows += [(impl, "grad_jvp", t, d, causal) for impl in grad_impls]
  return rows


def parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--impls", default=",".join(IMPLS))
  p.add_argument("--modes", default=",".join(MODES), help="jvp, grad_jvp or both (comma-separated)")
  p.add_argument("--lengths", default="1024,2048,4096,8192,16384")
  p.add_argument("--head-dims", default="64,128")
  p.add_argument("--causal", choices=("both", "causal", "noncausal"), default="both")
  p.add_argument("--grad-impls", default=None,
                 help="implementations of the grad_jvp rows (default: those of --impls that have one)")
  p.add_argument("--grad-lengths", default=None, help="lengths of the grad_jvp rows (default: --lengths)")
  p.add_argument("--max-xla-len", type=int, default=None,
                 help="skip xla_tangent and jax_nn rows (quadratic memory) longer than this (status skipped)")
  p.add_argument("--max-grad-len", type=int, default=None,
                 help="skip grad_jvp rows longer than this (status skipped)")
  p.add_argument("--output", default=None)
  p.add_argument("--append", action="store_true",
                 help="keep the output's rows and skip rows already measured (status other than skipped)")
  p.add_argument("--rerun-failed", action="store_true", help="with --append: measure again rows not ok")
  p.add_argument("--max-minutes", type=float, default=None,
                 help="start no row after this many minutes (rerun the command with --append)")
  p.add_argument("--cpu-smoke", action="store_true", help="tiny shapes, kernels in interpret mode")
  p.add_argument("--smoke-lengths", default="40", help=argparse.SUPPRESS)
  p.add_argument("--smoke-head-dims", default="64", help=argparse.SUPPRESS)
  p.add_argument("--list", action="store_true", help="print the planned rows (and skips) and exit")
  return p


def main(argv=None) -> None:
  args = parser().parse_args(argv)
  if args.list:
    for impl, mode, t, d, causal in plan(args):
      print(impl, mode, f"T{t}", f"D{d}", "causal" if causal else "noncausal",
            skip_reason(impl, mode, t, args) or "")
    return
  if args.cpu_smoke:  # before JAX starts its CPU client (see mosaic_gpu.config.INTERPRET_WGS): Mosaic's
    os.environ.setdefault("PJRT_NPROC", "8")  # interpreted warpgroups can hang a smaller thread pool
  device = jax.devices()[0]
  if not args.cpu_smoke and device.platform != "gpu":
    sys.exit("bench/attention_jvp.py times GPUs; pass --cpu-smoke to run tiny shapes on this device")
  b, h = (1, 2) if args.cpu_smoke else (4, 8)
  output = args.output or harness.results_file("attention_jvp")
  os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
  meta = dict(device=device.device_kind, platform=device.platform, versions=timing.library_versions(),
              commit=timing.code_commit(), interpret=args.cpu_smoke,
              command=" ".join([os.path.basename(sys.executable), "-m", "bench.attention_jvp",
                                *(sys.argv[1:] if argv is None else argv)]))
  kept = harness.load_rows(output) if args.append else []
  done = {row_key(r): r.get("status") for r in kept}
  todo, planned = [], plan(args)
  for impl, mode, t, d, causal in planned:
    key = row_key(dict(impl=impl, mode=mode, batch=b, heads=h, seq=t, head_dim=d, causal=causal,
                       dtype="bfloat16"))
    st = done.get(key)
    if st is None or st == "skipped" or (args.rerun_failed and st != "ok"):
      todo.append((key, (impl, mode, t, d, causal)))
  if len(todo) < len(planned):
    print(f"[attention_jvp] {len(planned) - len(todo)} row(s) already in {output}; skipping them",
          file=sys.stderr)
  again = {k for k, _ in todo}
  with open(output, "w") as f:  # the kept rows, less those measured again
    f.writelines(json.dumps(r) + "\n" for r in kept if row_key(r) not in again)
  start = time.monotonic()
  with open(output, "a") as f:
    for i, (_, (impl, mode, t, d, causal)) in enumerate(todo):
      if args.max_minutes is not None and time.monotonic() - start > 60 * args.max_minutes:
        print(f"[attention_jvp] --max-minutes reached: {len(todo) - i} row(s) left; rerun with --append",
              file=sys.stderr)
        break
      t0 = time.monotonic()
      reason = skip_reason(impl, mode, t, args)
      if reason:
        row = dict(meta, suite="attention_jvp", impl=impl, mode=mode, batch=b, heads=h, seq=t, head_dim=d,
                   causal=causal, dtype="bfloat16", status="skipped", error=reason)
      else:
        row = measure(impl, mode, b, h, t, d, causal, args.cpu_smoke, meta)
      row["wall_s"] = round(time.monotonic() - t0, 2)
      row["timestamp"] = time.strftime("%Y-%m-%dT%H:%M:%S")
      print(json.dumps({"row": f"{i + 1}/{len(todo)}",
                        **{k: row.get(k) for k in ("impl", "mode", "seq", "head_dim", "causal", "status", "ms",
                                                   "temp_bytes", "compiled_total_bytes", "wall_s")}}), flush=True)
      f.write(json.dumps(row) + "\n")
      f.flush()


if __name__ == "__main__":
  main()
