"""Dense boolean masks: the structured Mask equal to one, for the hint that names it."""

from __future__ import annotations

import jax
import numpy as np


def structured_equivalent(dense, q_len: int, kv_len: int):
  """The constructor call (text) of a structured Mask equal to a concrete dense boolean mask
  broadcastable to ``[batch, heads, q_len, kv_len]``, or None (traced, head-dependent, or no
  band / key-length form). Detects a diagonal band (causal, sliding window) shared by the
  batch, or per-batch key lengths (``k < L[b]`` for every query)."""
  if isinstance(dense, jax.core.Tracer):
    return None
  try:
    m = np.asarray(dense)
  except Exception:  # noqa: BLE001 -- anything not concrete has no suggestion
    return None
  if m.ndim > 4 or m.dtype == object:
    return None
  m = m.astype(bool).reshape((1,) * (4 - m.ndim) + m.shape)
  try:
    m = np.broadcast_to(m, m.shape[:2] + (q_len, kv_len))
  except ValueError:
    return None
  if not (m == m[:, :1]).all():
    return None  # differs across heads
  m = m[:, 0]
  if not m.any() or m.all():
    return None
  d = np.arange(kv_len)[None, :] - np.arange(q_len)[:, None]
  if (m == m[:1]).all():
    lo, hi = int(d[m[0]].min()), int(d[m[0]].max())
    if ((d >= lo) & (d <= hi) == m[0]).all():
      lo = None if lo <= -(q_len - 1) else lo
      hi = None if hi >= kv_len - 1 else hi
      if lo is None and hi is not None:
        return f"CausalMask({hi})"
      if lo is not None:
        if hi is None:
          return f"LocalWindowMask({-lo}, None)" if lo <= 0 else f"LocalWindowMask(0, None, offset={lo})"
        if lo <= 0 <= hi:
          return f"LocalWindowMask({-lo}, {hi})"
        return f"LocalWindowMask({hi - lo}, 0, offset={hi})"
  rows = m[:, 0]
  lengths = rows.sum(-1)
  if (m == rows[:, None]).all() and (rows == (np.arange(kv_len)[None] < lengths[:, None])).all():
    if m.shape[0] == 1:
      return f"KVLenMask(jnp.full((batch,), {int(lengths[0])}))"
    return f"KVLenMask(jnp.array({lengths.tolist()}))"
  return None
