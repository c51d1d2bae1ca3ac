"""A position predicate given as a function: ``mask_mod(b, h, q_idx, kv_idx) -> bool``, as
PyTorch flex_attention's ``mask_mod``.

The function is traced on index arrays (int32, broadcastable to each other) and returns True
where query ``q_idx`` of batch element ``b`` and query head ``h`` attends to key ``kv_idx``.
It is the element predicate of the mask (:meth:`Mask.element`); its tile classification (the
block mask of flex's ``create_block_mask``) is the function evaluated once on the whole
``[batch|1, heads|1, q_len, kv_len]`` grid, at trace time, where it depends on no traced
value: each ``block_q x block_k`` tile is EMPTY (skipped), FULL (computed without the
predicate) or PARTIAL. A function of traced values (closing over arrays passed to
``jax.jit``) is exact too, with every tile PARTIAL.

``batch=None`` / ``heads=None`` mean the function is the same for every batch element / query
head (flex's ``B=None`` / ``H=None``): it is called with ``b = 0`` / ``h = 0``, and a function
seen to read ``b`` (``h``) without them raises ValueError. Where it depends on the query head,
the mask has a head axis (:attr:`Mask.heads`). Under grouped-query attention ``h`` is the
query head; its key/value head is ``h // (heads // kv_heads)``.

Which paths compute it:

* the XLA path (dense and flash formulations), always: the flash loop skips EMPTY tiles and
  computes FULL ones without the function;
* the Pallas-Triton kernel (``implementation="triton"``; forward, every backward pass and the
  fused jvp): the function is traced once per kernel on its tile's index arrays
  (:meth:`MaskModPredicate.tile_function`) and evaluated in the kernel body on PARTIAL tiles;
  the kernel loops over per-batch lists of the tile classes, so EMPTY tiles are never loaded and
  FULL ones run without it. Scalars the function closes over (a traced window, a flag) become
  kernel operands. Its ``supports`` refuses, with the reason, a function that closes over an
  array of more than one element (reading it per position is a gather: ``SegmentMask`` is the
  kernel's document mask) or uses an operation Pallas Triton cannot lower. Its split-KV decoding
  forward does not compute it (the regular forward does);
* not the Mosaic GPU kernel nor cuDNN: they refuse the predicate by name.

The default dispatch keeps a mask_mod on the XLA path (``explain_dispatch`` says so); ask for
the Triton kernel with ``implementation="triton"``.

Define the function once, not per call: it is part of the mask's static description, compared
by identity, so a new function is a new compilation.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from probjax.ops.attention.masks.base import Mask, Predicate, TileFunction, TileGrid

# Grid elements evaluated per step of the tile classification (its memory, not its result).
_CHUNK = 1 << 24


@dataclasses.dataclass(frozen=True)
class MaskModPredicate(Predicate):
  """``mask_mod(b, h, q_idx, kv_idx)``; ``batch``/``heads``: the batch size / query heads it is
  defined for (None: the same for all, called with 0)."""

  mask_mod: Callable | None = None
  batch: int | None = None
  heads: int | None = None

  kind = "mask_mod"
  fields = ("mask_mod",)

  @classmethod
  def from_fields(cls, mask_mod=None):
    return None if mask_mod is None else _predicate(mask_mod, None, None)

  def combine(self, other):
    return MaskModPredicate(_And(self.mask_mod, other.mask_mod), _same("batch", self.batch, other.batch),
                            _same("heads", self.heads, other.heads))

  def _call(self, b, h, q_idx, k_idx):
    i32 = lambda x: jnp.asarray(x, jnp.int32)
    out = self.mask_mod(i32(b), i32(h), i32(q_idx), i32(k_idx))
    return jnp.asarray(out).astype(bool)

  def element(self, q_idx, k_idx, b):
    nd = max(jnp.ndim(q_idx), jnp.ndim(k_idx))
    shape = jnp.broadcast_shapes(jnp.shape(q_idx), jnp.shape(k_idx))
    hh, lead = 0, ()
    if self.heads is not None:
      hh, lead = jnp.arange(self.heads).reshape((-1,) + (1,) * nd), (self.heads,)
    bb = 0
    if self.batch is not None:
      if b is None:
        bb = jnp.arange(self.batch).reshape((-1,) + (1,) * (len(lead) + nd))
        lead = (self.batch,) + lead
      else:
        bb = b
    return jnp.broadcast_to(self._call(bb, hh, q_idx, k_idx), lead + shape)

  def classify(self, grid: TileGrid):
    batch = 1 if self.batch is None else grid.batch
    classes = _tile_classes(self, batch, grid.q_len, grid.kv_len, grid.block_q, grid.block_k)
    if classes is None:  # the function depends on traced values: every tile PARTIAL
      return True, False
    return jnp.asarray(classes[0]), jnp.asarray(classes[1])

  def tile_function(self, q_shape, k_shape):
    # Traced here, outside the kernel: a kernel cannot capture the arrays the function closes
    # over, so they become its operands (TileFunction.consts).
    i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)
    shape = jnp.broadcast_shapes(tuple(q_shape), tuple(k_shape))

    def on_tile(b, h, q_idx, k_idx):  # b / h as element() passes them: 0 where not defined per b / h
      b = b if self.batch is not None else 0
      h = h if self.heads is not None else 0
      return jnp.broadcast_to(self._call(b, h, q_idx, k_idx), shape)

    closed = jax.make_jaxpr(on_tile)(i32(), i32(), i32(*q_shape), i32(*k_shape))
    return TileFunction(closed.jaxpr, tuple(closed.consts))

  def validate(self, batch, q_len, kv_len):
    if self.batch is not None and self.batch != batch:
      raise ValueError(f"MaskMod was built for batch={self.batch}, but the call has batch {batch}")


@dataclasses.dataclass(frozen=True)
class _And:
  """``f & g`` of two mask_mods (a value: equal for equal parts, so that equal masks share a
  compilation)."""

  f: Callable
  g: Callable

  def __call__(self, b, h, q_idx, kv_idx):
    return jnp.asarray(self.f(b, h, q_idx, kv_idx)).astype(bool) & jnp.asarray(self.g(b, h, q_idx, kv_idx)).astype(bool)


def _same(name, a, b):
  if a is not None and b is not None and a != b:
    raise ValueError(f"cannot combine MaskMods built for {name}={a} and {name}={b}")
  return a if b is None else b


def reads(mask_mod: Callable) -> tuple[bool, bool] | None:
  """``(reads b, reads h)``: whether ``mask_mod``'s result varies in shape with its batch / head
  index (it reads them), from one abstract evaluation; None where that evaluation fails (a
  function that branches on index values in Python), which leaves the caller's word."""
  s = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)
  try:
    out = jax.eval_shape(mask_mod, s(3, 1), s(5), s(), s())
  except Exception:  # noqa: BLE001 -- any failure: no evidence either way
    return None
  shape = tuple(getattr(out, "shape", ()))
  shape = (1,) * (2 - len(shape)) + shape if len(shape) <= 2 else shape
  return shape[-2] == 3, shape[-1] == 5


