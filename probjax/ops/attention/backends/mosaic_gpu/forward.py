"""Flash-attention forward kernel in Pallas Mosaic GPU (Hopper: TMA loads, wgmma).

One CTA per (query tile, batch, query head), or with ``persistent`` one per SM looping over
them (:func:`_schedule`; the next tile's queries load while the last tile finishes), with
``compute_wgs + 1`` warpgroups: each compute warpgroup owns ``block_q`` query
rows (wgmma's M is 64 per warpgroup) and runs the float32 online softmax in base 2; the
last warpgroup only issues the TMA copies of the K/V tiles into a ring of ``num_stages``
shared-memory slots. Per slot, a "ready" barrier (completed by the copy) and a "free"
barrier (one arrival per compute warpgroup) hand it back and forth. Two compute
warpgroups take turns on the tensor cores (FA3's ping-pong): a shared barrier passed after
each QK^T is issued and after each softmax lets one's softmax overlap the other's matmuls.

The key tiles of a CTA are ``[lo, hi)`` from the mask's band and this batch element's key
length (tiles they empty are never loaded); ``[full_lo, full_hi)`` inside it are tiles the
band and the lengths fill completely for every row of the CTA, which skip the element
predicate. Tiles that overhang the sequence ends read zeros and store only the rows that
exist (TMA's out-of-bounds handling; key rows past ``kv_len`` are masked).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from probjax.ops.attention.gpu import kernel_device, order_group
from probjax.ops.attention.masks import Mask, heavy_first_program, num_tiles, pad_axis, round_up
from probjax.ops.attention.backends.mosaic_gpu import common as C
from probjax.ops.attention.backends.mosaic_gpu.config import MosaicForwardConfig, cluster_refusal


def _kernel(q_ref, k_ref, v_ref, len_ref, rng_ref, qid_ref, kid_ref, order_ref, o_ref, lse_ref, q_smem, k_smem,
            v_smem, lse_smem, qid_smem, kid_smem, q_bar, k_ready, v_ready, kid_ready, k_free, v_free,
            sched_bar, *staging, band: Mask | None, lengths: bool, segments: bool, scale: float,
            score_mod, groups: int, cfg, q_len: int, kv_len: int, dtype, grid: tuple[int, int, int],
            num_ctas: int, by_work: bool, group: int, own_out: bool):
  bq, bk, stages, wgs = cfg.block_q, cfg.block_k, cfg.num_stages, cfg.compute_wgs
  wg = lax.axis_index("wg")
  # Whether any key tile can need the element predicate (a band, lengths, segments, a partial
  # last key tile).
  masked_tiles = band is not None or lengths or segments or kv_len % bk != 0
  # Base-2 exponent of a score t: t * c (the scale folded in), or with score_mod, which takes
  # the scaled score, t = score_mod(scale * q k^T, ...) and c = log2(e).
  c = C.LOG2E if score_mod is not None else scale * C.LOG2E
  # staging: the output tiles' own buffer where ``own_out`` (MosaicForwardConfig.own_output_buffer),
  # then P's (interpret mode only).
  o_smem = staging[0] if own_out else q_smem
  p_smem = staging[int(own_out)] if len(staging) > int(own_out) else None
  # One CTA per tile: a causal-like band reverses the query tiles (segment ids make a tile's
  # work follow its document, not its position). Persistent: ``order_ref`` when ``by_work``.
  reverse = cfg.heavy_first and band is not None and band.work_grows(by_q=True) and not segments
  n_steps, item = _schedule(grid, num_ctas, cfg.persistent, reverse, order_ref if by_work else None, group)
  if cfg.cluster > 1:  # ``grid`` counts pairs of query tiles; this CTA takes its own of each
    pair_item, half = item, lax.axis_index("cluster")
    item = lambda step: (lambda i, b, h: (i * cfg.cluster + half, b, h))(*pair_item(step))

  def each_tile(body):
    """``body(n, base) -> base'`` over this CTA's tiles (:func:`_schedule`); ``base`` counts
    the K/V ring steps of earlier tiles."""
    if not cfg.persistent:
      return body(0, 0)
    return lax.fori_loop(0, n_steps, body, jnp.int32(0))

  def ranges(i, b):
    cta_start = i * (wgs * bq)
    return cta_start, C.block_tiles(rng_ref, len_ref, b, i, segments=segments, lengths=lengths,
                                     ranges=lambda *v: C.kv_tiles(band, cta_start, wgs * bq, kv_len, bk, *v))

  def visited(i, b):
    """``(lo, hi)``: the key tiles this CTA's producer loads for query tile ``i``: its own,
    or in a cluster those of the whole cluster's rows (a band's ranges of adjacent tiles
    are contiguous, so their union is the range of the rows together)."""
    if cfg.cluster == 1:
      return ranges(i, b)[1][0][:2]
    rows = cfg.cluster * wgs * bq
    valid = (len_ref[0, b], len_ref[1, b]) if lengths else (None, None)
    return C.kv_tiles(band, i // cfg.cluster * rows, rows, kv_len, bk, *valid)[:2]

  def load_q(step):
    i, b, h = item(step)
    rows = pl.ds(i * (wgs * bq) + wg * bq, bq)
    plgpu.copy_gmem_to_smem(q_ref.at[b, rows, h], q_smem.at[wg], q_bar.at[wg])

  @pl.when(wg < wgs)
  def _compute():
    plgpu.set_max_registers(C.registers(wgs)[0], action="increase")  # the producer needs few

    load_q(0)

    def tile(n, base):
      i, b, h = item(n)
      cta_start, ((lo, hi, flo, fhi), valid) = ranges(i, b)
      vlo, vhi = (lo, hi) if cfg.cluster == 1 else visited(i, b)
      if cfg.cluster > 1:  # this CTA's tiles inside the cluster's
        lo = jnp.clip(lo, vlo, vhi)
        hi = jnp.clip(hi, lo, vhi)
        flo, fhi = jnp.clip(flo, lo, hi), jnp.clip(fhi, lo, hi)
        fhi = jnp.maximum(flo, fhi)
      q_start = cta_start + wg * bq
      rows = pl.ds(q_start, bq)
      if segments:
        plgpu.copy_gmem_to_smem(qid_ref.at[b, rows], qid_smem.at[wg], q_bar.at[wgs + wg])
        plgpu.barrier_wait(q_bar.at[wgs + wg])
      plgpu.barrier_wait(q_bar.at[wg])
      d = v_smem.shape[-1]  # the accumulator has the values' width
      carry = (plgpu.layout_cast(jnp.zeros((bq, d), jnp.float32), plgpu.Layout.WGMMA),
               plgpu.layout_cast(jnp.full((bq,), -jnp.inf, jnp.float32), plgpu.Layout.WGMMA.reduce(1)),
               plgpu.layout_cast(jnp.zeros((bq,), jnp.float32), plgpu.Layout.WGMMA.reduce(1)))
      slot_of = lambda j: lax.rem(base + j - vlo, jnp.int32(stages))

      def schedule():  # ping-pong: the two compute warpgroups take turns on the tensor cores
        if wgs == 2:
          plgpu.barrier_arrive(sched_bar)
          plgpu.barrier_wait(sched_bar)

      def wait_next_k(j):  # every K copy is awaited once, while the previous P @ V runs
        @pl.when(j + 1 < hi)
        def _():
          plgpu.barrier_wait(k_ready.at[slot_of(j + 1)])

      def scores(j, slot, t, masked):
        """Score tile ``j`` (ring slot ``slot``) after the modifier and the mask; releases its K
        slot. ``masked``: a bool, or a traced one (the predicate then runs in a branch)."""
        iotas = lambda: C.iotas(bq, bk, q_start, j * bk)
        pos = iotas() if masked is True or score_mod is not None else None
        if score_mod is not None:  # before the mask, as in the other backends
          t = score_mod(t * scale, b, h, *pos)

        def apply_mask(t):
          ok = C.element_ok(band, *(pos or iotas()), q_len, kv_len, *valid)
          if segments:
            plgpu.barrier_wait(kid_ready.at[slot])
            ok &= C.same_segment(qid_smem.at[wg], kid_smem.at[slot], bq, bk)
          return jnp.where(ok, t, -jnp.inf)

        def unmasked(t):
          if segments:
            plgpu.barrier_wait(kid_ready.at[slot])  # every copy's phase is observed
          return t
        if isinstance(masked, bool):
          t = (apply_mask if masked else unmasked)(t)
        else:
          t = lax.cond(masked, apply_mask, unmasked, t)
        plgpu.barrier_arrive(k_free.at[slot])
        return t

      def softmax(t, m, l):
        """``(m', alpha, p, l')``: the running max and sum after score tile ``t``, the factor
        that rescales the accumulator and ``t``'s probabilities (float32)."""
        m_new = jnp.maximum(m, t.max(axis=1) * c)
        m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # rows that have seen no valid key
        alpha = jnp.exp2(m - m_safe)
        p = jnp.exp2(t * c - lax.broadcast_in_dim(m_safe, t.shape, [0]))
        return m_new, alpha, p, l * alpha + p.sum(axis=1)

      def handover(x):  # softmax done: hand the tensor cores to the other warpgroup
        if wgs == 2:
          x = lax.optimization_barrier(x)
          plgpu.barrier_arrive(sched_bar)
        return x

      rescale = lambda acc, alpha: acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
      # V's rows past this batch element's key length are zeroed before P V: their
      # probabilities are zero, which does not cancel NaN. K's need not be: their scores are
      # masked (replaced by -inf) whatever they hold.
      zero_values_past = lambda j, slot: C.zero_rows_past(v_smem.at[slot], j * bk, valid[1])
      p_staging = None if p_smem is None else p_smem.at[wg]

      def step(j, carry, masked: bool):
        acc, m, l = carry
        slot = slot_of(j)
        t = scores(j, slot, C.mma(q_smem.at[wg], k_smem.at[slot].T, (bq, bk), during=schedule), masked)
        m_new, alpha, p, l = softmax(t, m, l)
        acc = rescale(acc, alpha)
        acc, l, m_new, p = handover((acc, l, m_new, p.astype(dtype)))
        plgpu.barrier_wait(v_ready.at[slot])
        if masked:  # a tile a key length cuts is masked
          zero_values_past(j, slot)
        if wgs == 2:  # take the tensor cores back for P @ V
          plgpu.barrier_wait(sched_bar)
        acc = C.mma_acc(acc, p, v_smem.at[slot], p_staging, during=lambda: wait_next_k(j))
        plgpu.barrier_arrive(v_free.at[slot])
        return acc, m_new, l

      def overlapped(n, carry, masked):  # Q K_n^T with P_{n-1} V_{n-1} (cfg.overlap)
        acc, m, l, p_prev = carry
        slot, prev = slot_of(n), slot_of(n - 1)
        plgpu.barrier_wait(k_ready.at[slot])
        plgpu.barrier_wait(v_ready.at[prev])
        zero_values_past(n - 1, prev)

        def consume(t):
          m_new, alpha, p, l_new = softmax(scores(n, slot, t, masked), m, l)
          out = handover((m_new, alpha, p.astype(dtype), l_new))
          if wgs == 2:
            plgpu.barrier_wait(sched_bar)
          return out
        acc, (m, alpha, p, l) = C.mma_overlap(acc, p_prev, v_smem.at[prev], (q_smem.at[wg], k_smem.at[slot].T),
                                              (bq, bk), consume, (m, m, p_prev, l), p_staging, during=schedule)
        plgpu.barrier_arrive(v_free.at[prev])
        acc, _ = lax.optimization_barrier((acc, p_prev))  # P_{n-1} stays in registers until its wgmma is done
        return rescale(acc, alpha), m, l, p

      def overlapped_tiles(carry):
        """Tiles ``[lo, hi)`` (``lo < hi``) in the pipelined order of ``cfg.overlap``: Q K^T and
        softmax of ``lo`` (masked whether or not it is full), then per tile ``n`` its Q K^T
        with the P V of ``n - 1``, then the last P V."""
        acc, m, l = carry
        first = slot_of(lo)
        plgpu.barrier_wait(k_ready.at[first])
        t = scores(lo, first, C.mma(q_smem.at[wg], k_smem.at[first].T, (bq, bk), during=schedule), True)
        m, _, p, l = softmax(t, m, l)  # acc is still zero
        m, p, l = handover((m, p.astype(dtype), l))
        if wgs == 2:
          plgpu.barrier_wait(sched_bar)
        carry = (acc, m, l, p)
        b1 = jnp.clip(flo, lo + 1, hi)
        b2 = jnp.clip(fhi, b1, hi)
        # One loop, each tile's predicate (where a tile can need one) in a branch of its
        # softmax: with P and the accumulator carried from one loop into the next (masked, full,
        # masked tiles), ptxas serialized every wgmma of the kernel (warning C7513; docs/dev/decisions.md,
        # "Settled by probes": "Intra-warpgroup overlap in the Mosaic forward").
        masked = (lambda n: (n < b1) | (n >= b2)) if masked_tiles else (lambda n: False)
        acc, m, l, p = lax.fori_loop(lo + 1, hi, lambda n, c: overlapped(n, c, masked(n)), carry)
        last = slot_of(hi - 1)
        plgpu.barrier_wait(v_ready.at[last])
        zero_values_past(hi - 1, last)
        acc = C.mma_acc(acc, p, v_smem.at[last], p_staging)
        plgpu.barrier_arrive(v_free.at[last])
        return acc, m, l

      def pass_over(j):  # a tile of the cluster's range outside this CTA's: release it
        slot = slot_of(j)
        for ready, free in ((k_ready, k_free), (v_ready, v_free)):
          plgpu.barrier_wait(ready.at[slot])
          plgpu.barrier_arrive(free.at[slot])

      if cfg.cluster > 1:
        pl.loop(vlo, lo)(pass_over)

      if not cfg.overlap:
        @pl.when(lo < hi)
        def _():
          plgpu.barrier_wait(k_ready.at[slot_of(lo)])

      pl.when(wg == 1)(schedule)  # offsets the two warpgroups by half a step
      if cfg.overlap:
        acc, m, l = lax.cond(lo < hi, overlapped_tiles, lambda c: c, carry)
      else:
        carry = lax.fori_loop(lo, flo, functools.partial(step, masked=True), carry)
        carry = lax.fori_loop(flo, fhi, functools.partial(step, masked=False), carry)
        acc, m, l = lax.fori_loop(fhi, hi, functools.partial(step, masked=True), carry)
      pl.when(wg == 0)(schedule)
      if cfg.cluster > 1:
        pl.loop(hi, vhi)(pass_over)
      if cfg.persistent:  # this tile's last QK^T has completed: the query buffer is free
        pl.when(n + 1 < n_steps)(lambda: load_q(n + 1))
      empty = l == 0.0
      l = jnp.where(empty, 1.0, l)
      out = acc / lax.broadcast_in_dim(l, acc.shape, [0])
      plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last tile's stores have read the buffers
      o_smem.at[wg][...] = out.astype(dtype)
      lse_smem.at[wg][...] = jnp.where(empty, jnp.inf, (m + jnp.log2(l)) * (1.0 / C.LOG2E))
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(o_smem.at[wg], o_ref.at[b, rows, h])
      plgpu.copy_smem_to_gmem(lse_smem.at[wg], lse_ref.at[b, h, rows])
      return base + jnp.maximum(vhi - vlo, 0)

    each_tile(tile)
    plgpu.wait_smem_to_gmem(0)

  @pl.when(wg == wgs)
  def _load():
    plgpu.set_max_registers(C.registers(wgs)[1], action="decrease")

    def tile(n, base):
      i, b, h = item(n)
      lo, hi = visited(i, b)
      issue_k, issue_v = C.kv_issuer(b, h // groups, bk, k_ref, v_ref, kid_ref, k_smem, v_smem, kid_smem,
                                     k_ready, v_ready, kid_ready, segments=segments,
                                     multicast=cfg.cluster > 1)
      return C.produce(lo, hi, stages, (((k_free,), issue_k), ((v_free,), issue_v)), base, drain=False)

    C.drain_ring(each_tile(tile), stages, (k_free, v_free))


