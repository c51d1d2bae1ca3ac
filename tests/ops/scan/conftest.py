"""Fixtures of the scan tests."""

import pytest

from probjax.core.device import Device
from probjax.testing import pretend_h200, verify_triton_lowering


@pytest.fixture
def fake_h200(monkeypatch):
  """The process looks like an H200 (sm_90, 140 GiB) to the dispatch and to Pallas' lowering,
  which verifies the Triton IR it emits: a kernel lowers for the GPU on a CPU machine."""
  pretend_h200(monkeypatch)
  monkeypatch.setattr(Device, "current", classmethod(lambda cls: Device("gpu", (9, 0), 140 << 30)))
  verify_triton_lowering(monkeypatch)
