"""Flash-attention forward kernel (Pallas, Triton backend).

One program per (query tile, batch, query head); online softmax in float32 in
base 2 (``log2(e)`` folded into the scale). Saves the output and the natural
log-sum-exp; rows without a valid key give output 0 and lse ``+inf``.
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from probjax.ops.attention.masks import Mask
from probjax.ops.attention.backends.triton import config as config_lib
from probjax.ops.attention.backends.triton import tiles
from probjax.ops.attention.backends.triton.config import ForwardConfig


def _forward_kernel(q_ref, k_ref, v_ref, *refs, tm: tiles.TileMask, scale: float,
                    score_mod: Callable | None, groups: int, block_q: int, block_k: int,
                    num_kv_tiles: int, fast_exp2: bool, grid: tuple, group: int):
  mr = tiles.MaskRefs.unpack(tm, refs[:-2])
  o_ref, lse_ref = refs[-2:]
  i, b, h = tiles.program_tile(tm, *grid, group, by_q=True)
  hkv = h // groups
  q_start = i * block_q
  q_rows = (b, pl.ds(q_start, block_q), h)
  q = tiles.load_head(q_ref, q_rows, q_start, tm.q_len)

  kv_valid = mr.valid(b, keys=True)

  def body(j, carry, masked):
    # Only masked tiles can hold the partial last tile of the keys, or this batch element's.
    k_start = j * block_k
    load = lambda ref: tiles.load_head(ref, (b, pl.ds(k_start, block_k), hkv), k_start, tm.kv_len, masked, kv_valid)
    k, v = load(k_ref), load(v_ref)
    if masked:
      ok = tiles.tile_valid(tm, mr, b, q_start, k_start, block_q, block_k, h=h)
      k, v = tiles.unseen_keys_zeroed(tm, ok, k, v)
    t, c, _ = tiles.scores(q, k, scale=scale, score_mod=score_mod, b=b, h=h,
                           q_start=q_start, k_start=k_start)
    if masked:
      t = jnp.where(ok, t, -jnp.inf)
    return tiles.online_softmax_step(carry, t, c, v, fast_exp2)

  init = tiles.online_softmax_init(block_q, tiles.padded_head_dim(v_ref.shape[-1]))
  carry = tiles.tile_loop(tm, mr, b, i, num_kv_tiles, body, init, by_q=True, block_outer=block_q,
                          block_inner=block_k)
  out, lse2, empty = tiles.online_softmax_finish(carry)
  lse = jnp.where(empty, jnp.inf, lse2 * (1.0 / tiles.LOG2E))
  tiles.store_head(o_ref, q_rows, out.astype(o_ref.dtype), q_start, tm.q_len)
  lse_ref.at[b, h, pl.ds(q_start, block_q)][...] = lse


def forward(q, k, v, mask: Mask | None, *, scale: float, score_mod: Callable | None,
            config: ForwardConfig, interpret: bool):
  """Attention forward.

  Args:
    q, k: ``[batch, q_len | kv_len, heads | kv_heads, head_dim]``; v: ``[batch, kv_len, kv_heads, v_head_dim]``.
    config: launch config (already fitted to the device).
  Returns:
    ``(out [batch, q_len, heads, v_head_dim], lse [batch, heads, q_len] float32)``.
  """
  batch, q_len, heads, d = q.shape
  kv_len, kv_heads = k.shape[1], k.shape[2]
  bq, bk = config.block_q, config.block_k
  dv = v.shape[-1]
  dp, dvp = tiles.padded_head_dim(d), tiles.padded_head_dim(dv)
  q_pad, kv_pad = tiles.round_up(q_len, bq), tiles.round_up(kv_len, bk)
  tm, mask_ops = tiles.mask_operands(mask, batch, q_len, kv_len, q_pad, kv_pad, bq, bk, by_q=True)
  grid = (q_pad // bq, batch, heads)
  device = config_lib.kernel_device(interpret)
  group = config_lib.order_group(device, kv_pad * (dp + dvp) * k.dtype.itemsize)  # tiles.program_tile
  kernel = functools.partial(
      _forward_kernel, tm=tm, scale=scale, score_mod=score_mod, groups=heads // kv_heads,
      block_q=bq, block_k=bk, num_kv_tiles=kv_pad // bk,
      fast_exp2=config.fast_exp2 and not interpret, grid=grid, group=group)
  out, lse = pl.pallas_call(
      kernel,
      grid=grid,
      out_shape=(jax.ShapeDtypeStruct((batch, q_len, heads, dv), q.dtype),
                 jax.ShapeDtypeStruct((batch, heads, q_pad), jnp.float32)),
      compiler_params=plgpu.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages),
      interpret=interpret,
      name="probjax_attention_fwd",
  )(q, k, v, *mask_ops)  # in place: masked tiles past the lengths and head_dims (tiles.load_head)
  return out, lse[:, :, :q_len]

