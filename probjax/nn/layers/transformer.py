"""Pre-norm transformer blocks, a layer stack and a decoder-only LM.

:class:`Transformer` creates its ``num_layers`` blocks with ``nnx.vmap`` (parameters stacked
on a leading layer axis) and applies them, by default, in a Python loop over per-layer views of
the same parameters (``num_layers`` compiled copies; the backward pass reads each block's
residuals where they were made) or, with ``scan_layers=True``, with ``nnx.scan`` (one compiled
block, not ``num_layers`` copies, so shorter compiles for deep stacks). Why the loop is the
default: under a scan XLA stacks every layer's residuals into ``[layers, ...]`` buffers with
dynamic-update-slices and copies, and its GPU dynamic-slice fusion duplicates a custom-call
kernel whose output is stacked (an attention forward then runs twice per layer); the train
steps of ``bench/lm_step.py`` and ``bench/dit_step.py`` measure the difference.
``remat=True`` wraps the block in ``nnx.remat``.

Its KV cache is one :class:`~probjax.nn.layers.kv_cache.KVCache` with one ``lengths
[batch]`` for every layer, in one of two layouts (``init_cache(..., layout=)``):

* ``"per_layer"`` (default): k and v are tuples of ``layers`` arrays ``[batch, max_len,
  kv_heads, head_dim]``. ``prefill``/``decode_step`` unroll the layer loop (``layers`` copies of
  the block in the decode program) over :meth:`Transformer.unstacked` blocks, whose
  parameters a decode loop slices once outside the loop (``decode_step(..., layers=)``), and
  every layer's K/V is written and read in place: the decoding layout.
* ``"stacked"``: k and v ``[layers, batch, max_len, kv_heads, head_dim]``, carried through an
  ``nnx.scan`` over the layers (one compiled block, whatever ``scan_layers`` says) and written
  in place at the layer's index; but each layer's K/V reaches attention as a dynamic slice of
  the carry, which XLA may copy (a copy of the whole cache per step).
"""

from __future__ import annotations

import numbers
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp
from flax import nnx

from probjax.nn.layers.attention import dot_product_attention
from probjax.nn.layers import kv_cache as kvc
from probjax.nn.layers import _sharding as shd
from probjax.nn.layers._checks import check_array, check_mask
from probjax.nn.layers.mlp import ACTIVATIONS as MLP_KINDS, FiLM, MLP, default_hidden_features
from probjax.nn.layers.multi_head_attention import MultiHeadAttention, check_heads
from probjax.ops.norm import layer_norm, rms_norm

__all__ = ["TransformerBlock", "Transformer", "TransformerLM", "MIXERS", "FFNS"]

NORMS = ("layernorm", "rmsnorm")


def add_norm(norm, x, y):
  """``(h, norm(h))`` with ``h = x + y`` (x's dtype) for a block's ``nnx.LayerNorm`` or
  ``nnx.RMSNorm``, as one fused op (``probjax.ops.norm``) where the norm's output dtype is no
  wider than x's (the op's output dtype); else the add, then the module."""
  scale = norm.scale[...]
  bias = norm.bias[...] if isinstance(norm, nnx.LayerNorm) else None
  out = norm.dtype or jnp.result_type(x, *(p for p in (scale, bias) if p is not None))
  if jnp.result_type(x.dtype, out) != x.dtype:
    h = x + y
    return h, norm(h)
  if bias is None:
    normed, h = rms_norm(y, scale, residual=x, eps=norm.epsilon)
  else:
    normed, h = layer_norm(y, scale, bias, residual=x, eps=norm.epsilon)
  return h, normed.astype(out)


def _norm(kind, features, dtype, param_dtype, rngs):
  if kind == "layernorm":
    return nnx.LayerNorm(features, dtype=dtype, param_dtype=param_dtype, rngs=rngs,
                         **shd.norm("embed", bias=True))
  return nnx.RMSNorm(features, dtype=dtype, param_dtype=param_dtype, rngs=rngs, **shd.norm("embed"))


MIXERS = ("attention", "mamba", "mamba2", "rla")
FFNS = ("mlp", "moe")


def _kwargs(name, value, kind, kinds):
  """The constructor's keyword arguments: ``value`` itself, or, when every key of ``value``
  names a kind (``{"rla": {...}, "mamba": {...}}``), the entry of ``kind`` (none: {})."""
  if value is None:
    return {}
  if not isinstance(value, Mapping):
    raise TypeError(f"{name} must be a dict of keyword arguments (or of them by kind) or None, "
                    f"got {type(value).__name__}")
  if value and all(k in kinds for k in value):
    value = value.get(kind)
    value = {} if value is None else value
    if not isinstance(value, Mapping):
      raise TypeError(f"{name}[{kind!r}] must be a dict of keyword arguments, got {type(value).__name__}")
  return dict(value)


def _check_choice(name, value, choices):
  if isinstance(value, str):
    if value not in choices:
      raise ValueError(f"{name} must be one of {choices} or a factory, got {value!r}")
  elif not callable(value):
    raise TypeError(f"{name} must be one of {choices} or a factory (a callable returning a module), "
                    f"got {type(value).__name__}")


