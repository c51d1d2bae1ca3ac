"""Measured dispatch's shared runner and report (issue 41): one per op's sampler.

An op's sampler (:mod:`bench.dispatch_sample` for attention, :mod:`bench.dispatch_ops` for MLA,
the grouped matmul and the scans) draws calls and describes them as a *spec*: an object with

* ``suite``; ``plan(call, device)``: ``{path or None: Decision or Refused}``, what the op's
  ``explain_dispatch`` says the default (None) and each exact path would run, in order;
* ``function(call, path)``: ``(f, diff_argnums)``, the op called on arrays with that path's
  arguments; ``avals(call)``: the arrays' ``jax.ShapeDtypeStruct`` s; ``inputs(call)``: the arrays;
* ``row(call, plan, path, result, status, error)``: the JSON row; ``row_name(path)``: its
  ``impl``; ``check(call, row)``: raises SystemExit where a stored row of the call's id has
  another shape; ``describe(call)``, ``summary_line(rows)``: the progress lines.

:func:`run_calls` measures the calls in batches: every (call, path) of a batch is lowered and
compiled at once on a pool of ``workers`` threads (XLA's compiler and Triton's release the GIL;
the tracing and Pallas lowering in Python do not), then each call is timed alone, its paths in
rotating rounds (``bench.harness``'s rounds), nothing else running. A batch is started only
where its expected cost fits the budget; a failure is its case's status, never the run's.

The report's arithmetic (:func:`calls_of`, :func:`summarize_calls`, :func:`group_calls`,
:func:`evaluate`, :func:`build_report`, :func:`markdown`) is the same for every op: regret =
the default's ms / the fastest exact path's.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import hashlib
import json
import math
import os
import secrets
import statistics
import sys
import time
import types
from typing import Callable, Iterable

import numpy as np

# --- the budget every sampler keeps its draws in ---------------------------------------------
EST_MS_RANGE = (0.02, 20.0)  # an H200 estimate of the call's time
MAX_BYTES = 8 << 30          # its arrays (inputs, outputs, gradients)
H200_FLOPS = 400e12          # a fast kernel's throughput on an H200 (bf16/fp16, FLOP/s)
H200_BYTES = 3.0e12          # its effective HBM bandwidth (bytes/s)
MAX_DRAWS = 100_000

# --- the runner ------------------------------------------------------------------------------
# Expected seconds per (call, path) before any is measured: its compile (shared by the workers) and its timing.
PRIOR_COMPILE_S = {"fwd": 4.0, "fwd_bwd": 8.0}
PRIOR_RUN_S = 1.0
SLOW_MS = 50.0  # a call slower than this is timed with one repeat per round, no warm-up
SINGLE_CALL_MS = 250.0  # slower than this: its probe call is its time
MISS = 1.05  # the default "misses" where it is more than 5% slower than the best exact path
DEFAULT_WORKERS = min(8, os.cpu_count() or 1)


# ---------------------------------------------------------------------------------------------
# drawing
# ---------------------------------------------------------------------------------------------
def call_id(seed: int, index: int) -> str:
  """A drawn call's name in rows and reports: its sample's seed and its index there ("s4101#7")."""
  return f"s{seed}#{index}"


def log_uniform_int(rng: np.random.Generator, lo: int, hi: int) -> int:
  """An integer in [lo, hi], log-uniform (odd values as likely as their neighbours)."""
  return int(min(hi, max(lo, math.floor(math.exp(rng.uniform(math.log(lo), math.log(hi + 1)))))))


def choice(rng: np.random.Generator, options):
  return options[int(rng.integers(len(options)))]


def in_budget(est_ms: float, nbytes: int) -> bool:
  """Whether a draw lies in the budget: :data:`EST_MS_RANGE` and :data:`MAX_BYTES`."""
  return EST_MS_RANGE[0] <= est_ms <= EST_MS_RANGE[1] and nbytes <= MAX_BYTES


def roofline_ms(flops: float, nbytes: float) -> float:
  """The larger of ``flops`` at :data:`H200_FLOPS` and ``nbytes`` at :data:`H200_BYTES`, in ms:
  the budget's yardstick, not a prediction of any kernel."""
  return 1e3 * max(flops / H200_FLOPS, nbytes / H200_BYTES)


