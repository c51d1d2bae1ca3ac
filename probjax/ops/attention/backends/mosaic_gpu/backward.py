"""Flash-attention backward in Pallas Mosaic GPU (Hopper): two deterministic kernels, or
with ``MosaicBackwardConfig.fused_dq`` one (dQ added by the dK/dV kernel, not deterministic).

Both follow the forward's structure (:mod:`.forward`): compute warpgroups of 64 rows and a
producer warpgroup that streams tiles by TMA into a ring of shared-memory slots.

* dK/dV: one CTA per (key tile of ``64 * compute_wgs`` rows, batch, KV head). Its K and V
  rows (``head_dim`` and ``v_head_dim`` wide) stay in shared memory; the producer streams,
  for each query head of the group and each query tile the mask allows, the Q and dO tiles
  and their (lse, delta) rows. On transposed tiles ``S^T = K Q^T`` (``[64, block_q]``):
  ``P^T``, ``dV += P^T dO``, ``dP^T = V dO^T``, ``dS^T = P^T (dP^T - delta)``, ``dK += dS^T Q``;
  dK/dV are summed over the group in registers (no atomics): ``[64, head_dim]`` and
  ``[64, v_head_dim]`` float32 per warpgroup (:func:`width_refusal`).
* dQ: one CTA per (query tile, batch, query head), streaming K and V tiles:
  ``S = Q K^T``, ``P``, ``dP = dO V^T``, ``dS = P (dP - delta)``, ``dQ += dS K``.

``delta = rowsum(dO * O)`` and the base-2 lse are computed in XLA and padded to whole tiles
(+inf lse: query rows past the end have P = 0); tiles that overhang the ends of Q, K, V and
dO read zeros (TMA's out-of-bounds fill) and store only the gradient rows that exist.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from probjax.ops.attention.gpu import output_delta, smem_limit
from probjax.ops.attention.masks import Mask, num_tiles, pad_axis, round_up
from probjax.ops.attention.backends.mosaic_gpu import common as C
from probjax.ops.attention.backends.mosaic_gpu.config import INTERPRET_WGS, check_tiles, smem_total

R = C.ROWS


@dataclasses.dataclass(frozen=True)
class MosaicBackwardConfig:
  """``block_q``: query tiles the dK/dV kernel streams; ``block_k``: key tiles the dQ kernel
  streams; ``num_stages`` ring slots; ``compute_wgs`` compute warpgroups (64 rows each).
  ``fused_dq``: no dQ kernel; the dK/dV kernel also multiplies each dS tile by its K rows
  and adds the product to a float32 dQ in global memory (TMA reduce-add): five matmuls per
  tile pair instead of seven, dQ's float32 sums in an order that varies from run to run
  (not bitwise deterministic; dK and dV still are). ``shared_dq`` (with ``fused_dq``): one
  dQ partial per CTA instead of one per compute warpgroup: the warpgroups exchange their dS^T
  tiles through shared memory and each multiplies all of them by its slice of head_dim (a
  multiple of 64) of the CTA's K rows: half the reduce-adds and dQ registers of two
  warpgroups, for a barrier between them per step."""
  block_q: int = 64
  block_k: int = 64
  num_stages: int = 2
  compute_wgs: int = 2
  fused_dq: bool = False
  shared_dq: bool = False

  def __post_init__(self):
    check_tiles(self, ("block_q", "block_k"))
    for name in ("fused_dq", "shared_dq"):
      if not isinstance(getattr(self, name), bool):
        raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
    if self.shared_dq and not self.fused_dq:
      raise ValueError("shared_dq=True needs fused_dq=True (it shapes the fused dQ's partials)")

  def smem_bytes(self, itemsize: int, head_dim: int, v_head_dim: int | None = None) -> int:
    """The larger of the two kernels' shared memory (:func:`.config.smem_total` of the
    scratch in :func:`backward`): resident 64-row tiles of two operands per compute
    warpgroup (K and V, or Q and dO), ``num_stages`` slots of two streamed tiles (Q and dO,
    or K and V), their float32 statistics and segment ids. Q, K and dQ are ``head_dim`` wide,
    V and dO ``v_head_dim`` wide (None: ``head_dim``)."""
    wgs, st, d, s = self.compute_wgs, self.num_stages, head_dim, itemsize
    dv = v_head_dim or head_dim
    rows = lambda n, width: n * width * s
    fused = []  # dS^T (two buffers when shared), dQ
    if self.fused_dq:
      fused = [(1 + self.shared_dq) * wgs * R * self.block_q * s, wgs * self.block_q * d * 4 // (1 + self.shared_dq)]
    dkv = smem_total([rows(wgs * R, d), rows(wgs * R, dv), rows(st * self.block_q, d), rows(st * self.block_q, dv),
                      st * 2 * self.block_q * 4, wgs * R * 4, st * self.block_q * 4, *fused],
                     3 * wgs + 5 * st + 3 * self.shared_dq)
    if self.fused_dq:
      return dkv
    dq = smem_total([rows(wgs * R, d), rows(wgs * R, dv), wgs * 2 * R * 4, wgs * R * 4, rows(st * self.block_k, d),
                     rows(st * self.block_k, dv), st * self.block_k * 4], 4 * wgs + 4 * st)
    return max(dkv, dq)


# fused_dq stays off by default: this backward promises bitwise-equal gradients across runs,
# and at head_dim 128 the fused dK/dV kernel spills registers and is slower (at head_dim 64 it
# is faster). The tiles are the H200 sweep's best two-kernel configs. Measurements:
# docs/dev/decisions.md ("Settled by probes", mosaic_long.backward_min_work) and bench/results/h200/tiles.json.
DEFAULTS = {64: MosaicBackwardConfig(128, 128, 2, 2), 128: MosaicBackwardConfig(64, 128, 2, 2)}
# dK [64, head_dim] and dV [64, v_head_dim] stay in registers as float32 through the dK/dV
# kernel's loop: (head_dim + v_head_dim) / 2 registers per thread of a warpgroup (64 rows over
# 128 threads), beside the float32 S^T and dP^T tiles of a step, 32 registers each at the
# smallest query tile (64 x 64). A compute warpgroup has 232 (common.registers): widths
# summing to 320 (192/128, 256/64) take 160 + 64 = 224 of them; wider pairs (192/192 at
# 256, or head_dim 256 alone, whose dK/dV take 256) leave no room and are refused.
MAX_WIDTHS = 320


def width_refusal(head_dim: int, v_head_dim: int | None = None) -> str | None:
  """Why the backward cannot take these widths (queries/keys ``head_dim``, values
  ``v_head_dim``, None: ``head_dim``), or None: their dK/dV accumulators must fit the
  registers (:data:`MAX_WIDTHS`)."""
  dv = v_head_dim or head_dim
  if head_dim + dv > MAX_WIDTHS:
    widths = f"head_dim {head_dim} and value head_dim {dv}"
    return (f"the Mosaic backward takes widths summing to at most {MAX_WIDTHS}, got {widths} (its dK/dV "
            "accumulators would not fit the registers); use the Triton backward")
  return None


def default_config(head_dim: int, v_head_dim: int, itemsize: int, limit: int | None) -> MosaicBackwardConfig:
  """The backward's tiles for these widths where none is given (unmeasured for values of their
  own width): the measured :data:`DEFAULTS` where values are as wide as keys, else head_dim
  128's, the widest measured; where that does not fit ``limit`` bytes of shared memory (None:
  unbounded), key tiles of 64 rows in three ring slots, or two. Query tiles stay at 64 rows:
  every 64 more add 64 float32 registers of S^T and dP^T beside the dK/dV accumulators.

  Example, 192/128 in bf16 (an H200 has 232,448 bytes): in (64, 128, 2, 2) the dQ kernel
  holds 64 Q and dO rows per warpgroup (2 x 64 x (192 + 128) x 2 bytes: 80 KiB) and two ring
  slots of 128 K and V rows (2 x 128 x 320 x 2: 160 KiB), 251,008 bytes in all: over. Slots of
  64 rows take 40 KiB each: (64, 64, 3, 2) needs 211,112 bytes (either kernel), a fourth slot
  would not fit. At 128/64, (64, 128, 2, 2) fits as it is (152,704 bytes)."""
  if head_dim == v_head_dim and head_dim in DEFAULTS:
    return DEFAULTS[head_dim]
  cfg = DEFAULTS[128]
  fits = lambda c: limit is None or c.smem_bytes(itemsize, head_dim, v_head_dim) <= limit
  if fits(cfg):
    return cfg
  small = dataclasses.replace(cfg, block_k=64, num_stages=3)
  return small if fits(small) else dataclasses.replace(small, num_stages=2)


def fit(config: MosaicBackwardConfig | None, itemsize: int, head_dim: int, device: str,
        v_head_dim: int | None = None) -> MosaicBackwardConfig:
  """As :func:`probjax.ops.attention.backends.mosaic_gpu.config.fit`, for the backward: widths
  that :func:`width_refusal` takes (``v_head_dim`` None: ``head_dim``), ``config`` (None:
  :func:`default_config`) checked against ``device``'s shared memory."""
  dv = v_head_dim or head_dim
  why = width_refusal(head_dim, dv)
  if why:
    raise ValueError(f"backward_pass_impl='mosaic': {why}")
  limit = smem_limit(device)
  cfg = config if config is not None else default_config(head_dim, dv, itemsize, limit)
  if device == "interpret" and config is None:  # see config.INTERPRET_WGS
    cfg = dataclasses.replace(cfg, compute_wgs=INTERPRET_WGS)
  if cfg.shared_dq and head_dim % (R * cfg.compute_wgs):
    raise ValueError(f"shared_dq=True splits head_dim into {cfg.compute_wgs} slices of whole 64-column "
                     f"tiles; head_dim {head_dim} is not a multiple of {R * cfg.compute_wgs}")
  if limit is not None and (need := cfg.smem_bytes(itemsize, head_dim, dv)) > limit:
    widths = "" if dv == head_dim else f", value head_dim {dv}"
    raise ValueError(f"{cfg} needs {need} bytes of shared memory at head_dim {head_dim}{widths}; {device} has {limit}")
  return cfg


