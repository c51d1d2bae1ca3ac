"""Measured thresholds of XLA's dense and flash formulations off the GPU (issue 41, CPU).

On a CPU every attention call runs XLA's exact path, in one of two formulations
(``probjax/ops/attention/backends/xla/``): ``dense`` (the scores of a whole call in one array)
or ``flash`` (tiles of 256 x 256 with block skipping, linear memory). ``choose_formulation``
picks by length. This module draws CPU-sized calls at random, times both formulations of each
in one process (rotating rounds), fits the thresholds on one sample and validates them on a
sample drawn afterwards:

  python -m bench.cpu_formulations run --seed S --n N --out PATH [--budget-s SECONDS]
  python -m bench.cpu_formulations draw-seed --fit FIT.json --out SEED.json
  python -m bench.cpu_formulations run --seed-file SEED.json --n N --out VAL.json
  python -m bench.cpu_formulations report --fit FIT.json [--validate VAL.json] [--out PREFIX]

``run`` resumes: calls already in ``--out`` are skipped, so a run stopped by its budget (or
killed) continues where it stopped. The validation seed comes from ``draw-seed`` (the OS's
entropy, recorded with the time and the SHA-256 of the fit rows), so no threshold can have
been fitted to the validation calls.

Distribution (:func:`draw_call`; :data:`SAMPLER_VERSION` names it in every row): kind
self-attention (0.5: ``q_len == kv_len``, log-uniform in [16, 4096]), cross-attention (0.15:
both lengths log-uniform in [16, 4096]) or decoding (0.35: 1-64 queries log-uniform against
64-16384 keys); batch log-uniform in [1, 8]; q heads in {1, 2, 4, 8, 16} with a GQA ratio in
{1, 2, 4} dividing them; head_dim in {32, 64, 128}; mask none, causal (bottom-right aligned) or
key lengths (uniform in [kv_len // 4, kv_len], the first ``kv_len``); float32; ``fwd`` or
``fwd_bwd`` (decoding ``fwd`` only). A draw is kept when its visible-key FLOPs lie in
[1e5, 4e9] (a CPU call of microseconds to about a second); otherwise it is drawn again.

Rows: one per (call, formulation, mode) with ``suite="cpu_formulations"``, the call's fields,
``impl`` ("dense" or "flash"), ``ms`` (median over rounds of each round's median),
``round_ms``, ``status``, device, versions, commit and command.

Regret of a rule on a call = its formulation's time / the faster formulation's time. The rule
fitted (:func:`fit`, :func:`scores_rule`): dense while the call's scores ``B·H·Tq·Tkv`` are at
most ``max_scores`` and, under a causal mask, at most ``band_max_scores`` (the flash loop skips
the tiles above the diagonal); flash otherwise. The thresholds are powers of two
(:data:`SCORES_GRID`, :data:`BAND_GRID`); the fit minimises the geometric-mean regret (ties:
the smaller maximum). The report also scores the rule before the fit (:data:`BEFORE`,
:func:`length_rule`), round 1's form (:func:`head_band_rule`) and ``shipped``,
``choose_formulation`` as the code has it.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import hashlib
import json
import math
import os
import secrets
import statistics
import sys
import time

import numpy as np

# Version 2 adds round lengths (ROUND_SHARE of the calls): users' lengths are often powers of
# two or multiples of the flash tile, where flash pads nothing, and version 1 (log-uniform
# lengths only) almost never drew one.
SAMPLER_VERSION = "cpu_formulations/2"
SUITE = "cpu_formulations"
FIT_SEED = 5203  # fixed before any measurement of version 2 (version 1's was 4102); validation: draw-seed
ROUND_SHARE = 0.4
KINDS = (("self", 0.5), ("cross", 0.15), ("decode", 0.35))
LEN_RANGE = (16, 4096)
DECODE_QUERIES = (1, 64)
DECODE_KEYS = (64, 16384)
BATCH_RANGE = (1, 8)
Q_HEADS = (1, 2, 4, 8, 16)
GQA = (1, 2, 4)
HEAD_DIMS = (32, 64, 128)
MASKS = ("none", "causal", "kv_lengths")
FLOP_RANGE = (1e5, 4e9)
FORMULATIONS = ("dense", "flash")
SCORES_GRID = tuple(range(10, 27))  # log2 of the call's scores
BAND_GRID = tuple(range(10, 27))    # log2 of the call's scores under a band mask


@dataclasses.dataclass(frozen=True)
class Call:
  """One drawn call: ``[batch, q_len, q_heads, head_dim]`` queries against ``[batch, kv_len,
  kv_heads, head_dim]`` keys and values."""
  seed: int
  index: int
  kind: str
  batch: int
  q_heads: int
  kv_heads: int
  q_len: int
  kv_len: int
  head_dim: int
  mask: str
  mode: str
  kv_lengths: tuple[int, ...] | None = None

  @property
  def call_id(self) -> str:
    return f"s{self.seed}#{self.index}"

  def flops(self) -> float:
    """Forward FLOPs over the visible keys (4·B·H·Tq·Tkv·D, causal about halved); x3.5 for
    forward+backward."""
    keys = self.kv_len
    if self.mask == "causal":
      keys = max(1, self.kv_len - self.q_len / 2)
    elif self.mask == "kv_lengths":
      keys = sum(self.kv_lengths) / len(self.kv_lengths)
    f = 4.0 * self.batch * self.q_heads * self.q_len * keys * self.head_dim
    return f * (3.5 if self.mode == "fwd_bwd" else 1.0)

  def as_dict(self) -> dict:
    d = dataclasses.asdict(self)
    d["kv_lengths"] = None if self.kv_lengths is None else list(self.kv_lengths)
    d["call_id"] = self.call_id
    return d


def _log_int(rng, lo: int, hi: int) -> int:
  return int(min(hi, max(lo, math.floor(math.exp(rng.uniform(math.log(lo), math.log(hi + 1)))))))


def _choice(rng, options):
  return options[int(rng.integers(len(options)))]


def round_length(n: int) -> int:
  """A round length near ``n``: the nearest multiple of 256 (the flash tile) from 256 on, else
  the power of two at or above ``n``."""
  return max(256, int(round(n / 256)) * 256) if n >= 256 else 1 << max(0, (n - 1).bit_length())


def _draw_once(rng, seed: int, index: int) -> Call:
  kind = KINDS[int(rng.choice(len(KINDS), p=[p for _, p in KINDS]))][0]
  if kind == "self":
    q_len = kv_len = _log_int(rng, *LEN_RANGE)
  elif kind == "cross":
    q_len, kv_len = _log_int(rng, *LEN_RANGE), _log_int(rng, *LEN_RANGE)
  else:
    q_len, kv_len = _log_int(rng, *DECODE_QUERIES), _log_int(rng, *DECODE_KEYS)
  if rng.uniform() < ROUND_SHARE:  # decoding keeps its query count; the cache length is rounded
    q_len = q_len if kind == "decode" else round_length(q_len)
    kv_len = round_length(kv_len)
  batch = _log_int(rng, *BATCH_RANGE)
  q_heads = _choice(rng, Q_HEADS)
  ratio = _choice(rng, [g for g in GQA if q_heads % g == 0])
  head_dim = _choice(rng, HEAD_DIMS)
  mask = _choice(rng, MASKS)
  mode = "fwd" if kind == "decode" else _choice(rng, ("fwd", "fwd_bwd"))
  kv_lengths = None
  if mask == "kv_lengths":
    kv_lengths = (kv_len,) + tuple(int(rng.integers(max(1, kv_len // 4), kv_len + 1))
                                   for _ in range(batch - 1))
  return Call(seed, index, kind, batch, q_heads, q_heads // ratio, q_len, kv_len, head_dim, mask,
              mode, kv_lengths)


def draw_call(seed: int, index: int) -> Call:
  """Call ``index`` of sample ``seed`` (its own generator: independent of the sample's size)."""
  rng = np.random.default_rng([seed, index])
  while True:
    c = _draw_once(rng, seed, index)
    if FLOP_RANGE[0] <= c.flops() <= FLOP_RANGE[1]:
      return c


def sample(seed: int, n: int) -> list[Call]:
  return [draw_call(seed, i) for i in range(n)]


# --- timing -----------------------------------------------------------------------------------
def _builders(c: Call):
  """``{formulation: (fn, args)}`` for the call, jitted; ``fn(*args)`` returns what to wait on."""
  import jax
  import jax.numpy as jnp

  from probjax.ops.attention import masks as M
  from probjax.ops.attention.backends import xla as xla_backend

  rng = np.random.default_rng([c.seed, c.index, 1])
  f = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)
  q, k, v = f(c.batch, c.q_len, c.q_heads, c.head_dim), f(c.batch, c.kv_len, c.kv_heads, c.head_dim), \
      f(c.batch, c.kv_len, c.kv_heads, c.head_dim)
  mask = {"none": None, "causal": M.CausalMask(offset=c.kv_len - c.q_len),
          "kv_lengths": None if c.kv_lengths is None else M.KVLenMask(jnp.asarray(c.kv_lengths, jnp.int32))}[c.mask]
  scale = 1.0 / math.sqrt(c.head_dim)
  out = {}
  for form in FORMULATIONS:
    def attn(q, k, v, form=form):
      return xla_backend.attention(q, k, v, formulation=form, mask=mask, scale=scale)
    if c.mode == "fwd":
      out[form] = (jax.jit(attn), (q, k, v))
    else:
      loss = lambda q, k, v, attn=attn: jnp.sum(attn(q, k, v) ** 2)
      out[form] = (jax.jit(jax.grad(loss, argnums=(0, 1, 2))), (q, k, v))
  return out


