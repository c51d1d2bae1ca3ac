"""Attention report for the machine it runs on (the main job).

    python -m probjax.attention_report            # default shapes for this device
    python -m probjax.attention_report --quick    # tiny shapes (smoke test)
    python -m probjax.attention_report --seq 600,1500 --mask causal --dtype bfloat16

For each shape it runs every probjax implementation available on the present
device (``available_implementations()``), the default (``implementation=None``)
and ``jax.nn.dot_product_attention`` as a peer (XLA, and cuDNN on NVIDIA GPUs);
checks output and gradients against the float64 reference; times the forward and
the forward+backward (:func:`probjax.core.timing.time_fn`: the compiling call, then
single synchronised calls: median and p10/p90); prints one table per case with each
time's ratio to jax.nn and to the fastest implementation, the errors against their
tolerance, the implementation the default picks and the rule that picked it, and a flag
where another implementation is faster than the default; writes the rows to JSON
(``--output``, by default ``reports/attention_report.json``) and a figure beside it
(``reports/attention_report.png``; ``--no-figure``: none): per mode, each case's median time
of every implementation, the default's bar outlined.

While it runs, a progress bar on stderr names the case and the implementation being measured
(``--quiet``: none). The bar and the figure need tqdm and matplotlib (the ``bench`` extra,
``pip install -e '.[bench]'``); without them the report runs the same, with plain progress
lines and no figure, and says so in one line.

The flag never compares the default with itself: the default's row and the row of the
implementation it runs (``probjax_<implementation>``, and under grad on Triton the backward
variant's) are the same kernel, their difference the measurement's noise
(:func:`same_impl_labels`); the default is compared with the other implementations only
(:func:`annotate_default`).

Row fields: the benchmark row's ``suite="report"``, ``impl``, ``dtype``, ``batch``,
``q_heads``, ``kv_heads``, ``q_len``, ``kv_len``, ``head_dim``, ``causal``, ``mask``,
``mode`` ("fwd"/"fwd_bwd"), ``ms`` (median), ``status``
("ok"/"oom"/"unsupported"/"fail"/"error", :func:`probjax.core.timing.classify_error`),
``device``, ``max_error``; plus ``case``, ``p10_ms``, ``p90_ms``, ``n_repeats``,
``vs_jaxnn`` (``ms`` over the fastest jax.nn row's), ``vs_fastest`` (over the fastest
row's that passed its check), ``fastest`` (that row's impl), ``check`` ("pass"/"fail"
against the dtype's tolerance), ``tolerance``, ``error`` (message), ``commit``; the
default's rows add ``default_impl``, ``default_rule``, ``default_same_impl`` (the labels of
the rows that run the default's implementation), ``default_best`` (the fastest of those),
``fastest_other`` (the fastest other implementation that passed its check),
``default_vs_other`` (the first's time over the second's), ``default_is_fastest`` (no other
implementation is faster) and ``default_slower`` (not the fastest and ``default_best``'s p10
above ``fastest_other``'s p90: slower beyond the spread; None with too few repeats).

A failure of one implementation is recorded in its row; the report goes on.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib
import json
import math
import os
import sys
import time
import traceback
from typing import Any, Callable

import numpy as np

from probjax.core import config, timing
from probjax.core.timing import STATUSES, classify_error  # noqa: F401 (the report's statuses)

MASKS = ("none", "causal", "window", "kv_len", "segments")
DTYPES = ("float32", "bfloat16", "float16")
DEFAULT_OUTPUT = os.path.join("reports", "attention_report.json")
# Fewer repeats give no spread to tell a slower default from noise (default_slower: None).
MIN_SPREAD_REPEATS = 5
# The timed modes and their names in the tables and the figure.
_MODES = (("fwd", "fwd"), ("fwd_bwd", "fwd+bwd"))


# -----------------------------------------------------------------------------
# cases
# -----------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Case(timing.Shape):
  """A named report case: its :class:`probjax.core.timing.Shape` (passed by keyword), dtype and mask."""
  name: str
  dtype: str
  mask: str = "none"

  @property
  def causal(self) -> bool:
    return self.mask == "causal"

  def label(self) -> str:
    heads = f"{self.q_heads}" if self.q_heads == self.kv_heads else f"{self.q_heads}/{self.kv_heads}"
    seq = f"{self.q_len}" if self.q_len == self.kv_len else f"{self.q_len}x{self.kv_len}"
    return f"{self.name}: B={self.batch} H={heads} T={seq} D={self.head_dim} {self.dtype} mask={self.mask}"


# Default shape sets. name -> (batch, q_heads, kv_heads, seq, head_dim, mask); seq is T or
# (q_len, kv_len).
_DEFAULTS = {
    # 2-core CPU: the whole report finishes in well under 2 minutes.
    "cpu": dict(dtype="float32", repeats=5, cases=[
        ("plain", 1, 8, 8, 1024, 64, "none"),
        ("causal", 1, 8, 8, 1024, 64, "causal"),
        ("gqa", 1, 8, 2, 512, 64, "none"),
        ("odd", 1, 8, 8, 600, 64, "none"),
        ("decode", 1, 8, 2, (1, 4096), 64, "none"),
    ]),
    "gpu": dict(dtype="bfloat16", repeats=20, cases=[
        ("plain", 4, 8, 8, 4096, 64, "none"),
        ("causal", 4, 8, 8, 4096, 64, "causal"),
        ("gqa", 4, 8, 2, 4096, 128, "none"),
        ("odd", 4, 8, 8, 1500, 64, "none"),
        ("decode", 1, 32, 8, (1, 16384), 128, "none"),  # the split-KV forward
    ]),
    # Enough repeats for a p10-p90 spread (MIN_SPREAD_REPEATS); compiling dominates anyway.
    "quick": dict(dtype="float32", repeats=5, cases=[
        ("plain", 1, 2, 2, 64, 16, "none"),
        ("causal", 1, 2, 2, 64, 16, "causal"),
        ("gqa", 1, 4, 2, 32, 16, "none"),
        ("odd", 1, 2, 2, 37, 16, "none"),
        ("decode", 1, 4, 2, (1, 64), 16, "none"),
    ]),
}


def _ints(values: list[str] | None) -> list[int] | None:
  if not values:
    return None
  out = []
  for v in values:
    for part in str(v).split(","):
      part = part.strip()
      if part:
        n = int(part)
        if n < 1:
          raise argparse.ArgumentTypeError(f"--seq values must be >= 1, got {n}")
        out.append(n)
  return out


def build_cases(args, platform_kind: str) -> tuple[list[Case], int]:
  """Cases and repeats from the CLI (defaults per device, ``--quick`` tiny)."""
  preset = _DEFAULTS["quick" if args.quick else ("gpu" if platform_kind == "gpu" else "cpu")]
  dtype = args.dtype or preset["dtype"]
  repeats = args.repeats if args.repeats is not None else preset["repeats"]
  seqs = _ints(args.seq)
  masks = args.mask
  custom = seqs is not None or masks is not None or args.heads is not None or args.kv_heads is not None
  cases = []
  if not custom:
    for name, b, h, hkv, t, d, m in preset["cases"]:
      tq, tk = t if isinstance(t, tuple) else (t, t)
      cases.append(Case(name=name, batch=args.batch or b, q_heads=h, kv_heads=hkv, q_len=tq, kv_len=tk,
                        head_dim=args.head_dim or d, dtype=dtype, mask=m))
  else:
    b0, h0, _, t0, d0, _ = preset["cases"][0][1:]
    heads = args.heads or h0
    kv_heads = args.kv_heads or heads
    if heads % kv_heads:
      raise SystemExit(f"--heads ({heads}) must be a multiple of --kv-heads ({kv_heads})")
    for t in seqs or [t0]:
      for m in masks or ["none"]:
        cases.append(Case(name=f"T{t}-{m}", batch=args.batch or b0, q_heads=heads, kv_heads=kv_heads,
                          q_len=t, kv_len=t, head_dim=args.head_dim or d0, dtype=dtype, mask=m))
  return cases, max(1, repeats)


# -----------------------------------------------------------------------------
# inputs and masks
# -----------------------------------------------------------------------------
def make_mask(kind: str, case: Case):
  """A probjax Mask for ``kind`` (None for "none"): the shared test masks of :mod:`probjax.testing`."""
  from probjax.testing import make_mask as shared_make_mask
  if kind not in MASKS:
    raise ValueError(f"unknown mask {kind!r}; expected one of {MASKS}")
  return shared_make_mask(kind, case.batch, case.q_len, case.kv_len)


def make_inputs(case: Case, seed: int = 0):
  """Fresh random ``(q, k, v, do)`` for ``case`` (:func:`probjax.testing.make_inputs`)."""
  from probjax.testing import make_inputs as shared_make_inputs
  x = shared_make_inputs(seed, case.batch, case.q_len, case.kv_len, case.q_heads, case.kv_heads,
                         case.head_dim, case.dtype)
  return x.q, x.k, x.v, x.do


# -----------------------------------------------------------------------------
# implementations
# -----------------------------------------------------------------------------
BACKWARD_VARIANTS = ("triton_onepass", "triton_fused", "triton_split")


def _probjax_fn(name: str | None, mask, platform_kind: str = "cpu") -> Callable:
  """``dot_product_attention`` for label ``probjax_<name>`` (None: the default).

  ``name`` is an implementation ("xla", "triton", ...) or a Triton backward
  variant ("triton_onepass", ...). Off an NVIDIA GPU, Triton runs in Pallas
  interpret mode (slow; only when asked for with ``--impl``).
  """
  from probjax.nn.layers.attention import dot_product_attention
  kw: dict[str, Any] = {}
  implementation = name
  if name in BACKWARD_VARIANTS:
    implementation, kw["backward_pass_impl"] = "triton", name
  if implementation in ("triton", "pallas") and platform_kind != "gpu":
    kw["interpret"] = True
  def f(q, k, v):
    return dot_product_attention(q, k, v, mask=mask, implementation=implementation, **kw)
  return f


def _jaxnn_fn(backend: str, case: Case, mask_kind: str, mask) -> Callable:
  import jax
  from probjax.ops.attention.backends.cudnn import jaxnn_arguments
  if mask_kind == "segments":  # jax.nn has no segment ids: a dense boolean mask [B, 1, T, S]
    kw = dict(mask=mask.dense(case.batch, case.q_len, case.kv_len))
  else:
    kw = jaxnn_arguments(mask, case.batch)

  def f(q, k, v):
    return jax.nn.dot_product_attention(q, k, v, implementation=backend, **kw)
  return f


def implementations(platform_kind: str, dtype: str, only: list[str] | None) -> list[tuple[str, str, Any]]:
  """``[(label, kind, arg)]`` with kind "probjax" (arg: implementation or None) or "jaxnn" (arg: backend).

  Without ``--impl``: probjax default, every available probjax implementation,
  jax.nn XLA, and jax.nn cuDNN on GPU for 16-bit dtypes. ``--impl`` filters by
  label (``probjax_xla``), short name (``xla`` matches probjax_xla, ``default``
  matches probjax_default) or peer label (``jaxnn_xla``); a probjax name that
  is not available here (e.g. ``triton`` on CPU, interpret mode) is still tried.
  """
  avail: list[str] = []
  try:
    from probjax.nn.layers.attention import available_implementations
    avail = list(available_implementations())
  except Exception:  # API not importable: the probjax_default rows record the error
    pass
  out: list[tuple[str, str, Any]] = [("probjax_default", "probjax", None)]
  out += [(f"probjax_{n}", "probjax", n) for n in avail]
  if platform_kind == "gpu" and "triton" in avail:
    out += [(f"probjax_{n}", "probjax", n) for n in BACKWARD_VARIANTS]
  out.append(("jaxnn_xla", "jaxnn", "xla"))
  if platform_kind == "gpu" and dtype in ("bfloat16", "float16"):
    out.append(("jaxnn_cudnn", "jaxnn", "cudnn"))
  if only:
    want = set()
    for tok in only:
      want.update(t.strip() for t in tok.split(",") if t.strip())
    labels = {lab for lab, _, _ in out}
    for t in sorted(want):
      if t.startswith("jaxnn_") and t not in labels:
        out.append((t, "jaxnn", t[len("jaxnn_"):]))
      elif not t.startswith("jaxnn_") and t != "default" and f"probjax_{t.removeprefix('probjax_')}" not in labels:
        name = t.removeprefix("probjax_")
        out.append((f"probjax_{name}", "probjax", name))
    def keep(lab):
      short = lab.removeprefix("probjax_")
      return lab in want or short in want or (lab == "probjax_default" and "default" in want)
    out = [x for x in out if keep(x[0])]
  return out


def explain(case: Case, mask) -> dict:
  """What the default picks: ``{"default_impl", "default_rule", ...}`` (impl "?" on error)."""
  try:
    import jax.numpy as jnp
    from probjax.nn.layers.attention import explain_dispatch
    d = explain_dispatch((case.batch, case.q_len, case.q_heads, case.head_dim),
                         (case.batch, case.kv_len, case.kv_heads, case.head_dim),
                         jnp.dtype(case.dtype), mask=mask)
    out = dict(default_impl=d.implementation, default_rule=d.rule)
    if d.under_grad.backward is not None:
      out["default_backward_pass_impl"] = d.under_grad.backward
    if d.get("formulation") is not None:
      out["default_formulation"] = d.get("formulation")
    return out
  except Exception as e:  # noqa: BLE001
    return dict(default_impl="?", default_rule=f"explain_dispatch failed: {type(e).__name__}: {_first_line(e)}")


def _slice_mask(mask, b: int):
  """The mask restricted to batch element ``b`` (per-batch arrays sliced, bands kept)."""
  if mask is None:
    return None
  import jax
  return jax.tree.map(lambda x: x[b:b + 1], mask)


def reference(q, k, v, do, mask, *, max_chunk_scores: int = 1 << 24):
  """float64 ``(out, dq, dk, dv)``, computed per (batch element, KV head) when the
  ``[B, H, Tq, Tkv]`` scores exceed ``max_chunk_scores`` (bounded device memory)."""
  from probjax.ops.attention.reference import reference_vjp
  b, tq, h, _ = q.shape
  tk, hkv = k.shape[1], k.shape[2]
  if b * h * tq * tk <= max_chunk_scores:
    out, dq, dk, dv, _ = reference_vjp(q, k, v, do, mask=mask)
    return out, dq, dk, dv
  g = h // hkv
  out = np.zeros(q.shape, np.float64)
  dq = np.zeros(q.shape, np.float64)
  dk = np.zeros(k.shape, np.float64)
  dv = np.zeros(v.shape, np.float64)
  for bi in range(b):
    mb = _slice_mask(mask, bi)
    for hi in range(hkv):
      qs = slice(hi * g, (hi + 1) * g)
      o, a, c, d, _ = reference_vjp(q[bi:bi + 1, :, qs], k[bi:bi + 1, :, hi:hi + 1], v[bi:bi + 1, :, hi:hi + 1],
                                    do[bi:bi + 1, :, qs], mask=mb)
      out[bi:bi + 1, :, qs], dq[bi:bi + 1, :, qs] = o, a
      dk[bi:bi + 1, :, hi:hi + 1], dv[bi:bi + 1, :, hi:hi + 1] = c, d
  return out, dq, dk, dv


# -----------------------------------------------------------------------------
# measuring
# -----------------------------------------------------------------------------
def _first_line(e: BaseException, limit: int = 300) -> str:
  s = str(e).strip().splitlines()
  s = s[0] if s else ""
  return s[:limit]


def time_call(fn: Callable, args: tuple, repeats: int) -> tuple[dict, Any]:
  """``{"ms" (median), "p10_ms", "p90_ms", "n_repeats"}`` of single synchronised calls of
  ``fn(*args)`` after the compiling call, and that call's output (for the check)."""
  import jax
  first = []

  def call():
    out = fn(*args)
    if not first:
      first.append(out)
    return out
  res = timing.time_fn(call, jax.block_until_ready, warmup=0, repeats=repeats, min_repeat_s=0.0, max_calls=1)
  return {k: res[k] for k in ("ms", "p10_ms", "p90_ms", "n_repeats")}, first[0]


