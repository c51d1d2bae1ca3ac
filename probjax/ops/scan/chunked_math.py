"""The chunk-parallel XLA formulations and the math the scan room's backends share (the compute
dtype, RLA's feature map, a Mamba-1 step, the group a head reads): backends share math through
this module, never through each other.

Every function takes the core operands the op's wrapper prepares (dt after bias and softplus,
an initial state, float32 or wider) and returns ``(y, final_state)`` in the compute dtype
(float32 for 16-bit inputs). The sequence is cut into chunks of ``chunk`` steps (the last one
padded with inert steps); the work inside a chunk runs for every chunk at once, the state
crosses chunk boundaries by a scan (or a cumulative sum) over chunks. Mamba-1's and SSD's
per-chunk functions are ``jax.checkpoint``-ed, so the backward recomputes inside a chunk; RLA's
form has its own backward (:func:`linear_attention_chunked`). A differentiated call saves its
inputs, their cumulative decays and the chunk-boundary states, never a state per position.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.custom_derivatives import SymbolicZero, linear_call

from probjax.core import jax_patches
from probjax.ops.scan.calls import MambaCall, RLACall

# RLA's backward is the transpose of a linear_call: its rules for vmap and second derivatives.
jax_patches.apply()


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


def _rla_operands(fq, fk, v, chunk, dtype):
  """fq ``[b, nc, C, hk, r, f]``, fk ``[b, nc, C, hk, f]``, v ``[b, nc, C, hk, dv]`` in the
  matmuls' ``dtype``; the chunk axis ``C`` zero-padded at the end (inert: a zero key adds
  nothing to the state, a zero query reads nothing)."""
  b, _, h, f = fq.shape
  hk = v.shape[2]
  q = chunked(fq.astype(dtype), chunk).reshape(b, -1, chunk, hk, h // hk, f)
  return q, chunked(fk.astype(dtype), chunk), chunked(v.astype(dtype), chunk)


def _dot(spec, a, b):
  """``einsum(spec, a, b)`` reading the operands in their own (matmul) dtype, accumulating and
  returning float32 or wider. XLA's CPU has no 16-bit x 16-bit -> float32 dot: there the
  operands are widened first, which gives the same products (a product of two 16-bit floats
  is exact in float32)."""
  cd = compute_dtype(a.dtype)
  narrow = lambda a, b: jnp.einsum(spec, a, b, preferred_element_type=cd)
  if a.dtype == cd:
    return narrow(a, b)
  wide = lambda a, b: jnp.einsum(spec, a.astype(cd), b.astype(cd))
  return jax.lax.platform_dependent(a, b, cpu=wide, default=narrow)


def _scores(spec, a, b):
  """The masked ``[..., t, s]`` scores of a chunk (``s <= t``), ``einsum(spec, a, b)`` in the
  operands' dtype as the next matmul reads them: the matmul accumulates in float32 and rounds
  its output once, as a float32 product rounded afterwards would, at half the bytes written."""
  scores = jnp.einsum(spec, a, b, preferred_element_type=a.dtype)
  t = scores.shape[-1]
  return jnp.where(jnp.arange(t)[:, None] >= jnp.arange(t)[None, :], scores, 0)


def _prefix(first, chunks, reverse=False):
  """``[first, first + x_0, first + x_0 + x_1, ...]`` over axis 1 of ``chunks`` (its last
  element left out; from the end with ``reverse``): one cumulative sum, no second pass to
  remove each chunk's own term."""
  parts = (chunks[:, 1:], first[:, None]) if reverse else (first[:, None], chunks[:, :-1])
  return jax.lax.cumsum(jnp.concatenate(parts, axis=1), axis=1, reverse=reverse)


