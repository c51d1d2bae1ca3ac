"""Whether an op's Pallas Triton kernels run on a device: the one check every op's ``triton``
backend makes (``available``, and the float64 refusal of the kernels built on dots).

The kernels run on an NVIDIA GPU, and anywhere in Pallas interpret mode
(:meth:`probjax.core.device.Device.interpreter`). Each backend keeps the wording its users and
tests read, as a message template with ``{platform}``.
"""

from __future__ import annotations

import numpy as np

from probjax.core.device import Device

__all__ = ["NEEDS_GPU_OR_INTERPRET", "EMULATED_ANYWHERE", "unavailable", "float64_refusal"]

NEEDS_GPU_OR_INTERPRET = "Pallas Triton needs an NVIDIA GPU or interpret mode, not {platform}"
EMULATED_ANYWHERE = ("the Triton kernels need an NVIDIA GPU (platform is {platform}); "
                     "interpret=True emulates them on any platform")


def unavailable(device: Device, message: str = NEEDS_GPU_OR_INTERPRET) -> str | None:
  """None where Pallas Triton kernels run on ``device`` (a GPU, or interpret mode), else
  ``message`` with the device's platform."""
  if device.interpret or device.platform == "gpu":
    return None
  return message.format(platform=device.platform)


def float64_refusal(dtype, device: Device, operands: str = "inputs") -> str | None:
  """Why float64 ``operands`` are refused on ``device``: the Triton kernels' dots run in float64
  only in interpret mode; None for another dtype, or in interpret mode."""
  if np.dtype(dtype) == np.float64 and not device.interpret:
    return f"float64 {operands}: the Triton kernels' dots run in float64 only in interpret mode"
  return None
