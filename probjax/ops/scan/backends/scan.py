"""``"scan"``: the sequential form, one ``lax.scan`` step per position (state in float32 for
16-bit inputs). Exact for every call on every device; its reverse mode is ``lax.scan``'s, which
saves every step's state."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from probjax.core.backend import Backend
from probjax.ops.scan.calls import MambaCall, RLACall, SSDCall
from probjax.ops.scan.chunked_math import compute_dtype, group_of_heads, mamba_step


def _scan(step, h0, xs):
  """``lax.scan`` over axis 1 of every ``xs`` (the sequence axis); outputs back on axis 1."""
  h, y = jax.lax.scan(step, h0, tuple(jnp.moveaxis(t, 1, 0) for t in xs))
  return jnp.moveaxis(y, 0, 1), h


class _Sequential:
  name = "scan"

  def supports(self, call, device):
    return None

  def chunk_size(self, call) -> None:
    return None


class MambaScan(_Sequential, Backend[MambaCall]):
  def __call__(self, x, dt, A, B, C, h0, *, call: MambaCall):
    cd = compute_dtype(x.dtype)

    def step(h, xs):
      return mamba_step(h, *(t.astype(cd) for t in xs), A)

    return _scan(step, h0.astype(cd), (x, dt, B, C))


class SSDScan(_Sequential, Backend[SSDCall]):
  def __call__(self, x, dt, A, B, C, h0, *, call: SSDCall):
    cd = compute_dtype(x.dtype)
    group = group_of_heads(call.heads, call.groups)

    def step(h, xs):
      xt, dtt, bt, ct = (t.astype(cd) for t in xs)
      bt, ct = bt[:, group], ct[:, group]                         # [b, heads, n]
      h = jnp.exp(dtt * A)[..., None, None] * h + (dtt[..., None] * xt)[..., None] * bt[:, :, None]
      return h, jnp.einsum("bhpn,bhn->bhp", h, ct)

    return _scan(step, h0.astype(cd), (x, dt, B, C))


class RLAScan(_Sequential, Backend[RLACall]):
  def __call__(self, fq, fk, v, s0, *, call: RLACall):
    cd = compute_dtype(v.dtype)
    kv_head = group_of_heads(call.heads, call.kv_heads)

    def step(s, xs):
      qt, kt, vt = (t.astype(cd) for t in xs)
      s = s + jnp.einsum("bkf,bkd->bkfd", kt, vt)
      return s, jnp.einsum("bhf,bhfd->bhd", qt, s[:, kv_head])

    return _scan(step, s0.astype(cd), (fq, fk, v))