def device_info() -> tuple[str, str]:
  """(platform kind "cpu"/"gpu"/..., device name) of :func:`probjax.core.timing.device_info`."""
  info = timing.device_info()
  return info["platform"], info["device"]


def run_case(case: Case, impls, repeats: int, device: str, platform_kind: str,
             log: Callable[[str], None] = lambda s: None, bar=None) -> list[dict]:
  """One case's rows: every implementation of ``impls``, forward and forward+backward,
  checked and timed (:func:`annotate`). ``bar``: a tqdm bar named after the case and the
  implementation being measured, ticked once per implementation (None: none)."""
  import jax
  from probjax.ops.attention.tolerances import max_error, tolerance

  tf32 = platform_kind == "gpu" and case.dtype == "float32"
  tol_fwd = tolerance(case.dtype, tf32=tf32)
  tol_bwd = tolerance(case.dtype, grad=True, tf32=tf32)
  base = dict(suite="report", dtype=case.dtype, batch=case.batch, q_heads=case.q_heads,
              kv_heads=case.kv_heads, q_len=case.q_len, kv_len=case.kv_len, head_dim=case.head_dim,
              causal=case.causal, mask=case.mask, device=device, case=case.name)
  rows: list[dict] = []
  try:
    mask = make_mask(case.mask, case)
  except Exception as e:
    for label, _, _ in impls:
      for mode in ("fwd", "fwd_bwd"):
        rows.append(dict(base, impl=label, mode=mode, ms=None, status="error", max_error=None,
                         check=None, tolerance=None, error=f"mask: {type(e).__name__}: {_first_line(e)}"))
    if bar is not None:
      bar.update(len(impls))
    annotate(rows)
    return rows
  dispatch_info = explain(case, mask)
  q, k, v, do = make_inputs(case)
  try:
    ref_out, ref_dq, ref_dk, ref_dv = reference(q, k, v, do, mask)
    ref_error = None
  except Exception as e:  # noqa: BLE001 -- time the implementations anyway
    ref_out = ref_dq = ref_dk = ref_dv = None
    ref_error = f"float64 reference failed: {type(e).__name__}: {_first_line(e)}"
    log("  " + ref_error)

  for label, kind, arg in impls:
    if bar is not None:
      bar.set_description(f"{case.name}: {label}")
    extra = dict(dispatch_info) if label == "probjax_default" else {}
    try:
      f = _probjax_fn(arg, mask, platform_kind) if kind == "probjax" else _jaxnn_fn(arg, case, case.mask, mask)
    except Exception as e:
      f = e
    fwd = None if isinstance(f, Exception) else jax.jit(f)

    def fb(q, k, v, do, f=f):
      out, vjp = jax.vjp(f, q, k, v)
      return (out,) + tuple(vjp(do))
    fwd_bwd = None if isinstance(f, Exception) else jax.jit(fb)

    for mode in ("fwd", "fwd_bwd"):
      row = dict(base, impl=label, mode=mode, ms=None, status="error", max_error=None, check=None,
                 tolerance=tol_fwd if mode == "fwd" else tol_bwd, error=None, **extra)
      try:
        if isinstance(f, Exception):
          raise f
        if mode == "fwd":
          t, out = time_call(fwd, (q, k, v), repeats)
        else:
          t, (out, dq, dk, dv) = time_call(fwd_bwd, (q, k, v, do), repeats)
        row.update(ms=round(t["ms"], 4), p10_ms=round(t["p10_ms"], 4), p90_ms=round(t["p90_ms"], 4),
                   n_repeats=t["n_repeats"], status="ok")
        if ref_error is not None:
          row["error"] = ref_error
        else:
          if mode == "fwd":
            err = max_error(out, ref_out)
          else:
            err = max(max_error(dq, ref_dq), max_error(dk, ref_dk), max_error(dv, ref_dv))
            row["max_error_out"] = max_error(out, ref_out)
          row.update(max_error=err, check="pass" if err <= row["tolerance"] else "fail")
          if not math.isfinite(err):
            row["max_error"] = None
            row["error"] = "non-finite values in the result"
      except Exception as e:  # noqa: BLE001 -- recorded in the row, the report goes on
        row["status"] = classify_error(e)[0]
        row["error"] = f"{type(e).__name__}: {_first_line(e)}"
        if config.REPORT_TRACEBACK.value():
          traceback.print_exc()
      rows.append(row)
    if bar is not None:
      bar.update(1)
  annotate(rows)
  return rows


