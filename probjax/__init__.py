"""probjax: exact fast attention for JAX, and the Flax NNX layers built on it.

The names below load on first use, so ``import probjax`` does not import JAX.

>>> import jax
>>> import probjax
>>> q = k = v = jax.random.normal(jax.random.key(0), (1, 40, 2, 16))  # [batch, seq, heads, dim]
>>> probjax.dot_product_attention(q, k, v, mask=probjax.CausalMask()).shape
(1, 40, 2, 16)
>>> probjax.explain_dispatch(q.shape, k.shape, q.dtype).implementation in probjax.available_implementations()
True

Submodules: :mod:`probjax.masks` (the mask types), :mod:`probjax.nn` (the layers:
``probjax.nn.TransformerLM``, ``probjax.nn.MoELayer``, ``probjax.nn.Mamba2``, ...).
"""

import importlib
from typing import TYPE_CHECKING

from probjax.core.version import __version__  # the build reads it there (pyproject.toml)

if TYPE_CHECKING:
  # What type checkers see (mypy, pyright): the same names, imported. At runtime the
  # module-level __getattr__ below loads them on first use; tests/test_packaging.py checks
  # that this list and _EXPORTS name the same things.
  from probjax import masks as masks
  from probjax import nn as nn
  from probjax.core.autotune import autotune as autotune
  from probjax.masks import CausalMask as CausalMask
  from probjax.masks import KVLenMask as KVLenMask
  from probjax.masks import LengthMask as LengthMask
  from probjax.masks import LocalWindowMask as LocalWindowMask
  from probjax.masks import Mask as Mask
  from probjax.masks import MaskMod as MaskMod
  from probjax.masks import PrefixLMMask as PrefixLMMask
  from probjax.masks import SegmentMask as SegmentMask
  from probjax.nn.layers.attention import available_implementations as available_implementations
  from probjax.nn.layers.attention import dot_product_attention as dot_product_attention
  from probjax.nn.layers.attention import explain_dispatch as explain_dispatch
  from probjax.nn.layers.attention import flex_attention as flex_attention
  from probjax.nn.layers.attention import mha as mha

_ATTENTION = "probjax.nn.layers.attention"
_EXPORTS = {
    "dot_product_attention": _ATTENTION,
    "flex_attention": _ATTENTION,
    "mha": _ATTENTION,
    "explain_dispatch": _ATTENTION,
    "available_implementations": _ATTENTION,
    "autotune": "probjax.core.autotune",
    "Mask": "probjax.masks",
    "CausalMask": "probjax.masks",
    "LocalWindowMask": "probjax.masks",
    "KVLenMask": "probjax.masks",
    "LengthMask": "probjax.masks",
    "SegmentMask": "probjax.masks",
    "PrefixLMMask": "probjax.masks",
    "MaskMod": "probjax.masks",
}
_SUBMODULES = ("masks", "nn")

__all__ = sorted(_EXPORTS) + list(_SUBMODULES) + ["__version__"]


def _load(name: str):
  if name in _EXPORTS:
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
  elif name in _SUBMODULES:
    value = importlib.import_module(f"{__name__}.{name}")
  else:
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
  globals()[name] = value
  return value


if not TYPE_CHECKING:  # type checkers see the imports above, and an unknown name as an error
  __getattr__ = _load


def __dir__():
  return sorted(set(globals()) | set(__all__))
