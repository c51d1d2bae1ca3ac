"""TransformerBlock's pluggable sequence mixer (attention / Mamba / Mamba-2 / RLA / a factory) and
feed-forward (MLP / MoE / a factory): a block equals its layers run by hand with the same
parameters; per-layer lists (hybrid and MoE stacks) equal their blocks in sequence; decoding of
an attention-mixer MoE LM (stacked and per-layer lists; generate too) equals the full pass; wrong
configurations raise errors naming the argument."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from probjax.nn.layers.attention import dot_product_attention
from probjax.nn.layers.decoding import generate
from probjax.nn.layers.mamba import Mamba, Mamba2
from probjax.nn.layers.mlp import MLP
from probjax.nn.layers.moe import MoELayer
from probjax.nn.layers.multi_head_attention import MultiHeadAttention
from probjax.nn.layers.rattention import RAttention
from probjax.nn.layers.transformer import Transformer, TransformerBlock, TransformerLM
from probjax.ops.attention.masks import SegmentMask
from probjax.testing import numpy_init

XLA = functools.partial(dot_product_attention, implementation="xla")
F = 16
MOE = dict(num_experts=4, top_k=2, dispatch="dense")
TOL = dict(atol=2e-5, rtol=2e-5)


def _x(shape=(2, 7, F), seed=1):
  return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), jnp.float32)


def _copy(dst, src):
  """``dst`` with ``src``'s parameters (values): the same structure, checked."""
  nnx.update(dst, nnx.state(src, nnx.Param))
  for a, b in zip(jax.tree.leaves(nnx.state(dst, nnx.Param)), jax.tree.leaves(nnx.state(src, nnx.Param))):
    np.testing.assert_array_equal(a, b)
  return dst


# (mixer, mixer_kwargs, the standalone mixer) and (ffn, ffn_kwargs, the standalone feed-forward)
MIXER_CASES = {
    "attention": (None, lambda: MultiHeadAttention(num_heads=2, num_kv_heads=1, in_features=F, rngs=nnx.Rngs(9))),
    "mamba": (dict(d_state=4), lambda: Mamba(d_model=F, d_state=4, rngs=nnx.Rngs(9))),
    "mamba2": (dict(d_state=4, head_dim=8), lambda: Mamba2(d_model=F, d_state=4, head_dim=8, rngs=nnx.Rngs(9))),
    "rla": (dict(window_size=2, attention_implementation="xla"),
            lambda: RAttention(num_heads=2, num_kv_heads=1, in_features=F, window_size=2,
                               attention_implementation="xla", rngs=nnx.Rngs(9))),
}
FFN_CASES = {
    "moe": (MOE, lambda: MoELayer(F, 32, 4, 2, activation="swiglu", dispatch="dense", rngs=nnx.Rngs(9))),
    "mlp": (None, lambda: MLP(features=F, hidden_features=32, activation="swiglu", rngs=nnx.Rngs(9))),
}


@pytest.mark.parametrize("mixer, ffn", [("mamba", "moe"), ("mamba2", "mlp"), ("rla", "moe"), ("attention", "moe")])
def test_block_equals_its_layers_by_hand(mixer, ffn):
  """``x + mixer(norm(x))``, then ``+ ffn(norm(.))``, with the standalone layers given the
  block's parameters; the MoE's RouterAux is returned as the block's aux."""
  mixer_kwargs, make_mixer = MIXER_CASES[mixer]
  ffn_kwargs, make_ffn = FFN_CASES[ffn]
  block = numpy_init(lambda: TransformerBlock(
      features=F, num_heads=2, num_kv_heads=1, mlp="swiglu", mlp_features=32, norm="rmsnorm",
      mixer=mixer, mixer_kwargs=mixer_kwargs, ffn=ffn, ffn_kwargs=ffn_kwargs, rngs=nnx.Rngs(0)))
  assert block.mixer_kind == mixer and block.ffn_kind == ffn
  assert (block.attn is None) == (mixer != "attention") and (block.mixer is None) == (mixer == "attention")
  norm1 = _copy(nnx.RMSNorm(F, rngs=nnx.Rngs(9)), block.attn_norm)
  norm2 = _copy(nnx.RMSNorm(F, rngs=nnx.Rngs(9)), block.mlp_norm)
  mix = _copy(make_mixer(), block.mixer if block.attn is None else block.attn)
  ff = _copy(make_ffn(), block.mlp)
  x = _x()
  h = x + mix(norm1(x))
  out = ff(norm2(h))
  y_ff, aux_want = out if isinstance(out, tuple) else (out, None)
  want = h + y_ff
  got, aux = nnx.jit(lambda b, x: b(x, return_aux=True))(block, x)
  np.testing.assert_allclose(got, want, **TOL)
  np.testing.assert_allclose(block(x), want, **TOL)
  if aux_want is None:
    assert aux is None
  else:
    np.testing.assert_array_equal(aux.expert_counts, aux_want.expert_counts)
    np.testing.assert_allclose(aux.load_balancing_loss, aux_want.load_balancing_loss, **TOL)