def _counts(r: dict) -> bool:
  """A row that ran and did not fail its check (one whose time competes)."""
  return r["status"] == "ok" and r.get("check") != "fail" and r["ms"] is not None


def annotate(rows: list[dict]) -> None:
  """Adds ``vs_jaxnn``, ``vs_fastest`` and ``fastest`` (over every row that counts) to one
  case's rows, and the default's flag to its rows (:func:`annotate_default`)."""
  for mode, _ in _MODES:
    mrows = [r for r in rows if r["mode"] == mode]
    ok = [r for r in mrows if _counts(r)]
    peers = [r for r in ok if r["impl"].startswith("jaxnn_")]
    fastest = min(ok, key=lambda r: r["ms"], default=None)
    peer = min(peers, key=lambda r: r["ms"], default=None)
    for r in mrows:
      ran = r["status"] == "ok" and r["ms"] is not None
      r["fastest"] = fastest and fastest["impl"]
      r["vs_fastest"] = round(r["ms"] / fastest["ms"], 4) if ran and fastest else None
      r["vs_jaxnn"] = round(r["ms"] / peer["ms"], 4) if ran and peer else None
  annotate_default(rows)


def same_impl_labels(default_row: dict) -> set[str]:
  """The rows' labels that run what the default runs in ``default_row``'s mode: the default's
  own and ``probjax_<implementation>``, and in ``fwd_bwd`` on Triton the backward variant's."""
  labels = {"probjax_default"}
  impl = default_row.get("default_impl")
  if impl and impl != "?":
    labels.add(f"probjax_{impl}")
  bwd = default_row.get("default_backward_pass_impl")
  if default_row.get("mode") == "fwd_bwd" and impl == "triton" and bwd:
    labels.add(f"probjax_{bwd}")
  return labels


