"""Builds the figures and the performance pages from the benchmark JSON only.

  python -m bench.benchmark_figures            # bench/results/<device>/<suite>.json ->
      docs/dev/attention-performance.md, docs/dev/h200.md, docs/dev/figures/*.png

The pages are the benchmark evidence of the developer section of the docs (docs/dev/, beside
decisions.md, which their links name), not user pages.

Every number on the pages comes from the JSON rows; suites that have no rows
yet print "not measured yet". Cells: median ms; OOM, fail† (XLA autotuning
found no configuration), unsup., error, — (not measured).
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import sys

from bench.harness import IMPL_LABELS, OWN_SCHEMA_KEYS, RESULTS_DIR, ROOT, load_rows, row_key

DOCS_DIR = os.path.join(ROOT, "docs", "dev")  # where the pages and figures/ go by default
STATUS_CELL = {"oom": "OOM", "fail": "fail†", "unsupported": "unsup.", "error": "error"}
NOT_MEASURED = "_Not measured yet._"
PEER_PREFIXES = ("jaxnn_", "torch_", "tokamax_")
DTYPE_SHORT = {"bfloat16": "bf16", "float32": "fp32", "float16": "fp16"}
MODE_LABEL = {"fwd": "forward", "fwd_bwd": "forward + backward"}
REPRO = """```bash
# Peers: tokamax and its dependencies travel as wheels in the git-ignored .peers/:
#   bash bench/stage_peers.sh      # copies ../shared/wheels into .peers/
#   source bench/gpu_env.sh        # on the GPU machine: installs them, sets PYTHONPATH and $PY
# All GPU suites in priority order, at most N minutes per call, resuming from bench/results/:
#   OUT=/tmp/out bash bench/gpu_batch.sh all 7.5   # returns $OUT/results.tar.gz; here:
#   tar xzf results.tar.gz -C /tmp/r && python -m bench.merge_rows bench/results /tmp/r
# Two plans at once on a two-GPU host (each suite's peers on the same GPU):
#   OUT=/tmp/out bash bench/gpu_pair.sh tests,tiles grid:4096+8192:bf16,masked 9
# Long suites stop after --max-minutes; rerun the same command with --append to resume.
# Rows made stale by a code change: python -m bench.drop_rows bench/results/h200/grid.json --impl 'probjax_*' ...

# Each suite writes bench/results/<device>/<suite>.json (--output FILE: all rows to one file).
python -m bench.benchmark_gpu_attention                        # grid.json, masked.json
python -m bench.benchmark_gpu_attention_tiles                  # tiles.json
python -m bench.benchmark_gpu_attention_tiles --kernel mosaic --dtypes bf16 --append
python -m bench.benchmark_kernel_attn_gpu --device gpu --suite dispatch,peak,residuals
python -m bench.benchmark_kernel_attn_ext --device gpu --suite gqa,decode
# Chosen implementations of one shape in one process, rotating rounds (interleaved.json):
python -m bench.interleaved --lengths 4096 --head-dims 64,128 \\
  --impls probjax_default,probjax_cudnn,jaxnn_cudnn,torch_sdpa_cudnn

# CPU (torch_cpu rows need .torchenv: python3 -m venv .torchenv && .torchenv/bin/pip install torch==2.13.0 numpy).
make bench-cpu                                                 # bench/results/cpu/cpu.json, cpu_memory.json

# Rebuild the figures and these pages from the JSON, and README's CPU numbers.
make docs
```"""


# ---------------------------------------------------------------------------
# data
# ---------------------------------------------------------------------------
def load_all(results_dir: str) -> list[dict]:
  """All rows of every ``<device>/<suite>.json`` under results_dir; later rows with the same
  key win. ``_file``: the row's file, relative to results_dir."""
  rows = collections.OrderedDict()
  for path in sorted(glob.glob(os.path.join(results_dir, "*", "*.json"))):
    if os.path.splitext(os.path.basename(path))[0] in OWN_SCHEMA_KEYS:
      continue  # the layer and op benchmarks' files (their own keys; not these pages' rows)
    for r in load_rows(path):
      if not isinstance(r, dict) or "suite" not in r:
        continue
      r = dict(r, _file=os.path.relpath(path, results_dir))
      rows[row_key(r) + (r.get("platform"), r.get("device"))] = r
  return list(rows.values())


def label(impl: str) -> str:
  return IMPL_LABELS.get(impl, impl)


def fmt_ms(ms: float) -> str:
  if ms is None:
    return "—"
  if ms < 1:
    return f"{ms:.3f}"
  if ms < 100:
    return f"{ms:.2f}"
  return f"{ms:.0f}"


def fmt_mb(b) -> str:
  return "—" if b is None else f"{b / 2**20:,.0f}" if b >= 2**20 * 10 else f"{b / 2**20:.2f}"


def cell(row, value=None, fmt=fmt_ms) -> str:
  if row is None:
    return "—"
  if row.get("status") != "ok":
    return STATUS_CELL.get(row.get("status"), row.get("status", "?"))
  v = row.get("ms") if value is None else row.get(value)
  return "—" if v is None else fmt(v)


def md_table(header, body) -> str:
  lines = ["| " + " | ".join(map(str, header)) + " |", "|" + "---|" * len(header)]
  lines += ["| " + " | ".join(map(str, r)) + " |" for r in body]
  return "\n".join(lines)


def select(rows, **kw):
  out = []
  for r in rows:
    if all((r.get(k) in v) if isinstance(v, (tuple, list, set)) else r.get(k) == v
           for k, v in kw.items()):
      out.append(r)
  return out


def gpu_rows(rows):
  return [r for r in rows if r.get("platform") not in ("cpu",)]


def impl_color(impl: str):
  import matplotlib
  known = list(IMPL_LABELS)
  i = known.index(impl) if impl in known else abs(hash(impl))
  return matplotlib.colormaps["tab20"](i % 20)


def impl_order_key(lbl: str):
  inv = {v: k for k, v in IMPL_LABELS.items()}
  known = list(IMPL_LABELS)
  i = inv.get(lbl, lbl)
  return (known.index(i) if i in known else len(known), lbl)


def impl_order(impls):
  known = list(IMPL_LABELS)
  return sorted(set(impls), key=lambda i: (known.index(i) if i in known else len(known), i))


def joinlist(xs):
  return ", ".join(str(x) for x in xs)


# ---------------------------------------------------------------------------
# "where an alternative is faster"
# ---------------------------------------------------------------------------
def faster_alternatives(rows, threshold: float = 1.05, min_len: int = 512, suite: str = "grid",
                        baseline: str = "probjax_default", peers_only: bool = True):
  """Configurations (T >= min_len) where an implementation beats the baseline by > threshold.

  Returns a list of groups, one per (dtype, head_dim, causal, mode) that has
  at least one faster alternative, each a dict with ``dtype, head_dim, causal,
  mode, impls`` (impl -> sorted list of T) and ``largest`` (impl, ratio, T)
  where ratio = baseline ms / alternative ms. Only rows with status "ok" and a
  baseline row at the same shape count.
  """
  base = {}
  for r in rows:
    if r.get("suite") == suite and r.get("impl") == baseline and r.get("status") == "ok" \
        and r.get("ms") and r.get("mask", "none") == "none":
      base[(r["dtype"], r["head_dim"], r["causal"], r["mode"], r["batch"], r["q_heads"],
            r["kv_heads"], r["q_len"], r["kv_len"])] = r["ms"]
  groups = collections.OrderedDict()
  for r in rows:
    if r.get("suite") != suite or r.get("status") != "ok" or not r.get("ms"):
      continue
    impl = r["impl"]
    if impl == baseline or (peers_only and not impl.startswith(PEER_PREFIXES)):
      continue
    if r.get("mask", "none") != "none" or max(r["q_len"], r["kv_len"]) < min_len:
      continue
    k = (r["dtype"], r["head_dim"], r["causal"], r["mode"], r["batch"], r["q_heads"],
         r["kv_heads"], r["q_len"], r["kv_len"])
    if k not in base:
      continue
    ratio = base[k] / r["ms"]
    if ratio <= threshold:
      continue
    g = groups.setdefault(k[:4], {"dtype": k[0], "head_dim": k[1], "causal": k[2], "mode": k[3],
                                  "impls": {}, "largest": None})
    g["impls"].setdefault(impl, set()).add(r["q_len"])
    if g["largest"] is None or ratio > g["largest"][1]:
      g["largest"] = (impl, ratio, r["q_len"])
  out = []
  mode_rank = {"fwd_bwd": 0, "fwd": 1}
  for g in groups.values():
    g["impls"] = {i: sorted(ts) for i, ts in sorted(g["impls"].items(), key=lambda kv: kv[0])}
    out.append(g)
  out.sort(key=lambda g: (mode_rank.get(g["mode"], 2), g["dtype"], g["head_dim"], g["causal"]))
  return out