# ---------------------------------------------------------------------------------------------
# decisions
# ---------------------------------------------------------------------------------------------
class Refused(tuple):
  """``(status, message)``: why ``explain_dispatch`` gave no decision for a path (its
  ValueError: "unsupported")."""

  def __new__(cls, status: str, message: str):
    return super().__new__(cls, (status, message))


def refusal(e: BaseException) -> Refused:
  from probjax.core.timing import classify_error
  return Refused(*classify_error(e))


def impl_of(decision, grad: bool = False) -> str | None:
  """The implementation a Decision runs (under grad: what a differentiated call runs), across
  the Decision's versions (``under_grad`` / ``grad_implementation``)."""
  if decision is None or isinstance(decision, Refused):
    return None
  if grad:
    under = getattr(decision, "under_grad", None)
    if under is not None:
      return under.implementation
    return getattr(decision, "grad_implementation", None) or decision.implementation
  return decision.implementation


# ---------------------------------------------------------------------------------------------
# measuring: compile (in threads), then time (alone)
# ---------------------------------------------------------------------------------------------
def mode_function(f: Callable, mode: str, diff_argnums: tuple[int, ...]) -> Callable:
  """``f`` itself (``fwd``), or (``fwd_bwd``) a function of ``f``'s arguments and a cotangent
  that returns ``f``'s output and its vjp in the arguments ``diff_argnums``, as bench.impls
  builds every JAX-side call."""
  if mode == "fwd":
    return f
  import jax

  def fwd_bwd(*args):
    *args, ct = args
    diff = [args[i] for i in diff_argnums]

    def g(*d):
      full = list(args)
      for i, x in zip(diff_argnums, d):
        full[i] = x
      return f(*full)
    out, vjp = jax.vjp(g, *diff)
    return (out,) + tuple(vjp(ct))
  return fwd_bwd


class JaxMeasure:
  """Measures a spec's calls with JAX: :meth:`compile` (thread-safe; no device arrays: the
  arguments' ``ShapeDtypeStruct`` s) jits and lowers and compiles one path of a call;
  :meth:`inputs` makes the call's arrays (a cotangent added for ``fwd_bwd``); :meth:`prepare` runs
  the compiled call once as a probe and returns ``(timer, finish)``: the timer is
  :func:`bench.harness.time_fn` with ``timing_kw``, with one repeat and no warm-up for a call
  slower than :data:`SLOW_MS`, and for one slower than :data:`SINGLE_CALL_MS` the probe itself
  (``timing: "single call"``), so that a slow path does not eat the budget (it is not the fastest)."""

  def __init__(self, timing_kw: dict | None = None):
    self.timing_kw = dict(timing_kw or {})

  def compile(self, spec, call, path):
    import jax
    t0 = time.perf_counter()
    f, diff = spec.function(call, path)
    avals = list(spec.avals(call))
    if call.mode == "fwd_bwd":
      avals.append(jax.eval_shape(f, *avals))
    compiled = jax.jit(mode_function(f, call.mode, diff)).lower(*avals).compile()
    return compiled, round(time.perf_counter() - t0, 3)

  def inputs(self, spec, call):
    import jax
    arrays = tuple(spec.inputs(call))
    if call.mode == "fwd_bwd":
      f, _ = spec.function(call, None)
      out = jax.eval_shape(f, *spec.avals(call))
      ct = jax.tree.map(lambda s, k: jax.random.normal(k, s.shape, s.dtype), out,
                        _split_like(out, jax.random.key(call.index + 1)))
      arrays += (ct,)
    return arrays

  def prepare(self, compiled, arrays):
    from bench import harness
    exe, compile_s = compiled
    fn, sync = (lambda: exe(*arrays)), jax_block
    t0 = time.perf_counter()
    sync(fn())
    first_ms = (time.perf_counter() - t0) * 1e3
    t0 = time.perf_counter()
    sync(fn())
    probe_ms = (time.perf_counter() - t0) * 1e3
    extra = {"compile_s": compile_s, "first_call_ms": round(first_ms, 4), "probe_ms": round(probe_ms, 4)}
    if probe_ms > SINGLE_CALL_MS:
      return (lambda: {"ms": probe_ms, "n_repeats": 1, "timing": "single call"}), (lambda res: dict(res, **extra))
    kw = dict(self.timing_kw, warmup=0, repeats=1) if probe_ms > SLOW_MS else self.timing_kw
    return (lambda: harness.time_fn(fn, sync, **kw)), (lambda res: dict(res, **extra))


def jax_block(x):
  import jax
  return jax.block_until_ready(x)