def _dkv_kernel(*refs, band, lengths, segments, scale, score_mod, groups, cfg, q_len, kv_len, dtype, interpret):
  n_in = 9 + cfg.fused_dq  # with fused_dq, the float32 dQ accumulator (a mutable input) last
  q_ref, k_ref, v_ref, do_ref, st_ref, len_ref, rng_ref, qid_ref, kid_ref = refs[:9]
  dq_ref = refs[9] if cfg.fused_dq else None
  (dk_ref, dv_ref, k_smem, v_smem, q_smem, do_smem, st_smem, kid_smem, qid_smem, kv_bar, q_ready, do_ready,
   st_ready, qid_ready, free, *extra) = refs[n_in:]
  n_fused = 2 * cfg.fused_dq + 2 * cfg.shared_dq
  ds_smem, dq_smem, ds_bar, done_bar = (extra[:n_fused] + [None] * 4)[:4]
  staging = extra[n_fused] if interpret else None
  bq, stages, wgs = cfg.block_q, cfg.num_stages, cfg.compute_wgs
  b, hkv, i = lax.axis_index("batch"), lax.axis_index("kv_heads"), lax.axis_index("kv_tiles")
  wg = lax.axis_index("wg")
  cta_start = i * (wgs * R)
  (lo, hi, flo, fhi), valid = C.block_tiles(
      rng_ref, len_ref, b, i, segments=segments, lengths=lengths,
      ranges=lambda *v: C.q_tiles(band, cta_start, wgs * R, q_len, bq, *v))
  nq = hi - lo

  @pl.when(wg < wgs)
  def _compute():
    plgpu.set_max_registers(C.registers(wgs)[0], action="increase")
    k_start = cta_start + wg * R
    rows = pl.ds(k_start, R)
    plgpu.copy_gmem_to_smem(k_ref.at[b, rows, hkv], k_smem.at[wg], kv_bar.at[wg])
    plgpu.copy_gmem_to_smem(v_ref.at[b, rows, hkv], v_smem.at[wg], kv_bar.at[wgs + wg])
    plgpu.barrier_wait(kv_bar.at[wg])
    plgpu.barrier_wait(kv_bar.at[wgs + wg])
    # Rows past this batch element's lengths are zeroed before the products (common.zero_rows_past):
    # K and V's here, once (K multiplies dS into the fused dQ, V dO^T gives dP^T); Q's and dO's
    # in the tile a query length cuts (dS^T Q, P^T dO).
    C.zero_rows_past(k_smem.at[wg], k_start, valid[1])
    C.zero_rows_past(v_smem.at[wg], k_start, valid[1])
    if segments:
      plgpu.copy_gmem_to_smem(kid_ref.at[b, rows], kid_smem.at[wg], kv_bar.at[2 * wgs + wg])
      plgpu.barrier_wait(kv_bar.at[2 * wgs + wg])
    d = k_smem.shape[-1]
    zeros = lambda width: plgpu.layout_cast(jnp.zeros((R, width), jnp.float32), plgpu.Layout.WGMMA)
    stage = None if staging is None else staging.at[wg]
    col = lambda x: lax.broadcast_in_dim(x, (R, bq), [1])

    def step(j, carry, g, masked: bool):
      dk, dv = carry
      n = g * nq + j - lo  # the step's place in the ring
      slot = lax.rem(n, jnp.int32(stages))
      plgpu.barrier_wait(q_ready.at[slot])
      if masked:
        C.zero_rows_past(q_smem.at[slot], j * bq, valid[0])
      plgpu.barrier_wait(st_ready.at[slot])
      lse2 = plgpu.load(st_smem.at[slot, 0], layout=plgpu.Layout.WGMMA.reduce(0))
      ki, qi = C.iotas(R, bq, k_start, j * bq) if masked or score_mod is not None else (None, None)
      x, pull = C.exponent(C.mma(k_smem.at[wg], q_smem.at[slot].T, (R, bq)), scale, score_mod, b,
                           hkv * groups + g, qi, ki)
      pt = jnp.exp2(x - col(lse2))
      if segments:
        plgpu.barrier_wait(qid_ready.at[slot])
      if masked:
        ok = C.element_ok(band, qi, ki, q_len, kv_len, *valid)
        if segments:
          ok &= C.same_segment(qid_smem.at[slot], kid_smem.at[wg], R, bq, transposed=True)
        pt = jnp.where(ok, pt, 0.0)
      plgpu.barrier_wait(do_ready.at[slot])
      if masked:
        C.zero_rows_past(do_smem.at[slot], j * bq, valid[0])
      dv = C.mma_acc(dv, pt.astype(dtype), do_smem.at[slot], stage)
      delta = plgpu.load(st_smem.at[slot, 1], layout=plgpu.Layout.WGMMA.reduce(0))
      dst = pull(pt * (C.mma(v_smem.at[wg], do_smem.at[slot].T, (R, bq)) - col(delta)))
      if masked and score_mod is not None:  # score_mod's derivative may be non-finite there
        dst = jnp.where(ok, dst, 0.0)
      dst = dst.astype(dtype)
      dq_rows = (b, pl.ds(j * bq, bq), hkv * groups + g)
      if cfg.shared_dq:
        # Double-buffered: a warpgroup rewrites buffer p two steps on, after the other has
        # passed this step's ds_bar and so finished the dQ product that reads it.
        p = lax.rem(n, jnp.int32(2))
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
        ds_smem.at[p, wg][...] = dst
        plgpu.commit_smem()
        plgpu.barrier_arrive(ds_bar.at[p])
      elif cfg.fused_dq:  # dS^T to shared memory, as dS (its transposed view) is dQ's A operand
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last tile's dQ has been read
        ds_smem.at[wg][...] = dst
        plgpu.commit_smem()
      dk = C.mma_acc(dk, dst, q_smem.at[slot], stage)
      plgpu.barrier_arrive(free.at[slot])
      if cfg.shared_dq:
        plgpu.barrier_wait(ds_bar.at[p])
        _shared_dq(ds_smem.at[p], k_smem, dq_smem.at[wg], dq_ref.at[dq_rows], wg, interpret)
      elif cfg.fused_dq:
        dq_smem.at[wg][...] = C.mma(ds_smem.at[wg].T, k_smem.at[wg], (bq, d))
        plgpu.commit_smem()
        _add_to(dq_smem.at[wg], (dq_ref.at[wg] if interpret else dq_ref).at[dq_rows], interpret)
      return dk, dv

    def head(g, carry):
      carry = lax.fori_loop(lo, flo, functools.partial(step, g=g, masked=True), carry)
      carry = lax.fori_loop(flo, fhi, functools.partial(step, g=g, masked=False), carry)
      return lax.fori_loop(fhi, hi, functools.partial(step, g=g, masked=True), carry)

    dk, dv = lax.fori_loop(0, groups, head, (zeros(d), zeros(v_smem.shape[-1])))
    if cfg.shared_dq:  # the other warpgroups' last dQ products read this warpgroup's K rows
      plgpu.barrier_arrive(done_bar)
      plgpu.barrier_wait(done_bar)
    k_smem.at[wg][...] = (dk * scale).astype(dtype)  # K and V are no longer needed
    v_smem.at[wg][...] = dv.astype(dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(k_smem.at[wg], dk_ref.at[b, rows, hkv])
    plgpu.copy_smem_to_gmem(v_smem.at[wg], dv_ref.at[b, rows, hkv])
    plgpu.wait_smem_to_gmem(0)

  @pl.when(wg == wgs)
  def _load():
    plgpu.set_max_registers(C.registers(wgs)[1], action="decrease")

    def issue(s, slot):  # step s: query head g of the group, query tile lo + s % nq
      g, j = s // nq, lo + lax.rem(s, nq)
      h = hkv * groups + g
      tile = (b, pl.ds(j * bq, bq), h)
      plgpu.copy_gmem_to_smem(q_ref.at[tile], q_smem.at[slot], q_ready.at[slot])
      plgpu.copy_gmem_to_smem(do_ref.at[tile], do_smem.at[slot], do_ready.at[slot])
      plgpu.copy_gmem_to_smem(st_ref.at[b, h, :, pl.ds(j * bq, bq)], st_smem.at[slot], st_ready.at[slot])
      if segments:
        plgpu.copy_gmem_to_smem(qid_ref.at[b, pl.ds(j * bq, bq)], qid_smem.at[slot], qid_ready.at[slot])
    C.produce(jnp.int32(0), groups * nq, stages, (((free,), issue),))


def _shared_dq(ds_smem, k_smem, dq_smem, dq_dst, wg, interpret: bool):
  """``shared_dq``: warpgroup ``wg``'s slice of head_dim of the CTA's dQ partial, ``dS K``
  over the keys of every warpgroup (their dS^T tiles ``ds_smem [wgs, 64, block_q]``, K rows
  ``k_smem [wgs, 64, head_dim]``), added to ``dq_dst [block_q, head_dim]`` (global memory)
  from ``dq_smem``. The column slices are static, one branch per warpgroup."""
  wgs, bq, dw = ds_smem.shape[0], ds_smem.shape[2], dq_smem.shape[-1]
  for w in range(wgs):
    @pl.when(wg == w)
    def _():
      cols = pl.ds(w * dw, dw)
      dq_smem[...] = C.mma_sum([(ds_smem.at[x].T, k_smem.at[x, :, cols]) for x in range(wgs)], (bq, dw))
      plgpu.commit_smem()
      _add_to(dq_smem, dq_dst.at[:, cols], interpret)


def _add_to(src, dst, interpret: bool):
  """``dst += src`` (a float32 tile from shared to global memory) by TMA reduce-add, which
  interpret mode lacks: there the CTAs run one at a time and the tile is read, added and
  written back. A CTA's warpgroups run at once, so each adds into its own dQ partial
  (:func:`backward`), or with ``shared_dq`` its own columns: two read-add-writes of the same
  rows would lose one of the sums."""
  if interpret:
    dst[...] = dst[...] + src[...]
  else:
    plgpu.copy_smem_to_gmem(src, dst, reduction_op="add")


def _dq_kernel(q_ref, k_ref, v_ref, do_ref, st_ref, len_ref, rng_ref, qid_ref, kid_ref, dq_ref, q_smem,
               do_smem, st_smem, qid_smem, k_smem, v_smem, kid_smem, row_bar, k_ready, v_ready, kid_ready,
               free, staging=None, *, band, lengths, segments, scale, score_mod, groups, cfg, q_len, kv_len,
               dtype):
  bk, stages, wgs = cfg.block_k, cfg.num_stages, cfg.compute_wgs
  b, h, i = lax.axis_index("batch"), lax.axis_index("heads"), lax.axis_index("q_tiles")
  wg = lax.axis_index("wg")
  cta_start = i * (wgs * R)
  (lo, hi, flo, fhi), valid = C.block_tiles(
      rng_ref, len_ref, b, i, segments=segments, lengths=lengths,
      ranges=lambda *v: C.kv_tiles(band, cta_start, wgs * R, kv_len, bk, *v))

  @pl.when(wg < wgs)
  def _compute():
    plgpu.set_max_registers(C.registers(wgs)[0], action="increase")
    q_start = cta_start + wg * R
    rows = pl.ds(q_start, R)
    plgpu.copy_gmem_to_smem(q_ref.at[b, rows, h], q_smem.at[wg], row_bar.at[wg])
    plgpu.copy_gmem_to_smem(do_ref.at[b, rows, h], do_smem.at[wg], row_bar.at[wgs + wg])
    plgpu.copy_gmem_to_smem(st_ref.at[b, h, :, rows], st_smem.at[wg], row_bar.at[2 * wgs + wg])
    if segments:
      plgpu.copy_gmem_to_smem(qid_ref.at[b, rows], qid_smem.at[wg], row_bar.at[3 * wgs + wg])
    for r in (wg, wgs + wg, 2 * wgs + wg) + ((3 * wgs + wg,) if segments else ()):
      plgpu.barrier_wait(row_bar.at[r])
    # Rows past this batch element's lengths are zeroed before the products (common.zero_rows_past):
    # dO's here (dO V^T), K's and V's in the tile a key length cuts (dS K, dO V^T). Q's need not
    # be: its scores are masked, so P and dS are zero whatever Q holds.
    C.zero_rows_past(do_smem.at[wg], q_start, valid[0])
    row = lambda x: lax.broadcast_in_dim(x, (R, bk), [0])
    lse2 = row(plgpu.load(st_smem.at[wg, 0], layout=plgpu.Layout.WGMMA.reduce(1)))
    delta = row(plgpu.load(st_smem.at[wg, 1], layout=plgpu.Layout.WGMMA.reduce(1)))
    stage = None if staging is None else staging.at[wg]
    d = q_smem.shape[-1]

    def step(j, dq, masked: bool):
      slot = lax.rem(j - lo, jnp.int32(stages))
      plgpu.barrier_wait(k_ready.at[slot])
      if masked:
        C.zero_rows_past(k_smem.at[slot], j * bk, valid[1])
      qi, ki = C.iotas(R, bk, q_start, j * bk) if masked or score_mod is not None else (None, None)
      x, pull = C.exponent(C.mma(q_smem.at[wg], k_smem.at[slot].T, (R, bk)), scale, score_mod, b, h, qi, ki)
      p = jnp.exp2(x - lse2)
      if segments:
        plgpu.barrier_wait(kid_ready.at[slot])
      if masked:
        ok = C.element_ok(band, qi, ki, q_len, kv_len, *valid)
        if segments:
          ok &= C.same_segment(qid_smem.at[wg], kid_smem.at[slot], R, bk)
        p = jnp.where(ok, p, 0.0)
      plgpu.barrier_wait(v_ready.at[slot])
      if masked:
        C.zero_rows_past(v_smem.at[slot], j * bk, valid[1])
      ds = pull(p * (C.mma(do_smem.at[wg], v_smem.at[slot].T, (R, bk)) - delta))
      if masked and score_mod is not None:
        ds = jnp.where(ok, ds, 0.0)
      dq = C.mma_acc(dq, ds.astype(dtype), k_smem.at[slot], stage)
      plgpu.barrier_arrive(free.at[slot])
      return dq

    dq = plgpu.layout_cast(jnp.zeros((R, d), jnp.float32), plgpu.Layout.WGMMA)
    dq = lax.fori_loop(lo, flo, functools.partial(step, masked=True), dq)
    dq = lax.fori_loop(flo, fhi, functools.partial(step, masked=False), dq)
    dq = lax.fori_loop(fhi, hi, functools.partial(step, masked=True), dq)
    q_smem.at[wg][...] = (dq * scale).astype(dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(q_smem.at[wg], dq_ref.at[b, rows, h])
    plgpu.wait_smem_to_gmem(0)

  @pl.when(wg == wgs)
  def _load():
    plgpu.set_max_registers(C.registers(wgs)[1], action="decrease")
    issue_k, issue_v = C.kv_issuer(b, h // groups, bk, k_ref, v_ref, kid_ref, k_smem, v_smem, kid_smem,
                                   k_ready, v_ready, kid_ready, segments=segments)
    C.produce(lo, hi, stages, (((free,), issue_k), ((), issue_v)))


def backward(q, k, v, out, lse, do, mask: Mask | None, *, scale: float, config: MosaicBackwardConfig,
             interpret: bool, score_mod=None):
  """Gradients of attention (shapes as in :func:`probjax.ops.attention.backends.mosaic_gpu.forward.forward`:
  q ``[batch, q_len, heads, head_dim]``, k ``[batch, kv_len, kv_heads, head_dim]``, v
  ``[batch, kv_len, kv_heads, v_head_dim]``, out and do ``[batch, q_len, heads, v_head_dim]``,
  widths that :func:`width_refusal` takes; ``lse`` the natural log-sum-exp ``[batch, heads,
  q_len]``; ``score_mod`` that of the forward, differentiated per tile with ``jax.vjp``).
  Returns ``(dq, dk, dv)`` shaped as ``(q, k, v)``."""
  batch, q_len, heads, d = q.shape
  d_v = v.shape[-1]
  kv_len, kv_heads = k.shape[1], k.shape[2]
  cfg = config
  wgs, stages = cfg.compute_wgs, cfg.num_stages
  q_pad = round_up(q_len, math.lcm(wgs * R, cfg.block_q))   # whole tiles of both kernels
  kv_pad = round_up(kv_len, math.lcm(wgs * R, cfg.block_k))
  # Each kernel's grid covers its own rows' tiles of the arrays, not the pads: a pad rounded
  # to the other kernel's tiles (block_k or block_q wider than 64 * compute_wgs) would add CTAs
  # wholly past the end, whose segment ranges (one per tile the mask has) do not exist.
  n_kv, n_q = num_tiles(kv_len, wgs * R), num_tiles(q_len, wgs * R)
  delta = output_delta(out, do, mask)
  stats = jnp.stack([pad_axis(lse * C.LOG2E, 2, q_pad, jnp.inf), pad_axis(delta, 2, q_pad)], axis=2)
  # Operands and gradients are not copied to whole tiles (:func:`.common.tma_rows`): rows past
  # the ends read as zeros, as the pads did, and their gradients are not stored.
  q_rows, kv_rows = C.tma_rows(q_len, cfg.block_q, R), C.tma_rows(kv_len, cfg.block_k, R)
  qp, dop = (pad_axis(x.astype(q.dtype), 1, q_rows) for x in (q, do))
  kp, vp = (pad_axis(x, 1, kv_rows) for x in (k, v))
  band, lengths, lens = C.split_mask(mask, batch, q_len, kv_len)
  segments = C.has_segments(mask)
  static = dict(band=band, lengths=lengths, segments=segments, scale=scale, score_mod=score_mod,
                groups=heads // kv_heads, cfg=cfg, q_len=q_len, kv_len=kv_len, dtype=q.dtype)
  seg = functools.partial(C.segment_operands, mask, batch, q_len, kv_len, q_pad, kv_pad)
  smem = lambda *shape, dt=q.dtype: plgpu.SMEM(shape, dt, transforms=C.TILED)
  barriers = lambda n, arrivals=1: plgpu.Barrier(num_arrivals=arrivals, num_barriers=n)
  common = dict(num_threads=wgs + 1, thread_name="wg", compiler_params=plgpu.CompilerParams(approx_math=True),
                interpret=plgpu.InterpretGPUParams() if interpret else False)

  ids = lambda *shape: plgpu.SMEM(shape, jnp.int32)  # segment ids
  dkv_scratch = [smem(wgs, R, d), smem(wgs, R, d_v), smem(stages, cfg.block_q, d), smem(stages, cfg.block_q, d_v),
                 plgpu.SMEM((stages, 2, cfg.block_q), jnp.float32), ids(wgs, R), ids(stages, cfg.block_q),
                 barriers(3 * wgs), barriers(stages), barriers(stages), barriers(stages), barriers(stages),
                 barriers(stages, wgs)]
  dq_acc = []
  if cfg.shared_dq:  # two buffers of every warpgroup's dS^T, each warpgroup's dQ slice, barriers
    dkv_scratch += [smem(2, wgs, R, cfg.block_q), plgpu.SMEM((wgs, cfg.block_q, d // wgs), jnp.float32),
                    barriers(2, wgs), plgpu.Barrier(num_arrivals=wgs)]
  elif cfg.fused_dq:  # dS^T (bf16) and dQ (float32) tiles
    dkv_scratch += [smem(wgs, R, cfg.block_q), plgpu.SMEM((wgs, cfg.block_q, d), jnp.float32)]
  if cfg.fused_dq:  # the dQ accumulator, zeroed
    per_wg = (wgs,) if interpret and not cfg.shared_dq else ()  # see _add_to
    dq_acc = [jax.new_ref(jnp.zeros((*per_wg, batch, q_pad, heads, d), jnp.float32))]
  if interpret:  # P^T and dS^T staging (see common.mma_acc)
    dkv_scratch.append(smem(wgs, R, cfg.block_q))
  dk, dv = plgpu.kernel(
      functools.partial(_dkv_kernel, **static, interpret=bool(interpret)),
      out_type=(jax.ShapeDtypeStruct((batch, kv_rows, kv_heads, d), k.dtype),
                jax.ShapeDtypeStruct((batch, kv_rows, kv_heads, d_v), v.dtype)),
      scratch_types=dkv_scratch, grid=(n_kv, batch, kv_heads),
      grid_names=("kv_tiles", "batch", "kv_heads"), kernel_name="probjax_attention_bwd_dkv_mosaic",
      **common)(qp, kp, vp, dop, stats, lens, *seg(cfg.block_q, wgs * R, by_q=False, n_outer=n_kv), *dq_acc)
  if cfg.fused_dq:
    dq = jax.freeze(dq_acc[0])
    if per_wg:
      dq = dq.sum(0)
    dq = (dq[:, :q_len] * scale).astype(q.dtype)
    return dq, C.first_rows(dk, kv_len), C.first_rows(dv, kv_len)

  dq_scratch = [smem(wgs, R, d), smem(wgs, R, d_v), plgpu.SMEM((wgs, 2, R), jnp.float32), ids(wgs, R),
                smem(stages, cfg.block_k, d), smem(stages, cfg.block_k, d_v), ids(stages, cfg.block_k),
                barriers(4 * wgs), barriers(stages), barriers(stages), barriers(stages), barriers(stages, wgs)]
  if interpret:
    dq_scratch.append(smem(wgs, R, cfg.block_k))
  dq = plgpu.kernel(
      functools.partial(_dq_kernel, **static),
      out_type=jax.ShapeDtypeStruct((batch, q_rows, heads, d), q.dtype),
      scratch_types=dq_scratch, grid=(n_q, batch, heads),
      grid_names=("q_tiles", "batch", "heads"), kernel_name="probjax_attention_bwd_dq_mosaic",
      **common)(qp, kp, vp, dop, stats, lens, *seg(wgs * R, cfg.block_k, by_q=True, n_outer=n_q))
  return C.first_rows(dq, q_len), C.first_rows(dk, kv_len), C.first_rows(dv, kv_len)
