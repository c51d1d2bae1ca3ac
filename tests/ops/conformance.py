"""What every op's conformance suite shares: its case grid turned into pytest parameters.

Each op has one suite, ``tests/ops/<op>/conformance.py``, a class of ``test_<name>(self, case)``
methods subclassed once per backend. The suite lists each test's cases in :meth:`Conformance._grid`
(``[(id, case)]``); a backend's subclass picks among them by ``fnmatch`` patterns on
``"test_<name>[<id>]"``: ``slow_cases`` are marked slow unless they also match ``fast_cases``,
``thorough_cases`` (slow cases repeating others at more sizes) are marked thorough (and so slow),
``left_out`` cases are not generated at all. Kernel backends in interpret mode compile every
case anew (seconds of CPU each): their subclasses keep the smallest case of each code path fast.
"""

from __future__ import annotations

import fnmatch

import pytest

SLOW = pytest.mark.slow
THOROUGH = pytest.mark.thorough


class Conformance:
  """The case selection of an op's suite; the suite defines :meth:`_grid`."""

  slow_cases: frozenset = frozenset()
  fast_cases: frozenset = frozenset()
  thorough_cases: frozenset = frozenset()
  left_out: frozenset = frozenset()

  def _grid(self, test: str):
    """``[(id, case)]`` of ``test`` (before the slow and left-out patterns); None: not a case grid."""
    return None

  def pytest_generate_tests(self, metafunc):
    test = metafunc.function.__name__
    grid = self._grid(test)
    if grid is None:
      return
    # Brackets in a pattern are literal (the id's), "*" and "?" wildcards.
    literal = lambda p: p.replace("[", "\0").replace("]", "[]]").replace("\0", "[[]")
    match = lambda pats, cid: any(fnmatch.fnmatchcase(f"{test}[{cid}]", literal(p)) for p in pats)
    marks = lambda cid: ((SLOW,) if match(self.slow_cases, cid) and not match(self.fast_cases, cid) else ()) + (
        (THOROUGH,) if match(self.thorough_cases, cid) else ())
    params = [pytest.param(case, id=cid, marks=marks(cid)) for cid, case in grid if not match(self.left_out, cid)]
    metafunc.parametrize("case", params)
