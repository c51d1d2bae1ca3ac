"""tools/gpu_tests.sh caps its xdist workers by the GPU's memory (GPU_GIB_PER_WORKER a worker),
so that a worker count sized for one card does not run another out of memory. Run on CPU with
stand-ins for ``nvidia-smi`` (the card's memory) and ``python`` (records its arguments)."""

import os
import pathlib
import stat
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _stub(path: pathlib.Path, body: str) -> None:
  path.write_text("#!/usr/bin/env bash\n" + body)
  path.chmod(path.stat().st_mode | stat.S_IXUSR)


def _pytest_calls(tmp_path, mib, **env):
  bin_dir = tmp_path / "bin"
  bin_dir.mkdir()
  log = tmp_path / "calls.txt"
  _stub(bin_dir / "nvidia-smi", f"echo {mib}\n" if mib is not None else "exit 9\n")
  # the script asks python whether pytest and xdist import (yes), then runs pytest twice
  _stub(bin_dir / "python", f'[ "$1" = -c ] && exit 0\necho "$*" >> {log}\n')
  full = {**os.environ, "PATH": f"{bin_dir}:/usr/bin:/bin", **env}
  full.pop("OUT", None)
  out = subprocess.run(["bash", str(ROOT / "tools" / "gpu_tests.sh")], env=full, capture_output=True, text=True,
                       check=True)
  return log.read_text().splitlines(), out.stderr


@pytest.mark.parametrize("mib,asked,want", [(81559, 14, 7), (143771, 14, 14), (143771, 6, 6), (8192, 4, 1)],
                         ids=["h100_capped", "h200_fits", "fewer_asked", "small_card_one"])
def test_workers_are_capped_by_the_cards_memory(tmp_path, mib, asked, want):
  calls, err = _pytest_calls(tmp_path, mib, WORKERS=str(asked))
  kernels = calls[0].split()
  if want > 1:
    assert kernels[kernels.index("-n") + 1] == str(want)
  else:
    assert "-n" not in kernels
  assert ("fit" in err) == (want < asked)


def test_without_nvidia_smi_the_asked_count_stands(tmp_path):
  calls, _ = _pytest_calls(tmp_path, None, WORKERS="5")
  kernels = calls[0].split()
  assert kernels[kernels.index("-n") + 1] == "5"
