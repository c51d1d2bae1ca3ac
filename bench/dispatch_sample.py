"""Measured dispatch (issue 41): attention calls drawn at random, every exact implementation timed.

The default (``implementation=None``) was fitted by hand on grid shapes; off the grid it is often
slower than another exact path. This module draws attention calls from the documented
distribution below, times the default and every implementation that accepts each call in one
process on the same inputs, and reports where the default misses the fastest exact path:

  python -m bench.dispatch_sample sample --seed S --n N            # the calls, one JSON line each
  python -m bench.dispatch_sample run --seed S --n N --out PATH [--budget-s SECONDS] [--compile-workers W] [--autotune-cache C.json]
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
default's choice for the call), ``round_ms`` (each round's median), ``compile_s`` (its lowering
and compilation, in a thread beside the batch's others), ``first_call_ms`` and ``probe_ms``.
Implementations whose ``supports`` refuses the call get a row with status "unsupported" and the
reason, so a resumed run skips them too; a case that fails to compile gets its status.

The runner is :func:`bench.dispatch_core.run_calls` (shared with :mod:`bench.dispatch_ops`):
calls in batches of ``--batch-calls`` (default ``--compile-workers``, min(8, CPUs)), every
(call, implementation) of a batch lowered and compiled at once on ``--compile-workers``
threads, then each call timed alone in rotating rounds; no batch is started past the budget.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import threading
import time
from typing import Callable, Iterable

import numpy as np

from bench import dispatch_core as core
from bench.dispatch_core import (EST_MS_RANGE, H200_BYTES, H200_FLOPS, MAX_BYTES, MAX_DRAWS, MISS,  # noqa: F401
                                 Refused, evaluate, geomean, impl_of)

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

# --- the budget (EST_MS_RANGE, MAX_BYTES, H200_FLOPS, H200_BYTES: bench.dispatch_core's) -----------
FWD_BWD_FLOPS = 3.5   # fwd_bwd = 3.5 x fwd (bench.harness.attention_flops' convention)
FWD_BWD_BYTES = 3.0   # the backward reads q, k, v, o, dO and writes dq, dk, dv

# --- the runner ------------------------------------------------------------------------------
EXACT_IMPLS = ("xla", "triton", "cudnn", "mosaic")  # implementation= names
DEFAULT = "probjax_default"
ROW_IMPL = {None: DEFAULT, **{n: f"probjax_{n}" for n in EXACT_IMPLS},  # bench.impls' names
            core.AUTOTUNED: f"probjax_{core.AUTOTUNED}"}


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
    return core.call_id(self.seed, self.index)

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
  return core.roofline_ms(flops, nbytes)


def array_bytes(c: SampledCall) -> int:
  """Bytes of the call's arrays: q, k, v, o (and dO, dq, dk, dv for fwd_bwd), 2 bytes each."""
  q = c.batch * c.q_len * c.q_heads * c.head_dim
  kv = c.batch * c.kv_len * c.kv_heads * c.head_dim
  return 2 * (2 * q + 2 * kv) * (2 if c.mode == "fwd_bwd" else 1)


def _draw_once(rng: np.random.Generator, seed: int, index: int) -> SampledCall:
  kinds, probs = zip(*KINDS)
  kind = kinds[int(rng.choice(len(kinds), p=probs))]
  batch = core.log_uniform_int(rng, *BATCH_RANGE)
  q_heads = core.choice(rng, Q_HEADS)
  kv_heads = q_heads // core.choice(rng, GQA_RATIOS)
  head_dim = core.choice(rng, HEAD_DIMS)
  mask = core.choice(rng, MASKS)
  dtype = core.choice(rng, DTYPES)
  mode = core.choice(rng, MODES)
  kv_len = core.log_uniform_int(rng, *LEN_RANGE)
  if kind == "self":
    q_len = kv_len
  elif kind == "cross":
    q_len = core.log_uniform_int(rng, *LEN_RANGE)
    if mask != "none" and mask != "kv_lengths" and q_len > kv_len:
      q_len, kv_len = kv_len, q_len  # a band: the queries are a chunk at the end of the keys
  else:
    q_len = int(rng.integers(DECODE_Q_RANGE[0], DECODE_Q_RANGE[1] + 1))
    mode = "fwd"
  window = core.log_uniform_int(rng, *WINDOW_RANGE) if mask == "window" else None
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
    if core.in_budget(est, array_bytes(c)):
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


