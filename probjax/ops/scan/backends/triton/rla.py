"""Causal linear attention kernels on features (the RLA branch after its shift): one program
per (batch, query head) carries its key/value head's ``[features, v_head_dim]`` state in
registers from chunk to chunk; inside a chunk the masked ``q kᵀ`` times v are matmuls.

Forward: ``o = q S_in + tril(q kᵀ) v``, then ``S += kᵀ v``. Backward, exact: dq
runs forward like the forward (``dq = do S_inᵀ + tril(do vᵀ) k``); dk and dv run backward
with the reverse state ``R = dS_final + Σ_{later} qᵀ do`` (``dv = k R + triu(k qᵀ) do``,
``dk = v Rᵀ + triu(v doᵀ) q``), per query head; XLA adds a group's partials in a fixed order.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from probjax.ops.scan.backends.triton import common


def num_warps(f: int, dv: int) -> int:
  """Enough warps that the ``[features, v_head_dim]`` state fits their registers."""
  return 8 if common.block(f) * common.block(dv) > 4096 else 4


class _Blocks:
  """Block views of one (batch, head) program: sequence chunks of ``chunk`` rows."""

  def __init__(self, chunk, block_f, block_v, length, f, dv):
    self.chunk, self.bf, self.bv, self.length, self.f, self.dv = chunk, block_f, block_v, length, f, dv

  def feat(self, ref, bi, head, t0):
    return common.load(ref, (bi, pl.ds(t0, self.chunk), head, pl.ds(0, self.bf)), (t0, None),
                       (self.chunk, self.bf), (self.length, self.f))

  def val(self, ref, bi, head, t0):
    return common.load(ref, (bi, pl.ds(t0, self.chunk), head, pl.ds(0, self.bv)), (t0, None),
                       (self.chunk, self.bv), (self.length, self.dv))

  def put_feat(self, ref, bi, head, t0, value):
    common.store(ref, (bi, pl.ds(t0, self.chunk), head, pl.ds(0, self.bf)), (t0, None), value,
                 (self.length, self.f))

  def put_val(self, ref, bi, head, t0, value):
    common.store(ref, (bi, pl.ds(t0, self.chunk), head, pl.ds(0, self.bv)), (t0, None), value,
                 (self.length, self.dv))

  def state(self, ref, bi, head):
    return common.load(ref, (bi, head, pl.ds(0, self.bf), pl.ds(0, self.bv)), (None, None),
                       (self.bf, self.bv), (self.f, self.dv))

  def put_state(self, ref, bi, head, value):
    common.store(ref, (bi, head, pl.ds(0, self.bf), pl.ds(0, self.bv)), (None, None), value,
                 (self.f, self.dv))


def _over_chunks(k_ref, v_ref, s0_ref, bi, hk, blocks: _Blocks, emit):
  """Walks the chunks in order, calling ``emit(t0, k, v, s)`` with the chunk's keys and values
  and ``s``, the state before it (the initial state plus ``k^T v`` of the earlier chunks);
  returns the final state."""
  def body(c, s):
    t0 = c * blocks.chunk
    k, v = blocks.feat(k_ref, bi, hk, t0), blocks.val(v_ref, bi, hk, t0)
    emit(t0, k, v, s)
    return s + common.dot_tn(k, v)

  return jax.lax.fori_loop(0, pl.cdiv(blocks.length, blocks.chunk), body, blocks.state(s0_ref, bi, hk))


def _forward_kernel(q_ref, k_ref, v_ref, s0_ref, o_ref, s_ref, *, blocks: _Blocks, groups):
  bi, hi = pl.program_id(0), pl.program_id(1)
  causal = common.tril(blocks.chunk)

  def emit(t0, k, v, s):
    q = blocks.feat(q_ref, bi, hi, t0)
    scores = jnp.where(causal, common.dot_nt(q, k), 0.0)
    blocks.put_val(o_ref, bi, hi, t0, common.dot(scores, v) + common.dot(q, s))

  blocks.put_state(s_ref, bi, hi, _over_chunks(k_ref, v_ref, s0_ref, bi, hi // groups, blocks, emit))


def _dq_kernel(k_ref, v_ref, s0_ref, do_ref, dq_ref, *, blocks: _Blocks, groups):
  bi, hi = pl.program_id(0), pl.program_id(1)
  causal = common.tril(blocks.chunk)

  def emit(t0, k, v, s):
    do = blocks.val(do_ref, bi, hi, t0)
    dov = jnp.where(causal, common.dot_nt(do, v), 0.0)
    blocks.put_feat(dq_ref, bi, hi, t0, common.dot_nt(do, s) + common.dot(dov, k))

  _over_chunks(k_ref, v_ref, s0_ref, bi, hi // groups, blocks, emit)


def _dkv_kernel(q_ref, k_ref, v_ref, do_ref, ds_ref, dk_ref, dv_ref, r_ref, *, blocks: _Blocks,
                groups):
  bi, hi = pl.program_id(0), pl.program_id(1)
  hk = hi // groups
  later = common.tril(blocks.chunk, transposed=True)  # [key s, query t]: t >= s
  num_chunks = pl.cdiv(blocks.length, blocks.chunk)

  def body(i, r):
    t0 = (num_chunks - 1 - i) * blocks.chunk
    q, k = blocks.feat(q_ref, bi, hi, t0), blocks.feat(k_ref, bi, hk, t0)
    v, do = blocks.val(v_ref, bi, hk, t0), blocks.val(do_ref, bi, hi, t0)
    kq = jnp.where(later, common.dot_nt(k, q), 0.0)
    vdo = jnp.where(later, common.dot_nt(v, do), 0.0)
    blocks.put_val(dv_ref, bi, hi, t0, common.dot(k, r) + common.dot(kq, do))
    blocks.put_feat(dk_ref, bi, hi, t0, common.dot_nt(v, r) + common.dot(vdo, q))
    return r + common.dot_tn(q, do)

  # The final state's cotangent enters once per group: through its first query head.
  r = jnp.where(hi % groups == 0, blocks.state(ds_ref, bi, hk), 0.0)
  blocks.put_state(r_ref, bi, hi, jax.lax.fori_loop(0, num_chunks, body, r))


def _setup(fq, v, chunk):
  b, length, h, f = fq.shape
  hk, dv = v.shape[2:]
  blocks = _Blocks(chunk, common.block(f, 16), common.block(dv, 16), length, f, dv)
  cfg = dict(grid=(b, h), compiler_params=common.params(num_warps(f, dv)))
  return blocks, h // hk, cfg


def forward(fq, fk, v, s0, *, chunk: int, interpret: bool):
  """``(o [b, L, h, dv], S_final [b, hk, f, dv])`` in float32; arguments as
  :func:`probjax.ops.scan.chunked_math.linear_attention_chunked`'s."""
  b, length, h, f = fq.shape
  dv = v.shape[3]
  blocks, groups, cfg = _setup(fq, v, chunk)
  o, s = pl.pallas_call(
      functools.partial(_forward_kernel, blocks=blocks, groups=groups), **cfg,
      out_shape=(jax.ShapeDtypeStruct((b, length, h, dv), jnp.float32),
                 jax.ShapeDtypeStruct((b, h, f, dv), jnp.float32)),
      interpret=interpret, name="probjax_rla_fwd")(fq, fk, v, s0)
  return o, s[:, ::groups]


