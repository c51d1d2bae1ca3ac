"""MoE and grouped-matmul benchmark (GPU; ``--cpu-smoke`` runs a tiny version on CPU).

Suites (``--suite``, comma-separated):

* ``moe_train``: the spec's MoE (d_model 512, 64 experts, top-8, SwiGLU experts of width 128,
  shared expert 1024, bf16, dropless): forward plus the gradients w.r.t. every parameter and
  the input, at 16,384 / 131,072 / 1,048,576 tokens, for every ``MoELayer`` dispatch and for
  peers: the sorted dispatch with ``jax.lax.ragged_dot`` (JAX's own autodiff) or tokamax's
  ``ragged_dot`` (Mosaic and Triton; rows say ``missing`` where tokamax does not import);
* ``moe_fwd``: the forward alone, same cases;
* ``gmm``: the grouped matmul alone (``fwd``, ``d_lhs``, ``d_rhs``) with M rows = those token
  counts, 64 groups of uniform or Zipf (s = 1.2, largest first) sizes, K x N = 512 x 256 and
  128 x 512 (the spec's two expert projections), for probjax's backends and the same peers.

Every implementation of a case is built in one process and timed in ``--rounds`` rounds in a
rotated order (``probjax.core.timing.time_fn``: warm-up, synchronised repeats; a row's ``ms``
is the median of its rounds' medians, ``round_ms`` the rounds). Rows (JSON Lines, one per
implementation and case, written as measured) carry the device, library versions, probjax
commit, command, status (``ok``, ``oom``, ``unsupported``, ``error``, ``missing``), the compiled
program's memory (``compiled_bytes``: arguments + outputs + temporaries, XLA's memory
analysis) and the device's peak memory so far (``device_peak_bytes``; a process-wide high-water
mark). ``--append`` keeps the rows of the file and skips the cases already measured (their
row key: suite, mode, impl, size, distribution, shape); ``--max-minutes`` stops starting new
cases after that long (default 9, inside a 10-minute device call), so repeating the command
with ``--append`` resumes.

    python -m bench.moe --output bench/results/h200/moe.json --append
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from bench import harness
from probjax.core import timing
from probjax.core.device import Device
from probjax.ops.grouped_matmul import REGISTRY
from probjax.ops.grouped_matmul.call import make_call
from probjax.ops.grouped_matmul.activations import activate
from probjax.ops.grouped_matmul.permute import expand_sorted, permute_rows, sort_assignments

SPEC = dict(d_model=512, experts=64, top_k=8, width=128, shared=1024)
SMOKE = dict(d_model=64, experts=4, top_k=2, width=64, shared=64)
TOKENS = (16384, 131072, 1048576)
SMOKE_TOKENS = (64,)
KN = ((512, 256), (128, 512))
SMOKE_KN = ((64, 128),)
DISPATCHES = ("auto", "dense", "sorted", "fused_gsum", "triton", "pallas", "mosaic")
GMM_IMPLS = tuple(REGISTRY.names())
PEERS = ("jax_ragged_dot", "tokamax_mosaic", "tokamax_triton")
KEY = ("suite", "mode", "impl", "size", "dist", "shape")


def _tokamax():
  try:
    import tokamax
    return tokamax
  except Exception as e:  # noqa: BLE001 (any import failure: the peer is missing)
    return f"{type(e).__name__}: {e}"


def peer_gmm(name: str):
  """``(lhs, rhs, group_sizes) -> out`` of a peer, or a string saying why it is missing."""
  if name == "jax_ragged_dot":
    return lambda a, b, g: jax.lax.ragged_dot(a, b, g)
  tk = _tokamax()
  if isinstance(tk, str):
    return f"tokamax does not import ({tk})"
  impl = name.split("_", 1)[1]
  return lambda a, b, g: tk.ragged_dot(a, b, g, implementation=impl)


# ---------------------------------------------------------------------------
# MoE cases
# ---------------------------------------------------------------------------
def _layer(cfg, dispatch: str, interpret: bool):
  from probjax.nn.layers.moe import MoELayer
  return MoELayer(cfg["d_model"], cfg["width"], cfg["experts"], cfg["top_k"], shared_hidden=cfg["shared"],
                  activation="swiglu", dispatch=dispatch, interpret=interpret, dtype=jnp.bfloat16,
                  rngs=nnx.Rngs(0))


def _peer_moe(layer, gmm):
  """The sorted dispatch of ``layer`` with a peer's grouped matmul (and its own autodiff)."""
  from probjax.nn.layers.moe import route

  def call(x):
    x = x.astype(jnp.bfloat16)
    logits = x.astype(jnp.float32) @ layer.router[...].astype(jnp.float32)
    r = route(logits, layer.top_k, router=layer.router_kind, renormalize=layer.renormalize)
    s = sort_assignments(r.expert_ids.reshape(-1), layer.num_experts)
    w_in, w_out = layer.w_in[...].astype(x.dtype), layer.w_out[...].astype(x.dtype)
    h = activate(gmm(expand_sorted(x, s, layer.top_k), w_in, s.group_sizes), layer.activation).astype(x.dtype)
    ys = gmm(h, w_out, s.group_sizes)
    yk = permute_rows(ys, s.inverse, s.order).reshape(-1, layer.top_k, layer.d_model)
    y = jnp.einsum("tkd,tk->td", yk.astype(jnp.float32), r.weights).astype(x.dtype)
    return y + layer.shared(x).astype(x.dtype), r.aux

  return call


