"""Launch configuration of the Mosaic GPU forward kernel, validated against shared memory.

Shared-memory model (:func:`smem_total`): every scratch buffer rounded up to 1 KiB, 8 bytes
per barrier, and 2 KiB that Mosaic GPU reserves. It reproduces the byte counts of the
Mosaic compiler's own errors on sm_90 (235,672 for ``block_k=128, num_stages=3,
compute_wgs=2`` and 235,632 for ``192, 2, 2`` at head_dim 128, bf16, before the schedule
barrier; ``tests/ops/attention/test_mosaic_attention.py::test_smem_model_covers_the_compilers_counts``).
"""

from __future__ import annotations

import dataclasses
import os
import warnings

from probjax.ops.attention.masks import Mask, num_tiles, round_up
from probjax.ops.attention.gpu import smem_limit

SMEM_ALIGN, SMEM_RESERVED = 1024, 2048


def smem_total(buffers: list[int], barriers: int) -> int:
  """Shared-memory bytes of a Mosaic GPU kernel with scratch ``buffers`` (bytes each) and
  ``barriers`` mbarriers."""
  return sum(round_up(b, SMEM_ALIGN) for b in buffers) + 8 * barriers + SMEM_RESERVED


def check_tiles(cfg, blocks: tuple[str, ...], max_wgs: int = 2) -> None:
  """Validates a Mosaic config: the ``blocks`` fields positive multiples of 64 (wgmma tiles),
  ``num_stages >= 2`` (a ring), ``compute_wgs`` from 1 to ``max_wgs``."""
  for name in blocks:
    v = getattr(cfg, name)
    if not isinstance(v, int) or v < 64 or v % 64:
      raise ValueError(f"{name} must be a positive multiple of 64, got {v!r}")
  if not isinstance(cfg.num_stages, int) or cfg.num_stages < 2:
    raise ValueError(f"num_stages must be an int >= 2, got {cfg.num_stages!r}")
  if not isinstance(cfg.compute_wgs, int) or not 1 <= cfg.compute_wgs <= max_wgs:
    raise ValueError(f"compute_wgs must be an int from 1 to {max_wgs}, got {cfg.compute_wgs!r}")


@dataclasses.dataclass(frozen=True)
class MosaicForwardConfig:
  """``block_q`` query rows per compute warpgroup (wgmma's M: 64), ``compute_wgs`` compute
  warpgroups per CTA (two take turns on the tensor cores; three run free with fewer
  registers each, see :func:`.common.registers`), ``block_k`` keys per step, ``num_stages``
  K/V slots in flight; ``persistent``: one CTA per SM looping over the tiles, its producer
  loading the next tile's K/V and each compute warpgroup the next tile's queries while it
  finishes the last (the output goes through a buffer of its own). ``heavy_first``: where
  the mask makes tiles differ in work, the heaviest start first, so that the kernel ends on
  light ones. Persistent, under a causal-like band, per-batch lengths or segment ids: the
  tiles in the order of the key tiles each visits (computed from the mask), alternate waves
  mirrored across the SMs, so each SM's total is near the mean. One CTA per tile, under a
  causal-like band without segment ids: the heaviest query tiles first across groups of
  heads (as the Triton kernels' grids). ``cluster``: 2 runs CTAs in pairs on adjacent query
  tiles of one head, each loading half of every K/V tile and multicasting it to both (TMA
  multicast: half the K/V traffic from L2); both CTAs of a pair visit the same key
  tiles: calls with a band or lengths visit the union of the pair's key ranges (a CTA
  releases the tiles outside its own without computing); segment ids are refused, and the
  query tiles must come in whole pairs. ``overlap``: each compute warpgroup issues the next
  tile's Q K^T together with this tile's P V and runs the next softmax while P V is in flight
  (FA3's intra-warpgroup pipelining), keeping one more P tile in registers. Exact with any
  mask; measured slower where the kernel has masked tiles (see :data:`DEFAULTS`)."""
  block_q: int = 64
  block_k: int = 128
  num_stages: int = 2
  compute_wgs: int = 2
  persistent: bool = False
  heavy_first: bool = True
  cluster: int = 1
  overlap: bool = False

  def __post_init__(self):
    for name in ("persistent", "heavy_first", "overlap"):
      if not isinstance(getattr(self, name), bool):
        raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
    if self.cluster not in (1, 2) or isinstance(self.cluster, bool):
      raise ValueError(f"cluster must be 1 or 2, got {self.cluster!r}")
    if self.block_q != 64:
      raise ValueError(f"block_q must be 64 (one wgmma M tile per warpgroup), got {self.block_q!r}")
    check_tiles(self, ("block_k",), max_wgs=3)

  def own_output_buffer(self, head_dim: int, v_head_dim: int | None = None) -> bool:
    """Whether the output tiles have a buffer of their own: when persistent (the next tile's
    queries load meanwhile) and where values are narrower or wider than queries (the query
    buffer's tiles do not have the output's shape)."""
    return self.persistent or (v_head_dim or head_dim) != head_dim

  def smem_bytes(self, itemsize: int, head_dim: int, v_head_dim: int | None = None) -> int:
    """Query tiles (``head_dim`` wide), output tiles (``v_head_dim`` wide, None: ``head_dim``)
    where :meth:`own_output_buffer`, the K ring (``head_dim``) and the V ring (``v_head_dim``),
    lse rows, query and key segment ids; the barriers of :func:`.forward.forward`."""
    wgs, bq, bk, st = self.compute_wgs, self.block_q, self.block_k, self.num_stages
    dv = v_head_dim or head_dim
    out = [wgs * bq * dv * itemsize] if self.own_output_buffer(head_dim, dv) else []
    return smem_total([wgs * bq * head_dim * itemsize, *out, st * bk * head_dim * itemsize, st * bk * dv * itemsize,
                       wgs * bq * 4, wgs * bq * 4, st * bk * 4], 2 * wgs + 5 * st + 1)


