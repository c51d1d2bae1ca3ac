"""Neural-network layers: ``probjax.nn.layers`` (attention and the Flax NNX layers)."""

import importlib


def __getattr__(name):
  layers = importlib.import_module("probjax.nn.layers")
  if name == "layers":
    return layers
  if name in layers.__all__:
    return getattr(layers, name)
  raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
