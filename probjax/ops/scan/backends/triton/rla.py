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

# Rows per chunk, as flash-linear-attention's chunk kernels: the gradient kernel holds [C,
# features] and [C, v_head_dim] float32 accumulators and two [C, C] score tiles, 112 KB at C
# 64, features 128 and v_head_dim 64 (the RLA softmax map of head_dim 64) over 8 warps; wider
# rows halve the chunk.
CHUNK = 64
# The state kernels' block of a state's rows and columns. Those kernels run the chunks in
# order, so their programs (blocks x batch x key/value heads) are what fills the device: a
# [32, 32] block gives B4 Hkv8 F128 Dv64 256 programs, about two an H200 SM.
STATE_BLOCK = 32
# Their loop waits on each chunk's loads and does little with them: three pipeline stages keep
# the next two chunks' loads in flight.
STATE_STAGES = 3


def default_chunk(call) -> int:
  """The kernels' chunk: the call's, else ``CHUNK`` (half where features or v_head_dim is above
  128), or the power of two (at least 16) covering a shorter call."""
  if call.chunk_size is not None:
    return call.chunk_size
  wide = max(call.features, call.v_head_dim) > 128
  return min(CHUNK // 2 if wide else CHUNK, common.block(call.length, 16))


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

  def params(self, num_warps, grid, num_stages=2):
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
      interpret=interpret, name="probjax_rla_fwd_states")(k, v, s0)
  o = pl.pallas_call(
      functools.partial(_output_kernel, n=n), **n.params(4, (n.chunks, n.batch, n.heads)),
      out_shape=jax.ShapeDtypeStruct((n.batch, n.length, n.heads, n.dv), out_dtype),
      interpret=interpret, name="probjax_rla_fwd")(q, k, v, h)
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
      interpret=interpret, name="probjax_rla_bwd_states")(q, do, ds)
  dq, dk, dv = pl.pallas_call(
      functools.partial(_grads_kernel, n=n), **n.params(8, (n.chunks, n.batch, n.kv_heads)),
      out_shape=(jax.ShapeDtypeStruct(q.shape, jnp.float32), jax.ShapeDtypeStruct(k.shape, jnp.float32),
                 jax.ShapeDtypeStruct(v.shape, dv_dtype)),
      interpret=interpret, name="probjax_rla_bwd")(q, k, v, do, h, dh)
  return dq, dk, dv, ds0