def faster_bullets(groups) -> list[str]:
  out = []
  for g in groups:
    parts = "; ".join(f"{label(i)} at T = {joinlist(ts)}" for i, ts in g["impls"].items())
    i, ratio, t = g["largest"]
    out.append(f"- {DTYPE_SHORT.get(g['dtype'], g['dtype'])}, head_dim {g['head_dim']}, "
               f"{'causal' if g['causal'] else 'non-causal'}, {MODE_LABEL[g['mode']]}: {parts}. "
               f"Largest gap: {label(i)} is {ratio:.2f}× faster at T={t}.")
  return out


# ---------------------------------------------------------------------------
# figures
# ---------------------------------------------------------------------------
def _plt():
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  return plt


def fig_grid(rows, dtype, path, ratio=False):
  """Time (or ratio to probjax default) vs T; columns (head_dim, causal), rows fwd / fwd_bwd."""
  g = select(rows, suite="grid", dtype=dtype, status="ok")
  if not g:
    return False
  plt = _plt()
  dims = sorted({r["head_dim"] for r in g})
  causals = sorted({r["causal"] for r in g})
  modes = ["fwd_bwd"] if ratio else [m for m in ("fwd", "fwd_bwd") if any(r["mode"] == m for r in g)]
  cols = [(d, c) for d in dims for c in causals]
  fig, axes = plt.subplots(len(modes), len(cols), figsize=(4.2 * len(cols), 3.6 * len(modes)),
                           squeeze=False)
  for i, mode in enumerate(modes):
    for j, (d, c) in enumerate(cols):
      ax = axes[i][j]
      sub = [r for r in g if r["mode"] == mode and r["head_dim"] == d and r["causal"] == c]
      base = {r["q_len"]: r["ms"] for r in sub if r["impl"] == "probjax_default"}
      for impl in impl_order(r["impl"] for r in sub):
        pts = sorted((r["q_len"], r["ms"]) for r in sub if r["impl"] == impl)
        if ratio:
          pts = [(t, ms / base[t]) for t, ms in pts if t in base]
        if not pts:
          continue
        style = dict(lw=2.8, color="black", marker="o") if impl == "probjax_default" else \
            dict(lw=1, marker=".", ls="--" if impl.startswith(("torch", "tokamax")) else "-",
                 color=impl_color(impl))
        ax.plot([p[0] for p in pts], [p[1] for p in pts], label=label(impl), **style)
      ax.set_xscale("log", base=2)
      if ratio:
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_yscale("log")
      else:
        ax.set_yscale("log")
      ax.set_title(f"{DTYPE_SHORT.get(dtype, dtype)} D={d} {'causal' if c else 'non-causal'} "
                   f"{mode}", fontsize=9)
      ax.set_xlabel("T")
      ax.set_ylabel("time / probjax default" if ratio else "ms")
      ax.grid(True, which="both", alpha=0.3)
  handles, labels = axes[0][0].get_legend_handles_labels()
  for ax in axes.flat:
    h, l = ax.get_legend_handles_labels()
    for hh, ll in zip(h, l):
      if ll not in labels:
        handles.append(hh)
        labels.append(ll)
  order = sorted(range(len(labels)), key=lambda i: impl_order_key(labels[i]))
  handles, labels = [handles[i] for i in order], [labels[i] for i in order]
  ncol = max(1, min(len(labels), int(4.2 * len(cols) / 2.4)))
  nrows_leg = -(-len(labels) // ncol)
  fig.legend(handles, labels, loc="lower center", ncol=ncol, fontsize=8)
  fig.tight_layout(rect=(0, min(0.4, 0.035 * nrows_leg / len(modes) * 2 + 0.02), 1, 1))
  fig.savefig(path, dpi=90)
  plt.close(fig)
  return True


def series_by(rows, name, value=lambda r: r["ms"], keep=lambda r: True) -> dict:
  """``{name(row): [(q_len, value(row)), ...]}`` of the rows that ran and ``keep`` accepts."""
  series = collections.defaultdict(list)
  for r in rows:
    if r["status"] == "ok" and keep(r):
      series[name(r)].append((r["q_len"], value(r)))
  return series


def fig_lines(series: dict, path: str, xlabel: str, ylabel: str, title: str, logy=True, hline=None):
  """series: label -> list of (x, y)."""
  series = {k: sorted(v) for k, v in series.items() if v}
  if not series:
    return False
  plt = _plt()
  fig, ax = plt.subplots(figsize=(6.4, 4.2))
  for name, pts in series.items():
    ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
  ax.set_xscale("log", base=2)
  if logy:
    ax.set_yscale("log")
  if hline is not None:
    ax.axhline(hline, color="k", lw=0.8, ls=":")
  ax.set_xlabel(xlabel)
  ax.set_ylabel(ylabel)
  ax.set_title(title, fontsize=10)
  ax.grid(True, which="both", alpha=0.3)
  ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=90)
  plt.close(fig)
  return True


def _fig_ref(fig_dir_rel, name, ok, alt):
  return f"![{alt}]({fig_dir_rel}/{name})" if ok else ""


# ---------------------------------------------------------------------------
# sections
# ---------------------------------------------------------------------------
def setup_section(rows) -> str:
  if not rows:
    return NOT_MEASURED
  devs = collections.Counter((r.get("device"), str(r.get("compute_capability"))) for r in rows)
  vers = {}
  for r in rows:
    for k, v in (r.get("versions") or {}).items():
      vers.setdefault(k, set()).add(v)
    if r.get("torch_version"):
      vers.setdefault("torch (CPU worker interpreter)", set()).add(r["torch_version"])
  peers = {}
  for r in rows:
    for k, v in (r.get("peers") or {}).items():
      if v is True:
        peers[k] = "present"
      elif peers.get(k) != "present":
        peers[k] = f"absent ({v})"
  lines = []
  for (d, cc), n in devs.most_common():
    lines.append(f"- Device: {d}" + (f" (compute capability {cc})" if cc not in ("None", "") else "")
                 + f": {n} rows.")
  lines.append("- Versions: " + ", ".join(f"{k} {'/'.join(sorted(map(str, v)))}"
                                          for k, v in sorted(vers.items())))
  if peers:
    lines.append("- Peers importable by the benchmarking (JAX) process: " + "; ".join(f"{k} {v}" for k, v in sorted(peers.items())))
  dates = sorted(r.get("time", "") for r in rows if r.get("time"))
  if dates:
    lines.append(f"- Measured {dates[0][:10]} … {dates[-1][:10]}.")
  commits = collections.Counter(r.get("commit") or "not recorded" for r in rows)
  lines.append("- Code (probjax commit: rows): " + ", ".join(f"{c}: {n}" for c, n in commits.most_common()) + ".")
  conc = sum(1 for r in rows if (r.get("concurrent_suites") or 1) > 1)
  if conc:
    lines.append(f"- {conc} rows were measured while another suite ran on another GPU of the same host "
                 "(`bench/gpu_pair.sh`); each row's peers ran on its own GPU in the same run.")
  return "\n".join(lines)