def _split_like(tree, key):
  import jax
  leaves, treedef = jax.tree.flatten(tree)
  return jax.tree.unflatten(treedef, list(jax.random.split(key, len(leaves))))


def _outcome(f: Callable):
  """``(value, None)``, or ``(None, (status, error))`` where ``f()`` raised."""
  from probjax.core.timing import classify_error
  try:
    return f(), None
  except Exception as e:  # noqa: BLE001 (a case's failure is its status)
    return None, classify_error(e)


# ---------------------------------------------------------------------------------------------
# the runner
# ---------------------------------------------------------------------------------------------
def _stored_rows(spec, out: str) -> dict[str, list[dict]]:
  from bench import harness
  old: dict[str, list[dict]] = {}
  for r in harness.load_rows(out):
    if isinstance(r, dict) and r.get("suite") == spec.suite:
      old.setdefault(r.get("call_id"), []).append(r)
  os.makedirs(os.path.dirname(os.path.abspath(out)) or ".", exist_ok=True)
  if os.path.exists(out) and os.path.getsize(out):
    with open(out, "rb+") as f:  # a line cut by a killed run: the next row starts on a line of its own
      f.seek(-1, os.SEEK_END)
      if f.read(1) != b"\n":
        f.write(b"\n")
  return old


def run_calls(spec, calls: list, out: str, *, measure=None, device=None, rounds: int = 3,
              budget_s: float | None = None, clock: Callable[[], float] = time.monotonic,
              log: Callable[[str], None] | None = None, workers: int = DEFAULT_WORKERS,
              batch_calls: int | None = None, start: float | None = None) -> dict:
  """Measures each call's default and every exact path its plan accepts (``measure``, by default
  :class:`JaxMeasure`; tests inject a fake), appending rows to ``out``; rows already there (by
  call id and path) are skipped. Calls go in batches of ``batch_calls`` (default ``workers``):
  the batch's cases are compiled on ``workers`` threads, then each call's cases are timed in
  ``rounds`` rotating rounds and its rows written. A call joins a batch only where the time
  spent (from ``start``), the batch's expected cost so far and its own (the mean seconds per case
  so far, compile share included, x1.5) stay within ``budget_s``; the first call that does not fit
  ends the run after its batch (never skipping to a cheaper one, so that the calls measured stay
  the first ones of the sample). Before any case is measured, a case is expected to take
  :data:`PRIOR_COMPILE_S` over the workers plus :data:`PRIOR_RUN_S`. Returns counts."""
  from bench import harness
  log = log or (lambda s: print(s, file=sys.stderr, flush=True))
  start = clock() if start is None else start
  measure = measure or JaxMeasure()
  workers = max(1, int(workers))
  batch_calls = max(1, int(batch_calls or workers))
  old = _stored_rows(spec, out)
  stats = {"calls": len(calls), "calls_done": 0, "calls_skipped": 0, "rows_written": 0, "stopped": False,
           "batches": 0, "compile_wall_s": 0.0, "compile_sum_s": 0.0}
  spent = {"fwd": [], "fwd_bwd": []}  # seconds per case measured (its share of the compile included), by mode
  tag = f"[{spec.suite}]"
  log(f"{tag} {len(calls)} call(s), {sum(c.call_id in old for c in calls)} with rows in {out} already; "
      f"budget {budget_s if budget_s is not None else 'none'} s; {workers} compile worker(s), "
      f"{batch_calls} call(s) a batch")
  per_case = lambda mode: statistics.mean(spent[mode]) if spent[mode] else PRIOR_COMPILE_S[mode] / workers + PRIOR_RUN_S
  i = 0
  while i < len(calls) and not stats["stopped"]:
    batch, expected = [], 0.0
    while i < len(calls) and len(batch) < batch_calls:
      c = calls[i]
      stored = old.get(c.call_id, [])
      for r in stored[:1]:
        spec.check(c, r)
      have = {r.get("impl") for r in stored}
      plan = spec.plan(c, device)
      todo = [p for p in plan if spec.row_name(p) not in have]
      if not todo:
        stats["calls_skipped"] += 1
        i += 1
        continue
      timed = [p for p in todo if not isinstance(plan[p], Refused)]
      cost = 1.5 * per_case(c.mode) * len(timed)
      elapsed = clock() - start
      if budget_s is not None and elapsed + expected + cost > budget_s:
        stats["stopped"] = True
        log(f"{tag} budget: {elapsed:.0f} s spent of {budget_s:.0f} s, {expected:.0f} s expected for the "
            f"batch, {cost:.0f} s for {c.call_id}; stopping before it ({i}/{len(calls)}); the same command resumes")
        break
      batch.append(types.SimpleNamespace(pos=i + 1, call=c, plan=plan, todo=todo, timed=timed, stored=stored))
      expected += cost
      i += 1
    if not batch:
      break
    stats["batches"] += 1
    # compile every (call, path) of the batch at once
    t_batch = clock()
    keys = [(b.pos, p) for b in batch for p in b.timed]
    by_pos = {b.pos: b for b in batch}
    compiled: dict = {}
    if keys:
      t0 = time.perf_counter()
      with concurrent.futures.ThreadPoolExecutor(min(workers, len(keys))) as pool:
        futures = {k: pool.submit(_outcome, lambda k=k: measure.compile(spec, by_pos[k[0]].call, k[1])) for k in keys}
        compiled = {k: f.result() for k, f in futures.items()}
      wall = time.perf_counter() - t0
      sums = sum(v[1] for v, err in compiled.values() if err is None)
      stats["compile_wall_s"] += wall
      stats["compile_sum_s"] += sums
      log(f"{tag} batch {stats['batches']}: {len(keys)} case(s) of {len(batch)} call(s) compiled in {wall:.1f} s "
          f"(their compile times sum to {sums:.1f} s)")
    compile_share = (clock() - t_batch) / max(1, len(keys))
    # time each call alone, its paths in rotating rounds
    for b in batch:
      c = b.call
      t0 = clock()
      outcomes = {}
      if b.timed:
        arrays, err = _outcome(lambda: measure.inputs(spec, c))
        if err is not None:  # an OOM drawing the inputs: every row gets its status
          outcomes = {p: (None, *err) for p in b.timed}
        else:
          cases = []
          for p in b.timed:
            exe, cerr = compiled.pop((b.pos, p))
            if cerr is not None:
              cases.append(types.SimpleNamespace(run=lambda e=cerr: {"status": e[0], "error": e[1]}, prepare=None))
            else:
              cases.append(types.SimpleNamespace(run=lambda: {}, prepare=lambda exe=exe: measure.prepare(exe, arrays)))
          outcomes = dict(zip(b.timed, harness._run_rounds(cases, rounds)))
        arrays = cases = None
        per = (clock() - t0) / len(b.timed)
        spent[c.mode].extend([compile_share + per] * len(b.timed))
      rows = [spec.row(c, b.plan, p, *(outcomes[p] if p in outcomes else (None, *b.plan[p]))) for p in b.todo]
      with open(out, "a") as f:
        f.writelines(json.dumps(r, default=harness._json_default) + "\n" for r in rows)
      stats["rows_written"] += len(rows)
      stats["calls_done"] += 1
      log(f"{tag} {b.pos}/{len(calls)} {spec.describe(c)}: {spec.summary_line(rows + b.stored)} "
          f"[{clock() - start:.0f} s]")
    compiled = None
  stats["compile_wall_s"] = round(stats["compile_wall_s"], 3)
  stats["compile_sum_s"] = round(stats["compile_sum_s"], 3)
  if not stats["stopped"]:
    log(f"{tag} done: {stats['calls_done']} call(s) measured, {stats['calls_skipped']} already in {out}")
  return stats