class TransformerBlock(nnx.Module):
  """Pre-norm block on ``[batch, seq, features]``: ``x + mixer(norm(x))``, then (with
  ``context_features``) ``x + cross_attn(norm(x), context)``, then ``x + ffn(norm(x))``.

  The sequence mixer and the feed-forward sublayer are chosen by keyword: ``mixer`` is
  ``"attention"`` (the default: :class:`MultiHeadAttention`, at ``self.attn``), ``"mamba"`` /
  ``"mamba2"`` (:class:`~probjax.nn.layers.mamba.Mamba` / ``Mamba2`` with ``d_model=features``),
  ``"rla"`` (:class:`~probjax.nn.layers.rattention.RAttention` with the block's heads; its
  ``window_size`` in ``mixer_kwargs``) or a factory; ``ffn`` is ``"mlp"`` (the default:
  :class:`MLP`) or ``"moe"`` (:class:`~probjax.nn.layers.moe.MoELayer` with ``d_model=features``,
  ``d_hidden=mlp_features`` and the ``mlp`` activation; ``num_experts`` and ``top_k`` in
  ``ffn_kwargs``) or a factory. Mamba, Mamba-2 and RLA mixers (at ``self.mixer``) are causal
  whatever ``is_causal``, take no ``mask`` (ValueError) and no positions (they have no
  positional encoding); KV-cache decoding (:meth:`prefill`, :meth:`decode_step`) needs the
  attention mixer. :class:`Transformer` takes per-layer lists of ``mixer`` / ``ffn`` (hybrid
  and MoE models).

  Args:
    features: the block's width (of ``x`` in and out).
    num_heads: heads of the attention (and of the "rla" mixer and the cross-attention); needed
      unless the mixer is "mamba", "mamba2" or a factory and there is no cross-attention.
    num_kv_heads: key/value heads (see :class:`MultiHeadAttention`).
    head_dim: per-head features (see :class:`MultiHeadAttention`).
    mlp: the feed-forward activation, "gelu" or "swiglu" (of the MLP, or of the experts).
    mlp_features: the feed-forward hidden width (see :class:`MLP`; per expert with ``ffn="moe"``).
    norm: "layernorm" or "rmsnorm".
    rotary: RoPE in the self-attention (see :class:`MultiHeadAttention`).
    rotary_base: RoPE's base.
    qk_norm: RMS-norm of queries and keys in every attention.
    is_causal: the self-attention's default causal masking.
    context_features: features of a cross-attention context (None: no cross-attention).
    film_features: features of a FiLM conditioning vector modulating each normalized
      sublayer input (None: no FiLM).
    dropout_rate: residual dropout.
    attention_dropout_rate: dropout on the attention weights.
    use_bias: biases in the attention, MLP (and Mamba/RLA unless ``mixer_kwargs`` says) projections.
    attention_fn: passed to every attention layer.
    mixer: "attention", "mamba", "mamba2", "rla", or a factory called as ``mixer(features=,
      dtype=, param_dtype=, rngs=, **mixer_kwargs)`` returning a module ``h [batch, seq,
      features] -> [batch, seq, features]``.
    mixer_kwargs: more keyword arguments of the mixer's constructor (e.g. ``{"window_size":
      64}`` for "rla", ``{"d_state": 16}`` for "mamba"), or a dict of them by mixer kind
      (``{"rla": {"window_size": 64}, "mamba": {"d_state": 16}}``: the block takes its kind's
      entry; for hybrid stacks).
    ffn: "mlp", "moe", or a factory called as ``ffn(features=, dtype=, param_dtype=, rngs=,
      **ffn_kwargs)`` returning a module ``h -> y`` or ``h -> (y, aux)``.
    ffn_kwargs: more keyword arguments of the feed-forward's constructor (e.g.
      ``{"num_experts": 8, "top_k": 2}`` for "moe"), or a dict of them by kind (``{"moe":
      {...}}``: an "mlp" block takes none).
    dtype: compute dtype (None: from the inputs and params).
    param_dtype: parameter dtype.
    rngs: the parameters' (and dropout's) random streams.

  >>> import jax.numpy as jnp
  >>> from flax import nnx
  >>> blk = TransformerBlock(features=32, num_heads=4, mlp="swiglu", norm="rmsnorm",
  ...                        context_features=8, film_features=3, rngs=nnx.Rngs(0))
  >>> apply = nnx.jit(lambda m, x, c, f: m(x, context=c, film=f))
  >>> apply(blk, jnp.ones((2, 6, 32)), jnp.ones((2, 5, 8)), jnp.ones((2, 3))).shape
  (2, 6, 32)
  >>> hybrid = TransformerBlock(features=32, mixer="mamba", mixer_kwargs={"d_state": 8}, ffn="moe",
  ...                           ffn_kwargs={"num_experts": 4, "top_k": 2}, rngs=nnx.Rngs(0))
  >>> y, aux = hybrid(jnp.ones((2, 6, 32)), return_aux=True)   # aux: the MoE's RouterAux
  >>> y.shape, aux.expert_counts.shape
  ((2, 6, 32), (4,))
  """

  def __init__(self, *, features: int, num_heads: int | None = None, num_kv_heads: int | None = None,
               head_dim: int | None = None, mlp: str = "gelu", mlp_features: int | None = None,
               norm: str = "layernorm", rotary: bool = False, rotary_base: float = 10000.0,
               qk_norm: bool = False, is_causal: bool = False, context_features: int | None = None,
               film_features: int | None = None, dropout_rate: float = 0.0,
               attention_dropout_rate: float = 0.0, use_bias: bool = False,
               attention_fn: Callable = dot_product_attention, mixer: str | Callable = "attention",
               mixer_kwargs: Mapping[str, Any] | None = None, ffn: str | Callable = "mlp",
               ffn_kwargs: Mapping[str, Any] | None = None, dtype=None,
               param_dtype=jnp.float32, rngs: nnx.Rngs):
    if norm not in NORMS:
      raise ValueError(f"norm must be one of {NORMS}, got {norm!r}")
    if mlp not in MLP_KINDS:
      raise ValueError(f"mlp must be one of {MLP_KINDS}, got {mlp!r}")
    if not 0.0 <= dropout_rate < 1.0:
      raise ValueError(f"dropout_rate must lie in [0, 1), got {dropout_rate}")
    _check_choice("mixer", mixer, MIXERS)
    _check_choice("ffn", ffn, FFNS)
    mixer_kwargs = _kwargs("mixer_kwargs", mixer_kwargs, mixer, MIXERS)
    ffn_kwargs = _kwargs("ffn_kwargs", ffn_kwargs, ffn, FFNS)
    if isinstance(features, bool) or not isinstance(features, numbers.Integral) or features < 1:
      raise ValueError(f"features must be an int >= 1, got {features!r}")
    needs_heads = mixer in ("attention", "rla") or context_features is not None
    if num_heads is None and needs_heads:
      raise ValueError(f"num_heads must be given (mixer={mixer!r}"
                       f"{', context_features set' if context_features is not None else ''})")
    if needs_heads:
      check_heads(features, num_heads, num_kv_heads, head_dim)
    self.features, self.context_features, self.film_features = features, context_features, film_features
    self.mixer_kind = mixer if isinstance(mixer, str) else "factory"
    self.ffn_kind = ffn if isinstance(ffn, str) else "factory"
    self.dtype, self.param_dtype = dtype, param_dtype
    kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    attn = dict(num_heads=num_heads, in_features=features, num_kv_heads=num_kv_heads,
                head_dim=head_dim, use_bias=use_bias, dropout_rate=attention_dropout_rate,
                attention_fn=attention_fn, **kw)
    self.attn_norm = _norm(norm, features, dtype, param_dtype, rngs)
    if mixer == "attention":
      self.attn = MultiHeadAttention(rotary=rotary, rotary_base=rotary_base, qk_norm=qk_norm,
                                     is_causal=is_causal, **{**attn, **mixer_kwargs})
      self.mixer = None
    else:
      self.attn = None
      self.mixer = _make_mixer(mixer, mixer_kwargs, features=features, num_heads=num_heads,
                               num_kv_heads=num_kv_heads, head_dim=head_dim, use_bias=use_bias, **kw)
    if context_features is not None:
      self.cross_norm = _norm(norm, features, dtype, param_dtype, rngs)
      self.cross = MultiHeadAttention(context_features=context_features, qk_norm=qk_norm, **attn)
    else:
      self.cross_norm = self.cross = None
    self.mlp_norm = _norm(norm, features, dtype, param_dtype, rngs)
    if ffn == "mlp":
      self.mlp = MLP(features=features, hidden_features=mlp_features, activation=mlp,
                     use_bias=use_bias, **{**kw, **ffn_kwargs})
    elif ffn == "moe":
      self.mlp = _make_moe(ffn_kwargs, features=features, mlp=mlp, mlp_features=mlp_features, **kw)
    else:
      self.mlp = ffn(features=features, **kw, **ffn_kwargs)
    n_sites = 2 + (context_features is not None)
    self.film = (None if film_features is None else
                 FiLM(features=features, context_features=film_features, num=n_sites, **kw))
    self.dropout = nnx.Dropout(dropout_rate, rngs=rngs) if dropout_rate > 0 else None

  def check_inputs(self, x, seq="seq", *, context=None, context_mask=None, film=None, positions=None,
                   mask=None):
    """Static checks of a call's inputs (ValueError for shapes, TypeError for dtypes and types,
    naming the argument): floating ``x [batch, seq, features]``, integer ``positions [batch,
    seq]``, ``mask`` fitting ``[batch, seq, seq]`` (and no mask for a mixer other than
    attention), floating ``context [batch, ctx_seq, context_features]`` with ``context_mask``
    fitting ``[batch, seq, ctx_seq]``, floating ``film [batch, film_features]``. Returns the
    sizes bound (``batch``, ``seq``, ...)."""
    s = check_array("x", x, ("batch", seq, ("features", self.features)))
    b, t = s["batch"][0], s[seq][0]
    if positions is not None:
      check_array("positions", positions, ("batch", seq), dtype="int", sizes=s)
    if mask is not None and self.attn is None:
      raise ValueError(f"mask: the {self.mixer_kind!r} mixer takes no mask (it is causal over the "
                       "whole sequence); packed documents need the attention mixer")
    check_mask(mask, b, t, t)
    if context is not None and self.context_features is not None:
      s = check_array("context", context, ("batch", "ctx_seq", ("context_features", self.context_features)),
                      sizes=s)
      check_mask(context_mask, b, t, s["ctx_seq"][0], name="context_mask")
    if film is not None and self.film_features is not None:
      check_array("film", film, ("batch", ("film_features", self.film_features)), sizes=s)
    return s

  def _dropped(self, y, deterministic):
    if self.dropout is not None:
      if deterministic is None:
        raise ValueError("deterministic must be given (True or False) when dropout_rate > 0")
      y = self.dropout(y, deterministic=deterministic)
    return y

  def _residual(self, x, y, deterministic):
    return x + self._dropped(y, deterministic).astype(x.dtype)

  def _residual_norm(self, x, y, norm, deterministic):
    """``(x + y, norm(x + y))``, the add and the norm fused (:func:`add_norm`)."""
    return add_norm(norm, x, self._dropped(y, deterministic).astype(x.dtype))

  def _apply(self, x, self_attn, *, context, context_mask, film, deterministic):
    """The block with ``self_attn(h) -> (y, aux)`` as its sequence mixer; returns ``(x, aux,
    ffn_aux)`` (``ffn_aux``: the feed-forward's auxiliary output, e.g. the MoE's RouterAux, or
    None)."""
    if (film is None) != (self.film is None):
      raise ValueError("film must be given exactly when the block has film_features"
                       if self.film is not None else "film given to a block without film_features")
    if (context is None) != (self.cross is None):
      raise ValueError("context must be given exactly when the block has context_features"
                       if self.cross is not None else "context given to a block without context_features")
    mods = self.film(film) if self.film is not None else [None] * 3
    y, aux = self_attn(FiLM.apply(self.attn_norm(x), mods[0]))
    if self.cross is not None:
      x, h = self._residual_norm(x, y, self.cross_norm, deterministic)
      y = self.cross(FiLM.apply(h, mods[1]), context, mask=context_mask, deterministic=deterministic)
    x, h = self._residual_norm(x, y, self.mlp_norm, deterministic)
    out = self.mlp(FiLM.apply(h, mods[-1]))
    y, ffn_aux = out if isinstance(out, tuple) else (out, None)
    x = self._residual(x, y, deterministic)
    return x, aux, ffn_aux

  def __call__(self, x, *, context=None, context_mask=None, film=None, positions=None, mask=None,
               deterministic: bool | None = None, return_aux: bool = False):
    """``x [batch, seq, features] -> [batch, seq, features]``.

    Args:
      x: ``[batch, seq, features]`` floating.
      context: ``[batch, ctx_seq, context_features]`` for the cross-attention.
      context_mask: the cross-attention's mask (e.g. ``KVLenMask``).
      film: ``[batch, film_features]``.
      positions: as in :class:`MultiHeadAttention` (attention mixer; the others ignore them).
      mask: as in :class:`MultiHeadAttention` (attention mixer only).
      deterministic: False applies dropout (needed when a dropout rate is set).
      return_aux: also return the feed-forward's auxiliary output (the MoE's
        :class:`~probjax.nn.layers.moe.RouterAux`; None for the MLP).

    Wrong shapes or dtypes raise ValueError / TypeError naming the argument (:meth:`check_inputs`).
    """
    self.check_inputs(x, context=context, context_mask=context_mask, film=film, positions=positions, mask=mask)
    if self.attn is not None:
      mix = lambda h: (self.attn(h, positions=positions, mask=mask, deterministic=deterministic), None)
    else:
      mix = lambda h: (self.mixer(h), None)
    x, _, ffn_aux = self._apply(x, mix, context=context, context_mask=context_mask, film=film,
                                deterministic=deterministic)
    return (x, ffn_aux) if return_aux else x

  def _check_decoding(self):
    if self.attn is None:
      raise ValueError(f"KV-cache decoding needs the attention mixer; this block's mixer is "
                       f"{self.mixer_kind!r}")

  def prefill(self, x, cache, lengths, *, layer=None, positions=None, context=None,
              context_mask=None, film=None):
    """As :meth:`MultiHeadAttention.prefill` for the block; returns ``(x, cache)``."""
    self._check_decoding()
    self.check_inputs(x, "P", context=context, context_mask=context_mask, film=film, positions=positions)
    attn = lambda h: self.attn.prefill(h, cache, lengths, positions=positions, layer=layer)
    return self._apply(x, attn, context=context, context_mask=context_mask, film=film,
                       deterministic=True)[:2]

  def decode_step(self, x, cache, *, layer=None, positions=None, context=None, context_mask=None,
                  film=None):
    """As :meth:`MultiHeadAttention.decode_step` for the block; returns ``(x, cache)``."""
    self._check_decoding()
    self.check_inputs(x, "n", context=context, context_mask=context_mask, film=film, positions=positions)
    attn = lambda h: self.attn.decode_step(h, cache, positions=positions, layer=layer)
    return self._apply(x, attn, context=context, context_mask=context_mask, film=film,
                       deterministic=True)[:2]


