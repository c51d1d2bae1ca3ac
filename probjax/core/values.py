"""Whether an argument holds values the host can read: the checks that only concrete
arguments allow (index ranges, sizes) and the rules for traced ones hang on this."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def is_traced(x) -> bool:
  """``x`` is a tracer (inside ``jit``, ``grad``, ``vmap``...): its values are unknown."""
  return isinstance(x, jax.core.Tracer)


def concrete_values(x) -> np.ndarray | None:
  """``x``'s values as a NumPy array (read to the host), or None where they are not known
  (a tracer, a ``jax.ShapeDtypeStruct``)."""
  if is_traced(x) or not isinstance(x, (np.ndarray, np.generic, jax.Array, list, tuple, int)):
    return None
  return np.asarray(x)


def check_scale(scale, head_dim: int):
  """The softmax scale: ``head_dim ** -0.5`` for None, a Python float for a finite real
  scalar, or a traced float scalar as it is (only the XLA path takes those)."""
  if scale is None:
    return 1.0 / float(np.sqrt(head_dim))
  if isinstance(scale, (bool, np.bool_)) or isinstance(scale, (str, bytes)):
    raise TypeError(f"scale must be a finite real number (or a traced scalar), got {type(scale).__name__}")
  if is_traced(scale):
    if np.ndim(scale) != 0 or not (jnp.issubdtype(scale.dtype, jnp.floating)
                                   or jnp.issubdtype(scale.dtype, jnp.integer)):
      raise TypeError(f"a traced scale must be a real scalar, got {scale.dtype}{list(np.shape(scale))}")
    return scale
  try:
    if np.ndim(scale) != 0:
      raise TypeError
    value = np.asarray(scale)
    if not (np.issubdtype(value.dtype, np.floating) or np.issubdtype(value.dtype, np.integer)):
      raise TypeError
    value = float(value)
  except TypeError:
    raise TypeError(f"scale must be a finite real number (or a traced scalar), got {type(scale).__name__}"
                    f"{'' if np.ndim(scale) == 0 else f' of shape {np.shape(scale)}'}") from None
  if not np.isfinite(value):
    raise ValueError(f"scale must be finite, got {value}")
  return value