def check_section(rows) -> str:
  """Largest forward-output error per implementation and dtype (vs a float64 reference slice)."""
  errs = collections.defaultdict(float)
  for r in rows:
    if r.get("status") == "ok" and r.get("max_abs_err") is not None:
      k = (r["impl"], r["dtype"])
      errs[k] = max(errs[k], r["max_abs_err"])
  if not errs:
    return NOT_MEASURED
  dts = sorted({d for _, d in errs}, key=lambda d: (d != "bfloat16", d))
  impl_list = impl_order(i for i, _ in errs)
  return ("Every forward row also compares its output (batch 0, head 0, first 64 queries) with a "
          "float64 reference on the same rounded inputs; largest |difference| over all forward rows:\n\n"
          + md_table(["impl"] + [DTYPE_SHORT.get(d, d) for d in dts],
                     [[label(i)] + [f"{errs[(i, d)]:.1e}" if (i, d) in errs else "—" for d in dts]
                      for i in impl_list]))


def grid_tables(rows, dtype) -> str:
  g = select(rows, suite="grid", dtype=dtype)
  if not g:
    return NOT_MEASURED
  out = []
  for mode in ("fwd", "fwd_bwd"):
    for d in sorted({r["head_dim"] for r in g}):
      for c in sorted({r["causal"] for r in g}):
        sub = [r for r in g if r["mode"] == mode and r["head_dim"] == d and r["causal"] == c]
        if not sub:
          continue
        ts = sorted({r["q_len"] for r in sub})
        idx = {(r["impl"], r["q_len"]): r for r in sub}
        body = [[label(i)] + [cell(idx.get((i, t))) for t in ts]
                for i in impl_order(r["impl"] for r in sub)]
        out.append(f"**{DTYPE_SHORT.get(dtype, dtype)}, head_dim {d}, "
                   f"{'causal' if c else 'non-causal'}, {MODE_LABEL[mode]}** (ms)\n\n"
                   + md_table(["impl"] + [f"T={t}" for t in ts], body))
  return "<details><summary>Tables (ms)</summary>\n\n" + "\n\n".join(out) + "\n\n</details>"


def t4096_table(rows, t=4096) -> str:
  g = select(rows, suite="grid", mode="fwd_bwd", q_len=t)
  if not g:
    return NOT_MEASURED
  cfgs = sorted({(r["dtype"], r["head_dim"], r["causal"]) for r in g})
  idx = {(r["impl"], r["dtype"], r["head_dim"], r["causal"]): r for r in g}
  body = [[label(i)] + [cell(idx.get((i,) + c)) for c in cfgs] for i in impl_order(r["impl"] for r in g)]
  head = ["impl"] + [f"{DTYPE_SHORT.get(dt, dt)} D{d} {'causal' if c else 'full'}" for dt, d, c in cfgs]
  return f"fwd+bwd at T={t} in every configuration (ms):\n\n" + md_table(head, body)


def when_to_use(rows, cpu_rows) -> str:
  g = select(rows, suite="grid", status="ok")
  lines = []
  if g:
    by = collections.defaultdict(dict)
    for r in g:
      if max(r["q_len"], r["kv_len"]) >= 512:
        by[(r["dtype"], r["head_dim"], r["causal"], r["mode"], r["q_len"])][r["impl"]] = r["ms"]
    for dtype in sorted({k[0] for k in by}):
      shapes = [v for k, v in by.items() if k[0] == dtype and "probjax_default" in v]
      if not shapes:
        continue
      fastest = sum(1 for v in shapes if v["probjax_default"] <= min(v.values()) * 1.05)
      lines.append(f"- {DTYPE_SHORT.get(dtype, dtype)}: the probjax default is the fastest "
                   f"implementation (within 5%) in {fastest} of {len(shapes)} measured "
                   f"configurations with T ≥ 512; the others are listed under "
                   f"[Where an alternative is faster](#where-an-alternative-is-faster).")
    for impl in ("jaxnn_xla", "torch_sdpa_math", "probjax_xla"):
      for mode in ("fwd_bwd",):
        bad = sorted({r["q_len"] for r in select(rows, suite="grid", impl=impl, mode=mode)
                      if r["status"] in ("oom", "fail")})
        okk = sorted({r["q_len"] for r in select(rows, suite="grid", impl=impl, mode=mode, status="ok")})
        if bad:
          lines.append(f"- {label(impl)} (fwd+bwd) does not run from T = {bad[0]} in this grid "
                       f"(OOM or fail†); it ran up to T = {max(okk) if okk else '—'}.")
  ml = {r["impl"]: r for r in rows if r.get("suite") == "max_len" and r.get("status") == "ok"}
  if "probjax_default" in ml:
    r = ml["probjax_default"]
    bound = " (the largest length tried)" if r.get("max_len") == r.get("search_max") else ""
    dense = [f"{label(i)} up to T = {x['max_len']:,}" for i, x in ml.items()
             if i in ("jaxnn_xla", "torch_sdpa_math", "probjax_xla")]
    lines.append(f"- Memory: the default's fwd+bwd ran up to T = {r['max_len']:,}{bound} at batch "
                 f"{r['batch']} and {r['q_heads']} heads" + (f"; {', '.join(dense)}." if dense else "."))
  c = cpu_at(cpu_rows, 4096)
  if c:
    lines.append("- CPU: " + c)
  if not lines:
    return NOT_MEASURED
  return "\n".join(lines)


def cpu_at(cpu_rows, t=4096):
  ms = {r["impl"]: r["ms"] for r in select(cpu_rows, suite="cpu", q_len=t, mode="fwd_bwd",
                                            causal=False, status="ok")}
  if not ms:
    return None
  parts = [f"{label(i)} {ms[i]:.0f} ms" for i in ("probjax_default", "probjax_xla", "jaxnn_xla",
                                                    "torch_cpu") if i in ms]
  s = f"at T={t} (non-causal fwd+bwd, fp32, batch 1, 8 heads, head_dim 64): " + ", ".join(parts) + "."
  if "probjax_default" in ms and "torch_cpu" in ms:
    fastest = min(ms, key=ms.get)
    s += f" Fastest: {label(fastest)}."
  return s


