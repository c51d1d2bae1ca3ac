"""The predicate contract, its registry, and :class:`Mask`, the conjunction of predicates.

A :class:`Predicate` is one kind of position predicate on query ``q`` and key ``k`` of batch
element ``b`` (a band, lengths, segment ids, ...). It declares everything a backend needs
once: the element function, the tile classification, its static key/query ranges, how its
arrays are validated, clamped and padded, and the operands a kernel reads. :class:`Mask`
combines one predicate per kind and answers every backend question through those methods;
backends never read a predicate's fields.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, ClassVar, Iterable

import jax
import jax.numpy as jnp
import numpy as np

EMPTY, PARTIAL, FULL = 0, 1, 2

PREDICATES: dict[str, type[Predicate]] = {}
# What a bare function becomes in ``mask & fn`` (masks/__init__.py registers MaskMod: a
# ``mask_mod(b, h, q_idx, kv_idx)`` function), so that this module imports no predicate.
_FROM_CALLABLE: list[Callable] = []


def register_callable(factory: Callable) -> None:
  """Sets what ``mask & fn`` makes of a function ``fn`` (``factory(fn)``: a Mask)."""
  _FROM_CALLABLE[:] = [factory]


def register(*classes: type[Predicate]) -> None:
  """Adds predicate kinds (masks name their components in registration order) and registers
  each as a pytree: the arrays named in ``roles`` are its leaves, the other fields static."""
  for cls in classes:
    if cls.kind in PREDICATES:
      raise ValueError(f"mask predicate kind {cls.kind!r} is registered already")
    taken = {f for c in PREDICATES.values() for f in c.fields}
    if taken & set(cls.fields):
      raise ValueError(f"mask predicate {cls.kind!r}: fields {sorted(taken & set(cls.fields))} are taken")
    PREDICATES[cls.kind] = cls
    names = [f.name for f in dataclasses.fields(cls)]
    jax.tree_util.register_dataclass(cls, data_fields=list(cls.roles),
                                     meta_fields=[n for n in names if n not in cls.roles])


@dataclasses.dataclass(frozen=True)
class TileGrid:
  """The ``block_q x block_k`` tiles of a ``[q_len, kv_len]`` score matrix: tile ``(i, j)``
  holds queries ``[qs[i], qe[i])`` and keys ``[ks[j], ke[j])`` (``qs``/``qe`` ``[nq, 1]``,
  ``ks``/``ke`` ``[1, nk]``; the last tile of an axis may overhang it)."""

  batch: int
  q_len: int
  kv_len: int
  block_q: int
  block_k: int

  @property
  def nq(self) -> int:
    return -(-self.q_len // self.block_q)

  @property
  def nk(self) -> int:
    return -(-self.kv_len // self.block_k)

  @property
  def qs(self):
    return jnp.arange(self.nq)[:, None] * self.block_q

  @property
  def qe(self):
    return jnp.minimum(self.qs + self.block_q, self.q_len)

  @property
  def ks(self):
    return jnp.arange(self.nk)[None, :] * self.block_k

  @property
  def ke(self):
    return jnp.minimum(self.ks + self.block_k, self.kv_len)


class Predicate:
  """One kind of position predicate; subclasses are frozen dataclasses, listed in the registry
  (``masks/__init__.py``). Static parameters (Python ints) are plain fields, arrays are the
  fields named in ``roles``.

  Class attributes:
    kind: the registry name, e.g. ``"band"``.
    fields: the :class:`Mask` keywords and attributes it answers (``Mask(lower=...)``,
      ``mask.lower``: the compatibility view; backends use the methods).
    roles: its arrays, by field name, each with its batch role for sharding: ``"b"``
      ``[batch]``, ``"bt"`` ``[batch, q_len]``, ``"bs"`` ``[batch, kv_len]``.
  """

  kind: ClassVar[str]
  fields: ClassVar[tuple[str, ...]]
  roles: ClassVar[dict[str, str]] = {}
  # The query heads of a predicate that differs per head (None: the same for every head). Such
  # a predicate's element has a head axis before the position axes: ``[heads, ...]`` for a
  # scalar ``b``, ``[batch|1, heads, ...]`` for ``b=None``.
  heads: ClassVar[int | None] = None

  @classmethod
  def from_fields(cls, **values) -> Predicate | None:
    """The predicate of ``Mask(**values)`` (None if every value is None)."""
    return None if all(v is None for v in values.values()) else cls(**values)

  @property
  def components(self) -> tuple[str, ...]:
    return (self.kind,)

  def combine(self, other: Predicate) -> Predicate:
    """The conjunction with another predicate of the same kind."""
    raise ValueError(f"cannot combine two {self.kind} mask predicates")

  def element(self, q_idx, k_idx, b):
    """Boolean predicate on broadcastable index arrays (``b``: see :meth:`Mask.element`)."""
    raise NotImplementedError

  def classify(self, grid: TileGrid):
    """``(any, full)``: booleans broadcastable to ``[batch, nq, nk]``, whether some / every
    element of each tile of ``grid`` is allowed. Conservative: True for ``any`` and False for
    ``full`` where not proven."""
    raise NotImplementedError

  def kv_range(self, q_start: int, q_end: int, kv_len: int) -> tuple[int, int]:
    """Static key range ``[lo, hi)`` allowed for queries ``[q_start, q_end)``."""
    return 0, kv_len

  def q_range(self, k_start: int, k_end: int, q_len: int) -> tuple[int, int]:
    """Static query range ``[lo, hi)`` allowed for keys ``[k_start, k_end)``."""
    return 0, q_len

  def work_grows(self, *, by_q: bool) -> bool:
    """Whether later outer tiles have more inner tiles (see :meth:`Mask.work_grows`)."""
    return False

  def validate(self, batch: int, q_len: int, kv_len: int) -> None:
    """Raises if the arrays do not fit the call (see :func:`check_array`)."""

  def clamped(self, q_len: int, kv_len: int) -> Predicate:
    """The predicate with traced out-of-range values clipped to what the call allows."""
    return self

  def padded(self, batch: int, q_pad: int, kv_pad: int) -> Predicate:
    """The predicate on ``q_pad`` queries and ``kv_pad`` keys, arrays broadcast to ``batch``,
    padded positions matching what they matched before padding or nothing."""
    return self

  def operands(self, batch: int, q_pad: int | None, kv_pad: int | None) -> tuple:
    """The int32 arrays a kernel reads, broadcast to ``batch`` and, per position, padded to
    ``q_pad``/``kv_pad`` (None: unpadded)."""
    return ()

  def tile_function(self, q_shape: tuple, k_shape: tuple) -> TileFunction | None:
    """The predicate as a kernel traces it in its body, on index arrays of ``q_shape`` /
    ``k_shape`` with scalar batch and query-head indices (:class:`TileFunction`); None where
    kernels compute it from :meth:`operands` (every kind but a mask_mod)."""
    return None


@dataclasses.dataclass(frozen=True, eq=False)
class TileFunction:
  """A predicate traced once on one tile's index shapes, for a kernel to evaluate in its body:
  ``jaxpr`` maps ``(b, h, q_idx, k_idx)`` (int32: scalar batch element and query head, index
  arrays of the traced shapes) to a bool tile. ``consts`` are the arrays the function closes
  over (concrete or traced); a kernel cannot capture arrays, so it takes them as operands and
  passes them back, read inside the kernel, to :meth:`__call__`."""

  jaxpr: Any
  consts: tuple

  def __call__(self, consts, b, h, q_idx, k_idx):
    return jax.core.eval_jaxpr(self.jaxpr, list(consts), b, h, q_idx, k_idx)[0]


@dataclasses.dataclass(frozen=True, init=False)
class Mask:
  """Conjunction of position predicates, at most one of each registered kind.

  ``Mask(*predicates, **fields)``: predicates, or their fields as keywords (``Mask(lower=-4,
  upper=0)``, ``Mask(kv_lengths=lengths)``); the constructors in :mod:`probjax.masks` are the
  usual way. A predicate's fields read as attributes (``mask.kv_lengths``; None where the mask
  has no such predicate).
  """

  predicates: tuple[Predicate, ...]

  def __init__(self, *predicates: Predicate, **fields):
    found = list(predicates)
    for cls in PREDICATES.values():
      if any(f in fields for f in cls.fields):
        p = cls.from_fields(**{f: fields.pop(f, None) for f in cls.fields})
        if p is not None:
          found.append(p)
    if fields:
      raise TypeError(f"Mask got unexpected keyword arguments {sorted(fields)}")
    by_kind: dict[str, Predicate] = {}
    for p in found:
      by_kind[p.kind] = by_kind[p.kind].combine(p) if p.kind in by_kind else p
    order = list(PREDICATES)
    object.__setattr__(self, "predicates", tuple(sorted(by_kind.values(), key=lambda p: order.index(p.kind))))

  @classmethod
  def _of(cls, predicates: Iterable[Predicate]) -> Mask:
    out = object.__new__(cls)
    object.__setattr__(out, "predicates", tuple(predicates))
    return out

  def __getattr__(self, name):
    # Reached only for names the class lacks: the registered predicates' fields.
    if name == "ndim":
      # Flax's combine_masks (MultiHeadAttention with decode=True) reads ``mask.ndim`` before
      # densifying; a Mask has no dense form without the call's shapes, so say what works.
      raise AttributeError(DENSE_ONLY_MESSAGE)
    if not name.startswith("_") and name != "predicates":
      for cls in PREDICATES.values():
        if name in cls.fields:
          p = self.get(cls.kind)
          return None if p is None else getattr(p, name)
    raise AttributeError(f"'Mask' object has no attribute {name!r}")

  # numpy defers ``ndarray & mask`` to :meth:`__rand__` instead of looping over elements.
  __array_ufunc__ = None

  # -- combination -----------------------------------------------------------
  def __and__(self, other):
    if isinstance(other, MaskWithDense):
      return other & self
    if _is_dense(other):
      return MaskWithDense(self, other)
    if not isinstance(other, Mask) and callable(other) and _FROM_CALLABLE:
      other = _FROM_CALLABLE[0](other)  # a mask_mod(b, h, q_idx, kv_idx), the same for every b and h
    if not isinstance(other, Mask):
      return NotImplemented
    return Mask(*self.predicates, *other.predicates)

  __rand__ = __and__

  # -- what the mask holds ---------------------------------------------------
  @property
  def kinds(self) -> tuple[str, ...]:
    """The kinds of its predicates, in registry order."""
    return tuple(p.kind for p in self.predicates)

  def get(self, kind: str) -> Predicate | None:
    """The predicate of ``kind``, or None."""
    return next((p for p in self.predicates if p.kind == kind), None)

  @property
  def has_band(self) -> bool:
    return "band" in self.kinds

  @property
  def heads(self) -> int | None:
    """The query heads the mask is defined for, where it differs per head (a
    :func:`~probjax.ops.attention.masks.MaskMod` reading ``h``); None: the same for all."""
    return next((p.heads for p in self.predicates if p.heads is not None), None)

  @property
  def has_arrays(self) -> bool:
    """Whether any predicate depends on per-batch arrays."""
    return any(p.roles for p in self.predicates)

  @property
  def components(self) -> tuple[str, ...]:
    """Names of the active predicates, e.g. ``("causal", "kv_lengths")``."""
    return tuple(c for p in self.predicates for c in p.components)

  @property
  def name(self) -> str:
    return "&".join(self.components) or "none"

  def is_causal(self, offset: int = 0) -> bool:
    """True iff the mask is exactly ``CausalMask(offset)``."""
    return self.components == ("causal",) and self.band_bounds[1] == offset

  def is_kv_lengths_only(self) -> bool:
    return self.components == ("kv_lengths",)

  def refusal(self, kinds: Iterable[str], who: str) -> str | None:
    """Why ``who``, which computes the predicate kinds ``kinds``, cannot take the mask, or None."""
    kinds = tuple(kinds)
    other = [p.kind for p in self.predicates if p.kind not in kinds]
    if not other:
      return None
    return (f"mask predicate {other[0]!r} ({who} computes {', '.join(kinds)}; the XLA path "
            "computes every predicate)")

  # -- what the kernels read -------------------------------------------------
  @property
  def band(self) -> Mask:
    """The static diagonal band alone (no arrays: usable at trace time)."""
    return Mask._of(p for p in self.predicates if p.kind == "band")

  @property
  def band_bounds(self) -> tuple[int | None, int | None]:
    """``(lower, upper)``: the band ``q + lower <= k <= q + upper`` as static ints (None: unbounded)."""
    p = self.get("band")
    return (None, None) if p is None else (p.lower, p.upper)

  def operands(self, batch: int, q_pad: int | None = None, kv_pad: int | None = None) -> dict[str, tuple]:
    """Per predicate kind with arrays, the int32 arrays a kernel reads (:meth:`Predicate.operands`)."""
    return {p.kind: ops for p in self.predicates if (ops := p.operands(batch, q_pad, kv_pad))}

  def tile_function(self, q_shape: tuple, k_shape: tuple) -> TileFunction | None:
    """The predicate a kernel traces in its body (:meth:`Predicate.tile_function`: a mask_mod),
    or None; at most one kind has one."""
    fns = [f for p in self.predicates if (f := p.tile_function(q_shape, k_shape)) is not None]
    return fns[0] if fns else None

  def lengths(self, batch: int):
    """``(q_lengths, kv_lengths)``: ``[batch]`` int32 each, or None where the mask has none."""
    ops = lambda kind: None if self.get(kind) is None else self.get(kind).operands(batch, None, None)[0]
    return ops("q_lengths"), ops("kv_lengths")

  def padded_segment_ids(self, batch: int, q_pad: int, kv_pad: int):
    """Segment ids as ``[batch, q_pad]`` / ``[batch, kv_pad]`` int32; padded positions get ids
    that match nothing (-1 for queries, -2 for keys)."""
    return self.get("segments").operands(batch, q_pad, kv_pad)

  def padded(self, batch: int, q_pad: int, kv_pad: int) -> Mask:
    """The mask on ``q_pad`` queries and ``kv_pad`` keys (:meth:`Predicate.padded`)."""
    return Mask._of(p.padded(batch, q_pad, kv_pad) for p in self.predicates)

  def arrays(self) -> tuple[tuple[str, Any], ...]:
    """``(role, array)`` of every per-batch array (roles as :class:`Predicate` ``roles``)."""
    return tuple((role, getattr(p, n)) for p in self.predicates for n, role in p.roles.items())

  def with_arrays(self, arrays: Iterable) -> Mask:
    """The mask with its arrays replaced, in the order of :meth:`arrays`."""
    it = iter(arrays)
    return Mask._of(dataclasses.replace(p, **{n: next(it) for n in p.roles}) for p in self.predicates)

  # -- validation --------------------------------------------------------------
  def validate(self, batch: int, q_len: int, kv_len: int) -> None:
    """Raises ValueError if the mask's arrays do not fit ``[batch, q_len/kv_len]``."""
    for p in self.predicates:
      p.validate(batch, q_len, kv_len)

  def clamped(self, q_len: int, kv_len: int) -> Mask:
    """The mask with its lengths clipped to ``[0, q_len]`` / ``[0, kv_len]``: what every
    backend computes for traced lengths out of range (concrete ones raise in :meth:`validate`)."""
    return Mask._of(p.clamped(q_len, kv_len) for p in self.predicates)

  # -- element predicate -------------------------------------------------------
  def element(self, q_idx, k_idx, b=None):
    """Boolean predicate on broadcastable index arrays.

    Args:
      q_idx: query positions, e.g. ``[..., tq, 1]``.
      k_idx: key positions, e.g. ``[..., 1, tk]``.
      b: batch index (scalar) for the per-batch arrays; None means the arrays
        are used with their leading batch axis, broadcast as ``[batch, 1, 1]``
        against ``[tq, tk]`` indices.
    Returns:
      bool array of the broadcast shape (``[batch, tq, tk]`` when b is None and
      the mask has per-batch arrays). A mask that differs per query head (:attr:`heads`; then
      ``q_idx``/``k_idx`` are 2-D) has a head axis: ``[heads, tq, tk]`` for a scalar ``b``,
      ``[batch|1, heads, tq, tk]`` for ``b=None``.
    """
    shape = jnp.broadcast_shapes(jnp.shape(q_idx), jnp.shape(k_idx))
    ok = jnp.ones(shape, bool)
    per_head = self.heads is not None
    for p in self.predicates:
      e = p.element(q_idx, k_idx, b)
      if per_head and p.heads is None and b is None and jnp.ndim(e) == len(shape) + 1:
        e = e[:, None]  # [batch, tq, tk] against [batch|1, heads, tq, tk]
      ok = ok & e
    if per_head and b is None:
      ok = ok.reshape((1,) * (len(shape) + 2 - ok.ndim) + ok.shape)
    return ok

  def dense(self, batch: int, q_len: int, kv_len: int):
    """The mask as a ``[batch, 1, q_len, kv_len]`` boolean array (for references);
    ``[batch, heads, q_len, kv_len]`` for a mask that differs per query head (:attr:`heads`)."""
    q = jnp.arange(q_len)[:, None]
    k = jnp.arange(kv_len)[None, :]
    if self.heads is not None:
      return jnp.broadcast_to(self.element(q, k), (batch, self.heads, q_len, kv_len))
    return jnp.broadcast_to(self.element(q, k), (batch, q_len, kv_len))[:, None]

  # -- tiles -------------------------------------------------------------------
  def kv_range(self, q_start: int, q_end: int, kv_len: int) -> tuple[int, int]:
    """Static key range ``[lo, hi)`` that the mask allows for queries ``[q_start, q_end)``."""
    lo, hi = 0, kv_len
    for p in self.predicates:
      a, b = p.kv_range(q_start, q_end, kv_len)
      lo, hi = max(lo, a), min(hi, b)
    return lo, max(lo, hi)

  def q_range(self, k_start: int, k_end: int, q_len: int) -> tuple[int, int]:
    """Static query range ``[lo, hi)`` that the mask allows for keys ``[k_start, k_end)``."""
    lo, hi = 0, q_len
    for p in self.predicates:
      a, b = p.q_range(k_start, k_end, q_len)
      lo, hi = max(lo, a), min(hi, b)
    return lo, max(lo, hi)

  def work_grows(self, *, by_q: bool) -> bool:
    """Whether the band gives later outer tiles more inner tiles (``by_q``: query tiles, whose
    keys a causal band grows; else key tiles, seen by more queries under a lower bound only).
    Schedules start the heaviest first from it."""
    return any(p.work_grows(by_q=by_q) for p in self.predicates)

  def classify_tiles(self, batch: int, q_len: int, kv_len: int, block_q: int, block_k: int):
    """Per-tile classification, ``[batch, ceil(q_len/block_q), ceil(kv_len/block_k)]`` int32.

    EMPTY (0): no element of the tile is allowed; PARTIAL (1): some are;
    FULL (2): all are (and the tile lies inside ``[q_len, kv_len]``). The
    classification is conservative: EMPTY and FULL are only claimed when
    proven, so a backend that applies the element mask on PARTIAL tiles and
    skips EMPTY ones is exact.
    """
    g = TileGrid(batch, q_len, kv_len, block_q, block_k)
    # Tiles that overhang the arrays contain padding: never FULL.
    full = (g.qs + block_q <= q_len) & (g.ks + block_k <= kv_len)
    any_ = jnp.ones((g.nq, g.nk), bool)
    for p in self.predicates:
      a, f = p.classify(g)
      any_, full = any_ & a, full & f
    full = jnp.broadcast_to(full, (batch, g.nq, g.nk))
    any_ = jnp.broadcast_to(any_, (batch, g.nq, g.nk))
    return jnp.where(any_, jnp.where(full, FULL, PARTIAL), EMPTY).astype(jnp.int32)


