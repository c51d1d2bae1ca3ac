"""``"triton"``: the loss as Pallas-Triton kernels (:mod:`.kernels`), the ``[tokens, vocab]``
logits never stored: a forward kernel per token tile (online log-sum-exp over vocabulary
tiles), a ``dx`` kernel per token tile and a ``dw``/``dbias`` kernel per vocabulary tile (each
looping over the other axis in order, so the sums are deterministic)."""

from __future__ import annotations

import numpy as np

from probjax.core.backend import Backend
from probjax.core.device import Device
from probjax.ops.linear_cross_entropy.backends.triton import kernels
from probjax.ops.linear_cross_entropy.call import LinearCrossEntropyCall

__all__ = ["Triton", "kernels"]


class Triton(Backend[LinearCrossEntropyCall]):
  name = "triton"
  aliases = ("pallas_triton",)

  def available(self, device: Device) -> str | None:
    if device.interpret or device.platform == "gpu":
      return None
    return f"Pallas Triton needs an NVIDIA GPU or interpret mode, not {device.platform}"

  def supports(self, call: LinearCrossEntropyCall, device: Device) -> str | None:
    if (why := self.available(device)) is not None:
      return why
    if np.dtype(call.dtype) == np.float64 and not device.interpret:
      return "float64 inputs: the Triton kernels' dots run in float64 only in interpret mode"
    return None

  def tile(self, call: LinearCrossEntropyCall) -> tuple[int, int]:
    """The kernels' ``(block_t, block_v)``."""
    return kernels.blocks(call)

  def __call__(self, x, w, b, labels, *, call: LinearCrossEntropyCall):
    return kernels.per_token_loss(x, w, b, labels, call, call.interpret)