def _schedule(grid: tuple[int, int, int], num_ctas: int, persistent: bool, reverse: bool, order=None,
              group: int = 1):
  """``(n_steps, item)``: this CTA's number of tiles and ``item(step) -> (query tile, batch,
  head)`` of its ``step``-th. ``grid``: (query tiles, batch, heads). One CTA per tile: its
  grid position, or when ``reverse`` (later query tiles heavier) the heaviest first across
  groups of ``group`` (batch, head) pairs (:func:`~probjax.ops.attention.masks.heavy_first_program`;
  the hardware starts CTAs in grid order). Persistent: :func:`persistent_tile`."""
  nq, nb, nh = grid
  if not persistent:
    def item(step):
      i, b, h = lax.axis_index("q_tiles"), lax.axis_index("batch"), lax.axis_index("heads")
      return heavy_first_program(i, b, h, nq, nb, nh, group) if reverse else (i, b, h)
    return 1, item
  cta, total = lax.axis_index("sm"), nq * nb * nh
  n_steps = total // num_ctas + (cta < total % num_ctas).astype(jnp.int32)
  return n_steps, lambda step: persistent_tile(step, cta, num_ctas, grid, order)


def persistent_tile(step, cta, num_ctas: int, grid: tuple[int, int, int], order=None):
  """``(query tile, batch, head)`` of CTA ``cta``'s ``step``-th tile: CTA ``c`` takes tiles
  ``c``, ``c + num_ctas``, ... of a sequence. Without ``order``, query tiles run fastest in it,
  so that a wave's tiles read the keys of one or two heads and share them in L2. ``order``
  (:func:`work_order`, ``[batch * query tiles]``): the (batch, query tile) pairs heaviest
  first, each with every head in turn, and every second full wave mirrored across the CTAs,
  pairing a CTA's heavier half of one wave with its lighter half of the next."""
  nq, nb, nh = grid
  if order is None:
    n = step * num_ctas + cta
    i, bh = n % nq, n // nq
    return i, bh // nh, bh % nh
  mirrored = (step % 2 == 1) & ((step + 1) * num_ctas <= nq * nb * nh)
  n = step * num_ctas + jnp.where(mirrored, num_ctas - 1 - cta, cta)
  f = order[n // nh]
  return f % nq, f // nq, n % nh


def work_order(work):
  """``[batch * query tiles]`` int32: the flat ``batch * n_q + i`` indices of ``work``
  (``[batch, n_q]`` key tiles per query tile) heaviest first, ties in index order."""
  return jnp.argsort(-work.reshape(-1), stable=True).astype(jnp.int32)


def tile_work(band: Mask | None, lens, ranges, *, lengths: bool, segments: bool, n_q: int, rows: int,
              kv_len: int, block_k: int):
  """``[batch, n_q]``: the key tiles each query tile of ``rows`` rows visits (the kernel's
  ``[lo, hi)``): from the segment ranges, else from the band and the lengths ``lens``."""
  if segments:
    return ranges[:, 1] - ranges[:, 0]
  valid = (lens[0][:, None], lens[1][:, None]) if lengths else (None, None)
  lo, hi, _, _ = C.kv_tiles(band, jnp.arange(n_q, dtype=jnp.int32)[None] * rows, rows, kv_len, block_k, *valid)
  return jnp.broadcast_to(hi - lo, (lens.shape[1], n_q))


def _num_sms() -> int:
  # jax's CUDA devices report their SM count; traced without one (lowering on CPU), an H100/H200's.
  return getattr(jax.devices()[0], "core_count", None) or 132


def forward(q, k, v, mask: Mask | None, *, scale: float, config: MosaicForwardConfig,
            interpret: bool, score_mod=None):
  """Attention forward.

  Args:
    q: ``[batch, q_len, heads, head_dim]``; k: ``[batch, kv_len, kv_heads, head_dim]``; v:
      ``[batch, kv_len, kv_heads, v_head_dim]``; bfloat16 or float16, both widths multiples of
      64; mask: any position mask (band,
      per-batch lengths, segment ids); score_mod: ``f(score, b, h, q_idx, kv_idx)`` on the
      float32 scaled scores, before the mask (indices as full ``[64, block_k]`` tiles).
  Returns:
    ``(out [batch, q_len, heads, v_head_dim], lse [batch, heads, q_len] float32)``, lse the
    natural log-sum-exp (``+inf`` for rows without a valid key).
  """
  batch, q_len, heads, d = q.shape
  dv = v.shape[-1]
  kv_len, kv_heads = k.shape[1], k.shape[2]
  cfg = config
  rows = cfg.block_q * cfg.compute_wgs
  q_pad, kv_pad = round_up(q_len, rows), round_up(kv_len, cfg.block_k)
  # No copies to whole tiles (:func:`.common.tma_rows`): keys past the end are masked, query
  # rows past it dropped. The lse rows stay padded to whole tiles: TMA needs their head
  # stride a multiple of 16 bytes.
  q_rows, kv_rows = C.tma_rows(q_len, rows), C.tma_rows(kv_len, cfg.block_k)
  qp = pad_axis(q, 1, q_rows)
  kp, vp = (pad_axis(x, 1, kv_rows) for x in (k, v))
  tiled = C.TILED
  if cfg.cluster > 1 and (why := cluster_refusal(mask, q_len, rows, cfg.cluster)):
    raise ValueError(f"{cfg} cannot run this call: {why}")
  # A released K/V slot is released to the producers of every CTA of the cluster.
  free = functools.partial(plgpu.ClusterBarrier, collective_axes=("cluster",)) if cfg.cluster > 1 else plgpu.Barrier
  scratch = [
      plgpu.SMEM((cfg.compute_wgs, cfg.block_q, d), q.dtype, transforms=tiled),
      plgpu.SMEM((cfg.num_stages, cfg.block_k, d), q.dtype, transforms=tiled),
      plgpu.SMEM((cfg.num_stages, cfg.block_k, dv), q.dtype, transforms=tiled),
      plgpu.SMEM((cfg.compute_wgs, cfg.block_q), jnp.float32),
      plgpu.SMEM((cfg.compute_wgs, cfg.block_q), jnp.int32),   # query segment ids
      plgpu.SMEM((cfg.num_stages, cfg.block_k), jnp.int32),    # key segment ids per slot
      plgpu.Barrier(num_barriers=2 * cfg.compute_wgs),
      plgpu.Barrier(num_barriers=cfg.num_stages),
      plgpu.Barrier(num_barriers=cfg.num_stages),
      plgpu.Barrier(num_barriers=cfg.num_stages),
      free(num_arrivals=cfg.compute_wgs, num_barriers=cfg.num_stages),
      free(num_arrivals=cfg.compute_wgs, num_barriers=cfg.num_stages),
      plgpu.Barrier(num_arrivals=cfg.compute_wgs),  # the ping-pong schedule
  ]
  own_out = cfg.own_output_buffer(d, dv)
  if own_out:
    scratch.append(plgpu.SMEM((cfg.compute_wgs, cfg.block_q, dv), q.dtype, transforms=tiled))
  if interpret:  # P's staging buffer (see common.mma_acc)
    scratch.append(plgpu.SMEM((cfg.compute_wgs, cfg.block_q, cfg.block_k), q.dtype, transforms=tiled))
  band, lengths, lens = C.split_mask(mask, batch, q_len, kv_len)
  seg_ops = C.segment_operands(mask, batch, q_len, kv_len, q_pad, kv_pad, rows, cfg.block_k, by_q=True,
                               n_outer=num_tiles(q_pad, rows))
  segments = C.has_segments(mask)
  # Grid and schedule in units of ``cfg.cluster`` query tiles (a cluster's CTAs share them).
  tiles = (num_tiles(q_pad, rows) // cfg.cluster, batch, heads)
  grid, names = tiles, ("q_tiles", "batch", "heads")
  if cfg.persistent:  # one CTA (or cluster) per SM (or pair of SMs), each looping over tiles
    grid, names = (min(math.prod(tiles), (2 if interpret else _num_sms()) // cfg.cluster),), ("sm",)
  # Persistent CTAs take the tiles heaviest first where the mask makes their work differ.
  by_work = cfg.persistent and cfg.heavy_first and (
      lengths or segments or (band is not None and band.work_grows(by_q=True)))
  order = jnp.zeros((1,), jnp.int32)
  if by_work:
    work = functools.partial(tile_work, band, lengths=lengths, segments=segments, n_q=tiles[0],
                             rows=rows * cfg.cluster,
                             kv_len=kv_len, block_k=cfg.block_k)
    if lengths or segments:
      order = work_order(work(lens, seg_ops[0]))
    else:  # the band alone: a constant of the trace
      with jax.ensure_compile_time_eval():
        order = work_order(work(lens, None))
  kernel = functools.partial(_kernel, band=band, lengths=lengths, segments=segments, scale=scale,
                             score_mod=score_mod, groups=heads // kv_heads, cfg=cfg, q_len=q_len, kv_len=kv_len,
                             dtype=q.dtype, grid=tiles, num_ctas=grid[0] if cfg.persistent else 0,
                             by_work=by_work, own_out=own_out,
                             group=order_group(kernel_device(interpret), kv_rows * (d + dv) * k.dtype.itemsize))
  out, lse = plgpu.kernel(
      kernel,
      out_type=(jax.ShapeDtypeStruct((batch, q_rows, heads, dv), q.dtype),
                jax.ShapeDtypeStruct((batch, heads, q_pad), jnp.float32)),
      scratch_types=scratch,
      grid=grid,
      grid_names=names,
      num_threads=cfg.compute_wgs + 1,
      thread_name="wg",
      **(dict(cluster=(cfg.cluster,), cluster_names=("cluster",)) if cfg.cluster > 1 else {}),
      compiler_params=plgpu.CompilerParams(approx_math=True),
      interpret=plgpu.InterpretGPUParams() if interpret else False,
      kernel_name="probjax_attention_fwd_mosaic",
  )(qp, kp, vp, lens, *seg_ops, order)
  return C.first_rows(out, q_len), lse[:, :, :q_len]
