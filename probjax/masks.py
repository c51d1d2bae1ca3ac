"""Position masks for attention: the public names of :mod:`probjax.ops.attention.masks`.

Masks combine with ``&``; backends skip the tiles a mask leaves empty.

>>> import jax.numpy as jnp
>>> from probjax.masks import CausalMask, KVLenMask
>>> (CausalMask() & KVLenMask(jnp.array([3, 2]))).name
'causal&kv_lengths'

The tiling helpers of that module (``num_tiles``, ``pad_axis``, ...) serve the kernels and are
not re-exported.
"""

from probjax.ops.attention.masks import (EMPTY, FULL, PARTIAL, CausalMask, KVLenMask, LengthMask,
                                         LocalWindowMask, Mask, MaskMod, PrefixLMMask, SegmentMask)

__all__ = ["Mask", "CausalMask", "LocalWindowMask", "KVLenMask", "LengthMask", "SegmentMask",
           "PrefixLMMask", "MaskMod", "EMPTY", "PARTIAL", "FULL"]