def jnp_dtype(name: str):
  import jax.numpy as jnp
  return {"bfloat16": jnp.bfloat16, "float16": jnp.float16}[name]


def plan_call(c: SampledCall, device=None, mask=None) -> dict:
  """``{implementation name or None: Decision or Refused}``: what ``explain_dispatch`` says the
  default and each exact implementation would run."""
  from probjax.ops.attention import explain_dispatch
  mask = make_mask(c) if mask is None else mask
  out = {}
  for impl in (None, *EXACT_IMPLS):
    try:
      out[impl] = explain_dispatch((c.batch, c.q_len, c.q_heads, c.head_dim),
                                   (c.batch, c.kv_len, c.kv_heads, c.head_dim), jnp_dtype(c.dtype),
                                   mask=mask, implementation=impl, device=device)
    except Exception as e:  # noqa: BLE001 (ValueError: refused; anything else is recorded, never raised)
      out[impl] = core.refusal(e)
  return out


def shapes(c: SampledCall) -> tuple:
  """q, k, v: ``[batch, q_len, q_heads, head_dim]``, ``[batch, kv_len, kv_heads, head_dim]`` twice."""
  kv = (c.batch, c.kv_len, c.kv_heads, c.head_dim)
  return (c.batch, c.q_len, c.q_heads, c.head_dim), kv, kv


def make_inputs(c: SampledCall, seed: int = 0):
  """q, k, v on the default device in the call's dtype (standard normal), shared by every
  implementation of the call."""
  import jax
  dt = jnp_dtype(c.dtype)
  return tuple(jax.random.normal(k, s, dt) for k, s in zip(jax.random.split(jax.random.key(seed), 3), shapes(c)))


def row_case(c: SampledCall, row_impl: str, suite: str = SUITE):
  """The harness case of a call's row, ``row_impl`` its ``impl`` (for attention's sample:
  :data:`ROW_IMPL`'s name of the implementation)."""
  from bench import harness
  return harness.Case(suite=suite, impl=row_impl, dtype=c.dtype, batch=c.batch, q_heads=c.q_heads,
                      kv_heads=c.kv_heads, q_len=c.q_len, kv_len=c.kv_len, head_dim=c.head_dim,
                      causal=c.causal, mode=c.mode, mask=c.mask, variant=c.call_id, run=None, flops=False)


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
          "default_impl": impl_of(d),
          "default_grad_impl": impl_of(d, grad=True) if c.mode == "fwd_bwd" else None}


def row_key(row: dict) -> tuple:
  return row.get("call_id"), row.get("impl")


def load_rows(path: str) -> list[dict]:
  from bench import harness
  return [r for r in harness.load_rows(path) if isinstance(r, dict) and r.get("suite") == SUITE]


