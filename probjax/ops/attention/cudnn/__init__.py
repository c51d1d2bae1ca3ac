"""The cuDNN route: ``jax.nn.dot_product_attention(implementation="cudnn")``.

cuDNN's fused attention takes no probjax mask beyond per-batch key lengths and
equal-length causal masking, no dropout or score_mod here, 16-bit inputs only
and head_dim a multiple of 8 up to 128 (jax.nn's checks). :func:`supports`
names the first reason a call is outside that set.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from probjax.ops.attention.masks import Mask

MAX_HEAD_DIM = 128


def supports(q_shape, kv_shape, dtype, *, mask: Mask | None = None, score_mod=None, bias=False,
             dense_mask=False, dropout=False, platform: str | None = None) -> str | None:
  """None if cuDNN computes the call exactly, else the reason it cannot."""
  platform = platform or jax.default_backend()
  if platform != "gpu":
    return f"cuDNN needs an NVIDIA GPU (platform is {platform})"
  if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
    return f"cuDNN attention takes bfloat16/float16 only, got {jnp.dtype(dtype).name}"
  d = q_shape[-1]
  if d % 8 or d > MAX_HEAD_DIM:
    return f"head_dim {d} is not a multiple of 8 up to {MAX_HEAD_DIM}"
  if bias or dense_mask:
    return "additive bias / dense boolean mask are not routed to cuDNN"
  if dropout:
    return "dropout"
  if score_mod is not None:
    return "score_mod"
  if mask is not None and mask.components:
    equal_causal = mask.is_causal(0) and q_shape[1] == kv_shape[1]
    if not (mask.is_kv_lengths_only() or equal_causal):
      return f"mask {mask.name!r}: cuDNN takes only KVLenMask or equal-length CausalMask()"
  return None


def attention(q, k, v, *, mask: Mask | None = None, scale: float):
  """q ``[B, Tq, H, D]``, k/v ``[B, Tkv, Hkv, D]`` (bf16/fp16) → ``[B, Tq, H, D]`` via cuDNN."""
  causal = mask is not None and mask.is_causal(0)
  kv_lengths = None
  if mask is not None and mask.kv_lengths is not None:
    kv_lengths = jnp.broadcast_to(mask.kv_lengths, (q.shape[0],)).astype(jnp.int32)
  out = jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=causal,
                                     key_value_seq_lengths=kv_lengths, implementation="cudnn")
  if kv_lengths is not None:  # rows with no valid key are zeros, as on every other path
    out = jnp.where((kv_lengths > 0)[:, None, None, None], out, 0).astype(out.dtype)
  return out
