"""The float64 sequential references of the scan room, shared by every test.

One step per position, written from the definitions (no chunking, no shifted copies), in
float64 under ``jax.enable_x64``. :func:`reference` returns the outputs, :func:`reference_vjp`
the gradients of every floating input for given output cotangents; both as float64 numpy.

>>> import numpy as np
>>> x = np.ones((1, 3, 2)); A = -np.ones((2, 1)); B = C = np.ones((1, 3, 1))
>>> y, h = reference("mamba", x=x, dt=np.zeros((1, 3, 2)), A=A, B=B, C=C, dt_softplus=False)
>>> y.shape, h.shape
((1, 3, 2), (1, 2, 1))
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np


def _dt(dt, dt_bias, dt_softplus):
  dt = dt if dt_bias is None else dt + dt_bias
  return jax.nn.softplus(dt) if dt_softplus else dt


def mamba(x, dt, A, B, C, D=None, z=None, dt_bias=None, initial_state=None, *, dt_softplus=True):
  """``h_t = exp(dt_t A) ⊙ h_{t-1} + dt_t x_t B_t``, ``y_t = (C_t · h_t + D x_t) · silu(z_t)``;
  returns ``(y [b, L, d], h_L [b, d, n])``."""
  dt = _dt(dt, dt_bias, dt_softplus)
  b, _, d = x.shape
  h0 = jnp.zeros((b, d, A.shape[1]), x.dtype) if initial_state is None else initial_state

  def step(h, t):
    xt, dtt, bt, ct = x[:, t], dt[:, t], B[:, t], C[:, t]
    h = jnp.exp(dtt[:, :, None] * A) * h + (dtt * xt)[:, :, None] * bt[:, None, :]
    return h, jnp.einsum("bdn,bn->bd", h, ct)

  h, y = jax.lax.scan(step, h0, jnp.arange(x.shape[1]))
  y = jnp.moveaxis(y, 0, 1)
  if D is not None:
    y = y + D * x
  if z is not None:
    y = y * jax.nn.silu(z)
  return y, h


def ssd(x, dt, A, B, C, D=None, z=None, dt_bias=None, initial_state=None, *, dt_softplus=True):
  """Per head: ``h_t = exp(dt_t A) h_{t-1} + dt_t x_t B_tᵀ``, ``y_t = (h_t C_t + D x_t) ·
  silu(z_t)`` with B, C of group ``head // (heads // groups)``; returns ``(y [b, L, h, p],
  h_L [b, h, p, n])``."""
  dt = _dt(dt, dt_bias, dt_softplus)
  b, _, heads, p = x.shape
  g, n = B.shape[2:]
  group = jnp.arange(heads) // (heads // g)
  h0 = jnp.zeros((b, heads, p, n), x.dtype) if initial_state is None else initial_state

  def step(h, t):
    bt, ct = B[:, t][:, group], C[:, t][:, group]             # [b, heads, n]
    decay = jnp.exp(dt[:, t] * A)[:, :, None, None]
    h = decay * h + (dt[:, t, :, None] * x[:, t])[..., None] * bt[:, :, None, :]
    return h, jnp.einsum("bhpn,bhn->bhp", h, ct)

  h, y = jax.lax.scan(step, h0, jnp.arange(x.shape[1]))
  y = jnp.moveaxis(y, 0, 1)
  if D is not None:
    y = y + D[:, None] * x
  if z is not None:
    y = y * jax.nn.silu(z)
  return y, h


def _phi(x, kind):
  if kind == "softmax":
    return jnp.concatenate([jax.nn.softmax(x, -1), jax.nn.softmax(-x, -1)], -1)
  return jax.nn.relu(x)


def rla(q, k, v, initial_state=None, *, window_size, feature_map="softmax"):
  """``o_t = φ(q_t) · S_t``, ``S_t = S_0 + Σ_{s <= t - window_size - 1} φ(k_s) v_sᵀ`` (query
  head ``i`` reads key head ``i // (heads // kv_heads)``); returns ``(o [b, L, h, dv], S_{L-1}
  [b, kv_heads, f, dv])``, the state the last query read."""
  b, length, heads, _ = q.shape
  hk, dv = v.shape[2:]
  f = 2 * q.shape[-1] if feature_map == "softmax" else q.shape[-1]
  kv_head = jnp.arange(heads) // (heads // hk)
  s0 = jnp.zeros((b, hk, f, dv), q.dtype) if initial_state is None else initial_state

  def step(s, t):
    src = t - window_size - 1                                     # the key leaving the window
    fk = _phi(k[:, jnp.maximum(src, 0)], feature_map)
    s = s + jnp.where(src >= 0, 1.0, 0.0) * jnp.einsum("bkf,bkd->bkfd", fk, v[:, jnp.maximum(src, 0)])
    return s, jnp.einsum("bhf,bhfd->bhd", _phi(q[:, t], feature_map), s[:, kv_head])

  s, o = jax.lax.scan(step, s0, jnp.arange(length))
  return jnp.moveaxis(o, 0, 1), s


OPS = {"mamba": mamba, "ssd": ssd, "rla": rla}
_STATIC = ("dt_softplus", "window_size", "feature_map")


def _split(inputs):
  arrays = {k: v for k, v in inputs.items() if k not in _STATIC and v is not None}
  static = {k: v for k, v in inputs.items() if k in _STATIC}
  return arrays, static


@functools.partial(jax.jit, static_argnames=("op", "static"))
def _forward(arrays, *, op, static):
  return OPS[op](**arrays, **dict(static))


@functools.partial(jax.jit, static_argnames=("op", "static"))
def _vjp(arrays, cts, *, op, static):
  return jax.vjp(lambda a: OPS[op](**a, **dict(static)), arrays)[1](cts)[0]


def _float64(arrays):
  return {k: jnp.asarray(np.asarray(v, np.float64)) for k, v in arrays.items()}


def reference(op: str, **inputs):
  """float64 ``(output, final_state)`` of ``op`` ("mamba", "ssd" or "rla") on ``inputs``
  (the keyword arguments of :func:`mamba`, :func:`ssd` or :func:`rla`)."""
  arrays, static = _split(inputs)
  with jax.enable_x64(True):
    outs = _forward(_float64(arrays), op=op, static=tuple(sorted(static.items())))
    return tuple(np.asarray(o) for o in outs)


def reference_vjp(op: str, cotangents, **inputs) -> dict:
  """float64 gradients of ``op`` for ``cotangents = (d_output, d_final_state)``: a dict over
  the array inputs given (None inputs are absent)."""
  arrays, static = _split(inputs)
  with jax.enable_x64(True):
    cts = tuple(jnp.asarray(np.asarray(c, np.float64)) for c in cotangents)
    grads = _vjp(_float64(arrays), cts, op=op, static=tuple(sorted(static.items())))
    return {k: np.asarray(g) for k, g in grads.items()}
