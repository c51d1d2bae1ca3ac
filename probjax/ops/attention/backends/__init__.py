"""The attention backends: ``xla``, ``triton``, ``mosaic_gpu`` and ``cudnn``.

Each is a package with a subclass of :class:`probjax.ops.attention.backend.AttentionBackend`
in its ``backend.py``, registered by one line of :mod:`probjax.ops.attention.registry`; no
backend imports another (a forward of one backend runs with the backward of another through
:mod:`probjax.ops.attention.vjp`, the backward found by name in the registry).
"""
