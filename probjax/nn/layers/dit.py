"""Diffusion Transformer (DiT, Peebles & Xie 2023) with adaLN-Zero blocks.

:class:`DiffusionTransformer` maps noisy tokens ``[batch, n, in_features]`` (or images
``[batch, H, W, C]`` cut into ``patch_size`` patches, with a fixed 2-D sin-cos position
embedding) and times ``t [batch]`` to ``[batch, n, out_features]`` (images back to ``[batch,
H, W, out_features]``). Tokens get no position embedding: over a token set the model is
permutation-equivariant (sequences add positions to their tokens). The conditioning vector
``c`` is the sum of a timestep embedding (sinusoidal features -> Linear-SiLU-Linear) and, as
configured, a class-label embedding (label ``num_classes`` is the null label of
classifier-free guidance; ``class_dropout_rate`` replaces labels by it while training) and a
linear map of a context vector ``cond``. A context sequence ``context`` enters every block
through cross-attention.

Every block's shift/scale/gate and the final layer's shift/scale depend on ``c`` only: they
come out of one zero-initialised matmul of ``silu(c)``, computed once per call, not per
block. At initialisation every gate is zero, so every block is exactly the identity, and the
zero-initialised final projection makes the output exactly zero. The blocks' parameters are
stacked (``nnx.vmap``) and applied by default by a Python loop over their slices (one
compiled copy per block), or with ``scan_layers=True`` by ``nnx.scan`` (one compiled block:
shorter compiles for deep models, but XLA's loop stores every block's residuals for the
backward pass with extra copies; docs/dev/decisions.md, "DiT"); the parameters and the output are
the same either way.

``mask`` (a probjax mask, e.g. ``KVLenMask(sizes)`` for token sets right-padded to a common
size) goes to every self-attention; ``context_mask`` to every cross-attention.

>>> import jax.numpy as jnp
>>> from flax import nnx
>>> dit = DiffusionTransformer(in_features=4, features=32, num_layers=2, num_heads=2,
...                            patch_size=2, num_classes=10, rngs=nnx.Rngs(0))
>>> y = dit(jnp.ones((3, 8, 8, 4)), jnp.full((3,), 0.5), labels=jnp.array([1, 2, dit.null_label]))
>>> y.shape, float(jnp.abs(y).max())                 # zero at initialisation
((3, 8, 8, 4), 0.0)
"""

from __future__ import annotations

import math
from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from probjax.nn.layers import _sharding as shd
from probjax.nn.layers.attention import dot_product_attention
from probjax.nn.layers._checks import check_array, check_mask
from probjax.nn.layers.mlp import ACTIVATIONS as MLP_KINDS, MLP
from probjax.nn.layers.multi_head_attention import MultiHeadAttention, check_heads
from probjax.ops.norm import adaln_modulate

__all__ = ["DiTBlock", "DiffusionTransformer", "timestep_embedding", "sincos_2d"]


def timestep_embedding(t, features: int, max_period: float = 10000.0):
  """``t [batch]`` -> ``[batch, features]``: ``cos(t w_i), sin(t w_i)`` with frequencies
  ``w_i = max_period^(-i / (features / 2))`` (float32; ``features`` even)."""
  check_array("t", t, ("batch",), dtype="real")
  half = features // 2
  freqs = jnp.exp(-math.log(max_period) * jnp.arange(half, dtype=jnp.float32) / half)
  arg = jnp.asarray(t, jnp.float32)[:, None] * freqs
  return jnp.concatenate([jnp.cos(arg), jnp.sin(arg)], axis=-1)


