"""The Triton backend's registry object: the kernels of this package, over one call."""

from __future__ import annotations

from probjax.core import pallas_triton
from probjax.ops.attention.backend import AttentionBackend, call_flags


class Triton(AttentionBackend):
  """The fused Pallas-Triton kernels (NVIDIA GPUs; anywhere in interpret mode)."""

  name = "triton"
  aliases = ("pallas",)
  backward_pass_impls = ("auto", "triton_onepass", "triton_fused", "triton_split")
  backward_variants = backward_pass_impls

  def available(self, device):
    return pallas_triton.unavailable(
        device, "the Triton kernel needs an NVIDIA GPU (platform is {platform}); use interpret=True to run it on CPU")

  def supports(self, call, device):
    from probjax.ops.attention.backends import triton
    if call.page_size is not None:  # a paged KV cache: the split-KV decode kernel reads its pages
      return (self.available(device) or call.not_for_kernels()
              or triton.paged_supports(call.q_shape, call.kv_shape, call.dtype, page_size=call.page_size,
                                       device=device, **call_flags(call)))
    from probjax.ops.attention.call import TRITON_MASK_KINDS
    return (self.available(device) or call.not_for_kernels(TRITON_MASK_KINDS)
            or triton.supports(call.q_shape, call.kv_shape, call.dtype, interpret=True, **call_flags(call)))

  def __call__(self, q, k, v, mask, *, call, backward_pass_impl=None):
    from probjax.ops.attention.backends import triton
    return triton.attention(q, k, v, mask=mask, score_mod=call.score_mod, scale=call.scale,
                            backward_pass_impl=backward_pass_impl or call.backward_pass_impl,
                            forward_config=call.forward_config, backward_config=call.backward_config,
                            split_kv=call.split_kv, interpret=call.interpret)

  def paged_kernel(self, q, k_pages, v_pages, page_table, mask, *, call):
    from probjax.ops.attention.backends import triton
    return triton.paged_attention(q, k_pages, v_pages, page_table, mask=mask, scale=call.scale,
                                  split_kv=call.split_kv, interpret=call.interpret)

  def forward_kernel(self, q, k, v, mask, *, scale, score_mod, config, interpret):
    from probjax.ops.attention.backends import triton
    return triton.forward_kernel(q, k, v, scale=scale, score_mod=score_mod, config=config, interpret=interpret)

  def tangent_kernel(self, call, exact):
    from probjax.ops.attention.backends import triton
    return triton.tangent_kernel(call, exact)

  def backward_kernel(self, q, k, v, *, variant, scale, score_mod, config, interpret):
    from probjax.ops.attention.backends import triton
    return triton.backward_kernel(q, k, v, scale=scale, score_mod=score_mod, variant=variant, config=config,
                                  interpret=interpret)
