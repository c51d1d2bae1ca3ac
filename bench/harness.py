"""One benchmark harness for every suite under ``bench/``.

Every suite builds a list of :class:`Case` objects (one per JSON row) and hands them to
:func:`run_cases`, which

* writes each row to ``bench/results/<device>/<suite>.json`` (``--results-dir``; one file per
  device and suite), or every row to ``--output FILE``,
* skips cases whose key is already in the output (``--append`` resumes),
* stops cleanly when ``--max-minutes`` is spent (rerun with ``--append``),
* times each case with :func:`time_fn` (:func:`probjax.core.timing.time_fn`, plus the
  kernels' time per call from a profile with ``--device-time``),
* turns failures into a status (:func:`probjax.core.timing.classify_error`) instead of aborting,
* writes one JSON object per line, flushed after each row, with the device, its compute
  capability, the library versions, the commit measured and the command line.

FLOP convention (docs/dev/architecture.md): forward = 4·B·H·Tq·Tkv·D, halved for causal;
forward+backward = 3.5 × forward.

Row schema (required fields): see :data:`REQUIRED_FIELDS`; a row's key: :data:`KEY_FIELDS`
(:func:`row_id` writes it as the text the tuning tables' evidence cites).
"""

from __future__ import annotations

import argparse
import dataclasses
import fnmatch
import json
import os
import re
import statistics
import sys
import time
from typing import Any, Callable, Iterable

from bench.peers import free_memory, peers_present, require_gpu  # noqa: F401 (require_gpu: the suites')
from probjax.core import timing
from probjax.core.timing import STATUSES, Unsupported, classify_error, device_info, summarize  # noqa: F401

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS_DIR = os.path.join(ROOT, "bench", "results")

REQUIRED_FIELDS = {
    "suite": str, "impl": str, "dtype": str, "batch": int, "q_heads": int, "kv_heads": int,
    "q_len": int, "kv_len": int, "head_dim": int, "causal": bool, "mask": str, "mode": str,
    "ms": (float, int, type(None)), "status": str, "device": str,
}
MODES = ("fwd", "fwd_bwd")
KEY_FIELDS = ("suite", "impl", "dtype", "batch", "q_heads", "kv_heads", "q_len", "kv_len",
              "head_dim", "causal", "mask", "mode", "variant")

# Human-readable labels used by the pages.
IMPL_LABELS = {
    "probjax_default": "probjax default", "probjax_xla": "probjax xla",
    "probjax_triton": "probjax triton", "probjax_pallas": "probjax pallas",
    "probjax_triton_onepass": "probjax triton (onepass bwd)",
    "probjax_triton_fused": "probjax triton (fused bwd)",
    "probjax_triton_split": "probjax triton (split bwd)", "probjax_cudnn": "probjax cudnn",
    "probjax_mosaic": "probjax mosaic", "probjax_mosaic_bwd": "probjax mosaic (mosaic bwd)",
    "probjax_repeat_kv": "probjax on repeated K/V",
    "jaxnn_xla": "jax.nn XLA", "jaxnn_cudnn": "jax.nn cuDNN",
    "torch_sdpa_flash": "torch SDPA flash", "torch_sdpa_efficient": "torch SDPA efficient",
    "torch_sdpa_cudnn": "torch SDPA cuDNN", "torch_sdpa_math": "torch SDPA math",
    "torch_flex": "torch flex_attention", "torch_cpu": "torch CPU SDPA",
    "tokamax_mosaic": "tokamax mosaic", "tokamax_triton": "tokamax triton",
    "tokamax_cudnn": "tokamax cuDNN", "tokamax_xla_chunked": "tokamax xla_chunked",
}


# ---------------------------------------------------------------------------
# FLOPs
# ---------------------------------------------------------------------------
def attention_flops(batch, q_heads, q_len, kv_len, head_dim, causal, mode) -> float:
  """fwd = 4·B·H·Tq·Tkv·D (halved for causal); fwd_bwd = 3.5 × fwd."""
  f = 4.0 * batch * q_heads * q_len * kv_len * head_dim
  if causal:
    f /= 2
  if mode == "fwd_bwd":
    f *= 3.5
  elif mode != "fwd":
    raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
  return f