def annotate_default(rows: list[dict]) -> None:
  """Sets the default's ``default_is_fastest`` and ``default_slower`` in one case's rows
  against the other implementations only (not the rows of :func:`same_impl_labels`).

  ``default_is_fastest``: no other implementation's row that counts (ran, passed its check)
  is faster than the default's own best (the fastest of its row and its implementation's,
  ``default_best``); ``default_slower``: not the fastest and ``default_best``'s p10 above that
  faster implementation's p90 (None with too few repeats for a spread)."""
  for mode, _ in _MODES:
    mrows = [r for r in rows if r["mode"] == mode]
    d = next((r for r in mrows if r["impl"] == "probjax_default"), None)
    if d is None:
      continue
    same = same_impl_labels(d)
    d["default_same_impl"] = sorted(same)
    if not (d["status"] == "ok" and d["ms"] is not None):
      d["default_is_fastest"] = d["default_slower"] = None
      continue
    counts = [r for r in mrows if _counts(r)]
    own = [r for r in counts if r["impl"] in same] or [d]
    others = [r for r in counts if r["impl"] not in same]
    best_own = min(own, key=lambda r: r["ms"])
    rival = min(others, key=lambda r: r["ms"], default=None)
    d["default_is_fastest"] = rival is None or best_own["ms"] <= rival["ms"]
    d["fastest_other"] = None if rival is None else rival["impl"]
    d["default_best"] = best_own["impl"]
    d["default_vs_other"] = None if rival is None else round(best_own["ms"] / rival["ms"], 4)
    if d["default_is_fastest"]:
      d["default_slower"] = False
    elif min(best_own.get("n_repeats") or 0, rival.get("n_repeats") or 0) >= MIN_SPREAD_REPEATS:
      d["default_slower"] = bool(best_own["p10_ms"] > rival["p90_ms"])
    else:
      d["default_slower"] = None


