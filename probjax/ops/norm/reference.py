"""The float64 reference every test of ``probjax.ops.norm`` compares against: values and
gradients."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from probjax.ops.norm.formula import fused

NAMES = ("x", "residual", "scale", "bias", "shift", "mod_scale")


def _mod(m, x):
  return m if m is None or m.ndim == x.ndim else jnp.expand_dims(m, -2)


def _formula(arrays, kind, eps):
  x, residual = arrays["x"], arrays.get("residual")
  if arrays.get("shift") is not None:
    mul, add = 1 + _mod(arrays["mod_scale"], x), _mod(arrays["shift"], x)
  else:
    mul, add = arrays.get("scale"), arrays.get("bias")
  return fused(x, residual, mul, add, kind=kind, eps=eps, acc=jnp.float64)


def _f64(arrays):
  return {k: jnp.asarray(np.asarray(v, np.float64)) for k, v in arrays.items() if v is not None}


def reference(x, *, kind: str, eps: float, residual=None, scale=None, bias=None, shift=None, mod_scale=None):
  """numpy float64 ``(y, h)``: ``h = x + residual`` (x without one), ``y = norm(h) * scale +
  bias`` or, with ``shift``/``mod_scale`` (adaLN, ``[B, d]`` or broadcastable to x's shape),
  ``norm(h) * (1 + mod_scale) + shift``."""
  with jax.enable_x64(True):
    y, h = _formula(_f64(dict(x=x, residual=residual, scale=scale, bias=bias, shift=shift, mod_scale=mod_scale)),
                    kind, eps)
    return np.asarray(y), np.asarray(h)


def reference_grads(dy, dh, x, *, kind: str, eps: float, **arrays):
  """numpy float64 gradients ``{name: d}`` of ``<dy, y> + <dh, h>`` (``dh`` None: ``y`` only)
  with respect to every array given (``x`` and those of :data:`NAMES` not None)."""
  with jax.enable_x64(True):
    primals = _f64(dict(x=x, **arrays))
    (y, h), pull = jax.vjp(lambda p: _formula(p, kind, eps), primals)
    cts = (jnp.asarray(np.asarray(dy, np.float64)),
           jnp.zeros_like(h) if dh is None else jnp.asarray(np.asarray(dh, np.float64)))
    (grads,) = pull(cts)
    return {k: np.asarray(v) for k, v in grads.items()}


def reference_jvp(tangents, x, *, kind: str, eps: float, **arrays):
  """numpy float64 ``(dy, dh)``: the derivative of ``(y, h)`` along ``tangents`` (a dict over the
  arrays given, as :func:`reference_grads`' names)."""
  with jax.enable_x64(True):
    primals = _f64(dict(x=x, **arrays))
    _, (ty, th) = jax.jvp(lambda p: _formula(p, kind, eps), (primals,), (_f64(tangents),))
    return np.asarray(ty), np.asarray(th)


def _qk(arrays, positions, eps, base):
  from probjax.ops.norm.formula import qk_norm_rotary
  return qk_norm_rotary(arrays["x"], arrays.get("scale"), positions, eps=eps, base=base, acc=jnp.float64)


def reference_qk_norm_rotary(x, scale, positions, *, eps: float = 1e-6, base: float = 10000.0):
  """numpy float64 ``y`` of :func:`probjax.ops.norm.qk_norm_rotary` (``scale``/``positions``
  None: no norm / no rotation)."""
  with jax.enable_x64(True):
    return np.asarray(_qk(_f64(dict(x=x, scale=scale)), positions, eps, base))


def reference_qk_norm_rotary_grads(dy, x, scale, positions, *, eps: float = 1e-6, base: float = 10000.0):
  """numpy float64 ``{"x": dx, "scale": dscale}`` (scale's only when given) of ``<dy, y>``."""
  with jax.enable_x64(True):
    y, pull = jax.vjp(lambda p: _qk(p, positions, eps, base), _f64(dict(x=x, scale=scale)))
    (grads,) = pull(jnp.asarray(np.asarray(dy, np.float64)))
    return {k: np.asarray(v) for k, v in grads.items()}


def reference_qk_norm_rotary_jvp(tangents, x, scale, positions, *, eps: float = 1e-6, base: float = 10000.0):
  """numpy float64 derivative of ``y`` along ``tangents`` (a dict over ``x`` and ``scale``)."""
  with jax.enable_x64(True):
    _, ty = jax.jvp(lambda p: _qk(p, positions, eps, base), (_f64(dict(x=x, scale=scale)),), (_f64(tangents),))
    return np.asarray(ty)
