"""``"triton"`` (alias ``"pallas"``): Pallas-Triton kernels.

* Mamba-1: forward and backward kernels (:mod:`.mamba`), exact; the backward recomputes the
  states inside each chunk from the chunk-boundary states its forward saved.
* SSD: chunked forward and backward kernels (:mod:`.ssd`), exact; the backward carries only the
  state's cotangent across the chunks in reverse, and computes each chunk's gradients in
  parallel over the chunks from the chunk-boundary states its forward saved.
  A differentiated GPU call that names no implementation runs the tuned form instead, forward
  and backward (``tuning/gpu.json`` "grad": the chunked XLA form; the decision's ``grad``).
* RLA: flash-linear-attention-style chunk kernels (:mod:`.rla`), forward and backward, exact;
  their matmuls read the inputs' dtype.

The kernels' dots run at Triton's default precision (TF32 for float32 operands on the GPU).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from probjax.core import pallas_triton
from probjax.core.backend import Backend
from probjax.core.device import Device
from probjax.ops.scan.backends.triton import common
from probjax.ops.scan.backends.triton import mamba as mamba_kernel
from probjax.ops.scan.backends.triton import rla as rla_kernel
from probjax.ops.scan.backends.triton import ssd as ssd_kernel
from probjax.ops.scan.calls import MambaCall, RLACall, SSDCall

DTYPES = ("float32", "bfloat16", "float16")
# The state a program keeps in registers: [block, state] (Mamba, SSD), [features, v_head_dim]
# (RLA) with these widths at most.
MAX_WIDTH = 256
# Sequence rows per chunk: the chunk's [chunk, chunk] score tile and its operands stay in
# registers next to the state (not tuned on a GPU yet).
CHUNK = 32
CHUNKS = (16, 32, 64, 128)


class _Triton:
  name = "triton"
  aliases = ("pallas",)

  def available(self, device: Device) -> str | None:
    return pallas_triton.unavailable(device, pallas_triton.EMULATED_ANYWHERE)

  def _refusal(self, call, device: Device, widths) -> str | None:
    why = self.available(device)
    if why:
      return why
    if call.dtype not in DTYPES:
      return f"the kernels take {', '.join(DTYPES)} inputs, not {call.dtype}"
    for name, w in widths:
      if w > MAX_WIDTH:
        return f"{name} = {w} is above the kernels' {MAX_WIDTH} (their state lives in registers)"
    return None

  def _chunk_refusal(self, call) -> str | None:
    if call.chunk_size is not None and call.chunk_size not in CHUNKS:
      return f"the kernels' chunk_size is one of {CHUNKS}, got {call.chunk_size}"
    return None

  def chunk_size(self, call) -> int:
    return kernel_chunk(call)


def kernel_chunk(call) -> int:
  """The kernels' chunk: the call's, else ``CHUNK`` or the power of two (at least 16) covering a
  shorter call."""
  if call.chunk_size is not None:
    return call.chunk_size
  return min(CHUNK, common.block(call.length, 16))


def _state_kernels(module, plain, saving_states):
  """``f(call, x, dt, A, B, C, h0) -> (y, h_L)``: ``module``'s forward kernel, differentiated by
  its backward kernels from the inputs and the states entering each chunk (Mamba-1 and SSD take
  the same operands). ``plain(call)`` and ``saving_states(call)``: the forward's keywords without
  and with those states among its outputs (an undifferentiated call does not write them)."""
  def forward(call, *args):
    return module.forward(*args, interpret=call.interpret, **plain(call))

  f = jax.custom_vjp(forward, nondiff_argnums=(0,))

  def fwd(call, *args):
    y, h, hc = module.forward(*args, interpret=call.interpret, **saving_states(call))
    return (y, h), (*args[:5], hc)   # h0 is not needed: hc holds the state entering each chunk

  def bwd(call, res, ct):
    grads = module.backward(*res, *ct, chunk=kernel_chunk(call), interpret=call.interpret)
    x, dt, A, B, C = res[:5]
    # h0 is in the compute dtype, like A.
    return tuple(g.astype(t.dtype) for g, t in zip(grads, (x, dt, A, B, C, A)))

  f.defvjp(fwd, bwd)
  return f


_mamba = _state_kernels(mamba_kernel, lambda call: {}, lambda call: dict(chunk=kernel_chunk(call)))


class MambaTriton(_Triton, Backend[MambaCall]):
  """Forward and backward kernels; the chunk is the backward's, between the saved states."""

  def supports(self, call: MambaCall, device: Device) -> str | None:
    return self._refusal(call, device, [("state", call.state)]) or self._chunk_refusal(call)

  def __call__(self, x, dt, A, B, C, h0, *, call: MambaCall):
    return _mamba(call, x, dt, A, B, C, h0)