def memory_section(rows, fig_dir, fig_rel) -> str:
  out = []
  peak = select(rows, suite="peak", status="ok")
  if peak:
    series = series_by(peak, lambda r: label(r["impl"]), value=lambda r: r["peak_bytes"] / 2**20,
                       keep=lambda r: bool(r.get("peak_bytes")))
    ok = fig_lines(series, os.path.join(fig_dir, "memory_peak.png"), "T", "device peak (MiB)",
                   "fwd+bwd device peak")
    r0 = peak[0]
    out.append(f"True device peak of one fwd+bwd call, {DTYPE_SHORT.get(r0['dtype'], r0['dtype'])}, "
               f"head_dim {r0['head_dim']}, batch {r0['batch']}, {r0['q_heads']} heads, non-causal, "
               f"one fresh process per implementation ({r0.get('_file')}), MiB:")
    out.append(_fig_ref(fig_rel, "memory_peak.png", ok, "device peak"))
    ts = sorted({r["q_len"] for r in select(rows, suite="peak")})
    idx = {(r["impl"], r["q_len"]): r for r in select(rows, suite="peak")}
    out.append(md_table(["impl"] + [f"T={t}" for t in ts],
                        [[label(i)] + [cell(idx.get((i, t)), "peak_bytes", fmt_mb) for t in ts]
                         for i in impl_order(r["impl"] for r in select(rows, suite="peak"))]))
  ml = select(rows, suite="max_len")
  if ml:
    out.append("Largest power-of-two T whose fwd+bwd ran (the search stops at the value in the last "
               "column, so reaching it means at least that):")
    out.append(md_table(["impl", "largest T", "stopped by", "search limit"],
                        [[label(r["impl"]), f"{r['max_len']:,}" if r.get("max_len") else cell(r),
                          (f"{STATUS_CELL.get(r['stopped_by']['status'], r['stopped_by']['status'])}"
                           f" at T={r['stopped_by']['q_len']:,}") if r.get("stopped_by") else "—",
                          f"{r.get('search_max', 0):,}"] for r in ml]))
  res = select(rows, suite="residuals")
  if res:
    r0 = res[0]
    ts = sorted({r["q_len"] for r in res})
    idx = {(r["impl"], r["q_len"]): r for r in res}
    out.append(f"Bytes kept for the backward pass (jax.vjp residuals excluding the inputs, MiB), "
               f"{DTYPE_SHORT.get(r0['dtype'], r0['dtype'])}, batch {r0['batch']}, {r0['q_heads']} "
               f"heads, head_dim {r0['head_dim']} ({r0.get('_file')}):")
    impl_list = impl_order(r["impl"] for r in res)
    out.append(md_table(["impl"] + [f"T={t}" for t in ts],
                        [[label(i)] + [cell(idx.get((i, t)), "residual_bytes_excl_inputs", fmt_mb)
                                       for t in ts] for i in impl_list]))
    out.append("XLA temporaries of the compiled fwd+bwd (memory_analysis, MiB):")
    out.append(md_table(["impl"] + [f"T={t}" for t in ts],
                        [[label(i)] + [cell(idx.get((i, t)), "temp_bytes", fmt_mb) for t in ts]
                         for i in impl_list]))
  return "\n\n".join(x for x in out if x) if out else NOT_MEASURED


def dispatch_section(rows, fig_dir=None, fig_rel=None) -> str:
  d = select(rows, suite="dispatch")
  if not d:
    return NOT_MEASURED
  out = []
  r0 = d[0]
  if fig_dir:
    series = series_by(d, lambda r: f"{label(r['impl'])} D{r['head_dim']}")
    ok = fig_lines(series, os.path.join(fig_dir, "dispatch.png"), "T", "fwd+bwd ms",
                   f"batch {r0['batch']}, {r0['q_heads']} heads, {DTYPE_SHORT.get(r0['dtype'], r0['dtype'])}")
    out.append(_fig_ref(fig_rel, "dispatch.png", ok, "dispatch sweep"))
  for hd in sorted({r["head_dim"] for r in d}):
    sub = [r for r in d if r["head_dim"] == hd]
    ts = sorted({r["q_len"] for r in sub})
    idx = {(r["impl"], r["q_len"]): r for r in sub}
    out.append(f"**{DTYPE_SHORT.get(r0['dtype'], r0['dtype'])}, batch {r0['batch']}, {r0['q_heads']} "
               f"heads, head_dim {hd}, non-causal fwd+bwd (ms)**\n\n"
               + md_table(["impl"] + [f"T={t}" for t in ts],
                          [[label(i)] + [cell(idx.get((i, t))) for t in ts]
                           for i in impl_order(r["impl"] for r in sub)]))
    faster = [t for t in ts if idx.get(("probjax_triton", t), {}).get("status") == "ok"
              and idx.get(("probjax_xla", t), {}).get("status") == "ok"
              and idx[("probjax_xla", t)]["ms"] > 1.05 * idx[("probjax_triton", t)]["ms"]]
    if any(("probjax_triton", t) in idx for t in ts):
      out.append(f"head_dim {hd}: the Triton kernel is more than 5% faster than the XLA path at "
                 f"T = {joinlist(faster) if faster else 'none of the swept lengths'}.")
    exp = [(r["q_len"], r["dispatch"]) for r in sub if r["impl"] == "probjax_default" and r.get("dispatch")]
    if exp:
      out.append("explain_dispatch for the default:\n\n" + md_table(
          ["T", "explain_dispatch"],
          [[t, str(e).replace("\n", " ").replace("|", "/")[:300]] for t, e in sorted(exp, key=lambda x: x[0])]))
  return "\n\n".join(out)


def _config_key(cfg):
  """A recorded config dict without its switched-off options (``False``): rows predating an
  option, or recorded while a since-removed option existed, compare equal to rows that
  record it off."""
  if not isinstance(cfg, dict):
    return cfg
  return tuple(sorted((k, v) for k, v in cfg.items() if v is not False))


def tiles_section(rows) -> str:
  t = select(rows, suite="tiles")
  if not t:
    return NOT_MEASURED
  body, within, with_auto = [], 0, 0
  shape = lambda r: (r["impl"], r["dtype"], r["head_dim"], r["q_len"], r["mode"])
  keys = sorted({shape(r) for r in t})
  for impl, *key in keys:
    sub = [r for r in t if shape(r) == (impl, *key)]
    auto = next((r for r in sub if r.get("variant") == "auto"), None)
    libdev = next((r for r in sub if r.get("variant") == "auto_libdevice_exp2"), None)
    forced = [r for r in sub if not r.get("variant", "").startswith("auto")]
    if key[3] == "fwd_bwd" and auto is not None:
      # Backward rows include a forward: compare only those run with auto's forward tiles.
      fwd = _config_key((auto.get("auto_config") or {}).get("forward"))
      forced = [r for r in forced if _config_key(r.get("forward_config")) in (fwd, None)]
    okf = [r for r in forced if r["status"] == "ok"]
    # Short calls' wall clock is host-bound (see the kernel-time section): where every row
    # of the shape has a kernel time, the comparison uses it.
    clock = "kernel" if okf and all(r.get("device_ms") for r in okf + [auto or {}]) else "wall"
    field = "device_ms" if clock == "kernel" else "ms"
    best = min(okf, key=lambda r: r[field]) if okf else None
    ok_auto = best and auto and auto.get("status") == "ok"
    with_auto += auto is not None
    within += bool(ok_auto and auto[field] <= 1.05 * best[field])
    auto_cfg = (auto or {}).get("auto_config", "—")
    if isinstance(auto_cfg, dict):
      auto_cfg = auto_cfg.get("forward" if key[3] == "fwd" else "backward", "—")
    body.append([label(impl), DTYPE_SHORT.get(key[0], key[0]), key[1], key[2], MODE_LABEL.get(key[3], key[3]),
                 cell(auto, field), auto_cfg, cell(best, field), best["variant"] if best else "—",
                 f"{auto[field] / best[field]:.2f}" if ok_auto else "—", cell(libdev, field), clock,
                 f"{len(okf)} ran / {len(forced) - len(okf)} rejected"])
  r0 = t[0]
  return (f"Auto tiles against the best forced configuration, batch {r0['batch']}, {r0['q_heads']} heads "
          f"({r0.get('_file')}); forward: (block_q, block_k, num_stages, num_warps), forward + backward: "
          f"the split backward's tiles, each row with auto's forward tiles. Times are kernel time "
          f"(`device_ms`) where every row of a shape has one, else wall clock (column \"clock\"). "
          f"Auto within 5% of the best in {within} of {with_auto} shapes with an auto row"
          + (f" ({len(keys) - with_auto} without one: their auto configuration changed after the "
             f"sweep and is not measured yet)" if with_auto < len(keys) else "") + ".\n\n"
          + md_table(["kernel", "dtype", "head_dim", "T", "mode", "auto ms", "auto config", "best forced ms",
                      "best forced", "auto / best", "auto, libdevice exp2f ms", "clock", "configs"], body))


