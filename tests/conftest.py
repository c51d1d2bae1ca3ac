"""Shared pytest configuration.

* ``--gpu``: run the tests marked ``gpu`` (skipped otherwise). With ``--gpu`` on a
  machine without a CUDA GPU visible to JAX they are skipped with that reason.
* Markers (also declared in pyproject.toml): ``gpu``, ``slow``, ``thorough``, ``quick``.

Which tests are slow is decided where each test is defined, by what it runs, never by a
stopwatch: ``@pytest.mark.slow`` on the test or on one ``pytest.param``, or a module's
``pytestmark``, with a comment saying why (an interpret-mode kernel whose every call compiles
anew, a subprocess, dozens of compiles for every tangent subset, a Flax model trained eagerly,
...). ``make test`` runs ``-m "not slow"`` (a few minutes on 2 cores); ``make test-slow`` runs
``-m slow``; CI (.ci/run) runs both, the second with ``-k "not thorough"``. Every test runs in
one of the two. The rules kept here, by design:

* ``thorough``: slow cases that repeat what other slow cases cover at more sizes (more chunk
  sizes, more examples); marked ``thorough`` they are also ``slow`` (added below), so
  ``make test-slow`` runs them and CI's ``-k "not thorough"`` leaves them out.
* Doctests of the modules under ``SLOW_DOCTESTS`` are ``slow``: they build a Flax model (or
  call MLA) and run it eagerly, so every op compiles on its first use (3-10 s an example on a
  2-core CPU, whatever the shapes). The other doctests run in ``make test``.

Most of a CPU test's time is XLA compiling (the small shapes run in milliseconds), and the same
programs compile again in each xdist worker, in each step and on each run: the tests (and the
subprocesses they start) share JAX's persistent compilation cache, every compilation included,
in ``$PROBJAX_TEST_JAX_CACHE`` (default ``$XDG_CACHE_HOME/probjax/jax-test-cache``, else
``~/.cache/...``; outside the checkout, so a fresh clone finds it). ``PROBJAX_TEST_JAX_CACHE=off``
turns it off; a ``JAX_COMPILATION_CACHE_DIR`` already set is used as it is. A hit gives the
executable XLA would compile (the key holds the program, the compile options and the
jax/jaxlib versions); Pallas interpret-mode kernels with host callbacks are never cached. The
directory is cut back to the newest ``CACHE_KEEP_BYTES`` when it grows past twice that.

With ``--gpu`` on a GPU the gpu tests run longest first (``bench.gpu_suite.longest_first``: each test's
seconds in the newest full GPU suite under ``bench/results/*/gpu_suite.json``; tests it lacks
first of all): xdist's workers then end together instead of waiting on one long test at the
end, which matters on the device, whose time is rationed.
"""

from __future__ import annotations

import functools
import os

import pytest

# Pallas Mosaic GPU interpret mode blocks XLA:CPU's thread pool (one thread per core unless
# PJRT_NPROC says otherwise) in its simulated barrier waits and can hang on a small machine
# (probjax.ops.attention.backends.mosaic_gpu.config.INTERPRET_WGS); JAX reads it when it creates the CPU
# client, which test modules do at import.
os.environ.setdefault("PJRT_NPROC", "8")

CACHE_KEEP_BYTES = 1 << 30


def _compile_cache_dir() -> str | None:
  """Sets JAX's persistent compilation cache up through the environment (read when jax is
  imported, here and in the subprocesses tests start); returns its directory or None."""
  if os.environ.get("JAX_COMPILATION_CACHE_DIR"):
    return os.environ["JAX_COMPILATION_CACHE_DIR"]
  where = os.environ.get("PROBJAX_TEST_JAX_CACHE")
  if where is not None and where.strip().lower() in ("", "0", "off", "no", "false"):
    return None
  if not where:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    where = os.path.join(base, "probjax", "jax-test-cache")
  os.environ["JAX_COMPILATION_CACHE_DIR"] = where
  os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")  # the many small ones too
  os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "-1")
  return where


_CACHE_DIR = _compile_cache_dir()


