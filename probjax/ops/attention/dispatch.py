"""Which implementation computes a call: the generic rules and the device table.

Everything here is a pure function of the call's static description, the
device (platform, compute capability, memory) and the environment, so it is
tested on CPU with faked devices.

Generic rules (``implementation=None``):
  1. Not on an NVIDIA GPU → ``"xla"`` (the exact, linear-memory XLA path).
  2. Dense boolean mask, additive bias, dropout, non-default precision or an
     attention-weights ``module`` → ``"xla"``.
  3. Fewer than ``MIN_KERNEL_KV_LEN`` keys → ``"xla"``.
  4. Otherwise the fused Triton kernel, if it computes the call exactly.
Device table (:mod:`probjax.ops.attention.tuning`), applied first when
every kernel argument is at its default: cuDNN for large eligible 16-bit calls,
XLA's dense formulation for float32 above a head_dim while it fits, the Mosaic GPU
forward (sm_90) where the Triton kernel would run on long 16-bit calls, and the
device's ``backward_pass_impl``.
"""

from __future__ import annotations

import dataclasses
import os

import jax.numpy as jnp

from probjax.core.device import Device
from probjax.ops.attention import tuning as attention_device
from probjax.ops.attention.backends import cudnn as cudnn_backend
from probjax.ops.attention.call import AttentionCall
from probjax.ops.attention.registry import REGISTRY
from probjax.ops.attention.masks import Mask

MIN_KERNEL_KV_LEN = 64
# XLA's dense formulation keeps a few float32 [B, H, Tq, Tkv] arrays for the backward.
_DENSE_BYTES_PER_SCORE = 4 * 4


@dataclasses.dataclass(frozen=True)
class Decision:
  """The implementation chosen for a call and the rule that chose it."""

  implementation: str
  rule: str
  backward_pass_impl: str = "auto"
  formulation: str = "auto"  # XLA path: "auto" (by length), "dense" or "flash"
  split_kv: int = 0  # Triton: key splits of the split-KV forward (0: the regular forward)
  # What differentiated calls run (forward with residuals and backward) when it differs
  # from ``implementation``; ``backward_pass_impl`` is then its backward.
  grad_implementation: str | None = None
  route: str = ""  # cuDNN: which call runs it (:func:`probjax.ops.attention.backends.cudnn.route`)

  def __str__(self):
    extra = f", via {self.route}" if self.route else ""
    if self.implementation in ("triton", "mosaic"):
      extra = f", backward={self.backward_pass_impl}"
      if self.split_kv:
        extra += f", split_kv={self.split_kv} splits"
    if self.grad_implementation:
      extra += f"; under grad {self.grad_implementation}, backward={self.backward_pass_impl}"
    return f"{self.implementation}{extra} ({self.rule})"


def _env_off(name: str, env) -> bool:
  return env.get(name, "1").strip().lower() in ("0", "false", "off", "no")


def canonical(implementation: str | None) -> str | None:
  """``implementation`` with aliases resolved (the registry's names); None stays None."""
  return REGISTRY.canonical(implementation)


def triton_supports(q_shape, kv_shape, dtype, *, device: Device, **kw) -> str | None:
  """Reason the Triton kernel cannot compute the call, or None."""
  return REGISTRY.get("triton").supports(AttentionCall(q_shape, kv_shape, dtype, **kw), device)


def mosaic_supports(q_shape, kv_shape, dtype, *, device: Device, **kw) -> str | None:
  """Reason the Mosaic GPU kernels cannot compute the call, or None (``device`` with no
  compute capability: interpret mode)."""
  return REGISTRY.get("mosaic").supports(AttentionCall(q_shape, kv_shape, dtype, **kw), device)


def explain_dispatch(q_shape, kv_shape, dtype, *, mask: Mask | None = None, bias: bool = False,
                     dense_mask: bool = False, dropout: bool = False, score_mod=None,
                     precision=None, module: bool = False, implementation: str | None = None,
                     backward_pass_impl: str = "auto", split_kv=None, kernel_args_default: bool = True,
                     v_head_dim: int | None = None, device: Device | None = None, env=None) -> Decision:
  """Returns the :class:`Decision` for a call described by shapes and flags.

  Args:
    q_shape: ``(batch, q_len, q_heads, head_dim)``; kv_shape likewise for keys.
    dtype: input dtype.
    mask: a :class:`Mask` (position mask) or None; ``dense_mask``/``bias``/
      ``dropout`` flag the presence of those arguments.
    implementation: an explicit choice is checked, never replaced: if it cannot
      compute the call exactly, ValueError says why.
    split_kv: the Triton split-KV forward (see
      :func:`probjax.ops.attention.backends.triton.attention`); True or a config on a call
      that does not run the Triton kernel raises ValueError.
    kernel_args_default: False when the caller set kernel arguments
      (tile configs, a non-auto backward), which disables the device table.
    v_head_dim: the values' head_dim where it differs from the keys' (None: the same).
    device: defaults to :meth:`Device.current`; env defaults to ``os.environ``.
  """
  device = device or Device.current()
  decision = _decide(q_shape, kv_shape, dtype, mask=mask, bias=bias, dense_mask=dense_mask,
                     dropout=dropout, score_mod=score_mod, precision=precision, module=module,
                     implementation=implementation, backward_pass_impl=backward_pass_impl,
                     kernel_args_default=kernel_args_default, v_head_dim=v_head_dim, device=device,
                     env=env)
  if decision.implementation == "cudnn":
    decision = dataclasses.replace(decision, route=cudnn_backend.route(env))
  if decision.implementation != "triton":
    if split_kv is not None and split_kv is not False:
      raise ValueError(f"split_kv={split_kv!r} configures the Triton kernel, but this call runs "
                       f"{decision}; pass implementation='triton'")
    return decision
  from probjax.ops.attention.backends.triton import decode  # local: the kernels import Pallas
  kind = "sm_%d%d" % device.compute_capability if device.compute_capability else "interpret"
  cfg = decode.plan(q_shape, kv_shape, dtype, mask=mask, score_mod=score_mod, split_kv=split_kv,
                    device=kind)
  return dataclasses.replace(decision, split_kv=cfg.num_splits if cfg is not None else 0)