def _predicate(mask_mod, batch, heads) -> MaskModPredicate:
  if not callable(mask_mod):
    raise TypeError(f"mask_mod must be callable f(b, h, q_idx, kv_idx) -> bool, got {type(mask_mod).__name__}")
  for name, v in (("batch", batch), ("heads", heads)):
    if v is not None and (isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1):
      raise TypeError(f"MaskMod's {name} must be a positive Python int or None, got {v!r}")
  seen = reads(mask_mod)
  if seen is not None:
    for name, arg, read, v in (("batch", "b", seen[0], batch), ("heads", "h", seen[1], heads)):
      if read and v is None:
        raise ValueError(f"this mask_mod reads its {arg} argument: pass MaskMod(fn, {name}=...) (the call's "
                         f"{name}), or the mask to dot_product_attention / flex_attention as mask=fn, which "
                         "knows it")
  return MaskModPredicate(mask_mod, None if batch is None else int(batch), None if heads is None else int(heads))


def MaskMod(mask_mod: Callable, batch: int | None = None, heads: int | None = None) -> Mask:  # noqa: N802
  """A mask from a function ``mask_mod(b, h, q_idx, kv_idx) -> bool`` (PyTorch flex's mask_mod).

  Args:
    mask_mod: traced on int32 index arrays that broadcast against each other; True where the
      query attends to the key. It may close over arrays (document ids: ``lambda b, h, q, k:
      doc[b, q] == doc[b, k]``); positions past the lengths are passed to it too (an array it
      indexes clamps them), and it must not raise on them.
    batch, heads: the call's batch size / query heads, where the function reads ``b`` / ``h``
      (None: it does not; it is called with 0).

  Composes with ``&`` (with other masks, and with another MaskMod: the conjunction).

  >>> import jax.numpy as jnp
  >>> m = MaskMod(lambda b, h, q, k: (k <= q) & (q - k < 2))
  >>> m.dense(1, 3, 3)[0, 0].astype(int).tolist()
  [[1, 0, 0], [1, 1, 0], [0, 1, 1]]
  >>> m.classify_tiles(1, 4, 4, 2, 2)[0].tolist()  # [q tiles, k tiles]: EMPTY 0, PARTIAL 1, FULL 2
  [[1, 0], [1, 1]]
  """
  return Mask(_predicate(mask_mod, batch, heads))


@functools.lru_cache(maxsize=64)
def _tile_classes(p: MaskModPredicate, batch: int, q_len: int, kv_len: int, block_q: int, block_k: int):
  """``(any, full)`` numpy bool ``[batch, nq, nk]``: whether some / every position of each tile
  inside ``[q_len, kv_len]`` is allowed, for some / every head; None where ``mask_mod`` depends
  on traced values. Evaluated per batch element and block of query tiles (at most about
  ``_CHUNK`` grid elements at a time)."""
  nq, nk = -(-q_len // block_q), -(-kv_len // block_k)
  heads = 1 if p.heads is None else p.heads
  kv_pad = nk * block_k
  k = np.arange(kv_pad)[None, :]
  hh = np.arange(heads)[:, None, None] if p.heads is not None else 0
  per = max(1, _CHUNK // (heads * block_q * kv_pad))  # query tiles per step
  any_, full = np.zeros((batch, nq, nk), bool), np.zeros((batch, nq, nk), bool)
  with jax.ensure_compile_time_eval():
    for b in range(batch):
      for t0 in range(0, nq, per):
        t1 = min(nq, t0 + per)
        q = np.arange(t0 * block_q, t1 * block_q)[:, None]
        e = p._call(b if p.batch is not None else 0, hh, q, k)
        if isinstance(e, jax.core.Tracer):
          return None
        e = np.broadcast_to(np.asarray(e).reshape((1,) * (3 - e.ndim) + e.shape), (heads, q.shape[0], kv_pad))
        inside = (q < q_len) & (k < kv_len)
        tiles = lambda x: x.reshape(heads, t1 - t0, block_q, nk, block_k)
        any_[b, t0:t1] = tiles(e & inside).any(axis=(0, 2, 4))
        full[b, t0:t1] = tiles(e | ~inside).all(axis=(0, 2, 4))
  return any_, full