def _trim_compile_cache(path: str, keep: int = CACHE_KEEP_BYTES) -> None:
  """Deletes the least recently written entries once the directory holds over ``2 * keep``."""
  try:
    files = [(e.stat().st_mtime, e.stat().st_size, e.path) for e in os.scandir(path) if e.is_file()]
  except OSError:
    return
  total = sum(size for _, size, _ in files)
  if total <= 2 * keep:
    return
  for _, size, p in sorted(files):
    if total <= keep:
      break
    try:
      os.remove(p)
      total -= size
    except OSError:
      pass

MARKERS = (
    "gpu: needs an NVIDIA GPU; run with pytest --gpu",
    "slow: long CPU tests (make test-slow); the reason is written where the test is defined",
    "thorough: slow cases repeating other slow cases at more sizes; also slow; CI skips them (-k 'not thorough')",
    "quick: a few-minute GPU selection: pytest --gpu -m 'gpu and quick'",
)

# Doctests (by module path, relative to the repository root) that run in the slow step: see above.
SLOW_DOCTESTS = ("probjax/nn/layers/", "probjax/ops/mla/")

# The conformance suites (tests/ops/conformance.py and one tests/ops/<op>/conformance.py per op)
# hold no test or doctest of their own: the test files that subclass them import them.
# --doctest-modules would import each as the one top-level module "conformance" and fail on the
# second.
collect_ignore_glob = ["ops/conformance.py", "ops/*/conformance.py"]


def pytest_addoption(parser):
  parser.addoption("--gpu", action="store_true", default=False,
                   help="run tests marked gpu (needs an NVIDIA GPU visible to JAX)")


def pytest_configure(config):
  for line in MARKERS:
    config.addinivalue_line("markers", line)


@functools.cache
def _gpu_devices() -> tuple[str, str]:
  """(``""`` or a reason why no GPU is usable, device description)."""
  try:
    import jax
    devs = jax.devices("gpu")
  except Exception as e:  # no CUDA backend / no device
    return f"--gpu given but JAX sees no GPU ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})", ""
  if not devs:
    return "--gpu given but JAX sees no GPU", ""
  return "", str(devs[0].device_kind)


def _slow_doctest(item) -> bool:
  if type(item).__name__ != "DoctestItem":
    return False
  path = item.nodeid.split("::", 1)[0].replace(os.sep, "/")
  return path.startswith(SLOW_DOCTESTS)


@pytest.hookimpl(tryfirst=True)  # before pytest's -m selection reads the markers
def pytest_collection_modifyitems(config, items):
  for it in items:
    if it.get_closest_marker("slow") is None and (it.get_closest_marker("thorough") is not None
                                                  or _slow_doctest(it)):
      it.add_marker(pytest.mark.slow)
  gpu_items = [it for it in items if it.get_closest_marker("gpu") is not None]
  if not gpu_items:
    return
  if not config.getoption("--gpu"):
    skip = pytest.mark.skip(reason="needs --gpu (tests marked gpu run only with pytest --gpu)")
  else:
    reason, _ = _gpu_devices()
    if not reason:
      from bench import gpu_suite
      items[:] = gpu_suite.longest_first(items, gpu_suite.recorded_seconds())
      return
    skip = pytest.mark.skip(reason=reason)
  for it in gpu_items:
    it.add_marker(skip)


def pytest_report_header(config):
  if config.getoption("--gpu"):
    reason, kind = _gpu_devices()
    return f"probjax: --gpu, device: {kind or reason}"
  return None


def pytest_runtest_logreport(report):
  """With --gpu, print each failure as it happens: device runs are cut off by time limits
  before pytest's end-of-run summary, which would otherwise lose the tracebacks."""
  if report.failed and _INSTAFAIL[0]:
    import sys
    sys.stdout.write(f"\n[FAILED] {report.nodeid} ({report.when})\n{report.longreprtext[-4000:]}\n")
    sys.stdout.flush()


_INSTAFAIL = [False]


def pytest_sessionstart(session):
  _INSTAFAIL[0] = bool(session.config.getoption("--gpu"))
  if _CACHE_DIR and not os.environ.get("PYTEST_XDIST_WORKER"):  # once, in the controller
    _trim_compile_cache(_CACHE_DIR)
