"""MLA's ``mosaic`` backend: the absorbed form with the Mosaic GPU split-KV decode kernel
(:mod:`.decode`) as its attention; forward only, its gradient is the XLA form's (through a
custom_vjp). Reached by ``implementation="mosaic"`` (alias ``"mosaic_gpu"``), and by the default where the
device's tuning names it for the call's query rows (``decode_kernels`` in
``probjax/ops/mla/tuning/<device>.json``, read by :mod:`probjax.ops.mla.dispatch`)."""

from __future__ import annotations

import jax.numpy as jnp

from probjax.core.backend import Backend
from probjax.core.device import Device
from probjax.core.eager import compile_once
from probjax.ops.mla import forms
from probjax.ops.mla.backends.mosaic_gpu.decode import decode, why_not
from probjax.ops.mla.call import MLACall


class MosaicBackend(Backend[MLACall]):
  """The absorbed form with MLA's Pallas Mosaic GPU decode kernel: sm_90 (off the GPU, Pallas
  interpret mode), bfloat16 or float16, 1 to 4 queries, KVLenMask and a causal band (or no mask),
  ``d_c`` a multiple of 64 up to 256 or of 128 up to 512, ``d_rope`` a multiple of 64,
  contiguous or paged caches (pages a power of two >= 64)."""

  name = "mosaic"
  aliases = ("mosaic_gpu",)

  def available(self, device: Device) -> str | None:
    if device.interpret:
      return None
    if device.platform == "gpu" and device.compute_capability not in (None, (9, 0)):
      return f"the Mosaic GPU decode kernel needs an sm_90 (Hopper) GPU, this is {device.kind}"
    if device.platform not in ("gpu", "cpu"):
      return f"the Mosaic GPU decode kernel runs on an sm_90 GPU or in interpret mode on CPU, not {device.platform}"
    return None

  def supports(self, call: MLACall, device: Device) -> str | None:
    return self.available(device) or why_not(q_len=call.q_len, d_c=call.d_c, d_rope=call.d_rope, dtype=call.dtype,
                                             mask_kinds=call.mask_kinds, page_size=call.page_size)

  def __call__(self, q_nope, q_rope, kv_latent, k_rope, w_uk, w_uv, *, call: MLACall, mask=None,
               page_table=None, device: Device, **_):
    """``[B, Tq, H, d_v]``; ``mask`` (KVLenMask, a band, both, or None) gives the lengths and
    the band."""
    lengths = mask.lengths(call.batch)[1] if mask is not None else None
    if lengths is None:
      lengths = jnp.full((call.batch,), call.kv_len, jnp.int32)
    band = mask.band_bounds if mask is not None else (None, None)
    return absorbed_decode(q_nope, q_rope, kv_latent, k_rope, w_uk, w_uv, lengths=lengths, band=band,
                           page_table=page_table, scale=call.softmax_scale,
                           sm_count=device.num_sms, interpret=device.interpret or device.platform != "gpu")


# Interpret mode stands in for an H200's SMs with a few CTAs (each simulated in turn): the key
# splits then still run, over several key tiles each.
INTERPRET_SMS = 4


@compile_once  # eager calls: the kernel compiled once per call description
def absorbed_decode(q_nope, q_rope, kv_latent, k_rope, w_uk, w_uv, *, lengths, band, page_table, scale,
                    sm_count: int = 132, interpret: bool = False):
  """The absorbed form with MLA's Mosaic GPU decode kernel as its attention (forward only: the
  gradient is the XLA form's, through a custom_vjp); caches contiguous or paged (see
  :func:`probjax.ops.mla.backends.mosaic_gpu.decode`); ``[B, Tq, H, d_v]``."""
  kernel = lambda *a: decode(*a[:5], scale=scale, band=band, page_table=a[5],
                             sm_count=INTERPRET_SMS if interpret else sm_count, interpret=interpret)[0]
  return forms.absorbed_with_kernel(kernel, q_nope, q_rope, kv_latent, k_rope, w_uk, w_uv, lengths=lengths,
                                    page_table=page_table, scale=scale, band=band)
