"""The Mosaic GPU backend's registry object: the kernels of this package, over one call."""

from __future__ import annotations

from probjax.ops.attention.backend import AttentionBackend, call_flags


class Mosaic(AttentionBackend):
  """The Pallas Mosaic GPU kernels (sm_90; anywhere in interpret mode)."""

  name = "mosaic"
  # Its own backward, or a Triton one on the same residuals (found by name: :mod:`.registry`).
  backward_pass_impls = ("auto", "triton_onepass", "triton_fused", "triton_split", "mosaic")

  def available(self, device):
    if device.platform != "gpu":
      return f"the Mosaic GPU kernel needs an sm_90 GPU (platform is {device.platform}); use interpret=True to run it on CPU"
    if device.compute_capability not in (None, (9, 0)):
      return "the Mosaic GPU kernel needs an sm_90 (Hopper) GPU, this is " + device.kind
    return None

  def supports(self, call, device):
    why = self.available(device) or call.not_paged("the Mosaic GPU kernel") or call.not_for_kernels()
    if why:
      return why
    from probjax.ops.attention.backends import mosaic_gpu
    # The only backend whose answer depends on the scale (a non-positive one without score_mod).
    return mosaic_gpu.supports(call.q_shape, call.kv_shape, call.dtype, scale=call.scale, interpret=True,
                               backward_pass_impl=call.backward_pass_impl, **call_flags(call))

  def __call__(self, q, k, v, mask, *, call, backward_pass_impl=None):
    from probjax.ops.attention.backends import mosaic_gpu
    return mosaic_gpu.attention(q, k, v, mask=mask, score_mod=call.score_mod, scale=call.scale,
                                backward_pass_impl=backward_pass_impl or call.backward_pass_impl,
                                forward_config=call.forward_config, backward_config=call.backward_config,
                                interpret=call.interpret)

  def forward_kernel(self, q, k, v, mask, *, scale, score_mod, config, interpret):
    from probjax.ops.attention.backends import mosaic_gpu
    return mosaic_gpu.forward_kernel(q, k, v, mask, scale=scale, score_mod=score_mod, config=config,
                                     interpret=interpret)

  def tangent_kernel(self, call, exact):
    from probjax.ops.attention.backends import mosaic_gpu
    return mosaic_gpu.tangent_kernel(call, exact)