def moe_flops(cfg, tokens: int, mode: str) -> float:
  """Matmul FLOPs of the routed and shared experts (router included); a train step counts
  the backward as twice the forward."""
  d, k, h, s, e = cfg["d_model"], cfg["top_k"], cfg["width"], cfg["shared"], cfg["experts"]
  fwd = 2 * tokens * (k * (d * 2 * h + h * d) + d * 2 * s + s * d + d * e)
  return fwd * (3 if mode == "train_step" else 1)


def moe_builders(cfg, tokens: int, mode: str, impls, interpret: bool):
  """``{impl: (jitted fn, args, row fields) or the reason it cannot run}`` for one MoE case;
  the inputs are shared by every impl."""
  kx, kc = jax.random.split(jax.random.key(tokens))
  x = jax.random.normal(kx, (tokens, cfg["d_model"]), jnp.bfloat16)
  ct = jax.random.normal(kc, (tokens, cfg["d_model"]), jnp.bfloat16)
  out = {}
  for impl in impls:
    extra = {}
    if impl in DISPATCHES:
      layer = _layer(cfg, impl, interpret)
      try:
        extra["resolved"] = list(layer.plan(jnp.bfloat16))
      except ValueError as e:
        out[impl] = str(e)
        continue
      graph, state = nnx.split(layer)
      call = lambda st, x, graph=graph: nnx.merge(graph, st)(x)
    else:
      gmm = peer_gmm(impl)
      if isinstance(gmm, str):
        out[impl] = gmm
        continue
      graph, state = nnx.split(_layer(cfg, "sorted", interpret))
      call = lambda st, x, graph=graph, gmm=gmm: _peer_moe(nnx.merge(graph, st), gmm)(x)
    if mode == "fwd":
      fn = jax.jit(lambda st, x, ct, call=call: call(st, x)[0])
    else:
      def loss(st, x, ct, call=call):
        y, aux = call(st, x)
        return jnp.sum(y.astype(jnp.float32) * ct) + 1e-2 * aux.load_balancing_loss
      fn = jax.jit(jax.grad(loss, argnums=(0, 1)))
    out[impl] = (fn, (state, x, ct), extra)
  return out


