"""``"chunked"``: the chunk-parallel XLA formulations of :mod:`probjax.ops.scan.chunked_math`
(matmuls inside a chunk for SSD and RLA, a short scan over chunks, float32 state, the backward
recomputing inside each chunk). Exact for every call on every device."""

from __future__ import annotations

import jax.numpy as jnp

from probjax.core.backend import Backend
from probjax.ops.scan import chunked_math
from probjax.ops.scan.calls import MambaCall, RLACall, SSDCall


class _Chunked:
  name = "chunked"

  def supports(self, call, device):
    return None

  def chunk_size(self, call) -> int:
    return chunked_math.default_chunk(call)


class MambaChunked(_Chunked, Backend[MambaCall]):
  def __call__(self, x, dt, A, B, C, h0, *, call: MambaCall):
    return chunked_math.mamba_chunked(x, dt, A, B, C, h0, chunk=self.chunk_size(call))


class SSDChunked(_Chunked, Backend[SSDCall]):
  def __call__(self, x, dt, A, B, C, h0, *, call: SSDCall):
    return chunked_math.ssd_chunked(x, dt, A, B, C, h0, chunk=self.chunk_size(call))


class RLAChunked(_Chunked, Backend[RLACall]):
  def __call__(self, fq, fk, v, s0, *, call: RLACall):
    # The matmuls read q's and v's dtype (the features arrive in the compute dtype).
    return chunked_math.linear_attention_chunked(fq, fk, v, s0, chunk=self.chunk_size(call),
                                                 dtype=jnp.promote_types(call.dtype, v.dtype))
