"""The chunk-parallel XLA formulations and the math the scan room's backends share (the compute
dtype, RLA's feature map, a Mamba-1 step, the group a head reads): backends share math through
this module, never through each other.

Every function takes the core operands the op's wrapper prepares (dt after bias and softplus,
an initial state, float32 or wider) and returns ``(y, final_state)`` in the compute dtype
(float32 for 16-bit inputs). The sequence is cut into chunks of ``chunk`` steps (the last one
padded with inert steps); the work inside a chunk runs for every chunk at once, the state
crosses chunk boundaries by a scan (or a cumulative sum) over chunks. The per-chunk functions
are ``jax.checkpoint``-ed, so the backward recomputes inside a chunk: a differentiated call
saves its inputs, their cumulative decays and the chunk-boundary states, never a state per
position.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from probjax.ops.scan.calls import MambaCall


def compute_dtype(dtype):
  """float32 for 16-bit inputs (the state always accumulates in float32 or wider)."""
  return jnp.promote_types(dtype, jnp.float32)


def feature_map(x, kind: str):
  """RLA's feature map over the last axis, in the compute dtype: ``[softmax(x), softmax(-x)]``
  (twice the width) for ``"softmax"``, ``relu(x)`` for ``"relu"``."""
  x = x.astype(compute_dtype(x.dtype))
  if kind == "softmax":
    return jnp.concatenate([jax.nn.softmax(x, axis=-1), jax.nn.softmax(-x, axis=-1)], axis=-1)
  return jax.nn.relu(x)


def group_of_heads(heads: int, groups: int):
  """``[heads]``: the group (of B and C, or the key/value head) each head reads,
  ``h // (heads // groups)``."""
  return jnp.arange(heads) // (heads // groups)


def mamba_step(h, x, dt, B, C, A):
  """One Mamba-1 step over any leading axes: ``h = exp(dt A) ⊙ h + dt x B`` and ``y = C · h``.

  x, dt ``[..., d]``; B, C ``[..., n]``; h ``[..., d, n]``; A ``[d, n]``. Returns ``(h, y)``."""
  h = jnp.exp(dt[..., None] * A) * h + (dt * x)[..., None] * B[..., None, :]
  return h, jnp.einsum("...dn,...n->...d", h, C)