# ---------------------------------------------------------------------------
# Grouped-matmul cases
# ---------------------------------------------------------------------------
def group_sizes(m: int, groups: int, dist: str) -> np.ndarray:
  """``m`` rows over ``groups``: equal (``uniform``) or Zipf weights ``1 / rank^1.2``; the
  remainder goes to the first group."""
  w = np.ones(groups) if dist == "uniform" else 1.0 / np.arange(1, groups + 1) ** 1.2
  sizes = np.floor(m * w / w.sum()).astype(np.int64)
  sizes[0] += m - sizes.sum()
  return sizes.astype(np.int32)


def gmm_builders(m: int, k: int, n: int, groups: int, dist: str, mode: str, impls, interpret: bool):
  keys = jax.random.split(jax.random.key(m + k + n), 3)
  lhs = jax.random.normal(keys[0], (m, k), jnp.bfloat16)
  rhs = jax.random.normal(keys[1], (groups, k, n), jnp.bfloat16)
  d_out = jax.random.normal(keys[2], (m, n), jnp.bfloat16)
  gs = jnp.asarray(group_sizes(m, groups, dist))
  call = make_call(lhs, rhs, gs, interpret=interpret)
  device = Device.interpreter() if interpret else Device.current()
  out = {}
  for impl in impls:
    if impl in GMM_IMPLS:
      backend = REGISTRY.get(impl)
      why = backend.supports(call, device)
      if why is not None:
        out[impl] = why
        continue
      fn = {"fwd": lambda a, b, g, d, be=backend: be.gmm(a, b, g, call=call),
            "d_lhs": lambda a, b, g, d, be=backend: be.gmm(d, b, g, call=call.d_lhs_call()),
            "d_rhs": lambda a, b, g, d, be=backend: be.tgmm(a, d, g, call=call)}[mode]
    else:
      gmm = peer_gmm(impl)
      if isinstance(gmm, str):
        out[impl] = gmm
        continue
      fn = {"fwd": lambda a, b, g, d, f=gmm: f(a, b, g),
            "d_lhs": lambda a, b, g, d, f=gmm: jax.vjp(lambda a: f(a, b, g), a)[1](d)[0],
            "d_rhs": lambda a, b, g, d, f=gmm: jax.vjp(lambda b: f(a, b, g), b)[1](d)[0]}[mode]
    out[impl] = (jax.jit(fn), (lhs, rhs, gs, d_out), {})
  return out


# ---------------------------------------------------------------------------
# Running, rows, resume
# ---------------------------------------------------------------------------
def _memory(fn, args) -> int | None:
  try:
    ma = fn.lower(*args).compile().memory_analysis()
    return int(ma.argument_size_in_bytes + ma.output_size_in_bytes + ma.temp_size_in_bytes
               - ma.alias_size_in_bytes)
  except Exception:  # noqa: BLE001 (not every backend reports it)
    return None


def _device_peak() -> int | None:
  try:
    return (jax.devices()[0].memory_stats() or {}).get("peak_bytes_in_use")
  except Exception:  # noqa: BLE001
    return None


def row_key(row: dict) -> tuple:
  return tuple(row.get(f) for f in KEY)


# The implementation every other is compared against (the first of these that runs): the
# dense dispatch computes every expert on every token, so it shares no routing code path with
# the grouped matmuls; where it runs out of memory the sorted dispatch is the reference.
AGREE_REFS = ("dense", "sorted", "mosaic")


def max_rel_diff(a, b) -> float:
  """Largest ``max|a - b| / max|b|`` over the leaves of two result pytrees (outputs or
  gradients): one number per implementation, in the units of the issue's bf16 agreement."""
  diffs = [float(jnp.max(jnp.abs(x.astype(jnp.float32) - y.astype(jnp.float32)))
                 / max(float(jnp.max(jnp.abs(y.astype(jnp.float32)))), 1e-30))
           for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b))]
  return max(diffs) if diffs else 0.0