class AttentionSpec:
  """Attention as :func:`bench.dispatch_core.run_calls` measures it (the spec's methods: that
  module's docstring): ``dot_product_attention`` with the call's mask and ``implementation=``
  None (the default) or each of :data:`EXACT_IMPLS`; rows of ``bench.harness.make_row``'s schema
  plus :func:`row_extra`.

  With ``autotune_cache`` (a JSON path) each call also gets the path
  :data:`bench.dispatch_core.AUTOTUNED`: the default traced under
  ``probjax.autotune(cache_path=autotune_cache)``, which measures the call's exact candidates
  on its first trace and runs the fastest (rows ``probjax_autotuned``). Its tracing holds a lock,
  so that two compile threads never time candidates on the device at once."""
  suite = SUITE

  def __init__(self, autotune_cache: str | None = None):
    self.autotune_cache = autotune_cache
    self._tuning = threading.Lock()

  def plan(self, c: SampledCall, device) -> dict:
    plan = plan_call(c, device)
    if self.autotune_cache is not None:
      plan[core.AUTOTUNED] = plan[None]
    return plan

  def function(self, c: SampledCall, impl: str | None):
    from probjax.ops.attention import dot_product_attention
    mask = make_mask(c)
    if impl != core.AUTOTUNED:
      return (lambda q, k, v: dot_product_attention(q, k, v, mask=mask, implementation=impl)), (0, 1, 2)
    import probjax

    def tuned(q, k, v):
      with self._tuning, probjax.autotune(cache_path=self.autotune_cache):
        return dot_product_attention(q, k, v, mask=mask)
    return tuned, (0, 1, 2)

  def avals(self, c: SampledCall):
    import jax
    return tuple(jax.ShapeDtypeStruct(s, jnp_dtype(c.dtype)) for s in shapes(c))

  def inputs(self, c: SampledCall):
    return make_inputs(c, seed=c.index)

  def row_name(self, impl: str | None) -> str:
    return ROW_IMPL[impl]

  def row(self, c: SampledCall, plan: dict, impl: str | None, result, status: str, error) -> dict:
    from bench import harness
    row = harness.make_row(row_case(c, ROW_IMPL[impl]), result, status, error)
    row.update(row_extra(c, plan, impl), jax_version=row.get("versions", {}).get("jax"))
    if impl == core.AUTOTUNED:  # measured when traced: the choice is the cache's, not a rule's
      row["decision"] = f"autotuned: the choice cached in {self.autotune_cache}"
    return row

  def check(self, c: SampledCall, row: dict) -> None:
    """A stored row of the call's id must have the call's shape (the sampler is unchanged)."""
    for f in ("batch", "q_heads", "kv_heads", "q_len", "kv_len", "head_dim", "mask", "dtype", "mode"):
      if row.get(f) != getattr(c, f):
        raise SystemExit(f"{row.get('call_id')}: the stored row's {f} is {row.get(f)!r}, the sampler draws "
                         f"{getattr(c, f)!r} (sampler changed?): write to a new --out file")

  def describe(self, c) -> str:
    return describe(c)

  def summary_line(self, rows: list[dict]) -> str:
    return core.summary_line(rows, DEFAULT, lambda impl: impl.removeprefix("probjax_"))


ATTENTION = AttentionSpec()


def run_sample(calls: list[SampledCall], out: str, *, measure=None, device=None, rounds: int = 3,
               budget_s: float | None = None, clock: Callable[[], float] = time.monotonic,
               log: Callable[[str], None] | None = None, timing_kw: dict | None = None,
               start: float | None = None, workers: int = core.DEFAULT_WORKERS, batch_calls: int | None = None,
               autotune_cache: str | None = None) -> dict:
  """:func:`bench.dispatch_core.run_calls` of attention's calls: each call's default and every
  exact implementation that accepts it (and, with ``autotune_cache``, the default autotuned:
  :class:`AttentionSpec`), compiled ``workers`` at a time in batches of ``batch_calls`` calls,
  then timed alone in ``rounds`` rotating rounds (``measure``: by default
  :class:`bench.dispatch_core.JaxMeasure` with ``timing_kw``; tests inject a fake). Rows already
  in ``out`` are skipped; no batch is started past ``budget_s``. Returns counts."""
  spec = ATTENTION if autotune_cache is None else AttentionSpec(autotune_cache)
  return core.run_calls(spec, calls, out, measure=measure or core.JaxMeasure(timing_kw), device=device,
                        rounds=rounds, budget_s=budget_s, clock=clock, log=log, workers=workers,
                        batch_calls=batch_calls, start=start)


def describe(c: SampledCall | dict) -> str:
  g = c.as_dict() if isinstance(c, SampledCall) else c
  m = g["mask"] + (f"{g['window']}" if g["mask"] == "window" else "")
  return (f"{g['call_id']} {g['kind']} {SHORT_DTYPE.get(g["dtype"], g["dtype"])} B{g['batch']} H{g['q_heads']}/{g['kv_heads']} "
          f"T{g['q_len']}/{g['kv_len']} D{g['head_dim']} {m} {g['mode']}")



