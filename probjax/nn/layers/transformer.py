"""Pre-norm transformer blocks, a scanned layer stack and a decoder-only LM.

:class:`Transformer` creates its ``num_layers`` blocks with ``nnx.vmap`` (parameters stacked
on a leading layer axis) and applies them with ``nnx.scan``: one compiled block, not
``num_layers`` copies; ``remat=True`` wraps the block in ``nnx.remat``.

Its KV cache is one :class:`~probjax.nn.layers.kv_cache.KVCache` with one ``lengths
[batch]`` for every layer, in one of two layouts (``init_cache(..., layout=)``):

* ``"per_layer"`` (default): k and v are tuples of ``layers`` arrays ``[batch, max_len,
  kv_heads, head_dim]``. ``prefill``/``decode_step`` unroll the layer loop (``layers`` copies of
  the block in the decode program) over :meth:`Transformer.unstacked` blocks, whose
  parameters a decode loop slices once outside the loop (``decode_step(..., layers=)``), and
  every layer's K/V is written and read in place: the decoding layout.
* ``"stacked"``: k and v ``[layers, batch, max_len, kv_heads, head_dim]``, carried through the
  same ``nnx.scan`` as training (one compiled block) and written in place at the layer's
  index; but each layer's K/V reaches attention as a dynamic slice of the carry, which XLA
  may copy (a copy of the whole cache per step).
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from probjax.nn.layers.attention import dot_product_attention
from probjax.nn.layers import kv_cache as kvc
from probjax.nn.layers._checks import check_array, check_mask
from probjax.nn.layers.mlp import ACTIVATIONS as MLP_KINDS, FiLM, MLP
from probjax.nn.layers.multi_head_attention import MultiHeadAttention, check_heads

__all__ = ["TransformerBlock", "Transformer", "TransformerLM"]

NORMS = ("layernorm", "rmsnorm")


def _norm(kind, features, dtype, param_dtype, rngs):
  if kind == "layernorm":
    return nnx.LayerNorm(features, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
  return nnx.RMSNorm(features, dtype=dtype, param_dtype=param_dtype, rngs=rngs)


class TransformerBlock(nnx.Module):
  """Pre-norm block on ``[batch, seq, features]``: ``x + attn(norm(x))``, then (with
  ``context_features``) ``x + cross_attn(norm(x), context)``, then ``x + mlp(norm(x))``.

  Args:
    features, num_heads, num_kv_heads, head_dim, rotary, rotary_base, qk_norm, is_causal:
      of the self-attention (see :class:`MultiHeadAttention`).
    mlp: "gelu" or "swiglu"; mlp_features: its hidden width (see :class:`MLP`).
    norm: "layernorm" or "rmsnorm".
    context_features: features of a cross-attention context (None: no cross-attention).
    film_features: features of a FiLM conditioning vector modulating each normalized
      sublayer input (None: no FiLM).
    dropout_rate: residual dropout; attention_dropout_rate: on the attention weights.
    attention_fn: passed to every attention layer.

  >>> import jax.numpy as jnp
  >>> from flax import nnx
  >>> blk = TransformerBlock(features=32, num_heads=4, mlp="swiglu", norm="rmsnorm",
  ...                        context_features=8, film_features=3, rngs=nnx.Rngs(0))
  >>> apply = nnx.jit(lambda m, x, c, f: m(x, context=c, film=f))
  >>> apply(blk, jnp.ones((2, 6, 32)), jnp.ones((2, 5, 8)), jnp.ones((2, 3))).shape
  (2, 6, 32)
  """

  def __init__(self, *, features: int, num_heads: int, num_kv_heads: int | None = None,
               head_dim: int | None = None, mlp: str = "gelu", mlp_features: int | None = None,
               norm: str = "layernorm", rotary: bool = False, rotary_base: float = 10000.0,
               qk_norm: bool = False, is_causal: bool = False, context_features: int | None = None,
               film_features: int | None = None, dropout_rate: float = 0.0,
               attention_dropout_rate: float = 0.0, use_bias: bool = False,
               attention_fn: Callable = dot_product_attention, dtype=None,
               param_dtype=jnp.float32, rngs: nnx.Rngs):
    if norm not in NORMS:
      raise ValueError(f"norm must be one of {NORMS}, got {norm!r}")
    if mlp not in MLP_KINDS:
      raise ValueError(f"mlp must be one of {MLP_KINDS}, got {mlp!r}")
    if not 0.0 <= dropout_rate < 1.0:
      raise ValueError(f"dropout_rate must lie in [0, 1), got {dropout_rate}")
    check_heads(features, num_heads, num_kv_heads, head_dim)
    self.features, self.context_features, self.film_features = features, context_features, film_features
    kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    attn = dict(num_heads=num_heads, in_features=features, num_kv_heads=num_kv_heads,
                head_dim=head_dim, use_bias=use_bias, dropout_rate=attention_dropout_rate,
                attention_fn=attention_fn, **kw)
    self.attn_norm = _norm(norm, features, dtype, param_dtype, rngs)
    self.attn = MultiHeadAttention(rotary=rotary, rotary_base=rotary_base, qk_norm=qk_norm,
                                   is_causal=is_causal, **attn)
    if context_features is not None:
      self.cross_norm = _norm(norm, features, dtype, param_dtype, rngs)
      self.cross = MultiHeadAttention(context_features=context_features, qk_norm=qk_norm, **attn)
    else:
      self.cross_norm = self.cross = None
    self.mlp_norm = _norm(norm, features, dtype, param_dtype, rngs)
    self.mlp = MLP(features=features, hidden_features=mlp_features, activation=mlp,
                   use_bias=use_bias, **kw)
    n_sites = 2 + (context_features is not None)
    self.film = (None if film_features is None else
                 FiLM(features=features, context_features=film_features, num=n_sites, **kw))
    self.dropout = nnx.Dropout(dropout_rate, rngs=rngs) if dropout_rate > 0 else None

  def check_inputs(self, x, seq="seq", *, context=None, context_mask=None, film=None, positions=None,
                   mask=None):
    """Static checks of a call's inputs (ValueError for shapes, TypeError for dtypes and types,
    naming the argument): floating ``x [batch, seq, features]``, integer ``positions [batch,
    seq]``, ``mask`` fitting ``[batch, seq, seq]``, floating ``context [batch, ctx_seq,
    context_features]`` with ``context_mask`` fitting ``[batch, seq, ctx_seq]``, floating
    ``film [batch, film_features]``. Returns the sizes bound (``batch``, ``seq``, ...)."""
    s = check_array("x", x, ("batch", seq, ("features", self.features)))
    b, t = s["batch"][0], s[seq][0]
    if positions is not None:
      check_array("positions", positions, ("batch", seq), dtype="int", sizes=s)
    check_mask(mask, b, t, t)
    if context is not None and self.context_features is not None:
      s = check_array("context", context, ("batch", "ctx_seq", ("context_features", self.context_features)),
                      sizes=s)
      check_mask(context_mask, b, t, s["ctx_seq"][0], name="context_mask")
    if film is not None and self.film_features is not None:
      check_array("film", film, ("batch", ("film_features", self.film_features)), sizes=s)
    return s

  def _residual(self, x, y, deterministic):
    if self.dropout is not None:
      if deterministic is None:
        raise ValueError("deterministic must be given (True or False) when dropout_rate > 0")
      y = self.dropout(y, deterministic=deterministic)
    return x + y.astype(x.dtype)

  def _apply(self, x, self_attn, *, context, context_mask, film, deterministic):
    """The block with ``self_attn(h) -> (y, aux)`` as its self-attention; returns (x, aux)."""
    if (film is None) != (self.film is None):
      raise ValueError("film must be given exactly when the block has film_features"
                       if self.film is not None else "film given to a block without film_features")
    if (context is None) != (self.cross is None):
      raise ValueError("context must be given exactly when the block has context_features"
                       if self.cross is not None else "context given to a block without context_features")
    mods = self.film(film) if self.film is not None else [None] * 3
    y, aux = self_attn(FiLM.apply(self.attn_norm(x), mods[0]))
    x = self._residual(x, y, deterministic)
    if self.cross is not None:
      h = FiLM.apply(self.cross_norm(x), mods[1])
      x = self._residual(x, self.cross(h, context, mask=context_mask, deterministic=deterministic),
                         deterministic)
    x = self._residual(x, self.mlp(FiLM.apply(self.mlp_norm(x), mods[-1])), deterministic)
    return x, aux

  def __call__(self, x, *, context=None, context_mask=None, film=None, positions=None, mask=None,
               deterministic: bool | None = None):
    """``x [batch, seq, features] -> [batch, seq, features]``. ``context [batch, ctx_seq,
    context_features]`` and ``context_mask`` (e.g. ``KVLenMask``) for cross-attention; ``film
    [batch, film_features]``; ``positions``/``mask`` as in :class:`MultiHeadAttention`. Wrong
    shapes or dtypes raise ValueError / TypeError naming the argument (:meth:`check_inputs`)."""
    self.check_inputs(x, context=context, context_mask=context_mask, film=film, positions=positions, mask=mask)
    attn = lambda h: (self.attn(h, positions=positions, mask=mask, deterministic=deterministic), None)
    return self._apply(x, attn, context=context, context_mask=context_mask, film=film,
                       deterministic=deterministic)[0]

  def prefill(self, x, cache, lengths, *, layer=None, positions=None, context=None,
              context_mask=None, film=None):
    """As :meth:`MultiHeadAttention.prefill` for the block; returns ``(x, cache)``."""
    self.check_inputs(x, "P", context=context, context_mask=context_mask, film=film, positions=positions)
    attn = lambda h: self.attn.prefill(h, cache, lengths, positions=positions, layer=layer)
    return self._apply(x, attn, context=context, context_mask=context_mask, film=film,
                       deterministic=True)

  def decode_step(self, x, cache, *, layer=None, positions=None, context=None, context_mask=None,
                  film=None):
    """As :meth:`MultiHeadAttention.decode_step` for the block; returns ``(x, cache)``."""
    self.check_inputs(x, "n", context=context, context_mask=context_mask, film=film, positions=positions)
    attn = lambda h: self.attn.decode_step(h, cache, positions=positions, layer=layer)
    return self._apply(x, attn, context=context, context_mask=context_mask, film=film,
                       deterministic=True)


class Transformer(nnx.Module):
  """``num_layers`` :class:`TransformerBlock` s with stacked parameters, applied by ``nnx.scan``.

  ``Transformer(*, num_layers, remat=False, rngs, **block_kwargs)``: ``block_kwargs`` are
  :class:`TransformerBlock`'s (``features``, ``num_heads``, ...). ``remat=True`` recomputes each
  block's activations in the backward pass (``nnx.remat``).

  >>> import jax.numpy as jnp
  >>> from flax import nnx
  >>> tr = Transformer(num_layers=3, features=16, num_heads=2, rngs=nnx.Rngs(0))
  >>> tr.blocks.mlp.up.kernel.shape  # stacked on a leading layer axis
  (3, 16, 64)
  >>> nnx.jit(lambda m, x: m(x))(tr, jnp.ones((2, 5, 16))).shape
  (2, 5, 16)
  """

  def __init__(self, *, num_layers: int, remat: bool = False, rngs: nnx.Rngs, **block_kwargs):
    if num_layers < 1:
      raise ValueError(f"num_layers must be >= 1, got {num_layers}")
    self.num_layers, self.remat = num_layers, remat

    @nnx.split_rngs(splits=num_layers)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def make(rngs):
      return TransformerBlock(rngs=rngs, **block_kwargs)

    self.blocks = make(rngs)
    attn = self.blocks.attn
    self.num_kv_heads, self.head_dim = attn.num_kv_heads, attn.head_dim
    self.dtype, self.param_dtype = attn.dtype, attn.param_dtype

  def _scan(self, body, carry):
    if self.remat:
      body = nnx.remat(body)
    return nnx.scan(body, in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)(carry, self.blocks)

  def __call__(self, x, *, context=None, context_mask=None, film=None, positions=None, mask=None,
               deterministic: bool | None = None):
    """``[batch, seq, features] -> [batch, seq, features]``; arguments as in
    :meth:`TransformerBlock.__call__`, shared by every layer (and checked as there)."""
    self.blocks.check_inputs(x, context=context, context_mask=context_mask, film=film, positions=positions,
                             mask=mask)
    def body(x, block):
      return block(x, context=context, context_mask=context_mask, film=film, positions=positions,
                   mask=mask, deterministic=deterministic)
    return self._scan(body, x)

  def init_cache(self, batch: int, max_len: int, dtype=None, *, layout: str = "per_layer") -> kvc.KVCache:
    """An empty cache (zeros, lengths 0) in ``layout`` "per_layer" (k, v: tuples of
    ``num_layers`` arrays ``[batch, max_len, num_kv_heads, head_dim]``) or "stacked" (k, v
    ``[num_layers, batch, max_len, num_kv_heads, head_dim]``); see the module docstring."""
    dtype = dtype or self.dtype or self.param_dtype
    return kvc.KVCache.init(batch, max_len, kv_heads=self.num_kv_heads, head_dim=self.head_dim,
                            dtype=dtype, num_layers=self.num_layers, layout=layout)

  def unstacked(self) -> list[TransformerBlock]:
    """The ``num_layers`` blocks as separate modules, each with its slice of the stacked
    parameters (copies). A decode loop slices them once, outside the loop, and passes them to
    every step as ``layers=`` (:func:`~probjax.nn.layers.decoding.decode_loop` does)."""
    graphdef, state = nnx.split(self.blocks)
    return [nnx.merge(graphdef, jax.tree.map(lambda a, i=i: a[i], state)) for i in range(self.num_layers)]

  def _check_cache(self, cache, sizes):
    kvc.check_cache(cache, sizes, (("num_kv_heads", self.num_kv_heads), ("head_dim", self.head_dim)),
                    num_layers=self.num_layers)

  def _cached(self, method, x, cache, layers=None, **kw):
    if cache.per_layer:
      if len(cache.k) != self.num_layers:
        raise ValueError(f"the cache has {len(cache.k)} layers, the model {self.num_layers}")
      layers = self.unstacked() if layers is None else layers
      if len(layers) != self.num_layers:
        raise ValueError(f"layers: {len(layers)} blocks given, the model has {self.num_layers}")
      ks, vs = [], []
      for i, block in enumerate(layers):
        x, c = getattr(block, method)(x, kvc.KVCache(cache.k[i], cache.v[i], cache.lengths), **kw)
        ks.append(c.k)
        vs.append(c.v)
      return x, tuple(ks), tuple(vs)
    def body(carry, block):
      x, k, v, i = carry
      x, c = getattr(block, method)(x, kvc.KVCache(k, v, cache.lengths), layer=i, **kw)
      return x, c.k, c.v, i + 1

    if layers is not None:
      raise ValueError("layers= is for the per-layer cache layout")
    x, k, v, _ = nnx.scan(body, in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)(
        (x, cache.k, cache.v, jnp.zeros((), jnp.int32)), self.blocks)
    return x, k, v

  def prefill(self, x, cache: kvc.KVCache, lengths, *, positions=None, context=None,
              context_mask=None, film=None):
    """Right-padded prompts ``x [batch, P, features]`` with ``lengths [batch]`` into an empty
    stacked cache; returns ``(y [batch, P, features], cache)`` with ``cache.lengths = lengths``."""
    self._check_cache(cache, self.blocks.check_inputs(x, "P", context=context, context_mask=context_mask,
                                                      film=film, positions=positions))
    kvc.check_prefix(cache, x.shape[1], lengths)
    x, k, v = self._cached("prefill", x, cache, lengths=lengths, positions=positions,
                           context=context, context_mask=context_mask, film=film)
    return x, kvc.KVCache(k, v, jnp.asarray(lengths, jnp.int32))

  def decode_step(self, x, cache: kvc.KVCache, *, positions=None, context=None, context_mask=None,
                  film=None, layers=None):
    """``x [batch, n, features]`` new tokens at ``cache.lengths[b] + arange(n)``; returns
    ``(y [batch, n, features], cache)`` with lengths advanced by ``n``. ``layers``: the
    :meth:`unstacked` blocks to use (per-layer cache; default: sliced here)."""
    self._check_cache(cache, self.blocks.check_inputs(x, "n", context=context, context_mask=context_mask,
                                                      film=film, positions=positions))
    n = x.shape[1]
    kvc.check_room(cache, n)
    x, k, v = self._cached("decode_step", x, cache, layers=layers, positions=positions,
                           context=context, context_mask=context_mask, film=film)
    return x, kvc.KVCache(k, v, cache.lengths + n)


class TransformerLM(nnx.Module):
  """Decoder-only language model: token embedding, a causal :class:`Transformer` (RoPE),
  final norm and a tied (``embed.attend``) or untied output head.

  ``TransformerLM(*, vocab_size, features, num_layers, num_heads, tie_embeddings=True,
  mlp="swiglu", norm="rmsnorm", rotary=True, remat=False, rngs, **block_kwargs)``.
  Logits are float32 ``[batch, seq, vocab_size]`` (float64 for float64 params).

  >>> import jax.numpy as jnp
  >>> from flax import nnx
  >>> lm = TransformerLM(vocab_size=11, features=16, num_layers=2, num_heads=2, num_kv_heads=1,
  ...                    rngs=nnx.Rngs(0))
  >>> nnx.jit(lambda m, t: m(t))(lm, jnp.zeros((2, 7), jnp.int32)).shape
  (2, 7, 11)
  >>> cache = lm.init_cache(2, 16)        # see decoding.generate for prefill + decode_step
  >>> len(cache.k), cache.k[0].shape      # per layer: [batch, max_len, kv_heads, head_dim]
  (2, (2, 16, 1, 8))
  """

  def __init__(self, *, vocab_size: int, features: int, num_layers: int, num_heads: int,
               tie_embeddings: bool = True, mlp: str = "swiglu", norm: str = "rmsnorm",
               rotary: bool = True, remat: bool = False, dtype=None, param_dtype=jnp.float32,
               rngs: nnx.Rngs, **block_kwargs):
    if vocab_size < 1:
      raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
    self.vocab_size, self.tie_embeddings = vocab_size, tie_embeddings
    self.embed = nnx.Embed(vocab_size, features, dtype=dtype, param_dtype=param_dtype,
                           embedding_init=nnx.initializers.normal(features ** -0.5), rngs=rngs)
    self.transformer = Transformer(num_layers=num_layers, remat=remat, features=features,
                                   num_heads=num_heads, mlp=mlp, norm=norm, rotary=rotary,
                                   is_causal=True, dtype=dtype, param_dtype=param_dtype, rngs=rngs,
                                   **block_kwargs)
    self.final_norm = _norm(norm, features, dtype, param_dtype, rngs)
    self.head = (None if tie_embeddings else
                 nnx.Linear(features, vocab_size, use_bias=False, dtype=dtype,
                            param_dtype=param_dtype, rngs=rngs))

  def _logits(self, h):
    h = self.final_norm(h)
    out = self.embed.attend(h) if self.head is None else self.head(h)
    return out.astype(jnp.promote_types(out.dtype, jnp.float32))  # float32 (float64 stays)

  def __call__(self, tokens, *, positions=None, mask=None, deterministic: bool | None = None):
    """``tokens [batch, seq]`` ints -> logits ``[batch, seq, vocab]``; causal, combined with
    ``mask`` (e.g. ``SegmentMask(doc_ids)`` with per-document ``positions``). Float tokens
    raise TypeError, other shapes ValueError, naming ``tokens``."""
    check_array("tokens", tokens, ("batch", "seq"), dtype="int")
    h = self.transformer(self.embed(tokens), positions=positions, mask=mask,
                         deterministic=deterministic)
    return self._logits(h)

  def init_cache(self, batch: int, max_len: int, dtype=None, *, layout: str = "per_layer") -> kvc.KVCache:
    """See :meth:`Transformer.init_cache`."""
    return self.transformer.init_cache(batch, max_len, dtype, layout=layout)

  def prefill(self, tokens, lengths, cache: kvc.KVCache, *, positions=None):
    """Right-padded prompts ``tokens [batch, P]`` with ``lengths [batch]``; returns
    ``(logits [batch, P, vocab], cache)``. The next-token logits of element ``b`` are at
    ``lengths[b] - 1``."""
    check_array("tokens", tokens, ("batch", "P"), dtype="int")
    h, cache = self.transformer.prefill(self.embed(tokens), cache, lengths, positions=positions)
    return self._logits(h), cache

  def decode_step(self, tokens, cache: kvc.KVCache, *, positions=None, layers=None):
    """``tokens [batch, n]`` (one or several new tokens per element); returns
    ``(logits [batch, n, vocab], cache)``. ``layers``: see :meth:`Transformer.decode_step`."""
    check_array("tokens", tokens, ("batch", "n"), dtype="int")
    h, cache = self.transformer.decode_step(self.embed(tokens), cache, positions=positions,
                                            layers=layers)
    return self._logits(h), cache