def measure(c: Call, rounds: int = 5, min_block_s: float = 0.03) -> dict[str, dict]:
  """Both formulations of ``c`` in rotating rounds: ``{formulation: {"ms", "round_ms",
  "compile_s", "status"}}``."""
  import jax

  from probjax.core.timing import classify_error
  res = {}
  fns = {}
  for form, (fn, args) in _builders(c).items():
    try:
      t0 = time.perf_counter()
      jax.block_until_ready(fn(*args))
      res[form] = {"compile_s": time.perf_counter() - t0, "status": "ok", "round_ms": []}
      fns[form] = (fn, args)
    except Exception as e:  # noqa: BLE001 (a failure is a row's status)
      res[form] = {"status": classify_error(e)[0], "error": f"{type(e).__name__}: {e}"[:500], "ms": None}
  if not fns:
    return res
  one = {}
  for form, (fn, args) in fns.items():
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    one[form] = max(time.perf_counter() - t0, 1e-6)
  calls = {form: max(1, math.ceil(min_block_s / t)) for form, t in one.items()}
  order = list(fns)
  for r in range(rounds):
    for form in order[r % len(order):] + order[:r % len(order)]:
      fn, args = fns[form]
      times = []
      for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(calls[form]):
          out = fn(*args)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - t0) / calls[form] * 1e3)
      res[form]["round_ms"].append(statistics.median(times))
  for form in fns:
    res[form]["ms"] = statistics.median(res[form]["round_ms"])
  return res