# -----------------------------------------------------------------------------
# output
# -----------------------------------------------------------------------------
def _fmt_ms(x):
  return "—" if x is None else (f"{x:.3f}" if x < 10 else f"{x:.1f}")


def _fmt_spread(r):
  if r is None or r["status"] != "ok":
    return "—"
  return f"{_fmt_ms(r['p10_ms'])}-{_fmt_ms(r['p90_ms'])}"


def _fmt_ratio(r, key):
  x = None if r is None else r.get(key)
  return "—" if x is None else f"{x:.2f}"


def _fmt_err(r):
  """``error/tolerance`` (FAIL above it), or the status of a row that did not run."""
  if r is None:
    return "—"
  if r["status"] != "ok":
    return r["status"]
  e, tol = r["max_error"], r.get("tolerance")
  if e is None and r.get("check") is None:
    return "no ref"
  s = ("inf" if e is None else f"{e:.1e}") + (f"/{tol:.0e}" if tol is not None else "")
  return s + ("" if r["check"] == "pass" else " FAIL")


_LEGEND = ("ms: median; p10-p90: the spread over the repeats; x jax.nn, x best: time over the fastest\n"
           "jax.nn backend's and over the fastest implementation's that passed its check (below 1: faster);\n"
           "err: max error/tolerance against the float64 reference.")


