"""Public attention API: ``dot_product_attention``, ``flex_attention`` and ``mha``.

Inputs are ``[batch, seq, heads, head_dim]``; keys and values may have fewer
heads than queries (grouped-query / multi-query attention), which no path
repeats in memory. ``implementation=None`` picks the fastest path that
computes the call exactly (:func:`explain_dispatch` says which and why); an
explicit ``implementation`` that cannot compute the call raises ValueError.

>>> import jax, jax.numpy as jnp
>>> from probjax.nn.layers.attention import dot_product_attention, CausalMask
>>> q = k = v = jax.random.normal(jax.random.key(0), (2, 100, 4, 32))
>>> dot_product_attention(q, k, v, mask=CausalMask()).shape
(2, 100, 4, 32)
"""

from __future__ import annotations

import functools
from typing import Callable

import jax.numpy as jnp

from probjax.ops.attention import base
from probjax.ops.attention import dispatch, registry
from probjax.ops.attention import xla as xla_backend
from probjax.ops.attention.autodiff import with_forward_mode
from probjax.ops.attention.call import AttentionCall
from probjax.ops.attention.cudnn.config import CudnnConfig
from probjax.ops.attention.dispatch import Decision, Device
from probjax.ops.attention.masks import (CausalMask, KVLenMask, LengthMask, LocalWindowMask, Mask,
                                         SegmentMask)

__all__ = [
    "dot_product_attention", "flex_attention", "mha", "explain_dispatch", "available_implementations",
    "Mask", "CausalMask", "KVLenMask", "LengthMask", "LocalWindowMask", "SegmentMask", "Decision",
    "CudnnConfig",
]

BACKWARD_PASS_IMPLS = ("auto", "triton_onepass", "triton_fused", "triton_split", "mosaic")


def available_implementations(device: Device | None = None) -> list[str]:
  """Implementation names that can run on ``device`` (default: the current one)."""
  return registry.available(device or Device.current())


def explain_dispatch(q_shape, kv_shape, dtype, **kw) -> Decision:
  """The implementation ``implementation=None`` picks for a call, and the rule; see
  :func:`probjax.ops.attention.dispatch.explain_dispatch` for the arguments."""
  return dispatch.explain_dispatch(tuple(q_shape), tuple(kv_shape), dtype, **kw)


def dot_product_attention(query, key, value, bias=None, mask=None, broadcast_dropout: bool = True,
                          dropout_rng=None, dropout_rate: float = 0.0, deterministic: bool = False,
                          dtype=None, precision=None, module=None, promote_dtype=None,
                          is_causal: bool = False, *, implementation: str | None = None,
                          scale: float | None = None, score_mod: Callable | None = None,
                          backward_pass_impl: str = "auto", split_kv=None, interpret: bool = False):
  """Exact scaled dot-product attention; a drop-in ``attention_fn`` for Flax NNX.

  Args:
    query: ``[batch, q_len, heads, head_dim]``.
    key, value: ``[batch, kv_len, kv_heads, head_dim]``; ``heads % kv_heads == 0``.
    bias: additive float bias broadcastable to ``[batch, heads, q_len, kv_len]``
      (differentiable).
    mask: a position :class:`Mask` (e.g. ``CausalMask() & KVLenMask(lengths)``)
      or a boolean array broadcastable to ``[batch, heads, q_len, kv_len]``
      (True = attend), as Flax passes it.
    broadcast_dropout, dropout_rng, dropout_rate, deterministic: dropout on the
      attention weights, as in ``flax.nnx.dot_product_attention``.
    dtype: computation dtype (inputs are cast to it); precision: matmul precision.
    module: if given, the attention weights are sown into it (dense path).
    promote_dtype: Flax's dtype promotion hook, applied to (query, key, value).
    is_causal: shorthand for ``mask & CausalMask()``.
    implementation: None (automatic), "xla", "triton" (alias "pallas"), "cudnn" or "mosaic"
      (sm_90: the Mosaic GPU forward with the Triton backward).
    scale: softmax scale, default ``head_dim ** -0.5``.
    score_mod: ``f(score, b, h, q_idx, kv_idx) -> score`` (see :func:`flex_attention`).
    backward_pass_impl: Triton backward: "auto", "triton_onepass", "triton_fused",
      "triton_split"; or "mosaic" (with ``implementation="mosaic"``: the Mosaic GPU backward).
    split_kv: Triton split-KV forward for decoding: None (automatic: at most 64
      queries, at least 1024 keys, two or more splits), False (never), True or a
      ``SplitKVConfig`` (whenever the call allows; ValueError otherwise). Under
      ``jax.grad`` the regular kernel runs.
    interpret: run the Triton or Mosaic kernels in Pallas interpret mode (CPU testing).
  Returns:
    ``[batch, q_len, heads, head_dim]`` in the input dtype. Rows with no valid
    key are zero.
  """
  if promote_dtype is not None:
    query, key, value = promote_dtype((query, key, value), dtype=dtype)
  elif dtype is not None:
    query, key, value = (jnp.asarray(x, dtype) for x in (query, key, value))
  shape = base.check_qkv(query, key, value)
  pos_mask, dense_mask = base.check_mask(mask, shape)
  if is_causal:
    pos_mask = CausalMask() if pos_mask is None else pos_mask & CausalMask()
  if pos_mask is not None:
    pos_mask = pos_mask.clamped(shape.q_len, shape.kv_len)
  bias = base.check_broadcast("bias", bias, shape, boolean=False)
  rate, rng = base.check_dropout(dropout_rate, dropout_rng, deterministic)
  return _attention(query, key, value, shape, bias=bias, mask=pos_mask, dense_mask=dense_mask,
                    score_mod=score_mod, scale=scale, dropout_rate=rate, dropout_rng=rng,
                    broadcast_dropout=broadcast_dropout, precision=precision, module=module,
                    implementation=implementation, backward_pass_impl=backward_pass_impl,
                    split_kv=split_kv, interpret=interpret)


