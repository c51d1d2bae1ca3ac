"""Sequence mixers: the Mamba-1 selective scan, Mamba-2's SSD and the linear branch of residual
linear attention (RLA).

``implementation=None`` picks the fastest backend that computes the call exactly
(:func:`explain_dispatch` says which and why): ``"scan"`` (sequential ``lax.scan``),
``"associative"`` (``lax.associative_scan``; Mamba-1 and SSD), ``"chunked"`` (chunk-parallel
XLA) or ``"triton"`` (Pallas-Triton kernels; ``interpret=True`` emulates them on any device).
Every backend is differentiable in every floating input, the final state included; states
accumulate in float32 for 16-bit inputs.

>>> import jax.numpy as jnp
>>> x = jnp.ones((2, 10, 8)); B = jnp.ones((2, 10, 4))
>>> mamba_scan(x, x, -jnp.ones((8, 4)), B, B, jnp.ones(8)).shape
(2, 10, 8)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from probjax.core.device import Device
from probjax.core.eager import compile_once
from probjax.ops.scan import chunked_math, dispatch
from probjax.ops.scan.calls import MambaCall, RLACall, SSDCall
from probjax.ops.scan.chunked_math import compute_dtype, feature_map
from probjax.ops.scan.dispatch import Decision, available_implementations, explain_dispatch

__all__ = ["mamba_scan", "ssd_scan", "residual_linear_attention", "explain_dispatch",
           "available_implementations", "feature_map", "Decision", "MambaCall", "SSDCall", "RLACall"]


def _device(call) -> Device:
  """The device :func:`dispatch.resolve` decides for (part of an eager call's description)."""
  return Device.interpreter() if call.interpret else Device.current()


def _dt(dt, dt_bias, dt_softplus, cd):
  dt = dt.astype(cd) if dt_bias is None else dt.astype(cd) + dt_bias.astype(cd)
  return jax.nn.softplus(dt) if dt_softplus else dt


def _finish(y, x, D, z, cd, final, return_final_state):
  if D is not None:
    y = y + D.astype(cd) * x.astype(cd)
  if z is not None:
    y = y * jax.nn.silu(z.astype(cd))
  y = y.astype(x.dtype)
  return (y, final) if return_final_state else y


def mamba_scan(x, dt, A, B, C, D=None, *, z=None, dt_bias=None, dt_softplus: bool = True,
               initial_state=None, return_final_state: bool = False, chunk_size: int | None = None,
               implementation: str | None = None, interpret: bool = False):
  """The Mamba-1 selective scan.

  ``Δ = softplus(dt + dt_bias)`` (``dt + dt_bias`` without ``dt_softplus``), then per channel
  ``d`` and state ``n``: ``h_t = exp(Δ_t A) ⊙ h_{t-1} + Δ_t x_t B_t``, ``y_t = C_t · h_t +
  D x_t``, and ``y_t *= silu(z_t)`` where ``z`` is given.

  Args:
    x: ``[batch, length, channels]``; dt: like x (before bias and softplus).
    A: ``[channels, state]``, the decay rates themselves, negative: a Mamba layer stores
      ``A_log`` and passes ``A = -exp(A_log)``.
    B, C: ``[batch, length, state]``. D: ``[channels]`` skip, or None.
    z: the gate, like x. dt_bias: ``[channels]``.
    initial_state: ``[batch, channels, state]`` (default zeros).
    return_final_state: also return ``h_L``, ``[batch, channels, state]`` in the compute dtype
      (float32 for 16-bit inputs).
    chunk_size: the chunk of the chunked forms (default: :func:`explain_dispatch`'s).
    implementation: None, "scan", "associative", "chunked" or "triton" (alias "pallas").
  Returns:
    y like x (and the final state).
  """
  call = MambaCall.of(x, dt, A, B, C, D, z=z, dt_bias=dt_bias, initial_state=initial_state,
                      chunk_size=chunk_size, interpret=interpret)
  return _mamba(call, implementation, _device(call), dt_softplus, return_final_state, x, dt, A, B, C, D, z,
                dt_bias, initial_state)


# The computations after validation: eager calls compile each once per call description
# (:func:`probjax.core.eager.compile_once`; ``device`` is in it, as dispatch reads it).
@compile_once
def _mamba(call, implementation, device, dt_softplus, return_final_state, x, dt, A, B, C, D, z, dt_bias,
           initial_state):
  del device
  cd = compute_dtype(x.dtype)
  h0 = (jnp.zeros((call.batch, call.channels, call.state), cd) if initial_state is None
        else initial_state.astype(cd))
  y, final = dispatch.resolve(call, implementation)(x, _dt(dt, dt_bias, dt_softplus, cd), A.astype(cd),
                                                     B, C, h0)
  return _finish(y, x, D, z, cd, final, return_final_state)


def ssd_scan(x, dt, A, B, C, D=None, *, z=None, dt_bias=None, dt_softplus: bool = True,
             initial_state=None, return_final_state: bool = False, chunk_size: int | None = None,
             implementation: str | None = None, interpret: bool = False):
  """Mamba-2's SSD scan: one scalar decay per head, B and C shared by the heads of a group.

  ``Δ = softplus(dt + dt_bias)``, then per head ``h``: ``S_t = exp(Δ_t A_h) S_{t-1} + Δ_t x_t
  B_tᵀ`` (``[head_dim, state]``), ``y_t = S_t C_t + D_h x_t``, times ``silu(z_t)`` where given;
  head ``h`` reads group ``h // (heads // groups)``.

  Args:
    x: ``[batch, length, heads, head_dim]``; dt: ``[batch, length, heads]``.
    A: ``[heads]``, negative (``-exp(A_log)``). B, C: ``[batch, length, groups, state]``.
    D: ``[heads]`` or None. z: like x. dt_bias: ``[heads]``.
    initial_state: ``[batch, heads, head_dim, state]``.

  The other arguments are as :func:`mamba_scan`'s.
  """
  call = SSDCall.of(x, dt, A, B, C, D, z=z, dt_bias=dt_bias, initial_state=initial_state,
                    chunk_size=chunk_size, interpret=interpret)
  return _ssd(call, implementation, _device(call), dt_softplus, return_final_state, x, dt, A, B, C, D, z,
              dt_bias, initial_state)


@compile_once
def _ssd(call, implementation, device, dt_softplus, return_final_state, x, dt, A, B, C, D, z, dt_bias,
         initial_state):
  del device
  cd = compute_dtype(x.dtype)
  h0 = (jnp.zeros((call.batch, call.heads, call.head_dim, call.state), cd) if initial_state is None
        else initial_state.astype(cd))
  y, final = dispatch.resolve(call, implementation)(x, _dt(dt, dt_bias, dt_softplus, cd), A.astype(cd),
                                                     B, C, h0)
  return _finish(y, x, None if D is None else D[:, None], z, cd, final, return_final_state)


def _shift(x, n):
  """``x`` moved ``n`` positions later along axis 1, zeros in front (same length)."""
  n = min(n, x.shape[1])
  return jnp.pad(x, [(0, 0), (n, 0)] + [(0, 0)] * (x.ndim - 2))[:, :x.shape[1]]


def residual_linear_attention(q, k, v, *, window_size: int, feature_map: str = "softmax",
                              initial_state=None, return_final_state: bool = False,
                              chunk_size: int | None = None, implementation: str | None = None,
                              interpret: bool = False):
  """The linear-attention branch of RLA: each query reads the keys outside its sliding window.

  ``o_t = φ(q_t) · S_t`` with ``S_t = S_0 + Σ_{s <= t - window_size - 1} φ(k_s) v_sᵀ``,
  unnormalised; ``φ(x) = [softmax(x), softmax(-x)]`` over head_dim (``"softmax"``, features
  ``2 * head_dim``) or ``relu(x)``. A causal sliding-window attention over ``[t - window_size,
  t]`` (``LocalWindowMask(window_size, 0)``) covers the other keys: RAttention adds the two.

  Args:
    q: ``[batch, length, heads, head_dim]``; k: ``[batch, length, kv_heads, head_dim]``; v:
      ``[batch, length, kv_heads, v_head_dim]``; query head ``h`` reads key/value head
      ``h // (heads // kv_heads)``.
    initial_state: ``S_0``, ``[batch, kv_heads, features, v_head_dim]`` (keys before the call
      that every query reads).
    return_final_state: also return ``S_{L-1}``, the state the last query read (compute
      dtype); a decoder adds ``φ(k_{t-w-1}) v_{t-w-1}ᵀ`` before each next query.
    chunk_size, implementation ("scan", "chunked" or "triton"), interpret: as
      :func:`mamba_scan`'s.
  Returns:
    o ``[batch, length, heads, v_head_dim]`` in q's dtype (and the final state).
  """
  call = RLACall.of(q, k, v, window_size=window_size, feature_map=feature_map,
                    initial_state=initial_state, chunk_size=chunk_size, interpret=interpret)
  return _rla(call, implementation, _device(call), window_size, feature_map, return_final_state, q, k, v,
              initial_state)


@compile_once
def _rla(call, implementation, device, window_size, feature_map, return_final_state, q, k, v, initial_state):
  del device
  cd = compute_dtype(q.dtype)
  s0 = (jnp.zeros((call.batch, call.kv_heads, call.features, call.v_head_dim), cd)
        if initial_state is None else initial_state.astype(cd))
  shift = window_size + 1
  phi = lambda t: chunked_math.feature_map(t, feature_map)
  o, final = dispatch.resolve(call, implementation)(phi(q), _shift(phi(k), shift), _shift(v, shift), s0)
  o = o.astype(q.dtype)
  return (o, final) if return_final_state else o

