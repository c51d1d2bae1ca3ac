"""The fused MoE expert block ("fused_gsum"): no ``[T * top_k, d_model]`` array exists.

``y[t] = sum_j w[t, j] * expert_{e(t, j)}(x[t])`` over token ``t``'s kept choices, with the
experts' two grouped matmuls on the Triton kernels (:mod:`.backends.triton.kernels`):

* up projection: the kernel reads each sorted row's token row of ``x`` through the index
  vector ``src`` (no expanded copy of ``x``);
* down projection: the kernel multiplies each output row by its combine weight and adds it
  into its token's row of a ``[T, d_model]`` float32 buffer (atomic adds: on the GPU the
  ``top_k`` terms of a row are summed in a run-dependent order);
* backward, likewise: ``d_x`` is a scatter-summed grouped matmul against the up projection
  read transposed; the weight gradients are ``tgmm`` with gathered (and, for the down
  projection, weighted) cotangent rows; the combine weights' gradient is a row-wise dot of
  the hidden activations with the gathered cotangent times the transposed down projection.

Only expert-width arrays ``[T * top_k, hidden]`` (the hidden activations) are kept.

This is the kernel math of the ``"fused_gsum"`` strategy of the MoE expert block
(:mod:`.strategies`, registered in :data:`.strategies.STRATEGIES`, chosen by
:func:`.moe_dispatch.decide_moe`); it is a shared module of the op, not a backend, since it
runs the Triton backend's kernels.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from probjax.core.device import Device
from probjax.ops.grouped_matmul.activations import ACTIVATIONS, activate
from probjax.ops.grouped_matmul.backends.triton import config as triton_config
from probjax.ops.grouped_matmul.backends.triton import kernels


def fused_experts(x, src, row_weights, group_sizes, w_in, w_out, *, activation: str, interpret: bool = False):
  """``[T, D]`` in ``x``'s dtype.

  Args:
    x: ``[T, D]`` tokens.
    src: ``[A]`` int32, the token of each sorted assignment (``order // top_k``); within one
      expert's rows every token appears at most once.
    row_weights: ``[A]`` combine weight of each sorted assignment (zero for dropped ones).
    group_sizes: ``[E]`` int32 kept assignments per expert (assignments past them are
      dropped).
    w_in: ``[E, D, F]`` (``F = 2 * hidden`` for SwiGLU), ``w_out``: ``[E, hidden, D]``, in
      ``x``'s dtype.
  """
  if activation not in ACTIVATIONS:
    raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
  return _fused(activation, bool(interpret), x, src, row_weights, group_sizes, w_in, w_out)


def _cfg(m, k, n, dtype, interpret, *, transposed=False):
  device = Device.interpreter() if interpret else Device.current()
  return triton_config.choose(m, k, n, dtype, device, transposed=transposed)


def _forward(activation, interpret, x, src, row_weights, group_sizes, w_in, w_out):
  t, d = x.shape
  a, f = src.shape[0], w_in.shape[2]
  hp = kernels.gmm(x, w_in, group_sizes, cfg=_cfg(a, d, f, x.dtype, interpret), out_dtype=x.dtype,
                   interpret=interpret, lhs_rows=src, rows=a)
  h = activate(hp, activation).astype(x.dtype)
  y = kernels.gmm(h, w_out, group_sizes, cfg=_cfg(a, h.shape[1], d, x.dtype, interpret), out_dtype=jnp.float32,
                  interpret=interpret, scatter_rows=src, scatter_scale=row_weights, scatter_len=t)
  return y.astype(x.dtype), hp


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _fused(activation, interpret, x, src, row_weights, group_sizes, w_in, w_out):
  return _forward(activation, interpret, x, src, row_weights, group_sizes, w_in, w_out)[0]


def _fused_fwd(activation, interpret, x, src, row_weights, group_sizes, w_in, w_out):
  y, hp = _forward(activation, interpret, x, src, row_weights, group_sizes, w_in, w_out)
  return y, (x, src, row_weights, group_sizes, w_in, w_out, hp)


def _fused_bwd(activation, interpret, res, dy):
  x, src, row_weights, group_sizes, w_in, w_out, hp = res
  t, d = x.shape
  a, f = hp.shape
  hidden = w_out.shape[1]
  dy = dy.astype(x.dtype)
  h32, act_vjp = jax.vjp(lambda z: activate(z, activation), hp)
  h = h32.astype(x.dtype)
  # g[r] = dy[src[r]] @ w_out[e]^T: the cotangent of row r's unweighted expert output.
  g = kernels.gmm(dy, w_out, group_sizes, cfg=_cfg(a, d, hidden, x.dtype, interpret), out_dtype=jnp.float32,
                  transpose_rhs=True, interpret=interpret, lhs_rows=src, rows=a)
  d_row_weights = jnp.sum(h32 * g, axis=1).astype(row_weights.dtype)
  d_hp = act_vjp(g * row_weights.astype(jnp.float32)[:, None])[0].astype(x.dtype)
  d_w_out = kernels.tgmm(h, dy, group_sizes, cfg=_cfg(a, hidden, d, x.dtype, interpret, transposed=True),
                         out_dtype=w_out.dtype, interpret=interpret, b_rows=src, b_scale=row_weights)
  d_x = kernels.gmm(d_hp, w_in, group_sizes, cfg=_cfg(a, f, d, x.dtype, interpret), out_dtype=jnp.float32,
                    transpose_rhs=True, interpret=interpret, scatter_rows=src,
                    scatter_scale=jnp.ones((a,), jnp.float32), scatter_len=t)
  d_w_in = kernels.tgmm(x, d_hp, group_sizes, cfg=_cfg(a, d, f, x.dtype, interpret, transposed=True),
                        out_dtype=w_in.dtype, interpret=interpret, a_rows=src)
  return d_x.astype(x.dtype), None, d_row_weights, None, d_w_in, d_w_out


_fused.defvjp(_fused_fwd, _fused_bwd)
