"""MLA's ``triton`` backend: the absorbed form with the split-KV decode kernel (:mod:`.decode`)
as its attention; forward only, its gradient is the XLA form's (through a custom_vjp)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from probjax.core.backend import Backend
from probjax.core.device import Device
from probjax.core.eager import compile_once
from probjax.ops.attention import KVLenMask, dot_product_attention
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


def _attend_xla(q_lat, q_rope, kv_latent, k_rope, lengths, page_table, scale):
  """The absorbed form's attention alone on XLA: ``[B, Tq, H, d_c]``."""
  if page_table is not None:
    kv_latent, k_rope = forms.gather_pages(kv_latent, page_table), forms.gather_pages(k_rope, page_table)
  ok = forms.valid_positions(lengths, kv_latent.shape[1])
  kv_latent, k_rope = jnp.where(ok, kv_latent, 0), jnp.where(ok, k_rope, 0)
  q = jnp.concatenate([q_lat, q_rope], -1)
  k = jnp.concatenate([kv_latent, k_rope], -1)[:, :, None, :]
  return dot_product_attention(q, k, kv_latent[:, :, None, :], mask=KVLenMask(lengths), scale=scale,
                               implementation="xla")


@compile_once  # eager calls: the kernel compiled once per call description
def absorbed_decode(q_nope, q_rope, kv_latent, k_rope, w_uk, w_uv, *, lengths, page_table, scale,
                    interpret: bool = False):
  """The absorbed form with MLA's Triton decode kernel as its attention (forward only: the
  gradient is the XLA form's, through a custom_vjp); caches contiguous or paged (see
  :func:`probjax.ops.mla.backends.triton.decode`); ``[B, Tq, H, d_v]``."""

  @jax.custom_vjp
  def attend(q_lat, q_rope, kv_latent, k_rope, lengths, page_table):
    return decode(q_lat, q_rope, kv_latent, k_rope, lengths, scale=scale, page_table=page_table,
                  interpret=interpret)[0]

  def fwd(*args):
    return attend(*args), args

  def bwd(args, g):
    xla = lambda a, b, c, d: _attend_xla(a, b, c, d, args[4], args[5], scale)
    return (*jax.vjp(xla, *args[:4])[1](g), None, None)

  attend.defvjp(fwd, bwd)
  dt = q_nope.dtype
  q_lat = forms.project("bthd,chd->bthc", q_nope, w_uk, dt)
  o_lat = attend(q_lat, q_rope, kv_latent, k_rope, jnp.asarray(lengths, jnp.int32), page_table)
  return forms.project("bthc,chd->bthd", o_lat, w_uv, dt)
