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
  ``jaxnn_cudnn`` (``jax.nn.dot_product_attention(implementation="cudnn")``). Variants of the
  probjax row (``--variants``, default :data:`DEFAULT_VARIANTS`, any of :data:`VARIANTS` or a
  '.'-joined mix; rows ``probjax_<variant>``, ``probjax`` the baseline, whose options the peers
  share: the model's default ``scan_layers=False``, the blocks unrolled): ``scanned``
  (``scan_layers=True``: the 12 blocks as one ``nnx.scan`` body), ``flat_adamw``
  (the parameters as one flat fp32 vector: the AdamW update is one fusion instead of one per
  leaf), ``adamw_mu_bf16`` (``optax.adamw(mu_dtype=bfloat16)``), and XLA flags read when JAX
  starts, each run in a child process with them in ``XLA_FLAGS``: ``xla_cmdbuf_off`` (no
  command buffers / CUDA graphs), ``xla_cmdbuf_while`` (command buffers also over the scan's
  while loop and conditionals, graphs of any size), ``xla_cmdbuf_unroll`` (that loop unrolled
  inside the command buffer).

Each row: wall ms per step (median ``ms``, ``p10_ms``/``p90_ms`` over the rounds), and on a GPU
from a ``jax.profiler`` trace of ``--iters`` more steps (``bench.harness.kernel_intervals``):
``device_ms`` (the kernels' summed duration per step, ``bench.harness.kernel_ms``'s
convention), ``wall_over_device`` (``ms / device_ms``: 1 when the host keeps the GPU busy),
``kernels_per_step``, ``kernel_ms_by_kind`` (attention / matmul / other by kernel name; other:
elementwise, norms, reductions, the optimizer) and ``top_kernels`` (the 8 names with the most
time: ``ms_per_step``, ``count_per_step``). XLA runs the profiled steps op by op, not from
command buffers, so ``device_ms`` is the kernels' time either way and ``ms`` alone shows what
command buffers save: the XLA-flag rows are not profiled, and their ``wall_over_device``
divides by the ``device_ms`` of the row without the flags (``device_ms_of``). Elsewhere
``device_ms_error`` says why there is none. Every row's first-step loss and its loss after one
update (``second_loss``) are checked against the baseline probjax row's:
``check_rel_loss_diff``, ``check_rel_loss2_diff``, ``check``.

FLOP convention (model FLOPs, no recomputation counted), printed with the rows: per token,
``N_tok`` = matmul parameters applied to every token = layers * (4 d^2 + 2 d F) (q, k, v,
out; the MLP's two matrices, ``F = 4d``) + the patch embedding ``p^2 C d`` + the final
projection ``d p^2 C``; per example, ``N_ex`` = the timestep MLP ``(256 + d) d`` + the
modulation of every block and the final layer ``d (6 layers + 2) d``. Dense: ``6 * (N_tok *
tokens + N_ex * batch)`` (forward 2N, backward 4N). Attention per layer forward: ``QK^T`` and
``PV`` are ``2 * B * T^2 * d`` each, so ``4*B*T^2*d``; forward + backward ``12 * layers * B *
T^2 * d`` (no mask). MFU = FLOPs / time / peak (989.4e12 bf16 dense for H100/H200 SXM; None
on other devices, where ``frac_of_matmul`` still says how close).

Timing: compile + warm-up, then ``--repeats`` rounds; each round times every row once (a
block of ``--iters`` steps), in an order that rotates by one each round; rows run in the same
process on the same inputs, except the XLA-flag variants (their own process, after the
others). Medians are reported. A row whose check fails says so in ``check``. Rows are JSON lines
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
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
  sys.path.insert(0, ROOT)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402
from jax.flatten_util import ravel_pytree  # noqa: E402

from bench.harness import kernel_intervals, kernel_summary, load_rows  # noqa: E402
from bench.lm_step import (Rows, _describe, _Progress, adamw, apply_updates, attention_fns,  # noqa: E402
                           optax, peak_flops, run_matmul, step_times, tree_copy, with_attention)
from probjax.core.timing import Unsupported, classify_error, device_info, summarize  # noqa: E402
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


# -- variants of the probjax row ------------------------------------------------------
# Options (merged over '.'-joined names, e.g. "scanned.xla_cmdbuf_off"): scan_layers (the
# model's), optimizer ("adamw": optax.adamw on the parameter tree; "flat": the same on one
# flat fp32 vector that the step unravels into the tree, so the update is one fusion, not one
# per leaf; "mu_bf16": optax.adamw(mu_dtype=bfloat16)), xla_flags (appended to XLA_FLAGS in a
# child process: they are read when JAX starts).
VARIANTS = {
    "baseline": {},
    "scanned": dict(scan_layers=True),
    "flat_adamw": dict(optimizer="flat"),
    "adamw_mu_bf16": dict(optimizer="mu_bf16"),
    "xla_cmdbuf_off": dict(xla_flags=("--xla_gpu_enable_command_buffer=",)),
    "xla_cmdbuf_while": dict(xla_flags=("--xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL",
                                        "--xla_gpu_graph_min_graph_size=1")),
    "xla_cmdbuf_unroll": dict(xla_flags=("--xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL",
                                         "--xla_gpu_command_buffer_unroll_loops=true")),
}
# --variants' default: all but xla_cmdbuf_unroll (each XLA-flag row is a child process, ~25 s
# of start and compile per case; the default run of S and B stays near 5 minutes on an H200).
DEFAULT_VARIANTS = tuple(v for v in VARIANTS if v != "xla_cmdbuf_unroll")
DEFAULTS = dict(scan_layers=False, optimizer="adamw", xla_flags=())  # the model's default
CHECK_REL = 2e-2  # relative loss difference that fails a row's check (bf16 compute)


def variant_options(name: str) -> dict:
  """The options of a ``'.'``-joined variant name (:data:`VARIANTS`); raises ValueError on an
  unknown part or two parts setting one option differently."""
  opts = dict(DEFAULTS)
  for part in name.split("."):
    if part not in VARIANTS:
      raise ValueError(f"variant {part!r} unknown; choose from {sorted(VARIANTS)} ('.'-joined)")
    for k, v in VARIANTS[part].items():
      if k == "xla_flags":
        opts[k] = opts[k] + v
      elif opts[k] != DEFAULTS[k] and opts[k] != v:
        raise ValueError(f"variant {name!r}: {k} set twice")
      else:
        opts[k] = v
  return opts


def impl_name(variant: str) -> str:
  return "probjax" if variant == "baseline" else f"probjax_{variant}"


# -- the step ------------------------------------------------------------------------
def _init_params(c: Config):
  """The model's ``(graphdef, params)`` with random modulation and final weights."""
  model = make_dit(c)
  graphdef, params = nnx.split(model)
  # adaLN-Zero: at initialisation the output is zero and only the final layer gets a gradient;
  # timing a step there would measure a model whose loss ignores the attention. Random
  # modulation and final weights (as after some training) make every peer's check meaningful.
  rng = np.random.default_rng(0)
  params = jax.tree_util.tree_map_with_path(
      lambda path, a: (jnp.asarray(0.02 * rng.standard_normal(a.shape), a.dtype)
                       if any(k in jax.tree_util.keystr(path) for k in ("'modulation'", "'final'"))
                       and jnp.issubdtype(a.dtype, jnp.floating) else a), params)
  return graphdef, params


def _batch(c: Config):
  rng = np.random.default_rng(1)
  shape = (c.batch, c.image, c.image, c.channels)
  return dict(x0=jnp.asarray(rng.standard_normal(shape), jnp.float32),
              x1=jnp.asarray(rng.standard_normal(shape), jnp.float32),
              t=jnp.asarray(rng.uniform(0, 1, c.batch), jnp.float32),
              labels=jnp.asarray(rng.integers(0, c.classes, c.batch), jnp.int32))


def _with_options(graphdef, params, fn, scan_layers):
  model = nnx.merge(with_attention(graphdef, params, fn), params)
  model.scan_layers = scan_layers
  return nnx.split(model)[0]


def make_step(graphdef, params, fn, opts):
  """``(step, params0, opt_state0, optimizer_name)``: ``step(p, o, batch) -> (p, o, loss)``
  jitted with ``p`` and ``o`` donated (``donate_argnums=(0, 1)``)."""
  gd = _with_options(graphdef, params, fn, opts["scan_layers"])
  unravel = None
  if opts["optimizer"] == "mu_bf16":
    if optax is None:
      raise Unsupported("adamw_mu_bf16 needs optax")
    tx, label = optax.adamw(1e-4, weight_decay=0.0, mu_dtype=jnp.bfloat16), "optax.adamw(mu_dtype=bfloat16)"
  else:
    tx = adamw(1e-4, weight_decay=0.0)
    label = "optax.adamw" if optax is not None else "adamw (optax missing: bench/lm_step._AdamW)"
  p0 = tree_copy(params)
  if opts["optimizer"] == "flat":
    if any(a.dtype != jnp.float32 for a in jax.tree.leaves(params)):
      raise Unsupported("flat_adamw needs every parameter in float32")
    p0, unravel = ravel_pytree(p0)
    label += " on one flat vector"

  @functools.partial(jax.jit, donate_argnums=(0, 1))
  def step(p, o, batch):
    tree = (lambda p: p) if unravel is None else unravel
    loss, g = jax.value_and_grad(lambda p: flow_matching_loss(nnx.merge(gd, tree(p)), batch))(p)
    updates, o = tx.update(g, o, p)
    return apply_updates(p, updates), o, loss
  return step, p0, tx.init(p0), label


def measure(entries: dict, batch, args, bar, no_profile: str | None) -> dict:
  """For each ``name: builder`` (``builder() -> make_step``'s tuple): compile (``first_call_s``),
  the first two steps' losses (``first_loss``; ``second_loss`` after one update), warm-up, then
  ``args.repeats`` rounds, each timing a block of ``args.iters`` steps of every entry in an
  order rotated by one per round (``ms_all``: ms per step per round); then a kernel profile of
  ``args.iters`` steps (:func:`kernel_summary`), unless ``no_profile`` says why not (it becomes
  ``device_ms_error``). A failing entry is its row's status, not the end of the run."""
  state, info = {}, {}
  for name, build in entries.items():
    try:
      t0 = time.perf_counter()
      step, p, o, label = build()
      p, o, loss = step(p, o, batch)
      first = float(loss)
      first_s = time.perf_counter() - t0
      p, o, loss = step(p, o, batch)
      info[name] = dict(first_call_s=first_s, first_loss=first, second_loss=float(loss), status="ok",
                        optimizer=label)
      for _ in range(args.warmup):
        p, o, _ = step(p, o, batch)
      jax.block_until_ready(p)
      state[name] = [step, p, o]
    except Exception as e:  # noqa: BLE001 (a failing row, not the end of the run)
      status, msg = classify_error(e)
      info[name] = dict(status=status, error=msg)
  times = step_times(state, batch, args.repeats, args.iters, bar)
  for name in state:
    s = summarize(times[name])
    info[name].update(s, ms_all=times[name])
    if no_profile:
      info[name]["device_ms_error"] = no_profile
      continue
    st = state[name]

    def one():
      st[1], st[2], loss = st[0](st[1], st[2], batch)
      return loss
    try:
      k = kernel_summary(kernel_intervals(one, jax.block_until_ready, args.iters, "jax"), args.iters)
      info[name].update(k, wall_over_device=s["ms"] / k["device_ms"] if k["device_ms"] else None)
    except Exception as e:  # noqa: BLE001 (the wall-clock row stands without it)
      info[name]["device_ms_error"] = f"{type(e).__name__}: {e}"[:300]
  state.clear()
  return info


def run_child(key, variant, args):
  """A variant with XLA flags, in a child process with them in ``XLA_FLAGS``: its row (the
  child's own timing; its check is the caller's)."""
  flags = variant_options(variant)["xla_flags"]
  env = dict(os.environ, XLA_FLAGS=" ".join([os.environ.get("XLA_FLAGS", ""), *flags]).strip())
  env.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # this process keeps its GPU memory
  with tempfile.TemporaryDirectory() as d:
    out = os.path.join(d, "rows.json")
    cmd = [sys.executable, os.path.abspath(__file__), "--child", "--sections", "train", "--cases", key,
           "--variants", variant, "--output", out, "--repeats", str(args.repeats), "--iters",
           str(args.iters), "--warmup", str(args.warmup)] + (["--cpu-smoke"] if args.cpu_smoke else [])
    t0 = time.perf_counter()
    res = subprocess.run(cmd, env=env, capture_output=True, text=True)
    rows = [r for r in load_rows(out) if r.get("impl") == impl_name(variant)]
  if res.returncode or not rows:
    return dict(status="fail", error=f"child exited {res.returncode}: {(res.stderr or res.stdout)[-600:]}",
                xla_flags=env["XLA_FLAGS"])
  keep = ("section", "case", "section_s", "time", "config", "device", "platform", "compute_capability",
          "versions", "commit", "command", "quick", "cpu_smoke")
  return dict({k: v for k, v in rows[0].items() if k not in keep}, child_s=time.perf_counter() - t0,
              xla_flags=env["XLA_FLAGS"])


def run_train(c, key, args, bar, impls, variants, fns, child=False):
  """The rows of one case: the peers ``impls`` (each with ``attention_fn``, baseline options)
  and the probjax ``variants``; those with XLA flags run in child processes (:func:`run_child`).
  Every row's losses are checked against the baseline probjax row's."""
  graphdef, params = _init_params(c)
  batch = _batch(c)
  names = {impl_name(v): v for v in variants}
  names.update({i: "baseline" for i in impls})
  local = {n: v for n, v in names.items() if child or not variant_options(v)["xla_flags"]}
  entries = {n: functools.partial(make_step, graphdef, params,
                                  fns["probjax" if n.startswith("probjax") else n], variant_options(v))
             for n, v in local.items()}
  platform = jax.devices()[0].platform
  no_profile = (f"no kernel profile on platform {platform}: GPU only" if platform != "gpu" else
                "not profiled: under the profiler XLA runs op by op, without command buffers, so the "
                "kernels are those of the row without the flags (device_ms_of)" if child else None)
  info = measure(entries, batch, args, bar, no_profile)
  del entries
  for n, v in names.items():
    if n in local:
      continue
    info[n] = run_child(key, v, args)
    same = impl_name(".".join(p for p in v.split(".") if "xla_flags" not in VARIANTS[p]) or "baseline")
    if info.get(same, {}).get("device_ms") and info[n].get("ms"):
      info[n].update(device_ms_of=same, wall_over_device=info[n]["ms"] / info[same]["device_ms"])
  flops = train_flops(c)
  peak = peak_flops(device_info()["device"])
  ref = info.get("probjax", {})
  n_tok, n_ex = matmul_params(c)
  rows = []
  for name, variant in names.items():
    opts = variant_options(variant)
    row = dict(impl=name, variant=variant, scan_layers=opts["scan_layers"], **flops,
               tokens_per_step=c.batch * c.tokens, matmul_params_per_token=n_tok,
               matmul_params_per_example=n_ex, params=int(sum(x.size for x in jax.tree.leaves(params))))
    row.update(info[name])
    if row.get("ms"):
      ms = row["ms"]
      row.update(images_per_s=c.batch / (ms * 1e-3), tokens_per_s=c.batch * c.tokens / (ms * 1e-3),
                 tflops=flops["flops"] / (ms * 1e-3) / 1e12,
                 mfu=None if peak is None else flops["flops"] / (ms * 1e-3) / peak)
    if row.get("status") == "ok" and "first_loss" in ref and not child:
      diffs = [abs(row[k] - ref[k]) / abs(ref[k]) for k in ("first_loss", "second_loss")]
      row["check_rel_loss_diff"], row["check_rel_loss2_diff"] = diffs
      row["check"] = ("ok" if max(diffs) < CHECK_REL else
                      f"FAILED: losses {row['first_loss']}, {row['second_loss']} vs probjax "
                      f"{ref['first_loss']}, {ref['second_loss']}")
    rows.append(row)
  return rows


def describe(r) -> str:
  """A row as one line: ``bench.lm_step``'s, then the profile's device time and top kernel."""
  line = _describe(r)
  if r.get("device_ms"):
    top = r["top_kernels"][0] if r.get("top_kernels") else None
    line += (f"  device {r['device_ms']:.3f} ms (wall/device {r['wall_over_device']:.2f}, "
             f"{r['kernels_per_step']:.0f} kernels; " +
             ", ".join(f"{k} {v:.2f}" for k, v in r["kernel_ms_by_kind"].items()) + " ms)")
    if top:
      line += f"  top {top['name'][:50]} {top['ms_per_step']:.2f} ms x{top['count_per_step']:.0f}"
  elif r.get("device_ms_of"):
    line += f"  wall/device {r['wall_over_device']:.2f} (device_ms of {r['device_ms_of']})"
  return line


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
  ap.add_argument("--variants", default=",".join(DEFAULT_VARIANTS),
                  help=f"comma list of probjax variants, each {sorted(VARIANTS)} or a '.'-joined mix "
                       "(default: %(default)s; 'baseline' is the probjax row)")
  ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)  # run_child's: no peers
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
    if any(i not in fns for i in impls):
      raise SystemExit(f"--impls: choose from {sorted(fns)}; got {impls}")
  variants = [v for v in args.variants.split(",") if v]
  try:
    for v in variants:
      variant_options(v)
  except ValueError as e:
    raise SystemExit(f"--variants: {e}")
  impls = [] if args.child else [i for i in impls if i != "probjax"]
  if not args.child and "baseline" not in variants:
    variants.insert(0, "baseline")            # the reference of every row's check
  names = [impl_name(v) for v in variants] + impls
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
    groups += [("train", case_name(c, k), (k, c), names) for k, c in cases.items()]
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
      out = run_train(c[1], c[0], args, bar, impls, variants, fns, child=args.child)
      c = c[1]
    for r in out:
      if ceiling and r.get("tflops") and section != "matmul":
        r["frac_of_matmul"] = r["tflops"] / ceiling
      r.update(section=section, case=case, section_s=time.perf_counter() - t0, time=time.time(),
               config=dataclasses.asdict(c), **meta)
    rows.add(out)
    for r in out:
      bar.write(describe(r))
  bar.close()
  if args.output:
    print(f"rows in {args.output}: {len(rows.rows)}")
  return list(rows.rows.values())


if __name__ == "__main__":
  main()
