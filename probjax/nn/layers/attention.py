"""Attention's public functions where they were first published: the same objects as
:mod:`probjax.ops.attention` (the op's face, :mod:`probjax.ops.attention.api`), re-exported
so that ``from probjax.nn.layers.attention import dot_product_attention`` keeps working.

New code imports them from :mod:`probjax.ops.attention` (or :mod:`probjax`); the layers in
:mod:`probjax.nn.layers` are clients of that face.

>>> from probjax.nn.layers import attention
>>> import probjax.ops.attention as op
>>> attention.dot_product_attention is op.dot_product_attention
True
"""

from __future__ import annotations

from probjax.ops.attention.api import (  # noqa: F401
    BACKWARD_PASS_IMPLS, AttentionCall, CausalMask, CudnnConfig, Decision, Device, KVLenMask, LengthMask,
    LocalWindowMask, Mask, MaskMod, MaskWithDense, PrefixLMMask, SegmentMask, available_implementations, base,
    context_parallel_attention, dispatch, dot_product_attention, explain_dispatch, flex_attention, mha, registry,
    structured_equivalent, with_forward_mode, xla_backend)

__all__ = [  # probjax.ops.attention.api.__all__ (tests/test_import_rules.py checks that they agree)
    "dot_product_attention", "flex_attention", "mha", "explain_dispatch", "available_implementations",
    "Mask", "MaskWithDense", "CausalMask", "KVLenMask", "LengthMask", "LocalWindowMask", "SegmentMask", "PrefixLMMask",
    "MaskMod",
    "Decision",
    "CudnnConfig",
    "context_parallel_attention",
]
