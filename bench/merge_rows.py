"""Merges the results folders of several device batches into one.

  python -m bench.merge_rows OUT_DIR BATCH_DIR [BATCH_DIR ...]
  python -m bench.merge_rows bench/results /tmp/out/results     # a device run's rows into the repository's

Every ``*.json`` below a batch folder (``<device>/<suite>.json``) is merged into the file of
the same relative path under ``OUT_DIR`` (its rows included): rows are keyed as ``--append``
keys them (:func:`harness.row_key`); of two measured rows ("ok") with one key the more recent
(``time``; on a tie, the later folder's) is kept, so that a batch's copy of an older row never
replaces another batch's new one, and a measured row is never replaced by one that is not.
Used by ``gpu_pair.sh``, whose two batches run on two GPUs of one host.
"""

from __future__ import annotations

import glob
import json
import os
import sys

from bench import harness


def merge(paths: list[str]) -> list[dict]:
  """Rows of ``paths`` in order, one per key (see the module docstring)."""
  by_key: dict = {}
  for path in paths:
    key = harness.key_function(path)
    for row in harness.load_rows(path):
      k = key(row)
      old = by_key.get(k)
      ok, old_ok = row.get("status") == "ok", old is not None and old.get("status") == "ok"
      if old is None or not old_ok or (ok and row.get("time", "") >= old.get("time", "")):
        by_key[k] = row
  return list(by_key.values())


def main(argv=None) -> int:
  argv = sys.argv[1:] if argv is None else argv
  if len(argv) < 2:
    print(__doc__, file=sys.stderr)
    return 2
  out, batches = argv[0], argv[1:]
  names = sorted({os.path.relpath(p, b) for b in batches
                  for p in glob.glob(os.path.join(b, "**", "*.json"), recursive=True)})
  for name in names:
    paths = [p for p in (os.path.join(d, name) for d in [out, *batches]) if os.path.exists(p)]
    rows = merge(paths)
    target = os.path.join(out, name)
    os.makedirs(os.path.dirname(os.path.abspath(target)), exist_ok=True)
    with open(target, "w") as f:
      f.writelines(json.dumps(r) + "\n" for r in rows)
    print(f"[merge] {name}: {len(rows)} rows from {len(paths)} file(s)")
  return 0


if __name__ == "__main__":
  sys.exit(main())
