"""The experts' activations, written once: the MoE expert block's strategies (dense, sorted,
fused gather-sum) and :class:`probjax.nn.layers.moe.MoELayer` all read them from here.

>>> import jax.numpy as jnp
>>> round(float(activate(jnp.array([[1.0, 2.0]]), "swiglu")[0, 0]), 4)  # silu(1) * 2
1.4621
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["ACTIVATIONS", "activate"]

ACTIVATIONS = ("swiglu", "gelu")


def activate(h, activation: str):
  """SwiGLU (``silu(gate) * up`` of the two halves, gate first) or GELU, in float32 (or
  float64)."""
  h = h.astype(jnp.promote_types(h.dtype, jnp.float32))
  if activation == "swiglu":
    gate, up = jnp.split(h, 2, axis=-1)
    return jax.nn.silu(gate) * up
  return jax.nn.gelu(h)
