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

from probjax.core.version import __version__  # the build reads it there (pyproject.toml)

_ATTENTION = "probjax.nn.layers.attention"
_EXPORTS = {
    "dot_product_attention": _ATTENTION,
    "flex_attention": _ATTENTION,
    "mha": _ATTENTION,
    "explain_dispatch": _ATTENTION,
    "available_implementations": _ATTENTION,
    "Mask": "probjax.masks",
    "CausalMask": "probjax.masks",
    "LocalWindowMask": "probjax.masks",
    "KVLenMask": "probjax.masks",
    "LengthMask": "probjax.masks",
    "SegmentMask": "probjax.masks",
    "PrefixLMMask": "probjax.masks",
}
_SUBMODULES = ("masks", "nn")

__all__ = sorted(_EXPORTS) + list(_SUBMODULES) + ["__version__"]


def __getattr__(name):
  if name in _EXPORTS:
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
  elif name in _SUBMODULES:
    value = importlib.import_module(f"{__name__}.{name}")
  else:
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
  globals()[name] = value
  return value


def __dir__():
  return sorted(set(globals()) | set(__all__))
