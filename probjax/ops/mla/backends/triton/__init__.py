"""MLA's ``triton`` backend (:mod:`.backend`): the absorbed form with its own decode kernel
(Pallas, Triton backend: :mod:`.decode`)."""

from probjax.ops.mla.backends.triton.backend import TritonBackend
from probjax.ops.mla.backends.triton.decode import decode, why_not

__all__ = ["TritonBackend", "decode", "why_not"]
