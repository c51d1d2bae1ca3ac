"""Attention conditioners for sets: the Set Transformer's blocks (Lee et al. 2019) and a
cross-attention conditioner mapping a variable-size context set to a fixed number of tokens.

Blocks are pre-norm: ``MAB(x, y) = h + MLP(norm(h))`` with ``h = x + MHA(norm(x), norm(y))``
(the paper's post-norm ``LayerNorm`` placement moved before each sublayer, as in
:class:`~probjax.nn.layers.transformer.TransformerBlock`). ``SAB(x) = MAB(x, x)``; ``ISAB``
attends through ``num_inducing`` learned points, ``MAB(x, MAB(I, x))`` (linear in the set
size); ``PMA`` pools with ``num_seeds`` learned seeds, ``MAB(S, MLP(x))``.

Padded sets: ``mask`` is a probjax mask on the set's elements, normally
``KVLenMask(set_sizes)`` for sets right-padded to a common size, passed through to
``attention_fn``. Padded elements are never read as keys, so the outputs of real elements
(and ISAB's inducing summaries, PMA's pooled seeds) do not depend on them; the outputs at
padded positions are unspecified.

>>> import jax.numpy as jnp
>>> from flax import nnx
>>> from probjax.ops.attention.masks import KVLenMask
>>> x = jnp.ones((2, 7, 16))                      # two sets of 7 and 4 elements, padded to 7
>>> isab = ISAB(features=16, num_heads=2, num_inducing=4, rngs=nnx.Rngs(0))
>>> pma = PMA(features=16, num_heads=2, num_seeds=1, rngs=nnx.Rngs(0))
>>> mask = KVLenMask(jnp.array([7, 4]))
>>> pma(isab(x, mask=mask), mask=mask).shape
(2, 1, 16)
"""

from __future__ import annotations

from typing import Callable

import jax.numpy as jnp
from flax import nnx

from probjax.nn.layers.attention import dot_product_attention
from probjax.nn.layers._checks import check_array, check_mask
from probjax.nn.layers.mlp import ACTIVATIONS as MLP_KINDS, MLP
from probjax.nn.layers.multi_head_attention import MultiHeadAttention, check_heads
from probjax.nn.layers.transformer import NORMS, Transformer, _norm
from probjax.ops.attention.masks import Mask

__all__ = ["MAB", "SAB", "ISAB", "PMA", "CrossAttentionConditioner"]


def check_key_mask(mask):
  """A key mask whose predicate depends on the key index only (per-batch set sizes), so that it
  applies to any queries: learned inducing points or seeds as well as the set itself."""
  if mask is None:
    return
  if not isinstance(mask, Mask) or mask.components not in ((), ("kv_lengths",)):
    name = mask.name if isinstance(mask, Mask) else type(mask).__name__
    raise ValueError(f"mask must be a probjax key-length mask (KVLenMask(set_sizes)), got {name}")


def _check_set(name, x, features, mask, label="features"):
  """The sizes of a floating set ``[batch, n, features]`` (ValueError/TypeError naming ``name``),
  after checking that a key-length ``mask`` fits it."""
  s = check_array(name, x, ("batch", "n", (label, features)))
  check_key_mask(mask)
  check_mask(mask, s["batch"][0], s["n"][0], s["n"][0])
  return s


def _count(name, n):
  if n < 1:
    raise ValueError(f"{name} must be >= 1, got {n}")


