"""The norm op's backends against each other, in one process: ``rms_norm`` and ``layer_norm``
(each with and without ``residual=``) and ``adaln_modulate`` (``probjax.ops.norm``) with
``implementation="xla"`` (XLA's fusion of the formula), ``"triton"`` (the Pallas-Triton row
kernels) and ``default`` (``implementation=None``; its row records the decision).

    python -m bench.norm --max-minutes 2.5 --append              # a GPU: bench/results/<device>/norm.json
    python -m bench.norm --dtypes float32 --max-minutes 2.5 --append
    python -m bench.norm --smoke --output /tmp/norm_smoke.json    # tiny, CPU (the kernels in interpret mode)

Cases (``--cases``, default all; ``<shape>/<op>``; ``--smoke``: the same cases at tiny sizes):
  lm/rms, lm/rms_residual, lm/layer, lm/layer_residual
      the LM step's rows (bench/lm_step.py): batch 8 x 2048 tokens = 16384 rows, d_model 768
  dit/adaln
      DiT-B/2's (bench/dit_step.py): batch 64 x 256 tokens, d 768, layer norm, adaLN shift and
      scale per batch element ([64, 768])
  wide/rms, wide/rms_residual, wide/layer, wide/layer_residual, wide/adaln
      a wider row: batch 4 x 2048 = 8192 tokens, d 4096
  lm/qk
      ``qk_norm_rotary`` at the LM step's queries: ``[8, 2048, 12, 64]``, a ``[64]`` float32
      scale and int32 positions ``[8, 2048]`` (the norm and RoPE in one pass; MultiHeadAttention's
      q/k go through it)
each ``fwd`` (the outputs: ``y``, and ``h = x + residual`` with a residual) and ``fwd_bwd``
(``jax.vjp`` in one program: the outputs and the gradient of every input, for random cotangents
of every output), in bfloat16 by default (``--dtypes bfloat16,float32``). RMS and layer norm's
``scale`` and ``bias`` are ``[d]`` float32 (the models' float32 parameters); adaLN's ``shift``
and ``scale`` are ``[B, d]`` in x's dtype (activations). ``fwd_bwd`` differentiates the floating
inputs only (not qk's positions).

Bytes and GB/s (``bytes``, ``gb_s``, the rows' ``bytes_convention``): the bytes of the inputs
read once plus the outputs written once, per mode: ``fwd`` reads x (and residual) and the
norm's parameters and writes y (and h); ``fwd_bwd`` reads those and the cotangents of y (and h)
and writes y (and h) and the gradient of every input (dx, dresidual, and the parameters'); GB/s
= bytes / ms / 1e6. What a backend moves beyond that (the Triton backward's float32 ``dy *
xhat``, adaLN's per-row modulation broadcast to ``[rows, d]`` for the kernels) is its cost.

Timing: per (case, mode, dtype) every implementation is compiled and run once
(``first_call_s``; its outputs against ``xla``'s: ``max_error``, ``check`` against the dtype's
bound in probjax/core/tolerances.py), then timed in ``--rounds`` rounds in a rotated order
(``bench.harness.time_fn`` each: ``--warmup`` calls, ``--repeats`` synchronised blocks of at
least ``--min-repeat-ms``); a row's ``ms`` is the median of its rounds' medians, ``p10_ms`` /
``p90_ms`` the medians of theirs, ``round_ms`` each round's. ``default`` runs what ``xla`` runs
on a GPU for now, so their two rows are a measure of the noise. ``--device-time`` adds
``device_ms`` (the kernels' summed time per call from a profile, ``bench.harness.kernel_ms``)
and ``device_gb_s``: these calls last tens of microseconds, where the wall clock may count
host dispatch.

Rows: JSON Lines in ``bench/results/<device>/norm.json`` (``--output``), keyed by (case, impl,
mode, dtype), with the device, versions, commit and command; a measured key replaces its row,
the file's other rows stay; ``--append`` skips the keys already there (``--rerun-failed``:
except those not ``ok``); no (case, mode, dtype) starts that would end past ``--max-minutes``
(rerun with ``--append`` to resume). A failure (out of memory, a refusal) is a row with its
status, never the end of the run.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import sys
import time

import jax
import jax.numpy as jnp

from bench import harness
from bench.torch_isab_worker import pool_rounds
from probjax.core import timing
from probjax.core.tolerances import tolerance
from probjax.ops.norm import NormCall, adaln_modulate, explain_dispatch, layer_norm, qk_norm_rotary, rms_norm

KEY = ("case", "impl", "mode", "dtype")
IMPLS = ("xla", "triton", "default")
REF = "xla"
MODES = ("fwd", "fwd_bwd")
OPS = ("rms", "rms_residual", "layer", "layer_residual", "adaln")
QK = "qk"
BYTES_CONVENTION = ("bytes of the inputs read once plus the outputs written once: fwd reads x (and residual) "
                    "and the parameters ([d] float32 scale, bias; adaLN's [B, d] shift, scale in x's dtype) "
                    "and writes y (and h); fwd_bwd also reads the cotangents of y (and h) and writes the "
                    "gradient of every input; GB/s = bytes / ms / 1e6")


@dataclasses.dataclass(frozen=True)
class Case:
  shape: str                   # the shape's name: "lm", "dit", "wide"
  op: str                      # one of OPS
  batch: int
  tokens: int                  # per batch element
  d: int                       # the normalised width (qk: head_dim)
  heads: int = 1               # qk: x is [batch, tokens, heads, d]

  @property
  def name(self) -> str:
    return f"{self.shape}/{self.op}"

  @property
  def rows(self) -> int:
    return self.batch * self.tokens * self.heads


def _cases(sizes: dict, qk: tuple) -> dict:
  cases = [Case(shape, op, *sizes[shape]) for shape, ops in (("lm", OPS[:4]), ("dit", ("adaln",)), ("wide", OPS))
           for op in ops]
  return {c.name: c for c in cases + [Case("lm", QK, *qk)]}


CASES = _cases({"lm": (8, 2048, 768), "dit": (64, 256, 768), "wide": (4, 2048, 4096)}, (8, 2048, 64, 12))
# Widths off the kernels' power-of-two blocks and row counts off their row blocks (masked edges).
SMOKE = _cases({"lm": (2, 16, 48), "dit": (2, 8, 40), "wide": (1, 40, 200)}, (2, 9, 24, 3))


def make_inputs(case: Case, dtype) -> dict:
  """The op's arrays (see the module doc): x and residual ``[B, T, d]``, the parameters around
  their identity."""
  keys = iter(jax.random.split(jax.random.key(case.rows * 7919 + case.d), 5))
  draw = lambda shape, dt=dtype, s=1.0, c=0.0: (c + s * jax.random.normal(next(keys), shape, jnp.float32)).astype(dt)
  if case.op == QK:
    return dict(x=draw((case.batch, case.tokens, case.heads, case.d)), scale=draw((case.d,), jnp.float32, 0.2, 1.0),
                positions=jnp.broadcast_to(jnp.arange(case.tokens, dtype=jnp.int32), (case.batch, case.tokens)))
  x_shape = (case.batch, case.tokens, case.d)
  a = dict(x=draw(x_shape))
  if case.op.endswith("_residual"):
    a["residual"] = draw(x_shape)
  if case.op == "adaln":
    a["shift"], a["scale"] = draw((case.batch, case.d), s=0.5), draw((case.batch, case.d), s=0.5)
  else:
    a["scale"] = draw((case.d,), jnp.float32, 0.2, 1.0)
    if case.op.startswith("layer"):
      a["bias"] = draw((case.d,), jnp.float32, 0.5)
  return a


def op_fn(case: Case, impl: str, interpret: bool):
  """``f(arrays) -> outputs``: ``(y,)`` or, with a residual, ``(y, h)``."""
  kw = dict(implementation=None if impl == "default" else impl, interpret=interpret)

  def f(a):
    r = a.get("residual")
    if case.op == QK:
      return (qk_norm_rotary(a["x"], a["scale"], a["positions"], **kw),)
    if case.op.startswith("rms"):
      out = rms_norm(a["x"], a["scale"], residual=r, **kw)
    elif case.op.startswith("layer"):
      out = layer_norm(a["x"], a["scale"], a["bias"], residual=r, **kw)
    else:
      out = adaln_modulate(a["x"], a["shift"], a["scale"], norm="layer", residual=r, **kw)
    return out if isinstance(out, tuple) else (out,)
  return f


def build(case: Case, impl: str, mode: str, inputs: dict, interpret: bool):
  """``(jitted fn, its arguments)``: the outputs (``fwd``), or the outputs and the gradient of
  floating input for the cotangents drawn here (``fwd_bwd``)."""
  f = op_fn(case, impl, interpret)
  if mode == "fwd":
    return jax.jit(f), (inputs,)
  outs = jax.eval_shape(f, inputs)
  keys = jax.random.split(jax.random.key(1), len(outs))
  cts = tuple(jax.random.normal(k, o.shape, jnp.float32).astype(o.dtype) for k, o in zip(keys, outs))
  fixed = {k: v for k, v in inputs.items() if not jnp.issubdtype(v.dtype, jnp.floating)}

  def step(a, ct):
    out, vjp = jax.vjp(lambda floats: f({**floats, **fixed}), a)
    return out, vjp(ct)[0]
  return jax.jit(step), ({k: v for k, v in inputs.items() if k not in fixed}, cts)


def moved_bytes(fn, args) -> int:
  """The convention's bytes (the module doc): every argument read once, every output written once."""
  nbytes = lambda tree: sum(x.size * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))
  return nbytes(args) + nbytes(jax.eval_shape(fn, *args))