def _make_mixer(kind, kwargs, *, features, num_heads, num_kv_heads, head_dim, use_bias, dtype,
                param_dtype, rngs):
  kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
  if kind in ("mamba", "mamba2"):
    from probjax.nn.layers.mamba import Mamba, Mamba2
    return (Mamba if kind == "mamba" else Mamba2)(d_model=features, **{"use_bias": use_bias, **kw, **kwargs})
  if kind == "rla":
    from probjax.nn.layers.rattention import RAttention
    if "window_size" not in kwargs:
      raise ValueError("mixer='rla' needs its window_size in mixer_kwargs, e.g. "
                       "mixer_kwargs={'window_size': 64}")
    return RAttention(num_heads=num_heads, in_features=features, num_kv_heads=num_kv_heads,
                      head_dim=head_dim, **{"use_bias": use_bias, **kw, **kwargs})
  return kind(features=features, **kw, **kwargs)


def _make_moe(kwargs, *, features, mlp, mlp_features, dtype, param_dtype, rngs):
  from probjax.nn.layers.moe import MoELayer
  missing = [k for k in ("num_experts", "top_k") if k not in kwargs]
  if missing:
    raise ValueError(f"ffn='moe' needs {' and '.join(missing)} in ffn_kwargs, e.g. "
                     "ffn_kwargs={'num_experts': 8, 'top_k': 2}")
  kwargs = dict(kwargs)
  d_hidden = kwargs.pop("d_hidden", mlp_features)
  d_hidden = default_hidden_features(features, mlp) if d_hidden is None else d_hidden
  kwargs.setdefault("activation", mlp)
  return MoELayer(features, d_hidden, kwargs.pop("num_experts"), kwargs.pop("top_k"), dtype=dtype,
                  param_dtype=param_dtype, rngs=rngs, **kwargs)


