"""The default's decision on every call of the benchmark grid is the recorded one."""

import json

from tests.ops.attention import dispatch_grid


def test_dispatch_decisions_on_the_grid_are_unchanged():
  want = json.loads(dispatch_grid.PATH.read_text())
  got = dispatch_grid.decisions()
  assert got.keys() == want.keys()
  moved = {k: (want[k], got[k]) for k in want if want[k] != got[k]}
  assert not moved, f"{len(moved)} decisions moved, e.g. {next(iter(moved.items()))}"
