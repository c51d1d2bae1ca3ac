"""TransformerLM (GQA + RoPE + q/k-norm): KV-cache decoding against the full forward, packed
documents against each document alone, generation."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from probjax.nn.layers.attention import dot_product_attention
from probjax.nn.layers.decoding import decode_loop, generate, sample_logits
from probjax.nn.layers.transformer import TransformerLM
from probjax.ops.attention.masks import SegmentMask
from probjax.testing import numpy_init



LENGTHS = np.array([5, 2, 7])   # prompt lengths per element (right-padded to P = 7)
P, M, V = 7, 4, 13              # prompt width, continuation tokens, vocab
TOL = dict(atol=2e-5, rtol=2e-5)


@pytest.fixture(scope="module")
def setup():
  lm = numpy_init(lambda: TransformerLM(
      vocab_size=V, features=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
      qk_norm=True, rotary=True, tie_embeddings=False,
      attention_fn=functools.partial(dot_product_attention, implementation="xla"),
      rngs=nnx.Rngs(0)))
  rng = np.random.default_rng(0)
  seqs = [rng.integers(0, V, n + M) for n in LENGTHS]   # element b: prompt (n tokens) + M more
  full = np.zeros((3, P + M), np.int32)                  # right-padded full sequences
  prompts = np.zeros((3, P), np.int32)
  cont = np.zeros((3, M), np.int32)
  for b, (s, n) in enumerate(zip(seqs, LENGTHS)):
    full[b, :len(s)] = s
    prompts[b, :n] = s[:n]
    cont[b] = s[n:]
  forward = nnx.jit(lambda m, t: m(t))
  return lm, forward, jnp.asarray(full), jnp.asarray(prompts), jnp.asarray(cont)


def _at(logits, b, i):
  return np.asarray(logits[b, i])


def test_cache_decode_matches_full_forward(setup):
  lm, forward, full, prompts, cont = setup
  want = forward(lm, full)                                        # [3, P + M, V]
  prefill = nnx.jit(lambda m, t, n, c: m.prefill(t, n, c))
  step = nnx.jit(lambda m, t, c: m.decode_step(t, c), donate_argnums=(2,))
  lengths = jnp.asarray(LENGTHS)

  # Prefill, then one token per step.
  logits, cache = prefill(lm, prompts, lengths, lm.init_cache(3, 16))
  for b, n in enumerate(LENGTHS):
    np.testing.assert_allclose(_at(logits, b, n - 1), _at(want, b, n - 1), **TOL)
  for j in range(M):
    logits, cache = step(lm, cont[:, j:j + 1], cache)
    assert cache.lengths.tolist() == (LENGTHS + j + 1).tolist()
    for b, n in enumerate(LENGTHS):
      np.testing.assert_allclose(_at(logits, b, 0), _at(want, b, n + j), **TOL)

  # Prefill, then 3 tokens in one step (causal within them, per-element offsets), then 1; in
  # both cache layouts.
  # (The stacked layout shares the attention code; its own part is the layer scan.)
  for layout in ("per_layer", "stacked"):
    cache = lm.init_cache(3, 16, layout=layout)
    assert isinstance(cache.k, tuple) == (layout == "per_layer")
    logits, cache = prefill(lm, prompts, lengths, cache)
    logits3, cache = step(lm, cont[:, :3], cache)
    assert cache.lengths.tolist() == (LENGTHS + 3).tolist()
    if layout == "per_layer":
      logits1, cache = step(lm, cont[:, 3:], cache)
    for b, n in enumerate(LENGTHS):
      np.testing.assert_allclose(_at(logits, b, n - 1), _at(want, b, n - 1), **TOL)
      for j in range(3):
        np.testing.assert_allclose(_at(logits3, b, j), _at(want, b, n + j), **TOL)
      if layout == "per_layer":
        np.testing.assert_allclose(_at(logits1, b, 0), _at(want, b, n + 3), **TOL)


@pytest.mark.slow  # three eager generate loops
def test_generate_greedy_sampled_and_eos(setup):
  lm, forward, _, prompts, _ = setup
  lengths = jnp.asarray(LENGTHS)
  toks, num = generate(lm, prompts, lengths, max_new_tokens=M)
  assert toks.shape == (3, M) and num.tolist() == [M] * 3
  # Greedy is the argmax of the full forward over prompt + generated tokens.
  full = np.zeros((3, P + M), np.int32)
  for b, n in enumerate(LENGTHS):
    full[b, :n], full[b, n:n + M] = np.asarray(prompts[b, :n]), np.asarray(toks[b])
  logits = forward(lm, jnp.asarray(full))
  for b, n in enumerate(LENGTHS):
    assert np.argmax(np.asarray(logits[b, n - 1:n - 1 + M]), -1).tolist() == np.asarray(toks[b]).tolist()
  # Sampling from the top 1 is greedy whatever the temperature (the same compiled program).
  t1, _ = generate(lm, prompts, lengths, max_new_tokens=M, temperature=2.0, top_k=1, rng=jax.random.key(5))
  np.testing.assert_array_equal(t1, toks)
  # EOS: the while_loop variant stops each element at its first EOS and pads after it.
  eos = int(toks[0, 1])
  te, ne = generate(lm, prompts, lengths, max_new_tokens=M, eos_id=eos, pad_id=V)
  for b in range(3):
    row = np.asarray(toks[b]).tolist()
    k = row.index(eos) + 1 if eos in row else M
    assert int(ne[b]) == k
    assert np.asarray(te[b]).tolist() == row[:k] + [V] * (M - k)


def test_decode_loop_early_stop_and_sampling(setup):
  lm = setup[0]
  cache = lm.init_cache(3, 8)
  eos = 3
  run = nnx.jit(lambda m, c, t: decode_loop(m, c, t, jax.random.key(0), num_steps=5, eos_id=eos,
                                            pad_id=0, early_stop=True))
  toks, done, cache2, steps = run(lm, cache, jnp.array([eos, eos, eos]))  # done before the first step
  assert int(steps) == 0 and done.all() and (np.asarray(toks) == 0).all()
  assert cache2.lengths.tolist() == [0, 0, 0]
  # top-k sampling never leaves the k largest logits, in proportion to their probabilities;
  # top_k=1 is greedy whatever the temperature (traced temperature and top_k: one compilation).
  logits = np.tile(np.array([[0.0, 3.0, 1.0, 2.9, -1.0]], np.float32), (4000, 1))
  logits[:8] = np.random.default_rng(0).standard_normal((8, 5))
  p3 = np.exp(2.9) / (np.exp(3.0) + np.exp(2.9))
  traced = jax.jit(sample_logits)
  static = jax.jit(sample_logits, static_argnames=("temperature", "top_k"))
  for sample, f32, i32 in ((traced, jnp.float32, jnp.int32), (static, float, int)):
    s = np.asarray(sample(logits, jax.random.key(1), temperature=f32(1.0), top_k=i32(2)))[8:]
    assert set(s.tolist()) == {1, 3}
    assert abs((s == 3).mean() - p3) < 0.03
    np.testing.assert_array_equal(sample(logits, jax.random.key(3), temperature=f32(5.0), top_k=i32(1)),
                                  np.argmax(logits, -1))


def test_packed_documents_equal_separate_documents(setup):
  lm, forward = setup[:2]
  rng = np.random.default_rng(4)
  doc_lengths = [[4, 3, 5], [6, 6]]                     # two rows of 12 tokens
  docs = [[rng.integers(0, V, n) for n in row] for row in doc_lengths]
  tokens = np.stack([np.concatenate(row) for row in docs]).astype(np.int32)
  seg = np.stack([np.repeat(np.arange(len(r)), r) for r in doc_lengths]).astype(np.int32)
  pos = np.stack([np.concatenate([np.arange(n) for n in r]) for r in doc_lengths]).astype(np.int32)
  packed = nnx.jit(lambda m, t, s, p: m(t, positions=p, mask=SegmentMask(s)))(lm, tokens, seg, pos)
  # Each document alone (right-padded into one batch: causal, so padding is never seen).
  flat = [d for row in docs for d in row]
  alone = np.zeros((len(flat), 6), np.int32)
  for i, d in enumerate(flat):
    alone[i, :len(d)] = d
  want = forward(lm, jnp.asarray(alone))
  i = 0
  for r, row in enumerate(docs):
    start = 0
    for d in row:
      np.testing.assert_allclose(packed[r, start:start + len(d)], want[i, :len(d)], **TOL)
      start, i = start + len(d), i + 1


def test_generate_without_lengths_is_full_length_prompts(setup):
  """Unpadded prompts: ``lengths`` omitted equals ``lengths = P`` for every element (one
  compilation: the lengths are an argument), greedy and sampled."""
  lm, _, _, prompts, _ = setup
  full = jnp.full((prompts.shape[0],), prompts.shape[1], jnp.int32)
  for kw in (dict(), dict(temperature=1.5, top_k=4, rng=jax.random.key(2))):
    toks, n = generate(lm, prompts, max_new_tokens=M, **kw)
    want, want_n = generate(lm, prompts, full, max_new_tokens=M, **kw)
    np.testing.assert_array_equal(toks, want)
    np.testing.assert_array_equal(n, want_n)
  with pytest.raises(TypeError, match="lengths"):
    generate(lm, prompts, full.astype(jnp.float32), max_new_tokens=M)


def _subjaxprs(eqn):
  """The jaxprs nested in ``eqn``'s parameters (a scan's body, a jit's program, ...)."""
  for param in eqn.params.values():
    for sub in param if isinstance(param, (list, tuple)) else (param,):
      inner = getattr(sub, "jaxpr", sub)
      if hasattr(inner, "eqns"):
        yield inner


