"""A functional KV cache for decoding: an immutable pytree passed in and returned.

Convention (chosen over NNX ``nnx.Cache`` variables so that the cache can be donated to a
jitted step, carried through ``lax.scan`` / ``lax.while_loop`` and stacked over layers):

* ``k``, ``v``: ``[batch, max_len, kv_heads, head_dim]`` for one attention layer. A layer
  stack's cache holds either a tuple of ``layers`` such arrays (``layout="per_layer"``, the
  default of :meth:`KVCache.init` with ``num_layers``: every layer's K/V is its own buffer,
  read and written in place) or one ``[layers, batch, max_len, kv_heads, head_dim]`` array
  each (``layout="stacked"``: written in place at a ``layer=`` index, but a layer's K/V reaches
  the attention function as a dynamic slice, which XLA may copy).
* ``lengths``: ``[batch]`` int32, the number of valid positions of each batch element (the
  position of its next token). Entries at or past ``lengths[b]`` are never attended to.

Writes (:func:`write`) scatter the new tokens of element ``b`` at positions
``lengths[b] + j`` with ``mode="drop"``: under ``jax.jit`` with the cache donated XLA updates
the buffer in place (no copy of the cache per step), and a write past ``max_len`` is dropped
rather than clamped onto valid entries. Overflow is checked eagerly (ValueError naming
``max_len``) wherever the lengths are concrete; under ``jax.jit`` it cannot be, and tokens
past ``max_len`` are silently not stored (their outputs are then wrong, never NaN).

>>> import jax.numpy as jnp
>>> c = KVCache.init(2, 8, kv_heads=1, head_dim=4)
>>> c = write(c, jnp.ones((2, 3, 1, 4)), jnp.ones((2, 3, 1, 4)))   # 3 tokens per element
>>> c.k.shape, c.lengths.tolist()
((2, 8, 1, 4), [3, 3])
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from probjax.nn.layers._checks import check_array, check_instance

LAYOUTS = ("per_layer", "stacked")

__all__ = ["KVCache", "write", "write_prefix", "read", "check_room", "check_prefix", "check_cache"]


@dataclasses.dataclass(frozen=True)
class KVCache:
  """Keys, values and per-element lengths; see the module docstring for shapes."""

  k: Any
  v: Any
  lengths: Any

  @classmethod
  def init(cls, batch: int, max_len: int, *, kv_heads: int, head_dim: int, dtype=jnp.float32,
           num_layers: int | None = None, layout: str = "per_layer") -> "KVCache":
    """An empty (zero-filled, all lengths 0) cache; with ``num_layers``, in ``layout``
    "per_layer" (tuples of arrays) or "stacked" (a leading layer axis)."""
    if layout not in LAYOUTS:
      raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    for name, n in (("batch", batch), ("max_len", max_len), ("kv_heads", kv_heads),
                    ("head_dim", head_dim)):
      if int(n) < 1:
        raise ValueError(f"init_cache: {name} must be >= 1, got {n}")
    shape = (int(batch), int(max_len), int(kv_heads), int(head_dim))
    lengths = jnp.zeros((int(batch),), jnp.int32)
    if num_layers is None:
      return cls(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype), lengths)
    if layout == "stacked":
      shape = (int(num_layers),) + shape
      return cls(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype), lengths)
    zeros = tuple(jnp.zeros(shape, dtype) for _ in range(int(num_layers)))
    return cls(zeros, tuple(jnp.zeros(shape, dtype) for _ in range(int(num_layers))), lengths)

  @property
  def per_layer(self) -> bool:
    """Whether k and v are tuples of per-layer arrays."""
    return isinstance(self.k, (tuple, list))

  @property
  def max_len(self) -> int:
    return (self.k[0] if self.per_layer else self.k).shape[-3]

  @property
  def batch(self) -> int:
    return (self.k[0] if self.per_layer else self.k).shape[-4]

  def replace(self, **kw) -> "KVCache":
    return dataclasses.replace(self, **kw)


jax.tree_util.register_dataclass(KVCache, data_fields=["k", "v", "lengths"], meta_fields=[])


def _concrete(x):
  """``x`` as a numpy array if it is concrete (not traced), else None."""
  try:
    return np.asarray(x)
  except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
    return None


def check_cache(cache, sizes=None, k_tail=(), v_tail=None, *, layers=None, num_layers=None):
  """Raises unless ``cache`` is a :class:`KVCache` whose ``k`` is ``[batch, max_len, *k_tail]``
  and ``v`` ``[batch, max_len, *v_tail]`` (``v_tail`` default ``k_tail``; entries as
  :func:`~probjax.nn.layers._checks.check_array`'s) of a floating dtype, and ``lengths``
  ``[batch]`` integers (TypeError for types and dtypes, ValueError for shapes, naming
  ``cache.k``, ``cache.v`` or ``cache.lengths``). ``sizes``: sizes bound already (``batch``
  from the layer's input). ``layers``: the cache of one layer of a stack (its k, v have a
  leading layer axis: the stacked layout, indexed with ``layer=``); ``num_layers``: a whole
  stack's cache, in either layout, of that many layers. Returns the sizes bound. A
  :class:`PagedKVCache` is checked likewise (its pools ``[num_pages, page_size, *tail]``, the
  page table ``[batch, pages_per_seq]`` integers; per-layer pools only)."""
  if isinstance(cache, PagedKVCache):
    return _check_paged(cache, sizes, k_tail, k_tail if v_tail is None else v_tail, layers=layers,
                        num_layers=num_layers)
  check_instance("cache", cache, (KVCache, PagedKVCache), "a KVCache or PagedKVCache (from init_cache)")
  v_tail = k_tail if v_tail is None else v_tail
  lead = ("layers",) if layers else ()
  ks, vs = cache.k, cache.v
  if num_layers is None and isinstance(ks, (tuple, list)):
    raise ValueError(f"cache: a layer takes one layer's cache, got a per-layer stack of {len(ks)} (pass "
                     "KVCache(cache.k[i], cache.v[i], cache.lengths), or the stack to the Transformer)")
  if num_layers is not None:
    if isinstance(ks, (tuple, list)):
      if len(ks) != num_layers or not isinstance(vs, (tuple, list)) or len(vs) != num_layers:
        raise ValueError(f"cache: the per-layer cache must hold num_layers={num_layers} k and v arrays, "
                         f"got {len(ks)} and {len(vs) if isinstance(vs, (tuple, list)) else type(vs).__name__}")
    else:
      lead = (("num_layers", num_layers),)
  ks = ks if isinstance(ks, (tuple, list)) else (ks,)
  vs = vs if isinstance(vs, (tuple, list)) else (vs,)
  sizes = dict(sizes or {})
  for k, v in zip(ks, vs):
    sizes = check_array("cache.k", k, (*lead, "batch", "max_len", *k_tail), sizes=sizes)
    sizes = check_array("cache.v", v, (*lead, "batch", "max_len", *v_tail), sizes=sizes)
  return check_array("cache.lengths", cache.lengths, ("batch",), dtype="int", sizes=sizes)


def check_room(cache: KVCache, num_new: int, lengths=None) -> None:
  """Raises ValueError (naming ``max_len``) if ``num_new`` tokens do not fit after ``lengths``
  (default ``cache.lengths``) where those are concrete; a no-op for traced lengths."""
  if num_new > cache.max_len:
    raise ValueError(f"KV cache overflow: {num_new} new tokens do not fit in max_len={cache.max_len}")
  lengths = cache.lengths if lengths is None else lengths
  n = _concrete(lengths)
  if n is not None and n.size and int(n.max()) + num_new > cache.max_len:
    raise ValueError(f"KV cache overflow: lengths up to {int(n.max())} + {num_new} new tokens exceed "
                     f"max_len={cache.max_len}; init the cache with a larger max_len")


def write(cache: KVCache, k_new, v_new, *, layer=None, advance: bool = True) -> KVCache:
  """Writes ``k_new``/``v_new`` ``[batch, n, kv_heads, head_dim]`` at positions
  ``lengths[b] + arange(n)`` (of layer ``layer`` of a stacked cache); with ``advance`` the
  returned cache's lengths are ``lengths + n``. A :class:`PagedKVCache` (one layer's) is written
  through its page table."""
  if isinstance(cache, PagedKVCache):
    tail = lambda pool: tuple(pool.shape[-2:])
    s = check_array("k_new", k_new, ("batch", "n", *tail(cache.k_pages)), sizes={"batch": (cache.batch, "cache")})
    check_array("v_new", v_new, ("batch", "n", *tail(cache.v_pages)), sizes=s)
    n = k_new.shape[1]
    check_room(cache, n)
    pos = cache.lengths[:, None] + jnp.arange(n, dtype=jnp.int32)
    return _paged_write(cache, k_new, v_new, pos, cache.lengths + n if advance else cache.lengths, layer)
  tail = tuple((cache.k[0] if cache.per_layer else cache.k).shape[-2:])
  s = check_array("k_new", k_new, ("batch", "n", *tail), sizes={"batch": (cache.batch, "cache")})
  check_array("v_new", v_new, ("batch", "n", *tuple((cache.v[0] if cache.per_layer else cache.v).shape[-2:])),
              sizes=s)
  n = k_new.shape[1]
  check_room(cache, n)
  pos = cache.lengths[:, None] + jnp.arange(n, dtype=jnp.int32)          # [b, n]
  b = jnp.arange(cache.batch, dtype=jnp.int32)[:, None]                   # [b, 1]
  idx = (b, pos) if layer is None else (jnp.asarray(layer, jnp.int32), b, pos)
  upd = lambda buf, x: buf.at[idx].set(x.astype(buf.dtype), mode="drop", unique_indices=True,
                                       indices_are_sorted=True)
  lengths = cache.lengths + n if advance else cache.lengths
  return KVCache(upd(cache.k, k_new), upd(cache.v, v_new), lengths)


def check_prefix(cache: KVCache, p: int, lengths) -> None:
  """Raises ValueError if a prompt of ``p`` tokens does not fit (naming ``max_len``) or
  concrete ``lengths`` lie outside ``[0, p]``."""
  if p > cache.max_len:
    raise ValueError(f"KV cache overflow: a prompt of {p} tokens does not fit in max_len={cache.max_len}")
  if jnp.shape(lengths) != (cache.batch,):
    raise ValueError(f"prefill: lengths must have shape [batch] = ({cache.batch},), got {jnp.shape(lengths)}")
  check_array("lengths", lengths, ("batch",), dtype="int")
  n = _concrete(lengths)
  if n is not None and n.size and (n.min() < 0 or n.max() > p):
    raise ValueError(f"prefill: lengths must lie in [0, {p}] (the prompt length), got [{n.min()}, {n.max()}]")


def write_prefix(cache: KVCache, k_new, v_new, lengths, *, layer=None) -> KVCache:
  """Prefill: writes ``[batch, P, kv_heads, head_dim]`` at positions ``[0, P)`` of every element
  (one ``dynamic_update_slice``; a :class:`PagedKVCache`: through its page table) and sets the
  lengths to ``lengths`` (``[batch]``, each <= P)."""
  check_prefix(cache, k_new.shape[1], lengths)
  if isinstance(cache, PagedKVCache):
    pos = jnp.broadcast_to(jnp.arange(k_new.shape[1], dtype=jnp.int32), (cache.batch, k_new.shape[1]))
    return _paged_write(cache, k_new, v_new, pos, lengths, layer)
  start = (0, 0, 0, 0) if layer is None else (layer, 0, 0, 0, 0)
  def upd(buf, x):
    x = x.astype(buf.dtype)
    return jax.lax.dynamic_update_slice(buf, x if layer is None else x[None], start)
  return KVCache(upd(cache.k, k_new), upd(cache.v, v_new), jnp.asarray(lengths, jnp.int32))


def read(cache: KVCache, *, layer=None):
  """``(k, v)`` ``[batch, max_len, kv_heads, head_dim]`` of one layer."""
  if layer is None:
    return cache.k, cache.v
  take = lambda x: jax.lax.dynamic_index_in_dim(x, layer, 0, keepdims=False)
  return take(cache.k), take(cache.v)


# -- paged cache -------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True, kw_only=True)
class PagedKVCache:
  """A paged KV cache for decoding: page pools, a page table and per-element lengths (an
  immutable pytree, passed in and returned like :class:`KVCache`, for which it stands in
  :meth:`MultiHeadAttention.prefill` / ``decode_step`` and :class:`TransformerLM`'s).

  Position ``p`` of element ``b`` lives at ``k_pages[page_table[b, p // page_size], p %
  page_size]``, so sequences need no contiguous ``max_len`` buffer each: pages may come from
  anywhere in the pool, in any order. Attention reads the pools through the table
  (:func:`probjax.ops.attention.dot_product_attention`'s ``page_table``: the Triton decode
  kernel reads the pages in place on a GPU, the XLA path gathers them).

  The allocator is static: :meth:`init` takes a fixed ``page_table`` from the caller (any
  assignment of distinct pages; pages no sequence names stay unused) or, by default, assigns
  element ``b`` the contiguous pages ``[b * pages_per_seq, (b + 1) * pages_per_seq)``. Pages are
  never freed or moved; a caller that shares a pool between requests edits the table itself.

  Args:
    k_pages: ``[num_pages, page_size, kv_heads, head_dim]`` key pool, or (a layer stack) a
      tuple of one such pool per layer.
    v_pages: the value pool(s), as ``k_pages`` (the head_dim may differ).
    page_table: ``[batch, pages_per_seq]`` int32: element ``b``'s pages, in order; shared by
      every layer. Entries must be pages of the pool, distinct across the batch.
    lengths: ``[batch]`` int32 valid positions per element (the position of its next token);
      at most ``max_len = pages_per_seq * page_size``.

  Writes past ``max_len`` (or, under ``jax.jit``, through a table entry outside the pool) are
  dropped, never clamped onto valid entries; concrete lengths are checked eagerly (ValueError
  naming ``max_len``), as :class:`KVCache`'s.

  >>> import jax.numpy as jnp
  >>> c = PagedKVCache.init(2, page_size=4, pages_per_seq=3, kv_heads=1, head_dim=8)
  >>> c.page_table.tolist(), c.max_len, c.k_pages.shape
  ([[0, 1, 2], [3, 4, 5]], 12, (6, 4, 1, 8))
  >>> c = write(c, jnp.ones((2, 5, 1, 8)), jnp.ones((2, 5, 1, 8)))   # 5 tokens: pages 0-1, 3-4
  >>> c.lengths.tolist(), float(c.k_pages[4, 0, 0, 0]), float(c.k_pages[2, 0, 0, 0])
  ([5, 5], 1.0, 0.0)
  """

  k_pages: Any
  v_pages: Any
  page_table: Any
  lengths: Any

  @classmethod
  def init(cls, batch: int, *, page_size: int, kv_heads: int, head_dim: int, pages_per_seq: int | None = None,
           num_pages: int | None = None, page_table=None, dtype=jnp.float32,
           num_layers: int | None = None) -> "PagedKVCache":
    """An empty (zero-filled, all lengths 0) cache.

    Args:
      batch: sequences.
      page_size: positions per page (the Triton decode kernel reads pages of a multiple of 16
        in place; other sizes are gathered on the XLA path).
      kv_heads, head_dim: per position.
      pages_per_seq: pages per sequence (``max_len = pages_per_seq * page_size``); default
        ``page_table``'s width.
      num_pages: pool size; default ``batch * pages_per_seq`` (no page_table) or one past the
        table's largest entry.
      page_table: ``[batch, pages_per_seq]`` ints, each a page of the pool, no page named
        twice (ValueError naming ``page_table``); None: the contiguous assignment.
      dtype: the pools' dtype.
      num_layers: one pool pair per layer (tuples), for a layer stack.
    """
    for name, n in (("batch", batch), ("page_size", page_size), ("kv_heads", kv_heads), ("head_dim", head_dim)):
      if int(n) < 1:
        raise ValueError(f"PagedKVCache.init: {name} must be >= 1, got {n}")
    batch, page_size = int(batch), int(page_size)
    if page_table is None:
      if pages_per_seq is None or int(pages_per_seq) < 1:
        raise ValueError(f"PagedKVCache.init: pages_per_seq must be >= 1 without a page_table, got {pages_per_seq}")
      pages_per_seq = int(pages_per_seq)
      num_pages = batch * pages_per_seq if num_pages is None else int(num_pages)
      if num_pages < batch * pages_per_seq:
        raise ValueError(f"PagedKVCache.init: num_pages {num_pages} < batch * pages_per_seq = "
                         f"{batch * pages_per_seq} (the contiguous assignment's pages)")
      page_table = jnp.arange(batch * pages_per_seq, dtype=jnp.int32).reshape(batch, pages_per_seq)
    else:
      check_array("page_table", page_table, (("batch", batch), "pages_per_seq"), dtype="int")
      if pages_per_seq is not None and int(pages_per_seq) != page_table.shape[1]:
        raise ValueError(f"page_table has {page_table.shape[1]} pages per sequence, pages_per_seq is {pages_per_seq}")
      table = _concrete(page_table)
      if num_pages is None:
        if table is None:
          raise ValueError("PagedKVCache.init: a traced page_table needs num_pages")
        num_pages = int(table.max()) + 1
      num_pages = int(num_pages)
      check_page_table(page_table, num_pages)
      page_table = jnp.asarray(page_table, jnp.int32)
    shape = (num_pages, page_size, int(kv_heads), int(head_dim))
    lengths = jnp.zeros((batch,), jnp.int32)
    pools = lambda: (jnp.zeros(shape, dtype) if num_layers is None
                     else tuple(jnp.zeros(shape, dtype) for _ in range(int(num_layers))))
    return cls(k_pages=pools(), v_pages=pools(), page_table=page_table, lengths=lengths)

  @property
  def per_layer(self) -> bool:
    """Whether k_pages and v_pages are tuples of per-layer pools."""
    return isinstance(self.k_pages, (tuple, list))

  @property
  def _pool(self):
    return self.k_pages[0] if self.per_layer else self.k_pages

  @property
  def page_size(self) -> int:
    return self._pool.shape[1]

  @property
  def num_pages(self) -> int:
    return self._pool.shape[0]

  @property
  def max_len(self) -> int:
    """Positions per sequence: ``pages_per_seq * page_size``."""
    return self.page_table.shape[1] * self.page_size

  @property
  def batch(self) -> int:
    return self.page_table.shape[0]

  def replace(self, **kw) -> "PagedKVCache":
    return dataclasses.replace(self, **kw)


jax.tree_util.register_dataclass(PagedKVCache, data_fields=["k_pages", "v_pages", "page_table", "lengths"],
                                 meta_fields=[])

__all__ += ["PagedKVCache", "check_page_table", "layer_cache", "layer_arrays", "with_layers"]


def check_page_table(page_table, num_pages: int) -> None:
  """Raises ValueError (naming ``page_table``) unless its concrete entries are pages of the
  pool, in ``[0, num_pages)``, none named twice (two sequences writing one page would
  overwrite each other); a no-op for a traced table."""
  table = _concrete(page_table)
  if table is None or not table.size:
    return
  if table.min() < 0 or table.max() >= num_pages:
    bad = table[(table < 0) | (table >= num_pages)]
    raise ValueError(f"page_table entries must be pages of the pool, in [0, {num_pages}); got {bad[:4].tolist()}")
  values, counts = np.unique(table, return_counts=True)
  if (counts > 1).any():
    raise ValueError(f"page_table names pages {values[counts > 1][:4].tolist()} more than once: each "
                     "position needs a page of its own")


def layer_cache(cache, i: int):
  """Layer ``i``'s cache of a per-layer stack (a :class:`KVCache` or :class:`PagedKVCache`)."""
  if isinstance(cache, PagedKVCache):
    return cache.replace(k_pages=cache.k_pages[i], v_pages=cache.v_pages[i])
  return KVCache(cache.k[i], cache.v[i], cache.lengths)


def layer_arrays(cache):
  """``(k, v)`` storage of a one-layer cache: the buffers, or the page pools."""
  if isinstance(cache, PagedKVCache):
    return cache.k_pages, cache.v_pages
  return cache.k, cache.v


def with_layers(cache, k, v, lengths):
  """``cache`` with storage ``k``/``v`` (arrays or per-layer tuples) and ``lengths``."""
  if isinstance(cache, PagedKVCache):
    return cache.replace(k_pages=k, v_pages=v, lengths=jnp.asarray(lengths, jnp.int32))
  return KVCache(k, v, jnp.asarray(lengths, jnp.int32))


def _paged_slots(cache: PagedKVCache, pos):
  """``(page, offset)`` of positions ``pos [batch, n]``; a position past ``max_len`` or on an
  entry outside the pool gets page ``num_pages``, which a ``mode="drop"`` scatter drops."""
  ps, n_pages = cache.page_size, cache.num_pages
  idx = pos // ps
  in_seq = idx < cache.page_table.shape[1]
  page = jnp.take_along_axis(cache.page_table, jnp.minimum(idx, cache.page_table.shape[1] - 1), axis=1)
  ok = in_seq & (page >= 0) & (page < n_pages)
  return jnp.where(ok, page, n_pages), pos % ps


def _paged_write(cache: PagedKVCache, k_new, v_new, pos, lengths, layer) -> PagedKVCache:
  if layer is not None:
    raise ValueError("a PagedKVCache holds per-layer pools (tuples), not a stacked layout: pass no layer=")
  page, off = _paged_slots(cache, pos)
  upd = lambda pool, x: pool.at[page, off].set(x.astype(pool.dtype), mode="drop")
  return cache.replace(k_pages=upd(cache.k_pages, k_new), v_pages=upd(cache.v_pages, v_new),
                       lengths=jnp.asarray(lengths, jnp.int32))


def _check_paged(cache: PagedKVCache, sizes, k_tail, v_tail, *, layers, num_layers):
  if layers:
    raise ValueError("cache: a PagedKVCache holds per-layer pools (tuples), not a stacked layout")
  ks, vs = cache.k_pages, cache.v_pages
  stacked = isinstance(ks, (tuple, list))
  if num_layers is None and stacked:
    raise ValueError(f"cache: a layer takes one layer's cache, got a per-layer stack of {len(ks)} pools")
  if num_layers is not None:
    if not stacked or not isinstance(vs, (tuple, list)) or len(ks) != num_layers or len(vs) != num_layers:
      raise ValueError(f"cache: a stack's PagedKVCache holds num_layers={num_layers} k and v pools (tuples; "
                       "PagedKVCache.init(..., num_layers=))")
  ks = ks if stacked else (ks,)
  vs = vs if isinstance(vs, (tuple, list)) else (vs,)
  sizes = dict(sizes or {})
  for k, v in zip(ks, vs):
    sizes = check_array("cache.k_pages", k, ("num_pages", "page_size", *k_tail), sizes=sizes)
    sizes = check_array("cache.v_pages", v, ("num_pages", "page_size", *v_tail), sizes=sizes)
  sizes = check_array("cache.page_table", cache.page_table, ("batch", "pages_per_seq"), dtype="int", sizes=sizes)
  return check_array("cache.lengths", cache.lengths, ("batch",), dtype="int", sizes=sizes)
