"""The face of ``probjax.ops.norm``: RMS and layer norm with an optional fused residual add,
DiT's adaLN modulation, and attention's fused per-head q/k RMS norm + RoPE, with
``explain_dispatch``.

>>> import jax, jax.numpy as jnp
>>> k = jax.random.split(jax.random.key(0), 3)
>>> x, r = jax.random.normal(k[0], (2, 5, 8)), jax.random.normal(k[1], (2, 5, 8))
>>> scale = 1 + 0.1 * jax.random.normal(k[2], (8,))
>>> y, h = rms_norm(x, scale, residual=r)        # h = x + r, y = rms_norm(h)
>>> want = h * jax.lax.rsqrt(jnp.mean(h * h, -1, keepdims=True) + 1e-6) * scale
>>> bool(jnp.allclose(y, want, atol=1e-5)), bool(jnp.allclose(h, x + r))
(True, True)
"""

from __future__ import annotations

import numbers

import jax
import jax.numpy as jnp

from probjax.core.device import Device
from probjax.core.dispatch import Decision
from probjax.core.eager import compile_once
from probjax.ops.norm.call import NormCall
from probjax.ops.norm.dispatch import decide, device_of
from probjax.ops.norm.registry import REGISTRY

__all__ = ["rms_norm", "layer_norm", "adaln_modulate", "qk_norm_rotary", "explain_dispatch",
           "available_implementations", "NormCall"]

NORMS = ("layer", "rms")


def _floating(name, a):
  if not hasattr(a, "shape") or not hasattr(a, "dtype"):
    raise TypeError(f"{name} must be an array, got {type(a).__name__}")
  if not jnp.issubdtype(a.dtype, jnp.floating):
    raise TypeError(f"{name} must be floating point, got {a.dtype}")
  return a


def _check_x(x, residual, eps):
  _floating("x", x)
  if x.ndim < 1 or x.shape[-1] < 1:
    raise ValueError(f"x must be [..., d] with d >= 1, got shape {x.shape}")
  if residual is not None:
    _floating("residual", residual)
    if residual.shape != x.shape:
      raise ValueError(f"residual must have x's shape {x.shape}, got {residual.shape}")
    if residual.dtype != x.dtype:
      raise TypeError(f"residual must have x's dtype {x.dtype}, got {residual.dtype}")
  if isinstance(eps, bool) or not isinstance(eps, numbers.Real) or not eps >= 0:
    raise ValueError(f"eps must be a non-negative number, got {eps!r}")


def _check_vector(name, a, d):
  _floating(name, a)
  if a.shape != (d,):
    raise ValueError(f"{name} must be [d] = ({d},), got shape {a.shape}")


def _rows(x):
  d = x.shape[-1]
  return x.reshape(-1, d)


def _run(x, residual, mul, add, *, kind, eps, affine, implementation, interpret):
  rows = x.size // x.shape[-1]
  call = NormCall(rows=rows, d=x.shape[-1], dtype=x.dtype, kind=kind, residual=residual is not None,
                  affine=affine, offset=add is not None, eps=float(eps), interpret=bool(interpret))
  decision = decide(call, device_of(call), implementation)
  y, h = _compute(decision.implementation, call, x, residual, mul, add)
  return (y, h) if residual is not None else y


@compile_once
def _compute(name: str, call: NormCall, x, residual, mul, add):
  d = call.d
  flat = lambda a: None if a is None else (a.reshape(1, d) if a.ndim == 1 else
                                          jnp.broadcast_to(a, x.shape).reshape(call.rows, d))
  y, h = REGISTRY.get(name)(_rows(x), flat(residual), flat(mul), flat(add), call=call)
  return y.reshape(x.shape), h.reshape(x.shape)


