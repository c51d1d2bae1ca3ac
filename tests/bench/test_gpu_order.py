"""bench.gpu_suite.longest_first: the order of a --gpu run (recorded seconds, longest first)."""

import types

from bench import gpu_suite


def test_longest_first_puts_unrecorded_tests_first_then_the_longest():
  items = [types.SimpleNamespace(nodeid=n) for n in (
      "tests/ops/a.py::test_short", "tests/ops/a.py::test_new", "tests/b.py::test_long[x-1]",
      "tests/b.py::TestK::test_mid")]
  seconds = {"tests.ops.a::test_short": 1.0, "tests.b::test_long[x-1]": 30.0, "tests.b.TestK::test_mid": 5.0}
  assert [it.nodeid for it in gpu_suite.longest_first(items, seconds)] == [
      "tests/ops/a.py::test_new", "tests/b.py::test_long[x-1]", "tests/b.py::TestK::test_mid",
      "tests/ops/a.py::test_short"]


def test_recorded_seconds_come_from_the_full_suites():
  seconds = gpu_suite.recorded_seconds()
  assert seconds and all(k.startswith("tests.") and "::" in k and v >= 0 for k, v in seconds.items())