def test_factory_mixer_and_ffn():
  """A factory is called with ``features``, ``dtype``, ``param_dtype``, ``rngs`` and the kwargs;
  a feed-forward factory may return ``(y, aux)``."""

  class Scaled(nnx.Module):
    def __init__(self, *, features, scale, dtype, param_dtype, rngs):
      self.lin = nnx.Linear(features, features, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
      self.scale = scale

    def __call__(self, h):
      return self.scale * self.lin(h)

  class WithAux(Scaled):
    def __call__(self, h):
      y = super().__call__(h)
      return y, jnp.sum(y)

  block = TransformerBlock(features=F, mixer=Scaled, mixer_kwargs=dict(scale=2.0), ffn=WithAux,
                           ffn_kwargs=dict(scale=0.5), norm="rmsnorm", rngs=nnx.Rngs(0))
  x = _x()
  h = x + block.mixer(block.attn_norm(x))
  want = h + block.mlp(block.mlp_norm(h))[0]
  got, aux = block(x, return_aux=True)
  np.testing.assert_allclose(got, want, **TOL)
  np.testing.assert_allclose(aux, jnp.sum(block.mlp(block.mlp_norm(h))[0]), rtol=1e-5)


def test_default_block_is_unchanged():
  """No mixer/ffn arguments: the attention + MLP block of before, same parameters (same paths,
  same values from the same rngs)."""
  a = TransformerBlock(features=F, num_heads=2, rngs=nnx.Rngs(0))
  b = TransformerBlock(features=F, num_heads=2, mixer="attention", ffn="mlp", rngs=nnx.Rngs(0))
  assert a.mixer is None and isinstance(a.mlp, MLP)
  sa, sb = nnx.state(a, nnx.Param), nnx.state(b, nnx.Param)
  assert sorted(k for k, _ in nnx.to_flat_state(sa)) == sorted(k for k, _ in nnx.to_flat_state(sb))
  assert ("attn", "qkv", "kernel") in [k for k, _ in nnx.to_flat_state(sa)]


def test_hybrid_stack_equals_its_blocks_in_sequence():
  """Per-layer lists build separate blocks (kwargs by kind); the stack equals the blocks applied
  one after the other, with a per-layer aux list; a stacked MoE stack returns its aux with a
  leading layer axis."""
  tr = numpy_init(lambda: Transformer(
      num_layers=3, features=F, num_heads=2, num_kv_heads=1, mlp="swiglu", mlp_features=32,
      is_causal=True, attention_fn=XLA, mixer=["mamba", "attention", "rla"],
      mixer_kwargs={"mamba": dict(d_state=4), "rla": dict(window_size=2, attention_implementation="xla")},
      ffn=["moe", "mlp", "moe"], ffn_kwargs={"moe": MOE}, rngs=nnx.Rngs(0)))
  assert not tr.stacked and len(tr.blocks) == 3
  assert [(b.mixer_kind, b.ffn_kind) for b in tr.blocks] == [("mamba", "moe"), ("attention", "mlp"), ("rla", "moe")]
  x = _x()
  want, auxes = x, []
  for block in tr.blocks:
    want, a = block(want, return_aux=True)
    auxes.append(a)
  got, aux = nnx.jit(lambda m, x: m(x, return_aux=True))(tr, x)
  np.testing.assert_allclose(got, want, **TOL)
  assert aux[1] is None and int(aux[0].expert_counts.sum()) == int(aux[2].expert_counts.sum()) == 2 * 7 * 2
  # The same stack with remat.
  tr.remat = True
  np.testing.assert_allclose(nnx.jit(lambda m, x: m(x))(tr, x), want, **TOL)

  stacked = Transformer(num_layers=2, features=F, num_heads=2, ffn="moe", ffn_kwargs=MOE, rngs=nnx.Rngs(0))
  assert stacked.stacked and stacked.blocks.mlp.w_in.shape[0] == 2
  y, aux = stacked(x, return_aux=True)
  assert aux.expert_counts.shape == (2, 4) and aux.expert_counts.sum(1).tolist() == [28, 28]
  h = x
  for block in stacked.unstacked():
    h = block(h)
  np.testing.assert_allclose(y, h, **TOL)


def test_hybrid_lm_runs_and_refuses_kv_cache_decoding():
  lm = TransformerLM(vocab_size=11, features=F, num_layers=2, num_heads=2,
                     mixer=["mamba2", "attention"], mixer_kwargs={"mamba2": dict(d_state=4, head_dim=8)},
                     attention_fn=XLA, rngs=nnx.Rngs(0))
  assert lm(jnp.zeros((2, 5), jnp.int32)).shape == (2, 5, 11)
  with pytest.raises(ValueError, match="layer 0 has mixer 'mamba2'"):
    lm.init_cache(2, 8)
  with pytest.raises(ValueError, match="mask"):
    lm(jnp.zeros((2, 5), jnp.int32), mask=SegmentMask(jnp.zeros((2, 5), jnp.int32)))


@pytest.mark.parametrize("ffn", ["moe", ["moe", "mlp"]], ids=["stacked", "list"])
def test_moe_lm_decoding_equals_the_full_pass(ffn):
  """An attention-mixer LM with MoE feed-forwards (dropless): prefill and one-token decode steps
  give the full pass's logits (per-layer cache; the stacked cache too for stacked blocks)."""
  lm = numpy_init(lambda: TransformerLM(
      vocab_size=13, features=F, num_layers=2, num_heads=2, num_kv_heads=1, qk_norm=True,
      ffn=ffn, ffn_kwargs={"moe": MOE}, attention_fn=XLA, rngs=nnx.Rngs(0)))
  lengths = np.array([4, 2])
  seq = np.random.default_rng(3).integers(0, 13, (2, 7)).astype(np.int32)
  want = nnx.jit(lambda m, t: m(t))(lm, jnp.asarray(seq))
  prompts = np.where(np.arange(4)[None] < lengths[:, None], seq[:, :4], 0).astype(np.int32)
  layouts = ("per_layer", "stacked") if isinstance(ffn, str) else ("per_layer",)
  prefill = nnx.jit(lambda m, t, n, c: m.prefill(t, n, c))
  step = nnx.jit(lambda m, t, c: m.decode_step(t, c))
  for layout in layouts:
    logits, cache = prefill(lm, jnp.asarray(prompts), jnp.asarray(lengths), lm.init_cache(2, 8, layout=layout))
    for b, n in enumerate(lengths):
      np.testing.assert_allclose(logits[b, n - 1], want[b, n - 1], **TOL)
    for j in range(2):
      tok = seq[np.arange(2), lengths + j][:, None]
      logits, cache = step(lm, jnp.asarray(tok), cache)
      for b, n in enumerate(lengths):
        np.testing.assert_allclose(logits[b, 0], want[b, n + j], **TOL)
  if not isinstance(ffn, str):
    with pytest.raises(ValueError, match="layout='stacked'"):
      lm.init_cache(2, 8, layout="stacked")
    # generate (decode_loop over the list's blocks): greedy tokens are the full pass's argmax.
    toks, _ = generate(lm, jnp.asarray(seq[:, :4]), max_new_tokens=3)
    logits = nnx.jit(lambda m, t: m(t))(lm, jnp.concatenate([jnp.asarray(seq[:, :4]), toks], 1))
    np.testing.assert_array_equal(toks, np.argmax(np.asarray(logits[:, 3:6]), -1))


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(mixer="lstm"), ValueError, "mixer must be one of"),
    (dict(mixer=3), TypeError, "mixer must be"),
    (dict(ffn="dense"), ValueError, "ffn must be one of"),
    (dict(ffn=None), TypeError, "ffn must be"),
    (dict(ffn="moe"), ValueError, "ffn_kwargs"),
    (dict(ffn="moe", ffn_kwargs=dict(num_experts=4)), ValueError, "top_k in ffn_kwargs"),
    (dict(mixer="rla"), ValueError, "window_size in mixer_kwargs"),
    (dict(mixer="mamba", mixer_kwargs=[dict(d_state=4)]), TypeError, "mixer_kwargs must be a dict"),
    (dict(mixer="mamba", mixer_kwargs={"mamba": []}), TypeError, r"mixer_kwargs\['mamba'\]"),
    (dict(num_heads=None), ValueError, "num_heads must be given"),
    (dict(num_heads=None, mixer="mamba", context_features=4), ValueError, "num_heads must be given"),
    (dict(features=0), ValueError, "features"),
])
def test_block_configuration_errors(kwargs, error, match):
  kw = dict(features=F, num_heads=2, rngs=nnx.Rngs(0))
  kw.update(kwargs)
  with pytest.raises(error, match=match):
    TransformerBlock(**kw)


def test_call_and_stack_errors():
  block = TransformerBlock(features=F, mixer="mamba", mixer_kwargs=dict(d_state=4), rngs=nnx.Rngs(0))
  x = _x()
  with pytest.raises(ValueError, match="mask: the 'mamba' mixer takes no mask"):
    block(x, mask=SegmentMask(jnp.zeros((2, 7), jnp.int32)))
  with pytest.raises(ValueError, match="KV-cache decoding needs the attention mixer"):
    block.prefill(x, None, jnp.array([7, 7]))
  with pytest.raises(ValueError, match="mixer: a per-layer list needs num_layers=3 entries, got 2"):
    Transformer(num_layers=3, features=F, num_heads=2, mixer=["mamba", "attention"], rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="num_layers"):
    Transformer(num_layers=0, features=F, num_heads=2, rngs=nnx.Rngs(0))
  tr = nnx.eval_shape(lambda: Transformer(num_layers=2, features=F, num_heads=2, mixer="mamba",
                                          mixer_kwargs=dict(d_state=4), rngs=nnx.Rngs(0)))
  with pytest.raises(ValueError, match="the layers have mixer 'mamba'"):
    tr.init_cache(2, 8)