def tflops(flops: float, ms: float | None) -> float | None:
  if ms is None or ms <= 0:
    return None
  return flops / (ms * 1e-3) / 1e12


# ---------------------------------------------------------------------------
# Timing
# ---------------------------------------------------------------------------
def time_fn(fn: Callable[[], Any], sync: Callable[[Any], Any], *, device_time: bool = False,
            backend: str = "jax", **kw) -> dict:
  """:func:`probjax.core.timing.time_fn` (``kw``: its arguments), and with ``device_time``, for
  calls of at most :data:`DEVICE_TIME_MAX_MS` (longer ones keep the device busy),
  ``device_ms``: the GPU kernels' summed duration per call from a profile of up to 50 more
  calls (``backend`` "jax" or "torch"), free of the host gaps that dominate short calls' wall
  clock; ``device_ms_error`` says why where it could not be read."""
  res = timing.time_fn(fn, sync, **kw)
  if device_time and res["ms"] <= DEVICE_TIME_MAX_MS:
    try:
      res["device_ms"] = kernel_ms(fn, sync, min(res["calls_per_repeat"], 50), backend)
    except Exception as e:  # noqa: BLE001 (the wall-clock row stands without it)
      res["device_ms_error"] = f"{type(e).__name__}: {e}"[:300]
  return res


def backend_of(impl: str) -> str:
  """The profiler :func:`kernel_ms` reads for an implementation name: "torch" or "jax"."""
  return "torch" if impl.startswith("torch_") else "jax"


DEVICE_TIME_MAX_MS = 2.0  # profiling a call costs ~seconds; longer calls are device-bound


def kernel_ms(fn: Callable[[], Any], sync: Callable[[Any], Any], n: int, backend: str) -> float:
  """Summed duration of the GPU kernels of ``n`` calls of ``fn``, per call, in ms (profiler:
  ``jax.profiler`` or ``torch.profiler``)."""
  return sum(k[1] for k in kernel_intervals(fn, sync, n, backend)) / n / 1e3


def kernel_intervals(fn: Callable[[], Any], sync: Callable[[Any], Any], n: int,
                     backend: str) -> list[tuple[float, float, str]]:
  """(start, duration, name), times in us, of every GPU kernel of ``n`` calls of ``fn``,
  sorted by start (profiler: ``jax.profiler`` or ``torch.profiler``). JAX calls in a process
  where torch's profiler has run (it keeps CUPTI, and JAX's trace then has no GPU streams)
  are profiled by torch's, which records every kernel of the process."""
  if backend == "torch":
    return _torch_intervals(fn, sync, n)
  try:
    return _jax_intervals(fn, sync, n)
  except RuntimeError as e:
    if "no GPU stream threads" not in str(e) or "torch" not in sys.modules:
      raise
    return _torch_intervals(fn, sync, n)


def _torch_intervals(fn, sync, n):
  import torch
  from torch.profiler import ProfilerActivity, profile
  with profile(activities=[ProfilerActivity.CUDA]) as prof:
    out = None
    for _ in range(n):
      out = fn()
    sync(out)
  kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
  if not kernels:
    raise RuntimeError("the torch profile has no CUDA kernel events")
  return sorted((float(e.time_range.start), float(e.time_range.elapsed_us()), e.name) for e in kernels)


def _jax_intervals(fn, sync, n):
  import glob
  import gzip
  import shutil
  import tempfile
  import jax
  d = tempfile.mkdtemp(prefix="probjax_trace_")
  try:
    with jax.profiler.trace(d, create_perfetto_trace=True):
      out = None
      for _ in range(n):
        out = fn()
      sync(out)
    paths = glob.glob(os.path.join(d, "**", "perfetto_trace.json.gz"), recursive=True)
    if not paths:
      raise RuntimeError("jax.profiler wrote no perfetto trace")
    with gzip.open(paths[0]) as f:
      trace = json.load(f)
    return gpu_stream_intervals(trace.get("traceEvents", []) if isinstance(trace, dict) else trace)
  finally:
    shutil.rmtree(d, ignore_errors=True)