def gqa_section(rows, fig_dir=None, fig_rel=None) -> str:
  out = []
  g = select(rows, suite="gqa")
  if g:
    r0 = g[0]
    if fig_dir:
      series = series_by(g, lambda r: f"{label(r['impl'])} {r['mode']}")
      ok = fig_lines(series, os.path.join(fig_dir, "gqa.png"), "T", "ms", "GQA, 32 query / 8 KV heads")
      out.append(_fig_ref(fig_rel, "gqa.png", ok, "GQA"))
    for mode in ("fwd", "fwd_bwd"):
      sub = [r for r in g if r["mode"] == mode]
      if not sub:
        continue
      ts = sorted({r["q_len"] for r in sub})
      idx = {(r["impl"], r["q_len"]): r for r in sub}
      out.append(f"**GQA {MODE_LABEL[mode]}**, {DTYPE_SHORT.get(r0['dtype'], r0['dtype'])}, "
                 f"{r0['q_heads']} query heads, {r0['kv_heads']} KV heads, head_dim {r0['head_dim']}, "
                 f"batch {r0['batch']}, Lq = Lkv = T (ms)\n\n"
                 + md_table(["impl"] + [f"T={t}" for t in ts],
                            [[label(i)] + [cell(idx.get((i, t))) for t in ts]
                             for i in impl_order(r["impl"] for r in sub)]))
  gm = select(rows, suite="gqa_memory")
  if gm:
    ts = sorted({r["q_len"] for r in gm})
    idx = {(r["impl"], r["q_len"]): r for r in gm}
    out.append("Compile-time memory (temporaries + arguments + outputs) of one fwd+bwd, native GQA "
               "against the kernel on repeated K/V (MiB):\n\n"
               + md_table(["impl"] + [f"T={t}" for t in ts],
                          [[label(i)] + [cell(idx.get((i, t)), "compiled_total_bytes", fmt_mb)
                                         for t in ts] for i in impl_order(r["impl"] for r in gm)]))
  dec = select(rows, suite="decode")
  if dec:
    cfgs = sorted({(r["batch"], r["kv_heads"], r["q_len"], r["kv_len"]) for r in dec})
    idx = {(r["impl"], r["batch"], r["kv_heads"], r["q_len"], r["kv_len"]): r for r in dec}
    r0 = dec[0]
    impl_list = impl_order(r["impl"] for r in dec)
    out.append(f"**Decoding** (few queries, long KV), {DTYPE_SHORT.get(r0['dtype'], r0['dtype'])}, "
               f"{r0['q_heads']} query heads, head_dim {r0['head_dim']}, forward (ms):\n\n"
               + md_table(["batch", "KV heads", "Lq", "Lkv"] + [label(i) for i in impl_list],
                          [[b, hk, lq, f"{lkv:,}"] + [cell(idx.get((i, b, hk, lq, lkv))) for i in impl_list]
                           for b, hk, lq, lkv in cfgs]))
  return "\n\n".join(out) if out else NOT_MEASURED


def cpu_section(cpu_rows, fig_dir, fig_rel) -> str:
  c = select(cpu_rows, suite="cpu")
  out = []
  if c:
    r0 = c[0]
    series = series_by(c, lambda r: label(r["impl"]),
                       keep=lambda r: r["mode"] == "fwd_bwd" and not r["causal"])
    ok = fig_lines(series, os.path.join(fig_dir, "cpu_time.png"), "T", "ms",
                   "CPU fwd+bwd, non-causal")
    loads = sorted(r["loadavg_1m"] for r in c if r.get("loadavg_1m") is not None)
    load = (f"; 1-minute load average during the run {loads[0]:.1f}–{loads[-1]:.1f} (a shared host: "
            f"expect run-to-run noise)" if loads else "")
    out.append(f"fp32, batch {r0['batch']}, {r0['q_heads']} heads, head_dim {r0['head_dim']}, "
               f"{r0['device']}{load} ({r0.get('_file')}), ms:")
    out.append(_fig_ref(fig_rel, "cpu_time.png", ok, "CPU time"))
    for causal in (False, True):
      for mode in ("fwd", "fwd_bwd"):
        sub = [r for r in c if r["mode"] == mode and r["causal"] == causal]
        if not sub:
          continue
        ts = sorted({r["q_len"] for r in sub})
        idx = {(r["impl"], r["q_len"]): r for r in sub}
        out.append(f"**{'causal' if causal else 'non-causal'} {MODE_LABEL[mode]}**\n\n"
                   + md_table(["impl"] + [f"T={t}" for t in ts],
                              [[label(i)] + [cell(idx.get((i, t))) for t in ts]
                               for i in impl_order(r["impl"] for r in sub)]))
    s = cpu_at(cpu_rows)
    if s:
      out.append(s[0].upper() + s[1:])
    notes = {r.get("error") for r in c if r["impl"] == "torch_cpu" and r["status"] != "ok"}
    if notes:
      out.append("torch_cpu rows that did not run: " + "; ".join(sorted(n for n in notes if n))[:400])
  m = select(cpu_rows, suite="cpu_memory")
  if m:
    ts = sorted({r["q_len"] for r in m})
    idx = {(r["impl"], r["q_len"]): r for r in m}
    impl_list = impl_order(r["impl"] for r in m)
    out.append("XLA temporaries of the non-causal fwd+bwd (compile-time memory analysis, MiB):\n\n"
               + md_table(["impl"] + [f"T={t}" for t in ts],
                          [[label(i)] + [cell(idx.get((i, t)), "temp_bytes", fmt_mb) for t in ts]
                           for i in impl_list]))
    out.append("Compile-time memory (temporaries + arguments + outputs) of one fwd+bwd (MiB):\n\n"
               + md_table(["impl"] + [f"T={t}" for t in ts],
                          [[label(i)] + [cell(idx.get((i, t)), "compiled_total_bytes", fmt_mb)
                                         for t in ts] for i in impl_list]))
  cd = select(cpu_rows, suite="decode")
  if cd:
    cfgs = sorted({(r["batch"], r["kv_heads"], r["q_len"], r["kv_len"]) for r in cd})
    idx = {(r["impl"], r["batch"], r["kv_heads"], r["q_len"], r["kv_len"]): r for r in cd}
    impl_list = impl_order(r["impl"] for r in cd)
    out.append("CPU decoding, fp32 (ms):\n\n" + md_table(
        ["batch", "KV heads", "Lq", "Lkv"] + [label(i) for i in impl_list],
        [[b, hk, lq, lkv] + [cell(idx.get((i, b, hk, lq, lkv))) for i in impl_list]
         for b, hk, lq, lkv in cfgs]))
  return "\n\n".join(x for x in out if x) if out else NOT_MEASURED


def masked_section(rows) -> str:
  m = select(rows, suite="masked")
  if not m:
    return NOT_MEASURED
  r0 = m[0]
  cfgs = sorted({(r["mask"], r["mode"]) for r in m})
  idx = {(r["impl"], r["mask"], r["mode"]): r for r in m}
  impl_list = impl_order(r["impl"] for r in m)
  return (f"Masked attention, {DTYPE_SHORT.get(r0['dtype'], r0['dtype'])}, batch {r0['batch']}, "
          f"{r0['q_heads']} heads, head_dim {r0['head_dim']}, T = {r0['q_len']} (ms; window512 = causal "
          f"with 512 keys to the left, docs4 = 4 equal packed documents, softcap30 = causal with the "
          f"score modifier 30·tanh(s/30)):\n\n"
          + md_table(["mask", "mode"] + [label(i) for i in impl_list],
                     [[mk, md] + [cell(idx.get((i, mk, md))) for i in impl_list] for mk, md in cfgs]))


