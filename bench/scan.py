"""GPU benchmark of the scan room: every implementation of each op, in one process.

Cases (``--cases``, default all):
  mamba1   Mamba-1 selective scan, B8 L2048 to L16384, D1536 N16 (with z, D and dt_bias)
  rla      RLA linear branch, B4 H8 T2048 to T16384, D64, window 512 (bfloat16: ``--dtypes
           bfloat16``)
  mamba2   Mamba-2 SSD, B8 L2048 and L8192, 24 heads, head_dim 64, state 128, one group
each forward (``fwd``) and forward+backward (``fwd_bwd``: the gradient of every floating
input), float32 by default (``--dtypes``). Implementations: every registered one that can run
on the device, and ``default`` (``implementation=None``; its row records the decision); for RLA
also ``peer``, a plain chunked XLA form written here (:func:`rla_peer`), the form the op's
backends must beat. ``--chunks 64,128`` adds rows ``chunked/64``, ``triton/64``, ... at those
chunk sizes (where the implementation takes them); ``--lengths`` keeps the cases of those
sequence lengths.

Timing: per (case, mode, dtype), every implementation is compiled and warmed up, then
``--rounds`` rounds run each implementation in turn, starting one later each round (rotating
order, so drifts of clock and temperature spread over all of them); a round times a block of
calls lasting at least ``--min-block-ms`` and synchronises once. A row holds the median, p10
and p90 of the rounds' per-call times.

Rows: one JSON object per line in ``bench/results/<device>/scan.json`` (``--output``), with
the device, library versions, commit and command line. ``--append`` keeps the rows there and
skips their keys (resume); a run stops before ``--max-minutes`` (default 9) and says so. A
failure (out of memory, a refusal) is a row with its status, never the end of the run.

GPU: ``python -m bench.scan --append``; Mamba-1's kernels against the associative and chunked
forms, float32 and bfloat16, length by length: ``python -m bench.scan --cases mamba1 --dtypes
float32,bfloat16 --impls triton,associative,chunked``; CPU smoke (tiny shapes, the Triton kernels in
interpret mode): ``python -m bench.scan --cpu-smoke --output /tmp/scan_smoke.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from bench import harness
from probjax.core import timing
from probjax.core.device import Device
from probjax.ops import scan
from probjax.ops.scan import registry
from probjax.ops.scan.calls import MambaCall, RLACall, SSDCall

KEY = ("case", "impl", "mode", "dtype", "shape")
REGISTRIES = {"mamba": registry.MAMBA, "ssd": registry.SSD, "rla": registry.RLA}


@dataclasses.dataclass(frozen=True)
class Case:
  name: str
  op: str        # "mamba", "ssd" or "rla"
  shape: tuple   # mamba (B, L, D, N); ssd (B, L, H, P, G, N); rla (B, T, H, Hkv, D, window)


CASES = {
    "mamba1": [Case("mamba1", "mamba", (8, length, 1536, 16)) for length in (2048, 4096, 8192, 16384)],
    "rla": [Case("rla", "rla", (4, length, 8, 8, 64, 512)) for length in (2048, 4096, 8192, 16384)],
    "mamba2": [Case("mamba2", "ssd", (8, length, 24, 64, 1, 128)) for length in (2048, 8192)],
}
SMOKE = {
    "mamba1": [Case("mamba1", "mamba", (2, 100, 16, 4))],
    "rla": [Case("rla", "rla", (2, 128, 4, 2, 8, 16))],
    "mamba2": [Case("mamba2", "ssd", (2, 100, 4, 8, 1, 8))],
}


def make_inputs(case: Case, dtype):
  """The op's keyword arguments: activations in ``dtype``, parameters float32."""
  keys = iter(jax.random.split(jax.random.key(0), 8))
  act = lambda *s, scale=1.0: (scale * jax.random.normal(next(keys), s, jnp.float32)).astype(dtype)
  if case.op == "mamba":
    b, length, d, n = case.shape
    a_log = jnp.log(jnp.broadcast_to(jnp.arange(1, n + 1, dtype=jnp.float32), (d, n)))
    return dict(x=act(b, length, d), dt=act(b, length, d, scale=0.5), A=-jnp.exp(a_log),
                B=act(b, length, n), C=act(b, length, n), D=jnp.ones((d,)), z=act(b, length, d),
                dt_bias=jnp.full((d,), -4.0))
  if case.op == "ssd":
    b, length, h, p, g, n = case.shape
    return dict(x=act(b, length, h, p), dt=act(b, length, h, scale=0.5),
                A=-jnp.linspace(1.0, 16.0, h), B=act(b, length, g, n), C=act(b, length, g, n),
                D=jnp.ones((h,)), dt_bias=jnp.full((h,), -4.0))
  b, t, h, hk, d, _ = case.shape
  return dict(q=act(b, t, h, d), k=act(b, t, hk, d), v=act(b, t, hk, d))


