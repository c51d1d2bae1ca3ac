"""Row-by-row ratios between two benchmark JSON files (a before/after of a change, or two runs).

  python -m bench.compare_runs OLD.json NEW.json [--impl probjax_triton] [--suite grid]
  git show REV:bench/results/h200/grid.json > /tmp/old.json   # a committed "before"

Rows are matched by their key (suite, impl, dtype, shape, mask, mode, variant); only rows
measured ("ok") in both files count. Prints new/old per row and the spread of the ratios of
the peers (impls not selected), which is the run-to-run noise the selected rows' ratios
should be read against.
"""

from __future__ import annotations

import argparse
import fnmatch
import statistics
import sys

from bench import harness


def ratios(old: list[dict], new: list[dict], impl: str = "*", suite: str = "*") -> list[tuple[dict, float]]:
  """(new row, new ms / old ms) for the rows of both files that match and ran in both."""
  before = {harness.row_key(r): r for r in old if r.get("status") == "ok" and r.get("ms")}
  out = []
  for r in new:
    o = before.get(harness.row_key(r))
    if (o is None or r.get("status") != "ok" or not r.get("ms")
        or not any(fnmatch.fnmatch(r["impl"], p) for p in impl.split(","))
        or not fnmatch.fnmatch(r["suite"], suite)):
      continue
    out.append((r, r["ms"] / o["ms"]))
  return out


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("old")
  p.add_argument("new")
  p.add_argument("--impl", default="probjax_*", help="comma-separated globs of the rows to list")
  p.add_argument("--suite", default="*")
  args = p.parse_args(argv)
  old, new = harness.load_rows(args.old), harness.load_rows(args.new)
  sel = ratios(old, new, args.impl, args.suite)
  for r, x in sorted(sel, key=lambda t: (t[0]["suite"], t[0]["impl"], t[0]["head_dim"], t[0]["q_len"],
                                          t[0]["causal"], t[0]["mode"])):
    print(f"{r['suite']:>8} {r['impl']:<24} {r['dtype']:<8} D{r['head_dim']:<4} T{r['q_len']:<6}"
          f"{' causal' if r['causal'] else '       '} {r['mode']:<8} {r.get('variant') or '':<12} "
          f"{r['ms']:9.4f} ms  new/old {x:.3f}")
  peers = [x for r, x in ratios(old, new, "*", args.suite)
           if not any(fnmatch.fnmatch(r["impl"], q) for q in args.impl.split(","))]
  if sel:
    xs = [x for _, x in sel]
    print(f"selected: {len(xs)} rows, new/old median {statistics.median(xs):.3f}, "
          f"range {min(xs):.3f}-{max(xs):.3f}")
  if peers:
    print(f"other rows (noise): {len(peers)} rows, median {statistics.median(peers):.3f}, "
          f"range {min(peers):.3f}-{max(peers):.3f}")
  if not sel:
    print("no rows ran in both files")
  return 0


if __name__ == "__main__":
  sys.exit(main())
