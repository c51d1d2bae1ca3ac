"""Feed-forward blocks (GELU or SwiGLU) and FiLM conditioning.

>>> import jax.numpy as jnp
>>> from flax import nnx
>>> MLP(features=16, hidden_features=32, activation="swiglu", rngs=nnx.Rngs(0))(jnp.ones((2, 5, 16))).shape
(2, 5, 16)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from probjax.nn.layers._checks import check_array
from probjax.nn.layers import _sharding as shd

__all__ = ["MLP", "FiLM", "default_hidden_features"]

ACTIVATIONS = ("gelu", "swiglu")


def default_hidden_features(features: int, activation: str) -> int:
  """The hidden width of an MLP (or an expert) left unset: ``4 * features`` (GELU) or
  ``round_up(8/3 * features, 64)`` (SwiGLU).

  >>> default_hidden_features(96, "gelu"), default_hidden_features(96, "swiglu")
  (384, 256)
  """
  return 4 * features if activation == "gelu" else -(-(8 * features // 3) // 64) * 64


class MLP(nnx.Module):
  """``[batch, seq, features] -> [batch, seq, features]`` (row-wise: any leading axes,
``[..., features]``; a floating ``x`` whose last axis is not ``features`` raises ValueError
naming ``x``, an integer one TypeError).

  ``activation="gelu"``: ``W2 gelu(W1 x)``; ``"swiglu"``: ``W2 (silu(x Wg) * (x Wu))`` with the
  gate and up projections fused into one matmul. ``hidden_features`` defaults to
  ``4 * features`` (GELU) or ``round_up(8/3 * features, 64)`` (SwiGLU, about the GELU MLP's
  parameter count).
  """

  def __init__(self, *, features: int, hidden_features: int | None = None, activation: str = "gelu",
               use_bias: bool = False, dtype=None, param_dtype=jnp.float32, rngs: nnx.Rngs):
    if activation not in ACTIVATIONS:
      raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    if hidden_features is None:
      hidden_features = default_hidden_features(features, activation)
    self.features, self.activation, self.hidden_features = features, activation, hidden_features
    kw = dict(use_bias=use_bias, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    width = hidden_features * (2 if activation == "swiglu" else 1)
    self.up = nnx.Linear(features, width, **kw, **shd.linear("embed", "mlp"))
    self.down = nnx.Linear(hidden_features, features, **kw, **shd.linear("mlp", "embed"))

  def __call__(self, x):
    check_array("x", x, (..., ("features", self.features)))
    h = self.up(x)
    if self.activation == "swiglu":
      gate, up = jnp.split(h, 2, axis=-1)
      h = jax.nn.silu(gate) * up
    else:
      h = jax.nn.gelu(h)
    return self.down(h)


class FiLM(nnx.Module):
  """Feature-wise affine conditioning: ``x * (1 + scale(c)) + shift(c)`` for ``num`` sites.

  ``context [batch, context_features]`` gives ``num`` (scale, shift) pairs of
  ``[batch, 1, features]`` (broadcast over the sequence). Zero-initialized: the identity at
  initialization.
  """

  def __init__(self, *, features: int, context_features: int, num: int = 1, dtype=None,
               param_dtype=jnp.float32, rngs: nnx.Rngs):
    self.features, self.context_features, self.num = features, context_features, num
    self.proj = nnx.Linear(context_features, 2 * num * features, kernel_init=nnx.initializers.zeros_init(),
                           dtype=dtype, param_dtype=param_dtype, rngs=rngs)

  def __call__(self, context):
    """``[(scale, shift), ...]`` (``num`` pairs), each ``[batch, 1, features]``, from a floating
    ``context [batch, context_features]``."""
    check_array("context", context, ("batch", ("context_features", self.context_features)))
    p = self.proj(context)[:, None, :]
    parts = jnp.split(p, 2 * self.num, axis=-1)
    return [(parts[2 * i], parts[2 * i + 1]) for i in range(self.num)]

  @staticmethod
  def apply(x, scale_shift):
    if scale_shift is None:
      return x
    scale, shift = scale_shift
    return x * (1 + scale.astype(x.dtype)) + shift.astype(x.dtype)
