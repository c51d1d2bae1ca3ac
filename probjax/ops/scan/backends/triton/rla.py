"""Causal linear attention kernels on features (the RLA branch after its shift), split into
chunks as flash-linear-attention's chunk kernels split the work: a sequential pass carries the
state from chunk to chunk and writes the state entering each chunk; every chunk's outputs are
then independent, one program each, their matmuls on tensor cores.

Per (batch, query head), with chunks of C rows, ``S_c`` the state entering chunk ``c`` (the
initial state plus ``kᵀ v`` of the earlier chunks) and ``A = tril(q kᵀ)`` inside a chunk:

* forward: ``_states_kernel`` (one program per block of the ``[features, v_head_dim]`` state
  and (batch, key/value head), sequential over chunks) writes every ``S_c`` and the final
  state; ``_output_kernel`` (one program per (chunk, batch, query head)) writes ``o = q S_c +
  A v``.
* backward, exact: ``_reverse_states_kernel`` runs the chunks backwards and writes ``R_c =
  dS_final + Σ_{c' > c} qᵀ do`` (summed over the group's query heads: the gradient of every
  state the chunk's ``kᵀ v`` enters) and ``dS_0``; ``_grads_kernel`` (one program per
  (chunk, batch, key/value head)) writes ``dq = do S_cᵀ + dA k`` per query head, with ``dA =
  tril(do vᵀ)``, and ``dk = v Rᵀ + Σ dAᵀ q``, ``dv = k R + Σ Aᵀ do`` over the group's heads.

The matmuls read their operands in the inputs' dtype (the states ``S_c`` and ``R_c`` rounded to
it, as the output's matmul reads them) and accumulate in float32; the carried states stay
float32. The forward saves the operands and the ``S_c`` for the backward.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from probjax.ops.scan.backends.triton import common

# Rows per chunk, as flash-linear-attention's chunk kernels; wider rows halve it, and so does a
# device whose shared memory the kernels would overflow (:func:`default_chunk`).
CHUNK = 64
MIN_CHUNK = 16
# The state kernels' block of a state's rows and columns. Those kernels run the chunks in
# order, so their programs (blocks x batch x key/value heads) are what fills the device: a
# [32, 32] block gives B4 Hkv8 F128 Dv64 256 programs, about two an H200 SM.
STATE_BLOCK = 32
# Their loop waits on each chunk's loads and does little with them: three pipeline stages keep
# the next two chunks' loads in flight.
STATE_STAGES = 3
# The chunk kernels' warps and stages (the output kernel's, the gradient kernel's).
OUTPUT_WARPS, GRADS_WARPS, CHUNK_STAGES = 4, 8, 2
# Kernel names, as their launches and the compiler's messages give them.
FWD_STATES, FWD, BWD_STATES, BWD = ("probjax_rla_fwd_states", "probjax_rla_fwd", "probjax_rla_bwd_states",
                                    "probjax_rla_bwd")


def smem_bytes(dtype, features: int, v_head_dim: int, chunk: int, stages: int = STATE_STAGES) -> dict[str, int]:
  """Estimated shared-memory bytes per block of each kernel (by name), an upper bound:
  operands of ``dtype`` (the matmuls'), ``features`` (twice head_dim under the softmax map)
  and ``v_head_dim`` wide, in chunks of ``chunk`` rows; ``stages``: the state kernels'.

  The chunk kernels' dots read their operand tiles through shared memory. Counting each tile
  once: the output kernel holds q and k ``[C, F]``, v ``[C, Dv]``, the state ``[F, Dv]`` and the
  scores ``[C, C]``; the gradient kernel k, q ``[C, F]``, v, do ``[C, Dv]``, the states S and R
  ``[F, Dv]`` and the two score tiles. On top, at 64 rows and more (sm_90's warpgroup MMAs,
  whose operands stay in shared memory while they run) two ``[C, max(F, Dv)]`` tiles, else one.
  E.g. float32, F = Dv = 128 (relu, head_dim 128), C 64, gradient kernel: 4 B x (2 x 64 x 128
  + 2 x 64 x 128 + 2 x 128 x 128 + 2 x 64 x 64) = 294,912 B, what the official Triton compiler
  allocates for sm_90 (tests/ops/scan/rla_triton_smem_probe.py); the Triton inside XLA asked
  for 327,680 on an H100, one [64, 128] tile more, and the official compiler itself allocates
  one such tile beyond the sum at F 256 (557,056), hence two: 360,448, over the H100's 232,448,
  so that call runs in chunks of 32 (221,184 estimated, 147,456 compiled). Below 64 rows (mma.sync,
  the same figures on sm_86 as on sm_90 where measured) the compiler allocates at most one such
  tile beyond the sum (bfloat16 F = Dv = 64, C 32: 38,912 against 36,864), mostly well under;
  at 64 sm_86 allocates less than sm_90.

  The chunk kernels' pipeline stages do not enter: their only loop, the gradient kernel's over a
  group's heads, moved its peak by one tile either way between 1 and 2 stages, so fewer stages
  would not fit a kernel that 2 overflow. Nor does the group count: one head's q and do at a
  time (groups of 4 compiled the most). The state kernels stage ``stages`` chunks' ``[C, 32]``
  loads beside their float32 ``[32, 32]`` state block."""
  e = jnp.dtype(dtype).itemsize
  f, dv, c = common.block(features, 16), common.block(v_head_dim, 16), chunk
  sf, sv = min(STATE_BLOCK, f), min(STATE_BLOCK, dv)
  extra = (2 if c >= 64 else 1) * c * max(f, dv) * e
  states = stages * c * (sf + sv) * e + sf * sv * 4
  return {FWD_STATES: states,
          FWD: (2 * c * f + c * dv + f * dv + c * c) * e + extra,
          BWD_STATES: states,
          BWD: 2 * (c * f + c * dv + f * dv + c * c) * e + extra}


def call_smem(call, chunk: int) -> tuple[str, int]:
  """The kernel of ``call`` (an RLA call) needing the most shared memory at ``chunk``, and its
  bytes (:func:`smem_bytes`; a differentiated call runs all four kernels)."""
  need = smem_bytes(call.dtype, call.features, call.v_head_dim, chunk)
  name = max(need, key=need.get)
  return name, need[name]


def default_chunk(call, smem_limit: int | None = None) -> int:
  """The kernels' chunk: the call's, else ``CHUNK`` (half where features or v_head_dim is above
  128), or the power of two (at least 16) covering a shorter call, halved (down to
  ``MIN_CHUNK``) while a kernel's :func:`call_smem` is over ``smem_limit`` (bytes per block;
  None: no limit, as in interpret mode). The chunk splits the same sums, so every chunk is
  exact."""
  if call.chunk_size is not None:
    return call.chunk_size
  wide = max(call.features, call.v_head_dim) > 128
  chunk = min(CHUNK // 2 if wide else CHUNK, common.block(call.length, MIN_CHUNK))
  while smem_limit is not None and chunk > MIN_CHUNK and call_smem(call, chunk)[1] > smem_limit:
    chunk //= 2
  return chunk


class _Sizes:
  """The static sizes of one call and its blocks: ``bf``/``bv`` cover a row of features/values,
  ``sf``/``sv`` are the state kernels' blocks (``nf`` x ``nv`` of them)."""

  def __init__(self, q, v, chunk):
    self.batch, self.length, self.heads, self.f = q.shape
    self.kv_heads, self.dv = v.shape[2:]
    self.groups = self.heads // self.kv_heads
    self.chunk, self.chunks = chunk, pl.cdiv(self.length, chunk)
    self.bf, self.bv = common.block(self.f, 16), common.block(self.dv, 16)
    self.sf, self.sv = min(STATE_BLOCK, self.bf), min(STATE_BLOCK, self.bv)
    self.nf, self.nv = pl.cdiv(self.f, self.sf), pl.cdiv(self.dv, self.sv)

  def rows(self, ref, bi, t0, head, c0, cols):
    """``ref[bi, t0:t0 + chunk, head, c0:c0 + cols]`` (a ``[batch, length, heads, width]``
    array), in its own dtype; rows past the length and columns past the width read 0."""
    return common.load(ref, (bi, pl.ds(t0, self.chunk), head, pl.ds(c0, cols)), (t0, c0),
                       (self.chunk, cols), (self.length, ref.shape[3]), dtype=ref.dtype)

  def put_rows(self, ref, bi, t0, head, value):
    common.store(ref, (bi, pl.ds(t0, self.chunk), head, pl.ds(0, value.shape[1])), (t0, None), value,
                 (self.length, ref.shape[3]))

  def state(self, ref, index, f0, v0, shape, dtype):
    """The ``shape`` block at ``(f0, v0)`` of the state ``ref[index]`` (``[..., f, dv]``)."""
    return common.load(ref, (*index, pl.ds(f0, shape[0]), pl.ds(v0, shape[1])), (f0, v0), shape,
                       (self.f, self.dv), dtype=dtype)

  def put_state(self, ref, index, f0, v0, value):
    common.store(ref, (*index, pl.ds(f0, value.shape[0]), pl.ds(v0, value.shape[1])), (f0, v0), value,
                 (self.f, self.dv))

  def state_block(self):
    """This state-kernel program's ``(f0, v0)``, from grid axis 0."""
    i = pl.program_id(0)
    return (i // self.nv) * self.sf, (i % self.nv) * self.sv

  def params(self, num_warps, grid, num_stages=CHUNK_STAGES):
    return dict(grid=grid, compiler_params=common.params(num_warps, num_stages))


def _states_kernel(k_ref, v_ref, s0_ref, h_ref, final_ref, *, n: _Sizes):
  (f0, v0), bi, hk = n.state_block(), pl.program_id(1), pl.program_id(2)

  def body(c, s):
    t0 = c * n.chunk
    n.put_state(h_ref, (bi, c, hk), f0, v0, s)
    k, v = n.rows(k_ref, bi, t0, hk, f0, n.sf), n.rows(v_ref, bi, t0, hk, v0, n.sv)
    return s + common.dot_tn(k, v)

  s = n.state(s0_ref, (bi, hk), f0, v0, (n.sf, n.sv), jnp.float32)
  n.put_state(final_ref, (bi, hk), f0, v0, jax.lax.fori_loop(0, n.chunks, body, s))


def _output_kernel(q_ref, k_ref, v_ref, h_ref, o_ref, *, n: _Sizes):
  c, bi, hi = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  hk, t0 = hi // n.groups, c * n.chunk
  q, k = n.rows(q_ref, bi, t0, hi, 0, n.bf), n.rows(k_ref, bi, t0, hk, 0, n.bf)
  v, s = n.rows(v_ref, bi, t0, hk, 0, n.bv), n.state(h_ref, (bi, c, hk), 0, 0, (n.bf, n.bv), h_ref.dtype)
  scores = jnp.where(common.tril(n.chunk), common.dot_nt(q, k), 0.0).astype(v.dtype)
  n.put_rows(o_ref, bi, t0, hi, common.dot(q, s) + common.dot(scores, v))


def _reverse_states_kernel(q_ref, do_ref, ds_ref, dh_ref, ds0_ref, *, n: _Sizes):
  (f0, v0), bi, hk = n.state_block(), pl.program_id(1), pl.program_id(2)

  def body(i, r):
    c = n.chunks - 1 - i
    t0 = c * n.chunk
    n.put_state(dh_ref, (bi, c, hk), f0, v0, r)

    def head(j, r):
      hi = hk * n.groups + j
      return r + common.dot_tn(n.rows(q_ref, bi, t0, hi, f0, n.sf), n.rows(do_ref, bi, t0, hi, v0, n.sv))
    return jax.lax.fori_loop(0, n.groups, head, r)

  r = n.state(ds_ref, (bi, hk), f0, v0, (n.sf, n.sv), jnp.float32)
  n.put_state(ds0_ref, (bi, hk), f0, v0, jax.lax.fori_loop(0, n.chunks, body, r))


def _grads_kernel(q_ref, k_ref, v_ref, do_ref, h_ref, dh_ref, dq_ref, dk_ref, dv_ref, *, n: _Sizes):
  c, bi, hk = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  t0 = c * n.chunk
  causal = common.tril(n.chunk)
  k, v = n.rows(k_ref, bi, t0, hk, 0, n.bf), n.rows(v_ref, bi, t0, hk, 0, n.bv)
  s = n.state(h_ref, (bi, c, hk), 0, 0, (n.bf, n.bv), h_ref.dtype)
  r = n.state(dh_ref, (bi, c, hk), 0, 0, (n.bf, n.bv), dh_ref.dtype)

  def head(j, acc):
    dk, dv = acc
    hi = hk * n.groups + j
    q, do = n.rows(q_ref, bi, t0, hi, 0, n.bf), n.rows(do_ref, bi, t0, hi, 0, n.bv)
    a = jnp.where(causal, common.dot_nt(q, k), 0.0).astype(k.dtype)     # [query t, key s]
    da = jnp.where(causal, common.dot_nt(do, v), 0.0).astype(k.dtype)
    n.put_rows(dq_ref, bi, t0, hi, common.dot(da, k) + common.dot_nt(do, s))
    return dk + common.dot_tn(da, q), dv + common.dot_tn(a, do)

  dk, dv = jax.lax.fori_loop(0, n.groups, head, (common.dot_nt(v, r), common.dot(k, r)))
  n.put_rows(dk_ref, bi, t0, hk, dk)
  n.put_rows(dv_ref, bi, t0, hk, dv)


def forward(q, k, v, s0, *, chunk: int, out_dtype, interpret: bool):
  """``(o [b, L, h, dv] in out_dtype, S_final [b, hk, f, dv] float32, S_c [b, nc, hk, f, dv])``,
  the states entering the chunks in the operands' dtype (the backward's residual).

  q ``[b, L, h, f]``, k ``[b, L, hk, f]``, v ``[b, L, hk, dv]``: the features and values in
  the matmuls' dtype; s0 ``[b, hk, f, dv]`` float32."""
  n = _Sizes(q, v, chunk)
  h, final = pl.pallas_call(
      functools.partial(_states_kernel, n=n), **n.params(4, (n.nf * n.nv, n.batch, n.kv_heads), STATE_STAGES),
      out_shape=(jax.ShapeDtypeStruct((n.batch, n.chunks, n.kv_heads, n.f, n.dv), q.dtype),
                 jax.ShapeDtypeStruct(s0.shape, jnp.float32)),
      interpret=interpret, name=FWD_STATES)(k, v, s0)
  o = pl.pallas_call(
      functools.partial(_output_kernel, n=n), **n.params(OUTPUT_WARPS, (n.chunks, n.batch, n.heads)),
      out_shape=jax.ShapeDtypeStruct((n.batch, n.length, n.heads, n.dv), out_dtype),
      interpret=interpret, name=FWD)(q, k, v, h)
  return o, final, h


def backward(q, k, v, h, do, ds, *, chunk: int, dv_dtype, interpret: bool):
  """``(dq [b, L, h, f], dk [b, L, hk, f], dv [b, L, hk, dv], ds0 [b, hk, f, dv])``, float32
  (dv in ``dv_dtype``: the values' own, the features' gradients go on through the feature
  map in float32), for the cotangents ``do [b, L, h, dv]`` and ``ds [b, hk, f, dv]`` of
  :func:`forward` (its operands and its states ``h``)."""
  n = _Sizes(q, v, chunk)
  do, ds = do.astype(q.dtype), ds.astype(jnp.float32)
  dh, ds0 = pl.pallas_call(
      functools.partial(_reverse_states_kernel, n=n),
      **n.params(4, (n.nf * n.nv, n.batch, n.kv_heads), STATE_STAGES),
      out_shape=(jax.ShapeDtypeStruct(h.shape, q.dtype), jax.ShapeDtypeStruct(ds.shape, jnp.float32)),
      interpret=interpret, name=BWD_STATES)(q, do, ds)
  dq, dk, dv = pl.pallas_call(
      functools.partial(_grads_kernel, n=n), **n.params(GRADS_WARPS, (n.chunks, n.batch, n.kv_heads)),
      out_shape=(jax.ShapeDtypeStruct(q.shape, jnp.float32), jax.ShapeDtypeStruct(k.shape, jnp.float32),
                 jax.ShapeDtypeStruct(v.shape, dv_dtype)),
      interpret=interpret, name=BWD)(q, k, v, do, h, dh)
  return dq, dk, dv, ds0