def _decide(q_shape, kv_shape, dtype, *, mask, bias, dense_mask, dropout, score_mod, precision,
            module, implementation, backward_pass_impl, kernel_args_default, v_head_dim, device,
            env) -> Decision:
  env = os.environ if env is None else env
  dtype = jnp.dtype(dtype)
  impl = canonical(implementation)
  kw = dict(mask=mask, score_mod=score_mod, bias=bias, dense_mask=dense_mask, dropout=dropout,
            v_head_dim=v_head_dim)
  if backward_pass_impl == "mosaic" and impl != "mosaic":
    raise ValueError("backward_pass_impl='mosaic' is the Mosaic GPU kernel's backward: it needs "
                     f"implementation='mosaic', got {implementation!r}")

  if impl == "xla":
    return Decision("xla", "requested", formulation=xla_formulation(q_shape, kv_shape, device))
  if impl is not None:
    call = AttentionCall(q_shape, kv_shape, dtype, precision=precision, module=module, **kw)
    why = REGISTRY.get(impl).supports(call, device)
    if why:
      raise ValueError(f"implementation={impl!r} cannot compute this call exactly: {why}")
    backward = _resolve_backward(backward_pass_impl, mask) if impl != "cudnn" else "auto"
    return Decision(impl, "requested", backward)

  # implementation=None: the default.
  if device.platform != "gpu":
    return Decision("xla", f"platform {device.platform}: exact linear-memory XLA path")
  b, tq, h, _ = q_shape
  tk = kv_shape[1]
  what = _not_for_kernels(bias=bias, dense_mask=dense_mask, dropout=dropout, precision=precision, module=module)
  if what:
    return Decision("xla", f"{what}: the kernels cannot take it{_DENSE_MASK_HINT if dense_mask else ''}",
                    formulation=xla_formulation(q_shape, kv_shape, device))

  table = None
  if kernel_args_default and not _env_off("PROBJAX_ATTENTION_DEVICE_DEFAULTS", env):
    table = attention_device.lookup(device.compute_capability)
  if table is not None:
    cc = "sm_%d%d" % device.compute_capability
    decoding = tq <= table.decode_max_q_len and tk >= table.decode_min_kv_len
    if (not _env_off("PROBJAX_ATTENTION_CUDNN", env) and b * h * tq * tk >= table.cudnn_min_work
        and q_shape[-1] >= table.cudnn_min_head_dim and not decoding):
      if REGISTRY.get("cudnn").supports(AttentionCall(q_shape, kv_shape, dtype, **kw), device) is None:
        rule = f"{cc} device table: eligible 16-bit call above the cuDNN work threshold"
        work, causal = b * h * tq * tk, mask is not None and mask.is_causal()
        mosaic_fwd = _mosaic_forward(q_shape, kv_shape, dtype, table, device, env, kw)
        grad, why = "cudnn", ""
        if (causal and work <= dict(table.grad_mosaic_band_max_work).get(q_shape[-1], -1)
            and _mosaic_allowed(q_shape, kv_shape, dtype, device, env, kw)):
          grad, why = "mosaic", "; differentiated causal: the Mosaic forward with the Triton backward is faster"
        elif (q_shape[-1] <= table.grad_triton_max_head_dim and work < table.grad_triton_max_work
              and tk <= table.grad_triton_max_kv_len
              and triton_supports(q_shape, kv_shape, dtype, device=device, **kw) is None):
          grad, why = "triton", "; differentiated: the Triton kernel's backward is faster"
        ranges = table.mosaic_forward_ragged_work if _ragged(q_shape, kv_shape) else table.mosaic_forward_work
        fast = any(m == _mask_kind(mask) and d == q_shape[-1] and lo <= work and (hi is None or work <= hi)
                   for m, d, lo, hi in ranges)
        backward = "auto" if grad == "cudnn" else _resolve_backward(backward_pass_impl, mask, table)
        if fast and mosaic_fwd:
          return Decision("mosaic", rule + "; forward: the Mosaic kernel is faster at this mask, head_dim "
                          "and work" + why, backward, grad_implementation=None if grad == "mosaic" else grad)
        return Decision("cudnn", rule + (why and why + " at this head_dim and work"), backward,
                        grad_implementation=None if grad == "cudnn" else grad)
    band = mask is not None and mask.has_band
    dense_max = table.fp32_band_dense_max_len if band else table.fp32_dense_max_len
    if dtype == jnp.float32 and max(tq, tk) <= dense_max and score_mod is None \
        and q_shape[-1] > table.fp32_kernel_max_head_dim and _dense_fits(q_shape, kv_shape, device):
      return Decision("xla", f"{cc} device table: float32 runs fastest in XLA's dense formulation (TF32)",
                      formulation="dense")
  if tk < MIN_KERNEL_KV_LEN:
    return Decision("xla", f"fewer than {MIN_KERNEL_KV_LEN} keys: the einsum is faster",
                    formulation=xla_formulation(q_shape, kv_shape, device))
  why = triton_supports(q_shape, kv_shape, dtype, device=device, **kw)
  if why is None:
    backward = _resolve_backward(backward_pass_impl, mask, table)
    if _mosaic_forward(q_shape, kv_shape, dtype, table, device, env, kw):  # so the table (and cc) exist
      mosaic_bwd_min = dict(table.mosaic_backward_min_work).get(q_shape[-1])
      if mosaic_bwd_min is not None and b * h * tq * tk >= mosaic_bwd_min:
        return Decision("mosaic", f"{cc} device table: long 16-bit call, the Mosaic forward and "
                        "backward are faster than the Triton kernel's", "mosaic")
      return Decision("mosaic", f"{cc} device table: long 16-bit call, the Mosaic forward is faster "
                      "than the Triton kernel's (the Triton backward)", backward)
    return Decision("triton", "fused kernel: exact for this call", backward)
  return Decision("xla", f"the kernel cannot take it ({why})", formulation=xla_formulation(q_shape, kv_shape, device))


