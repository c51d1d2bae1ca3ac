"""Positions past a mask's lengths, made harmless before a kernel reads them (every backend
that takes length masks uses this)."""

from __future__ import annotations

import jax.numpy as jnp

from probjax.ops.attention.masks import Mask


def zero_padding(mask: Mask | None, q, k, v):
  """``(q, k, v, q_ok)``: q ``[B, Tq, H, D]`` and k/v ``[B, Tkv, Hkv, D]`` with the positions past
  ``mask``'s lengths set to zero, and ``q_ok`` ``[B, Tq, 1, 1]`` (None without query lengths).

  Those positions may hold anything (a KV cache's unwritten tail, NaN included). Their scores
  are masked, but a masked key still meets a zero weight in ``P @ V`` and in the gradients
  (``dS @ K``, ``dS^T @ Q``), where ``0 * NaN`` is NaN; zeroing them, and the output rows of
  padded queries with :func:`zero_rows` (so a NaN cotangent there is dropped too), keeps them
  out of every output and gradient. Positions excluded only by the band or segment ids are
  read for other queries, so they must be finite.
  """
  if mask is None:
    return q, k, v, None
  valid = lambda lengths, n: (jnp.arange(n)[None, :] < lengths[:, None])[:, :, None, None]
  q_lens, kv_lens = mask.lengths(q.shape[0])
  if kv_lens is not None:
    k_ok = valid(kv_lens, k.shape[1])
    k, v = jnp.where(k_ok, k, 0), jnp.where(k_ok, v, 0)
  q_ok = None
  if q_lens is not None:
    q_ok = valid(q_lens, q.shape[1])
    q = jnp.where(q_ok, q, 0)
  return q, k, v, q_ok


def zero_rows(out, q_ok):
  """``out`` ``[B, Tq, H, D]`` with the rows of padded queries zero (``q_ok`` from :func:`zero_padding`)."""
  return out if q_ok is None else jnp.where(q_ok, out, 0)
