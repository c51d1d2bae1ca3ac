"""Fused flash-attention kernels in Pallas with the Triton backend.

:func:`attention` computes ``softmax(score_mod(scale * q k^T) | mask) v`` with
float32 online softmax, native GQA/MQA (query head ``h`` reads KV head
``h // G``), tile skipping from :class:`~probjax.ops.attention.masks.Mask` and
three backward kernels (see :mod:`.backward`). Values may be narrower or wider than queries
and keys (multi-head latent attention: q/k 192, v 128). :func:`supports` says whether a
call is computed exactly by these kernels; the dispatcher uses it to choose.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

import jax
import jax.numpy as jnp

from probjax.core import pallas_triton
from probjax.core.device import Device
from probjax.ops.attention import vjp
from probjax.ops.attention.base import check_kernel_call, score_mod_reason
from probjax.ops.attention.call import TRITON_MASK_KINDS
from probjax.ops.attention.gpu import triton_lowerable  # (re-exported)
from probjax.ops.attention.masks import Mask
from probjax.ops.attention.backends.triton import config as config_lib
from probjax.ops.attention.backends.triton import backward as backward_lib
from probjax.ops.attention.backends.triton.config import BackwardConfig, ForwardConfig, SplitKVConfig
from probjax.ops.attention.backends.triton import decode as decode_lib
from probjax.ops.attention.backends.triton import forward as forward_lib
from probjax.ops.attention.backends.triton import jvp as jvp_lib
from probjax.ops.attention.backends.triton import tiles as tiles_lib
from probjax.ops.attention.backends.triton.tiles import padded_head_dim

__all__ = ["attention", "supports", "paged_attention", "paged_supports", "forward_kernel", "backward_kernel", "ForwardConfig", "BackwardConfig", "SplitKVConfig"]

_HEAD_DIMS_MAX = 256
_DTYPES = ("bfloat16", "float16", "float32")


def supports(q_shape, kv_shape, dtype, *, mask: Mask | None = None,
             score_mod: Callable | None = None, bias: bool = False, dense_mask: bool = False,
             dropout: bool = False, interpret: bool = False, v_head_dim: int | None = None) -> str | None:
  """None if :func:`attention` computes the call exactly, else a short reason.

  Args:
    q_shape: ``(batch, q_len, heads, head_dim)``; kv_shape: the keys', ``(batch, kv_len, kv_heads, head_dim)``.
    v_head_dim: the values' head_dim, at most 256 like ``head_dim`` (None: ``head_dim``).
    bias, dense_mask, dropout: whether the call has them (the kernels do not).
  """
  if bias:
    return "additive bias"
  if dense_mask:
    return "dense boolean mask"
  if dropout:
    return "dropout"
  if (why := pallas_triton.unavailable(Device(jax.devices()[0].platform, interpret=interpret),
                                       "platform {platform} without interpret")):
    return why
  if _dtype_name(dtype) not in _DTYPES:
    return f"dtype {_dtype_name(dtype)}"
  if len(q_shape) != 4 or len(kv_shape) != 4:
    return "inputs must be [batch, seq, heads, head_dim]"
  d = q_shape[-1]
  if d > _HEAD_DIMS_MAX:
    return f"head_dim {d} > {_HEAD_DIMS_MAX}"
  if kv_shape[-1] != d:
    return f"k head_dim {kv_shape[-1]} != q head_dim {d}"
  if v_head_dim is not None and not 0 < v_head_dim <= _HEAD_DIMS_MAX:
    return f"value head_dim {v_head_dim} not in [1, {_HEAD_DIMS_MAX}]"
  if q_shape[2] % kv_shape[2]:
    return f"heads {q_shape[2]} not a multiple of kv_heads {kv_shape[2]}"
  if q_shape[0] != kv_shape[0]:
    return "batch mismatch"
  if q_shape[1] == 0 or kv_shape[1] == 0:
    return "empty sequence"
  if mask is not None and not isinstance(mask, Mask):
    return f"mask of type {type(mask).__name__}"
  if mask is not None and (why := mask.refusal(TRITON_MASK_KINDS, "the Triton kernel")
                           or tiles_lib.mask_function_reason(mask)):
    return why
  return score_mod_reason(score_mod) or triton_lowerable(score_mod, grad=True)


def _dtype_name(dtype) -> str:
  return jnp.dtype(dtype).name


def paged_supports(q_shape, kv_shape, dtype, *, page_size: int, mask: Mask | None = None,
                   score_mod: Callable | None = None, bias: bool = False, dense_mask: bool = False,
                   dropout: bool = False, v_head_dim: int | None = None, device=None) -> str | None:
  """None if :func:`paged_attention` computes a paged call exactly, else a short reason.
  ``kv_shape``: the contiguous shape the pages stand for; ``device``: a
  :class:`~probjax.core.device.Device` (None: interpret mode), whose shared memory the tiles
  must fit. Besides :func:`supports`' conditions: the key lengths in the mask, and a call the
  split-KV decode kernel takes (at most 64 queries, no ``score_mod``, pages of a multiple of 16)."""
  why = supports(q_shape, kv_shape, dtype, mask=mask, score_mod=score_mod, bias=bias, dense_mask=dense_mask,
                 dropout=dropout, interpret=True, v_head_dim=v_head_dim)
  if why:
    return why
  if mask is None or "kv_lengths" not in mask.kinds:
    return "a paged KV cache needs the key lengths (KVLenMask)"
  cc = None if device is None else device.compute_capability
  try:
    decode_lib.plan(q_shape, kv_shape, dtype, mask=mask, score_mod=score_mod, split_kv=None,
                    device="sm_%d%d" % cc if cc else "interpret", v_head_dim=v_head_dim, page_size=page_size)
  except ValueError as e:
    return str(e)
  return None


def paged_attention(q, k_pages, v_pages, page_table, *, mask: Mask, scale: float | None = None,
                    split_kv: bool | SplitKVConfig | None = None, interpret: bool = False):
  """Decoding attention over a paged KV cache by the split-KV kernel (:mod:`.decode`), reading
  the pages in place; forward only.

  Args:
    q: ``[batch, q_len, heads, head_dim]`` (at most 64 queries).
    k_pages, v_pages: page pools ``[num_pages, page_size, kv_heads, head_dim]`` (``v_pages``'
      head_dim may differ); ``page_size`` a multiple of 16 (the key block divides the page).
    page_table: ``[batch, pages_per_seq]`` integers; an entry outside ``[0, num_pages)`` reads
      page 0 and its positions get zero weight.
    mask: holds the key lengths (``KVLenMask``; a band, query lengths or segments too).
    split_kv: None or True (the splits fitted to the device) or a :class:`SplitKVConfig`.
  Returns:
    ``[batch, q_len, heads, v_head_dim]`` in q's dtype.
  """
  page_size = k_pages.shape[1]
  kv_shape = (q.shape[0], page_table.shape[1] * page_size) + tuple(k_pages.shape[2:])
  why = paged_supports(q.shape, kv_shape, q.dtype, page_size=page_size, mask=mask, v_head_dim=v_pages.shape[-1])
  if why:
    raise ValueError(f"triton attention cannot compute this paged call: {why}")
  mask.validate(q.shape[0], q.shape[1], kv_shape[1])
  scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
  cfg = decode_lib.plan(q.shape, kv_shape, q.dtype, mask=mask, score_mod=None, split_kv=split_kv,
                        device=config_lib.kernel_device(interpret), v_head_dim=v_pages.shape[-1], page_size=page_size)
  return decode_lib.forward(q, k_pages, v_pages, mask, scale=float(scale), config=cfg, interpret=interpret,
                            page_table=page_table)


def attention(q, k, v, *, mask: Mask | None = None, score_mod: Callable | None = None,
              scale: float | None = None, backward_pass_impl: str = "auto",
              forward_config: ForwardConfig | None = None,
              backward_config: BackwardConfig | None = None,
              split_kv: bool | SplitKVConfig | None = None, interpret: bool = False):
  """Fused exact attention.

  Args:
    q: ``[batch, q_len, heads, head_dim]``; k: ``[batch, kv_len, kv_heads, head_dim]``;
      v: ``[batch, kv_len, kv_heads, v_head_dim]`` (``v_head_dim`` at most 256, may differ from
      ``head_dim``); ``heads % kv_heads == 0``; bfloat16, float16 or float32 (TF32 dots).
    mask: position mask; rows with no valid key give 0 (and zero gradients).
    score_mod: ``f(score, b, h, q_idx, kv_idx) -> score`` on float32 tiles
      (``score`` ``[bq, bk]``, ``b``/``h`` scalars, ``q_idx`` ``[bq, 1]``,
      ``kv_idx`` ``[1, bk]``), applied after scaling and before masking; it
      must not close over arrays (see :func:`supports`).
    scale: score scale, default ``1/sqrt(head_dim)``.
    backward_pass_impl: ``"auto"``, ``"triton_onepass"`` (nondeterministic dQ),
      ``"triton_fused"`` or ``"triton_split"``.
    forward_config, backward_config: explicit tiles (validated against the
      device's shared memory); None picks them from the tuned tables.
    split_kv: the split-KV forward for decoding (:mod:`.decode`): None picks it
      for at most 64 queries against at least 1024 keys when two or more splits
      fill the device better, or one split packs a GQA group's heads; False never;
      True or a :class:`SplitKVConfig` whenever it can take the call (ValueError
      otherwise). It computes the
      output only: under ``jax.grad`` the regular forward runs.
    interpret: run the kernels in Pallas interpret mode (CPU testing).
  Returns:
    ``[batch, q_len, heads, v_head_dim]`` in q's dtype.
  """
  check_kernel_call("triton", supports(q.shape, k.shape, q.dtype, mask=mask, score_mod=score_mod,
                                      interpret=interpret, v_head_dim=v.shape[-1]), q, k, v, mask)
  if scale is None:
    scale = 1.0 / math.sqrt(q.shape[-1])
  device, fcfg, impl, bcfg = _configs(q, k, v, forward_config, backward_config, backward_pass_impl,
                                      interpret, _has_mask_mod(mask))
  split = decode_lib.plan(q.shape, k.shape, q.dtype, mask=mask, score_mod=score_mod,
                          split_kv=split_kv, device=device, v_head_dim=v.shape[-1])
  st = _Static(score_mod, float(scale), fcfg, bcfg, impl, split, bool(interpret))
  kernel = lambda fn: vjp.Kernel(fn, st, _partitioned(score_mod, mask))
  return vjp.attention(kernel(_forward_shard), kernel(_backward_shard), q, k, v, mask,
                       primal=None if split is None else kernel(_decode_shard))


def forward_kernel(q, k, v, *, scale: float, score_mod: Callable | None = None,
                   config: ForwardConfig | None = None, interpret: bool = False) -> vjp.Kernel:
  """The Triton forward as a pass with its residuals, ``(out, lse [batch, heads, q_len])``, for a
  caller that combines blocks by their log-sum-exp (context parallelism) or pairs it with
  another backward. ``config``: its tiles (None: fitted to the device). Inputs validated by the
  caller (:func:`supports`)."""
  fcfg = _forward_config(q, k, v, config, config_lib.kernel_device(interpret))
  st = _Static(score_mod, float(scale), fcfg, None, "", None, bool(interpret))
  return vjp.Kernel(_forward_shard, st, _partitioned(score_mod))


def tangent_kernel(call, exact: Callable) -> Callable | None:
  """The fused forward + jvp kernel (:mod:`.jvp`) as ``f(q, k, v, mask, q_dot, k_dot, v_dot) ->
  out_dot`` for an :class:`~probjax.ops.attention.call.AttentionCall` this backend computes, or
  None where it cannot take the call (a ``score_mod``: the tangent is then ``exact``'s jvp)."""
  if jvp_lib.supports(call.score_mod) is not None:
    return None
  q = jax.ShapeDtypeStruct(call.q_shape, call.dtype)
  k = jax.ShapeDtypeStruct(call.kv_shape, call.dtype)
  v = jax.ShapeDtypeStruct(call.kv_shape[:-1] + (call.v_head_dim or call.kv_shape[-1],), call.dtype)
  scale = 1.0 / math.sqrt(call.q_shape[-1]) if call.scale is None else call.scale
  config = _forward_config(q, k, v, call.forward_config, config_lib.kernel_device(call.interpret),
                           _has_mask_mod(call.mask))
  return jvp_lib.tangent(exact, scale=scale, config=config, interpret=call.interpret,
                         partitioned=_partitioned(None, call.mask))


def backward_kernel(q, k, v, *, scale: float, score_mod: Callable | None = None, variant: str = "auto",
                    config: BackwardConfig | None = None, interpret: bool = False) -> vjp.Kernel:
  """The Triton backward as a pass that another backend's forward pairs with
  (:func:`probjax.ops.attention.vjp.attention`: the residuals are the output and the natural
  log-sum-exp every fused forward saves). ``variant``: ``"auto"`` or a ``"triton_*"``
  backward; ``config``: its tiles (None: fitted to the device). Inputs validated by the caller."""
  impl, bcfg = _backward_config(q, k, v, config, variant, config_lib.kernel_device(interpret))
  st = _Static(score_mod, float(scale), None, bcfg, impl, None, bool(interpret))
  return vjp.Kernel(_backward_shard, st, _partitioned(score_mod))


def _has_mask_mod(mask: Mask | None) -> bool:
  """Whether the kernels evaluate a mask_mod, which costs shared memory
  (:func:`config.mask_mod_smem_bytes`)."""
  return mask is not None and "mask_mod" in mask.kinds


def _configs(q, k, v, forward_config, backward_config, backward_pass_impl: str, interpret: bool,
             mask_mod: bool = False):
  """``(device, forward config, backward variant, backward config)`` of a call, fitted to the
  device (``"interpret"`` in interpret mode); ``mask_mod``: the call's mask has one."""
  device = config_lib.kernel_device(interpret)
  return (device, _forward_config(q, k, v, forward_config, device, mask_mod),
          *_backward_config(q, k, v, backward_config, backward_pass_impl, device, mask_mod))


def _forward_config(q, k, v, config, device: str, mask_mod: bool = False) -> ForwardConfig:
  """The forward's tiles fitted to the device (both head widths padded as the kernel loads them)."""
  return config_lib.fit_forward_config(config, q.dtype, padded_head_dim(q.shape[-1]), q.shape[1], k.shape[1],
                                       device, padded_head_dim(v.shape[-1]), mask_mod)


def _backward_config(q, k, v, config, variant: str, device: str, mask_mod: bool = False):
  """``(backward variant, its config)`` fitted to the device: the variant rules read the wider
  of the two head widths (their tables were tuned with every operand that wide) and the tiles
  fit both widths' shared memory."""
  d, dv, q_len, kv_len = q.shape[-1], v.shape[-1], q.shape[1], k.shape[1]
  impl = config_lib.resolve_backward_impl(variant, device, q.dtype, max(d, dv), q_len, kv_len)
  return impl, config_lib.fit_backward_config(config, q.dtype, padded_head_dim(d), q_len, kv_len, device, impl,
                                              padded_head_dim(dv), mask_mod)


@dataclasses.dataclass(frozen=True)
class _Static:
  """The kernels' static arguments (one bundle for the forward, split-KV and backward passes;
  a backward paired with another backend's forward has no forward config)."""

  score_mod: Callable | None
  scale: float
  fcfg: ForwardConfig | None
  bcfg: BackwardConfig | None
  impl: str
  split: SplitKVConfig | None
  interpret: bool


def _partitioned(score_mod: Callable | None, mask: Mask | None = None) -> bool:
  """Whether the kernels run per shard of batch and heads (:func:`sharding.masked_call`): not
  with a ``score_mod`` or a mask_mod (they see global batch and head indices)."""
  return score_mod is None and (mask is None or "mask_mod" not in mask.kinds)


def _decode_shard(st: _Static, q, k, v, mask):
  return (decode_lib.forward(q, k, v, mask, scale=st.scale, config=st.split, interpret=st.interpret),)


def _forward_shard(st: _Static, q, k, v, mask):
  return forward_lib.forward(q, k, v, mask, scale=st.scale, score_mod=st.score_mod,
                             config=st.fcfg, interpret=st.interpret)


def _backward_shard(st: _Static, q, k, v, out, lse, do, mask):
  return backward_lib.backward(q, k, v, out, lse, do, mask, scale=st.scale, score_mod=st.score_mod,
                               impl=st.impl, config=st.bcfg, interpret=st.interpret)


