"""Layers calling the fused norm op (``probjax.ops.norm``) equal their unfused formula: DiT's
adaLN (``norm(x) * (1 + scale) + shift`` with a parameterless LayerNorm) in values and
gradients, with the parameters and module tree unchanged."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from probjax.core.tolerances import max_error, tolerance
from probjax.nn.layers import dit
from probjax.nn.layers.mlp import FiLM
from probjax.testing import numpy_init


def _unfused(norm, x, shift, scale):
  return FiLM.apply(norm(x), (scale, shift))


def _model():
  return numpy_init(lambda: dit.DiffusionTransformer(
      in_features=3, features=24, num_layers=2, num_heads=2, num_classes=3, context_features=5,
      frequency_features=16, rngs=nnx.Rngs(0)))


def _inputs():
  r = np.random.default_rng(0)
  return dict(x=jnp.asarray(r.standard_normal((2, 7, 3)), jnp.float32),
              t=jnp.asarray(r.uniform(0.05, 1, 2), jnp.float32), labels=jnp.array([0, 2]),
              context=jnp.asarray(r.standard_normal((2, 4, 5)), jnp.float32))


def test_dit_adaln_equals_the_unfused_formula(monkeypatch):
  model, a = _model(), _inputs()
  graphdef, params = nnx.split(model, nnx.Param)

  def loss(p, x):
    return jnp.sum(jnp.sin(nnx.merge(graphdef, p)(x, a["t"], labels=a["labels"], context=a["context"])))

  fused = jax.value_and_grad(loss, argnums=(0, 1))(params, a["x"])
  monkeypatch.setattr(dit, "_modulate", _unfused)
  plain = jax.value_and_grad(loss, argnums=(0, 1))(params, a["x"])
  assert max_error(fused[0], plain[0]) <= tolerance(jnp.float32)
  for g, w in zip(jax.tree.leaves(fused[1]), jax.tree.leaves(plain[1])):
    assert max_error(g, w) <= tolerance(jnp.float32, grad=True)


@pytest.mark.parametrize("dtype", [None, jnp.bfloat16])
def test_dit_block_keeps_its_norm_modules_and_output_dtype(dtype):
  blk = dit.DiTBlock(features=16, num_heads=2, dtype=dtype, rngs=nnx.Rngs(0))
  # The parameterless LayerNorms stay in the module tree (checkpoints keep their structure).
  assert len(blk.norms) == blk.sites and not jax.tree.leaves(nnx.state(blk.norms, nnx.Param))
  x = jnp.asarray(np.random.default_rng(1).standard_normal((2, 5, 16)), jnp.float32)
  m = jnp.asarray(0.3 * np.random.default_rng(2).standard_normal((2, 1, blk.sites * 3 * 16)), jnp.float32)
  shift, scale = m[..., :16], m[..., 16:32]
  got = dit._modulate(blk.norms[0], x, shift, scale)
  want = _unfused(blk.norms[0], x, shift, scale)
  assert got.dtype == want.dtype
  assert max_error(got, want) <= tolerance(want.dtype)


def _unfused_add_norm(norm, x, y):
  h = x + y
  return h, norm(h)


@pytest.mark.parametrize("norm, dtype", [("rmsnorm", None), ("layernorm", None), ("rmsnorm", jnp.bfloat16)])
def test_transformer_block_add_norm_equals_the_unfused_formula(monkeypatch, norm, dtype):
  from probjax.nn.layers import transformer
  blk = numpy_init(lambda: transformer.TransformerBlock(features=20, num_heads=2, norm=norm, context_features=6,
                                                        dtype=dtype, rngs=nnx.Rngs(0)))
  r = np.random.default_rng(3)
  x = jnp.asarray(r.standard_normal((2, 5, 20)), jnp.float32)
  ctx = jnp.asarray(r.standard_normal((2, 3, 6)), jnp.float32)
  graphdef, params = nnx.split(blk, nnx.Param)

  def loss(p, x):
    return jnp.sum(jnp.sin(nnx.merge(graphdef, p)(x, context=ctx).astype(jnp.float32)))

  fused = jax.value_and_grad(loss, argnums=(0, 1))(params, x)
  monkeypatch.setattr(transformer, "add_norm", _unfused_add_norm)
  plain = jax.value_and_grad(loss, argnums=(0, 1))(params, x)
  assert jax.tree.structure(fused[1]) == jax.tree.structure(plain[1])
  # A bfloat16 block rounds its norms' outputs (from the op's float32 or flax's): bfloat16's bound.
  tol = jnp.float32 if dtype is None else dtype
  assert max_error(fused[0], plain[0]) <= tolerance(tol)
  for g, w in zip(jax.tree.leaves(fused[1]), jax.tree.leaves(plain[1])):
    assert max_error(g, w) <= tolerance(tol, grad=True)
