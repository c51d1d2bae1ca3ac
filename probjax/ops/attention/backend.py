"""The base every attention backend subclasses (:class:`AttentionBackend`): the core
:class:`~probjax.core.backend.Backend` contract over one :class:`AttentionCall`, plus what lets
any backend's forward pair with any backend's backward (:mod:`probjax.ops.attention.vjp`).

A backend lives in its folder, ``probjax/ops/attention/backends/<name>/``, as a subclass in
``backend.py``, and takes part through one line of :mod:`probjax.ops.attention.registry`
(``docs/dev/adding-a-backend.md``)."""

from __future__ import annotations

from typing import Callable, ClassVar

from probjax.core.backend import Backend
from probjax.ops.attention.call import AttentionCall


class AttentionBackend(Backend[AttentionCall]):
  """An attention backend.

  ``__call__(q, k, v, mask, *, call, backward_pass_impl=None)`` computes ``call`` on
  ``q [batch, q_len, heads, d]``, ``k [batch, kv_len, kv_heads, d]``, ``v [batch, kv_len,
  kv_heads, d_v]`` and the :class:`~probjax.ops.attention.masks.Mask` (or None) into ``[batch,
  q_len, heads, d_v]``, differentiable in reverse mode; ``backward_pass_impl`` (None: the call's)
  is one of :attr:`backward_pass_impls`."""

  # The ``backward_pass_impl`` values the backend's calls take (empty: it has one backward and
  # takes none but "auto").
  backward_pass_impls: ClassVar[tuple[str, ...]] = ()
  # The backward variants it offers to other backends' forwards (:meth:`backward_kernel`).
  backward_variants: ClassVar[tuple[str, ...]] = ()

  def forward_kernel(self, q, k, v, mask, *, scale: float, score_mod: Callable | None, config,
                     interpret: bool):
    """The :class:`probjax.ops.attention.vjp.Kernel` of the backend's forward with its residuals,
    ``(out, lse [batch, heads, q_len])``, ``lse`` the natural log-sum-exp (``+inf`` for rows
    without a valid key), for these operands; backends without one raise NotImplementedError
    (context parallelism then cannot run its blocks on them)."""
    raise NotImplementedError(f"{self.name} has no forward pass with its log-sum-exp")

  def tangent_kernel(self, call: AttentionCall, exact: Callable):
    """A fused ``f(q, k, v, mask, q_dot, k_dot, v_dot) -> out_dot`` for ``call``'s tangent
    (:func:`probjax.ops.attention.autodiff.with_forward_mode`), ``exact(q, k, v, mask)`` being
    the exact XLA formulation; None where the backend has none for the call (the tangent is then
    ``exact``'s jvp)."""
    return None

  def paged_kernel(self, q, k_pages, v_pages, page_table, mask, *, call: AttentionCall):
    """The forward of a paged ``call`` (``call.page_size`` set) reading ``k_pages`` / ``v_pages``
    ``[num_pages, page_size, kv_heads, d]`` in place through ``page_table [batch, pages_per_seq]``
    (integers; ``mask`` holds the key lengths), into ``[batch, q_len, heads, d_v]``. It must read
    an entry outside the pool as :data:`probjax.ops.attention.paged.CLAMP_PAGE` and give its
    positions zero weight, as the XLA path does (:mod:`probjax.ops.attention.paged`). Forward
    only: the face differentiates the XLA gather path. Backends whose ``supports`` refuses paged
    calls never get here."""
    raise NotImplementedError(f"{self.name} reads no paged KV cache")

  def backward_kernel(self, q, k, v, *, variant: str, scale: float, score_mod: Callable | None,
                      config, interpret: bool):
    """The :class:`probjax.ops.attention.vjp.Kernel` of the backward ``variant`` (one of
    :attr:`backward_variants`) for these operands."""
    raise NotImplementedError(f"{self.name} offers no backward pass to other backends")


def call_flags(call: AttentionCall) -> dict:
  """The call's arguments that a kernel's ``supports`` reads, as keywords."""
  return dict(mask=call.mask, score_mod=call.score_mod, bias=call.bias, dense_mask=call.dense_mask,
              dropout=call.dropout, v_head_dim=call.v_head_dim)