# ---------------------------------------------------------------------------
# pages
# ---------------------------------------------------------------------------
def device_time_section(rows) -> str:
  """Wall clock against kernel time (``device_ms``, from ``--device-time``) for short calls."""
  dt = [r for r in rows if r.get("status") == "ok" and r.get("device_ms")]
  if not dt:
    return ("_No row records `device_ms` yet (`--device-time`, or `DEVICE_TIME=1` in "
            "`gpu_batch.sh`)._")
  body = [[r["suite"], label(r["impl"]), DTYPE_SHORT.get(r["dtype"], r["dtype"]), r["batch"], r["q_heads"],
           r["q_len"], r["head_dim"], "yes" if r["causal"] else "no", r["mode"], fmt_ms(r["ms"]),
           fmt_ms(r["device_ms"]), f"{r['ms'] / r['device_ms']:.2f}"]
          for r in sorted(dt, key=lambda r: (r["suite"], r["q_len"], r["head_dim"], r["causal"],
                                             r["mode"], r["impl"]))]
  return ("Calls of at most 2 ms: the median wall-clock time per call (what the tables above "
          "use) against the GPU kernels' summed time per call read from a profile "
          "(`device_ms`). A wall / kernel ratio well above 1 means the host, not the GPU, set "
          "the row's time.\n\n<details><summary>Table</summary>\n\n"
          + md_table(["suite", "impl", "dtype", "batch", "heads", "T", "head_dim", "causal", "mode",
                      "wall ms", "kernel ms", "wall / kernel"], body) + "\n\n</details>")


def performance_page(all_rows, fig_dir, fig_rel) -> str:
  rows = gpu_rows(all_rows)
  cpu_rows = [r for r in all_rows if r.get("platform") == "cpu"]
  gsuite = select(rows, suite="grid")
  dev = collections.Counter(r.get("device") for r in gsuite).most_common(1)
  devname = dev[0][0] if dev else "GPU"
  parts = ["# Attention performance", "",
           "probjax's attention (the default `dot_product_attention`, explicit implementations and "
           "backward variants) against `jax.nn.dot_product_attention` (XLA, cuDNN), PyTorch SDPA "
           "pinned to each backend, compiled `torch.nn.attention.flex_attention` and tokamax, on the "
           "same inputs and cotangents. Generated by `python -m bench.benchmark_figures` from "
           "the JSON in `bench/results/`; no number on this page is typed by hand. Why each default is "
           "what it is: [decisions.md](decisions.md).", "",
           "Inputs are [batch, seq, heads, head_dim]; torch receives [batch, heads, seq, head_dim]. "
           "Times are medians in milliseconds (each row also stores p10/p90). FLOPs: forward "
           "4·B·H·Tq·Tkv·D, halved for causal; fwd+bwd 3.5× that. OOM: out of device memory. fail†: "
           "XLA found no kernel configuration during autotuning (NOT_FOUND). unsup.: the "
           "implementation rejects the shape or backend. error: another failure (the JSON row has "
           "the message). —: not measured.", "",
           "## Setup", "", setup_section(rows + cpu_rows), "",
           "### Output check", "", check_section(rows + cpu_rows), "",
           "## When to use which", "", when_to_use(rows, cpu_rows), "",
           "## Time", ""]
  dtypes = sorted({r["dtype"] for r in gsuite}, key=lambda d: (d != "bfloat16", d))
  if not dtypes:
    parts.append(NOT_MEASURED)
  for dt in dtypes:
    ok = fig_grid(rows, dt, os.path.join(fig_dir, f"grid_{DTYPE_SHORT.get(dt, dt)}.png"))
    ex = gsuite[0]
    parts += [f"### {DTYPE_SHORT.get(dt, dt)}", "",
              f"{DTYPE_SHORT.get(dt, dt)}, batch {ex['batch']}, {ex['q_heads']} heads, {devname}."
              + (" fp32 matmuls in JAX run at its default precision (TF32 on GPU)." if dt == "float32" else ""),
              "", _fig_ref(fig_rel, f"grid_{DTYPE_SHORT.get(dt, dt)}.png", ok, f"time {dt}"), "",
              grid_tables(rows, dt), ""]
  parts += ["### Ratio to the probjax default", ""]
  any_ratio = False
  for dt in dtypes:
    ok = fig_grid(rows, dt, os.path.join(fig_dir, f"ratio_{DTYPE_SHORT.get(dt, dt)}.png"), ratio=True)
    any_ratio |= ok
    parts += [_fig_ref(fig_rel, f"ratio_{DTYPE_SHORT.get(dt, dt)}.png", ok, f"ratio {dt}"), ""]
  if any_ratio:
    parts += ["fwd+bwd time of each implementation divided by the probjax default at the same "
              "shape; below the line is faster than probjax.", ""]
  else:
    parts += [NOT_MEASURED, ""]
  parts += ["## Where an alternative is faster", ""]
  groups = faster_alternatives(rows)
  if not gsuite:
    parts.append(NOT_MEASURED)
  elif not groups:
    parts.append("No configuration with T ≥ 512 in which a peer is more than 5% faster than the "
                 "probjax default (computed from the grid rows).")
  else:
    files = sorted({r.get("_file") for r in gsuite})
    parts.append(f"Configurations (T ≥ 512) in which another library is more than 5% faster than "
                 f"the probjax default, computed from {', '.join(files)}:")
    parts.append("")
    parts += faster_bullets(groups)
  parts += ["", t4096_table(rows) if gsuite else "", "",
            "## Masked attention", "", masked_section(rows), "",
            "## Memory", "", memory_section(rows, fig_dir, fig_rel), "",
            "## Short sequences and the default dispatch", "", dispatch_section(rows, fig_dir, fig_rel), "",
            "## Tile selection", "", tiles_section(rows), "",
            "## Grouped-query attention and decoding", "", gqa_section(rows, fig_dir, fig_rel), "",
            "## Short calls: wall clock and kernel time", "", device_time_section(rows), "",
            "## CPU", "", cpu_section(cpu_rows, fig_dir, fig_rel), "",
            "## How to reproduce", "", REPRO, ""]
  return "\n".join(parts)


def why_tables(rows) -> list[str]:
  """Computed evidence for the three kinds of device default (cuDNN threshold, backward, fp32)."""
  out = []
  ok = [r for r in rows if r.get("status") == "ok" and r.get("ms") and r.get("suite") in ("grid", "dispatch")
        and r.get("mask", "none") == "none"]
  # 1. cuDNN vs Triton by work = batch * q_heads * q_len * kv_len (16-bit, fwd_bwd)
  by = collections.defaultdict(dict)
  for r in ok:
    if r["dtype"] in ("bfloat16", "float16") and r["mode"] == "fwd_bwd":
      by[(r["batch"], r["q_heads"], r["q_len"], r["kv_len"], r["head_dim"], r["causal"])][r["impl"]] = r["ms"]
  body, first_win = [], None
  for k in sorted(by, key=lambda k: (k[0] * k[1] * k[2] * k[3], k)):
    v = by[k]
    cud = v.get("probjax_cudnn", v.get("jaxnn_cudnn"))
    tri = v.get("probjax_triton")
    if cud is None or tri is None:
      continue
    work = k[0] * k[1] * k[2] * k[3]
    body.append([f"{work:,}", f"B{k[0]} H{k[1]} T{k[2]} D{k[4]}{' causal' if k[5] else ''}",
                 fmt_ms(tri), fmt_ms(cud), f"{tri / cud:.2f}"])
    if first_win is None and tri > cud:
      first_win = work
  if body:
    out += ["### cuDNN against the Triton kernel by work (16-bit, fwd+bwd)", "",
            "work = batch × query heads × Lq × Lkv; cuDNN column: probjax implementation=\"cudnn\" "
            "(jax.nn cuDNN where that row is missing)." + (
                f" The smallest measured work at which cuDNN is faster: {first_win:,}."
                if first_win else " cuDNN was not faster at any measured work."), "",
            "<details><summary>Table</summary>\n\n" + md_table(
                ["work", "shape", "triton ms", "cuDNN ms", "triton / cuDNN"], body) + "\n\n</details>", ""]
  # 2. backward variants
  bw = ("probjax_triton_onepass", "probjax_triton_fused", "probjax_triton_split")
  by = collections.defaultdict(dict)
  for r in ok:
    if r["mode"] == "fwd_bwd" and r["impl"] in bw:
      by[(r["dtype"], r["head_dim"], r["causal"], r["q_len"])][r["impl"]] = r["ms"]
  body, near = [], 0
  full = {k: v for k, v in by.items() if len(v) == 3}
  for k in sorted(full):
    v = full[k]
    best = min(v.values())
    near += v["probjax_triton_split"] <= 1.01 * best
    body.append([DTYPE_SHORT.get(k[0], k[0]), k[1], "yes" if k[2] else "no", k[3]]
                + [fmt_ms(v[i]) for i in bw] + [label(min(v, key=v.get))])
  if body:
    out += ["### Backward variants (fwd+bwd)", "",
            f"The split backward is within 1% of the fastest variant in {near} of {len(body)} shapes.", "",
            "<details><summary>Table</summary>\n\n" + md_table(
                ["dtype", "head_dim", "causal", "T", "onepass ms", "fused ms", "split ms", "fastest"],
                body) + "\n\n</details>", ""]
  # 3. fp32: dense XLA vs kernels
  by = collections.defaultdict(dict)
  for r in select(rows, suite="grid", dtype="float32", mode="fwd_bwd"):
    by[(r["head_dim"], r["causal"], r["q_len"])][r["impl"]] = r
  cols = ("probjax_default", "probjax_triton", "probjax_xla", "jaxnn_xla")
  body = [[k[0], "yes" if k[1] else "no", k[2]] + [cell(by[k].get(i)) for i in cols]
          for k in sorted(by)]
  if body:
    out += ["### float32 (fwd+bwd, ms)", "", md_table(["head_dim", "causal", "T"] + [label(i) for i in cols],
                                                       body), ""]
  return out


