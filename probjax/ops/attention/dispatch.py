"""Which implementation computes a call: an ordered list of small rules over the device table.

Everything here is a pure function of the call's static description (:class:`AttentionCall`),
the device (platform, compute capability, memory) and the environment, so it is tested on CPU
with faked devices.

``implementation=None`` runs :data:`RULES` in order, each ``rule(call, device, defaults) ->
Decision | None``, and the first decision wins (the last rule always decides).
``defaults`` is the device table in effect (:mod:`probjax.ops.attention.tuning`): None off
a table device, when a kernel argument is set or under
``PROBJAX_ATTENTION_DEVICE_DEFAULTS=0``; a rule whose group of the table is None (switched
off by ``PROBJAX_ATTENTION_CUDNN=0`` or ``PROBJAX_ATTENTION_MOSAIC=0``) does not apply.

  1. :func:`off_gpu`: not on an NVIDIA GPU → XLA.
  2. :func:`kernel_arguments`: bias, dense mask, dropout, precision, ``module`` → XLA.
  3. :func:`mosaic_primal`: a call of rule 4 whose forward the Mosaic kernel runs faster →
     the Mosaic forward; under grad rules 5-6 or cuDNN.
  4. :func:`cudnn`: eligible 16-bit call above the cuDNN work threshold, not decoding → cuDNN
     (in a measured range, the Triton forward); under grad rules 5-6 or cuDNN.
  5. :func:`grad_mosaic` (under grad, rules 3-4): causal up to a work per head_dim → the Mosaic
     forward with the Triton backward.
  6. :func:`grad_triton` (under grad, rules 3-4): small head_dim, work and key count → Triton.
  7. :func:`fp32_dense`: float32 above a head_dim while it fits → XLA's dense formulation.
  8. :func:`few_keys`: fewer than ``MIN_KERNEL_KV_LEN`` keys → XLA.
  9. :func:`mosaic_long`: a call of rule 10, 16-bit, both lengths long → the Mosaic forward
     (and backward at large D128 work); cross-attention of few queries over many keys at a
     wide head_dim without a window or key lengths, at any length.
  10. :func:`triton`: the fused Triton kernel, where it computes the call exactly.
  11. :func:`xla`: otherwise XLA.

An explicit ``implementation=`` is checked against its backend's ``supports``, never replaced.
"""

from __future__ import annotations

import dataclasses
import os

import jax.numpy as jnp

from probjax.core import autotune as core_autotune
from probjax.core import config
from probjax.core.device import Device
from probjax.core.dispatch import REQUESTED, Decision
from probjax.ops.attention import tuning
from probjax.ops.attention.backends import cudnn as cudnn_backend
from probjax.ops.attention.call import TRITON_MASK_KINDS, AttentionCall
from probjax.ops.attention.registry import REGISTRY
from probjax.ops.attention.masks import Mask
from probjax.ops.attention.tuning import DeviceDefaults

MIN_KERNEL_KV_LEN = 32
# XLA's dense formulation keeps a few float32 [B, H, Tq, Tkv] arrays for the backward.
_DENSE_BYTES_PER_SCORE = 4 * 4


def _xla(rule: str, formulation: str = "auto") -> Decision:
  """XLA's exact path; ``formulation``: "auto" (by length), "dense" or "flash"."""
  return Decision("xla", rule, config=(("formulation", formulation),))


def _differentiated_by_cudnn() -> Decision:
  return Decision("cudnn", "differentiated: cuDNN's forward and backward")


def canonical(implementation: str | None) -> str | None:
  """``implementation`` with aliases resolved (the registry's names); None stays None."""
  return REGISTRY.canonical(implementation)


