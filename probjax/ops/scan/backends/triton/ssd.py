"""Mamba-2 SSD forward kernel, chunked: one program per (batch, head, block of head_dim)
carries the ``[block, state]`` state in registers from chunk to chunk; inside a chunk,
``(C Bᵀ ⊙ decay ⊙ dt) x`` and the state's contribution ``exp(cum) C hᵀ`` are matmuls, and the
state moves on by ``exp(Σ a) h + (x ⊙ w)ᵀ B``."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from probjax.ops.scan.backends.triton import common

BLOCK_P = 32
NUM_WARPS = 4


def _kernel(x_ref, dt_ref, a_ref, b_ref, c_ref, h0_ref, y_ref, h_ref, *, chunk, block_p,
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


def forward(x, dt, A, B, C, h0, *, chunk: int, interpret: bool):
  """``(y [b, L, h, p], h_L [b, h, p, n])`` in float32; arguments as
  :func:`probjax.ops.scan.chunked_math.ssd_chunked`'s."""
  b, length, heads, p = x.shape
  g, n = B.shape[2:]
  block_p = min(BLOCK_P, common.block(p, 16))
  kernel = functools.partial(_kernel, chunk=chunk, block_p=block_p, block_n=common.block(n, 16),
                             groups=heads // g)
  return pl.pallas_call(
      kernel, grid=(b, heads, pl.cdiv(p, block_p)),
      out_shape=(jax.ShapeDtypeStruct((b, length, heads, p), jnp.float32),
                 jax.ShapeDtypeStruct((b, heads, p, n), jnp.float32)),
      compiler_params=common.params(NUM_WARPS), interpret=interpret, name="probjax_ssd_scan_fwd",
  )(x, dt, A, B, C, h0)
