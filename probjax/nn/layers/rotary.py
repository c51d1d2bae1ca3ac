"""Rotary position embedding (RoPE) from explicit integer positions.

The rotate-half convention (GPT-NeoX, LLaMA): feature pairs ``(i, i + head_dim/2)`` are rotated
by ``positions * base ** (-2i / head_dim)``. Angles are computed in float32 (float64 for float64
inputs) from the integer positions.

>>> import jax.numpy as jnp
>>> x = jnp.ones((1, 3, 2, 4))                       # [batch, seq, heads, head_dim]
>>> y = apply_rotary(x, jnp.arange(3)[None])         # positions [batch, seq]
>>> y.shape, bool(jnp.allclose(y[:, 0], x[:, 0]))    # position 0 is the identity
((1, 3, 2, 4), True)
"""

from __future__ import annotations

import jax.numpy as jnp

from probjax.nn.layers._checks import check_array
from probjax.ops.norm.formula import rotate

__all__ = ["apply_rotary", "default_positions"]


def default_positions(batch: int, seq: int, offset=None):
  """``[batch, seq]`` int32 positions ``offset[b] + arange(seq)`` (``offset``: None or ``[batch]``)."""
  pos = jnp.broadcast_to(jnp.arange(seq, dtype=jnp.int32), (batch, seq))
  if offset is not None:
    pos = pos + jnp.asarray(offset, jnp.int32)[:, None]
  return pos


def apply_rotary(x, positions, *, base: float = 10000.0):
  """Rotates ``x [batch, seq, heads, head_dim]`` by ``positions [batch, seq]`` (ints).

  Returns an array of ``x``'s shape and dtype. ``head_dim`` must be even. A non-floating ``x``
  or non-numeric ``positions`` raise TypeError, an ``x`` of another rank ValueError.
  """
  s = check_array("x", x, ("batch", "seq", "heads", "head_dim"))
  check_array("positions", positions, ("batch", "seq"), dtype="real", sizes=s)
  head_dim = x.shape[-1]
  if head_dim % 2:
    raise ValueError(f"apply_rotary: head_dim must be even, got {head_dim}")
  positions = jnp.asarray(positions)
  if positions.shape != x.shape[:2]:
    raise ValueError(f"apply_rotary: positions must have shape [batch, seq] = {x.shape[:2]}, "
                     f"got {positions.shape}")
  ct = jnp.promote_types(x.dtype, jnp.float32)  # float32, or float64 under x64
  return rotate(x, positions, base=base, acc=ct).astype(x.dtype)
