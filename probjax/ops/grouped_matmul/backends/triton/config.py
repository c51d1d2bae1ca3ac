"""Tile sizes of the Triton grouped matmuls, from the call's shape, dtype and the device.

Blocks are powers of two of at least 16 (``tl.dot``'s minimum), no larger than the next power
of two of the axis they tile, and the streamed operands of all pipeline stages must fit the
device's shared memory per block (unbounded in interpret mode).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from probjax.core.device import Device


@dataclasses.dataclass(frozen=True)
class TileConfig:
  """``block_m`` rows (the ragged axis) by ``block_n`` output columns, ``block_k`` contracted
  per step. For ``tgmm`` the output tile is ``[block_k, block_n]`` (``block_k`` tiles lhs's
  columns) and ``block_m`` rows are contracted per step."""

  block_m: int = 64
  block_n: int = 128
  block_k: int = 64
  num_warps: int = 4
  num_stages: int = 3

  def __post_init__(self):
    for f in ("block_m", "block_n", "block_k"):
      v = getattr(self, f)
      if v < 16 or v & (v - 1):
        raise ValueError(f"TileConfig.{f} must be a power of two >= 16, got {v}")

  def smem_bytes(self, itemsize: int, transposed: bool = False) -> int:
    """Shared memory of the streamed tiles over all stages: ``[block_m, block_k]`` and
    ``[block_k, block_n]`` per stage for ``gmm``, ``[block_m, block_k]`` and
    ``[block_m, block_n]`` for ``tgmm`` (``transposed``)."""
    inner = self.block_m if transposed else self.block_k
    outer = self.block_k if transposed else self.block_m
    return (outer * inner + inner * self.block_n) * itemsize * self.num_stages


def _fit(block: int, size: int) -> int:
  return max(16, min(block, 1 << max(size - 1, 0).bit_length()))


def choose(m: int, k: int, n: int, dtype, device: Device, *, transposed: bool = False,
           base: TileConfig | None = None) -> TileConfig:
  """The tile config of a ``gmm`` (``[m, k] x [k, n]``) or, ``transposed``, a ``tgmm``
  (``[m, k]^T x [m, n]``): ``base`` (default: 64 x 128 x 64, half the contracted block for
  4-byte dtypes) fitted to the shape, stages dropped until the device's shared memory holds
  them."""
  itemsize = np.dtype(dtype).itemsize
  if base is None:
    base = TileConfig(block_k=64 if itemsize <= 2 else 32)
    if transposed:
      base = dataclasses.replace(base, block_m=base.block_k, block_k=64)
  cfg = dataclasses.replace(base, block_m=_fit(base.block_m, m), block_n=_fit(base.block_n, n),
                            block_k=_fit(base.block_k, k),
                            num_stages=base.num_stages if device.kind.startswith("sm_") else 1)
  limit = device.smem_per_block
  while limit is not None and cfg.num_stages > 1 and cfg.smem_bytes(itemsize, transposed) > limit:
    cfg = dataclasses.replace(cfg, num_stages=cfg.num_stages - 1)
  return cfg
