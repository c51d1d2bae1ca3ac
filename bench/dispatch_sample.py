"""Measured dispatch (issue 41): attention calls drawn at random, every exact implementation timed.

The default (``implementation=None``) was fitted by hand on grid shapes; off the grid it is often
slower than another exact path. This module draws attention calls from the documented
distribution below, times the default and every implementation that accepts each call in one
process on the same inputs, and reports where the default misses the fastest exact path:

  python -m bench.dispatch_sample sample --seed S --n N            # the calls, one JSON line each
  python -m bench.dispatch_sample run --seed S --n N --out PATH [--budget-s SECONDS]
  python -m bench.dispatch_sample draw-seed --fit FIT.json --out SEED.json
  python -m bench.dispatch_sample report --fit FIT.json [--validate VAL.json] [--out PREFIX]

Protocol: the fit sample is seed :data:`FIT_SEED` (fixed here before any measurement); rules
are fitted on its rows only. The validation seed is drawn afterwards by ``draw-seed``, which
takes it from the OS's entropy and records it with the time and the SHA-256 of the fit rows it
follows (``run --seed-file SEED.json`` reads it), so that no rule can have been fitted to the
validation calls. Sample ``i`` of a seed does not depend on ``--n`` (each call has its own
generator, ``numpy.random.default_rng([seed, i])``): a larger ``--n`` extends a sample, and the
first K calls of a run stopped by its budget are a random sample of the same distribution.

Distribution (:func:`draw_call`; :data:`SAMPLER_VERSION` names it in every row):

* kind: self-attention prefill (0.45: ``q_len == kv_len``), cross-attention (0.20: ``q_len``
  and ``kv_len`` drawn independently; with a band mask the shorter is the queries, as a chunk of
  a prefill against its cache), decode (0.35: 1-16 queries, uniform);
* lengths: log-uniform integers in [128, 32768] (odd lengths included);
* batch: log-uniform integer in [1, 64];
* q heads: uniform in {8, 16, ..., 64}; GQA ratio (q heads per K/V head) uniform in {1, 2, 4, 8};
* head_dim: uniform in {32, 64, 80, 96, 128, 192, 256} (values as wide as keys);
* mask: uniform in none, causal, local window, key lengths (``KVLenMask``), causal & key
  lengths. Bands are aligned bottom-right (``offset = kv_len - q_len``: the last query sees the
  last key); the window's ``left`` is log-uniform in [64, 4096] (``right=0``, a causal window);
  key lengths are uniform in [kv_len // 4, kv_len] per batch element, the first one ``kv_len``;
* dtype: bfloat16 or float16 (0.5 each);
* mode: ``fwd`` or ``fwd_bwd`` (0.5 each); decode calls are ``fwd`` only (nobody differentiates
  a decoding step, and under grad the split-KV forward does not run).

A draw is kept only if its estimated time on an H200 (:func:`estimate_ms`: the visible-key
FLOPs at :data:`H200_FLOPS`, or its bytes at :data:`H200_BYTES`, whichever is slower) lies in
:data:`EST_MS_RANGE` (0.02-20 ms) and its arrays (inputs, outputs, gradients) fit in
:data:`MAX_BYTES`; otherwise the call is drawn again from the same generator. The sample is the
distribution above conditioned on that budget (long calls come with small batches and few heads).

Rows (JSON lines, one per call x implementation; ``bench.harness.make_row``'s schema: shape,
dtype, mode, impl, ms, status, device, versions (jax's included), commit (``$PROBJAX_COMMIT``,
else ``git rev-parse``), command, time) with ``suite="dispatch_sample"``, ``variant`` the call's
id ``s<seed>#<index>``, and the call's draw (``kind``, ``window``, ``kv_lengths``,
``causal_offset``, ``est_ms``), ``decision`` (what the implementation ran, per
``explain_dispatch``), ``default_decision`` / ``default_impl`` / ``default_grad_impl`` (the
default's choice for the call), ``round_ms`` (each round's median) and ``compile_s``.
Implementations whose ``supports`` refuses the call get a row with status "unsupported" and the
reason, so a resumed run skips them too.
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
from typing import Callable, Iterable

import numpy as np

SAMPLER_VERSION = "dispatch_sample/1"
SUITE = "dispatch_sample"
FIT_SEED = 4101  # fixed before any measurement (issue 41); the validation seed: draw-seed

# --- the distribution -------------------------------------------------------------------------
KINDS = (("self", 0.45), ("cross", 0.20), ("decode", 0.35))
LEN_RANGE = (128, 32768)
BATCH_RANGE = (1, 64)
Q_HEADS = (8, 16, 24, 32, 40, 48, 56, 64)
GQA_RATIOS = (1, 2, 4, 8)
HEAD_DIMS = (32, 64, 80, 96, 128, 192, 256)
DECODE_Q_RANGE = (1, 16)
MASKS = ("none", "causal", "window", "kv_lengths", "causal&kv_lengths")
WINDOW_RANGE = (64, 4096)
KV_LENGTH_MIN_FRACTION = 4  # key lengths in [kv_len // 4, kv_len]
DTYPES = ("bfloat16", "float16")
SHORT_DTYPE = {"bfloat16": "bf16", "float16": "fp16"}
MODES = ("fwd", "fwd_bwd")  # bench.harness.MODES

# --- the budget ------------------------------------------------------------------------------
EST_MS_RANGE = (0.02, 20.0)
MAX_BYTES = 8 << 30
H200_FLOPS = 400e12   # a fast kernel's attention throughput on an H200 (bf16/fp16, FLOP/s)
H200_BYTES = 3.0e12   # its effective HBM bandwidth (bytes/s)
FWD_BWD_FLOPS = 3.5   # fwd_bwd = 3.5 x fwd (bench.harness.attention_flops' convention)
FWD_BWD_BYTES = 3.0   # the backward reads q, k, v, o, dO and writes dq, dk, dv
MAX_DRAWS = 100_000

# --- the runner ------------------------------------------------------------------------------
EXACT_IMPLS = ("xla", "triton", "cudnn", "mosaic")  # implementation= names
DEFAULT = "probjax_default"
ROW_IMPL = {None: DEFAULT, **{n: f"probjax_{n}" for n in EXACT_IMPLS}}  # bench.impls' names
PRIOR_IMPL_S = {"fwd": 5.0, "fwd_bwd": 10.0}  # expected seconds per implementation before any is seen
SLOW_MS = 50.0  # a call slower than this is timed with one repeat per round, no warm-up
SINGLE_CALL_MS = 250.0  # slower than this: its probe call is its time
MISS = 1.05  # the default "misses" where it is more than 5% slower than the best exact path


# ---------------------------------------------------------------------------------------------
# sampler
# ---------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class SampledCall:
  """One drawn attention call: q ``[batch, q_len, q_heads, head_dim]``, k/v ``[batch, kv_len,
  kv_heads, head_dim]``, its mask, dtype and mode."""
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
  dtype: str
  mode: str
  window: int | None = None
  kv_lengths: tuple[int, ...] | None = None
  est_ms: float = 0.0
  draws: int = 1

  @property
  def call_id(self) -> str:
    return f"s{self.seed}#{self.index}"

  @property
  def causal_offset(self) -> int:
    """The band's offset: bottom-right alignment (the last query sees the last key)."""
    return self.kv_len - self.q_len

  @property
  def causal(self) -> bool:
    return self.mask in ("causal", "causal&kv_lengths")

  @property
  def decode(self) -> bool:
    return self.kind == "decode"

  def as_dict(self) -> dict:
    d = dataclasses.asdict(self)
    d["kv_lengths"] = None if self.kv_lengths is None else list(self.kv_lengths)
    d["call_id"] = self.call_id
    return d


