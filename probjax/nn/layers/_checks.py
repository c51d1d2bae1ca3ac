"""Static input checks shared by the layers: shapes, dtypes and types only.

Every check reads ``.shape`` / ``.dtype`` (or a Python value's type), never an array's values,
so under ``jax.jit`` it runs once at trace time and costs nothing at run time. A failed check
raises ValueError (shape, rank, value) or TypeError (dtype, type) whose message names the
argument and the expected form, e.g.::

  x must be [batch, seq, 256] (in_features=256), got shape (4, 10, 128)

:func:`check_array` describes an argument's axes as a tuple: a string names an axis whose size
is free the first time and bound afterwards (``sizes``: what earlier arguments bound, e.g. the
batch of ``x``), an int is a fixed size, and a ``(label, int)`` pair a fixed size set by the
configuration argument ``label`` (the message says ``label=int``).

>>> import jax.numpy as jnp
>>> s = check_array("x", jnp.ones((4, 10, 8)), ("batch", "seq", ("in_features", 8)))
>>> s["batch"]
(4, 'x')
>>> check_array("context", jnp.ones((3, 5, 6)), ("batch", "ctx_seq", ("context_features", 6)), sizes=s)
Traceback (most recent call last):
ValueError: context must be [batch, ctx_seq, 6] (batch=4 as x's, context_features=6), got shape (3, 5, 6)
"""

from __future__ import annotations

from typing import Any, Sequence

import jax.numpy as jnp
import numpy as np

from probjax.ops.attention.masks import Mask, MaskWithDense

__all__ = ["check_array", "check_instance", "check_mask", "form"]

DTYPE_KINDS = {
    "float": ("a floating", lambda d: jnp.issubdtype(d, jnp.floating)),
    "int": ("an integer", lambda d: jnp.issubdtype(d, jnp.integer)),
    "real": ("an integer or floating", lambda d: jnp.issubdtype(d, jnp.integer) or jnp.issubdtype(d, jnp.floating)),
}

Sizes = dict[str, tuple[int, str]]


def _shape_dtype(name: str, x, expected: str):
  """``(shape, dtype)`` of an array, a tracer, or a Python number / nested list (as numpy reads it)."""
  if hasattr(x, "shape") and hasattr(x, "dtype"):
    return tuple(x.shape), x.dtype
  if isinstance(x, (bool, int, float, complex, np.generic, list, tuple)):
    try:
      a = np.asarray(x)
    except ValueError:  # ragged nested lists
      a = None
    if a is not None and a.dtype != object:
      return a.shape, a.dtype
  raise TypeError(f"{name} must be an array {expected}, got {type(x).__name__}")


def form(dims: Sequence[Any]) -> str:
  """The bracketed form of ``dims``, e.g. ``[batch, seq, 256]``."""
  out = []
  for d in dims:
    if d is Ellipsis:
      out.append("...")
    elif isinstance(d, tuple):
      out.append(str(d[1]))
    else:
      out.append(str(d))
  return "[" + ", ".join(out) + "]"


def _notes(dims: Sequence[Any], sizes: Sizes) -> str:
  notes = []
  for d in dims:
    if isinstance(d, str) and d in sizes:
      n, src = sizes[d]
      notes.append(f"{d}={n} as {src}'s")
    elif isinstance(d, tuple):
      notes.append(f"{d[0]}={d[1]}")
  return f" ({', '.join(dict.fromkeys(notes))})" if notes else ""


def _matches(dims: Sequence[Any], shape: tuple, sizes: Sizes) -> bool:
  if dims and dims[0] is Ellipsis:
    dims = dims[1:]
    if len(shape) < len(dims):
      return False
    shape = shape[len(shape) - len(dims):]
  if len(shape) != len(dims):
    return False
  bound: dict[str, int] = {}
  for d, n in zip(dims, shape):
    if isinstance(d, tuple):
      d = d[1]
    if isinstance(d, int):
      if n != d:
        return False
    elif d in sizes:
      if n != sizes[d][0]:
        return False
    elif bound.setdefault(d, n) != n:  # one name twice in a form: equal sizes
      return False
  return True


def check_array(name: str, x, dims: Sequence[Any] | list[Sequence[Any]], *, dtype: str | None = "float",
                sizes: Sizes | None = None) -> Sizes:
  """Raises unless ``x`` is an array of the form ``dims`` (see the module docstring; a leading
  ``...`` allows any number of leading axes; a list of forms: any one of them) and, with
  ``dtype`` "float", "int" or "real" (integer or floating, not bool), of that dtype kind.

  Returns ``sizes`` updated with the sizes ``x`` binds to its named axes, each as ``(size,
  name)``, for the arguments checked after it.
  """
  sizes = dict(sizes or {})
  alternatives = dims if isinstance(dims, list) else [dims]
  expected = " or ".join(form(d) for d in alternatives)
  shape, dt = _shape_dtype(name, x, expected)
  if dtype is not None:
    what, ok = DTYPE_KINDS[dtype]
    if jnp.issubdtype(dt, jnp.bool_) or not ok(dt):
      raise TypeError(f"{name} must have {what} dtype ({expected}), got {dt}")
  for d in alternatives:
    if _matches(d, shape, sizes):
      if d and d[0] is Ellipsis:
        d = d[1:]
        shape = shape[len(shape) - len(d):]
      for a, n in zip(d, shape):
        if isinstance(a, str) and a not in sizes:
          sizes[a] = (n, name)
      return sizes
  notes = _notes([a for d in alternatives for a in d], sizes)
  raise ValueError(f"{name} must be {expected}{notes}, got shape {shape}")


def check_instance(name: str, x, cls: type | tuple[type, ...], what: str) -> None:
  """TypeError naming ``name`` unless ``x`` is a ``cls`` (``what``: how the message names it)."""
  if not isinstance(x, cls):
    raise TypeError(f"{name} must be {what}, got {type(x).__name__}")


def check_mask(mask, batch: int, q_len: int, kv_len: int, name: str = "mask") -> None:
  """Raises unless ``mask`` is None, a probjax ``Mask`` whose arrays fit ``[batch, q_len,
  kv_len]`` (``Mask.validate``), a ``mask & dense`` (its Mask part validated so) or an array
  (a dense mask: the attention function checks that it broadcasts). ``name``: the argument's
  name in the messages (e.g. ``context_mask``)."""
  if mask is None:
    return
  structured = mask.mask if isinstance(mask, MaskWithDense) else mask
  if isinstance(structured, Mask):
    try:
      structured.validate(batch, q_len, kv_len)
    except (TypeError, ValueError) as e:
      if name == "mask":
        raise
      raise type(e)(f"{name}: {e}") from None
  elif not (hasattr(mask, "shape") and hasattr(mask, "dtype")):
    raise TypeError(f"{name} must be a probjax Mask (e.g. KVLenMask(lengths)) or a boolean array "
                    f"broadcastable to [batch, heads, q_len, kv_len], got {type(mask).__name__}")