PER_LAYER_KEYS = ("mixer", "mixer_kwargs", "ffn", "ffn_kwargs")


class Transformer(nnx.Module):
  """``num_layers`` :class:`TransformerBlock` s with stacked parameters, applied one after the
  other (or by ``nnx.scan``).

  ``Transformer(*, num_layers, remat=False, scan_layers=False, rngs, **block_kwargs)``:
  ``block_kwargs`` are :class:`TransformerBlock`'s (``features``, ``num_heads``, ...).
  ``remat=True`` recomputes each block's activations in the backward pass (``nnx.remat``);
  ``scan_layers=True`` runs the stacked blocks with ``nnx.scan`` (the same parameters and
  outputs, one compiled block).

  Hybrid and MoE stacks: ``mixer``, ``mixer_kwargs``, ``ffn`` and ``ffn_kwargs`` may each be a
  list of ``num_layers`` entries, one per layer (e.g. ``mixer=["mamba", "attention"] * 2``,
  ``ffn=["mlp", "moe", "moe", "moe"]``). Such layers differ, so they are not stacked:
  ``blocks`` is an ``nnx.List`` of separate blocks applied one after the other (each compiled
  on its own). KV-cache decoding needs the attention mixer in every layer and, for a list of
  blocks, the "per_layer" cache layout.

  Args:
    num_layers: the number of blocks (>= 1).
    remat: recompute each block's activations in the backward pass.
    scan_layers: apply stacked blocks in a Python loop over their per-layer views (False, the
      default: a compiled copy per layer, no stacked residuals, the faster train step) or with
      ``nnx.scan`` (True: one compiled block, short compiles for deep stacks). A list of blocks
      always loops.
    rngs: the parameters' (and dropout's) random streams.
    **block_kwargs: :class:`TransformerBlock`'s arguments, shared by every layer (the four
      above may be per-layer lists).

  >>> import jax.numpy as jnp
  >>> from flax import nnx
  >>> tr = Transformer(num_layers=3, features=16, num_heads=2, rngs=nnx.Rngs(0))
  >>> tr.blocks.mlp.up.kernel.shape  # stacked on a leading layer axis
  (3, 16, 64)
  >>> nnx.jit(lambda m, x: m(x))(tr, jnp.ones((2, 5, 16))).shape
  (2, 5, 16)
  >>> scanned = Transformer(num_layers=3, features=16, num_heads=2, scan_layers=True, rngs=nnx.Rngs(0))
  >>> bool(jnp.allclose(scanned(jnp.ones((2, 5, 16))), tr(jnp.ones((2, 5, 16))), atol=1e-5))
  True
  >>> hybrid = Transformer(num_layers=3, features=16, num_heads=2, mixer=["rla", "attention", "rla"],
  ...                      mixer_kwargs={"rla": {"window_size": 2}}, ffn=["mlp", "moe", "moe"],
  ...                      ffn_kwargs={"moe": {"num_experts": 4, "top_k": 1}}, rngs=nnx.Rngs(0))
  >>> " ".join(f"{b.mixer_kind}+{b.ffn_kind}" for b in hybrid.blocks)
  'rla+mlp attention+moe rla+moe'
  """

  def __init__(self, *, num_layers: int, remat: bool = False, scan_layers: bool = False, rngs: nnx.Rngs,
               **block_kwargs):
    if isinstance(num_layers, bool) or not isinstance(num_layers, numbers.Integral) or num_layers < 1:
      raise ValueError(f"num_layers must be an int >= 1, got {num_layers!r}")
    if not isinstance(scan_layers, bool):
      raise TypeError(f"scan_layers must be a bool, got {scan_layers!r}")
    self.num_layers, self.remat, self.scan_layers = num_layers, remat, scan_layers
    lists = [k for k in PER_LAYER_KEYS if isinstance(block_kwargs.get(k), (list, tuple))]
    for k in lists:
      if len(block_kwargs[k]) != num_layers:
        raise ValueError(f"{k}: a per-layer list needs num_layers={num_layers} entries, got "
                         f"{len(block_kwargs[k])}")
    self.stacked = not lists
    if self.stacked:
      @nnx.split_rngs(splits=num_layers)
      @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: shd.LAYERS})
      def make(rngs):
        return TransformerBlock(rngs=rngs, **block_kwargs)

      self.blocks = make(rngs)
    else:
      per_layer = lambda i: {**block_kwargs, **{k: block_kwargs[k][i] for k in lists}}
      self.blocks = nnx.List([TransformerBlock(rngs=rngs, **per_layer(i)) for i in range(num_layers)])
    first = self._first
    attn = next((b.attn for b in ([first] if self.stacked else self.blocks) if b.attn is not None), None)
    self.num_kv_heads = None if attn is None else attn.num_kv_heads
    self.head_dim = None if attn is None else attn.head_dim
    self.dtype, self.param_dtype = first.dtype, first.param_dtype

  @property
  def _first(self) -> TransformerBlock:
    """The stacked blocks (one module), or the first of a list."""
    return self.blocks if self.stacked else self.blocks[0]

  def _scan(self, body, carry, aux=False):
    if self.remat:
      body = nnx.remat(body)
    out_axes = (nnx.Carry, 0) if aux else nnx.Carry
    return nnx.scan(body, in_axes=(nnx.Carry, 0), out_axes=out_axes,
                    transform_metadata={nnx.PARTITION_NAME: shd.LAYERS})(carry, self.blocks)

  def __call__(self, x, *, context=None, context_mask=None, film=None, positions=None, mask=None,
               deterministic: bool | None = None, return_aux: bool = False):
    """``[batch, seq, features] -> [batch, seq, features]``; arguments as in
    :meth:`TransformerBlock.__call__`, shared by every layer (and checked as there).
    ``return_aux``: also return the feed-forwards' auxiliary outputs: stacked blocks, one
    pytree with a leading layer axis (e.g. a ``RouterAux`` of ``[num_layers]`` losses; None
    without MoE); a list of blocks, a list of ``num_layers`` (None for an MLP layer)."""
    self._first.check_inputs(x, context=context, context_mask=context_mask, film=film,
                             positions=positions, mask=mask)
    kw = dict(context=context, context_mask=context_mask, film=film, positions=positions, mask=mask,
              deterministic=deterministic)
    if not (self.stacked and self.scan_layers):
      return self._loop(x, kw, return_aux)
    if return_aux:
      return self._scan(lambda x, block: block(x, return_aux=True, **kw), x, aux=True)
    return self._scan(lambda x, block: block(x, **kw), x)

  def _loop(self, x, kw, return_aux):
    """The layers one after the other in Python (a compiled copy of each): a list's blocks,
    or the stacked blocks' :meth:`unstacked` views, whose state besides the parameters
    (dropout's RNG counters) goes back into the stack after the loop. Auxiliary outputs: a
    list for a list of blocks, stacked on a leading layer axis as ``nnx.scan`` returns them."""
    layers = self.unstacked()
    call = lambda b, x: b(x, return_aux=True, **kw)
    if self.remat:
      call = nnx.remat(call)
    auxes = []
    for block in layers:
      x, a = call(block, x)
      auxes.append(a)
    if self.stacked:
      shd.restack_state(self.blocks, layers)
      auxes = jax.tree.map(lambda *a: jnp.stack(a), *auxes)
    return (x, auxes) if return_aux else x

  def init_cache(self, batch: int, max_len: int, dtype=None, *, layout: str = "per_layer") -> kvc.KVCache:
    """An empty cache (zeros, lengths 0) in ``layout`` "per_layer" (k, v: tuples of
    ``num_layers`` arrays ``[batch, max_len, num_kv_heads, head_dim]``) or "stacked" (k, v
    ``[num_layers, batch, max_len, num_kv_heads, head_dim]``); see the module docstring."""
    self._check_decodable(layout)
    dtype = dtype or self.dtype or self.param_dtype
    return kvc.KVCache.init(batch, max_len, kv_heads=self.num_kv_heads, head_dim=self.head_dim,
                            dtype=dtype, num_layers=self.num_layers, layout=layout)

  def init_paged_cache(self, batch: int, *, page_size: int, pages_per_seq: int | None = None,
                       num_pages: int | None = None, page_table=None, dtype=None) -> kvc.PagedKVCache:
    """An empty paged cache (:class:`~probjax.nn.layers.kv_cache.PagedKVCache`): one pool pair
    ``[num_pages, page_size, num_kv_heads, head_dim]`` per layer, one page table ``[batch,
    pages_per_seq]`` (given, or the contiguous assignment) and one ``lengths`` for all layers.
    It stands in for :meth:`init_cache`'s in :meth:`prefill` / :meth:`decode_step` (the
    per-layer layout)."""
    self._check_decodable("per_layer")
    dtype = dtype or self.dtype or self.param_dtype
    return kvc.PagedKVCache.init(batch, page_size=page_size, pages_per_seq=pages_per_seq, num_pages=num_pages,
                                 page_table=page_table, kv_heads=self.num_kv_heads, head_dim=self.head_dim,
                                 dtype=dtype, num_layers=self.num_layers)

  def _check_decodable(self, layout):
    kinds = [self._first.mixer_kind] if self.stacked else [b.mixer_kind for b in self.blocks]
    bad = [(i, k) for i, k in enumerate(kinds) if k != "attention"]
    if bad:
      i, k = bad[0]
      raise ValueError(f"KV-cache decoding needs the attention mixer in every layer; "
                       f"{'the layers have' if self.stacked else f'layer {i} has'} mixer {k!r}")
    if layout == "stacked" and not self.stacked:
      raise ValueError("layout='stacked' needs stacked blocks (no per-layer mixer/ffn lists); "
                       "use layout='per_layer'")

  def unstacked(self) -> list[TransformerBlock]:
    """The ``num_layers`` blocks as separate modules, each with its slice of the stacked
    parameters (copies). A decode loop slices them once, outside the loop, and passes them to
    every step as ``layers=`` (:func:`~probjax.nn.layers.decoding.decode_loop` does). A list
    of blocks (per-layer mixers or ffns): the blocks themselves."""
    if not self.stacked:
      return list(self.blocks)
    return shd.layer_views(self.blocks, self.num_layers)

  def _check_cache(self, cache, sizes):
    kvc.check_cache(cache, sizes, (("num_kv_heads", self.num_kv_heads), ("head_dim", self.head_dim)),
                    num_layers=self.num_layers)

  def _cached(self, method, x, cache, layers=None, **kw):
    if cache.per_layer:
      self._check_decodable("per_layer")
      n_cached = len(kvc.layer_arrays(cache)[0])
      if n_cached != self.num_layers:
        raise ValueError(f"the cache has {n_cached} layers, the model {self.num_layers}")
      layers = self.unstacked() if layers is None else layers
      if len(layers) != self.num_layers:
        raise ValueError(f"layers: {len(layers)} blocks given, the model has {self.num_layers}")
      ks, vs = [], []
      for i, block in enumerate(layers):
        x, c = getattr(block, method)(x, kvc.layer_cache(cache, i), **kw)
        k, v = kvc.layer_arrays(c)
        ks.append(k)
        vs.append(v)
      return x, tuple(ks), tuple(vs)
    def body(carry, block):
      x, k, v, i = carry
      x, c = getattr(block, method)(x, kvc.KVCache(k, v, cache.lengths), layer=i, **kw)
      return x, c.k, c.v, i + 1

    if layers is not None:
      raise ValueError("layers= is for the per-layer cache layout")
    if isinstance(cache, kvc.PagedKVCache):
      raise ValueError("a PagedKVCache for a layer stack holds one pool per layer (tuples): "
                       "init_paged_cache / PagedKVCache.init(..., num_layers=)")
    self._check_decodable("stacked")
    x, k, v, _ = nnx.scan(body, in_axes=(nnx.Carry, 0), out_axes=nnx.Carry,
                          transform_metadata={nnx.PARTITION_NAME: shd.LAYERS})(
        (x, cache.k, cache.v, jnp.zeros((), jnp.int32)), self.blocks)
    return x, k, v

  def prefill(self, x, cache: kvc.KVCache, lengths, *, positions=None, context=None,
              context_mask=None, film=None):
    """Right-padded prompts ``x [batch, P, features]`` with ``lengths [batch]`` into an empty
    stacked cache; returns ``(y [batch, P, features], cache)`` with ``cache.lengths = lengths``."""
    self._check_cache(cache, self._first.check_inputs(x, "P", context=context, context_mask=context_mask,
                                                      film=film, positions=positions))
    kvc.check_prefix(cache, x.shape[1], lengths)
    x, k, v = self._cached("prefill", x, cache, lengths=lengths, positions=positions,
                           context=context, context_mask=context_mask, film=film)
    return x, kvc.with_layers(cache, k, v, lengths)

  def decode_step(self, x, cache: kvc.KVCache, *, positions=None, context=None, context_mask=None,
                  film=None, layers=None):
    """``x [batch, n, features]`` new tokens at ``cache.lengths[b] + arange(n)``; returns
    ``(y [batch, n, features], cache)`` with lengths advanced by ``n``. ``layers``: the
    :meth:`unstacked` blocks to use (per-layer cache; default: sliced here)."""
    self._check_cache(cache, self._first.check_inputs(x, "n", context=context, context_mask=context_mask,
                                                      film=film, positions=positions))
    n = x.shape[1]
    kvc.check_room(cache, n)
    x, k, v = self._cached("decode_step", x, cache, layers=layers, positions=positions,
                           context=context, context_mask=context_mask, film=film)
    return x, kvc.with_layers(cache, k, v, cache.lengths + n)


