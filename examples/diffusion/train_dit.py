"""Train a tiny class-conditional DiT with flow matching on token sets, then sample by Euler steps.

Data (generated here): each example is a set of 8 to 16 points in 2-D drawn from one of
``--classes`` Gaussian mixtures (4 components on a circle of radius 2, rotated by the class
index, std 0.15); the sets are right-padded to 16 tokens and masked with ``KVLenMask``, so the
model sees each set at its own size. The DiT has no position embedding: it is
permutation-equivariant over a set's points.

Flow matching (rectified flow): ``x_t = (1 - t) x_0 + t x_1`` with noise ``x_0 ~ N(0, I)``
and data ``x_1``; the model predicts the velocity ``x_1 - x_0``, trained by its squared error
over the real tokens. Labels are dropped to the null label with probability 0.1 while
training, so that sampling can use classifier-free guidance ``v = v_null + w (v_label -
v_null)``. Sampling integrates ``dx/dt = v`` from ``t = 0`` to 1 in ``--sample-steps`` Euler
steps and reports how far the samples fall from their class's mixture centres.

    python examples/diffusion/train_dit.py                        # ~2 minutes on 2 CPU cores
    python examples/diffusion/train_dit.py --steps 20             # a smoke run, seconds
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

from probjax.nn.layers.dit import DiffusionTransformer
from probjax.ops.attention.masks import KVLenMask

COMPONENTS, RADIUS, STD = 4, 2.0, 0.15


def centres(num_classes: int) -> np.ndarray:
  """``[classes, COMPONENTS, 2]``: class ``k``'s mixture centres, rotated by ``k`` steps."""
  angle = (2 * np.pi * np.arange(COMPONENTS)[None] / COMPONENTS
           + np.pi / (COMPONENTS * num_classes) * np.arange(num_classes)[:, None])
  return RADIUS * np.stack([np.cos(angle), np.sin(angle)], axis=-1)


def mixture_sets(rng: np.random.Generator, batch: int, num_classes: int, min_size: int, max_size: int):
  """``(points [batch, max_size, 2] float32, sizes [batch], labels [batch])``; points past a
  set's size are padding (noise, which the mask keeps out)."""
  labels = rng.integers(0, num_classes, batch)
  sizes = rng.integers(min_size, max_size + 1, batch)
  comp = rng.integers(0, COMPONENTS, (batch, max_size))
  pts = centres(num_classes)[labels[:, None], comp] + STD * rng.standard_normal((batch, max_size, 2))
  return pts.astype(np.float32), sizes.astype(np.int32), labels.astype(np.int32)


# -- flow matching (shared with examples/set_conditioning) ---------------------------
def valid_tokens(sizes, n):
  return (jnp.arange(n)[None, :] < sizes[:, None]).astype(jnp.float32)


def flow_matching_loss(model, x1, sizes, key, **conditioning):
  """Mean squared velocity error over the real tokens of ``x1 [batch, n, d]``."""
  k0, kt = jax.random.split(key)
  x0 = jax.random.normal(k0, x1.shape, x1.dtype)
  t = jax.random.uniform(kt, (x1.shape[0],))
  xt = (1 - t[:, None, None]) * x0 + t[:, None, None] * x1
  v = model(xt, t, mask=KVLenMask(sizes), **conditioning)
  w = valid_tokens(sizes, x1.shape[1])[..., None]
  return jnp.sum(w * (v - (x1 - x0)) ** 2) / (jnp.sum(w) * x1.shape[-1])


def euler_sample(velocity, x0, steps: int):
  """``x_1`` from ``x_0`` by ``steps`` Euler steps of ``dx/dt = velocity(x, t [batch])``."""
  dt = 1.0 / steps

  def body(i, x):
    return x + dt * velocity(x, jnp.full((x.shape[0],), i * dt))
  return jax.lax.fori_loop(0, steps, body, x0)