def explain_dispatch(q_shape, kv_shape, dtype, *, mask: Mask | None = None, bias: bool = False,
                     dense_mask: bool = False, dropout: bool = False, score_mod=None, scale=None,
                     precision=None, module: bool = False, implementation: str | None = None,
                     backward_pass_impl: str = "auto", split_kv=None, kernel_args_default: bool = True,
                     v_head_dim: int | None = None, page_size: int | None = None, device: Device | None = None,
                     env=None) -> Decision:
  """Returns the :class:`Decision` for a call described by shapes and flags.

  Args:
    q_shape: ``(batch, q_len, q_heads, head_dim)``; kv_shape likewise for keys.
    dtype: input dtype.
    mask: a :class:`Mask` (position mask) or None; ``dense_mask``/``bias``/
      ``dropout`` flag the presence of those arguments.
    scale: the softmax scale (None: ``head_dim ** -0.5``); the Mosaic kernel refuses a
      non-positive one without a ``score_mod``.
    implementation: an explicit choice is checked, never replaced: if it cannot
      compute the call exactly, ValueError says why.
    split_kv: the Triton split-KV forward (see
      :func:`probjax.ops.attention.backends.triton.attention`); True or a config on a call
      that does not run the Triton kernel raises ValueError.
    kernel_args_default: False when the caller set kernel arguments
      (tile configs, a non-auto backward), which disables the device table.
    v_head_dim: the values' head_dim where it differs from the keys' (None: the same).
    page_size: a paged KV cache's page length (``kv_shape`` the contiguous shape its pages stand
      for; :mod:`probjax.ops.attention.paged`): only backends that read pages take it (the
      Triton split-KV decode kernel); the rules give the others' calls to XLA, which gathers.
    device: defaults to :meth:`Device.current`; env defaults to ``os.environ``.
  """
  device = device or Device.current()
  env = os.environ if env is None else env
  call = AttentionCall(q_shape, kv_shape, dtype, mask=mask, score_mod=score_mod, scale=scale, bias=bias,
                       dense_mask=dense_mask, dropout=dropout, module=module, precision=precision,
                       backward_pass_impl=backward_pass_impl, v_head_dim=v_head_dim, page_size=page_size)
  impl = canonical(implementation)
  if backward_pass_impl == "mosaic" and impl != "mosaic":
    raise ValueError("backward_pass_impl='mosaic' is the Mosaic GPU kernel's backward: it needs "
                     f"implementation='mosaic', got {implementation!r}")
  if impl is None:
    decision = None
    if kernel_args_default and split_kv is None and page_size is None and core_autotune.active(env):
      # Opt-in autotuning (probjax.autotune): a measured (or cached) choice, else the rules.
      from probjax.ops.attention import autotune  # local: it measures (and loads backends) when on
      decision = autotune.decide(call, device, env, resolve_backward=_resolve_backward)
    if decision is None:
      decision = decide(call, device, defaults_in_effect(device, env) if kernel_args_default else None)
  else:
    decision = _requested(impl, call, device)
  if decision.implementation == "cudnn":
    decision = decision.replace(config={"route": cudnn_backend.route(env)})
  if decision.implementation != "triton":
    if split_kv is not None and split_kv is not False:
      raise ValueError(f"split_kv={split_kv!r} configures the Triton kernel, but this call runs "
                       f"{decision}; pass implementation='triton'")
    return decision
  from probjax.ops.attention.backends.triton import decode  # local: the kernels import Pallas
  kind = "sm_%d%d" % device.compute_capability if device.compute_capability else "interpret"
  cfg = decode.plan(q_shape, kv_shape, dtype, mask=mask, score_mod=score_mod, split_kv=split_kv,
                    device=kind, v_head_dim=call.v_head_dim, page_size=page_size)
  return decision if cfg is None else decision.replace(config={"split_kv": cfg.num_splits})


def defaults_in_effect(device: Device, env) -> DeviceDefaults | None:
  """The device table's entry for ``device`` less the groups its opt-outs switch off
  (``PROBJAX_ATTENTION_CUDNN=0``: rules 3-4; ``PROBJAX_ATTENTION_MOSAIC=0``: rules 3, 5, 9),
  or None (no entry, or ``PROBJAX_ATTENTION_DEVICE_DEFAULTS=0``)."""
  if not config.ATTENTION_DEVICE_DEFAULTS.enabled(env):
    return None
  defaults = tuning.lookup(device.compute_capability)
  if defaults is None:
    return None
  off = {}
  if not config.ATTENTION_CUDNN.enabled(env):
    off.update(cudnn=None)
  if not config.ATTENTION_MOSAIC.enabled(env):
    off.update(mosaic_primal=None, grad_mosaic=None, mosaic_long=None)
  return dataclasses.replace(defaults, **off)


