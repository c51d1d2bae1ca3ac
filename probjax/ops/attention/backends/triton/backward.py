"""Flash-attention backward kernels (Pallas, Triton backend).

Shared preprocess: ``delta = rowsum(dO * O)`` in float32. Three variants:

* ``"triton_split"``: a dK/dV pallas_call (one program per KV tile and KV head,
  looping over the ``G`` query heads of the group, so dK/dV are summed over the
  group in registers) and a separate dQ pallas_call (one program per query tile
  and query head). Bitwise deterministic.
* ``"triton_fused"``: the same two programs launched as one pallas_call whose
  flattened grid covers both. Bitwise deterministic.
* ``"triton_onepass"``: the dK/dV programs also add each tile's dQ contribution
  into a float32 buffer with atomic adds (FlashAttention-2 style). The order of
  those adds is not fixed, so dQ is not bitwise reproducible across runs.
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from probjax.ops.attention.gpu import output_delta
from probjax.ops.attention.masks import Mask
from probjax.ops.attention.backends.triton import tiles
from probjax.ops.attention.backends.triton import config as config_lib
from probjax.ops.attention.backends.triton.config import BackwardConfig

_T = (((0,), (0,)), ((), ()))   # dot_general: contract the rows (a^T @ b)
_NT = (((1,), (1,)), ((), ()))  # contract the columns (a @ b^T)


def _dot(a, b, dims=(((1,), (0,)), ((), ()))):
  return jax.lax.dot_general(a, b, dims, preferred_element_type=jnp.float32)


def _probs_and_ds(q, k, v, do, lse2, delta, *, tm, mr, b, h, q_start, k_start, masked,
                  scale, score_mod, fast_exp2, transposed=False):
  """``(p, dS, k)``: ``p`` and ``dS`` (w.r.t. the scaled, pre-``score_mod`` score) of one tile,
  ``[block_q, block_k]`` or, ``transposed``, ``[block_k, block_q]``, and the key rows the
  products with ``dS`` read (:func:`tiles.unseen_keys_zeroed`)."""
  bq, bk = q.shape[0], k.shape[0]
  pos = dict(b=b, h=h, q_start=q_start, k_start=k_start, transposed=transposed)
  valid = tiles.tile_valid(tm, mr, b, q_start, k_start, bq, bk, transposed=transposed, h=h) if masked else None
  if masked:
    k, v = tiles.unseen_keys_zeroed(tm, valid, k, v, transposed=transposed)
  t, c, s_nat = tiles.scores(q, k, scale=scale, score_mod=score_mod, **pos)
  if transposed:
    p = tiles.exp2_affine(t, c, lse2[None, :], fast_exp2)
    dp = _dot(v, do, _NT) - delta[None, :]
  else:
    p = tiles.exp2_affine(t, c, lse2[:, None], fast_exp2)
    dp = _dot(do, v, _NT) - delta[:, None]
  if masked:  # after the exponent, so that the scale folds into its fused multiply-add
    p = jnp.where(valid, p, 0.0)
  ds = p * dp
  if score_mod is not None:
    ds = tiles.score_mod_grad(score_mod, s_nat, ds, **pos)
    if masked:  # score_mod's derivative may be non-finite where the mask hides its value
      ds = jnp.where(valid, ds, 0.0)
  return p, ds, k


def _dkv_program(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, mr, dk_ref, dv_ref, dq_acc_ref,
                 *, b, hkv, j, tm, scale, score_mod, groups, block_q, block_k, num_q_tiles,
                 fast_exp2, splits=1, split=0):
  """dK, dV of KV tile ``j`` of KV head ``hkv``, summed over its query heads (with
  ``splits`` > 1: over the ``split``-th of ``splits`` equal parts of them, stored as a
  partial at head ``hkv * splits + split``).

  Works on transposed ``[block_k, block_q]`` tiles (``k @ q^T``) so that ``p^T``
  and ``dS^T`` are the register operands of the dV and dK products; the
  untransposed form would transpose them through shared memory every step.
  With ``dq_acc_ref`` (onepass) each tile's dQ is atomically added there too.
  """
  k_start = j * block_k
  kv_valid, q_valid = mr.valid(b, keys=True), mr.valid(b, keys=False)
  keys = (b, pl.ds(k_start, block_k), hkv)
  k, v = (tiles.load_head(ref, keys, k_start, tm.kv_len, valid=kv_valid) for ref in (k_ref, v_ref))

  def head(g, carry):
    h = hkv * groups + g

    def body(i, carry, masked):
      dk, dv = carry
      q_start = i * block_q
      rows = pl.ds(q_start, block_q)
      # Only masked tiles can hold the partial last tile of the queries, or this batch element's.
      q, do = (tiles.load_head(ref, (b, rows, h), q_start, tm.q_len, masked, q_valid) for ref in (q_ref, do_ref))
      pt, dst, kt = _probs_and_ds(q, k, v, do, lse_ref.at[b, h, rows][...],
                              delta_ref.at[b, h, rows][...], tm=tm, mr=mr, b=b, h=h,
                              q_start=q_start, k_start=k_start, masked=masked, scale=scale,
                              score_mod=score_mod, fast_exp2=fast_exp2, transposed=True)
      dv = dv + _dot(pt.astype(do.dtype), do)
      dst = dst.astype(q.dtype)
      dk = dk + _dot(dst, q)
      if dq_acc_ref is not None:
        plgpu.atomic_add(dq_acc_ref, (b, rows, h, slice(None)), _dot(dst, kt, _T) * scale)
      return dk, dv

    return tiles.tile_loop(tm, mr, b, j, num_q_tiles, body, carry, by_q=False,
                           block_outer=block_k, block_inner=block_q)

  zeros = (jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32))
  per_split = groups // splits
  dk, dv = jax.lax.fori_loop(split * per_split, (split + 1) * per_split, head, zeros)
  out_keys = (b, pl.ds(k_start, block_k), hkv * splits + split)
  tiles.store_head(dk_ref, out_keys, (dk * scale).astype(dk_ref.dtype), k_start, tm.kv_len)
  tiles.store_head(dv_ref, out_keys, dv.astype(dv_ref.dtype), k_start, tm.kv_len)


def _dq_program(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, mr, dq_ref, *, b, h, i, tm, scale,
                score_mod, groups, block_q, block_k, num_kv_tiles, fast_exp2):
  """dQ of query tile ``i`` of query head ``h``."""
  hkv = h // groups
  q_start = i * block_q
  rows = pl.ds(q_start, block_q)
  kv_valid, q_valid = mr.valid(b, keys=True), mr.valid(b, keys=False)
  q, do = (tiles.load_head(ref, (b, rows, h), q_start, tm.q_len, valid=q_valid) for ref in (q_ref, do_ref))
  lse2 = lse_ref.at[b, h, rows][...]
  delta = delta_ref.at[b, h, rows][...]

  def body(j, dq, masked):
    k_start = j * block_k
    k, v = (tiles.load_head(ref, (b, pl.ds(k_start, block_k), hkv), k_start, tm.kv_len, masked, kv_valid)
            for ref in (k_ref, v_ref))
    _, ds, k = _probs_and_ds(q, k, v, do, lse2, delta, tm=tm, mr=mr, b=b, h=h, q_start=q_start,
                          k_start=k_start, masked=masked, scale=scale, score_mod=score_mod,
                          fast_exp2=fast_exp2)
    return dq + _dot(ds.astype(k.dtype), k)

  dq = tiles.tile_loop(tm, mr, b, i, num_kv_tiles, body, jnp.zeros(q.shape, jnp.float32), by_q=True,
                       block_outer=block_q, block_inner=block_k)
  tiles.store_head(dq_ref, (b, rows, h), (dq * scale).astype(dq_ref.dtype), q_start, tm.q_len)


def _split_refs(refs, tms):
  """``refs`` = 6 operands, mask refs per entry of ``tms``, then outputs."""
  ops, rest = refs[:6], refs[6:]
  mrs = []
  for tm in tms:
    n = tiles.MaskRefs.count(tm)
    mrs.append(tiles.MaskRefs.unpack(tm, rest[:n]))
    rest = rest[n:]
  return ops, mrs, rest


def _dkv_kernel(*refs, tm, onepass, grid, group, **kw):
  ops, (mr,), outs = _split_refs(refs, [tm])
  if onepass:
    dq_acc, dk, dv = outs[1:]  # outs[0] is the aliased input of dq_acc
  else:
    (dk, dv), dq_acc = outs, None
  j, b, p = tiles.program_tile(tm, *grid, group, by_q=False)
  splits = kw["splits"]
  _dkv_program(*ops, mr, dk, dv, dq_acc, b=b, hkv=p // splits, split=p % splits, j=j, tm=tm, **kw)


def _dq_kernel(*refs, tm, grid, group, **kw):
  ops, (mr,), (dq,) = _split_refs(refs, [tm])
  i, b, h = tiles.program_tile(tm, *grid, group, by_q=True)
  _dq_program(*ops, mr, dq, b=b, h=h, i=i, tm=tm, **kw)


def _fused_kernel(*refs, tm_dkv, tm_dq, kv_heads, heads, num_kv_tiles, num_q_tiles, dkv_kw, dq_kw):
  ops, (mr_dkv, mr_dq), (dq, dk, dv) = _split_refs(refs, [tm_dkv, tm_dq])
  p, b = pl.program_id(0), pl.program_id(1)
  splits = dkv_kw["splits"]
  n_dkv = num_kv_tiles * kv_heads * splits

  @pl.when(p < n_dkv)
  def _():
    j = tiles.longest_first(tm_dkv, p // (kv_heads * splits), num_kv_tiles, by_q=False)
    r = p % (kv_heads * splits)
    _dkv_program(*ops, mr_dkv, dk, dv, None, b=b, hkv=r // splits, split=r % splits, j=j, tm=tm_dkv,
                 **dkv_kw)

  @pl.when(p >= n_dkv)
  def _():
    p2 = p - n_dkv
    i = tiles.longest_first(tm_dq, p2 // heads, num_q_tiles, by_q=True)
    _dq_program(*ops, mr_dq, dq, b=b, h=p2 % heads, i=i, tm=tm_dq, **dq_kw)


def backward(q, k, v, out, lse, do, mask: Mask | None, *, scale: float,
             score_mod: Callable | None, impl: str, config: BackwardConfig, interpret: bool):
  """Gradients of attention.

  Args:
    q: ``[batch, q_len, heads, head_dim]``; k: ``[batch, kv_len, kv_heads, head_dim]``;
    v: ``[batch, kv_len, kv_heads, v_head_dim]``.
    out, do: ``[batch, q_len, heads, v_head_dim]``; lse: ``[batch, heads, q_len]`` float32.
    impl: ``"triton_onepass"``, ``"triton_fused"`` or ``"triton_split"``.
  Returns:
    ``(dq, dk, dv)`` in the dtypes and shapes of q, k, v.
  """
  batch, q_len, heads, d = q.shape
  kv_len, kv_heads = k.shape[1], k.shape[2]
  c = config
  dp, dvp = tiles.padded_head_dim(d), tiles.padded_head_dim(v.shape[-1])
  q_pad = tiles.round_up(q_len, max(c.block_q_dkv, c.block_q_dq))
  kv_pad = tiles.round_up(kv_len, max(c.block_kv_dkv, c.block_kv_dq))
  # Preprocess (shared): delta = rowsum(dO * O); lse in base 2. Both are small
  # [batch, heads, q_len] rows, padded (+inf, 0) so their loads need no mask. Q, K, V and dO
  # are read in place: masked tiles past the lengths and head_dims (tiles.load_head).
  delta = output_delta(out, do, mask)
  ops = (q, k, v, do.astype(q.dtype),
         tiles.pad_axis(lse * tiles.LOG2E, 2, q_pad, jnp.inf), tiles.pad_axis(delta, 2, q_pad))

  tm_dkv, mops_dkv = tiles.mask_operands(mask, batch, q_len, kv_len, q_pad, kv_pad, c.block_q_dkv,
                                         c.block_kv_dkv, by_q=False)
  tm_dq, mops_dq = tiles.mask_operands(mask, batch, q_len, kv_len, q_pad, kv_pad, c.block_q_dq,
                                       c.block_kv_dq, by_q=True)
  groups = heads // kv_heads
  common = dict(scale=scale, score_mod=score_mod, groups=groups, fast_exp2=c.fast_exp2 and not interpret)
  nk_dkv, nq_dq = kv_pad // c.block_kv_dkv, q_pad // c.block_q_dq
  # Few KV heads (MQA/GQA) at short lengths leave the device idle with one dK/dV program per
  # KV tile and head: split the group over programs and add their float32 partials in XLA.
  device = config_lib.kernel_device(interpret)
  splits = c.splits_for(groups, nk_dkv * batch * kv_heads, device)
  dkv_kw = dict(common, block_q=c.block_q_dkv, block_k=c.block_kv_dkv, num_q_tiles=q_pad // c.block_q_dkv,
                splits=splits)
  dq_kw = dict(common, block_q=c.block_q_dq, block_k=c.block_kv_dq, num_kv_tiles=kv_pad // c.block_kv_dq)
  dq_shape = jax.ShapeDtypeStruct(q.shape, q.dtype)
  dkv_shape = tuple(jax.ShapeDtypeStruct((batch, kv_len, kv_heads * splits, x.shape[-1]),
                                         x.dtype if splits == 1 else jnp.float32)
                    for x in (k, v))
  call = functools.partial(
      pl.pallas_call, interpret=interpret,
      compiler_params=plgpu.CompilerParams(num_warps=c.num_warps, num_stages=c.num_stages))

  # Causal-like grids run heaviest first across groups of heads (tiles.program_tile), sized
  # by the operands each program streams: Q and dO of its heads (dK/dV), K and V (dQ).
  dkv_grid, dq_grid = (nk_dkv, batch, kv_heads * splits), (nq_dq, batch, heads)
  itemsize = q.dtype.itemsize
  dkv_order = dict(grid=dkv_grid, group=config_lib.order_group(
      device, q_pad * (dp + dvp) * itemsize * groups // splits))
  dq_order = dict(grid=dq_grid, group=config_lib.order_group(device, kv_pad * (dp + dvp) * itemsize))
  if impl == "triton_split":
    dk, dv = call(functools.partial(_dkv_kernel, tm=tm_dkv, onepass=False, **dkv_order, **dkv_kw),
                  grid=dkv_grid, out_shape=dkv_shape, name="probjax_attention_bwd_dkv")(*ops, *mops_dkv)
    dq = call(functools.partial(_dq_kernel, tm=tm_dq, **dq_order, **dq_kw), grid=dq_grid,
              out_shape=dq_shape, name="probjax_attention_bwd_dq")(*ops, *mops_dq)
  elif impl == "triton_fused":
    dq, dk, dv = call(
        functools.partial(_fused_kernel, tm_dkv=tm_dkv, tm_dq=tm_dq, kv_heads=kv_heads, heads=heads,
                          num_kv_tiles=nk_dkv, num_q_tiles=nq_dq, dkv_kw=dkv_kw, dq_kw=dq_kw),
        grid=(nk_dkv * kv_heads * splits + nq_dq * heads, batch), out_shape=(dq_shape, *dkv_shape),
        name="probjax_attention_bwd_fused")(*ops, *mops_dkv, *mops_dq)
  elif impl == "triton_onepass":  # dQ accumulates in a float32 buffer padded to whole tiles
    # (and to the tile's head_dim: interpret mode has no masked atomic add)
    dq_acc = jnp.zeros((batch, q_pad, heads, dp), jnp.float32)
    n_in = len(ops) + len(mops_dkv)
    dq, dk, dv = call(functools.partial(_dkv_kernel, tm=tm_dkv, onepass=True, **dkv_order, **dkv_kw),
                      grid=dkv_grid,
                      out_shape=(jax.ShapeDtypeStruct(dq_acc.shape, jnp.float32), *dkv_shape),
                      input_output_aliases={n_in: 0},
                      name="probjax_attention_bwd_onepass")(*ops, *mops_dkv, dq_acc)
    dq = dq[:, :q_len, :, :d].astype(q.dtype)
  else:
    raise ValueError(f"unknown backward_pass_impl {impl!r}")
  if splits > 1:  # fixed order: still bitwise reproducible
    dk, dv = (x.reshape(batch, kv_len, kv_heads, splits, x.shape[-1]).sum(3).astype(y.dtype)
              for x, y in ((dk, k), (dv, v)))
  return dq, dk, dv
