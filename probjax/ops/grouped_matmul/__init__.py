"""Grouped matmul: ``out[i] = lhs[i] @ rhs[g]`` for the rows ``i`` of group ``g``.

``lhs [M, K]``, ``rhs [G, K, N]`` (``[G, N, K]`` with ``transpose_rhs``), ``group_sizes [G]``
integer: group ``g`` owns the ``group_sizes[g]`` consecutive rows after those of the groups
before it; rows past ``sum(group_sizes)`` give zero output and zero ``lhs`` gradient. Both
gradients are exact (:mod:`.base`); an empty group's weight gradient is exactly zero.

>>> import jax, jax.numpy as jnp
>>> from probjax.ops.grouped_matmul import grouped_matmul
>>> lhs = jnp.ones((5, 3)); rhs = jnp.stack([jnp.eye(3), 2 * jnp.eye(3)])
>>> grouped_matmul(lhs, rhs, jnp.array([2, 2], jnp.int32))[:, 0].tolist()
[1.0, 1.0, 2.0, 2.0, 0.0]
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from probjax.core.device import Device
from probjax.core.eager import compile_once
from probjax.ops.grouped_matmul.call import GroupedMatmulCall, clamp_group_sizes, make_call
from probjax.ops.grouped_matmul.dispatch import Decision, decide
from probjax.ops.grouped_matmul.registry import REGISTRY

__all__ = ["grouped_matmul", "explain_dispatch", "available_implementations", "Decision",
           "GroupedMatmulCall", "REGISTRY"]


def _device(device: Device | None, interpret: bool) -> Device:
  if interpret:
    return Device.interpreter()
  return device or Device.current()


def explain_dispatch(lhs, rhs, group_sizes=None, *, implementation: str | None = None,
                     preferred_element_type=None, transpose_rhs: bool = False, interpret: bool = False,
                     device: Device | None = None) -> Decision:
  """The backend :func:`grouped_matmul` runs for these arguments (arrays or
  ``jax.ShapeDtypeStruct``; ``group_sizes`` defaults to int32 ``[G]``) on ``device``
  (default: the current one), and the rule."""
  if group_sizes is None:
    group_sizes = jax.ShapeDtypeStruct((rhs.shape[0],), jnp.int32)
  call = make_call(lhs, rhs, group_sizes, preferred_element_type=preferred_element_type,
                   transpose_rhs=transpose_rhs, interpret=interpret)
  return decide(call, _device(device, interpret), implementation)


def available_implementations(device: Device | None = None) -> list[str]:
  """Backend names that can run on ``device`` (default: the current one)."""
  return REGISTRY.available(device or Device.current())


def grouped_matmul(lhs, rhs, group_sizes, *, implementation: str | None = None, preferred_element_type=None,
                   transpose_rhs: bool = False, interpret: bool = False):
  """``[M, N]`` grouped product (see the module docstring).

  Args:
    lhs: ``[M, K]`` float.
    rhs: ``[G, K, N]`` float (``[G, N, K]`` when ``transpose_rhs``: read transposed, no copy).
      Both operands are promoted to their common dtype.
    group_sizes: ``[G]`` integer. Concrete sizes are checked (ValueError for a negative size
      or a sum above M; this reads them to the host); traced ones are clamped (negative sizes count as zero, groups are cut
      at row M: :func:`~probjax.ops.grouped_matmul.call.clamp_group_sizes`).
    implementation: None (the default per device, :func:`explain_dispatch`), ``"xla"``
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
  device = _device(None, interpret)
  decision = decide(call, device, implementation)
  lhs, rhs = jnp.asarray(lhs, call.dtype), jnp.asarray(rhs, call.dtype)
  if call.empty:
    return jnp.zeros((call.m, call.n), call.out_dtype)
  return _run(decision.implementation, call, device, lhs, rhs, jnp.asarray(group_sizes))


@compile_once
def _run(implementation: str, call: GroupedMatmulCall, device: Device, lhs, rhs, group_sizes):
  """The chosen backend's product of the validated call: eager calls compile it once per call
  description (:func:`probjax.core.eager.compile_once`; ``device`` is part of the description,
  the kernels fit their tiles to it)."""
  del device
  return REGISTRY.get(implementation)(lhs, rhs, clamp_group_sizes(group_sizes, call.m), call=call)