def _requested(impl: str, call: AttentionCall, device: Device) -> Decision:
  """An explicit ``implementation=``: checked, never replaced."""
  if impl == "xla":
    return _xla(REQUESTED, xla_formulation(call.q_shape, call.kv_shape, device))
  why = REGISTRY.get(impl).supports(call, device)
  if why:
    raise ValueError(f"implementation={impl!r} cannot compute this call exactly: {why}")
  takes_variants = bool(REGISTRY.get(impl).backward_pass_impls)
  return Decision(impl, REQUESTED, backward=_resolve_backward(call) if takes_variants else None)


def decide(call: AttentionCall, device: Device, defaults: DeviceDefaults | None) -> Decision:
  """The default's decision: the first of :data:`RULES` that decides (rule 11 always does)."""
  return next(d for d in (rule(call, device, defaults) for rule in RULES) if d is not None)


# The rules, numbered as in docs/dev/decisions.md and the README. The reasons they give are the
# ``Decision.rule`` strings explain_dispatch reports (tests/ops/attention/data/dispatch_grid.json records them).


def off_gpu(call: AttentionCall, device: Device, defaults) -> Decision | None:
  """Rule 1. Not on an NVIDIA GPU: XLA's exact linear-memory path.

  A CPU call at B1 H8 T4096 D64 float32 runs XLA's tiled flash loop: the Pallas kernels have no
  CPU lowering (interpret mode emulates them, far slower), and the tiled loop keeps memory
  linear in T where jax.nn's XLA attention materialises the 4096 x 4096 scores per head."""
  if device.platform != "gpu":
    return _xla(f"platform {device.platform}: exact linear-memory XLA path")
  return None


def kernel_arguments(call: AttentionCall, device: Device, defaults) -> Decision | None:
  """Rule 2. An argument no fused kernel takes (additive bias, dense boolean mask, dropout,
  non-default precision, the attention weights of a ``module``): XLA.

  A correctness rule: a causal call passed as a dense [T, T] boolean mask cannot run a kernel,
  which reads structured masks only; the reason names the structured mask to pass instead. So
  is a mask predicate the kernels do not compute (PrefixLMMask). A ``mask_mod``, which the
  Triton kernel computes exactly when asked (``implementation="triton"``), stays on XLA too:
  the device tables hold no measurement of the kernel with one, and the later rules choose
  kernels by measurements."""
  what = call.not_for_kernels()
  if what:
    why = (_MASK_MOD_RULE if _mask_mod_only(call)
           else f"{what}: the kernels cannot take it{_DENSE_MASK_HINT if call.dense_mask else ''}")
    return _xla(why, xla_formulation(call.q_shape, call.kv_shape, device))
  return None


def _mask_mod_only(call: AttentionCall) -> bool:
  """Whether the default's kernel rules refuse the call for its mask_mod alone, which the Triton
  kernel computes when asked (:data:`~probjax.ops.attention.call.TRITON_MASK_KINDS`)."""
  return call.mask is not None and "mask_mod" in call.mask.kinds and call.not_for_kernels(TRITON_MASK_KINDS) is None


def mosaic_primal(call: AttentionCall, device: Device, defaults: DeviceDefaults | None) -> Decision | None:
  """Rule 3. A call of rule 4 whose mask, head_dim and work lie in a range of
  ``defaults.mosaic_primal`` (lengths off the 128-row tiles: its ``ragged_work``), with both
  lengths at least ``defaults.mosaic_long.min_len``: the Mosaic GPU forward; under grad, rule 5
  or 6, else cuDNN's forward and backward.

  At B4 H8 T4096 causal bf16 D128 on sm_90 (work 2^29, in the causal D128 range) the Mosaic
  forward wins: its persistent CTAs run the causal query tiles heaviest first, so the diagonal's
  uneven tiles do not leave SMs idle at the end, and the two compute warpgroups take turns on
  the tensor cores while the softmax of the other runs. Unmasked calls in whole tiles have no
  range (cuDNN's forward is level or ahead there), nor causal work above 2^31, where cuDNN is
  ahead again; off the tiles (B4 H8 T3000) the Mosaic kernel reads the partial last tile with
  TMA's zero fill and is ahead unmasked too."""
  if defaults is None or defaults.mosaic_primal is None or not _cudnn_takes(call, device, defaults):
    return None
  ranges = defaults.mosaic_primal.ragged_work if _ragged(call) else defaults.mosaic_primal.work
  if not (_in_ranges(ranges, call) and min(call.q_len, call.kv_len) >= defaults.mosaic_long.min_len
          and _mosaic_takes(call, device)):
    return None
  return _kernel_forward("mosaic", "the Mosaic kernel", call, device, defaults)