jax.tree_util.register_pytree_node(Mask, lambda m: (m.predicates, None), lambda _, ps: Mask._of(ps))


# -- helpers for predicates ------------------------------------------------------
def per_batch(arr, b):
  """A ``[batch]`` array for the element function: entry ``b``, or with ``b`` None the whole
  array as ``[batch, 1, 1]`` (against ``[tq, tk]`` indices)."""
  arr = jnp.asarray(arr)
  return arr[b] if b is not None else arr[:, None, None]


def per_tile(arr, batch: int):
  """A ``[batch]`` array as ``[batch, 1, 1]``, against a tile grid's ``[nq, nk]``."""
  return jnp.broadcast_to(jnp.asarray(arr), (batch,))[:, None, None]


def check_array(name: str, arr, shape: tuple, bound: int | None = None) -> None:
  """Raises unless ``arr`` is an integer array of ``shape`` (``shape[0]`` is the batch) whose
  concrete values lie in ``[0, bound]`` (no bound: any)."""
  if not hasattr(arr, "shape") or not hasattr(arr, "dtype"):
    raise TypeError(f"mask.{name} must be an integer array of shape {shape}, got {type(arr).__name__}")
  if not jnp.issubdtype(arr.dtype, jnp.integer):
    raise TypeError(f"mask.{name} must have an integer dtype, got {arr.dtype}")
  if tuple(arr.shape) != shape:
    raise ValueError(f"mask.{name} must have shape {shape} (batch={shape[0]}), got {tuple(arr.shape)}")
  if bound is not None and not isinstance(arr, jax.core.Tracer):
    a = np.asarray(arr)
    if a.size and (a.min() < 0 or a.max() > bound):
      raise ValueError(f"mask.{name} must lie in [0, {bound}], got values in [{a.min()}, {a.max()}]")