def _done(path: str) -> set[str]:
  if not os.path.exists(path):
    return set()
  return {json.loads(l)["call_id"] for l in open(path) if l.strip()}


def run(calls: list[Call], out: str, budget_s: float | None = None, rounds: int = 5) -> int:
  """Measures the calls not yet in ``out`` (appending rows); returns how many were measured."""
  from probjax.core.timing import device_info
  info = device_info()
  command = "python -m bench.cpu_formulations " + " ".join(sys.argv[1:])
  commit = os.environ.get("PROBJAX_COMMIT") or info.get("commit")
  done = _done(out)
  todo = [c for c in calls if c.call_id not in done]
  t_start = time.monotonic()
  n = 0
  for i, c in enumerate(todo):
    if budget_s is not None and time.monotonic() - t_start > budget_s:
      print(f"budget spent after {n} calls; rerun the same command to continue", flush=True)
      break
    res = measure(c, rounds=rounds)
    with open(out, "a") as f:
      for form, r in res.items():
        row = dict(c.as_dict(), suite=SUITE, sampler=SAMPLER_VERSION, impl=form, flops=c.flops(),
                   device=info["device"], platform=info["platform"], versions=info["versions"],
                   commit=commit, command=command,
                   time=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), **r)
        f.write(json.dumps(row) + "\n")
    n += 1
    ms = {form: r.get("ms") for form, r in res.items()}
    print(f"[{len(done) + n}/{len(calls)}] {c.call_id} {c.kind} B{c.batch} H{c.q_heads}/{c.kv_heads} "
          f"T{c.q_len}/{c.kv_len} D{c.head_dim} {c.mask} {c.mode}: "
          + ", ".join(f"{k} {v:.3f} ms" if v else f"{k} {res[k]['status']}" for k, v in ms.items()),
          flush=True)
  return n


