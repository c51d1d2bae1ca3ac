"""Attention's public face: ``dot_product_attention``, ``flex_attention``, ``mha``,
``explain_dispatch`` and ``available_implementations`` (re-exported by
:mod:`probjax.ops.attention`, :mod:`probjax` and :mod:`probjax.nn.layers.attention`).

Inputs are ``[batch, seq, heads, head_dim]``; keys and values may have fewer
heads than queries (grouped-query / multi-query attention), which no path
repeats in memory. ``implementation=None`` picks the fastest path that
computes the call exactly (:func:`explain_dispatch` says which and why); an
explicit ``implementation`` that cannot compute the call raises ValueError.

A call validates its arguments and asks the dispatch once, in Python; what it then computes
is a function of the arrays and the static call description. Called eagerly (outside
``jax.jit``), that computation is compiled once per description and shape
(:func:`probjax.core.eager.compile_once`), not retraced per call.

>>> import jax, jax.numpy as jnp
>>> from probjax.ops.attention import dot_product_attention, CausalMask
>>> q = k = v = jax.random.normal(jax.random.key(0), (2, 100, 4, 32))
>>> dot_product_attention(q, k, v, mask=CausalMask()).shape
(2, 100, 4, 32)

Decoding over a paged KV cache: ``key``/``value`` are page pools ``[num_pages, page_size,
kv_heads, head_dim]``, ``page_table [batch, pages_per_seq]`` names each sequence's pages, and
``KVLenMask`` gives the lengths (:mod:`probjax.ops.attention.paged`):

>>> from probjax.ops.attention import KVLenMask
>>> pool = jax.random.normal(jax.random.key(1), (6, 16, 2, 32))        # 6 pages of 16 positions
>>> table = jnp.array([[4, 1, 0], [2, 5, 3]], jnp.int32)              # 48 positions per sequence
>>> q1 = jax.random.normal(jax.random.key(2), (2, 1, 4, 32))
>>> dot_product_attention(q1, pool, pool, mask=KVLenMask(jnp.array([40, 7])), page_table=table).shape
(2, 1, 4, 32)
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from probjax.core.eager import compile_once
from probjax.core.values import check_scale, is_traced
from probjax.ops.attention import base
from probjax.ops.attention import dispatch, paged, registry
from probjax.ops.attention.backends import xla as xla_backend
from probjax.ops.attention.autodiff import with_forward_mode
from probjax.ops.attention.call import AttentionCall
from probjax.ops.attention.context_parallel import context_parallel_attention
from probjax.ops.attention.backends.cudnn.config import CudnnConfig
from probjax.core.dispatch import Decision
from probjax.ops.attention.dispatch import Device
from probjax.ops.attention.masks import (CausalMask, KVLenMask, LengthMask, LocalWindowMask, Mask, MaskMod,
                                         MaskWithDense, PrefixLMMask, SegmentMask, structured_equivalent)
from probjax.ops.attention.masks.mask_mod import reads as _mask_mod_reads

__all__ = [
    "dot_product_attention", "flex_attention", "mha", "explain_dispatch", "available_implementations",
    "Mask", "MaskWithDense", "CausalMask", "KVLenMask", "LengthMask", "LocalWindowMask", "SegmentMask", "PrefixLMMask",
    "MaskMod",
    "Decision",
    "CudnnConfig",
    "context_parallel_attention",
]

BACKWARD_PASS_IMPLS = ("auto", "triton_onepass", "triton_fused", "triton_split", "mosaic")


def _explain_call(call: AttentionCall, kv_shape, dtype, kw) -> Decision:
  """:func:`explain_dispatch` of a call object: its fields as the shape-based spelling's flags."""
  if kv_shape is not None or dtype is not None:
    raise TypeError("explain_dispatch(call): the call carries the shapes and dtype; pass no "
                    f"kv_shape or dtype, got kv_shape={kv_shape!r}, dtype={dtype!r}")
  unknown = set(kw) - {"implementation", "device", "env"}
  if unknown:
    raise TypeError(f"explain_dispatch(call) takes implementation=, device= and env= only (the call "
                    f"carries the rest), got {sorted(unknown)}")
  return dispatch.explain_dispatch(
      call.q_shape, call.kv_shape, call.dtype, mask=call.mask, bias=call.bias, dense_mask=call.dense_mask,
      dropout=call.dropout, score_mod=call.score_mod, scale=call.scale, precision=call.precision,
      module=call.module, backward_pass_impl=call.backward_pass_impl, split_kv=call.split_kv,
      kernel_args_default=(call.forward_config is None and call.backward_config is None
                           and call.backward_pass_impl == "auto"),
      v_head_dim=call.v_head_dim, page_size=call.page_size, **kw)


def available_implementations(device: Device | None = None) -> list[str]:
  """Implementation names that can run on ``device`` (default: the current one)."""
  return registry.available(device or Device.current())


