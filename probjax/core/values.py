"""Whether an argument holds values the host can read: the checks that only concrete
arguments allow (index ranges, sizes) and the rules for traced ones hang on this."""

from __future__ import annotations

import jax
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
