"""Tolerances, one place for every test and check.

Errors are measured as ``max|x - ref| / max(1, max|ref|)`` against the float64
reference. Per input dtype (and, for float32 inputs on GPU, whether the
matmuls run as TF32), outputs and gradients have their own bound. A check may
instead scale by a same-precision reference's own error
(:func:`scaled_tolerance`), as FlashAttention's tests do.
"""

from __future__ import annotations

import numpy as np

# (forward, gradient) bounds on the normalised max error.
_TOL = {
    "float64": (1e-9, 1e-8),
    "float32": (2e-5, 1e-4),
    "tf32": (5e-3, 2e-2),
    "bfloat16": (2e-2, 6e-2),
    "float16": (4e-3, 1e-2),
}


def tolerance(dtype, *, grad: bool = False, tf32: bool = False) -> float:
  """Bound for :func:`max_error` of an implementation computing in ``dtype``."""
  name = np.dtype(dtype).name if not isinstance(dtype, str) else dtype
  if tf32 and name == "float32":
    name = "tf32"
  if name not in _TOL:
    raise ValueError(f"no tolerance for dtype {name!r}; known: {sorted(_TOL)}")
  return _TOL[name][1 if grad else 0]


def max_error(x, ref) -> float:
  """``max|x - ref| / max(1, max|ref|)`` in float64; NaN or inf anywhere gives inf."""
  x = np.asarray(x, np.float64)
  ref = np.asarray(ref, np.float64)
  if x.shape != ref.shape:
    raise ValueError(f"shape mismatch: {x.shape} vs reference {ref.shape}")
  if not np.all(np.isfinite(x)):
    return float("inf")
  if x.size == 0:
    return 0.0
  return float(np.max(np.abs(x - ref)) / max(1.0, float(np.max(np.abs(ref)))))


def scaled_tolerance(same_precision_error: float, dtype, *, factor: float = 2.0, grad: bool = False) -> float:
  """FlashAttention-style bound: ``factor`` × a same-precision reference's own error,
  floored at a tenth of the dtype's fixed bound."""
  return max(factor * same_precision_error, 0.1 * tolerance(dtype, grad=grad))
