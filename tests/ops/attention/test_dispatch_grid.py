"""The default's decision on every call of the benchmark grid is the recorded one, and every
recorded grid came with its reason (``dispatch_grid_changes.json``)."""

import json

from tests.ops.attention import dispatch_grid


def test_dispatch_decisions_on_the_grid_are_unchanged():
  want = json.loads(dispatch_grid.PATH.read_text())
  got = dispatch_grid.decisions()
  assert got.keys() == want.keys()
  moved = {k: (want[k], got[k]) for k in want if want[k] != got[k]}
  assert not moved, f"{len(moved)} decisions moved, e.g. {next(iter(moved.items()))}"


def test_the_recorded_grid_is_the_last_recorded_change():
  # A grid rewritten without `--reason` (or by hand) has no entry of its own.
  changes = json.loads(dispatch_grid.CHANGES.read_text())
  assert changes and all(c["reason"].strip() for c in changes)
  assert changes[-1]["sha256"] == dispatch_grid.digest(dispatch_grid.PATH.read_text())


def test_moved_counts_what_changed():
  a = {"x": {"implementation": "triton", "rule": "r"}, "y": {"implementation": "xla", "rule": "r"}}
  b = {"x": {"implementation": "cudnn", "rule": "s"}, "y": {"implementation": "xla", "rule": "t"},
       "z": {"implementation": "xla", "rule": "r"}}
  got = dispatch_grid.moved(a, b)
  assert got["moved"] == 2 and got["by_implementation"] == {"triton -> cudnn": 1, "= xla": 1}
  assert (got["added"], got["removed"], got["examples"]) == (1, 0, ["x", "y"])
