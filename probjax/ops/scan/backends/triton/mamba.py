"""Mamba-1 kernels: one program per (batch, block of channels) carries the ``[block, state]``
state in registers through the sequence, one position per loop iteration (the form of the
Mamba-1 CUDA kernel: the decay is per (channel, state), so a chunk has no matmul form).

Forward: ``h_t = exp(dt_t A) h_{t-1} + dt_t x_t B_t``, ``y_t = h_t C_t``; for a differentiated
call it also stores the state entering every chunk of ``chunk`` positions. Backward: the chunks
in reverse; per chunk the program recomputes the chunk's states from its stored start into its
own region of a global scratch output (Pallas Triton has no shared-memory scratch), then steps
back through them carrying ``g_{t+1}`` scaled by its decay: ``g_t = dy_t C_t + exp(dt_{t+1} A)
g_{t+1}``, from which ``dx_t = dt_t g_t B_t``, ``ddt_t = g_t (A exp(dt_t A) h_{t-1} + x_t B_t)``,
``dA = Σ_t g_t dt_t exp(dt_t A) h_{t-1}``, ``dh_0 = exp(dt_0 A) g_0``; dB and dC leave as
partials per channel block that XLA sums in a fixed order (no atomics: deterministic).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from probjax.ops.scan.backends.triton import common

BLOCK_D = 32
NUM_WARPS = 2


class _Rows:
  """Block views of one (batch, channel block) program: channel rows ``[block_d]``, state rows
  ``[block_n]`` and states ``[block_d, block_n]``, masked to ``d`` channels and ``n`` states."""

  def __init__(self, block_d, block_n, d, n):
    self.bd, self.bn, self.d, self.n = block_d, block_n, d, n

  def chan(self, ref, bi, t, d0):
    return common.load(ref, (bi, t, pl.ds(d0, self.bd)), (d0,), (self.bd,), (self.d,))

  def put_chan(self, ref, bi, t, d0, value):
    common.store(ref, (bi, t, pl.ds(d0, self.bd)), (d0,), value, (self.d,))

  def vec(self, ref, index):
    return common.load(ref, (*index, pl.ds(0, self.bn)), (None,), (self.bn,), (self.n,))

  def put_vec(self, ref, index, value):
    common.store(ref, (*index, pl.ds(0, self.bn)), (None,), value, (self.n,))

  def state(self, ref, index, d0):
    return common.load(ref, (*index, pl.ds(d0, self.bd), pl.ds(0, self.bn)), (d0, None),
                       (self.bd, self.bn), (self.d, self.n))

  def put_state(self, ref, index, d0, value):
    common.store(ref, (*index, pl.ds(d0, self.bd), pl.ds(0, self.bn)), (d0, None), value,
                 (self.d, self.n))


def _forward_kernel(x_ref, dt_ref, a_ref, b_ref, c_ref, h0_ref, y_ref, h_ref, *hc_ref, rows, chunk):
  bi, j = pl.program_id(0), pl.program_id(1)
  length = x_ref.shape[1]
  d0 = j * rows.bd
  a = rows.state(a_ref, (), d0)

  def step(t, h):
    xt, dtt = rows.chan(x_ref, bi, t, d0), rows.chan(dt_ref, bi, t, d0)
    bt, ct = rows.vec(b_ref, (bi, t)), rows.vec(c_ref, (bi, t))
    h = jnp.exp(dtt[:, None] * a) * h + (dtt * xt)[:, None] * bt[None, :]
    rows.put_chan(y_ref, bi, t, d0, jnp.sum(h * ct[None, :], axis=1))
    return h

  h = rows.state(h0_ref, (bi,), d0)
  if not hc_ref:
    h = jax.lax.fori_loop(0, length, step, h)
  else:
    def over_chunk(c, h):
      rows.put_state(hc_ref[0], (bi, c), d0, h)
      return jax.lax.fori_loop(c * chunk, jnp.minimum((c + 1) * chunk, length), step, h)

    h = jax.lax.fori_loop(0, pl.cdiv(length, chunk), over_chunk, h)
  rows.put_state(h_ref, (bi,), d0, h)


def _backward_kernel(x_ref, dt_ref, a_ref, b_ref, c_ref, hc_ref, dy_ref, ds_ref, dx_ref, ddt_ref,
                     db_ref, dc_ref, da_ref, dh0_ref, hs_ref, *, rows, chunk, interpret):
  bi, j = pl.program_id(0), pl.program_id(1)
  length = x_ref.shape[1]
  num_chunks = pl.cdiv(length, chunk)
  d0 = j * rows.bd
  a = rows.state(a_ref, (), d0)
  scratch = lambda s: hs_ref.at[bi, j, s]  # h_{t0 + s - 1}, the state before position t0 + s

  def sync():
    # Another thread of the program may own an element of the scratch block: order its
    # writes before the reads (and the reads before the next chunk's writes).
    if not interpret:
      plgpu.debug_barrier()

  def over_chunk(i, carry):
    t0 = (num_chunks - 1 - i) * chunk
    count = jnp.minimum(chunk, length - t0)

    def recompute(s, h):
      plgpu.store(scratch(s), h)
      xt, dtt = rows.chan(x_ref, bi, t0 + s, d0), rows.chan(dt_ref, bi, t0 + s, d0)
      return jnp.exp(dtt[:, None] * a) * h + (dtt * xt)[:, None] * rows.vec(b_ref, (bi, t0 + s))[None, :]

    jax.lax.fori_loop(0, count, recompute, rows.state(hc_ref, (bi, t0 // chunk), d0))
    sync()

    def back(s, carry):
      g_next, da = carry
      t = t0 + count - 1 - s
      h_prev = plgpu.load(scratch(count - 1 - s))
      xt, dtt, dyt = (rows.chan(r, bi, t, d0) for r in (x_ref, dt_ref, dy_ref))
      bt, ct = rows.vec(b_ref, (bi, t)), rows.vec(c_ref, (bi, t))
      decay = jnp.exp(dtt[:, None] * a)
      kept = decay * h_prev                                       # exp(dt_t A) h_{t-1}
      u = dtt * xt
      g = dyt[:, None] * ct[None, :] + g_next
      rows.put_chan(dx_ref, bi, t, d0, dtt * jnp.sum(g * bt[None, :], axis=1))
      rows.put_chan(ddt_ref, bi, t, d0, jnp.sum(g * (a * kept + xt[:, None] * bt[None, :]), axis=1))
      rows.put_vec(db_ref, (bi, t, j), jnp.sum(g * u[:, None], axis=0))
      rows.put_vec(dc_ref, (bi, t, j), jnp.sum(dyt[:, None] * (kept + u[:, None] * bt[None, :]), axis=0))
      return decay * g, da + g * dtt[:, None] * kept

    carry = jax.lax.fori_loop(0, count, back, carry)
    sync()
    return carry

  g, da = jax.lax.fori_loop(0, num_chunks, over_chunk,
                            (rows.state(ds_ref, (bi,), d0), jnp.zeros((rows.bd, rows.bn), jnp.float32)))
  rows.put_state(dh0_ref, (bi,), d0, g)
  rows.put_state(da_ref, (bi,), d0, da)


def _setup(x, A):
  b, length, d = x.shape
  n = A.shape[1]
  rows = _Rows(min(BLOCK_D, common.block(d)), common.block(n), d, n)
  cfg = dict(grid=(b, pl.cdiv(d, rows.bd)), compiler_params=common.params(NUM_WARPS))
  return rows, cfg


def forward(x, dt, A, B, C, h0, *, chunk: int | None = None, interpret: bool):
  """``(y [b, L, d], h_L [b, d, n])`` in float32, and with ``chunk`` the state entering each
  chunk of ``chunk`` positions, ``[b, cdiv(L, chunk), d, n]`` (the backward's residual);
  arguments as :func:`probjax.ops.scan.chunked_math.mamba_chunked`'s."""
  b, length, d = x.shape
  n = A.shape[1]
  rows, cfg = _setup(x, A)
  out_shape = [jax.ShapeDtypeStruct((b, length, d), jnp.float32), jax.ShapeDtypeStruct((b, d, n), jnp.float32)]
  if chunk is not None:
    out_shape.append(jax.ShapeDtypeStruct((b, pl.cdiv(length, chunk), d, n), jnp.float32))
  return pl.pallas_call(
      functools.partial(_forward_kernel, rows=rows, chunk=chunk), **cfg, out_shape=tuple(out_shape),
      interpret=interpret, name="probjax_mamba_scan_fwd" if chunk is None else "probjax_mamba_scan_fwd_res",
  )(x, dt, A, B, C, h0)


def backward(x, dt, A, B, C, hc, dy, ds, *, chunk: int, interpret: bool):
  """``(dx, ddt, dA, dB, dC, dh0)`` in float32 for the cotangents ``dy [b, L, d]`` and ``ds [b,
  d, n]`` of :func:`forward`'s outputs, given its chunk states ``hc``."""
  b, length, d = x.shape
  n = A.shape[1]
  rows, cfg = _setup(x, A)
  nb = cfg["grid"][1]
  f32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)
  dx, ddt, db, dc, da, dh0, _ = pl.pallas_call(
      functools.partial(_backward_kernel, rows=rows, chunk=chunk, interpret=interpret), **cfg,
      out_shape=(f32(b, length, d), f32(b, length, d), f32(b, length, nb, n), f32(b, length, nb, n),
                 f32(b, d, n), f32(b, d, n), f32(b, nb, chunk, rows.bd, rows.bn)),
      interpret=interpret, name="probjax_mamba_scan_bwd",
  )(x, dt, A, B, C, hc, dy.astype(jnp.float32), ds.astype(jnp.float32))
  return dx, ddt, da.sum(0), db.sum(2), dc.sum(2), dh0
