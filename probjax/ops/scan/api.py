"""The scan room's public face: ``mamba_scan`` (the Mamba-1 selective scan), ``ssd_scan``
(Mamba-2's SSD), ``residual_linear_attention`` (the linear branch of RLA), ``explain_dispatch``
and ``available_implementations`` (re-exported by :mod:`probjax.ops.scan`).

``implementation=None`` picks the fastest backend that computes the call exactly
(:func:`explain_dispatch` says which and why): ``"scan"`` (sequential ``lax.scan``),
``"associative"`` (``lax.associative_scan``; Mamba-1 and SSD), ``"chunked"`` (chunk-parallel
XLA) or ``"triton"`` (Pallas-Triton kernels; ``interpret=True`` emulates them on any device).
An explicit ``implementation`` that cannot compute the call raises ValueError with the reason.
Every backend is differentiable in every floating input, the final state included; states
accumulate in float32 for 16-bit inputs.

A call validates its arguments (its call object: :class:`MambaCall`, :class:`SSDCall`,
:class:`RLACall`) and asks the dispatch once, in Python; what it then computes is a function
of the arrays, the call and the decision, compiled once per description when called eagerly
(:func:`probjax.core.eager.compile_once`).

>>> import jax.numpy as jnp
>>> x = jnp.ones((1, 6, 2, 4))
>>> call = RLACall.of(x, x, x, window_size=2)
>>> explain_dispatch(call, device=Device("cpu")).summary()
'chunked, chunk_size=8'
>>> residual_linear_attention(x, x, x, window_size=2).shape
(1, 6, 2, 4)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from probjax.core.device import Device
from probjax.core.dispatch import Decision
from probjax.core.eager import compile_once
from probjax.ops.scan import dispatch
from probjax.ops.scan.calls import MambaCall, RLACall, SSDCall
from probjax.ops.scan.chunked_math import compute_dtype, feature_map

__all__ = ["mamba_scan", "ssd_scan", "residual_linear_attention", "explain_dispatch",
           "available_implementations", "feature_map", "Decision", "MambaCall", "SSDCall", "RLACall"]


def explain_dispatch(call, *, implementation: str | None = None, device: Device | None = None) -> Decision:
  """The :class:`~probjax.core.dispatch.Decision` for ``call`` (a :class:`MambaCall`,
  :class:`SSDCall` or :class:`RLACall`) on ``device`` (default: the current one, or the
  interpreter's for a call with ``interpret=True``): the implementation, the rule, its
  ``chunk_size`` (``decision.get("chunk_size")``, where it runs in chunks) and, where a
  differentiated call runs another implementation, that decision (``decision.grad``).

  Raises ValueError where an explicit ``implementation`` cannot compute the call, with the
  reason."""
  return dispatch.decide(call, implementation, device or dispatch.device_of(call))


def available_implementations(call, device: Device | None = None) -> list[str]:
  """The implementations of ``call``'s op that can run on ``device`` (default: the current one)."""
  return dispatch.available_implementations(call, device)


# -- the computation after validation and dispatch, one for every op ---------------------------

@compile_once
def _compute(call, decision, form, options, return_final_state, arrays, initial_state):
  """``form(cd, *arrays, **options)`` gives the backend's operands and the function finishing its
  output; the backend runs from ``initial_state`` (zeros of ``call.state_shape`` where None) in
  the compute dtype ``cd``. Eager calls compile this once per call description (``decision`` is
  part of it: the device enters through it)."""
  cd = compute_dtype(jnp.dtype(call.dtype))
  state = jnp.zeros(call.state_shape, cd) if initial_state is None else initial_state.astype(cd)
  operands, finish = form(cd, *arrays, **dict(options))
  out, final = dispatch.runner(call, decision)(*operands, state)
  out = finish(out)
  return (out, final) if return_final_state else out


def _run(call, implementation, form, options, return_final_state, arrays, initial_state):
  decision = dispatch.decide(call, implementation, dispatch.device_of(call))
  return _compute(call, decision, form, tuple(options.items()), return_final_state, arrays, initial_state)


def _selective(cd, x, dt, A, B, C, D, z, dt_bias, *, dt_softplus):
  """Mamba-1's and SSD's operands (``Δ = softplus(dt + dt_bias)``, A in the compute dtype) and
  their finish (``+ D x``, ``* silu(z)``, x's dtype)."""
  dt = dt.astype(cd) if dt_bias is None else dt.astype(cd) + dt_bias.astype(cd)
  if dt_softplus:
    dt = jax.nn.softplus(dt)

  def finish(y):
    if D is not None:  # [channels] (Mamba-1) or [heads] against [..., heads, head_dim] (SSD)
      y = y + D.astype(cd).reshape(D.shape + (1,) * (x.ndim - 3)) * x.astype(cd)
    if z is not None:
      y = y * jax.nn.silu(z.astype(cd))
    return y.astype(x.dtype)

  return (x, dt, A.astype(cd), B, C), finish


def _shift(x, n):
  """``x`` moved ``n`` positions later along axis 1, zeros in front (same length)."""
  n = min(n, x.shape[1])
  return jnp.pad(x, [(0, 0), (n, 0)] + [(0, 0)] * (x.ndim - 2))[:, :x.shape[1]]


def _linear(cd, q, k, v, *, window_size, kind):
  """RLA's operands (features of q, features of k and v shifted past the window) and finish
  (q's dtype)."""
  del cd
  shift = window_size + 1
  phi = lambda t: feature_map(t, kind)
  return (phi(q), _shift(phi(k), shift), _shift(v, shift)), lambda o: o.astype(q.dtype)


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
  return _run(call, implementation, _selective, {"dt_softplus": dt_softplus}, return_final_state,
              (x, dt, A, B, C, D, z, dt_bias), initial_state)


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
  return _run(call, implementation, _selective, {"dt_softplus": dt_softplus}, return_final_state,
              (x, dt, A, B, C, D, z, dt_bias), initial_state)


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
  return _run(call, implementation, _linear, {"window_size": window_size, "kind": feature_map},
              return_final_state, (q, k, v), initial_state)
