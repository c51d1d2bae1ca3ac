"""Split-KV decode of the absorbed form in Pallas Mosaic GPU (Hopper: TMA loads, wgmma).

Multi-query attention of all ``H`` heads of a sequence over its one shared latent: rows
``r = t * H + h`` of ``q_lat [B, Tq * H, d_c]`` / ``q_rope [B, Tq * H, d_rope]`` attend over keys
``[latent, k_rope]`` with values the latent itself. The rows are the wgmma's M side, in tiles of
64 (one warpgroup's M): 128 heads of one query are two row tiles, so one latent tile read from
HBM serves 64 heads in each of two CTAs (the second read comes from L2).

One CTA per (row tile, key split, batch element) with ``value_wgs + 1`` warpgroups:

* the last warpgroup only issues TMA copies: the row tile's queries once, then the split's key
  tiles of ``BLOCK_K`` positions (latent and rope, from a contiguous cache or a page of a pool
  through ``page_table``) into a ring of ``num_stages`` shared-memory slots, each with "ready"
  barriers (completed by the copies) and a "free" barrier (one arrival per compute warpgroup);
* each compute warpgroup ``w`` accumulates ``P @ latent[:, w-th part]`` in float32 over
  ``d_c / value_wgs`` columns: a 64 x 512 float32 accumulator is 256 registers a thread, more
  than a warpgroup has, so at d_c 512 two warpgroups share the value width. The score tile
  ``Q [latent, rope]^T`` (64 x BLOCK_K) and the online softmax in base 2 are computed once, by
  the first ("leader"), which hands P (16-bit) and the row factors to the second ("follower")
  through shared memory, one tile at a time (``share_scores``); or by each warpgroup itself
  (``share_scores=False``: half again the tensor-core work, no hand-over).

Each CTA writes its normalised float32 partial output and natural-log LSE per row; :func:`combine`
merges the splits in XLA. Positions at or past a sequence's length are never used: their tiles
are not loaded, and inside the last tile their scores are masked and their latent rows zeroed
before ``P @ latent`` (a probability of zero does not cancel a NaN there).
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

from probjax.core.device import SMEM_PER_BLOCK
from probjax.ops.mla import forms

LOG2E = math.log2(math.e)
ROWS = 64          # rows of one wgmma (M) per warpgroup: the row tile
BLOCK_K = 64       # positions per key tile: wgmma's N of the scores, a whole (8, 64) smem tile
PART = 64          # the (8, 64) smem tiling: query, latent and rope widths are multiples of it
MAX_PART = 256     # wgmma's largest N: the value columns one warpgroup accumulates
MAX_VALUE_WGS = 2  # beside the producer, two compute warpgroups get 232 registers a thread
TMA_ROWS = 8       # TMA copies need the copied array's second-minor axis in multiples of 8
SMEM_ALIGN, SMEM_RESERVED = 1024, 2048
SMEM_SM90 = SMEM_PER_BLOCK["sm_90"]
REGISTERS_PER_SM = 65536
PRODUCER_REGISTERS = 40
MASK_KINDS = ("band", "kv_lengths")
MAX_QUERIES = 4
DTYPES = ("bfloat16", "float16")
TILED = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
TILED_F32 = (plgpu.TilingTransform((8, 32)), plgpu.SwizzleTransform(128))


def _round_up(n: int, m: int) -> int:
  return -(-n // m) * m


def value_wgs(d_c: int) -> int:
  """Compute warpgroups of a CTA: each accumulates ``d_c / value_wgs`` value columns, at most
  :data:`MAX_PART` (wgmma's N, and 128 float32 registers a thread for 64 rows)."""
  return max(1, -(-d_c // MAX_PART))


def can_share(d_c: int, d_rope: int) -> bool:
  """Whether the two compute warpgroups can share one score tile (``share_scores``): two of
  them, and rope queries as wide as P, whose buffer they arrive in."""
  return value_wgs(d_c) == 2 and d_rope == BLOCK_K


def smem_bytes(d_c: int, d_rope: int, itemsize: int, num_stages: int, wgs: int, share: bool = False) -> int:
  """Shared memory of the kernel on the GPU (each buffer rounded up to 1 KiB, 8 bytes per
  barrier and the 2 KiB Mosaic GPU reserves): the absorbed queries, the ring (whose memory the
  float32 output tiles and the lse reuse after the last key tile), and the rope queries or, with
  ``share``, P's tile and the row factors (the rope queries arrive in P's tile)."""
  ring = num_stages * BLOCK_K * (d_c + d_rope) * itemsize
  out = _round_up(ROWS * d_c * 4, SMEM_ALIGN) + ROWS * 4
  buffers = [ROWS * d_c * itemsize, max(ring, out)]
  buffers += [ROWS * BLOCK_K * itemsize, ROWS * 4] if share else [ROWS * d_rope * itemsize]
  barriers = (wgs + 1) + (wgs + 1) * num_stages + num_stages + (wgs > 1) + 2 * share
  return sum(_round_up(b, SMEM_ALIGN) for b in buffers) + 8 * barriers + SMEM_RESERVED


def fit_stages(d_c: int, d_rope: int, itemsize: int, wgs: int, share: bool = False, limit: int = SMEM_SM90,
               max_stages: int = 4) -> int:
  """The deepest ring (2 to ``max_stages`` slots) that fits ``limit`` bytes; 0 if two do not."""
  fits = [s for s in range(2, max_stages + 1) if smem_bytes(d_c, d_rope, itemsize, s, wgs, share) <= limit]
  return max(fits, default=0)


def why_not(*, q_len: int, d_c: int, d_rope: int, dtype, mask_kinds: tuple[str, ...],
            page_size: int | None = None) -> str | None:
  """Why the kernel cannot compute a call (None if it can); the device is the caller's check."""
  name = jnp.dtype(dtype).name
  if name not in DTYPES:
    return f"dtype {name}: the Mosaic GPU decode kernel takes bfloat16 and float16"
  other = [k for k in mask_kinds if k not in MASK_KINDS]
  if other:
    return (f"mask predicate {other[0]!r}: the Mosaic GPU decode kernel takes KVLenMask and a causal band "
            "(CausalMask, LocalWindowMask)")
  if not 1 <= q_len <= MAX_QUERIES:
    return f"{q_len} queries per sequence: the Mosaic GPU decode kernel takes 1 to {MAX_QUERIES}"
  wgs = value_wgs(d_c)
  if wgs > MAX_VALUE_WGS or d_c % (PART * wgs):
    return (f"d_c {d_c}: the Mosaic GPU decode kernel takes a multiple of {PART} up to {MAX_PART}, or of "
            f"{PART * MAX_VALUE_WGS} up to {MAX_PART * MAX_VALUE_WGS}")
  if d_rope % PART or d_rope > MAX_PART:
    return f"d_rope {d_rope}: the Mosaic GPU decode kernel takes a multiple of {PART} up to {MAX_PART}"
  if page_size is not None and (page_size < BLOCK_K or page_size & (page_size - 1)):
    return f"page_size {page_size}: the Mosaic GPU decode kernel takes a power of two >= {BLOCK_K}"
  if not fit_stages(d_c, d_rope, jnp.dtype(dtype).itemsize, wgs):
    need = smem_bytes(d_c, d_rope, jnp.dtype(dtype).itemsize, 2, wgs)
    return f"d_c {d_c} + d_rope {d_rope}: two key tiles and the queries need {need} bytes of shared memory"
  return None


@dataclasses.dataclass(frozen=True)
class _Static:
  heads: int
  q_len: int
  scale: float
  band: tuple[int | None, int | None]
  page_size: int | None
  num_splits: int
  num_stages: int
  wgs: int
  share: bool
  dtype: jnp.dtype
  interpret: bool


def _key_blocks(st: _Static, row0, length):
  """``(first, end)``: the key tiles that rows ``[row0, row0 + ROWS)`` may see, bounded by this
  element's ``length`` and the band (row ``r`` is query ``r // heads``)."""
  lower, upper = st.band
  t_first = jnp.minimum(row0 // st.heads, st.q_len - 1)
  t_last = jnp.minimum((row0 + ROWS - 1) // st.heads, st.q_len - 1)
  hi = length if upper is None else jnp.clip(t_last + upper + 1, 0, length)
  lo = jnp.int32(0) if lower is None else jnp.clip(t_first + lower, 0, hi)
  return lo // BLOCK_K, (hi + BLOCK_K - 1) // BLOCK_K


def _mma_sum(pairs, shape):
  """``sum(a @ b for a, b in pairs)`` (float32 ``shape``) in one accumulator; each ``b`` a
  shared-memory ref, each ``a`` one too or a 16-bit register array in the wgmma layout."""
  def run(acc_ref):
    for a, b in pairs:
      plgpu.wgmma(acc_ref, a, b)
    return acc_ref[...]
  return pl.run_scoped(run, plgpu.ACC(shape, jnp.float32))


def _mma_acc(acc, a, b):
  """``acc + a @ b`` with ``a`` in registers (16-bit, wgmma layout) and ``b`` a shared-memory
  ref, accumulated in place by wgmma."""
  return pl.run_state(lambda acc_ref: plgpu.wgmma(acc_ref, a, b))(plgpu.ACC.init(acc))


def _zero_rows_past(tile, start, valid):
  """Zeroes the rows of a ``[BLOCK_K, cols]`` shared-memory tile holding positions ``start..``
  at or past ``valid`` (a traced int32), where the tile reaches past it, 64 columns at a time
  (few registers beside the accumulator). Rows before ``valid`` are rewritten with their own
  value, so a warpgroup reading the tile meanwhile (a score product) reads what was there or,
  past the length, zeros (whose scores are masked)."""
  @pl.when(valid - start < BLOCK_K)
  def _():
    row = plgpu.broadcasted_iota(jnp.int32, (BLOCK_K,), 0, layout=plgpu.Layout.WGMMA.reduce(1))
    keep = lax.broadcast_in_dim(start + row < valid, (BLOCK_K, PART), [0])
    for c in range(0, tile.shape[1], PART):
      chunk = tile.at[:, pl.ds(c, PART)]
      chunk[...] = jnp.where(keep, chunk[...], jnp.zeros((), tile.dtype))
    plgpu.commit_smem()  # the generic-proxy writes before the wgmma that reads the tile


def _row_layout(x):
  return plgpu.layout_cast(x, plgpu.Layout.WGMMA.reduce(1))


def _kernel(lens_ref, table_ref, ql_ref, qr_ref, lat_ref, rope_ref, o_ref, lse_ref, *, st: _Static, ql, union,
            q_bar, lat_ready, rope_ready, free, qr=None, done=None, p_buf=None, a_buf=None, p_ready=None,
            p_free=None):
  """One CTA. Scratch (keywords): ``ql`` the row tile's absorbed queries ``[wgs, 64, part]``; ``qr``
  its rope queries ``[64, d_rope]`` (None where they land in ``p_buf`` and the leader holds them
  in registers); ``union`` the key ring ``([stages, wgs, 64, part], [stages, 64, d_rope])`` whose
  memory the outputs ``([wgs, 64, part] float32, [64] float32 lse)`` reuse; ``p_buf``
  ``[n, 64, 64]``: P shared by the leader (``share``), or each warpgroup's P staging (interpret
  mode); ``a_buf`` ``[64]`` float32: the leader's row factor (its final row sums after the
  loop); barriers as named."""
  wgs, stages = st.wgs, st.num_stages
  part = ql.shape[-1]
  wg = lax.axis_index("wg")
  rt, split, b = lax.axis_index("rows"), lax.axis_index("splits"), lax.axis_index("batch")
  (lat, rope), (o_smem, lse_smem) = union
  row0 = rt * ROWS
  length = lens_ref[b]
  first, end = _key_blocks(st, row0, length)
  # The splits share this element's visited tiles, not the cache's (lengths differ per element).
  per_split = (end - first + st.num_splits - 1) // st.num_splits
  lo = first + split * per_split
  hi = jnp.maximum(lo, jnp.minimum(lo + per_split, end))
  slot_of = lambda j: lax.rem(j - lo, jnp.int32(stages))
  c = st.scale * LOG2E  # base-2 exponents: the scale folded into one multiply
  lower, upper = st.band
  zeros = lambda n: plgpu.layout_cast(jnp.zeros((ROWS, n), jnp.float32), plgpu.Layout.WGMMA)
  row_init = lambda v: _row_layout(jnp.full((ROWS,), v, jnp.float32))

  def wait_tile(slot, parts):
    for p in parts:
      plgpu.barrier_wait(lat_ready.at[p * stages + slot])

  def scores(j, slot, q_rope):
    """The masked score tile of key tile ``j`` (float32 ``[64, BLOCK_K]``, -inf where masked)."""
    wait_tile(slot, range(wgs))
    plgpu.barrier_wait(rope_ready.at[slot])
    pairs = [(ql.at[p], lat.at[slot, p].T) for p in range(wgs)] + [(q_rope, rope.at[slot].T)]
    s = _mma_sum(pairs, (ROWS, BLOCK_K))
    it = lambda dim: plgpu.broadcasted_iota(jnp.int32, (ROWS, BLOCK_K), dim, layout=plgpu.Layout.WGMMA)
    ki = j * BLOCK_K + it(1)
    ok = ki < length
    if upper is not None or lower is not None:
      d = ki - (row0 + it(0)) // st.heads  # key position minus query index
      if upper is not None:
        ok &= d <= upper
      if lower is not None:
        ok &= d >= lower
    return jnp.where(ok, s, -jnp.inf)

  def softmax(s, m, l):
    """``(m', alpha, p, l')``: running max (base 2) and sum after ``s``, the accumulator's factor
    and ``s``'s probabilities."""
    m_new = jnp.maximum(m, s.max(axis=1) * c)
    m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # rows that have seen no valid key
    alpha = jnp.exp2(m - m_safe)
    p = jnp.exp2(s * c - lax.broadcast_in_dim(m_safe, s.shape, [0]))
    return m_new, alpha, p, l * alpha + p.sum(axis=1)

  rescale = lambda acc, alpha: acc * lax.broadcast_in_dim(alpha, acc.shape, [0])

  def pv(acc, p, j, slot, staged=None):
    """``acc + p @ latent[slot, wg-th part]`` for key tile ``j``, its rows past the length
    zeroed first; ``staged``: P's copy in shared memory, read from there (interpret mode, the
    follower) instead of registers."""
    values = lat.at[slot, wg]
    _zero_rows_past(values, j * BLOCK_K, length)
    if staged is None:
      return _mma_acc(acc, p, values)
    return acc + _mma_sum(((staged, values),), acc.shape)

  def finish(acc, l, m=None):
    """Writes this warpgroup's normalised output columns (and with ``m`` the lse) once every
    compute warpgroup is done with the ring, whose memory the outputs reuse."""
    if done is not None:
      plgpu.barrier_arrive(done)
      plgpu.barrier_wait(done)
    empty = l == 0.0
    l = jnp.where(empty, 1.0, l)
    o_smem.at[wg][...] = acc / lax.broadcast_in_dim(l, acc.shape, [0])
    if m is not None:
      lse_smem[...] = jnp.where(empty, -jnp.inf, (m + jnp.log2(l)) * (1.0 / LOG2E))
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(o_smem.at[wg], o_ref.at[b, split, pl.ds(row0, ROWS), pl.ds(wg * part, part)])
    if m is not None:
      plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[b, split, pl.ds(row0, ROWS)])
    plgpu.wait_smem_to_gmem(0)

  def independent():
    """Every compute warpgroup computes the score tile itself (``share`` off)."""
    for i in range(wgs + 1):
      plgpu.barrier_wait(q_bar.at[i])
    # Interpret mode's wgmma reads shared memory only and cannot accumulate in place: P staged.
    staging = p_buf.at[wg] if st.interpret else None

    def step(j, carry):
      acc, m, l = carry
      slot = slot_of(j)
      m, alpha, p, l = softmax(scores(j, slot, qr), m, l)
      acc = rescale(acc, alpha)
      p = p.astype(st.dtype)
      if staging is not None:
        staging[...] = p
        plgpu.commit_smem()
      acc = pv(acc, p, j, slot, staging)
      plgpu.barrier_arrive(free.at[slot])
      return acc, m, l

    acc, m, l = lax.fori_loop(lo, hi, step, (zeros(part), row_init(-jnp.inf), row_init(0.0)))
    finish(acc, l, m)

  def leader():
    """Warpgroup 0 (``share``): the score tile and softmax, P and the row factor handed to the
    follower through ``p_buf`` / ``a_buf``, then its own value columns."""
    for i in range(wgs + 1):
      plgpu.barrier_wait(q_bar.at[i])
    # On the GPU the rope queries arrived in p_buf (before any P) and stay in registers; interpret
    # mode's wgmma reads shared memory only (its rope queries have a buffer, its P is read back).
    q_rope = qr if st.interpret else plgpu.load(p_buf.at[0], layout=plgpu.Layout.WGMMA)

    def step(j, carry):
      acc, m, l = carry
      slot = slot_of(j)
      m, alpha, p, l = softmax(scores(j, slot, q_rope), m, l)
      p = p.astype(st.dtype)

      @pl.when(j > lo)
      def _():
        plgpu.barrier_wait(p_free)  # the follower is done with the last P
      p_buf.at[0][...] = p
      a_buf[...] = alpha
      plgpu.commit_smem()
      plgpu.barrier_arrive(p_ready)
      acc = pv(rescale(acc, alpha), p, j, slot, p_buf.at[0] if st.interpret else None)
      plgpu.barrier_arrive(free.at[slot])
      return acc, m, l

    acc, m, l = lax.fori_loop(lo, hi, step, (zeros(part), row_init(-jnp.inf), row_init(0.0)))

    @pl.when(hi > lo)
    def _():
      plgpu.barrier_wait(p_free)
    a_buf[...] = l
    plgpu.commit_smem()
    plgpu.barrier_arrive(p_ready)
    finish(acc, l, m)

  def follower():
    """Warpgroup 1 (``share``): its value columns from the leader's P and row factors."""
    def step(j, acc):
      slot = slot_of(j)
      plgpu.barrier_wait(p_ready)
      acc = rescale(acc, plgpu.load(a_buf, layout=plgpu.Layout.WGMMA.reduce(1)))
      wait_tile(slot, (1,))
      acc = pv(acc, None, j, slot, p_buf.at[0])
      plgpu.barrier_arrive(p_free)
      plgpu.barrier_arrive(free.at[slot])
      return acc

    acc = lax.fori_loop(lo, hi, step, zeros(part))
    plgpu.barrier_wait(p_ready)
    finish(acc, plgpu.load(a_buf, layout=plgpu.Layout.WGMMA.reduce(1)))

  @pl.when(wg < wgs)
  def _compute():
    # The producer needs few registers; the compute warpgroups share the rest (multiples of 8).
    compute = (REGISTERS_PER_SM // 128 - PRODUCER_REGISTERS) // wgs // 8 * 8
    plgpu.set_max_registers(min(compute, 232), action="increase")
    if not st.share:
      independent()
    else:
      pl.when(wg == 0)(leader)
      pl.when(wg == 1)(follower)

  @pl.when(wg == wgs)
  def _produce():
    plgpu.set_max_registers(PRODUCER_REGISTERS, action="decrease")
    rows = pl.ds(row0, ROWS)
    for p in range(wgs):
      plgpu.copy_gmem_to_smem(ql_ref.at[b, rows, pl.ds(p * part, part)], ql.at[p], q_bar.at[p])
    plgpu.copy_gmem_to_smem(qr_ref.at[b, rows], qr if qr is not None else p_buf.at[0], q_bar.at[wgs])

    @pl.loop(lo, hi)
    def _issue(j):
      slot = slot_of(j)

      @pl.when(j - lo >= stages)
      def _():
        plgpu.barrier_wait(free.at[slot])
      pos = j * BLOCK_K
      if st.page_size is None:
        at = lambda ref, cols: ref.at[b, pl.ds(pos, BLOCK_K), cols]
      else:
        page = table_ref[b, pos // st.page_size]
        at = lambda ref, cols: ref.at[page, pl.ds(pos % st.page_size, BLOCK_K), cols]
      for p in range(wgs):
        plgpu.copy_gmem_to_smem(at(lat_ref, pl.ds(p * part, part)), lat.at[slot, p], lat_ready.at[p * stages + slot])
      plgpu.copy_gmem_to_smem(at(rope_ref, slice(None)), rope.at[slot], rope_ready.at[slot])

    # Every release is observed before the CTA ends (the last ``stages`` were not awaited above).
    @pl.loop(jnp.maximum(hi - stages, lo), hi)
    def _drain(j):
      plgpu.barrier_wait(free.at[slot_of(j)])


combine = forms.combine_splits


def default_splits(batch: int, row_tiles: int, key_tiles: int, sm_count: int) -> int:
  """Key splits per (row tile, element): enough CTAs for one per SM where the batch alone has
  fewer, at most one per key tile."""
  return max(1, min(key_tiles, sm_count // (batch * row_tiles)))


def decode(q_lat, q_rope, kv_latent, k_rope, lengths, *, scale: float, band=(None, None), page_table=None,
           num_splits: int | None = None, num_stages: int | None = None, wgs: int | None = None,
           share_scores: bool | None = None, sm_count: int = 132, interpret: bool = False):
  """Absorbed-form attention over a latent cache: ``(out [B, Tq, H, d_c], lse [B, Tq, H])``.

  Args:
    q_lat: ``[B, Tq, H, d_c]`` (q_nope absorbed through w_uk); q_rope: ``[B, Tq, H, d_rope]``;
      bfloat16 or float16.
    kv_latent, k_rope: ``[B, S, d_c]`` / ``[B, S, d_rope]``, or with ``page_table``
      (``[B, pages_per_seq]`` int32, entries clamped into the pool) the page pools
      ``[num_pages, page_size, d]``, ``page_size`` a power of two >= 64.
    lengths: ``[B]`` int32 valid positions per element (clamped to the cache); positions at or
      past it are never used. Rows without a valid key give zeros and lse ``-inf``.
    scale: the softmax scale; band: ``(lower, upper)``, static: query ``t`` sees position ``k``
      iff ``t + lower <= k <= t + upper`` (None: unbounded), as ``Mask.band_bounds``.
    num_splits, num_stages, wgs: key splits (None: :func:`default_splits`), ring slots (None: the
      most that fit) and compute warpgroups (None: :func:`value_wgs`; ``d_c / wgs`` a multiple of 64).
    share_scores: with two compute warpgroups, the first computes the score tile and softmax and
      hands P to the second (through shared memory) instead of both computing them; None: where
      :func:`can_share`.
    interpret: Pallas Mosaic GPU interpret mode (CPU).
  Returns:
    The output in q_lat's dtype, the natural-log lse float32.
  """
  batch, tq, heads, d_c = q_lat.shape
  d_rope = q_rope.shape[-1]
  paged = page_table is not None
  page_size = kv_latent.shape[1] if paged else None
  kv_len = page_table.shape[1] * page_size if paged else kv_latent.shape[1]
  why = why_not(q_len=tq, d_c=d_c, d_rope=d_rope, dtype=q_lat.dtype, mask_kinds=(), page_size=page_size)
  if why:
    raise ValueError(why)
  wgs = wgs or value_wgs(d_c)
  if wgs > MAX_VALUE_WGS or d_c % (PART * wgs) or d_c // wgs > MAX_PART:
    raise ValueError(f"wgs {wgs}: d_c {d_c} must split into at most {MAX_VALUE_WGS} parts of a multiple of {PART} "
                     f"up to {MAX_PART}")
  share = (wgs == 2 and d_rope == BLOCK_K) if share_scores is None else bool(share_scores)
  if share and (wgs != 2 or d_rope != BLOCK_K):
    raise ValueError(f"share_scores needs two compute warpgroups and d_rope {BLOCK_K}, got {wgs} and {d_rope}")
  itemsize = jnp.dtype(q_lat.dtype).itemsize
  stages = num_stages or fit_stages(d_c, d_rope, itemsize, wgs, share)
  need = smem_bytes(d_c, d_rope, itemsize, stages, wgs, share)
  if not interpret and need > SMEM_SM90:
    raise ValueError(f"num_stages {stages} needs {need} bytes of shared memory; sm_90 has {SMEM_SM90}")
  rows = tq * heads
  row_tiles = -(-rows // ROWS)
  key_tiles = max(1, -(-kv_len // BLOCK_K))
  num_splits = num_splits or default_splits(batch, row_tiles, key_tiles, sm_count)
  lengths = jnp.clip(jnp.asarray(lengths, jnp.int32), 0, kv_len)
  if paged:
    table = jnp.clip(page_table.astype(jnp.int32), 0, kv_latent.shape[0] - 1)
  else:
    table = jnp.zeros((1, 1), jnp.int32)
    # A TMA window cannot exceed its array: a short or odd cache is padded (the one copy); the
    # last key tile otherwise overhangs the cache and reads zeros there.
    s_pad = max(_round_up(kv_len, TMA_ROWS), BLOCK_K)
    if s_pad != kv_len:
      kv_latent, k_rope = (jnp.pad(x, ((0, 0), (0, s_pad - kv_len), (0, 0))) for x in (kv_latent, k_rope))
  rows_pad = row_tiles * ROWS
  pad_rows = lambda x: jnp.pad(x.reshape(batch, rows, -1), ((0, 0), (0, rows_pad - rows), (0, 0)))
  part = d_c // wgs
  dt = q_lat.dtype
  st = _Static(heads, tq, float(scale), tuple(band), page_size, num_splits, stages, wgs, share, jnp.dtype(dt),
               bool(interpret))
  ring = (plgpu.SMEM((stages, wgs, BLOCK_K, part), dt, transforms=TILED),
          plgpu.SMEM((stages, BLOCK_K, d_rope), dt, transforms=TILED))
  outs = (plgpu.SMEM((wgs, ROWS, part), jnp.float32, transforms=TILED_F32), plgpu.SMEM((ROWS,), jnp.float32))
  scratch = dict(
      ql=plgpu.SMEM((wgs, ROWS, part), dt, transforms=TILED),
      union=plgpu.RefUnion(ring, outs),
      q_bar=plgpu.Barrier(num_barriers=wgs + 1),           # the query copies
      lat_ready=plgpu.Barrier(num_barriers=wgs * stages),  # a latent part ready, per part and slot
      rope_ready=plgpu.Barrier(num_barriers=stages),       # a rope tile ready
      free=plgpu.Barrier(num_arrivals=wgs, num_barriers=stages),  # a slot released by every compute warpgroup
  )
  if wgs > 1:  # every compute warpgroup done with the ring, whose memory the outputs reuse
    scratch["done"] = plgpu.Barrier(num_arrivals=wgs)
  if interpret or not share:
    scratch["qr"] = plgpu.SMEM((ROWS, d_rope), dt, transforms=TILED)
  if share or interpret:  # P shared by the leader, or each warpgroup's P staging (interpret mode)
    scratch["p_buf"] = plgpu.SMEM((1 if share else wgs, ROWS, BLOCK_K), dt, transforms=TILED)
  if share:
    scratch.update(a_buf=plgpu.SMEM((ROWS,), jnp.float32), p_ready=plgpu.Barrier(), p_free=plgpu.Barrier())
  o, lse = plgpu.kernel(
      functools.partial(_kernel, st=st),
      out_type=(jax.ShapeDtypeStruct((batch, num_splits, rows_pad, d_c), jnp.float32),
                jax.ShapeDtypeStruct((batch, num_splits, rows_pad), jnp.float32)),
      scratch_types=scratch,
      grid=(row_tiles, num_splits, batch),
      grid_names=("rows", "splits", "batch"),
      num_threads=wgs + 1,
      thread_name="wg",
      compiler_params=plgpu.CompilerParams(approx_math=True),
      interpret=plgpu.InterpretGPUParams() if interpret else False,
      kernel_name="probjax_mla_decode_mosaic",
  )(lengths, table, pad_rows(q_lat), pad_rows(q_rope), kv_latent, k_rope)
  if num_splits == 1:
    out, lse = o[:, 0], lse[:, 0]
  else:
    out, lse = combine(o, lse)
  out = out[:, :rows].reshape(batch, tq, heads, d_c).astype(dt)
  return out, lse[:, :rows].reshape(batch, tq, heads)