def summary_line(rows: list[dict], default: str, name: Callable[[str], str] = str) -> str:
  """The progress line of a call's rows: the default's ms (and pick) against the best exact path's."""
  ms = {r["impl"]: r.get("ms") for r in rows if r.get("status") == "ok" and r.get("ms") is not None}
  d = ms.pop(default, None)
  if not ms:
    return "no exact path ran" + (f"; default {d:.3f} ms" if d else "")
  best = min(ms, key=ms.get)
  pick = next((r.get("default_impl") for r in rows if r.get("default_impl")), "?")
  if d is None:
    return f"default failed; best {name(best)} {ms[best]:.3f} ms"
  return f"default ({pick}) {d:.3f} ms, best {name(best)} {ms[best]:.3f} ms ({d / ms[best]:.2f}x)"


# ---------------------------------------------------------------------------------------------
# rows
# ---------------------------------------------------------------------------------------------
def environment() -> dict:
  """What every row records besides its measurement: the device, its compute capability, the
  versions (jax's as ``jax_version`` too), the commit, the command and the time."""
  from bench import harness
  dev = harness.device_info()
  env = {"device": dev["device"], "platform": dev["platform"], "compute_capability": dev["compute_capability"],
         "versions": dict(dev["versions"]), "jax_version": dev["versions"].get("jax"),
         "command": harness.command_line()}
  if dev["commit"]:
    env["commit"] = dev["commit"]
  env["time"] = time.strftime("%Y-%m-%dT%H:%M:%S")
  return env


