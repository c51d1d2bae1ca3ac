"""The one reference: the grouped matmul and its gradients in float64 numpy, a loop over groups.

Every test compares against :func:`reference` (values) and :func:`reference_vjp` (gradients);
both return float64 arrays. Group sizes must be valid (non-negative, summing to at most M).
"""

from __future__ import annotations

import numpy as np


def _groups(group_sizes):
  ends = np.cumsum(np.asarray(group_sizes, np.int64))
  return zip(ends - np.asarray(group_sizes, np.int64), ends)


def _w(rhs, g, transpose_rhs):
  """Group ``g``'s ``[K, N]`` matrix."""
  return rhs[g].T if transpose_rhs else rhs[g]


def reference(lhs, rhs, group_sizes, *, transpose_rhs: bool = False):
  """``[M, N]`` float64: ``lhs[rows of g] @ rhs[g]`` per group, zero rows past the groups."""
  lhs, rhs = np.asarray(lhs, np.float64), np.asarray(rhs, np.float64)
  n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
  out = np.zeros((lhs.shape[0], n))
  for g, (s, e) in enumerate(_groups(group_sizes)):
    out[s:e] = lhs[s:e] @ _w(rhs, g, transpose_rhs)
  return out


def reference_vjp(lhs, rhs, group_sizes, d_out, *, transpose_rhs: bool = False):
  """``(d_lhs [M, K], d_rhs)`` float64 for the cotangent ``d_out [M, N]``; ``d_rhs`` has rhs's
  shape and is exactly zero for empty groups."""
  lhs, rhs, d_out = (np.asarray(x, np.float64) for x in (lhs, rhs, d_out))
  d_lhs, d_rhs = np.zeros_like(lhs), np.zeros_like(rhs)
  for g, (s, e) in enumerate(_groups(group_sizes)):
    d_lhs[s:e] = d_out[s:e] @ _w(rhs, g, transpose_rhs).T
    dw = lhs[s:e].T @ d_out[s:e]
    d_rhs[g] = dw.T if transpose_rhs else dw
  return d_lhs, d_rhs