def cudnn(call: AttentionCall, device: Device, defaults: DeviceDefaults | None) -> Decision | None:
  """Rule 4. An eligible bf16/fp16 call (a mask cuDNN computes exactly, head_dim from
  ``defaults.cudnn.min_head_dim`` to ``max_head_dim``) with at least its work threshold
  (``defaults.cudnn.min_work``, or ``min_work_at`` for its mask and head_dim), not decoding
  (``defaults.decode``): cuDNN, or the Triton forward in a ``triton_forward_work`` range; under
  grad, rule 5 or 6, else cuDNN's forward and backward.

  At B4 H8 T2048 D128 unmasked bf16 on sm_90 (work 2^27) cuDNN's fused forward and backward
  are ahead of the Triton kernel's; at B4 H8 T1024 (2^25), a call bound by its fixed per-call
  cost, the Triton forward is ahead, hence the work threshold. At head_dim 32 the Triton kernel
  is ahead at every measured length. From 40 it is not: it loads head_dims padded to a power of
  two, so at 40 or 48 (padded to 64) and at 80 or 96 (to 128) a third or more of its matmul
  work multiplies zeros, where cuDNN computes the width as it is: at B4 H8 T4096 D48 cuDNN's
  forward is 1.3x ahead, and at D80 and D96 it is ahead from a quarter of the general
  threshold, key lengths included. Unmasked D64 at B4 H8 T1500 (work 72 x 2^20) the Triton
  forward is ahead of cuDNN's while cuDNN's forward and backward are ahead under grad: a
  ``triton_forward_work`` range. At head_dim 192 or 256 cuDNN runs from any work: the Triton
  kernel pads 192 to 256, and at these widths both probjax kernels' backwards fall far behind
  cuDNN's (B2 H24 T6133 D192 unmasked, forward and backward: cuDNN's take a third of the time
  of the Mosaic forward with the Triton backward). Decoding, B8 H32/8 with 16 queries against
  65536 keys, stays off cuDNN: its forward parallelises over query tiles, one per (batch, head)
  here, each walking all the keys, where the Triton split-KV forward spreads the keys over the
  SMs (rule 10)."""
  if defaults is None or not _cudnn_takes(call, device, defaults):
    return None
  if _in_ranges(defaults.cudnn.triton_forward_work, call):
    return _kernel_forward("triton", "the Triton kernel", call, device, defaults)
  grad = _under_grad(call, device, defaults)
  if grad is None:
    return Decision("cudnn", _cudnn_rule(device))
  return Decision("cudnn", f"{_cudnn_rule(device)}; {grad.rule} at this head_dim and work", grad=grad)


def grad_mosaic(call: AttentionCall, device: Device, defaults: DeviceDefaults) -> Decision | None:
  """Rule 5 (what a differentiated call of rules 3-4 runs). ``CausalMask()`` alone at a
  head_dim of ``defaults.grad_mosaic.causal_max_work`` and at most that work: the Mosaic GPU
  forward with the Triton backward.

  At B4 H8 T4096 causal bf16 D64 on sm_90 (2^29, at the D64 limit) the Mosaic forward, which
  saves the same residuals (output and log-sum-exp), with the Triton fused backward, which
  orders its tiles before its heads under a band, beats cuDNN's forward and backward. At D128
  the limit is 2^27 (T2048): from T4096 cuDNN's backward is ahead. Off the 128-row tiles
  (``ragged_causal_max_work``) D128 has no range: at B4 H8 T1500 the Mosaic forward's partial
  last tiles make it slower than cuDNN's, and cuDNN's forward and backward are ahead."""
  g = defaults.grad_mosaic
  limits = None if g is None else g.ragged_causal_max_work if _ragged(call) else g.causal_max_work
  limit = None if limits is None else dict(limits).get(call.head_dim)
  if (limit is not None and call.mask is not None and call.mask.is_causal() and call.work <= limit
      and _mosaic_takes(call, device)):
    return Decision("mosaic", "differentiated causal: the Mosaic forward with the Triton backward is faster",
                    backward=_resolve_backward(call, defaults))
  return None