# --- fit and report ---------------------------------------------------------------------------
def calls_of(rows: list[dict]) -> list[dict]:
  """One record per call measured by both formulations: its fields and ``ms`` per formulation."""
  by = {}
  for r in rows:
    if r.get("status") == "ok" and r.get("ms"):
      by.setdefault(r["call_id"], dict(r, ms={}))["ms"][r["impl"]] = r["ms"]
  return [c for c in by.values() if all(f in c["ms"] for f in FORMULATIONS)]


def length_rule(max_len: int, max_queries: int, max_scores: int):
  """The rule before this fit (dense up to ``max_len`` keys or queries, or for at most
  ``max_queries`` queries under ``max_scores`` scores): a function of a call record."""
  def choose(c: dict) -> str:
    if max(c["q_len"], c["kv_len"]) <= max_len:
      return "dense"
    if c["q_len"] <= max_queries and c["batch"] * c["q_heads"] * c["q_len"] * c["kv_len"] <= max_scores:
      return "dense"
    return "flash"
  return choose


# The rule before the fit, kept to report what the fit changed.
BEFORE = dict(max_len=256, max_queries=16, max_scores=1 << 26)


def scores_rule(max_scores: int, band_max_scores: int):
  """The fitted form: dense while the call's scores (``B·H·Tq·Tkv``) are at most
  ``max_scores`` and, under a band (causal) mask, at most ``band_max_scores``; flash otherwise."""
  def choose(c: dict) -> str:
    scores = c["batch"] * c["q_heads"] * c["q_len"] * c["kv_len"]
    if scores > max_scores or (c["mask"] == "causal" and scores > band_max_scores):
      return "flash"
    return "dense"
  return choose


# The first fitted form (round 1 of the record in bench/tuning/cpu_formulations/): a band
# threshold on one head's scores. Its validation sample showed small causal calls (B1 H1
# T519) sent to flash 3x slower; the record keeps how it scored.
def head_band_rule(max_scores: int, band_max_head_scores: int):
  """Round 1's form: as :func:`scores_rule`, the band threshold on ``Tq·Tkv``."""
  def choose(c: dict) -> str:
    head = c["q_len"] * c["kv_len"]
    if c["batch"] * c["q_heads"] * head > max_scores or (c["mask"] == "causal" and head > band_max_head_scores):
      return "flash"
    return "dense"
  return choose


ROUND1 = dict(max_scores=1 << 23, band_max_head_scores=1 << 17)
# Round 2, fitted on version 1's sample and shipped until version 2's fit (:func:`scores_rule`).
ROUND2 = dict(max_scores=1 << 23, band_max_scores=1 << 21)


def padding(c: dict) -> float:
  """The flash loop's scores over the call's (``flash_padding``: both lengths rounded up to its
  tiles), e.g. 1.93 at T553 and 1.0 at T512 or T1024."""
  from probjax.ops.attention.backends.xla import flash_padding
  return flash_padding(c["q_len"], c["kv_len"])


def padded_rule(max_scores: int, band_max_scores: int, tiled_max_scores: int, max_padding: float):
  """Round 3's form: :func:`scores_rule`, with a lower threshold, ``tiled_max_scores``, for
  calls the flash tiles cover with little padding (:func:`padding` at most ``max_padding``)."""
  base = scores_rule(max_scores, band_max_scores)

  def choose(c: dict) -> str:
    pad = c["padding"] if "padding" in c else padding(c)
    if pad <= max_padding and c["batch"] * c["q_heads"] * c["q_len"] * c["kv_len"] > tiled_max_scores:
      return "flash"
    return base(c)
  return choose