def sincos_2d(h: int, w: int, features: int):
  """Fixed ``[h * w, features]`` position embedding of a row-major ``h x w`` grid: half the
  features embed the row, half the column (``features`` a multiple of 4)."""
  rows, cols = jnp.meshgrid(jnp.arange(h), jnp.arange(w), indexing="ij")
  emb = lambda p: timestep_embedding(p.reshape(-1), features // 2)
  return jnp.concatenate([emb(rows), emb(cols)], axis=-1)


def _plain_norm(features, dtype, param_dtype, rngs):
  # No affine parameters: adaLN's scale and shift take their place.
  return nnx.LayerNorm(features, epsilon=1e-6, use_scale=False, use_bias=False, dtype=dtype,
                       param_dtype=param_dtype, rngs=rngs)


def _modulate(norm, x, shift, scale):
  """``norm(x) * (1 + scale) + shift`` as one fused op (``probjax.ops.norm``); ``norm``, the
  parameterless LayerNorm, gives its epsilon and output dtype."""
  y = adaln_modulate(x, shift, scale, norm="layer", eps=norm.epsilon)
  return y if norm.dtype is None else y.astype(norm.dtype)


class DiTBlock(nnx.Module):
  """adaLN-Zero block on ``[batch, n, features]``: for each sublayer ``f`` (self-attention,
  then cross-attention with ``context_features``, then the MLP)
  ``x + gate * f(norm(x) * (1 + scale) + shift)``, with ``(shift, scale, gate)`` per sublayer
  from ``modulation [batch, 1, sites * 3 * features]`` (``sites`` = 2, or 3 with
  cross-attention; in that order). A zero modulation makes the block exactly the identity.

  >>> import jax.numpy as jnp
  >>> from flax import nnx
  >>> blk = DiTBlock(features=16, num_heads=2, rngs=nnx.Rngs(0))
  >>> x = jnp.ones((2, 5, 16))
  >>> bool((blk(x, jnp.zeros((2, 1, blk.sites * 3 * 16))) == x).all())
  True
  """

  def __init__(self, *, features: int, num_heads: int, num_kv_heads: int | None = None,
               head_dim: int | None = None, mlp: str = "gelu", mlp_features: int | None = None,
               qk_norm: bool = False, context_features: int | None = None, use_bias: bool = True,
               attention_fn: Callable = dot_product_attention, dtype=None,
               param_dtype=jnp.float32, rngs: nnx.Rngs):
    if mlp not in MLP_KINDS:
      raise ValueError(f"mlp must be one of {MLP_KINDS}, got {mlp!r}")
    check_heads(features, num_heads, num_kv_heads, head_dim)
    kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    attn = dict(num_heads=num_heads, in_features=features, num_kv_heads=num_kv_heads,
                head_dim=head_dim, qk_norm=qk_norm, use_bias=use_bias, attention_fn=attention_fn, **kw)
    self.features, self.context_features = features, context_features
    self.sites = 2 + (context_features is not None)
    self.norms = nnx.List([_plain_norm(features, **kw) for _ in range(self.sites)])
    self.attn = MultiHeadAttention(**attn)
    self.cross = (None if context_features is None else
                  MultiHeadAttention(context_features=context_features, **attn))
    self.mlp = MLP(features=features, hidden_features=mlp_features, activation=mlp,
                   use_bias=use_bias, **kw)

  def __call__(self, x, modulation, *, context=None, context_mask=None, mask=None):
    """``x [batch, n, features]``, ``modulation [batch, 1, sites * 3 * features]``; ``context
    [batch, m, context_features]`` with ``context_mask`` for cross-attention; ``mask`` for
    self-attention. Returns ``[batch, n, features]``. Wrong shapes raise ValueError, wrong
    dtypes TypeError, naming the argument (``modulation`` may also be ``[1, 1, ...]``)."""
    if (context is None) != (self.cross is None):
      raise ValueError("context must be given exactly when the block has context_features"
                       if self.cross is not None else "context given to a block without context_features")
    s = check_array("x", x, ("batch", "n", ("features", self.features)))
    width = ("sites * 3 * features", self.sites * 3 * self.features)
    check_array("modulation", modulation, [("batch", 1, width), (1, 1, width)], sizes=s)
    check_mask(mask, s["batch"][0], s["n"][0], s["n"][0])
    if context is not None:
      s = check_array("context", context, ("batch", "m", ("context_features", self.context_features)), sizes=s)
      check_mask(context_mask, s["batch"][0], s["n"][0], s["m"][0], name="context_mask")
    mods = jnp.split(modulation, 3 * self.sites, axis=-1)
    sublayers = [lambda h: self.attn(h, mask=mask)]
    if self.cross is not None:
      sublayers.append(lambda h: self.cross(h, context, mask=context_mask))
    sublayers.append(self.mlp)
    for i, (f, norm) in enumerate(zip(sublayers, self.norms)):
      shift, scale, gate = mods[3 * i:3 * i + 3]
      y = f(_modulate(norm, x, shift, scale))
      x = x + (gate.astype(y.dtype) * y).astype(x.dtype)
    return x


class DiffusionTransformer(nnx.Module):
  """DiT on token sets or images (see the module docstring).

  Args:
    in_features: features of a token, or channels of an image; out_features (default
      ``in_features``).
    features, num_layers, num_heads, num_kv_heads, head_dim, mlp, mlp_features, qk_norm:
      the blocks' (:class:`DiTBlock`).
    patch_size: images ``[batch, H, W, in_features]`` in ``patch_size`` patches (None: tokens).
    num_classes: class-label conditioning (labels ``0 .. num_classes - 1``, and
      ``null_label = num_classes``); class_dropout_rate: the probability that a label becomes
      the null label when ``deterministic=False`` (from the ``dropout`` stream of ``rngs``).
    cond_features: features of a context vector ``cond [batch, cond_features]``.
    context_features: features of a context sequence ``context [batch, m, context_features]``
      (cross-attention in every block).
    frequency_features, time_scale: the timestep features are
      ``timestep_embedding(time_scale * t, frequency_features)`` (``t`` in [0, 1] by default).
    remat: recompute each block in the backward pass (``nnx.remat``).
    scan_layers: run the blocks unrolled (False, the default: the faster train step) or
      under ``nnx.scan`` (True: one compiled block); the same stacked parameters and output.
    attention_fn: of every attention layer; dtype, param_dtype: compute and parameter dtypes.

  >>> import jax.numpy as jnp
  >>> from flax import nnx
  >>> from probjax.ops.attention.masks import KVLenMask
  >>> dit = DiffusionTransformer(in_features=2, features=16, num_layers=2, num_heads=2,
  ...                            cond_features=3, context_features=5, rngs=nnx.Rngs(0))
  >>> dit(jnp.ones((2, 7, 2)), jnp.array([0.1, 0.9]), cond=jnp.ones((2, 3)),
  ...     context=jnp.ones((2, 4, 5)), mask=KVLenMask(jnp.array([7, 3]))).shape
  (2, 7, 2)
  """

  def __init__(self, *, in_features: int, features: int, num_layers: int, num_heads: int,
               out_features: int | None = None, num_kv_heads: int | None = None,
               head_dim: int | None = None, mlp: str = "gelu", mlp_features: int | None = None,
               qk_norm: bool = False, patch_size: int | None = None, num_classes: int | None = None,
               class_dropout_rate: float = 0.0, cond_features: int | None = None,
               context_features: int | None = None, frequency_features: int = 256,
               time_scale: float = 1000.0, remat: bool = False, scan_layers: bool = False,
               attention_fn: Callable = dot_product_attention, dtype=None,
               param_dtype=jnp.float32, rngs: nnx.Rngs):
    for name, v in (("in_features", in_features), ("features", features), ("num_layers", num_layers),
                    ("patch_size", patch_size), ("num_classes", num_classes),
                    ("cond_features", cond_features), ("context_features", context_features),
                    ("out_features", out_features)):
      if v is not None and v < 1:
        raise ValueError(f"{name} must be >= 1, got {v}")
    if frequency_features < 2 or frequency_features % 2:
      raise ValueError(f"frequency_features must be even and >= 2, got {frequency_features}")
    if patch_size is not None and features % 4:
      raise ValueError(f"features ({features}) must be a multiple of 4 with patch_size (the 2-D "
                       "position embedding)")
    if not 0.0 <= class_dropout_rate <= 1.0:
      raise ValueError(f"class_dropout_rate must lie in [0, 1], got {class_dropout_rate}")
    if class_dropout_rate > 0 and num_classes is None:
      raise ValueError("class_dropout_rate needs num_classes")
    check_heads(features, num_heads, num_kv_heads, head_dim)
    self.in_features, self.features, self.num_layers = in_features, features, num_layers
    self.out_features = in_features if out_features is None else out_features
    self.patch_size, self.num_classes = patch_size, num_classes
    self.class_dropout_rate, self.cond_features = class_dropout_rate, cond_features
    self.context_features = context_features
    self.frequency_features, self.time_scale, self.remat = frequency_features, time_scale, remat
    self.scan_layers = scan_layers
    kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    p2 = 1 if patch_size is None else patch_size ** 2
    self.embed = nnx.Linear(p2 * in_features, features, **kw)
    self.time_in = nnx.Linear(frequency_features, features, **kw)
    self.time_out = nnx.Linear(features, features, **kw)
    self.label_embed = (None if num_classes is None else
                        nnx.Embed(num_classes + 1, features, embedding_init=nnx.initializers.normal(0.02),
                                  **kw))
    self.cond_proj = None if cond_features is None else nnx.Linear(cond_features, features, **kw)
    self.rngs = rngs.dropout.fork() if class_dropout_rate > 0 else None

    @nnx.split_rngs(splits=num_layers)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def make(rngs):
      return DiTBlock(features=features, num_heads=num_heads, num_kv_heads=num_kv_heads,
                      head_dim=head_dim, mlp=mlp, mlp_features=mlp_features, qk_norm=qk_norm,
                      context_features=context_features, attention_fn=attention_fn, dtype=dtype,
                      param_dtype=param_dtype, rngs=rngs)

    self.blocks = make(rngs)
    self.sites = 2 + (context_features is not None)
    zeros = nnx.initializers.zeros_init()
    # Every block's (shift, scale, gate) per site, then the final layer's (shift, scale).
    self.modulation = nnx.Linear(features, (num_layers * self.sites * 3 + 2) * features,
                                 kernel_init=zeros, **kw)
    self.final_norm = _plain_norm(features, **kw)
    self.final = nnx.Linear(features, p2 * self.out_features, kernel_init=zeros, **kw)

  @property
  def null_label(self) -> int:
    """The label of the unconditional model (classifier-free guidance)."""
    return self.num_classes

  # -- input checks (static: shapes and dtypes) ---------------------------------
  def _check_x(self, x):
    """The sizes of ``x`` (tokens ``[batch, n, in_features]`` or an image ``[batch, H, W,
    in_features]``, floating), or ValueError/TypeError naming ``x``."""
    if self.patch_size is None:
      return check_array("x", x, ("batch", "n", ("in_features", self.in_features)))
    s = check_array("x", x, ("batch", "H", "W", ("in_features", self.in_features)))
    hh, ww, p = s["H"][0], s["W"][0], self.patch_size
    if hh % p or ww % p:
      raise ValueError(f"patch_size ({p}) must divide the image's height and width, got {hh}x{ww} "
                       f"(x of shape {tuple(x.shape)})")
    return {**s, "n": (hh // p * (ww // p), "x")}

  def _check_conditioning(self, t, labels, cond, sizes=None):
    """``t [batch]`` (integer or floating), ``labels [batch]`` integers, ``cond [batch,
    cond_features]`` floating (``sizes``: ``batch`` bound by ``x``)."""
    if isinstance(t, (int, float)) or getattr(t, "shape", None) == ():
      b = f" (batch={sizes['batch'][0]} as x's)" if sizes else ""
      raise ValueError(f"t must be [batch]{b}, one time per batch element, got a scalar: pass "
                       "jnp.full((batch,), t)")
    s = check_array("t", t, ("batch",), dtype="real", sizes=sizes)
    if labels is not None and self.label_embed is not None:
      check_array("labels", labels, ("batch",), dtype="int", sizes=s)
    if cond is not None and self.cond_proj is not None:
      check_array("cond", cond, ("batch", ("cond_features", self.cond_features)), sizes=s)
    return s

  def _check_context(self, sizes, context, context_mask, mask):
    b, n = sizes["batch"][0], sizes["n"][0]
    check_mask(mask, b, n, n)
    if context is not None and self.context_features is not None:
      s = check_array("context", context, ("batch", "m", ("context_features", self.context_features)),
                      sizes=sizes)
      check_mask(context_mask, b, n, s["m"][0], name="context_mask")

  # -- conditioning -----------------------------------------------------------
  def conditioning(self, t, *, labels=None, cond=None, deterministic=None, rngs=None):
    """The conditioning vector ``c [batch, features]`` from ``t [batch]`` and the labels / cond
    (a scalar ``t``, or labels / cond of another batch, raise ValueError naming them)."""
    self._check_conditioning(t, labels, cond)
    c = self.time_out(jax.nn.silu(self.time_in(
        timestep_embedding(self.time_scale * jnp.asarray(t), self.frequency_features))))
    if (labels is None) != (self.label_embed is None):
      raise ValueError("labels must be given exactly when the model has num_classes"
                       if self.label_embed is not None else "labels given to a model without num_classes")
    if (cond is None) != (self.cond_proj is None):
      raise ValueError("cond must be given exactly when the model has cond_features"
                       if self.cond_proj is not None else "cond given to a model without cond_features")
    if labels is not None:
      if self.class_dropout_rate > 0:
        if deterministic is None:
          raise ValueError("deterministic must be given (True or False) when class_dropout_rate > 0")
        if not deterministic:
          stream = rngs.dropout if isinstance(rngs, nnx.Rngs) else (rngs or self.rngs)
          drop = jax.random.uniform(stream(), labels.shape) < self.class_dropout_rate
          labels = jnp.where(drop, self.null_label, labels)
      c = c + self.label_embed(labels)
    if cond is not None:
      c = c + self.cond_proj(cond)
    return c

  # -- tokens -----------------------------------------------------------------
  def _tokens(self, x):
    if self.patch_size is None:
      if x.ndim != 3 or x.shape[-1] != self.in_features:
        raise ValueError(f"x must be [batch, n, in_features={self.in_features}], got {x.shape}")
      return self.embed(x)
    p = self.patch_size
    if x.ndim != 4 or x.shape[-1] != self.in_features:
      raise ValueError(f"x must be an image [batch, H, W, in_features={self.in_features}], got {x.shape}")
    b, hh, ww, ch = x.shape
    if hh % p or ww % p:
      raise ValueError(f"patch_size ({p}) must divide the image's height and width, got {hh}x{ww}")
    x = x.reshape(b, hh // p, p, ww // p, p, ch).transpose(0, 1, 3, 2, 4, 5).reshape(b, -1, p * p * ch)
    h = self.embed(x)
    return h + sincos_2d(hh // p, ww // p, self.features).astype(h.dtype)

  def _untokens(self, y, shape):
    if self.patch_size is None:
      return y
    p, (b, hh, ww, _) = self.patch_size, shape
    y = y.reshape(b, hh // p, ww // p, p, p, self.out_features).transpose(0, 1, 3, 2, 4, 5)
    return y.reshape(b, hh, ww, self.out_features)

  # -- forward ------------------------------------------------------------------
  def hidden(self, x, c, *, context=None, context_mask=None, mask=None):
    """Tokens after the embedding and every block, ``[batch, n, features]``, with the
    conditioning ``c`` (:meth:`conditioning`); returns ``(hidden, final_modulation)``."""
    s = self._check_x(x)
    check_array("c", c, ("batch", ("features", self.features)), sizes=s)
    self._check_context(s, context, context_mask, mask)
    b, f, l, k = x.shape[0], self.features, self.num_layers, self.sites * 3
    mods = self.modulation(jax.nn.silu(c))                         # one matmul for every block
    blocks, final = jnp.split(mods, [l * k * f], axis=-1)
    blocks = blocks.reshape(b, l, 1, k * f).swapaxes(0, 1)         # [layers, batch, 1, k * f]

    def body(h, block, m):
      return block(h, m, context=context, context_mask=context_mask, mask=mask)
    if self.remat:
      body = nnx.remat(body)
    h = self._tokens(x)
    if self.scan_layers:
      h = nnx.scan(body, in_axes=(nnx.Carry, 0, 0), out_axes=nnx.Carry)(h, self.blocks, blocks)
    else:
      views = shd.layer_views(self.blocks, l)
      for view, m in zip(views, blocks):
        h = body(h, view, m)
      shd.restack_state(self.blocks, views)
    return h, final[:, None, :]

  def __call__(self, x, t, *, labels=None, cond=None, context=None, context_mask=None, mask=None,
               deterministic: bool | None = None, rngs=None):
    """``x`` tokens ``[batch, n, in_features]`` (or an image ``[batch, H, W, in_features]``
    with ``patch_size``), ``t [batch]`` -> ``[batch, n, out_features]`` (or ``[batch, H, W,
    out_features]``).

    Args:
      labels: ``[batch]`` ints (``null_label`` for the unconditional model); cond: ``[batch,
        cond_features]``; context: ``[batch, m, context_features]`` with ``context_mask``.
      mask: a probjax mask for the self-attention (e.g. ``KVLenMask(sizes)``); outputs at
        padded tokens are unspecified.
      deterministic: False drops labels (with ``class_dropout_rate > 0``); rngs: an
        ``nnx.Rngs`` (its ``dropout`` stream) or a stream for that, default the model's own.
    """
    s = self._check_x(x)
    self._check_conditioning(t, labels, cond, s)
    self._check_context(s, context, context_mask, mask)
    c = self.conditioning(t, labels=labels, cond=cond, deterministic=deterministic, rngs=rngs)
    h, final = self.hidden(x, c, context=context, context_mask=context_mask, mask=mask)
    shift, scale = jnp.split(final, 2, axis=-1)
    y = self.final(_modulate(self.final_norm, h, shift, scale))
    return self._untokens(y, x.shape)
