"""Flax NNX layers built on probjax's ops (attention, grouped matmul, scans).

The layers load lazily (``from probjax.nn.layers import MultiHeadAttention``), so that importing
``probjax.nn.layers.attention`` does not import Flax.
"""

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
  # What type checkers see: the same names, imported from their modules (at runtime the
  # module-level __getattr__ below imports each module on first use). tests/test_packaging.py
  # checks that this list and _EXPORTS agree.
  from probjax.nn.layers.conditioners import MAB as MAB
  from probjax.nn.layers.conditioners import ISAB as ISAB
  from probjax.nn.layers.conditioners import PMA as PMA
  from probjax.nn.layers.conditioners import SAB as SAB
  from probjax.nn.layers.conditioners import CrossAttentionConditioner as CrossAttentionConditioner
  from probjax.nn.layers.decoding import decode_loop as decode_loop
  from probjax.nn.layers.decoding import generate as generate
  from probjax.nn.layers.decoding import sample_logits as sample_logits
  from probjax.nn.layers.dit import DiffusionTransformer as DiffusionTransformer
  from probjax.nn.layers.dit import DiTBlock as DiTBlock
  from probjax.nn.layers.kv_cache import KVCache as KVCache
  from probjax.nn.layers.kv_cache import PagedKVCache as PagedKVCache
  from probjax.nn.layers.mamba import Mamba as Mamba
  from probjax.nn.layers.mamba import Mamba2 as Mamba2
  from probjax.nn.layers.mla import MultiHeadLatentAttention as MultiHeadLatentAttention
  from probjax.nn.layers.mlp import MLP as MLP
  from probjax.nn.layers.mlp import FiLM as FiLM
  from probjax.nn.layers.moe import MoELayer as MoELayer
  from probjax.nn.layers.multi_head_attention import MultiHeadAttention as MultiHeadAttention
  from probjax.nn.layers.rattention import RAttention as RAttention
  from probjax.nn.layers.rotary import apply_rotary as apply_rotary
  from probjax.nn.layers.transformer import Transformer as Transformer
  from probjax.nn.layers.transformer import TransformerBlock as TransformerBlock
  from probjax.nn.layers.transformer import TransformerLM as TransformerLM

_EXPORTS = {
    "MultiHeadAttention": "multi_head_attention",
    "KVCache": "kv_cache",
    "PagedKVCache": "kv_cache",
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


def _load(name: str):
  if name in _EXPORTS:
    return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
  raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


if not TYPE_CHECKING:  # type checkers see the imports above, and an unknown name as an error
  __getattr__ = _load


def __dir__():
  return sorted(list(globals()) + __all__)
