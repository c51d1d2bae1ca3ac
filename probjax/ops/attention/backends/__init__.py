"""The attention backends: ``xla``, ``triton``, ``mosaic_gpu`` and ``cudnn``.

Each is a package adapted to :class:`probjax.ops.attention.registry.AttentionBackend` and
registered in :mod:`probjax.ops.attention.registry`; no backend imports another (a forward of
one backend runs with the backward of another through :mod:`probjax.ops.attention.vjp`, the
backward found by name in the registry).
"""
