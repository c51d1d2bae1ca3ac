"""Sequence mixers: the Mamba-1 selective scan, Mamba-2's SSD and the linear branch of residual
linear attention (RLA). The op's face is :mod:`probjax.ops.scan.api` (``mamba_scan``,
``ssd_scan``, ``residual_linear_attention``, ``explain_dispatch``,
``available_implementations``, ``feature_map``, ``Decision`` and the call types), whose names
this package exports.

They load on first use, so that importing one of the op's modules (``probjax.ops.scan.calls``,
a backend) does not import the face, its dispatch and the backends.

>>> from probjax.ops.scan import mamba_scan
>>> from probjax.ops.scan import api
>>> mamba_scan is api.mamba_scan
True
"""

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # what type checkers see: the same names, imported (at runtime: _load on first use)
  from probjax.ops.scan.api import Decision as Decision
  from probjax.ops.scan.api import MambaCall as MambaCall
  from probjax.ops.scan.api import RLACall as RLACall
  from probjax.ops.scan.api import SSDCall as SSDCall
  from probjax.ops.scan.api import available_implementations as available_implementations
  from probjax.ops.scan.api import explain_dispatch as explain_dispatch
  from probjax.ops.scan.api import feature_map as feature_map
  from probjax.ops.scan.api import mamba_scan as mamba_scan
  from probjax.ops.scan.api import residual_linear_attention as residual_linear_attention
  from probjax.ops.scan.api import ssd_scan as ssd_scan

# The face's public names (probjax.ops.scan.api.__all__; tests/test_scan_dispatch.py checks that
# the lists agree).
__all__ = ["mamba_scan", "ssd_scan", "residual_linear_attention", "explain_dispatch",
           "available_implementations", "feature_map", "Decision", "MambaCall", "SSDCall", "RLACall"]


def _load(name: str):
  if name in __all__:
    value = getattr(importlib.import_module(f"{__name__}.api"), name)
    globals()[name] = value
    return value
  raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


if not TYPE_CHECKING:  # type checkers see the imports above, and an unknown name as an error
  __getattr__ = _load


def __dir__():
  return sorted(set(globals()) | set(__all__))
