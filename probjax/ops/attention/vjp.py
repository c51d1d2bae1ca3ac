"""Attention's one reverse-mode wiring: any backend's forward with any backend's backward.

Every fused attention kernel saves the same residuals, the output and the natural log-sum-exp
``[batch, heads, q_len]``, so a forward pass of one backend pairs with a backward pass of
another (the Mosaic GPU forward with the Triton backward, say) without either importing the
other: a backend describes each pass as a :class:`Kernel` and :func:`attention` runs the pair
under one ``custom_vjp``, each pass through :func:`probjax.ops.attention.sharding.masked_call`
(per shard of batch and heads, ``vmap`` folded into the batch).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Hashable

import jax

from probjax.ops.attention.masks import Mask
from probjax.ops.attention.sharding import KV, Q, STATS, masked_call

__all__ = ["Kernel", "attention"]


@dataclasses.dataclass(frozen=True)
class Kernel:
  """One pass of a backend's kernels and its static arguments.

  Attributes:
    fn: a forward ``fn(static, q, k, v, mask) -> (out, lse)``, a backward
      ``fn(static, q, k, v, out, lse, do, mask) -> (dq, dk, dv)`` or a primal-only forward
      ``fn(static, q, k, v, mask) -> (out,)``, on ``[batch, len, heads, head_dim]`` operands and
      ``[batch, heads, q_len]`` float32 natural log-sum-exp (``+inf`` for rows without a valid
      key); a module-level function (it is hashed).
    static: the pass's frozen, hashable arguments (scale, fitted tiles, ``score_mod``, ...).
    partitioned: whether the pass runs per shard of batch and heads under a mesh (not where it
      sees global batch or head indices, e.g. a ``score_mod``).
  """

  fn: Callable
  static: Hashable
  partitioned: bool = True


def attention(forward: Kernel, backward: Kernel, q, k, v, mask: Mask | None, *,
              primal: Kernel | None = None):
  """``[batch, q_len, heads, d_v]`` attention computed by ``forward``, differentiated by
  ``backward`` on ``forward``'s residuals. ``primal``: a forward without residuals that calls
  which are not differentiated run instead (e.g. the split-KV decoding forward). Inputs are
  validated by the backends that built the passes."""
  return _attention(_Pair(forward, backward, primal), q, k, v, mask)


@dataclasses.dataclass(frozen=True)
class _Pair:
  forward: Kernel
  backward: Kernel
  primal: Kernel | None


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attention(pair: _Pair, q, k, v, mask):
  if pair.primal is not None:
    p = pair.primal
    return masked_call(p.fn, p.static, (q, k, v), (Q, KV, KV), mask, (Q,), partition=p.partitioned)[0]
  return _fwd(pair, q, k, v, mask)[0]


def _fwd(pair: _Pair, q, k, v, mask):
  f = pair.forward
  out, lse = masked_call(f.fn, f.static, (q, k, v), (Q, KV, KV), mask, (Q, STATS), partition=f.partitioned)
  return out, (q, k, v, out, lse, mask)


def _bwd(pair: _Pair, res, do):
  q, k, v, out, lse, mask = res
  b = pair.backward
  dq, dk, dv = masked_call(b.fn, b.static, (q, k, v, out, lse, do), (Q, KV, KV, Q, STATS, Q), mask,
                           (Q, KV, KV), partition=b.partitioned)
  return dq, dk, dv, jax.tree.map(lambda _: None, mask)


_attention.defvjp(_fwd, _bwd)
