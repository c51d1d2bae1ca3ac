"""The grouped product itself: :func:`grouped_matmul` validates its arguments, asks the
dispatch (:func:`.dispatch.decide`) and runs the chosen backend of :data:`.registry.REGISTRY`.

The op's face (:mod:`probjax.ops.grouped_matmul.api`) exports it; it lives in its own module so
that the MoE strategies (:mod:`.strategies`), which run it, and the face, which lists them,
import in one direction.
"""

from __future__ import annotations

import jax.numpy as jnp

from probjax.core.device import Device
from probjax.core.eager import compile_once
from probjax.ops.grouped_matmul.call import GroupedMatmulCall, clamp_group_sizes, make_call
from probjax.ops.grouped_matmul.dispatch import decide
from probjax.ops.grouped_matmul.registry import REGISTRY

__all__ = ["grouped_matmul", "op_device"]


def op_device(device: Device | None, interpret: bool) -> Device:
  """The device a call is dispatched for: the interpreter's in interpret mode, else ``device``
  (default: the current one)."""
  if interpret:
    return Device.interpreter()
  return device or Device.current()


def grouped_matmul(lhs, rhs, group_sizes, *, implementation: str | None = None, preferred_element_type=None,
                   transpose_rhs: bool = False, interpret: bool = False):
  """``[M, N]`` grouped product (see :mod:`probjax.ops.grouped_matmul`).

  Args:
    lhs: ``[M, K]`` float.
    rhs: ``[G, K, N]`` float (``[G, N, K]`` when ``transpose_rhs``: read transposed, no copy).
      Both operands are promoted to their common dtype.
    group_sizes: ``[G]`` integer. Concrete sizes are checked (ValueError for a negative size
      or a sum above M; this reads them to the host); traced ones are clamped (negative sizes count as zero, groups are cut
      at row M: :func:`~probjax.ops.grouped_matmul.call.clamp_group_sizes`).
    implementation: None (the default per device, :func:`~probjax.ops.grouped_matmul.api.explain_dispatch`), ``"xla"``
      (a loop over row tiles, each multiplied by its group's matrix), ``"triton"`` (Pallas Triton) or ``"mosaic"`` (Pallas
      Mosaic GPU, sm_90, 16-bit operands, K and N multiples of 64). An explicit one that cannot
      compute the call raises ValueError with the reason.
    preferred_element_type: the output dtype (default: the operands'); products accumulate in
      float32 (float64 for float64 operands) whatever the output.
    interpret: run the Pallas kernels in interpret mode (CPU tests); the default then picks
      the Triton kernel.

  Returns:
    ``[M, N]`` in ``preferred_element_type``. Differentiable in reverse mode w.r.t. ``lhs``
    and ``rhs``; the cotangent is cast to the operands' dtype first. A call with a zero
    dimension returns zeros without running a kernel.
  """
  call = make_call(lhs, rhs, group_sizes, preferred_element_type=preferred_element_type,
                   transpose_rhs=transpose_rhs, interpret=interpret)
  device = op_device(None, interpret)
  decision = decide(call, device, implementation)
  lhs, rhs = jnp.asarray(lhs, call.dtype), jnp.asarray(rhs, call.dtype)
  if call.empty:
    return jnp.zeros((call.m, call.n), call.out_dtype)
  grad = decision.under_grad.implementation
  return _run(decision.implementation, grad, call, device, lhs, rhs, jnp.asarray(group_sizes))


@compile_once
def _run(implementation: str, grad: str, call: GroupedMatmulCall, device: Device, lhs, rhs, group_sizes):
  """The chosen backend's product of the validated call (differentiated: ``grad``'s forward and
  backward): eager calls compile it once per call description
  (:func:`probjax.core.eager.compile_once`; ``device`` is part of the description, the kernels
  fit their tiles to it)."""
  del device
  return REGISTRY.get(implementation)(lhs, rhs, clamp_group_sizes(group_sizes, call.m), call=call,
                                      grad=REGISTRY.get(grad))