def explain_dispatch(q_shape, kv_shape=None, dtype=None, *, dense_mask=False, mask: Mask | None = None,
                     is_causal: bool = False, query_seq_lengths=None, key_value_seq_lengths=None,
                     local_window_size=None, **kw) -> Decision:
  """The implementation ``implementation=None`` picks for a call, and the rule; see
  :func:`probjax.ops.attention.dispatch.explain_dispatch` for the arguments.

  ``dense_mask`` may be the dense boolean array itself: where a concrete one equals a
  structured mask (a dense causal mask is ``CausalMask()``), the rule names it, since passing
  that instead lets the kernels run.

  ``is_causal``, ``query_seq_lengths``, ``key_value_seq_lengths`` and ``local_window_size`` are
  ``jax.nn.dot_product_attention``'s flags, read as :func:`dot_product_attention` reads them (one
  mapping, :func:`_jaxnn_mask`) and combined with ``mask``: ``explain_dispatch(..., is_causal=True)``
  is ``explain_dispatch(..., mask=CausalMask())``.

  ``q_shape`` may instead be the call's description, an :class:`AttentionCall` (then
  ``kv_shape`` and ``dtype`` are omitted and the flags come from it; ``kw`` takes
  ``implementation``, ``device`` and ``env``): every op's ``explain_dispatch`` takes its call
  object. The two spellings give the same decision:

  >>> from probjax.core.device import Device
  >>> gpu = Device("gpu", compute_capability=(9, 0))
  >>> call = AttentionCall((2, 4096, 8, 128), (2, 4096, 8, 128), "bfloat16", mask=CausalMask())
  >>> explain_dispatch(call, device=gpu) == explain_dispatch(
  ...     (2, 4096, 8, 128), (2, 4096, 8, 128), "bfloat16", is_causal=True, device=gpu)
  True"""
  if isinstance(q_shape, AttentionCall):
    flags = {"dense_mask": dense_mask is not False, "mask": mask is not None, "is_causal": is_causal,
             "query_seq_lengths": query_seq_lengths is not None,
             "key_value_seq_lengths": key_value_seq_lengths is not None,
             "local_window_size": local_window_size is not None}
    if any(flags.values()):
      raise TypeError(f"explain_dispatch(call): the call carries its mask and flags; drop "
                      f"{sorted(k for k, v in flags.items() if v)}")
    return _explain_call(q_shape, kv_shape, dtype, kw)
  mask = _jaxnn_mask(mask, is_causal, query_seq_lengths, key_value_seq_lengths, local_window_size)
  if mask is not None:
    kw["mask"] = mask
  flag = dense_mask is not False and dense_mask is not None
  decision = dispatch.explain_dispatch(tuple(q_shape), tuple(kv_shape), dtype, dense_mask=flag, **kw)
  if flag and not isinstance(dense_mask, bool):
    same = structured_equivalent(dense_mask, q_shape[1], kv_shape[1])
    if same is not None:
      decision = decision.replace(
          rule=f"{decision.rule}; this dense mask equals {same}, which as mask= leaves "
                         "the kernels eligible (a dense mask forces the XLA path)")
  return decision