_ssd = _state_kernels(ssd_kernel, lambda call: dict(chunk=kernel_chunk(call)),
                      lambda call: dict(chunk=kernel_chunk(call), residuals=True))


class SSDTriton(_Triton, Backend[SSDCall]):
  """Chunked forward and backward kernels (:mod:`.ssd`); the backward's chunks are the
  forward's, between the saved states: x ``[b, L, h, p]``, dt ``[b, L, h]``, A ``[h]``, B, C
  ``[b, L, g, n]``, h0 ``[b, h, p, n]`` give ``(y [b, L, h, p], h_L [b, h, p, n])`` in
  float32."""

  def supports(self, call: SSDCall, device: Device) -> str | None:
    return (self._refusal(call, device, [("state", call.state)]) or self._chunk_refusal(call))

  def __call__(self, x, dt, A, B, C, h0, *, call: SSDCall):
    return _ssd(call, x, dt, A, B, C, h0)


def _smem_limit(call, device: Device) -> int | None:
  """The shared memory per block the RLA kernels must fit on ``device`` (none in interpret mode)."""
  return None if call.interpret else device.smem_per_block


def _rla_chunk(call, device: Device | None = None) -> int:
  """The RLA kernels' chunk on ``device`` (default: the current one), fitting its shared memory.
  Forward and backward take the same one: the backward reads the forward's per-chunk states."""
  return rla_kernel.default_chunk(call, _smem_limit(call, device or Device.current()))


def _rla_operands(call, fq, fk, v):
  """The kernels' operands: the features (float32 from the feature map) and the values in the
  matmuls' dtype, q's and v's (bfloat16 inputs give bfloat16 tensor-core matmuls)."""
  dtype = jnp.promote_types(call.dtype, v.dtype)
  return fq.astype(dtype), fk.astype(dtype), v.astype(dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _rla(call, dtypes, fq, fk, v, s0):
  del dtypes
  o, final, _ = rla_kernel.forward(*_rla_operands(call, fq, fk, v), s0, chunk=_rla_chunk(call),
                                   out_dtype=call.dtype, interpret=call.interpret)
  return o, final


def _rla_fwd(call, dtypes, fq, fk, v, s0):
  del dtypes
  q, k, v = _rla_operands(call, fq, fk, v)
  o, final, h = rla_kernel.forward(q, k, v, s0, chunk=_rla_chunk(call),
                                   out_dtype=call.dtype, interpret=call.interpret)
  return (o, final), (q, k, v, h)


def _rla_bwd(call, dtypes, res, ct):
  grads = rla_kernel.backward(*res, *ct, chunk=_rla_chunk(call), dv_dtype=dtypes[2],
                              interpret=call.interpret)
  return tuple(g.astype(t) for g, t in zip(grads, dtypes))


_rla.defvjp(_rla_fwd, _rla_bwd)


class RLATriton(_Triton, Backend[RLACall]):
  """Chunk kernels, forward and backward (:mod:`.rla`); chunk :func:`.rla.default_chunk`, the
  largest whose kernels fit the device's shared memory."""

  def supports(self, call: RLACall, device: Device) -> str | None:
    return (self._refusal(call, device, [("features", call.features), ("v_head_dim", call.v_head_dim)])
            or self._chunk_refusal(call) or self._smem_refusal(call, device))

  def _smem_refusal(self, call: RLACall, device: Device) -> str | None:
    """Why not, where a kernel at the call's chunk (:func:`.rla.default_chunk` for the device)
    would overflow the device's shared memory, a failure that would otherwise come at launch.
    Every kernel counts: the call may be differentiated."""
    limit = _smem_limit(call, device)
    if limit is None:
      return None
    chunk = _rla_chunk(call, device)
    name, need = rla_kernel.call_smem(call, chunk)
    if need <= limit:
      return None
    how = "the call's chunk_size" if call.chunk_size is not None else "the smallest chunk"
    return (f"the {name} kernel needs {need} bytes of shared memory (estimated, {call.dtype} at features "
            f"{call.features}, v_head_dim {call.v_head_dim}, {how} {chunk}), the device has {limit}")

  def chunk_size(self, call) -> int:
    return _rla_chunk(call)

  def __call__(self, fq, fk, v, s0, *, call: RLACall):
    # The output in q's dtype (the op's), the gradients in each input's.
    return _rla(call, tuple(t.dtype.name for t in (fq, fk, v, s0)), fq, fk, v, s0)