def default_flags(crow: list[dict]) -> list[str]:
  """One line per mode where another implementation is faster than the default's own
  (:func:`annotate_default`): which, by how much, and whether beyond the spread."""
  out = []
  for mode, name in _MODES:
    d = next((r for r in crow if r["impl"] == "probjax_default" and r["mode"] == mode), None)
    if d is None or d.get("default_is_fastest") is not False:
      continue
    why = {True: "beyond the p10-p90 spread", False: "within the p10-p90 spread",
           None: "too few repeats to tell from noise"}[d.get("default_slower")]
    out.append(f"  ! {name}: the default is not the fastest: {d['fastest_other']} is "
               f"{d['default_vs_other']:.2f}x faster than the default's {d.get('default_impl') or '?'} "
               f"({d['default_best']}; {why})")
  return out


def format_case(case: Case, crow: list[dict]) -> str:
  """One case's table: a row per implementation, forward and forward+backward side by side."""
  lines = ["", case.label()]
  d = next((r for r in crow if r["impl"] == "probjax_default" and "default_impl" in r), None)
  if d is not None:
    bwd = d.get("default_backward_pass_impl")
    bwd = f", backward={bwd}" if d["default_impl"] == "triton" and bwd else ""
    lines.append(f"  default -> {d['default_impl']}{bwd}  ({d['default_rule']})")
  head = ["impl"]
  for _, name in _MODES:
    head += [f"{name} ms", "p10-p90", "x jax.nn", "x best"]
  head += ["err out", "err grad", "note"]
  table = [head]
  for label in dict.fromkeys(r["impl"] for r in crow):
    by_mode = {m: next((r for r in crow if r["impl"] == label and r["mode"] == m), None) for m, _ in _MODES}
    cells = [label]
    for m, _ in _MODES:
      r = by_mode[m]
      ran = r is not None and r["status"] == "ok"
      cells += [_fmt_ms(r["ms"]) if ran else "—", _fmt_spread(r), _fmt_ratio(r, "vs_jaxnn"),
                _fmt_ratio(r, "vs_fastest")]
    f, b = by_mode["fwd"], by_mode["fwd_bwd"]
    errs = [r["error"] for r in (f, b) if r is not None and r.get("error")]
    note = errs[0] if errs else ""
    if len(note) > 90:
      note = note[:87] + "..."
    cells += [_fmt_err(f), _fmt_err(b), note]
    table.append(cells)
  widths = [max(len(str(t[i])) for t in table) for i in range(len(head) - 1)]
  for i, t in enumerate(table):
    cells = [str(c).ljust(w) if j == 0 else str(c).rjust(w) for j, (c, w) in enumerate(zip(t[:-1], widths))]
    lines.append("  " + "  ".join(cells) + ("  " + t[-1] if t[-1] else ""))
    if i == 0:
      lines.append("  " + "  ".join("-" * w for w in widths))
  lines += default_flags(crow)
  return "\n".join(lines)