def static_int(name, v) -> int:
  if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
    raise TypeError(f"{name} must be a Python int, got {type(v).__name__}")
  return int(v)


def int_array(name, x, ndim):
  x = jnp.asarray(x)
  if not jnp.issubdtype(x.dtype, jnp.integer):
    raise TypeError(f"{name} must be an integer array, got dtype {x.dtype}")
  if x.ndim != ndim:
    shape = "[batch]" if ndim == 1 else "[batch, seq]"
    raise ValueError(f"{name} must have shape {shape}, got {tuple(x.shape)}")
  return x.astype(jnp.int32)


# -- dense masks -----------------------------------------------------------------
DENSE_ONLY_MESSAGE = (
    "a probjax Mask has no dense form (no ndim) without the call's shapes. With "
    "flax.nnx.MultiHeadAttention(decode=True), Flax already restricts the query to the cached keys "
    "(key index <= cache index) with a dense mask it builds: pass mask=None (or a dense boolean "
    "[batch, 1, 1, max_length] padding mask). For structured masks while decoding (KVLenMask over a "
    "KV cache, the kernels' split-KV decoding), use probjax.nn.layers.multi_head_attention."
    "MultiHeadAttention with probjax.nn.layers.kv_cache.KVCache")


def _is_dense(x) -> bool:
  """A dense mask operand of ``&``: an array (numpy, JAX or a tracer), not a Mask."""
  return isinstance(x, (np.ndarray, jax.Array, jax.core.Tracer, np.bool_))


@dataclasses.dataclass(frozen=True)
class MaskWithDense:
  """``mask & dense``: a :class:`Mask` and a dense boolean array (True = attend) broadcastable
  to ``[batch..., heads, q_len, kv_len]``, both required.

  Built by ``&`` of a Mask and an array (either order). :func:`dot_product_attention` takes it
  and runs the XLA path (the kernels take no dense mask), exactly; flex_attention refuses it.
  """

  mask: Mask
  dense: Any

  __array_ufunc__ = None

  @property
  def ndim(self):
    raise AttributeError(DENSE_ONLY_MESSAGE)

  def __and__(self, other):
    if isinstance(other, MaskWithDense):
      return MaskWithDense(self.mask & other.mask, jnp.logical_and(self.dense, other.dense))
    if isinstance(other, Mask):
      return MaskWithDense(self.mask & other, self.dense)
    if _is_dense(other):
      return MaskWithDense(self.mask, jnp.logical_and(self.dense, other))
    return NotImplemented

  __rand__ = __and__


jax.tree_util.register_dataclass(MaskWithDense, data_fields=["mask", "dense"], meta_fields=[])