def _log_uniform_int(rng: np.random.Generator, lo: int, hi: int) -> int:
  """An integer in [lo, hi], log-uniform (odd values as likely as their neighbours)."""
  return int(min(hi, max(lo, math.floor(math.exp(rng.uniform(math.log(lo), math.log(hi + 1)))))))


def _choice(rng: np.random.Generator, options):
  return options[int(rng.integers(len(options)))]


def visible_keys(q_len: int, kv_len: int, mask: str, window: int | None = None,
                 kv_lengths: Iterable[int] | None = None) -> float:
  """The mean number of keys a query sees (over the batch and the queries; at most 256 query
  positions evaluated), with the bands aligned bottom-right."""
  lens = np.asarray([kv_len] if kv_lengths is None or "kv_lengths" not in mask else list(kv_lengths),
                    np.float64)
  q = np.unique(np.linspace(0, q_len - 1, min(q_len, 256)).round())
  off = kv_len - q_len
  hi = np.minimum(lens[:, None], kv_len) - 1  # last valid key of each batch element
  lo = np.zeros_like(q)
  if mask in ("causal", "causal&kv_lengths", "window"):
    hi = np.minimum(hi, q + off)
  if mask == "window":
    lo = np.maximum(lo, q + off - int(window))
  return float(np.clip(hi - lo + 1, 0, None).mean())


def estimate_ms(c: SampledCall | dict) -> float:
  """The call's time on an H200 (ms) at :data:`H200_FLOPS` and :data:`H200_BYTES`: the larger of
  its visible-key FLOPs (4 B Hq Tq keys D, x3.5 for fwd_bwd) and its bytes (q, k, v, o; x3 for
  fwd_bwd) over those rates. The budget's yardstick, not a prediction of any kernel."""
  g = c.as_dict() if isinstance(c, SampledCall) else c
  keys = visible_keys(g["q_len"], g["kv_len"], g["mask"], g.get("window"), g.get("kv_lengths"))
  flops = 4.0 * g["batch"] * g["q_heads"] * g["q_len"] * keys * g["head_dim"]
  nbytes = 2.0 * g["head_dim"] * g["batch"] * (2 * g["q_len"] * g["q_heads"] + 2 * g["kv_len"] * g["kv_heads"])
  if g["mode"] == "fwd_bwd":
    flops *= FWD_BWD_FLOPS
    nbytes *= FWD_BWD_BYTES
  return 1e3 * max(flops / H200_FLOPS, nbytes / H200_BYTES)