# ---------------------------------------------------------------------------------------------
# the report
# ---------------------------------------------------------------------------------------------
def default_name(impl: str) -> str:
  """A row's ``impl`` as the report names it: "default" for the default, the path's name else
  (attention's "probjax_" prefix dropped)."""
  return "default" if impl in ("default", "probjax_default") else impl.removeprefix("probjax_")


# The default under ``probjax.autotune()`` (a path of its own where a run measures it: not an
# exact path of the rules, so never the best; its ratio to the best is reported beside the
# default's).
AUTOTUNED = "autotuned"


def calls_of(rows: Iterable[dict], suite: str, fields: tuple[str, ...], group: Callable[[dict], str]) -> list[dict]:
  """One record per call of ``suite``: ``fields`` of its rows, ``ms`` ({path: ms} of the rows
  that ran; "default" for the default, :data:`AUTOTUNED` for it autotuned), ``status`` ({path:
  status}), ``default_ms``, ``best_impl``/``best_ms`` (the fastest exact path), ``ratio``
  (default / best; None where either did not run), ``autotuned_ratio`` (the autotuned default /
  best, where measured), ``default_pick`` (what the default ran: under grad ``default_grad_impl``)
  and ``pick_ratio`` (the default against that path requested), ``decision_ratio`` (that path
  requested against the best: whether the decision was right, free of the run-to-run spread
  between the default's row and the same kernel's), ``apart`` (every round of the default
  slower than every round of the best: a gap the rounds' spread does not explain; None without
  both rows' rounds), ``group`` (``group(record)``).
  The later of two rows of a call and path wins."""
  by_call: dict[str, dict] = {}
  for r in rows:
    if r.get("suite") != suite or not r.get("call_id"):
      continue
    rec = by_call.setdefault(r["call_id"], {"ms": {}, "status": {}, "rounds": {}})
    for f in fields:
      if r.get(f) is not None or f not in rec:
        rec[f] = r.get(f)
    name = default_name(r["impl"])
    rec["status"][name] = r.get("status")
    rec["ms"].pop(name, None)
    rec["rounds"].pop(name, None)
    if r.get("status") == "ok" and r.get("ms") is not None:
      rec["ms"][name] = float(r["ms"])
      if r.get("round_ms"):
        rec["rounds"][name] = [float(x) for x in r["round_ms"]]
  out = []
  for rec in by_call.values():
    exact = {k: v for k, v in rec["ms"].items() if k not in ("default", AUTOTUNED)}
    rec["default_ms"] = rec["ms"].get("default")
    tuned = rec["ms"].get(AUTOTUNED)
    rec["best_impl"] = min(exact, key=exact.get) if exact else None
    rec["best_ms"] = exact[rec["best_impl"]] if exact else None
    rec["ratio"] = (rec["default_ms"] / rec["best_ms"]) if rec["default_ms"] and rec["best_ms"] else None
    rec["autotuned_ratio"] = tuned / rec["best_ms"] if tuned and rec["best_ms"] else None
    rec["default_pick"] = (rec.get("default_grad_impl") if rec.get("mode") == "fwd_bwd" else None) or rec.get("default_impl")
    same = rec["ms"].get(rec["default_pick"] or "")
    rec["pick_ratio"] = rec["default_ms"] / same if rec["default_ms"] and same else None
    rec["decision_ratio"] = same / rec["best_ms"] if same and rec["best_ms"] else None
    mine, best = rec["rounds"].get("default"), rec["rounds"].get(rec["best_impl"] or "")
    rec["apart"] = min(mine) > max(best) if mine and best else None
    rec["group"] = group(rec)
    out.append(rec)
  return sorted(out, key=lambda r: (r.get("seed") or 0, r.get("index") or 0))


def geomean(xs: list[float]) -> float | None:
  xs = [x for x in xs if x is not None and x > 0]
  return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else None


