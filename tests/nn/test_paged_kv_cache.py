"""PagedKVCache (probjax/nn/layers/kv_cache.py) in place of KVCache: MultiHeadAttention and
TransformerLM decoding give the contiguous cache's values (GQA, odd and ragged lengths, pages
in shuffled order, several tokens per step), NaN in unused pages never reaches them, and greedy
decoding emits the same tokens."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from probjax.core.tolerances import max_error, tolerance
from probjax.nn.layers import kv_cache as kvc
from probjax.nn.layers.attention import dot_product_attention
from probjax.nn.layers.decoding import decode_loop
from probjax.nn.layers.kv_cache import PagedKVCache
from probjax.nn.layers.multi_head_attention import MultiHeadAttention
from probjax.nn.layers.transformer import TransformerLM
from probjax.testing import numpy_init

LENGTHS = np.array([5, 2, 7])   # ragged prompt lengths (right-padded to P)
P, V = 7, 13
XLA = functools.partial(dot_product_attention, implementation="xla")


def _shuffled_table(seed, batch, pages_per_seq, num_pages):
  order = np.random.default_rng(seed).permutation(num_pages)
  return jnp.asarray(order[:batch * pages_per_seq].reshape(batch, pages_per_seq), jnp.int32)


def _poison_unused(cache: PagedKVCache) -> PagedKVCache:
  """NaN in every page the table does not name (a pool shared with other requests)."""
  unused = np.setdiff1d(np.arange(cache.num_pages), np.asarray(cache.page_table))
  nan = lambda pool: pool.at[unused].set(jnp.nan)
  per = lambda pools: tuple(map(nan, pools)) if isinstance(pools, tuple) else nan(pools)
  return cache.replace(k_pages=per(cache.k_pages), v_pages=per(cache.v_pages))


def test_init_allocates_contiguous_pages_or_checks_the_given_table():
  c = PagedKVCache.init(3, page_size=4, pages_per_seq=2, kv_heads=2, head_dim=8)
  assert c.page_table.tolist() == [[0, 1], [2, 3], [4, 5]] and c.k_pages.shape == (6, 4, 2, 8)
  c = PagedKVCache.init(2, page_size=4, kv_heads=1, head_dim=8, page_table=jnp.array([[5, 0], [2, 7]]))
  assert c.num_pages == 8 and c.max_len == 8 and c.page_table.dtype == jnp.int32
  with pytest.raises(ValueError, match=r"page_table entries .*\[0, 6\)"):
    PagedKVCache.init(2, page_size=4, kv_heads=1, head_dim=8, num_pages=6, page_table=jnp.array([[5, 0], [2, 7]]))
  with pytest.raises(ValueError, match=r"page_table names pages \[2\] more than once"):
    PagedKVCache.init(2, page_size=4, kv_heads=1, head_dim=8, page_table=jnp.array([[2, 0], [2, 1]]))
  with pytest.raises(TypeError):
    PagedKVCache(c.k_pages, c.v_pages, c.page_table, c.lengths)   # keyword-only
  with pytest.raises(ValueError, match="max_len=8"):
    kvc.write(c, jnp.ones((2, 9, 1, 8)), jnp.ones((2, 9, 1, 8)))


def test_traced_writes_past_the_pages_are_dropped():
  c = PagedKVCache.init(2, page_size=4, pages_per_seq=2, kv_heads=1, head_dim=2, num_pages=5)
  c = c.replace(lengths=jnp.array([6, 7], jnp.int32))
  out = jax.jit(lambda c, x: kvc.write(c, x, x))(c, jnp.ones((2, 3, 1, 2)))  # 6..8 and 7..9 of 8
  k = np.asarray(out.k_pages)
  assert k[1, 2:].all() and k[1, :2].sum() == 0 and k[3, 3].all() and k[3, :3].sum() == 0
  assert k[4].sum() == 0 and k[0].sum() == 0 and k[2].sum() == 0    # nothing clamped elsewhere


@pytest.mark.parametrize("page_size", [4, 16])
def test_multi_head_attention_paged_equals_contiguous(page_size):
  """GQA layer, ragged odd prompts, shuffled pages with NaN in the unused ones: prefill, then
  one token, then three tokens in one step (per-element causal offsets), then one more."""
  mha = numpy_init(lambda: MultiHeadAttention(num_heads=4, in_features=16, num_kv_heads=2, head_dim=8,
                                              is_causal=True, rotary=True, attention_fn=XLA, rngs=nnx.Rngs(0)))
  rng = np.random.default_rng(0)
  xs = [jnp.asarray(rng.standard_normal((3, n, 16)), jnp.float32) for n in (P, 1, 3, 1)]
  pages_per_seq = -(-16 // page_size)
  table = _shuffled_table(1, 3, pages_per_seq, 3 * pages_per_seq + 3)
  paged = _poison_unused(mha.init_paged_cache(3, page_size=page_size, page_table=table,
                                              num_pages=3 * pages_per_seq + 3))
  contiguous = mha.init_cache(3, pages_per_seq * page_size)
  lengths = jnp.asarray(LENGTHS)
  y_p, paged = mha.prefill(xs[0], paged, lengths)
  y_c, contiguous = mha.prefill(xs[0], contiguous, lengths)
  for x in xs[1:]:
    y_p, paged = mha.decode_step(x, paged)
    y_c, contiguous = mha.decode_step(x, contiguous)
    assert np.all(np.isfinite(np.asarray(y_p)))
    assert max_error(y_p, y_c) <= tolerance(jnp.float32)
  assert paged.lengths.tolist() == (LENGTHS + 5).tolist()


def test_paged_decode_through_the_triton_kernel_equals_contiguous():
  """The decode kernel reading the pages in place (Pallas interpret mode): pages of 16."""
  attn = functools.partial(dot_product_attention, implementation="triton", interpret=True)
  mha = numpy_init(lambda: MultiHeadAttention(num_heads=4, in_features=16, num_kv_heads=2, head_dim=16,
                                              is_causal=True, attention_fn=attn, rngs=nnx.Rngs(1)))
  ref = numpy_init(lambda: MultiHeadAttention(num_heads=4, in_features=16, num_kv_heads=2, head_dim=16,
                                              is_causal=True, attention_fn=XLA, rngs=nnx.Rngs(1)))
  x = jnp.asarray(np.random.default_rng(2).standard_normal((3, P, 16)), jnp.float32)
  x1 = jnp.asarray(np.random.default_rng(3).standard_normal((3, 1, 16)), jnp.float32)
  table = _shuffled_table(4, 3, 2, 8)
  paged = _poison_unused(mha.init_paged_cache(3, page_size=16, page_table=table, num_pages=8))
  _, paged = mha.prefill(x, paged, jnp.asarray(LENGTHS))
  _, contiguous = ref.prefill(x, ref.init_cache(3, 32), jnp.asarray(LENGTHS))
  y_p, _ = jax.jit(lambda x, c: mha.decode_step(x, c))(x1, paged)
  y_c, _ = ref.decode_step(x1, contiguous)
  assert max_error(y_p, y_c) <= tolerance(jnp.float32)


@pytest.fixture(scope="module")
def lm():
  return numpy_init(lambda: TransformerLM(
      vocab_size=V, features=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
      qk_norm=True, rotary=True, tie_embeddings=False, attention_fn=XLA, rngs=nnx.Rngs(0)))


def test_transformer_lm_greedy_decode_paged_equals_contiguous(lm):
  rng = np.random.default_rng(0)
  prompts = np.zeros((3, P), np.int32)
  for b, n in enumerate(LENGTHS):
    prompts[b, :n] = rng.integers(0, V, n)
  prompts, lengths = jnp.asarray(prompts), jnp.asarray(LENGTHS)
  prefill = nnx.jit(lambda m, t, n, c: m.prefill(t, n, c))
  run = nnx.jit(lambda m, c, t: decode_loop(m, c, t, jax.random.key(0), num_steps=6))
  table = _shuffled_table(5, 3, 4, 14)
  caches = {"contiguous": lm.init_cache(3, 16),
            "paged": _poison_unused(lm.init_paged_cache(3, page_size=4, page_table=table, num_pages=14))}
  tokens, logits = {}, {}
  for name, cache in caches.items():
    out, cache = prefill(lm, prompts, lengths, cache)
    logits[name] = out[jnp.arange(3), lengths - 1]
    first = jnp.argmax(logits[name], -1).astype(jnp.int32)
    toks, _, cache, _ = run(lm, cache, first)
    tokens[name] = np.asarray(toks)
    assert cache.lengths.tolist() == (LENGTHS + 6).tolist()
  assert max_error(logits["paged"], logits["contiguous"]) <= tolerance(jnp.float32)
  np.testing.assert_array_equal(tokens["paged"], tokens["contiguous"])


def test_transformer_refuses_a_paged_cache_without_per_layer_pools(lm):
  one = PagedKVCache.init(3, page_size=4, pages_per_seq=4, kv_heads=2, head_dim=8)
  with pytest.raises(ValueError, match="num_layers=2"):
    lm.prefill(jnp.zeros((3, P), jnp.int32), jnp.asarray(LENGTHS), one)
