"""MLA's absorbed-form decode kernel (Pallas, Triton backend): :mod:`.decode`."""

from probjax.ops.mla.backends.triton.decode import decode, why_not

__all__ = ["decode", "why_not"]