def grad_triton(call: AttentionCall, device: Device, defaults: DeviceDefaults) -> Decision | None:
  """Rule 6 (what a differentiated call of rules 3-4 runs, after rule 5). head_dim at most
  ``defaults.grad_triton.max_head_dim``, work below its ``max_work`` and at most its
  ``max_kv_len`` keys: the Triton kernel's forward and backward.

  At B64 H8 T512 D64 bf16 on sm_90 (work 2^27) the Triton kernel's forward and backward were
  measured ahead of cuDNN's; at B4 H8 T2048 D64, the same work over four times the keys per
  row, cuDNN's were: work alone does not separate the two, the key count does. At D128 cuDNN's
  backward is ahead already at B4 H8 T2048."""
  g = defaults.grad_triton
  if (call.head_dim <= g.max_head_dim and call.work < g.max_work and call.kv_len <= g.max_kv_len
      and REGISTRY.get("triton").supports(call, device) is None):
    return Decision("triton", "differentiated: the Triton kernel's backward is faster",
                    backward=_resolve_backward(call, defaults))
  return None


def fp32_dense(call: AttentionCall, device: Device, defaults: DeviceDefaults | None) -> Decision | None:
  """Rule 7. float32 with head_dim above ``defaults.fp32_dense.kernel_max_head_dim`` and both
  lengths at most its ``max_len`` (``band_max_len`` under a causal/window band), no
  ``score_mod``, while the dense scores fit in a quarter of device memory: XLA's dense
  formulation (TF32 matmuls).

  At B4 H8 T4096 D128 float32 on sm_90 XLA's two dense einsums are large TF32 GEMMs, where the
  kernel's float32 tiles (half the elements of its 16-bit ones in the same shared memory) run
  small matmuls. Under a causal band the kernel skips the empty half of the tiles, which the
  dense formulation computes: the kernel is ahead from 1024 keys. At head_dim 64 it is ahead at
  every measured length."""
  if defaults is None:
    return None
  band = call.mask is not None and call.mask.has_band
  f = defaults.fp32_dense
  dense_max = f.band_max_len if band else f.max_len
  if (call.dtype == jnp.float32 and max(call.q_len, call.kv_len) <= dense_max and call.score_mod is None
      and call.head_dim > f.kernel_max_head_dim and _dense_fits(call.q_shape, call.kv_shape, device)):
    return _xla(f"{_cc(device)} device table: float32 runs fastest in XLA's dense formulation (TF32)", "dense")
  return None


def few_keys(call: AttentionCall, device: Device, defaults) -> Decision | None:
  """Rule 8. Fewer than ``MIN_KERNEL_KV_LEN`` (32) keys: XLA.

  A kernel's key tile is then mostly masked padding, and XLA's einsum, one batched matmul, is
  assumed faster (unmeasured below 32 keys). From 32 keys the kernel is level or ahead: at B64 H8
  with 64 keys, D32 level and D64 ahead; in the ISAB block (B64 H4 D32, 1024 queries over 32
  inducing keys) the block is faster with the Triton kernel for that attention than with XLA's
  einsum (docs/dev/decisions.md, rule 8)."""
  if call.kv_len < MIN_KERNEL_KV_LEN:
    return _xla(f"fewer than {MIN_KERNEL_KV_LEN} keys: the einsum is faster",
                xla_formulation(call.q_shape, call.kv_shape, device))
  return None