def time_group(builders: dict, base: dict, args, write) -> None:
  """Times every built implementation of one case in rotated rounds; writes a row each. Each
  row also says how far its first result is from the reference implementation's
  (``agree_ref``, ``max_rel_diff``)."""
  live, rows = {}, {}
  ref_name, ref_out = None, None
  order = sorted(builders, key=lambda i: AGREE_REFS.index(i) if i in AGREE_REFS else len(AGREE_REFS))
  for impl in order:
    built = builders[impl]
    row = dict(base, impl=impl)
    if isinstance(built, str):
      status = "missing" if "does not import" in built else "unsupported"
      write(dict(row, status=status, error=built))
      continue
    fn, fargs, extra = built
    row.update(extra)
    try:
      t0 = time.perf_counter()
      first = jax.block_until_ready(fn(*fargs))
      row["first_call_s"] = time.perf_counter() - t0
      row["compiled_bytes"] = _memory(fn, fargs)
      if ref_out is None:
        ref_name, ref_out = impl, first
      row.update(agree_ref=ref_name, max_rel_diff=max_rel_diff(first, ref_out))
      del first
    except Exception as e:  # noqa: BLE001 (one failing implementation never ends a run)
      status, msg = timing.classify_error(e)
      write(dict(row, status=status, error=msg))
      continue
    live[impl], rows[impl] = (fn, fargs), dict(row, round_ms=[])
  names = list(live)
  for r in range(args.rounds):
    for impl in names[r % max(len(names), 1):] + names[:r % max(len(names), 1)]:
      fn, fargs = live[impl]
      try:
        res = timing.time_fn(lambda: fn(*fargs), jax.block_until_ready, warmup=args.warmup,
                             repeats=args.repeats, min_repeat_s=args.min_repeat_ms / 1e3)
      except Exception as e:  # noqa: BLE001
        status, msg = timing.classify_error(e)
        write(dict(rows.pop(impl), status=status, error=msg))
        names.remove(impl)
        continue
      rows[impl]["round_ms"].append(res["ms"])
      rows[impl].update(calls_per_repeat=res["calls_per_repeat"], n_repeats=res["n_repeats"])
  for impl in names:
    row = rows[impl]
    row["ms"] = float(np.median(row["round_ms"]))
    row["rounds"] = len(row["round_ms"])
    row["tflops"] = row["flops"] / (row["ms"] * 1e-3) / 1e12 if row.get("flops") else None
    row["device_peak_bytes"] = _device_peak()
    write(dict(row, status="ok"))


def cases(args, cfg):
  """``(base row, builder thunk)`` per case, smallest sizes first."""
  suites = args.suite.split(",")
  for size in args.tokens:
    for mode, suite in (("train_step", "moe_train"), ("fwd", "moe_fwd")):
      if suite in suites:
        base = dict(suite=suite, mode=mode, size=size, dist="router", shape="spec", flops=moe_flops(cfg, size, mode),
                    config=cfg, dtype="bfloat16")
        yield base, lambda impls, size=size, mode=mode: moe_builders(cfg, size, mode, impls, args.interpret)
    if "gmm" in suites:
      for (k, n) in args.kn:
        for dist in args.dist:
          for mode in ("fwd", "d_lhs", "d_rhs"):
            base = dict(suite="gmm", mode=mode, size=size, dist=dist, shape=f"{k}x{n}", flops=2.0 * size * k * n,
                        groups=cfg["experts"], dtype="bfloat16")
            yield base, lambda impls, size=size, k=k, n=n, dist=dist, mode=mode: gmm_builders(
                size, k, n, cfg["experts"], dist, mode, impls, args.interpret)


