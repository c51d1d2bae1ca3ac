"""Public API: Flax attention_fn contract, argument errors, explicit implementations."""

import flax.nnx as nnx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from probjax.nn.layers.attention import (CausalMask, KVLenMask, LocalWindowMask, SegmentMask,
                                         available_implementations, dot_product_attention,
                                         flex_attention, mha)
from probjax.ops.attention.reference import reference_attention
from probjax.ops.attention.tolerances import max_error, tolerance
from probjax.testing import make_inputs


def test_flax_multihead_attention_matches_flax_default():
  kw = dict(num_heads=4, in_features=32, qkv_features=32, decode=False)
  ours = nnx.MultiHeadAttention(**kw, rngs=nnx.Rngs(0), attention_fn=dot_product_attention)
  theirs = nnx.MultiHeadAttention(**kw, rngs=nnx.Rngs(0), attention_fn=nnx.dot_product_attention)
  x = jax.random.normal(jax.random.key(1), (2, 300, 32))
  mask = nnx.make_causal_mask(jnp.ones((2, 300)))  # float 1/0 mask, as Flax builds it
  a = ours(x, mask=mask, deterministic=True)
  b = theirs(x, mask=mask, deterministic=True)
  np.testing.assert_allclose(a, b, atol=2e-5, rtol=2e-5)
  # dropout path through Flax's arguments runs and is reproducible
  d1 = ours(x, mask=mask, deterministic=False, rngs=nnx.Rngs(dropout=3))
  assert d1.shape == x.shape and np.all(np.isfinite(np.asarray(d1)))


def test_flax_sow_attention_weights():
  x = make_inputs(0, 1, 20, 20, 2, 2, 8)
  class Holder(nnx.Module):
    pass
  holder = Holder()
  dot_product_attention(x.q, x.k, x.v, module=holder)
  w = holder.attention_weights.get_value()[0]
  assert w.shape == (1, 2, 20, 20)
  np.testing.assert_allclose(np.asarray(w).sum(-1), 1.0, rtol=1e-5)


def test_masks_combine_and_is_causal():
  x = make_inputs(2, 2, 90, 90, 4, 1, 16)
  lens = jnp.array([90, 40])
  a = dot_product_attention(x.q, x.k, x.v, mask=KVLenMask(lens), is_causal=True)
  ref = reference_attention(x.q, x.k, x.v, mask=CausalMask() & KVLenMask(lens))
  assert max_error(a, ref) <= tolerance(jnp.float32)
  b = flex_attention(x.q, x.k, x.v, mask=CausalMask() & KVLenMask(lens))
  np.testing.assert_allclose(a, b, atol=1e-6)


def test_dtype_argument_casts():
  x = make_inputs(3, 1, 16, 16, 2, 2, 8)
  out = dot_product_attention(x.q, x.k, x.v, dtype=jnp.bfloat16)
  assert out.dtype == jnp.bfloat16


def test_available_implementations_on_cpu():
  assert available_implementations() == ["xla"]


