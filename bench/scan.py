"""GPU benchmark of the scan room: every implementation of each op, in one process.

Cases (``--cases``, default all):
  mamba1        Mamba-1 selective scan, B8 L2048 to L16384, D1536 N16 (with z, D and dt_bias)
  rla           RLA linear branch, B4 H8 T2048 to T16384, D64, window 512 (bfloat16: ``--dtypes
                bfloat16``)
  mamba2        Mamba-2 SSD, B8 L2048 and L8192, 24 heads, head_dim 64, state 128, one group
  mamba2_b4h32  Mamba-2 SSD at the issue's shape, B4 H32 P64 N128, one group (Mamba-2's default
                ngroups), L2048, L4096, L8192 and L16384 (time linear in the length)
each forward (``fwd``) and forward+backward (``fwd_bwd``: the gradient of every floating
input), float32 by default (``--dtypes``). Implementations: every registered one that can run
on the device, and ``default`` (``implementation=None``; its row records the decision); for RLA
also ``peer``, a plain chunked XLA form written here (:func:`rla_peer`), the form the op's
backends must beat. ``--chunks 64,128`` adds rows ``chunked/64``, ``triton/64``, ... at those
chunk sizes (where the implementation takes them); ``--lengths`` keeps the cases of those
sequence lengths.

Torch peers (on a GPU, after the JAX side; ``--no-torch`` skips them), in their own process
(bench/torch_scan_worker.py, whose docstring says exactly what each computes) on the same cases,
modes and dtypes: ``mamba_ssm_triton`` for SSD (mamba_ssm's Triton ``mamba_chunk_scan_combined``,
chunk 256, with probjax's D, dt_bias and softplus) and, for RLA's linear branch,
``fla_chunk`` (torch's φ and window shift, then flash-linear-attention's ``chunk_linear_attn``
unnormalised, scale 1) and ``fla_chunk_kernel`` (fla's call alone on the prepared features).
Neither package is on the GPU machine: ``bash bench/stage_scan_peers.sh`` stages their
pure-Python Triton sources (and their licenses, and the commits in VERSIONS.json) into the
git-ignored ``.peers/scan/``, and a device run carries it: ``run(..., carry=[".peers"])``.
Without it, or where a peer cannot import, its rows have status ``unavailable`` and the reason.
Their rows have the same keys as the JAX rows, plus ``peer_versions`` (torch, triton, the
peer's version and commit) and ``peer_check`` (the worker's comparison, at a small shape in the
row's dtype, of the peer's output with a float32 evaluation of the op's definition:
``rel_err``, ``status``). The JAX side runs
with ``XLA_PYTHON_CLIENT_PREALLOCATE=false`` (unless set) so that the worker finds GPU memory;
``--peer-minutes`` (default 1.5) of ``--max-minutes`` is kept for it. ``--impls`` names them
like any other.

Memory floor (SSD rows, JAX and torch): ``floor_bytes``, x, dt, B and C read once and y written
once (``fwd_bwd``: also dy read and dx, ddt, dB, dC written once) in the activation dtype;
``floor_ms`` those bytes over bench/mla.py's ``HBM_BYTES_PER_S`` (4.0e12 B/s), and ``x_floor =
ms / floor_ms``.

Timing: per (case, mode, dtype), every implementation is compiled and warmed up, then
``--rounds`` rounds run each implementation in turn, starting one later each round (rotating
order, so drifts of clock and temperature spread over all of them); a round times a block of
calls lasting at least ``--min-block-ms`` and synchronises once. A row holds the median, p10
and p90 of the rounds' per-call times; with ``--profile`` (GPU) also the kernels of five more
calls (``device_ms``, ``kernel_ms_by_kind``, ``top_kernels``), which say which kernel of a
multi-kernel implementation takes the time. The torch peers: :func:`probjax.core.timing.time_fn`,
``--rounds`` repeats of blocks lasting at least ``--min-block-ms``.

Rows: one JSON object per line in ``bench/results/<device>/scan.json`` (``--output``), with
the device, library versions, commit and command line. ``--append`` keeps the rows there and
skips their keys (resume; a peer row ``unavailable`` is tried again); a run stops before
``--max-minutes`` (default 9) and says so. A failure (out of memory, a refusal) is a row with
its status, never the end of the run.

GPU: ``python -m bench.scan --append``; Mamba-1's kernels against the associative and chunked
forms, float32 and bfloat16, length by length: ``python -m bench.scan --cases mamba1 --dtypes
float32,bfloat16 --impls triton,associative,chunked``; CPU smoke (tiny shapes, the Triton kernels in
interpret mode): ``python -m bench.scan --cpu-smoke --output /tmp/scan_smoke.json`` (with
``--torch-peers`` the worker runs too: without torch its rows say ``unavailable``).

The peers in the same run (issue 44), SSD at B4 H32 P64 N128 and RLA, bfloat16, L4096 and
L16384: stage once here (``bash bench/stage_scan_peers.sh``, from the ``fetch``ed mirrors of
state-spaces/mamba and fla-org/flash-linear-attention), then on the device
``run(command=..., carry=[".peers"])`` with (the device's ``python3`` holds JAX and torch)::

  python3 -m bench.scan --cases mamba2_b4h32,rla --dtypes bfloat16 --lengths 4096,16384 \\
      --impls chunked,triton,default,peer,mamba_ssm_triton,fla_chunk,fla_chunk_kernel \\
      --rounds 5 --max-minutes 3 --output $OUT/scan.json

``--max-minutes 3`` keeps it under 4 minutes: the JAX side starts no job past 1.5 minutes,
the worker none past 3 (a job under way finishes; the worker is killed 90 s after); what did
not fit says so in the output. The rest of the length series in a second call: ``--lengths
2048,8192``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
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
from bench.torch_scan_worker import IMPLS as TORCH_IMPLS, PEER_OF

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
    "mamba2_b4h32": [Case("mamba2_b4h32", "ssd", (4, length, 32, 64, 1, 128))
                     for length in (2048, 4096, 8192, 16384)],
}
SMOKE = {
    "mamba1": [Case("mamba1", "mamba", (2, 100, 16, 4))],
    "rla": [Case("rla", "rla", (2, 128, 4, 2, 8, 16))],
    "mamba2": [Case("mamba2", "ssd", (2, 100, 4, 8, 1, 8))],
    "mamba2_b4h32": [Case("mamba2_b4h32", "ssd", (1, 64, 4, 8, 1, 8))],
}


def ssd_floor(shape, dtype, mode: str) -> dict:
  """SSD's memory floor: x, dt, B and C read once and y written once (``fwd_bwd``: also the
  cotangent of y read once and the gradients of x, dt, B and C written once), all in the
  activation dtype, over bench/mla.py's ``HBM_BYTES_PER_S``; A, D and dt_bias (``[heads]``)
  are not counted. ``{"floor_bytes", "floor_ms"}``."""
  from bench.mla import HBM_BYTES_PER_S
  b, length, h, p, g, n = shape
  x, dt, bc = b * length * h * p, b * length * h, 2 * b * length * g * n
  elems = 2 * x + dt + bc                    # x, dt, B, C read; y written
  if mode == "fwd_bwd":
    elems += x + (x + dt + bc)               # dy read; dx, ddt, dB, dC written
  nbytes = elems * jnp.dtype(dtype).itemsize
  return dict(floor_bytes=nbytes, floor_ms=nbytes / HBM_BYTES_PER_S * 1e3)


def add_floor(row):
  """``x_floor = ms / floor_ms`` on an SSD row that has both."""
  if row.get("floor_ms") and row.get("ms"):
    row["x_floor"] = row["ms"] / row["floor_ms"]
  return row


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


PROFILE_CALLS = 5  # --profile: the calls whose kernels a row reports


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
  if case.op == "ssd":
    base.update(ssd_floor(case.shape, dtype, mode))
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
      if getattr(args, "profile", False):
        rows[impl].update(harness.kernel_profile(lambda: fns[impl](inputs), PROFILE_CALLS))
  return [add_floor(r) for r in rows.values()]


def torch_rows(peer_jobs, meta, args, max_seconds: float, on_row):
  """The torch peers (bench/torch_scan_worker.py, a process of its own, started after the JAX
  side) of ``peer_jobs`` (``(case, mode, dtype name, impl)``): each of its rows as a row of
  this benchmark, passed to ``on_row`` as it comes (the worker's correctness check of the peer
  as ``peer_check``). The worker starts no job after ``max_seconds`` and is killed 90 s
  later."""
  by_shape = {(c.op, tuple(c.shape)): c for c, *_ in peer_jobs}
  spec = dict(jobs=[[c.op, list(c.shape), mode, dt, impl] for c, mode, dt, impl in peer_jobs],
              repeats=args.rounds, warmup=args.warmup, min_repeat_s=args.min_block_ms / 1e3,
              max_seconds=max_seconds, check=not args.no_peer_check)
  worker = os.path.join(os.path.dirname(os.path.abspath(__file__)), "torch_scan_worker.py")
  checks = {}
  with tempfile.TemporaryFile("w+") as err:
    p = subprocess.Popen([args.torch_python or sys.executable, worker, json.dumps(spec)],
                         stdout=subprocess.PIPE, stderr=err, text=True)
    killer = threading.Timer(max_seconds + 90, p.kill)
    killer.start()
    try:
      for line in p.stdout:
        if not line.startswith("{"):
          continue
        r = json.loads(line)
        if r.get("check"):
          checks[(r["impl"], r["dtype"])] = {k: v for k, v in r.items() if k not in ("check", "op", "impl")}
          continue
        case = by_shape[(r["op"], tuple(r["shape"]))]
        peer = r.get("peer") or {}
        row = dict(suite="scan", case=case.name, op=case.op, shape=list(case.shape), mode=r["mode"],
                   dtype=r["dtype"], **meta, impl=r["impl"], status=r["status"], ms=None,
                   peer_versions={"torch": r.get("torch"), "triton": r.get("triton"),
                                  PEER_OF[r["impl"]]: peer.get("version"),
                                  f"{PEER_OF[r['impl']]}_commit": peer.get("commit")},
                   peer_check=checks.get(("fla_chunk" if r["impl"] == "fla_chunk_kernel" else r["impl"], r["dtype"])))
        if r.get("gpu"):
          row["torch_device"] = r["gpu"]
        if case.op == "ssd":
          row.update(ssd_floor(case.shape, getattr(jnp, r["dtype"]), r["mode"]))
        if r["status"] == "ok":
          t = r["timing"]
          row.update(ms=t["ms"], p10_ms=t["p10_ms"], p90_ms=t["p90_ms"], rounds=t["n_repeats"],
                     calls_per_block=t["calls_per_repeat"], first_call_s=t["first_call_s"])
        else:
          row["error"] = r.get("error")
          if r.get("traceback"):
            row["traceback"] = r["traceback"]
        on_row(add_floor(row))
      p.wait()
    finally:
      killer.cancel()
      if p.poll() is None:
        p.kill()
    if p.returncode:
      err.seek(0)
      print(f"torch worker exited {p.returncode}: {err.read()[-1500:]}", file=sys.stderr)


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
  p.add_argument("--profile", action="store_true",
                 help="also each JAX row's kernels (device_ms, kernel_ms_by_kind, top_kernels; GPU only)")
  p.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on CPU, the kernels in interpret mode")
  p.add_argument("--no-torch", action="store_true", help="skip the torch peers (mamba_ssm_triton, fla_chunk)")
  p.add_argument("--torch-peers", action="store_true", help="run the torch peers' worker under --cpu-smoke too "
                 "(its rows then say why the peers cannot run)")
  p.add_argument("--torch-python", default=None, help="the interpreter of the torch worker (default: this one)")
  p.add_argument("--peer-minutes", type=float, default=1.5,
                 help="of --max-minutes, the time kept for the torch peers after the JAX side")
  p.add_argument("--no-peer-check", action="store_true", help="skip the worker's check of the peers' outputs")
  args = p.parse_args(argv)
  from tqdm import tqdm

  start = time.perf_counter()
  peers_on = not args.no_torch and (args.torch_peers or not args.cpu_smoke)
  if peers_on:   # JAX grows its memory as needed instead of taking most of the GPU: the worker needs some
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
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
  if args.append:   # a peer that could not run is tried again
    done = {key_of(r) for r in harness.load_rows(output) if r.get("status") != "unavailable"}
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
  selected = lambda impl: args.impls is None or impl in args.impls.split(",")
  peer_jobs = [(case, mode, jnp.dtype(dt).name, impl) for case, mode, dt in jobs for impl in TORCH_IMPLS.get(case.op, ())
               if peers_on and selected(impl)
               and key_of(dict(case=case.name, impl=impl, mode=mode, dtype=jnp.dtype(dt).name,
                               shape=list(case.shape))) not in done]
  jax_minutes = args.max_minutes - (args.peer_minutes if peer_jobs else 0.0)
  if todo and jax_minutes <= 0:
    raise SystemExit(f"--peer-minutes {args.peer_minutes:g} keeps all of --max-minutes {args.max_minutes:g} for "
                     "the torch peers: no JAX row would run; raise --max-minutes or lower --peer-minutes")
  progress = tqdm(total=sum(len(t[3]) for t in todo), desc="scan", unit="row")
  with open(output, "a" if args.append else "w") as f:
    longest = 0.0  # a job starts only if one as long as the longest so far still fits
    for case, mode, dt, impls in todo:
      if time.perf_counter() - start + longest > 60 * jax_minutes:
        progress.write(f"stopped before {jax_minutes:g} of --max-minutes {args.max_minutes} "
                       f"(--peer-minutes {args.peer_minutes} kept for the torch peers): rerun with --append to resume")
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
    if peer_jobs:   # after the JAX side, in the worker's own process

      def on_row(row):
        brief = {k: row.get(k) for k in ("case", "shape", "mode", "dtype", "impl", "status", "ms", "x_floor")}
        if row["status"] == "skipped":   # past the time: not written, so that --append runs it
          print("not run (past --max-minutes):", json.dumps(brief), flush=True)
          return
        row["timestamp"] = time.strftime("%Y-%m-%dT%H:%M:%S")
        f.write(json.dumps(row) + "\n")
        f.flush()
        print(json.dumps(dict(brief, error=(row.get("error") or "")[:200] or None)), flush=True)

      torch_rows(peer_jobs, meta, args, max(60 * args.max_minutes - (time.perf_counter() - start), 30.0), on_row)


if __name__ == "__main__":
  main()