def array_bytes(c: SampledCall) -> int:
  """Bytes of the call's arrays: q, k, v, o (and dO, dq, dk, dv for fwd_bwd), 2 bytes each."""
  q = c.batch * c.q_len * c.q_heads * c.head_dim
  kv = c.batch * c.kv_len * c.kv_heads * c.head_dim
  return 2 * (2 * q + 2 * kv) * (2 if c.mode == "fwd_bwd" else 1)


def _draw_once(rng: np.random.Generator, seed: int, index: int) -> SampledCall:
  kinds, probs = zip(*KINDS)
  kind = kinds[int(rng.choice(len(kinds), p=probs))]
  batch = _log_uniform_int(rng, *BATCH_RANGE)
  q_heads = _choice(rng, Q_HEADS)
  kv_heads = q_heads // _choice(rng, GQA_RATIOS)
  head_dim = _choice(rng, HEAD_DIMS)
  mask = _choice(rng, MASKS)
  dtype = _choice(rng, DTYPES)
  mode = _choice(rng, MODES)
  kv_len = _log_uniform_int(rng, *LEN_RANGE)
  if kind == "self":
    q_len = kv_len
  elif kind == "cross":
    q_len = _log_uniform_int(rng, *LEN_RANGE)
    if mask != "none" and mask != "kv_lengths" and q_len > kv_len:
      q_len, kv_len = kv_len, q_len  # a band: the queries are a chunk at the end of the keys
  else:
    q_len = int(rng.integers(DECODE_Q_RANGE[0], DECODE_Q_RANGE[1] + 1))
    mode = "fwd"
  window = _log_uniform_int(rng, *WINDOW_RANGE) if mask == "window" else None
  lengths = None
  if "kv_lengths" in mask:
    lens = rng.integers(max(1, kv_len // KV_LENGTH_MIN_FRACTION), kv_len + 1, size=batch)
    lens[0] = kv_len
    lengths = tuple(int(x) for x in lens)
  return SampledCall(seed, index, kind, batch, q_heads, kv_heads, q_len, kv_len, head_dim, mask,
                     dtype, mode, window, lengths)


def draw_call(seed: int, index: int) -> SampledCall:
  """Call ``index`` of sample ``seed``: draws from the distribution (module docstring) until one
  lies in the budget (:data:`EST_MS_RANGE`, :data:`MAX_BYTES`); ``draws`` counts the draws."""
  rng = np.random.default_rng([seed, index])
  for n in range(1, MAX_DRAWS + 1):
    c = _draw_once(rng, seed, index)
    est = estimate_ms(c)
    if EST_MS_RANGE[0] <= est <= EST_MS_RANGE[1] and array_bytes(c) <= MAX_BYTES:
      return dataclasses.replace(c, est_ms=round(est, 6), draws=n)
  raise RuntimeError(f"no call of sample {seed} index {index} within the budget in {MAX_DRAWS} draws")


def sample(seed: int, n: int, shard: tuple[int, int] = (0, 1)) -> list[SampledCall]:
  """Calls ``0..n-1`` of sample ``seed`` (``shard=(i, k)``: those with ``index % k == i``)."""
  i, k = shard
  return [draw_call(seed, j) for j in range(n) if j % k == i]


# ---------------------------------------------------------------------------------------------
# runner
# ---------------------------------------------------------------------------------------------
def make_mask(c: SampledCall):
  """The call's probjax mask (None for "none")."""
  from probjax.ops.attention import CausalMask, KVLenMask, LocalWindowMask
  if c.mask == "none":
    return None
  if c.mask == "causal":
    return CausalMask(offset=c.causal_offset)
  if c.mask == "window":
    return LocalWindowMask(left=c.window, right=0, offset=c.causal_offset)
  import jax.numpy as jnp
  lengths = KVLenMask(jnp.asarray(c.kv_lengths, jnp.int32))
  return lengths if c.mask == "kv_lengths" else CausalMask(offset=c.causal_offset) & lengths


def _dtype(name: str):
  import jax.numpy as jnp
  return {"bfloat16": jnp.bfloat16, "float16": jnp.float16}[name]


def _impl_of(decision, grad: bool = False) -> str | None:
  """The implementation a Decision runs (under grad: what a differentiated call runs), across
  the Decision's versions (``under_grad`` / ``grad_implementation``)."""
  if decision is None:
    return None
  if grad:
    under = getattr(decision, "under_grad", None)
    if under is not None:
      return under.implementation
    return getattr(decision, "grad_implementation", None) or decision.implementation
  return decision.implementation


class Refused(tuple):
  """``(status, message)``: why ``explain_dispatch`` gave no decision for an implementation
  (its ValueError: "unsupported")."""

  def __new__(cls, status: str, message: str):
    return super().__new__(cls, (status, message))


def plan_call(c: SampledCall, device=None, mask=None) -> dict:
  """``{implementation name or None: Decision or Refused}``: what ``explain_dispatch`` says the
  default and each exact implementation would run."""
  from probjax.ops.attention import explain_dispatch
  mask = make_mask(c) if mask is None else mask
  out = {}
  for impl in (None, *EXACT_IMPLS):
    try:
      out[impl] = explain_dispatch((c.batch, c.q_len, c.q_heads, c.head_dim),
                                   (c.batch, c.kv_len, c.kv_heads, c.head_dim), _dtype(c.dtype),
                                   mask=mask, implementation=impl, device=device)
    except Exception as e:  # noqa: BLE001 (ValueError: refused; anything else is recorded, never raised)
      from probjax.core.timing import classify_error
      out[impl] = Refused(*classify_error(e))
  return out


def make_inputs(c: SampledCall, seed: int = 0):
  """q, k, v, dO on the default device in the call's dtype (standard normal), shared by every
  implementation of the call."""
  import jax
  dt = _dtype(c.dtype)
  ks = jax.random.split(jax.random.key(seed), 4)
  shapes = ((c.batch, c.q_len, c.q_heads, c.head_dim), (c.batch, c.kv_len, c.kv_heads, c.head_dim),
            (c.batch, c.kv_len, c.kv_heads, c.head_dim), (c.batch, c.q_len, c.q_heads, c.head_dim))
  return tuple(jax.random.normal(k, s, dt) for k, s in zip(ks, shapes))


def jax_builder(timing_kw: dict) -> Callable:
  """``build(call, impl, mask, arrays) -> (timer, finish)`` for ``implementation=impl`` of
  probjax's ``dot_product_attention`` (None: the default), jitted (with ``jax.vjp`` for fwd_bwd,
  as ``bench.impls`` builds every JAX-side call). The first call (compilation) and one timed
  probe call run here; the timer is :func:`bench.harness.time_fn` with ``timing_kw``, with one
  repeat and no warm-up for a call slower than :data:`SLOW_MS`, and for one slower than
  :data:`SINGLE_CALL_MS` the probe itself (``timing: "single call"``), so that a slow path
  (XLA's tiled loop at 32k keys) does not eat the budget: it is not the fastest there."""
  from bench import harness, impls

  def build(c: SampledCall, impl: str | None, mask, arrays):
    from probjax.ops.attention import dot_product_attention

    def attn(q, k, v):
      return dot_product_attention(q, k, v, mask=mask, implementation=impl)
    t0 = time.perf_counter()
    fn, sync = impls._jax_fn(attn, arrays, c.dtype, c.mode)
    sync(fn())
    compile_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    sync(fn())
    probe_ms = (time.perf_counter() - t0) * 1e3
    extra = {"compile_s": round(compile_s, 3), "probe_ms": round(probe_ms, 4)}
    if probe_ms > SINGLE_CALL_MS:
      return (lambda: {"ms": probe_ms, "n_repeats": 1, "timing": "single call"}), (lambda res: dict(res, **extra))
    kw = dict(timing_kw, warmup=0, repeats=1) if probe_ms > SLOW_MS else timing_kw
    return (lambda: harness.time_fn(fn, sync, **kw)), (lambda res: dict(res, **extra))
  return build


def _case(c: SampledCall, impl: str | None, prepare):
  from bench import harness
  return harness.Case(suite=SUITE, impl=ROW_IMPL[impl], dtype=c.dtype, batch=c.batch, q_heads=c.q_heads,
                      kv_heads=c.kv_heads, q_len=c.q_len, kv_len=c.kv_len, head_dim=c.head_dim,
                      causal=c.causal, mode=c.mode, mask=c.mask, variant=c.call_id, run=(lambda: {}) if prepare else None,
                      prepare=prepare, flops=False)


def row_extra(c: SampledCall, plan: dict, impl: str | None) -> dict:
  """What a row adds to ``bench.harness.make_row``'s: the draw and the decisions."""
  d = plan.get(None)
  own = plan.get(impl)
  return {"sampler": SAMPLER_VERSION, "seed": c.seed, "index": c.index, "call_id": c.call_id, "kind": c.kind,
          "window": c.window,
          "causal_offset": c.causal_offset if c.mask in ("causal", "window", "causal&kv_lengths") else None,
          "kv_lengths": None if c.kv_lengths is None else list(c.kv_lengths), "est_ms": c.est_ms,
          "visible_keys": round(visible_keys(c.q_len, c.kv_len, c.mask, c.window, c.kv_lengths), 3),
          "decision": None if isinstance(own, Refused) else str(own),
          "default_decision": None if isinstance(d, Refused) else str(d),
          "default_impl": None if isinstance(d, Refused) else _impl_of(d),
          "default_grad_impl": _impl_of(d, grad=True) if c.mode == "fwd_bwd" and not isinstance(d, Refused) else None}


def row_key(row: dict) -> tuple:
  return row.get("call_id"), row.get("impl")


def load_rows(path: str) -> list[dict]:
  from bench import harness
  return [r for r in harness.load_rows(path) if isinstance(r, dict) and r.get("suite") == SUITE]


def _check_matches(c: SampledCall, row: dict) -> None:
  """A stored row of the call's id must have the call's shape (the sampler is unchanged)."""
  for f in ("batch", "q_heads", "kv_heads", "q_len", "kv_len", "head_dim", "mask", "dtype", "mode"):
    if row.get(f) != getattr(c, f):
      raise SystemExit(f"{row.get('call_id')}: the stored row's {f} is {row.get(f)!r}, the sampler draws "
                       f"{getattr(c, f)!r} (sampler changed?): write to a new --out file")


def run_sample(calls: list[SampledCall], out: str, *, build: Callable | None = None, device=None,
               rounds: int = 3, budget_s: float | None = None, clock: Callable[[], float] = time.monotonic,
               log: Callable[[str], None] | None = None, timing_kw: dict | None = None,
               start: float | None = None) -> dict:
  """Times each call's default and every exact implementation that accepts it (``build``, by
  default :func:`jax_builder`; tests inject a fake), in ``rounds`` rotating rounds
  (``bench.harness``'s rounds), appending rows to ``out``. Rows already in ``out`` (by call id
  and implementation) are skipped. A call is started only where the time spent (from ``start``)
  plus its expected cost (the mean seconds per implementation so far, x1.5) stays within
  ``budget_s``; the run stops at the first call that does not fit (never skipping to a cheaper
  one, so that the calls measured stay the first ones of the sample). A call's rows are written
  when its rounds end. Returns counts."""
  from bench import harness
  log = log or (lambda s: print(s, file=sys.stderr, flush=True))
  start = clock() if start is None else start
  build = build or jax_builder(timing_kw or {})
  old = {}
  for r in load_rows(out):
    old.setdefault(r.get("call_id"), []).append(r)
  os.makedirs(os.path.dirname(os.path.abspath(out)) or ".", exist_ok=True)
  if os.path.exists(out) and os.path.getsize(out):
    with open(out, "rb+") as f:  # a line cut by a killed run: the next row starts on a line of its own
      f.seek(-1, os.SEEK_END)
      if f.read(1) != b"\n":
        f.write(b"\n")
  stats = {"calls": len(calls), "calls_done": 0, "calls_skipped": 0, "rows_written": 0, "stopped": False}
  spent = {"fwd": [], "fwd_bwd": []}  # seconds per implementation timed, by mode
  log(f"[dispatch_sample] {len(calls)} call(s), {sum(c.call_id in old for c in calls)} with rows in {out} already; "
      f"budget {budget_s if budget_s is not None else 'none'} s")
  for pos, c in enumerate(calls, 1):
    stored = old.get(c.call_id, [])
    for r in stored[:1]:
      _check_matches(c, r)
    have = {r.get("impl") for r in stored}
    mask = make_mask(c)
    plan = plan_call(c, device, mask)
    todo = [impl for impl in plan if ROW_IMPL[impl] not in have]
    if not todo:
      stats["calls_skipped"] += 1
      continue
    timed = [impl for impl in todo if not isinstance(plan[impl], Refused)]
    per_impl = statistics.mean(spent[c.mode]) if spent[c.mode] else PRIOR_IMPL_S[c.mode]
    elapsed = clock() - start
    if budget_s is not None and elapsed + 1.5 * per_impl * len(timed) > budget_s:
      stats["stopped"] = True
      log(f"[dispatch_sample] budget: {elapsed:.0f} s spent of {budget_s:.0f} s, the next call needs about "
          f"{1.5 * per_impl * len(timed):.0f} s; stopping before {c.call_id} ({pos - 1}/{len(calls)} done); "
          "the same command resumes")
      break
    t0 = clock()
    outcomes = {}
    if timed:
      try:
        arrays = make_inputs(c, seed=c.index) if getattr(build, "needs_arrays", True) else None
      except Exception as e:  # noqa: BLE001 (an OOM drawing the inputs: every row gets its status)
        outcomes = {impl: (None, *harness.classify_error(e)) for impl in timed}
      else:
        cases = [_case(c, impl, lambda impl=impl: build(c, impl, mask, arrays)) for impl in timed]
        outcomes = dict(zip(timed, harness._run_rounds(cases, rounds)))
      arrays = cases = None
      spent[c.mode].append((clock() - t0) / len(timed))
    rows = []
    for impl in todo:
      if impl in outcomes:
        result, status, error = outcomes[impl]
      else:
        result, (status, error) = None, plan[impl]
      row = harness.make_row(_case(c, impl, None), result, status, error)
      row.update(row_extra(c, plan, impl), jax_version=row.get("versions", {}).get("jax"))
      rows.append(row)
    with open(out, "a") as f:
      f.writelines(json.dumps(r, default=harness._json_default) + "\n" for r in rows)
    stats["rows_written"] += len(rows)
    stats["calls_done"] += 1
    log(f"[dispatch_sample] {pos}/{len(calls)} {describe(c)}: {summary_line(rows + stored)} "
        f"[{clock() - start:.0f} s]")
  if not stats["stopped"]:
    log(f"[dispatch_sample] done: {stats['calls_done']} call(s) measured, {stats['calls_skipped']} already in {out}")
  return stats


def describe(c: SampledCall | dict) -> str:
  g = c.as_dict() if isinstance(c, SampledCall) else c
  m = g["mask"] + (f"{g['window']}" if g["mask"] == "window" else "")
  return (f"{g['call_id']} {g['kind']} {SHORT_DTYPE.get(g["dtype"], g["dtype"])} B{g['batch']} H{g['q_heads']}/{g['kv_heads']} "
          f"T{g['q_len']}/{g['kv_len']} D{g['head_dim']} {m} {g['mode']}")


def summary_line(rows: list[dict]) -> str:
  ms = {r["impl"]: r.get("ms") for r in rows if r.get("status") == "ok" and r.get("ms") is not None}
  default = ms.pop(DEFAULT, None)
  if not ms:
    return "no exact implementation ran" + (f"; default {default:.3f} ms" if default else "")
  best = min(ms, key=ms.get)
  pick = next((r.get("default_impl") for r in rows if r.get("default_impl")), "?")
  if default is None:
    return f"default failed; best {best} {ms[best]:.3f} ms"
  return f"default ({pick}) {default:.3f} ms, best {best[8:]} {ms[best]:.3f} ms ({default / ms[best]:.2f}x)"


# ---------------------------------------------------------------------------------------------
# report
# ---------------------------------------------------------------------------------------------
HEAD_DIM_BUCKETS = {32: "32", 64: "64", 80: "80/96", 96: "80/96", 128: "128", 192: "192/256", 256: "192/256"}
CALL_FIELDS = ("call_id", "seed", "index", "kind", "dtype", "batch", "q_heads", "kv_heads", "q_len", "kv_len",
               "head_dim", "mask", "window", "mode", "est_ms", "visible_keys", "default_decision", "default_impl",
               "default_grad_impl", "device", "commit")


def head_dim_bucket(d: int) -> str:
  return HEAD_DIM_BUCKETS.get(d, str(d))


def calls_of(rows: Iterable[dict]) -> list[dict]:
  """One record per call: its draw (:data:`CALL_FIELDS`), ``ms`` ({implementation: ms} of the
  rows that ran; "default" for the default, "xla", "triton", ... for the exact ones),
  ``status`` ({implementation: status}), ``default_ms``, ``best_impl``/``best_ms`` (the fastest
  exact implementation) and ``ratio`` (default / best; None where either did not run). The
  later of two rows of a call and implementation wins."""
  by_call: dict[str, dict] = {}
  for r in rows:
    if r.get("suite") != SUITE or not r.get("call_id"):
      continue
    rec = by_call.setdefault(r["call_id"], {"ms": {}, "status": {}})
    for f in CALL_FIELDS:
      if r.get(f) is not None or f not in rec:
        rec[f] = r.get(f)
    name = "default" if r["impl"] == DEFAULT else r["impl"].removeprefix("probjax_")
    rec["status"][name] = r.get("status")
    rec["ms"].pop(name, None)
    if r.get("status") == "ok" and r.get("ms") is not None:
      rec["ms"][name] = float(r["ms"])
  out = []
  for rec in by_call.values():
    exact = {k: v for k, v in rec["ms"].items() if k != "default"}
    rec["default_ms"] = rec["ms"].get("default")
    rec["best_impl"] = min(exact, key=exact.get) if exact else None
    rec["best_ms"] = exact[rec["best_impl"]] if exact else None
    rec["ratio"] = (rec["default_ms"] / rec["best_ms"]) if rec["default_ms"] and rec["best_ms"] else None
    rec["default_pick"] = (rec.get("default_grad_impl") if rec.get("mode") == "fwd_bwd" else None) or rec.get("default_impl")
    same = rec["ms"].get(rec["default_pick"] or "")
    rec["pick_ratio"] = rec["default_ms"] / same if rec["default_ms"] and same else None
    rec["group"] = group_key(rec)
    out.append(rec)
  return sorted(out, key=lambda r: (r.get("seed") or 0, r.get("index") or 0))


def group_key(rec: dict) -> str:
  """(head_dim bucket, mask kind, mode, decode or not) as text, e.g. ``D80/96 window fwd prefill``."""
  return (f"D{head_dim_bucket(rec['head_dim'])} {rec['mask']} {rec['mode']} "
          f"{'decode' if rec.get('kind') == 'decode' else 'prefill'}")


def geomean(xs: list[float]) -> float | None:
  xs = [x for x in xs if x is not None and x > 0]
  return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else None


def summarize_calls(calls: list[dict], miss: float = MISS) -> dict:
  """n calls, compared (the default and an exact implementation ran), misses (default more than
  ``miss`` x the best), their share, the geometric mean, median, 90th percentile and worst of
  default / best, the summed default and best ms, the calls where the default failed, how often
  each implementation was the best and the default's pick, and ``pick_spread_p50/p90``: the
  default against the same implementation requested, as max(r, 1/r) (the measurement's spread
  where both run the same kernel)."""
  cmp = [c for c in calls if c["ratio"] is not None]
  worst = max(cmp, key=lambda c: c["ratio"]) if cmp else None
  count = lambda key: dict(sorted(_counts(c[key] for c in cmp).items()))
  ratios = [c["ratio"] for c in cmp]
  picks = [max(c["pick_ratio"], 1 / c["pick_ratio"]) for c in calls if c.get("pick_ratio")]
  from probjax.core.timing import percentile
  return {"calls": len(calls), "compared": len(cmp),
          "p50": percentile(ratios, 50) if ratios else None, "p90": percentile(ratios, 90) if ratios else None,
          # the default against the same implementation requested (it runs the same kernel unless its
          # settings differ): the spread of the measurement itself
          "pick_spread_p50": percentile(picks, 50) if picks else None,
          "pick_spread_p90": percentile(picks, 90) if picks else None,
          "misses": sum(c["ratio"] > miss for c in cmp),
          "miss_share": (sum(c["ratio"] > miss for c in cmp) / len(cmp)) if cmp else None,
          "geomean": geomean([c["ratio"] for c in cmp]),
          "worst": None if worst is None else {"call_id": worst["call_id"], "ratio": worst["ratio"],
                                               "default_impl": worst.get("default_pick"),
                                               "best_impl": worst["best_impl"], "call": describe(worst)},
          "default_ms_sum": sum(c["default_ms"] for c in cmp), "best_ms_sum": sum(c["best_ms"] for c in cmp),
          "default_failed": [c["call_id"] for c in calls if c["default_ms"] is None and c["best_ms"] is not None],
          "best_impl_counts": count("best_impl"), "default_impl_counts": count("default_pick")}


def _counts(xs) -> dict:
  out: dict = {}
  for x in xs:
    out[str(x)] = out.get(str(x), 0) + 1
  return out


def group_calls(calls: list[dict], miss: float = MISS) -> dict:
  """:func:`summarize_calls` per :func:`group_key`, the groups with the worst geometric mean first."""
  groups: dict[str, list] = {}
  for c in calls:
    groups.setdefault(c["group"], []).append(c)
  out = {k: summarize_calls(v, miss) for k, v in groups.items()}
  return dict(sorted(out.items(), key=lambda kv: -(kv[1]["geomean"] or 0)))


def evaluate(calls: list[dict], choose: Callable[[dict], str]) -> dict:
  """A candidate rule on measured calls (the fitting step's yardstick): ``choose(call)`` names an
  exact implementation ("xla", "triton", ...) per call record of :func:`calls_of`; returns the
  geometric mean and worst of its ms over the best, the misses, and the calls whose choice did
  not run."""
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


def build_report(fit_rows: list[dict], val_rows: list[dict] | None = None, miss: float = MISS) -> dict:
  report = {"miss_threshold": miss, "samples": {}}
  for name, rows in (("fit", fit_rows), ("validate", val_rows)):
    if rows is None:
      continue
    calls = calls_of(rows)
    seeds = sorted({c["seed"] for c in calls if c.get("seed") is not None})
    report["samples"][name] = {"seeds": seeds, "summary": summarize_calls(calls, miss),
                               "groups": group_calls(calls, miss), "calls": calls}
  fs, vs = (set(report["samples"].get(k, {}).get("seeds", [])) for k in ("fit", "validate"))
  if fs & vs:
    report["warning"] = f"the fit and validation samples share seeds {sorted(fs & vs)}"
  return report


def _f(x, spec=".3f") -> str:
  return "-" if x is None else format(x, spec)


def markdown(report: dict, top: int = 15) -> str:
  lines = [f"# Measured dispatch: the default against the fastest exact implementation",
           "", f"A miss: the default more than {report['miss_threshold']:.2f}x the best exact implementation's ms.", ""]
  if report.get("warning"):
    lines += [f"**Warning: {report['warning']}.**", ""]
  lines += ["| sample | seeds | calls | compared | misses | geomean default/best | p90 | worst | worst call "
            "| default vs its pick requested (p50/p90) |",
            "|---|---|---|---|---|---|---|---|---|---|"]
  for name, s in report["samples"].items():
    m = s["summary"]
    w = m["worst"] or {}
    lines.append(f"| {name} | {','.join(map(str, s['seeds']))} | {m['calls']} | {m['compared']} | {m['misses']} | "
                 f"{_f(m['geomean'])} | {_f(m['p90'])} | {_f(w.get('ratio'), '.2f')} | {w.get('call', '-')} "
                 f"({w.get('default_impl', '-')} vs {w.get('best_impl', '-')}) | "
                 f"{_f(m['pick_spread_p50'])}/{_f(m['pick_spread_p90'])} |")
  for name, s in report["samples"].items():
    lines += ["", f"## {name}: by head_dim, mask, mode, decode", "",
              "| group | compared | misses | geomean | worst | default picks | best |", "|---|---|---|---|---|---|---|"]
    for g, m in s["groups"].items():
      lines.append(f"| {g} | {m['compared']} | {m['misses']} | {_f(m['geomean'])} | "
                   f"{_f((m['worst'] or {}).get('ratio'), '.2f')} | {_fmt_counts(m['default_impl_counts'])} | "
                   f"{_fmt_counts(m['best_impl_counts'])} |")
    worst = sorted((c for c in s["calls"] if c["ratio"] is not None), key=lambda c: -c["ratio"])[:top]
    lines += ["", f"### {name}: the {len(worst)} largest misses", "",
              "| call | default | default ms | best | best ms | default/best | all (ms) |", "|---|---|---|---|---|---|---|"]
    for c in worst:
      lines.append(f"| {describe(c)} | {c.get('default_pick')} | {_f(c['default_ms'])} | {c['best_impl']} | "
                   f"{_f(c['best_ms'])} | {c['ratio']:.2f} | "
                   f"{', '.join(f'{k} {v:.3f}' for k, v in sorted(c['ms'].items()) if k != 'default')} |")
  return "\n".join(lines) + "\n"


def _fmt_counts(d: dict) -> str:
  return " ".join(f"{k} {v}" for k, v in sorted(d.items(), key=lambda kv: -kv[1])) or "-"


# ---------------------------------------------------------------------------------------------
# command line
# ---------------------------------------------------------------------------------------------
def _shard(s: str) -> tuple[int, int]:
  i, k = (int(x) for x in s.split("/"))
  if not 0 <= i < k:
    raise argparse.ArgumentTypeError(f"--shard I/K needs 0 <= I < K, got {s}")
  return i, k


def _seed_of(args) -> int:
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


def main(argv=None, *, build: Callable | None = None, clock: Callable[[], float] = time.monotonic,
         device=None) -> int:
  """The command line; ``build``, ``clock`` and ``device`` are for tests (a fake timing, clock and device)."""
  p = argparse.ArgumentParser(prog="python -m bench.dispatch_sample", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  sub = p.add_subparsers(dest="cmd", required=True)
  for name in ("sample", "run"):
    s = sub.add_parser(name)
    s.add_argument("--seed", type=int, default=None, help=f"the sample (the fit sample: {FIT_SEED})")
    s.add_argument("--seed-file", default=None, help="read the seed from draw-seed's record")
    s.add_argument("--n", type=int, required=True, help="calls 0..n-1 of the sample")
    s.add_argument("--shard", type=_shard, default=(0, 1), help="I/K: only calls with index %% K == I")
  r = sub.choices["run"]
  r.add_argument("--out", required=True, help="JSON Lines file; rows already there are skipped (resume)")
  r.add_argument("--budget-s", type=float, default=None, help="wall seconds: no call is started that would end past it")
  r.add_argument("--rounds", type=int, default=3, help="rotating rounds per call (ms: the median of the rounds')")
  r.add_argument("--repeats", type=int, default=3)
  r.add_argument("--warmup", type=int, default=1)
  r.add_argument("--min-repeat-ms", type=float, default=5.0)
  d = sub.add_parser("draw-seed", help="draw the validation seed after the fit, and record it")
  d.add_argument("--fit", required=True, nargs="+", help="the fit sample's rows, which the seed follows")
  d.add_argument("--out", required=True)
  rep = sub.add_parser("report")
  rep.add_argument("--fit", required=True, nargs="+")
  rep.add_argument("--validate", nargs="+", default=None)
  rep.add_argument("--out", default=None, help="writes OUT.json and OUT.md (default: next to the first --fit file)")
  rep.add_argument("--miss", type=float, default=MISS, help="a miss: default/best above this (default %(default)s)")
  args = p.parse_args(argv)

  if args.cmd == "sample":
    for c in sample(_seed_of(args), args.n, args.shard):
      print(json.dumps(c.as_dict()))
    return 0
  if args.cmd == "run":
    start = clock()
    calls = sample(_seed_of(args), args.n, args.shard)
    timing_kw = dict(warmup=args.warmup, repeats=args.repeats, min_repeat_s=args.min_repeat_ms / 1e3)
    if build is None:
      from bench import harness
      harness.setup_environment(args)
    stats = run_sample(calls, args.out, build=build, device=device, rounds=args.rounds, budget_s=args.budget_s, clock=clock,
                       timing_kw=timing_kw, start=start)
    print(json.dumps(stats))
    return 0
  if args.cmd == "draw-seed":
    rec = {"seed": secrets.randbelow(2**31 - 1) + 1, "drawn_at": datetime.datetime.now(datetime.timezone.utc).isoformat(),
           "after": [{"path": f, "sha256": sha256(f), "rows": len(load_rows(f))} for f in args.fit],
           "sampler": SAMPLER_VERSION}
    if rec["seed"] == FIT_SEED:
      rec["seed"] += 1
    with open(args.out, "w") as f:
      json.dump(rec, f, indent=1)
    print(json.dumps(rec))
    return 0
  fit = [r for f in args.fit for r in load_rows(f)]
  val = [r for f in args.validate for r in load_rows(f)] if args.validate else None
  report = build_report(fit, val, args.miss)
  prefix = args.out or os.path.splitext(args.fit[0])[0] + ".report"
  with open(prefix + ".json", "w") as f:
    json.dump(report, f, indent=1, default=str)
  with open(prefix + ".md", "w") as f:
    f.write(markdown(report))
  for name, s in report["samples"].items():
    print(f"{name}: " + json.dumps({k: v for k, v in s["summary"].items()
                                    if k not in ("best_impl_counts", "default_impl_counts")}))
  print(f"wrote {prefix}.json and {prefix}.md")
  return 0


if __name__ == "__main__":
  sys.exit(main())
