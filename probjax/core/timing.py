"""Timing, error classification and device description, shared by
:mod:`probjax.attention_report` and the benchmark harness (``bench/harness.py``).

* :func:`time_fn`: warm-up, then repeats of ``n`` device-synchronised calls; the median,
  p10 and p90 of the per-call times (``differenced=True``: each repeat as ``2n`` calls
  minus ``n`` calls, which cancels what a repeat pays once).
* :func:`classify_error`: an exception as a row status (``oom``, ``fail``, ``unsupported``,
  ``error``) and its message, so that one failing measurement never ends a run.
* :func:`device_info`: the device, the library versions and the probjax commit measured.
* :class:`Shape`: the shape every measured attention call (a report case, a benchmark row) names.

Only the standard library (and :mod:`probjax.core.config`, standard library only too) is imported
at module level: the torch worker of the CPU suite, which runs in an interpreter without JAX,
imports this module too.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import platform
import statistics
import subprocess
import sys
import time
import traceback
from typing import Any, Callable

from probjax.core import config

STATUSES = ("ok", "oom", "unsupported", "fail", "error")


class Unsupported(Exception):
  """The implementation cannot run this case (status "unsupported")."""


@dataclasses.dataclass(frozen=True)
class Shape:
  """An attention call's shape: q ``[batch, q_len, q_heads, head_dim]``, k and v
  ``[batch, kv_len, kv_heads, head_dim]``."""
  batch: int
  q_heads: int
  kv_heads: int
  q_len: int
  kv_len: int
  head_dim: int

  @property
  def work(self) -> int:
    """``batch * q_heads * q_len * kv_len``, what the dispatch thresholds count."""
    return self.batch * self.q_heads * self.q_len * self.kv_len


# ---------------------------------------------------------------------------
# timing
# ---------------------------------------------------------------------------
def percentile(xs, p: float) -> float:
  """Linear-interpolated percentile (p in [0, 100]) of a non-empty sequence."""
  s = sorted(xs)
  if not s:
    raise ValueError("percentile of an empty sequence")
  k = (len(s) - 1) * p / 100.0
  lo, hi = math.floor(k), math.ceil(k)
  return s[lo] + (s[hi] - s[lo]) * (k - lo)


def summarize(times_ms) -> dict:
  """``{"ms": median, "p10_ms", "p90_ms", "n_repeats"}`` of per-call times."""
  times_ms = list(times_ms)
  return {"ms": statistics.median(times_ms), "p10_ms": percentile(times_ms, 10),
          "p90_ms": percentile(times_ms, 90), "n_repeats": len(times_ms)}


def time_fn(fn: Callable[[], Any], sync: Callable[[Any], Any], *, warmup: int = 2,
            repeats: int = 7, min_repeat_s: float = 0.02, max_calls: int = 1000,
            min_total_s: float = 0.0, max_repeats: int = 50,
            clock: Callable[[], float] = time.perf_counter, differenced: bool = False) -> dict:
  """Per-call milliseconds of ``fn``: :func:`summarize` of the repeats, plus
  ``calls_per_repeat`` and ``first_call_s`` (compilation and first run).

  ``fn()`` launches the work and returns what ``sync`` waits on (``jax.block_until_ready``,
  or a wrapper of ``torch.cuda.synchronize``). The first call and ``warmup`` more are not
  timed. One synced call estimates the call's time; a repeat runs ``n`` calls, enough to
  last ``min_repeat_s`` (at most ``max_calls``), and syncs once at its end. Where
  ``repeats`` repeats total less than ``min_total_s``, more run (at most ``max_repeats``),
  so that long calls get as many samples as short ones.

  ``differenced``: each repeat times ``n`` and then ``2 n`` calls and takes the difference
  over ``n``, which cancels the first call's dispatch latency and the final sync that a
  plain repeat spreads over its ``n`` calls; the result says ``timing: "differenced"``.
  Where the calls are bound by host dispatch the difference of two noisy blocks scatters:
  time those plain.
  """
  t0 = clock()
  sync(fn())
  first = clock() - t0
  for _ in range(warmup):
    sync(fn())
  t0 = clock()
  sync(fn())
  one = max(clock() - t0, 1e-7)
  n = int(min(max_calls, max(1, math.ceil(min_repeat_s / one))))
  repeats = max(repeats, min(max_repeats, math.ceil(min_total_s / (n * one))))

  def block(calls: int) -> float:
    t0 = clock()
    out = None
    for _ in range(calls):
      out = fn()
    sync(out)
    return clock() - t0

  times = []
  for _ in range(repeats):
    if differenced:
      once = block(n)
      times.append((block(2 * n) - once) / n * 1e3)
    else:
      times.append(block(n) / n * 1e3)
  res = summarize(times)
  if differenced:
    res["timing"] = "differenced"
  res["calls_per_repeat"] = n
  res["first_call_s"] = first
  return res


# ---------------------------------------------------------------------------
# errors
# ---------------------------------------------------------------------------
def classify_error(exc: BaseException) -> tuple[str, str]:
  """``(status, message)`` of an exception.

  oom: out of device memory (XLA RESOURCE_EXHAUSTED, torch OutOfMemoryError);
  fail: XLA autotuning found no kernel configuration (NOT_FOUND);
  unsupported: the implementation rejects the shape or backend (:class:`Unsupported`,
  NotImplementedError, ImportError, ValueError, a TypeError raised inside probjax, torch's
  "No available kernel");
  error: anything else. The message (at most 2000 characters) is kept.
  """
  name = type(exc).__name__
  msg = f"{name}: {exc}"
  low = msg.lower()
  short = msg if len(msg) < 2000 else msg[:2000] + "..."
  if ("resource_exhausted" in low or "out of memory" in low or "outofmemory" in low
      or name == "OutOfMemoryError" or isinstance(exc, MemoryError) or "failed to allocate" in low):
    return "oom", short
  if "not_found" in low and ("autotun" in low or "config" in low or "algorithm" in low):
    return "fail", short
  if isinstance(exc, (Unsupported, NotImplementedError, ImportError)):
    return "unsupported", short
  if "no available kernel" in low or "not supported" in low or "unsupported" in low:
    return "unsupported", short
  if isinstance(exc, ValueError):  # implementations reject shapes and dtypes with ValueError
    return "unsupported", short
  if isinstance(exc, TypeError) and "probjax" in "".join(traceback.format_tb(exc.__traceback__)):
    return "unsupported", short
  return "error", short


# ---------------------------------------------------------------------------
# device, versions, commit
# ---------------------------------------------------------------------------
@functools.cache
def library_versions() -> dict:
  """Versions of Python and of the libraries a measurement depends on."""
  import importlib.metadata as md
  out = {"python": platform.python_version()}
  for pkg in ("jax", "jaxlib", "flax", "numpy", "torch", "tokamax", "triton", "probjax"):
    try:
      out[pkg] = md.version(pkg)
    except Exception:  # noqa: BLE001 (not installed as a distribution)
      mod = sys.modules.get(pkg)
      if mod is not None and getattr(mod, "__version__", None):
        out[pkg] = mod.__version__
  return out


def cpu_name() -> str:
  try:
    with open("/proc/cpuinfo") as f:
      for line in f:
        if line.startswith("model name"):
          return line.split(":", 1)[1].strip()
  except OSError:
    pass
  return platform.processor() or platform.machine()


@functools.cache
def code_commit() -> str | None:
  """The probjax commit measured: ``$PROBJAX_COMMIT`` (a device machine gets the working
  tree without .git), else ``git rev-parse --short HEAD`` with ``+dirty`` for local edits
  under ``probjax/``; None outside a checkout."""
  commit = config.COMMIT.value()
  if commit is None:
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    try:
      run = lambda *a: subprocess.run(["git", "-C", root, *a], capture_output=True, text=True, timeout=10)
      head = run("rev-parse", "--short", "HEAD")
      if head.returncode == 0:
        dirty = run("status", "--porcelain", "--untracked-files=no", "probjax").stdout.strip()
        commit = head.stdout.strip() + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
      pass
  return commit


@functools.cache
def device_info() -> dict:
  """JAX's first device: ``device`` (its name; CPUs with model and threads), ``platform``
  ("cpu", "gpu", ...), ``compute_capability`` (None off NVIDIA GPUs), ``versions``
  (:func:`library_versions`) and ``commit`` (:func:`code_commit`)."""
  info = {"device": "unknown", "platform": "unknown", "compute_capability": None}
  try:
    import jax
    d = jax.devices()[0]
    info["platform"] = "gpu" if d.platform in ("gpu", "cuda", "rocm") else d.platform
    if d.platform == "cpu":
      info["device"] = f"CPU ({cpu_name()}, {os.cpu_count()} threads)"
    else:
      info["device"] = str(getattr(d, "device_kind", "") or d)
      info["compute_capability"] = getattr(d, "compute_capability", None)
  except Exception as e:  # noqa: BLE001 (recorded, never raised)
    info["device_error"] = repr(e)
  info["versions"] = library_versions()
  info["commit"] = code_commit()
  return info