def dot_product_attention(query, key, value, bias=None, mask=None, broadcast_dropout: bool = True,
                          dropout_rng=None, dropout_rate: float = 0.0, deterministic: bool = False,
                          dtype=None, precision=None, module=None, promote_dtype=None,
                          is_causal: bool = False, *, input_positions=None,
                          implementation: str | None = None, scale: float | None = None,
                          score_mod: Callable | None = None, query_seq_lengths=None,
                          key_value_seq_lengths=None, local_window_size=None, logits_soft_cap=None,
                          return_lse: bool = False, backward_pass_impl: str = "auto", split_kv=None,
                          interpret: bool = False, return_residual: bool = False, page_table=None):
  """Exact scaled dot-product attention; a drop-in ``attention_fn`` for Flax NNX (see docs/flax.md).

  The positional arguments and ``is_causal``/``input_positions`` are those that
  ``flax.nnx.MultiHeadAttention`` passes; ``scale``, ``query_seq_lengths``,
  ``key_value_seq_lengths`` and ``local_window_size`` are ``jax.nn.dot_product_attention``'s.

  Args:
    query: ``[batch..., q_len, heads, head_dim]`` (any number of batch axes, including none).
    key, value: ``[batch..., kv_len, kv_heads, head_dim]`` with query's batch axes;
      ``heads % kv_heads == 0``. With ``page_table``: page pools ``[num_pages, page_size,
      kv_heads, head_dim]``.
    bias: additive float bias broadcastable to ``[batch..., heads, q_len, kv_len]``
      (differentiable).
    mask: a position :class:`Mask` (e.g. ``CausalMask() & KVLenMask(lengths)``; with several
      batch axes its arrays are ``[batch...]`` / ``[batch..., len]`` or flattened), a boolean
      array broadcastable to ``[batch..., heads, q_len, kv_len]`` (True = attend; Flax's float
      1/0 masks too), or both (``CausalMask() & array``, which runs the XLA path). An array
      (mask or bias) with fewer axes than that whose axes before ``[q_len, kv_len]`` are not
      all 1 is refused as ambiguous (numpy broadcasting, as jax.nn and Flax do it, would read
      ``[batch, q_len, kv_len]`` as ``[heads, q_len, kv_len]``): pass all axes. Or a function
      ``mask_mod(b, h, q_idx, kv_idx) -> bool`` (see :func:`flex_attention`; ``b`` indexes the
      flattened batch axes).
    broadcast_dropout, dropout_rng, dropout_rate, deterministic: dropout on the
      attention weights, as in ``flax.nnx.dot_product_attention``.
    dtype: computation dtype (inputs are cast to it); precision: matmul precision.
    module: if given, the attention weights are sown into it (dense path).
    promote_dtype: Flax's dtype promotion hook ``f((q, k, v), dtype=dtype)``; None promotes
      as ``flax.nnx.nn.dtypes.promote_dtype`` does (``dtype``, else the inputs' common dtype).
    is_causal: shorthand for ``mask & CausalMask()``.
    input_positions: accepted because Flax's MultiHeadAttention forwards it; unused (positions
      enter attention only through RoPE, which is applied to query and key before this call).
    implementation: None (automatic), "xla", "triton" (alias "pallas"), "cudnn" or "mosaic"
      (sm_90: the Mosaic GPU forward with the Triton backward).
    scale: softmax scale, default ``head_dim ** -0.5``; a traced scale runs the XLA path.
    score_mod: ``f(score, b, h, q_idx, kv_idx) -> score`` (see :func:`flex_attention`).
    query_seq_lengths, key_value_seq_lengths: ``[batch...]`` ints, as jax.nn's:
      ``LengthMask``/``KVLenMask``. Queries past their length return zeros, as in jax.nn;
      unlike jax.nn (the mean of the values), rows with no valid key return zeros too.
    local_window_size: ``w`` or ``(left, right)``: query ``q`` sees keys
      ``q - left <= k <= q + right`` (jax.nn's; ``w`` is ``(w, w)``): ``LocalWindowMask``.
    logits_soft_cap: ``c``: scores become ``c * tanh(s / c)`` after scaling, bias and
      ``score_mod``, before masking (Gemma 2's cap).
    return_lse: also return the log-sum-exp of the masked, scaled scores, ``[batch..., q_len,
      heads]`` float32 (jax.nn's ``return_residual``; no gradient flows through it; -inf for
      rows with no valid key). Computed by the XLA path only, densely (``[batch, heads,
      q_len, kv_len]`` scores): an explicit non-XLA ``implementation`` raises ValueError.
    return_residual: ``jax.nn.dot_product_attention``'s spelling: ``(out, residual)``, the
      residual the log-sum-exp of ``return_lse`` in jax.nn's layout ``[batch..., q_len, heads]``
      (``BTN``) and, as jax.nn's, in the inputs' (promoted) dtype, without gradient. Unlike
      jax.nn's (which masks with a large finite negative), rows with no valid key give -inf.
      Not together with ``return_lse``.
    backward_pass_impl: Triton backward: "auto", "triton_onepass", "triton_fused",
      "triton_split"; or "mosaic" (with ``implementation="mosaic"``: the Mosaic GPU backward).
    split_kv: Triton split-KV forward for decoding: None (automatic: at most 64
      queries, at least 1024 keys, two or more splits or a GQA group's heads packed),
      False (never), True or a ``SplitKVConfig`` (whenever the call allows; ValueError
      otherwise). Under ``jax.grad`` the regular kernel runs.
    interpret: run the Triton or Mosaic kernels in Pallas interpret mode (CPU testing).
    page_table: ``[batch, pages_per_seq]`` int32: attention over a paged KV cache (one batch
      axis). ``key`` / ``value`` are then page pools ``[num_pages, page_size, kv_heads, head_dim]``
      and position ``p`` of element ``b`` is ``pool[page_table[b, p // page_size], p %
      page_size]``: the call stands for K/V of ``pages_per_seq * page_size`` positions, and the
      mask must give the key lengths (``KVLenMask(lengths)`` or ``key_value_seq_lengths``);
      positions past them are never read into the result (they may hold NaN). Entries must be
      in ``[0, num_pages)``: a concrete table is checked (ValueError); in a traced one an entry
      outside the pool reads page 0 and its positions get zero weight, so no path reads
      outside the pool. ``implementation=None`` runs the Triton split-KV decode kernel, which
      reads the pages in place, on an NVIDIA GPU where it computes the call (at most 64
      queries, ``page_size`` a multiple of 16, no ``score_mod``; ``explain_dispatch(...,
      page_size=)`` says); otherwise the pages are gathered to contiguous K/V, exactly, and
      the call runs as one without pages (``"xla"`` requests that). The gradient, of the
      queries and the pools, is the gather path's.
  Returns:
    ``[batch..., q_len, heads, head_dim]`` in the (promoted) input dtype; with ``return_lse``,
    ``(out, lse)``. Rows with no valid key are zero.
  """
  del input_positions  # positions only matter to RoPE, applied before attention
  _check_floating((query, key, value), dtype)
  if promote_dtype is not None:
    query, key, value = promote_dtype((query, key, value), dtype=dtype)
  else:
    query, key, value = _promote((query, key, value), dtype)
  if page_table is not None:
    run = _paged(query, key, value, page_table, mask=mask, is_causal=is_causal,
                 query_seq_lengths=query_seq_lengths, key_value_seq_lengths=key_value_seq_lengths,
                 local_window_size=local_window_size, bias=bias, dropout=base.check_dropout(
                     dropout_rate, dropout_rng, deterministic)[0] > 0, score_mod=score_mod,
                 logits_soft_cap=logits_soft_cap, scale=scale, precision=precision, module=module,
                 implementation=implementation, backward_pass_impl=backward_pass_impl, split_kv=split_kv,
                 interpret=interpret, return_lse=return_lse or return_residual)
    if not isinstance(run, _Gathered):
      return run
    # The gather path: the call as one without pages, its mask flags folded into ``mask``.
    key, value, mask = run.key, run.value, run.mask
    is_causal, query_seq_lengths, key_value_seq_lengths, local_window_size = False, None, None, None
  query, key, value, batch_dims = _flatten_batch(query, key, value)
  pos_mask, dense = _split_mask(_mask_mod(mask, query.shape[0], query.shape[2]))
  pos_mask = _jaxnn_mask(pos_mask, is_causal, query_seq_lengths, key_value_seq_lengths, local_window_size)
  q_len, heads, kv_len = query.shape[1], query.shape[2], key.shape[1]
  if pos_mask is not None:
    pos_mask = _flatten_mask_arrays(pos_mask, batch_dims)
  dense = _flatten_dense("mask", dense, batch_dims, heads, q_len, kv_len)
  bias = _flatten_dense("bias", bias, batch_dims, heads, q_len, kv_len)
  shape = base.check_qkv(query, key, value)
  pos_mask, _ = base.check_mask(pos_mask, shape)
  _check_heads(pos_mask, shape.q_heads)
  _, dense_mask = base.check_mask(dense, shape)
  if pos_mask is not None:
    pos_mask = pos_mask.clamped(shape.q_len, shape.kv_len)
  bias = base.check_broadcast("bias", bias, shape, boolean=False)
  score_mod = _soft_capped(score_mod, logits_soft_cap)
  rate, rng = base.check_dropout(dropout_rate, dropout_rng, deterministic)
  if return_lse and return_residual:
    raise ValueError("pass one of return_lse (float32 log-sum-exp) and return_residual (jax.nn's "
                     "spelling: the same in the inputs' dtype), not both")
  residual_dtype = query.dtype if return_residual else None
  return_lse = return_lse or return_residual
  if return_lse:
    if dispatch.canonical(implementation) not in (None, "xla"):
      flag = "return_residual" if residual_dtype is not None else "return_lse"
      raise ValueError(f"{flag}=True is computed by the XLA path only; got implementation="
                       f"{implementation!r}: pass implementation=None or 'xla'")
    implementation = "xla"
  out = _attention(query, key, value, shape, bias=bias, mask=pos_mask, dense_mask=dense_mask,
                   score_mod=score_mod, scale=scale, dropout_rate=rate, dropout_rng=rng,
                   broadcast_dropout=broadcast_dropout, precision=precision, module=module,
                   implementation=implementation, backward_pass_impl=backward_pass_impl,
                   split_kv=split_kv, interpret=interpret)
  out = out.reshape(batch_dims + out.shape[1:])
  if not return_lse:
    return out
  lse = _lse_once(query, key, shape, bias=bias, mask=pos_mask, dense_mask=dense_mask, score_mod=score_mod,
                  scale=scale, precision=precision)
  lse = lse.reshape(batch_dims + lse.shape[1:])
  return out, lse if residual_dtype is None else lse.astype(residual_dtype)