def _counts(xs) -> dict:
  out: dict = {}
  for x in xs:
    out[str(x)] = out.get(str(x), 0) + 1
  return out


def summarize_calls(calls: list[dict], miss: float = MISS, describe: Callable[[dict], str] = lambda c: c["call_id"]) -> dict:
  """n calls, compared (the default and an exact path ran), misses (default more than ``miss``
  x the best; ``misses_apart``: those whose rounds do not overlap the best's), their share, the
  geometric mean, median, 90th percentile and worst of default / best, the summed default and best ms, the calls where the default failed, how often each path
  was the best and the default's pick, and ``pick_spread_p50/p90``: the default against the same
  path requested, as max(r, 1/r) (the measurement's spread where both run the same kernel), and
  ``decision_geomean``/``decision_worst``/``decision_misses``: the same over ``decision_ratio``
  (the picked path's own row against the best), which tells a wrong decision from that spread."""
  from probjax.core.timing import percentile
  cmp = [c for c in calls if c["ratio"] is not None]
  worst = max(cmp, key=lambda c: c["ratio"]) if cmp else None
  count = lambda key: dict(sorted(_counts(c[key] for c in cmp).items()))
  ratios = [c["ratio"] for c in cmp]
  picks = [max(c["pick_ratio"], 1 / c["pick_ratio"]) for c in calls if c.get("pick_ratio")]
  decided = [c["decision_ratio"] for c in calls if c.get("decision_ratio")]
  return {"calls": len(calls), "compared": len(cmp),
          "p50": percentile(ratios, 50) if ratios else None, "p90": percentile(ratios, 90) if ratios else None,
          "pick_spread_p50": percentile(picks, 50) if picks else None,
          "pick_spread_p90": percentile(picks, 90) if picks else None,
          "misses": sum(r > miss for r in ratios),
          "misses_apart": sum(c["ratio"] > miss and bool(c.get("apart")) for c in cmp),
          **_autotuned_summary([c.get("autotuned_ratio") for c in calls if c.get("autotuned_ratio")], miss),
          "decision_geomean": geomean(decided), "decision_worst": max(decided) if decided else None,
          "decision_misses": sum(r > miss for r in decided),
          "miss_share": (sum(r > miss for r in ratios) / len(cmp)) if cmp else None,
          "geomean": geomean(ratios),
          "worst": None if worst is None else {"call_id": worst["call_id"], "ratio": worst["ratio"],
                                               "default_impl": worst.get("default_pick"),
                                               "best_impl": worst["best_impl"], "call": describe(worst)},
          "default_ms_sum": sum(c["default_ms"] for c in cmp), "best_ms_sum": sum(c["best_ms"] for c in cmp),
          "default_failed": [c["call_id"] for c in calls if c["default_ms"] is None and c["best_ms"] is not None],
          "best_impl_counts": count("best_impl"), "default_impl_counts": count("default_pick")}


def _autotuned_summary(ratios: list[float], miss: float) -> dict:
  """The autotuned default's ratios to the best: compared, geometric mean, worst, misses (empty
  where no run measured it)."""
  if not ratios:
    return {}
  return {"autotuned_compared": len(ratios), "autotuned_geomean": geomean(ratios),
          "autotuned_worst": max(ratios), "autotuned_misses": sum(r > miss for r in ratios)}


def group_calls(calls: list[dict], miss: float = MISS, describe: Callable[[dict], str] = lambda c: c["call_id"]) -> dict:
  """:func:`summarize_calls` per call ``group``, the groups with the worst geometric mean first."""
  groups: dict[str, list] = {}
  for c in calls:
    groups.setdefault(c["group"], []).append(c)
  out = {k: summarize_calls(v, miss, describe) for k, v in groups.items()}
  return dict(sorted(out.items(), key=lambda kv: -(kv[1]["geomean"] or 0)))


def evaluate(calls: list[dict], choose: Callable[[dict], str]) -> dict:
  """A candidate rule on measured calls (the fitting step's yardstick): ``choose(call)`` names an
  exact path per call record of :func:`calls_of`; returns the geometric mean and worst of its ms
  over the best, the misses, and the calls whose choice did not run."""
  ratios, missing = [], []
  for c in calls:
    if c["best_ms"] is None:
      continue
    ms = c["ms"].get(choose(c))
    if ms is None:
      missing.append(c["call_id"])
    else:
      ratios.append(ms / c["best_ms"])
  return {"compared": len(ratios), "misses": sum(r > MISS for r in ratios), "geomean": geomean(ratios),
          "worst": max(ratios) if ratios else None, "not_run": missing}


