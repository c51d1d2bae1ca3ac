"""``"associative"``: ``lax.associative_scan`` over the whole sequence (log-depth), which
materialises the state at every position, ``[b, L, d, n]`` (Mamba-1) or ``[b, L, h, p, n]``
(SSD). Not for RLA, whose per-position state is a ``features × v_head_dim`` matrix per head."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from probjax.core.backend import Backend
from probjax.ops.scan.calls import MambaCall, SSDCall
from probjax.ops.scan.chunked_math import compute_dtype, group_of_heads


def _combine(left, right):
  (a1, b1), (a2, b2) = left, right
  return a1 * a2, a2 * b1 + b2


def _states(decay, inputs, h0):
  """Every ``h_t = decay_t ⊙ h_{t-1} + inputs_t`` along axis 1, from ``h0``."""
  inputs = inputs.at[:, 0].add(decay[:, 0] * h0)
  return jax.lax.associative_scan(_combine, (decay, inputs), axis=1)[1]


class _Associative:
  name = "associative"

  def supports(self, call, device):
    return None

  def chunk_size(self, call) -> None:
    return None


class MambaAssociative(_Associative, Backend[MambaCall]):
  def __call__(self, x, dt, A, B, C, h0, *, call: MambaCall):
    cd = compute_dtype(x.dtype)
    x, dt, B, C = (t.astype(cd) for t in (x, dt, B, C))
    decay = jnp.exp(dt[..., None] * A)                            # [b, L, d, n]
    h = _states(decay, (dt * x)[..., None] * B[:, :, None, :], h0.astype(cd))
    return jnp.einsum("bldn,bln->bld", h, C), h[:, -1]


class SSDAssociative(_Associative, Backend[SSDCall]):
  def __call__(self, x, dt, A, B, C, h0, *, call: SSDCall):
    cd = compute_dtype(x.dtype)
    group = group_of_heads(call.heads, call.groups)
    x, dt, B, C = (t.astype(cd) for t in (x, dt, B, C))
    B, C = B[:, :, group], C[:, :, group]                         # [b, L, heads, n]
    decay = jnp.exp(dt * A)[..., None, None]                      # [b, L, h, 1, 1]
    h = _states(decay, (dt[..., None] * x)[..., None] * B[:, :, :, None], h0.astype(cd))
    return jnp.einsum("blhpn,blhn->blhp", h, C), h[:, -1]
