"""Sampling and on-device decode loops for :class:`~probjax.nn.layers.transformer.TransformerLM`.

:func:`generate` prefills right-padded prompts (``lengths`` omitted: unpadded ones) into a fresh KV cache and decodes
``max_new_tokens`` tokens under one ``jax.jit``: a ``lax.scan`` over a fixed number of steps,
or, with ``eos_id``, a ``lax.while_loop`` that stops once every element has emitted EOS.
``temperature=0`` is greedy; otherwise softmax sampling at ``temperature`` over the ``top_k``
largest logits (all when None).

>>> import jax, jax.numpy as jnp
>>> from flax import nnx
>>> from probjax.nn.layers.transformer import TransformerLM
>>> lm = TransformerLM(vocab_size=7, features=8, num_layers=1, num_heads=2, rngs=nnx.Rngs(0))
>>> toks, n = generate(lm, jnp.array([[1, 2, 3], [4, 5, 0]]), jnp.array([3, 2]), max_new_tokens=4)
>>> toks.shape, n.tolist()
((2, 4), [4, 4])
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from probjax.nn.layers import kv_cache as kvc
from probjax.nn.layers._checks import check_array

__all__ = ["sample_logits", "decode_loop", "generate", "check_sampling"]


def _is_static(x) -> bool:
  return x is None or (isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, bool))


def check_sampling(vocab_size: int, temperature, top_k) -> None:
  """ValueError naming ``temperature`` / ``top_k`` for bad Python values (arrays pass)."""
  if isinstance(temperature, bool) or (_is_static(temperature) and not temperature >= 0):
    raise ValueError(f"temperature must be >= 0, got {temperature!r}")
  if isinstance(top_k, bool) or (_is_static(top_k) and top_k is not None and not 1 <= top_k <= vocab_size):
    raise ValueError(f"top_k must lie in [1, vocab_size={vocab_size}], got {top_k}")


def sample_logits(logits, rng, *, temperature=0.0, top_k=None):
  """Next tokens ``[batch]`` int32 from logits ``[batch, vocab]``: argmax for
  ``temperature == 0``, else a sample of ``softmax(logits / temperature)`` restricted to the
  ``top_k`` largest logits (None: all).

  Python values pick the branch at trace time (``lax.top_k``); arrays (e.g. traced under
  ``jax.jit``, so that changing them does not recompile) select it on device, with the
  ``top_k``-th largest logit from a sort of the vocabulary, which ``top_k=None`` skips (every
  logit is kept, whatever the temperature).
  """
  check_array("logits", logits, ("batch", "vocab"))
  check_sampling(logits.shape[-1], temperature, top_k)
  logits = logits.astype(jnp.float32)
  v = logits.shape[-1]
  if _is_static(temperature) and _is_static(top_k):
    if temperature == 0:
      return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    if top_k is not None and top_k < v:
      kth = jax.lax.top_k(logits, top_k)[0][..., -1:]
      logits = jnp.where(logits < kth, -jnp.inf, logits)
    return jax.random.categorical(rng, logits / temperature, axis=-1).astype(jnp.int32)
  temperature = jnp.asarray(temperature, jnp.float32)
  masked = logits
  if top_k is not None:  # the sort of [batch, vocab] per call that top_k=None does without
    k = jnp.clip(jnp.asarray(top_k, jnp.int32), 1, v)
    kth = jnp.take(jnp.sort(logits, axis=-1), v - k, axis=-1)[..., None]
    masked = jnp.where(logits < kth, -jnp.inf, logits)
  sampled = jax.random.categorical(rng, masked / jnp.where(temperature > 0, temperature, 1.0), axis=-1)
  return jnp.where(temperature > 0, sampled, jnp.argmax(logits, axis=-1)).astype(jnp.int32)


def decode_loop(model, cache: kvc.KVCache, token, rng, *, num_steps: int, temperature: float = 0.0,
                top_k: int | None = None, eos_id: int | None = None, pad_id: int = 0,
                early_stop: bool = False):
  """Feeds ``token [batch]`` and ``num_steps`` sampled tokens after it through ``model``'s cache.

  A pure function for use under ``jax.jit`` (donate the cache). Elements that have emitted
  ``eos_id`` emit ``pad_id`` afterwards. ``early_stop`` (needs ``eos_id``) runs a
  ``lax.while_loop`` that ends when every element is done; else a ``lax.scan``.

  Returns ``(tokens [batch, num_steps], done [batch], cache, steps)``: the tokens sampled
  after ``token``, whether each element has emitted EOS (``token`` included), the cache and
  the number of decode steps run.
  """
  if early_stop and eos_id is None:
    raise ValueError("early_stop needs eos_id")
  check_sampling(model.vocab_size, temperature, top_k)
  check_array("token", token, ("batch",), dtype="int")
  b = token.shape[0]
  eos = lambda t: (t == eos_id) if eos_id is not None else jnp.zeros_like(t, bool)

  # NNX graph nodes cannot cross into a lax loop's trace: the body closes over the model's
  # arrays (loop-invariant operands) and rebuilds the model from them.
  # With a per-layer cache, each layer's parameters are sliced from the stacked ones once, here,
  # not in every step.
  graphdef, state = nnx.split(model)
  per_layer = cache.per_layer and hasattr(model, "transformer")
  layer_splits = [nnx.split(b) for b in model.transformer.unstacked()] if per_layer else []
  leaves, treedef = jax.tree.flatten((state, [st for _, st in layer_splits]))

  def step(i, tok, done, cache):
    state_i, layer_states = jax.tree.unflatten(treedef, leaves)
    m = nnx.merge(graphdef, state_i)
    kw = {}
    if per_layer:
      kw["layers"] = [nnx.merge(gd, st) for (gd, _), st in zip(layer_splits, layer_states)]
    logits, cache = m.decode_step(tok[:, None], cache, **kw)
    nxt = sample_logits(logits[:, 0], jax.random.fold_in(rng, i), temperature=temperature, top_k=top_k)
    nxt = jnp.where(done, pad_id, nxt)
    return nxt, done | eos(nxt), cache

  out = jnp.full((b, num_steps), pad_id, jnp.int32)
  done = eos(token)
  if not early_stop:
    def body(carry, i):
      tok, done, cache = carry
      tok, done, cache = step(i, tok, done, cache)
      return (tok, done, cache), tok
    (_, done, cache), toks = jax.lax.scan(body, (token, done, cache), jnp.arange(num_steps))
    return toks.T, done, cache, jnp.asarray(num_steps, jnp.int32)

  def cond(c):
    i, _, done, _, _ = c
    return (i < num_steps) & ~jnp.all(done)

  def wbody(c):
    i, tok, done, cache, out = c
    tok, done, cache = step(i, tok, done, cache)
    return i + 1, tok, done, cache, out.at[:, i].set(tok)

  i, _, done, cache, out = jax.lax.while_loop(
      cond, wbody, (jnp.zeros((), jnp.int32), token, done, cache, out))
  return out, done, cache, i


@functools.partial(jax.jit, static_argnames=("graphdef", "max_new_tokens", "max_len", "eos_id", "pad_id",
                                             "cache_dtype"))
def _generate(graphdef, state, prompts, lengths, rng, temperature, top_k, *, max_new_tokens, max_len,
              eos_id, pad_id, cache_dtype):
  model = nnx.merge(graphdef, state)
  cache = model.init_cache(prompts.shape[0], max_len, cache_dtype)
  logits, cache = model.prefill(prompts, lengths, cache)
  last = jnp.take_along_axis(logits, (lengths - 1)[:, None, None], axis=1)[:, 0]
  k_first, k_loop = jax.random.split(rng)
  first = sample_logits(last, k_first, temperature=temperature, top_k=top_k)
  rest, done, _, _ = decode_loop(model, cache, first, k_loop, num_steps=max_new_tokens - 1,
                                 temperature=temperature, top_k=top_k, eos_id=eos_id, pad_id=pad_id,
                                 early_stop=eos_id is not None)
  toks = jnp.concatenate([first[:, None], rest], axis=1)
  if eos_id is None:
    n = jnp.full((prompts.shape[0],), max_new_tokens, jnp.int32)
  else:  # tokens up to and including the first EOS
    is_eos = toks == eos_id
    n = jnp.where(is_eos.any(1), jnp.argmax(is_eos, 1) + 1, max_new_tokens).astype(jnp.int32)
  return toks, n


def generate(model, prompts, lengths=None, *, max_new_tokens: int, max_len: int | None = None, rng=None,
             temperature: float = 0.0, top_k: int | None = None, eos_id: int | None = None,
             pad_id: int = 0, cache_dtype=None):
  """Generates ``max_new_tokens`` tokens after right-padded ``prompts [batch, P]`` under one
  ``jax.jit``.

  Args:
    model: a :class:`~probjax.nn.layers.transformer.TransformerLM` (anything with its
      ``vocab_size``, ``init_cache``, ``prefill`` and ``decode_step``).
    prompts: ``[batch, P]`` integer tokens, right-padded.
    lengths: ``[batch]`` integer valid prompt lengths, each in ``[1, P]``; None (default):
      every prompt is unpadded, all ``P`` tokens valid (``lengths = full((batch,), P)``).
    max_new_tokens: tokens to generate per element (>= 1).
    max_len: the cache's size (default ``P + max_new_tokens``); too small a one raises
      ValueError naming ``max_len``.
    rng: a ``jax.random.key`` for sampling (default ``key(0)``).
    temperature: 0 is greedy, else softmax sampling at it; top_k: sample among the ``top_k``
      largest logits (None: all). Both enter the program as values: greedy and sampled
      generation share one compilation, and so do all integer ``top_k``; None, which needs no
      sort of the vocabulary per token, compiles a program of its own.
    eos_id: an element stops at its first ``eos_id`` (None: never); pad_id: emitted after it.
    cache_dtype: the KV cache's dtype (default: the model's).

  Returns ``(tokens [batch, max_new_tokens], num_tokens [batch])``: ``pad_id`` after an
  element's EOS, whose count includes its EOS.

  >>> import jax.numpy as jnp
  >>> from flax import nnx
  >>> from probjax.nn.layers.transformer import TransformerLM
  >>> lm = TransformerLM(vocab_size=7, features=8, num_layers=1, num_heads=2, rngs=nnx.Rngs(0))
  >>> prompts = jnp.array([[1, 2, 3], [4, 5, 6]])
  >>> a, _ = generate(lm, prompts, max_new_tokens=3)            # unpadded: lengths are P = 3
  >>> b, _ = generate(lm, prompts, jnp.array([3, 3]), max_new_tokens=3)
  >>> bool((a == b).all())
  True
  """
  s = check_array("prompts", prompts, ("batch", "P"), dtype="int")
  if lengths is None:
    lengths = jnp.full((s["batch"][0],), s["P"][0], jnp.int32)
  check_array("lengths", lengths, ("batch",), dtype="int", sizes=s)
  prompts = jnp.asarray(prompts, jnp.int32)
  lengths = jnp.asarray(lengths, jnp.int32)
  if max_new_tokens < 1:
    raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
  check_sampling(model.vocab_size, temperature, top_k)
  p = prompts.shape[1]
  n = kvc._concrete(lengths)
  if n is not None and (n.min() < 1 or n.max() > p):
    raise ValueError(f"lengths must lie in [1, P={p}], got [{n.min()}, {n.max()}]")
  need = p + max_new_tokens - 1 if n is None else max(p, int(n.max()) + max_new_tokens - 1)
  max_len = p + max_new_tokens if max_len is None else int(max_len)
  if max_len < need:
    raise ValueError(f"max_len={max_len} is too small: the prompts and {max_new_tokens} new tokens "
                     f"need {need} cache positions")
  rng = jax.random.key(0) if rng is None else rng
  graphdef, state = nnx.split(model)
  return _generate(graphdef, state, prompts, lengths, rng, jnp.float32(temperature),
                   None if top_k is None else jnp.int32(top_k),
                   max_new_tokens=max_new_tokens, max_len=max_len, eos_id=eos_id,
                   pad_id=pad_id, cache_dtype=None if cache_dtype is None else np.dtype(cache_dtype).name)