def _mosaic_allowed(q_shape, kv_shape, dtype, device: Device, env, kw) -> bool:
  """Whether a device-table rule may pick the Mosaic kernel for this call: not opted out
  (``PROBJAX_ATTENTION_MOSAIC=0``) and the kernel computes it exactly."""
  return (not _env_off("PROBJAX_ATTENTION_MOSAIC", env)
          and mosaic_supports(q_shape, kv_shape, dtype, device=device, **kw) is None)


def _mask_kind(mask: Mask | None) -> str | None:
  """The device table's name for the masks cuDNN takes: "none", "causal" or "window" (a causal
  sliding window, ``LocalWindowMask(left, 0)``); None for any other."""
  if mask is None:
    return "none"
  if mask.is_causal():
    return "causal"
  return "window" if mask.components == ("window",) and mask.upper == 0 else None


def _ragged(q_shape, kv_shape) -> bool:
  """Lengths that are not multiples of the Mosaic kernel's 128-row tiles (a partial last tile)."""
  return bool(q_shape[1] % 128 or kv_shape[1] % 128)


def _mosaic_forward(q_shape, kv_shape, dtype, table, device: Device, env, kw) -> bool:
  """Whether the device table's Mosaic rule replaces the Triton forward of this call."""
  return (table is not None and min(q_shape[1], kv_shape[1]) >= table.mosaic_min_len
          and _mosaic_allowed(q_shape, kv_shape, dtype, device, env, kw))


# The structured masks the kernels take in place of a dense one.
_DENSE_MASK_HINT = ("; a structured mask does not force the XLA path: CausalMask or LocalWindowMask for a "
                    "diagonal band, KVLenMask or LengthMask for padding, SegmentMask for packed documents")


def _not_for_kernels(*, bias=False, dense_mask=False, dropout=False, precision=None, module=False) -> str | None:
  """The first argument no fused kernel takes, or None."""
  for present, what in ((bias, "additive bias"), (dense_mask, "dense boolean mask"), (dropout, "dropout"),
                        (precision is not None, "non-default precision"),
                        (module, "attention weights requested (module)")):
    if present:
      return what
  return None


def _dense_fits(q_shape, kv_shape, device: Device) -> bool:
  if device.memory_bytes is None:
    return True
  b, tq, h, _ = q_shape
  return b * h * tq * kv_shape[1] * _DENSE_BYTES_PER_SCORE <= device.memory_bytes // 4


def xla_formulation(q_shape, kv_shape, device: Device) -> str:
  """On GPUs XLA's dense formulation is far faster than the tiled loop (whose tiles run one
  after another) while it fits; elsewhere the length decides (dense up to 256, then tiles)."""
  if device.platform == "gpu" and _dense_fits(q_shape, kv_shape, device):
    return "dense"
  return "auto"


def _resolve_backward(backward_pass_impl, mask: Mask | None, table=None) -> str:
  if backward_pass_impl != "auto":
    return backward_pass_impl
  if table is not None:
    return table.backward_pass_impl_band if mask is not None and mask.has_band else table.backward_pass_impl
  return "auto"  # the Triton backend's generic rules (config.BACKWARD_IMPL_RULES) resolve it