def _kernel_names(eqns, out):
  """The names of the kernel calls (Pallas) in ``eqns`` and every jaxpr nested in them."""
  for eqn in eqns:
    name = eqn.params.get("name", eqn.params.get("name_and_src_info"))
    if eqn.primitive.name in ("pallas_call", "mpmd_map") and name is not None:
      out.append(str(name))
    for inner in _subjaxprs(eqn):
      _kernel_names(inner.eqns, out)
  return out


@pytest.mark.parametrize("scan_layers", [False, True], ids=["unrolled", "scanned"])
@pytest.mark.parametrize("implementation", ["mosaic", "triton"])
def test_a_training_step_traces_one_attention_forward_and_backward_per_layer(implementation, scan_layers):
  # Unrolled, each layer's block is in the program: one forward kernel per layer. Scanned, the
  # block is traced once. A second forward per layer (recomputed for the backward's residuals)
  # would cost a forward per layer.
  lm = TransformerLM(vocab_size=64, features=128, num_layers=2, num_heads=2, head_dim=64, rotary=True,
                     qk_norm=True, dtype=jnp.bfloat16, scan_layers=scan_layers, rngs=nnx.Rngs(0),
                     attention_fn=functools.partial(dot_product_attention, implementation=implementation,
                                                    interpret=True))
  graphdef, params = nnx.split(lm)
  tokens = jax.random.randint(jax.random.key(0), (1, 128), 0, 64)

  def loss(p):
    logits = nnx.merge(graphdef, p)(tokens).astype(jnp.float32)
    return -jnp.mean(jax.nn.log_softmax(logits)[:, :-1, 0])

  names = _kernel_names(jax.make_jaxpr(jax.jit(jax.value_and_grad(loss)))(params).jaxpr.eqns, [])
  forwards = [n for n in names if n.startswith("probjax_attention_fwd")]
  backwards = [n for n in names if n.startswith("probjax_attention_bwd")]
  assert len(forwards) == (1 if scan_layers else 2) and len(backwards) >= len(forwards), names


