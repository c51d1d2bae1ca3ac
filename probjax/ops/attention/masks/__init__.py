"""Position masks: one frozen pytree type, a conjunction of registered predicates.

A :class:`Mask` combines at most one predicate of each kind on a query index ``q`` and a key
index ``k`` of batch element ``b``:

* a diagonal band ``q + lower <= k <= q + upper`` (causal, local window: ``band.py``),
* per-batch query lengths ``q < q_lengths[b]`` and key lengths ``k < kv_lengths[b]``
  (``lengths.py``),
* packed documents ``q_segment_ids[b, q] == kv_segment_ids[b, k]`` (``segments.py``),
* prefix-LM ``k <= q or k < prefix_lengths[b]`` (``prefix_lm.py``),
* a function ``mask_mod(b, h, q_idx, kv_idx) -> bool``, as PyTorch flex_attention's, whose tile
  classes are the function evaluated on the grid at trace time (``mask_mod.py``; the XLA path
  and the Triton kernel compute it).

Each kind is a :class:`~probjax.ops.attention.masks.base.Predicate` (``base.py``): its element
function, tile classification, static key/query ranges, validation, clamping, padding and
kernel operands. A new kind is one module and one entry in the registry below
(``docs/dev/adding-a-mask.md``).

Lengths are clamped to ``[0, q_len]`` / ``[0, kv_len]``: concrete out-of-range lengths raise
``ValueError``, traced ones (under ``jax.jit``) are clipped (:meth:`Mask.clamped`), on every
backend. Keys at or past ``kv_lengths[b]`` and queries at or past ``q_lengths[b]`` may hold any
values, NaN and inf included (a KV cache's unwritten tail): they never reach an output or a
gradient. Positions excluded only by other predicates must be finite, since a key excluded
for one query is read for another.

Backends use two views of a mask: :meth:`Mask.element` (the boolean predicate on index grids)
and :meth:`Mask.classify_tiles` (each ``block_q x block_k`` tile is EMPTY, PARTIAL or FULL),
so that empty tiles are skipped and full tiles skip the element predicate. The band's bounds
are static Python ints, so a kernel can also bound its key loop at trace time
(:meth:`Mask.kv_range`).

The constructors combine with ``&``; ``mask & dense_boolean_array`` is a :class:`MaskWithDense`,
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

from probjax.ops.attention.masks.base import (DENSE_ONLY_MESSAGE, EMPTY, FULL, PARTIAL, PREDICATES, Mask,
                                              MaskWithDense, Predicate, TileFunction, TileGrid, register,
                                              register_callable)
from probjax.ops.attention.masks.band import Band, CausalMask, LocalWindowMask, band
from probjax.ops.attention.masks.dense import structured_equivalent
from probjax.ops.attention.masks.lengths import KVLengths, KVLenMask, LengthMask, QLengths
from probjax.ops.attention.masks.prefix_lm import PrefixLM, PrefixLMMask
from probjax.ops.attention.masks.segments import SegmentMask, Segments
from probjax.ops.attention.masks.mask_mod import MaskMod, MaskModPredicate
from probjax.ops.attention.masks.tiles import (heavy_first_order, heavy_first_program, lists_from_classes,
                                               num_tiles, pad_axis, ranges_from_classes, round_up)

# The registry: every predicate kind, in the order a mask names its components.
register(Band, QLengths, KVLengths, Segments, PrefixLM, MaskModPredicate)
register_callable(MaskMod)

__all__ = [
    "Mask", "MaskWithDense", "Predicate", "TileFunction", "TileGrid", "PREDICATES", "register", "EMPTY", "PARTIAL",
    "FULL",
    "DENSE_ONLY_MESSAGE", "Band", "QLengths", "KVLengths", "Segments", "PrefixLM", "band", "CausalMask",
    "LocalWindowMask", "KVLenMask", "LengthMask", "SegmentMask", "PrefixLMMask", "MaskMod", "MaskModPredicate",
    "structured_equivalent",
    "ranges_from_classes", "lists_from_classes", "num_tiles", "round_up", "pad_axis", "heavy_first_program",
    "heavy_first_order",
]
