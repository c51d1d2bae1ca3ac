"""Merges the benchmark JSON files of several device batches into one directory.

  python -m docs.scripts.merge_rows OUT_DIR BATCH_DIR [BATCH_DIR ...]

Every ``*.json`` in a batch directory is merged into ``OUT_DIR/<same name>``: rows are
keyed as ``--append`` keys them (:func:`harness.row_key`); of two measured rows ("ok") with
one key the more recent (``time``; on a tie, the later batch's) is kept, so that a batch's
copy of an older row never replaces another batch's new one, and a measured row is never
replaced by one that is not. A probe's file (one JSON object, not rows) is copied as it is; when several batches
wrote one, the last batch's copy is kept. Used by ``gpu_pair.sh``, whose two batches run on
two GPUs of one host.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import sys

from docs.scripts import harness


def merge(paths: list[str]) -> list[dict]:
  """Rows of ``paths`` in order, one per key (see the module docstring)."""
  by_key: dict[tuple, dict] = {}
  for path in paths:
    for row in harness.load_rows(path):
      k = harness.row_key(row)
      old = by_key.get(k)
      ok, old_ok = row.get("status") == "ok", old is not None and old.get("status") == "ok"
      if old is None or not old_ok or (ok and row.get("time", "") >= old.get("time", "")):
        by_key[k] = row
  return list(by_key.values())


def _is_probe(path: str) -> bool:
  """Whether ``path`` holds one JSON object (a probe's output) rather than rows."""
  try:
    with open(path) as f:
      obj = json.load(f)
    return isinstance(obj, dict) and "rows" in obj  # a one-line rows file is one row
  except json.JSONDecodeError:  # several lines: rows
    return False


def main(argv=None) -> int:
  argv = sys.argv[1:] if argv is None else argv
  if len(argv) < 2:
    print(__doc__, file=sys.stderr)
    return 2
  out, batches = argv[0], argv[1:]
  names = sorted({os.path.basename(p) for b in batches for p in glob.glob(os.path.join(b, "*.json"))})
  for name in names:
    paths = [p for p in (os.path.join(b, name) for b in batches) if os.path.exists(p)]
    if _is_probe(paths[-1]):
      shutil.copyfile(paths[-1], os.path.join(out, name))
      print(f"[merge] {name}: a probe's JSON object, copied from {os.path.dirname(paths[-1])}")
      continue
    rows = merge(paths)
    with open(os.path.join(out, name), "w") as f:
      f.writelines(json.dumps(r) + "\n" for r in rows)
    print(f"[merge] {name}: {len(rows)} rows from {len(paths)} batch(es)")
  return 0


if __name__ == "__main__":
  sys.exit(main())
