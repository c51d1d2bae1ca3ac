"""Which backend computes a grouped matmul: pure rules over the call and a :class:`Device`,
each decision with its reason (tests ask them of fake devices on CPU).

Every decision is the shared :class:`probjax.core.dispatch.Decision` (implementation and
rule; the grouped matmul's backends take no config). Default (``implementation=None``):

1. interpret mode: the Triton kernel, emulated (the kernels' CPU test path);
2. off the GPU: XLA (row tiles, each times its group's matrix), the only backend there;
3. a device whose table sets ``wgmma_default`` (``tuning/sm_90.json``) and a call the Mosaic
   GPU kernels compute (16-bit operands, K and N multiples of 64): Mosaic GPU, the wgmma kernels
   (the spec's H100 page: the fastest sorted MoE dispatch);
4. any other GPU call: the Triton kernel (it computes every float call but float64);
5. else XLA.

An explicit ``implementation`` that cannot compute the call raises ValueError with the reason.
Rule 3 is :func:`wgmma_default`, which the MoE expert block's dispatch
(:mod:`probjax.ops.grouped_matmul.moe_dispatch`) asks of each of its products: the sm_90 rule
is written here only, its device table read by :mod:`probjax.core.tuning`.

The GPU rules (3, 4) are not yet measured for these kernels: they follow the spec's H100 page
(the sorted dispatch on wgmma ragged-dot kernels is the fastest MoE train step) and the H200
peer anchors (``jax.lax.ragged_dot`` about ten times slower than a Mosaic ragged dot per
train step, and out of memory at 131,072 tokens); ``bench/moe.py`` measures them.
"""

from __future__ import annotations

import os

from probjax.core import tuning
from probjax.core.device import Device
from probjax.core.dispatch import REQUESTED, Decision
from probjax.ops.grouped_matmul.call import GroupedMatmulCall
from probjax.ops.grouped_matmul.registry import REGISTRY

__all__ = ["Decision", "decide", "wgmma_default"]

# The devices whose default is the wgmma kernels: ``{"wgmma_default": true}`` in their table
# (sm_90 only; the reason is rule 3's in the module's docstring).
TUNING = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tuning")


def wgmma_default(call: GroupedMatmulCall, device: Device) -> bool:
  """Rule 3, the one sm_90 rule (the MoE dispatch asks it too, of each of its products): on a
  device whose table sets ``wgmma_default`` (sm_90) the default is the Mosaic GPU wgmma kernels
  for every call they compute; never in interpret mode (no device kind)."""
  return (not device.interpret and tuning.values(TUNING, device).get("wgmma_default", False)
          and REGISTRY.get("mosaic").supports(call, device) is None)


def decide(call: GroupedMatmulCall, device: Device, implementation: str | None = None) -> Decision:
  """The backend for ``call`` on ``device``; raises ValueError when an explicit
  ``implementation`` cannot compute it."""
  name = REGISTRY.canonical(implementation)
  if name is not None:
    why = REGISTRY.get(name).supports(call, device)
    if why is not None:
      raise ValueError(f"grouped_matmul implementation={implementation!r} cannot compute this call: {why}")
    return Decision(name, REQUESTED)
  if device.interpret:
    return Decision("triton", "interpret mode: the Triton kernel, emulated")
  if device.platform != "gpu":
    return Decision("xla", f"{device.platform}: XLA (row tiles by group), the only backend off the GPU")
  if wgmma_default(call, device):
    return Decision("mosaic", f"{device.kind}, 16-bit operands, K and N multiples of 64: the wgmma kernels")
  why = REGISTRY.get("triton").supports(call, device)
  if why is None:
    return Decision("triton", f"{device.kind}: the Triton kernel"
                    + ("" if device.kind != "sm_90" else f" (Mosaic GPU: {REGISTRY.get('mosaic').supports(call, device)})"))
  return Decision("xla", f"XLA row tiles (Triton: {why})")