def main(argv=None) -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--output", required=True, help="JSON Lines file of rows")
  p.add_argument("--append", action="store_true", help="keep the file's rows, skip cases already measured")
  p.add_argument("--rerun-failed", action="store_true", help="with --append: measure non-ok rows again")
  p.add_argument("--suite", default="moe_train,moe_fwd,gmm")
  p.add_argument("--tokens", default=None, help="comma-separated token counts (gmm: rows M)")
  p.add_argument("--impl", default=None, help="comma-separated implementations (default: all)")
  p.add_argument("--dist", default="uniform,zipf")
  p.add_argument("--kn", default=None, help="gmm K x N shapes, e.g. 512x256,128x512")
  p.add_argument("--rounds", type=int, default=3)
  p.add_argument("--repeats", type=int, default=5)
  p.add_argument("--warmup", type=int, default=2)
  p.add_argument("--min-repeat-ms", type=float, default=20.0)
  p.add_argument("--max-minutes", type=float, default=9.0)
  p.add_argument("--cpu-smoke", action="store_true",
                 help="tiny sizes on CPU, the Pallas kernels in interpret mode (checks the script, not speed)")
  p.add_argument("--cpu", action="store_true",
                 help="time on CPU at the given sizes (the CPU dispatch's evidence, e.g. --tokens 512)")
  p.add_argument("--no-progress", action="store_true")
  args = p.parse_args(argv)
  args.interpret = args.cpu_smoke
  cfg = SMOKE if args.cpu_smoke else SPEC
  args.tokens = [int(t) for t in args.tokens.split(",")] if args.tokens else list(SMOKE_TOKENS if args.cpu_smoke else TOKENS)
  args.kn = ([tuple(int(v) for v in s.split("x")) for s in args.kn.split(",")] if args.kn
             else list(SMOKE_KN if args.cpu_smoke else KN))
  args.dist = args.dist.split(",")
  if args.cpu_smoke:
    args.rounds, args.repeats, args.warmup, args.min_repeat_ms = min(args.rounds, 2), min(args.repeats, 2), 0, 0.0
  elif jax.devices()[0].platform != "gpu" and not args.cpu:
    sys.exit("bench.moe times GPUs; use --cpu-smoke to check it on CPU, --cpu to time the CPU dispatch")
  wanted = set(args.impl.split(",")) if args.impl else None

  info = timing.device_info()
  common = dict(device=info["device"], platform=info["platform"], compute_capability=info["compute_capability"],
                versions=info["versions"], commit=info["commit"], command=" ".join(["python -m bench.moe", *sys.argv[1:]]))
  done = {}
  if args.append:
    done = {row_key(r): r for r in harness.load_rows(args.output)}
  elif os.path.exists(args.output):
    os.remove(args.output)
  os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)

  def write(row):
    row = dict(common, **row, time=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))
    with open(args.output, "a") as f:
      f.write(json.dumps(row, default=str) + "\n")

  from tqdm import tqdm
  todo = []
  for base, build in cases(args, cfg):
    all_impls = DISPATCHES + PEERS if base["suite"] != "gmm" else GMM_IMPLS + PEERS
    impls = [i for i in all_impls if (wanted is None or i in wanted)
             and not ((r := done.get(row_key(dict(base, impl=i)))) and (r["status"] == "ok" or not args.rerun_failed))]
    if impls:
      todo.append((base, build, impls))
  start = time.time()
  bar = tqdm(todo, disable=args.no_progress, dynamic_ncols=True)
  for base, build, impls in bar:
    if time.time() - start > args.max_minutes * 60:
      print(f"stopped after {args.max_minutes} minutes; repeat with --append to resume", file=sys.stderr)
      break
    bar.set_description(f"{base['suite']} {base['mode']} {base['size']} {base['dist']} {base['shape']}")
    try:
      builders = build(impls)
    except Exception as e:  # noqa: BLE001 (inputs that do not fit: every impl's row says so)
      status, msg = timing.classify_error(e)
      for impl in impls:
        write(dict(base, impl=impl, status=status, error=msg))
      continue
    time_group(builders, base, args, write)
    del builders
    jax.clear_caches()


if __name__ == "__main__":
  main()
