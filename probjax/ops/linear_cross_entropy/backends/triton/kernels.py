"""Pallas-Triton kernels of ``linear_cross_entropy``.

Operands are padded to whole tiles once, outside the kernels: tokens to ``block_t`` (padded
rows carry label -1, so they count for nothing), the width to a power of two and the
vocabulary to ``block_v`` (zero columns, masked by index inside the kernels). The head is used
as ``[d, vocab]``; a ``[vocab, d]`` head is transposed first (one copy of the head, as the
padding is).

- forward, one program per token tile ``[block_t]``: loops over the vocabulary tiles with an
  online log-sum-exp, and sums the label's logit and (for label smoothing) all logits;
- ``dx``, one program per token tile: recomputes each vocabulary tile's logits from the saved
  log-sum-exp, ``dz = g (p (1 + 2 z_loss lse) - (1 - eps) onehot - eps / V)`` and adds
  ``dz @ w_tile^T``;
- ``dw`` and ``dbias``, one program per vocabulary tile: the same ``dz`` over every token tile
  in order, adding ``x_tile^T @ dz``: each output element is written by one program, no atomics.

Logits and sums are float32 (float64 for float64 inputs, interpret mode only).

Each program holds full-width tiles (``x [block_t, d]``, ``w [d, block_v]``, and the ``dx`` /
``dw`` accumulators): there is no loop over the width, so at widths in the hundreds these tiles
exceed what a GPU program keeps on chip; a loop over the width (and tiles chosen per device) is
what the GPU measurement has to settle. Interpret mode checks the arithmetic only.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from probjax.ops.linear_cross_entropy.call import LinearCrossEntropyCall

BLOCK_T = 64
BLOCK_V = 128

_NN = (((1,), (0,)), ((), ()))
_NT = (((1,), (1,)), ((), ()))
_TN = (((0,), (0,)), ((), ()))


def _pow2(n: int) -> int:
  return max(16, 1 << (int(n) - 1).bit_length())


def blocks(call: LinearCrossEntropyCall) -> tuple[int, int]:
  """The kernels' tile ``(block_t, block_v)``: the call's chunks rounded up to a power of two
  (Triton's tiles are powers of two, at least 16), else :data:`BLOCK_T` x :data:`BLOCK_V`,
  at most the axis rounded up."""
  return (min(_pow2(call.chunk_tokens or BLOCK_T), _pow2(call.tokens)),
          min(_pow2(call.chunk_vocab or BLOCK_V), _pow2(call.vocab)))


def _dot(a, b, dims, acc):
  return jax.lax.dot_general(a, b.astype(a.dtype), dims, preferred_element_type=acc).astype(acc)


def _iota(n):
  return jax.lax.broadcasted_iota(jnp.int32, (n,), 0)


def _fwd_kernel(x_ref, w_ref, b_ref, y_ref, lse_ref, lab_ref, tot_ref, *, bv, vocab, acc):
  x = x_ref[...]
  y = y_ref[...]
  bt = x.shape[0]

  def step(j, state):
    m, s, lab, tot = state
    cols = j * bv + _iota(bv)
    z = _dot(x, w_ref[:, pl.ds(j * bv, bv)], _NN, acc) + b_ref[pl.ds(j * bv, bv)].astype(acc)[None, :]
    ok = (cols < vocab)[None, :]
    zm = jnp.where(ok, z, -jnp.inf)
    m_new = jnp.maximum(m, jnp.max(zm, axis=1))
    s = s * jnp.exp(m - m_new) + jnp.sum(jnp.exp(zm - m_new[:, None]), axis=1)
    lab = lab + jnp.sum(jnp.where(y[:, None] == cols[None, :], z, 0.0), axis=1)
    tot = tot + jnp.sum(jnp.where(ok, z, 0.0), axis=1)
    return m_new, s, lab, tot

  zeros = jnp.zeros((bt,), acc)
  m, s, lab, tot = jax.lax.fori_loop(0, pl.cdiv(vocab, bv), step, (jnp.full((bt,), -jnp.inf, acc), zeros, zeros,
                                                                   zeros))
  lse_ref[...] = m + jnp.log(s)
  lab_ref[...] = lab
  tot_ref[...] = tot


def _dz(x, w_tile, b_tile, y, g, lse, coef, cols, *, vocab, eps, acc):
  """The logits' gradient on one (token tile, vocabulary tile), zero on padded columns."""
  z = _dot(x, w_tile, _NN, acc) + b_tile.astype(acc)[None, :]
  p = jnp.exp(z - lse[:, None])
  hit = (y[:, None] == cols[None, :]).astype(acc)
  dz = g[:, None] * (p * coef[:, None] - (1 - eps) * hit - eps / vocab)
  return jnp.where((cols < vocab)[None, :], dz, 0.0)


def _dx_kernel(x_ref, w_ref, b_ref, y_ref, g_ref, lse_ref, coef_ref, dx_ref, *, bv, vocab, eps, acc):
  x, y, g, lse, coef = x_ref[...], y_ref[...], g_ref[...], lse_ref[...], coef_ref[...]

  def step(j, dx):
    wt = w_ref[:, pl.ds(j * bv, bv)]
    dz = _dz(x, wt, b_ref[pl.ds(j * bv, bv)], y, g, lse, coef, j * bv + _iota(bv), vocab=vocab, eps=eps, acc=acc)
    return dx + _dot(dz.astype(wt.dtype), wt, _NT, acc)

  dx_ref[...] = jax.lax.fori_loop(0, pl.cdiv(vocab, bv), step, jnp.zeros(x.shape, acc)).astype(dx_ref.dtype)


def _dw_kernel(x_ref, w_ref, b_ref, y_ref, g_ref, lse_ref, coef_ref, dw_ref, db_ref, *, bt, bv, n_tiles, vocab,
               eps, acc):
  wt, bb = w_ref[...], b_ref[...]
  cols = pl.program_id(0) * bv + _iota(bv)

  def step(i, state):
    dw, db = state
    rows = pl.ds(i * bt, bt)
    x = x_ref[rows, :]
    dz = _dz(x, wt, bb, y_ref[rows], g_ref[rows], lse_ref[rows], coef_ref[rows], cols, vocab=vocab, eps=eps, acc=acc)
    return dw + _dot(x, dz.astype(x.dtype), _TN, acc), db + jnp.sum(dz, axis=0)

  dw, db = jax.lax.fori_loop(0, n_tiles, step, (jnp.zeros(wt.shape, acc), jnp.zeros((bv,), acc)))
  dw_ref[...] = dw.astype(dw_ref.dtype)
  db_ref[...] = db.astype(db_ref.dtype)


def _pad(a, axis, size, value=0):
  widths = [(0, 0)] * a.ndim
  widths[axis] = (0, size - a.shape[axis])
  return jnp.pad(a, widths, constant_values=value) if size != a.shape[axis] else a


def _operands(x, w, b, labels, call):
  """The padded ``x [Np, Dp]``, ``w [Dp, Vp]``, ``b [Vp]`` and ``labels [Np]`` (-1 on padding)."""
  bt, bv = blocks(call)
  n_p, v_p, d_p = -(-call.tokens // bt) * bt, -(-call.vocab // bv) * bv, _pow2(call.d)
  wd = w if call.w_layout == "d_vocab" else w.T
  b = jnp.zeros((call.vocab,), x.dtype) if b is None else b
  return (_pad(_pad(x, 0, n_p), 1, d_p), _pad(_pad(wd, 0, d_p), 1, v_p), _pad(b, 0, v_p),
          _pad(labels.astype(jnp.int32), 0, n_p, -1))


def _valid(labels, call):
  ok = (labels >= 0) & (labels < call.vocab)
  if call.ignore_index is not None:
    ok &= labels != call.ignore_index
  return ok


def _forward(x, w, b, labels, call, interpret):
  acc = jnp.promote_types(x.dtype, jnp.float32)
  bt, bv = blocks(call)
  xp, wp, bp, yp = _operands(x, w, b, labels, call)
  n_p, d_p = xp.shape
  tile = pl.BlockSpec((bt,), lambda i: (i,))
  lse, lab, tot = pl.pallas_call(
      functools.partial(_fwd_kernel, bv=bv, vocab=call.vocab, acc=acc),
      grid=(n_p // bt,),
      in_specs=[pl.BlockSpec((bt, d_p), lambda i: (i, 0)), pl.BlockSpec(wp.shape, lambda i: (0, 0)),
                pl.BlockSpec(bp.shape, lambda i: (0,)), tile],
      out_specs=[tile, tile, tile],
      out_shape=[jax.ShapeDtypeStruct((n_p,), acc)] * 3,
      interpret=interpret, name="lce_forward")(xp, wp, bp, yp)
  lse, lab, tot = lse[:call.tokens], lab[:call.tokens], tot[:call.tokens]
  eps = call.label_smoothing
  per = lse - (1 - eps) * lab - eps * tot / call.vocab + call.z_loss * lse ** 2
  return jnp.where(_valid(labels, call), per, 0.0), lse


def _backward(x, w, b, labels, lse, g, call, interpret):
  acc = jnp.promote_types(x.dtype, jnp.float32)
  bt, bv = blocks(call)
  xp, wp, bp, yp = _operands(x, w, b, labels, call)
  n_p, d_p = xp.shape
  v_p = wp.shape[1]
  g = jnp.where(_valid(labels, call), g.astype(acc), 0.0)
  gp, lp = _pad(g, 0, n_p), _pad(lse, 0, n_p)
  cp = 1 + 2 * call.z_loss * lp
  kw = dict(vocab=call.vocab, eps=call.label_smoothing, acc=acc)
  tile = pl.BlockSpec((bt,), lambda i: (i,))
  whole = lambda a: pl.BlockSpec(a.shape, lambda i: (0,) * a.ndim)
  dx = pl.pallas_call(
      functools.partial(_dx_kernel, bv=bv, **kw),
      grid=(n_p // bt,),
      in_specs=[pl.BlockSpec((bt, d_p), lambda i: (i, 0)), whole(wp), whole(bp), tile, tile, tile, tile],
      out_specs=pl.BlockSpec((bt, d_p), lambda i: (i, 0)),
      out_shape=jax.ShapeDtypeStruct(xp.shape, x.dtype),
      interpret=interpret, name="lce_dx")(xp, wp, bp, yp, gp, lp, cp)
  dw, db = pl.pallas_call(
      functools.partial(_dw_kernel, bt=bt, bv=bv, n_tiles=n_p // bt, **kw),
      grid=(v_p // bv,),
      in_specs=[whole(xp), pl.BlockSpec((d_p, bv), lambda j: (0, j)), pl.BlockSpec((bv,), lambda j: (j,)),
                whole(yp), whole(gp), whole(lp), whole(cp)],
      out_specs=[pl.BlockSpec((d_p, bv), lambda j: (0, j)), pl.BlockSpec((bv,), lambda j: (j,))],
      out_shape=[jax.ShapeDtypeStruct(wp.shape, w.dtype), jax.ShapeDtypeStruct((v_p,), acc)],
      interpret=interpret, name="lce_dw")(xp, wp, bp, yp, gp, lp, cp)
  dx = dx[:call.tokens, :call.d]
  dw = dw[:call.d, :call.vocab]
  dw = dw if call.w_layout == "d_vocab" else dw.T
  return dx, dw, None if b is None else db[:call.vocab].astype(b.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def per_token_loss(x, w, b, labels, call: LinearCrossEntropyCall, interpret: bool):
  """Per-token loss ``[N]`` of ``x [N, d]``, the head ``w`` (``call.w_layout``), ``b [vocab]`` or
  None and ``labels [N]``; 0 for ignored or out-of-range labels (never read out of the head)."""
  return _forward(x, w, b, labels, call, interpret)[0]


def _fwd(x, w, b, labels, call, interpret):
  loss, lse = _forward(x, w, b, labels, call, interpret)
  return loss, (x, w, b, labels, lse)


def _bwd(call, interpret, res, g):
  x, w, b, labels, lse = res
  dx, dw, db = _backward(x, w, b, labels, lse, g, call, interpret)
  return dx, dw, db, np.zeros(labels.shape, jax.dtypes.float0)


per_token_loss.defvjp(_fwd, _bwd)