@dataclasses.dataclass(frozen=True)
class _Gathered:
  """A paged call's K/V gathered to contiguous arrays, with the mask (flags folded in) over them."""

  key: object
  value: object
  mask: object


def _paged(query, key, value, page_table, *, mask, is_causal, query_seq_lengths, key_value_seq_lengths,
           local_window_size, bias, dropout, score_mod, logits_soft_cap, scale, precision, module,
           implementation, backward_pass_impl, split_kv, interpret, return_lse):
  """A paged call (see ``page_table`` in :func:`dot_product_attention`): its output where a
  backend reads the pages in place, else a :class:`_Gathered` for the contiguous path."""
  page_size, kv_len = paged.check(query, key, value, page_table)
  b, tq, h, d = query.shape
  pos_mask, dense = _split_mask(_mask_mod(mask, b, h))
  pos_mask = _jaxnn_mask(pos_mask, is_causal, query_seq_lengths, key_value_seq_lengths, local_window_size)
  if pos_mask is not None and not isinstance(pos_mask, Mask):
    raise TypeError(f"mask must be a probjax Mask, a boolean array or both, got {type(pos_mask).__name__}")
  if pos_mask is not None:
    pos_mask.validate(b, tq, kv_len)
  lengths = None if pos_mask is None else pos_mask.lengths(b)[1]
  if lengths is None:
    raise ValueError("page_table needs the key lengths: pass mask=KVLenMask(lengths) (or "
                     "key_value_seq_lengths=), the number of valid positions of each sequence")
  _check_heads(pos_mask, h)
  pos_mask = pos_mask.clamped(tq, kv_len)
  kv_shape = (b, kv_len) + tuple(key.shape[2:])
  scale = check_scale(scale, d)
  if not return_lse and not is_traced(scale):  # the kernels take neither
    device = Device.interpreter() if interpret else Device.current()
    decision = dispatch.explain_dispatch(
        query.shape, kv_shape, query.dtype, mask=pos_mask, bias=bias is not None, dense_mask=dense is not None,
        dropout=dropout, score_mod=_soft_capped(score_mod, logits_soft_cap), scale=scale, precision=precision,
        module=module is not None, implementation=implementation, backward_pass_impl=backward_pass_impl,
        split_kv=split_kv, kernel_args_default=backward_pass_impl == "auto" and split_kv is None,
        v_head_dim=value.shape[-1], page_size=page_size, device=device)
    if decision.implementation != "xla":
      call = AttentionCall(query.shape, kv_shape, query.dtype, scale=scale, v_head_dim=value.shape[-1],
                           split_kv=split_kv, interpret=interpret, page_size=page_size)
      return _paged_kernel_once(_PagedRun(decision.implementation, call), query, key, value, page_table, pos_mask)
  k, v, ok = paged.gathered(key, value, page_table, lengths)
  mask = pos_mask if dense is None else MaskWithDense(pos_mask, dense)
  if is_traced(page_table):  # entries outside the pool read page 0: their positions get zero weight
    mask = mask & ok[:, None, None, :]
  return _Gathered(k, v, mask)


