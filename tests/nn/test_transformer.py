"""Transformer stack: float64 gradient checks of every parameter, and the example's training."""

from __future__ import annotations

import functools
import importlib.util
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.flatten_util import ravel_pytree
from jax.test_util import check_grads

from probjax.nn.layers.attention import dot_product_attention
from probjax.nn.layers.transformer import Transformer, TransformerLM
from probjax.ops.attention.masks import KVLenMask, SegmentMask
from probjax.testing import numpy_init

XLA = functools.partial(dot_product_attention, implementation="xla")
REMAT = True  # (a module constant for quick experiments)
ROOT = pathlib.Path(__file__).resolve().parents[2]




def _check_every_leaf(loss, tree, seed=0):
  """``check_grads`` (reverse mode) of ``(t, d) -> loss(tree + t * d)`` at ``t = 0`` for a random
  direction ``d`` supported on one leaf at a time, so that every leaf's gradient is checked.

  ``d`` is one flat vector (``ravel_pytree``), and ``jax.value_and_grad(loss)`` is compiled once
  and serves both the values that the finite differences take and the reverse-mode gradient
  that ``check_grads`` compares with them (a ``custom_vjp`` hands it over): few compilations.
  The derivative in ``d`` is zero at ``t = 0``."""
  flat, unravel = ravel_pytree(tree)
  vg = jax.jit(jax.value_and_grad(lambda t, d: loss(unravel(flat + t * d)), argnums=(0, 1)))

  @jax.custom_vjp
  def f(t, d):
    return vg(t, d)[0]

  f.defvjp(lambda t, d: vg(t, d), lambda grads, ct: (ct * grads[0], ct * grads[1]))
  rng = np.random.default_rng(seed)
  sizes = [x.size for x in jax.tree.leaves(tree)]
  offsets = np.cumsum([0] + sizes)
  for i in range(len(sizes)):
    d = np.zeros(flat.shape, flat.dtype)
    d[offsets[i]:offsets[i + 1]] = rng.standard_normal(sizes[i])
    check_grads(f, (jnp.float64(0.0), jnp.asarray(d)), order=1, modes=("rev",), eps=1e-5)
  return len(sizes)


@pytest.mark.slow  # float64 gradients of a cross-attention/FiLM/remat model against finite differences
def test_gradients_float64_cross_attention_film_remat():
  with jax.enable_x64(True):
    model = numpy_init(lambda: Transformer(
        num_layers=2, features=8, num_heads=2, num_kv_heads=1, head_dim=4, mlp="gelu",
        norm="layernorm", rotary=True, qk_norm=True, is_causal=True, context_features=6,
        film_features=3, remat=REMAT, use_bias=True, attention_fn=XLA, param_dtype=jnp.float64,
        rngs=nnx.Rngs(0)))  # random parameters: FiLM's zero init would be the identity
    graphdef, params = nnx.split(model)
    rng = np.random.default_rng(1)
    inputs = dict(x=rng.standard_normal((2, 5, 8)), context=rng.standard_normal((2, 4, 6)),
                  film=rng.standard_normal((2, 3)))
    inputs = jax.tree.map(jnp.asarray, inputs)
    w = jnp.asarray(rng.standard_normal((2, 5, 8)))
    ctx_len = jnp.array([4, 2])

    def loss(tree):
      p, a = tree
      y = nnx.merge(graphdef, p)(a["x"], context=a["context"], context_mask=KVLenMask(ctx_len),
                                 film=a["film"], deterministic=True)
      return jnp.sum(jnp.sin(y) * w)

    n = _check_every_leaf(loss, (params, inputs))
    assert n >= 25