def flex_attention(query, key, value, *, mask: Mask | None = None, score_mod: Callable | None = None,
                   scale: float | None = None, implementation: str | None = None,
                   backward_pass_impl: str = "auto", forward_config=None, backward_config=None,
                   split_kv=None, interpret: bool = False):
  """Attention with a position mask and a functional score modifier.

  Args:
    query: ``[batch, q_len, heads, head_dim]``; key, value ``[batch, kv_len, kv_heads, head_dim]``.
    mask: a :class:`Mask` (combine with ``&``); tiles it empties are skipped.
    score_mod: ``f(score, b, h, q_idx, kv_idx) -> score``, elementwise on float32
      scores after scaling, before masking; index arguments broadcast against
      the score. Differentiable, including through arrays it closes over
      (those run on the XLA path).
    implementation, backward_pass_impl, split_kv, interpret: as in :func:`dot_product_attention`.
    forward_config, backward_config: explicit tile configs (Triton: ``ForwardConfig``,
      ``BackwardConfig``; "mosaic": ``MosaicForwardConfig`` and the Triton backward's ``BackwardConfig``;
      "cudnn": a ``CudnnConfig`` as forward_config, for probjax's FFI call of cuDNN).

  ALiBi as a score modifier (the slopes are differentiable too):

  >>> import jax, jax.numpy as jnp
  >>> q = k = v = jax.random.normal(jax.random.key(0), (1, 300, 2, 16))
  >>> slopes = jnp.array([0.5, 0.25])
  >>> alibi = lambda s, b, h, qi, ki: s - slopes[h] * jnp.abs(qi - ki)
  >>> flex_attention(q, k, v, mask=CausalMask(), score_mod=alibi).shape
  (1, 300, 2, 16)
  """
  shape = base.check_qkv(query, key, value)
  if mask is not None and not isinstance(mask, Mask):
    raise TypeError(f"flex_attention's mask must be a probjax Mask (e.g. CausalMask()), got {type(mask).__name__}; "
                    "use dot_product_attention for dense boolean masks")
  if mask is not None:
    mask.validate(shape.batch, shape.q_len, shape.kv_len)
    mask = mask.clamped(shape.q_len, shape.kv_len)
  return _attention(query, key, value, shape, mask=mask, score_mod=score_mod, scale=scale,
                    implementation=implementation, backward_pass_impl=backward_pass_impl,
                    forward_config=forward_config, backward_config=backward_config,
                    split_kv=split_kv, interpret=interpret)


def mha(query, key, value, *, causal: bool = False, mask: Mask | None = None, scale: float | None = None,
        backward_pass_impl: str = "auto", forward_config=None, backward_config=None,
        split_kv=None, interpret: bool = False):
  """The fused Triton kernel itself (no dispatch): ``[batch, seq, heads, head_dim]`` in and out.

  Raises ValueError where the kernel cannot compute the call exactly.
  """
  if causal:
    mask = CausalMask() if mask is None else mask & CausalMask()
  return flex_attention(query, key, value, mask=mask, scale=scale, implementation="triton",
                        backward_pass_impl=backward_pass_impl, forward_config=forward_config,
                        backward_config=backward_config, split_kv=split_kv, interpret=interpret)


