"""Mamba-1 kernels: one program per (batch, block of channels) carries the ``[block_d, state]``
state in registers through the sequence (the form of the Mamba-1 CUDA kernel: the decay is per
(channel, state), so a chunk has no matmul form).

The sequence runs in groups of positions, unrolled (:class:`Geometry`): a group's rows (``x_t,
dt_t``: ``[block_d]``, ``B_t, C_t``: ``[state]``) are loaded together before its first step, so
the program waits for memory once per group, not once per position, and its state and rows stay
in registers. (Loading the next group's rows during this one's steps would carry them through
the loop, where Triton gives them a layout of their own and converts every row through shared
memory.) Past the sequence's end a row reads as zeros: ``dt = 0`` is the identity step, so the
last group needs no other care than masked stores.

Forward: ``h_t = exp(dt_t A) h_{t-1} + dt_t x_t B_t``, ``y_t = h_t C_t``; for a differentiated
call it also stores the state entering every chunk of ``chunk`` positions (a multiple of the
groups). Backward: the chunks in reverse; per chunk the program recomputes the chunk's states
from its stored start, storing those entering its reverse groups into its own region of a
global scratch output (Pallas Triton has no shared-memory scratch) and computing ``dC_t = Σ_d
dy_t h_t`` on the way; then it takes the groups in reverse: it recomputes the group's states in
registers and steps back through them carrying ``g_{t+1}`` scaled by its decay: ``g_t = dy_t
C_t + exp(dt_{t+1} A) g_{t+1}``, from which ``dx_t = dt_t g_t B_t``, ``ddt_t = g_t (A exp(dt_t
A) h_{t-1} + x_t B_t)``, ``dA = Σ_t g_t dt_t exp(dt_t A) h_{t-1}``, ``dh_0 = exp(dt_0 A) g_0``;
dB and dC leave as partials per channel block that XLA sums in a fixed order (no atomics:
deterministic).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from probjax.ops.scan.backends.triton import common

# exp(dt A) = exp2(dt (A log2 e)): one multiply and the hardware's exp2 per (channel, state).
LOG2E = math.log2(math.e)
# Programs that keep an H200's 132 SMs busy with about 8 one-warp programs each.
TARGET_PROGRAMS = 1024
NUM_WARPS = 1  # a program's warps (:func:`geometry` says why one)


@dataclasses.dataclass(frozen=True)
class Geometry:
  """A program's share: ``block_d`` channels and ``block_n`` (the state, a power of two) in one
  warp, and the positions unrolled per group: ``steps`` in the forward, ``recompute_steps`` in
  the backward's pass recomputing (and storing) the states entering its groups of
  ``bwd_steps``."""

  block_d: int
  block_n: int
  steps: int
  recompute_steps: int
  bwd_steps: int


def geometry(batch: int, channels: int, state: int) -> Geometry:
  """The kernels' blocks for ``batch`` sequences of ``channels`` × ``state``.

  One warp per program: Triton lays the ``[block_d, state]`` state out as its coalesced load
  (4 consecutive states per lane, at state 16 four lanes across the state and eight along the
  channels), so the sum over the state for ``y_t`` (and dx, ddt) stays in a lane and two
  shuffles; more warps would split the state across warps, a shared-memory reduction at every
  position. ``block_d`` is 8 or 16: a ``[block_d]`` row then has fewer elements than the warp's
  lanes, which Triton loads straight into the lanes that use it (at 32 it would coalesce the
  row and convert it through shared memory at every position). The sequence is sequential
  within a program, so the device is filled by ``batch × cdiv(channels, block_d)`` programs
  alone: 16 where that still gives ``TARGET_PROGRAMS``, else 8. E.g. B8 D1536 N16: 16 gives
  768 programs (5.8 one-warp programs per SM of an H200), 8 gives 1536 (11.6, whose loads
  overlap each other's arithmetic better): 8. B32 D1536: 16 (3072 programs).

  Groups: a lane holds ``v = block_d · block_n / 32`` values of each state-shaped array, and a
  group's rows take about ``2 v + 2`` registers a position (B_t and C_t over the lane's states,
  x_t and dt_t): the forward takes 16 positions at ``v <= 4`` (B8 D1536 N16: 128 registers),
  fewer as ``v`` grows, so that the group stays in registers with 12 programs on an SM. The
  backward's recomputation also reduces dC over the channels (half the forward's group); its
  reverse steps keep each position's state and decay too (``2 v`` more a position): 4 at
  ``v <= 4``.
  """
  block_n = common.block(state)
  block_d = 16 if batch * pl.cdiv(channels, 16) >= TARGET_PROGRAMS else 8
  lane_values = max(1, block_d * block_n // 32)
  steps = max(1, min(16, 64 // lane_values))
  bwd_steps = max(1, min(4, 16 // lane_values))
  return Geometry(block_d, block_n, steps, max(bwd_steps, steps // 2), bwd_steps)


class _View:
  """Masked block views of one program (batch ``bi``, channels from ``d0``) over a sequence of
  ``length``: channel rows ``[block_d]``, state rows ``[block_n]``, states ``[block_d,
  block_n]``. A row at ``t >= length`` reads as zeros and is not written; its address is clamped
  into the array."""

  def __init__(self, geo: Geometry, length, d, n, bi, d0):
    self.bd, self.bn = geo.block_d, geo.block_n
    self.length, self.d, self.n, self.bi, self.d0 = length, d, n, bi, d0

  def _at(self, t, bound):
    return jnp.minimum(t, self.length - 1), (t < self.length).astype(jnp.int32) * bound

  def chan(self, ref, t):
    tc, bound = self._at(t, self.d)
    return common.load(ref, (self.bi, tc, pl.ds(self.d0, self.bd)), (self.d0,), (self.bd,), (bound,))

  def put_chan(self, ref, t, value):
    tc, bound = self._at(t, self.d)
    common.store(ref, (self.bi, tc, pl.ds(self.d0, self.bd)), (self.d0,), value, (bound,))

  def vec(self, ref, t):
    tc, bound = self._at(t, self.n)
    return common.load(ref, (self.bi, tc, pl.ds(0, self.bn)), (None,), (self.bn,), (bound,))

  def put_vec(self, ref, t, j, value):
    tc, bound = self._at(t, self.n)
    common.store(ref, (self.bi, tc, j, pl.ds(0, self.bn)), (None,), value, (bound,))

  def state(self, ref, index):
    return common.load(ref, (*index, pl.ds(self.d0, self.bd), pl.ds(0, self.bn)), (self.d0, None),
                       (self.bd, self.bn), (self.d, self.n))

  def put_state(self, ref, index, value):
    common.store(ref, (*index, pl.ds(self.d0, self.bd), pl.ds(0, self.bn)), (self.d0, None), value,
                 (self.d, self.n))


def _step(h, a2, x, dt, b):
  """``(exp(dt A), exp(dt A) h + dt x B)``, ``a2 = A log2 e``."""
  decay = jnp.exp2(dt[:, None] * a2)
  return decay, decay * h + (dt * x)[:, None] * b[None, :]


def _forward_kernel(x_ref, dt_ref, a_ref, b_ref, c_ref, h0_ref, y_ref, h_ref, *hc_ref, geo, chunk):
  bi, j = pl.program_id(0), pl.program_id(1)
  length = x_ref.shape[1]
  v = _View(geo, length, x_ref.shape[2], a_ref.shape[1], bi, j * geo.block_d)
  a2 = v.state(a_ref, ()) * LOG2E
  steps = geo.steps
  groups = pl.cdiv(length, steps)

  def rows(k):
    t0 = k * steps
    return tuple((v.chan(x_ref, t0 + s), v.chan(dt_ref, t0 + s), v.vec(b_ref, t0 + s), v.vec(c_ref, t0 + s))
                 for s in range(steps))

  def group(k, h):
    for s, (x, dt, b, c) in enumerate(rows(k)):
      _, h = _step(h, a2, x, dt, b)
      v.put_chan(y_ref, k * steps + s, jnp.sum(h * c[None, :], axis=1))
    return h

  h = v.state(h0_ref, (bi,))
  if not hc_ref:
    h = jax.lax.fori_loop(0, groups, group, h)
  else:
    per = chunk // steps

    def over_chunk(c, h):
      v.put_state(hc_ref[0], (bi, c), h)
      return jax.lax.fori_loop(c * per, jnp.minimum((c + 1) * per, groups), group, h)

    h = jax.lax.fori_loop(0, pl.cdiv(length, chunk), over_chunk, h)
  v.put_state(h_ref, (bi,), h)


def _backward_kernel(x_ref, dt_ref, a_ref, b_ref, c_ref, hc_ref, dy_ref, ds_ref, dx_ref, ddt_ref,
                     db_ref, dc_ref, da_ref, dh0_ref, hs_ref, *, geo, chunk, interpret):
  bi, j = pl.program_id(0), pl.program_id(1)
  length = x_ref.shape[1]
  v = _View(geo, length, x_ref.shape[2], a_ref.shape[1], bi, j * geo.block_d)
  a = v.state(a_ref, ())
  a2 = a * LOG2E
  steps, wide = geo.bwd_steps, geo.recompute_steps
  num_chunks = pl.cdiv(length, chunk)
  scratch = lambda k: hs_ref.at[bi, j, k]  # the state entering group k of the chunk

  def sync():
    # Another lane of the program may own an element of the scratch block: order its writes
    # before the reads (and the reads before the next chunk's writes).
    if not interpret:
      plgpu.debug_barrier()

  def over_chunk(i, carry):
    t0 = (num_chunks - 1 - i) * chunk
    groups = jnp.minimum(chunk // steps, pl.cdiv(length - t0, steps))

    def entering(k, h):
      # Wider groups than the reverse steps' (fewer waits on memory), storing every ``steps``
      # positions, and dC, which needs the states but not their gradients (the reverse steps
      # then find this group's dy in the cache).
      ts = t0 + k * wide
      ins = [(v.chan(x_ref, ts + s), v.chan(dt_ref, ts + s), v.vec(b_ref, ts + s), v.chan(dy_ref, ts + s))
             for s in range(wide)]
      for s, (x, dt, b, dy) in enumerate(ins):
        if s % steps == 0:
          plgpu.store(scratch(k * (wide // steps) + s // steps), h)
        _, h = _step(h, a2, x, dt, b)
        v.put_vec(dc_ref, ts + s, j, jnp.sum(dy[:, None] * h, axis=0))
      return h

    jax.lax.fori_loop(0, pl.cdiv(groups * steps, wide), entering, v.state(hc_ref, (bi, t0 // chunk)))
    sync()

    def back(kk, carry):
      g_next, da = carry
      k = groups - 1 - kk
      ts = t0 + k * steps
      ins = [(v.chan(x_ref, ts + s), v.chan(dt_ref, ts + s), v.vec(b_ref, ts + s), v.vec(c_ref, ts + s),
              v.chan(dy_ref, ts + s)) for s in range(steps)]
      h = plgpu.load(scratch(k))
      before, decays = [], []
      for x, dt, b, _, _ in ins:
        before.append(h)
        decay, h = _step(h, a2, x, dt, b)
        decays.append(decay)
      for s in reversed(range(steps)):
        x, dt, b, c, dy = ins[s]
        t = ts + s
        g = dy[:, None] * c[None, :] + g_next
        gb = jnp.sum(g * b[None, :], axis=1)                          # Σ_n g_t B_t
        gk = g * (decays[s] * before[s])                              # g_t exp(dt_t A) h_{t-1}
        v.put_chan(dx_ref, t, dt * gb)
        v.put_chan(ddt_ref, t, jnp.sum(gk * a, axis=1) + x * gb)
        v.put_vec(db_ref, t, j, jnp.sum(g * (dt * x)[:, None], axis=0))
        da = da + gk * dt[:, None]
        g_next = decays[s] * g
      return g_next, da

    carry = jax.lax.fori_loop(0, groups, back, carry)
    sync()
    return carry

  g, da = jax.lax.fori_loop(0, num_chunks, over_chunk,
                            (v.state(ds_ref, (bi,)), jnp.zeros((geo.block_d, geo.block_n), jnp.float32)))
  v.put_state(dh0_ref, (bi,), g)
  v.put_state(da_ref, (bi,), da)


def _grid(geo: Geometry, b: int, d: int):
  return dict(grid=(b, pl.cdiv(d, geo.block_d)), compiler_params=common.params(NUM_WARPS, num_stages=1))


def forward(x, dt, A, B, C, h0, *, chunk: int | None = None, interpret: bool):
  """``(y [b, L, d], h_L [b, d, n])`` in float32, and with ``chunk`` (a multiple of the
  geometry's ``steps``) the state entering each chunk of ``chunk`` positions, ``[b, cdiv(L,
  chunk), d, n]`` (the backward's residual); arguments as
  :func:`probjax.ops.scan.chunked_math.mamba_chunked`'s."""
  b, length, d = x.shape
  n = A.shape[1]
  geo = geometry(b, d, n)
  out_shape = [jax.ShapeDtypeStruct((b, length, d), jnp.float32), jax.ShapeDtypeStruct((b, d, n), jnp.float32)]
  if chunk is not None:
    out_shape.append(jax.ShapeDtypeStruct((b, pl.cdiv(length, chunk), d, n), jnp.float32))
  return pl.pallas_call(
      functools.partial(_forward_kernel, geo=geo, chunk=chunk), **_grid(geo, b, d), out_shape=tuple(out_shape),
      interpret=interpret, name="probjax_mamba_scan_fwd" if chunk is None else "probjax_mamba_scan_fwd_res",
  )(x, dt, A, B, C, h0)


def backward(x, dt, A, B, C, hc, dy, ds, *, chunk: int, interpret: bool):
  """``(dx, ddt, dA, dB, dC, dh0)`` in float32 for the cotangents ``dy [b, L, d]`` and ``ds [b,
  d, n]`` of :func:`forward`'s outputs, given its chunk states ``hc``."""
  b, length, d = x.shape
  n = A.shape[1]
  geo = geometry(b, d, n)
  nb = pl.cdiv(d, geo.block_d)
  f32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)
  dx, ddt, db, dc, da, dh0, _ = pl.pallas_call(
      functools.partial(_backward_kernel, geo=geo, chunk=chunk, interpret=interpret), **_grid(geo, b, d),
      out_shape=(f32(b, length, d), f32(b, length, d), f32(b, length, nb, n), f32(b, length, nb, n),
                 f32(b, d, n), f32(b, d, n), f32(b, nb, chunk // geo.bwd_steps, geo.block_d, geo.block_n)),
      interpret=interpret, name="probjax_mamba_scan_bwd",
  )(x, dt, A, B, C, hc, dy.astype(jnp.float32), ds.astype(jnp.float32))
  return dx, ddt, da.sum(0), db.sum(2), dc.sum(2), dh0
