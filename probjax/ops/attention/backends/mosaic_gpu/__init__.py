"""Flash attention in Pallas Mosaic GPU for Hopper (sm_90): TMA loads, wgmma, a producer
warpgroup (FA3-style; :mod:`.forward`).

Built so far (16-bit, head_dim 64/128/192/256, values of their own width among those (MLA's
192/128), every position mask -- causal/window band,
per-batch query/key lengths, segment ids -- with tile skipping, GQA, any length): the
forward (:mod:`.forward`), a fused forward + jvp kernel whose tangent ``jax.jvp`` takes
(:mod:`.jvp`; head_dim and value head_dim 64 or 128, no ``score_mod``) and a deterministic
two-kernel backward (:mod:`.backward`, ``backward_pass_impl="mosaic"``, query/key and value
widths summing to at most 320: 64/64, 128/128, 192/128, 128/64, ...); other ``backward_pass_impl`` values run
the Triton kernels' backward on the same residuals, paired by name through
:func:`probjax.ops.attention.registry.backward_kernel` (this package never imports another
backend). ``score_mod`` runs in the forward and in both backwards (its gradient per tile by
``jax.vjp``). The default dispatch picks the kernel on sm_90 where the device table measured it
faster (:mod:`probjax.ops.attention.dispatch`); ``implementation="mosaic"`` asks for it.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

import jax.numpy as jnp

from probjax.ops.attention import gpu, registry, vjp  # registry: the other backends' backwards
from probjax.ops.attention.base import check_kernel_call, score_mod_reason
from probjax.ops.attention.masks import Mask
from probjax.ops.attention.backends.mosaic_gpu import backward as backward_lib
from probjax.ops.attention.backends.mosaic_gpu import config as config_lib
from probjax.ops.attention.backends.mosaic_gpu import forward as forward_lib
from probjax.ops.attention.backends.mosaic_gpu import jvp as jvp_lib
from probjax.ops.attention.backends.mosaic_gpu.backward import MosaicBackwardConfig
from probjax.ops.attention.backends.mosaic_gpu.config import MosaicForwardConfig

__all__ = ["attention", "supports", "forward_kernel", "tangent_kernel", "MosaicForwardConfig", "MosaicBackwardConfig"]

_HEAD_DIMS = (64, 128, 192, 256)  # multiples of 64: whole wgmma K tiles of the (8, 64) smem tiling


def supports(q_shape, kv_shape, dtype, *, mask: Mask | None = None, score_mod: Callable | None = None,
             bias: bool = False, dense_mask: bool = False, dropout: bool = False,
             scale: float | None = None, interpret: bool = False, device_kind: str | None = None,
             v_head_dim: int | None = None, backward_pass_impl: str = "auto") -> str | None:
  """None if :func:`attention` computes the call exactly, else a short reason.

  Args:
    q_shape: ``(batch, q_len, heads, head_dim)``; kv_shape: ``(batch, kv_len, kv_heads, head_dim)``.
    v_head_dim: the values' head_dim (None: ``head_dim``), any of the head_dims taken.
    backward_pass_impl: ``"mosaic"`` also asks whether this package's backward computes the
      call's gradient (:func:`backward_refusal`); the Triton backwards answer for themselves.
    device_kind: ``"sm_90"`` etc. (default: the current device's).
  """
  for present, what in ((bias, "additive bias"), (dense_mask, "dense boolean mask"), (dropout, "dropout")):
    if present:
      return what
  if not interpret:
    kind = device_kind or gpu.device_kind()
    if kind != "sm_90":
      return f"the Mosaic GPU kernel needs an sm_90 (Hopper) GPU, this is {kind}"
  if jnp.dtype(dtype).name not in ("bfloat16", "float16"):
    return f"dtype {jnp.dtype(dtype).name} (the Mosaic kernel takes bfloat16 and float16)"
  if len(q_shape) != 4 or len(kv_shape) != 4:
    return "inputs must be [batch, seq, heads, head_dim]"
  if q_shape[-1] not in _HEAD_DIMS or kv_shape[-1] != q_shape[-1]:
    return f"head_dim {q_shape[-1]} (the Mosaic kernel takes {_HEAD_DIMS}, equal for q and k)"
  if v_head_dim is not None and v_head_dim not in _HEAD_DIMS:
    return f"value head_dim {v_head_dim} (the Mosaic kernel takes {_HEAD_DIMS})"
  if v_head_dim not in (None, q_shape[-1]) and q_shape[-1] + v_head_dim > 384:
    # the output tiles then need a buffer of their own beside the query tiles (config.fit)
    return (f"value head_dim {v_head_dim} beside head_dim {q_shape[-1]} (the Mosaic kernel's tiles need "
            "their sum at most 384 where they differ)")
  if q_shape[0] != kv_shape[0]:
    return "batch mismatch"
  if q_shape[2] % kv_shape[2]:
    return f"heads {q_shape[2]} not a multiple of kv_heads {kv_shape[2]}"
  if q_shape[1] == 0 or kv_shape[1] == 0:
    return "empty sequence"
  if mask is not None:
    if not isinstance(mask, Mask):
      return f"mask of type {type(mask).__name__}"
  if scale is not None and not scale > 0 and score_mod is None:
    return f"scale {scale} (without score_mod the Mosaic kernel takes a positive scale)"
  why = score_mod_reason(score_mod) or _lowerable(score_mod)
  if why or backward_pass_impl != "mosaic":
    return why
  why = backward_refusal(q_shape[-1], v_head_dim, score_mod)
  return None if why is None else f"backward_pass_impl='mosaic' cannot compute this call: {why}"


def backward_refusal(head_dim: int, v_head_dim: int | None, score_mod: Callable | None) -> str | None:
  """Why the Mosaic backward (``backward_pass_impl="mosaic"``) cannot compute the gradient of a
  call the forward takes, or None: widths whose dK/dV accumulators do not fit the registers
  (:func:`.backward.width_refusal`), a ``score_mod`` whose vjp Pallas Mosaic GPU cannot lower."""
  return backward_lib.width_refusal(head_dim, v_head_dim) or _lowerable(score_mod, mosaic_grad=True)


def _lowerable(score_mod: Callable | None, *, mosaic_grad: bool = False) -> str | None:
  """Why the kernels cannot lower ``score_mod``: Pallas Mosaic GPU its forward (on the score
  tile, full index tiles; with ``mosaic_grad`` its vjp too, for the Mosaic backward), Pallas
  Triton its gradient (the Triton backward); or None."""
  if score_mod is None:
    return None
  if mosaic_grad:
    return gpu.mosaic_gpu_lowerable(score_mod, grad=True)
  return gpu.mosaic_gpu_lowerable(score_mod, grad=False) or gpu.triton_lowerable(score_mod, grad=True)


def attention(q, k, v, *, mask: Mask | None = None, score_mod: Callable | None = None,
              scale: float | None = None, backward_pass_impl: str = "auto",
              forward_config: MosaicForwardConfig | None = None,
              backward_config=None,
              interpret: bool = False):
  """Exact attention with the Mosaic GPU forward and the Triton backward.

  Args:
    q: ``[batch, q_len, heads, head_dim]``; k: ``[batch, kv_len, kv_heads, head_dim]``; v:
      ``[batch, kv_len, kv_heads, v_head_dim]``; bfloat16 or float16, ``heads % kv_heads == 0``,
      both widths in ``_HEAD_DIMS``.
    mask: any position mask (band, per-batch lengths, segment ids, their ``&``); rows
      without a valid key give zeros.
    score_mod: ``f(score, b, h, q_idx, kv_idx) -> score`` on float32 scores after scaling,
      before the mask (``q_idx``/``kv_idx`` full int32 tiles of the score's shape); it must
      not close over arrays. Both backwards differentiate it.
    backward_pass_impl: ``"mosaic"`` (this package's backward, :mod:`.backward`, widths
      :func:`backward_refusal` takes), or the Triton backward's variant (``"auto"``,
      ``"triton_*"``, see :mod:`probjax.ops.attention.backends.triton`):
      "auto" is the Triton backward, faster at head_dim 64 (the device table gives head_dim 128
      calls from 2^29 work the Mosaic backward; evidence in docs/dev/decisions.md).
    forward_config: explicit tiles, checked against the device's shared memory.
    backward_config: the backward's tiles (a ``MosaicBackwardConfig`` for "mosaic", else the
      config of the backend whose backward the variant names, the Triton ``BackwardConfig``).
    interpret: Mosaic GPU interpret mode (CPU testing; where the machine has few cores, set
      PJRT_NPROC, see :func:`.config.warn_if_interpret_may_hang`).
  Returns:
    ``[batch, q_len, heads, v_head_dim]`` in q's dtype.
  """
  if forward_config is not None and not isinstance(forward_config, MosaicForwardConfig):
    raise TypeError(f"forward_config must be a MosaicForwardConfig, got {type(forward_config).__name__}")
  check_kernel_call("mosaic", supports(q.shape, k.shape, q.dtype, mask=mask, score_mod=score_mod, scale=scale,
                                      interpret=interpret, v_head_dim=v.shape[-1]), q, k, v, mask)
  scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
  device = gpu.kernel_device(interpret)
  itemsize, d, dv = jnp.dtype(q.dtype).itemsize, q.shape[-1], v.shape[-1]
  forward = forward_kernel(q, k, v, mask, scale=scale, score_mod=score_mod, config=forward_config,
                           interpret=interpret)
  st = forward.static
  cfg = st.fcfg
  mosaic_bwd = backward_pass_impl == "mosaic"
  if backward_config is not None and isinstance(backward_config, MosaicBackwardConfig) != mosaic_bwd:
    raise TypeError(f"backward_config {type(backward_config).__name__} does not match "
                    f"backward_pass_impl={backward_pass_impl!r} (MosaicBackwardConfig goes with 'mosaic')")
  if mosaic_bwd:
    why = backward_refusal(d, dv, score_mod)
    if why:
      raise ValueError(f"backward_pass_impl='mosaic' cannot compute this call: {why}")
    bcfg = backward_lib.fit(backward_config, itemsize, d, device, v_head_dim=dv)
    if interpret:
      config_lib.warn_if_interpret_may_hang(max(cfg.cluster * (cfg.compute_wgs + 1), bcfg.compute_wgs + 1))
    backward = vjp.Kernel(_backward_shard, dataclasses.replace(st, bcfg=bcfg), gpu.mosaic_partitioned(st))
  else:
    if interpret:
      config_lib.warn_if_interpret_may_hang(cfg.cluster * (cfg.compute_wgs + 1))
    backward = registry.backward_kernel(backward_pass_impl, q, k, v, scale=scale, score_mod=score_mod,
                                        config=backward_config, interpret=interpret)
  return vjp.attention(forward, backward, q, k, v, mask)


def forward_kernel(q, k, v, mask: Mask | None, *, scale: float, score_mod: Callable | None = None,
                   config: MosaicForwardConfig | None = None, interpret: bool = False) -> vjp.Kernel:
  """The Mosaic GPU forward as a pass with its residuals, ``(out, lse [batch, heads, q_len])``,
  for a caller that pairs it with a backward or combines blocks by their log-sum-exp (context
  parallelism); ``config``: its tiles (None: fitted to the device, the mask and the lengths).
  Inputs validated by the caller (:func:`supports`)."""
  cfg = config_lib.fit(config, jnp.dtype(q.dtype).itemsize, q.shape[-1], gpu.kernel_device(interpret), mask=mask,
                       q_len=q.shape[1], kv_len=k.shape[1], score_mod=score_mod is not None, v_head_dim=v.shape[-1])
  st = _Static(float(scale), cfg, None, bool(interpret), score_mod)
  return vjp.Kernel(_forward_shard, st, gpu.mosaic_partitioned(st))


def tangent_kernel(call, exact: Callable) -> Callable | None:
  """The fused forward + jvp kernel (:mod:`.jvp`) as ``f(q, k, v, mask, q_dot, k_dot, v_dot) ->
  out_dot`` for an :class:`~probjax.ops.attention.call.AttentionCall` this backend computes, or
  None where it cannot take the call (a ``score_mod``, widths other than 64 and 128: the tangent
  is then ``exact``'s jvp). Its tiles are the call's forward config fitted to the kernel
  (:func:`.jvp.fit`)."""
  d, dv = call.q_shape[-1], call.v_head_dim or call.kv_shape[-1]
  if jvp_lib.supports(call.score_mod, d, dv) is not None:
    return None
  scale = 1.0 / math.sqrt(d) if call.scale is None else call.scale
  config = jvp_lib.fit(call.forward_config, jnp.dtype(call.dtype).itemsize, d, gpu.kernel_device(call.interpret),
                       v_head_dim=dv)
  return jvp_lib.tangent(exact, scale=scale, config=config, interpret=call.interpret)


@dataclasses.dataclass(frozen=True)
class _Static:
  """The kernels' static arguments (the backward config: the Mosaic backward's, else None)."""
  scale: float
  fcfg: MosaicForwardConfig
  bcfg: MosaicBackwardConfig | None
  interpret: bool
  score_mod: Callable | None = None


def _forward_shard(st: _Static, q, k, v, mask):
  return forward_lib.forward(q, k, v, mask, scale=st.scale, config=st.fcfg, interpret=st.interpret,
                             score_mod=st.score_mod)


def _backward_shard(st: _Static, q, k, v, out, lse, do, mask):
  return backward_lib.backward(q, k, v, out, lse, do, mask, scale=st.scale, config=st.bcfg,
                               interpret=st.interpret, score_mod=st.score_mod)