class TransformerLM(nnx.Module):
  """Decoder-only language model: token embedding, a causal :class:`Transformer` (RoPE),
  final norm and a tied (``embed.attend``) or untied output head.

  ``TransformerLM(*, vocab_size, features, num_layers, num_heads, tie_embeddings=True,
  mlp="swiglu", norm="rmsnorm", rotary=True, remat=False, scan_layers=False, rngs, **block_kwargs)``.
  Logits are float32 ``[batch, seq, vocab_size]`` (float64 for float64 params). Hybrid and
  MoE models are one configuration: ``mixer`` / ``ffn`` (and their kwargs) as in
  :class:`Transformer`, per layer as lists.

  Args:
    vocab_size: the vocabulary (>= 1).
    features: the model width.
    num_layers: blocks.
    num_heads: attention heads (may be None when no layer has attention or an "rla" mixer).
    tie_embeddings: the output head is ``embed.attend`` (else a separate Linear).
    mlp: the feed-forward activation, "gelu" or "swiglu".
    norm: "layernorm" or "rmsnorm".
    rotary: RoPE in the attention.
    remat: recompute each block's activations in the backward pass.
    scan_layers: the layer stack unrolled (False, the default) or under ``nnx.scan`` (True);
      see :class:`Transformer`.
    dtype: compute dtype (None: from the inputs and params).
    param_dtype: parameter dtype.
    rngs: the parameters' (and dropout's) random streams.
    **block_kwargs: more :class:`TransformerBlock` arguments (``num_kv_heads``, ``mixer``,
      ``ffn``, ...; see :class:`Transformer` for per-layer lists).

  >>> import jax.numpy as jnp
  >>> from flax import nnx
  >>> lm = TransformerLM(vocab_size=11, features=16, num_layers=2, num_heads=2, num_kv_heads=1,
  ...                    rngs=nnx.Rngs(0))
  >>> nnx.jit(lambda m, t: m(t))(lm, jnp.zeros((2, 7), jnp.int32)).shape
  (2, 7, 11)
  >>> cache = lm.init_cache(2, 16)        # see decoding.generate for prefill + decode_step
  >>> len(cache.k), cache.k[0].shape      # per layer: [batch, max_len, kv_heads, head_dim]
  (2, (2, 16, 1, 8))
  >>> moe_lm = TransformerLM(vocab_size=11, features=16, num_layers=2, num_heads=2, ffn=["mlp", "moe"],
  ...                        ffn_kwargs={"moe": {"num_experts": 4, "top_k": 2}}, rngs=nnx.Rngs(0))
  >>> logits, aux = moe_lm(jnp.zeros((2, 7), jnp.int32), return_aux=True)
  >>> aux[0] is None, int(aux[1].expert_counts.sum())   # per layer: the MLP's none, the MoE's RouterAux
  (True, 28)
  """

  def __init__(self, *, vocab_size: int, features: int, num_layers: int, num_heads: int | None = None,
               tie_embeddings: bool = True, mlp: str = "swiglu", norm: str = "rmsnorm",
               rotary: bool = True, remat: bool = False, scan_layers: bool = False, dtype=None,
               param_dtype=jnp.float32, rngs: nnx.Rngs, **block_kwargs):
    if vocab_size < 1:
      raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
    self.vocab_size, self.tie_embeddings = vocab_size, tie_embeddings
    self.embed = nnx.Embed(vocab_size, features, dtype=dtype, param_dtype=param_dtype,
                           embedding_init=nnx.initializers.normal(features ** -0.5), rngs=rngs,
                           embedding_metadata=shd.names("vocab", "embed"))
    self.transformer = Transformer(num_layers=num_layers, remat=remat, scan_layers=scan_layers,
                                   features=features,
                                   num_heads=num_heads, mlp=mlp, norm=norm, rotary=rotary,
                                   is_causal=True, dtype=dtype, param_dtype=param_dtype, rngs=rngs,
                                   **block_kwargs)
    self.final_norm = _norm(norm, features, dtype, param_dtype, rngs)
    self.head = (None if tie_embeddings else
                 nnx.Linear(features, vocab_size, use_bias=False, dtype=dtype,
                            param_dtype=param_dtype, rngs=rngs, **shd.linear("embed", "vocab")))

  def _logits(self, h):
    h = self.final_norm(h)
    out = self.embed.attend(h) if self.head is None else self.head(h)
    return out.astype(jnp.promote_types(out.dtype, jnp.float32))  # float32 (float64 stays)

  def __call__(self, tokens, *, positions=None, mask=None, deterministic: bool | None = None,
               return_aux: bool = False):
    """``tokens [batch, seq]`` ints -> logits ``[batch, seq, vocab]``; causal, combined with
    ``mask`` (e.g. ``SegmentMask(doc_ids)`` with per-document ``positions``). Float tokens
    raise TypeError, other shapes ValueError, naming ``tokens``. ``return_aux``: ``(logits,
    aux)`` with the feed-forwards' auxiliary outputs (see :meth:`Transformer.__call__`; the
    MoE layers' load-balancing and z losses)."""
    check_array("tokens", tokens, ("batch", "seq"), dtype="int")
    h = self.transformer(self.embed(tokens), positions=positions, mask=mask,
                         deterministic=deterministic, return_aux=return_aux)
    if return_aux:
      h, aux = h
      return self._logits(h), aux
    return self._logits(h)

  def loss(self, tokens, labels=None, *, positions=None, mask=None, deterministic: bool | None = None,
           ignore_index: int | None = -100, z_loss: float = 0.0, label_smoothing: float = 0.0,
           reduction: str = "mean", chunk_tokens: int | None = None, chunk_vocab: int | None = None,
           return_aux: bool = False):
    """The cross-entropy of the model's logits against ``labels`` without forming the logits:
    the output head runs inside :func:`probjax.ops.linear_cross_entropy.linear_cross_entropy`,
    in tiles of tokens x vocabulary, forward and backward (the ``[batch, seq, vocab]`` float32
    logits of :meth:`__call__` are 2 GB at batch 8, seq 2048, vocab 32768).

    Args:
      tokens: ``[batch, seq]`` ints, as :meth:`__call__`.
      labels: ``[batch, seq]`` ints, the target at each position, ``ignore_index`` where none
        counts; None: next-token prediction (``tokens`` shifted left, the last position
        ignored).
      positions, mask, deterministic: as :meth:`__call__`.
      ignore_index, z_loss, label_smoothing, reduction: as ``linear_cross_entropy``.
      chunk_tokens, chunk_vocab: the loss's tile of tokens x vocabulary, as
        ``linear_cross_entropy`` (None: its default).
      return_aux: also return the feed-forwards' auxiliary outputs (:meth:`__call__`).

    Returns:
      The loss (a float32 scalar, or ``[batch, seq]`` for ``reduction="none"``), and the
      auxiliary outputs with ``return_aux``.
    """
    from probjax.ops.linear_cross_entropy import linear_cross_entropy
    sizes = check_array("tokens", tokens, ("batch", "seq"), dtype="int")
    if labels is None:
      if ignore_index is None:
        raise ValueError("loss(tokens) without labels marks the last position with ignore_index; pass an int")
      labels = jnp.concatenate([tokens[:, 1:], jnp.full_like(tokens[:, :1], ignore_index)], axis=1)
    check_array("labels", labels, ("batch", "seq"), dtype="int", sizes=sizes)
    h = self.transformer(self.embed(tokens), positions=positions, mask=mask, deterministic=deterministic,
                         return_aux=return_aux)
    if return_aux:
      h, aux = h
    h = self.final_norm(h)
    if self.head is None:
      w, layout, dtype = self.embed.embedding[...], "vocab_d", self.embed.dtype
    else:
      w, layout, dtype = self.head.kernel[...], "d_vocab", self.head.dtype
    dtype = dtype or jnp.promote_types(h.dtype, w.dtype)
    out = linear_cross_entropy(h.astype(dtype), w.astype(dtype), labels, w_layout=layout,
                               ignore_index=ignore_index, z_loss=z_loss, label_smoothing=label_smoothing,
                               reduction=reduction, chunk_tokens=chunk_tokens, chunk_vocab=chunk_vocab)
    return (out, aux) if return_aux else out

  def init_cache(self, batch: int, max_len: int, dtype=None, *, layout: str = "per_layer") -> kvc.KVCache:
    """See :meth:`Transformer.init_cache`."""
    return self.transformer.init_cache(batch, max_len, dtype, layout=layout)

  def init_paged_cache(self, batch: int, *, page_size: int, pages_per_seq: int | None = None,
                       num_pages: int | None = None, page_table=None, dtype=None) -> kvc.PagedKVCache:
    """See :meth:`Transformer.init_paged_cache`: a paged cache that :meth:`prefill`,
    :meth:`decode_step` and :func:`~probjax.nn.layers.decoding.decode_loop` take in place of
    :meth:`init_cache`'s.

    >>> from flax import nnx
    >>> lm = TransformerLM(vocab_size=11, features=16, num_layers=2, num_heads=2, head_dim=8,
    ...                    rngs=nnx.Rngs(0))
    >>> cache = lm.init_paged_cache(2, page_size=16, pages_per_seq=2)
    >>> len(cache.k_pages), cache.k_pages[0].shape, cache.max_len   # per layer: the pool
    (2, (4, 16, 2, 8), 32)
    """
    return self.transformer.init_paged_cache(batch, page_size=page_size, pages_per_seq=pages_per_seq,
                                             num_pages=num_pages, page_table=page_table, dtype=dtype)

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
