"""Mamba-2 SSD kernels, chunked. The forward's program, one per (batch, head, block of
head_dim), carries a ``[block, state]`` state in registers from chunk to chunk; inside a chunk
of ``T`` rows the work is ``[T, T]`` and ``[T, state]`` matmuls.

Per head, with ``a_t = dt_t A``, ``cum_t = Σ_{s <= t} a_s`` inside the chunk, ``L_ts =
exp(cum_t - cum_s)`` for ``s <= t`` (else 0), ``h_in`` the state entering the chunk and
``to_end_s = exp(cum_T - cum_s) dt_s`` (``cum_T``: the chunk's whole decay):

* forward: ``y = (C Bᵀ ⊙ L ⊙ dt) x + exp(cum) ⊙ C h_inᵀ``, and the state moves on by ``h_out =
  exp(cum_T) h_in + (x ⊙ to_end)ᵀ B``; for a differentiated call it also stores every
  ``h_in``, ``[b, h, n_chunks, p, n]`` float32 (the backward's residual).
* backward, exact: with ``dh`` the cotangent of the chunk's ``h_out`` (``dh_L`` for the last),
  ``W = C Bᵀ ⊙ L ⊙ dt`` and ``G = dy xᵀ``: ``dx = Wᵀ dy + to_end ⊙ B dhᵀ``; ``dC = (G ⊙ L ⊙
  dt) B + exp(cum) ⊙ dy h_in``; ``dB = (G ⊙ L ⊙ dt)ᵀ C + to_end ⊙ x dh``; the cotangent of
  ``h_in``, ``dh_in = exp(cum_T) dh + Δ`` with ``Δ = (exp(cum) ⊙ dy)ᵀ C``, is the next chunk
  back's ``dh`` and, from the first chunk, ``dh_0``. The decay's gradient: ``dcum_t = Σ_s M_ts
  - Σ_s M_st + dy_t · y2_t - to_end_t u_t`` with ``M = G ⊙ W``, ``y2 = exp(cum) ⊙ C h_inᵀ`` and
  ``u_t = x_t · dh B_t``, plus ``⟨dh, h_out⟩`` at the chunk's end, so ``da_s = Σ_{t >= s}
  dcum_t``, ``ddt_s = A da_s + Σ_t (G ⊙ C Bᵀ ⊙ L)_ts + exp(cum_T - cum_s) u_s`` and ``dA = Σ_t
  dt_t da_t``.

Only ``dh`` crosses chunks, and its step is affine with a part, ``Δ``, that needs no other
chunk: the backward is three kernels, so that the chain holds one multiply-add per element of
the state per chunk and every chunk's matmuls run side by side, over batch x heads x chunks
programs:

1. ``_local_kernel``, one program per (batch, head, chunk; block of head_dim past 64): the
   chunk's ``Δ`` into a ``[b, h, n_chunks + 1, p, n]`` float32 buffer;
2. ``_pass_kernel``, one program per (batch, head, narrow block of head_dim): the chunks in
   reverse, a ``[block, state]`` float32 carry from ``dh_L``, overwriting each ``Δ`` in place
   with its chunk's ``dh_in`` (and the last slot with ``dh_L``): the slot after a chunk's holds
   its ``dh``, the first holds ``dh_0``;
3. ``_grads_kernel``, one program per (batch, head, chunk; block of head_dim past 64): the
   chunk's gradients from its saved ``h_in`` and its ``dh``, recomputing its forward terms.

dB, dC (shared by a group's heads), ddt and dA (sums over head_dim blocks, and for dA over
chunks) leave the gradients' kernel as one partial per program, which XLA sums in a fixed order
(no atomics: deterministic).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from probjax.ops.scan.backends.triton import common

BLOCK_P = 32
NUM_WARPS = 4
# The backward's chunk programs take head_dim in blocks of this many (Mamba-2's 64 whole: one
# partial of dB, dC per head); the gradients' program holds the chunk's entering state and the
# cotangent of its leaving one (``[block, state]`` each), B and C (``[T, state]``) and about six
# ``[T, T]`` tiles.
BWD_BLOCK_P = 64
BWD_NUM_WARPS = 8
# The state cotangent's pass is elementwise on its carry: narrow blocks, more programs.
PASS_BLOCK_P = 16


def _block_p(p: int) -> int:
  return min(BLOCK_P, common.block(p, 16))


def _bwd_block_p(p: int) -> int:
  return min(BWD_BLOCK_P, common.block(p, 16))


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


def _local_kernel(dt_ref, a_ref, c_ref, dy_ref, out_ref, *, chunk, block_p, block_n, groups):
  """``Δ_c = (exp(cum) ⊙ dy)ᵀ C`` of one chunk and head_dim block into ``out[b, h, c]``."""
  bi, hi, c, j = (pl.program_id(i) for i in range(4))
  length, _, p = dy_ref.shape[1:]
  n = c_ref.shape[3]
  t0, p0 = c * chunk, j * block_p
  seq = pl.ds(t0, chunk)
  rows = (bi, seq, hi, pl.ds(p0, block_p))
  dy = common.load(dy_ref, rows, (t0, p0), (chunk, block_p), (length, p))
  dt = common.load(dt_ref, (bi, seq, hi), (t0,), (chunk,), (length,))
  cm = common.load(c_ref, (bi, seq, hi // groups, pl.ds(0, block_n)), (t0, None), (chunk, block_n),
                   (length, n))
  cum = jnp.cumsum(dt * a_ref[hi].astype(jnp.float32))
  common.store(out_ref, (bi, hi, c, pl.ds(p0, block_p), pl.ds(0, block_n)), (p0, None),
               common.dot_tn(dy * jnp.exp(cum)[:, None], cm), (p, n))


def _pass_kernel(dt_ref, a_ref, ds_ref, local_ref, dh_ref, *, chunk, block_p, block_n):
  """The state cotangent's recurrence over the chunks in reverse, in place (``local`` and ``dh``
  are one buffer): ``local[c] = Δ_c`` is overwritten by the cotangent of the state entering
  chunk ``c``, ``dh[c] = exp(cum_T) dh[c + 1] + Δ_c``, from ``dh[n_chunks] = dh_L``."""
  bi, hi, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  length = dt_ref.shape[1]
  num_chunks, p, n = dh_ref.shape[2] - 1, dh_ref.shape[3], dh_ref.shape[4]
  p0 = j * block_p
  pn = (pl.ds(p0, block_p), pl.ds(0, block_n))
  a_h = a_ref[hi].astype(jnp.float32)
  dh = common.load(ds_ref, (bi, hi, *pn), (p0, None), (block_p, block_n), (p, n))
  last = j * 0 + num_chunks  # a run-time index (interpret mode takes no static one in a store)
  common.store(dh_ref, (bi, hi, last, *pn), (p0, None), dh, (p, n))

  def body(i, dh):
    c = num_chunks - 1 - i
    t0 = c * chunk
    dt = common.load(dt_ref, (bi, pl.ds(t0, chunk), hi), (t0,), (chunk,), (length,))
    at = (bi, hi, c, *pn)
    # Each element is written after its own read (its new value depends on it): in place.
    local = common.load(local_ref, at, (p0, None), (block_p, block_n), (p, n))
    dh = jnp.exp(jnp.sum(dt * a_h)) * dh + local
    common.store(dh_ref, at, (p0, None), dh, (p, n))
    return dh

  jax.lax.fori_loop(0, num_chunks, body, dh)


def _grads_kernel(x_ref, dt_ref, a_ref, b_ref, c_ref, hc_ref, dh_ref, dy_ref, dx_ref, ddt_ref,
                  da_ref, db_ref, dc_ref, *, chunk, block_p, block_n, groups, blocks):
  """One chunk and head_dim block's gradients, from the state entering it (``hc``) and the
  cotangent of the state leaving it (``dh[c + 1]``)."""
  bi, hi, c, j = (pl.program_id(i) for i in range(4))
  length, _, p = x_ref.shape[1:]
  n = b_ref.shape[3]
  gi = hi // groups
  part = (hi % groups) * blocks + j  # this program's partial of its group's dB, dC
  t0, p0 = c * chunk, j * block_p
  pn = (pl.ds(p0, block_p), pl.ds(0, block_n))
  a_h = a_ref[hi].astype(jnp.float32)
  causal = common.tril(chunk)  # [t, s]: s <= t
  seq = pl.ds(t0, chunk)
  rows = (bi, seq, hi, pl.ds(p0, block_p))
  x = common.load(x_ref, rows, (t0, p0), (chunk, block_p), (length, p))
  dy = common.load(dy_ref, rows, (t0, p0), (chunk, block_p), (length, p))
  dt = common.load(dt_ref, (bi, seq, hi), (t0,), (chunk,), (length,))
  st = (bi, seq, gi, pl.ds(0, block_n))
  bm = common.load(b_ref, st, (t0, None), (chunk, block_n), (length, n))
  cm = common.load(c_ref, st, (t0, None), (chunk, block_n), (length, n))
  h_in = common.load(hc_ref, (bi, hi, c, *pn), (p0, None), (block_p, block_n), (p, n))
  dh = common.load(dh_ref, (bi, hi, c + 1, *pn), (p0, None), (block_p, block_n), (p, n))
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
  common.store(da_ref, (bi, hi, c, j, pl.ds(0, chunk)), (None,), dt * da, (chunk,))


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
  num_chunks = pl.cdiv(length, chunk)
  block_n = common.block(n, 16)
  block_p = _bwd_block_p(p)
  nb = pl.cdiv(p, block_p)
  r = heads // g
  f32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)
  dy = dy.astype(jnp.float32)
  chunks = functools.partial(pl.pallas_call, grid=(b, heads, num_chunks, nb), interpret=interpret)
  # [b, h, c] holds Δ_c, then the cotangent of the state entering chunk c; [b, h, n_chunks]: dh_L.
  local = chunks(
      functools.partial(_local_kernel, chunk=chunk, block_p=block_p, block_n=block_n, groups=r),
      out_shape=f32(b, heads, num_chunks + 1, p, n), compiler_params=common.params(NUM_WARPS),
      name="probjax_ssd_scan_bwd_local",
  )(dt, A, C, dy)
  dh = pl.pallas_call(
      functools.partial(_pass_kernel, chunk=chunk, block_p=PASS_BLOCK_P, block_n=block_n),
      grid=(b, heads, pl.cdiv(p, PASS_BLOCK_P)), out_shape=f32(b, heads, num_chunks + 1, p, n),
      input_output_aliases={3: 0}, compiler_params=common.params(NUM_WARPS), interpret=interpret,
      name="probjax_ssd_scan_bwd_pass",
  )(dt, A, ds.astype(jnp.float32), local)
  dx, ddt, da, db, dc = chunks(
      functools.partial(_grads_kernel, chunk=chunk, block_p=block_p, block_n=block_n, groups=r,
                        blocks=nb),
      out_shape=(f32(b, length, heads, p), f32(b, length, heads, nb),
                 f32(b, heads, num_chunks, nb, chunk), f32(b, length, g, r * nb, n),
                 f32(b, length, g, r * nb, n)),
      compiler_params=common.params(BWD_NUM_WARPS), name="probjax_ssd_scan_bwd_grads",
  )(x, dt, A, B, C, hc, dh, dy)
  return dx, ddt.sum(3), da.sum((0, 2, 3, 4)), db.sum(3), dc.sum(3), dh[:, :, 0]