def rms_norm(x, scale, *, residual=None, eps: float = 1e-6, implementation: str | None = None,
             interpret: bool = False):
  """RMS norm ``h / sqrt(mean(h**2) + eps) * scale`` over the last axis, with ``h = x +
  residual`` when a residual is given (the pre-norm residual stream's add fused with the norm).

  Statistics in float32 (float64 for float64 inputs), the output in x's dtype; ``eps`` as
  ``flax.nnx.RMSNorm``'s ``epsilon``.

  Args:
    x: ``[..., d]`` floating point.
    scale: ``[d]``.
    residual: optional, x's shape and dtype.
    eps: added to the mean square.
    implementation: None (the default, :func:`explain_dispatch` says which) or a backend name;
      one that cannot compute the call raises ValueError.
    interpret: run the Pallas kernels in interpret mode (any platform).

  Returns:
    ``y`` (x's shape and dtype), or ``(y, h)`` with a residual: ``h = x + residual`` in x's
    dtype, the updated residual stream.
  """
  _check_x(x, residual, eps)
  _check_vector("scale", scale, x.shape[-1])
  return _run(x, residual, scale, None, kind="rms", eps=eps, affine="columns", implementation=implementation,
              interpret=interpret)


def layer_norm(x, scale, bias, *, residual=None, eps: float = 1e-6, implementation: str | None = None,
               interpret: bool = False):
  """Layer norm ``(h - mean) / sqrt(var + eps) * scale + bias`` over the last axis, with ``h = x
  + residual`` when a residual is given. ``eps`` as ``flax.nnx.LayerNorm``'s ``epsilon``.

  Args:
    x: ``[..., d]`` floating point.
    scale: ``[d]``.
    bias: ``[d]``.
    residual: optional, x's shape and dtype.
    eps: added to the variance.
    implementation: None (the default) or a backend name, as :func:`rms_norm`'s.
    interpret: run the Pallas kernels in interpret mode (any platform).

  Returns:
    ``y``, or ``(y, h)`` with a residual, as :func:`rms_norm`.
  """
  _check_x(x, residual, eps)
  _check_vector("scale", scale, x.shape[-1])
  _check_vector("bias", bias, x.shape[-1])
  return _run(x, residual, scale, bias, kind="layer", eps=eps, affine="columns", implementation=implementation,
              interpret=interpret)


def _modulation(name, m, x):
  """``m`` with x's number of axes: ``[..., d]`` per sample (``x [..., T, d]``: a token axis
  inserted) or broadcastable to x's shape with its last axis ``d``."""
  _floating(name, m)
  if x.ndim >= 2 and m.ndim == x.ndim - 1:
    m = jnp.expand_dims(m, -2)
  ok = m.ndim == x.ndim and m.shape[-1] == x.shape[-1]
  if ok:
    try:
      ok = jnp.broadcast_shapes(m.shape, x.shape) == x.shape
    except ValueError:
      ok = False
  if not ok:
    raise ValueError(f"{name} must be [..., d] per sample or broadcastable to x's shape {x.shape} "
                     f"(e.g. [B, d], [B, 1, d] or [B, T, d]), got shape {m.shape}")
  return m


def adaln_modulate(x, shift, scale, *, norm: str = "layer", eps: float = 1e-6, residual=None,
                   implementation: str | None = None, interpret: bool = False):
  """DiT's adaLN: ``norm(h) * (1 + scale) + shift``, the norm without affine parameters (as
  :class:`~probjax.nn.layers.DiTBlock`'s ``LayerNorm(use_scale=False, use_bias=False,
  epsilon=1e-6)``), ``h = x + residual`` when a residual is given.

  Args:
    x: ``[B, T, d]`` (any ``[..., d]``) floating point.
    shift: ``[B, d]`` per sample, ``[B, T, d]`` per token, or anything broadcastable to x's shape
      with x's number of axes (``[B, 1, d]``).
    scale: as ``shift``; the multiplier is ``1 + scale``.
    norm: ``"layer"`` or ``"rms"``.
    eps: added to the variance (mean square).
    residual: optional, x's shape and dtype.
    implementation: None (the default) or a backend name, as :func:`rms_norm`'s.
    interpret: run the Pallas kernels in interpret mode (any platform).

  Returns:
    ``y`` (x's shape and dtype), or ``(y, h)`` with a residual.
  """
  if norm not in NORMS:
    raise ValueError(f"norm must be one of {NORMS}, got {norm!r}")
  _check_x(x, residual, eps)
  shift, scale = _modulation("shift", shift, x), _modulation("scale", scale, x)
  return _run(x, residual, 1 + scale, shift, kind=norm, eps=eps, affine="rows", implementation=implementation,
              interpret=interpret)


