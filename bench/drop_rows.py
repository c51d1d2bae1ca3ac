"""Removes rows that no longer describe the code from a benchmark JSON file, so that the
next ``--append`` run measures them again (the old rows stay in git history).

  python -m bench.drop_rows bench/results/h200/grid.json --impl 'probjax_*'
  python -m bench.drop_rows bench/results/h200/tiles.json --variant 'auto*'
  python -m bench.drop_rows bench/results/h200/grid.json --suite grid --q_len 4096,8192

Selectors are comma-separated glob patterns; a row is dropped when it matches every
selector given (at least one is required). ``--dry-run`` only counts.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import sys

from bench import harness

FIELDS = ("impl", "suite", "variant", "dtype", "mode", "mask", "commit", "q_len", "head_dim", "causal", "status")


def matches(row: dict, selectors: dict[str, str]) -> bool:
  """Whether ``row`` matches every ``field -> comma-separated globs`` selector."""
  return all(any(fnmatch.fnmatch(str(row.get(field)), p) for p in pats.split(","))
             for field, pats in selectors.items())


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("file")
  for field in FIELDS:
    p.add_argument(f"--{field}", help=f"glob patterns of the row's {field!r}")
  p.add_argument("--dry-run", action="store_true")
  args = p.parse_args(argv)
  selectors = {f: getattr(args, f) for f in FIELDS if getattr(args, f) is not None}
  if not selectors:
    p.error("give at least one selector (" + ", ".join(f"--{f}" for f in FIELDS) + ")")
  rows = harness.load_rows(args.file)
  keep = [r for r in rows if not matches(r, selectors)]
  print(f"{args.file}: {len(rows) - len(keep)} of {len(rows)} rows match"
        + (" (dry run)" if args.dry_run else "; dropped"))
  if not args.dry_run:
    with open(args.file, "w") as f:
      f.writelines(json.dumps(r) + "\n" for r in keep)
  return 0


if __name__ == "__main__":
  sys.exit(main())
