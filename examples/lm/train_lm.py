"""Train a small decoder-only LM on synthetic arithmetic, then generate through the KV cache.

Documents are character-level sums such as ``^37+405=442$`` (``^`` begins and ``$`` ends a
document) generated in code. They are packed into rows of ``--seq`` tokens: a
``SegmentMask`` keeps documents apart and each document's positions restart at 0, so the
model sees each sum as if it ran alone. Training is optax AdamW on the next-token loss within
documents; generation prompts the model with ``^a+b=`` and decodes the answer greedily and
by top-k sampling (``probjax.nn.layers.decoding.generate``: prefill + on-device loop, stopped
at ``$``).

    python examples/lm/train_lm.py                     # 100k parameters, ~2 minutes on 2 CPU cores:
                                                       # greedy decoding then solves 2-digit sums
    python examples/lm/train_lm.py --tiny --steps 30   # what the test runs
"""

from __future__ import annotations

import argparse
import functools
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from probjax.nn.layers.decoding import generate
from probjax.nn.layers.transformer import TransformerLM
from probjax.ops.attention.masks import SegmentMask

CHARS = "0123456789+=^$"
PAD, BOS, EOS = len(CHARS), CHARS.index("^"), CHARS.index("$")
VOCAB = len(CHARS) + 1  # + padding


def encode(s: str) -> list[int]:
  return [CHARS.index(c) for c in s]


def decode(ids) -> str:
  return "".join(CHARS[i] if i < len(CHARS) else "" for i in ids)


def make_sum(rng: np.random.Generator, digits: int) -> tuple[str, str]:
  """``("^a+b=", "c$")`` for random ``a, b`` of up to ``digits`` digits."""
  a, b = rng.integers(0, 10 ** digits, size=2)
  return f"^{a}+{b}=", f"{a + b}$"


def packed_batch(rng: np.random.Generator, batch: int, seq: int, digits: int):
  """Rows of packed documents: ``tokens``, ``segment_ids`` (1, 2, ...; 0 for padding) and
  per-document ``positions``, each ``[batch, seq]`` int32."""
  tokens = np.full((batch, seq), PAD, np.int32)
  seg = np.zeros((batch, seq), np.int32)
  pos = np.zeros((batch, seq), np.int32)
  for r in range(batch):
    t, doc = 0, 1
    while True:
      ids = encode("".join(make_sum(rng, digits)))
      if t + len(ids) > seq:
        break
      tokens[r, t:t + len(ids)] = ids
      seg[r, t:t + len(ids)] = doc
      pos[r, t:t + len(ids)] = np.arange(len(ids))
      t, doc = t + len(ids), doc + 1
  return tokens, seg, pos


def loss_fn(model, tokens, seg, pos):
  """Mean next-token cross-entropy over positions whose target is in the same document."""
  logits = model(tokens, positions=pos, mask=SegmentMask(seg), deterministic=True)
  valid = (seg[:, 1:] == seg[:, :-1]) & (seg[:, 1:] > 0)
  ce = optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], tokens[:, 1:])
  return jnp.sum(ce * valid) / jnp.maximum(valid.sum(), 1)