def backward(fq, fk, v, s0, do, ds, *, chunk: int, interpret: bool):
  """``(dfq, dfk, dv, ds0)`` for the cotangents ``do [b, L, h, dv]`` and ``ds [b, hk, f, dv]``
  of :func:`forward`."""
  b, length, h, f = fq.shape
  hk, dv = v.shape[2:]
  blocks, groups, cfg = _setup(fq, v, chunk)
  do, ds = do.astype(jnp.float32), ds.astype(jnp.float32)
  dq = pl.pallas_call(
      functools.partial(_dq_kernel, blocks=blocks, groups=groups), **cfg,
      out_shape=jax.ShapeDtypeStruct((b, length, h, f), jnp.float32),
      interpret=interpret, name="probjax_rla_bwd_dq")(fk, v, s0, do)
  dk, dvv, r = pl.pallas_call(
      functools.partial(_dkv_kernel, blocks=blocks, groups=groups), **cfg,
      out_shape=(jax.ShapeDtypeStruct((b, length, h, f), jnp.float32),
                 jax.ShapeDtypeStruct((b, length, h, dv), jnp.float32),
                 jax.ShapeDtypeStruct((b, h, f, dv), jnp.float32)),
      interpret=interpret, name="probjax_rla_bwd_dkv")(fq, fk, v, do, ds)
  by_group = lambda t: t.reshape(*t.shape[:2], hk, groups, t.shape[-1]).sum(3)
  return dq, by_group(dk), by_group(dvv), r.reshape(b, hk, groups, f, dv).sum(2)