class MAB(nnx.Module):
  """Multihead attention block ``x [batch, n, features], y [batch, m, context_features] ->
  [batch, n, features]``: ``h = x + MHA(norm(x), norm(y))``, ``h + MLP(norm(h))``.

  Args:
    features: of ``x`` and the output; context_features: of ``y`` (default ``features``).
    num_heads, num_kv_heads, head_dim, qk_norm: of the attention (:class:`MultiHeadAttention`).
    mlp: "gelu" or "swiglu"; mlp_features: its hidden width; norm: "layernorm" or "rmsnorm".
    attention_fn: the attention function (default probjax's ``dot_product_attention``).

  >>> import jax.numpy as jnp
  >>> from flax import nnx
  >>> MAB(features=8, context_features=6, num_heads=2, rngs=nnx.Rngs(0))(
  ...     jnp.ones((2, 3, 8)), jnp.ones((2, 5, 6))).shape
  (2, 3, 8)
  """

  def __init__(self, *, features: int, num_heads: int, context_features: int | None = None,
               num_kv_heads: int | None = None, head_dim: int | None = None, mlp: str = "gelu",
               mlp_features: int | None = None, norm: str = "layernorm", qk_norm: bool = False,
               use_bias: bool = False, attention_fn: Callable = dot_product_attention, dtype=None,
               param_dtype=jnp.float32, rngs: nnx.Rngs):
    if norm not in NORMS:
      raise ValueError(f"norm must be one of {NORMS}, got {norm!r}")
    if mlp not in MLP_KINDS:
      raise ValueError(f"mlp must be one of {MLP_KINDS}, got {mlp!r}")
    check_heads(features, num_heads, num_kv_heads, head_dim)
    context_features = features if context_features is None else context_features
    self.features, self.context_features = features, context_features
    kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    self.norm_x = _norm(norm, features, **kw)
    self.norm_y = _norm(norm, context_features, **kw)
    self.attn = MultiHeadAttention(num_heads=num_heads, in_features=features,
                                   context_features=context_features, num_kv_heads=num_kv_heads,
                                   head_dim=head_dim, qk_norm=qk_norm, use_bias=use_bias,
                                   attention_fn=attention_fn, **kw)
    self.norm_h = _norm(norm, features, **kw)
    self.mlp = MLP(features=features, hidden_features=mlp_features, activation=mlp,
                   use_bias=use_bias, **kw)

  def __call__(self, x, y, *, mask=None):
    """``mask``: a probjax mask of ``[batch, heads, n, m]`` (e.g. ``KVLenMask(sizes)`` over
    ``y``'s elements), passed to ``attention_fn``. Wrong shapes or dtypes of ``x``, ``y`` or
    ``mask`` raise ValueError / TypeError naming the argument."""
    s = check_array("x", x, ("batch", "n", ("features", self.features)))
    s = check_array("y", y, ("batch", "m", ("context_features", self.context_features)), sizes=s)
    check_mask(mask, s["batch"][0], s["n"][0], s["m"][0])
    h = x + self.attn(self.norm_x(x), self.norm_y(y), mask=mask).astype(x.dtype)
    return h + self.mlp(self.norm_h(h)).astype(h.dtype)


class SAB(nnx.Module):
  """Set attention block ``MAB(x, x)``: ``[batch, n, features] -> [batch, n, features]``,
  permutation-equivariant. Arguments as :class:`MAB`'s (``context_features`` is ``features``).

  >>> import jax.numpy as jnp
  >>> from flax import nnx
  >>> SAB(features=8, num_heads=2, rngs=nnx.Rngs(0))(jnp.ones((2, 5, 8))).shape
  (2, 5, 8)
  """

  def __init__(self, *, features: int, num_heads: int, rngs: nnx.Rngs, **mab_kwargs):
    self.mab = MAB(features=features, num_heads=num_heads, rngs=rngs, **mab_kwargs)

  def __call__(self, x, *, mask=None):
    """``mask``: e.g. ``KVLenMask(set_sizes)``."""
    return self.mab(x, x, mask=mask)


def _learned_tokens(num, features, param_dtype, rngs):
  return nnx.Param(nnx.initializers.normal(features ** -0.5)(rngs.params(), (1, num, features), param_dtype))


class ISAB(nnx.Module):
  """Induced set attention block ``MAB(x, MAB(I, x))`` with ``num_inducing`` learned points
  ``I``: ``[batch, n, features] -> [batch, n, features]``, permutation-equivariant, cost
  linear in ``n``. Arguments as :class:`MAB`'s.

  >>> import jax.numpy as jnp
  >>> from flax import nnx
  >>> ISAB(features=8, num_heads=2, num_inducing=3, rngs=nnx.Rngs(0))(jnp.ones((2, 5, 8))).shape
  (2, 5, 8)
  """

  def __init__(self, *, features: int, num_heads: int, num_inducing: int, param_dtype=jnp.float32,
               rngs: nnx.Rngs, **mab_kwargs):
    _count("num_inducing", num_inducing)
    mab = lambda: MAB(features=features, num_heads=num_heads, param_dtype=param_dtype, rngs=rngs,
                      **mab_kwargs)
    self.inducing = _learned_tokens(num_inducing, features, param_dtype, rngs)
    self.mab_in, self.mab_out = mab(), mab()

  def __call__(self, x, *, mask=None):
    """``mask``: a key-length mask over the set (``KVLenMask(set_sizes)``)."""
    _check_set("x", x, self.mab_out.features, mask)
    i = jnp.broadcast_to(self.inducing[...], (x.shape[0],) + self.inducing.shape[1:])
    return self.mab_out(x, self.mab_in(i.astype(x.dtype), x, mask=mask))