def qk_norm_rotary(x, scale=None, positions=None, *, eps: float = 1e-6, base: float = 10000.0,
                   implementation: str | None = None, interpret: bool = False):
  """Attention's q/k preparation in one pass: the per-head RMS norm ``x * (rsqrt(mean(x**2) +
  eps) * scale)`` over ``head_dim`` (as ``flax.nnx.RMSNorm``), then RoPE (rotate-half, as
  :func:`probjax.nn.layers.rotary.apply_rotary`) by integer ``positions``.

  Everything in float32 (float64 for float64 inputs), rounded to x's dtype once at the end.

  Args:
    x: ``[batch, seq, heads, head_dim]`` floating point (head_dim even with ``positions``).
    scale: ``[head_dim]``, the norm's learned scale; None: no norm.
    positions: ``[batch, seq]`` integers; None: no rotation. ``scale`` and ``positions`` may not
      both be None.
    eps: added to the mean square.
    base: RoPE's base (frequencies ``base ** (-2i / head_dim)``).
    implementation: None (the default) or a backend name, as :func:`rms_norm`'s.
    interpret: run the Pallas kernels in interpret mode (any platform).

  Returns:
    ``y``, x's shape and dtype. Differentiable in ``x`` and ``scale``.
  """
  _floating("x", x)
  if x.ndim != 4 or x.shape[-1] < 1:
    raise ValueError(f"x must be [batch, seq, heads, head_dim], got shape {x.shape}")
  if scale is None and positions is None:
    raise ValueError("qk_norm_rotary needs scale (the norm) or positions (the rotation), got neither")
  if scale is not None:
    _check_vector("scale", scale, x.shape[-1])
  if positions is not None:
    if not hasattr(positions, "shape") or not hasattr(positions, "dtype"):
      raise TypeError(f"positions must be an integer array [batch, seq], got {type(positions).__name__}")
    if not jnp.issubdtype(positions.dtype, jnp.integer):
      raise TypeError(f"positions must be integers [batch, seq], got {positions.dtype}")
    if positions.shape != x.shape[:2]:
      raise ValueError(f"positions must be [batch, seq] = {x.shape[:2]}, got shape {positions.shape}")
    if x.shape[-1] % 2:
      raise ValueError(f"x's head_dim must be even for the rotation (positions given), got {x.shape[-1]}")
  if isinstance(eps, bool) or not isinstance(eps, numbers.Real) or not eps >= 0:
    raise ValueError(f"eps must be a non-negative number, got {eps!r}")
  if isinstance(base, bool) or not isinstance(base, numbers.Real) or not base > 0:
    raise ValueError(f"base must be a positive number, got {base!r}")
  call = NormCall(rows=x.size // x.shape[-1], d=x.shape[-1], dtype=x.dtype, kind="rms" if scale is not None else "none",
                  affine="columns" if scale is not None else "none", eps=float(eps), interpret=bool(interpret),
                  rotary=positions is not None, rotary_base=float(base))
  decision = decide(call, device_of(call), implementation)
  return _compute_qk(decision.implementation, call, x, scale, positions)


@compile_once
def _compute_qk(name: str, call: NormCall, x, scale, positions):
  return REGISTRY.get(name).qk_norm_rotary(x, scale, positions, call=call)


def explain_dispatch(call: NormCall, *, implementation: str | None = None, device: Device | None = None) -> Decision:
  """The backend the op runs ``call`` on, and why.

  >>> import jax.numpy as jnp
  >>> explain_dispatch(NormCall(rows=4096, d=1024, dtype=jnp.bfloat16), device=Device("gpu", (9, 0))).implementation
  'xla'
  """
  if not isinstance(call, NormCall):
    raise TypeError(f"call must be a NormCall, got {type(call).__name__}")
  return decide(call, device or device_of(call), implementation)


def available_implementations(device: Device | None = None) -> list[str]:
  """Backend names that can run on ``device`` (default: the current one)."""
  return REGISTRY.available(device or Device.current())