@jax.jit
def _max_error(out, ref):
  """``max|out - ref| / max(1, max|ref|)`` over every array, in float32, on the device
  (probjax.core.tolerances.max_error's measure, without copying the arrays to the host)."""
  f32 = lambda a: a.astype(jnp.float32)
  errs = [jnp.max(jnp.abs(f32(o) - f32(r))) / jnp.maximum(1.0, jnp.max(jnp.abs(f32(r))))
          for o, r in zip(jax.tree.leaves(out), jax.tree.leaves(ref))]
  return jnp.max(jnp.stack(errs))


def agreement(out, ref, dtype, mode) -> dict:
  if ref is None:
    return {}
  err = float(_max_error(out, ref))
  bound = tolerance(dtype, grad=mode == "fwd_bwd")
  return dict(agree_ref=REF, max_error=err, check="ok" if err <= bound else f"FAILED: {err:.3g} > {bound}")


def norm_call(case: Case, dtype, interpret: bool) -> NormCall:
  if case.op == QK:
    return NormCall(rows=case.rows, d=case.d, dtype=dtype, kind="rms", affine="columns", rotary=True,
                    interpret=interpret)
  kind = "rms" if case.op.startswith("rms") else "layer"
  return NormCall(rows=case.rows, d=case.d, dtype=dtype, kind=kind, residual=case.op.endswith("_residual"),
                  affine="rows" if case.op == "adaln" else "columns", offset=kind == "layer", interpret=interpret)


