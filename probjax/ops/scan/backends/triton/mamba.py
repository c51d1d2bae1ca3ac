"""Mamba-1 forward kernel: one program per (batch, block of channels) carries the ``[block,
state]`` state in registers through the sequence, one position per loop iteration (the form of
the Mamba-1 CUDA kernel: the decay is per (channel, state), so a chunk has no matmul form)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from probjax.ops.scan.backends.triton import common

BLOCK_D = 32
NUM_WARPS = 2


def _kernel(x_ref, dt_ref, a_ref, b_ref, c_ref, h0_ref, y_ref, h_ref, *, block_d, block_n):
  bi, j = pl.program_id(0), pl.program_id(1)
  length, d = x_ref.shape[1:]
  n = a_ref.shape[1]
  d0 = j * block_d
  dn = (pl.ds(d0, block_d), pl.ds(0, block_n))
  a = common.load(a_ref, dn, (d0, None), (block_d, block_n), (d, n))
  h = common.load(h0_ref, (bi, *dn), (d0, None), (block_d, block_n), (d, n))

  def step(t, h):
    chan = (bi, t, pl.ds(d0, block_d))
    st = (bi, t, pl.ds(0, block_n))
    xt = common.load(x_ref, chan, (d0,), (block_d,), (d,))
    dtt = common.load(dt_ref, chan, (d0,), (block_d,), (d,))
    bt = common.load(b_ref, st, (None,), (block_n,), (n,))
    ct = common.load(c_ref, st, (None,), (block_n,), (n,))
    h = jnp.exp(dtt[:, None] * a) * h + (dtt * xt)[:, None] * bt[None, :]
    common.store(y_ref, chan, (d0,), jnp.sum(h * ct[None, :], axis=1), (d,))
    return h

  h = jax.lax.fori_loop(0, length, step, h)
  common.store(h_ref, (bi, *dn), (d0, None), h, (d, n))


def forward(x, dt, A, B, C, h0, *, interpret: bool):
  """``(y [b, L, d], h_L [b, d, n])`` in float32; arguments as
  :func:`probjax.ops.scan.chunked_math.mamba_chunked`'s."""
  b, length, d = x.shape
  n = A.shape[1]
  block_d = min(BLOCK_D, common.block(d))
  kernel = functools.partial(_kernel, block_d=block_d, block_n=common.block(n))
  return pl.pallas_call(
      kernel, grid=(b, pl.cdiv(d, block_d)),
      out_shape=(jax.ShapeDtypeStruct((b, length, d), jnp.float32),
                 jax.ShapeDtypeStruct((b, d, n), jnp.float32)),
      compiler_params=common.params(NUM_WARPS), interpret=interpret, name="probjax_mamba_scan_fwd",
  )(x, dt, A, B, C, h0)