def rla_peer(q, k, v, *, window_size: int, chunk: int = 64):
  """RLA's linear branch as a plain chunked XLA form, the peer the op's backends are timed
  against: features in the input dtype, keys and values shifted past the window, inside each
  chunk the masked ``q kᵀ`` times v plus ``q`` times the state entering the chunk (a cumulative
  sum of the chunks' ``kᵀ v``), matmuls accumulating in float32; JAX differentiates it.
  ``[b, t, h, d]`` inputs with ``t`` a multiple of ``chunk``; key/value heads may divide the
  heads (GQA)."""
  b, t, h, _ = q.shape
  hk, n = k.shape[2], t // chunk
  phi = lambda x: jnp.concatenate([jax.nn.softmax(x, -1), jax.nn.softmax(-x, -1)], -1).astype(x.dtype)
  shift = lambda x: jnp.pad(x, ((0, 0), (window_size + 1, 0), (0, 0), (0, 0)))[:, :t]
  fq = phi(q).reshape(b, n, chunk, hk, h // hk, -1)
  fk, vs = shift(phi(k)).reshape(b, n, chunk, hk, -1), shift(v).reshape(b, n, chunk, hk, -1)
  mm = lambda spec, x, y: jnp.einsum(spec, x, y, preferred_element_type=jnp.float32)
  kv = mm("bnskf,bnskd->bnkfd", fk, vs)
  state = (jnp.cumsum(kv, axis=1) - kv).astype(q.dtype)
  causal = jnp.arange(chunk)[:, None] >= jnp.arange(chunk)[None, :]
  scores = jnp.where(causal, mm("bntkrf,bnskf->bnkrts", fq, fk), 0).astype(q.dtype)
  o = mm("bnkrts,bnskd->bntkrd", scores, vs) + mm("bntkrf,bnkfd->bntkrd", fq, state)
  return o.reshape(b, t, h, -1).astype(q.dtype)


def op_fn(case: Case):
  if case.op == "mamba":
    return scan.mamba_scan
  if case.op == "ssd":
    return scan.ssd_scan
  return lambda **a: scan.residual_linear_attention(**a, window_size=case.shape[-1])


def impl_fn(case: Case, impl: str | None, interpret: bool):
  """``f(**inputs)`` computing ``case`` as ``impl`` names it: a registered implementation (None:
  the default), ``name/chunk`` (at that chunk size) or, for RLA, ``peer``."""
  if impl == "peer":
    return lambda **a: rla_peer(**a, window_size=case.shape[-1])
  fn = op_fn(case)
  name, _, chunk = (impl or "").partition("/")
  kw = dict(implementation=name or None, interpret=interpret, **({"chunk_size": int(chunk)} if chunk else {}))
  return lambda **a: fn(**a, **kw)


def call_of(case: Case, inputs, interpret: bool):
  if case.op == "mamba":
    return MambaCall.of(**inputs, interpret=interpret)
  if case.op == "ssd":
    return SSDCall.of(**inputs, interpret=interpret)
  return RLACall.of(**inputs, window_size=case.shape[-1], interpret=interpret)


def build(case: Case, impl: str | None, mode: str, inputs, interpret: bool):
  """A jitted function of the inputs: the op's output, or the gradients of every input."""
  fn = impl_fn(case, impl, interpret)
  run = lambda a: fn(**a)
  if mode == "fwd":
    return jax.jit(run)
  return jax.jit(jax.grad(lambda a: jnp.sum(run(a).astype(jnp.float32))))


def block_ms(fn, inputs, calls: int) -> float:
  t0 = time.perf_counter()
  out = None
  for _ in range(calls):
    out = fn(inputs)
  jax.block_until_ready(out)
  return (time.perf_counter() - t0) / calls * 1e3


def key_of(row) -> str:
  return json.dumps([row.get(k) for k in KEY])


def measure(case, mode, dtype, impls, args, interpret, meta, progress):
  """The rows of one (case, mode, dtype): every implementation, rotating order."""
  base = dict(suite="scan", case=case.name, op=case.op, shape=list(case.shape), mode=mode,
              dtype=jnp.dtype(dtype).name, **meta)
  rows = {impl: dict(base, impl=impl, status="ok", ms=None) for impl in impls}
  fns = {}

  def failed(impl, e):
    rows[impl].update(status=timing.classify_error(e)[0], error=f"{type(e).__name__}: {e}"[:2000])
    if rows[impl]["status"] == "error":
      rows[impl]["traceback"] = traceback.format_exc()[-2000:]

  try:
    inputs = make_inputs(case, dtype)
    call = call_of(case, inputs, interpret)
  except Exception as e:  # noqa: BLE001 (the inputs do not fit: every row says so)
    for impl in impls:
      failed(impl, e)
    progress.update(len(impls))
    return list(rows.values())
  for impl in impls:
    row = rows[impl]
    try:
      if impl == "default":
        row["decision"] = str(scan.explain_dispatch(call))
      fn = build(case, None if impl == "default" else impl, mode, inputs, interpret)
      t0 = time.perf_counter()
      jax.block_until_ready(fn(inputs))
      row["first_call_s"] = time.perf_counter() - t0
      for _ in range(args.warmup):
        jax.block_until_ready(fn(inputs))
      one = block_ms(fn, inputs, 1)
      row["calls_per_block"] = max(1, min(args.max_calls, int(np.ceil(args.min_block_ms / max(one, 1e-3)))))
      fns[impl] = fn
    except Exception as e:  # noqa: BLE001 (one failure is one row)
      failed(impl, e)
    progress.update(1)
  times = {impl: [] for impl in fns}
  order = list(fns)
  for r in range(args.rounds):
    for impl in order[r % len(order):] + order[:r % len(order)]:
      try:
        times[impl].append(block_ms(fns[impl], inputs, rows[impl]["calls_per_block"]))
      except Exception as e:  # noqa: BLE001
        failed(impl, e)
  for impl, ts in times.items():
    if ts and rows[impl]["status"] == "ok":
      rows[impl].update(ms=statistics.median(ts), p10_ms=float(np.percentile(ts, 10)),
                        p90_ms=float(np.percentile(ts, 90)), rounds=len(ts))
  return list(rows.values())


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--cases", default=",".join(CASES), help="comma-separated: " + ", ".join(CASES))
  p.add_argument("--modes", default="fwd,fwd_bwd")
  p.add_argument("--dtypes", default="float32")
  p.add_argument("--impls", default=None, help="comma-separated (default: every available one and default)")
  p.add_argument("--chunks", default="", help="comma-separated chunk sizes: also rows chunked/N and triton/N")
  p.add_argument("--lengths", default="", help="comma-separated sequence lengths to keep (default: every case's)")
  p.add_argument("--output", default=None)
  p.add_argument("--append", action="store_true", help="keep the output's rows and skip their keys")
  p.add_argument("--max-minutes", type=float, default=9.0, help="no job starts that would end past it")
  p.add_argument("--rounds", type=int, default=7)
  p.add_argument("--warmup", type=int, default=2)
  p.add_argument("--min-block-ms", type=float, default=50.0)
  p.add_argument("--max-calls", type=int, default=200)
  p.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on CPU, the kernels in interpret mode")
  args = p.parse_args(argv)
  from tqdm import tqdm

  start = time.perf_counter()
  device = jax.devices()[0]
  if args.cpu_smoke:
    args.rounds, args.warmup, args.min_block_ms = 2, 1, 1.0
  elif device.platform != "gpu":
    sys.exit("bench/scan.py times GPUs; pass --cpu-smoke to run tiny shapes on this device")
  interpret = args.cpu_smoke
  table = SMOKE if args.cpu_smoke else CASES
  output = args.output or harness.results_file("scan")
  os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
  done = set()
  if args.append:
    done = {key_of(r) for r in harness.load_rows(output)}
  meta = dict(device=device.device_kind, platform=device.platform, versions=timing.library_versions(),
              commit=timing.code_commit(), command=" ".join([os.path.basename(sys.executable), "-m", "bench.scan", *sys.argv[1:]]),
              interpret=interpret)
  lengths = {int(n) for n in filter(None, args.lengths.split(","))}
  jobs = [(case, mode, getattr(jnp, dt)) for name in args.cases.split(",") for case in table[name]
          if not lengths or case.shape[1] in lengths
          for mode in args.modes.split(",") for dt in args.dtypes.split(",")]

  on = Device.interpreter() if interpret else Device.current()
  todo = []
  for case, mode, dt in jobs:
    names = REGISTRIES[case.op].available(on)
    names += ["default"] + (["peer"] if case.op == "rla" else [])
    names += [f"{n}/{c}" for c in filter(None, args.chunks.split(",")) for n in ("chunked", "triton") if n in names]
    impls = [i for i in names
             if (args.impls is None or i in args.impls.split(",") or i.partition("/")[0] in args.impls.split(","))
             and key_of(dict(case=case.name, impl=i, mode=mode, dtype=jnp.dtype(dt).name,
                             shape=list(case.shape))) not in done]
    if impls:
      todo.append((case, mode, dt, impls))
  progress = tqdm(total=sum(len(t[3]) for t in todo), desc="scan", unit="row")
  with open(output, "a" if args.append else "w") as f:
    longest = 0.0  # a job starts only if one as long as the longest so far still fits
    for case, mode, dt, impls in todo:
      if time.perf_counter() - start + longest > 60 * args.max_minutes:
        progress.write(f"stopped before --max-minutes {args.max_minutes}: rerun with --append to resume")
        break
      progress.set_postfix_str(f"{case.name} {case.shape[1]} {mode} {jnp.dtype(dt).name}")
      t0 = time.perf_counter()
      rows = measure(case, mode, dt, impls, args, interpret, meta, progress)
      longest = max(longest, time.perf_counter() - t0)
      for row in rows:
        row["timestamp"] = time.strftime("%Y-%m-%dT%H:%M:%S")
        f.write(json.dumps(row) + "\n")
        f.flush()
  progress.close()


if __name__ == "__main__":
  main()