def _rla_core(q, k, vc, s0, length):
  """The chunked forward on :func:`_rla_operands`' operands: ``(o [b, L, h, dv], final [b, hk,
  f, dv])`` in the compute dtype, and what the backward reads besides the operands: the states
  entering the chunks and the masked scores, as the output's matmuls read them (rounded to the
  operands' dtype; both are materialised for those matmuls anyway, so keeping them costs no
  pass)."""
  dtype = q.dtype
  kv = _dot("bcskf,bcskd->bckfd", k, vc)                          # each chunk's k^T v
  s_in = _prefix(s0.astype(kv.dtype), kv)                         # the state entering chunk c
  final = s_in[:, -1] + kv[:, -1]
  s_in = s_in.astype(dtype)
  scores = _scores("bctkrf,bcskf->bckrts", q, k)
  o = _dot("bckrts,bcskd->bctkrd", scores, vc) + _dot("bctkrf,bckfd->bctkrd", q, s_in)
  o = unchunked(o.reshape(*o.shape[:3], -1, o.shape[-1]), length)
  return (o, final), (s_in, scores)


@functools.partial(jax.custom_jvp, nondiff_argnums=(4, 5, 6))
def _rla(fq, fk, v, s0, chunk, dtype, dtypes):
  del dtypes
  return _rla_core(*_rla_operands(fq, fk, v, chunk, dtype), s0, fq.shape[1])[0]


def _rla_jvp(chunk, dtype, dtypes, primals, tangents):
  """The tangent is a ``linear_call`` in the inputs that have one: forward mode runs the
  chunked form's own jvp on the operands; reverse mode transposes it with :func:`_rla_bwd`, so
  ``jax.grad`` runs that backward on the forward's residuals."""
  fq, fk, v, s0 = primals
  length = fq.shape[1]
  operands = _rla_operands(fq, fk, v, chunk, dtype)
  out, kept = _rla_core(*operands, s0, length)
  present = tuple(not isinstance(t, SymbolicZero) for t in tangents)

  def tangent(res, lin):
    lin = iter(lin)
    dots = tuple(next(lin) if p else jnp.zeros(x.shape, x.dtype) for p, x in zip(present, primals))
    dots = (*_rla_operands(*dots[:3], chunk, dtype), dots[3])
    return jax.jvp(lambda *a: _rla_core(*a, length)[0], res[:4], dots)[1]

  def transpose(res, ct):
    grads = _rla_bwd(chunk, dtype, dtypes, (*res[:3], *res[4:]), ct)
    return tuple(g for g, p in zip(grads, present) if p)

  lin = tuple(t for t, p in zip(tangents, present) if p)
  return out, linear_call(tangent, transpose, (*operands, s0, *kept), lin)


_rla.defjvp(_rla_jvp, symbolic_zeros=True)


def _rla_bwd(chunk, dtype, dtypes, saved, ct):
  """The exact gradients, every matmul again on ``dtype`` operands: with ``R_c = dS_final +
  Σ_{c' > c} q_{c'}ᵀ do_{c'}`` (the gradient of each state added after chunk ``c``) and the
  masked ``A = q kᵀ``, ``dA = do vᵀ`` of a chunk, ``dq = do S_inᵀ + dA k``, ``dk = v Rᵀ +
  dAᵀ q``, ``dv = k R + Aᵀ do`` (a key/value head's summed over its query heads) and ``ds0 =
  R_0 + q_0ᵀ do_0``; ``dtypes`` are the inputs' (the gradients')."""
  q, k, vc, s_in, scores = saved
  do, ds = ct
  b, nc, c, hk, r, f = q.shape
  length, dv = do.shape[1], do.shape[-1]
  do = chunked(do.astype(dtype), chunk).reshape(b, nc, c, hk, r, dv)
  qdo = _dot("bctkrf,bctkrd->bckfd", q, do)                       # what chunk c adds to dS_in
  rev = _prefix(ds.astype(qdo.dtype), qdo, reverse=True)           # R_c
  ds0 = rev[:, 0] + qdo[:, 0]
  rev = rev.astype(dtype)
  dscores = _scores("bctkrd,bcskd->bckrts", do, vc)
  dq = _dot("bckrts,bcskf->bctkrf", dscores, k) + _dot("bctkrd,bckfd->bctkrf", do, s_in)
  dk = _dot("bckrts,bctkrf->bcskf", dscores, q) + _dot("bcskd,bckfd->bcskf", vc, rev)
  dvv = _dot("bckrts,bctkrd->bcskd", scores, do) + _dot("bcskf,bckfd->bcskd", k, rev)
  dq = unchunked(dq.reshape(b, nc, c, hk * r, f), length)
  grads = (dq, unchunked(dk, length), unchunked(dvv, length), ds0)
  return tuple(g.astype(t) for g, t in zip(grads, dtypes))


