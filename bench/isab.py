"""ISAB benchmark: probjax's induced set attention block with each attention function against
jax.nn's and against the same block in torch with ``flex_attention`` (GPU; ``--cpu-smoke``
runs tiny sizes on CPU).

The block (:class:`probjax.nn.layers.conditioners.ISAB`): hidden 128, 4 heads (head_dim 32),
32 inducing points, GELU MLP (4x), LayerNorm, batch 64, sets of 256 / 1024 / 4096 elements
whose last 25% are padding (random values, masked as keys by ``KVLenMask``), bf16 compute with
fp32 parameters. Modes: ``fwd`` (the output) and ``fwd_bwd`` (the gradients of
``sum(y * ct)`` w.r.t. every parameter and the input; ``ct`` is zero at padded rows, whose
outputs are unspecified).

Implementations (the ``attention_fn`` of every MAB): ``probjax_default``
(``dot_product_attention``), ``probjax_{triton,mosaic,cudnn,xla}`` (``implementation=``; a row
says ``unsupported`` where one refuses the call), ``jaxnn_cudnn`` / ``jaxnn_xla``
(``jax.nn.dot_product_attention`` with the padding as ``key_value_seq_lengths``) and
``torch_flex`` (bench/torch_isab_worker.py: the same block and parameters in torch, the padding
as a flex block mask, ``torch.compile``d, in its own process).

FLOPs (``flop_convention`` in the rows): the attention matmuls only, on the padded sizes:
``4 B H Tq Tk d`` per attention, two attentions (inducing -> set, set -> inducing), so
``8 B m n F`` forward (``m`` inducing points, ``n`` the set size, ``F = H d``); ``fwd_bwd``
counts 3.5x the forward (the backward recomputes the scores: 5 matmuls against 2).

Agreement: every row's first result against ``jaxnn_xla``'s (jax.nn's XLA attention, no
probjax code): ``max_error`` (probjax/core/tolerances.py) over the valid rows of the output, or
over every gradient, and ``check`` against the bf16 bound.

Timing: the JAX rows of a set size are compiled, then timed in ``--rounds`` rounds in a rotated
order (``probjax.core.timing.time_fn`` each); torch times its rows in its process the same way.
A row's ``ms`` is the median of its rounds' medians, ``p10_ms`` / ``p90_ms`` the medians of
theirs. Rows (JSON Lines, keyed by case, impl, mode) carry the device, versions, commit and
command; a measured key replaces its row, the file's other rows stay; ``--append`` skips the keys
already there (``--rerun-failed``: except those not ``ok``).

    python -m bench.isab --output bench/results/h200/isab.json --append
    python -m bench.isab --cpu-smoke --output /tmp/isab.json            # tiny, CPU
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import json
import os
import subprocess
import sys
import tempfile
import time

# JAX grows its memory as needed instead of taking most of the GPU, leaving room for the torch worker.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from bench import harness  # noqa: E402
from bench.torch_isab_worker import pool_rounds  # noqa: E402
from probjax.core import timing  # noqa: E402
from probjax.core.tolerances import max_error, tolerance  # noqa: E402
from probjax.nn.layers.attention import KVLenMask, dot_product_attention, explain_dispatch  # noqa: E402
from probjax.nn.layers.conditioners import ISAB  # noqa: E402

PROBJAX_IMPLS = ("triton", "mosaic", "cudnn", "xla")
IMPLS = ("jaxnn_xla", "probjax_default", *(f"probjax_{i}" for i in PROBJAX_IMPLS), "jaxnn_cudnn", "torch_flex")
REF = "jaxnn_xla"
MODES = ("fwd", "fwd_bwd")
KEY = harness.OWN_SCHEMA_KEYS["isab"]
FWD_BWD_FLOP_FACTOR = 3.5
FLOP_CONVENTION = (f"attention matmuls only, padded sizes: 4*B*H*Tq*Tk*d per attention, two per ISAB; "
                   f"fwd_bwd = {FWD_BWD_FLOP_FACTOR} x fwd")
WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "torch_isab_worker.py")


@dataclasses.dataclass(frozen=True)
class Config:
  features: int = 128
  heads: int = 4
  inducing: int = 32
  batch: int = 64
  pad_fraction: float = 0.25

  def valid(self, n: int) -> int:
    """Elements of a padded set of ``n`` that are real (the rest, its tail, padding)."""
    return n - int(n * self.pad_fraction)


SET_SIZES = (256, 1024, 4096)
SMOKE, SMOKE_SIZES = Config(features=16, heads=2, inducing=4, batch=2), (16,)


def attention_flops(c: Config, n: int, mode: str) -> float:
  fwd = 2 * 4.0 * c.batch * c.inducing * n * c.features
  return fwd * (FWD_BWD_FLOP_FACTOR if mode == "fwd_bwd" else 1.0)


def jaxnn_attention(implementation: str):
  """An ``attention_fn`` calling ``jax.nn.dot_product_attention``; a key-length mask becomes
  ``key_value_seq_lengths`` (the padding is each set's tail)."""
  def attend(q, k, v, *, mask=None, is_causal=False, dropout_rate=0.0, **_):
    if dropout_rate:
      raise ValueError("jax.nn.dot_product_attention has no dropout")
    lengths = None if mask is None else mask.kv_lengths
    return jax.nn.dot_product_attention(q, k, v, is_causal=is_causal, key_value_seq_lengths=lengths,
                                        implementation=implementation)
  return attend


def attention_fn(impl: str):
  if impl == "jaxnn_cudnn" and jax.default_backend() != "gpu":
    raise ValueError("jax.nn's cuDNN attention needs an NVIDIA GPU")
  if impl.startswith("jaxnn_"):
    return jaxnn_attention(impl.removeprefix("jaxnn_"))
  if impl == "probjax_default":
    return dot_product_attention
  return functools.partial(dot_product_attention, implementation=impl.removeprefix("probjax_"))


def _isab(c: Config, attend):
  return ISAB(features=c.features, num_heads=c.heads, num_inducing=c.inducing, attention_fn=attend,
              dtype=jnp.bfloat16, param_dtype=jnp.float32, rngs=nnx.Rngs(0))


@functools.cache
def _params(c: Config):
  return nnx.state(nnx.jit(lambda: _isab(c, dot_product_attention))())


def make_isab(c: Config, attend):
  """``(graph, state)`` of the block: the graph with ``attend`` as every MAB's
  ``attention_fn``, the parameters from seed 0 (the same for every implementation)."""
  graph, _ = nnx.split(nnx.eval_shape(lambda: _isab(c, attend)))
  return graph, _params(c)


def flat(tree) -> dict:
  """``{"mab_in.attn.q.kernel": array, ...}`` of a module's state or its gradient."""
  leaves = jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(tree))[0]
  return {".".join(str(k.key) for k in path): np.asarray(v, np.float32) for path, v in leaves}


