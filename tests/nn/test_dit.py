"""DiffusionTransformer: adaLN-Zero identity at initialisation, padded tokens change nothing,
gradients across attention functions, label dropout, configuration errors, the example."""

from __future__ import annotations

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
from probjax.nn.layers.dit import DiffusionTransformer, DiTBlock
from probjax.ops.attention.masks import KVLenMask
from probjax.testing import numpy_init

ROOT = pathlib.Path(__file__).resolve().parents[2]
TOL = tolerance(jnp.float32)
SIZES = np.array([6, 3])   # real tokens per set, padded to N
N = 6


def _dit(attention_fn=dot_product_attention, **kw):
  return DiffusionTransformer(in_features=2, features=16, num_layers=2, num_heads=2, num_classes=3,
                              cond_features=3, context_features=4, frequency_features=16,
                              attention_fn=attention_fn, rngs=nnx.Rngs(0), **kw)


def _inputs(seed=0):
  rng = np.random.default_rng(seed)
  a = dict(x=rng.standard_normal((2, N, 2)), t=rng.uniform(0.05, 1, 2), cond=rng.standard_normal((2, 3)),
           context=rng.standard_normal((2, 5, 4)))
  assert all(np.all(v != 0) for v in a.values())
  a = {k: jnp.asarray(v, jnp.float32) for k, v in a.items()}
  return dict(a, labels=jnp.array([0, 2]))


def _forward(model, a, mask=None, context_mask=None):
  return model(a["x"], a["t"], labels=a["labels"], cond=a["cond"], context=a["context"], mask=mask,
               context_mask=context_mask)


@pytest.mark.slow  # three DiT variants built and run eagerly (every op compiles on first use)
def test_identity_blocks_and_zero_output_at_init():
  model = _dit()
  a = _inputs()
  assert float(jnp.abs(model.modulation.kernel[...]).max()) == 0.0

  @nnx.jit
  def run(model, a):
    c = model.conditioning(a["t"], labels=a["labels"], cond=a["cond"])
    h, final = model.hidden(a["x"], c, context=a["context"])
    return h, model._tokens(a["x"]), final, _forward(model, a)

  h, tokens, final, out = run(model, a)
  np.testing.assert_array_equal(h, tokens)                      # every block exactly the identity
  assert float(jnp.abs(final).max()) == 0.0 and float(jnp.abs(tokens).min()) > 0
  np.testing.assert_array_equal(out, 0.0)
  # A block with random parameters is the identity under a zero modulation (the gates).
  blk = numpy_init(lambda: DiTBlock(features=16, num_heads=2, context_features=4, rngs=nnx.Rngs(0)))
  h = jnp.asarray(np.random.default_rng(2).standard_normal((2, N, 16)), jnp.float32)
  apply = nnx.jit(lambda blk, h, m, ctx: blk(h, m, context=ctx))
  np.testing.assert_array_equal(apply(blk, h, jnp.zeros((2, 1, 9 * 16)), a["context"]), h)
  assert max_error(apply(blk, h, jnp.ones((2, 1, 9 * 16)), a["context"]), h) > 1e-2


def test_padded_tokens_and_context_change_nothing():
  model = numpy_init(_dit)   # random parameters: non-zero gates and output
  a = _inputs()
  f = nnx.jit(_forward)
  out = np.asarray(f(model, a, KVLenMask(jnp.asarray(SIZES)), KVLenMask(jnp.array([5, 2]))))
  assert np.all(np.isfinite(out)) and np.abs(out).min() > 0
  for b, (n, m) in enumerate(zip(SIZES, [5, 2])):
    alone = {k: v[b:b + 1] for k, v in a.items()}
    alone["x"], alone["context"] = alone["x"][:, :n], alone["context"][:, :m]
    assert max_error(out[b, :n], f(model, alone)[0]) < TOL, b
  # No position embedding on tokens: permuting a set's tokens permutes its outputs.
  perm = np.random.default_rng(3).permutation(N)
  out_p = f(model, dict(a, x=a["x"][:, perm]))
  assert max_error(out_p, f(model, a)[:, perm]) < TOL


def test_image_patches_round_trip_and_bfloat16():
  model = numpy_init(lambda: DiffusionTransformer(in_features=3, out_features=2, features=16,
                                                  num_layers=1, num_heads=2, patch_size=2,
                                                  frequency_features=8, dtype=jnp.bfloat16,
                                                  rngs=nnx.Rngs(0)))
  x = jnp.asarray(np.random.default_rng(0).standard_normal((2, 4, 6, 3)), jnp.float32)
  y = nnx.jit(lambda m, x: m(x, jnp.array([0.2, 0.7])))(model, x)
  assert y.shape == (2, 4, 6, 2) and y.dtype == jnp.bfloat16 and bool(jnp.isfinite(y).all())
  with pytest.raises(ValueError, match="patch_size"):
    model(jnp.ones((2, 5, 6, 3)), jnp.ones(2))


