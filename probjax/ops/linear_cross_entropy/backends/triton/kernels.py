"""Pallas-Triton kernels of ``linear_cross_entropy``.

Operands are padded to whole tiles once, outside the kernels: tokens to ``block_t`` (padded
rows carry label -1, so they count for nothing), the width to a multiple of ``block_d`` and the
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

Nothing a program holds spans the width ``d``, so its on-chip footprint is bounded whatever
``d`` is (a full-width ``x [block_t, d]`` / ``w [d, block_v]`` tile and ``[block_t, d]``
accumulator at ``d = 768`` asked an H100 for 918,016 bytes of shared memory, four times what a
block has):

- every logits tile ``[block_t, block_v]`` is a float32 sum over ``block_d``-wide chunks of the
  width, ``x[:, chunk] @ w[chunk, tile]`` (:func:`_logits`);
- ``dx`` and ``dw`` are accumulated one ``block_d`` chunk at a time, in float32, in an output
  that only this program writes (``dx [block_t, d]`` rows of its token tile, ``dw [d,
  block_v]`` columns of its vocabulary tile): for each vocabulary (token) tile the program
  computes ``dz`` once, then for each width chunk loads its float32 chunk, adds
  ``dz @ w[chunk, tile]^T`` (``x[:, chunk]^T @ dz``) and stores it back. The partial sums go
  through global memory (L2: the chunks a program rewrites are its own, re-read soon) instead
  of a ``[block_t, d]`` register accumulator, and each tile's logits are recomputed once rather
  than once per width chunk, as a grid axis over width chunks would. The same threads store and
  reload a chunk one whole logits loop apart; that loop's dots pass operands through shared
  memory behind CTA barriers, which also order the global stores before the reloads.
  The float32 ``dx`` and ``dw`` are cast to the inputs' dtype outside the kernels.

Shared memory per program is :func:`smem_bytes` (the worked example is there);
:func:`choose_tiles` drops pipeline stages, then halves ``block_d``, until it fits the
device's per-block limit, and the backend refuses a call whose tiles fit at none.

Logits and sums are float32 (float64 for float64 inputs, interpret mode only).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from probjax.core.device import Device
from probjax.ops.linear_cross_entropy.call import LinearCrossEntropyCall

BLOCK_T = 64
BLOCK_V = 128
BLOCK_D = 64  # 32 for 4-byte inputs: the same bytes per chunk
NUM_STAGES = 3
NUM_WARPS = 4

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


def smem_bytes(block_t: int, block_v: int, block_d: int, itemsize: int, num_stages: int) -> int:
  """An upper estimate of one program's shared memory, the largest of the three kernels'.

  Two loops run one after the other: the logits loop streams ``x [block_t, block_d]`` and
  ``w [block_d, block_v]`` chunks, ``num_stages`` deep (Triton's software pipelining); the
  accumulation loop streams ``w [block_d, block_v]`` (``dx``) or ``x [block_t, block_d]``
  (``dw``) chunks as deep, holds ``dz [block_t, block_v]`` as a dot operand and passes a
  float32 chunk (``[block_t, block_d]`` or ``[block_d, block_v]``) through shared memory for
  a layout change. Triton may reuse the first loop's buffers in the second; the estimate adds
  them, so it does not count on that. Independent of the width ``d``.

  At ``block_t=64, block_v=128, block_d=64``, bf16, 3 stages: logits 3 x (8 + 16) KiB = 72 KiB,
  ``dx`` 3 x 16 + 16 + 16 = 80 KiB (``dw`` 3 x 8 + 16 + 32 = 72 KiB), 152 KiB (155,648 bytes)
  of sm_90's 227 KiB; sm_86's 99 KiB gets ``block_d=32`` and 2 stages, 64 KiB (65,536 bytes).
  """
  s, st = itemsize, num_stages
  logits = st * (block_t * block_d + block_d * block_v) * s
  dz = block_t * block_v * s
  dx = st * block_d * block_v * s + dz + block_t * block_d * 4
  dw = st * block_t * block_d * s + dz + block_d * block_v * 4
  return logits + max(dx, dw)


@dataclasses.dataclass(frozen=True)
class Tiles:
  """The kernels' tiles: ``block_t`` tokens by ``block_v`` vocabulary entries per logits tile,
  the width in ``block_d`` chunks, ``num_stages`` pipeline stages."""

  block_t: int
  block_v: int
  block_d: int
  num_stages: int

  def smem_bytes(self, itemsize: int) -> int:
    return smem_bytes(self.block_t, self.block_v, self.block_d, itemsize, self.num_stages)


def choose_tiles(call: LinearCrossEntropyCall, device: Device) -> Tiles:
  """:func:`blocks`, ``block_d`` = :data:`BLOCK_D` (half for 4-byte inputs, at most the width
  rounded up) and :data:`NUM_STAGES` stages on a GPU (one in interpret mode, which has no
  limit); while :func:`smem_bytes` exceeds ``device``'s shared memory per block, stages drop to
  two, then ``block_d`` halves down to 16, then stages drop to one. ValueError (the reason) if
  even that does not fit: :func:`tiles_refusal` says so before a call is made."""
  itemsize = np.dtype(call.dtype).itemsize
  bt, bv = blocks(call)
  bd = min(BLOCK_D if itemsize <= 2 else BLOCK_D // 2, _pow2(call.d))
  limit = device.smem_per_block
  t = Tiles(bt, bv, bd, NUM_STAGES if limit is not None else 1)
  while limit is not None and t.smem_bytes(itemsize) > limit:
    if t.num_stages > 2:
      t = dataclasses.replace(t, num_stages=t.num_stages - 1)
    elif t.block_d > 16:
      t = dataclasses.replace(t, block_d=t.block_d // 2)
    elif t.num_stages > 1:
      t = dataclasses.replace(t, num_stages=1)
    else:
      raise ValueError(f"tiles of {bt} tokens x {bv} vocabulary entries need {t.smem_bytes(itemsize)} bytes of "
                       f"shared memory even with 16-wide width chunks and no pipelining, more than {device.kind}'s "
                       f"{limit} per block: pass a smaller chunk_tokens or chunk_vocab")
  return t


def tiles_refusal(call: LinearCrossEntropyCall, device: Device) -> str | None:
  """Why the kernels' tiles cannot fit ``device``'s shared memory (:func:`choose_tiles`), or None."""
  try:
    choose_tiles(call, device)
  except ValueError as e:
    return str(e)
  return None


def _dot(a, b, dims, acc):
  return jax.lax.dot_general(a, b.astype(a.dtype), dims, preferred_element_type=acc).astype(acc)


def _iota(n):
  return jax.lax.broadcasted_iota(jnp.int32, (n,), 0)


def _logits(x_ref, w_ref, b_ref, rows, cols, *, bd, nd, acc):
  """The logits ``[rows, cols]``: the bias plus ``x[rows, chunk] @ w[chunk, cols]`` summed over
  the ``nd`` width chunks of ``bd``."""
  def step(k, z):
    chunk = pl.ds(k * bd, bd)
    return z + _dot(x_ref[rows, chunk], w_ref[chunk, cols], _NN, acc)

  z = jax.lax.fori_loop(0, nd, step, jnp.zeros((rows.size, cols.size), acc))
  return z + b_ref[cols].astype(acc)[None, :]


def _fwd_kernel(x_ref, w_ref, b_ref, y_ref, lse_ref, lab_ref, tot_ref, *, bt, bv, bd, nd, vocab, acc):
  y = y_ref[...]
  rows = pl.ds(0, bt)

  def step(j, state):
    m, s, lab, tot = state
    cols = j * bv + _iota(bv)
    z = _logits(x_ref, w_ref, b_ref, rows, pl.ds(j * bv, bv), bd=bd, nd=nd, acc=acc)
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


def _dz(z, y, g, lse, coef, cols, *, vocab, eps, acc):
  """The logits' gradient on one (token tile, vocabulary tile), zero on padded columns."""
  p = jnp.exp(z - lse[:, None])
  hit = (y[:, None] == cols[None, :]).astype(acc)
  dz = g[:, None] * (p * coef[:, None] - (1 - eps) * hit - eps / vocab)
  return jnp.where((cols < vocab)[None, :], dz, 0.0)


def _zero_chunks(ref, nd, shape, chunk_of):
  """Zeroes ``ref`` one width chunk (``chunk_of(k)``) at a time, never a full-width tile."""
  def step(k, carry):
    ref[chunk_of(k)] = jnp.zeros(shape, ref.dtype)
    return carry

  jax.lax.fori_loop(0, nd, step, 0)


def _dx_kernel(x_ref, w_ref, b_ref, y_ref, g_ref, lse_ref, coef_ref, dx_ref, *, bt, bv, bd, nd, vocab, eps, acc):
  y, g, lse, coef = y_ref[...], g_ref[...], lse_ref[...], coef_ref[...]
  rows = pl.ds(0, bt)
  at = lambda k: (slice(None), pl.ds(k * bd, bd))
  _zero_chunks(dx_ref, nd, (bt, bd), at)

  def step(j, carry):
    cols = pl.ds(j * bv, bv)
    z = _logits(x_ref, w_ref, b_ref, rows, cols, bd=bd, nd=nd, acc=acc)
    dz = _dz(z, y, g, lse, coef, j * bv + _iota(bv), vocab=vocab, eps=eps, acc=acc).astype(w_ref.dtype)

    def chunk(k, carry):
      dx_ref[at(k)] = dx_ref[at(k)] + _dot(dz, w_ref[pl.ds(k * bd, bd), cols], _NT, acc)
      return carry

    return jax.lax.fori_loop(0, nd, chunk, carry)

  jax.lax.fori_loop(0, pl.cdiv(vocab, bv), step, 0)


def _dw_kernel(x_ref, w_ref, b_ref, y_ref, g_ref, lse_ref, coef_ref, dw_ref, db_ref, *, bt, bv, bd, nd, n_tiles,
               vocab, eps, acc):
  cols = pl.ds(0, bv)
  vcols = pl.program_id(0) * bv + _iota(bv)
  at = lambda k: (pl.ds(k * bd, bd), slice(None))
  _zero_chunks(dw_ref, nd, (bd, bv), at)

  def step(i, db):
    rows = pl.ds(i * bt, bt)
    z = _logits(x_ref, w_ref, b_ref, rows, cols, bd=bd, nd=nd, acc=acc)
    dz = _dz(z, y_ref[rows], g_ref[rows], lse_ref[rows], coef_ref[rows], vcols, vocab=vocab, eps=eps, acc=acc)
    dzc = dz.astype(x_ref.dtype)

    def chunk(k, carry):
      dw_ref[at(k)] = dw_ref[at(k)] + _dot(x_ref[rows, pl.ds(k * bd, bd)], dzc, _TN, acc)
      return carry

    jax.lax.fori_loop(0, nd, chunk, 0)
    return db + jnp.sum(dz, axis=0)

  db_ref[...] = jax.lax.fori_loop(0, n_tiles, step, jnp.zeros((bv,), acc)).astype(db_ref.dtype)


def _pad(a, axis, size, value=0):
  widths = [(0, 0)] * a.ndim
  widths[axis] = (0, size - a.shape[axis])
  return jnp.pad(a, widths, constant_values=value) if size != a.shape[axis] else a


def _operands(x, w, b, labels, call, t: Tiles):
  """The padded ``x [Np, Dp]``, ``w [Dp, Vp]``, ``b [Vp]`` and ``labels [Np]`` (-1 on padding)."""
  bt, bv, bd = t.block_t, t.block_v, t.block_d
  n_p, v_p, d_p = -(-call.tokens // bt) * bt, -(-call.vocab // bv) * bv, -(-call.d // bd) * bd
  wd = w if call.w_layout == "d_vocab" else w.T
  b = jnp.zeros((call.vocab,), x.dtype) if b is None else b
  return (_pad(_pad(x, 0, n_p), 1, d_p), _pad(_pad(wd, 0, d_p), 1, v_p), _pad(b, 0, v_p),
          _pad(labels.astype(jnp.int32), 0, n_p, -1))


def _valid(labels, call):
  ok = (labels >= 0) & (labels < call.vocab)
  if call.ignore_index is not None:
    ok &= labels != call.ignore_index
  return ok


def _tiles(call):
  return choose_tiles(call, Device.interpreter() if call.interpret else Device.current())


def _params(t: Tiles):
  return plgpu.CompilerParams(num_warps=NUM_WARPS, num_stages=t.num_stages)


def _forward(x, w, b, labels, call, interpret):
  acc = jnp.promote_types(x.dtype, jnp.float32)
  t = _tiles(call)
  bt = t.block_t
  xp, wp, bp, yp = _operands(x, w, b, labels, call, t)
  n_p, d_p = xp.shape
  tile = pl.BlockSpec((bt,), lambda i: (i,))
  lse, lab, tot = pl.pallas_call(
      functools.partial(_fwd_kernel, bt=bt, bv=t.block_v, bd=t.block_d, nd=d_p // t.block_d, vocab=call.vocab,
                        acc=acc),
      grid=(n_p // bt,),
      in_specs=[pl.BlockSpec((bt, d_p), lambda i: (i, 0)), pl.BlockSpec(wp.shape, lambda i: (0, 0)),
                pl.BlockSpec(bp.shape, lambda i: (0,)), tile],
      out_specs=[tile, tile, tile],
      out_shape=[jax.ShapeDtypeStruct((n_p,), acc)] * 3,
      compiler_params=_params(t), interpret=interpret, name="lce_forward")(xp, wp, bp, yp)
  lse, lab, tot = lse[:call.tokens], lab[:call.tokens], tot[:call.tokens]
  eps = call.label_smoothing
  per = lse - (1 - eps) * lab - eps * tot / call.vocab + call.z_loss * lse ** 2
  return jnp.where(_valid(labels, call), per, 0.0), lse


def _backward(x, w, b, labels, lse, g, call, interpret):
  acc = jnp.promote_types(x.dtype, jnp.float32)
  t = _tiles(call)
  bt, bv, bd = t.block_t, t.block_v, t.block_d
  xp, wp, bp, yp = _operands(x, w, b, labels, call, t)
  n_p, d_p = xp.shape
  v_p = wp.shape[1]
  g = jnp.where(_valid(labels, call), g.astype(acc), 0.0)
  gp, lp = _pad(g, 0, n_p), _pad(lse, 0, n_p)
  cp = 1 + 2 * call.z_loss * lp
  kw = dict(bt=bt, bv=bv, bd=bd, nd=d_p // bd, vocab=call.vocab, eps=call.label_smoothing, acc=acc)
  tile = pl.BlockSpec((bt,), lambda i: (i,))
  whole = lambda a: pl.BlockSpec(a.shape, lambda i: (0,) * a.ndim)
  dx = pl.pallas_call(
      functools.partial(_dx_kernel, **kw),
      grid=(n_p // bt,),
      in_specs=[pl.BlockSpec((bt, d_p), lambda i: (i, 0)), whole(wp), whole(bp), tile, tile, tile, tile],
      out_specs=pl.BlockSpec((bt, d_p), lambda i: (i, 0)),
      out_shape=jax.ShapeDtypeStruct(xp.shape, acc),
      compiler_params=_params(t), interpret=interpret, name="lce_dx")(xp, wp, bp, yp, gp, lp, cp)
  dw, db = pl.pallas_call(
      functools.partial(_dw_kernel, n_tiles=n_p // bt, **kw),
      grid=(v_p // bv,),
      in_specs=[whole(xp), pl.BlockSpec((d_p, bv), lambda j: (0, j)), pl.BlockSpec((bv,), lambda j: (j,)),
                whole(yp), whole(gp), whole(lp), whole(cp)],
      out_specs=[pl.BlockSpec((d_p, bv), lambda j: (0, j)), pl.BlockSpec((bv,), lambda j: (j,))],
      out_shape=[jax.ShapeDtypeStruct(wp.shape, acc), jax.ShapeDtypeStruct((v_p,), acc)],
      compiler_params=_params(t), interpret=interpret, name="lce_dw")(xp, wp, bp, yp, gp, lp, cp)
  dx = dx[:call.tokens, :call.d].astype(x.dtype)
  dw = dw[:call.d, :call.vocab].astype(w.dtype)
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