@functools.partial(jax.jit, static_argnums=(0, 1))
def inputs(c: Config, n: int):
  """``x [batch, n, features]`` bf16, ``lengths [batch]``, ``ct`` (zero at padded rows) and
  the valid-row mask ``[batch, n, 1]``."""
  kx, kc = jax.random.split(jax.random.key(n))
  x = jax.random.normal(kx, (c.batch, n, c.features), jnp.float32).astype(jnp.bfloat16)
  lengths = jnp.full((c.batch,), c.valid(n), jnp.int32)
  valid = (jnp.arange(n)[None, :, None] < lengths[:, None, None])
  ct = (jax.random.normal(kc, x.shape, jnp.float32) * valid).astype(jnp.bfloat16)
  return x, lengths, ct, valid


def build(c: Config, impl: str, mode: str, x, lengths, ct, valid):
  """``(jitted fn, args, to_result)``: ``to_result`` maps its output to the compared arrays
  (the valid rows of the output, or every gradient by name)."""
  graph, state = make_isab(c, attention_fn(impl))
  call = lambda st, x, lengths: nnx.merge(graph, st)(x, mask=KVLenMask(lengths))
  if mode == "fwd":
    fn = jax.jit(call)
    return fn, (state, x, lengths), lambda y: {"y": np.asarray((y * valid).astype(jnp.float32))}
  loss = lambda st, x, lengths: jnp.sum(call(st, x, lengths).astype(jnp.float32) * ct.astype(jnp.float32))
  fn = jax.jit(jax.grad(loss, argnums=(0, 1)))
  return fn, (state, x, lengths), lambda g: dict(flat(g[0]), x=np.asarray(g[1], np.float32))