# Why these defaults (evidence: the H200 tile sweep, bench/results/h200/tiles.json, and
# docs/dev/decisions.md, "Settled by probes"): block_k 128 with two compute warpgroups is the
# fastest family at head_dim 64 and 128 (three compute warpgroups are not faster; at head_dim
# 128 deeper rings and block_k 192 do not fit), and persistent CTAs are faster than one CTA per
# tile there; causal calls, whose tiles differ in work, gain from persistence too ("Mosaic
# forward schedules"). Head_dim 256 is unmeasured: the largest ring that fits (not persistent:
# its output buffer would not fit). Head_dim 192 (MLA's q/k width, values 128 wide) is unmeasured:
# block_k 64 leaves room for a deeper ring beside the 192-wide query tiles and the output buffer
# (block_k 128 with two stages does not fit).
# CTA pairs (cluster=2; "CTA pairs with K/V multicast"): faster for unmasked calls at head_dim
# 128 at long lengths, no gain at head_dim 64; under a band, where the pair visits the union of
# its key ranges, they lose below T16384: the default takes pairs at head_dim 128 without a mask.
# overlap ("Intra-warpgroup overlap in the Mosaic forward"): faster without masks, much slower
# with them: ptxas serializes the kernel's wgmmas when a masked loop is compiled in (warning
# C7513: "non wgmma instructions defining input registers of a wgmma"). The PTX shows why: P's
# registers are copied into the P V wgmma's operands after the Q K^T wgmma is issued, where P
# is carried from one of the masked and full-tile loops into the next; the kernel without
# masked tiles has one loop and ptxas folds the copies. Neither a register fence before the
# wgmmas nor one loop with each tile's predicate in a branch (forward.py ``masked_tiles``,
# exact in interpret mode) avoids it, so :func:`fit` keeps overlap for calls without masked
# tiles only: no mask, no score_mod and whole key tiles.
DEFAULTS = {64: MosaicForwardConfig(64, 128, 2, 2, True, overlap=True),
            128: MosaicForwardConfig(64, 128, 2, 2, True, cluster=2, overlap=True),
            192: MosaicForwardConfig(64, 64, 3, 2, True),
            256: MosaicForwardConfig(64, 64, 2, 2, False)}


