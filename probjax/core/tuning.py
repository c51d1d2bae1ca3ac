"""Per-device tuned values of an op, read from data: ``probjax/ops/<op>/tuning/*.json``.

An op's ``tuning/`` folder holds values only (the measurements behind them live under
``bench/`` and in ``docs/dev/decisions.md``): ``cpu.json`` for every CPU, ``gpu.json`` for every
NVIDIA GPU, and ``sm_XY.json`` for compute capability X.Y, whose entries replace ``gpu.json``'s.
Each file is one JSON object of named values (lists read as tuples). :func:`values` merges the
files that apply to a device; an op reads its values through it when it decides, so a new
device's table is one file. Attention's device table, with its typed groups, has its own loader
(``probjax/ops/attention/tuning/``).

>>> import os, probjax.ops.scan as scan
>>> from probjax.core.device import Device
>>> folder = os.path.join(os.path.dirname(scan.__file__), "tuning")
>>> values(folder, Device("cpu"))["default"]["mamba_scan"]
'scan'
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Mapping

from probjax.core.device import Device


def _tuple(x):
  if isinstance(x, list):
    return tuple(_tuple(v) for v in x)
  if isinstance(x, dict):
    return {k: _tuple(v) for k, v in x.items()}
  return x


@functools.lru_cache(maxsize=None)
def _read(path: str) -> Mapping:
  if not os.path.exists(path):
    return {}
  with open(path) as f:
    data = json.load(f)
  if not isinstance(data, dict):
    raise ValueError(f"{path}: a tuning file is one JSON object of named values")
  return _tuple(data)


def files(folder: str, device: Device) -> list[str]:
  """The files of ``folder`` that apply to ``device``, the more specific last."""
  names = ["gpu.json"] if device.platform == "gpu" else [f"{device.platform}.json"]
  if device.platform == "gpu" and device.compute_capability:
    names.append("sm_%d%d.json" % tuple(device.compute_capability))
  return [os.path.join(folder, n) for n in names]


def values(folder: str, device: Device) -> dict:
  """The tuned values for ``device``: the applicable files of ``folder`` merged, the more
  specific one's entries winning; empty where none applies."""
  out: dict = {}
  for path in files(folder, device):
    out.update(_read(path))
  return out
