"""Rewrites README.md's performance section from the CPU benchmark JSON.

  python -m bench.cpu_readme_numbers [--json bench/results/cpu/cpu.json] [--readme README.md] [--check]

Replaces everything between the markers ``<!-- perf:begin -->`` and
``<!-- perf:end -->`` (which must exist in the README) with a table generated
from the JSON (suite "cpu"); no number is typed by hand. ``--check`` exits 1
if the section is out of date instead of writing.
"""
from __future__ import annotations

import argparse
import os
import sys

from bench.harness import IMPL_LABELS, ROOT, load_rows

BEGIN, END = "<!-- perf:begin -->", "<!-- perf:end -->"
# probjax_xla (implementation="xla") is left out: off the GPU the default runs that same path,
# so a second row would only show the run's noise.
IMPLS = ("probjax_default", "jaxnn_xla", "torch_cpu")
STATUS = {"oom": "OOM", "fail": "fail†", "unsupported": "unsup.", "error": "error"}


def _cell(r):
  if r is None:
    return "—"
  if r.get("status") != "ok":
    return STATUS.get(r.get("status"), "?")
  fmt = lambda ms: f"{ms:.0f}" if ms >= 10 else f"{ms:.2f}"
  if r.get("p10_ms") is None or r.get("p90_ms") is None:
    return fmt(r["ms"])
  return f"{fmt(r['ms'])} ({fmt(r['p10_ms'])}–{fmt(r['p90_ms'])})"


def _cap(s: str) -> str:
  return s[:1].upper() + s[1:]


def section(rows, json_name: str) -> str:
  cpu = [r for r in rows if r.get("suite") == "cpu"]
  if not cpu:
    return f"_CPU numbers not measured yet ({json_name} has no rows)._"
  r0 = cpu[0]
  out = [f"CPU attention, fp32, batch {r0['batch']}, {r0['q_heads']} heads, head_dim "
         f"{r0['head_dim']}, median ms (10th–90th percentile of the repeats) on {r0['device']} (generated from `{json_name}` by "
         f"`python -m bench.cpu_readme_numbers`; rerun with "
         f"`make bench-cpu`):", ""]
  cols = sorted({(r["causal"], r["mode"], r["q_len"]) for r in cpu},
                key=lambda c: (c[0], c[1] != "fwd_bwd", c[2]))
  idx = {(r["impl"], r["causal"], r["mode"], r["q_len"]): r for r in cpu}
  impls = [i for i in IMPLS if any(k[0] == i for k in idx)]
  out.append("| impl | " + " | ".join(f"{'causal ' if c else ''}{'fwd+bwd' if m == 'fwd_bwd' else 'fwd'} T={t}"
                                      for c, m, t in cols) + " |")
  out.append("|---|" + "---|" * len(cols))
  for i in impls:
    out.append(f"| {IMPL_LABELS.get(i, i)} | " + " | ".join(_cell(idx.get((i,) + c)) for c in cols) + " |")
  key = {i: idx.get((i, False, "fwd_bwd", 4096)) for i in IMPLS}
  ok = {i: r["ms"] for i, r in key.items() if r is not None and r.get("status") == "ok"}
  if "probjax_default" in ok:
    p = "probjax_default"
    parts, goals = [], []
    if "jaxnn_xla" in ok:
      parts.append(f"jax.nn XLA {ok['jaxnn_xla']:.0f} ms ({ok['jaxnn_xla'] / ok[p]:.2f}× the probjax time)")
      goals.append(f"faster than jax.nn XLA: {'yes' if ok[p] < ok['jaxnn_xla'] else 'no'}")
    if "torch_cpu" in ok:
      parts.append(f"torch {ok['torch_cpu']:.0f} ms ({ok['torch_cpu'] / ok[p]:.2f}×)")
      goals.append(f"within 2× of torch: {'yes' if ok[p] <= 2 * ok['torch_cpu'] else 'no'}")
    loads = sorted(r["loadavg_1m"] for r in cpu if r.get("loadavg_1m") is not None)
    load = (f" Host 1-minute load average during the run: {loads[0]:.1f}–{loads[-1]:.1f}."
            if loads else "")
    if parts:
      out += ["", f"At T=4096 (non-causal fwd+bwd) {IMPL_LABELS[p]} takes {ok[p]:.0f} ms; "
              + ", ".join(parts) + ". " + _cap("; ".join(goals)) + "." + load]
  return "\n".join(out)


def rewrite(text: str, new_section: str) -> str:
  if BEGIN not in text or END not in text or text.index(BEGIN) > text.index(END):
    raise ValueError(f"README needs the markers {BEGIN} and {END} (in that order)")
  a = text.index(BEGIN) + len(BEGIN)
  b = text.index(END)
  return text[:a] + "\n" + new_section.strip() + "\n" + text[b:]


def main(argv=None):
  root = ROOT
  p = argparse.ArgumentParser(description=__doc__)
  p.add_argument("--json", default=os.path.join(root, "bench", "results", "cpu", "cpu.json"))
  p.add_argument("--readme", default=os.path.join(root, "README.md"))
  p.add_argument("--check", action="store_true")
  args = p.parse_args(argv)
  new = section(load_rows(args.json), os.path.relpath(args.json, root))
  with open(args.readme) as f:
    text = f.read()
  try:
    out = rewrite(text, new)
  except ValueError as e:
    print(str(e), file=sys.stderr)
    return 2
  if args.check:
    return 0 if out == text else 1
  with open(args.readme, "w") as f:
    f.write(out)
  print(new)
  return 0


if __name__ == "__main__":
  sys.exit(main())