def build_report(samples: dict[str, list[dict] | None], calls: Callable[[list[dict]], list[dict]],
                 miss: float = MISS, describe: Callable[[dict], str] = lambda c: c["call_id"]) -> dict:
  """``{"miss_threshold", "samples": {name: {seeds, summary, groups, calls}}}`` of each sample's
  rows (``calls``: the op's :func:`calls_of`), with a ``warning`` where the fit and validation
  samples share a seed."""
  report = {"miss_threshold": miss, "samples": {}}
  for name, rows in samples.items():
    if rows is None:
      continue
    cs = calls(rows)
    seeds = sorted({c["seed"] for c in cs if c.get("seed") is not None})
    report["samples"][name] = {"seeds": seeds, "summary": summarize_calls(cs, miss, describe),
                               "groups": group_calls(cs, miss, describe), "calls": cs}
  fs, vs = (set(report["samples"].get(k, {}).get("seeds", [])) for k in ("fit", "validate"))
  if fs & vs:
    report["warning"] = f"the fit and validation samples share seeds {sorted(fs & vs)}"
  return report


def _f(x, spec=".3f") -> str:
  return "-" if x is None else format(x, spec)


def _fmt_counts(d: dict) -> str:
  return " ".join(f"{k} {v}" for k, v in sorted(d.items(), key=lambda kv: -kv[1])) or "-"


def markdown(report: dict, describe: Callable[[dict], str], title: str, groups_by: str, top: int = 15) -> str:
  """The report as Markdown: per sample its summary, its groups (``groups_by`` names their key)
  and its ``top`` largest misses."""
  lines = [f"# {title}", "",
           f"A miss: the default more than {report['miss_threshold']:.2f}x the best exact path's ms.", ""]
  if report.get("warning"):
    lines += [f"**Warning: {report['warning']}.**", ""]
  lines += ["| sample | seeds | calls | compared | misses (rounds apart) | geomean default/best | p90 | worst | worst call "
            "| default vs its pick requested (p50/p90) | its pick requested/best: geomean, worst, misses |",
            "|---|---|---|---|---|---|---|---|---|---|---|"]
  for name, s in report["samples"].items():
    m = s["summary"]
    w = m["worst"] or {}
    lines.append(f"| {name} | {','.join(map(str, s['seeds']))} | {m['calls']} | {m['compared']} | "
                 f"{m['misses']} ({m.get('misses_apart', '-')}) | "
                 f"{_f(m['geomean'])} | {_f(m['p90'])} | {_f(w.get('ratio'), '.2f')} | {w.get('call', '-')} "
                 f"({w.get('default_impl', '-')} vs {w.get('best_impl', '-')}) | "
                 f"{_f(m['pick_spread_p50'])}/{_f(m['pick_spread_p90'])} | "
                 f"{_f(m['decision_geomean'])}, {_f(m['decision_worst'], '.2f')}, {m['decision_misses']} |")
  tuned = [(name, s["summary"]) for name, s in report["samples"].items() if s["summary"].get("autotuned_compared")]
  if tuned:
    lines += ["", "Under `probjax.autotune()` (the default measured on first use, then cached):", "",
              "| sample | compared | geomean autotuned/best | worst | misses |", "|---|---|---|---|---|"]
    lines += [f"| {name} | {m['autotuned_compared']} | {_f(m['autotuned_geomean'])} | "
              f"{_f(m['autotuned_worst'], '.2f')} | {m['autotuned_misses']} |" for name, m in tuned]
  for name, s in report["samples"].items():
    lines += ["", f"## {name}: by {groups_by}", "",
              "| group | compared | misses | geomean | worst | default picks | best |", "|---|---|---|---|---|---|---|"]
    for g, m in s["groups"].items():
      lines.append(f"| {g} | {m['compared']} | {m['misses']} | {_f(m['geomean'])} | "
                   f"{_f((m['worst'] or {}).get('ratio'), '.2f')} | {_fmt_counts(m['default_impl_counts'])} | "
                   f"{_fmt_counts(m['best_impl_counts'])} |")
    worst = sorted((c for c in s["calls"] if c["ratio"] is not None), key=lambda c: -c["ratio"])[:top]
    lines += ["", f"### {name}: the {len(worst)} largest misses", "",
              "| call | default | default ms | best | best ms | default/best | rounds apart | all (ms) |",
              "|---|---|---|---|---|---|---|---|"]
    for c in worst:
      apart = {True: "yes", False: "no"}.get(c.get("apart"), "-")
      lines.append(f"| {describe(c)} | {c.get('default_pick')} | {_f(c['default_ms'])} | {c['best_impl']} | "
                   f"{_f(c['best_ms'])} | {c['ratio']:.2f} | {apart} | "
                   f"{', '.join(f'{k} {v:.3f}' for k, v in sorted(c['ms'].items()) if k != 'default')} |")
  return "\n".join(lines) + "\n"


