"""RAttention (Flax NNX): causal sliding-window attention plus residual linear attention over
the keys that left the window, on ``[batch, length, features]``.

Per head: ``o = RMSNorm(swa) + RMSNorm(rla)`` where ``swa`` is
:func:`~probjax.nn.layers.attention.dot_product_attention` under ``LocalWindowMask(window_size,
0)`` (keys ``[t - window_size, t]``) and ``rla`` is
:func:`~probjax.ops.scan.residual_linear_attention` (keys ``<= t - window_size - 1``); then
the out-projection. The layer has no positional encoding: the window's softmax does not depend
on the keys' order, so decoding keeps the window in a ring buffer.

Decoding state (:class:`RAttentionState`): the last ``window_size + 1`` keys and values, slot
``t % (window_size + 1)`` holding position ``t``, the linear state the last query read, and the
next position. Each :meth:`RAttention.step` first moves the key leaving the window (the one in
the slot it overwrites) into the linear state.

>>> import jax.numpy as jnp
>>> from flax import nnx
>>> layer = RAttention(num_heads=4, num_kv_heads=2, in_features=32, window_size=3, rngs=nnx.Rngs(0))
>>> y1, state = layer.step(jnp.ones((2, 32)), layer.init_state(2))
>>> y1.shape, int(state.position)
((2, 32), 1)
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from probjax.nn.layers._checks import check_array, check_instance
from probjax.nn.layers import _sharding as shd
from probjax.nn.layers.attention import KVLenMask, LocalWindowMask, dot_product_attention
from probjax.nn.layers.multi_head_attention import check_heads
from probjax.ops.scan import feature_map as rla_features
from probjax.ops.scan import residual_linear_attention
from probjax.ops.scan.calls import FEATURE_MAPS

__all__ = ["RAttention", "RAttentionState"]


@dataclasses.dataclass(frozen=True)
class RAttentionState:
  """k, v ``[batch, window_size + 1, kv_heads, head_dim]`` (a ring: slot ``t % (window_size +
  1)`` holds position ``t``); linear ``[batch, kv_heads, features, head_dim]`` float32, the
  state the last query read; position: the next token's position (int32 scalar)."""

  k: Any
  v: Any
  linear: Any
  position: Any


jax.tree_util.register_dataclass(RAttentionState, data_fields=["k", "v", "linear", "position"],
                                 meta_fields=[])