@pytest.mark.parametrize("kwargs,exc,pattern", [
    (dict(query=jnp.ones((8, 4, 16))), ValueError, "batch axes"),  # [seq, heads, dim] is batch-free
    (dict(key=jnp.ones((3, 8, 2, 16)), value=jnp.ones((3, 8, 2, 16))), ValueError, "batch"),
    (dict(key=jnp.ones((2, 8, 2, 8)), value=jnp.ones((2, 8, 2, 8))), ValueError, "head_dim"),
    (dict(key=jnp.ones((2, 8, 3, 16)), value=jnp.ones((2, 8, 3, 16))), ValueError, "multiple of key/value heads"),
    (dict(value=jnp.ones((2, 9, 2, 16))), ValueError, "same shape"),
    (dict(query=jnp.ones((2, 8, 4, 16), jnp.complex64)), TypeError, "float32, bfloat16"),  # ints promote
    (dict(key=jnp.ones((2, 8, 2, 16), jnp.bfloat16), value=jnp.ones((2, 8, 2, 16), jnp.bfloat16),
          promote_dtype=lambda a, dtype: a), TypeError, "share a dtype"),  # no hook: promoted as Flax
    (dict(mask=jnp.ones((2, 4, 8, 9), bool)), ValueError, "does not broadcast"),
    (dict(bias=jnp.ones((3, 1, 8, 8))), ValueError, "does not broadcast"),
    (dict(bias=jnp.ones((8, 8), jnp.int32)), TypeError, "floating"),
    (dict(mask=KVLenMask(jnp.array([3, 9]))), ValueError, r"lie in \[0, 8\]"),
    (dict(mask=KVLenMask(jnp.array([3]))), ValueError, "shape"),
    (dict(mask=SegmentMask(jnp.zeros((2, 7), jnp.int32))), ValueError, "q_segment_ids"),
    (dict(implementation="flash"), ValueError, "unknown implementation"),
    (dict(implementation="cudnn"), ValueError, "cannot compute this call exactly"),
    (dict(implementation="triton"), ValueError, "cannot compute this call exactly"),
    (dict(backward_pass_impl="fast"), ValueError, "backward_pass_impl"),
    (dict(dropout_rate=0.1), ValueError, "dropout_rng"),
    (dict(dropout_rate=1.5, dropout_rng=jax.random.key(0)), ValueError, "dropout_rate"),
    (dict(score_mod=3), TypeError, "score_mod"),
])
def test_errors_name_the_argument(kwargs, exc, pattern):
  args = dict(query=jnp.ones((2, 8, 4, 16)), key=jnp.ones((2, 8, 2, 16)), value=jnp.ones((2, 8, 2, 16)))
  args.update(kwargs)
  with pytest.raises(exc, match=pattern):
    dot_product_attention(**args)


def test_mask_constructor_errors():
  with pytest.raises(TypeError, match="offset"):
    CausalMask(offset=1.5)
  with pytest.raises(ValueError, match="left"):
    LocalWindowMask(left=-1)
  with pytest.raises(ValueError, match="at least one"):
    LocalWindowMask(left=None, right=None)
  with pytest.raises(ValueError, match=r"\[batch\]"):
    KVLenMask(jnp.ones((2, 3), jnp.int32))
  with pytest.raises(TypeError, match="integer"):
    KVLenMask(jnp.ones((2,)))
  s = SegmentMask(jnp.zeros((1, 4), jnp.int32))
  with pytest.raises(ValueError, match="two SegmentMasks"):
    s & s


def test_flex_attention_rejects_dense_mask_and_mha_refuses_cpu():
  x = make_inputs(0, 1, 8, 8, 1, 1, 16)
  with pytest.raises(TypeError, match="probjax Mask"):
    flex_attention(x.q, x.k, x.v, mask=jnp.ones((8, 8), bool))
  with pytest.raises(ValueError, match="Triton kernel needs an NVIDIA GPU"):
    mha(x.q, x.k, x.v, causal=True)


def test_configs_without_triton_raise():
  x = make_inputs(0, 1, 8, 8, 1, 1, 16)
  with pytest.raises(ValueError, match="forward_config"):
    flex_attention(x.q, x.k, x.v, forward_config=object(), implementation="xla")


@pytest.mark.slow  # the split-KV Triton kernel in interpret mode through three functions
def test_split_kv_through_the_api():
  from probjax.ops.attention.backends.triton import SplitKVConfig
  x = make_inputs(5, 2, 2, 300, 8, 2, 32)
  mask = KVLenMask(jnp.array([300, 40]))
  cfg = SplitKVConfig(block_k=16, num_splits=4)
  ref = reference_attention(x.q, x.k, x.v, mask=mask)
  for f in (dot_product_attention, flex_attention, mha):
    out = f(x.q, x.k, x.v, mask=mask, split_kv=cfg, interpret=True,
            **({} if f is mha else {"implementation": "triton"}))
    assert max_error(out, ref) <= tolerance(jnp.float32)
  with pytest.raises(ValueError, match="split_kv"):
    dot_product_attention(x.q, x.k, x.v, split_kv=cfg)  # CPU default: the XLA path


