"""probjax's dot_product_attention as a drop-in ``attention_fn`` for Flax NNX, and its
jax.nn-style arguments, each checked against ``flax.nnx.dot_product_attention`` or
``jax.nn.dot_product_attention(implementation="xla")`` (or the float64 reference)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from probjax.core.tolerances import max_error, tolerance
from probjax.core.device import Device
from probjax.nn.layers.attention import (CausalMask, KVLenMask, Mask, MaskWithDense, dot_product_attention,
                                         explain_dispatch, flex_attention)
from probjax.ops.attention.reference import reference_attention

TOL = tolerance(jnp.float32)
H200 = Device("gpu", (9, 0), 140 << 30)


def _qkv(shape_q, shape_kv, seed=0, dtype=jnp.float32):
  kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
  return (jax.random.normal(kq, shape_q, dtype), jax.random.normal(kk, shape_kv, dtype),
          jax.random.normal(kv, shape_kv, dtype))


def _close(got, want, tol=TOL):
  assert got.shape == want.shape, (got.shape, want.shape)
  assert max_error(got, want) <= tol, max_error(got, want)


def _mha(attention_fn, decode=False):
  return nnx.MultiHeadAttention(num_heads=2, in_features=8, qkv_features=16, decode=decode,
                                attention_fn=attention_fn, rngs=nnx.Rngs(0))


# -- 1. Flax MultiHeadAttention(decode=True) --------------------------------------------------
def test_flax_decode_with_structured_mask_says_what_to_do():
  layer = _mha(dot_product_attention, decode=True)
  layer.init_cache((2, 6, 8))
  with pytest.raises(AttributeError, match=r"decode=True.*mask=None.*KVCache"):
    layer(jnp.ones((2, 1, 8)), mask=CausalMask())
  with pytest.raises(AttributeError, match="decode=True"):
    layer(jnp.ones((2, 1, 8)), mask=CausalMask() & jnp.ones((2, 1, 1, 6), bool))
  # An AttributeError (not another type) keeps hasattr() duck-typing checks working.
  assert not hasattr(CausalMask(), "ndim")


def test_flax_decode_with_flax_mask_matches_flax():
  ours, theirs = _mha(dot_product_attention, decode=True), _mha(nnx.dot_product_attention, decode=True)
  for m in (ours, theirs):
    m.init_cache((2, 6, 8))
  x = jax.random.normal(jax.random.key(1), (2, 6, 8))
  for t in range(4):  # Flax masks the cache's unwritten tail with a dense [batch, 1, 1, 6] mask
    _close(ours(x[:, t:t + 1]), theirs(x[:, t:t + 1]))


def test_flax_self_attention_with_structured_mask_and_input_positions():
  x = jax.random.normal(jax.random.key(2), (2, 7, 8))
  ours, theirs = _mha(dot_product_attention), _mha(nnx.dot_product_attention)
  want = theirs(x, mask=nnx.make_causal_mask(jnp.ones((2, 7))))
  _close(ours(x, mask=CausalMask()), want)
  _close(ours(x, is_causal=True), want)
  # Flax forwards input_positions to attention_fn; they are accepted and do not change the result.
  _close(ours(x, mask=CausalMask(), input_positions=jnp.broadcast_to(jnp.arange(7), (2, 7))), want)


# -- 2. CausalMask() & dense -------------------------------------------------------------------
@pytest.mark.parametrize("order", ["mask_first", "dense_first", "numpy"])
def test_structured_and_dense_mask(order):
  q, k, v = _qkv((2, 9, 4, 16), (2, 9, 2, 16))
  dense = jax.random.bernoulli(jax.random.key(3), 0.7, (2, 1, 9, 9)) | jnp.eye(9, dtype=bool)
  combined = {"mask_first": lambda: CausalMask() & dense, "dense_first": lambda: dense & CausalMask(),
              "numpy": lambda: np.asarray(dense) & CausalMask()}[order]()
  assert isinstance(combined, MaskWithDense)
  want = jax.nn.dot_product_attention(q, k, v, mask=dense, is_causal=True, implementation="xla")
  _close(dot_product_attention(q, k, v, mask=combined), want)
  _close(jax.jit(lambda m: dot_product_attention(q, k, v, mask=m))(combined), want)
  with pytest.raises(TypeError, match="dot_product_attention"):
    flex_attention(q, k, v, mask=combined)


# -- 4. dtype promotion ------------------------------------------------------------------------
def test_mixed_dtypes_promote_like_flax():
  q, k, v = _qkv((2, 5, 2, 8), (2, 6, 2, 8))
  qb = q.astype(jnp.bfloat16)
  want = nnx.dot_product_attention(qb, k, v)
  got = dot_product_attention(qb, k, v)
  assert got.dtype == want.dtype == jnp.float32
  _close(got, want)
  got = dot_product_attention(qb, k, v, dtype=jnp.bfloat16)
  assert got.dtype == nnx.dot_product_attention(qb, k, v, dtype=jnp.bfloat16).dtype == jnp.bfloat16


# -- 5. batch axes -----------------------------------------------------------------------------
@pytest.mark.slow  # six batch layouts, each a forward of its own (about 10 s of CPU)
def test_several_and_no_batch_axes():
  q, k, v = _qkv((2, 3, 5, 4, 8), (2, 3, 6, 2, 8))
  mask = jax.random.bernoulli(jax.random.key(4), 0.8, (2, 1, 1, 5, 6)) | (jnp.arange(6) == 0)
  bias = jax.random.normal(jax.random.key(5), (1, 3, 4, 5, 6))
  full = lambda x: jnp.broadcast_to(x, (2, 3) + x.shape[2:])  # Flax wants every batch axis
  want = nnx.dot_product_attention(q, k, v, bias=full(bias), mask=full(mask))
  _close(dot_product_attention(q, k, v, bias=bias, mask=mask), want)
  # A Mask's arrays and the jax.nn lengths take the batch axes too.
  lengths = jnp.array([[6, 3, 1], [2, 5, 4]], jnp.int32)
  want = nnx.dot_product_attention(q, k, v, mask=full(jnp.arange(6) < lengths[..., None, None, None]))
  _close(dot_product_attention(q, k, v, mask=Mask(kv_lengths=lengths)), want)
  _close(dot_product_attention(q, k, v, key_value_seq_lengths=lengths), want)
  # No batch axis: [seq, heads, head_dim], as jax.nn and Flax take it.
  q, k, v = q[0, 0], k[0, 0], v[0, 0]
  _close(dot_product_attention(q, k, v, is_causal=True),
         jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla"))
  with pytest.raises(ValueError, match="batch axes"):
    dot_product_attention(q[None], k, v)


# -- 6. dense mask ranks -----------------------------------------------------------------------
def test_dense_mask_ranks():
  q, k, v = _qkv((2, 5, 2, 8), (2, 6, 2, 8))
  m4 = jax.random.bernoulli(jax.random.key(6), 0.7, (2, 1, 5, 6)) | (jnp.arange(6) == 0)
  _close(dot_product_attention(q, k, v, mask=m4), jax.nn.dot_product_attention(q, k, v, mask=m4, implementation="xla"))
  # [q, kv] and [1, q, kv] are unambiguous; [n, q, kv] with n > 1 could mean batch or heads.
  m2 = m4[0, 0]
  _close(dot_product_attention(q, k, v, mask=m2), jax.nn.dot_product_attention(q, k, v, mask=m2[None, None], implementation="xla"))
  _close(dot_product_attention(q, k, v, mask=m2[None]), dot_product_attention(q, k, v, mask=m2))
  with pytest.raises(ValueError, match=r"ambiguous.*mask\[:, None\]"):
    dot_product_attention(q, k, v, mask=m4[:, 0])
  with pytest.raises(ValueError, match=r"ambiguous.*bias\[:, None\]"):
    dot_product_attention(q, k, v, bias=jnp.zeros((2, 5, 6)))


# -- 7. jax.nn-style arguments -----------------------------------------------------------------
# Two forwards a case (ours and jax.nn's): make test keeps a symmetric window without and an
# asymmetric one with is_causal; the other four are slow.
@pytest.mark.parametrize("causal,window", [
    (c, w) if (c, w) in ((False, 2), (True, (3, 1))) else pytest.param(c, w, marks=pytest.mark.slow)
    for c in (False, True) for w in (2, (3, 1), (0, 2))],
    ids=[f"{c}-{w}" for c in (False, True) for w in ("2", "window1", "window2")])
def test_local_window_size_matches_jax_nn(window, causal):
  q, k, v = _qkv((2, 11, 4, 16), (2, 11, 2, 16))
  want = jax.nn.dot_product_attention(q, k, v, local_window_size=window, is_causal=causal, implementation="xla")
  _close(dot_product_attention(q, k, v, local_window_size=window, is_causal=causal), want)


def test_seq_lengths_match_jax_nn():
  q, k, v = _qkv((3, 7, 4, 16), (3, 9, 2, 16))
  ql, kl = jnp.array([7, 3, 1], jnp.int32), jnp.array([9, 4, 2], jnp.int32)
  want = jax.nn.dot_product_attention(q, k, v, query_seq_lengths=ql, key_value_seq_lengths=kl,
                                      implementation="xla")
  _close(dot_product_attention(q, k, v, query_seq_lengths=ql, key_value_seq_lengths=kl), want)
  _close(dot_product_attention(q, k, v, mask=CausalMask(), key_value_seq_lengths=kl),
         jax.nn.dot_product_attention(q, k, v, is_causal=True, key_value_seq_lengths=kl, implementation="xla"))
  with pytest.raises(TypeError, match="key_value_seq_lengths"):
    dot_product_attention(q, k, v, key_value_seq_lengths=kl.astype(jnp.float32))
  with pytest.raises(TypeError, match="local_window_size"):
    dot_product_attention(q, k, v, local_window_size=(1, 2, 3))


def test_logits_soft_cap():
  q, k, v = _qkv((2, 6, 2, 8), (2, 7, 2, 8))
  q = 4 * q
  cap = 2.5
  want = reference_attention(q, k, v, mask=CausalMask(), score_mod=lambda s, *_: cap * jnp.tanh(s / cap))
  _close(dot_product_attention(q, k, v, is_causal=True, logits_soft_cap=cap), want)
  alibi = lambda s, b, h, i, j: s - 0.5 * jnp.abs(i - j)
  want = reference_attention(q, k, v, score_mod=lambda s, *ix: cap * jnp.tanh(alibi(s, *ix) / cap))
  _close(dot_product_attention(q, k, v, score_mod=alibi, logits_soft_cap=cap), want)
  with pytest.raises(ValueError, match="logits_soft_cap"):
    dot_product_attention(q, k, v, logits_soft_cap=0.0)


@pytest.mark.parametrize("kw", [dict(), dict(is_causal=True), dict(key_value_seq_lengths=jnp.array([7, 3], jnp.int32))])
def test_return_lse_matches_jax_nn_residual(kw):
  q, k, v = _qkv((2, 6, 4, 8), (2, 7, 2, 8))
  bias = jax.random.normal(jax.random.key(7), (1, 4, 6, 7))
  want_out, want_lse = jax.nn.dot_product_attention(q, k, v, bias, return_residual=True, implementation="xla", **kw)
  out, lse = dot_product_attention(q, k, v, bias=bias, return_lse=True, **kw)
  assert lse.shape == (2, 6, 4)
  _close(out, want_out)
  _close(lse, want_lse)
  q5 = q.reshape(1, 2, 6, 4, 8)
  _, lse5 = dot_product_attention(q5, k[None], v[None], return_lse=True, **kw)
  assert lse5.shape == (1, 2, 6, 4)
  with pytest.raises(ValueError, match="return_lse"):
    dot_product_attention(q, k, v, return_lse=True, implementation="triton")


def test_return_lse_is_minus_inf_without_keys():
  q, k, v = _qkv((2, 3, 2, 8), (2, 5, 2, 8))
  out, lse = dot_product_attention(q, k, v, mask=KVLenMask(jnp.array([0, 5])), return_lse=True)
  assert np.all(np.asarray(lse[0]) == -np.inf) and np.all(np.isfinite(np.asarray(lse[1])))
  assert np.all(np.asarray(out[0]) == 0)


def test_traced_scale_under_jit_matches_jax_nn():
  q, k, v = _qkv((2, 6, 4, 8), (2, 7, 2, 8))
  f = jax.jit(lambda s: dot_product_attention(q, k, v, scale=s, is_causal=True))
  g = jax.jit(lambda s: jax.nn.dot_product_attention(q, k, v, scale=s, is_causal=True, implementation="xla"))
  _close(f(jnp.float32(0.2)), g(jnp.float32(0.2)))
  _close(jax.grad(lambda s: f(s).sum())(0.2), jax.grad(lambda s: g(s).sum())(0.2), tolerance(jnp.float32, grad=True))


# -- 8. dispatch explains dense masks ----------------------------------------------------------
def test_explain_dispatch_names_the_structured_mask():
  shape = (2, 512, 8, 64)
  d = explain_dispatch(shape, shape, jnp.bfloat16, dense_mask=jnp.tril(jnp.ones((512, 512), bool)), device=H200)
  assert d.implementation == "xla"
  assert "dense boolean mask" in d.rule and "CausalMask(0)" in d.rule
  d = explain_dispatch(shape, shape, jnp.bfloat16, dense_mask=True, device=H200)
  assert "CausalMask or LocalWindowMask" in d.rule
  d = explain_dispatch(shape, shape, jnp.bfloat16, mask=CausalMask(), device=H200)
  assert d.implementation != "xla"
  lengths = KVLenMask(jnp.array([100, 512])).dense(2, 512, 512)
  d = explain_dispatch(shape, shape, jnp.bfloat16, dense_mask=lengths, device=H200)
  assert "KVLenMask(jnp.array([100, 512]))" in d.rule


def test_attention_fn_signature_covers_flax_keywords():
  # Every keyword flax.nnx.MultiHeadAttention passes to attention_fn.
  import inspect
  from flax.nnx.nn import attention as flax_attention
  src = inspect.getsource(flax_attention.MultiHeadAttention.__call__)
  passed = {"mask", "dropout_rng", "dropout_rate", "broadcast_dropout", "deterministic", "dtype",
            "precision", "module", "is_causal", "input_positions"}
  assert all(f"{name}" in src for name in passed)
  params = inspect.signature(dot_product_attention).parameters
  assert passed <= set(params)
  assert functools.partial(dot_product_attention, implementation="xla")  # partials work as attention_fn


def test_rope_recipe_of_docs_matches_flax():
  rope = nnx.RoPE()

  def attention_with_rope(query, key, value, *, rope, input_positions=None, **kw):  # docs/flax.md
    apply = jax.vmap(rope, in_axes=(-2, None), out_axes=-2)
    return dot_product_attention(apply(query, input_positions), apply(key, input_positions), value, **kw)

  q, k, v = _qkv((2, 6, 2, 8), (2, 6, 2, 8))
  # Flax 0.12.10's own wrapper fails on explicit input_positions (its vmap's out_axes), so the
  # comparison is at its default positions; the recipe with [seq] positions is RoPE's.
  want = nnx.dot_product_attention_with_rope(q, k, v, rope=rope, is_causal=True)
  _close(attention_with_rope(q, k, v, rope=rope, is_causal=True), want)
  _close(attention_with_rope(q, k, v, rope=rope, input_positions=jnp.arange(6.0), is_causal=True), want)
