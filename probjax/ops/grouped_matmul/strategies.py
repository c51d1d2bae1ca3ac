"""The MoE expert block's strategies: the ways the routed experts of an MoE layer run, registered
in :data:`STRATEGIES` (the names :func:`.moe_dispatch.decide_moe` chooses among).

Each takes the tokens ``x [T, D]``, the routing (``expert_ids [T, top_k]`` int32, combine
``weights [T, top_k]``, ``keep [T, top_k]`` bool or None for dropless) and the experts'
weights ``w_in [E, D, F]``, ``w_out [E, hidden, D]`` in ``x``'s dtype, and returns the
weighted sum of each token's experts ``[T, D]``:

* ``"dense"``: every expert on every token (the reference), one-hot combine weights;
* ``"sorted"``: the ``T * top_k`` assignments sorted by expert (gathers whose gradients are the
  inverse permutation, :mod:`.permute`), the experts as two grouped matmuls
  (:func:`.product.grouped_matmul`, on the implementation the decision names, or its default);
* ``"fused_gsum"``: token rows gathered inside the Triton kernels and the weighted outputs
  scatter-summed in the down projection's epilogue (:mod:`.fused`): no ``[T * top_k, D]``
  array exists. It runs the Triton backend's kernels, so it runs where they do.

Strategies are not backends of the grouped matmul (:data:`.registry.REGISTRY`): they compose
its products with the routing, and none imports another.
"""

from __future__ import annotations

import abc

import jax
import jax.numpy as jnp

from probjax.core.backend import Backend, Registry
from probjax.core.device import Device
from probjax.ops.grouped_matmul.activations import activate
from probjax.ops.grouped_matmul.call import MoECall
from probjax.ops.grouped_matmul.fused import fused_experts
from probjax.ops.grouped_matmul.permute import expand_sorted, permute_rows, sort_assignments
from probjax.ops.grouped_matmul.product import grouped_matmul as _grouped_matmul
from probjax.ops.grouped_matmul.registry import REGISTRY

__all__ = ["ExpertsStrategy", "DenseExperts", "SortedExperts", "FusedGsumExperts", "STRATEGIES"]


class ExpertsStrategy(Backend[MoECall]):
  """One way to run the MoE expert block (see the module docstring)."""

  def supports(self, call: MoECall, device: Device) -> str | None:
    return self.available(device)

  @abc.abstractmethod
  def __call__(self, x, expert_ids, weights, keep, w_in, w_out, *, call: MoECall,
               grouped_matmul: str | None = None):
    """``[T, D]``: the experts' outputs summed with ``weights`` (in ``weights``' dtype for
    the dense and sorted strategies, ``x``'s for the fused one). ``grouped_matmul``: the
    grouped matmul's implementation (the decision's config; None: its default)."""


def _sorted_assignments(expert_ids, keep, call: MoECall):
  return sort_assignments(expert_ids.reshape(-1), call.num_experts, None if keep is None else keep.reshape(-1))


class DenseExperts(ExpertsStrategy):
  name = "dense"

  def __call__(self, x, expert_ids, weights, keep, w_in, w_out, *, call: MoECall, grouped_matmul=None):
    # Outputs in the compute dtype (XLA accumulates 16-bit products in float32), as the
    # grouped matmuls round theirs.
    hp = jnp.einsum("td,edf->tef", x, w_in)
    h = activate(hp, call.activation).astype(x.dtype)
    ye = jnp.einsum("teh,ehd->ted", h, w_out)
    dense_w = jnp.einsum("tke,tk->te", jax.nn.one_hot(expert_ids, call.num_experts, dtype=weights.dtype), weights)
    return jnp.einsum("te,ted->td", dense_w, ye.astype(weights.dtype))


class SortedExperts(ExpertsStrategy):
  name = "sorted"

  def __call__(self, x, expert_ids, weights, keep, w_in, w_out, *, call: MoECall, grouped_matmul=None):
    s = _sorted_assignments(expert_ids, keep, call)
    kw = dict(implementation=grouped_matmul, interpret=call.interpret)
    hp = _grouped_matmul(expand_sorted(x, s, call.top_k), w_in, s.group_sizes, **kw)
    h = activate(hp, call.activation).astype(x.dtype)
    ys = _grouped_matmul(h, w_out, s.group_sizes, **kw)
    yk = permute_rows(ys, s.inverse, s.order).reshape(-1, call.top_k, x.shape[-1])
    return jnp.einsum("tkd,tk->td", yk.astype(weights.dtype), weights)


class FusedGsumExperts(ExpertsStrategy):
  name = "fused_gsum"

  def available(self, device: Device) -> str | None:
    if (why := REGISTRY.get("triton").available(device)) is not None:
      return f"runs Triton kernels: {why}"
    return None

  def __call__(self, x, expert_ids, weights, keep, w_in, w_out, *, call: MoECall, grouped_matmul=None):
    s = _sorted_assignments(expert_ids, keep, call)
    row_w = permute_rows(weights.reshape(-1), s.order, s.inverse)
    return fused_experts(x, s.order // call.top_k, row_w, s.group_sizes, w_in, w_out,
                         activation=call.activation, interpret=call.interpret)


STRATEGIES: Registry[MoECall] = Registry("moe_dispatch")
STRATEGIES.register(DenseExperts())
STRATEGIES.register(SortedExperts())
STRATEGIES.register(FusedGsumExperts())
