"""A new user's first minutes on a CPU machine: ``pip install`` of the built wheel into a fresh
venv (no pip cache, dependencies from the package index) and the README's quick start run
verbatim, each timed once (one row: install_s, quick_start_s, total_s, the goal 120 s and
goal_met, status "ok" when both ran, and the
host's 1-minute load average: other work on the machine slows both).

  python -m bench.quickstart --output bench/results/cpu/quickstart.json

The wheel is built first (``pip wheel --no-deps .``, not timed); the row carries the device,
versions, commit and command. Needs pip access; takes a minute or two.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
GOAL_S = 120.0


def quick_start_code(readme: str) -> str:
  """The README's first python block under ``## Quick start``."""
  section = readme.split("## Quick start", 1)[1].split("\n## ", 1)[0]
  return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--output", default=str(ROOT / "bench/results/cpu/quickstart.json"))
  args = p.parse_args(argv)
  run = lambda *cmd, **kw: subprocess.run(cmd, check=True, **kw)
  with tempfile.TemporaryDirectory() as work:
    work = pathlib.Path(work)
    print("[quickstart] building the wheel", flush=True)
    run(sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(work / "dist"), str(ROOT),
        stdout=subprocess.DEVNULL)
    wheel = next((work / "dist").glob("probjax_attention-*.whl"))
    run(sys.executable, "-m", "venv", str(work / "venv"))
    py = str(work / "venv/bin/python")
    (work / "quick_start.py").write_text(quick_start_code((ROOT / "README.md").read_text()))
    print("[quickstart] timing pip install and the quick start", flush=True)
    t0 = time.perf_counter()
    run(py, "-m", "pip", "install", "-q", "--no-cache-dir", str(wheel), stderr=subprocess.DEVNULL)
    t1 = time.perf_counter()
    run(py, str(work / "quick_start.py"), cwd=work, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    t2 = time.perf_counter()
  from probjax.core.timing import device_info  # noqa: E402 (after the timed part)
  row = {"suite": "quickstart", "install_s": round(t1 - t0, 1), "quick_start_s": round(t2 - t1, 1),
         "total_s": round(t2 - t0, 1), "goal_s": GOAL_S,
         "goal_met": t2 - t0 <= GOAL_S, "status": "ok", **device_info(),
         "loadavg_1m": round(os.getloadavg()[0], 2),
         "command": "python -m bench.quickstart " + " ".join(sys.argv[1:]),
         "time": time.strftime("%Y-%m-%dT%H:%M:%S")}
  out = pathlib.Path(args.output)
  out.parent.mkdir(parents=True, exist_ok=True)
  out.write_text(json.dumps(row) + "\n")
  print(f"[quickstart] install {row['install_s']} s, quick start {row['quick_start_s']} s, "
        f"total {row['total_s']} s (goal {GOAL_S:.0f} s) -> {out}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