PADDING_GRID = (1.0, 1.1, 1.25, 1.5)


def shipped(c: dict) -> str:
  """What ``choose_formulation`` (the code as it is) picks for the call record."""
  from probjax.ops.attention.backends import xla as xla_backend
  q = (c["batch"], c["q_len"], c["q_heads"], c["head_dim"])
  kv = (c["batch"], c["kv_len"], c["kv_heads"], c["head_dim"])
  return xla_backend.choose_formulation(q, kv, band=c["mask"] == "causal")


def evaluate(calls: list[dict], choose) -> dict:
  """Regret (chosen / fastest) of ``choose`` over ``calls``: geometric mean, maximum, the share
  over 1.05 and the worst calls."""
  reg = []
  for c in calls:
    best = min(c["ms"].values())
    reg.append((c["ms"][choose(c)] / best, c))
  if not reg:
    return {"n": 0}
  rs = [r for r, _ in reg]
  worst = sorted(reg, key=lambda x: -x[0])[:5]
  return {"n": len(rs), "geomean": math.exp(sum(map(math.log, rs)) / len(rs)), "max": max(rs),
          "over_1.05": sum(r > 1.05 for r in rs) / len(rs),
          "worst": [dict(regret=r, call_id=c["call_id"], kind=c["kind"], shape=_describe(c), ms=c["ms"])
                    for r, c in worst]}


def _describe(c: dict) -> str:
  return (f"B{c['batch']} H{c['q_heads']}/{c['kv_heads']} T{c['q_len']}/{c['kv_len']} "
          f"D{c['head_dim']} {c['mask']} {c['mode']}")


def fit(calls: list[dict]) -> tuple[dict, dict]:
  """The thresholds of :func:`scores_rule` (powers of two) with the least geometric-mean
  regret on ``calls`` (ties: the smaller maximum, then the smaller thresholds):
  ``(thresholds, evaluation)``."""
  best = None
  for a in SCORES_GRID:
    for b in BAND_GRID:
      t = dict(max_scores=1 << a, band_max_scores=1 << b)
      ev = evaluate(calls, scores_rule(**t))
      key = (round(ev["geomean"], 4), round(ev["max"], 3), a, b)
      if best is None or key < best[0]:
        best = (key, t, ev)
  return best[1], best[2]


def fit_padded(calls: list[dict]) -> tuple[dict, dict]:
  """The parameters of :func:`padded_rule` (thresholds powers of two, ``max_padding`` from
  :data:`PADDING_GRID`) with the least geometric-mean regret on ``calls`` (ties as :func:`fit`).
  Each call's padding is computed once, not once per candidate."""
  best = None
  calls = [dict(c, padding=padding(c)) for c in calls]
  for a in SCORES_GRID:
    for b in BAND_GRID:
      for t_ in SCORES_GRID:
        if t_ > a:
          continue  # a tiled threshold above the general one changes nothing
        for w in PADDING_GRID:
          t = dict(max_scores=1 << a, band_max_scores=1 << b, tiled_max_scores=1 << t_, max_padding=w)
          ev = evaluate(calls, padded_rule(**t))
          key = (round(ev["geomean"], 4), round(ev["max"], 3), a, b, -t_, w)
          if best is None or key < best[0]:
            best = (key, t, ev)
  return best[1], best[2]


def report(fit_rows: list[dict], val_rows: list[dict] | None = None) -> dict:
  """The fit on ``fit_rows`` and, given, its validation on ``val_rows``: each sample's regret
  under the rule before, the fitted rule, the shipped code and each formulation alone."""
  fit_calls = calls_of(fit_rows)
  fitted, fit_ev = fit(fit_calls)
  fitted_padded, _ = fit_padded(fit_calls)

  def rules(calls):
    return {"before": evaluate(calls, length_rule(**BEFORE)), "round1": evaluate(calls, head_band_rule(**ROUND1)),
            "round2": evaluate(calls, scores_rule(**ROUND2)),
            "fitted": evaluate(calls, scores_rule(**fitted)),
            "fitted_padded": evaluate(calls, padded_rule(**fitted_padded)),
            "shipped": evaluate(calls, shipped), "all_dense": evaluate(calls, lambda c: "dense"),
            "all_flash": evaluate(calls, lambda c: "flash")}
  out = {"sampler": SAMPLER_VERSION, "before": BEFORE, "fitted": fitted, "fitted_padded": fitted_padded,
         "fit": dict(seed=sorted({c["seed"] for c in fit_calls}), **rules(fit_calls))}
  if val_rows:
    val_calls = calls_of(val_rows)
    out["validate"] = dict(seed=sorted({c["seed"] for c in val_calls}), **rules(val_calls))
  return out