def gpu_stream_intervals(events: list[dict]) -> list[tuple[float, float, str]]:
  """(start, duration in us, name) of the complete events on the GPU stream threads of a
  Chrome/Perfetto trace (process "/device:GPU:*", threads "Stream ..."), sorted by start;
  raises, naming the threads seen, if there are none."""
  procs = {e["pid"]: e.get("args", {}).get("name", "") for e in events
           if e.get("ph") == "M" and e.get("name") == "process_name"}
  threads = {(e["pid"], e.get("tid")): e.get("args", {}).get("name", "") for e in events
             if e.get("ph") == "M" and e.get("name") == "thread_name"}
  streams = {k for k, name in threads.items()
             if procs.get(k[0], "").startswith("/device:GPU") and name.startswith("Stream")}
  if not streams:
    seen = sorted({f"{procs.get(p, p)}/{n}" for (p, _), n in threads.items()})[:12]
    raise RuntimeError(f"no GPU stream threads in the trace (threads: {seen})")
  return sorted((float(e.get("ts", 0)), float(e.get("dur", 0)), str(e.get("name", ""))) for e in events
                if e.get("ph") == "X" and (e.get("pid"), e.get("tid")) in streams)


# ---------------------------------------------------------------------------
# Environment and results files
# ---------------------------------------------------------------------------
_PEERS: dict = {}  # which peer libraries import, once per process (setup_environment)


# Kernels by kind, from their names (cuDNN's and the Pallas attention kernels name attention;
# cuBLAS/cuBLASLt/CUTLASS gemms name matmuls).
KERNEL_KINDS = (("attention", ("attention", "attn", "flash", "fmha", "sdpa", "cudnn")),
                ("matmul", ("gemm", "nvjet", "xmma", "cutlass", "cublas", "matmul")))


def kernel_kind(name: str) -> str:
  """"attention", "matmul" or "other" (elementwise, norms, reductions, the optimizer), by the
  kernel's name."""
  low = name.lower()
  return next((kind for kind, keys in KERNEL_KINDS if any(k in low for k in keys)), "other")


def kernel_summary(intervals, steps: int, top: int = 24) -> dict:
  """Per step, from ``(start_us, duration_us, name)`` kernel intervals of ``steps`` steps:
  ``device_ms`` (the kernels' summed duration, bench.harness.kernel_ms's convention),
  ``kernels_per_step``, ``kernel_ms_by_kind`` (:func:`kernel_kind`) and ``top_kernels``: the
  ``top`` names by total time, each with ``ms_per_step`` and ``count_per_step``."""
  by_name, by_kind = {}, {}
  for _, dur, name in intervals:
    tot = by_name.setdefault(name, [0.0, 0])
    tot[0] += dur
    tot[1] += 1
    kind = kernel_kind(name)
    by_kind[kind] = by_kind.get(kind, 0.0) + dur
  ranked = sorted(by_name.items(), key=lambda kv: -kv[1][0])[:top]
  return dict(device_ms=sum(d for _, d, _ in intervals) / steps / 1e3,
              kernels_per_step=len(intervals) / steps,
              kernel_ms_by_kind={k: v / steps / 1e3 for k, v in sorted(by_kind.items())},
              top_kernels=[dict(name=n[:160], ms_per_step=t / steps / 1e3, count_per_step=k / steps)
                           for n, (t, k) in ranked])


def kernel_profile(fn: Callable[[], Any], calls: int) -> dict:
  """:func:`kernel_summary` of ``calls`` more calls of the JAX function ``fn()`` (one step each),
  or ``device_ms_error`` saying why there is none (GPU only; a failing profile leaves the timed
  row standing)."""
  import jax
  platform = jax.devices()[0].platform
  if platform != "gpu":
    return dict(device_ms_error=f"no kernel profile on platform {platform}: GPU only")
  try:
    return kernel_summary(kernel_intervals(fn, jax.block_until_ready, calls, "jax"), calls)
  except Exception as e:  # noqa: BLE001 (the timed row stands without it)
    return dict(device_ms_error=f"{type(e).__name__}: {e}"[:300])


def command_line() -> str:
  return " ".join(["python"] + ([f"-m {sys.modules['__main__'].__spec__.name}"]
                                if getattr(sys.modules.get("__main__"), "__spec__", None)
                                else [sys.argv[0]]) + sys.argv[1:])