@dataclasses.dataclass(frozen=True)
class _PagedRun:
  """A paged call a backend reads in place: the backend's name and the call's description."""

  implementation: str
  call: AttentionCall


def _gathered_xla(query, key, value, page_table, mask, scale):
  """The paged call on the XLA path (gathered pages): the kernels' exact formulation, whose
  derivatives are theirs."""
  k, v, ok = paged.gathered(key, value, page_table, mask.lengths(query.shape[0])[1])
  return xla_backend.attention(query, k, v, formulation="auto", mask=mask, dense_mask=ok[:, None, None, :],
                               scale=scale)


def _paged_kernel(run: _PagedRun, query, key, value, page_table, mask):
  """The backend's paged kernel for the output; derivatives of any order and mode from the
  gather path (a custom_jvp: its tangent rule is the XLA formulation's, which reverse mode
  transposes)."""
  backend = registry.REGISTRY.get(run.implementation)
  exact = lambda q, k, v: _gathered_xla(q, k, v, page_table, mask, run.call.scale)

  @jax.custom_jvp
  def attend(q, k, v):
    return backend.paged_kernel(q, k, v, page_table, mask, call=run.call)

  @attend.defjvp
  def _(primals, tangents):
    return attend(*primals), jax.jvp(exact, primals, tangents)[1]

  return attend(query, key, value)


_paged_kernel_once = compile_once(_paged_kernel)  # eager calls: compiled once per call description


def _check_floating(arrays, dtype):
  """query/key/value are float arrays (integers would be scores of rounded values: refused,
  not cast), and ``dtype``, if given, a float dtype."""
  for name, x in zip(("query", "key", "value"), arrays):
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
      raise TypeError(f"{name} must be an array, got {type(x).__name__}")
    if not jnp.issubdtype(x.dtype, jnp.floating):
      raise TypeError(f"{name} must be a floating array (float32, bfloat16, float16 or float64), got {x.dtype}")
  if dtype is not None and not jnp.issubdtype(dtype, jnp.floating):
    raise TypeError(f"dtype must be a floating dtype or None, got {dtype!r}")


def _promote(arrays, dtype):
  """``flax.nnx.nn.dtypes.promote_dtype``: all to ``dtype``, else to the inputs' common
  dtype, so a bfloat16 query with float32 keys computes in float32."""
  return tuple(jnp.asarray(x, jnp.result_type(*arrays) if dtype is None else dtype) for x in arrays)


