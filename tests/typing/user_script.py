"""A user's script that must type-check cleanly (mypy; tests/test_typing.py, .ci/typecheck.sh).

The README's quick start through the top-level names (``import probjax``) and the lazy
``probjax.nn`` / ``probjax.nn.layers`` packages, with ``assert_type`` on what a type checker
sees: a real type, not ``Any`` (``assert_type`` of an ``Any`` expression is an error). The body
is in functions, so that importing the file (pytest's doctest collection) runs nothing.
"""

from typing import assert_type

import jax
import jax.numpy as jnp
from flax import nnx

import probjax
import probjax.nn.layers
from probjax.masks import Mask
from probjax.nn import TransformerLM
from probjax.nn.layers import MultiHeadAttention, MoELayer
from probjax.ops.attention import Decision


def quick_start() -> None:
  kq, kk, kv = jax.random.split(jax.random.key(0), 3)
  q = jax.random.normal(kq, (2, 600, 8, 64))   # [batch, seq, heads, head_dim]
  k = jax.random.normal(kk, (2, 600, 2, 64))
  v = jax.random.normal(kv, (2, 600, 2, 64))

  causal = probjax.CausalMask()
  assert_type(causal, Mask)
  mask = causal & probjax.KVLenMask(jnp.array([600, 450]))
  out = probjax.dot_product_attention(q, k, v, mask=causal)
  grads = jax.grad(lambda q: probjax.dot_product_attention(q, k, v, mask=mask).sum())(q)
  out_xla = probjax.dot_product_attention(q, k, v, mask=probjax.CausalMask(), implementation="xla")
  del out, grads, out_xla
  decision = probjax.explain_dispatch(q.shape, k.shape, q.dtype)
  assert_type(decision, Decision)
  assert_type(decision.implementation, str)

  mha = nnx.MultiHeadAttention(num_heads=8, in_features=512, decode=False,
                               attention_fn=probjax.dot_product_attention, rngs=nnx.Rngs(0))
  y = mha(jnp.ones((2, 128, 512)))
  del y


def layers() -> None:
  rngs = nnx.Rngs(0)
  lm = probjax.nn.TransformerLM(vocab_size=256, features=64, num_layers=2, num_heads=4, rngs=rngs)
  assert_type(lm, TransformerLM)
  assert_type(probjax.nn.layers.TransformerLM, type[TransformerLM])
  attn = MultiHeadAttention
  assert_type(attn, type[MultiHeadAttention])
  assert_type(probjax.nn.MoELayer, type[MoELayer])