@pytest.mark.slow  # gradients of the model under three attention functions, eagerly
def test_gradients_match_across_attention_functions():
  # The default against plain attention (tests/nn/test_conditioners.py also forces "xla").
  a = _inputs()
  mask, cmask = KVLenMask(jnp.asarray(SIZES)), KVLenMask(jnp.array([5, 2]))

  def grads(fn):
    model = numpy_init(lambda: _dit(fn))
    loss = lambda m, x: jnp.sum(jnp.sin(_forward(m, dict(a, x=x), mask, cmask))[:, :3])
    return nnx.jit(nnx.grad(loss, argnums=(0, 1)))(model, a["x"])

  flat = lambda g: jnp.concatenate([jnp.ravel(v) for v in jax.tree.leaves(g)])
  want = flat(grads(flax_attention))
  assert float(jnp.abs(want).max()) > 0
  assert max_error(flat(grads(dot_product_attention)), want) < tolerance(jnp.float32, grad=True)


def test_label_dropout_uses_the_null_label_when_training():
  model = numpy_init(lambda: _dit(class_dropout_rate=0.5))
  a = _inputs()
  labels = jnp.zeros(64, jnp.int32)
  t = jnp.full(64, 0.5)
  c_train = model.conditioning(t, labels=labels, cond=jnp.ones((64, 3)), deterministic=False,
                               rngs=nnx.Rngs(dropout=1))
  kept = model.conditioning(t, labels=labels, cond=jnp.ones((64, 3)), deterministic=True)
  null = model.conditioning(t, labels=labels + model.null_label, cond=jnp.ones((64, 3)), deterministic=True)
  is_kept = np.all(np.isclose(c_train, kept), axis=-1)
  is_null = np.all(np.isclose(c_train, null), axis=-1)
  assert np.all(is_kept ^ is_null) and 10 < is_null.sum() < 54
  with pytest.raises(ValueError, match="deterministic"):
    _forward(model, a)


@pytest.mark.parametrize("kw, name", [
    (dict(patch_size=2, features=18), "features"), (dict(patch_size=0), "patch_size"),
    (dict(num_layers=0), "num_layers"), (dict(num_heads=3), "num_heads"),
    (dict(class_dropout_rate=1.5), "class_dropout_rate"), (dict(frequency_features=7), "frequency_features"),
    (dict(mlp="relu"), "mlp"), (dict(num_classes=None, class_dropout_rate=0.1), "num_classes")])
def test_bad_configurations_raise(kw, name):
  args = dict(in_features=2, features=16, num_layers=1, num_heads=2, num_classes=3, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match=name):
    DiffusionTransformer(**{**args, **kw})


def test_missing_conditioning_raises():
  model = _dit()
  a = _inputs()
  with pytest.raises(ValueError, match="labels"):
    model(a["x"], a["t"], cond=a["cond"], context=a["context"])
  with pytest.raises(ValueError, match="cond"):
    model(a["x"], a["t"], labels=a["labels"], context=a["context"])
  with pytest.raises(ValueError, match="context"):
    model(a["x"], a["t"], labels=a["labels"], cond=a["cond"])
  with pytest.raises(ValueError, match="in_features"):
    model(a["x"][..., :1], a["t"], labels=a["labels"], cond=a["cond"], context=a["context"])


@pytest.mark.slow  # about a minute on a shared 2-core CPU, most of it compiling
def test_example_training_lowers_loss_and_samples():
  spec = importlib.util.spec_from_file_location("train_dit", ROOT / "examples" / "diffusion" / "train_dit.py")
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  out = mod.main(["--steps", "30", "--sample-steps", "4"])
  losses = np.asarray(out["losses"])
  assert len(losses) == 30 and np.isfinite(losses).all()
  assert losses[-5:].mean() < 0.9 * losses[:5].mean(), losses
  assert out["samples"].shape[-1] == 2 and np.isfinite(out["samples"]).all()


@pytest.mark.slow  # ~15 s each on a shared 2-core CPU, most of it compiling
@pytest.mark.parametrize("remat", [False, True])
def test_unrolled_layers_match_the_scan(remat):
  # The same stacked parameters (numpy_init draws them by path) run by nnx.scan and unrolled.
  a = _inputs()
  mask, cmask = KVLenMask(jnp.asarray(SIZES)), KVLenMask(jnp.array([5, 2]))
  loss = lambda m, x: jnp.sum(jnp.sin(_forward(m, dict(a, x=x), mask, cmask))[:, :3])
  f = nnx.jit(nnx.value_and_grad(loss, argnums=(0, 1)))
  (want, (gm_want, gx_want)), (got, (gm, gx)) = [
      f(numpy_init(lambda s=s: _dit(scan_layers=s, remat=remat)), a["x"]) for s in (True, False)]
  flat = lambda g: jnp.concatenate([jnp.ravel(v) for v in jax.tree.leaves(g)])
  assert float(jnp.abs(flat(gm_want)).max()) > 0 and float(jnp.abs(gx_want).max()) > 0
  assert max_error(got, want) < TOL
  assert max_error(flat(gm), flat(gm_want)) < tolerance(jnp.float32, grad=True)
  assert max_error(gx, gx_want) < tolerance(jnp.float32, grad=True)
