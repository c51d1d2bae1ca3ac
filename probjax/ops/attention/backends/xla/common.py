"""What the dense and flash formulations share: the compute dtype."""

from __future__ import annotations

import jax.numpy as jnp


def compute_dtype(dtype) -> jnp.dtype:
  """The dtype of scores, softmax and accumulation: float64 for float64 inputs, else float32."""
  return jnp.dtype(jnp.float64 if jnp.dtype(dtype) == jnp.float64 else jnp.float32)
