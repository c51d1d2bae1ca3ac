"""probjax/core/tuning.py: an op's per-device values merged from its tuning/*.json."""

import json
import pathlib

import pytest

from probjax.core import tuning
from probjax.core.device import Device

OPS = pathlib.Path(__file__).resolve().parents[2] / "probjax" / "ops"


def _write(folder, name, data):
  (folder / name).write_text(json.dumps(data))


def test_the_more_specific_file_wins_and_lists_read_as_tuples(tmp_path):
  _write(tmp_path, "cpu.json", {"a": "cpu"})
  _write(tmp_path, "gpu.json", {"a": "gpu", "b": [1, [2, 3]]})
  _write(tmp_path, "sm_90.json", {"a": "sm_90"})
  folder = str(tmp_path)
  assert tuning.values(folder, Device("cpu")) == {"a": "cpu"}
  assert tuning.values(folder, Device("gpu", (9, 0))) == {"a": "sm_90", "b": (1, (2, 3))}
  assert tuning.values(folder, Device("gpu", (8, 6))) == {"a": "gpu", "b": (1, (2, 3))}
  assert tuning.values(folder, Device("tpu")) == {}


def test_a_file_that_is_not_one_object_is_refused(tmp_path):
  _write(tmp_path, "gpu.json", [1, 2])
  with pytest.raises(ValueError, match="one JSON object"):
    tuning.values(str(tmp_path), Device("gpu", (9, 0)))


@pytest.mark.parametrize("path", sorted(OPS.glob("*/tuning/*.json")), ids=lambda p: f"{p.parent.parent.name}/{p.name}")
def test_every_shipped_table_is_one_object(path):
  assert isinstance(json.loads(path.read_text()), dict)


def test_grouped_matmul_wgmma_default_is_sm_90_only():
  from probjax.ops.grouped_matmul import dispatch
  on = lambda device: tuning.values(dispatch.TUNING, device).get("wgmma_default", False)
  assert on(Device("gpu", (9, 0)))
  assert not on(Device("gpu", (8, 6))) and not on(Device("cpu"))
