"""The float64 reference every test of ``probjax.ops.norm`` compares against."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from probjax.ops.norm.formula import fused


def _f64(a):
  return None if a is None else jnp.asarray(np.asarray(a, np.float64))


def _mod(m, x):
  return m if m is None or m.ndim == x.ndim else jnp.expand_dims(m, -2)


def reference(x, *, kind: str, eps: float, residual=None, scale=None, bias=None, shift=None, mod_scale=None):
  """float64 ``(y, h)``: ``h = x + residual``, ``y = norm(h) * scale + bias`` or, with
  ``shift``/``mod_scale`` (adaLN, ``[B, d]`` or x's shape), ``norm(h) * (1 + mod_scale) + shift``."""
  with jax.enable_x64(True):
    x, residual = _f64(x), _f64(residual)
    if shift is not None:
      mul, add = 1 + _mod(_f64(mod_scale), x), _mod(_f64(shift), x)
    else:
      mul, add = _f64(scale), _f64(bias)
    return fused(x, residual, mul, add, kind=kind, eps=eps, acc=jnp.float64)
