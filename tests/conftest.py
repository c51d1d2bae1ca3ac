"""Shared pytest configuration.

* ``--gpu``: run the tests marked ``gpu`` (skipped otherwise). With ``--gpu`` on a
  machine without a CUDA GPU visible to JAX they are skipped with that reason.
* markers ``gpu`` and ``slow`` (also declared in pyproject.toml).
"""

from __future__ import annotations

import functools
import os
import pathlib

import pytest

# Pallas Mosaic GPU interpret mode blocks XLA:CPU's thread pool (one thread per core unless
# PJRT_NPROC says otherwise) in its simulated barrier waits and can hang on a small machine
# (probjax.ops.attention.backends.mosaic_gpu.config.INTERPRET_WGS); JAX reads it when it creates the CPU
# client, which test modules do at import.
os.environ.setdefault("PJRT_NPROC", "8")


def pytest_addoption(parser):
  parser.addoption("--gpu", action="store_true", default=False,
                   help="run tests marked gpu (needs an NVIDIA GPU visible to JAX)")


def pytest_configure(config):
  config.addinivalue_line("markers", "gpu: needs an NVIDIA GPU; run with pytest --gpu")
  config.addinivalue_line("markers", "slow: long CPU tests")
  config.addinivalue_line("markers", "quick: a few-minute GPU selection: pytest --gpu -m 'gpu and quick'")


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


_SLOW_LIST = pathlib.Path(__file__).with_name("slow_tests.txt")


def _measured_slow() -> set[str]:
  """Node ids listed in tests/slow_tests.txt (measured: see its header)."""
  lines = _SLOW_LIST.read_text().splitlines() if _SLOW_LIST.exists() else []
  return {l.strip() for l in lines if l.strip() and not l.startswith("#")}


@pytest.hookimpl(tryfirst=True)  # before pytest's -m selection reads the markers
def pytest_collection_modifyitems(config, items):
  slow = _measured_slow()
  for it in items:
    if it.nodeid in slow:
      it.add_marker(pytest.mark.slow)
  gpu_items = [it for it in items if it.get_closest_marker("gpu") is not None]
  if not gpu_items:
    return
  if not config.getoption("--gpu"):
    skip = pytest.mark.skip(reason="needs --gpu (tests marked gpu run only with pytest --gpu)")
  else:
    reason, _ = _gpu_devices()
    if not reason:
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
