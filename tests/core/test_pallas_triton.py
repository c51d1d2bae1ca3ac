"""probjax.core.pallas_triton: the one check of whether an op's Pallas Triton kernels run on a
device, and the float64 refusal, as every op's triton backend reports them."""

import jax.numpy as jnp
import numpy as np
import pytest

from probjax.core import pallas_triton
from probjax.core.device import Device

H200 = Device("gpu", (9, 0), 140 << 30)


@pytest.mark.parametrize("device", [H200, Device("gpu", (8, 6), 24 << 30), Device("gpu"), Device.interpreter()])
def test_available_on_a_gpu_and_in_interpret_mode(device):
  assert pallas_triton.unavailable(device) is None
  assert pallas_triton.unavailable(device, pallas_triton.EMULATED_ANYWHERE) is None


@pytest.mark.parametrize("platform", ["cpu", "tpu"])
def test_unavailable_elsewhere_names_the_platform(platform):
  device = Device(platform)
  assert pallas_triton.unavailable(device) == f"Pallas Triton needs an NVIDIA GPU or interpret mode, not {platform}"
  assert pallas_triton.unavailable(device, pallas_triton.EMULATED_ANYWHERE) == (
      f"the Triton kernels need an NVIDIA GPU (platform is {platform}); interpret=True emulates them on any platform")
  assert pallas_triton.unavailable(device, "no {platform} here") == f"no {platform} here"
  assert pallas_triton.unavailable(Device(platform, interpret=True)) is None


def test_float64_only_in_interpret_mode():
  why = pallas_triton.float64_refusal(np.float64, H200, "operands")
  assert why == "float64 operands: the Triton kernels' dots run in float64 only in interpret mode"
  assert pallas_triton.float64_refusal(jnp.float64, H200).startswith("float64 inputs: ")
  assert pallas_triton.float64_refusal(np.float64, Device.interpreter()) is None
  for dtype in (jnp.float32, jnp.bfloat16, np.float16):
    assert pallas_triton.float64_refusal(dtype, H200) is None

