"""`make run`: :mod:`probjax.attention_report` with a progress bar and a figure.

    python -m bench.report            # what `make run` runs; the report's options (--quick, --seq, ...)
    python -m bench.report --quick    # tiny shapes, seconds

The same cases, implementations, checks, tables and JSON rows as
``python -m probjax.attention_report`` (its options, its ``--output``), and:

* a progress bar (tqdm, the ``bench`` extra) on stderr naming the case and the implementation
  being measured (``--quiet``: none);
* the flag "the default is not the fastest" never compares the default with the
  implementation it runs: the default's rows are compared with the other implementations'
  (:func:`annotate_default`; the row of the implementation the default picked is the same
  kernel, and their difference is the measurement's noise);
* a figure beside the JSON (``reports/attention_report.png`` for the default output;
  ``--no-figure``: none; matplotlib, the ``bench`` extra): per mode, each case's median time
  of every implementation, the default's bar outlined.

The rows' fields are the report's (its module docstring); :func:`annotate_default` sets the
default's ``default_is_fastest``, ``default_slower``, ``default_same_impl`` (the labels of
the rows that run the default's implementation), ``default_best`` (the faster of those),
``fastest_other`` (the fastest other implementation) and ``default_vs_other`` (the first's
time over the second's).
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import time

from probjax import attention_report as report

MODES = (("fwd", "fwd"), ("fwd_bwd", "fwd+bwd"))


# -----------------------------------------------------------------------------
# the flag
# -----------------------------------------------------------------------------
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
  is faster than the default's own best (the faster of its row and its implementation's);
  ``default_slower``: not the fastest and its p10 above that faster implementation's p90
  (None with too few repeats for a spread). Rows the report's ``annotate`` set are kept
  otherwise (``fastest``, ``vs_fastest``: over every row)."""
  for mode, _ in MODES:
    mrows = [r for r in rows if r["mode"] == mode]
    d = next((r for r in mrows if r["impl"] == "probjax_default"), None)
    if d is None:
      continue
    same = same_impl_labels(d)
    d["default_same_impl"] = sorted(same)
    if not (d["status"] == "ok" and d["ms"] is not None):
      d["default_is_fastest"] = d["default_slower"] = None
      continue
    counts = [r for r in mrows if report._counts(r)]
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
    elif min(best_own.get("n_repeats") or 0, rival.get("n_repeats") or 0) >= report.MIN_SPREAD_REPEATS:
      d["default_slower"] = bool(best_own["p10_ms"] > rival["p90_ms"])
    else:
      d["default_slower"] = None


def default_flags(crow: list[dict]) -> list[str]:
  """One line per mode where another implementation is faster than the default's own
  (:func:`annotate_default`): which, by how much, and whether beyond the spread."""
  out = []
  for mode, name in MODES:
    d = next((r for r in crow if r["impl"] == "probjax_default" and r["mode"] == mode), None)
    if d is None or d.get("default_is_fastest") is not False:
      continue
    why = {True: "beyond the p10-p90 spread", False: "within the p10-p90 spread",
           None: "too few repeats to tell from noise"}[d.get("default_slower")]
    own = d.get("default_impl") or "?"
    out.append(f"  ! {name}: the default ({own}) is not the fastest: {d['fastest_other']} "
               f"({d['default_vs_other']:.2f}x faster than {d['default_best']}, {why})")
  return out


def format_case(case, crow: list[dict]) -> str:
  """The report's table of one case, with :func:`default_flags` in place of its flags."""
  lines = [ln for ln in report.format_case(case, crow).split("\n") if not ln.startswith("  ! ")]
  return "\n".join(lines + default_flags(crow))


# -----------------------------------------------------------------------------
# progress
# -----------------------------------------------------------------------------
class _Ticking(list):
  """The implementations of one case; iterating them (as ``report.run_case`` does, once)
  names each on the bar before it is measured and ticks it after."""

  def __init__(self, impls, bar, case_name: str):
    super().__init__(impls)
    self.bar, self.case_name = bar, case_name

  def __iter__(self):
    for item in list.__iter__(self):
      if self.bar is not None:
        self.bar.set_description(f"{self.case_name}: {item[0]}")
      yield item
      if self.bar is not None:
        self.bar.update(1)


