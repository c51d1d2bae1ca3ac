"""Writes tests/slow_tests.txt from a ``pytest --durations=0`` log: the node ids whose setup +
call + teardown took at least ``--min-s`` seconds.

    python -m pytest -q -n 2 -m "not slow" --durations=0 > durations.log
    python tests/slow_tests.py durations.log > tests/slow_tests.txt
"""

import argparse
import collections
import re
import sys

HEADER = """\
# Tests marked slow by tests/conftest.py: those whose setup + call took {min_s:g} s or more in
# `pytest -n 2 -m 'not slow' --durations=0` on the 2-core CI machine (one node id a line).
# They run in CI's slow step (make test-slow), so the default make test stays short.
# Regenerate: python tests/slow_tests.py DURATIONS_LOG > tests/slow_tests.txt
"""


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("log")
  p.add_argument("--min-s", type=float, default=3.0)
  args = p.parse_args(argv)
  per = collections.defaultdict(float)
  with open(args.log) as f:
    for line in f:
      m = re.match(r"([0-9.]+)s (?:call|setup|teardown)\s+(\S+)", line)
      if m:
        per[m.group(2)] += float(m.group(1))
  sys.stdout.write(HEADER.format(min_s=args.min_s))
  sys.stdout.write("".join(f"{k}\n" for k in sorted(k for k, v in per.items() if v >= args.min_s)))


if __name__ == "__main__":
  main()
