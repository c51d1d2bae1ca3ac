"""The cuDNN backend's registry object."""

from __future__ import annotations

from probjax.ops.attention.backend import AttentionBackend, call_flags
from probjax.ops.attention.base import check_kernel_call


class Cudnn(AttentionBackend):
  """cuDNN's fused attention, for the calls it computes exactly (NVIDIA GPUs, 16-bit)."""

  name = "cudnn"

  def available(self, device):
    if device.interpret:
      return "cuDNN has no interpret mode (interpret=True emulates only the Pallas kernels, Triton and Mosaic)"
    if device.platform != "gpu":
      return f"cuDNN needs an NVIDIA GPU (platform is {device.platform})"
    return None

  def supports(self, call, device):
    from probjax.ops.attention.backends import cudnn
    return (self.available(device) or call.not_paged("cuDNN") or call.not_for_kernels()
            or cudnn.supports(call.q_shape, call.kv_shape, call.dtype, platform="gpu",
                              compute_capability=device.compute_capability, **call_flags(call)))

  def __call__(self, q, k, v, mask, *, call, backward_pass_impl=None):
    from probjax.ops.attention.backends import cudnn
    from probjax.ops.attention.backends.cudnn.config import CudnnConfig
    # A caller whose call description did not carry the value width must not reach cuDNN with
    # values it refuses (the Pallas backends check inside their own ``attention``).
    check_kernel_call(self.name, cudnn.supports(q.shape, k.shape, q.dtype, mask=mask, v_head_dim=v.shape[-1],
                                                platform="gpu"), q, k, v, mask)
    config = call.forward_config if isinstance(call.forward_config, CudnnConfig) else None
    return cudnn.attention(q, k, v, mask=mask, scale=call.scale, config=config)