def _exact(query, key, device, score_mod, scale):
  """The exact XLA formulation ``f(q, k, v, mask)`` whose jvp gives the kernels' tangents."""
  formulation = dispatch.xla_formulation(query.shape, key.shape, device)
  return lambda q, k, v, mask: xla_backend.attention(q, k, v, formulation=formulation, mask=mask,
                                                     score_mod=score_mod, scale=scale)


def _attention(query, key, value, shape: base.AttentionShape, *, bias=None, mask=None, dense_mask=None,
               score_mod=None, scale=None, dropout_rate=0.0, dropout_rng=None, broadcast_dropout=True,
               precision=None, module=None, implementation=None, backward_pass_impl="auto",
               forward_config=None, backward_config=None, split_kv=None, interpret=False):
  if backward_pass_impl not in BACKWARD_PASS_IMPLS:
    raise ValueError(f"backward_pass_impl must be one of {BACKWARD_PASS_IMPLS}, got {backward_pass_impl!r}")
  if score_mod is not None and not callable(score_mod):
    raise TypeError(f"score_mod must be callable f(score, b, h, q_idx, kv_idx), got {type(score_mod).__name__}")
  scale = base.check_scale(scale, shape.head_dim)
  if base.is_traced(scale):
    if dispatch.canonical(implementation) not in (None, "xla"):
      raise ValueError(f"implementation={implementation!r} cannot take a traced scale (the kernels compile "
                       "the scale in): pass a Python float, or implementation=None or 'xla'")
    score_mod, bias, scale = _fold_traced_scale(scale, score_mod, bias)
  # Interpret mode emulates the GPU kernel anywhere.
  device = Device.interpreter() if interpret else Device.current()
  decision = dispatch.explain_dispatch(
      query.shape, key.shape, shape.dtype, mask=mask, bias=bias is not None,
      dense_mask=dense_mask is not None, dropout=dropout_rate > 0, score_mod=score_mod,
      precision=precision, module=module is not None, implementation=implementation,
      backward_pass_impl=backward_pass_impl, split_kv=split_kv,
      kernel_args_default=(backward_pass_impl == "auto" and forward_config is None
                           and backward_config is None and split_kv is None),
      device=device)
  cudnn_config = isinstance(forward_config, CudnnConfig)
  if cudnn_config and (decision.implementation != "cudnn" or backward_config is not None):
    raise ValueError(f"a CudnnConfig configures the cuDNN route (no backward_config), but this call runs "
                     f"{decision}; pass implementation='cudnn'")
  if (not cudnn_config and (forward_config is not None or backward_config is not None)
      and decision.implementation not in ("triton", "mosaic")):
    raise ValueError(f"forward_config/backward_config configure the Triton or Mosaic kernel, but this call "
                     f"runs {decision}; pass implementation='triton' or 'mosaic'")
  if decision.implementation != "xla":
    call = AttentionCall(query.shape, key.shape, shape.dtype, mask=mask, score_mod=score_mod, scale=scale,
                         backward_pass_impl=backward_pass_impl, split_kv=split_kv,
                         forward_config=forward_config, backward_config=backward_config, interpret=interpret)
    run = lambda name: None if name is None else functools.partial(
        registry.REGISTRY.get(name), call=call, backward_pass_impl=decision.backward_pass_impl)
    return with_forward_mode(run(decision.implementation), _exact(query, key, device, score_mod, scale),
                             run(decision.grad_implementation))(query, key, value, mask)
  return xla_backend.attention(query, key, value, formulation=decision.formulation, module=module,
                               bias=bias, mask=mask, dense_mask=dense_mask, score_mod=score_mod,
                               scale=scale, dropout_rate=dropout_rate, dropout_rng=dropout_rng,
                               broadcast_dropout=broadcast_dropout, precision=precision)


def _fold_traced_scale(scale, score_mod, bias):
  """``(score_mod, bias, 1.0)`` computing scores at a traced ``scale``: the scores are formed at
  scale 1 and the modifier scales them and adds the bias, in the order of the static-scale path
  (``score_mod(scale * q k^T + bias)``). The modifier closes over traced arrays, so only the XLA
  path runs it, and the scale (and bias) stay differentiable."""
  user = score_mod

  def mod(s, b, h, i, j):
    s = s * scale
    if bias is not None:
      # bias is [b|1, h|1, q|1, k|1]; a size-1 axis broadcasts, and padded tile positions
      # (masked later) read the last row or column.
      at = lambda idx, n: jnp.zeros_like(idx) if n == 1 else jnp.minimum(idx, n - 1)
      s = s + bias[at(b, bias.shape[0]), at(h, bias.shape[1]), at(i, bias.shape[2]),
                   at(j, bias.shape[3])].astype(s.dtype)
    return s if user is None else user(s, b, h, i, j)
  return mod, None, 1.0