def cudnn_route() -> str:
  """Which call probjax's cuDNN route makes here (its FFI extension or jax.nn)."""
  try:
    from probjax.ops.attention.backends import cudnn
    return cudnn.route()
  except Exception as e:  # noqa: BLE001
    return f"unknown ({type(e).__name__})"


def device_slug(device: str | None = None) -> str:
  """The results folder of a device (:func:`probjax.core.timing.device_info`'s name by
  default): ``"h200"`` for "NVIDIA H200", ``"cpu"`` for any CPU."""
  name = (device or device_info()["device"]).strip()
  if name.lower().startswith("cpu"):
    return "cpu"
  name = re.sub(r"^nvidia\s+", "", name, flags=re.IGNORECASE)
  return re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_") or "unknown"


def results_file(suite: str, results_dir: str = RESULTS_DIR, device: str | None = None) -> str:
  """``<results_dir>/<device>/<suite>.json``: where a suite's rows on a device live."""
  return os.path.join(results_dir, device_slug(device), f"{suite}.json")


def output_of(case: "Case", args) -> str:
  """The file ``case``'s row goes to: ``--output`` if given, else its suite's results file."""
  if getattr(args, "output", None):
    return args.output
  return results_file(case.suite, getattr(args, "results_dir", None) or RESULTS_DIR)



# ---------------------------------------------------------------------------
# Cases and rows
# ---------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Case(timing.Shape):
  """One measurement of a :class:`probjax.core.timing.Shape` (passed by keyword). ``run``
  returns a dict merged into the row.

  ``run()`` typically calls :func:`time_fn`; it may also return extra fields
  (``peak_bytes``, ``max_len`` ...). Exceptions become statuses.
  """
  suite: str
  impl: str
  dtype: str
  causal: bool
  mode: str
  run: Callable[[], dict] | None
  mask: str = "none"
  variant: str = ""          # extra key part (e.g. tile config); "" for most rows
  extra: dict = dataclasses.field(default_factory=dict)
  flops: bool = True          # whether tflops is meaningful (False for masked rows)
  # For --rounds: builds the call once and returns ``(timer, finish)``: ``timer()`` times it
  # (a :func:`time_fn` dict), ``finish(result)`` adds what the row needs besides the timing.
  prepare: Callable[[], tuple[Callable[[], dict], Callable[[dict], dict]]] | None = None

  def key(self) -> tuple:
    return row_key(dataclasses.asdict(self))


def row_key(row: dict) -> tuple:
  return tuple(row.get(f, "") if f == "variant" else row.get(f) for f in KEY_FIELDS)


# The suites with their own row schema (bench/lm_step.py, moe.py, scan.py, dit_step.py,
# mla.py, isab.py, quickstart.py, eager.py; and results of probes whose conclusion docs/dev/decisions.md
# records, their scripts in git history: mla_decode_tiles.json, a tile sweep of MLA's decode
# kernel, mla_decode_xla_check.json, segment_traced.json of bench/segment_traced.py): the
# fields that key their rows, by file name.
OWN_SCHEMA_KEYS = {"lm_step": ("section", "case", "impl"),
                   "moe": ("suite", "mode", "impl", "size", "dist", "shape"),
                   "scan": ("case", "impl", "mode", "dtype", "shape"),
                   "attention_jvp": ("impl", "mode", "batch", "heads", "seq", "head_dim", "causal", "dtype"),
                   "dit_step": ("section", "case", "impl"),
                   "mla": ("suite", "case", "impl", "mode"),
                   "isab": ("case", "impl", "mode"),
                   "norm": ("case", "impl", "mode", "dtype"),
                   "mla_decode_tiles": ("case", "impl"),
                   "segment_traced": ("case", "impl"),
                   "quickstart": ("suite",),
                   "eager": ("case", "impl"),
                   "mla_decode_xla_check": ("suite", "case", "impl", "mode"),
                   "gpu_suite": ("selection",),
                   "ci_times": ("step",),
                   "cpu_formulations_fit": ("call_id", "impl"),
                   "cpu_formulations_validate1": ("call_id", "impl"),
                   "cpu_formulations_validate2": ("call_id", "impl"),
                   "cpu_formulations_v2_fit": ("call_id", "impl"),
                   "cpu_formulations_v2_validate": ("call_id", "impl"),
                   "lce_memory": ("case", "impl"),
                   "decode_splits": ("call_id", "impl"),
                   "lce": ("case", "impl"),
                   "lce_validate": ("case", "impl"),
                   "attention_launches": ("case",),
                   "lm_hlo": ("case", "impl"),
                   # bench/dispatch_sample.py and bench/dispatch_ops.py: one row per drawn call and
                   # implementation (attention's fit and validation samples, each op's; a second
                   # validation sample where a rule was refitted on the first)
                   **{f"dispatch_{op}{part}": ("call_id", "impl")
                      for op in ("attention", "mla", "grouped_matmul", "mamba_scan", "ssd_scan",
                                 "residual_linear_attention")
                      for part in ("_fit", "_validate", "_validate2", "_validate3")}}