def agreement(result: dict, ref: dict | None, mode: str) -> dict:
  if ref is None:
    return {}
  err = max(max_error(result[k], ref[k]) for k in ref)
  bound = tolerance("bfloat16", grad=mode == "fwd_bwd")
  return dict(agree_ref=REF, max_error=err, check="ok" if err <= bound else f"FAILED: {err:.3g} > {bound}")


def dispatch_of(c: Config, n: int, lengths) -> list[str]:
  """What ``probjax_default`` runs for the two attentions (inducing -> set, set -> inducing)."""
  q, s = (c.batch, c.inducing, c.heads, c.features // c.heads), (c.batch, n, c.heads, c.features // c.heads)
  return [str(explain_dispatch(q, s, jnp.bfloat16, mask=KVLenMask(lengths))), str(explain_dispatch(s, q, jnp.bfloat16))]


def time_jax(c, n, todo, args, write, refs, base):
  """Compiles the JAX rows ``todo`` of set size ``n``, then times them in rotated rounds.
  ``refs``: ``{mode: REF's result}``, filled in here from ``REF``'s rows (compiled first)."""
  x, lengths, ct, valid = inputs(c, n)
  live = {}
  for impl, mode in sorted(todo, key=lambda t: t[0] != REF):
    row = dict(base(mode), impl=impl)
    if impl == "probjax_default":
      row["dispatch"] = dispatch_of(c, n, lengths)
    try:
      fn, fargs, to_result = build(c, impl, mode, x, lengths, ct, valid)
      t0 = time.perf_counter()
      result = to_result(jax.block_until_ready(fn(*fargs)))
      row["first_call_s"] = time.perf_counter() - t0
      if impl == REF:
        refs[mode] = result
      row.update(agreement(result, refs.get(mode), mode))
      del result
    except Exception as e:  # noqa: BLE001 (one failing implementation never ends a run)
      status, msg = timing.classify_error(e)
      write(dict(row, status=status, error=msg))
      continue
    live[impl, mode] = (fn, fargs, row, [])
  names = list(live)
  for r in range(args.rounds if names else 0):
    for name in names[r % len(names):] + names[:r % len(names)]:
      fn, fargs, _, results = live[name]
      results.append(timing.time_fn(lambda: fn(*fargs), jax.block_until_ready, warmup=args.warmup,
                                    repeats=args.repeats, min_repeat_s=args.min_repeat_ms / 1e3))
  for fn, fargs, row, results in live.values():
    write(dict(row, status="ok", **pool_rounds(results)))


def reference(c, n, modes):
  """``{mode: result}`` of ``REF`` (the agreement's reference) where its rows are not measured."""
  x, lengths, ct, valid = inputs(c, n)
  out = {}
  for mode in modes:
    fn, fargs, to_result = build(c, REF, mode, x, lengths, ct, valid)
    out[mode] = to_result(fn(*fargs))
  return out


def time_torch(c, n, modes, args, write, refs, base):
  """Runs bench/torch_isab_worker.py on the same parameters and inputs; one row per mode."""
  x, lengths, ct, valid = inputs(c, n)
  with tempfile.TemporaryDirectory() as d:
    np.savez(os.path.join(d, "params.npz"), **flat(make_isab(c, dot_product_attention)[1]))
    for name, a in (("x", x), ("ct", ct), ("lengths", lengths)):
      np.save(os.path.join(d, f"{name}.npy"), np.asarray(a.astype(jnp.float32) if a.dtype == jnp.bfloat16 else a))
    with open(os.path.join(d, "spec.json"), "w") as f:
      json.dump(dict(heads=c.heads, modes=list(modes), rounds=args.rounds, warmup=args.warmup,
                     repeats=args.repeats, min_repeat_s=args.min_repeat_ms / 1e3), f)
    try:
      p = subprocess.run([args.torch_python, WORKER, d], capture_output=True, text=True, timeout=args.torch_timeout)
      lines = [line for line in p.stdout.splitlines() if line.startswith("{")]
      res = json.loads(lines[-1]) if lines else {"status": "error", "error": f"torch worker failed: {p.stderr[-1500:]}"}
    except subprocess.TimeoutExpired:
      res = {"status": "error", "error": f"torch worker ran past --torch-timeout {args.torch_timeout} s"}
    for mode in modes:
      row = dict(base(mode), impl="torch_flex", torch_python=args.torch_python)
      got = res["rows"][mode] if "rows" in res else res
      if "error" in got:
        status = "missing" if "No module named 'torch'" in got["error"] else got["status"]
        write(dict(row, status=status, error=got["error"]))
        continue
      if mode == "fwd":
        result = {"y": np.load(os.path.join(d, "out_fwd.npy")) * np.asarray(valid)}
      else:
        result = dict(np.load(os.path.join(d, "grads_fwd_bwd.npz")))
      write(dict(row, status="ok", torch_version=res["torch"], torch_device=res["device"], **got,
                 **agreement(result, refs.get(mode), mode)))


def case_name(c: Config, n: int) -> str:
  return f"B{c.batch} n{n} F{c.features} H{c.heads} m{c.inducing} pad{int(100 * c.pad_fraction)}"


def row_key(row: dict) -> tuple:
  return tuple(row.get(k) for k in KEY)


def summary(rows: list[dict]) -> list[str]:
  """Per case and mode: probjax_default's speed over the fastest peer (jax.nn, torch)."""
  ok = {row_key(r): r["ms"] for r in rows if r.get("status") == "ok"}
  lines = []
  for case, mode in sorted({(r["case"], r["mode"]) for r in rows}):
    peers = {i: ok[case, i, mode] for i in ("jaxnn_cudnn", "jaxnn_xla", "torch_flex") if (case, i, mode) in ok}
    ours = ok.get((case, "probjax_default", mode))
    if ours and peers:
      best = min(peers, key=peers.get)
      lines.append(f"{case} {mode}: probjax_default {ours:.3f} ms, {peers[best] / ours:.2f}x the fastest peer "
                   f"({best} {peers[best]:.3f} ms)")
  return lines


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--output", required=True, help="JSON Lines file of rows")
  p.add_argument("--append", action="store_true", help="keep the file's rows, skip keys already measured")
  p.add_argument("--rerun-failed", action="store_true", help="with --append: measure non-ok rows again")
  p.add_argument("--sizes", default=None, help="comma-separated set sizes (default 256,1024,4096)")
  p.add_argument("--impl", default=None, help=f"comma-separated, of {','.join(IMPLS)} (default all)")
  p.add_argument("--modes", default=",".join(MODES))
  p.add_argument("--rounds", type=int, default=3)
  p.add_argument("--repeats", type=int, default=5)
  p.add_argument("--warmup", type=int, default=2)
  p.add_argument("--min-repeat-ms", type=float, default=20.0)
  p.add_argument("--max-minutes", type=float, default=4.0, help="start no new set size after this")
  p.add_argument("--torch-python", default=sys.executable, help="interpreter with torch for torch_flex")
  p.add_argument("--torch-timeout", type=float, default=240.0)
  p.add_argument("--cpu-smoke", action="store_true", help="tiny sizes on CPU (checks the script, not speed)")
  p.add_argument("--no-progress", action="store_true")
  args = p.parse_args(argv)
  c = SMOKE if args.cpu_smoke else Config()
  sizes = [int(s) for s in args.sizes.split(",")] if args.sizes else list(SMOKE_SIZES if args.cpu_smoke else SET_SIZES)
  impls = args.impl.split(",") if args.impl else list(IMPLS)
  modes = args.modes.split(",")
  if unknown := [i for i in impls if i not in IMPLS] + [m for m in modes if m not in MODES]:
    raise SystemExit(f"unknown --impl/--modes {unknown}; implementations: {IMPLS}, modes: {MODES}")
  if args.cpu_smoke:
    args.rounds, args.repeats, args.warmup, args.min_repeat_ms = min(args.rounds, 2), min(args.repeats, 2), 0, 0.0
  elif jax.devices()[0].platform != "gpu":
    sys.exit("bench.isab times GPUs; use --cpu-smoke to check it on CPU")

  info = timing.device_info()
  common = dict(suite="isab", device=info["device"], platform=info["platform"],
                compute_capability=info["compute_capability"], versions=info["versions"], commit=info["commit"],
                command=" ".join(["python -m bench.isab", *(sys.argv[1:] if argv is None else argv)]),
                config=dataclasses.asdict(c), dtype="bfloat16", flop_convention=FLOP_CONVENTION)
  rows = {row_key(r): r for r in harness.load_rows(args.output)}   # a measured key replaces its row
  done = dict(rows) if args.append else {}
  os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)

  def write(row):  # the file is rewritten: one row per key
    row = dict(row, time=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))
    if row.get("status") == "ok":
      row["tflops"] = row["flops"] / (row["ms"] * 1e-3) / 1e12
    rows[row_key(row)] = row
    with open(args.output, "w") as f:
      f.writelines(json.dumps(r, default=str) + "\n" for r in rows.values())
    bar.write(f"{row['case']} {row['mode']:7s} {row['impl']:16s} {row['status']:11s} "
              + (f"{row['ms']:.3f} ms  {row['tflops']:.1f} TFLOP/s  err {row.get('max_error', float('nan')):.2g}"
                 if row["status"] == "ok" else row.get("error", "")[:160]))

  def wanted(n, impl, mode):
    r = done.get((case_name(c, n), impl, mode))
    return r is None or (args.rerun_failed and r.get("status") != "ok")

  from tqdm import tqdm
  plan = [(n, [(i, m) for i in impls for m in modes if wanted(n, i, m)]) for n in sizes]
  plan = [(n, todo) for n, todo in plan if todo]
  bar = tqdm(total=sum(len(t) for _, t in plan), disable=args.no_progress, dynamic_ncols=True, desc="isab")
  start = time.time()
  for n, todo in plan:
    if time.time() - start > args.max_minutes * 60:
      bar.write(f"[isab] --max-minutes {args.max_minutes} spent; rerun with --append to resume at n={n}")
      break
    base = lambda mode, n=n: dict(common, case=case_name(c, n), set_size=n,
                                  valid_per_set=c.valid(n), mode=mode, flops=attention_flops(c, n, mode))
    refs = reference(c, n, sorted({m for _, m in todo} - {m for i, m in todo if i == REF}))
    jax_todo = [(i, m) for i, m in todo if i != "torch_flex"]
    time_jax(c, n, jax_todo, args, write, refs, base)
    bar.update(len(jax_todo))
    torch_modes = [m for i, m in todo if i == "torch_flex"]
    jax.clear_caches()
    if torch_modes:
      time_torch(c, n, torch_modes, args, write, refs, base)
      bar.update(len(torch_modes))
  bar.close()
  for line in summary(list(rows.values())):
    print(line)
  return list(rows.values())



if __name__ == "__main__":
  main()
