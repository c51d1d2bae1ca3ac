"""Flax NNX layers built on probjax's ops (attention, grouped matmul, scans).

The layers load lazily (``from probjax.nn.layers import MultiHeadAttention``), so that importing
``probjax.nn.layers.attention`` does not import Flax.
"""

import importlib

_EXPORTS = {
    "MultiHeadAttention": "multi_head_attention",
    "KVCache": "kv_cache",
    "apply_rotary": "rotary",
    "MLP": "mlp",
    "FiLM": "mlp",
    "TransformerBlock": "transformer",
    "Transformer": "transformer",
    "TransformerLM": "transformer",
    "sample_logits": "decoding",
    "generate": "decoding",
    "decode_loop": "decoding",
    "MoELayer": "moe",
    "Mamba": "mamba",
    "Mamba2": "mamba",
    "RAttention": "rattention",
    "MultiHeadLatentAttention": "mla",
    "DiTBlock": "dit",
    "DiffusionTransformer": "dit",
    "MAB": "conditioners",
    "SAB": "conditioners",
    "ISAB": "conditioners",
    "PMA": "conditioners",
    "CrossAttentionConditioner": "conditioners",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
  if name in _EXPORTS:
    return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
  raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
  return sorted(list(globals()) + __all__)
