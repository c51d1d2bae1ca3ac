"""The cuDNN route: cuDNN's fused attention, through probjax's FFI extension
(:mod:`probjax.ops.attention.backends.cudnn.ffi`, without XLA's memsets of the outputs) when it is
built, else ``jax.nn.dot_product_attention(implementation="cudnn")``.

cuDNN's fused attention takes, of probjax's masks, per-batch key lengths,
equal-length causal masking and equal-length causal sliding windows
(``LocalWindowMask(left, 0)``, jax.nn's ``local_window_size=(left, 0)``); no
dropout or score_mod here, 16-bit inputs only. Head dims: multiples of 8; one
width up to 128 on either call (jax.nn's checks); through the FFI extension only,
on sm_90, q/k and v widths of their own, each up to 256 (cuDNN's limits there,
forward and backward; MLA's 192/128). :func:`supports` names the first reason a
call is outside that set; :func:`jaxnn_arguments` is the mapping, which CPU tests
check against the reference through jax.nn's XLA implementation.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from probjax.ops.attention.backends.cudnn import extension, ffi
from probjax.ops.attention.backends.cudnn.config import CudnnConfig
from probjax.ops.attention.masks import Mask
from probjax.ops.attention.padding import zero_padding

MAX_HEAD_DIM = 128  # jax.nn's route: one width for q, k and v
FFI_MAX_HEAD_DIM = 256  # the FFI call on sm_90: q/k and v widths each
NEEDS_EXTENSION = f"needs probjax's cuDNN extension ({extension.BUILD_COMMAND})"


def _local_capability() -> tuple[int, int] | None:
  """This process's first GPU's compute capability; None without a GPU (dispatch asked about
  another device) or where the device does not say."""
  if jax.default_backend() != "gpu":
    return None
  cc = getattr(jax.devices()[0], "compute_capability", None)
  return None if cc is None else tuple(int(x) for x in str(cc).split(".")[:2])


def _ffi_only_reason(d: int, dv: int, compute_capability, env) -> str | None:
  """Why widths jax.nn's route refuses (``dv != d`` or above 128) cannot run here, or None."""
  what = f"value head_dim {dv} != q/k head_dim {d}" if dv != d else f"head_dim {d} > {MAX_HEAD_DIM}"
  cc = compute_capability or _local_capability()
  if cc is not None and cc[0] != 9:
    return f"{what}: probjax's cuDNN call takes it on sm_90 only (this GPU is sm_{cc[0]}{cc[1]})"
  if why := ffi.unavailable(env):
    return f"{what} {NEEDS_EXTENSION}; jax.nn's cuDNN route cannot take it, and {why}"
  return None


def supports(q_shape, kv_shape, dtype, *, mask: Mask | None = None, score_mod=None, bias=False,
             dense_mask=False, dropout=False, platform: str | None = None,
             v_head_dim: int | None = None, compute_capability: tuple[int, int] | None = None,
             env=None) -> str | None:
  """None if cuDNN computes the call exactly, else the reason it cannot.

  ``v_head_dim``: the values' head_dim (None: ``head_dim``). Widths other than one up to 128
  need the FFI extension (:func:`ffi.unavailable` under ``env``, default ``os.environ``; it
  neither builds nor loads) and sm_90: ``compute_capability``, else this process's GPU's,
  else (no GPU: a dispatch question about another device) not checked."""
  platform = platform or jax.default_backend()
  if platform != "gpu":
    return f"cuDNN needs an NVIDIA GPU (platform is {platform})"
  if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
    return f"cuDNN attention takes bfloat16/float16 only, got {jnp.dtype(dtype).name}"
  d = q_shape[-1]
  dv = d if v_head_dim is None else v_head_dim
  for name, width in (("head_dim", d), ("value head_dim", dv)):
    if width % 8 or not 0 < width <= FFI_MAX_HEAD_DIM:
      return f"{name} {width} is not a multiple of 8 up to {FFI_MAX_HEAD_DIM}"
  if (dv != d or d > MAX_HEAD_DIM) and (why := _ffi_only_reason(d, dv, compute_capability, env)):
    return why
  if bias or dense_mask:
    return "additive bias / dense boolean mask are not routed to cuDNN"
  if dropout:
    return "dropout"
  if score_mod is not None:
    return "score_mod"
  if mask is not None and mask.components and not mask.is_kv_lengths_only():
    equal = q_shape[1] == kv_shape[1]
    causal_window = mask.components == ("window",) and mask.band_bounds[1] == 0
    if not (equal and (mask.is_causal(0) or causal_window)):
      return (f"mask {mask.name!r}: cuDNN takes only KVLenMask, or CausalMask() / "
              "LocalWindowMask(left, 0) with equal lengths")
  return None


