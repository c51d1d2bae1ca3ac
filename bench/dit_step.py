"""End-to-end DiT benchmark: a flow-matching training step of ``DiffusionTransformer`` with
probjax attention against the same model with peer attention functions.

Sections (``--sections``, default all, in this order):

* ``matmul``: the measured bf16 matmul ceiling (``bench/lm_step.py``'s), against which the
  training rows' ``frac_of_matmul`` is computed.
* ``train``: class-conditional DiTs on 256 tokens (a 32 x 32 x 4 latent in 2 x 2 patches, as
  DiT-S/2 and DiT-B/2 at 256 px), batch 64, GELU MLP (4x), 1000 classes, bf16 compute with
  fp32 parameters, no mask; one optax AdamW step of the flow-matching loss, jitted with the
  parameters and optimizer state donated. Cases (``--cases``): ``S`` (hidden 384, depth 12,
  6 heads: head_dim 64) and ``B`` (768, 12, 12: head_dim 64). Peers (``attention_fn``):
  ``probjax`` (``dot_product_attention``), ``flax`` (``flax.nnx.dot_product_attention``) and
  ``jaxnn_cudnn`` (``jax.nn.dot_product_attention(implementation="cudnn")``).

FLOP convention (model FLOPs, no recomputation counted), printed with the rows: per token,
``N_tok`` = matmul parameters applied to every token = layers * (4 d^2 + 2 d F) (q, k, v,
out; the MLP's two matrices, ``F = 4d``) + the patch embedding ``p^2 C d`` + the final
projection ``d p^2 C``; per example, ``N_ex`` = the timestep MLP ``(256 + d) d`` + the
modulation of every block and the final layer ``d (6 layers + 2) d``. Dense: ``6 * (N_tok *
tokens + N_ex * batch)`` (forward 2N, backward 4N). Attention per layer forward: ``QK^T`` and
``PV`` are ``2 * B * T^2 * d`` each, so ``4*B*T^2*d``; forward + backward ``12 * layers * B *
T^2 * d`` (no mask). MFU = FLOPs / time / peak (989.4e12 bf16 dense for H100/H200 SXM; None
on other devices, where ``frac_of_matmul`` still says how close).

Timing: compile + warm-up, then ``--repeats`` rounds; each round times every peer once (a
block of ``--iters`` steps), in an order that rotates by one each round; peers run in the same
process on the same inputs. Medians are reported. Every peer is first checked against
probjax (first-step loss): a row whose check fails says so in ``check``. Rows are JSON lines
in ``--output`` keyed by (section, case, impl); a rerun with the same ``--output`` skips the
groups already there (``--force`` re-measures), and ``--max-minutes`` stops cleanly between
groups.

    python bench/dit_step.py --output bench/results/h200/dit_step.json        # H200
    python bench/dit_step.py --cpu-smoke --quick --output /tmp/x.json         # tiny, CPU
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
  sys.path.insert(0, ROOT)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from bench.lm_step import (Rows, _describe, _Progress, adamw, apply_updates, attention_fns,  # noqa: E402
                           optax, peak_flops, run_matmul, time_steps, with_attention)
from probjax.core.timing import device_info, summarize  # noqa: E402
from probjax.nn.layers.dit import DiffusionTransformer  # noqa: E402

SECTIONS = ("matmul", "train")


@dataclasses.dataclass(frozen=True)
class Config:
  d_model: int
  layers: int
  heads: int
  image: int = 32          # latent side; tokens = (image / patch)^2
  channels: int = 4
  patch: int = 2
  batch: int = 64
  classes: int = 1000
  frequency_features: int = 256

  @property
  def tokens(self) -> int:
    return (self.image // self.patch) ** 2


CASES = {"S": Config(d_model=384, layers=12, heads=6), "B": Config(d_model=768, layers=12, heads=12)}
SMOKE = {"S": Config(d_model=32, layers=2, heads=2, image=8, batch=2, classes=10, frequency_features=16)}
MATMUL_N = {"full": 8192, "smoke": 256}


@dataclasses.dataclass(frozen=True)
class _MatmulConfig:  # what bench.lm_step.run_matmul reads
  matmul_n: int


# -- FLOPs ---------------------------------------------------------------------------
def matmul_params(c: Config) -> tuple[int, int]:
  """``(N_tok, N_ex)``: matmul parameters applied per token and per example (docstring)."""
  d, pc = c.d_model, c.patch ** 2 * c.channels
  per_token = c.layers * (4 * d * d + 2 * d * 4 * d) + 2 * pc * d
  per_example = (c.frequency_features + d) * d + d * (6 * c.layers + 2) * d
  return per_token, per_example


def train_flops(c: Config) -> dict:
  n_tok, n_ex = matmul_params(c)
  dense = 6.0 * (n_tok * c.tokens * c.batch + n_ex * c.batch)
  attn = 12.0 * c.layers * c.batch * c.tokens ** 2 * c.d_model
  return {"dense_flops": dense, "attention_flops": attn, "flops": dense + attn}


# -- the step ------------------------------------------------------------------------
def make_dit(c: Config, seed=0):
  return nnx.jit(lambda: DiffusionTransformer(
      in_features=c.channels, features=c.d_model, num_layers=c.layers, num_heads=c.heads,
      patch_size=c.patch, num_classes=c.classes, frequency_features=c.frequency_features,
      dtype=jnp.bfloat16, param_dtype=jnp.float32, rngs=nnx.Rngs(seed)))()


def flow_matching_loss(model, batch):
  """Rectified flow: the velocity ``x1 - x0`` at ``x_t = (1 - t) x0 + t x1``, squared error."""
  x0, x1, t = batch["x0"], batch["x1"], batch["t"]
  xt = (1 - t[:, None, None, None]) * x0 + t[:, None, None, None] * x1
  v = model(xt, t, labels=batch["labels"]).astype(jnp.float32)
  return jnp.mean((v - (x1 - x0)) ** 2)


def run_train(c, args, bar, impls, fns):
  model = make_dit(c)
  graphdef, params = nnx.split(model)
  del model
  # adaLN-Zero: at initialisation the output is zero and only the final layer gets a gradient;
  # timing a step there would measure a model whose loss ignores the attention. Random
  # modulation and final weights (as after some training) make every peer's check meaningful.
  rng = np.random.default_rng(0)
  params = jax.tree_util.tree_map_with_path(
      lambda path, a: (jnp.asarray(0.02 * rng.standard_normal(a.shape), a.dtype)
                       if any(k in jax.tree_util.keystr(path) for k in ("'modulation'", "'final'"))
                       and jnp.issubdtype(a.dtype, jnp.floating) else a), params)
  tx = adamw(1e-4, weight_decay=0.0)
  shape = (c.batch, c.image, c.image, c.channels)
  batch = dict(x0=jnp.asarray(rng.standard_normal(shape), jnp.float32),
               x1=jnp.asarray(rng.standard_normal(shape), jnp.float32),
               t=jnp.asarray(rng.uniform(0, 1, c.batch), jnp.float32),
               labels=jnp.asarray(rng.integers(0, c.classes, c.batch), jnp.int32))

  def make_step(gd):
    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def step(p, o, batch):
      loss, g = jax.value_and_grad(lambda p: flow_matching_loss(nnx.merge(gd, p), batch))(p)
      updates, o = tx.update(g, o, p)
      return apply_updates(p, updates), o, loss
    return step

  info, times = time_steps(lambda name: make_step(with_attention(graphdef, params, fns[name])),
                           impls, params, tx, batch, args, bar)
  flops = train_flops(c)
  peak = peak_flops(device_info()["device"])
  ref = info.get("probjax", {}).get("first_loss")
  n_tok, n_ex = matmul_params(c)
  rows = []
  for name in impls:
    row = dict(impl=name, **info[name], **flops, tokens_per_step=c.batch * c.tokens,
               optimizer="optax.adamw" if optax is not None else "adamw (optax missing: bench/lm_step._AdamW)",
               matmul_params_per_token=n_tok, matmul_params_per_example=n_ex,
               params=int(sum(x.size for x in jax.tree.leaves(params))))
    if name in times:
      s = summarize(times[name])
      row.update(s, ms_all=times[name], images_per_s=c.batch / (s["ms"] * 1e-3),
                 tokens_per_s=c.batch * c.tokens / (s["ms"] * 1e-3),
                 tflops=flops["flops"] / (s["ms"] * 1e-3) / 1e12,
                 mfu=None if peak is None else flops["flops"] / (s["ms"] * 1e-3) / peak)
      if ref is not None:
        rel = abs(row["first_loss"] - ref) / abs(ref)
        row["check_rel_loss_diff"] = rel
        row["check"] = "ok" if rel < 2e-2 else f"FAILED: first-step loss {row['first_loss']} vs probjax {ref}"
    rows.append(row)
  return rows


def case_name(c: Config, key: str) -> str:
  return (f"DiT-{key}/{c.patch}_d{c.d_model}_L{c.layers}_H{c.heads}_T{c.tokens}_B{c.batch}_"
          f"C{c.classes}_gelu_bf16")


# -- main ---------------------------------------------------------------------------
def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--output", default=None, help="JSON-lines results (resumed by row key)")
  ap.add_argument("--sections", default=",".join(SECTIONS), help=f"comma list of {SECTIONS}")
  ap.add_argument("--cases", default=None, help=f"comma list of {sorted(CASES)} (default all)")
  ap.add_argument("--impls", default=None, help="comma list of peers (default: all for the device)")
  ap.add_argument("--quick", action="store_true", help="fewer repeats and iterations")
  ap.add_argument("--cpu-smoke", action="store_true", help="tiny sizes (runs on CPU in seconds)")
  ap.add_argument("--repeats", type=int, default=None)
  ap.add_argument("--iters", type=int, default=None, help="training steps per timed block")
  ap.add_argument("--warmup", type=int, default=None)
  ap.add_argument("--max-minutes", type=float, default=5.0, help="start no new group after this")
  ap.add_argument("--force", action="store_true", help="re-measure groups already in --output")
  args = ap.parse_args(argv)
  args.repeats = args.repeats or (3 if args.quick else 7)
  args.iters = args.iters or (2 if args.quick else 5)
  args.warmup = args.warmup if args.warmup is not None else (1 if args.quick else 2)
  cases = SMOKE if args.cpu_smoke else CASES
  if args.cases:
    want = [k for k in args.cases.split(",") if k]
    if any(k not in cases for k in want):
      raise SystemExit(f"--cases: choose from {sorted(cases)}; got {want}")
    cases = {k: cases[k] for k in want}
  sections = [s for s in args.sections.split(",") if s]
  for s in sections:
    if s not in SECTIONS:
      raise SystemExit(f"unknown section {s!r}; choose from {SECTIONS}")
  dev = device_info()
  platform = dev["platform"]
  fns = attention_fns(platform)
  gpu = platform == "gpu"
  impls = ["probjax", "flax", "jaxnn_cudnn"] if gpu else ["probjax", "flax"]
  if args.impls:
    impls = [i for i in args.impls.split(",") if i]
    if any(i not in fns for i in impls) or "probjax" not in impls:
      raise SystemExit(f"--impls: choose from {sorted(fns)}, probjax included (the reference); got {impls}")
  if not gpu and not args.cpu_smoke:
    print("warning: not on a GPU and without --cpu-smoke: the full sizes will be slow", file=sys.stderr)

  meta = dict(device=dev["device"], platform=platform, compute_capability=dev["compute_capability"],
              versions=dev["versions"], commit=dev["commit"], command=" ".join([sys.executable, "bench/dit_step.py"] + (sys.argv[1:] if argv is None else list(argv))),
              quick=args.quick, cpu_smoke=args.cpu_smoke)
  mm = _MatmulConfig(MATMUL_N["smoke" if args.cpu_smoke else "full"])
  groups = []                                                   # (section, case, config, impls)
  if "matmul" in sections:
    groups.append(("matmul", f"N{mm.matmul_n}_bf16", mm, ["jnp.dot"]))
  if "train" in sections:
    groups += [("train", case_name(c, k), c, impls) for k, c in cases.items()]
  rows = Rows(args.output, args.force)
  todo = [g for g in groups if args.force or not rows.done(g[0], g[1], g[3])]
  for g in groups:
    if g not in todo:
      print(f"[skip] {g[0]} {g[1]}: already in {args.output}")
  print(f"device: {dev['device']}  jax {dev['versions'].get('jax')}  flax {dev['versions'].get('flax')}  "
        f"commit {dev['commit']}")
  for k, c in cases.items():
    tf, (n_tok, n_ex) = train_flops(c), matmul_params(c)
    print(f"DiT-{k} FLOPs per step: dense 6*(N_tok*tokens + N_ex*batch) = 6*({n_tok:,}*{c.batch * c.tokens:,} "
          f"+ {n_ex:,}*{c.batch}) = {tf['dense_flops']:.4g}; attention 12*L*B*T^2*d = "
          f"{tf['attention_flops']:.4g}; total {tf['flops']:.4g}")
  try:
    from tqdm.auto import tqdm
  except ImportError:
    tqdm = _Progress
  bar = tqdm(total=len(todo) * args.repeats, desc="dit_step", file=sys.stdout, mininterval=1.0)
  start = time.perf_counter()
  ceiling = next((r["tflops"] for r in rows.rows.values()
                  if r["section"] == "matmul" and r["case"] == f"N{mm.matmul_n}_bf16" and "tflops" in r), None)
  for section, case, c, group_impls in todo:
    if (time.perf_counter() - start) / 60 > args.max_minutes:
      print(f"[stop] --max-minutes {args.max_minutes} spent; rerun the same command to resume at {case}")
      break
    bar.set_description(case)
    t0 = time.perf_counter()
    if section == "matmul":
      out = run_matmul(c, args, bar)
      ceiling = out[0]["tflops"]
    else:
      out = run_train(c, args, bar, group_impls, fns)
    for r in out:
      if ceiling and r.get("tflops") and section != "matmul":
        r["frac_of_matmul"] = r["tflops"] / ceiling
      r.update(section=section, case=case, section_s=time.perf_counter() - t0, time=time.time(),
               config=dataclasses.asdict(c), **meta)
    rows.add(out)
    for r in out:
      bar.write(_describe(r))
  bar.close()
  if args.output:
    print(f"rows in {args.output}: {len(rows.rows)}")
  return list(rows.rows.values())


if __name__ == "__main__":
  main()
