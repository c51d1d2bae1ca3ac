"""MLA's ``triton`` backend: the absorbed form with the split-KV decode kernel (:mod:`.decode`)
as its attention; forward only, its gradient is the XLA form's (through a custom_vjp)."""

from __future__ import annotations

import jax.numpy as jnp

from probjax.core.backend import Backend
from probjax.core.device import Device
from probjax.core.eager import compile_once
from probjax.ops.mla import forms
from probjax.ops.mla.backends.triton.decode import decode, why_not
from probjax.ops.mla.call import MLACall


class TritonBackend(Backend[MLACall]):
  """The absorbed form with MLA's Pallas Triton decode kernel: KVLenMask (or no mask) only,
  ``d_c`` / ``d_rope`` multiples of 16, contiguous or paged caches (pages of a multiple of 16).
  Off the GPU it runs in Pallas interpret mode."""

  name = "triton"

  def supports(self, call: MLACall, device: Device) -> str | None:
    return why_not(q_len=call.q_len, heads=call.heads, d_c=call.d_c, d_rope=call.d_rope,
                   mask_kinds=call.mask_kinds, page_size=call.page_size)

  def __call__(self, q_nope, q_rope, kv_latent, k_rope, w_uk, w_uv, *, call: MLACall, mask=None,
               page_table=None, device: Device, **_):
    """``[B, Tq, H, d_v]``; ``mask`` (KVLenMask or None) gives the lengths."""
    lengths = mask.lengths(call.batch)[1] if mask is not None else None
    if lengths is None:
      lengths = jnp.full((call.batch,), call.kv_len, jnp.int32)
    return absorbed_decode(q_nope, q_rope, kv_latent, k_rope, w_uk, w_uv, lengths=lengths,
                           page_table=page_table, scale=call.softmax_scale,
                           interpret=device.platform != "gpu")


@compile_once  # eager calls: the kernel compiled once per call description
def absorbed_decode(q_nope, q_rope, kv_latent, k_rope, w_uk, w_uv, *, lengths, page_table, scale,
                    interpret: bool = False):
  """The absorbed form with MLA's Triton decode kernel as its attention (forward only: the
  gradient is the XLA form's, through a custom_vjp); caches contiguous or paged (see
  :func:`probjax.ops.mla.backends.triton.decode`); ``[B, Tq, H, d_v]``."""
  kernel = lambda *a: decode(*a[:5], scale=scale, page_table=a[5], interpret=interpret)[0]
  return forms.absorbed_with_kernel(kernel, q_nope, q_rope, kv_latent, k_rope, w_uk, w_uv, lengths=lengths,
                                    page_table=page_table, scale=scale)
