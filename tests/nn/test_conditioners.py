"""Set Transformer blocks and the cross-attention conditioner: padded elements change nothing,
permutation invariance/equivariance, gradients across attention functions, the example."""

from __future__ import annotations

import functools
import importlib.util
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from bench.lm_step import flax_attention  # plain attention: flax's, masks made dense
from probjax.core.tolerances import max_error, tolerance
from probjax.nn.layers.attention import dot_product_attention
from probjax.nn.layers.conditioners import ISAB, MAB, PMA, SAB, CrossAttentionConditioner
from probjax.ops.attention.masks import CausalMask, KVLenMask
from probjax.testing import numpy_init

ROOT = pathlib.Path(__file__).resolve().parents[2]
F, HEADS = 8, 2
SIZES = np.array([5, 3])    # real elements per set; padded to N
N = 7
XLA = functools.partial(dot_product_attention, implementation="xla")
TOL = tolerance(jnp.float32)


def _make(kind, attention_fn=dot_product_attention):
  cls, extra = {"mab": (MAB, dict(context_features=3)), "sab": (SAB, {}),
                "isab": (ISAB, dict(num_inducing=3)), "pma": (PMA, dict(num_seeds=2, mlp="swiglu")),
                "cross": (CrossAttentionConditioner, dict(context_features=3, num_latents=3, num_layers=1))}[kind]
  return numpy_init(lambda: cls(features=F, num_heads=HEADS, attention_fn=attention_fn,
                                rngs=nnx.Rngs(0), **extra))  # random parameters throughout (no zero or unit init left)


def _apply(kind, m, s, mask, q=None):
  if kind == "mab":
    return m(q, s, mask=mask)
  return m(s, mask=mask)


def _inputs(kind, seed=0):
  rng = np.random.default_rng(seed)
  width = 3 if kind in ("mab", "cross") else F
  sets = rng.standard_normal((2, N, width)).astype(np.float32)    # padding: random values too
  q = rng.standard_normal((2, 4, F)).astype(np.float32)
  assert np.all(sets != 0) and np.all(q != 0)
  return sets, q


EQUIVARIANT = ("sab", "isab")   # per-element outputs; the others: one output per set


@pytest.mark.parametrize("kind", ["mab", "sab", "isab", "pma", "cross"])
def test_padding_changes_nothing_and_permutations(kind):
  m = _make(kind)
  f = nnx.jit(functools.partial(_apply, kind))
  sets, q = _inputs(kind)
  mask = KVLenMask(jnp.asarray(SIZES))
  out = np.asarray(f(m, jnp.asarray(sets), mask, jnp.asarray(q)))
  assert np.all(np.isfinite(out))
  for b, n in enumerate(SIZES):
    alone = f(m, jnp.asarray(sets[b:b + 1, :n]), None, jnp.asarray(q[b:b + 1]))[0]
    got = out[b, :n] if kind in EQUIVARIANT else out[b]
    assert max_error(got, alone) < TOL, (kind, b)
  # Permuting the real elements (the padding stays put): invariance / equivariance.
  perm = np.concatenate([np.random.default_rng(1).permutation(SIZES[0]), np.arange(SIZES[0], N)])
  shuffled = sets.copy()
  shuffled[0] = sets[0, perm]
  out_p = np.asarray(f(m, jnp.asarray(shuffled), mask, jnp.asarray(q)))
  want = out[0, perm[:SIZES[0]]] if kind in EQUIVARIANT else out[0]
  got = out_p[0, :SIZES[0]] if kind in EQUIVARIANT else out_p[0]
  assert max_error(got, want) < TOL
  assert not np.allclose(out[0], out[1])   # the sets differ, and so do their outputs


@pytest.mark.slow  # gradients of every conditioner under three attention functions, eagerly
def test_gradients_match_across_attention_functions():
  sets, _ = _inputs("isab")
  mask = KVLenMask(jnp.asarray(SIZES))

  def grads(fn):
    isab, pma = _make("isab", fn), _make("pma", fn)

    def loss(models, x):
      a, b = models
      return jnp.sum(jnp.sin(b(a(x, mask=mask), mask=mask)))
    return nnx.jit(nnx.grad(loss, argnums=(0, 1)))((isab, pma), jnp.asarray(sets))

  flat = lambda g: jnp.concatenate([jnp.ravel(a) for a in jax.tree.leaves(g)])
  want = flat(grads(flax_attention))
  assert np.abs(np.asarray(want)).max() > 0
  for fn in (dot_product_attention, XLA):
    assert max_error(flat(grads(fn)), want) < tolerance(jnp.float32, grad=True)


def test_bad_configurations_raise():
  kw = dict(features=F, num_heads=HEADS, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="num_inducing"):
    ISAB(num_inducing=0, **kw)
  with pytest.raises(ValueError, match="num_seeds"):
    PMA(num_seeds=0, **kw)
  with pytest.raises(ValueError, match="num_latents"):
    CrossAttentionConditioner(context_features=3, num_latents=0, **kw)
  with pytest.raises(ValueError, match="num_layers"):
    CrossAttentionConditioner(context_features=3, num_latents=2, num_layers=-1, **kw)
  with pytest.raises(ValueError, match="num_heads"):
    MAB(features=F, num_heads=3, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="norm"):
    SAB(norm="batchnorm", **kw)
  with pytest.raises(ValueError, match="mlp"):
    MAB(mlp="relu", **kw)
  pma = PMA(num_seeds=1, **kw)
  with pytest.raises(ValueError, match="mask"):
    pma(jnp.ones((2, 4, F)), mask=CausalMask())   # learned seeds have no positions


@pytest.mark.slow  # about a minute on a shared 2-core CPU, most of it compiling
def test_set_conditioning_example_lowers_loss():
  spec = importlib.util.spec_from_file_location(
      "train_isab", ROOT / "examples" / "set_conditioning" / "train_isab.py")
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  out = mod.main(["--steps", "30"])
  losses = np.asarray(out["losses"])
  assert len(losses) == 30 and np.isfinite(losses).all()
  assert losses[-5:].mean() < 0.9 * losses[:5].mean(), losses
