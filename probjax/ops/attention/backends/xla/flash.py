"""Exact tiled (flash) attention in plain XLA, memory linear in sequence length.

The primal is a ``jax.custom_jvp`` whose tangent is a ``linear_call``: forward
mode runs a flash-style tangent pass, and reverse mode transposes that linear
call into a flash backward that recomputes the scores from the log-sum-exp.
The residuals kept for the backward are q, k, v, the output and the LSE. Both
passes compute only the terms of the inputs that have a tangent (cotangent).
Second derivatives differentiate the passes themselves (the ``linear_call`` JVP
rule of :mod:`probjax.core.jax_patches`); their tile loops have static trip
counts, so that reverse mode can transpose them too.

Internal layout: queries ``[batch, kv_heads, groups, q_len, head_dim]`` and
keys/values ``[batch, kv_heads, kv_len, head_dim]``, so grouped-query
attention never repeats K/V. Bias and dense masks keep their broadcast
(size-1) axes as ``[b|1, kv_heads|1, groups|1, q|1, k|1]``.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.custom_derivatives import SymbolicZero, linear_call

from probjax.core import jax_patches
from probjax.ops.attention.masks import EMPTY, FULL, PARTIAL, Mask, pad_axis, round_up
from probjax.ops.attention.padding import zero_padding, zero_rows
from probjax.ops.attention.backends.xla.common import compute_dtype

jax_patches.apply()  # linear_call's vmap and JVP rules, which the flash passes need


@dataclasses.dataclass(frozen=True)
class _Static:
  """Static (hashable) part of a call."""

  q_len: int
  kv_len: int
  block_q: int
  block_k: int
  scale: float
  groups: int
  band: Mask  # the mask's static band (loop bounds and, without mask arrays, the element test)
  dropout_rate: float
  broadcast_dropout: bool
  precision: Any
  score_mod: Callable | None  # closure-converted: f(s, b, h, q, k, *consts)
  dtype: Any = jnp.float32  # compute dtype: scores, softmax, accumulation

  @property
  def nq(self):
    return -(-self.q_len // self.block_q)

  @property
  def nk(self):
    return -(-self.kv_len // self.block_k)


def choose_blocks(q_len: int, kv_len: int) -> tuple[int, int]:
  """One tile of the whole (8-aligned) length up to 512, else 256."""
  pick = lambda n: round_up(max(n, 1), 8) if n <= 512 else 256
  return pick(q_len), pick(kv_len)


def _slice(x, axis, start, size):
  return x if x.shape[axis] == 1 else lax.dynamic_slice_in_dim(x, start, size, axis)


def _tile(x, iq, ik, st: _Static):
  if x is None:
    return None
  return _slice(_slice(x, -2, iq * st.block_q, st.block_q), -1, ik * st.block_k, st.block_k)


def _scores(st: _Static, iq, ik, qb, kb, bias_t, consts):
  """Scores of tile (iq, ik) in the compute dtype: ``[b, hkv, g, bq, bk]``."""
  s = jnp.einsum("bhgqd,bhkd->bhgqk", qb.astype(st.dtype), kb.astype(st.dtype),
                 precision=st.precision) * st.scale
  if bias_t is not None:
    s = s + bias_t.astype(st.dtype)
  if st.score_mod is not None:
    b, hkv, g = qb.shape[0], qb.shape[1], st.groups
    # int32 as the modifier was traced with (closure_convert), also under jax_enable_x64
    i32 = lambda x: jnp.asarray(x, jnp.int32)
    bi = i32(jnp.arange(b))[:, None, None, None, None]
    hi = i32(jnp.arange(hkv)[:, None] * g + jnp.arange(g)[None, :])[None, :, :, None, None]
    qi = i32(iq * st.block_q + jnp.arange(st.block_q))[:, None]
    ki = i32(ik * st.block_k + jnp.arange(st.block_k))[None, :]
    s = st.score_mod(s, bi, hi, qi, ki, *consts).astype(st.dtype)
  return s


def _valid(st: _Static, iq, ik, mask: Mask | None, dense_t, masked: bool = True):
  """Boolean ``[b|1, hkv|1, g|1, bq, bk]`` of allowed (query, key) pairs in the tile.

  ``masked=False``: a tile the mask's classes prove FULL, where only the keys past ``kv_len``
  (the padded last tile) and ``dense_t`` are tested, not the mask's element predicate."""
  qi = (iq * st.block_q + jnp.arange(st.block_q))[:, None]
  ki = (ik * st.block_k + jnp.arange(st.block_k))[None, :]
  ok = ki < st.kv_len
  if masked:
    m = st.band if mask is None else mask
    ok = ok & m.element(qi, ki)
  elif st.kv_len % st.block_k == 0:
    ok = jnp.ones_like(ok)
  if ok.ndim == 4:  # a mask that differs per query head: [b|1, heads, bq, bk], head = hkv * g + g_i
    ok = ok.reshape((ok.shape[0], ok.shape[1] // st.groups, st.groups, st.block_q, st.block_k))
  else:
    ok = ok.reshape((-1, 1, 1, st.block_q, st.block_k)) if ok.ndim == 3 else ok[None, None, None]
  if dense_t is not None:
    ok = ok & dense_t
  return ok


def _keep(st: _Static, rng, iq, ik, shape):
  """Dropout scale ``keep / (1 - rate)`` for tile (iq, ik), or None without dropout."""
  if st.dropout_rate == 0.0:
    return None
  if st.broadcast_dropout:
    shape = (1, 1, 1) + shape[-2:]
  key = jax.random.fold_in(jax.random.fold_in(rng, iq), ik)
  keep = jax.random.bernoulli(key, 1.0 - st.dropout_rate, shape)
  return keep.astype(st.dtype) / (1.0 - st.dropout_rate)


def _k_bounds(st: _Static, iq):
  """Key-tile range ``[lo, hi)`` that the static band allows for query tile(s) ``iq`` (traced,
  or numpy / Python ints for static bounds)."""
  xp = jnp if isinstance(iq, jax.Array) else np
  lower, upper = st.band.band_bounds
  lo, hi = 0, st.nk
  if lower is not None:
    lo = xp.clip((iq * st.block_q + lower) // st.block_k, 0, st.nk)
  if upper is not None:
    hi = xp.clip(-(-((iq + 1) * st.block_q - 1 + upper + 1) // st.block_k), 0, st.nk)
  return lo, xp.maximum(lo, hi)


def _q_bounds(st: _Static, ik):
  """Query-tile range ``[lo, hi)`` that the static band allows for key tile(s) ``ik``."""
  xp = jnp if isinstance(ik, jax.Array) else np
  lower, upper = st.band.band_bounds
  lo, hi = 0, st.nq
  if upper is not None:
    lo = xp.clip((ik * st.block_k - upper) // st.block_q, 0, st.nq)
  if lower is not None:
    hi = xp.clip(-(-((ik + 1) * st.block_k - 1 - lower + 1) // st.block_q), 0, st.nq)
  return lo, xp.maximum(lo, hi)


def _band_loop(st: _Static, bounds, n_outer: int, i, body, init):
  """``lax.fori_loop(lo, hi, body, init)`` over the inner tiles ``[lo, hi) = bounds(st, i)`` of
  outer tile ``i``, run for a static trip count (the most inner tiles of any outer tile).

  A loop with traced bounds is a while loop, which reverse mode cannot transpose; with a
  static count it is a scan, so second derivatives (which differentiate these passes) work
  in every mode. Iterations past ``hi`` (outer tiles that the band gives fewer inner tiles)
  are skipped by a cond.
  """
  los, his = bounds(st, np.arange(n_outer))
  trips = int(np.max(np.asarray(his) - np.asarray(los)))
  lo, hi = bounds(st, i)
  if np.all(np.asarray(his) - np.asarray(los) == trips):
    return lax.fori_loop(0, trips, lambda j, c: body(lo + j, c), init)
  return lax.fori_loop(0, trips, lambda j, c: lax.cond(lo + j < hi, lambda c: body(lo + j, c), lambda c: c, c),
                       init)


def _maybe_skip(tile_cls, iq, ik, compute, carry):
  """``compute(carry, masked)`` by the class of tile (iq, ik): skipped where EMPTY (for every
  batch element), ``masked=False`` (no element predicate) where FULL for every batch element
  and head, else ``masked=True``; ``tile_cls`` None: ``compute(carry, True)``."""
  if tile_cls is None:
    return compute(carry, True)
  branches = [None] * 3
  branches[EMPTY], branches[PARTIAL], branches[FULL] = (lambda c: c, lambda c: compute(c, True),
                                                        lambda c: compute(c, False))
  return lax.switch(tile_cls[iq, ik], branches, carry)


def _tile_classes(st: _Static, mask: Mask | None, batch: int):
  """``[nq, nk]`` int32 classes of the tiles over the batch (EMPTY: for every batch element,
  FULL: for every batch element; from the mask's arrays at run time, or from its function at
  trace time), or None where no tile is skipped."""
  if mask is None:
    return None  # a band alone (flash_attention drops band-only masks): loop bounds suffice
  if st.nq == 1 and st.nk == 1:
    # An empty single tile computes zero rows anyway. A cond on its class folds away only for
    # constant mask arrays; for traced ones (ids passed to jit) it stays, and on XLA:CPU it
    # costs more than the tile.
    return None
  cls = mask.classify_tiles(batch, st.nq * st.block_q, st.nk * st.block_k, st.block_q, st.block_k)
  any_, full = jnp.any(cls != EMPTY, axis=0), jnp.all(cls == FULL, axis=0)
  return jnp.where(any_, jnp.where(full, FULL, PARTIAL), EMPTY).astype(jnp.int32)


# -- forward -------------------------------------------------------------------------
def _forward(st: _Static, q, k, v, bias, consts, mask, dense, rng):
  """Returns out ``[b, hkv, g, Tq_pad, dv]`` (q dtype) and lse ``[b, hkv, g, Tq_pad]`` (compute dtype)."""
  b, hkv, g = q.shape[:3]
  d = v.shape[-1]  # the output's width is the values' (it may differ from q/k's)
  cdt = st.dtype
  tile_cls = _tile_classes(st, mask, b)

  def q_block(iq):
    qb = lax.dynamic_slice_in_dim(q, iq * st.block_q, st.block_q, 3)

    def body(ik, carry):
      def compute(carry, masked):
        m, l, acc = carry
        kb = lax.dynamic_slice_in_dim(k, ik * st.block_k, st.block_k, 2)
        vb = lax.dynamic_slice_in_dim(v, ik * st.block_k, st.block_k, 2)
        s = _scores(st, iq, ik, qb, kb, _tile(bias, iq, ik, st), consts)
        ok = _valid(st, iq, ik, mask, _tile(dense, iq, ik, st), masked)
        s = jnp.where(ok, s, -jnp.inf)
        # The running maximum only stabilises the exponentials (out and lse do not depend
        # on it), so differentiating this pass (second order) need not go through the max.
        m_new = lax.stop_gradient(jnp.maximum(m, s.max(-1)))
        m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
        p = jnp.exp(s - m_safe[..., None])
        alpha = jnp.exp(m - m_safe)
        l = alpha * l + p.sum(-1)
        z = _keep(st, rng, iq, ik, p.shape)
        pz = p if z is None else p * z
        acc = alpha[..., None] * acc + jnp.einsum("bhgqk,bhkd->bhgqd", pz, vb.astype(cdt),
                                                  precision=st.precision)
        return m_new, l, acc
      return _maybe_skip(tile_cls, iq, ik, compute, carry)

    init = (jnp.full((b, hkv, g, st.block_q), -jnp.inf, cdt), jnp.zeros((b, hkv, g, st.block_q), cdt),
            jnp.zeros((b, hkv, g, st.block_q, d), cdt))
    m, l, acc = _band_loop(st, _k_bounds, st.nq, iq, body, init)
    pos = l > 0
    out = jnp.where(pos[..., None], acc / jnp.where(pos, l, 1.0)[..., None], 0.0)
    lse = jnp.where(pos, m + jnp.log(jnp.where(pos, l, 1.0)), jnp.inf)
    return out.astype(q.dtype), lse

  out, lse = lax.map(q_block, jnp.arange(st.nq))
  out = jnp.moveaxis(out, 0, 3).reshape(b, hkv, g, st.nq * st.block_q, d)
  lse = jnp.moveaxis(lse, 0, 3).reshape(b, hkv, g, st.nq * st.block_q)
  return out, lse


def _restrict(fn, args, keep):
  """``fn`` as a function of the ``args`` where ``keep`` is True (the others held fixed), and those."""
  def sub(*xs):
    it = iter(xs)
    return fn(*(next(it) if k else a for a, k in zip(args, keep)))
  return sub, tuple(a for a, k in zip(args, keep) if k)


# -- tangent (forward-mode) ------------------------------------------------------------
def _tangent(st: _Static, res, tangents):
  """Output tangent ``[b, hkv, g, Tq_pad, dv]`` for ``tangents = (q, k, v, bias, consts)``, each
  None where that input has no tangent.

  Only the terms of present tangents are formed (no zero tangent is built): besides the
  wasted work, a dot with a zero tangent is a dot with a broadcast constant operand, which
  XLA:CPU's YNNPACK fusion miscomputes under ``jax.jit`` (garbage up to inf/NaN).
  """
  q, k, v, bias, consts, mask, dense, rng, out, lse = res
  qd, kd, vd, bd, cd = tangents
  score_dots = (qd, kd, bd, *cd)
  keep = tuple(t is not None for t in score_dots)
  cdt = st.dtype
  b, hkv, g = q.shape[:3]
  d = v.shape[-1]
  tile_cls = _tile_classes(st, mask, b)

  def q_block(iq):
    sl = lambda x: None if x is None else lax.dynamic_slice_in_dim(x, iq * st.block_q, st.block_q, 3)
    qb, qdb, ob, lse_b = sl(q), sl(qd), sl(out).astype(cdt), sl(lse)

    def body(ik, carry):
      def compute(carry, masked):
        acc, c = carry
        ksl = lambda x: None if x is None else lax.dynamic_slice_in_dim(x, ik * st.block_k, st.block_k, 2)
        fn = lambda qb, kb, bias_t, *consts: _scores(st, iq, ik, qb, kb, bias_t, consts)
        args = (qb, ksl(k), _tile(bias, iq, ik, st), *consts)
        ok = _valid(st, iq, ik, mask, _tile(dense, iq, ik, st), masked)
        if any(keep):  # the scores' tangent: the terms through q, k, bias and score_mod's arrays
          sub, primals = _restrict(fn, args, keep)
          dots = tuple(t for t in (qdb, ksl(kd), _tile(bd, iq, ik, st), *cd) if t is not None)
          s, sd = jax.jvp(sub, primals, dots)
        else:
          s = fn(*args)
        p = jnp.where(ok, jnp.exp(jnp.where(ok, s, 0.0) - lse_b[..., None]), 0.0)
        z = _keep(st, rng, iq, ik, p.shape)
        dz = lambda x: x if z is None else x * z
        if any(keep):
          psd = p * jnp.where(ok, sd, 0.0)
          acc = acc + jnp.einsum("bhgqk,bhkd->bhgqd", dz(psd), ksl(v).astype(cdt), precision=st.precision)
          c = c + psd.sum(-1)
        if vd is not None:
          acc = acc + jnp.einsum("bhgqk,bhkd->bhgqd", dz(p), ksl(vd).astype(cdt), precision=st.precision)
        return acc, c
      return _maybe_skip(tile_cls, iq, ik, compute, carry)

    c0 = jnp.zeros((b, hkv, g, st.block_q), cdt) if any(keep) else None
    acc, c = _band_loop(st, _k_bounds, st.nq, iq, body, (jnp.zeros((b, hkv, g, st.block_q, d), cdt), c0))
    return (acc if c is None else acc - c[..., None] * ob).astype(q.dtype)

  od = lax.map(q_block, jnp.arange(st.nq))
  return jnp.moveaxis(od, 0, 3).reshape(out.shape)


# -- transpose (reverse-mode backward) ----------------------------------------------------
def _transpose(st: _Static, present, res, do):
  """Cotangents ``(q, k, v, bias, consts)`` of output cotangent ``do``, computed only where
  ``present`` (the same structure of bools) is True and None elsewhere."""
  q, k, v, bias, consts, mask, dense, rng, out, lse = res
  pq, pk, pv, pb, pc = present
  keep = (pq, pk, pb, *pc)
  cdt = st.dtype
  b, hkv, g, tq, d = q.shape
  tile_cls = _tile_classes(st, mask, b)
  do = do.astype(cdt)
  delta = jnp.sum(do * out.astype(cdt), -1)
  zeros = lambda x, want: jnp.zeros(x.shape, cdt) if want else None

  def k_block(carry, ik):
    ksl = lambda x: lax.dynamic_slice_in_dim(x, ik * st.block_k, st.block_k, 2)
    kb, vb = ksl(k), ksl(v).astype(cdt)

    def body(iq, inner):
      def compute(inner, masked):
        dk, dv, dq, dbias, dconsts = inner
        qsl = lambda x, ax=3: lax.dynamic_slice_in_dim(x, iq * st.block_q, st.block_q, ax)
        qb, dob, lse_b, delta_b = qsl(q), qsl(do), qsl(lse), qsl(delta)
        fn = lambda qb, kb, bias_t, *consts: _scores(st, iq, ik, qb, kb, bias_t, consts)
        args = (qb, kb, _tile(bias, iq, ik, st), *consts)
        if any(keep):
          sub, primals = _restrict(fn, args, keep)
          s, vjp = jax.vjp(sub, *primals)
        else:
          s = fn(*args)
        ok = _valid(st, iq, ik, mask, _tile(dense, iq, ik, st), masked)
        p = jnp.where(ok, jnp.exp(jnp.where(ok, s, 0.0) - lse_b[..., None]), 0.0)
        z = _keep(st, rng, iq, ik, p.shape)
        if pv:
          dv = dv + jnp.einsum("bhgqk,bhgqd->bhkd", p if z is None else p * z, dob, precision=st.precision)
        if not any(keep):
          return dk, dv, dq, dbias, dconsts
        dp = jnp.einsum("bhgqd,bhkd->bhgqk", dob, vb, precision=st.precision)
        if z is not None:
          dp = dp * z
        cts = iter(vjp(p * (dp - delta_b[..., None])))
        dqt, dkt, dbt, *dct = (next(cts) if want else None for want in keep)
        if pq:
          dq = lax.dynamic_update_slice_in_dim(dq, qsl(dq) + dqt, iq * st.block_q, 3)
        if pk:
          dk = dk + dkt
        if pb:
          dbias = _tile_add(dbias, dbt, iq, ik, st)
        dconsts = tuple(a if t is None else a + t for a, t in zip(dconsts, dct))
        return dk, dv, dq, dbias, dconsts
      return _maybe_skip(tile_cls, iq, ik, compute, inner)

    dq, dbias, dconsts = carry
    init = (zeros(kb, pk), zeros(vb, pv), dq, dbias, dconsts)
    dk, dv, dq, dbias, dconsts = _band_loop(st, _q_bounds, st.nk, ik, body, init)
    return (dq, dbias, dconsts), (dk, dv)

  carry = (zeros(q, pq), zeros(bias, pb), tuple(zeros(c, want) for c, want in zip(consts, pc)))
  (dq, dbias, dconsts), (dk, dv) = lax.scan(k_block, carry, jnp.arange(st.nk))
  unstack = lambda x, like: None if x is None else jnp.moveaxis(x, 0, 2).reshape(like.shape)
  dk, dv = unstack(dk, k), unstack(dv, v)
  cast = lambda x, like: None if x is None else x.astype(like.dtype)
  return (cast(dq, q), cast(dk, k), cast(dv, v), cast(dbias, bias),
          tuple(cast(x, c) for x, c in zip(dconsts, consts)))


def _tile_add(x, t, iq, ik, st):
  """``x[tile(iq, ik)] += t`` on an array with broadcast (size-1) q/k axes."""
  qs = 0 if x.shape[-2] == 1 else iq * st.block_q
  ks = 0 if x.shape[-1] == 1 else ik * st.block_k
  idx = (0,) * (x.ndim - 2) + (qs, ks)
  return lax.dynamic_update_slice(x, lax.dynamic_slice(x, idx, t.shape) + t, idx)


# -- custom_jvp assembly ---------------------------------------------------------------
@functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
def _flash(st, q, k, v, bias, consts, mask, dense, rng):
  return _forward(st, q, k, v, bias, consts, mask, dense, rng)[0]


def _flash_jvp(st, primals, tangents):
  q, k, v, bias, consts, mask, dense, rng = primals
  out, lse = _forward(st, q, k, v, bias, consts, mask, dense, rng)
  res = (q, k, v, bias, consts, mask, dense, rng, out, lse)
  # Only non-zero tangents become linear inputs (None for the others): a zero tangent is a
  # constant, which linear_call's transpose rule does not accept as a linear input, and the
  # tangent and transpose passes compute only the terms of the present ones.
  is_zero = lambda t: t is None or isinstance(t, SymbolicZero)
  lin = jax.tree.map(lambda t: None if is_zero(t) else t, tuple(tangents[:5]), is_leaf=is_zero)
  present = jax.tree.map(lambda t: t is not None, lin, is_leaf=lambda t: t is None)
  out_dot = linear_call(functools.partial(_tangent, st), functools.partial(_transpose, st, present), res, lin)
  return out, out_dot


_flash.defjvp(_flash_jvp, symbolic_zeros=True)


def flash_attention(q, k, v, *, bias=None, mask: Mask | None = None, dense_mask=None,
                    score_mod=None, scale: float, dropout_rate: float = 0.0, dropout_rng=None,
                    broadcast_dropout: bool = True, precision=None, block_q: int | None = None,
                    block_k: int | None = None):
  """Tiled exact attention. q ``[B, Tq, H, D]``, k ``[B, Tkv, Hkv, D]``, v ``[B, Tkv, Hkv, Dv]``
  → ``[B, Tq, H, Dv]``.

  ``bias``/``dense_mask`` must already be rank 4 and broadcastable to
  ``[B, H, Tq, Tkv]``; ``mask`` is a :class:`Mask`. Scores and softmax are float32 (float64
  for float64 inputs). A row with no valid key (masked, or at -inf from ``bias`` or
  ``score_mod``; every row when ``Tkv = 0``) is zero, with zero gradients. Positions past the
  mask's lengths may hold NaN or inf (:func:`~probjax.ops.attention.padding.zero_padding`);
  those excluded only by the band, segment ids or ``dense_mask`` must be finite.
  """
  bsz, tq, h, d = q.shape
  tk, hkv, dv = k.shape[1], k.shape[2], v.shape[3]
  g = h // hkv
  if tq == 0 or tk == 0:
    return jnp.zeros((bsz, tq, h, dv), q.dtype)  # no query or no key: no tile to loop over, every row empty
  cdt = compute_dtype(q.dtype)
  q, k, v, q_ok = zero_padding(mask, q, k, v)
  dq_, dk_ = choose_blocks(tq, tk)
  bq, bk = block_q or dq_, block_k or dk_
  tq_p, tk_p = round_up(tq, bq), round_up(tk, bk)

  consts = ()
  mod = None
  if score_mod is not None:
    ex = jax.ShapeDtypeStruct((bsz, hkv, g, bq, bk), cdt)
    i32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32)
    mod5 = lambda s, b_, h_, q_, k_: score_mod(s, b_, h_, q_, k_)
    mod, consts = jax.closure_convert(mod5, ex, i32(bsz, 1, 1, 1, 1), i32(1, hkv, g, 1, 1), i32(bq, 1), i32(1, bk))
    consts = tuple(consts)

  band = Mask() if mask is None else mask.band
  if mask is not None:
    # Band only: handled by loop bounds and the static band; else every predicate, on the padded tiles.
    mask = mask.padded(bsz, tq_p, tk_p) if mask.kinds != band.kinds else None
  if jax.default_backend() == "cpu":
    # Mask arrays, dense masks and biases that are constants of the program (closed over by
    # jit) stay opaque to XLA:CPU: folded, a fully masked tile's probabilities become a
    # constant zero broadcast, and its YNNPACK dot fusion miscomputes dots with such an operand
    # (garbage up to NaN in dq of rows with no valid key); folding them also costs seconds of
    # compile time. On GPUs the fold stays: it removes the tile-skipping conds of empty tiles.
    mask, dense_mask, bias = jax.tree.map(_opaque, (mask, dense_mask, bias))
  st = _Static(tq, tk, bq, bk, float(scale), g, band, float(dropout_rate),
               bool(broadcast_dropout), precision, mod, cdt)

  qi = jnp.transpose(q, (0, 2, 1, 3)).reshape(bsz, hkv, g, tq, d)
  qi = pad_axis(qi, 3, tq_p)
  ki = pad_axis(jnp.transpose(k, (0, 2, 1, 3)), 2, tk_p)
  vi = pad_axis(jnp.transpose(v, (0, 2, 1, 3)), 2, tk_p)
  bias_i = _heads_split(bias, hkv, g, tq_p, tk_p, 0)
  dense_i = _heads_split(dense_mask, hkv, g, tq_p, tk_p, False)
  rng = dropout_rng if st.dropout_rate else None
  out = _flash(st, qi, ki, vi, bias_i, consts, mask, dense_i, rng)
  out = out[:, :, :, :tq].reshape(bsz, h, tq, dv)
  return zero_rows(jnp.transpose(out, (0, 2, 1, 3)), q_ok)


def _opaque(x):
  return lax.optimization_barrier(x) if isinstance(x, (jax.Array, np.ndarray)) else x


def _heads_split(x, hkv, g, tq_p, tk_p, pad_value):
  """``[b|1, h|1, q|1, k|1]`` → ``[b|1, hkv|1, g|1, q_pad|1, k_pad|1]``."""
  if x is None:
    return None
  b_, h_, q_, k_ = x.shape
  x = x.reshape(b_, hkv, g, q_, k_) if h_ != 1 else x.reshape(b_, 1, 1, q_, k_)
  return pad_axis(pad_axis(x, 3, tq_p, pad_value, broadcast=True), 4, tk_p, pad_value, broadcast=True)
