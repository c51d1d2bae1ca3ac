"""How an MoE expert block runs: pure rules over its call (:class:`.call.MoECall`) and a
:class:`Device`, returning the shared :class:`probjax.core.dispatch.Decision`.

The decision names a strategy of :data:`.strategies.STRATEGIES` (``"dense"``, ``"sorted"`` or
``"fused_gsum"``) and, for the sorted strategy, the grouped matmul's implementation as the
config ``grouped_matmul`` (absent: the grouped matmul's own default). ``dispatch`` (one of
:data:`DISPATCHES`):

* ``"dense"``, ``"sorted"``: that strategy (``rule="requested"``);
* ``"fused_gsum"``: the fused gather-sum strategy, where it runs (ValueError with its
  ``supports`` reason otherwise);
* ``"triton"``, ``"mosaic"``: the sorted strategy on that grouped matmul;
* ``"auto"``: in interpret mode the sorted strategy on the Triton kernel; off the GPU on the
  XLA grouped matmul; on a GPU as ``"pallas"``;
* ``"pallas"``: the sorted strategy on Mosaic GPU where the grouped matmul's sm_90 rule
  (:func:`.dispatch.wgmma_default`) takes every product of the block (16-bit compute, every
  size a multiple of 64), else on Triton.

>>> from probjax.core.device import Device
>>> from probjax.ops.grouped_matmul.call import MoECall
>>> print(decide_moe(MoECall("bfloat16", (512, 256, 128)), Device("gpu", (9, 0)), "auto"))
sorted, grouped_matmul=mosaic (sm_90, 16-bit compute: the sorted dispatch on the Mosaic GPU kernels)
"""

from __future__ import annotations

import numpy as np

from probjax.core.device import Device
from probjax.core.dispatch import REQUESTED, Decision
from probjax.ops.grouped_matmul.call import MoECall
from probjax.ops.grouped_matmul.dispatch import wgmma_default
from probjax.ops.grouped_matmul.strategies import STRATEGIES

__all__ = ["DISPATCHES", "decide_moe"]

DISPATCHES = ("auto", "dense", "sorted", "fused_gsum", "triton", "pallas", "mosaic")


def _sorted(implementation: str | None, rule: str) -> Decision:
  config = () if implementation is None else (("grouped_matmul", implementation),)
  return Decision("sorted", rule, config)


def decide_moe(call: MoECall, device: Device, dispatch: str = "auto") -> Decision:
  """The strategy (and grouped matmul) for ``call`` on ``device`` under ``dispatch``; raises
  ValueError for an unknown ``dispatch`` or a strategy that cannot run on ``device``."""
  if dispatch not in DISPATCHES:
    raise ValueError(f"dispatch must be one of {DISPATCHES}, got {dispatch!r}")
  if dispatch in STRATEGIES.names():
    if (why := STRATEGIES.get(dispatch).supports(call, device)) is not None:
      raise ValueError(f"dispatch={dispatch!r} {why}")
    return Decision(dispatch, REQUESTED)
  if dispatch in ("triton", "mosaic"):
    return _sorted(dispatch, REQUESTED)
  if dispatch == "auto":
    if device.interpret:
      return _sorted("triton", "interpret mode: the sorted dispatch on the Triton kernel")
    if device.platform != "gpu":
      return _sorted("xla", f"{device.platform}: the sorted dispatch on the XLA grouped matmul")
  if all(wgmma_default(p, device) for p in call.products()):
    return _sorted("mosaic", "sm_90, 16-bit compute: the sorted dispatch on the Mosaic GPU kernels")
  why = "not sm_90" if device.kind != "sm_90" else ("32-bit compute" if not _sixteen(call) else "sizes off 64")
  return _sorted("triton", f"the sorted dispatch on the Triton kernel ({why})")


def _sixteen(call: MoECall) -> bool:
  """Only for the reason's words: the choice above is the grouped matmul's rule."""
  return np.dtype(call.dtype).itemsize == 2