def key_function(path: str):
  """How the rows of the results file ``path`` are keyed: its suite's own fields, else
  :func:`row_key`."""
  own = OWN_SCHEMA_KEYS.get(os.path.splitext(os.path.basename(path))[0])
  return (lambda r: json.dumps([r.get(k) for k in own])) if own else row_key


def row_id(row: dict) -> str:
  """A row's key as text, e.g. ``grid probjax_default bfloat16 B4 H8/8 T4096/4096 D128 causal
  none fwd_bwd`` (``variant`` last where set): what the tuning tables' evidence and
  docs/dev/decisions.md cite."""
  parts = [row["suite"], row["impl"], row["dtype"], f"B{row['batch']}",
           f"H{row['q_heads']}/{row['kv_heads']}", f"T{row['q_len']}/{row['kv_len']}",
           f"D{row['head_dim']}", "causal" if row["causal"] else "noncausal", row["mask"], row["mode"]]
  if row.get("variant"):
    parts.append(row["variant"])
  return " ".join(str(p) for p in parts)


def find_row(rows: Iterable[dict], rid: str) -> dict | None:
  """The last row of ``rows`` whose :func:`row_id` is ``rid`` (later rows of a key win)."""
  hit = None
  for r in rows:
    if isinstance(r, dict) and "suite" in r and row_id(r) == rid:
      hit = r
  return hit


def validate_row(row: dict) -> list[str]:
  """Returns a list of schema problems (empty if the row is valid)."""
  errs = []
  for f, t in REQUIRED_FIELDS.items():
    if f not in row:
      errs.append(f"missing field {f}")
    elif not isinstance(row[f], t) or (t is int and isinstance(row[f], bool)):
      errs.append(f"field {f}: {type(row[f]).__name__} is not {t}")
  if row.get("status") not in STATUSES:
    errs.append(f"status {row.get('status')!r} not in {STATUSES}")
  if row.get("mode") not in MODES:
    errs.append(f"mode {row.get('mode')!r} not in {MODES}")
  if row.get("status") == "ok" and row.get("ms") is None and "peak_bytes" not in row \
      and "max_len" not in row and "residual_bytes" not in row and "temp_bytes" not in row:
    errs.append("status ok but no measurement (ms/peak_bytes/max_len/residual_bytes/temp_bytes)")
  if row.get("status") != "ok" and row.get("ms") is not None:
    errs.append("ms set on a row that did not run")
  return errs


def load_rows(path: str) -> list[dict]:
  """Reads JSON Lines (or a JSON list) into a list of rows; missing file -> []."""
  if not path or not os.path.exists(path):
    return []
  with open(path) as f:
    text = f.read()
  s = text.lstrip()
  if s.startswith("["):
    return json.loads(s)
  rows = []
  for line in text.splitlines():
    line = line.strip()
    if line:
      try:
        rows.append(json.loads(line))
      except json.JSONDecodeError:
        pass  # a line cut by a killed run
  return rows


def replace_rows(path: str, rows: list[dict]) -> None:
  """Writes ``rows`` into the JSON Lines file ``path``, replacing the rows of their keys
  (:func:`key_function` of the file)."""
  key = key_function(path)
  keys = {key(r) for r in rows}
  keep = [r for r in load_rows(path) if key(r) not in keys]
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  with open(path, "w") as f:
    f.writelines(json.dumps(r, default=_json_default) + "\n" for r in keep + list(rows))