def jaxnn_arguments(mask: Mask | None, batch: int) -> dict:
  """``jax.nn.dot_product_attention`` keyword arguments that express ``mask``."""
  kw = dict(is_causal=False, key_value_seq_lengths=None, local_window_size=None)
  if mask is None:
    return kw
  kv_lens = mask.lengths(batch)[1]
  if kv_lens is not None:
    kw["key_value_seq_lengths"] = kv_lens
  lower, upper = mask.band_bounds
  if upper == 0:
    kw["is_causal"] = True
    if lower is not None:
      kw["local_window_size"] = (-lower, 0)
  return kw


def _jaxnn_attention(q, k, v, mask: Mask | None, scale):
  """jax.nn's cuDNN call. With key lengths, jax.nn refuses to differentiate an odd query or
  key length (its cuDNN graph takes the lengths as a bias, which needs even lengths in
  training): such calls run with one more query row (zero, sliced off: its cotangent is zero,
  so it adds nothing to dK/dV) or one more key (past every length: never read)."""
  kw = jaxnn_arguments(mask, q.shape[0])
  tq, tk = q.shape[1], k.shape[1]
  if kw["key_value_seq_lengths"] is None or not (tq % 2 or tk % 2):
    return jax.nn.dot_product_attention(q, k, v, scale=scale, implementation="cudnn", **kw)
  pad = lambda x, n: jnp.pad(x, ((0, 0), (0, n % 2), (0, 0), (0, 0)))  # causal: equal lengths stay equal
  out = jax.nn.dot_product_attention(pad(q, tq), pad(k, tk), pad(v, tk), scale=scale, implementation="cudnn", **kw)
  return out[:, :tq]


def route(env=None) -> str:
  """Which call the cuDNN route makes: ``"probjax FFI"`` or ``"jax.nn (<why not the FFI>)"``."""
  why = ffi.unavailable(env)
  return "probjax FFI" if why is None else f"jax.nn ({why})"


def attention(q, k, v, *, mask: Mask | None = None, scale: float | None = None,
              config: CudnnConfig | None = None, env=None):
  """q ``[B, Tq, H, D]``, k ``[B, Tkv, Hkv, D]``, v ``[B, Tkv, Hkv, Dv]`` (bf16/fp16) →
  ``[B, Tq, H, Dv]`` via cuDNN.

  ``config`` (:class:`CudnnConfig`), ``Dv != D`` and ``D > 128`` need the FFI extension:
  without it, ValueError.

  K/V rows past the mask's key lengths are zeroed first: cuDNN masks their scores but still
  multiplies them by zero weights (in ``P @ V`` and the backward's ``dS @ K``), so NaN or inf
  there (a KV cache's unwritten tail) would reach every output row. The default sends only
  long calls here, where that pass over K and V is small beside the attention. ``scale``
  defaults to ``1/sqrt(D)``."""
  scale = q.shape[-1] ** -0.5 if scale is None else scale
  _, k, v, _ = zero_padding(mask, q, k, v)
  why = ffi.ready(env)
  if why is None:
    out = ffi.attention(q, k, v, mask=mask, scale=scale, config=config, env=env)
  elif config is not None:
    raise ValueError(f"a CudnnConfig configures probjax's FFI call of cuDNN, which is unavailable: {why}")
  elif v.shape[-1] != q.shape[-1] or q.shape[-1] > MAX_HEAD_DIM:
    raise ValueError(f"cuDNN attention with q/k head_dim {q.shape[-1]} and value head_dim {v.shape[-1]} "
                     f"{NEEDS_EXTENSION}, which is unavailable: {why}")
  else:
    out = _jaxnn_attention(q, k, v, mask, scale)
  kv_lens = None if mask is None else mask.lengths(q.shape[0])[1]
  if kv_lens is not None:  # rows with no valid key are zeros, as on every path
    valid = kv_lens > 0
    out = jnp.where(valid[:, None, None, None], out, 0).astype(out.dtype)
  return out