def make_train_step(graphdef, tx):
  @functools.partial(jax.jit, donate_argnums=(0, 1))
  def step(params, opt_state, tokens, seg, pos):
    loss, grads = jax.value_and_grad(lambda p: loss_fn(nnx.merge(graphdef, p), tokens, seg, pos))(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss
  return step


def build(args):
  model = TransformerLM(vocab_size=VOCAB, features=args.features, num_layers=args.layers,
                        num_heads=args.heads, num_kv_heads=args.kv_heads, qk_norm=True,
                        mlp="swiglu", norm="rmsnorm", rngs=nnx.Rngs(args.seed))
  return model


def evaluate(model, np_rng, n: int, digits: int, **sample):
  """Prompts ``^a+b=`` and decodes the answers; returns (accuracy, [(prompt, answer, ok), ...])."""
  pairs = [make_sum(np_rng, digits) for _ in range(n)]
  prompts = [encode(p) for p, _ in pairs]
  width = max(map(len, prompts))
  arr = np.full((n, width), PAD, np.int32)
  for i, p in enumerate(prompts):
    arr[i, :len(p)] = p
  lengths = np.array([len(p) for p in prompts], np.int32)
  toks, num = generate(model, arr, lengths, max_new_tokens=digits + 2, eos_id=EOS, pad_id=PAD, **sample)
  toks, num = np.asarray(toks), np.asarray(num)
  rows = []
  for (p, want), t, k in zip(pairs, toks, num):
    got = decode(t[:k])
    rows.append((p, got, got == want))
  return float(np.mean([r[2] for r in rows])), rows


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--tiny", action="store_true", help="a tiny model and batch (the test)")
  ap.add_argument("--steps", type=int, default=None, help="training steps (default 600; --tiny: 30)")
  ap.add_argument("--batch", type=int, default=None)
  ap.add_argument("--seq", type=int, default=None, help="packed row length")
  ap.add_argument("--features", type=int, default=None)
  ap.add_argument("--layers", type=int, default=None)
  ap.add_argument("--heads", type=int, default=None)
  ap.add_argument("--kv-heads", type=int, default=None)
  ap.add_argument("--digits", type=int, default=None)
  ap.add_argument("--lr", type=float, default=None)
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument("--samples", type=int, default=None, help="generated examples to print")
  args = ap.parse_args(argv)
  defaults = (dict(steps=30, batch=4, seq=64, features=32, layers=2, heads=4, kv_heads=2, digits=2,
                   lr=1e-2, samples=4) if args.tiny else
              dict(steps=600, batch=16, seq=128, features=64, layers=2, heads=4, kv_heads=2,
                   digits=2, lr=3e-3, samples=8))
  for k, v in defaults.items():
    if getattr(args, k) is None:
      setattr(args, k, v)

  from tqdm.auto import tqdm

  model = build(args)
  graphdef, params = nnx.split(model)
  n_params = sum(x.size for x in jax.tree.leaves(params))
  print(f"TransformerLM: {n_params:,} parameters, {args.layers} layers, d_model {args.features}, "
        f"{args.heads} heads / {args.kv_heads} KV heads; {jax.devices()[0].platform}")
  sched = optax.warmup_cosine_decay_schedule(0.0, args.lr, max(1, args.steps // 10), args.steps,
                                             args.lr * 0.1)
  tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(sched, weight_decay=0.01))
  opt_state = tx.init(params)
  step = make_train_step(graphdef, tx)
  rng = np.random.default_rng(args.seed)
  losses = []
  bar = tqdm(range(args.steps), desc="train", file=sys.stdout, mininterval=0.5)
  t0 = time.perf_counter()
  for i in bar:
    batch = packed_batch(rng, args.batch, args.seq, args.digits)
    params, opt_state, loss = step(params, opt_state, *map(jnp.asarray, batch))
    losses.append(float(loss))
    bar.set_postfix(loss=f"{losses[-1]:.3f}", refresh=False)
  bar.close()
  print(f"loss {losses[0]:.3f} -> {losses[-1]:.3f} in {time.perf_counter() - t0:.1f} s")

  model = nnx.merge(graphdef, params)
  eval_rng = np.random.default_rng(args.seed + 1)
  greedy_acc, greedy = evaluate(model, eval_rng, args.samples, args.digits)
  sampled_acc, sampled = evaluate(model, eval_rng, args.samples, args.digits, temperature=0.7, top_k=5,
                                  rng=jax.random.key(args.seed))
  for name, acc, rows in (("greedy", greedy_acc, greedy), ("top-5 T=0.7", sampled_acc, sampled)):
    print(f"{name}: {acc:.0%} exact")
    for p, got, ok in rows:
      print(f"  {p}{got}  {'ok' if ok else 'x'}")
  return dict(losses=losses, greedy_accuracy=greedy_acc, sampled_accuracy=sampled_acc,
              greedy=greedy, sampled=sampled, num_params=n_params)


if __name__ == "__main__":
  main()