def _flatten_batch(query, key, value):
  """q/k/v ``[batch..., seq, heads, dim]`` as ``[prod(batch), ...]``, and ``batch...``."""
  for name, x in (("query", query), ("key", key), ("value", value)):
    if not hasattr(x, "ndim") or x.ndim < 3:
      raise ValueError(f"{name} must have shape [batch..., seq, heads, head_dim] (rank >= 3), got "
                       f"{tuple(getattr(x, 'shape', ()))}")
  batch_dims = tuple(query.shape[:-3])
  for name, x in (("key", key), ("value", value)):
    if tuple(x.shape[:-3]) != batch_dims:
      raise ValueError(f"{name}'s batch axes {tuple(x.shape[:-3])} must equal query's {batch_dims} "
                       f"(shapes [batch..., seq, heads, head_dim])")
  flat = lambda x: x.reshape((math.prod(batch_dims),) + tuple(x.shape[-3:]))
  return flat(query), flat(key), flat(value), batch_dims


def _split_mask(mask):
  """``mask`` as ``(Mask or None, dense array or None)``."""
  if mask is None or isinstance(mask, Mask):
    return mask, None
  if isinstance(mask, MaskWithDense):
    return mask.mask, mask.dense
  return None, mask


def _mask_mod(mask, batch: int, heads: int):
  """A ``mask_mod(b, h, q_idx, kv_idx) -> bool`` function passed as ``mask`` as a
  :func:`MaskMod` for this call's (flattened) batch and query heads, where it reads ``b`` /
  ``h``; any other ``mask`` as it is."""
  if mask is None or isinstance(mask, (Mask, MaskWithDense)) or not callable(mask):
    return mask
  seen = _mask_mod_reads(mask)
  reads_b, reads_h = (True, True) if seen is None else seen
  return MaskMod(mask, batch=batch if reads_b else None, heads=heads if reads_h else None)


def _check_heads(mask: Mask | None, heads: int) -> None:
  if mask is not None and mask.heads not in (None, heads):
    raise ValueError(f"the mask was built for {mask.heads} query heads (MaskMod(..., heads={mask.heads})), "
                     f"but the call has {heads}")


def _and(a, b):
  return b if a is None else a if b is None else a & b


def _jaxnn_mask(mask: Mask | None, is_causal, query_seq_lengths, key_value_seq_lengths, local_window_size):
  """``mask`` (a Mask or None) and jax.nn's mask flags as one Mask (None: no mask): the one
  mapping of jax.nn's spelling, shared by :func:`dot_product_attention` and
  :func:`explain_dispatch`."""
  mask = _and(mask, _lengths_mask(query_seq_lengths, key_value_seq_lengths))
  mask = _and(mask, _window_mask(local_window_size))
  return _and(mask, CausalMask()) if is_causal else mask


def _lengths_mask(q_lengths, kv_lengths):
  """jax.nn's ``query_seq_lengths``/``key_value_seq_lengths`` as a Mask (batch axes kept)."""
  def ints(name, x):
    if x is None:
      return None
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.integer):
      raise TypeError(f"{name} must be an integer array of shape [batch...], got dtype {x.dtype}")
    return x.astype(jnp.int32)
  q, k = ints("query_seq_lengths", q_lengths), ints("key_value_seq_lengths", kv_lengths)
  return None if q is None and k is None else Mask(q_lengths=q, kv_lengths=k)


def _window_mask(size):
  """jax.nn's ``local_window_size`` (``w`` or ``(left, right)``) as a LocalWindowMask."""
  if size is None:
    return None
  if isinstance(size, (int, np.integer)) and not isinstance(size, bool):
    size = (int(size), int(size))
  if (not isinstance(size, (tuple, list)) or len(size) != 2
      or not all(v is None or (isinstance(v, (int, np.integer)) and not isinstance(v, bool)) for v in size)):
    raise TypeError(f"local_window_size must be an int or a (left, right) pair of ints, got {size!r}")
  if any(v is not None and v < 0 for v in size):
    raise ValueError(f"local_window_size must be >= 0, got {size!r}")
  return LocalWindowMask(*size)


def _flatten_mask_arrays(mask: Mask, batch_dims):
  """A Mask's per-batch arrays with ``batch...`` leading axes flattened to one, as q/k/v are."""
  n = len(batch_dims)

  def flat(x, extra):
    if x is None or not hasattr(x, "shape") or len(batch_dims) == 1:
      return x
    if x.ndim == n + extra and tuple(x.shape[:n]) == batch_dims:
      return jnp.reshape(x, (math.prod(batch_dims),) + tuple(x.shape[n:]))
    return x  # flattened already, or wrong: Mask.validate names the expected shape
  # Per-batch ([batch...]) arrays have role "b"; per position ([batch..., len]) "bt"/"bs".
  return mask.with_arrays(flat(x, 0 if role == "b" else 1) for role, x in mask.arrays())