class PMA(nnx.Module):
  """Pooling by multihead attention ``MAB(S, MLP(x))`` with ``num_seeds`` learned seeds ``S``:
  ``[batch, n, features] -> [batch, num_seeds, features]``, permutation-invariant. Arguments
  as :class:`MAB`'s (``mlp``, ``mlp_features`` also set the row-wise feed-forward on ``x``).

  >>> import jax.numpy as jnp
  >>> from flax import nnx
  >>> PMA(features=8, num_heads=2, num_seeds=2, rngs=nnx.Rngs(0))(jnp.ones((3, 5, 8))).shape
  (3, 2, 8)
  """

  def __init__(self, *, features: int, num_heads: int, num_seeds: int = 1, mlp: str = "gelu",
               mlp_features: int | None = None, use_bias: bool = False, dtype=None,
               param_dtype=jnp.float32, rngs: nnx.Rngs, **mab_kwargs):
    _count("num_seeds", num_seeds)
    kw = dict(mlp=mlp, mlp_features=mlp_features, use_bias=use_bias, dtype=dtype,
              param_dtype=param_dtype, rngs=rngs)
    self.mab = MAB(features=features, num_heads=num_heads, **kw, **mab_kwargs)
    self.seeds = _learned_tokens(num_seeds, features, param_dtype, rngs)
    self.ff = MLP(features=features, hidden_features=mlp_features, activation=mlp,
                  use_bias=use_bias, dtype=dtype, param_dtype=param_dtype, rngs=rngs)

  def __call__(self, x, *, mask=None):
    """``mask``: a key-length mask over the set (``KVLenMask(set_sizes)``)."""
    _check_set("x", x, self.mab.features, mask)
    s = jnp.broadcast_to(self.seeds[...], (x.shape[0],) + self.seeds.shape[1:])
    return self.mab(s.astype(x.dtype), self.ff(x), mask=mask)


class CrossAttentionConditioner(nnx.Module):
  """A variable-size context set ``[batch, m, context_features]`` to ``num_latents`` tokens
  ``[batch, num_latents, features]`` (a Perceiver-style encoder): learned latents cross-attend
  the set (a :class:`MAB`), then ``num_layers`` self-attention blocks
  (:class:`~probjax.nn.layers.transformer.Transformer`) over the latents, then a final norm.
  The output is a context sequence for a DiT's or a Transformer's cross-attention, with no
  mask (every latent is valid); it is permutation-invariant in the set.

  Args:
    features, num_heads, context_features, num_latents: as above; num_layers: latent
      self-attention blocks (0: none).
    mlp, mlp_features, norm, qk_norm, use_bias, attention_fn, dtype, param_dtype: of every block.

  >>> import jax.numpy as jnp
  >>> from flax import nnx
  >>> from probjax.ops.attention.masks import KVLenMask
  >>> cond = CrossAttentionConditioner(features=16, num_heads=2, context_features=3,
  ...                                  num_latents=4, num_layers=1, rngs=nnx.Rngs(0))
  >>> cond(jnp.ones((2, 9, 3)), mask=KVLenMask(jnp.array([9, 5]))).shape
  (2, 4, 16)
  """

  def __init__(self, *, features: int, num_heads: int, context_features: int, num_latents: int,
               num_layers: int = 1, mlp: str = "gelu", mlp_features: int | None = None,
               norm: str = "layernorm", qk_norm: bool = False, use_bias: bool = False,
               attention_fn: Callable = dot_product_attention, dtype=None,
               param_dtype=jnp.float32, rngs: nnx.Rngs):
    _count("num_latents", num_latents)
    if num_layers < 0:
      raise ValueError(f"num_layers must be >= 0, got {num_layers}")
    kw = dict(features=features, num_heads=num_heads, mlp=mlp, mlp_features=mlp_features,
              norm=norm, qk_norm=qk_norm, use_bias=use_bias, attention_fn=attention_fn,
              dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    self.latents = _learned_tokens(num_latents, features, param_dtype, rngs)
    self.cross = MAB(context_features=context_features, **kw)
    self.blocks = Transformer(num_layers=num_layers, **kw) if num_layers else None
    self.norm = _norm(norm, features, dtype=dtype, param_dtype=param_dtype, rngs=rngs)

  def __call__(self, context, *, mask=None):
    """``mask``: a key-length mask over the context set (``KVLenMask(set_sizes)``)."""
    _check_set("context", context, self.cross.context_features, mask, "context_features")
    z = jnp.broadcast_to(self.latents[...], (context.shape[0],) + self.latents.shape[1:])
    z = self.cross(z.astype(context.dtype), context, mask=mask)
    if self.blocks is not None:
      z = self.blocks(z)
    return self.norm(z)