# ---------------------------------------------------------------------------------------------
# report (the arithmetic: bench.dispatch_core's, the same for every op)
# ---------------------------------------------------------------------------------------------
HEAD_DIM_BUCKETS = {32: "32", 64: "64", 80: "80/96", 96: "80/96", 128: "128", 192: "192/256", 256: "192/256"}
CALL_FIELDS = ("call_id", "seed", "index", "kind", "dtype", "batch", "q_heads", "kv_heads", "q_len", "kv_len",
               "head_dim", "mask", "window", "mode", "est_ms", "visible_keys", "default_decision", "default_impl",
               "default_grad_impl", "device", "commit")


def head_dim_bucket(d: int) -> str:
  return HEAD_DIM_BUCKETS.get(d, str(d))


def group_key(rec: dict) -> str:
  """(head_dim bucket, mask kind, mode, decode or not) as text, e.g. ``D80/96 window fwd prefill``."""
  return (f"D{head_dim_bucket(rec['head_dim'])} {rec['mask']} {rec['mode']} "
          f"{'decode' if rec.get('kind') == 'decode' else 'prefill'}")


def calls_of(rows: Iterable[dict]) -> list[dict]:
  """One record per call (:func:`bench.dispatch_core.calls_of`): its draw (:data:`CALL_FIELDS`),
  ``ms`` ({implementation: ms}; "default" for the default, "xla", "triton", ... for the exact
  ones), ``default_ms``, ``best_impl``/``best_ms``, ``ratio`` (default / best) and its
  :func:`group_key`."""
  return core.calls_of(rows, SUITE, CALL_FIELDS, group_key)


def summarize_calls(calls: list[dict], miss: float = MISS) -> dict:
  return core.summarize_calls(calls, miss, describe)


def group_calls(calls: list[dict], miss: float = MISS) -> dict:
  return core.group_calls(calls, miss, describe)


def build_report(fit_rows: list[dict], val_rows: list[dict] | None = None, miss: float = MISS) -> dict:
  return core.build_report({"fit": fit_rows, "validate": val_rows}, calls_of, miss, describe)


def markdown(report: dict, top: int = 15) -> str:
  return core.markdown(report, describe, "Measured dispatch: the default against the fastest exact implementation",
                       "head_dim, mask, mode, decode", top)


# ---------------------------------------------------------------------------------------------
# command line
# ---------------------------------------------------------------------------------------------
def main(argv=None, *, measure=None, clock: Callable[[], float] = time.monotonic, device=None) -> int:
  """The command line; ``measure``, ``clock`` and ``device`` are for tests (a fake measurer, clock and device)."""
  p = argparse.ArgumentParser(prog="python -m bench.dispatch_sample", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  sub = p.add_subparsers(dest="cmd", required=True)
  for name in ("sample", "run"):
    core.add_sample_args(sub.add_parser(name), FIT_SEED)
  core.add_run_args(sub.choices["run"])
  sub.choices["run"].add_argument(
      "--autotune-cache", default=None,
      help="also time each call's default under probjax.autotune(cache_path=THIS) (rows probjax_autotuned); "
           "a fresh path measures every call's candidates once, an existing one reuses its entries")
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
    for c in sample(core.seed_of(args), args.n, args.shard):
      print(json.dumps(c.as_dict()))
    return 0
  if args.cmd == "run":
    start = clock()
    calls = sample(core.seed_of(args), args.n, args.shard)
    if measure is None:
      from bench import harness
      harness.setup_environment(args)
    stats = run_sample(calls, args.out, measure=measure, device=device, rounds=args.rounds, budget_s=args.budget_s,
                       clock=clock, timing_kw=core.timing_kwargs(args), start=start, workers=args.compile_workers,
                       batch_calls=args.batch_calls, autotune_cache=args.autotune_cache)
    print(json.dumps(stats))
    return 0
  if args.cmd == "draw-seed":
    core.draw_seed(args.fit, args.out, FIT_SEED, SAMPLER_VERSION, load_rows)
    return 0
  fit = [r for f in args.fit for r in load_rows(f)]
  val = [r for f in args.validate for r in load_rows(f)] if args.validate else None
  report = build_report(fit, val, args.miss)
  core.write_report(report, args.out or os.path.splitext(args.fit[0])[0] + ".report", markdown(report))
  return 0


if __name__ == "__main__":
  sys.exit(main())