def markdown(rep: dict) -> str:
  lines = [f"# CPU formulation thresholds ({rep['sampler']})", "",
           f"Rule before: {rep['before']} (dense up to max_len, or few queries); fitted form: dense while "
           f"B·H·Tq·Tkv <= max_scores and, under a causal mask, <= band_max_scores ('round1': the band "
           f"threshold on one head's Tq·Tkv); fitted "
           f"on the fit sample: {rep['fitted']}. 'fitted_padded' adds a lower threshold for calls the flash "
           f"tiles cover with little padding: {rep.get('fitted_padded')}. 'shipped' is choose_formulation as "
           f"committed.", "",
           "| sample | rule | calls | geomean regret | max regret | share > 1.05 |", "|---|---|---|---|---|---|"]
  for sample_name in ("fit", "validate"):
    if sample_name not in rep:
      continue
    for name, ev in rep[sample_name].items():
      if name == "seed" or not ev.get("n"):
        continue
      lines.append(f"| {sample_name} (seed {rep[sample_name]['seed']}) | {name} | {ev['n']} | "
                   f"{ev['geomean']:.3f} | {ev['max']:.2f} | {ev['over_1.05']:.0%} |")
  for sample_name in ("fit", "validate"):
    for rule in ("fitted", "fitted_padded"):
      if sample_name in rep and rule in rep[sample_name]:
        lines += ["", f"Worst calls under the {rule} rule, {sample_name} sample:", ""]
        lines += [f"- {w['regret']:.2f}: {w['shape']} ({w['kind']}; dense {w['ms']['dense']:.3f} ms, "
                  f"flash {w['ms']['flash']:.3f} ms)" for w in rep[sample_name][rule].get("worst", [])]
  return "\n".join(lines) + "\n"


def _load(path: str) -> list[dict]:
  return [json.loads(l) for l in open(path) if l.strip()]


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  sub = p.add_subparsers(dest="cmd", required=True)
  r = sub.add_parser("run")
  r.add_argument("--seed", type=int, default=FIT_SEED)
  r.add_argument("--seed-file", default=None)
  r.add_argument("--n", type=int, default=60)
  r.add_argument("--out", required=True)
  r.add_argument("--budget-s", type=float, default=None)
  r.add_argument("--rounds", type=int, default=5)
  d = sub.add_parser("draw-seed")
  d.add_argument("--fit", required=True)
  d.add_argument("--out", required=True)
  rp = sub.add_parser("report")
  rp.add_argument("--fit", required=True)
  rp.add_argument("--validate", default=None)
  rp.add_argument("--out", default=None, help="PREFIX: writes PREFIX.json and PREFIX.md")
  args = p.parse_args(argv)
  if args.cmd == "run":
    seed = json.load(open(args.seed_file))["seed"] if args.seed_file else args.seed
    run(sample(seed, args.n), args.out, args.budget_s, args.rounds)
  elif args.cmd == "draw-seed":
    rec = {"seed": secrets.randbits(31), "drawn": datetime.datetime.now(datetime.timezone.utc).isoformat(),
           "fit_sha256": hashlib.sha256(open(args.fit, "rb").read()).hexdigest()}
    with open(args.out, "w") as f:
      json.dump(rec, f)
    print(json.dumps(rec))
  else:
    rep = report(_load(args.fit), _load(args.validate) if args.validate else None)
    text = markdown(rep)
    if args.out:
      with open(args.out + ".json", "w") as f:
        json.dump(rep, f, indent=1)
      with open(args.out + ".md", "w") as f:
        f.write(text)
    print(text)
  return 0


if __name__ == "__main__":
  sys.exit(main())
