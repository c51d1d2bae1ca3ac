"""The norm's arithmetic, shared by the XLA backend and the float64 reference."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def normalize(h, kind: str, eps: float):
  """``(h - mean) / sqrt(var + eps)`` (``kind="layer"``) or ``h / sqrt(mean(h**2) + eps)``
  (``"rms"``) over the last axis, in ``h``'s dtype."""
  if kind == "layer":
    h = h - jnp.mean(h, axis=-1, keepdims=True)
  return h * jnp.reciprocal(jnp.sqrt(jnp.mean(h * h, axis=-1, keepdims=True) + eps))


def fused(x, residual, mul, add, *, kind: str, eps: float, acc):
  """``(normalize(h) * mul + add, h)`` with ``h = x + residual`` (``x`` alone when None),
  statistics in ``acc``, the output in ``x``'s dtype; ``mul``/``add`` broadcast (None: 1, 0)."""
  h = x if residual is None else (x.astype(acc) + residual.astype(acc)).astype(x.dtype)
  y = normalize(h.astype(acc), kind, eps)
  if mul is not None:
    y = y * mul.astype(acc)
  if add is not None:
    y = y + add.astype(acc)
  return y.astype(x.dtype), h


def inv_freq(d: int, base: float, acc):
  """RoPE's ``[d // 2]`` frequencies ``base ** (-2i / d)`` in ``acc``, as
  :func:`rotate` and :func:`probjax.nn.layers.rotary.apply_rotary`."""
  return base ** (-jnp.arange(d // 2, dtype=acc) * 2.0 / d)


def qk_norm_rotary(x, scale, positions, *, eps: float, base: float, acc):
  """``x [batch, seq, heads, d]``: ``x * (rsqrt(mean(x**2) + eps) * scale)`` over ``d`` (as
  ``flax.nnx.RMSNorm``; skipped when ``scale`` is None), then the rotate-half RoPE by
  ``positions [batch, seq]`` (skipped when None), all in ``acc``; the output in x's dtype."""
  y = x.astype(acc)
  if scale is not None:
    y = y * (jax.lax.rsqrt(jnp.mean(y * y, axis=-1, keepdims=True) + eps) * scale.astype(acc))
  if positions is not None:
    y = rotate(y, positions, base=base, acc=acc)
  return y.astype(x.dtype)


def rotate(y, positions, *, base: float, acc):
  """The rotate-half RoPE of ``y [batch, seq, heads, d]`` (d even) by ``positions [batch, seq]``:
  feature pairs ``(i, i + d/2)`` turned by ``positions * base ** (-2i / d)``, all in ``acc``."""
  half = y.shape[-1] // 2
  angles = positions.astype(acc)[..., None] * inv_freq(y.shape[-1], base, acc)     # [b, t, half]
  cos, sin = jnp.cos(angles)[:, :, None], jnp.sin(angles)[:, :, None]              # [b, t, 1, half]
  y1, y2 = y[..., :half].astype(acc), y[..., half:].astype(acc)
  return jnp.concatenate([y1 * cos - y2 * sin, y2 * cos + y1 * sin], axis=-1)