def test_gradients_float64_lm_packed():
  with jax.enable_x64(True):
    lm = numpy_init(lambda: TransformerLM(
        vocab_size=9, features=8, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=4,
        qk_norm=True, tie_embeddings=False, attention_fn=XLA, param_dtype=jnp.float64,
        rngs=nnx.Rngs(0)))
    graphdef, params = nnx.split(lm)
    tokens = jnp.array([[1, 2, 3, 4, 5, 6], [7, 8, 1, 2, 3, 4]])
    seg = jnp.array([[1, 1, 1, 2, 2, 2], [1, 1, 1, 1, 1, 1]])
    pos = jnp.array([[0, 1, 2, 0, 1, 2], [0, 1, 2, 3, 4, 5]])

    def loss(p):
      logits = nnx.merge(graphdef, p)(tokens, positions=pos, mask=SegmentMask(seg))
      return jnp.mean(jax.nn.log_softmax(logits)[..., 0] * jnp.arange(6.0))

    assert _check_every_leaf(loss, params) == 11


@pytest.mark.slow  # trains the example model, then generates
def test_example_training_lowers_loss_and_generates(capsys):
  spec = importlib.util.spec_from_file_location("train_lm", ROOT / "examples" / "lm" / "train_lm.py")
  train_lm = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(train_lm)
  out = train_lm.main(["--tiny", "--steps", "30", "--samples", "3"])
  losses = np.asarray(out["losses"])
  assert len(losses) == 30 and np.isfinite(losses).all()
  assert losses[-5:].mean() < 0.75 * losses[:5].mean(), losses
  assert len(out["greedy"]) == 3 and len(out["sampled"]) == 3
  printed = capsys.readouterr().out
  assert "greedy" in printed and "loss" in printed


def _pair(**kw):
  """The same stack (same parameters) under ``nnx.scan`` and unrolled."""
  make = lambda scan: Transformer(num_layers=3, features=8, num_heads=2, head_dim=4, attention_fn=XLA,
                                  scan_layers=scan, rngs=nnx.Rngs(0), **kw)
  return make(True), make(False)


@pytest.mark.parametrize("kw", [dict(), dict(remat=True, is_causal=True),
                                dict(ffn="moe", ffn_kwargs={"num_experts": 4, "top_k": 2})])
def test_unrolled_stack_equals_the_scan_values_gradients_and_aux(kw):
  scanned, unrolled = _pair(**kw)
  x = jax.random.normal(jax.random.key(1), (2, 5, 8))
  w = jax.random.normal(jax.random.key(2), (2, 5, 8))

  def run(model):
    def loss(m, x):
      y, aux = m(x, return_aux=True)
      return jnp.sum(jnp.sin(y) * w), aux
    (value, aux), (gm, gx) = nnx.jit(nnx.value_and_grad(loss, argnums=(0, 1), has_aux=True))(model, x)
    return value, aux, nnx.state(gm, nnx.Param), gx

  (v1, a1, g1, x1), (v2, a2, g2, x2) = run(scanned), run(unrolled)
  np.testing.assert_allclose(v2, v1, rtol=1e-5)
  np.testing.assert_allclose(x2, x1, rtol=1e-4, atol=1e-6)
  assert jax.tree.structure(g2) == jax.tree.structure(g1) and jax.tree.structure(a2) == jax.tree.structure(a1)
  for a, b in zip(jax.tree.leaves(g2) + jax.tree.leaves(a2), jax.tree.leaves(g1) + jax.tree.leaves(a1)):
    assert a.shape == b.shape  # the unrolled stack's gradients and aux keep the leading layer axis
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def test_unrolled_stack_draws_dropout_like_the_scan_and_advances_it():
  scanned, unrolled = _pair(dropout_rate=0.5)
  x = jax.random.normal(jax.random.key(1), (2, 5, 8))
  first = [m(x, deterministic=False) for m in (scanned, unrolled)]
  np.testing.assert_allclose(first[1], first[0], rtol=1e-5, atol=1e-6)
  counts = lambda m: jax.tree.leaves(nnx.state(m.blocks, nnx.RngCount))
  for a, b in zip(counts(unrolled), counts(scanned)):
    np.testing.assert_array_equal(a, b)  # the views' counters went back into the stack
  assert not np.allclose(unrolled(x, deterministic=False), first[1])  # a new mask on the next call


def test_scan_layers_must_be_a_bool():
  with pytest.raises(TypeError, match="scan_layers"):
    Transformer(num_layers=2, features=8, num_heads=2, scan_layers="no", rngs=nnx.Rngs(0))
