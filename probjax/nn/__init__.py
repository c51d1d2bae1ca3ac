"""Neural-network layers: ``probjax.nn.layers`` (attention and the Flax NNX layers)."""

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
  # What type checkers see: the layers, imported (``probjax.nn.layers`` loads them on first
  # use at runtime). tests/test_packaging.py checks the list against ``layers.__all__``.
  from probjax.nn import layers as layers
  from probjax.nn.layers import MAB as MAB
  from probjax.nn.layers import MLP as MLP
  from probjax.nn.layers import PMA as PMA
  from probjax.nn.layers import SAB as SAB
  from probjax.nn.layers import CrossAttentionConditioner as CrossAttentionConditioner
  from probjax.nn.layers import DiffusionTransformer as DiffusionTransformer
  from probjax.nn.layers import DiTBlock as DiTBlock
  from probjax.nn.layers import FiLM as FiLM
  from probjax.nn.layers import ISAB as ISAB
  from probjax.nn.layers import KVCache as KVCache
  from probjax.nn.layers import Mamba as Mamba
  from probjax.nn.layers import Mamba2 as Mamba2
  from probjax.nn.layers import MoELayer as MoELayer
  from probjax.nn.layers import MultiHeadAttention as MultiHeadAttention
  from probjax.nn.layers import MultiHeadLatentAttention as MultiHeadLatentAttention
  from probjax.nn.layers import PagedKVCache as PagedKVCache
  from probjax.nn.layers import RAttention as RAttention
  from probjax.nn.layers import Transformer as Transformer
  from probjax.nn.layers import TransformerBlock as TransformerBlock
  from probjax.nn.layers import TransformerLM as TransformerLM
  from probjax.nn.layers import apply_rotary as apply_rotary
  from probjax.nn.layers import decode_loop as decode_loop
  from probjax.nn.layers import generate as generate
  from probjax.nn.layers import sample_logits as sample_logits


def _load(name: str):
  layers = importlib.import_module("probjax.nn.layers")
  if name == "layers":
    return layers
  if name in layers.__all__:
    return getattr(layers, name)
  raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


if not TYPE_CHECKING:  # type checkers see the imports above, and an unknown name as an error
  __getattr__ = _load
