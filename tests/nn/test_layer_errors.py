"""Every layer refuses bad inputs with a ValueError (shape, rank, value) or TypeError (dtype,
type) that names the argument and its expected form, at trace time (the checks read shapes and
dtypes only); valid inputs still run.

The layers are built abstractly (``nnx.eval_shape``) and called under ``jax.eval_shape``: every
check and every shape rule of the forward pass runs, nothing is compiled or computed, so the
file runs in seconds (the layers' own test files compute their outputs)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from probjax import dot_product_attention
from probjax.masks import CausalMask, KVLenMask, LocalWindowMask, Mask, SegmentMask
from probjax.nn.layers import (ISAB, MAB, MLP, PMA, SAB, CrossAttentionConditioner, DiffusionTransformer, DiTBlock,
                               FiLM, KVCache, Mamba, Mamba2, MoELayer, MultiHeadAttention, MultiHeadLatentAttention,
                               RAttention, Transformer, TransformerBlock, TransformerLM, apply_rotary, generate,
                               sample_logits)
from probjax.nn.layers.dit import timestep_embedding
from probjax.nn.layers.kv_cache import write
from probjax.nn.layers.mamba import MambaState
from probjax.nn.layers.moe import route

R = lambda: nnx.Rngs(0)  # noqa: E731
F = lambda *shape: jnp.ones(shape, jnp.float32)  # noqa: E731
I = lambda *shape: jnp.ones(shape, jnp.int32)  # noqa: E731


def make(name):
  """The smallest layer of each kind (features 8, 2 heads, batch 2 in the calls)."""
  return BUILDERS[name]()


@functools.cache
def abstract(name):
  """``(graphdef, state)`` of the layer, its state abstract (shapes and dtypes only)."""
  return nnx.split(nnx.eval_shape(lambda: make(name)))


def trace(name, call):
  """``call(layer)`` traced under ``jax.eval_shape`` (the shapes of its outputs)."""
  if name is None:
    return jax.eval_shape(lambda: call(None))
  graphdef, state = abstract(name)
  return jax.eval_shape(lambda st: call(nnx.merge(graphdef, st)), state)


BUILDERS = {
      "mha": lambda: MultiHeadAttention(num_heads=2, in_features=8, is_causal=True, rotary=True, rngs=R()),
      "cross": lambda: MultiHeadAttention(num_heads=2, in_features=8, context_features=6, rngs=R()),
      "mlp": lambda: MLP(features=8, hidden_features=8, rngs=R()),
      "film": lambda: FiLM(features=8, context_features=3, rngs=R()),
      "block": lambda: TransformerBlock(features=8, num_heads=2, mlp_features=8, context_features=6,
                                        film_features=3, rngs=R()),
      "transformer": lambda: Transformer(num_layers=2, features=8, num_heads=2, mlp_features=8, is_causal=True,
                                         rngs=R()),
      "lm": lambda: TransformerLM(vocab_size=5, features=8, num_layers=1, num_heads=2, mlp_features=8, rngs=R()),
      "ditblock": lambda: DiTBlock(features=8, num_heads=2, mlp_features=8, context_features=6, rngs=R()),
      "dit": lambda: DiffusionTransformer(in_features=2, features=8, num_layers=1, num_heads=2, mlp_features=8,
                                          num_classes=3, cond_features=3, context_features=5,
                                          frequency_features=4, rngs=R()),
      "dit_image": lambda: DiffusionTransformer(in_features=2, features=8, num_layers=1, num_heads=2,
                                                mlp_features=8, patch_size=2, frequency_features=4, rngs=R()),
      "mab": lambda: MAB(features=8, context_features=6, num_heads=2, mlp_features=8, rngs=R()),
      "sab": lambda: SAB(features=8, num_heads=2, mlp_features=8, rngs=R()),
      "isab": lambda: ISAB(features=8, num_heads=2, num_inducing=2, mlp_features=8, rngs=R()),
      "pma": lambda: PMA(features=8, num_heads=2, mlp_features=8, rngs=R()),
      "conditioner": lambda: CrossAttentionConditioner(features=8, num_heads=2, context_features=3, num_latents=2,
                                                       num_layers=1, mlp_features=8, rngs=R()),
      "moe": lambda: MoELayer(8, 8, 2, 1, dispatch="dense", rngs=R()),
      "mamba": lambda: Mamba(d_model=8, d_state=2, rngs=R()),
      "mamba2": lambda: Mamba2(d_model=8, d_state=2, head_dim=4, rngs=R()),
      "rla": lambda: RAttention(num_heads=2, in_features=8, window_size=2, rngs=R()),
      "mla": lambda: MultiHeadLatentAttention(num_heads=2, in_features=8, kv_lora_rank=4, qk_nope_head_dim=4,
                                              qk_rope_head_dim=2, v_head_dim=4, rngs=R()),
}


X = F(2, 5, 8)
KV2 = KVLenMask(jnp.array([5, 3]))
KV3 = KVLenMask(jnp.array([5, 3, 1]))

# (id, layer name, call(layer), exception, regex the message matches: it names the argument)
BAD = [
    # MultiHeadAttention
    ("mha-x-width", "mha", lambda m: m(F(2, 5, 4)), ValueError,
     r"^x must be \[batch, seq, 8\] \(in_features=8\), got shape \(2, 5, 4\)"),
    ("mha-x-2d", "mha", lambda m: m(F(5, 8)), ValueError, r"^x must be \[batch, seq, 8\]"),
    ("mha-x-int", "mha", lambda m: m(I(2, 5, 8)), TypeError, r"^x must have a floating dtype.*int32"),
    ("mha-positions-shape", "mha", lambda m: m(X, positions=I(2, 4)), ValueError,
     r"^positions must be \[batch, seq\] \(batch=2 as x's, seq=5 as x's\), got shape \(2, 4\)"),
    ("mha-positions-float", "mha", lambda m: m(X, positions=F(2, 5)), TypeError, r"^positions must have an integer"),
    ("mha-mask-batch", "mha", lambda m: m(X, mask=KV3), ValueError, r"^mask\.kv_lengths must have shape \(2,\)"),
    ("mha-mask-type", "mha", lambda m: m(X, mask="causal"), TypeError, r"^mask must be a probjax Mask"),
    ("mha-context-to-self", "mha", lambda m: m(X, F(2, 3, 8)), ValueError, r"^context given"),
    ("mha-context-batch", "cross", lambda m: m(X, F(3, 4, 6)), ValueError,
     r"^context must be \[batch, ctx_seq, 6\] \(batch=2 as x's, context_features=6\)"),
    ("mha-context-width", "cross", lambda m: m(X, F(2, 4, 5)), ValueError, r"^context must be .*context_features=6"),
    ("mha-context-int", "cross", lambda m: m(X, I(2, 4, 6)), TypeError, r"^context must have a floating"),
    ("mha-context-missing", "cross", lambda m: m(X), ValueError, r"needs a context"),
    ("mha-context-mask", "cross", lambda m: m(X, F(2, 4, 6), mask=KVLenMask(jnp.array([1]))), ValueError,
     r"^mask\.kv_lengths must have shape \(2,\)"),
    ("mha-prefill-cache-batch", "mha", lambda m: m.prefill(X, m.init_cache(3, 8), jnp.array([5, 5])), ValueError,
     r"^cache\.k must be \[batch, max_len, 2, 4\] \(batch=2 as x's, num_kv_heads=2, head_dim=4\)"),
    ("mha-prefill-cache-heads", "mha",
     lambda m: m.prefill(X, KVCache.init(2, 8, kv_heads=1, head_dim=4), jnp.array([5, 5])), ValueError,
     r"^cache\.k must be .*num_kv_heads=2"),
    ("mha-prefill-cache-stack", "mha",
     lambda m: m.prefill(X, KVCache.init(2, 8, kv_heads=2, head_dim=4, num_layers=2), jnp.array([5, 5])),
     ValueError, r"^cache: a layer takes one layer's cache"),
    ("mha-prefill-lengths-float", "mha", lambda m: m.prefill(X, m.init_cache(2, 8), jnp.array([5.0, 5.0])),
     TypeError, r"^lengths must have an integer"),
    ("mha-prefill-x-width", "mha", lambda m: m.prefill(F(2, 5, 3), m.init_cache(2, 8), jnp.array([5, 5])),
     ValueError, r"^x must be \[batch, P, 8\]"),
    ("mha-decode-cache-type", "mha", lambda m: m.decode_step(F(2, 1, 8), F(2, 8)), TypeError,
     r"^cache must be a KVCache"),
    ("mha-decode-cache-lengths", "mha",
     lambda m: m.decode_step(F(2, 1, 8), m.init_cache(2, 8).replace(lengths=jnp.zeros((2,)))), TypeError,
     r"^cache\.lengths must have an integer"),
    ("mha-decode-positions", "mha", lambda m: m.decode_step(F(2, 1, 8), m.init_cache(2, 8), positions=I(2, 2)),
     ValueError, r"^positions must be \[batch, n\]"),
    # MLP, FiLM
    ("mlp-x-width", "mlp", lambda m: m(F(2, 5, 4)), ValueError, r"^x must be \[\.\.\., 8\] \(features=8\)"),
    ("mlp-x-int", "mlp", lambda m: m(I(2, 5, 8)), TypeError, r"^x must have a floating"),
    ("film-context-width", "film", lambda m: m(F(2, 4)), ValueError,
     r"^context must be \[batch, 3\] \(context_features=3\)"),
    ("film-context-3d", "film", lambda m: m(F(2, 1, 3)), ValueError, r"^context must be \[batch, 3\]"),
    # TransformerBlock, Transformer, TransformerLM, decoding
    ("block-x-width", "block", lambda m: m(F(2, 5, 6), context=F(2, 3, 6), film=F(2, 3)), ValueError,
     r"^x must be \[batch, seq, 8\] \(features=8\)"),
    ("block-context-width", "block", lambda m: m(X, context=F(2, 3, 8), film=F(2, 3)), ValueError,
     r"^context must be \[batch, ctx_seq, 6\] .*context_features=6"),
    ("block-context-mask", "block", lambda m: m(X, context=F(2, 3, 6), context_mask=KV3, film=F(2, 3)), ValueError,
     r"^context_mask: mask\.kv_lengths must have shape \(2,\)"),
    ("block-film-width", "block", lambda m: m(X, context=F(2, 3, 6), film=F(2, 4)), ValueError,
     r"^film must be \[batch, 3\] \(batch=2 as x's, film_features=3\)"),
    ("block-film-int", "block", lambda m: m(X, context=F(2, 3, 6), film=I(2, 3)), TypeError, r"^film must have"),
    ("block-positions", "block", lambda m: m(X, context=F(2, 3, 6), film=F(2, 3), positions=I(1, 5)), ValueError,
     r"^positions must be \[batch, seq\]"),
    ("transformer-x-2d", "transformer", lambda m: m(F(5, 8)), ValueError, r"^x must be \[batch, seq, 8\]"),
    ("transformer-mask", "transformer", lambda m: m(X, mask=SegmentMask(I(2, 4))), ValueError,
     r"^mask\.q_segment_ids must have shape \(2, 5\)"),
    ("transformer-cache-layers", "transformer",
     lambda m: m.prefill(X, KVCache.init(2, 8, kv_heads=2, head_dim=4, num_layers=3), jnp.array([5, 5])),
     ValueError, r"^cache: the per-layer cache must hold num_layers=2"),
    ("transformer-stacked-cache-batch", "transformer",
     lambda m: m.decode_step(F(2, 1, 8), KVCache.init(1, 8, kv_heads=2, head_dim=4, num_layers=2, layout="stacked")),
     ValueError, r"^cache\.k must be \[2, batch, max_len, 2, 4\] \(num_layers=2, batch=2 as x's"),
    ("lm-tokens-float", "lm", lambda m: m(F(2, 5)), TypeError, r"^tokens must have an integer dtype"),
    ("lm-tokens-3d", "lm", lambda m: m(I(2, 5, 1)), ValueError, r"^tokens must be \[batch, seq\]"),
    ("lm-prefill-tokens", "lm", lambda m: m.prefill(I(5), jnp.array([5]), m.init_cache(1, 8)), ValueError,
     r"^tokens must be \[batch, P\]"),
    ("lm-decode-tokens-float", "lm", lambda m: m.decode_step(F(2, 1), m.init_cache(2, 8)), TypeError,
     r"^tokens must have an integer"),
    ("lm-decode-cache-batch", "lm", lambda m: m.decode_step(I(2, 1), m.init_cache(3, 8)), ValueError,
     r"^cache\.k must be .*batch=2 as x's"),
    ("generate-prompts-float", "lm", lambda m: generate(m, F(1, 3), jnp.array([3]), max_new_tokens=2), TypeError,
     r"^prompts must have an integer"),
    ("generate-lengths-batch", "lm", lambda m: generate(m, I(1, 3), jnp.array([3, 3]), max_new_tokens=2),
     ValueError, r"^lengths must be \[batch\] \(batch=1 as prompts's\)"),
    ("sample-logits-1d", None, lambda _: sample_logits(F(7), jax.random.key(0)), ValueError,
     r"^logits must be \[batch, vocab\]"),
    ("kv-write", None, lambda _: write(KVCache.init(2, 8, kv_heads=1, head_dim=4), F(2, 1, 1, 3), F(2, 1, 1, 3)),
     ValueError, r"^k_new must be \[batch, n, 1, 4\]"),
    ("rotary-x-3d", None, lambda _: apply_rotary(F(1, 3, 4), I(1, 3)), ValueError,
     r"^x must be \[batch, seq, heads, head_dim\]"),
    ("rotary-positions-bool", None, lambda _: apply_rotary(F(1, 3, 2, 4), jnp.ones((1, 3), bool)), TypeError,
     r"^positions must have an integer or floating"),
    # DiTBlock, DiffusionTransformer
    ("ditblock-x-width", "ditblock", lambda m: m(F(2, 5, 4), F(2, 1, 72), context=F(2, 3, 6)), ValueError,
     r"^x must be \[batch, n, 8\] \(features=8\)"),
    ("ditblock-modulation", "ditblock", lambda m: m(X, F(2, 72), context=F(2, 3, 6)), ValueError,
     r"^modulation must be \[batch, 1, 72\] or \[1, 1, 72\]"),
    ("ditblock-context-width", "ditblock", lambda m: m(X, F(2, 1, 72), context=F(2, 3, 5)), ValueError,
     r"^context must be \[batch, m, 6\]"),
    ("dit-t-scalar", "dit", lambda m: m(F(2, 4, 2), 0.5, labels=I(2), cond=F(2, 3), context=F(2, 3, 5)), ValueError,
     r"^t must be \[batch\] \(batch=2 as x's\).*scalar"),
    ("dit-t-batch", "dit", lambda m: m(F(2, 4, 2), F(3), labels=I(2), cond=F(2, 3), context=F(2, 3, 5)), ValueError,
     r"^t must be \[batch\] \(batch=2 as x's\), got shape \(3,\)"),
    ("dit-t-bool", "dit", lambda m: m(F(2, 4, 2), jnp.ones(2, bool), labels=I(2), cond=F(2, 3), context=F(2, 3, 5)),
     TypeError, r"^t must have an integer or floating"),
    ("dit-labels-float", "dit", lambda m: m(F(2, 4, 2), F(2), labels=F(2), cond=F(2, 3), context=F(2, 3, 5)),
     TypeError, r"^labels must have an integer"),
    ("dit-labels-shape", "dit", lambda m: m(F(2, 4, 2), F(2), labels=I(2, 1), cond=F(2, 3), context=F(2, 3, 5)),
     ValueError, r"^labels must be \[batch\]"),
    ("dit-cond-width", "dit", lambda m: m(F(2, 4, 2), F(2), labels=I(2), cond=F(2, 4), context=F(2, 3, 5)),
     ValueError, r"^cond must be \[batch, 3\] \(batch=2 as x's, cond_features=3\)"),
    ("dit-context-width", "dit", lambda m: m(F(2, 4, 2), F(2), labels=I(2), cond=F(2, 3), context=F(2, 3, 4)),
     ValueError, r"^context must be \[batch, m, 5\]"),
    ("dit-x-int", "dit", lambda m: m(I(2, 4, 2), F(2), labels=I(2), cond=F(2, 3), context=F(2, 3, 5)), TypeError,
     r"^x must have a floating"),
    ("dit-x-2d", "dit", lambda m: m(F(4, 2), F(2), labels=I(2), cond=F(2, 3), context=F(2, 3, 5)), ValueError,
     r"^x must be \[batch, n, 2\] \(in_features=2\)"),
    ("dit-mask", "dit", lambda m: m(F(2, 4, 2), F(2), labels=I(2), cond=F(2, 3), context=F(2, 3, 5), mask=KV3),
     ValueError, r"^mask\.kv_lengths must have shape \(2,\)"),
    ("dit-context-mask", "dit",
     lambda m: m(F(2, 4, 2), F(2), labels=I(2), cond=F(2, 3), context=F(2, 3, 5), context_mask=KV3),
     ValueError, r"^context_mask: mask\.kv_lengths"),
    ("dit-conditioning-t", "dit", lambda m: m.conditioning(F(2, 1), labels=I(2), cond=F(2, 3)), ValueError,
     r"^t must be \[batch\]"),
    ("dit-hidden-c", "dit", lambda m: m.hidden(F(2, 4, 2), F(2, 4), context=F(2, 3, 5)), ValueError,
     r"^c must be \[batch, 8\] \(batch=2 as x's, features=8\)"),
    ("dit-image-3d", "dit_image", lambda m: m(F(2, 4, 2), F(2)), ValueError,
     r"^x must be \[batch, H, W, 2\] \(in_features=2\)"),
    ("dit-image-patch", "dit_image", lambda m: m(F(2, 4, 3, 2), F(2)), ValueError, r"^patch_size \(2\) must divide"),
    # Conditioners
    ("mab-y-width", "mab", lambda m: m(F(2, 3, 8), F(2, 4, 8)), ValueError,
     r"^y must be \[batch, m, 6\] \(batch=2 as x's, context_features=6\)"),
    ("mab-y-batch", "mab", lambda m: m(F(2, 3, 8), F(1, 4, 6)), ValueError, r"^y must be .*batch=2 as x's"),
    ("mab-x-width", "mab", lambda m: m(F(2, 3, 6), F(2, 4, 6)), ValueError, r"^x must be \[batch, n, 8\]"),
    ("sab-x-width", "sab", lambda m: m(F(2, 5, 4)), ValueError, r"^x must be \[batch, n, 8\] \(features=8\)"),
    ("isab-x-width", "isab", lambda m: m(F(2, 5, 6)), ValueError,
     r"^x must be \[batch, n, 8\] \(features=8\), got shape \(2, 5, 6\)"),
    ("isab-x-int", "isab", lambda m: m(I(2, 5, 8)), TypeError, r"^x must have a floating"),
    ("isab-mask-batch", "isab", lambda m: m(X, mask=KV3), ValueError, r"^mask\.kv_lengths must have shape \(2,\)"),
    ("isab-mask-kind", "isab", lambda m: m(X, mask=CausalMask()), ValueError, r"^mask must be a probjax key-length"),
    ("pma-x-2d", "pma", lambda m: m(F(5, 8)), ValueError, r"^x must be \[batch, n, 8\]"),
    ("conditioner-context-width", "conditioner", lambda m: m(F(2, 5, 4)), ValueError,
     r"^context must be \[batch, n, 3\] \(context_features=3\)"),
    ("timestep-embedding-t", None, lambda _: timestep_embedding(F(2, 1), 4), ValueError, r"^t must be \[batch\]"),
    # MoE
    ("route-logits", None, lambda _: route(F(2, 3, 4), 1), ValueError, r"^logits must be \[tokens, num_experts\]"),
    ("moe-x-width", "moe", lambda m: m(F(2, 5, 4)), ValueError,
     r"^x must be \[batch, seq, 8\] or \[tokens, 8\] \(d_model=8\)"),
    ("moe-x-4d", "moe", lambda m: m(F(1, 2, 5, 8)), ValueError, r"^x must be \[batch, seq, 8\] or \[tokens, 8\]"),
    ("moe-x-int", "moe", lambda m: m(I(2, 5, 8)), TypeError, r"^x must have a floating"),
    # Mamba, Mamba2
    ("mamba-x-width", "mamba", lambda m: m(F(2, 5, 4)), ValueError,
     r"^x must be \[batch, length, 8\] \(d_model=8\)"),
    ("mamba-x-2d", "mamba", lambda m: m(F(5, 8)), ValueError, r"^x must be \[batch, length, 8\]"),
    ("mamba-x-int", "mamba", lambda m: m(I(2, 5, 8)), TypeError, r"^x must have a floating"),
    ("mamba-step-x", "mamba", lambda m: m.step(F(2, 1, 8), m.init_state(2)), ValueError,
     r"^x must be \[batch, 8\] \(d_model=8\)"),
    ("mamba-step-no-state", "mamba", lambda m: m.step(F(2, 8), None), TypeError, r"^state must be a MambaState"),
    ("mamba-state-type", "mamba", lambda m: m(X, (F(2, 3, 16), F(2, 16, 2))), TypeError,
     r"^state must be a MambaState"),
    ("mamba-state-batch", "mamba", lambda m: m(X, m.init_state(3)), ValueError,
     r"^state\.conv must be \[batch, 3, 16\] \(batch=2 as x's"),
    ("mamba2-state-ssm", "mamba2", lambda m: m.step(F(2, 8), MambaState(m.init_state(2).conv, F(2, 4, 2, 2))),
     ValueError, r"^state\.ssm must be \[batch, 4, 4, 2\] .*heads=4"),
    # RAttention
    ("rla-x-width", "rla", lambda m: m(F(2, 5, 4)), ValueError, r"^x must be \[batch, length, 8\] \(in_features=8\)"),
    ("rla-x-int", "rla", lambda m: m(I(2, 5, 8)), TypeError, r"^x must have a floating"),
    ("rla-step-state-type", "rla", lambda m: m.step(F(2, 8), None), TypeError, r"^state must be an RAttentionState"),
    ("rla-step-state-batch", "rla", lambda m: m.step(F(2, 8), m.init_state(1)), ValueError,
     r"^state\.k must be \[batch, 3, 2, 4\] \(batch=2 as x's"),
    ("rla-step-x", "rla", lambda m: m.step(X, m.init_state(2)), ValueError, r"^x must be \[batch, 8\]"),
    # MultiHeadLatentAttention
    ("mla-x-width", "mla", lambda m: m(F(2, 5, 4)), ValueError, r"^x must be \[batch, seq, 8\] \(in_features=8\)"),
    ("mla-x-int", "mla", lambda m: m(I(2, 5, 8)), TypeError, r"^x must have a floating"),
    ("mla-positions", "mla", lambda m: m(X, positions=F(2, 5)), TypeError, r"^positions must have an integer"),
    ("mla-dense-mask", "mla", lambda m: m(X, mask=jnp.ones((2, 1, 5, 5), bool)), TypeError,
     r"^mask must be a probjax Mask"),
    ("mla-mask-batch", "mla", lambda m: m(X, mask=KV3), ValueError, r"^mask\.kv_lengths must have shape \(2,\)"),
    ("mla-prefill-cache-batch", "mla", lambda m: m.prefill(X, m.init_cache(3, 8), jnp.array([5, 5])), ValueError,
     r"^cache\.k must be \[batch, max_len, 1, 4\] \(batch=2 as x's"),
    ("mla-decode-cache-type", "mla", lambda m: m.decode_step(F(2, 1, 8), None), TypeError,
     r"^cache must be a latent cache"),
]


@pytest.mark.parametrize("name, call, exc, pattern", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_input_names_the_argument(name, call, exc, pattern):
  with pytest.raises(exc, match=pattern):
    trace(name, call)


def test_checks_run_at_trace_time_under_jit():
  m = make("mha")
  f = nnx.jit(lambda m, x: m(x))
  with pytest.raises(ValueError, match=r"^x must be \[batch, seq, 8\] \(in_features=8\)"):
    f(m, F(2, 5, 4))
  isab = make("isab")
  with pytest.raises(ValueError, match=r"^x must be \[batch, n, 8\]"):
    nnx.jit(lambda m, x: m(x))(isab, F(2, 5, 6))


def prefilled(m):
  """A cache of 8 positions after a prefill of X (valid lengths 5 and 3)."""
  return m.prefill(X, m.init_cache(2, 8), jnp.array([5, 3]))[1]


# (id, layer name, call(layer) -> an array whose shape is checked)
GOOD = [
    ("mha", "mha", lambda m: m(X, positions=I(2, 5), mask=KV2), (2, 5, 8)),
    ("mha-dense-mask", "mha", lambda m: m(X, mask=jnp.ones((2, 1, 5, 5), bool)), (2, 5, 8)),
    ("mha-decode", "mha", lambda m: m.decode_step(F(2, 1, 8), prefilled(m))[0], (2, 1, 8)),
    ("cross", "cross", lambda m: m(X, F(2, 3, 6), mask=KVLenMask(jnp.array([3, 1]))), (2, 5, 8)),
    ("mlp", "mlp", lambda m: m(F(3, 8)), (3, 8)),
    ("film", "film", lambda m: m(F(2, 3))[0][0], (2, 1, 8)),
    ("block", "block", lambda m: m(X, context=F(2, 3, 6), film=F(2, 3), positions=I(2, 5)), (2, 5, 8)),
    ("transformer", "transformer", lambda m: m(X, mask=KV2), (2, 5, 8)),
    ("transformer-decode", "transformer",
     lambda m: m.decode_step(F(2, 1, 8), KVCache.init(2, 8, kv_heads=2, head_dim=4, num_layers=2, layout="stacked"))[0],
     (2, 1, 8)),
    ("lm", "lm", lambda m: m(I(2, 5)), (2, 5, 5)),
    ("lm-decode", "lm", lambda m: m.decode_step(I(2, 1), m.init_cache(2, 4))[0], (2, 1, 5)),
    ("generate", "lm", lambda m: generate(m, I(2, 3), jnp.array([3, 2]), max_new_tokens=2)[0], (2, 2)),
    ("ditblock", "ditblock", lambda m: m(X, F(1, 1, 72), context=F(2, 3, 6)), (2, 5, 8)),
    ("dit", "dit", lambda m: m(F(2, 4, 2), jnp.array([1, 500]), labels=I(2), cond=F(2, 3), context=F(2, 3, 5),
                               mask=KVLenMask(jnp.array([4, 2]))), (2, 4, 2)),
    ("dit-image", "dit_image", lambda m: m(F(2, 4, 4, 2), F(2)), (2, 4, 4, 2)),
    ("mab", "mab", lambda m: m(F(2, 3, 8), F(2, 4, 6), mask=KVLenMask(jnp.array([4, 2]))), (2, 3, 8)),
    ("sab", "sab", lambda m: m(X, mask=KV2), (2, 5, 8)),
    ("isab", "isab", lambda m: m(X, mask=KV2), (2, 5, 8)),
    ("pma", "pma", lambda m: m(X, mask=KV2), (2, 1, 8)),
    ("conditioner", "conditioner", lambda m: m(F(2, 5, 3), mask=KV2), (2, 2, 8)),
    ("moe", "moe", lambda m: m(F(2, 5, 8))[0], (2, 5, 8)),
    ("moe-tokens", "moe", lambda m: m(F(4, 8))[0], (4, 8)),
    ("mamba", "mamba", lambda m: m(X, m.init_state(2)), (2, 5, 8)),
    ("mamba-step", "mamba", lambda m: m.step(F(2, 8), m.init_state(2))[0], (2, 8)),
    ("mamba2-step", "mamba2", lambda m: m.step(F(2, 8), m.init_state(2))[0], (2, 8)),
    ("rla", "rla", lambda m: m(X), (2, 5, 8)),
    ("rla-step", "rla", lambda m: m.step(F(2, 8), m.init_state(2))[0], (2, 8)),
    ("mla", "mla", lambda m: m(X, positions=I(2, 5), mask=KV2), (2, 5, 8)),
    ("mla-decode", "mla", lambda m: m.decode_step(F(2, 1, 8), prefilled(m))[0], (2, 1, 8)),
]


@pytest.mark.parametrize("name, call, shape", [g[1:] for g in GOOD], ids=[g[0] for g in GOOD])
def test_valid_inputs_still_run(name, call, shape):
  assert trace(name, call).shape == shape


# -- masks: what the band constructors refuse, and what negative offsets mean ------------------
@pytest.mark.parametrize("make_mask, exc, pattern", [
    (lambda: CausalMask(1.5), TypeError, "offset"),
    (lambda: CausalMask(True), TypeError, "offset"),
    (lambda: LocalWindowMask(-1), ValueError, "left"),
    (lambda: LocalWindowMask(2, -1), ValueError, "right"),
    (lambda: LocalWindowMask(None, None), ValueError, "at least one"),
    (lambda: LocalWindowMask(2, 0, offset=0.5), TypeError, "offset"),
    (lambda: Mask(lower=True), TypeError, "Mask.lower"),
    (lambda: Mask(upper=1.0), TypeError, "Mask.upper"),
])
def test_band_constructors_refuse(make_mask, exc, pattern):
  with pytest.raises(exc, match=pattern):
    make_mask()


def test_negative_causal_offsets_mean_fewer_keys():
  # k <= q + offset for every int offset: -1 is strictly causal; queries that see no key
  # (the first -offset ones, or all of them) return zeros.
  q = jax.random.normal(jax.random.key(0), (1, 6, 1, 4))
  strict = dot_product_attention(q, q, q, mask=CausalMask(-1))
  assert bool((strict[:, 0] == 0).all()) and bool((strict[:, 1:] != 0).any())
  np.testing.assert_allclose(strict[:, 1], q[:, 0], rtol=1e-6)  # query 1 sees key 0 only
  assert bool((dot_product_attention(q, q, q, mask=CausalMask(-100)) == 0).all())