def write_report(report: dict, prefix: str, text: str) -> None:
  with open(prefix + ".json", "w") as f:
    json.dump(report, f, indent=1, default=str)
  with open(prefix + ".md", "w") as f:
    f.write(text)
  for name, s in report["samples"].items():
    print(f"{name}: " + json.dumps({k: v for k, v in s["summary"].items()
                                    if k not in ("best_impl_counts", "default_impl_counts")}))
  print(f"wrote {prefix}.json and {prefix}.md")


# ---------------------------------------------------------------------------------------------
# the command line's shared pieces
# ---------------------------------------------------------------------------------------------
def shard_arg(s: str) -> tuple[int, int]:
  i, k = (int(x) for x in s.split("/"))
  if not 0 <= i < k:
    raise argparse.ArgumentTypeError(f"--shard I/K needs 0 <= I < K, got {s}")
  return i, k


def add_run_args(r: argparse.ArgumentParser) -> None:
  """``run``'s options: output, budget, rounds, timing, compile workers and batch."""
  r.add_argument("--out", required=True, help="JSON Lines file; rows already there are skipped (resume)")
  r.add_argument("--budget-s", type=float, default=None, help="wall seconds: no batch is started that would end past it")
  r.add_argument("--rounds", type=int, default=3, help="rotating rounds per call (ms: the median of the rounds')")
  r.add_argument("--repeats", type=int, default=3)
  r.add_argument("--warmup", type=int, default=1)
  r.add_argument("--min-repeat-ms", type=float, default=5.0)
  r.add_argument("--compile-workers", type=int, default=DEFAULT_WORKERS,
                 help="threads compiling a batch's cases at once (default: min(8, CPUs) = %(default)s)")
  r.add_argument("--batch-calls", type=int, default=None,
                 help="calls compiled together before they are timed (default: --compile-workers)")


def add_sample_args(s: argparse.ArgumentParser, fit_seed: int) -> None:
  s.add_argument("--seed", type=int, default=None, help=f"the sample (the fit sample: {fit_seed})")
  s.add_argument("--seed-file", default=None, help="read the seed from draw-seed's record")
  s.add_argument("--n", type=int, required=True, help="calls 0..n-1 of the sample")
  s.add_argument("--shard", type=shard_arg, default=(0, 1), help="I/K: only calls with index %% K == I")


def timing_kwargs(args) -> dict:
  return dict(warmup=args.warmup, repeats=args.repeats, min_repeat_s=args.min_repeat_ms / 1e3)


def seed_of(args) -> int:
  if args.seed_file:
    with open(args.seed_file) as f:
      return int(json.load(f)["seed"])
  if args.seed is None:
    raise SystemExit("give --seed or --seed-file")
  return args.seed


def sha256(path: str) -> str:
  h = hashlib.sha256()
  with open(path, "rb") as f:
    for chunk in iter(lambda: f.read(1 << 20), b""):
      h.update(chunk)
  return h.hexdigest()


def draw_seed(fit_files: list[str], out: str, fit_seed: int, sampler: str, load_rows: Callable[[str], list]) -> dict:
  """The validation seed, drawn after the fit from the OS's entropy (never ``fit_seed``), written
  to ``out`` with the time and the SHA-256 and row count of each fit file it follows."""
  rec = {"seed": secrets.randbelow(2**31 - 1) + 1, "drawn_at": datetime.datetime.now(datetime.timezone.utc).isoformat(),
         "after": [{"path": f, "sha256": sha256(f), "rows": len(load_rows(f))} for f in fit_files],
         "sampler": sampler}
  if rec["seed"] == fit_seed:
    rec["seed"] += 1
  with open(out, "w") as f:
    json.dump(rec, f, indent=1)
  print(json.dumps(rec))
  return rec
