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
  stack's cache, in either layout, of that many layers. Returns the sizes bound."""
  check_instance("cache", cache, KVCache, "a KVCache (from init_cache)")
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
  returned cache's lengths are ``lengths + n``."""
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
  (one ``dynamic_update_slice``) and sets the lengths to ``lengths`` (``[batch]``, each <= P)."""
  check_prefix(cache, k_new.shape[1], lengths)
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
