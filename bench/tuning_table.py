"""The shipped device tables from their evidence: ``bench/tuning/sm_*.json`` ->
``probjax/ops/attention/tuning/sm_*.json``.

Each evidence file (one per CUDA compute capability) holds ``about`` (prose), the
``compute_capability``, ``measured_on`` and ``entries``: entry name (``"cudnn.min_work"``) ->
``{"value": ..., "evidence": [[results file, row key, commit], ...]}``. The shipped table, which
the wheel carries and :mod:`probjax.ops.attention.tuning` loads, is the values only:
``{"compute_capability": [9, 0], "measured_on": ..., "entries": {"cudnn.min_work": 50331648,
...}}``, one entry a line, in the evidence file's order.

    python -m bench.tuning_table --check   # exit 1 where a shipped table differs from its evidence
    python -m bench.tuning_table --write   # write the shipped tables

To change a value: edit its ``value`` and ``evidence`` in ``bench/tuning/``, run ``--write``, and
say why in ``docs/dev/decisions.md``. ``tests/bench/test_benchmarks.py`` checks each triple is a row of that
results file at that commit; ``tests/ops/attention/test_dispatch.py`` that the shipped table is this script's.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EVIDENCE_DIR = os.path.join(ROOT, "bench", "tuning")
TABLE_DIR = os.path.join(ROOT, "probjax", "ops", "attention", "tuning")


def evidence_files() -> list[str]:
  """The evidence files, ``bench/tuning/sm_*.json``."""
  return sorted(os.path.join(EVIDENCE_DIR, n) for n in os.listdir(EVIDENCE_DIR)
                if n.startswith("sm_") and n.endswith(".json"))


def load_evidence(path: str) -> dict:
  with open(path) as f:
    return json.load(f)


def table_text(evidence: dict) -> str:
  """The shipped table's text for one evidence file's contents: values only."""
  entries = evidence["entries"]
  lines = ["{",
           f' "compute_capability": {json.dumps(evidence["compute_capability"])},',
           f' "measured_on": {json.dumps(evidence["measured_on"])},',
           ' "entries": {']
  names = list(entries)
  for i, name in enumerate(names):
    comma = "," if i < len(names) - 1 else ""
    lines.append(f"  {json.dumps(name)}: {json.dumps(entries[name]['value'])}{comma}")
  lines += [" }", "}", ""]
  return "\n".join(lines)


def table_path(evidence_path: str) -> str:
  """Where the shipped table generated from an evidence file goes (same file name)."""
  return os.path.join(TABLE_DIR, os.path.basename(evidence_path))


def generated() -> dict[str, str]:
  """Shipped table path -> the text generated from its evidence file."""
  return {table_path(p): table_text(load_evidence(p)) for p in evidence_files()}


def stale() -> list[str]:
  """The shipped tables that are missing or differ from what their evidence generates, and
  shipped tables without an evidence file."""
  out = []
  want = generated()
  for path, text in want.items():
    try:
      with open(path) as f:
        have = f.read()
    except FileNotFoundError:
      have = None
    if have != text:
      out.append(path)
  shipped = {os.path.join(TABLE_DIR, n) for n in os.listdir(TABLE_DIR) if n.startswith("sm_") and n.endswith(".json")}
  out += sorted(shipped - set(want))
  return out


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  mode = ap.add_mutually_exclusive_group(required=True)
  mode.add_argument("--check", action="store_true", help="exit 1 where a shipped table differs from its evidence")
  mode.add_argument("--write", action="store_true", help="write the shipped tables from the evidence")
  args = ap.parse_args(argv)
  if args.write:
    for path, text in generated().items():
      with open(path, "w") as f:
        f.write(text)
      print(f"wrote {os.path.relpath(path, ROOT)}")
    return 0
  bad = stale()
  for path in bad:
    print(f"{os.path.relpath(path, ROOT)}: differs from bench/tuning/ (python -m bench.tuning_table --write)",
          file=sys.stderr)
  if not bad:
    print(f"{len(evidence_files())} shipped table(s) match their evidence")
  return 1 if bad else 0


if __name__ == "__main__":
  sys.exit(main())