def _device_table_text():
  try:
    from probjax.nn.layers import attention_device as ad
  except Exception as e:  # noqa: BLE001
    return None, f"probjax.nn.layers.attention_device not importable ({type(e).__name__})"
  return "DEVICE_DEFAULTS", ad.DEVICE_DEFAULTS


def h200_page(all_rows, fig_dir, fig_rel, alt_rows=()) -> str:
  """``alt_rows``: see :func:`target_section`."""
  rows = [r for r in gpu_rows(all_rows)]
  devs = collections.Counter((r.get("device"), str(r.get("compute_capability"))) for r in rows)
  parts = ["# probjax on the NVIDIA H200", "",
           "Device-specific defaults of probjax's attention on this GPU and the measurements behind "
           "them (each rule's evidence: [decisions.md](decisions.md)). Generated from "
           "`bench/results/*/*.json` by `python -m bench.benchmark_figures`; "
           "no number is typed by hand.", "", "## Setup", "", setup_section(rows), ""]
  parts += ["## Device-specific defaults", ""]
  name, table = _device_table_text()
  if name:
    parts += [f"`probjax.nn.layers.attention_device.{name}` (the table the dispatch reads, loaded from "
              "`probjax/ops/attention/tuning/sm_*.json`, generated from `bench/tuning/sm_*.json`, where each "
              "value's evidence rows are):", "",
              "```", _pretty(table), "```", ""]
  else:
    parts += [f"_{table}._", ""]
  exp = [(r["head_dim"], r["q_len"], r["dispatch"]) for r in select(rows, suite="dispatch")
         if r.get("dispatch") and r["impl"] == "probjax_default"]
  if exp:
    parts += ["What the default picked in the dispatch sweep (explain_dispatch):", "",
              md_table(["head_dim", "T", "explain_dispatch"],
                       [[d, t, str(e).replace("\n", " ").replace("|", "/")[:300]] for d, t, e in sorted(exp, key=lambda x: x[:2])]), ""]
  parts += ["## Why", ""]
  g = select(rows, suite="grid", status="ok")
  pj = [r for r in g if r["impl"].startswith("probjax_")]
  if pj:
    by = collections.defaultdict(dict)
    for r in pj:
      by[(r["dtype"], r["head_dim"], r["causal"], r["mode"], r["q_len"])][r["impl"]] = r["ms"]
    body, slower = [], []
    for k in sorted(by):
      v = by[k]
      best = min(v, key=v.get)
      d = v.get("probjax_default")
      body.append([DTYPE_SHORT.get(k[0], k[0]), k[1], "yes" if k[2] else "no", k[3], k[4],
                   fmt_ms(d) if d else "—", label(best), fmt_ms(v[best]),
                   f"{d / v[best]:.2f}" if d else "—"])
      if d and d > 1.05 * v[best] and k[4] >= 512:
        slower.append(k)
    parts += ["Every probjax implementation and backward variant per grid shape: the default's time, "
              "the fastest probjax variant and their ratio (1.00 = the default picked the fastest).", "",
              f"The default is more than 5% slower than the best explicit probjax choice in "
              f"{len(slower)} of {len(body)} shapes.", "",
              "<details><summary>Table</summary>\n\n" + md_table(
                  ["dtype", "head_dim", "causal", "mode", "T", "default ms", "fastest probjax",
                   "its ms", "default / fastest"], body) + "\n\n</details>", ""]
    bw = [r for r in pj if r["mode"] == "fwd_bwd" and r["impl"] in
          ("probjax_triton_onepass", "probjax_triton_fused", "probjax_triton_split", "probjax_default")]
    if bw:
      series = series_by(bw, lambda r: label(r["impl"]), keep=lambda r: (
          r["dtype"] == "bfloat16" and r["head_dim"] == 128 and not r["causal"]))
      ok = fig_lines(series, os.path.join(fig_dir, "h200_backward.png"), "T", "ms",
                     "fwd+bwd by backward variant, bf16 D128 non-causal")
      parts += [_fig_ref(fig_rel, "h200_backward.png", ok, "backward variants"), ""]
  else:
    parts += [NOT_MEASURED, ""]
  parts += why_tables(rows)
  parts += ["## The dispatch target: the default against the fastest peer", "", target_section(rows, alt_rows), "",
            "## Against the peers on this GPU", ""]
  groups = faster_alternatives(rows)
  if not select(rows, suite="grid"):
    parts.append(NOT_MEASURED)
  elif groups:
    parts.append("Where a peer is more than 5% faster than the probjax default (T ≥ 512):")
    parts.append("")
    parts += faster_bullets(groups)
  else:
    parts.append("No peer is more than 5% faster than the probjax default at T ≥ 512.")
  parts += ["", t4096_table(rows) if select(rows, suite="grid") else "", "",
            "## Implementations timed in one process", "", interleaved_section(rows), "",
            "## Decoding with the default", "", gqa_section([r for r in rows if r["suite"] == "decode"]), ""]
  if not devs:
    parts.insert(6, NOT_MEASURED)
  return "\n".join(parts)


# Issue 4's target: the default within 2% of the fastest of these peers in every row.
TARGET_PEERS = ("jaxnn_cudnn", "torch_sdpa_cudnn", "torch_sdpa_flash", "torch_flex")
TARGET_LENGTHS = (1024, 3000, 4096, 16384)
TARGET_RATIO = 1.02


def _target_rows(rows):
  """``(body, within, slower, tokamax)`` of :func:`target_section`'s table for ``rows``."""
  cases = [r for r in select(rows, suite="grid", dtype="bfloat16", batch=4, q_heads=8, status="ok")
           if r["q_len"] in TARGET_LENGTHS] + select(rows, suite="gqa", dtype="bfloat16", status="ok")
  by = collections.defaultdict(dict)
  for r in cases:
    by[(r["suite"], r["q_heads"], r["kv_heads"], r["head_dim"], r["q_len"], r["causal"], r["mode"])][r["impl"]] = r
  body, within, slower, tok = [], 0, [], []
  for k in sorted(by):
    d = by[k].get("probjax_default")
    if d is None:
      continue
    peers = [r for i, r in by[k].items() if i in TARGET_PEERS and r.get("commit") == d.get("commit")]
    if not peers:
      continue
    best = min(peers, key=lambda r: r["ms"])
    ratio = d["ms"] / best["ms"]
    within += ratio <= TARGET_RATIO
    name = f"{'GQA ' if k[0] == 'gqa' else ''}D{k[3]} T{k[4]}{' causal' if k[5] else ''} {k[6]}"
    if ratio > 1.0:
      slower.append(f"{name} ({label(best['impl'])}, {ratio:.3f})")
    tm = by[k].get("tokamax_mosaic")
    if tm and tm.get("ms") and tm["ms"] < d["ms"]:
      same = "same run" if tm.get("commit") == d.get("commit") else f"tokamax at {tm.get('commit')}"
      tok.append(f"{name} ({fmt_ms(tm['ms'])} vs {fmt_ms(d['ms'])} ms, {same})")
    body.append([f"{k[1]}/{k[2]}", k[3], k[4], "yes" if k[5] else "no", k[6], fmt_ms(d["ms"]),
                 label(best["impl"]), fmt_ms(best["ms"]), f"{ratio:.3f}", d.get("timing", "plain"),
                 d.get("commit", "?")])
  return body, within, slower, tok


