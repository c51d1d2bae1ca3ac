"""Which backend computes a grouped matmul: pure rules over the call and a :class:`Device`,
each decision with its reason (tests ask them of fake devices on CPU).

Every decision is the shared :class:`probjax.core.dispatch.Decision` (implementation and
rule, and ``grad``, what a differentiated call runs, where that differs; the grouped matmul's
backends take no config). Default (``implementation=None``):

1. interpret mode: the Triton kernel, emulated (the kernels' CPU test path);
2. off the GPU: XLA (row tiles, each times its group's matrix), the only backend there;
3. a device whose table sets ``wgmma_default`` (``tuning/sm_90.json``) and a call the Mosaic
   GPU kernels compute (16-bit operands, K and N multiples of 64): the Triton kernel, and
   differentiated from the table's ``wgmma_grad_from`` sizes (K and M) the Mosaic GPU wgmma
   kernels for the forward and both backward products (:func:`sm90_default`);
4. any other GPU call: the Triton kernel (it computes every float call but float64);
5. else XLA.

An explicit ``implementation`` that cannot compute the call raises ValueError with the reason
(and runs the call differentiated too). The MoE expert block's dispatch
(:mod:`probjax.ops.grouped_matmul.moe_dispatch`) asks :func:`wgmma_default` of each of its
products: on sm_90 it runs the whole sorted block on the wgmma kernels.
"""

from __future__ import annotations

import os

from probjax.core import tuning
from probjax.core.device import Device
from probjax.core.dispatch import REQUESTED, Decision
from probjax.ops.grouped_matmul.call import GroupedMatmulCall
from probjax.ops.grouped_matmul.registry import REGISTRY

__all__ = ["Decision", "decide", "sm90_default", "wgmma_default"]

# The devices whose default is the wgmma kernels: ``{"wgmma_default": true}`` in their table
# (sm_90 only; the reason is rule 3's in the module's docstring). "wgmma_grad_from":
# ``{"k": K, "m": M}``, the sizes from which a plain differentiated call runs the wgmma
# kernels; below them, and undifferentiated, the Triton kernel. E.g. a forward product of
# [1480, 8192] x [64, 8192, 2048] runs Triton, as does a differentiated one over 41 rows at
# K 7168; a differentiated [27596, 7168] x [8, 7168, 4096] runs the wgmma kernels: its weight
# gradient, K x N per group contracted over every row, dominates the call, and the wgmma
# kernels are ahead there (docs/dev/decisions.md, "The grouped matmul on sm_90").
TUNING = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tuning")


def wgmma_default(call: GroupedMatmulCall, device: Device) -> bool:
  """Whether ``call`` is one the wgmma kernels compute on a device whose table sets
  ``wgmma_default`` (sm_90); never in interpret mode (no device kind). The MoE dispatch asks it
  of each of its products; a plain call asks :func:`sm90_default` which of the two kernels."""
  return (not device.interpret and tuning.values(TUNING, device).get("wgmma_default", False)
          and REGISTRY.get("mosaic").supports(call, device) is None)


def sm90_default(call: GroupedMatmulCall, device: Device) -> Decision:
  """Rule 3: the Triton kernel, differentiated the wgmma kernels from ``wgmma_grad_from``'s
  sizes; the wgmma kernels throughout where the Triton kernel cannot take the call or the table
  has no ``wgmma_grad_from``."""
  wgmma = f"{device.kind}, 16-bit operands, K and N multiples of 64: the wgmma kernels"
  grad_from = tuning.values(TUNING, device).get("wgmma_grad_from")
  if grad_from is None or REGISTRY.get("triton").supports(call, device) is not None:
    return Decision("mosaic", wgmma)
  k, m = grad_from["k"], grad_from["m"]
  if call.k >= k and call.m >= m:
    return Decision("triton", f"{device.kind}: the Triton kernel, ahead of the wgmma kernels on the forward product",
                    grad=Decision("mosaic", f"{wgmma}, forward and backward: differentiated at K {call.k} >= {k} "
                                            f"over M {call.m} >= {m} rows, where the weight gradient dominates"))
  return Decision("triton", f"{device.kind}: the Triton kernel, ahead of the wgmma kernels on the forward product "
                            f"and, differentiated, below K {k} or M {m}")


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
    return sm90_default(call, device)
  why = REGISTRY.get("triton").supports(call, device)
  if why is None:
    return Decision("triton", f"{device.kind}: the Triton kernel"
                    + ("" if device.kind != "sm_90" else f" (Mosaic GPU: {REGISTRY.get('mosaic').supports(call, device)})"))
  return Decision("xla", f"XLA row tiles (Triton: {why})")