def _flatten_dense(name, x, batch_dims, heads, q_len, kv_len):
  """A dense mask or bias broadcastable to ``[batch..., heads, q_len, kv_len]`` as a rank-4
  array ``[prod(batch) | 1, heads | 1, q_len | 1, kv_len | 1]``."""
  if x is None:
    return None
  if not hasattr(x, "shape"):
    raise TypeError(f"{name} must be an array broadcastable to [batch..., heads, q_len, kv_len], "
                    f"got {type(x).__name__}")
  full = batch_dims + (heads, q_len, kv_len)
  rank = len(full)
  if x.ndim > rank:
    raise ValueError(f"{name} of shape {tuple(x.shape)} has more axes than [batch..., heads, q_len, "
                     f"kv_len] = {full}")
  if x.ndim < rank and any(d != 1 for d in x.shape[:-2]):
    raise ValueError(
        f"{name} of shape {tuple(x.shape)} is ambiguous: it has fewer axes than [batch..., heads, "
        f"q_len, kv_len] = {full}, so its leading axis could be batch or heads (jax.nn and Flax "
        f"broadcast it as heads). Pass all {rank} axes, e.g. {name}[:, None] for [batch, 1, q_len, "
        f"kv_len] or {name}[None] for [1, heads, q_len, kv_len]")
  x = jnp.reshape(x, (1,) * (rank - x.ndim) + tuple(x.shape))
  lead = tuple(x.shape[:len(batch_dims)])
  if all(d == 1 for d in lead):
    return jnp.reshape(x, (1,) + tuple(x.shape[len(batch_dims):]))
  if any(d not in (1, want) for d, want in zip(lead, batch_dims)):
    raise ValueError(f"{name} of shape {tuple(x.shape)} does not broadcast to [batch..., heads, q_len, "
                     f"kv_len] = {full}")
  x = jnp.broadcast_to(x, batch_dims + tuple(x.shape[len(batch_dims):]))
  return jnp.reshape(x, (math.prod(batch_dims),) + tuple(x.shape[len(batch_dims):]))


def _soft_capped(score_mod, cap):
  """``score_mod`` followed by ``cap * tanh(s / cap)``; a Python float cap keeps the modifier
  free of arrays, so the kernels can run it."""
  if cap is None:
    return score_mod
  if not is_traced(cap):
    cap = float(cap)
    if not (np.isfinite(cap) and cap > 0):
      raise ValueError(f"logits_soft_cap must be a finite number > 0, got {cap}")
  return _SoftCapped(score_mod, cap)


@dataclasses.dataclass(frozen=True)
class _SoftCapped:
  """``user`` (None: the identity) followed by ``cap * tanh(s / cap)``: a value (equal for equal
  ``user`` and ``cap``), so that eager calls with the same cap share one compiled computation."""

  user: Callable | None
  cap: object

  def __call__(self, s, b, h, i, j):
    s = s if self.user is None else self.user(s, b, h, i, j)
    return self.cap * jnp.tanh(s / self.cap)


def _lse(query, key, shape: base.AttentionShape, *, bias, mask, dense_mask, score_mod, scale, precision):
  """``logsumexp`` over keys of the masked, scaled scores, ``[batch, q_len, heads]`` float32
  (float64 for float64 inputs), without gradient."""
  query, key = jax.lax.stop_gradient(query), jax.lax.stop_gradient(key)
  scale = check_scale(scale, shape.head_dim)
  acc = jnp.promote_types(shape.dtype, jnp.float32)
  b, tq, h, d = query.shape
  q = query.reshape(b, tq, shape.kv_heads, shape.groups, d)
  s = jnp.einsum("bqkgd,bskd->bkgqs", q, key, precision=precision, preferred_element_type=acc)
  s = s.reshape(b, h, tq, shape.kv_len) * scale
  if bias is not None:
    s = s + jax.lax.stop_gradient(bias).astype(acc)
  bi = jnp.arange(b)[:, None, None, None]
  hi = jnp.arange(h)[None, :, None, None]
  qi = jnp.arange(tq)[None, None, :, None]
  ki = jnp.arange(shape.kv_len)[None, None, None, :]
  if score_mod is not None:
    s = score_mod(s, bi, hi, qi, ki).astype(acc)
  ok = jnp.ones(s.shape, bool)
  if mask is not None:  # element() gives [batch, q, k] for per-batch arrays, else [q, k]; per head [b|1, h, q, k]
    e = mask.element(jnp.arange(tq)[:, None], jnp.arange(shape.kv_len)[None, :])
    ok = ok & (e if e.ndim == 4 else e[..., None, :, :])
  if dense_mask is not None:
    ok = ok & dense_mask
  s = jnp.where(ok, s, -jnp.inf)
  lse = jax.nn.logsumexp(s, axis=-1)  # rows with no valid key: -inf
  return jax.lax.stop_gradient(jnp.transpose(lse, (0, 2, 1)))


