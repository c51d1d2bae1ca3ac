"""Fused flash-attention forward + JVP kernel (Pallas, Triton backend).

One program per (query tile, batch, query head), the forward's grid and tile loops
(:mod:`.forward`, :mod:`.tiles`). With ``s = scale * q k^T`` (masked), ``p = softmax(s)`` and
the score tangent ``sd = scale * (qd k^T + q kd^T)``, one online pass keeps, rescaled like the
forward's accumulator::

  l = sum e^{s-m},  acc_o = sum e^{s-m} v,  acc_1 = sum e^{s-m} (vd + sd v),  acc_ds = sum e^{s-m} sd

and ends with ``o = acc_o / l``, ``lse_dot = acc_ds / l`` and ``od = acc_1 / l - lse_dot * o``
(``od = p vd + (p * (sd - rowsum(p * sd))) v``). Rows without a valid key give ``o = od = 0``,
``lse = +inf``, ``lse_dot = 0``. No ``score_mod`` (:func:`supports`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from probjax.ops.attention import autodiff, vjp
from probjax.ops.attention.masks import Mask
from probjax.ops.attention.backends.triton import config as config_lib
from probjax.ops.attention.backends.triton import tiles
from probjax.ops.attention.backends.triton.config import ForwardConfig

__all__ = ["supports", "forward_jvp", "tangent"]


def supports(score_mod: Callable | None) -> str | None:
  """None if :func:`forward_jvp` computes the tangent of a call the Triton forward computes, else
  the reason (the tangent then comes from the jvp of the exact XLA formulation)."""
  if score_mod is not None:
    return "score_mod: the fused jvp kernel has no score_mod tangent"
  return None


def _jvp_kernel(q_ref, k_ref, v_ref, qd_ref, kd_ref, vd_ref, *refs, tm: tiles.TileMask, scale: float,
                groups: int, block_q: int, block_k: int, num_kv_tiles: int, fast_exp2: bool, grid: tuple,
                group: int):
  mr = tiles.MaskRefs.unpack(tm, refs[:-4])
  o_ref, od_ref, lse_ref, lsed_ref = refs[-4:]
  i, b, h = tiles.program_tile(tm, *grid, group, by_q=True)
  hkv = h // groups
  q_start = i * block_q
  q_rows = (b, pl.ds(q_start, block_q), h)
  q, qd = (tiles.load_head(ref, q_rows, q_start, tm.q_len) for ref in (q_ref, qd_ref))
  kv_valid = mr.valid(b, keys=True)
  dot = lambda a, c, dims: jax.lax.dot_general(a, c, (dims, ((), ())), preferred_element_type=jnp.float32)

  def body(j, carry, masked):
    acc_o, acc_1, acc_ds, m, l = carry
    k_start = j * block_k
    load = lambda ref: tiles.load_head(ref, (b, pl.ds(k_start, block_k), hkv), k_start, tm.kv_len, masked,
                                       kv_valid)
    k, v, kd, vd = load(k_ref), load(v_ref), load(kd_ref), load(vd_ref)
    if masked:
      ok = tiles.tile_valid(tm, mr, b, q_start, k_start, block_q, block_k, h=h)
      k, v, kd, vd = tiles.unseen_keys_zeroed(tm, ok, k, v, kd, vd)
    t, c, _ = tiles.scores(q, k, scale=scale, score_mod=None, b=b, h=h, q_start=q_start, k_start=k_start)
    sd = (dot(qd, k, ((1,), (1,))) + dot(q, kd, ((1,), (1,)))) * scale
    if masked:
      t = jnp.where(ok, t, -jnp.inf)
      sd = jnp.where(ok, sd, 0.0)
    m_new = jnp.maximum(m, jnp.max(t, axis=1) * c)
    m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    alpha = tiles.exp2(m - m_safe, fast_exp2)
    p = tiles.exp2_affine(t, c, m_safe[:, None], fast_exp2)
    psd = p * sd
    l = l * alpha + jnp.sum(p, axis=1)
    acc_ds = acc_ds * alpha + jnp.sum(psd, axis=1)
    pv = lambda w, x: dot(w.astype(x.dtype), x, ((1,), (0,)))
    acc_o = acc_o * alpha[:, None] + pv(p, v)
    acc_1 = acc_1 * alpha[:, None] + pv(p, vd) + pv(psd, v)
    return acc_o, acc_1, acc_ds, m_new, l

  dv = tiles.padded_head_dim(v_ref.shape[-1])
  rows = lambda: jnp.zeros((block_q,), jnp.float32)
  init = (jnp.zeros((block_q, dv), jnp.float32), jnp.zeros((block_q, dv), jnp.float32), rows(),
          jnp.full((block_q,), -jnp.inf, jnp.float32), rows())
  acc_o, acc_1, acc_ds, m, l = tiles.tile_loop(tm, mr, b, i, num_kv_tiles, body, init, by_q=True,
                                               block_outer=block_q, block_inner=block_k)
  empty = l == 0.0
  l = jnp.where(empty, 1.0, l)
  out = acc_o / l[:, None]
  lse_dot = acc_ds / l
  out_dot = acc_1 / l[:, None] - lse_dot[:, None] * out
  lse = jnp.where(empty, jnp.inf, (m + jnp.log2(l)) * (1.0 / tiles.LOG2E))
  store = lambda ref, x: tiles.store_head(ref, q_rows, x.astype(ref.dtype), q_start, tm.q_len)
  store(o_ref, out)
  store(od_ref, out_dot)
  lse_ref.at[b, h, pl.ds(q_start, block_q)][...] = lse
  lsed_ref.at[b, h, pl.ds(q_start, block_q)][...] = lse_dot


def forward_jvp(q, k, v, qd, kd, vd, mask: Mask | None, *, scale: float, config: ForwardConfig,
                interpret: bool):
  """Attention and its tangent in one pass.

  Args:
    q, qd: ``[batch, q_len, heads, head_dim]``; k, kd: ``[batch, kv_len, kv_heads, head_dim]``;
      v, vd: ``[batch, kv_len, kv_heads, v_head_dim]`` (tangents in their primal's dtype).
    config: the forward's launch config (already fitted to the device).
  Returns:
    ``(out, out_dot [batch, q_len, heads, v_head_dim], lse, lse_dot [batch, heads, q_len] float32)``,
    ``lse`` the natural log-sum-exp.
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
  group = config_lib.order_group(device, 2 * kv_pad * (dp + dvp) * k.dtype.itemsize)
  kernel = functools.partial(
      _jvp_kernel, tm=tm, scale=scale, groups=heads // kv_heads, block_q=bq, block_k=bk,
      num_kv_tiles=kv_pad // bk, fast_exp2=config.fast_exp2 and not interpret, grid=grid, group=group)
  rows = jax.ShapeDtypeStruct((batch, q_len, heads, dv), q.dtype)
  stats = jax.ShapeDtypeStruct((batch, heads, q_pad), jnp.float32)
  out, out_dot, lse, lse_dot = pl.pallas_call(
      kernel,
      grid=grid,
      out_shape=(rows, rows, stats, stats),
      compiler_params=plgpu.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages),
      interpret=interpret,
      name="probjax_attention_fwd_jvp",
  )(q, k, v, qd, kd, vd, *mask_ops)  # in place: masked tiles past the lengths and head_dims (tiles.load_head)
  return out, out_dot, lse[:, :, :q_len], lse_dot[:, :, :q_len]


@dataclasses.dataclass(frozen=True)
class _Static:
  scale: float
  config: ForwardConfig
  interpret: bool


def _shard(st: _Static, q, k, v, qd, kd, vd, mask):
  return forward_jvp(q, k, v, qd, kd, vd, mask, scale=st.scale, config=st.config, interpret=st.interpret)


def tangent(exact: Callable, *, scale: float, config: ForwardConfig, interpret: bool,
            partitioned: bool = True) -> Callable:
  """``f(q, k, v, mask, qd, kd, vd) -> out_dot`` computed by the fused kernel, linear in the
  tangents, and differentiable in all six arrays in both modes (reverse over forward: MeanFlow,
  consistency models; the jvp of a jvp) through the jvp of ``exact``'s jvp, ``exact(q, k, v,
  mask)`` being the exact XLA formulation of the same attention
  (:func:`probjax.ops.attention.autodiff.kernel_tangent`). ``partitioned``: whether the kernel
  runs per shard of batch and heads (not under a mask_mod, which sees global indices)."""
  st = _Static(float(scale), config, bool(interpret))
  return autodiff.kernel_tangent(vjp.Kernel(_shard, st, partitioned), exact)
