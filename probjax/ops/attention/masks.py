"""Position masks: one frozen pytree type that every backend decomposes.

A :class:`Mask` is the conjunction of up to four position predicates on a
query index ``q`` and a key index ``k`` of batch element ``b``:

* a diagonal band ``q + lower <= k <= q + upper`` (causal, local window),
* per-batch query lengths ``q < q_lengths[b]``,
* per-batch key lengths ``k < kv_lengths[b]``,
* packed documents ``q_segment_ids[b, q] == kv_segment_ids[b, k]``.

Lengths are clamped to ``[0, q_len]`` / ``[0, kv_len]``: concrete out-of-range lengths raise
``ValueError``, traced ones (under ``jax.jit``) are clipped (:meth:`Mask.clamped`), on every
backend. Keys at or past ``kv_lengths[b]`` and queries at or past ``q_lengths[b]`` may hold any
values, NaN and inf included (a KV cache's unwritten tail): they never reach an output or a
gradient. Positions excluded only by the band or by segment ids must be finite, since a key
excluded for one query is read for another.

Backends use two views of it: :meth:`Mask.element` (the boolean predicate on
index grids) and :meth:`Mask.classify_tiles` (each ``block_q x block_k`` tile
is EMPTY, PARTIAL or FULL), so that empty tiles are skipped and full tiles
skip the element predicate. The band bounds are static Python ints, so a
kernel can also bound its key loop at trace time (:meth:`Mask.kv_range`).

The constructors :func:`CausalMask`, :func:`LocalWindowMask`,
:func:`KVLenMask`, :func:`LengthMask` and :func:`SegmentMask` build masks
that combine with ``&``; ``mask & dense_boolean_array`` is a :class:`MaskWithDense`,
which only ``dot_product_attention`` (on its XLA path) takes:

>>> import jax.numpy as jnp
>>> m = CausalMask() & KVLenMask(jnp.array([3, 2]))
>>> m.name
'causal&kv_lengths'
>>> m.dense(2, 3, 3)[1, 0].astype(int).tolist()  # batch 1: causal, keys 0..1 only
[[1, 0, 0], [1, 1, 0], [1, 1, 0]]
>>> m.classify_tiles(2, 4, 4, 2, 2)[0].tolist()  # [batch, q tiles, k tiles]: EMPTY 0, PARTIAL 1, FULL 2
[[1, 0], [2, 1]]
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

EMPTY, PARTIAL, FULL = 0, 1, 2


@dataclasses.dataclass(frozen=True)
class Mask:
  """Conjunction of position predicates; see the module docstring.

  Attributes:
    lower: static band bound, ``k >= q + lower`` (None: unbounded).
    upper: static band bound, ``k <= q + upper`` (None: unbounded).
    q_lengths: ``[batch]`` int32, valid queries per batch element, or None.
    kv_lengths: ``[batch]`` int32, valid keys per batch element, or None.
    q_segment_ids: ``[batch, q_len]`` int32 document ids, or None.
    kv_segment_ids: ``[batch, kv_len]`` int32 document ids, or None.
  """

  lower: int | None = None
  upper: int | None = None
  q_lengths: Any = None
  kv_lengths: Any = None
  q_segment_ids: Any = None
  kv_segment_ids: Any = None

  def __post_init__(self):
    for name in ("lower", "upper"):
      v = getattr(self, name)
      if v is not None and not isinstance(v, (int, np.integer)):
        raise TypeError(f"Mask.{name} must be a Python int or None, got {type(v).__name__}")
    if (self.q_segment_ids is None) != (self.kv_segment_ids is None):
      raise ValueError("Mask: q_segment_ids and kv_segment_ids must be given together")

  # numpy defers ``ndarray & mask`` to :meth:`__rand__` instead of looping over elements.
  __array_ufunc__ = None

  @property
  def ndim(self):
    # Flax's combine_masks (MultiHeadAttention with decode=True) reads ``mask.ndim`` before
    # densifying; a Mask has no dense form without the call's shapes, so say what works.
    raise AttributeError(DENSE_ONLY_MESSAGE)

  # -- combination -----------------------------------------------------------
  def __and__(self, other):
    if isinstance(other, MaskWithDense):
      return other & self
    if _is_dense(other):
      return MaskWithDense(self, other)
    if not isinstance(other, Mask):
      return NotImplemented
    if self.q_segment_ids is not None and other.q_segment_ids is not None:
      raise ValueError(
          "cannot combine two SegmentMasks: combine the segment ids into one "
          "pair of id arrays (e.g. id_a * num_ids_b + id_b) and pass one SegmentMask")
    pick = lambda a, b, f: a if b is None else b if a is None else f(a, b)
    return Mask(
        lower=pick(self.lower, other.lower, max),
        upper=pick(self.upper, other.upper, min),
        q_lengths=pick(self.q_lengths, other.q_lengths, jnp.minimum),
        kv_lengths=pick(self.kv_lengths, other.kv_lengths, jnp.minimum),
        q_segment_ids=pick(self.q_segment_ids, other.q_segment_ids, None),
        kv_segment_ids=pick(self.kv_segment_ids, other.kv_segment_ids, None),
    )

  __rand__ = __and__

  # -- properties used by dispatch -------------------------------------------
  @property
  def has_band(self) -> bool:
    return self.lower is not None or self.upper is not None

  @property
  def has_arrays(self) -> bool:
    """Whether any predicate depends on per-batch arrays (lengths or segment ids)."""
    return self.q_lengths is not None or self.kv_lengths is not None or self.q_segment_ids is not None

  def padded_segment_ids(self, batch: int, q_pad: int, kv_pad: int):
    """Segment ids as ``[batch, q_pad]`` / ``[batch, kv_pad]`` int32; padded positions get ids
    that match nothing (-1 for queries, -2 for keys)."""
    q_len, kv_len = self.q_segment_ids.shape[-1], self.kv_segment_ids.shape[-1]
    ids = lambda x, n: jnp.broadcast_to(jnp.asarray(x, jnp.int32), (batch, n))
    return (pad_axis(ids(self.q_segment_ids, q_len), 1, q_pad, -1),
            pad_axis(ids(self.kv_segment_ids, kv_len), 1, kv_pad, -2))

  @property
  def components(self) -> tuple[str, ...]:
    """Names of the active predicates, e.g. ``("causal", "kv_lengths")``."""
    out = []
    if self.upper is not None and self.lower is None:
      out.append("causal")
    elif self.has_band:
      out.append("window")
    if self.q_lengths is not None:
      out.append("q_lengths")
    if self.kv_lengths is not None:
      out.append("kv_lengths")
    if self.q_segment_ids is not None:
      out.append("segments")
    return tuple(out)

  @property
  def name(self) -> str:
    return "&".join(self.components) or "none"

  def is_causal(self, offset: int = 0) -> bool:
    """True iff the mask is exactly ``CausalMask(offset)``."""
    return self.components == ("causal",) and self.upper == offset

  def is_kv_lengths_only(self) -> bool:
    return self.components == ("kv_lengths",)

  # -- validation --------------------------------------------------------------
  def validate(self, batch: int, q_len: int, kv_len: int) -> None:
    """Raises ValueError if the mask's arrays do not fit ``[batch, q_len/kv_len]``."""
    def check(name, arr, shape, bound=None):
      if arr is None:
        return
      if not hasattr(arr, "shape") or not hasattr(arr, "dtype"):
        raise TypeError(f"mask.{name} must be an integer array of shape {shape}, got {type(arr).__name__}")
      if not jnp.issubdtype(arr.dtype, jnp.integer):
        raise TypeError(f"mask.{name} must have an integer dtype, got {arr.dtype}")
      if tuple(arr.shape) != shape:
        raise ValueError(f"mask.{name} must have shape {shape} (batch={batch}), got {tuple(arr.shape)}")
      if bound is not None and not isinstance(arr, jax.core.Tracer):
        a = np.asarray(arr)
        if a.size and (a.min() < 0 or a.max() > bound):
          raise ValueError(f"mask.{name} must lie in [0, {bound}], got values in [{a.min()}, {a.max()}]")
    check("q_lengths", self.q_lengths, (batch,), q_len)
    check("kv_lengths", self.kv_lengths, (batch,), kv_len)
    check("q_segment_ids", self.q_segment_ids, (batch, q_len))
    check("kv_segment_ids", self.kv_segment_ids, (batch, kv_len))

  def clamped(self, q_len: int, kv_len: int) -> "Mask":
    """The mask with its lengths clipped to ``[0, q_len]`` / ``[0, kv_len]``: what every
    backend computes for traced lengths out of range (concrete ones raise in :meth:`validate`)."""
    clip = lambda x, n: None if x is None else jnp.clip(x, 0, n).astype(jnp.int32)
    return dataclasses.replace(self, q_lengths=clip(self.q_lengths, q_len),
                               kv_lengths=clip(self.kv_lengths, kv_len))

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
      the mask has per-batch arrays).
    """
    ok = jnp.ones(jnp.broadcast_shapes(jnp.shape(q_idx), jnp.shape(k_idx)), bool)
    d = k_idx - q_idx
    if self.lower is not None:
      ok = ok & (d >= self.lower)
    if self.upper is not None:
      ok = ok & (d <= self.upper)

    def per_batch(arr):
      arr = jnp.asarray(arr)
      return arr[b] if b is not None else arr

    if self.q_lengths is not None:
      ql = per_batch(self.q_lengths)
      ok = ok & (q_idx < (ql if b is not None else ql[:, None, None]))
    if self.kv_lengths is not None:
      kl = per_batch(self.kv_lengths)
      ok = ok & (k_idx < (kl if b is not None else kl[:, None, None]))
    if self.q_segment_ids is not None:
      qs = per_batch(self.q_segment_ids)
      ks = per_batch(self.kv_segment_ids)
      qi = jnp.broadcast_to(q_idx, jnp.broadcast_shapes(jnp.shape(q_idx), jnp.shape(k_idx)))
      ki = jnp.broadcast_to(k_idx, qi.shape)
      if b is not None:
        ok = ok & (jnp.take(qs, qi, mode="clip") == jnp.take(ks, ki, mode="clip"))
      else:
        qsv = jnp.take(qs, qi.reshape(-1), axis=1, mode="clip").reshape((qs.shape[0],) + qi.shape)
        ksv = jnp.take(ks, ki.reshape(-1), axis=1, mode="clip").reshape((ks.shape[0],) + ki.shape)
        ok = ok & (qsv == ksv)
    return ok

  def dense(self, batch: int, q_len: int, kv_len: int):
    """The mask as a ``[batch, 1, q_len, kv_len]`` boolean array (for references)."""
    q = jnp.arange(q_len)[:, None]
    k = jnp.arange(kv_len)[None, :]
    return jnp.broadcast_to(self.element(q, k), (batch, q_len, kv_len))[:, None]

  # -- tiles -------------------------------------------------------------------
  def kv_range(self, q_start: int, q_end: int, kv_len: int) -> tuple[int, int]:
    """Static key range ``[lo, hi)`` that the band allows for queries ``[q_start, q_end)``."""
    lo = 0 if self.lower is None else max(0, q_start + self.lower)
    hi = kv_len if self.upper is None else min(kv_len, q_end - 1 + self.upper + 1)
    return lo, max(lo, hi)

  def q_range(self, k_start: int, k_end: int, q_len: int) -> tuple[int, int]:
    """Static query range ``[lo, hi)`` that the band allows for keys ``[k_start, k_end)``."""
    lo = 0 if self.upper is None else max(0, k_start - self.upper)
    hi = q_len if self.lower is None else min(q_len, k_end - 1 - self.lower + 1)
    return lo, max(lo, hi)

  def work_grows(self, *, by_q: bool) -> bool:
    """Whether the band gives later outer tiles more inner tiles (``by_q``: query tiles, whose
    keys a causal band grows; else key tiles, seen by more queries under a lower bound only).
    Schedules start the heaviest first from it."""
    if by_q:
      return self.upper is not None and self.lower is None
    return self.lower is not None and self.upper is None

  def classify_tiles(self, batch: int, q_len: int, kv_len: int, block_q: int, block_k: int):
    """Per-tile classification, ``[batch, ceil(q_len/block_q), ceil(kv_len/block_k)]`` int32.

    EMPTY (0): no element of the tile is allowed; PARTIAL (1): some are;
    FULL (2): all are (and the tile lies inside ``[q_len, kv_len]``). The
    classification is conservative: EMPTY and FULL are only claimed when
    proven, so a backend that applies the element mask on PARTIAL tiles and
    skips EMPTY ones is exact.
    """
    nq, nk = -(-q_len // block_q), -(-kv_len // block_k)
    qs = jnp.arange(nq)[:, None] * block_q           # [nq, 1]
    qe = jnp.minimum(qs + block_q, q_len)             # exclusive
    ks = jnp.arange(nk)[None, :] * block_k           # [1, nk]
    ke = jnp.minimum(ks + block_k, kv_len)
    # Tiles that overhang the arrays contain padding: never FULL.
    full = (qs + block_q <= q_len) & (ks + block_k <= kv_len)
    any_ = jnp.ones((nq, nk), bool)
    dmin, dmax = ks - (qe - 1), (ke - 1) - qs        # range of k - q in the tile
    if self.lower is not None:
      any_ &= dmax >= self.lower
      full &= dmin >= self.lower
    if self.upper is not None:
      any_ &= dmin <= self.upper
      full &= dmax <= self.upper
    full = jnp.broadcast_to(full, (batch, nq, nk))
    any_ = jnp.broadcast_to(any_, (batch, nq, nk))
    if self.q_lengths is not None:
      ql = jnp.broadcast_to(jnp.asarray(self.q_lengths), (batch,))[:, None, None]
      any_ = any_ & (qs[None] < ql)
      full = full & (qe[None] <= ql)
    if self.kv_lengths is not None:
      kl = jnp.broadcast_to(jnp.asarray(self.kv_lengths), (batch,))[:, None, None]
      any_ = any_ & (ks[None] < kl)
      full = full & (ke[None] <= kl)
    if self.q_segment_ids is not None:
      qmin, qmax = _block_min_max(jnp.broadcast_to(self.q_segment_ids, (batch, q_len)), block_q)
      kmin, kmax = _block_min_max(jnp.broadcast_to(self.kv_segment_ids, (batch, kv_len)), block_k)
      qmin, qmax = qmin[:, :, None], qmax[:, :, None]
      kmin, kmax = kmin[:, None, :], kmax[:, None, :]
      any_ = any_ & (qmin <= kmax) & (kmin <= qmax)
      full = full & (qmin == qmax) & (kmin == kmax) & (qmin == kmin)
    return jnp.where(any_, jnp.where(full, FULL, PARTIAL), EMPTY).astype(jnp.int32)


def _block_min_max(ids, block):
  """Per-block min and max of ``[batch, n]`` ids (padding ignored)."""
  b, n = ids.shape
  nb = -(-n // block)
  pad = nb * block - n
  lo = jnp.pad(ids, ((0, 0), (0, pad)), constant_values=jnp.iinfo(jnp.int32).max)
  hi = jnp.pad(ids, ((0, 0), (0, pad)), constant_values=jnp.iinfo(jnp.int32).min)
  return (lo.reshape(b, nb, block).min(-1), hi.reshape(b, nb, block).max(-1))


jax.tree_util.register_dataclass(
    Mask,
    data_fields=["q_lengths", "kv_lengths", "q_segment_ids", "kv_segment_ids"],
    meta_fields=["lower", "upper"],
)


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


# -- constructors ---------------------------------------------------------------
def CausalMask(offset: int = 0) -> Mask:  # noqa: N802 (mask types read as classes)
  """Key ``k`` is visible from query ``q`` iff ``k <= q + offset``.

  ``offset=0`` aligns the first query with the first key (as
  ``jax.nn.dot_product_attention(is_causal=True)``); for decoding with a
  cache use ``offset=kv_len - q_len`` (bottom-right alignment).
  """
  return Mask(upper=_int("offset", offset))


def LocalWindowMask(left: int | None, right: int | None = 0, offset: int = 0) -> Mask:  # noqa: N802
  """Sliding window: ``q + offset - left <= k <= q + offset + right``.

  ``left=None`` (or ``right=None``) leaves that side unbounded. The default
  ``right=0`` is a causal window.
  """
  if left is None and right is None:
    raise ValueError("LocalWindowMask: at least one of left, right must be an int")
  for name, v in (("left", left), ("right", right)):
    if v is not None and _int(name, v) < 0:
      raise ValueError(f"LocalWindowMask: {name} must be >= 0 or None, got {v}")
  off = _int("offset", offset)
  return Mask(lower=None if left is None else off - int(left), upper=None if right is None else off + int(right))


def KVLenMask(kv_lengths) -> Mask:  # noqa: N802
  """Per-batch key lengths: key ``k`` is valid iff ``k < kv_lengths[b]``; ``[batch]`` ints."""
  return Mask(kv_lengths=_int_array("kv_lengths", kv_lengths, 1))


def LengthMask(q_lengths, kv_lengths) -> Mask:  # noqa: N802
  """Per-batch query and key lengths (``[batch]`` ints each); padded queries return zeros."""
  return Mask(q_lengths=_int_array("q_lengths", q_lengths, 1),
              kv_lengths=_int_array("kv_lengths", kv_lengths, 1))


def SegmentMask(q_segment_ids, kv_segment_ids=None) -> Mask:  # noqa: N802
  """Packed documents: ``q`` sees ``k`` iff their segment ids are equal.

  Args:
    q_segment_ids: ``[batch, q_len]`` ints.
    kv_segment_ids: ``[batch, kv_len]`` ints; defaults to ``q_segment_ids``.
  """
  q = _int_array("q_segment_ids", q_segment_ids, 2)
  k = q if kv_segment_ids is None else _int_array("kv_segment_ids", kv_segment_ids, 2)
  return Mask(q_segment_ids=q, kv_segment_ids=k)


def _int(name, v) -> int:
  if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
    raise TypeError(f"{name} must be a Python int, got {type(v).__name__}")
  return int(v)


def _int_array(name, x, ndim):
  x = jnp.asarray(x)
  if not jnp.issubdtype(x.dtype, jnp.integer):
    raise TypeError(f"{name} must be an integer array, got dtype {x.dtype}")
  if x.ndim != ndim:
    shape = "[batch]" if ndim == 1 else "[batch, seq]"
    raise ValueError(f"{name} must have shape {shape}, got {tuple(x.shape)}")
  return x.astype(jnp.int32)


def ranges_from_classes(classes):
  """Per-batch inner tile ranges ``[batch, 4, n_outer]`` (lo, hi, full_lo, full_hi) from
  tile classes ``[batch, n_outer, n_inner]``.

  ``[lo, hi)`` spans every non-EMPTY tile (EMPTY ones inside it are computed with
  the element predicate, which is exact); ``[full_lo, full_hi)`` is the run of
  FULL tiles when they are contiguous (packed documents with sorted ids), else empty.
  """
  n = classes.shape[-1]
  first = lambda x: jnp.where(x.any(-1), jnp.argmax(x, -1), n)
  last = lambda x: jnp.where(x.any(-1), n - jnp.argmax(x[..., ::-1], -1), 0)
  live, full = classes != EMPTY, classes == FULL
  lo, hi = first(live), last(live)
  hi = jnp.maximum(lo, hi)
  flo, fhi = first(full), last(full)
  contiguous = full.sum(-1) == fhi - flo
  flo, fhi = jnp.where(contiguous, flo, lo), jnp.where(contiguous, fhi, lo)
  return jnp.stack([lo, hi, flo, fhi], axis=1).astype(jnp.int32)


def num_tiles(n: int, block: int) -> int:
  return math.ceil(n / block)


def round_up(n: int, m: int) -> int:
  """``n`` rounded up to a multiple of ``m``."""
  return num_tiles(n, m) * m


def pad_axis(x, axis: int, size: int, value=0, *, broadcast: bool = False):
  """Pads ``x`` along ``axis`` to ``size`` with ``value`` (no-op when already there); with
  ``broadcast``, a size-1 (broadcast) axis stays as it is."""
  n = x.shape[axis]
  if n == size or (broadcast and n == 1):
    return x
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, size - n)
  return jnp.pad(x, widths, constant_values=value)


def heavy_first_program(x, y, z, n_tiles: int, ny: int, nz: int, group: int):
  """``(tile, y, z)`` of the program at grid position ``(x, y, z)`` of an ``(n_tiles, ny, nz)``
  grid whose later tiles are heavier. The hardware starts programs in grid order (axis 0
  fastest): :func:`heavy_first_order` of the linear index runs the heaviest tiles of a group
  of (y, z) pairs first, so the grid ends on light programs while a group's streamed operands
  stay in L2; where that index arithmetic could overflow int32, heaviest first within each
  pair only."""
  pairs = ny * nz
  if max(n_tiles, -(-pairs // group)) * pairs >= 2**31:
    return n_tiles - 1 - x, y, z
  return heavy_first_order(x + n_tiles * (y + ny * z), n_tiles, ny, nz, group)


def heavy_first_order(n, n_tiles: int, ny: int, nz: int, group: int):
  """``(tile, y, z)`` of the ``n``-th program: the (y, z) pairs (y fastest) in
  ``ceil(pairs / group)`` groups of near-equal size (a small last group would end the kernel
  on a few heavy programs), in turn, each taking tile ``n_tiles - 1`` of every pair, then
  ``n_tiles - 2``, ..."""
  pairs = ny * nz
  n_groups = -(-pairs // group)
  first = lambda c: c * pairs // n_groups  # the group's first pair
  done = n // n_tiles  # whole pairs' worth of programs before this one
  c = ((done + 1) * n_groups + pairs - 1) // pairs - 1
  start, size = first(c), first(c + 1) - first(c)
  r = n - start * n_tiles
  pair = start + r % size
  return n_tiles - 1 - r // size, pair % ny, pair // ny
