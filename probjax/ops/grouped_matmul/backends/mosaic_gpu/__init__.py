"""The Pallas Mosaic GPU backend (sm_90): both products as wgmma kernels (:mod:`.kernels`).

It computes 16-bit operands (wgmma's shared-memory operands here are bfloat16 or float16),
with K and N multiples of 64: the TMA copies use the 128-byte swizzle, whose 64-element tile
an array's minor axis must fill. A row count off TMA's 8-row tiling (or below one tile) is
padded with rows past the groups, a copy of the operands that M = tokens x top_k with an even
top_k never needs.
"""

from __future__ import annotations

import jax.numpy as jnp

from probjax.core.device import Device
from probjax.ops.grouped_matmul.backends.mosaic_gpu import kernels
from probjax.ops.grouped_matmul.backends.mosaic_gpu.kernels import MosaicConfig
from probjax.ops.grouped_matmul.base import GroupedMatmulBackend
from probjax.ops.grouped_matmul.call import GroupedMatmulCall

__all__ = ["MosaicBackend", "MosaicConfig", "config", "kernels"]

TMA_ROWS = 8
MINOR_TILE = 64
# Persistent CTAs in interpret mode, which runs them one after the other (each as one thread,
# the kernels having one warpgroup): two cover the persistent loop's split of the tiles.
INTERPRET_SMS = 2


def config(p: int, q: int, device: Device, *, transposed: bool = False) -> MosaicConfig:
  """The tiles of a ``gmm`` with ``q`` output columns or, ``transposed``, a ``tgmm`` with a
  ``[p, q]`` output: 128 by 128 on the GPU (64 along an axis shorter than 128), 64 contracted
  per step; 64 by 64 in interpret mode."""
  if device.interpret:
    return MosaicConfig(block_m=64, block_n=64, block_k=64, stages=2)
  return MosaicConfig(block_m=128 if not transposed or p >= 128 else 64, block_n=128 if q >= 128 else 64,
                      block_k=64, stages=4)


def _kernel_device(interpret: bool) -> Device:
  return Device.interpreter() if interpret else Device.current()


def _pad_rows(x, rows: int):
  return x if x.shape[0] == rows else jnp.pad(x, ((0, rows - x.shape[0]), (0, 0)))


def _rows(m: int, block: int) -> int:
  return max(-(-m // TMA_ROWS) * TMA_ROWS, block)


class MosaicBackend(GroupedMatmulBackend):
  name = "mosaic"
  aliases = ("mosaic_gpu",)

  def available(self, device: Device) -> str | None:
    if device.interpret or device.kind == "sm_90":
      return None
    return f"Mosaic GPU's wgmma and TMA kernels need sm_90 (or interpret mode), not {device.kind}"

  def supports(self, call: GroupedMatmulCall, device: Device) -> str | None:
    if (why := self.available(device)) is not None:
      return why
    if call.dtype not in ("bfloat16", "float16"):
      return f"{call.dtype} operands: the wgmma kernels take bfloat16 or float16"
    if call.out_dtype not in ("bfloat16", "float16", "float32"):
      return f"{call.out_dtype} output: the kernels store 16-bit or float32"
    if call.k % MINOR_TILE or call.n % MINOR_TILE:
      return (f"K = {call.k}, N = {call.n}: both must be multiples of {MINOR_TILE} (the TMA copies' "
              f"128-byte swizzle tile)")
    return None

  def gmm(self, lhs, rhs, group_sizes, *, call: GroupedMatmulCall):
    device = _kernel_device(call.interpret)
    cfg = config(call.k, call.n, device)
    m = _rows(call.m, cfg.block_m)
    num_sms = INTERPRET_SMS if device.interpret else device.num_sms
    out = kernels.gmm(_pad_rows(lhs, m), rhs, group_sizes, cfg=cfg, out_dtype=call.out_dtype,
                      transpose_rhs=call.transpose_rhs, num_sms=num_sms, interpret=call.interpret)
    return out[:call.m] if m != call.m else out

  def tgmm(self, a, b, group_sizes, *, call: GroupedMatmulCall):
    device = _kernel_device(call.interpret)
    cfg = config(a.shape[1], b.shape[1], device, transposed=True)
    m = _rows(call.m, cfg.block_k)
    num_sms = INTERPRET_SMS if device.interpret else device.num_sms
    return kernels.tgmm(_pad_rows(a, m), _pad_rows(b, m), group_sizes, cfg=cfg, out_dtype=call.dtype,
                        num_sms=num_sms, interpret=call.interpret)

