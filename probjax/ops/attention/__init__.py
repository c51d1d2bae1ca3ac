"""Exact attention: the op's face is :mod:`probjax.ops.attention.api` (``dot_product_attention``,
``flex_attention``, ``mha``, ``explain_dispatch``, ``available_implementations``, the mask
types), whose names this package exports.

They load on first use, so that importing one of the op's modules (``probjax.ops.attention.masks``,
a backend) does not import the face, its dispatch and the backends.

>>> from probjax.ops.attention import dot_product_attention, CausalMask
>>> from probjax.ops.attention import api
>>> dot_product_attention is api.dot_product_attention
True
"""

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # what type checkers see: the same names, imported (at runtime: _load on first use)
  from probjax.ops.attention.api import CausalMask as CausalMask
  from probjax.ops.attention.api import CudnnConfig as CudnnConfig
  from probjax.ops.attention.api import Decision as Decision
  from probjax.ops.attention.api import KVLenMask as KVLenMask
  from probjax.ops.attention.api import LengthMask as LengthMask
  from probjax.ops.attention.api import LocalWindowMask as LocalWindowMask
  from probjax.ops.attention.api import Mask as Mask
  from probjax.ops.attention.api import MaskMod as MaskMod
  from probjax.ops.attention.api import MaskWithDense as MaskWithDense
  from probjax.ops.attention.api import PrefixLMMask as PrefixLMMask
  from probjax.ops.attention.api import SegmentMask as SegmentMask
  from probjax.ops.attention.api import available_implementations as available_implementations
  from probjax.ops.attention.api import context_parallel_attention as context_parallel_attention
  from probjax.ops.attention.api import dot_product_attention as dot_product_attention
  from probjax.ops.attention.api import explain_dispatch as explain_dispatch
  from probjax.ops.attention.api import flex_attention as flex_attention
  from probjax.ops.attention.api import mha as mha

# The face's public names (probjax.ops.attention.api.__all__; tests/test_import_rules.py checks
# that the lists agree).
__all__ = [
    "dot_product_attention", "flex_attention", "mha", "explain_dispatch", "available_implementations",
    "Mask", "MaskWithDense", "CausalMask", "KVLenMask", "LengthMask", "LocalWindowMask", "SegmentMask", "PrefixLMMask",
    "MaskMod",
    "Decision",
    "CudnnConfig",
    "context_parallel_attention",
]


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