def make_row(case: Case, result: dict | None, status: str, error: str | None) -> dict:
  dev = device_info()
  row = {
      "suite": case.suite, "impl": case.impl, "dtype": case.dtype, "batch": case.batch,
      "q_heads": case.q_heads, "kv_heads": case.kv_heads, "q_len": case.q_len,
      "kv_len": case.kv_len, "head_dim": case.head_dim, "causal": bool(case.causal),
      "mask": case.mask, "mode": case.mode, "ms": None, "status": status,
      "device": dev["device"],
  }
  if case.variant:
    row["variant"] = case.variant
  row.update(case.extra)
  if result:
    row.update(result)
  if status != "ok":
    row["ms"] = None
  if row.get("ms") is not None and case.flops:
    fl = attention_flops(case.batch, case.q_heads, case.q_len, case.kv_len, case.head_dim,
                         case.causal, case.mode)
    row["flops"] = fl
    row["tflops"] = tflops(fl, row["ms"])
  if error:
    row["error"] = error
  row["platform"] = dev["platform"]
  row["compute_capability"] = dev["compute_capability"]
  row["versions"] = dict(dev["versions"], probjax_cudnn_route=cudnn_route())
  if _PEERS:
    row["peers"] = dict(_PEERS)
  row["command"] = command_line()
  if dev["commit"]:
    row["commit"] = dev["commit"]
  try:
    row["loadavg_1m"] = round(os.getloadavg()[0], 2)
  except (OSError, AttributeError):
    pass
  # Suites running at once on other GPUs of the host (bench/gpu_pair.sh sets it).
  concurrent = os.environ.get("PROBJAX_CONCURRENT_SUITES")
  if concurrent:
    row["concurrent_suites"] = int(concurrent)
  row["time"] = time.strftime("%Y-%m-%dT%H:%M:%S")
  return row


def add_common_args(p: argparse.ArgumentParser) -> None:
  p.add_argument("--output", default=None,
                 help="JSON Lines file for every row (default: each suite's file under --results-dir; "
                      "without --append an --output file starts over)")
  p.add_argument("--results-dir", default=RESULTS_DIR,
                 help="rows go to RESULTS_DIR/<device>/<suite>.json (default: %(default)s); without "
                      "--append a measured case replaces its row there, other rows stay")
  p.add_argument("--append", action="store_true",
                 help="keep the rows already in the output and skip cases already measured (resume)")
  p.add_argument("--rerun-failed", action="store_true",
                 help="with --append: measure again cases whose stored status is not ok")
  p.add_argument("--quick", action="store_true", help="one tiny case per suite (CPU smoke test)")
  p.add_argument("--max-minutes", type=float, default=None,
                 help="stop starting new cases after this many minutes (rerun with --append)")
  p.add_argument("--impl", default="*", help="comma-separated glob patterns of impl names to run")
  p.add_argument("--skip-impl", default="", help="comma-separated glob patterns of impl names to skip")
  p.add_argument("--repeats", type=int, default=5)
  p.add_argument("--warmup", type=int, default=2)
  p.add_argument("--min-repeat-ms", type=float, default=10.0,
                 help="each timed repeat runs the call N times so that it lasts at least this long")
  p.add_argument("--min-total-ms", type=float, default=200.0,
                 help="more repeats (up to 50) until the timed repeats total at least this long")
  p.add_argument("--device-time", action="store_true",
                 help="also record device_ms: the GPU kernels' time per call from a profile")
  p.add_argument("--differenced", action="store_true",
                 help="time each repeat as (2n calls - n calls) / n: no per-repeat dispatch or sync cost")
  p.add_argument("--rounds", type=int, default=1,
                 help="R > 1: time the implementations of each shape in one process, in R rounds in a "
                      "rotated order (a row's ms: the median of its rounds' medians, round_ms: each)")
  p.add_argument("--no-progress", action="store_true")


def impl_selected(impl: str, args) -> bool:
  inc = [p for p in str(getattr(args, "impl", "*")).split(",") if p]
  exc = [p for p in str(getattr(args, "skip_impl", "")).split(",") if p]
  return any(fnmatch.fnmatch(impl, p) for p in inc) and not any(fnmatch.fnmatch(impl, p) for p in exc)