TARGET_HEADER = ["heads q/kv", "D", "T", "causal", "mode", "default ms", "fastest peer", "its ms",
                 "ratio", "timing", "commit"]


def target_section(rows, alt_rows=()) -> str:
  """The bf16 grid (batch 4, 8 heads) at :data:`TARGET_LENGTHS` and the GQA suite: the default
  against the fastest of :data:`TARGET_PEERS` measured in the same run (same commit), with the
  timing method of the rows; the fp32 D128 T4096 fwd+bwd row against jax.nn XLA; the rows
  where tokamax's Mosaic kernel is faster than the default; and ``alt_rows`` (the same shapes
  timed the other way, ``bench/results/<device>/other_timing/*.json``) as a second table."""
  body, within, slower, tok = _target_rows(rows)
  if not body:
    return NOT_MEASURED
  out = [f"The default against the fastest of {', '.join(label(i) for i in TARGET_PEERS)} in the same "
         f"run (bf16; batch 4, 8 heads; GQA: batch 1, 32 query / 8 KV heads): **{within} of {len(body)} "
         f"rows within {TARGET_RATIO}**. Timing `differenced`: each repeat is (2n calls - n calls) / n, "
         "without the per-repeat dispatch and sync; `plain`: n calls and one sync per repeat.", "",
         md_table(TARGET_HEADER, body), ""]
  out.append("Rows where a peer is faster than the default: " + ("; ".join(slower) if slower else "none") + ".")
  out.append("")
  out.append("Rows where tokamax's Mosaic kernel is faster than the default: "
             + ("; ".join(tok) if tok else "none measured") + ".")
  fp = {r["impl"]: r for r in select(rows, suite="grid", dtype="float32", head_dim=128, q_len=4096,
                                      causal=False, mode="fwd_bwd", status="ok")}
  if "probjax_default" in fp and "jaxnn_xla" in fp:
    d, x = fp["probjax_default"], fp["jaxnn_xla"]
    out += ["", f"fp32 D128 T4096 fwd+bwd: default {fmt_ms(d['ms'])} ms, jax.nn XLA {fmt_ms(x['ms'])} ms "
                f"(ratio {d['ms'] / x['ms']:.3f}; {d.get('commit')} / {x.get('commit')})."]
  a_body, a_within, a_slower, _ = _target_rows(list(alt_rows))
  if a_body:
    out += ["", f"The same shapes timed the other way in the same session "
                f"(`other_timing/*.json`): {a_within} of {len(a_body)} within {TARGET_RATIO}; "
                "a peer faster in: " + ("; ".join(a_slower) if a_slower else "none") + ".", "",
            "<details><summary>Table</summary>\n\n" + md_table(TARGET_HEADER, a_body) + "\n\n</details>"]
  return "\n".join(out)


def interleaved_section(rows) -> str:
  """The "interleaved" suite (``bench/interleaved.py``: implementations of a shape timed in
  one process in rotating rounds): one table per run (commit and command), each
  implementation's ms and, per probjax implementation, its time over the fastest peer's
  (peers: every non-probjax implementation of the run)."""
  rows = [r for r in rows if r.get("suite") == "interleaved"]
  if not rows:
    return NOT_MEASURED
  parts = ["Implementations timed in one process, in rotating rounds (median of the rounds' medians; "
           "bf16): the grid times torch in a process of its own. probjax / peer: the probjax "
           "implementation's ms over the fastest peer's in the row. The run of a row is its commit "
           "and command (`bench/results/h200/interleaved.json`)."]
  runs = collections.defaultdict(list)
  for r in rows:
    runs[(r.get("commit"), r.get("command", ""))].append(r)
  for (commit, command), rr in sorted(runs.items(), key=lambda kv: (str(kv[0][0]), kv[0][1])):
    impls = list(dict.fromkeys(r["impl"] for r in rr))
    ours = [i for i in impls if i.startswith("probjax_")]
    peers = [i for i in impls if not i.startswith("probjax_")]
    by = collections.defaultdict(dict)
    for r in rr:
      if r.get("ms") is not None:  # a failed implementation's row (status, error) shows as "—"
        by[(r["batch"], r["q_heads"], r["q_len"], r["head_dim"], r["causal"], r["mode"], r["mask"],
            r.get("timing", "plain"))][r["impl"]] = r["ms"]
    body = []
    for (b, h, t, d, c, mode, mask, tm), v in sorted(by.items()):
      best = min((v[p] for p in peers if p in v), default=None)
      body.append([f"B{b} H{h}", t, d, "yes" if c else "no", mode, mask, tm]
                  + [fmt_ms(v[i]) if i in v else "—" for i in impls]
                  + [f"{v[i] / best:.3f}" if i in v and best else "—" for i in ours])
    parts += ["", f"`{command}` at {commit}, {rr[0].get('device')}.", "",
              md_table(["shape", "T", "head_dim", "causal", "mode", "mask", "timing"]
                       + [f"{label(i)} ms" for i in impls] + [f"{label(i)} / peer" for i in ours], body)]
  return "\n".join(parts)


def _pretty(obj) -> str:
  """Readable text of the device table (dict of compute capability -> dataclass)."""
  import dataclasses as dc
  lines = []
  items = obj.items() if isinstance(obj, dict) else [("", obj)]
  for k, v in items:
    lines.append(f"compute capability {k}:" if k != "" else "")
    if dc.is_dataclass(v):
      for f in dc.fields(v):
        lines.append(f"  {f.name} = {getattr(v, f.name)!r}")
    else:
      lines.append(f"  {v!r}")
  return "\n".join(lines)[:6000]


def build(results_dir: str, docs_dir: str, fig_dir: str) -> dict:
  os.makedirs(fig_dir, exist_ok=True)
  rows = load_all(results_dir)
  fig_rel = os.path.relpath(fig_dir, docs_dir)
  perf = performance_page(rows, fig_dir, fig_rel)
  alt = [r for path in sorted(glob.glob(os.path.join(results_dir, "*", "other_timing", "*.json")))
         for r in load_rows(path)]
  h200 = h200_page(rows, fig_dir, fig_rel, alt)
  p1, p2 = os.path.join(docs_dir, "attention-performance.md"), os.path.join(docs_dir, "h200.md")
  for p, text in ((p1, perf), (p2, h200)):
    with open(p, "w") as f:
      f.write(text.rstrip() + "\n")
  return {"rows": len(rows), "pages": [p1, p2], "figures": sorted(os.listdir(fig_dir))}


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__)
  p.add_argument("--results-dir", default=RESULTS_DIR)
  p.add_argument("--docs-dir", default=DOCS_DIR)
  p.add_argument("--fig-dir", default=None, help="default: DOCS_DIR/figures")
  args = p.parse_args(argv)
  fig_dir = args.fig_dir or os.path.join(args.docs_dir, "figures")
  info = build(args.results_dir, args.docs_dir, fig_dir)
  print(json.dumps(info, indent=1))
  return 0


if __name__ == "__main__":
  sys.exit(main())