_lse_once = compile_once(_lse)


def flex_attention(query, key, value, *, mask: Mask | None = None, score_mod: Callable | None = None,
                   scale: float | None = None, implementation: str | None = None,
                   backward_pass_impl: str = "auto", forward_config=None, backward_config=None,
                   split_kv=None, interpret: bool = False):
  """Attention with a position mask and a functional score modifier.

  Args:
    query: ``[batch, q_len, heads, head_dim]``; key, value ``[batch, kv_len, kv_heads, head_dim]``.
    mask: a :class:`Mask` (combine with ``&``); tiles it empties are skipped. Or a function
      ``mask_mod(b, h, q_idx, kv_idx) -> bool`` (PyTorch flex's mask_mod): ``MaskMod(mask_mod)``
      for this call's batch and heads (:mod:`probjax.ops.attention.masks.mask_mod`; the XLA
      path computes it, skipping the tiles it empties, found at trace time, and so does the
      Triton kernel with ``implementation="triton"``).
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
  mask = _mask_mod(mask, shape.batch, shape.q_heads)
  if mask is not None and not isinstance(mask, Mask):
    raise TypeError(f"flex_attention's mask must be a probjax Mask (e.g. CausalMask()) or a mask_mod function, "
                    f"got {type(mask).__name__}; use dot_product_attention for dense boolean masks")
  if mask is not None:
    mask.validate(shape.batch, shape.q_len, shape.kv_len)
    _check_heads(mask, shape.q_heads)
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
  scale = check_scale(scale, shape.head_dim)
  if is_traced(scale):
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
      v_head_dim=value.shape[-1], scale=scale, device=device)
  cudnn_config = isinstance(forward_config, CudnnConfig)
  if cudnn_config and (decision.implementation != "cudnn" or backward_config is not None):
    raise ValueError(f"a CudnnConfig configures the cuDNN route (no backward_config), but this call runs "
                     f"{decision}; pass implementation='cudnn'")
  if (not cudnn_config and (forward_config is not None or backward_config is not None)
      and decision.implementation not in ("triton", "mosaic")):
    raise ValueError(f"forward_config/backward_config configure the Triton or Mosaic kernel, but this call "
                     f"runs {decision}; pass implementation='triton' or 'mosaic'")
  call = None
  if decision.implementation != "xla":
    # The kernels' call description; its mask is the argument below (arrays never in a key).
    call = AttentionCall(query.shape, key.shape, shape.dtype, score_mod=score_mod, scale=scale,
                         v_head_dim=value.shape[-1],
                         backward_pass_impl=backward_pass_impl, split_kv=split_kv,
                         forward_config=forward_config, backward_config=backward_config, interpret=interpret)
  run = _Run(decision, device, call, score_mod, scale, dropout_rate, broadcast_dropout, precision)
  # ``module`` receives the attention weights (sown as the call runs): run as it is.
  compute = _compute if module is not None else _compute_once
  return compute(run, query, key, value, mask, bias, dense_mask, dropout_rng, module)


@dataclasses.dataclass(frozen=True)
class _Run:
  """What a call computes besides its arrays, once validated and dispatched: the key under
  which eager calls share one compiled computation (:func:`probjax.core.eager.compile_once`)."""

  decision: Decision
  device: Device
  call: AttentionCall | None  # the kernels' call (its mask left out); None on the XLA path
  score_mod: Callable | None
  scale: float
  dropout_rate: float
  broadcast_dropout: bool
  precision: object


def _compute(run: _Run, query, key, value, mask, bias, dense_mask, dropout_rng, module=None):
  decision = run.decision
  if run.call is not None:
    call = dataclasses.replace(run.call, mask=mask)
    runner = lambda d: None if d is None else functools.partial(
        registry.REGISTRY.get(d.implementation), call=call, backward_pass_impl=d.backward)
    exact = _exact(query, key, run.device, run.score_mod, run.scale)
    tangents = (registry.REGISTRY.get(name).tangent_kernel(call, exact)
                for name in dispatch.tangent_candidates(decision, call, run.device))
    tangent = next((t for t in tangents if t is not None), None)
    return with_forward_mode(runner(decision), exact, runner(decision.grad), tangent)(query, key, value, mask)
  return xla_backend.attention(query, key, value, formulation=decision.get("formulation", "auto"), module=module,
                               bias=bias, mask=mask, dense_mask=dense_mask, score_mod=run.score_mod,
                               scale=run.scale, dropout_rate=run.dropout_rate, dropout_rng=dropout_rng,
                               broadcast_dropout=run.broadcast_dropout, precision=run.precision)


_compute_once = compile_once(_compute)


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
