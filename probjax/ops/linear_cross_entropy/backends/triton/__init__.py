"""``"triton"``: the loss as Pallas-Triton kernels (:mod:`.kernels`), the ``[tokens, vocab]``
logits never stored: a forward kernel per token tile (online log-sum-exp over vocabulary
tiles), a ``dx`` kernel per token tile and a ``dw``/``dbias`` kernel per vocabulary tile (each
looping over the other axis in order, so the sums are deterministic)."""

from __future__ import annotations

from probjax.core import pallas_triton
from probjax.core.backend import Backend
from probjax.core.device import Device
from probjax.ops.linear_cross_entropy.backends.triton import kernels
from probjax.ops.linear_cross_entropy.call import LinearCrossEntropyCall

__all__ = ["Triton", "kernels"]


class Triton(Backend[LinearCrossEntropyCall]):
  name = "triton"
  aliases = ("pallas_triton",)

  def available(self, device: Device) -> str | None:
    return pallas_triton.unavailable(device)

  def supports(self, call: LinearCrossEntropyCall, device: Device) -> str | None:
    return (self.available(device) or pallas_triton.float64_refusal(call.dtype, device, "inputs")
            or kernels.tiles_refusal(call, device))

  def tile(self, call: LinearCrossEntropyCall) -> tuple[int, int]:
    """The kernels' ``(block_t, block_v)``."""
    return kernels.blocks(call)

  def __call__(self, x, w, b, labels, *, call: LinearCrossEntropyCall):
    return kernels.per_token_loss(x, w, b, labels, call, call.interpret)