def train(model, loss_fn, batches, *, steps: int, lr: float, seed: int, desc: str):
  """optax AdamW (warm-up, cosine decay) on ``loss_fn(model, batch, key)``; returns the losses
  and the trained model. Only ``nnx.Param`` s are trained (the label-dropout RNG is state)."""
  from tqdm.auto import tqdm

  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  sched = optax.warmup_cosine_decay_schedule(0.0, lr, max(1, steps // 10), steps, lr * 0.1)
  tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(sched, weight_decay=0.01))
  opt_state = tx.init(params)

  @functools.partial(jax.jit, donate_argnums=(0, 1))
  def step(params, opt_state, batch, key):
    loss, grads = jax.value_and_grad(lambda p: loss_fn(nnx.merge(graphdef, p, rest), batch, key))(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  key, losses = jax.random.key(seed), []
  bar = tqdm(range(steps), desc=desc, file=sys.stdout, mininterval=0.5)
  t0 = time.perf_counter()
  for _ in bar:
    key, sub = jax.random.split(key)
    params, opt_state, loss = step(params, opt_state, jax.tree.map(jnp.asarray, next(batches)), sub)
    losses.append(float(loss))
    bar.set_postfix(loss=f"{losses[-1]:.3f}", refresh=False)
  bar.close()
  print(f"loss {np.mean(losses[:5]):.3f} -> {np.mean(losses[-5:]):.3f} (first/last 5 steps) "
        f"in {time.perf_counter() - t0:.1f} s")
  return losses, nnx.merge(graphdef, params, rest)


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--steps", type=int, default=600, help="training steps")
  ap.add_argument("--batch", type=int, default=64)
  ap.add_argument("--classes", type=int, default=3)
  ap.add_argument("--min-size", type=int, default=8)
  ap.add_argument("--max-size", type=int, default=16)
  ap.add_argument("--features", type=int, default=64)
  ap.add_argument("--layers", type=int, default=3)
  ap.add_argument("--heads", type=int, default=4)
  ap.add_argument("--lr", type=float, default=2e-3)
  ap.add_argument("--sample-steps", type=int, default=32, help="Euler steps of the sampler")
  ap.add_argument("--guidance", type=float, default=1.5, help="classifier-free guidance weight")
  ap.add_argument("--seed", type=int, default=0)
  args = ap.parse_args(argv)

  model = DiffusionTransformer(in_features=2, features=args.features, num_layers=args.layers,
                               num_heads=args.heads, num_classes=args.classes, class_dropout_rate=0.1,
                               frequency_features=64, rngs=nnx.Rngs(args.seed))
  n_params = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
  print(f"DiT: {n_params:,} parameters, {args.layers} layers, features {args.features}, "
        f"{args.heads} heads; {jax.devices()[0].platform}")
  rng = np.random.default_rng(args.seed)

  def batches():
    while True:
      yield mixture_sets(rng, args.batch, args.classes, args.min_size, args.max_size)

  def loss_fn(model, batch, key):
    x1, sizes, labels = batch
    kd, kl = jax.random.split(key)
    return flow_matching_loss(model, x1, sizes, kl, labels=labels, deterministic=False,
                              rngs=nnx.Rngs(dropout=kd))

  losses, model = train(model, loss_fn, batches(), steps=args.steps, lr=args.lr, seed=args.seed,
                        desc="train")

  # Sample 16 sets of max_size points per class with guidance; distance to the nearest centre.
  labels = jnp.repeat(jnp.arange(args.classes), 16)
  null = jnp.full(labels.shape, model.null_label)

  graphdef, state = nnx.split(model)

  @jax.jit
  def sample(state, x0):
    def velocity(x, t):
      # Fresh variables in the loop's trace (nnx variables belong to the trace that made them).
      m = nnx.merge(graphdef, jax.tree.map(lambda a: a, state))
      v_label = m(x, t, labels=labels, deterministic=True)
      v_null = m(x, t, labels=null, deterministic=True)
      return v_null + args.guidance * (v_label - v_null)
    return euler_sample(velocity, x0, args.sample_steps)

  x0 = jax.random.normal(jax.random.key(args.seed + 1), (labels.shape[0], args.max_size, 2))
  samples = np.asarray(sample(state, x0))
  c = centres(args.classes)[np.asarray(labels)]                               # [n, K, 2]
  dist = np.linalg.norm(samples[:, :, None] - c[:, None], axis=-1).min(-1)    # [n, max_size]
  other = centres(args.classes)[(np.asarray(labels) + 1) % args.classes]
  dist_other = np.linalg.norm(samples[:, :, None] - other[:, None], axis=-1).min(-1)
  print(f"samples: median distance to their class's nearest centre {np.median(dist):.3f} "
        f"(to the next class's {np.median(dist_other):.3f}; data std {STD}, {args.sample_steps} Euler steps)")
  return dict(losses=losses, samples=samples, distance=float(np.median(dist)),
              distance_other=float(np.median(dist_other)), num_params=n_params)


if __name__ == "__main__":
  main()