def linear_attention_chunked(fq, fk, v, s0, *, chunk: int, dtype=None):
  """Causal linear attention on features: ``o_t = fq_t · (s0 + Σ_{s <= t} fk_s v_sᵀ)``.

  fq ``[b, L, h, f]``; fk ``[b, L, hk, f]``; v ``[b, L, hk, dv]``; s0 ``[b, hk, f, dv]``;
  query head ``i`` reads key/value head ``i // (h // hk)``. Returns ``(o [b, L, h, dv],
  S_final [b, hk, f, dv])`` in the compute dtype.

  Every matmul reads its operands in ``dtype`` (default v's: bfloat16 inputs give bfloat16
  tensor-core matmuls) and accumulates in float32 or wider. Inside a chunk the masked
  ``fq fkᵀ`` times v and ``fq S_in``; the states entering the chunks are a cumulative sum of
  the chunks' ``fkᵀ v`` (no decay, so no scan). Its own backward (:func:`_rla_bwd`, the
  transpose of its jvp) keeps the backward's matmuls in ``dtype`` too (JAX's own transposes
  would read the float32 cotangents, a float32 matmul) and saves the operands, the
  chunk-entering states and the masked scores in ``dtype``, never a state per position;
  forward mode (``jax.jvp``) is the form's own jvp.
  """
  return _rla(fq, fk, v, s0, chunk, jnp.dtype(v.dtype if dtype is None else dtype).name,
              tuple(t.dtype.name for t in (fq, fk, v, s0)))


def rla_chunk(call) -> int:
  """The chunk of RLA's chunked XLA form. Its memory traffic (what bounds it: the matmuls are
  small) has two parts that move in opposite directions with the chunk C: each query head's
  ``[C, C]`` score tiles (written by one matmul, masked, read by the next), about C entries a
  position; and each key/value head's ``[features, v_head_dim]`` float32 states, one a chunk
  (summed over chunks, rounded, read), about twice a score entry's bytes apiece, so
  ``2 F Dv hk / (C h)`` a query position. Their sum is least at ``C² = 2 F Dv hk / h``: the
  smallest power of two whose square reaches it, between 16 and 256, and no longer than the
  power of two covering the sequence. E.g. softmax features of head_dim 64 (F = 128), Dv 64,
  no GQA: ``C² = 16384``, C = 128; with four query heads a key/value head, 64."""
  if call.chunk_size is not None:
    return call.chunk_size
  target = 2 * call.features * call.v_head_dim * call.kv_heads // call.heads
  chunk = min(256, max(16, 1 << ((target - 1).bit_length() + 1) // 2))
  return min(chunk, 1 << (call.length - 1).bit_length())


def default_chunk(call) -> int:
  """The chunk the XLA formulations use when the call asks for none. Mamba-1 runs ``chunk +
  L / chunk`` sequential steps, fewest at ``chunk ≈ sqrt(L)`` (the power of two nearest it);
  SSD does matmul work ``∝ chunk`` per position and ``L / chunk`` state steps: 64, or the
  power of two covering a shorter sequence; RLA: :func:`rla_chunk`."""
  if call.chunk_size is not None:
    return call.chunk_size
  if isinstance(call, RLACall):
    return rla_chunk(call)
  length = call.length
  if isinstance(call, MambaCall):
    return 1 << round(math.log2(math.sqrt(length)))
  return min(64, 1 << (length - 1).bit_length())
