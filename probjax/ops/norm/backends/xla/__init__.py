"""``"xla"``: the norm as plain ``jnp`` (XLA fuses the add, statistics and modulation);
reverse and forward mode by autodiff. Exact for every call on every device."""

from __future__ import annotations

import jax.numpy as jnp

from probjax.core.backend import Backend
from probjax.ops.norm.call import NormCall
from probjax.ops.norm.formula import fused, qk_norm_rotary


class Xla(Backend[NormCall]):
  name = "xla"
  aliases = ("jnp",)

  def supports(self, call: NormCall, device) -> str | None:
    return None

  def __call__(self, x, residual, mul, add, *, call: NormCall):
    """``x``/``residual`` ``[rows, d]``; ``mul``/``add`` ``[1, d]`` or ``[rows, d]`` (or None).
    Returns ``(y, h)``, both ``[rows, d]`` in x's dtype."""
    acc = jnp.promote_types(x.dtype, jnp.float32)
    return fused(x, residual, mul, add, kind=call.kind, eps=call.eps, acc=acc)

  def qk_norm_rotary(self, x, scale, positions, *, call: NormCall):
    """``x [batch, seq, heads, head_dim]``, ``scale [head_dim]`` or None, ``positions [batch,
    seq]`` or None. Returns ``y``, x's shape and dtype."""
    acc = jnp.promote_types(x.dtype, jnp.float32)
    return qk_norm_rotary(x, scale, positions, eps=call.eps, base=call.rotary_base, acc=acc)
