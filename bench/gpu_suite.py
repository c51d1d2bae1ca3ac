"""The GPU suite's outcome as a results row: ``tools/gpu_tests.sh``'s JUnit files (``$OUT/gpu_junit_*.xml``)
to one row of ``bench/results/<device>/gpu_suite.json`` (key: ``selection``), with every case's id,
status and seconds, so that a note's "the GPU suite passed" points at data. The recorded seconds
also order the next run (:func:`longest_first`, from ``tests/conftest.py`` under ``--gpu``).

  python -m bench.gpu_suite --junit DIR --selection full_f6f9512 --device "NVIDIA H100 80GB HBM3" \\
      --commit f6f9512 --command "WORKERS=8 bash tools/gpu_tests.sh" [--jax 0.11.2]
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import xml.etree.ElementTree as ET

from bench import harness


def cases(paths) -> list[dict]:
  """Every ``<testcase>`` of the JUnit files: ``{"id": "module::name", "status", "s"}``."""
  out = []
  for path in paths:
    for tc in ET.parse(path).getroot().iter("testcase"):
      status = "passed"
      for child, name in (("failure", "failed"), ("error", "error"), ("skipped", "skipped")):
        if tc.find(child) is not None:
          status = name
      out.append({"id": f"{tc.get('classname')}::{tc.get('name')}", "status": status,
                  "s": round(float(tc.get("time") or 0), 2)})
  return out


def wall_seconds(paths) -> float | None:
  """The sessions' elapsed time: the sum of each file's ``<testsuite time=...>`` (the kernel session and
  the benchmark session run one after the other); None where a file does not record it. The cases'
  own seconds overlap under xdist workers, so their sum is CPU-side work, not elapsed time."""
  total = 0.0
  for path in paths:
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    if not suites or any(s.get("time") is None for s in suites):
      return None
    total += sum(float(s.get("time")) for s in suites)
  return round(total, 2)


def row(paths, *, selection: str, device: str, commit: str, command: str, jax_version: str) -> dict:
  cs = cases(paths)
  count = lambda s: sum(c["status"] == s for c in cs)
  return {"suite": "gpu_suite", "selection": selection, "device": device, "jax": jax_version, "commit": commit,
          "command": command, "wall_s": wall_seconds(paths), "case_s_sum": round(sum(c["s"] for c in cs), 3),
          "passed": count("passed"),
          "failed": count("failed") + count("error"), "skipped": count("skipped"), "cases": cs}


def recorded_seconds() -> dict[str, float]:
  """``{junit id: seconds}`` from the newest ``full_*`` selection of each device's
  ``bench/results/<device>/gpu_suite.json`` (the longer where two devices have a test)."""
  out: dict[str, float] = {}
  for path in glob.glob(os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "*", "gpu_suite.json")):
    full = [r for r in map(json.loads, open(path).read().splitlines()) if str(r.get("selection")).startswith("full_")]
    for case in (full[-1].get("cases") or []) if full else []:
      out[case["id"]] = max(out.get(case["id"], 0.0), float(case.get("s") or 0.0))
  return out


def longest_first(items, seconds: dict[str, float]):
  """``items`` sorted by their recorded ``seconds`` (junit ids: ``tests/a/b.py::C::t[x]`` is
  ``tests.a.b.C::t[x]``), longest first; items without a record first of all, in their order."""
  def junit(nodeid):
    *where, name = nodeid.split("::")
    return ".".join([where[0].removesuffix(".py").replace("/", "."), *where[1:]]) + "::" + name
  return sorted(items, key=lambda it: -seconds.get(junit(it.nodeid), float("inf")))


def main(argv=None) -> dict:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--junit", required=True, help="the folder of gpu_junit_*.xml")
  p.add_argument("--selection", required=True)
  p.add_argument("--device", required=True)
  p.add_argument("--commit", required=True)
  p.add_argument("--command", required=True)
  p.add_argument("--jax", default="0.11.2")
  p.add_argument("--output", help="default: bench/results/<device>/gpu_suite.json")
  a = p.parse_args(argv)
  paths = sorted(glob.glob(os.path.join(a.junit, "gpu_junit_*.xml")))
  if not paths:
    raise SystemExit(f"no gpu_junit_*.xml in {a.junit}")
  r = row(paths, selection=a.selection, device=a.device, commit=a.commit, command=a.command, jax_version=a.jax)
  out = a.output or os.path.join(harness.RESULTS_DIR, harness.device_slug(a.device), "gpu_suite.json")
  _append(out, r)
  print(f"{out}: {a.selection}: {r['passed']} passed, {r['failed']} failed, {r['skipped']} skipped")
  return r


def _append(path: str, r: dict) -> None:
  os.makedirs(os.path.dirname(path), exist_ok=True)
  with open(path, "a") as f:
    f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
  main()
