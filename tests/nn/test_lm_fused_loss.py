"""TransformerLM.loss (the head inside linear_cross_entropy) equals the unfused loss of the
model's logits, in value and parameter gradients, tied and untied, with its options."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from probjax.core.tolerances import tolerance
from probjax.nn.layers.transformer import TransformerLM
from probjax.ops.linear_cross_entropy.reference import loss_from_logits64


def _lm(tie, dtype=jnp.float32):
  return TransformerLM(vocab_size=61, features=16, num_layers=1, num_heads=2, tie_embeddings=tie, dtype=dtype,
                       rngs=nnx.Rngs(0))


def _unfused(model, tokens, labels, **kw):
  logits = model(tokens).astype(jnp.float32)
  lse = jax.nn.logsumexp(logits, -1)
  valid = labels != -100
  lab = jnp.take_along_axis(logits, jnp.where(valid, labels, 0)[..., None], -1)[..., 0]
  eps, zl = kw.get("label_smoothing", 0.0), kw.get("z_loss", 0.0)
  per = jnp.where(valid, lse - (1 - eps) * lab - eps * jnp.mean(logits, -1) + zl * lse ** 2, 0.0)
  return jnp.sum(per) / jnp.maximum(jnp.sum(valid), 1)


@pytest.mark.parametrize("tie", [True, False])
@pytest.mark.parametrize("kw", [dict(), dict(z_loss=1e-3, label_smoothing=0.1)], ids=["plain", "options"])
def test_loss_and_gradients_equal_the_unfused_head(tie, kw):
  model = _lm(tie)
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, 61, (2, 9)), jnp.int32)
  labels = jnp.concatenate([tokens[:, 1:], jnp.full((2, 1), -100, jnp.int32)], 1)
  graphdef, params = nnx.split(model)
  fused = lambda p: nnx.merge(graphdef, p).loss(tokens, **kw)
  plain = lambda p: _unfused(nnx.merge(graphdef, p), tokens, labels, **kw)
  (a, ga), (b, gb) = jax.value_and_grad(fused)(params), jax.value_and_grad(plain)(params)
  tol = tolerance(jnp.float32, grad=True)
  assert abs(float(a) - float(b)) <= tol * max(1.0, abs(float(b)))
  np.testing.assert_allclose(float(a), loss_from_logits64(model(tokens), labels, **kw), rtol=tol)
  for x, y in zip(jax.tree.leaves(ga), jax.tree.leaves(gb)):
    assert float(jnp.max(jnp.abs(x - y))) <= tol * max(1.0, float(jnp.max(jnp.abs(y))))


@pytest.mark.parametrize("tie", [True, False])
def test_bfloat16_model_equals_the_unfused_head_within_bfloat16_tolerance(tie):
  """A bf16 model: the fused loss and its parameter gradients against the loss of the model's
  own (bf16) logits, each within bf16's bound, scaled by the gradient's largest entry."""
  model = _lm(tie, jnp.bfloat16)
  tokens = jnp.asarray(np.random.default_rng(1).integers(0, 61, (2, 11)), jnp.int32)
  labels = jnp.concatenate([tokens[:, 1:], jnp.full((2, 1), -100, jnp.int32)], 1)
  graphdef, params = nnx.split(model)
  fused = lambda p: nnx.merge(graphdef, p).loss(tokens)
  plain = lambda p: _unfused(nnx.merge(graphdef, p), tokens, labels)
  (a, ga), (b, gb) = jax.value_and_grad(fused)(params), jax.value_and_grad(plain)(params)
  assert abs(float(a) - float(b)) <= tolerance(jnp.bfloat16) * max(1.0, abs(float(b)))
  tol = tolerance(jnp.bfloat16, grad=True)
  for x, y in zip(jax.tree.leaves(ga), jax.tree.leaves(gb)):
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    assert np.all(np.isfinite(x)) and np.max(np.abs(x - y)) <= tol * max(1e-12, np.max(np.abs(y)))


def test_labels_and_errors():
  model = _lm(True)
  tokens = jnp.zeros((2, 5), jnp.int32)
  per = model.loss(tokens, jnp.full((2, 5), 3, jnp.int32), reduction="none")
  assert per.shape == (2, 5)
  with pytest.raises(ValueError, match="labels"):
    model.loss(tokens, jnp.zeros((2, 4), jnp.int32))
  with pytest.raises(TypeError, match="labels"):
    model.loss(tokens, jnp.zeros((2, 5), jnp.float32))
  with pytest.raises(ValueError, match="ignore_index"):
    model.loss(tokens, ignore_index=None)


@pytest.mark.parametrize("tile", [(5, 16), (7, 61)], ids=["tiled", "whole_vocab"])
def test_loss_tile_changes_nothing_but_the_tiling(tile):
  """``chunk_tokens``/``chunk_vocab`` reach the op: an odd tile (last token and vocabulary tiles
  starting earlier) gives the unfused loss and gradients."""
  model = _lm(False)
  tokens = jnp.asarray(np.random.default_rng(2).integers(0, 61, (2, 9)), jnp.int32)
  labels = jnp.concatenate([tokens[:, 1:], jnp.full((2, 1), -100, jnp.int32)], 1)
  graphdef, params = nnx.split(model)
  fused = lambda p: nnx.merge(graphdef, p).loss(tokens, chunk_tokens=tile[0], chunk_vocab=tile[1])
  plain = lambda p: _unfused(nnx.merge(graphdef, p), tokens, labels)
  (a, ga), (b, gb) = jax.value_and_grad(fused)(params), jax.value_and_grad(plain)(params)
  tol = tolerance(jnp.float32, grad=True)
  assert abs(float(a) - float(b)) <= tol * max(1.0, abs(float(b)))
  for x, y in zip(jax.tree.leaves(ga), jax.tree.leaves(gb)):
    assert float(jnp.max(jnp.abs(x - y))) <= tol * max(1.0, float(jnp.max(jnp.abs(y))))
  with pytest.raises(ValueError, match="chunk_tokens"):  # the tile reaches the op
    model.loss(tokens, chunk_tokens=0)
