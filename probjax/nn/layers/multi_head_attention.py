"""Multi-head attention (self and cross, GQA/MQA, RoPE, q/k RMS-norm, KV-cache decoding).

Self-attention projects ``x`` to q, k and v with one fused matmul; cross-attention projects
``x`` to q and the context to k and v (one matmul each). Keys and values keep their
``num_kv_heads`` heads all the way into ``attention_fn`` (never repeated). ``attention_fn``
defaults to :func:`probjax.nn.layers.attention.dot_product_attention` and is called as
``attention_fn(q, k, v, mask=..., is_causal=..., dropout_rng=..., dropout_rate=...,
broadcast_dropout=..., deterministic=...)`` with ``[batch, seq, heads, head_dim]`` arrays.

Decoding uses the functional :class:`~probjax.nn.layers.kv_cache.KVCache`:
:meth:`MultiHeadAttention.prefill` writes right-padded prompts at ``[0, P)`` and sets the
per-element lengths; :meth:`MultiHeadAttention.decode_step` writes ``n`` new tokens of element
``b`` at ``lengths[b] + arange(n)`` and attends over the cache: with ``KVLenMask(lengths + 1)``
for one token, and for ``n > 1`` with the dense boolean mask ``k <= lengths[b] + i`` (no
structured probjax mask has a per-batch causal offset). A
:class:`~probjax.nn.layers.kv_cache.PagedKVCache` (:meth:`MultiHeadAttention.init_paged_cache`)
stands in for it: the tokens are written through its page table and ``attention_fn`` is called
with the page pools as k and v and ``page_table=`` (probjax's ``dot_product_attention`` takes it).
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from probjax.nn.layers.attention import dot_product_attention
from probjax.nn.layers import kv_cache as kvc
from probjax.nn.layers import _sharding as shd
from probjax.nn.layers._checks import check_array, check_mask
from probjax.nn.layers.rotary import apply_rotary, default_positions
from probjax.ops.norm import qk_norm_rotary
from probjax.ops.attention.masks import KVLenMask

__all__ = ["MultiHeadAttention", "check_heads"]


def check_heads(features: int, num_heads: int, num_kv_heads: int | None, head_dim: int | None,
                features_name: str = "features"):
  """``(num_kv_heads, head_dim)`` after validation (ValueError naming the argument;
  ``features_name``: the caller's name for ``features``)."""
  if num_heads < 1:
    raise ValueError(f"num_heads must be >= 1, got {num_heads}")
  num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
  if num_kv_heads < 1 or num_heads % num_kv_heads:
    raise ValueError(f"num_kv_heads ({num_kv_heads}) must divide num_heads ({num_heads})")
  if head_dim is None:
    if features % num_heads:
      raise ValueError(f"{features_name} ({features}) must be divisible by num_heads ({num_heads}), "
                       "or pass head_dim")
    head_dim = features // num_heads
  if head_dim < 1:
    raise ValueError(f"head_dim must be >= 1, got {head_dim}")
  return num_kv_heads, head_dim


class MultiHeadAttention(nnx.Module):
  """Multi-head attention on ``[batch, seq, features]``.

  Args:
    num_heads: query heads; ``num_kv_heads``: key/value heads (default ``num_heads``; must
      divide it: GQA, or MQA with 1).
    in_features: features of ``x``; ``out_features`` (default ``in_features``).
    head_dim: per-head features (default ``in_features // num_heads``).
    context_features: features of the cross-attention context; None: self-attention.
    rotary: apply RoPE to q and k (self-attention only); ``rotary_base`` its base.
    qk_norm: RMS-normalize q and k per head (learned scale) before RoPE.
    is_causal: default causal masking (a call's ``is_causal`` overrides it).
    dropout_rate, broadcast_dropout: attention-weight dropout, through ``attention_fn``.
    attention_fn: the attention function (see the module docstring).
    dtype: compute dtype (None: from the inputs and params); param_dtype: parameter dtype.

  >>> import jax.numpy as jnp
  >>> from flax import nnx
  >>> mha = MultiHeadAttention(num_heads=4, num_kv_heads=2, in_features=32, rotary=True,
  ...                          qk_norm=True, is_causal=True, rngs=nnx.Rngs(0))
  >>> nnx.jit(lambda m, x: m(x))(mha, jnp.ones((2, 10, 32))).shape
  (2, 10, 32)
  """

  def __init__(self, *, num_heads: int, in_features: int, num_kv_heads: int | None = None,
               head_dim: int | None = None, out_features: int | None = None,
               context_features: int | None = None, use_bias: bool = False, rotary: bool = False,
               rotary_base: float = 10000.0, qk_norm: bool = False, is_causal: bool = False,
               dropout_rate: float = 0.0, broadcast_dropout: bool = True,
               attention_fn: Callable = dot_product_attention, kernel_init=None,
               dtype=None, param_dtype=jnp.float32, rngs: nnx.Rngs):
    self.num_kv_heads, self.head_dim = check_heads(in_features, num_heads, num_kv_heads, head_dim)
    if not 0.0 <= dropout_rate < 1.0:
      raise ValueError(f"dropout_rate must lie in [0, 1), got {dropout_rate}")
    if rotary and self.head_dim % 2:
      raise ValueError(f"rotary needs an even head_dim, got head_dim={self.head_dim}")
    if rotary and context_features is not None:
      raise ValueError("rotary applies to self-attention only (context_features is set)")
    self.num_heads, self.in_features = num_heads, in_features
    self.out_features = in_features if out_features is None else out_features
    self.context_features = context_features
    self.rotary, self.rotary_base, self.is_causal = rotary, rotary_base, is_causal
    self.dropout_rate, self.broadcast_dropout = dropout_rate, broadcast_dropout
    self.attention_fn = attention_fn
    self.dtype, self.param_dtype = dtype, param_dtype
    h, hk, d = num_heads, self.num_kv_heads, self.head_dim
    kw = dict(use_bias=use_bias, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    if kernel_init is not None:
      kw["kernel_init"] = kernel_init
    if context_features is None:
      self.qkv = nnx.Linear(in_features, (h + 2 * hk) * d, **kw, **shd.linear("embed", "heads"))
      self.q = self.kv = None
    else:
      self.qkv = None
      self.q = nnx.Linear(in_features, h * d, **kw, **shd.linear("embed", "heads"))
      self.kv = nnx.Linear(context_features, 2 * hk * d, **kw, **shd.linear(None, "heads"))
    self.out = nnx.Linear(h * d, self.out_features, **kw, **shd.linear("heads", "embed"))
    norm = lambda: nnx.RMSNorm(d, dtype=dtype, param_dtype=param_dtype, rngs=rngs, **shd.norm("kv"))
    self.q_norm = norm() if qk_norm else None
    self.k_norm = norm() if qk_norm else None
    self.rngs = rngs.dropout.fork() if dropout_rate > 0 else None

  # -- projections ---------------------------------------------------------------
  def _project(self, x, context, positions):
    """q ``[b, t, h, d]`` and k, v ``[b, s, hk, d]`` with q/k-norm and RoPE applied."""
    h, hk, d = self.num_heads, self.num_kv_heads, self.head_dim
    b, t = x.shape[:2]
    if self.qkv is not None:
      if context is not None:
        raise ValueError("context given to a self-attention layer (construct it with context_features)")
      qkv = self.qkv(x)
      q, k, v = jnp.split(qkv, [h * d, (h + hk) * d], axis=-1)
      s = t
    else:
      if context is None:
        raise ValueError("a cross-attention layer (context_features set) needs a context")
      q = self.q(x)
      k, v = jnp.split(self.kv(context), 2, axis=-1)
      s = context.shape[1]
    q, k, v = q.reshape(b, t, h, d), k.reshape(b, s, hk, d), v.reshape(b, s, hk, d)
    if self.rotary and positions is None:
      positions = default_positions(b, t)
    if self.rotary and not jnp.issubdtype(jnp.asarray(positions).dtype, jnp.integer):
      # Non-integer positions: the separate norm and rotation (the fused op takes integers).
      if self.q_norm is not None:
        q, k = self.q_norm(q), self.k_norm(k)
      return apply_rotary(q, positions, base=self.rotary_base), apply_rotary(k, positions, base=self.rotary_base), v
    if self.q_norm is not None or self.rotary:
      pos = positions if self.rotary else None
      q, k = self._norm_rotate(q, self.q_norm, pos), self._norm_rotate(k, self.k_norm, pos)
    return q, k, v

  def _norm_rotate(self, x, norm, positions):
    """``x [b, t, h, d]`` through ``norm`` (an ``nnx.RMSNorm`` or None) and RoPE by ``positions``
    (or None) in one :func:`~probjax.ops.norm.qk_norm_rotary` call; the norm's parameter stays
    the module's and its dtype rules are ``nnx.RMSNorm``'s (x and scale in ``norm.dtype``, else
    their common type)."""
    scale = None
    if norm is not None:
      scale = norm.scale[...]
      dt = norm.dtype or jnp.result_type(x, scale)
      x, scale = x.astype(dt), scale.astype(dt)
    return qk_norm_rotary(x, scale, positions, eps=norm.epsilon if norm is not None else 1e-6,
                          base=self.rotary_base)

  def _dropout(self, deterministic, rngs):
    if self.dropout_rate == 0.0 or deterministic in (None, True):
      if self.dropout_rate > 0.0 and deterministic is None:
        raise ValueError("deterministic must be given (True or False) when dropout_rate > 0")
      return dict(dropout_rng=None, dropout_rate=0.0, deterministic=True)
    stream = rngs.dropout if isinstance(rngs, nnx.Rngs) else (rngs or self.rngs)
    return dict(dropout_rng=stream(), dropout_rate=self.dropout_rate, deterministic=False)

  def _attend(self, q, k, v, *, mask, is_causal, deterministic=True, rngs=None, **kw):
    out = self.attention_fn(q, k, v, mask=mask, is_causal=is_causal,
                            broadcast_dropout=self.broadcast_dropout,
                            **self._dropout(deterministic, rngs), **kw)
    b, t = out.shape[:2]
    return self.out(out.reshape(b, t, self.num_heads * self.head_dim))

  # -- input checks (static: shapes and dtypes) -----------------------------------
  def _check_x(self, x, seq="seq", positions=None):
    """ValueError/TypeError naming ``x`` / ``positions`` unless ``x`` is floating ``[batch,
    seq, in_features]`` and ``positions`` (if given) integer ``[batch, seq]``."""
    s = check_array("x", x, ("batch", seq, ("in_features", self.in_features)))
    if positions is not None:
      check_array("positions", positions, ("batch", seq), dtype="int", sizes=s)
    return s

  def _check_cache(self, cache, sizes, layer):
    return kvc.check_cache(cache, sizes, (("num_kv_heads", self.num_kv_heads), ("head_dim", self.head_dim)),
                           layers=layer is not None)

  # -- forward -------------------------------------------------------------------
  def __call__(self, x, context=None, *, positions=None, mask=None, is_causal: bool | None = None,
               deterministic: bool | None = None, rngs=None):
    """Attention of ``x [batch, seq, in_features]`` to itself or to ``context [batch, ctx_seq,
    context_features]``.

    Args:
      positions: ``[batch, seq]`` int positions for RoPE (default ``arange(seq)``; packed
        documents pass per-document positions).
      mask: a probjax ``Mask`` (e.g. ``SegmentMask(ids)``, ``KVLenMask(ctx_lengths)``) or a
        boolean array broadcastable to ``[batch, heads, seq, kv_seq]``; passed through.
      is_causal: overrides the constructor's.
      deterministic: False applies attention dropout (needs ``dropout_rate > 0``).
    Returns:
      ``[batch, seq, out_features]``.
    """
    s = self._check_x(x, positions=positions)
    kv_len = s["seq"][0]
    if self.kv is None and context is not None:
      raise ValueError("context given to a self-attention layer (construct it with context_features)")
    if self.kv is not None:
      if context is None:
        raise ValueError("a cross-attention layer (context_features set) needs a context")
      s = check_array("context", context, ("batch", "ctx_seq", ("context_features", self.context_features)),
                      sizes=s)
      kv_len = s["ctx_seq"][0]
    check_mask(mask, s["batch"][0], s["seq"][0], kv_len)
    if self.dropout_rate > 0.0 and deterministic is None:
      raise ValueError("deterministic must be given (True or False) when dropout_rate > 0")
    q, k, v = self._project(x, context, positions)
    is_causal = self.is_causal if is_causal is None else is_causal
    return self._attend(q, k, v, mask=mask, is_causal=is_causal, deterministic=deterministic,
                        rngs=rngs)

  # -- decoding ------------------------------------------------------------------
  def init_cache(self, batch: int, max_len: int, dtype=None) -> kvc.KVCache:
    """An empty cache: k, v ``[batch, max_len, num_kv_heads, head_dim]``, lengths ``[batch]``."""
    dtype = dtype or self.dtype or self.param_dtype
    return kvc.KVCache.init(batch, max_len, kv_heads=self.num_kv_heads, head_dim=self.head_dim,
                            dtype=dtype)

  def init_paged_cache(self, batch: int, *, page_size: int, pages_per_seq: int | None = None,
                       num_pages: int | None = None, page_table=None, dtype=None) -> kvc.PagedKVCache:
    """An empty paged cache: pools ``[num_pages, page_size, num_kv_heads, head_dim]``, the page
    table ``[batch, pages_per_seq]`` (given, or the contiguous assignment) and lengths; see
    :meth:`PagedKVCache.init <probjax.nn.layers.kv_cache.PagedKVCache.init>`."""
    dtype = dtype or self.dtype or self.param_dtype
    return kvc.PagedKVCache.init(batch, page_size=page_size, pages_per_seq=pages_per_seq, num_pages=num_pages,
                                 page_table=page_table, kv_heads=self.num_kv_heads, head_dim=self.head_dim,
                                 dtype=dtype)

  def _check_decoding(self):
    if self.qkv is None:
      raise ValueError("KV-cache decoding is for self-attention layers (this one has context_features)")
    if not self.is_causal:
      raise ValueError("KV-cache decoding needs a causal layer (construct it with is_causal=True)")

  def prefill(self, x, cache: kvc.KVCache, lengths, *, positions=None, layer=None):
    """Runs right-padded prompts ``x [batch, P, in_features]`` (valid lengths ``[batch]``)
    causally and writes their keys/values at ``[0, P)`` of an empty ``cache``.

    Returns ``(y [batch, P, out_features], cache)`` with ``cache.lengths = lengths``; outputs
    at padded positions are unspecified. ``layer``: index into a stacked cache.
    """
    self._check_decoding()
    self._check_cache(cache, self._check_x(x, "P", positions), layer)
    kvc.check_prefix(cache, x.shape[1], lengths)
    q, k, v = self._project(x, None, positions)
    cache = kvc.write_prefix(cache, k, v, lengths, layer=layer)
    return self._attend(q, k, v, mask=None, is_causal=True), cache

  def decode_step(self, x, cache: kvc.KVCache, *, positions=None, layer=None):
    """Appends ``x [batch, n, in_features]`` (``n`` new tokens per element, at positions
    ``cache.lengths[b] + arange(n)``) to the cache and attends over it.

    Returns ``(y [batch, n, out_features], cache)`` with lengths advanced by ``n``.
    """
    self._check_decoding()
    self._check_cache(cache, self._check_x(x, "n", positions), layer)
    b, n = x.shape[:2]
    kvc.check_room(cache, n)
    if positions is None:
      positions = default_positions(b, n, cache.lengths)
    q, k_new, v_new = self._project(x, None, positions)
    cache = kvc.write(cache, k_new, v_new, layer=layer)
    paged = isinstance(cache, kvc.PagedKVCache)
    if n == 1:
      mask = KVLenMask(cache.lengths)
    else:  # causal within the new tokens, per-element offset: k <= lengths_before[b] + i
      limit = (cache.lengths - n)[:, None] + jnp.arange(n)                 # [b, n]
      mask = (jnp.arange(cache.max_len)[None, None, :] <= limit[:, :, None])[:, None]
      if paged:  # attention over pages reads the lengths from the mask
        mask = KVLenMask(cache.lengths) & mask
    if paged:
      return self._attend(q, cache.k_pages, cache.v_pages, mask=mask, is_causal=False,
                          page_table=cache.page_table), cache
    k, v = kvc.read(cache, layer=layer)
    return self._attend(q, k, v, mask=mask, is_causal=False), cache
