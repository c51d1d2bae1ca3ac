"""What every grouped-matmul backend shares: the two products it implements and the exact
custom VJP built from them (a differentiated call may run another backend's: ``grad``).

A backend implements the forward product :meth:`GroupedMatmulBackend.gmm` (either rhs layout)
and the weight-gradient product :meth:`GroupedMatmulBackend.tgmm`, whose contracting axis is
the ragged one. The VJP needs nothing else:

* ``d_lhs = gmm(d_out, rhs)`` with rhs read in the other layout (:meth:`GroupedMatmulCall.d_lhs_call`),
  so the weights are never transposed in memory;
* ``d_rhs[g] = tgmm(lhs, d_out)[g] = lhs[rows of g]^T @ d_out[rows of g]`` (transposed back for a
  ``transpose_rhs`` call by swapping the operands), exactly zero for an empty group.

The cotangent is cast to the operands' dtype first (the products accumulate in float32); the
gradients come back in the operands' dtype.
"""

from __future__ import annotations

import abc
import functools

import jax

from probjax.core.backend import Backend
from probjax.ops.grouped_matmul.call import GroupedMatmulCall


class GroupedMatmulBackend(Backend[GroupedMatmulCall]):
  """A grouped-matmul implementation: ``gmm`` and ``tgmm``; ``__call__`` is differentiable."""

  @abc.abstractmethod
  def gmm(self, lhs, rhs, group_sizes, *, call: GroupedMatmulCall):
    """``[m, n]`` in ``call.out_dtype``: ``lhs [m, k] @ rhs[g]`` per group (rhs in ``call``'s
    layout), zero rows past the groups. Operands are in ``call.dtype``; group sizes are valid
    int32 (clamped by the caller)."""

  @abc.abstractmethod
  def tgmm(self, a, b, group_sizes, *, call: GroupedMatmulCall):
    """``[num_groups, p, q]`` in ``call.dtype``: ``a[rows of g]^T @ b[rows of g]`` for
    ``a [m, p]``, ``b [m, q]``; zero for empty groups and rows past the groups ignored."""

  def __call__(self, lhs, rhs, group_sizes, *, call: GroupedMatmulCall, grad: "GroupedMatmulBackend | None" = None):
    """The product on this backend; differentiated, ``grad`` (default: this backend) computes
    the forward with its residuals and the backward products."""
    return _grouped_matmul(self, grad or self, call, lhs, rhs, group_sizes)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _grouped_matmul(backend, grad_backend, call, lhs, rhs, group_sizes):
  del grad_backend
  return backend.gmm(lhs, rhs, group_sizes, call=call)


def _fwd(backend, grad_backend, call, lhs, rhs, group_sizes):
  del backend
  return grad_backend.gmm(lhs, rhs, group_sizes, call=call), (lhs, rhs, group_sizes)


def _bwd(_, backend, call, res, d_out):
  lhs, rhs, group_sizes = res
  d_out = d_out.astype(call.dtype)
  d_lhs = backend.gmm(d_out, rhs, group_sizes, call=call.d_lhs_call())
  if call.transpose_rhs:
    d_rhs = backend.tgmm(d_out, lhs, group_sizes, call=call)
  else:
    d_rhs = backend.tgmm(lhs, d_out, group_sizes, call=call)
  return d_lhs, d_rhs, None


_grouped_matmul.defvjp(_fwd, _bwd)