def test_jit_and_tracer_lengths():
  x = make_inputs(4, 2, 300, 300, 2, 2, 16)
  f = jax.jit(lambda q, k, v, lens: dot_product_attention(q, k, v, mask=KVLenMask(lens)))
  lens = jnp.array([300, 17])
  ref = reference_attention(x.q, x.k, x.v, mask=KVLenMask(lens))
  assert max_error(f(x.q, x.k, x.v, lens), ref) <= tolerance(jnp.float32)


@pytest.mark.parametrize("flags,mask", [
    (dict(is_causal=True), CausalMask()),
    (dict(local_window_size=(16, 0)), LocalWindowMask(16, 0)),
    (dict(key_value_seq_lengths=jnp.array([5, 9])), KVLenMask(jnp.array([5, 9]))),
    (dict(is_causal=True, key_value_seq_lengths=jnp.array([5, 9])), CausalMask() & KVLenMask(jnp.array([5, 9]))),
])
def test_explain_dispatch_takes_jax_nn_flags(flags, mask):
  from probjax.ops.attention import explain_dispatch
  from probjax.ops.attention.dispatch import Device
  for device in (None, Device("gpu", (9, 0), 140 << 30), Device("gpu", (8, 6), 24 << 30)):
    for dtype, shapes in ((jnp.bfloat16, ((2, 4096, 8, 128), (2, 4096, 8, 128))),
                          (jnp.float32, ((2, 300, 4, 64), (2, 300, 2, 64)))):
      dev = {} if device is None else dict(device=device)
      want = explain_dispatch(*shapes, dtype, mask=mask, **dev)
      assert explain_dispatch(*shapes, dtype, **flags, **dev) == want
      # jax.nn's flags combine with mask=, as dot_product_attention combines them.
      assert (explain_dispatch(*shapes, dtype, mask=CausalMask(), **flags, **dev)
              == explain_dispatch(*shapes, dtype, mask=mask & CausalMask(), **dev))
  assert explain_dispatch((2, 8, 4, 16), (2, 8, 2, 16), jnp.float32, is_causal=True,
                          implementation="xla").implementation == "xla"


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("kw", [dict(), dict(is_causal=True), dict(key_value_seq_lengths=jnp.array([7, 3], jnp.int32)),
                                dict(local_window_size=(2, 1))])
def test_return_residual_is_jax_nn_s(kw, dtype):
  """``return_residual`` as jax.nn spells it: the log-sum-exp, ``[batch, q_len, heads]`` in the
  inputs' dtype, without gradient."""
  x = make_inputs(3, 2, 6, 7, 4, 2, 8, dtype=dtype)
  want_out, want_res = jax.nn.dot_product_attention(x.q, x.k, x.v, return_residual=True, implementation="xla", **kw)
  out, res = dot_product_attention(x.q, x.k, x.v, return_residual=True, **kw)
  assert res.shape == want_res.shape == (2, 6, 4) and res.dtype == want_res.dtype == dtype
  assert max_error(out, want_out) <= tolerance(dtype)
  assert max_error(res, want_res) <= tolerance(dtype)
  _, lse = dot_product_attention(x.q, x.k, x.v, return_lse=True, **kw)
  assert lse.dtype == jnp.float32 and max_error(res, lse.astype(dtype)) == 0
  g = jax.grad(lambda q: dot_product_attention(q, x.k, x.v, return_residual=True, **kw)[1].astype(jnp.float32).sum())
  assert not np.any(np.asarray(g(x.q), np.float32))
  with pytest.raises(ValueError, match="not both"):
    dot_product_attention(x.q, x.k, x.v, return_residual=True, return_lse=True)
  with pytest.raises(ValueError, match="return_residual"):
    dot_product_attention(x.q, x.k, x.v, return_residual=True, implementation="triton")
