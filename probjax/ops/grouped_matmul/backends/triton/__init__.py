"""The Pallas-Triton backend: both products as Triton kernels (:mod:`.kernels`), any float
dtype (float64 in interpret mode only), any shape."""

from __future__ import annotations

from probjax.core import pallas_triton
from probjax.core.device import Device
from probjax.ops.grouped_matmul.backends.triton import config, kernels
from probjax.ops.grouped_matmul.base import GroupedMatmulBackend
from probjax.ops.grouped_matmul.call import GroupedMatmulCall

__all__ = ["TritonBackend", "config", "kernels"]


def kernel_device(interpret: bool) -> Device:
  """The device a kernel is configured for: the interpreter's, or the current one."""
  return Device.interpreter() if interpret else Device.current()


class TritonBackend(GroupedMatmulBackend):
  name = "triton"
  aliases = ("pallas_triton",)

  def available(self, device: Device) -> str | None:
    return pallas_triton.unavailable(device)

  def supports(self, call: GroupedMatmulCall, device: Device) -> str | None:
    return self.available(device) or pallas_triton.float64_refusal(call.dtype, device, "operands")

  def gmm(self, lhs, rhs, group_sizes, *, call: GroupedMatmulCall):
    cfg = config.choose(call.m, call.k, call.n, call.dtype, kernel_device(call.interpret))
    return kernels.gmm(lhs, rhs, group_sizes, cfg=cfg, out_dtype=call.out_dtype,
                       transpose_rhs=call.transpose_rhs, interpret=call.interpret)

  def tgmm(self, a, b, group_sizes, *, call: GroupedMatmulCall):
    cfg = config.choose(call.m, a.shape[1], b.shape[1], call.dtype, kernel_device(call.interpret),
                        transposed=True)
    return kernels.tgmm(a, b, group_sizes, cfg=cfg, out_dtype=call.dtype, interpret=call.interpret)
