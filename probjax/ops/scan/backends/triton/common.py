"""Block loads and stores shared by the scan room's Triton kernels.

A kernel's blocks are powers of two (Triton's blocks); an axis shorter than its block, and the
rows past the sequence's end, are masked: they read as zeros and are never written, so no
operand is padded in memory."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu


def block(n: int, minimum: int = 1) -> int:
  """The power-of-two block covering ``n`` (at least ``minimum``)."""
  return max(minimum, 1 << (int(n) - 1).bit_length())


def _valid(start, shape, bounds):
  """Mask of a block at ``start`` (per axis; None: the axis starts at 0) against ``bounds``."""
  ok = None
  for axis, (s, bound) in enumerate(zip(start, bounds)):
    idx = jax.lax.broadcasted_iota(jnp.int32, shape, axis) + (0 if s is None else s)
    ok = idx < bound if ok is None else ok & (idx < bound)
  return ok


def _window(ref, index):
  """``ref.at[index]``, where a window may run past its axis's end (a power-of-two block over a
  shorter axis, read and written under the mask). JAX 0.12 rejects such a window when its start
  is static (0.11 did not check a start of 0), not when the kernel computes it, as the sequence
  chunks' starts: a static start past which the window ends is made a run-time value, from one
  of the index's scalars (a program id: ``pl.program_id`` itself does not run inside a loop in
  interpret mode)."""
  scalars = [i for i in index if not isinstance(i, (int, pl.Slice))]

  def runtime(i, dim):
    if isinstance(i, pl.Slice) and isinstance(i.start, int) and i.start + (i.size - 1) * i.stride >= dim:
      zero = scalars[0] * 0 if scalars else pl.program_id(0) * 0
      return pl.Slice(zero + i.start, i.size, i.stride)
    return i
  return ref.at[tuple(runtime(i, d) for i, d in zip(index, ref.shape))]


def load(ref, index, start, shape, bounds, dtype=jnp.float32):
  """``ref[index]`` as a ``shape`` block of ``dtype`` (default float32): ``index`` holds
  scalars for the leading axes and ``pl.ds`` windows (at ``start``, within ``bounds``) for the
  block's axes."""
  return plgpu.load(_window(ref, index), mask=_valid(start, shape, bounds), other=0).astype(dtype)


def store(ref, index, start, value, bounds):
  """``ref[index] = value`` for the elements of the block within ``bounds``."""
  plgpu.store(_window(ref, index), value.astype(ref.dtype), mask=_valid(start, value.shape, bounds))


def tril(n: int, transposed: bool = False):
  """``[n, n]`` causal mask ``row >= col`` (``row <= col`` transposed)."""
  r = jax.lax.broadcasted_iota(jnp.int32, (n, n), 0)
  c = jax.lax.broadcasted_iota(jnp.int32, (n, n), 1)
  return r <= c if transposed else r >= c


def dot_tn(a, b):
  """``aᵀ b``, contracting the first axis of both."""
  return jax.lax.dot_general(a, b, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32)


def dot_nt(a, b):
  """``a bᵀ``, contracting the last axis of both."""
  return jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)


def dot(a, b):
  return jnp.dot(a, b, preferred_element_type=jnp.float32)


def params(num_warps: int, num_stages: int = 2):
  return plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)
