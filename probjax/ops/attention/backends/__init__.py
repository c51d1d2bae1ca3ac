"""The attention backends: ``xla``, ``triton``, ``mosaic_gpu`` and ``cudnn``.

Each is a package that implements :class:`probjax.ops.attention.base.AttentionBackend` and is
registered in :mod:`probjax.ops.attention.registry`; no backend imports another (a forward of
one backend with the backward of another is composed in :mod:`probjax.ops.attention.compose`).
"""
