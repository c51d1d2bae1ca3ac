"""The grouped matmul's public face (re-exported by :mod:`probjax.ops.grouped_matmul`):

* the product: :func:`grouped_matmul`, :func:`explain_dispatch` (which backend of
  :data:`REGISTRY` runs a call, and why), :func:`available_implementations`;
* the MoE expert block built on it: :func:`moe_experts` runs the routed experts by a strategy
  of :data:`STRATEGIES`, :func:`explain_moe_dispatch` says which (and on which grouped matmul)
  for a ``dispatch`` of :data:`DISPATCHES`; :class:`~probjax.nn.layers.moe.MoELayer` asks these.

Every decision is the shared :class:`Decision` (:mod:`probjax.core.dispatch`).

>>> import jax.numpy as jnp
>>> from probjax.core.device import Device
>>> print(explain_moe_dispatch(MoECall("float32", (16, 32)), "auto", device=Device("cpu")))
sorted, grouped_matmul=xla (cpu: the sorted dispatch on the XLA grouped matmul)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from probjax.core.device import Device
from probjax.core.dispatch import Decision
from probjax.ops.grouped_matmul.activations import ACTIVATIONS
from probjax.ops.grouped_matmul.call import GroupedMatmulCall, MoECall, make_call
from probjax.ops.grouped_matmul.dispatch import decide
from probjax.ops.grouped_matmul.moe_dispatch import DISPATCHES, decide_moe
from probjax.ops.grouped_matmul.product import grouped_matmul, op_device
from probjax.ops.grouped_matmul.registry import REGISTRY
from probjax.ops.grouped_matmul.strategies import STRATEGIES

__all__ = ["grouped_matmul", "explain_dispatch", "available_implementations", "Decision",
           "GroupedMatmulCall", "make_call", "REGISTRY",
           "moe_experts", "explain_moe_dispatch", "MoECall", "STRATEGIES", "DISPATCHES", "ACTIVATIONS"]


def explain_dispatch(lhs, rhs=None, group_sizes=None, *, implementation: str | None = None,
                     preferred_element_type=None, transpose_rhs: bool = False, interpret: bool = False,
                     device: Device | None = None) -> Decision:
  """The backend :func:`grouped_matmul` runs for these arguments (arrays or
  ``jax.ShapeDtypeStruct``; ``group_sizes`` defaults to int32 ``[G]``) on ``device``
  (default: the current one), and the rule.

  ``lhs`` may instead be the call's description, a :class:`GroupedMatmulCall` (``make_call``
  builds one from the arrays; then no ``rhs``, ``group_sizes`` or flags, which it carries):

  >>> lhs = jax.ShapeDtypeStruct((512, 256), jnp.bfloat16)
  >>> rhs = jax.ShapeDtypeStruct((8, 256, 128), jnp.bfloat16)
  >>> sizes = jax.ShapeDtypeStruct((8,), jnp.int32)
  >>> gpu = Device("gpu", compute_capability=(9, 0))
  >>> explain_dispatch(make_call(lhs, rhs, sizes), device=gpu) == explain_dispatch(lhs, rhs, device=gpu)
  True"""
  if isinstance(lhs, GroupedMatmulCall):
    if any(v not in (None, False) for v in (rhs, group_sizes, preferred_element_type, transpose_rhs, interpret)):
      raise TypeError("explain_dispatch(call): the call carries rhs, group_sizes and the flags; pass only "
                      "implementation= and device=")
    return decide(lhs, op_device(device, lhs.interpret), implementation)
  if rhs is None:
    raise TypeError("explain_dispatch takes a GroupedMatmulCall or the arrays lhs and rhs")
  if group_sizes is None:
    group_sizes = jax.ShapeDtypeStruct((rhs.shape[0],), jnp.int32)
  call = make_call(lhs, rhs, group_sizes, preferred_element_type=preferred_element_type,
                   transpose_rhs=transpose_rhs, interpret=interpret)
  return decide(call, op_device(device, interpret), implementation)


def available_implementations(device: Device | None = None) -> list[str]:
  """Backend names that can run on ``device`` (default: the current one)."""
  return REGISTRY.available(device or Device.current())


def explain_moe_dispatch(call: MoECall, dispatch: str = "auto", *, device: Device | None = None) -> Decision:
  """How :func:`moe_experts` runs ``call`` under ``dispatch`` on ``device`` (default: the
  interpreter for an ``interpret`` call, else the current device): the strategy as the
  decision's implementation, the grouped matmul as its config ``grouped_matmul`` (absent: the
  grouped matmul's default), and the rule (:mod:`.moe_dispatch`). Raises ValueError for an
  unknown ``dispatch`` or a strategy that cannot run on the device."""
  if device is None:
    device = Device.interpreter() if call.interpret else Device.current()
  return decide_moe(call, device, dispatch)


def moe_experts(x, expert_ids, weights, keep, w_in, w_out, *, call: MoECall, dispatch: str = "auto"):
  """The routed experts of an MoE block: ``[T, D]``, each token's experts' outputs summed with
  its combine weights, run by the strategy :func:`explain_moe_dispatch` names.

  Args:
    x: ``[T, D]`` tokens in the compute dtype ``call.dtype``.
    expert_ids: ``[T, top_k]`` int32; ``weights``: ``[T, top_k]`` combine weights (zero where
      dropped); ``keep``: ``[T, top_k]`` bool, or None when nothing is dropped.
    w_in: ``[E, D, F]`` (``F = 2 * hidden`` for SwiGLU), ``w_out``: ``[E, hidden, D]``, in
      ``x``'s dtype.
    call: the block's description (``num_experts``, ``top_k``, ``activation``, ``interpret``).
    dispatch: one of :data:`DISPATCHES`.

  Returns:
    ``[T, D]`` in ``weights``' dtype (the dense and sorted strategies) or ``x``'s (fused).
  """
  decision = explain_moe_dispatch(call, dispatch)
  return STRATEGIES.get(decision.implementation)(x, expert_ids, weights, keep, w_in, w_out, call=call,
                                                 grouped_matmul=decision.get("grouped_matmul"))