def format_table(cases: list[Case], rows: list[dict]) -> str:
  """Every case's table (:func:`format_case`)."""
  return "\n".join(format_case(c, [r for r in rows if r["case"] == c.name]) for c in cases
                   if any(r["case"] == c.name for r in rows))


# -----------------------------------------------------------------------------
# progress bar and figure (the bench extra: tqdm, matplotlib)
# -----------------------------------------------------------------------------
BENCH_EXTRA = "pip install -e '.[bench]'"


def _optional(name: str):
  """The module ``name``, or None where it is not installed."""
  try:
    return importlib.import_module(name)
  except ImportError:
    return None


def progress_bar(total: int):
  """A tqdm bar on stderr over ``total`` implementations (None without tqdm)."""
  tqdm = _optional("tqdm")
  if tqdm is None:
    return None
  return tqdm.tqdm(total=total, file=sys.stderr, dynamic_ncols=True, unit="impl", leave=False)


def figure_path(output: str) -> str:
  """The PNG beside the JSON: ``reports/attention_report.json`` -> ``reports/attention_report.png``."""
  return os.path.splitext(output)[0] + ".png"


def write_figure(rows: list[dict], path: str, title: str = "") -> str | None:
  """Per mode, a bar per (case, implementation) of the median ms (log scale; rows that did
  not run left out, a failed check's bar hatched), the default's bar outlined. Returns
  ``path``, or None where there is nothing to draw or no matplotlib."""
  if _optional("matplotlib") is None:
    return None
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  ran = [r for r in rows if r.get("status") == "ok" and r.get("ms")]
  if not ran:
    return None
  cases = list(dict.fromkeys(r["case"] for r in rows))
  impls = list(dict.fromkeys(r["impl"] for r in rows))
  colors = plt.get_cmap("tab10")
  width = 0.8 / max(len(impls), 1)
  fig, axes = plt.subplots(1, len(_MODES), figsize=(max(6.0, 1.6 * len(cases)) * len(_MODES) / 1.5, 4.2),
                           squeeze=False)
  for ax, (mode, name) in zip(axes[0], _MODES):
    for j, impl in enumerate(impls):
      xs, ys, hatches = [], [], []
      for i, case in enumerate(cases):
        r = next((r for r in ran if r["case"] == case and r["impl"] == impl and r["mode"] == mode), None)
        if r is not None:
          xs.append(i - 0.4 + width * (j + 0.5))
          ys.append(r["ms"])
          hatches.append("//" if r.get("check") == "fail" else "")
      if not xs:
        continue
      default = impl == "probjax_default"
      bars = ax.bar(xs, ys, width, label=impl, color=colors(j % 10), edgecolor="black" if default else "none",
                    linewidth=1.2 if default else 0)
      for b, h in zip(bars, hatches):
        b.set_hatch(h)
    ax.set_yscale("log")
    ax.set_xticks(range(len(cases)))
    ax.set_xticklabels(cases, rotation=20)
    ax.set_ylabel("median ms (log)")
    ax.set_title(name)
    ax.grid(axis="y", alpha=0.3, which="both")
  axes[0][-1].legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
  if title:
    fig.suptitle(title, fontsize=10)
  fig.tight_layout()
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return path


def missing_extras_line(bar: bool, figure: bool) -> str | None:
  """The one line naming what the bench extra would add and is missing here (None: nothing):
  the progress bar (tqdm) where ``bar`` is wanted, the figure (matplotlib) where ``figure``."""
  missing = [(pkg, what) for want, pkg, what in ((bar, "tqdm", "no progress bar"),
                                                 (figure, "matplotlib", "no figure"))
             if want and _optional(pkg) is None]
  if not missing:
    return None
  return (f"{' and '.join(pkg for pkg, _ in missing)} not installed: {', '.join(w for _, w in missing)} "
          f"(the bench extra: {BENCH_EXTRA})")


