"""The diagonal band ``q + lower <= k <= q + upper``: causal masks and local windows.

Its bounds are static Python ints, so kernels bound their key loops at trace time and take the
band as two scalars (:attr:`Mask.band_bounds`).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from probjax.ops.attention.masks.base import Mask, Predicate, TileGrid, static_int


@dataclasses.dataclass(frozen=True)
class Band(Predicate):
  """``k >= q + lower`` and ``k <= q + upper`` (None: that side unbounded)."""

  lower: int | None = None
  upper: int | None = None

  kind = "band"
  fields = ("lower", "upper")

  @classmethod
  def from_fields(cls, lower=None, upper=None):
    for name, v in (("lower", lower), ("upper", upper)):
      if v is not None and (isinstance(v, bool) or not isinstance(v, (int, np.integer))):
        raise TypeError(f"Mask.{name} must be a Python int or None, got {type(v).__name__}")
    return None if lower is None and upper is None else cls(lower, upper)

  @property
  def components(self):
    return ("causal",) if self.lower is None else ("window",)

  def combine(self, other):
    pick = lambda a, b, f: a if b is None else b if a is None else f(a, b)
    return Band(pick(self.lower, other.lower, max), pick(self.upper, other.upper, min))

  def element(self, q_idx, k_idx, b):
    d = k_idx - q_idx
    if self.lower is None:
      return d <= self.upper
    if self.upper is None:
      return d >= self.lower
    return (d >= self.lower) & (d <= self.upper)

  def classify(self, grid: TileGrid):
    dmin, dmax = grid.ks - (grid.qe - 1), (grid.ke - 1) - grid.qs  # range of k - q in the tile
    any_ = full = True
    if self.lower is not None:
      any_, full = any_ & (dmax >= self.lower), full & (dmin >= self.lower)
    if self.upper is not None:
      any_, full = any_ & (dmin <= self.upper), full & (dmax <= self.upper)
    return any_, full

  def kv_range(self, q_start, q_end, kv_len):
    lo = 0 if self.lower is None else max(0, q_start + self.lower)
    hi = kv_len if self.upper is None else min(kv_len, q_end - 1 + self.upper + 1)
    return lo, hi

  def q_range(self, k_start, k_end, q_len):
    lo = 0 if self.upper is None else max(0, k_start - self.upper)
    hi = q_len if self.lower is None else min(q_len, k_end - 1 - self.lower + 1)
    return lo, hi

  def work_grows(self, *, by_q):
    if by_q:
      return self.upper is not None and self.lower is None
    return self.lower is not None and self.upper is None


def band(lower: int | None, upper: int | None) -> Mask:
  """The band ``q + lower <= k <= q + upper`` as a Mask (both None: no mask predicate)."""
  return Mask(lower=lower, upper=upper)


def CausalMask(offset: int = 0) -> Mask:  # noqa: N802 (mask types read as classes)
  """Key ``k`` is visible from query ``q`` iff ``k <= q + offset``.

  ``offset=0`` aligns the first query with the first key (as
  ``jax.nn.dot_product_attention(is_causal=True)``); for decoding with a
  cache use ``offset=kv_len - q_len`` (bottom-right alignment).

  Every int offset has that meaning, negative ones included: ``offset=-1`` is strictly
  causal (a query does not see its own key), and the first ``-offset`` queries see no key
  at all; such queries return zeros (and zero gradients), as every query without a visible
  key does. ``offset`` must be a Python int (TypeError otherwise: the band is static).
  """
  return Mask(Band(upper=static_int("offset", offset)))


def LocalWindowMask(left: int | None, right: int | None = 0, offset: int = 0) -> Mask:  # noqa: N802
  """Sliding window: ``q + offset - left <= k <= q + offset + right``.

  ``left=None`` (or ``right=None``) leaves that side unbounded. The default
  ``right=0`` is a causal window. ``left`` and ``right`` are window sizes: a negative one
  (a window that excludes its own centre) raises ValueError naming it, as does leaving both
  unbounded; ``offset`` shifts the window's centre and, as :func:`CausalMask`'s, may be any
  int (queries whose window holds no key return zeros).
  """
  if left is None and right is None:
    raise ValueError("LocalWindowMask: at least one of left, right must be an int")
  for name, v in (("left", left), ("right", right)):
    if v is not None and static_int(name, v) < 0:
      raise ValueError(f"LocalWindowMask: {name} must be >= 0 or None, got {v}")
  off = static_int("offset", offset)
  return Mask(Band(None if left is None else off - int(left), None if right is None else off + int(right)))
