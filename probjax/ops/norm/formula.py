"""The norm's arithmetic, shared by the XLA backend and the float64 reference."""

from __future__ import annotations

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
