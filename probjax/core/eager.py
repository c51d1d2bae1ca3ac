"""Eager calls of an op, compiled once per static call description.

An op's public function validates its arguments and dispatches in Python on every call (that
part reads concrete values: out-of-range lengths raise, a concrete scale is a Python float),
then computes. Called outside any transformation, JAX runs that computation op by op, and
every loop, ``custom_jvp``/``custom_vjp`` or Pallas kernel it builds (a new ``lax.scan`` body
per call) is traced and compiled anew: about a second per call where the jitted call takes
tens of milliseconds.

:func:`compile_once` wraps the computation after dispatch, ``fn(*args, **kwargs)``. Outside any
transformation, with every array argument concrete, it runs ``jax.jit`` of ``fn`` cached under
the call's static description: the arguments' pytree structure and every leaf that is not an
array (shapes, dtypes, flags, decisions, callables: hashable, compared by value, with their
type). Arrays (``jax.Array``, ``numpy.ndarray``) are the jitted function's arguments, never part
of the key, so one entry serves every call of the same description; ``jax.jit`` compiles it
once per input shape and dtype. Under a transformation (``jax.jit``, ``grad``, ``vmap``), with
a traced argument, or where the description is not hashable, ``fn`` runs as it is: traced
calls are unchanged.

``fn`` must compute from its arguments only: anything it reads that changes what it computes
(the device, the dispatch decision) is an argument, so it is part of the key.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import threading
import weakref
from typing import Any, Callable

import jax
import jax.extend.core
import numpy as np

__all__ = ["compile_once", "CacheInfo", "caches", "clear_all"]

MAX_ENTRIES = 64  # per function; the least recently used description is dropped beyond
_ARRAY = object()  # a leaf that is a jitted function's argument
_CACHES: weakref.WeakSet[_Cache] = weakref.WeakSet()  # every function's, while it lives


@dataclasses.dataclass(frozen=True)
class CacheInfo:
  """Counts of one :func:`compile_once` function since it was defined (or cleared).

  Attributes:
    entries: static descriptions held (each a jitted function).
    traces: times a jitted function was traced (each a compilation, per description and
      input shape).
    hits: eager calls served by a held description; misses: those that added one.
    bypassed: calls that ran the function directly (under a transformation, a traced or
      unhashable argument).
  """

  entries: int
  traces: int
  hits: int
  misses: int
  bypassed: int


def _at_top_level() -> bool:
  """Whether no transformation is tracing (JAX's current trace is its eval trace). Where JAX
  lacks the public function this reads, False: calls then run as they are (uncached)."""
  find = getattr(jax.extend.core, "find_top_trace", None)
  return find is not None and type(find(())).__name__ == "EvalTrace"


class _Cache:
  def __init__(self, fn: Callable, max_entries: int):
    self.fn = fn
    self.max_entries = max_entries
    self._entries: collections.OrderedDict[Any, Callable] = collections.OrderedDict()
    self._lock = threading.Lock()
    self.clear()

  def clear(self) -> None:
    with self._lock:
      self._entries.clear()
      self.traces = self.hits = self.misses = self.bypassed = 0

  def info(self) -> CacheInfo:
    return CacheInfo(len(self._entries), self.traces, self.hits, self.misses, self.bypassed)

  def _key(self, args, kwargs):
    """``(key, arrays)``, or None where the call must run as it is."""
    leaves, treedef = jax.tree_util.tree_flatten((args, kwargs))
    arrays, static = [], []
    for x in leaves:
      if isinstance(x, jax.core.Tracer):
        return None
      if isinstance(x, (jax.Array, np.ndarray)):
        arrays.append(x)
        static.append(_ARRAY)
      else:
        static.append((type(x), x))
    key = (treedef, tuple(static))
    try:
      hash(key)
    except TypeError:
      return None
    return key, arrays

  def __call__(self, *args, **kwargs):
    found = self._key(args, kwargs) if _at_top_level() else None
    if found is None:
      with self._lock:
        self.bypassed += 1
      return self.fn(*args, **kwargs)
    key, arrays = found
    with self._lock:
      jitted = self._entries.get(key)
      if jitted is None:
        self.misses += 1
        jitted = jax.jit(functools.partial(self._traced, key))
        self._entries[key] = jitted
        while len(self._entries) > self.max_entries:
          self._entries.popitem(last=False)
      else:
        self.hits += 1
        self._entries.move_to_end(key)
    return jitted(*arrays)

  def _traced(self, key, *arrays):
    with self._lock:
      self.traces += 1
    treedef, static = key
    it = iter(arrays)
    args, kwargs = jax.tree_util.tree_unflatten(treedef, [next(it) if s is _ARRAY else s[1] for s in static])
    return self.fn(*args, **kwargs)


def compile_once(fn: Callable | None = None, *, max_entries: int = MAX_ENTRIES):
  """``fn``, compiled once per static description when called eagerly (see the module
  docstring); usable as ``@compile_once`` or ``@compile_once(max_entries=...)``.

  The wrapper has ``cache_info()`` (a :class:`CacheInfo`), ``cache_clear()`` and
  ``__wrapped__`` (``fn`` itself).
  """
  if fn is None:
    return functools.partial(compile_once, max_entries=max_entries)
  cache = _Cache(fn, max_entries)
  _CACHES.add(cache)

  @functools.wraps(fn)
  def wrapper(*args, **kwargs):
    return cache(*args, **kwargs)
  wrapper.cache_info = cache.info
  wrapper.cache_clear = cache.clear
  return wrapper


def caches() -> dict[str, CacheInfo]:
  """Every :func:`compile_once` function's counts, by qualified name."""
  return {f"{c.fn.__module__}.{c.fn.__qualname__}": c.info() for c in _CACHES}


def clear_all() -> None:
  """Drops every held description (the next eager calls compile again)."""
  for c in _CACHES:
    c.clear()