def mosaic_long(call: AttentionCall, device: Device, defaults: DeviceDefaults | None) -> Decision | None:
  """Rule 9. A call rule 10 would give the Triton kernel, 16-bit, with both lengths at least
  ``defaults.mosaic_long.min_len`` (a ``score_mod`` included, where Mosaic GPU lowers it): the
  Mosaic GPU forward; its backward too at a head_dim of ``backward_min_work`` from that work,
  else the Triton backward.

  At B1 H16 T16384 D128 bf16 with 4 packed documents (a mask cuDNN cannot take) on sm_90 the
  Mosaic forward beats the Triton forward: a producer warpgroup keeps a ring of K/V tiles in
  flight by TMA while two compute warpgroups take turns on the tensor cores; with the soft cap
  30 tanh(s/30) the gap grows, one warpgroup's tanh running under the other's matmul. At T1024
  the Triton forward is ahead; at D128 from 2^29 work the Mosaic backward is ahead of the Triton
  one, at D64 it is behind. A causal window at D64 (``triton_masks``) keeps the Triton forward:
  at B21 H56 T6644 with a 177-key window the Mosaic forward visits more key tiles per query
  tile than the band holds and is half the Triton forward's speed."""
  m = None if defaults is None else defaults.mosaic_long
  if (m is None or REGISTRY.get("triton").supports(call, device) is not None
      or not _mosaic_takes(call, device)):
    return None
  if min(call.q_len, call.kv_len) < m.min_len:
    if _long_keys(call, m):
      return Decision("mosaic", f"{_cc(device)} device table: 16-bit cross-attention at head_dim "
                      f"{call.head_dim}, {call.kv_len // call.q_len}x more keys than queries, no window or "
                      "key lengths: the Mosaic forward is faster than the Triton kernel's "
                      "(the Triton backward)",
                      backward=_resolve_backward(call, defaults))
    return None
  if (_mask_kind(call.mask), call.head_dim) in m.triton_masks:
    return None
  bwd_min = dict(m.backward_min_work).get(call.head_dim)
  if bwd_min is not None and call.work >= bwd_min and _mosaic_backward_takes(call, device):
    return Decision("mosaic", f"{_cc(device)} device table: long 16-bit call, the Mosaic forward and "
                    "backward are faster than the Triton kernel's", backward="mosaic")
  return Decision("mosaic", f"{_cc(device)} device table: long 16-bit call, the Mosaic forward is faster "
                  "than the Triton kernel's (the Triton backward)",
                  backward=_resolve_backward(call, defaults))


def _long_keys(call: AttentionCall, m) -> bool:
  """Rule 9's short calls for the Mosaic forward: cross-attention from ``m.cross_min_head_dim``,
  at least ``m.cross_min_q_len`` queries and ``m.cross_min_kv_per_q`` times as many keys, and no
  mask or a causal one from the bottom-right diagonal on.

  These calls miss rule 4 (a causal offset cuDNN does not take, or too little work) and fall
  short of ``min_len`` by their queries, yet their work is in the keys, where the Mosaic
  forward, two compute warpgroups fed by a producer warpgroup, is ahead of the Triton one: e.g.
  1181 queries of 64 heads over 19748 keys at D192 with the bottom-right causal mask run 3.5x
  faster on it. A window or key lengths keep the Triton kernel, which skips the masked key
  tiles of each row tile where the Mosaic forward visits more of them: 581 queries over 20294
  keys with a 618-key window at D256 took it 1.8x the Triton forward's time. Self-attention of
  the same short lengths stays on Triton (at B4 H8 T1024 D128 its forward is ahead)."""
  mask = call.mask
  # causal from the bottom-right diagonal on: each query sees most keys (offset 0 would leave
  # the first query one key, a band the Triton kernel skips past)
  plain = mask is None or (mask.components == ("causal",)
                           and mask.band_bounds[1] >= call.kv_len - call.q_len)
  return (plain and call.head_dim >= m.cross_min_head_dim and call.q_len >= m.cross_min_q_len
          and call.kv_len >= m.cross_min_kv_per_q * call.q_len)


def triton(call: AttentionCall, device: Device, defaults: DeviceDefaults | None) -> Decision | None:
  """Rule 10. The fused Triton kernel, where it computes the call exactly (position masks and
  GQA included); ``backward_pass_impl="auto"`` from ``defaults.backward``, without a table the
  Triton backend's own rules.

  On an RTX 3090 (no table) a B4 H32/8 T4096 D128 causal call runs it: tiles past the diagonal
  are never loaded, K/V heads are read in place under GQA, and memory stays linear in T.
  Decoding calls (at most 64 queries, at least 1024 keys) get its split-KV forward."""
  if REGISTRY.get("triton").supports(call, device) is None:
    return Decision("triton", "fused kernel: exact for this call",
                    backward=_resolve_backward(call, defaults))
  return None