def cluster_refusal(mask: Mask | None, q_len: int, rows: int, cluster: int) -> str | None:
  """Why CTAs in clusters of ``cluster`` (sharing every K/V tile) cannot compute a call, or
  None: the CTAs of a cluster visit the union of their key ranges, which segment ids do not
  make contiguous, and the query tiles of ``rows`` rows must come in whole clusters."""
  if mask is not None and "segments" in mask.kinds:
    return "clusters share their K/V tiles, which segment ids do not allow"
  if num_tiles(q_len, rows) % cluster:
    return (f"q_len {q_len} has {num_tiles(q_len, rows)} query tiles of {rows} rows, not a "
            f"multiple of the cluster size {cluster}")
  return None


# Interpret mode runs each warpgroup of a CTA (a cluster's CTAs together) as a thread whose
# barrier waits block inside XLA:CPU host callbacks, which run on the CPU client's thread pool:
# one thread per core unless the PJRT_NPROC environment variable (read when JAX creates the
# client) says otherwise. The kernel launch's own callback holds one pool thread while its
# warpgroups run; when blocked waits hold the others, the warpgroup that would arrive at the
# barrier never gets one: a hang at 0% CPU (every time at PJRT_NPROC=1; at two cores, now and
# then even with one compute warpgroup). Default configs there use one compute warpgroup (the
# fewest threads); :func:`warn_if_interpret_may_hang` names the setting that avoids the hang.
INTERPRET_WGS = 1


def warn_if_interpret_may_hang(threads: int) -> None:
  """Warns when the CPU client's thread pool (as PJRT_NPROC, NPROC or the usable cores give it)
  has fewer than ``threads + 1`` threads, what an interpreted kernel of ``threads`` warpgroups
  and its launch can hold at once (see :data:`INTERPRET_WGS`)."""
  cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
  pool = os.environ.get("PJRT_NPROC") or os.environ.get("NPROC") or cores
  if int(pool) < threads + 1:
    warnings.warn(f"Pallas Mosaic GPU interpret mode runs this kernel as {threads} threads whose barrier waits "
                  f"block XLA:CPU's thread pool of {pool}: it can hang. Set PJRT_NPROC={threads + 1} or more "
                  "in the environment before JAX starts.", RuntimeWarning, stacklevel=3)


def fit(config: MosaicForwardConfig | None, itemsize: int, head_dim: int, device: str, *,
        mask: Mask | None = None, q_len: int | None = None, kv_len: int | None = None,
        score_mod: bool = False, v_head_dim: int | None = None) -> MosaicForwardConfig:
  """``config`` (or the default for the wider of ``head_dim``, the q/k width, and ``v_head_dim``,
  the values' width, None: ``head_dim``) checked against ``device``'s shared memory;
  a default that does not fit drops stages, an explicit one raises ``ValueError``. A default
  in CTA pairs runs single CTAs with a mask (pairs are measured without one), where the call
  cannot take pairs (:func:`cluster_refusal`; ``q_len`` None: unknown) and in interpret mode.
  A default with ``overlap`` drops it where the kernel would have masked tiles (a mask, a
  ``score_mod``, a partial last key tile; ``kv_len`` None: unknown), where it is slower."""
  limit = smem_limit(device)
  explicit = config is not None
  cfg = config if explicit else DEFAULTS[max(head_dim, v_head_dim or head_dim)]  # the wider operand's
  if device == "interpret" and not explicit:  # see INTERPRET_WGS
    cfg = dataclasses.replace(cfg, compute_wgs=INTERPRET_WGS, cluster=1)
  if not explicit and cfg.overlap and (mask is not None or score_mod or kv_len is None or kv_len % cfg.block_k):
    cfg = dataclasses.replace(cfg, overlap=False)
  if not explicit and cfg.cluster > 1 and (
      q_len is None or mask is not None or cluster_refusal(None, q_len, cfg.block_q * cfg.compute_wgs, cfg.cluster)):
    cfg = dataclasses.replace(cfg, cluster=1)
  if limit is None:
    return cfg
  while (need := cfg.smem_bytes(itemsize, head_dim, v_head_dim)) > limit:
    if explicit or cfg.num_stages == 2:
      widths = "" if v_head_dim in (None, head_dim) else f", value head_dim {v_head_dim}"
      raise ValueError(f"{cfg} needs {need} bytes of shared memory at head_dim {head_dim}{widths}; "
                       f"{device} has {limit}")
    cfg = dataclasses.replace(cfg, num_stages=cfg.num_stages - 1)
  return cfg