def timing_kwargs(args) -> dict:
  """Keyword arguments of :func:`time_fn` from the command line (callers timing torch
  add ``backend="torch"``)."""
  device_time = bool(getattr(args, "device_time", False))
  if getattr(args, "quick", False):
    return dict(warmup=1, repeats=3, min_repeat_s=0.0, max_calls=1, device_time=device_time)
  return dict(warmup=args.warmup, repeats=args.repeats, min_repeat_s=args.min_repeat_ms / 1e3,
              min_total_s=args.min_total_ms / 1e3, device_time=device_time,
              differenced=bool(getattr(args, "differenced", False)))


def select_cases(spec: str, builders: dict[str, Callable[[], list[Case]]]) -> list[Case]:
  """The cases of the comma-separated suite names in ``spec``, in ``builders``' order.

  An unknown name exits with the known ones listed, rather than silently running nothing.
  """
  names = [s for s in str(spec).split(",") if s]
  unknown = [n for n in names if n not in builders]
  if unknown or not names:
    raise SystemExit(f"--suite: unknown or empty {unknown or spec!r}; known: {', '.join(builders)}")
  return [c for name, build in builders.items() if name in names for c in build()]


def main_for(doc: str, build_cases: Callable[[argparse.Namespace], list[Case]], argv=None) -> None:
  """Command line of a suite that has only the common arguments: parse, build, run."""
  p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
  add_common_args(p)
  args = p.parse_args(argv)
  run_cases(build_cases(args), args)


def _outcome(f: Callable[[], dict | None]) -> tuple[dict | None, str, str | None]:
  """``(result, status, error)`` of ``f()``; an exception becomes its status, never aborting a sweep."""
  try:
    result = f() or {}
    return result, result.pop("status", "ok"), result.pop("error", None)
  except Exception as e:  # noqa: BLE001
    return (None, *classify_error(e))


def rotations(names, rounds: int) -> list:
  """Each round's order of ``names``: rotated by the round's index (rotating rounds)."""
  names = list(names)
  return [names[r % len(names):] + names[:r % len(names)] for r in range(rounds)] if names else [[]] * rounds


def _run_one(c: Case) -> list:
  if c.run is None:
    return [(None, "unsupported", c.extra.get("note", "not available"))]
  return [_outcome(c.run)]


def shape_groups(cases: list[Case]) -> list[list[Case]]:
  """The cases in groups of one shape (every key field but the implementation and the
  variant), in their first case's order: the implementations timed against each other."""
  groups: dict[tuple, list[Case]] = {}
  for c in cases:
    groups.setdefault((c.suite, c.dtype, c.batch, c.q_heads, c.kv_heads, c.q_len, c.kv_len, c.head_dim,
                       c.causal, c.mode, c.mask), []).append(c)
  return list(groups.values())