def xla(call: AttentionCall, device: Device, defaults) -> Decision:
  """Rule 11. Otherwise XLA, naming why the Triton kernel cannot take the call.

  A score_mod with ``jnp.round`` (no Pallas lowering) or a head_dim above the kernel's limit
  runs XLA's exact formulation instead of failing inside a kernel's lowering."""
  why = REGISTRY.get("triton").supports(call, device)
  return _xla(f"the kernel cannot take it ({why})", xla_formulation(call.q_shape, call.kv_shape, device))


RULES = (off_gpu, kernel_arguments, mosaic_primal, cudnn, fp32_dense, few_keys, mosaic_long, triton, xla)
# What a differentiated call of rules 3-4 runs instead of their primal kernel, first match.
GRAD_RULES = (grad_mosaic, grad_triton)


def _under_grad(call: AttentionCall, device: Device, defaults: DeviceDefaults) -> Decision | None:
  return next((d for d in (rule(call, device, defaults) for rule in GRAD_RULES) if d is not None), None)


# The kernel backends whose fused forward + JVP kernel computes a jvp where the call's own
# backend has none (cuDNN), fastest first: on sm_90 the Mosaic kernel, elsewhere the Triton one.
TANGENT_BACKENDS = ("mosaic", "triton")


def tangent_candidates(decision: Decision, call: AttentionCall, device: Device) -> tuple[str, ...]:
  """The backends, in order, whose fused forward + JVP kernel may compute ``jax.jvp`` of a kernel
  call: the decision's own, then those of :data:`TANGENT_BACKENDS` that compute the call. The
  first with a kernel for the call runs it (``Backend.tangent_kernel``: None where it has none,
  e.g. a ``score_mod``); with none, the tangent is the XLA formulation's jvp. E.g. a long
  unmasked bf16 call at head_dim 128 on an H100 runs cuDNN forward and backward, and its jvp
  the Mosaic kernel: cuDNN has no forward-mode kernel, and XLA's jvp of the call is the dense
  einsum (quadratic memory) or a loop over tiles."""
  others = tuple(n for n in TANGENT_BACKENDS
                 if n != decision.implementation and REGISTRY.get(n).supports(call, device) is None)
  return (decision.implementation, *others)


def _cc(device: Device) -> str:
  return "sm_%d%d" % device.compute_capability


def _cudnn_rule(device: Device) -> str:
  return f"{_cc(device)} device table: eligible 16-bit call above the cuDNN work threshold"


def _cudnn_takes(call: AttentionCall, device: Device, defaults: DeviceDefaults) -> bool:
  """Rule 4's conditions (rule 3 runs on the same calls)."""
  if defaults.cudnn is None:
    return False
  decoding = call.q_len <= defaults.decode.max_q_len and call.kv_len >= defaults.decode.min_kv_len
  return (call.work >= defaults.cudnn.threshold(_mask_kind(call.mask), call.head_dim)
          and call.head_dim >= defaults.cudnn.min_head_dim
          and (call.head_dim <= defaults.cudnn.max_head_dim or call.v_head_dim is not None)
          and not decoding and REGISTRY.get("cudnn").supports(call, device) is None)


def _kernel_forward(impl: str, name: str, call: AttentionCall, device: Device,
                    defaults: DeviceDefaults) -> Decision:
  """A call of rule 4 whose forward ``impl`` runs faster (rules 3 and 4): that forward, and
  under grad what rules 5-6 give, else cuDNN's forward and backward."""
  grad = _under_grad(call, device, defaults)
  rule = f"{_cudnn_rule(device)}; forward: {name} is faster at this mask, head_dim and work"
  if grad is None:
    return Decision(impl, rule, grad=_differentiated_by_cudnn())
  if grad.implementation == impl:
    return Decision(impl, f"{rule}; {grad.rule}", backward=grad.backward)
  return Decision(impl, f"{rule}; {grad.rule}", grad=grad)


