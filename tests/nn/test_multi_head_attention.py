"""MultiHeadAttention: against a plain einsum reference, swapped attention_fn, dropout, errors."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from probjax.nn.layers.attention import dot_product_attention
from probjax.nn.layers.decoding import generate, sample_logits
from probjax.nn.layers.kv_cache import KVCache
from probjax.nn.layers.multi_head_attention import MultiHeadAttention
from probjax.nn.layers.transformer import TransformerBlock, TransformerLM
from probjax.ops.attention.masks import KVLenMask, Mask, SegmentMask
from probjax.testing import numpy_init

XLA = functools.partial(dot_product_attention, implementation="xla")




def jit(f):
  """``nnx.jit``: one compilation instead of many eager op-by-op ones (CPU test time)."""
  return nnx.jit(f)




def _rope_ref(x, pos, base=10000.0):
  """RoPE as a complex rotation of the pairs (i, i + d/2)."""
  d = x.shape[-1] // 2
  theta = pos[..., None, None].astype(np.float64) * base ** (-np.arange(d) * 2.0 / (2 * d))
  z = (x[..., :d] + 1j * x[..., d:]) * np.exp(1j * theta)
  return np.concatenate([z.real, z.imag], -1)


def _rms_ref(x, scale, eps=1e-6):
  return x / np.sqrt(np.mean(x ** 2, -1, keepdims=True) + eps) * scale


def _mha_ref(mha, x, pos, mask_fn):
  """The layer in numpy: fused projection, q/k RMS-norm, RoPE, GQA by repeating K/V, einsum
  attention with ``mask_fn(b, t, s) -> bool [b, t, s]``, output projection."""
  h, hk, d = mha.num_heads, mha.num_kv_heads, mha.head_dim
  x = np.asarray(x, np.float64)
  b, t, _ = x.shape
  w = lambda lin: np.asarray(lin.kernel[...], np.float64)
  qkv = x @ w(mha.qkv)
  q = qkv[..., :h * d].reshape(b, t, h, d)
  k = qkv[..., h * d:(h + hk) * d].reshape(b, t, hk, d)
  v = qkv[..., (h + hk) * d:].reshape(b, t, hk, d)
  q = _rms_ref(q, np.asarray(mha.q_norm.scale[...]))
  k = _rms_ref(k, np.asarray(mha.k_norm.scale[...]))
  q, k = _rope_ref(q, pos), _rope_ref(k, pos)
  k, v = np.repeat(k, h // hk, axis=2), np.repeat(v, h // hk, axis=2)
  s = np.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(d)
  s = np.where(mask_fn(b, t, t)[:, None], s, -np.inf)
  p = np.exp(s - s.max(-1, keepdims=True))
  p = p / p.sum(-1, keepdims=True)
  o = np.einsum("bhqk,bkhd->bqhd", p, v).reshape(b, t, h * d)
  return o @ w(mha.out)


def _layer(rngs=lambda: nnx.Rngs(params=0, dropout=1), **kw):
  args = dict(num_heads=4, num_kv_heads=2, in_features=24, head_dim=6, rotary=True, qk_norm=True,
              is_causal=True, attention_fn=XLA, dropout_rate=0.5)
  args.update(kw)
  return numpy_init(lambda: MultiHeadAttention(rngs=rngs(), **args))


@pytest.fixture(scope="module")
def mha():
  return _layer()


X = jnp.asarray(np.random.default_rng(1).standard_normal((2, 9, 24)), jnp.float32)
SEG = jnp.array([[1, 1, 1, 2, 2, 2, 2, 3, 3], [1] * 9])
POS = jnp.array([[0, 1, 2, 0, 1, 2, 3, 0, 1], list(range(9))])
plain = jit(lambda m, x: m(x, deterministic=True))
packed = jit(lambda m, x, p, s: m(x, positions=p, mask=SegmentMask(s), deterministic=True))


def test_mha_matches_einsum_reference(mha):
  causal = lambda b, t, s: np.broadcast_to(np.tril(np.ones((t, s), bool)), (b, t, s))
  same = np.asarray(SEG)[:, :, None] == np.asarray(SEG)[:, None, :]
  got = plain(mha, X)
  want = _mha_ref(mha, X, np.broadcast_to(np.arange(9), (2, 9)), causal)
  np.testing.assert_allclose(got, want, atol=2e-5, rtol=2e-5)
  # Packed documents: a probjax SegmentMask and per-document positions pass through.
  got = packed(mha, X, POS, SEG)
  want = _mha_ref(mha, X, np.asarray(POS), lambda b, t, s: causal(b, t, s) & same)
  np.testing.assert_allclose(got, want, atol=2e-5, rtol=2e-5)
  # A dense boolean mask is accepted too.
  got = jit(lambda m, x, p, s: m(x, positions=p, mask=s, deterministic=True))(
      mha, X, POS, jnp.asarray(same)[:, None])
  np.testing.assert_allclose(got, want, atol=2e-5, rtol=2e-5)


def _flax_attention(query, key, value, *, mask=None, is_causal=False, **kw):
  """Adapter: flax.nnx.dot_product_attention has no GQA and no probjax masks."""
  b, t, h, _ = query.shape
  s, hk = key.shape[1], key.shape[2]
  key, value = jnp.repeat(key, h // hk, axis=2), jnp.repeat(value, h // hk, axis=2)
  if isinstance(mask, Mask):
    mask = mask.dense(b, t, s)
  if is_causal:
    causal = jnp.tril(jnp.ones((t, s), bool))[None, None]
    mask = causal if mask is None else mask & causal
  return nnx.dot_product_attention(query, key, value, mask=mask, **kw)


def _swapped(module, fn):
  other = nnx.clone(module)
  other.attention_fn = fn
  return other


def test_attention_fn_swap_to_flax(mha):
  np.testing.assert_allclose(packed(mha, X, POS, SEG), packed(_swapped(mha, _flax_attention), X, POS, SEG),
                             atol=1e-5, rtol=1e-5)
  # Cross-attention with per-element context lengths.
  ctx = jnp.asarray(np.random.default_rng(2).standard_normal((2, 5, 10)), jnp.float32)
  ours = numpy_init(lambda: MultiHeadAttention(num_heads=4, num_kv_heads=1, in_features=24,
                                                context_features=10, rngs=nnx.Rngs(1)))
  f = jit(lambda m, x, c, n: m(x, c, mask=KVLenMask(n)))
  n = jnp.array([5, 3])
  np.testing.assert_allclose(f(ours, X, ctx, n), f(_swapped(ours, _flax_attention), X, ctx, n),
                             atol=1e-5, rtol=1e-5)


def test_attention_dropout(mha):
  ref = plain(mha, X)
  drop = jit(lambda m, x: m(x, deterministic=False))
  a, b = drop(mha, X), drop(mha, X)
  assert not np.allclose(a, ref) and not np.allclose(a, b)  # a fresh key per call
  with pytest.raises(ValueError, match="deterministic"):
    mha(X)


def test_bad_configurations_raise(mha):
  with pytest.raises(ValueError, match="num_heads"):
    MultiHeadAttention(num_heads=5, in_features=24, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="num_kv_heads"):
    MultiHeadAttention(num_heads=4, num_kv_heads=3, in_features=24, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="num_kv_heads"):
    TransformerBlock(features=24, num_heads=6, num_kv_heads=4, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="head_dim"):
    MultiHeadAttention(num_heads=4, in_features=12, rotary=True, rngs=nnx.Rngs(0))  # head_dim 3
  with pytest.raises(ValueError, match="mlp|activation"):
    TransformerBlock(features=24, num_heads=4, mlp="relu", rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="top_k"):
    sample_logits(jnp.zeros((2, 7)), jax.random.key(0), temperature=1.0, top_k=8)
  # Cache overflow (concrete lengths are checked eagerly).
  cache = mha.init_cache(2, 8)
  with pytest.raises(ValueError, match="max_len"):
    mha.prefill(jnp.ones((2, 9, 24)), cache, jnp.array([9, 4]))
  with pytest.raises(ValueError, match="max_len"):
    mha.decode_step(jnp.ones((2, 3, 24)), cache.replace(lengths=jnp.array([6, 4])))
  lm = numpy_init(lambda: TransformerLM(vocab_size=7, features=8, num_layers=1, num_heads=2, rngs=nnx.Rngs(0)))
  with pytest.raises(ValueError, match="top_k"):
    generate(lm, jnp.ones((1, 3), jnp.int32), jnp.array([3]), max_new_tokens=2, temperature=1.0, top_k=9)
  with pytest.raises(ValueError, match="max_len"):
    generate(lm, jnp.ones((1, 3), jnp.int32), jnp.array([3]), max_new_tokens=4, max_len=5)
  with pytest.raises(ValueError, match="max_len"):
    lm.decode_step(jnp.ones((1, 3), jnp.int32), KVCache.init(1, 2, kv_heads=2, head_dim=4, num_layers=1))


def test_cache_write_in_place_under_jit(mha):
  """Each step's write is a scatter into the donated buffer: the jitted step's output aliases
  its input cache (no copy of the cache per step)."""
  graphdef, state = nnx.split(mha)
  cache = mha.init_cache(2, 64).replace(lengths=jnp.array([5, 3]))

  @functools.partial(jax.jit, donate_argnums=(1,))
  def step(state, cache, x):
    return nnx.merge(graphdef, state).decode_step(x, cache)

  text = step.lower(state, cache, jnp.ones((2, 1, 24))).compile().as_text()
  assert "input_output_alias" in text, "the donated cache is not aliased to the output"
  assert "scatter" in text
  ptr = cache.k.unsafe_buffer_pointer()
  _, new = step(state, cache, jnp.ones((2, 1, 24)))
  assert new.lengths.tolist() == [6, 4]
  assert new.k.unsafe_buffer_pointer() == ptr