def _run_rounds(group: list[Case], rounds: int) -> list:
  """``--rounds``: every case of ``group`` built once (:attr:`Case.prepare`; a case without one
  runs on its own), then timed once per round in a rotated order; each row is its median
  round's timing with ``round_ms`` (every round's ms) and ``ms`` their median."""
  prepared, outcome = {}, {}
  for i, c in enumerate(group):
    if c.run is None or c.prepare is None:
      outcome[i] = _run_one(c)[0]
      continue
    prep, status, error = _outcome(lambda c=c: {"fns": c.prepare()})
    if status == "ok":
      prepared[i] = prep["fns"]
    else:
      outcome[i] = (None, status, error)
  timings = {i: [] for i in prepared}
  for order in rotations(prepared, rounds):
    for i in order:
      if i in outcome:  # failed in an earlier round
        continue
      res, status, error = _outcome(prepared[i][0])
      if status == "ok":
        timings[i].append(res)
      else:
        outcome[i] = (None, status, error)
  for i, (timer, finish) in prepared.items():
    if i in outcome:
      continue
    ms = [t["ms"] for t in timings[i]]
    median_round = sorted(timings[i], key=lambda t: t["ms"])[(len(ms) - 1) // 2]
    outcome[i] = _outcome(lambda: finish(dict(median_round, ms=statistics.median(ms), round_ms=ms,
                                              rounds=len(ms))))
  prepared = timings = None
  free_memory()  # the shape's compiled calls and buffers, before the next shape
  return [outcome[i] for i in range(len(group))]


def run_cases(cases: Iterable[Case], args, *, on_row: Callable[[dict], None] | None = None) -> list[dict]:
  """Runs cases, writing each row to :func:`output_of` it; returns the rows written now."""
  cases = [c for c in cases if impl_selected(c.impl, args)]
  if not cases:
    print("[harness] no case selected", file=sys.stderr)
    return []
  paths = {c.key(): output_of(c, args) for c in cases}
  files = sorted(set(paths.values()))
  out = files[0] if len(files) == 1 else os.path.commonpath(files)
  for path in files:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  done = {}
  if args.append:
    for path in files:
      for r in load_rows(path):
        done[row_key(r)] = r.get("status")
  todo = []
  for c in cases:
    st = done.get(c.key())
    if st is None or (getattr(args, "rerun_failed", False) and st != "ok"):
      todo.append(c)
  skipped = len(cases) - len(todo)
  if not args.append:
    if getattr(args, "output", None):
      open(args.output, "w").close()
    else:  # the cases measured now replace their rows; the file's other rows stay
      again = {c.key() for c in todo}
      for path in files:
        keep = [r for r in load_rows(path) if row_key(r) not in again]
        with open(path, "w") as f:
          f.writelines(json.dumps(r, default=_json_default) + "\n" for r in keep)
  if todo and not _PEERS:
    setup_environment(args)  # imports jax (and peers) only when there is work to do
  start = time.monotonic()
  written = []
  try:
    from tqdm import tqdm
    bar = tqdm(total=len(todo), disable=getattr(args, "no_progress", False), dynamic_ncols=True,
               file=sys.stderr)
  except ImportError:  # pragma: no cover
    bar = None
  if skipped:
    print(f"[harness] {skipped} case(s) already in {out}; skipping them", file=sys.stderr)
  stopped = 0
  rounds = max(1, int(getattr(args, "rounds", 1) or 1))
  groups = shape_groups(todo) if rounds > 1 else [[c] for c in todo]
  done_cases = 0
  for group in groups:
    if args.max_minutes is not None and time.monotonic() - start > 60 * args.max_minutes:
      stopped = len(todo) - done_cases
      break
    c = group[0]
    if bar is not None:
      bar.set_description(f"{c.suite} {c.impl if len(group) == 1 else f'{len(group)} impls'} {c.dtype} "
                          f"T={c.q_len}/{c.kv_len} D={c.head_dim} {c.mode}"[:70])
    results = _run_one(c) if len(group) == 1 and rounds == 1 else _run_rounds(group, rounds)
    for c, (result, status, error) in zip(group, results):
      row = make_row(c, result, status, error)
      with open(paths[c.key()], "a") as f:
        f.write(json.dumps(row, default=_json_default) + "\n")
      written.append(row)
      if on_row:
        on_row(row)
      if bar is not None:
        bar.update(1)
    done_cases += len(group)
  if bar is not None:
    bar.close()
  if stopped:
    print(f"[harness] --max-minutes reached: {stopped} case(s) left; rerun the same command "
          f"with --append to continue", file=sys.stderr)
  else:
    print(f"[harness] done: {len(written)} row(s) written to {out}", file=sys.stderr)
  return written


def _json_default(o):
  try:
    import numpy as np
    if isinstance(o, np.generic):
      return o.item()
  except ImportError:  # pragma: no cover
    pass
  if isinstance(o, tuple):
    return list(o)
  return str(o)


DTYPE_NAMES = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp32": "float32", "float32": "float32",
               "fp16": "float16", "float16": "float16"}


def setup_environment(args) -> dict:
  """Records device, versions, commit and which peers import; prints them once."""
  info = dict(device_info())
  try:
    peers = peers_present()
  except Exception as e:  # noqa: BLE001
    peers = {"error": repr(e)}
  _PEERS.clear()
  _PEERS.update(peers)
  info["peers"] = peers
  print("[harness] " + json.dumps(info, default=str), file=sys.stderr)
  return info
