"""Score a token-tile rule for the fused linear cross-entropy offline, from rows that time
explicit tiles (``bench/linear_cross_entropy.py --tiles``): regret = the rule's tile / the
fastest XLA tile measured for the case, geometric mean and worst.

  python -m bench.lce_rule bench/results/h100_80gb_hbm3/lce_validate.json [more rows ...]
  python -m bench.lce_rule --tile fused_1024xall ROWS ...   # one fixed tile instead

The rule scored is :func:`proposed_tile`, written before its validation sample was drawn
(``bench/tuning/lce/validate2_seed.json``), or with ``--tile`` that tile for every case; a
case whose tile has no row is reported, not scored.
"""

from __future__ import annotations

import argparse
import json
import math
import sys

BUDGET_FLOOR_BYTES = 128 << 20


def proposed_tile(tokens: int, d: int, vocab: int) -> str:
  """The tile name (``fused_<tokens>x<vocab|all>``) the proposed rule picks.

  Wide models keep the per-token scheme: at d 3072 each whole-vocabulary token tile reads and
  writes a ``[d, vocab]`` float32 gradient accumulator three times the size of d 1024's, and the
  per-token tile avoids it. Otherwise the whole vocabulary, with the largest token tile that (a)
  rounds the tokens up by under 15% (the last tile is moved back and recomputes rows: 2250 tokens
  at 2048 compute 4096) and (b) keeps its float32 logits within a tenth of the materialised
  logits, or 128 MiB where that is more (16384 tokens x 32768 vocabulary: 1024, whose 128 MiB is
  1/16 of the 2 GiB materialised).
  """
  if d >= 3072 or (d >= 2048 and tokens < 4096):
    return "fused_1024x4096"
  budget = max(0.1 * tokens * vocab * 4, BUDGET_FLOOR_BYTES)
  for t in (2048, 1024, 512):
    if math.ceil(tokens / t) * t < 1.15 * tokens and t * vocab * 4 <= budget:
      return f"fused_{t}xall"
  return "fused_512xall"


def score(rows: list[dict], rule=None) -> dict:
  """``{"cases": {case: {tile, regret, best}}, "missing": [...], "geo_mean", "worst"}`` of
  ``rule(tokens, d, vocab) -> tile name`` (default :func:`proposed_tile`)."""
  rule = rule or proposed_tile
  times, shape = {}, {}
  for r in rows:
    if r.get("ms") and r.get("impl", "").startswith("fused_"):
      times.setdefault(r["case"], {})[r["impl"]] = r["ms"]
      shape[r["case"]] = (r["tokens"], r["d"], r["vocab"])
  cases, missing = {}, []
  for case, t in times.items():
    tile = rule(*shape[case])
    if tile not in t:
      missing.append(f"{case}: {tile} not measured")
      continue
    best = min(t, key=t.get)
    cases[case] = dict(tile=tile, regret=t[tile] / t[best], best=best)
  regrets = [c["regret"] for c in cases.values()]
  return dict(cases=cases, missing=missing,
              geo_mean=math.exp(sum(map(math.log, regrets)) / len(regrets)) if regrets else None,
              worst=max(regrets, default=None))


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("rows", nargs="+")
  p.add_argument("--tile", default=None, help="score this fixed tile (a row name, e.g. fused_1024xall)")
  args = p.parse_args(argv)
  rows = [json.loads(l) for path in args.rows for l in open(path) if l.strip()]
  s = score(rows, None if args.tile is None else (lambda *_: args.tile))
  for case, c in s["cases"].items():
    print(f"{case}: {c['tile']} regret {c['regret']:.3f} (best {c['best']})")
  for m in s["missing"]:
    print(m)
  if s["geo_mean"] is not None:
    print(f"geometric mean {s['geo_mean']:.3f}, worst {s['worst']:.3f}, {len(s['cases'])} cases")
  return 0


if __name__ == "__main__":
  sys.exit(main())