def chunked(x, chunk: int):
  """``[b, L, ...]`` as ``[b, L_pad / chunk, chunk, ...]``, zero-padded at the end."""
  b, length = x.shape[:2]
  pad = -length % chunk
  x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
  return x.reshape(b, (length + pad) // chunk, chunk, *x.shape[2:])


def unchunked(y, length: int):
  """Inverse of :func:`chunked`: ``[b, nc, chunk, ...]`` to ``[b, length, ...]``."""
  return y.reshape(y.shape[0], -1, *y.shape[3:])[:, :length]


def _carry_over_chunks(decay, local_end, h0):
  """``h_in[c]``, the state entering chunk ``c``, and the final state, from the states each
  chunk ends with from zero (``local_end [b, nc, ...]``) and its total decay (broadcastable)."""
  def step(h, xs):
    a, e = xs
    return a * h + e, h
  move = lambda t: jnp.moveaxis(t, 1, 0)
  decay = jnp.broadcast_to(decay, local_end.shape)
  final, h_in = jax.lax.scan(step, h0, (move(decay), move(local_end)))
  return move(h_in), final


def mamba_chunked(x, dt, A, B, C, h0, *, chunk: int):
  """Mamba-1 core: ``y_t = C_t · h_t`` with ``h_t = exp(dt_t A) ⊙ h_{t-1} + dt_t x_t B_t``.

  x, dt ``[b, L, d]``; A ``[d, n]``; B, C ``[b, L, n]``; h0 ``[b, d, n]``. The decay is per
  (channel, state), so a chunk has no matmul form: inside a chunk the recurrence runs from zero
  as a scan of ``chunk`` steps over every chunk at once; the states entering the chunks then
  come from a scan over chunks, and their contribution ``C_t · (exp(A cumsum(dt)) ⊙ h_in)`` is
  one fused elementwise product and reduction. Sequential steps: ``chunk + L / chunk``.
  """
  length = x.shape[1]
  cd = compute_dtype(x.dtype)
  x, B, C = (chunked(t.astype(cd), chunk) for t in (x, B, C))
  dt = chunked(dt.astype(cd), chunk)  # padded steps: dt = 0, no decay and no input
  A = A.astype(cd)

  @jax.checkpoint
  def local(x, dt, B, C):
    def step(h, xs):
      return mamba_step(h, *xs, A)                             # [b, nc, d], [b, nc, n]
    move = lambda t: jnp.moveaxis(t, 2, 0)
    h = jnp.zeros(x.shape[:2] + A.shape, cd)
    end, y = jax.lax.scan(step, h, tuple(map(move, (x, dt, B, C))))
    return jnp.moveaxis(y, 0, 2), end

  @jax.checkpoint
  def from_entering(C, cum, h_in):
    return jnp.sum(C[:, :, :, None, :] * jnp.exp(cum[..., None] * A) * h_in[:, :, None], axis=-1)

  y, end = local(x, dt, B, C)
  cum = jnp.cumsum(dt, axis=2)                                    # [b, nc, T, d]
  h_in, final = _carry_over_chunks(jnp.exp(cum[:, :, -1, :, None] * A), end, h0.astype(cd))
  y = y + from_entering(C, cum, h_in)
  return unchunked(y, length), final


def _segsum_decay(cum):
  """``exp(cum_t - cum_s)`` for ``s <= t``, else 0: ``[..., T, H]`` to ``[..., H, T, T]``.
  The difference is masked before the exponential, so no masked entry overflows (an inf
  there would turn the backward's products into NaN)."""
  cum = jnp.moveaxis(cum, -1, -2)                                 # [..., H, T]
  diff = cum[..., :, None] - cum[..., None, :]
  t = cum.shape[-1]
  causal = jnp.arange(t)[:, None] >= jnp.arange(t)[None, :]
  return jnp.exp(jnp.where(causal, diff, -jnp.inf))


def ssd_chunked(x, dt, A, B, C, h0, *, chunk: int):
  """Mamba-2 SSD core: ``y_t = h_t C_t`` with ``h_t = exp(dt_t A) h_{t-1} + dt_t x_t B_tᵀ``
  (one scalar decay per head).

  x ``[b, L, h, p]``; dt ``[b, L, h]``; A ``[h]``; B, C ``[b, L, g, n]``; h0 ``[b, h, p, n]``.
  Inside a chunk: ``(C Bᵀ ⊙ decay) (dt x)`` and the chunk's end state as matmuls; the states
  entering the chunks by a scan over chunks; their outputs ``exp(cum_t) C_t h_inᵀ``.
  """
  b, length, heads, p = x.shape
  g, n = B.shape[2:]
  r = heads // g
  cd = compute_dtype(x.dtype)
  x = chunked(x.astype(cd), chunk).reshape(b, -1, chunk, g, r, p)
  B, C = (chunked(t.astype(cd), chunk) for t in (B, C))       # [b, nc, T, g, n]
  dt = chunked(dt.astype(cd), chunk)                             # [b, nc, T, h]
  cum = jnp.cumsum(dt * A.astype(cd), axis=2)
  by_group = lambda t: t.reshape(*t.shape[:3], g, r)             # [b, nc, T, h] -> [..., g, r]

  @jax.checkpoint
  def local(x, dt, B, C, cum):
    decay = _segsum_decay(cum).reshape(b, -1, g, r, chunk, chunk)
    scores = jnp.einsum("bctgn,bcsgn->bcgts", C, B)[:, :, :, None]
    dt_s = by_group(dt).transpose(0, 1, 3, 4, 2)[..., None, :]   # [b, nc, g, r, 1, T]
    y = jnp.einsum("bcgrts,bcsgrp->bctgrp", scores * decay * dt_s, x)
    to_end = by_group(jnp.exp(cum[:, :, -1:] - cum) * dt)
    end = jnp.einsum("bcsgr,bcsgrp,bcsgn->bcgrpn", to_end, x, B)
    return y, end.reshape(b, -1, heads, p, n)

  @jax.checkpoint
  def from_entering(C, cum, h_in):
    y = jnp.einsum("bctgn,bcgrpn->bctgrp", C, h_in.reshape(b, -1, g, r, p, n))
    return y * jnp.exp(by_group(cum))[..., None]

  y, end = local(x, dt, B, C, cum)
  decay = jnp.exp(cum[:, :, -1])[..., None, None]                # [b, nc, h, 1, 1]
  h_in, final = _carry_over_chunks(decay, end, h0.astype(cd))
  y = y + from_entering(C, cum, h_in)
  return unchunked(y.reshape(b, -1, chunk, heads, p), length), final


def linear_attention_chunked(fq, fk, v, s0, *, chunk: int):
  """Causal linear attention on features: ``o_t = fq_t · (s0 + Σ_{s <= t} fk_s v_sᵀ)``.

  fq ``[b, L, h, f]``; fk ``[b, L, hk, f]``; v ``[b, L, hk, dv]``; s0 ``[b, hk, f, dv]``;
  query head ``i`` reads key/value head ``i // (h // hk)``. Inside a chunk the masked
  ``fq fkᵀ`` times v; the states entering the chunks are a cumulative sum of the chunks'
  ``fkᵀ v`` (no decay, so no scan is needed).
  """
  length, h, f = fq.shape[1:]
  hk, dv = v.shape[2:]
  r = h // hk
  cd = compute_dtype(v.dtype)
  fq = chunked(fq.astype(cd), chunk).reshape(fq.shape[0], -1, chunk, hk, r, f)
  fk, v = (chunked(t.astype(cd), chunk) for t in (fk, v))
  causal = jnp.arange(chunk)[:, None] >= jnp.arange(chunk)[None, :]

  @jax.checkpoint
  def local(fq, fk, v):
    scores = jnp.where(causal, jnp.einsum("bctkrf,bcskf->bckrts", fq, fk), 0.0)
    return jnp.einsum("bckrts,bcskd->bctkrd", scores, v), jnp.einsum("bcskf,bcskd->bckfd", fk, v)

  @jax.checkpoint
  def from_entering(fq, s_in):
    return jnp.einsum("bctkrf,bckfd->bctkrd", fq, s_in)

  o, kv = local(fq, fk, v)
  s0 = s0.astype(cd)
  before = jnp.pad(kv[:, :-1], [(0, 0), (1, 0), (0, 0), (0, 0), (0, 0)])
  s_in = s0[:, None] + jnp.cumsum(before, axis=1)                # the chunks before chunk c
  o = o + from_entering(fq, s_in)
  return unchunked(o.reshape(*o.shape[:3], h, dv), length), s0 + jnp.sum(kv, axis=1)


def default_chunk(call) -> int:
  """The chunk the XLA formulations use when the call asks for none. Mamba-1 runs ``chunk +
  L / chunk`` sequential steps, fewest at ``chunk ≈ sqrt(L)`` (the power of two nearest it);
  SSD and RLA do matmul work ``∝ chunk`` per position and ``L / chunk`` state steps: 64, or the
  power of two covering a shorter sequence."""
  if call.chunk_size is not None:
    return call.chunk_size
  length = call.length
  if isinstance(call, MambaCall):
    return 1 << round(math.log2(math.sqrt(length)))
  return min(64, 1 << (length - 1).bit_length())