@pytest.mark.gpu
@pytest.mark.parametrize("implementation,target", [("mosaic", "mosaic_gpu_v2"),
                                                   ("cudnn", "probjax_cudnn_sdpa_fwd_stats")])
def test_gpu_a_compiled_training_step_launches_one_forward_per_layer(implementation, target):
  # The default (unrolled) stack. Under nnx.scan, XLA's GPU dynamic-slice fusion copies a
  # custom-call kernel whose output is stacked into the scan's residual buffers, and the copy
  # and the original both run (docs/dev/decisions.md, the LM step's kernel profile): that is
  # why the layers are unrolled by default.
  if implementation == "cudnn":
    from probjax.ops.attention.backends.cudnn import ffi
    why = ffi.ready()
    if why is not None:
      pytest.skip(f"the cuDNN extension is not loaded: {why}")
  kw = dict(backward_pass_impl="triton_fused") if implementation == "mosaic" else {}
  lm = TransformerLM(vocab_size=256, features=256, num_layers=3, num_heads=4, head_dim=64,
                     dtype=jnp.bfloat16, rngs=nnx.Rngs(0),
                     attention_fn=functools.partial(dot_product_attention, implementation=implementation, **kw))
  graphdef, params = nnx.split(lm)
  tokens = jax.random.randint(jax.random.key(0), (2, 512), 0, 256)
  loss = lambda p: jnp.mean(nnx.merge(graphdef, p)(tokens).astype(jnp.float32))
  hlo = jax.jit(jax.value_and_grad(loss)).lower(params).compile().as_text()
  assert hlo.count(f'custom_call_target="{target}"') == 3