def progress_bar(total: int, enabled: bool):
  """A tqdm bar on stderr (None without tqdm or when not ``enabled``)."""
  if not enabled:
    return None
  try:
    from tqdm import tqdm
  except ImportError:  # the bench extra is not installed: the report's plain lines
    return None
  return tqdm(total=total, file=sys.stderr, dynamic_ncols=True, unit="impl", leave=False)


# -----------------------------------------------------------------------------
# figure
# -----------------------------------------------------------------------------
def figure_path(output: str) -> str:
  """The PNG beside the JSON: ``reports/attention_report.json`` -> ``reports/attention_report.png``."""
  return os.path.splitext(output)[0] + ".png"


def write_figure(rows: list[dict], path: str, title: str = "") -> str | None:
  """Per mode, a bar per (case, implementation) of the median ms (log scale; rows that did
  not run or failed their check left out, a failed check's bar hatched), the default's bar
  outlined. Returns ``path``, or None where there is nothing to draw or no matplotlib."""
  try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError:
    return None
  ran = [r for r in rows if r.get("status") == "ok" and r.get("ms")]
  if not ran:
    return None
  cases = list(dict.fromkeys(r["case"] for r in rows))
  impls = list(dict.fromkeys(r["impl"] for r in rows))
  colors = plt.get_cmap("tab10")
  width = 0.8 / max(len(impls), 1)
  fig, axes = plt.subplots(1, len(MODES), figsize=(max(6.0, 1.6 * len(cases)) * len(MODES) / 1.5, 4.2),
                           squeeze=False)
  for ax, (mode, name) in zip(axes[0], MODES):
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
      bars = ax.bar(xs, ys, width, label=impl, color=colors(j % 10),
                    edgecolor="black" if impl == "probjax_default" else "none",
                    linewidth=1.2 if impl == "probjax_default" else 0)
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


# -----------------------------------------------------------------------------
# command line
# -----------------------------------------------------------------------------
def main(argv=None) -> int:
  argv = list(sys.argv[1:] if argv is None else argv)
  no_figure = "--no-figure" in argv
  argv = [a for a in argv if a != "--no-figure"]
  if "-h" in argv or "--help" in argv:
    print(__doc__.split("\n\n")[0] + "\n\nThe report's options, and --no-figure (no PNG beside the JSON):\n")
  args = report.parse_args(argv)
  t_start = time.perf_counter()
  import jax
  platform_kind, device = report.device_info()
  cases, repeats = report.build_cases(args, platform_kind)
  impls = report.implementations(platform_kind, cases[0].dtype if cases else "float32", args.impl)
  print(f"probjax attention report  device: {device}  jax {jax.__version__}  repeats: {repeats} (median, p10-p90)",
        flush=True)
  print("implementations: " + ", ".join(lab for lab, _, _ in impls), flush=True)
  print(report._LEGEND, flush=True)
  bar = progress_bar(len(cases) * len(impls), enabled=not args.quiet)
  say = (lambda s: print(s, flush=True)) if bar is None else (lambda s: bar.write(s, file=sys.stdout))
  log = (lambda s: None) if args.quiet else (
      (lambda s: print(s, file=sys.stderr, flush=True)) if bar is None else (lambda s: bar.write(s, file=sys.stderr)))
  rows: list[dict] = []
  for case in cases:
    if bar is None:
      log(f"running {case.name} ...")
    crow = report.run_case(case, _Ticking(impls, bar, case.name), repeats, device, platform_kind, log=log)
    annotate_default(crow)
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
  info = report.timing.device_info()
  command = " ".join(["python -m bench.report"] + argv)
  date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
  for r in rows:
    r.setdefault("jax", jax.__version__)
    r.setdefault("command", command)
    r.setdefault("versions", info["versions"])
    r.setdefault("commit", info["commit"])
    r.setdefault("date", date)
  os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
  with open(args.output, "w") as fh:
    json.dump(rows, fh, indent=1, default=report._json_default)
    fh.write("\n")
  print(f"wrote {args.output}")
  if not no_figure:
    png = write_figure(rows, figure_path(args.output), title=f"{device}, jax {jax.__version__}")
    print(f"wrote {png}" if png else "no figure (nothing ran, or matplotlib missing: pip install -e .[bench])")
  return 0


if __name__ == "__main__":
  sys.exit(main())
