"""Mamba-2 SSD kernels, chunked: one program per (batch, head, block of head_dim) carries a
``[block, state]`` state in registers from chunk to chunk, the state in the forward, its
cotangent in the backward; inside a chunk of ``T`` rows the work is ``[T, T]`` and ``[T, state]``
matmuls.

Per head, with ``a_t = dt_t A``, ``cum_t = Σ_{s <= t} a_s`` inside the chunk, ``L_ts =
exp(cum_t - cum_s)`` for ``s <= t`` (else 0), ``h_in`` the state entering the chunk and
``to_end_s = exp(cum_T - cum_s) dt_s`` (``cum_T``: the chunk's whole decay):

* forward: ``y = (C Bᵀ ⊙ L ⊙ dt) x + exp(cum) ⊙ C h_inᵀ``, and the state moves on by ``h_out =
  exp(cum_T) h_in + (x ⊙ to_end)ᵀ B``; for a differentiated call it also stores every
  ``h_in``, ``[b, h, n_chunks, p, n]`` float32 (the backward's residual).
* backward, exact: the chunks in reverse, carrying ``dh`` (the cotangent of ``h_out``, from
  ``dh_L``); per chunk, from the saved ``h_in``, with ``W = C Bᵀ ⊙ L ⊙ dt`` and ``G = dy xᵀ``:
  ``dx = Wᵀ dy + to_end ⊙ B dhᵀ``; ``dC = (G ⊙ L ⊙ dt) B + exp(cum) ⊙ dy h_in``; ``dB = (G ⊙ L
  ⊙ dt)ᵀ C + to_end ⊙ x dh``; ``dh_in = exp(cum_T) dh + (exp(cum) ⊙ dy)ᵀ C``, the carry, which
  leaves as ``dh_0``. The decay's gradient: ``dcum_t = Σ_s M_ts - Σ_s M_st + dy_t · y2_t -
  to_end_t u_t`` with ``M = G ⊙ W``, ``y2 = exp(cum) ⊙ C h_inᵀ`` and ``u_t = x_t · dh B_t``,
  plus ``⟨dh, h_out⟩`` at the chunk's end, so ``da_s = Σ_{t >= s} dcum_t``, ``ddt_s = A da_s
  + Σ_t (G ⊙ C Bᵀ ⊙ L)_ts + exp(cum_T - cum_s) u_s`` and ``dA = Σ_t dt_t da_t``.

dB, dC (shared by a group's heads), ddt and dA (sums over head_dim) leave the backward as one
partial per program, which XLA sums in a fixed order (no atomics: deterministic).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from probjax.ops.scan.backends.triton import common

BLOCK_P = 32
NUM_WARPS = 4
# The backward's program holds the state's cotangent, the chunk's entering state, B and C
# (``[T, state]`` each) and about six ``[T, T]`` tiles: twice the forward's registers.
BWD_NUM_WARPS = 8


def _block_p(p: int) -> int:
  return min(BLOCK_P, common.block(p, 16))


def _kernel(x_ref, dt_ref, a_ref, b_ref, c_ref, h0_ref, y_ref, h_ref, *hc_ref, chunk, block_p,
            block_n, groups):
  bi, hi, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  length, _, p = x_ref.shape[1:]
  n = b_ref.shape[3]
  gi = hi // groups
  p0 = j * block_p
  pn = (pl.ds(p0, block_p), pl.ds(0, block_n))
  h = common.load(h0_ref, (bi, hi, *pn), (p0, None), (block_p, block_n), (p, n))
  a_h = a_ref[hi].astype(jnp.float32)
  causal = common.tril(chunk)

  def body(c, h):
    t0 = c * chunk
    if hc_ref:
      common.store(hc_ref[0], (bi, hi, c, *pn), (p0, None), h, (p, n))
    seq = pl.ds(t0, chunk)
    x = common.load(x_ref, (bi, seq, hi, pl.ds(p0, block_p)), (t0, p0), (chunk, block_p), (length, p))
    dt = common.load(dt_ref, (bi, seq, hi), (t0,), (chunk,), (length,))
    st = (bi, seq, gi, pl.ds(0, block_n))
    bm = common.load(b_ref, st, (t0, None), (chunk, block_n), (length, n))
    cm = common.load(c_ref, st, (t0, None), (chunk, block_n), (length, n))
    a = dt * a_h
    cum = jnp.cumsum(a)
    total = jnp.sum(a)  # the chunk's whole decay (padded rows have dt = 0)
    decay = jnp.exp(jnp.where(causal, cum[:, None] - cum[None, :], -jnp.inf))
    w = common.dot_nt(cm, bm) * decay * dt[None, :]
    y = common.dot(w, x) + jnp.exp(cum)[:, None] * common.dot_nt(cm, h)
    common.store(y_ref, (bi, seq, hi, pl.ds(p0, block_p)), (t0, p0), y, (length, p))
    to_end = jnp.exp(total - cum) * dt
    return jnp.exp(total) * h + common.dot_tn(x * to_end[:, None], bm)

  h = jax.lax.fori_loop(0, pl.cdiv(length, chunk), body, h)
  common.store(h_ref, (bi, hi, *pn), (p0, None), h, (p, n))


def _backward_kernel(x_ref, dt_ref, a_ref, b_ref, c_ref, hc_ref, dy_ref, ds_ref, dx_ref, ddt_ref,
                     da_ref, db_ref, dc_ref, dh0_ref, *, chunk, block_p, block_n, groups):
  bi, hi, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  length, _, p = x_ref.shape[1:]
  n = b_ref.shape[3]
  gi = hi // groups
  part = (hi % groups) * pl.cdiv(p, block_p) + j  # this program's partial of its group's dB, dC
  p0 = j * block_p
  pn = (pl.ds(p0, block_p), pl.ds(0, block_n))
  a_h = a_ref[hi].astype(jnp.float32)
  causal = common.tril(chunk)  # [t, s]: s <= t
  num_chunks = pl.cdiv(length, chunk)

  def body(i, carry):
    dh, da_sum = carry
    c = num_chunks - 1 - i
    t0 = c * chunk
    seq = pl.ds(t0, chunk)
    rows = (bi, seq, hi, pl.ds(p0, block_p))
    x = common.load(x_ref, rows, (t0, p0), (chunk, block_p), (length, p))
    dy = common.load(dy_ref, rows, (t0, p0), (chunk, block_p), (length, p))
    dt = common.load(dt_ref, (bi, seq, hi), (t0,), (chunk,), (length,))
    st = (bi, seq, gi, pl.ds(0, block_n))
    bm = common.load(b_ref, st, (t0, None), (chunk, block_n), (length, n))
    cm = common.load(c_ref, st, (t0, None), (chunk, block_n), (length, n))
    h_in = common.load(hc_ref, (bi, hi, c, *pn), (p0, None), (block_p, block_n), (p, n))
    # The forward's chunk again (padded rows: dt = 0, zero x, dy, B, C: they add nothing).
    a = dt * a_h
    cum = jnp.cumsum(a)
    total = jnp.sum(a)
    decay = jnp.exp(jnp.where(causal, cum[:, None] - cum[None, :], -jnp.inf))      # L
    e_cum = jnp.exp(cum)
    to_end = jnp.exp(total - cum) * dt
    scores = common.dot_nt(cm, bm)                                                  # C Bᵀ [t, s]
    g = common.dot_nt(dy, x)                                                        # dy xᵀ [t, s]
    gl = g * decay
    dscores = gl * dt[None, :]                                                      # d(C Bᵀ)
    w = scores * decay * dt[None, :]                                                # W
    bdh = common.dot_nt(bm, dh)                                                     # B dhᵀ [s, p]
    dx = common.dot_tn(w, dy) + to_end[:, None] * bdh
    dc = common.dot(dscores, bm) + e_cum[:, None] * common.dot(dy, h_in)
    db = common.dot_tn(dscores, cm) + to_end[:, None] * common.dot(x, dh)
    q = gl * scores                                                                 # G ⊙ C Bᵀ ⊙ L
    m = g * w
    u = jnp.sum(x * bdh, axis=1)                                                    # x_s · dh B_s
    y2 = e_cum[:, None] * common.dot_nt(cm, h_in)
    dcum = jnp.sum(m, axis=1) - jnp.sum(m, axis=0) + jnp.sum(dy * y2, axis=1) - to_end * u
    at_end = jnp.exp(total) * jnp.sum(dh * h_in) + jnp.sum(to_end * u)             # ⟨dh, h_out⟩
    da = jnp.sum(jnp.where(causal, dcum[:, None], 0.0), axis=0) + at_end            # Σ_{t >= s}
    ddt = a_h * da + jnp.sum(q, axis=0) + jnp.exp(total - cum) * u
    common.store(dx_ref, rows, (t0, p0), dx, (length, p))
    common.store(ddt_ref, (bi, seq, hi, j), (t0,), ddt, (length,))
    part_rows = (bi, seq, gi, part, pl.ds(0, block_n))
    common.store(db_ref, part_rows, (t0, None), db, (length, n))
    common.store(dc_ref, part_rows, (t0, None), dc, (length, n))
    dh = jnp.exp(total) * dh + common.dot_tn(dy * e_cum[:, None], cm)
    return dh, da_sum + dt * da

  dh = common.load(ds_ref, (bi, hi, *pn), (p0, None), (block_p, block_n), (p, n))
  dh, da_sum = jax.lax.fori_loop(0, num_chunks, body, (dh, jnp.zeros((chunk,), jnp.float32)))
  common.store(dh0_ref, (bi, hi, *pn), (p0, None), dh, (p, n))
  common.store(da_ref, (bi, hi, j, pl.ds(0, chunk)), (None,), da_sum, (chunk,))


def forward(x, dt, A, B, C, h0, *, chunk: int, interpret: bool, residuals: bool = False):
  """``(y [b, L, h, p], h_L [b, h, p, n])`` in float32, and with ``residuals`` the state
  entering each chunk, ``[b, h, cdiv(L, chunk), p, n]`` float32 (the backward's residual);
  arguments as :func:`probjax.ops.scan.chunked_math.ssd_chunked`'s."""
  b, length, heads, p = x.shape
  g, n = B.shape[2:]
  block_p = _block_p(p)
  kernel = functools.partial(_kernel, chunk=chunk, block_p=block_p, block_n=common.block(n, 16),
                             groups=heads // g)
  out_shape = [jax.ShapeDtypeStruct((b, length, heads, p), jnp.float32),
               jax.ShapeDtypeStruct((b, heads, p, n), jnp.float32)]
  if residuals:
    out_shape.append(jax.ShapeDtypeStruct((b, heads, pl.cdiv(length, chunk), p, n), jnp.float32))
  return pl.pallas_call(
      kernel, grid=(b, heads, pl.cdiv(p, block_p)), out_shape=tuple(out_shape),
      compiler_params=common.params(NUM_WARPS), interpret=interpret,
      name="probjax_ssd_scan_fwd_res" if residuals else "probjax_ssd_scan_fwd",
  )(x, dt, A, B, C, h0)


def backward(x, dt, A, B, C, hc, dy, ds, *, chunk: int, interpret: bool):
  """``(dx [b, L, h, p], ddt [b, L, h], dA [h], dB [b, L, g, n], dC [b, L, g, n], dh0 [b, h,
  p, n])`` in float32 for the cotangents ``dy [b, L, h, p]`` and ``ds [b, h, p, n]`` of
  :func:`forward`'s outputs, given its chunk states ``hc`` (``residuals=True``) at the same
  ``chunk``."""
  b, length, heads, p = x.shape
  g, n = B.shape[2:]
  block_p = _block_p(p)
  nb = pl.cdiv(p, block_p)
  r = heads // g
  kernel = functools.partial(_backward_kernel, chunk=chunk, block_p=block_p, block_n=common.block(n, 16),
                             groups=r)
  f32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)
  dx, ddt, da, db, dc, dh0 = pl.pallas_call(
      kernel, grid=(b, heads, nb),
      out_shape=(f32(b, length, heads, p), f32(b, length, heads, nb), f32(b, heads, nb, chunk),
                 f32(b, length, g, r * nb, n), f32(b, length, g, r * nb, n), f32(b, heads, p, n)),
      compiler_params=common.params(BWD_NUM_WARPS), interpret=interpret, name="probjax_ssd_scan_bwd",
  )(x, dt, A, B, C, hc, dy.astype(jnp.float32), ds.astype(jnp.float32))
  return dx, ddt.sum(3), da.sum((0, 2, 3)), db.sum(3), dc.sum(3), dh0
