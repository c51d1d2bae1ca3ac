"""Multi-head latent attention (DeepSeek-V2) as a Flax NNX layer, with a latent KV cache.

Keys and values are not projected per head from ``x``: ``x`` is compressed to a latent of
``kv_lora_rank`` features (RMS-normalised) plus one ``qk_rope_head_dim``-wide RoPE key that
all heads share; per head, K is ``[latent @ w_uk_h, k_rope]`` and V is ``latent @ w_uv_h``
(:func:`probjax.ops.mla.mla` computes the attention in the expanded or the absorbed form). Queries
come from ``x`` directly or, with ``q_lora_rank``, through a normalised low-rank bottleneck.

Decoding caches only the latent and the RoPE key (``kv_lora_rank + qk_rope_head_dim`` values per
position, whatever the heads) in the functional :class:`~probjax.nn.layers.kv_cache.KVCache`:
its ``k`` holds the latents ``[batch, max_len, 1, kv_lora_rank]`` and its ``v`` the rotated RoPE
keys ``[batch, max_len, 1, qk_rope_head_dim]``, written by the cache's own functions (prefill at
``[0, P)`` with ``dynamic_update_slice``, then per step at ``lengths[b]``), and attended over
with ``KVLenMask(lengths)``.
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from probjax.nn.layers import kv_cache as kvc
from probjax.nn.layers._checks import check_array, check_mask
from probjax.nn.layers.rotary import apply_rotary, default_positions
from probjax.ops.attention.masks import CausalMask, KVLenMask, Mask
from probjax.ops.mla import mla

__all__ = ["MultiHeadLatentAttention"]


class MultiHeadLatentAttention(nnx.Module):
  """Multi-head latent attention on ``[batch, seq, in_features]`` (self-attention).

  Args:
    num_heads: attention heads; in_features: features of ``x``; out_features (default in_features).
    kv_lora_rank: the latent's width ``d_c`` (DeepSeek-V2: 512).
    q_lora_rank: the queries' low-rank bottleneck (None: a full projection; DeepSeek-V2: 1536).
    qk_nope_head_dim, qk_rope_head_dim, v_head_dim: per-head widths of the position-free part of
      q/k, the RoPE part of q/k, and v (DeepSeek-V2: 128, 64, 128). The softmax scale is
      ``(qk_nope_head_dim + qk_rope_head_dim) ** -0.5``.
    rotary_base: RoPE's base. is_causal: default causal masking.
    form: ``mla``'s form, "auto", "expanded" or "absorbed"; implementation: passed to attention.
    dtype: compute dtype (None: from the inputs and params); param_dtype: parameter dtype.

  >>> import jax.numpy as jnp
  >>> from flax import nnx
  >>> layer = MultiHeadLatentAttention(num_heads=4, in_features=32, kv_lora_rank=16, q_lora_rank=24,
  ...                                  qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8,
  ...                                  rngs=nnx.Rngs(0))
  >>> x = jnp.ones((2, 10, 32))
  >>> layer(x).shape
  (2, 10, 32)
  >>> cache = layer.init_cache(2, 16)
  >>> y, cache = layer.prefill(x[:, :9], cache, jnp.array([9, 9]))
  >>> y, cache = layer.decode_step(x[:, 9:], cache)
  >>> y.shape, cache.lengths.tolist(), cache.k.shape
  ((2, 1, 32), [10, 10], (2, 16, 1, 16))
  """

  def __init__(self, *, num_heads: int, in_features: int, kv_lora_rank: int = 512,
               q_lora_rank: int | None = None, qk_nope_head_dim: int = 128, qk_rope_head_dim: int = 64,
               v_head_dim: int = 128, out_features: int | None = None, rotary_base: float = 10000.0,
               is_causal: bool = True, form: str = "auto", implementation: str | None = None,
               kernel_init=None, dtype=None, param_dtype=jnp.float32, rngs: nnx.Rngs):
    for name, n in (("num_heads", num_heads), ("in_features", in_features), ("kv_lora_rank", kv_lora_rank),
                    ("qk_nope_head_dim", qk_nope_head_dim), ("qk_rope_head_dim", qk_rope_head_dim),
                    ("v_head_dim", v_head_dim)):
      if int(n) < 1:
        raise ValueError(f"{name} must be >= 1, got {n}")
    if q_lora_rank is not None and q_lora_rank < 1:
      raise ValueError(f"q_lora_rank must be None or >= 1, got {q_lora_rank}")
    if qk_rope_head_dim % 2:
      raise ValueError(f"qk_rope_head_dim must be even (RoPE rotates pairs), got {qk_rope_head_dim}")
    if form not in ("auto", "expanded", "absorbed"):
      raise ValueError(f"form must be 'auto', 'expanded' or 'absorbed', got {form!r}")
    self.num_heads, self.in_features = num_heads, in_features
    self.out_features = in_features if out_features is None else out_features
    self.kv_lora_rank, self.q_lora_rank = kv_lora_rank, q_lora_rank
    self.d_nope, self.d_rope, self.d_v = qk_nope_head_dim, qk_rope_head_dim, v_head_dim
    self.rotary_base, self.is_causal = rotary_base, is_causal
    self.form, self.implementation = form, implementation
    self.dtype, self.param_dtype = dtype, param_dtype
    h, dq = num_heads, qk_nope_head_dim + qk_rope_head_dim
    kw = dict(use_bias=False, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    if kernel_init is not None:
      kw["kernel_init"] = kernel_init
    norm = lambda n: nnx.RMSNorm(n, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    if q_lora_rank is None:
      self.q_a, self.q_norm = None, None
      self.q_b = nnx.Linear(in_features, h * dq, **kw)
    else:
      self.q_a = nnx.Linear(in_features, q_lora_rank, **kw)
      self.q_norm = norm(q_lora_rank)
      self.q_b = nnx.Linear(q_lora_rank, h * dq, **kw)
    self.kv_a = nnx.Linear(in_features, kv_lora_rank + qk_rope_head_dim, **kw)
    self.kv_norm = norm(kv_lora_rank)
    # DeepSeek-V2's kv_b projection, kept per head as the two factors mla takes.
    init = kernel_init or nnx.initializers.lecun_normal(in_axis=0, out_axis=(1, 2))
    self.w_uk = nnx.Param(init(rngs.params(), (kv_lora_rank, h, qk_nope_head_dim), param_dtype))
    self.w_uv = nnx.Param(init(rngs.params(), (kv_lora_rank, h, v_head_dim), param_dtype))
    self.out = nnx.Linear(h * v_head_dim, self.out_features, **kw)

  # -- projections ---------------------------------------------------------------
  def _queries(self, x, positions):
    """q_nope ``[b, t, h, d_nope]`` and rotated q_rope ``[b, t, h, d_rope]``."""
    b, t = x.shape[:2]
    q = self.q_b(x if self.q_a is None else self.q_norm(self.q_a(x)))
    q = q.reshape(b, t, self.num_heads, self.d_nope + self.d_rope)
    q_nope, q_rope = q[..., :self.d_nope], q[..., self.d_nope:]
    return q_nope, apply_rotary(q_rope, positions, base=self.rotary_base)

  def _latents(self, x, positions):
    """The normalised latent ``[b, t, d_c]`` and the rotated shared RoPE key ``[b, t, d_rope]``."""
    kv = self.kv_a(x)
    latent = self.kv_norm(kv[..., :self.kv_lora_rank])
    k_rope = apply_rotary(kv[..., None, self.kv_lora_rank:], positions, base=self.rotary_base)[:, :, 0]
    return latent, k_rope

  def _attend(self, q_nope, q_rope, latent, k_rope, mask):
    dt = q_nope.dtype
    latent, k_rope = latent.astype(dt), k_rope.astype(dt)
    out = mla(q_nope, q_rope, latent, k_rope, self.w_uk[...].astype(dt), self.w_uv[...].astype(dt),
              mask=mask, form=self.form, implementation=self.implementation)
    b, t = out.shape[:2]
    return self.out(out.reshape(b, t, self.num_heads * self.d_v))

  # -- input checks (static: shapes and dtypes) -----------------------------------
  def _check_x(self, x, seq, positions):
    s = check_array("x", x, ("batch", seq, ("in_features", self.in_features)))
    if positions is not None:
      check_array("positions", positions, ("batch", seq), dtype="int", sizes=s)
    return s

  # -- forward -------------------------------------------------------------------
  def __call__(self, x, *, positions=None, mask: Mask | None = None, is_causal: bool | None = None):
    """Self-attention of ``x [batch, seq, in_features]``.

    Args:
      positions: ``[batch, seq]`` int RoPE positions (default ``arange(seq)``).
      mask: a probjax ``Mask`` (e.g. ``SegmentMask(ids)``, ``KVLenMask(lengths)``), combined with
        the causal mask when causal.
      is_causal: overrides the constructor's.
    Returns:
      ``[batch, seq, out_features]``.

    A wrong shape, dtype or type of ``x``, ``positions`` or ``mask`` raises ValueError /
    TypeError naming it (``mask`` must be a structured ``Mask``: ``mla`` takes no dense mask).
    """
    s = self._check_x(x, "seq", positions)
    if mask is not None and not isinstance(mask, Mask):
      raise TypeError(f"mask must be a probjax Mask (e.g. SegmentMask(ids), KVLenMask(lengths)), got "
                      f"{type(mask).__name__}: multi-head latent attention takes no dense mask")
    check_mask(mask, s["batch"][0], s["seq"][0], s["seq"][0])
    b, t = x.shape[:2]
    if positions is None:
      positions = default_positions(b, t)
    causal = self.is_causal if is_causal is None else is_causal
    if causal:
      mask = CausalMask() if mask is None else mask & CausalMask()
    q_nope, q_rope = self._queries(x, positions)
    latent, k_rope = self._latents(x, positions)
    return self._attend(q_nope, q_rope, latent, k_rope, mask)

  # -- decoding ------------------------------------------------------------------
  def init_cache(self, batch: int, max_len: int, dtype=None) -> kvc.KVCache:
    """An empty latent cache: ``k`` the latents ``[batch, max_len, 1, kv_lora_rank]``, ``v`` the
    RoPE keys ``[batch, max_len, 1, qk_rope_head_dim]``, lengths ``[batch]``."""
    dtype = dtype or self.dtype or self.param_dtype
    for name, n in (("batch", batch), ("max_len", max_len)):
      if int(n) < 1:
        raise ValueError(f"init_cache: {name} must be >= 1, got {n}")
    zeros = lambda d: jnp.zeros((int(batch), int(max_len), 1, d), dtype)
    return kvc.KVCache(zeros(self.kv_lora_rank), zeros(self.d_rope), jnp.zeros((int(batch),), jnp.int32))

  def _check_decoding(self, cache, sizes):
    if not self.is_causal:
      raise ValueError("latent-cache decoding needs a causal layer (construct it with is_causal=True)")
    if not isinstance(cache, kvc.KVCache):
      raise TypeError(f"cache must be a latent cache from init_cache (a KVCache), got {type(cache).__name__}")
    if jnp.shape(cache.k)[-2:] != (1, self.kv_lora_rank) or jnp.shape(cache.v)[-2:] != (1, self.d_rope):
      raise ValueError(f"cache must be a latent cache from init_cache (k [..., 1, {self.kv_lora_rank}], "
                       f"v [..., 1, {self.d_rope}]), got k {jnp.shape(cache.k)} and v {jnp.shape(cache.v)}")
    kvc.check_cache(cache, sizes, (1, ("kv_lora_rank", self.kv_lora_rank)),
                    (1, ("qk_rope_head_dim", self.d_rope)))

  def prefill(self, x, cache: kvc.KVCache, lengths, *, positions=None):
    """Runs right-padded prompts ``x [batch, P, in_features]`` (valid lengths ``[batch]``)
    causally and writes their latents at ``[0, P)`` of an empty ``cache``.

    Returns ``(y [batch, P, out_features], cache)`` with ``cache.lengths = lengths``; outputs at
    padded positions are unspecified.
    """
    self._check_decoding(cache, self._check_x(x, "P", positions))
    b, p = x.shape[:2]
    kvc.check_prefix(cache, p, lengths)
    if positions is None:
      positions = default_positions(b, p)
    q_nope, q_rope = self._queries(x, positions)
    latent, k_rope = self._latents(x, positions)
    cache = kvc.write_prefix(cache, latent[:, :, None], k_rope[:, :, None], lengths)
    return self._attend(q_nope, q_rope, latent, k_rope, CausalMask()), cache

  def decode_step(self, x, cache: kvc.KVCache, *, positions=None):
    """Appends ``x [batch, n, in_features]`` (positions ``cache.lengths[b] + arange(n)``) to the
    cache and attends over it; ``n > 1`` runs as ``n`` one-token steps (a per-element causal
    offset is no structured mask, and mla takes structured masks only).

    Returns ``(y [batch, n, out_features], cache)`` with lengths advanced by ``n``.
    """
    self._check_decoding(cache, self._check_x(x, "n", positions))
    b, n = x.shape[:2]
    kvc.check_room(cache, n)
    if positions is None:
      positions = default_positions(b, n, cache.lengths)
    ys = []
    for i in range(n):
      xi, pi = x[:, i:i + 1], positions[:, i:i + 1]
      q_nope, q_rope = self._queries(xi, pi)
      latent, k_rope = self._latents(xi, pi)
      cache = kvc.write(cache, latent[:, :, None], k_rope[:, :, None])
      ys.append(self._attend(q_nope, q_rope, cache.k[:, :, 0], cache.v[:, :, 0], KVLenMask(cache.lengths)))
    return jnp.concatenate(ys, axis=1), cache
