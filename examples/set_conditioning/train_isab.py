"""Set-conditioned generation: a DiT generates new points of a distribution given a
variable-size context set of points from it, embedded by ISAB + PMA (or by a
``CrossAttentionConditioner``).

Data (generated here): a task is a 2-D Gaussian ``N(mu, s^2 I)`` with ``mu ~ N(0, 4 I)`` and
``s ~ U(0.2, 0.8)``; its context set has 3 to ``--max-context`` points, right-padded and
masked with ``KVLenMask`` (padding never reaches the embedding), and the target is a set of
8 further points. The context embedding is trained with the DiT through the flow-matching
loss of ``examples/diffusion/train_dit.py``:

* ``--conditioner pma`` (default): ``Linear -> ISAB -> PMA(1 seed)``, a vector that enters
  the DiT's adaLN conditioning (``cond``);
* ``--conditioner cross``: ``CrossAttentionConditioner`` to 4 latent tokens, which the DiT's
  blocks cross-attend (``context``).

After training, samples for held-out contexts are compared with each task's ``mu`` and with
the mean of its context set (the best a model can do from few points).

    python examples/set_conditioning/train_isab.py                 # ~2 minutes on 2 CPU cores
    python examples/set_conditioning/train_isab.py --steps 20      # a smoke run
"""

from __future__ import annotations

import argparse
import importlib.util
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from probjax.nn.layers.conditioners import ISAB, PMA, CrossAttentionConditioner
from probjax.nn.layers.dit import DiffusionTransformer
from probjax.ops.attention.masks import KVLenMask

_spec = importlib.util.spec_from_file_location(
    "train_dit", pathlib.Path(__file__).resolve().parents[1] / "diffusion" / "train_dit.py")
flow = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(flow)

TARGET = 8


def tasks(rng: np.random.Generator, batch: int, max_context: int):
  """``(context [batch, max_context, 2], sizes [batch], target [batch, TARGET, 2], mu [batch, 2])``."""
  mu = 2.0 * rng.standard_normal((batch, 2))
  s = rng.uniform(0.2, 0.8, (batch, 1, 1))
  pts = mu[:, None] + s * rng.standard_normal((batch, max_context + TARGET, 2))
  sizes = rng.integers(3, max_context + 1, batch)
  return (pts[:, :max_context].astype(np.float32), sizes.astype(np.int32),
          pts[:, max_context:].astype(np.float32), mu.astype(np.float32))


class SetConditionedDiT(nnx.Module):
  """A context-set encoder and a DiT generating target points given it."""

  def __init__(self, *, features: int, layers: int, heads: int, conditioner: str, rngs: nnx.Rngs):
    self.conditioner = conditioner
    kw = dict(features=features, num_heads=heads, rngs=rngs)
    if conditioner == "pma":
      self.embed = nnx.Linear(2, features, rngs=rngs)
      self.isab = ISAB(num_inducing=8, **kw)
      self.pma = PMA(num_seeds=1, **kw)
      dit_cond = dict(cond_features=features)
    else:
      self.encoder = CrossAttentionConditioner(context_features=2, num_latents=4, num_layers=1, **kw)
      dit_cond = dict(context_features=features)
    self.dit = DiffusionTransformer(in_features=2, num_layers=layers, frequency_features=64,
                                    **kw, **dit_cond)

  def __call__(self, x, t, *, context, context_sizes, mask=None):
    key_mask = KVLenMask(context_sizes)
    if self.conditioner == "pma":
      h = self.isab(self.embed(context), mask=key_mask)
      return self.dit(x, t, cond=self.pma(h, mask=key_mask)[:, 0], mask=mask)
    return self.dit(x, t, context=self.encoder(context, mask=key_mask), mask=mask)


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--steps", type=int, default=600, help="training steps")
  ap.add_argument("--batch", type=int, default=64)
  ap.add_argument("--max-context", type=int, default=24)
  ap.add_argument("--conditioner", choices=("pma", "cross"), default="pma")
  ap.add_argument("--features", type=int, default=64)
  ap.add_argument("--layers", type=int, default=2)
  ap.add_argument("--heads", type=int, default=4)
  ap.add_argument("--lr", type=float, default=2e-3)
  ap.add_argument("--sample-steps", type=int, default=32, help="Euler steps of the sampler")
  ap.add_argument("--seed", type=int, default=0)
  args = ap.parse_args(argv)

  model = SetConditionedDiT(features=args.features, layers=args.layers, heads=args.heads,
                            conditioner=args.conditioner, rngs=nnx.Rngs(args.seed))
  n_params = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
  print(f"set-conditioned DiT ({args.conditioner}): {n_params:,} parameters; {jax.devices()[0].platform}")
  rng = np.random.default_rng(args.seed)

  def batches():
    while True:
      yield tasks(rng, args.batch, args.max_context)[:3]

  def loss_fn(model, batch, key):
    context, sizes, target = batch
    full = jnp.full((target.shape[0],), TARGET, jnp.int32)
    return flow.flow_matching_loss(model, target, full, key, context=context, context_sizes=sizes)

  losses, model = flow.train(model, loss_fn, batches(), steps=args.steps, lr=args.lr, seed=args.seed,
                             desc=f"train ({args.conditioner})")

  context, sizes, _, mu = tasks(np.random.default_rng(args.seed + 1), 32, args.max_context)
  graphdef, state = nnx.split(model)

  @jax.jit
  def sample(state, x0, context, sizes):
    def velocity(x, t):
      # Fresh variables in the loop's trace (nnx variables belong to the trace that made them).
      m = nnx.merge(graphdef, jax.tree.map(lambda a: a, state))
      return m(x, t, context=context, context_sizes=sizes)
    return flow.euler_sample(velocity, x0, args.sample_steps)

  x0 = jax.random.normal(jax.random.key(args.seed + 2), (32, TARGET, 2))
  samples = np.asarray(sample(state, x0, jnp.asarray(context), jnp.asarray(sizes)))
  valid = np.arange(args.max_context)[None] < sizes[:, None]
  context_mean = (context * valid[..., None]).sum(1) / sizes[:, None]
  err = np.linalg.norm(samples.mean(1) - mu, axis=-1)
  best = np.linalg.norm(context_mean - mu, axis=-1)
  print(f"held-out tasks: |sample mean - mu| median {np.median(err):.3f} (context mean's "
        f"{np.median(best):.3f}; the prior's spread 2.0)")
  return dict(losses=losses, samples=samples, mean_error=float(np.median(err)),
              context_mean_error=float(np.median(best)), num_params=n_params)


if __name__ == "__main__":
  main()