def measure(case: Case, mode: str, dtype, impls, args, interpret: bool, base: dict, write) -> None:
  """Writes the rows of one (case, mode, dtype): every implementation of ``impls`` compiled and
  checked against ``xla``'s outputs, then timed in rotated rounds."""
  dt = jnp.dtype(dtype).name
  common = dict(base, case=case.name, shape=case.shape, op=case.op, mode=mode, dtype=dt, batch=case.batch,
                tokens=case.tokens, rows=case.rows, d=case.d, heads=case.heads, residual=case.op.endswith("_residual"),
                param_dtype=dt if case.op == "adaln" else "float32")

  def failed(row, e):
    status, msg = timing.classify_error(e)
    write(dict(row, status=status, error=msg))

  try:
    inputs = make_inputs(case, dtype)
  except Exception as e:  # noqa: BLE001 (the inputs do not fit: every row says so)
    for impl in impls:
      failed(dict(common, impl=impl), e)
    return
  live, ref = {}, None
  for impl in sorted(impls, key=lambda i: i != REF):   # the reference first: the others compare to it
    row = dict(common, impl=impl)
    try:
      decision = explain_dispatch(norm_call(case, dtype, interpret), implementation=None if impl == "default" else impl)
      row.update(implementation=decision.implementation, decision=str(decision))
      fn, fargs = build(case, impl, mode, inputs, interpret)
      row["bytes"] = moved_bytes(fn, fargs)
      t0 = time.perf_counter()
      out = jax.block_until_ready(fn(*fargs))
      row["first_call_s"] = time.perf_counter() - t0
      if impl == REF:
        ref = out
      else:
        row.update(agreement(out, ref, dt, mode))
      del out
    except Exception as e:  # noqa: BLE001 (one failing implementation never ends a run)
      failed(row, e)
      continue
    live[impl] = (fn, fargs, row, [])
  ref = None
  kw = dict(warmup=args.warmup, repeats=args.repeats, min_repeat_s=args.min_repeat_ms / 1e3)
  for order in harness.rotations(live, args.rounds if live else 0):
    for impl in order:
      fn, fargs, row, results = live[impl]
      if row.get("status"):     # failed in an earlier round
        continue
      try:
        results.append(harness.time_fn(lambda: fn(*fargs), jax.block_until_ready, **kw))
      except Exception as e:  # noqa: BLE001
        row.update(zip(("status", "error"), timing.classify_error(e)))
  for fn, fargs, row, results in live.values():
    if row.get("status"):
      write(row)
      continue
    row = dict(row, status="ok", **pool_rounds(results))
    row["gb_s"] = row["bytes"] / row["ms"] / 1e6
    if args.device_time:
      try:
        row["device_ms"] = harness.kernel_ms(lambda: fn(*fargs), jax.block_until_ready, 20, "jax")
        row["device_gb_s"] = row["bytes"] / row["device_ms"] / 1e6
      except Exception as e:  # noqa: BLE001 (the wall-clock row stands without it)
        row["device_ms_error"] = f"{type(e).__name__}: {e}"[:300]
    write(row)