class RAttention(nnx.Module):
  """Residual linear attention, causal.

  Args:
    num_heads: query heads; num_kv_heads: key/value heads (default num_heads; must divide it).
    in_features: features of ``x``; out_features (default in_features).
    window_size: keys ``[t - window_size, t]`` go through softmax attention, the older ones
      through the linear branch.
    head_dim: per-head features (default ``in_features // num_heads``).
    feature_map: the linear branch's, "softmax" (``[softmax(x), softmax(-x)]``) or "relu".
    implementation: the linear branch's (:func:`~probjax.ops.scan.residual_linear_attention`);
      attention_implementation: the window attention's.
    dtype: compute dtype (None: from the inputs and params); param_dtype: parameter dtype.
  """

  def __init__(self, *, num_heads: int, in_features: int, window_size: int,
               num_kv_heads: int | None = None, head_dim: int | None = None,
               out_features: int | None = None, feature_map: str = "softmax",
               use_bias: bool = False, implementation: str | None = None,
               attention_implementation: str | None = None, dtype=None,
               param_dtype=jnp.float32, rngs: nnx.Rngs):
    num_kv_heads, head_dim = check_heads(in_features, num_heads, num_kv_heads, head_dim, "in_features")
    if not isinstance(window_size, int) or window_size < 0:
      raise ValueError(f"window_size must be an int >= 0, got {window_size!r}")
    if feature_map not in FEATURE_MAPS:
      raise ValueError(f"feature_map must be one of {FEATURE_MAPS}, got {feature_map!r}")
    self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
    self.in_features = in_features
    self.window_size, self.feature_map = window_size, feature_map
    self.implementation, self.attention_implementation = implementation, attention_implementation
    self.dtype, self.param_dtype = dtype, param_dtype
    h, hk, d = num_heads, num_kv_heads, head_dim
    kw = dict(use_bias=use_bias, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    self.qkv = nnx.Linear(in_features, (h + 2 * hk) * d, **kw, **shd.linear("embed", "heads"))
    self.out = nnx.Linear(h * d, in_features if out_features is None else out_features, **kw,
                          **shd.linear("heads", "embed"))
    norm = lambda: nnx.RMSNorm(d, dtype=dtype, param_dtype=param_dtype, rngs=rngs, **shd.norm("kv"))
    self.window_norm, self.linear_norm = norm(), norm()

  @property
  def features(self) -> int:
    return 2 * self.head_dim if self.feature_map == "softmax" else self.head_dim

  def _project(self, x):
    h, hk, d = self.num_heads, self.num_kv_heads, self.head_dim
    b, t = x.shape[:2]
    q, k, v = jnp.split(self.qkv(x), [h * d, (h + hk) * d], axis=-1)
    return q.reshape(b, t, h, d), k.reshape(b, t, hk, d), v.reshape(b, t, hk, d)

  def _combine(self, window, linear):
    b, t = window.shape[:2]
    o = self.window_norm(window) + self.linear_norm(linear.astype(window.dtype))
    return self.out(o.reshape(b, t, self.num_heads * self.head_dim))

  def __call__(self, x, *, return_state: bool = False):
    """``x [batch, length, in_features]`` from the start; returns ``[batch, length,
    out_features]`` (and the decoding state after it). A wrong shape or a non-floating ``x``
    raises ValueError / TypeError naming ``x``."""
    check_array("x", x, ("batch", "length", ("in_features", self.in_features)))
    q, k, v = self._project(x)
    window = dot_product_attention(q, k, v, mask=LocalWindowMask(self.window_size, 0),
                                   implementation=self.attention_implementation)
    linear, s = residual_linear_attention(q, k, v, window_size=self.window_size,
                                          feature_map=self.feature_map, return_final_state=True,
                                          implementation=self.implementation)
    y = self._combine(window, linear)
    if not return_state:
      return y
    length, slots = x.shape[1], self.window_size + 1
    # Slot j holds the latest position t < length with t % slots == j (none yet: zeros).
    pos = length - 1 - (length - 1 - jnp.arange(slots)) % slots
    ring = lambda a: jnp.where((pos >= 0)[None, :, None, None], a[:, jnp.maximum(pos, 0)], 0)
    return y, RAttentionState(ring(k), ring(v), s, jnp.asarray(length, jnp.int32))

  def init_state(self, batch: int, dtype=None) -> RAttentionState:
    """The state before the first token."""
    dtype = dtype or self.dtype or self.param_dtype
    ring = jnp.zeros((batch, self.window_size + 1, self.num_kv_heads, self.head_dim), dtype)
    linear = jnp.zeros((batch, self.num_kv_heads, self.features, self.head_dim), jnp.float32)
    return RAttentionState(ring, ring, linear, jnp.asarray(0, jnp.int32))

  def step(self, x, state: RAttentionState):
    """One token ``x [batch, in_features]`` at ``state.position``: ``(y [batch, out_features],
    state)``. Wrong shapes raise ValueError, wrong dtypes or types TypeError, naming ``x`` or
    ``state``."""
    s = check_array("x", x, ("batch", ("in_features", self.in_features)))
    check_instance("state", state, RAttentionState, "an RAttentionState (from init_state or a previous call)")
    ring = ("batch", ("window_size + 1", self.window_size + 1), ("num_kv_heads", self.num_kv_heads),
            ("head_dim", self.head_dim))
    check_array("state.k", state.k, ring, sizes=s)
    check_array("state.v", state.v, ring, sizes=s)
    check_array("state.linear", state.linear, ("batch", ("num_kv_heads", self.num_kv_heads),
                                               ("features", self.features), ("head_dim", self.head_dim)), sizes=s)
    check_array("state.position", state.position, (), dtype="int")
    q, k, v = self._project(x[:, None])
    t, slots = state.position, self.window_size + 1
    slot = t % slots
    # The key in the slot about to be overwritten is position t - slots: it leaves the window.
    k_old, v_old = state.k[:, slot], state.v[:, slot]
    leaving = jnp.einsum("bkf,bkd->bkfd", rla_features(k_old, self.feature_map),
                         v_old.astype(jnp.float32))
    linear = state.linear + jnp.where(t >= slots, 1.0, 0.0) * leaving
    ring_k = state.k.at[:, slot].set(k[:, 0].astype(state.k.dtype))
    ring_v = state.v.at[:, slot].set(v[:, 0].astype(state.v.dtype))
    lengths = jnp.full((x.shape[0],), jnp.minimum(t + 1, slots), jnp.int32)
    window = dot_product_attention(q, ring_k.astype(q.dtype), ring_v.astype(q.dtype),
                                   mask=KVLenMask(lengths),
                                   implementation=self.attention_implementation)
    kv_head = jnp.arange(self.num_heads) // (self.num_heads // self.num_kv_heads)
    lin = jnp.einsum("bhf,bhfd->bhd", rla_features(q[:, 0], self.feature_map), linear[:, kv_head])
    y = self._combine(window, lin[:, None])
    return y[:, 0], RAttentionState(ring_k, ring_v, linear, t + 1)
