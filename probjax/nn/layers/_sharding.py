"""Logical axis names on the layers' parameters (Flax NNX ``out_sharding`` metadata).

Every parameter of :class:`~probjax.nn.layers.multi_head_attention.MultiHeadAttention`,
:class:`~probjax.nn.layers.mlp.MLP`, :class:`~probjax.nn.layers.moe.MoELayer`,
:class:`~probjax.nn.layers.mamba.Mamba` / ``Mamba2``,
:class:`~probjax.nn.layers.rattention.RAttention` and of the blocks, stacks and
:class:`~probjax.nn.layers.transformer.TransformerLM` built from them carries logical axis
names, one per axis (None: not to be sharded), which ``nnx.get_partition_spec`` reads. The
table of them, parameter by parameter, is in the layers guide (docs/guide/layers.md, "Sharding
metadata"): ``"embed"`` (model width), ``"vocab"``, ``"heads"`` (heads x head_dim, flattened),
``"kv"`` (head_dim), ``"mlp"`` (feed-forward hidden width), ``"experts"``, ``"inner"`` (Mamba's
d_inner) and ``"layers"`` (a stacked Transformer's layer axis).

The names are metadata only (``eager_sharding=False``): creating a layer needs no mesh. To
shard, map the names to mesh axes with ``nnx.logical_axis_rules`` and place the state, e.g.::

    rules = [("embed", None), ("heads", "model"), ("kv", None), ("mlp", "model"),
             ("experts", "expert"), ("vocab", "model"), ("inner", "model"), ("layers", None)]
    with nnx.logical_axis_rules(rules):
      specs = nnx.get_partition_spec(nnx.state(model))
    state = jax.device_put(nnx.state(model), jax.tree.map(lambda s: NamedSharding(mesh, s), specs))
    nnx.update(model, state)

>>> from flax import nnx
>>> from probjax.nn.layers.mlp import MLP
>>> specs = nnx.get_partition_spec(nnx.state(MLP(features=8, rngs=nnx.Rngs(0))))
>>> tuple(specs["up"]["kernel"].get_value()), tuple(specs["down"]["kernel"].get_value())
(('embed', 'mlp'), ('mlp', 'embed'))
"""

from __future__ import annotations

from typing import Any

__all__ = ["AXES", "LAYERS", "names", "linear", "norm"]

AXES = ("embed", "vocab", "heads", "kv", "mlp", "experts", "inner", "layers")
LAYERS = "layers"   # nnx.vmap / nnx.scan's partition name of a stacked Transformer


def names(*axes: str | None) -> dict[str, Any]:
  """A variable's metadata: logical names ``axes`` (one per axis), no eager sharding."""
  for a in axes:
    if a is not None and a not in AXES:  # a typo here would silently replicate
      raise ValueError(f"unknown logical axis {a!r}; the layers' axes are {AXES}")
  return {"out_sharding": tuple(axes), "eager_sharding": False}


def linear(in_axis: str | None, out_axis: str | None) -> dict[str, Any]:
  """``nnx.Linear`` keyword arguments naming its kernel's ``[in, out]`` and bias's ``[out]``."""
  return dict(kernel_metadata=names(in_axis, out_axis), bias_metadata=names(out_axis))


def norm(axis: str | None, *, bias: bool = False) -> dict[str, Any]:
  """``nnx.RMSNorm`` (``bias=False``) / ``nnx.LayerNorm`` (``bias=True``) keyword arguments
  naming the scale's (and bias's) axis."""
  out = dict(scale_metadata=names(axis))
  if bias:
    out["bias_metadata"] = names(axis)
  return out