def _in_ranges(ranges, call: AttentionCall) -> bool:
  """Whether ``call`` lies in one of ``((mask, head_dim, min_work, max_work), ...)`` (``max_work``
  None: no limit), both ends included."""
  kind, work = _mask_kind(call.mask), call.work
  return any(m == kind and d == call.head_dim and lo <= work and (hi is None or work <= hi)
             for m, d, lo, hi in ranges)


def _mosaic_takes(call: AttentionCall, device: Device) -> bool:
  """Whether the Mosaic kernel computes the call exactly (its rules' groups are None under
  ``PROBJAX_ATTENTION_MOSAIC=0``)."""
  return REGISTRY.get("mosaic").supports(call, device) is None


def _mosaic_backward_takes(call: AttentionCall, device: Device) -> bool:
  """Whether the Mosaic backward computes the call's gradient too: a table keyed by head_dim
  alone does not say so for every call of that head_dim (128 queries/keys with 256-wide values
  overflow its dK/dV registers; a score_mod whose vjp Mosaic GPU cannot lower)."""
  return REGISTRY.get("mosaic").supports(dataclasses.replace(call, backward_pass_impl="mosaic"), device) is None


def _mask_kind(mask: Mask | None) -> str | None:
  """The device table's name for the masks cuDNN takes: "none", "causal" or "window" (a causal
  sliding window, ``LocalWindowMask(left, 0)``); None for any other."""
  if mask is None:
    return "none"
  if mask.is_causal():
    return "causal"
  return "window" if mask.components == ("window",) and mask.upper == 0 else None


def _ragged(call: AttentionCall) -> bool:
  """Lengths that are not multiples of the Mosaic kernel's 128-row tiles (a partial last tile)."""
  return bool(call.q_len % 128 or call.kv_len % 128)


# The structured masks the kernels take in place of a dense one.
# The default keeps a mask_mod on the XLA path: the device tables hold no measurement of the
# Triton kernel with one, and its rules choose kernels by measurements.
_MASK_MOD_RULE = ("mask predicate 'mask_mod': the default keeps it on the XLA path (implementation='triton' "
                  "computes it in the fused kernel)")
_DENSE_MASK_HINT = ("; a structured mask does not force the XLA path: CausalMask or LocalWindowMask for a "
                    "diagonal band, KVLenMask or LengthMask for padding, SegmentMask for packed documents")


def _dense_fits(q_shape, kv_shape, device: Device) -> bool:
  if device.memory_bytes is None:
    return True
  b, tq, h, _ = q_shape
  return b * h * tq * kv_shape[1] * _DENSE_BYTES_PER_SCORE <= device.memory_bytes // 4


def xla_formulation(q_shape, kv_shape, device: Device) -> str:
  """On GPUs XLA's dense formulation is far faster than the tiled loop (whose tiles run one
  after another) while it fits; elsewhere the call's scores decide (``choose_formulation``)."""
  if device.platform == "gpu" and _dense_fits(q_shape, kv_shape, device):
    return "dense"
  return "auto"


def _resolve_backward(call: AttentionCall, defaults: DeviceDefaults | None = None) -> str:
  """The Triton backward a call's ``backward_pass_impl`` names: the device table's for "auto".

  At B4 H8 T600 D128 unmasked on sm_90 the fused backward (the dK/dV and dQ programs in one
  launch) is ahead of the split one (the same programs in two launches): each launch has a few
  hundred programs at most there, so the split's dQ launch starts only after the dK/dV launch's
  last wave, which the fused grid fills with dQ programs. The table's ``short_impl_max_kv_len``
  sends such short unmasked calls to the fused kernel."""
  if call.backward_pass_impl != "auto":
    return call.backward_pass_impl
  if defaults is None:
    return "auto"  # the Triton backend's generic rules (config.BACKWARD_IMPL_RULES) resolve it
  b = defaults.backward
  if call.mask is not None and call.mask.has_band:
    return b.band_impl
  short = dict(b.short_impl_max_kv_len).get(call.head_dim)
  return b.band_impl if short is not None and call.kv_len <= short else b.impl
