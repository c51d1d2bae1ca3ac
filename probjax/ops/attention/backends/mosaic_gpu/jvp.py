"""Fused flash-attention forward + JVP kernel in Pallas Mosaic GPU (Hopper: TMA loads, wgmma).

The math of the Triton backend's fused jvp: with ``s = scale * q k^T`` (masked), the score
tangent ``sd = scale * (qd k^T + q kd^T)`` and the forward's online softmax, one pass over the
key tiles keeps, rescaled like the forward's accumulator::

  l = sum e^{s-m},  acc_o = sum e^{s-m} v,  acc_1 = sum e^{s-m} (vd + sd v),  acc_ds = sum e^{s-m} sd

(``acc_1`` as two products, ``P vd + (P * sd) v``) and ends with ``o = acc_o / l``,
``lse_dot = acc_ds / l`` and ``od = acc_1 / l - lse_dot * o``. Rows without a valid key give
``o = od = 0``, ``lse = +inf``, ``lse_dot = 0``.

The kernel's structure is the backward's dQ kernel's (:mod:`.backward`): one CTA per (query
tile of ``64 * compute_wgs`` rows, batch, query head), the heaviest first under a causal-like
band (as the forward's grid); each compute warpgroup owns 64 query rows, whose Q and Qd tiles
stay in shared memory, and a producer warpgroup streams the K, Kd, V and Vd tiles the mask
allows (:func:`.common.kv_tiles`, the precomputed ranges with segment ids) into a ring of
``num_stages`` slots, one "free" barrier per slot released after the step's last product.
Full tiles skip the element predicate, as in the forward. No ``score_mod`` (:func:`supports`),
no persistent CTAs, CTA pairs or intra-warpgroup overlap (the forward's schedules): its tiles
are :func:`fit`'s.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from probjax.ops.attention import autodiff, vjp
from probjax.ops.attention.gpu import kernel_device, mosaic_partitioned, order_group, smem_limit
from probjax.ops.attention.masks import Mask, heavy_first_program, num_tiles, pad_axis, round_up
from probjax.ops.attention.backends.mosaic_gpu import common as C
from probjax.ops.attention.backends.mosaic_gpu.config import (INTERPRET_WGS, MosaicForwardConfig, smem_total,
                                                               warn_if_interpret_may_hang)

__all__ = ["supports", "fit", "forward_jvp", "tangent"]

R = C.ROWS
HEAD_DIMS = (64, 128)
# Registers per thread of a compute warpgroup (64 rows over its 128 threads: a float32 [64, n]
# tile takes n / 2 of them). The two float32 output accumulators, acc_o and acc_1, take
# v_head_dim (v_head_dim / 2 each) through the whole loop; a step's score tile and its tangent,
# [64, block_k] float32 each, take block_k while the softmax runs (then P and P * sd in 16 bits,
# block_k / 4 each, while S and sd are dead). Keeping v_head_dim + block_k at most 192 leaves 40
# of the 232 a compute warpgroup gets beside one other (common.registers) for the row statistics
# (m, l, acc_ds), the mask's predicate and the addresses: v_head_dim 128 takes key tiles of 64,
# v_head_dim 64 key tiles of 128. Three compute warpgroups get 160 each, less than the 192 of
# v_head_dim 128's accumulators and a step's two 64-key score tiles, so the kernel runs one or two.
TILE_REGISTERS = 192
MAX_WGS = 2
# block_k for the wider width; two compute warpgroups, two ring slots (four operands a slot:
# a third does not fit beside the Q and Qd tiles at either width, see fit).
DEFAULTS = {64: MosaicForwardConfig(64, 128, 2, 2), 128: MosaicForwardConfig(64, 64, 2, 2)}


def supports(score_mod: Callable | None, head_dim: int, v_head_dim: int | None = None) -> str | None:
  """None if :func:`forward_jvp` computes the tangent of a call the Mosaic forward computes, else
  the reason (the tangent then comes from the jvp of the exact XLA formulation)."""
  if score_mod is not None:
    return "score_mod: the fused jvp kernel has no score_mod tangent"
  dv = v_head_dim or head_dim
  if head_dim not in HEAD_DIMS or dv not in HEAD_DIMS:
    return (f"head_dim {head_dim}, value head_dim {dv}: the fused Mosaic jvp kernel takes {HEAD_DIMS} (its two "
            "float32 output accumulators fill the registers past value head_dim 128, and its Q, Qd, K and Kd "
            "tiles the shared memory past head_dim 128)")
  return None


def smem_bytes(cfg: MosaicForwardConfig, itemsize: int, head_dim: int, v_head_dim: int) -> int:
  """Shared memory of :func:`forward_jvp`'s scratch at ``cfg`` (:func:`.config.smem_total`): the
  Q and Qd tiles, the output and its tangent's tiles where values are narrower or wider than
  queries (else they reuse Q's and Qd's), the K, Kd, V and Vd rings, the lse and lse_dot rows,
  the segment ids and the barriers."""
  wgs, bk, st, s = cfg.compute_wgs, cfg.block_k, cfg.num_stages, itemsize
  own = [wgs * R * v_head_dim * s] * 2 if v_head_dim != head_dim else []
  return smem_total([wgs * R * head_dim * s] * 2 + own + [st * bk * head_dim * s] * 2 + [st * bk * v_head_dim * s] * 2
                    + [wgs * R * 4] * 3 + [st * bk * 4], 3 * wgs + 6 * st)


def fit(config: MosaicForwardConfig | None, itemsize: int, head_dim: int, device: str,
        v_head_dim: int | None = None) -> MosaicForwardConfig:
  """The kernel's tiles: ``config`` (the call's forward config; None: :data:`DEFAULTS` of the
  wider width, one compute warpgroup in interpret mode, see :data:`.config.INTERPRET_WGS`)
  with its schedules dropped (not persistent, no CTA pairs, no overlap), at most
  :data:`MAX_WGS` compute warpgroups and key tiles within :data:`TILE_REGISTERS`; then fewer
  ring slots, then smaller key tiles, until it fits ``device``'s shared memory. The config
  was chosen for the forward kernel, whose tiles may not fit this one: it is fitted, never
  refused. Widths :func:`supports` takes."""
  dv = v_head_dim or head_dim
  base = config if config is not None else DEFAULTS[max(head_dim, dv)]
  wgs = INTERPRET_WGS if device == "interpret" and config is None else min(base.compute_wgs, MAX_WGS)
  block_k = max(R, min(base.block_k, (TILE_REGISTERS - dv) // R * R))
  cfg = MosaicForwardConfig(R, block_k, base.num_stages, wgs, heavy_first=base.heavy_first)
  limit = smem_limit(device)
  while limit is not None and (need := smem_bytes(cfg, itemsize, head_dim, dv)) > limit:
    if cfg.num_stages > 2:
      cfg = dataclasses.replace(cfg, num_stages=cfg.num_stages - 1)
    elif cfg.block_k > R:
      cfg = dataclasses.replace(cfg, block_k=cfg.block_k - R)
    else:
      raise ValueError(f"the fused Mosaic jvp kernel needs {need} bytes of shared memory at head_dim {head_dim}, "
                       f"value head_dim {dv} ({cfg}); {device} has {limit}")
  return cfg


def _kernel(q_ref, k_ref, v_ref, qd_ref, kd_ref, vd_ref, len_ref, rng_ref, qid_ref, kid_ref, o_ref, od_ref,
            lse_ref, lsed_ref, q_smem, qd_smem, k_smem, kd_smem, v_smem, vd_smem, lse_smem, lsed_smem, qid_smem,
            kid_smem, row_bar, k_ready, kd_ready, v_ready, vd_ready, kid_ready, free, *extra, band: Mask | None,
            lengths: bool, segments: bool, scale: float, groups: int, cfg: MosaicForwardConfig, q_len: int,
            kv_len: int, dtype, grid: tuple[int, int, int], reverse: bool, group: int, own_out: bool):
  bk, stages, wgs = cfg.block_k, cfg.num_stages, cfg.compute_wgs
  i, b, h = lax.axis_index("q_tiles"), lax.axis_index("batch"), lax.axis_index("heads")
  if reverse:  # a causal-like band: later query tiles see more keys
    i, b, h = heavy_first_program(i, b, h, *grid, group)
  wg = lax.axis_index("wg")
  cta_start = i * (wgs * R)
  (lo, hi, flo, fhi), valid = C.block_tiles(
      rng_ref, len_ref, b, i, segments=segments, lengths=lengths,
      ranges=lambda *v: C.kv_tiles(band, cta_start, wgs * R, kv_len, bk, *v))
  # extra: the output tiles' own buffers where values are not as wide as queries, then the
  # staging buffer of the register operands of P V (interpret mode only, see common.mma_acc).
  o_smem, od_smem = extra[:2] if own_out else (q_smem, qd_smem)
  staging = extra[2 * own_out:]
  c = scale * C.LOG2E  # the base-2 exponent of a score tile t = q k^T is t * c

  @pl.when(wg < wgs)
  def _compute():
    plgpu.set_max_registers(C.registers(wgs)[0], action="increase")
    q_start = cta_start + wg * R
    rows = pl.ds(q_start, R)
    plgpu.copy_gmem_to_smem(q_ref.at[b, rows, h], q_smem.at[wg], row_bar.at[wg])
    plgpu.copy_gmem_to_smem(qd_ref.at[b, rows, h], qd_smem.at[wg], row_bar.at[wgs + wg])
    if segments:
      plgpu.copy_gmem_to_smem(qid_ref.at[b, rows], qid_smem.at[wg], row_bar.at[2 * wgs + wg])
    for r in (wg, wgs + wg) + ((2 * wgs + wg,) if segments else ()):
      plgpu.barrier_wait(row_bar.at[r])
    stage = staging[0].at[wg] if staging else None
    row = lambda x, shape: lax.broadcast_in_dim(x, shape, [0])

    def step(j, carry, masked: bool):
      acc_o, acc_1, acc_ds, m, l = carry
      slot = lax.rem(j - lo, jnp.int32(stages))
      plgpu.barrier_wait(k_ready.at[slot])
      plgpu.barrier_wait(kd_ready.at[slot])
      t = C.mma(q_smem.at[wg], k_smem.at[slot].T, (R, bk))
      sd = C.mma_sum(((qd_smem.at[wg], k_smem.at[slot].T), (q_smem.at[wg], kd_smem.at[slot].T)), (R, bk)) * scale
      if segments:
        plgpu.barrier_wait(kid_ready.at[slot])  # every copy's phase is observed
      if masked:
        # Scores of keys past this batch element's length (which may hold anything) and of
        # masked pairs are replaced, never multiplied: NaN there reaches neither.
        ok = C.element_ok(band, *C.iotas(R, bk, q_start, j * bk), q_len, kv_len, *valid)
        if segments:
          ok &= C.same_segment(qid_smem.at[wg], kid_smem.at[slot], R, bk)
        t = jnp.where(ok, t, -jnp.inf)
        sd = jnp.where(ok, sd, 0.0)
      m_new = jnp.maximum(m, t.max(axis=1) * c)
      m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # rows that have seen no valid key
      alpha = jnp.exp2(m - m_safe)
      p = jnp.exp2(t * c - row(m_safe, t.shape))
      psd = p * sd
      l = l * alpha + p.sum(axis=1)
      acc_ds = acc_ds * alpha + psd.sum(axis=1)
      acc_o = acc_o * row(alpha, acc_o.shape)
      acc_1 = acc_1 * row(alpha, acc_1.shape)
      p, psd = p.astype(dtype), psd.astype(dtype)
      plgpu.barrier_wait(v_ready.at[slot])
      plgpu.barrier_wait(vd_ready.at[slot])
      if masked:  # V's and Vd's rows past the key length: a zero probability does not cancel NaN
        C.zero_rows_past(v_smem.at[slot], j * bk, valid[1])
        C.zero_rows_past(vd_smem.at[slot], j * bk, valid[1])
      acc_o = C.mma_acc(acc_o, p, v_smem.at[slot], stage)
      acc_1 = C.mma_acc(acc_1, p, vd_smem.at[slot], stage)
      acc_1 = C.mma_acc(acc_1, psd, v_smem.at[slot], stage)
      plgpu.barrier_arrive(free.at[slot])
      return acc_o, acc_1, acc_ds, m_new, l

    dv = v_smem.shape[-1]
    acc = lambda: plgpu.layout_cast(jnp.zeros((R, dv), jnp.float32), plgpu.Layout.WGMMA)
    stat = lambda x: plgpu.layout_cast(jnp.full((R,), x, jnp.float32), plgpu.Layout.WGMMA.reduce(1))
    carry = (acc(), acc(), stat(0.0), stat(-jnp.inf), stat(0.0))
    carry = lax.fori_loop(lo, flo, functools.partial(step, masked=True), carry)
    carry = lax.fori_loop(flo, fhi, functools.partial(step, masked=False), carry)
    acc_o, acc_1, acc_ds, m, l = lax.fori_loop(fhi, hi, functools.partial(step, masked=True), carry)
    empty = l == 0.0
    l = jnp.where(empty, 1.0, l)
    out = acc_o / row(l, acc_o.shape)
    lse_dot = acc_ds / l
    out_dot = acc_1 / row(l, acc_1.shape) - row(lse_dot, out.shape) * out
    # The loop's last products have completed: Q's and Qd's tiles take the outputs where
    # values are as wide as queries.
    o_smem.at[wg][...] = out.astype(dtype)
    od_smem.at[wg][...] = out_dot.astype(dtype)
    lse_smem.at[wg][...] = jnp.where(empty, jnp.inf, (m + jnp.log2(l)) * (1.0 / C.LOG2E))
    lsed_smem.at[wg][...] = lse_dot
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(o_smem.at[wg], o_ref.at[b, rows, h])
    plgpu.copy_smem_to_gmem(od_smem.at[wg], od_ref.at[b, rows, h])
    plgpu.copy_smem_to_gmem(lse_smem.at[wg], lse_ref.at[b, h, rows])
    plgpu.copy_smem_to_gmem(lsed_smem.at[wg], lsed_ref.at[b, h, rows])
    plgpu.wait_smem_to_gmem(0)

  @pl.when(wg == wgs)
  def _load():
    plgpu.set_max_registers(C.registers(wgs)[1], action="decrease")
    hkv = h // groups
    issue_k, issue_v = C.kv_issuer(b, hkv, bk, k_ref, v_ref, kid_ref, k_smem, v_smem, kid_smem, k_ready, v_ready,
                                   kid_ready, segments=segments)
    issue_kd, issue_vd = C.kv_issuer(b, hkv, bk, kd_ref, vd_ref, None, kd_smem, vd_smem, None, kd_ready, vd_ready,
                                     None, segments=False)
    C.produce(lo, hi, stages, (((free,), issue_k), ((), issue_kd), ((), issue_v), ((), issue_vd)))


def forward_jvp(q, k, v, qd, kd, vd, mask: Mask | None, *, scale: float, config: MosaicForwardConfig,
                interpret: bool):
  """Attention and its tangent in one pass.

  Args:
    q, qd: ``[batch, q_len, heads, head_dim]``; k, kd: ``[batch, kv_len, kv_heads, head_dim]``;
      v, vd: ``[batch, kv_len, kv_heads, v_head_dim]``; bfloat16 or float16 (tangents cast to
      q's dtype), widths :func:`supports` takes; mask: any position mask the Mosaic forward
      takes (band, per-batch lengths, segment ids).
    config: the kernel's tiles (:func:`fit`).
  Returns:
    ``(out, out_dot [batch, q_len, heads, v_head_dim], lse, lse_dot [batch, heads, q_len]
    float32)``, ``lse`` the natural log-sum-exp (``+inf`` for rows without a valid key, whose
    ``out``, ``out_dot`` and ``lse_dot`` are zero).
  """
  batch, q_len, heads, d = q.shape
  dv = v.shape[-1]
  kv_len, kv_heads = k.shape[1], k.shape[2]
  cfg, dtype = config, q.dtype
  rows = R * cfg.compute_wgs
  q_pad, kv_pad = round_up(q_len, rows), round_up(kv_len, cfg.block_k)
  # No copies to whole tiles (:func:`.common.tma_rows`): keys past the end are masked, query
  # rows past it dropped; the statistics' rows stay padded (TMA: 16-byte head strides).
  q_rows, kv_rows = C.tma_rows(q_len, rows), C.tma_rows(kv_len, cfg.block_k)
  qp, qdp = (pad_axis(x.astype(dtype), 1, q_rows) for x in (q, qd))
  kp, vp, kdp, vdp = (pad_axis(x.astype(dtype), 1, kv_rows) for x in (k, v, kd, vd))
  smem = lambda *shape, dt=dtype: plgpu.SMEM(shape, dt, transforms=C.TILED)
  barriers = lambda n, arrivals=1: plgpu.Barrier(num_arrivals=arrivals, num_barriers=n)
  wgs, st, bk = cfg.compute_wgs, cfg.num_stages, cfg.block_k
  scratch = [smem(wgs, R, d), smem(wgs, R, d), smem(st, bk, d), smem(st, bk, d), smem(st, bk, dv), smem(st, bk, dv),
             plgpu.SMEM((wgs, R), jnp.float32), plgpu.SMEM((wgs, R), jnp.float32),
             plgpu.SMEM((wgs, R), jnp.int32), plgpu.SMEM((st, bk), jnp.int32),  # query and key segment ids
             barriers(3 * wgs), barriers(st), barriers(st), barriers(st), barriers(st), barriers(st),
             barriers(st, wgs)]
  own_out = dv != d
  if own_out:
    scratch += [smem(wgs, R, dv), smem(wgs, R, dv)]
  if interpret:
    scratch.append(smem(wgs, R, bk))
    warn_if_interpret_may_hang(wgs + 1)
  band, lengths, lens = C.split_mask(mask, batch, q_len, kv_len)
  segments = C.has_segments(mask)
  grid = (num_tiles(q_pad, rows), batch, heads)
  seg_ops = C.segment_operands(mask, batch, q_len, kv_len, q_pad, kv_pad, rows, bk, by_q=True, n_outer=grid[0])
  # Segment ids make a tile's work follow its document, not its position.
  reverse = cfg.heavy_first and band is not None and band.work_grows(by_q=True) and not segments
  kernel = functools.partial(
      _kernel, band=band, lengths=lengths, segments=segments, scale=scale, groups=heads // kv_heads, cfg=cfg,
      q_len=q_len, kv_len=kv_len, dtype=dtype, grid=grid, reverse=reverse, own_out=own_out,
      group=order_group(kernel_device(interpret), 2 * kv_rows * (d + dv) * jnp.dtype(dtype).itemsize))
  out_rows = jax.ShapeDtypeStruct((batch, q_rows, heads, dv), dtype)
  stats = jax.ShapeDtypeStruct((batch, heads, q_pad), jnp.float32)
  out, out_dot, lse, lse_dot = plgpu.kernel(
      kernel,
      out_type=(out_rows, out_rows, stats, stats),
      scratch_types=scratch,
      grid=grid,
      grid_names=("q_tiles", "batch", "heads"),
      num_threads=wgs + 1,
      thread_name="wg",
      compiler_params=plgpu.CompilerParams(approx_math=True),
      interpret=plgpu.InterpretGPUParams() if interpret else False,
      kernel_name="probjax_attention_fwd_jvp_mosaic",
  )(qp, kp, vp, qdp, kdp, vdp, lens, *seg_ops)
  return C.first_rows(out, q_len), C.first_rows(out_dot, q_len), lse[:, :, :q_len], lse_dot[:, :, :q_len]


@dataclasses.dataclass(frozen=True)
class _Static:
  """The kernel's static arguments (``score_mod`` always None: read by
  :func:`probjax.ops.attention.gpu.mosaic_partitioned`)."""
  scale: float
  config: MosaicForwardConfig
  interpret: bool
  score_mod: None = None


def _shard(st: _Static, q, k, v, qd, kd, vd, mask):
  return forward_jvp(q, k, v, qd, kd, vd, mask, scale=st.scale, config=st.config, interpret=st.interpret)


def tangent(exact: Callable, *, scale: float, config: MosaicForwardConfig, interpret: bool) -> Callable:
  """``f(q, k, v, mask, qd, kd, vd) -> out_dot`` computed by the fused kernel at ``config``
  (:func:`fit`), linear in the tangents and differentiable in all six arrays in both modes
  (reverse over forward: MeanFlow, consistency models; the jvp of a jvp) through the jvp of
  ``exact``'s jvp, ``exact(q, k, v, mask)`` being the exact XLA formulation of the same
  attention (:func:`probjax.ops.attention.autodiff.kernel_tangent`)."""
  st = _Static(float(scale), config, bool(interpret))
  return autodiff.kernel_tangent(vjp.Kernel(_shard, st, mosaic_partitioned(st)), exact)