def row_key(row: dict) -> tuple:
  return tuple(row.get(k) for k in KEY)


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--output", default=None, help="JSON Lines file of rows (default: bench/results/<device>/norm.json)")
  p.add_argument("--append", action="store_true", help="keep the file's rows, skip keys already measured")
  p.add_argument("--rerun-failed", action="store_true", help="with --append: measure non-ok rows again")
  p.add_argument("--cases", default=None, help=f"comma-separated, of {','.join(CASES)} (default all)")
  p.add_argument("--impl", default=None, help=f"comma-separated, of {','.join(IMPLS)} (default all)")
  p.add_argument("--modes", default=",".join(MODES))
  p.add_argument("--dtypes", default="bfloat16", help="comma-separated: bfloat16, float32")
  p.add_argument("--rounds", type=int, default=3)
  p.add_argument("--repeats", type=int, default=5)
  p.add_argument("--warmup", type=int, default=2)
  p.add_argument("--min-repeat-ms", type=float, default=10.0)
  p.add_argument("--device-time", action="store_true",
                 help="also device_ms: the kernels' time per call from a profile (about a second a row)")
  p.add_argument("--max-minutes", type=float, default=9.0,
                 help="no (case, mode, dtype) starts that would end past it (rerun with --append)")
  p.add_argument("--smoke", action="store_true", help="tiny sizes on CPU, the kernels in interpret mode (seconds)")
  p.add_argument("--no-progress", action="store_true")
  args = p.parse_args(argv)
  start = time.perf_counter()
  table = SMOKE if args.smoke else CASES
  names = args.cases.split(",") if args.cases else list(table)
  impls = args.impl.split(",") if args.impl else list(IMPLS)
  modes, dtypes = args.modes.split(","), [harness.DTYPE_NAMES.get(d, d) for d in args.dtypes.split(",")]
  unknown = ([n for n in names if n not in table] + [i for i in impls if i not in IMPLS]
             + [m for m in modes if m not in MODES] + [d for d in dtypes if d not in ("bfloat16", "float32")])
  if unknown:
    raise SystemExit(f"unknown --cases/--impl/--modes/--dtypes {unknown}; cases: {', '.join(table)}; "
                     f"implementations: {IMPLS}; modes: {MODES}; dtypes: bfloat16, float32")
  if args.smoke:
    if not args.output:
      p.error("--smoke writes to --output only")
    args.rounds, args.repeats, args.warmup, args.min_repeat_ms = min(args.rounds, 2), min(args.repeats, 2), 0, 0.0
  elif jax.devices()[0].platform != "gpu":
    sys.exit("bench.norm times GPUs; pass --smoke to check it on this device")
  interpret = args.smoke and jax.devices()[0].platform != "gpu"
  output = args.output or harness.results_file("norm")

  info = timing.device_info()
  base = dict(suite="norm", device=info["device"], platform=info["platform"],
              compute_capability=info["compute_capability"], versions=info["versions"], commit=info["commit"],
              command=" ".join(["python -m bench.norm", *(sys.argv[1:] if argv is None else argv)]),
              interpret=interpret, bytes_convention=BYTES_CONVENTION)
  rows = {row_key(r): r for r in harness.load_rows(output)}   # a measured key replaces its row
  done = dict(rows) if args.append else {}
  os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)

  def write(row):  # the file is rewritten: one row per key
    row = dict(row, time=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))
    rows[row_key(row)] = row
    with open(output, "w") as f:
      f.writelines(json.dumps(r, default=str) + "\n" for r in rows.values())
    err = f"  err {row['max_error']:.2g}" if "max_error" in row else ""
    bar.write(f"{row['case']:20s} {row['mode']:7s} {row['dtype']:8s} {row['impl']:7s} {row['status']:11s} "
              + (f"{row['ms']:.4f} ms  {row['gb_s']:7.1f} GB/s{err}" if row["status"] == "ok"
                 else row.get("error", "")[:160]))
    bar.update(1)

  def wanted(name, impl, mode, dt):
    r = done.get((name, impl, mode, dt))
    return r is None or (args.rerun_failed and r.get("status") != "ok")

  from tqdm import tqdm
  plan = [(table[n], m, dt, [i for i in impls if wanted(n, i, m, dt)]) for dt in dtypes for n in names for m in modes]
  plan = [job for job in plan if job[3]]
  bar = tqdm(total=sum(len(job[3]) for job in plan), disable=args.no_progress, dynamic_ncols=True, desc="norm",
             file=sys.stderr)
  if len(plan) < len(dtypes) * len(names) * len(modes):
    bar.write(f"[norm] skipping keys already in {output} (--append)")
  longest = 0.0  # a job starts only if one as long as the longest so far still fits
  for case, mode, dt, todo in plan:
    if time.perf_counter() - start + longest > 60 * args.max_minutes:
      bar.write(f"[norm] stopped before --max-minutes {args.max_minutes}: rerun with --append to resume")
      break
    bar.set_postfix_str(f"{case.name} {mode} {dt}")
    t0 = time.perf_counter()
    measure(case, mode, getattr(jnp, dt), todo, args, interpret, base, write)
    longest = max(longest, time.perf_counter() - t0)
    harness.free_memory()
  bar.close()
  print(f"[norm] {time.perf_counter() - start:.1f} s; rows in {output}", file=sys.stderr)
  return list(rows.values())


if __name__ == "__main__":
  main()