# -----------------------------------------------------------------------------
# command line
# -----------------------------------------------------------------------------
def parse_args(argv=None):
  p = argparse.ArgumentParser(
      prog="python -m probjax.attention_report",
      description="Attention report for this machine: every available implementation against the "
                  "float64 reference (max error of output and gradients), forward and forward+backward "
                  "times, and which implementation the default picks and why. Writes JSON rows and a "
                  "PNG figure beside them.")
  p.add_argument("--batch", type=int, help="batch size (default: per device)")
  p.add_argument("--heads", type=int, help="query heads (giving it, --kv-heads, --seq or --mask replaces the default shape set)")
  p.add_argument("--kv-heads", type=int, help="key/value heads (GQA when fewer than --heads; default: --heads)")
  p.add_argument("--seq", action="append", metavar="T[,T...]",
                 help="sequence lengths (q_len = kv_len); repeatable or a comma list")
  p.add_argument("--head-dim", type=int, help="head dimension (default: per device)")
  p.add_argument("--dtype", choices=DTYPES, help="input dtype (default: float32 on CPU, bfloat16 on GPU)")
  p.add_argument("--mask", action="append", choices=MASKS,
                 help="mask kind; repeatable (default: the default set, or none with --seq/--heads)")
  p.add_argument("--impl", action="append", metavar="NAME[,NAME...]",
                 help="only these implementations (probjax_xla or xla, default, jaxnn_xla, jaxnn_cudnn, ...); "
                      "a probjax implementation not available here (e.g. triton in interpret mode on CPU) is tried")
  p.add_argument("--repeats", type=int, help="timed repeats after one warm-up; the median is reported")
  p.add_argument("--output", default=DEFAULT_OUTPUT,
                 help="JSON output path (default: %(default)s, relative to the working directory); "
                      "the figure is written beside it with the suffix .png")
  p.add_argument("--no-figure", action="store_true", help="no PNG figure beside the JSON")
  p.add_argument("--quick", action="store_true", help="tiny shapes and 5 repeats (smoke test)")
  p.add_argument("--quiet", action="store_true", help="no progress bar or progress lines on stderr")
  return p.parse_args(argv)


def main(argv=None) -> int:
  argv = list(sys.argv[1:] if argv is None else argv)
  args = parse_args(argv)
  t_start = time.perf_counter()
  import jax
  platform_kind, device = device_info()
  cases, repeats = build_cases(args, platform_kind)
  impls = implementations(platform_kind, cases[0].dtype if cases else "float32", args.impl)
  print(f"probjax attention report  device: {device}  jax {jax.__version__}  repeats: {repeats} (median, p10-p90)",
        flush=True)
  print("implementations: " + ", ".join(lab for lab, _, _ in impls), flush=True)
  print(_LEGEND, flush=True)
  missing = missing_extras_line(bar=not args.quiet, figure=not args.no_figure)
  if missing:
    print(missing, flush=True)
  bar = None if args.quiet else progress_bar(len(cases) * len(impls))
  if bar is None:
    say = lambda s: print(s, flush=True)  # noqa: E731
    log = (lambda s: None) if args.quiet else (lambda s: print(s, file=sys.stderr, flush=True))
  else:  # lines above the bar
    say = lambda s: bar.write(s, file=sys.stdout)  # noqa: E731
    log = lambda s: bar.write(s, file=sys.stderr)  # noqa: E731
  rows: list[dict] = []
  for case in cases:
    if bar is None:
      log(f"running {case.name} ...")
    crow = run_case(case, impls, repeats, device, platform_kind, log=log, bar=bar)
    say(format_case(case, crow))
    rows += crow
  if bar is not None:
    bar.close()
  elapsed = time.perf_counter() - t_start
  n_bad = sum(r["status"] != "ok" for r in rows)
  n_fail = sum(r["check"] == "fail" for r in rows)
  slower = sorted({f"{r['case']} {r['mode']}" for r in rows if r.get("default_slower")})
  print(f"\n{len(rows)} rows, {n_bad} did not run, {n_fail} outside tolerance; default slower than "
        f"the fastest other implementation beyond the spread: {', '.join(slower) or 'none'}; {elapsed:.1f} s")
  info = timing.device_info()
  command = " ".join(["python -m probjax.attention_report"] + argv)
  date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
  for r in rows:
    r.setdefault("jax", jax.__version__)
    r.setdefault("command", command)
    r.setdefault("versions", info["versions"])
    r.setdefault("commit", info["commit"])
    r.setdefault("date", date)
  out_dir = os.path.dirname(os.path.abspath(args.output))
  os.makedirs(out_dir, exist_ok=True)
  with open(args.output, "w") as fh:
    json.dump(rows, fh, indent=1, default=_json_default)
    fh.write("\n")
  print(f"wrote {args.output}")
  if not args.no_figure:
    png = write_figure(rows, figure_path(args.output), title=f"{device}, jax {jax.__version__}")
    if png:
      print(f"wrote {png}")
    elif _optional("matplotlib") is not None:  # (without it, the line above said so)
      print("no figure: no implementation ran")
  return 0


def _json_default(x):
  if isinstance(x, (np.floating, np.integer)):
    return x.item()
  return str(x)


if __name__ == "__main__":
  sys.exit(main())
