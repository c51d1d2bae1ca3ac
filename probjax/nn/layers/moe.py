"""Mixture-of-experts feed-forward layer: a router, top-k routing, experts run as grouped matmuls.

>>> import jax.numpy as jnp
>>> from flax import nnx
>>> layer = MoELayer(16, 32, 4, 2, shared_hidden=32, rngs=nnx.Rngs(0))
>>> y, aux = layer(jnp.ones((2, 5, 16)))
>>> y.shape, aux.expert_counts.shape, int(aux.expert_counts.sum())
((2, 5, 16), (4,), 20)
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import nnx

from probjax.core.device import Device
from probjax.core.dispatch import Decision
from probjax.nn.layers._checks import check_array
from probjax.nn.layers import _sharding as shd
from probjax.nn.layers.mlp import MLP
from probjax.ops.grouped_matmul import ACTIVATIONS, DISPATCHES, MoECall, explain_moe_dispatch, moe_experts
from probjax.ops.grouped_matmul.permute import sort_assignments

__all__ = ["MoELayer", "RouterAux", "Routing", "route", "resolve_dispatch", "DISPATCHES", "ROUTERS"]

ROUTERS = ("softmax", "sigmoid")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RouterAux:
  """Auxiliary outputs of the router.

  ``load_balancing_loss``: Switch/GShard ``E * sum_e f_e * P_e`` (1 when balanced), with
  ``f_e`` the fraction of the ``T * top_k`` assignments routed to expert ``e`` (before
  capacity drops; not differentiable) and ``P_e`` the mean over tokens of the router's
  distribution (softmax probabilities, or the sigmoid scores normalised per token).
  ``router_z_loss``: ST-MoE's ``mean_t logsumexp(logits_t)^2``. ``expert_counts [E]`` int32:
  assignments routed to each expert; ``dropped``: assignments over an expert's capacity.
  """

  load_balancing_loss: jax.Array
  router_z_loss: jax.Array
  expert_counts: jax.Array
  dropped: jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Routing:
  """``expert_ids [T, top_k]`` int32 (by decreasing score, ties to the lowest expert index),
  ``weights [T, top_k]`` float32 (float64 for float64 logits) combine weights (zero where
  dropped), ``keep [T, top_k]``."""

  expert_ids: jax.Array
  weights: jax.Array
  keep: jax.Array
  aux: RouterAux


def route(logits, top_k: int, *, router: str = "softmax", renormalize: bool = False,
          capacity_factor: float | None = None) -> Routing:
  """Top-k routing of ``logits [T, E]`` (computed in float32 or wider).

  ``router="softmax"``: weights are the softmax probabilities of the chosen experts;
  ``"sigmoid"``: their sigmoid scores. ``renormalize``: the chosen weights of a token are
  divided by their sum. ``capacity_factor``: each expert takes at most
  ``ceil(capacity_factor * T * top_k / E)`` assignments, the earliest tokens first (by token,
  then choice); the others are dropped (weight zero). None: dropless.
  """
  check_array("logits", logits, ("tokens", "num_experts"))
  t, e = logits.shape
  if not 1 <= top_k <= e:
    raise ValueError(f"top_k must be in [1, num_experts = {e}], got {top_k}")
  if router not in ROUTERS:
    raise ValueError(f"router must be one of {ROUTERS}, got {router!r}")
  logits = logits.astype(jnp.promote_types(logits.dtype, jnp.float32))
  if router == "softmax":
    scores = jax.nn.softmax(logits, axis=-1)
    dist = scores
  else:
    scores = jax.nn.sigmoid(logits)
    dist = scores / jnp.sum(scores, axis=-1, keepdims=True)
  # lax.top_k returns equal values lowest index first: ties go to the lowest expert index.
  weights, ids = jax.lax.top_k(scores, top_k)
  if renormalize:
    weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
  flat = ids.reshape(-1)
  counts = jnp.bincount(flat, length=e).astype(jnp.int32)
  if capacity_factor is None:
    keep = jnp.ones(ids.shape, bool)
  else:
    capacity = math.ceil(capacity_factor * t * top_k / e)
    s = sort_assignments(flat, e)
    starts = jnp.cumsum(s.group_sizes) - s.group_sizes
    rank = jnp.arange(flat.shape[0], dtype=jnp.int32) - starts[flat[s.order]]
    keep = (rank < capacity)[s.inverse].reshape(ids.shape)
    weights = jnp.where(keep, weights, 0.0)
  f = jax.lax.stop_gradient(counts.astype(logits.dtype) / flat.shape[0])
  aux = RouterAux(load_balancing_loss=e * jnp.sum(f * jnp.mean(dist, axis=0)),
                  router_z_loss=jnp.mean(jax.nn.logsumexp(logits, axis=-1) ** 2),
                  expert_counts=counts, dropped=jnp.sum(~keep).astype(jnp.int32))
  return Routing(ids.astype(jnp.int32), weights, keep, aux)


def resolve_dispatch(dispatch: str, device: Device, dtype, *, sizes: tuple[int, ...] = ()) -> tuple[str, str | None, str]:
  """``(mode, grouped-matmul implementation, reason)`` for a dispatch name on ``device``: a thin
  client of the grouped-matmul op's MoE dispatch
  (:func:`probjax.ops.grouped_matmul.explain_moe_dispatch`, whose rules are the only ones),
  its :class:`~probjax.core.dispatch.Decision` as a tuple.

  ``mode`` is ``"dense"``, ``"sorted"`` or ``"fused_gsum"`` (the decision's strategy); the
  implementation (sorted mode, the decision's ``grouped_matmul`` config) None means the
  grouped matmul's own default. ``"pallas"`` is Mosaic GPU on sm_90 for 16-bit compute when
  the Mosaic kernels compute every product (``sizes``: the matmuls' K and N), else Triton;
  ``"auto"`` is the sorted dispatch with XLA off the GPU, the Triton kernel in interpret mode,
  else ``"pallas"``.

  >>> resolve_dispatch("auto", Device("gpu", (9, 0)), jnp.bfloat16, sizes=(512, 256, 128))
  ('sorted', 'mosaic', 'sm_90, 16-bit compute: the sorted dispatch on the Mosaic GPU kernels')
  """
  return _as_tuple(explain_moe_dispatch(MoECall(jnp.dtype(dtype), sizes), dispatch, device=device))


def _as_tuple(d: Decision) -> tuple[str, str | None, str]:
  return d.implementation, d.get("grouped_matmul"), d.rule


def _expert_init(fan_in_axis: int):
  return nnx.initializers.variance_scaling(1.0, "fan_in", "truncated_normal", in_axis=fan_in_axis,
                                           out_axis=-1, batch_axis=(0,))


class MoELayer(nnx.Module):
  """``[batch, seq, d_model]`` (or ``[tokens, d_model]``) ``-> (same shape, RouterAux)``; another
  shape raises ValueError, a non-floating ``x`` TypeError, naming ``x``.

  Each token goes to its ``top_k`` experts (:func:`route`; router logits in float32 or wider), each an
  MLP ``d_model -> d_hidden -> d_model`` (SwiGLU: ``w_out (silu(x w_gate) * (x w_up))`` with
  the gate and up projections fused, ``w_in [E, d_model, 2 d_hidden]``; GELU:
  ``w_in [E, d_model, d_hidden]``; ``w_out [E, d_hidden, d_model]``); their outputs are summed
  with the routing weights, plus an always-on shared expert of width ``shared_hidden``.

  ``dispatch``: ``"dense"`` runs every expert on every token (the reference); ``"sorted"``
  sorts the ``T * top_k`` assignments by expert (gathers whose gradients are the inverse
  permutation) and runs the experts as two grouped matmuls on the grouped matmul's default;
  ``"triton"`` / ``"mosaic"`` name that grouped matmul; ``"pallas"`` is Mosaic GPU on sm_90
  for 16-bit compute, else Triton; ``"fused_gsum"`` gathers token rows inside the Triton
  kernels and scatter-sums the weighted outputs in the down projection's epilogue, so no
  ``[T * top_k, d_model]`` array exists; ``"auto"`` picks per device. The choice is the
  grouped-matmul op's (:func:`probjax.ops.grouped_matmul.explain_moe_dispatch`, which
  :meth:`explain_dispatch`, :meth:`plan` and :func:`resolve_dispatch` report), and so is the
  computation of the experts (:func:`probjax.ops.grouped_matmul.moe_experts`); the layer
  routes. ``interpret``: the Pallas kernels in interpret mode (tests).
  """

  def __init__(self, d_model: int, d_hidden: int, num_experts: int, top_k: int, *,
               shared_hidden: int | None = None, activation: str = "swiglu", router: str = "softmax",
               renormalize: bool = False, capacity_factor: float | None = None, dispatch: str = "auto",
               interpret: bool = False, dtype=None, param_dtype=jnp.float32, rngs: nnx.Rngs):
    if not 1 <= top_k <= num_experts:
      raise ValueError(f"top_k must be in [1, num_experts = {num_experts}], got {top_k}")
    if activation not in ACTIVATIONS:
      raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    if router not in ROUTERS:
      raise ValueError(f"router must be one of {ROUTERS}, got {router!r}")
    if dispatch not in DISPATCHES:
      raise ValueError(f"dispatch must be one of {DISPATCHES}, got {dispatch!r}")
    if capacity_factor is not None and not capacity_factor > 0:
      raise ValueError(f"capacity_factor must be positive or None (dropless), got {capacity_factor!r}")
    self.d_model, self.d_hidden, self.num_experts, self.top_k = d_model, d_hidden, num_experts, top_k
    self.activation, self.router_kind, self.renormalize = activation, router, renormalize
    self.capacity_factor, self.dispatch, self.interpret, self.dtype = capacity_factor, dispatch, interpret, dtype
    width = 2 * d_hidden if activation == "swiglu" else d_hidden
    self.router = nnx.Param(nnx.initializers.lecun_normal()(rngs.params(), (d_model, num_experts), param_dtype),
                            **shd.names("embed", None))
    self.w_in = nnx.Param(_expert_init(-2)(rngs.params(), (num_experts, d_model, width), param_dtype),
                          **shd.names("experts", "embed", "mlp"))
    self.w_out = nnx.Param(_expert_init(-2)(rngs.params(), (num_experts, d_hidden, d_model), param_dtype),
                           **shd.names("experts", "mlp", "embed"))
    self.shared = (MLP(features=d_model, hidden_features=shared_hidden, activation=activation, dtype=dtype,
                       param_dtype=param_dtype, rngs=rngs) if shared_hidden else None)

  def moe_call(self, dtype) -> MoECall:
    """The expert block's description for compute ``dtype``, as the grouped-matmul op's MoE
    dispatch and strategies read it."""
    return MoECall(jnp.dtype(dtype), (self.d_model, self.w_in.shape[2], self.d_hidden), self.num_experts,
                   self.top_k, self.activation, self.interpret)

  def explain_dispatch(self, dtype, device: Device | None = None) -> Decision:
    """The grouped-matmul op's decision for this layer's ``dispatch`` and compute ``dtype``
    (:func:`probjax.ops.grouped_matmul.explain_moe_dispatch`; default device: the interpreter
    under ``interpret``, else the current one)."""
    return explain_moe_dispatch(self.moe_call(dtype), self.dispatch, device=device)

  def plan(self, dtype, device: Device | None = None) -> tuple[str, str | None, str]:
    """:meth:`explain_dispatch` as :func:`resolve_dispatch`'s ``(mode, implementation,
    reason)``."""
    return _as_tuple(self.explain_dispatch(dtype, device))

  def __call__(self, x):
    width = ("d_model", self.d_model)
    check_array("x", x, [("batch", "seq", width), ("tokens", width)])
    shape = x.shape
    dtype = self.dtype or jnp.result_type(x.dtype, self.w_in.dtype)
    x2 = x.reshape(-1, self.d_model).astype(dtype)
    acc = jnp.promote_types(dtype, jnp.float32)  # router, weights and sums: float32 or wider
    logits = x2.astype(acc) @ self.router[...].astype(acc)
    r = route(logits, self.top_k, router=self.router_kind, renormalize=self.renormalize,
              capacity_factor=self.capacity_factor)
    w_in, w_out = self.w_in[...].astype(dtype), self.w_out[...].astype(dtype)
    keep = None if self.capacity_factor is None else r.keep
    y = moe_experts(x2, r.expert_ids, r.weights, keep, w_in, w_out, call=self.moe_call(dtype), dispatch=self.dispatch)
    y = y.astype(dtype).reshape(shape)
    if self.shared is not None:
      y = y + self.shared(x.astype(dtype)).astype(dtype)
    return y, r.aux
