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

A stacked Transformer's layers run unrolled over :func:`layer_views` (per-layer copies whose
names drop ``"layers"``); :func:`restack_state` writes back what such a run changed besides the
parameters.

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

import jax
import jax.numpy as jnp
from flax import nnx

__all__ = ["AXES", "LAYERS", "names", "linear", "norm", "layer_views", "restack_state"]

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


def _layer_slice(v, i):
  """Layer ``i`` of a stacked variable (or array), its logical names without the layer axis."""
  if not isinstance(v, nnx.Variable):
    return v[i]
  axes = v.get_metadata().get("out_sharding")
  v = v.replace(v.get_value()[i])
  if axes and axes[0] == LAYERS:
    v.set_metadata(out_sharding=tuple(axes[1:]))
  return v


def layer_views(stacked: nnx.Module, num_layers: int) -> list[nnx.Module]:
  """The ``num_layers`` layers of a module made by ``nnx.vmap`` (every variable stacked on a
  leading layer axis) as separate modules, each holding its slices (copies) of the variables
  with the layer axis dropped from their logical names. A loop over them runs the layers
  unrolled; :func:`restack_state` writes back what they changed besides parameters."""
  graphdef, state = nnx.split(stacked)
  is_var = lambda v: isinstance(v, nnx.Variable)
  return [nnx.merge(graphdef, jax.tree.map(lambda v, i=i: _layer_slice(v, i), state, is_leaf=is_var))
          for i in range(num_layers)]


def restack_state(stacked: nnx.Module, views: list[nnx.Module]) -> None:
  """Write the variables other than parameters of :func:`layer_views`' ``views`` (e.g.
  dropout's RNG counters, advanced by a training call) back into ``stacked``, so that the
  next call draws new masks as it does under ``nnx.scan``."""
  rest = [nnx.state(v, nnx.Not(nnx.Param)) for v in views]
  if jax.tree.leaves(rest[0]):
    nnx.update(stacked, jax.tree.map(lambda *a: jnp.stack(a), *rest))
