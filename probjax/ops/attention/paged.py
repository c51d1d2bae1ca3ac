"""Attention over a paged KV cache: what the public face and the XLA path share.

A paged cache keeps keys and values in page pools ``[num_pages, page_size, kv_heads, head_dim]``;
``page_table [batch, pages_per_seq]`` (int32) names the pages of each sequence in order, so
position ``p`` of element ``b`` lies at ``pool[page_table[b, p // page_size], p % page_size]``.
The call stands for contiguous K/V of ``kv_len = pages_per_seq * page_size`` positions, of which
the mask's ``KVLenMask`` lengths are valid (the spelling of :func:`probjax.ops.mla.mla`'s
``page_table``).

Entries must be pages of the pool, in ``[0, num_pages)``: a concrete table is checked
(ValueError naming ``page_table``). A traced one cannot be, so every path reads an entry
outside the pool as page 0 (:data:`CLAMP_PAGE`) and gives that page's positions zero weight,
as if past the length: no path reads outside the pool, and a bad entry drops its positions
from the softmax instead of attending to another sequence's keys.

The XLA path is exact: it gathers the pages to contiguous ``[batch, kv_len, kv_heads, head_dim]``
(:func:`gather`), zeroes the positions that get no weight (past the lengths, or on a page
outside the pool: they may hold NaN, and ``0 * nan`` is NaN) and runs attention's XLA
formulation. A backend may read the pages in place instead (``AttentionBackend.paged_kernel``).
"""

from __future__ import annotations

import jax.numpy as jnp

from probjax.core.values import concrete_values

# The page an entry outside the pool reads (its positions then get zero weight).
CLAMP_PAGE = 0


def check(query, key, value, page_table):
  """Validates a paged call and returns ``(page_size, kv_len)``: ``query [batch, q_len, heads,
  head_dim]``, ``key``/``value`` pools ``[num_pages, page_size, kv_heads, head_dim]`` (value's
  head_dim may differ), ``page_table [batch, pages_per_seq]`` integers, each concrete entry a
  page of the pool (ValueError / TypeError naming the argument)."""
  if query.ndim != 4:
    raise ValueError(f"with page_table, query must be [batch, q_len, heads, head_dim] (one batch axis), got "
                     f"shape {tuple(query.shape)}")
  for name, x in (("key", key), ("value", value)):
    if x.ndim != 4:
      raise ValueError(f"with page_table, {name} must be a page pool [num_pages, page_size, kv_heads, head_dim], "
                       f"got shape {tuple(x.shape)}")
  if key.shape[:3] != value.shape[:3]:
    raise ValueError(f"the key and value pools must agree in [num_pages, page_size, kv_heads], got "
                     f"{tuple(key.shape)} and {tuple(value.shape)}")
  if not hasattr(page_table, "shape") or not hasattr(page_table, "dtype"):
    raise TypeError(f"page_table must be an int32 array [batch, pages_per_seq], got {type(page_table).__name__}")
  if len(page_table.shape) != 2:
    raise ValueError(f"page_table must be [batch, pages_per_seq], got shape {tuple(page_table.shape)}")
  if not jnp.issubdtype(page_table.dtype, jnp.integer):
    raise TypeError(f"page_table must be an integer array [batch, pages_per_seq], got {page_table.dtype}")
  batch, pages = page_table.shape
  if batch != query.shape[0]:
    raise ValueError(f"page_table's batch {batch} does not match query's batch {query.shape[0]}")
  num_pages, page_size = int(key.shape[0]), int(key.shape[1])
  if num_pages < 1 or page_size < 1 or pages < 1:
    raise ValueError(f"a paged call needs pages: pools {tuple(key.shape)}, page_table {tuple(page_table.shape)}")
  table = concrete_values(page_table)
  if table is not None and (table.min() < 0 or table.max() >= num_pages):
    bad = table[(table < 0) | (table >= num_pages)]
    raise ValueError(f"page_table entries must be pages of the pool, in [0, {num_pages}); got "
                     f"{bad[:4].tolist()}{' ...' if bad.size > 4 else ''} (pad unused entries with any "
                     "valid page, e.g. 0: positions past the lengths are never read)")
  return page_size, pages * page_size


def page_ok(page_table, num_pages: int):
  """``[batch, pages_per_seq]`` bool: the entry is a page of the pool."""
  return (page_table >= 0) & (page_table < num_pages)


def clamped(page_table, num_pages: int):
  """The table as the paths read it: int32, entries outside the pool replaced by :data:`CLAMP_PAGE`."""
  table = jnp.asarray(page_table, jnp.int32)
  return jnp.where(page_ok(table, num_pages), table, CLAMP_PAGE)


def gather(pool, page_table):
  """``pool [num_pages, page_size, ...]`` read through ``page_table [batch, pages]`` as a
  contiguous ``[batch, pages * page_size, ...]`` (entries outside the pool read page 0)."""
  b, n = page_table.shape
  pages = clamped(page_table, pool.shape[0]).reshape(-1)
  out = jnp.take(pool, pages, axis=0, mode="clip")
  return out.reshape((b, n * pool.shape[1]) + tuple(pool.shape[2:]))


def valid_positions(page_table, num_pages: int, page_size: int, kv_lengths):
  """``[batch, kv_len]`` bool: the positions that get weight, below the length and on a page
  of the pool."""
  ok = jnp.repeat(page_ok(page_table, num_pages), page_size, axis=1)
  kv_len = ok.shape[1]
  return ok & (jnp.arange(kv_len)[None, :] < jnp.asarray(kv_lengths)[:, None])


def gathered(key, value, page_table, kv_lengths):
  """``(k, v, valid)``: the pools gathered to contiguous ``[batch, kv_len, kv_heads, d]`` with
  the positions that get no weight zeroed, and ``valid [batch, kv_len]``."""
  ok = valid_positions(page_table, key.shape[0], key.shape[1], kv_lengths)
  zero = lambda x: jnp.where(ok[:, :, None, None], x, jnp.zeros((), x.dtype))
  return zero(gather(key, page_table)), zero(gather(value, page_table)), ok
