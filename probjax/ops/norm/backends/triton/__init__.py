"""``"triton"``: Pallas-Triton row kernels (``kernels.py``) under a ``custom_vjp``: the forward
saves ``h``, the rows' mean and inverse deviation; the backward kernel gives ``dx`` (=
``dresidual``) and ``dy * xhat``, whose sums over rows (the multiplier's gradient) and ``dy``'s
(the offset's) run in XLA. Forward mode is not defined (a ``custom_vjp``); use ``"xla"``.

``qk_norm_rotary``: one kernel reads x's rows once and writes y once; its backward recomputes
the norm from ``x`` and writes ``dx`` and each program's share of ``dscale`` (summed in XLA, a
fixed order)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from probjax.core import pallas_triton
from probjax.core.backend import Backend
from probjax.core.device import Device
from probjax.ops.norm.backends.triton import kernels
from probjax.ops.norm.call import NormCall
from probjax.ops.norm.formula import inv_freq

DTYPES = ("float32", "bfloat16", "float16")
# Widest row a program holds in registers (padded to a power of two).
MAX_WIDTH = 16384


class Triton(Backend[NormCall]):
  name = "triton"
  aliases = ("pallas",)

  def available(self, device: Device) -> str | None:
    return pallas_triton.unavailable(device, pallas_triton.EMULATED_ANYWHERE)

  def supports(self, call: NormCall, device: Device) -> str | None:
    if call.dtype.name not in DTYPES:
      return f"the kernels take {', '.join(DTYPES)} inputs, not {call.dtype.name}"
    if call.d > MAX_WIDTH:
      return f"d = {call.d} is above the kernels' {MAX_WIDTH} (a row lives in registers)"
    return None

  def __call__(self, x, residual, mul, add, *, call: NormCall):
    return _norm(x, residual, mul, add, call)

  def qk_norm_rotary(self, x, scale, positions, *, call: NormCall):
    """``x [batch, seq, heads, head_dim]`` as ``[rows, head_dim]`` rows; the positions
    broadcast over heads to one float32 per row (exact below 2**24), the frequencies from XLA."""
    b, t, h, d = x.shape
    pos = freq = None
    if positions is not None:
      pos = jnp.broadcast_to(positions.astype(jnp.float32)[:, :, None], (b, t, h)).reshape(-1)
      freq = inv_freq(d, call.rotary_base, jnp.float32)[None]
    s = None if scale is None else scale.reshape(1, d)
    y = _qk(x.reshape(-1, d), s, pos, freq, call)
    return y.reshape(x.shape)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _norm(x, residual, mul, add, call):
  y, h, _, _ = kernels.forward(x, residual, mul, add, kind=call.kind, eps=call.eps, interpret=call.interpret)
  return y, h


def _fwd(x, residual, mul, add, call):
  y, h, mean, rstd = kernels.forward(x, residual, mul, add, kind=call.kind, eps=call.eps,
                                     interpret=call.interpret)
  return (y, h), (h, mean, rstd, mul, add)


def _reduce(g, like):
  """``g [rows, d]`` summed to ``like``'s ``[1, d]`` (or kept per row), in its dtype."""
  return (g if like.shape[0] > 1 else jnp.sum(g, 0, keepdims=True)).astype(like.dtype)


def _bwd(call, res, cts):
  h, mean, rstd, mul, add = res
  dy, dh_out = cts
  dh, gx = kernels.backward(h, mean, rstd, dy, mul, dh_out if call.residual else None, kind=call.kind,
                            interpret=call.interpret)
  dx = dh.astype(h.dtype)
  dmul = None if mul is None else _reduce(gx, mul)
  dadd = None if add is None else _reduce(dy.astype(jnp.float32), add)
  return dx, dx if call.residual else None, dmul, dadd


_norm.defvjp(_fwd, _bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _qk(x, scale, pos, freq, call):
  return kernels.qk_forward(x, scale, pos, freq, eps=call.eps, interpret=call.interpret)


def _qk_fwd(x, scale, pos, freq, call):
  return _qk(x, scale, pos, freq, call), (x, scale, pos, freq)


def _qk_bwd(call, res, dy):
  x, scale, pos, freq = res
  dx, partials = kernels.qk_backward(x, dy, scale, pos, freq, eps=call.eps, interpret=call.interpret)
  dscale = None if scale is None else jnp.sum(partials, 0, keepdims=True).astype(scale.dtype)
  zero = lambda a: None if a is None else jnp.zeros_like(a)
  return dx, dscale, zero(pos), zero(freq)


_qk.defvjp(_qk_fwd, _qk_bwd)
