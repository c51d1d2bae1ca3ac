"""Tile configurations, the shared-memory model and the per-device tables.

Configs are frozen dataclasses validated on construction. Default configs come
from :data:`FORWARD_TABLE` / :data:`BACKWARD_TABLE` (per device kind, dtype and
head_dim) and are shrunk -- pipeline stages first, then blocks -- until the
shared-memory model fits the device (:data:`SMEM_LIMIT`). An explicit config
that does not fit raises ``ValueError``; nothing over budget is ever compiled.

Shared-memory model (bytes, ``s`` = itemsize, ``D`` = padded query/key head_dim,
``Dv`` = padded value head_dim, ``D`` unless given): Triton on sm_80+ buffers every
streamed tile once per pipeline stage and keeps the loop-invariant tiles resident:

* forward: ``stages * (K + V tiles) + Q tile`` = ``stages*bk*(D+Dv)*s + bq*D*s``;
* dK/dV (split/fused/onepass): ``stages * (Q + dO tiles) + K + V tiles``;
* dQ: ``stages * (K + V tiles) + Q + dO tiles``;
* split-KV forward: ``stages * (K + V tiles) + packed query rows``.

The H100 failures of the spec (327,680 bytes for the head_dim-256 forward at
128x64 tiles and 4 stages; 262,144 bytes for the fp32 head_dim-128 single-pass
backward at 64x128 tiles and 2 stages) are reproduced exactly by this model.

A mask_mod (:func:`mask_mod_smem_bytes`) adds, in every kernel, a zeroed copy of each
key-row tile the products read (:func:`tiles.unseen_keys_zeroed`): one K and one V tile
more in shared memory, plus the reduction row that finds the unseen keys.
"""

from __future__ import annotations

import dataclasses

import numpy as np

# The device tables are the core's: one description of every device.
from probjax.core.device import (DEFAULT_SM_COUNT, SM_COUNT, SMEM_PER_BLOCK as SMEM_LIMIT,  # noqa: F401
                                 DEFAULT_SMEM_PER_BLOCK as DEFAULT_SMEM_LIMIT)
# Shared with the Mosaic GPU kernels (re-exported: the Triton modules read them as config_lib.*).
from probjax.ops.attention.gpu import device_kind, kernel_device, order_group, smem_limit  # noqa: F401

MIN_BLOCK = 16  # Triton's tl.dot minimum: never request fewer rows.


PROGRAMS_PER_SM = 2  # a grid this many programs per SM deep keeps the device busy


def num_programs_target(device: str) -> int:
  """Programs that fill ``device`` (``PROGRAMS_PER_SM`` per SM)."""
  import jax  # local: config tables must import without initialising backends
  sms = None
  if device.startswith("sm_") and jax.devices()[0].platform == "gpu":
    sms = getattr(jax.devices()[0], "core_count", None)
  return PROGRAMS_PER_SM * (sms or SM_COUNT.get(device, DEFAULT_SM_COUNT))


BACKWARD_IMPLS = ("triton_onepass", "triton_fused", "triton_split")


def _pow2(name, v):
  if not isinstance(v, int) or v < MIN_BLOCK or v & (v - 1):
    raise ValueError(f"{name} must be a power of two >= {MIN_BLOCK}, got {v!r}")


def _warps_stages(num_warps, num_stages):
  if num_warps not in (1, 2, 4, 8):
    raise ValueError(f"num_warps must be one of 1, 2, 4, 8, got {num_warps!r}")
  if not isinstance(num_stages, int) or num_stages < 1:
    raise ValueError(f"num_stages must be an int >= 1, got {num_stages!r}")


@dataclasses.dataclass(frozen=True)
class ForwardConfig:
  """Forward tiles: ``block_q`` query rows per program, ``block_k`` keys per step.

  ``fast_exp2``: the softmax exponentials as one ``ex2.approx.ftz.f32`` instruction
  each, the scores' scale and shift folded into one ``fma.rn.f32`` before it
  (probabilities below 2**-126 flush to zero) instead of libdevice's ``exp2f``;
  GPU only (interpret mode computes ``jnp.exp2``). None: the device's entry in
  :data:`FAST_EXP2`.
  """
  block_q: int = 128
  block_k: int = 64
  num_warps: int = 4
  num_stages: int = 2
  fast_exp2: bool | None = None

  def __post_init__(self):
    _pow2("block_q", self.block_q)
    _pow2("block_k", self.block_k)
    _warps_stages(self.num_warps, self.num_stages)

  def smem_bytes(self, itemsize: int, head_dim: int, v_head_dim: int | None = None,
                 mask_mod: bool = False) -> int:
    """``mask_mod``: the call's mask has one (:func:`mask_mod_smem_bytes`)."""
    dv = head_dim if v_head_dim is None else v_head_dim
    extra = mask_mod_smem_bytes(self.block_k, itemsize, head_dim, dv) if mask_mod else 0
    return (self.num_stages * self.block_k * (head_dim + dv) + self.block_q * head_dim) * itemsize + extra


@dataclasses.dataclass(frozen=True)
class BackwardConfig:
  """Backward tiles: dK/dV kernel ``block_q_dkv x block_kv_dkv``, dQ kernel
  ``block_q_dq x block_kv_dq`` (the onepass backward uses the dK/dV pair);
  ``fast_exp2`` as in :class:`ForwardConfig`. ``group_splits``: dK/dV programs per KV
  tile and KV head, each summing ``G / group_splits`` query heads of the GQA group into a
  float32 partial that XLA adds up (None: the fewest that fill the device; 1: one program
  sums the whole group)."""
  block_q_dkv: int = 64
  block_kv_dkv: int = 64
  block_q_dq: int = 64
  block_kv_dq: int = 64
  num_warps: int = 4
  num_stages: int = 2
  fast_exp2: bool | None = None
  group_splits: int | None = None

  def __post_init__(self):
    for f in ("block_q_dkv", "block_kv_dkv", "block_q_dq", "block_kv_dq"):
      _pow2(f, getattr(self, f))
    _warps_stages(self.num_warps, self.num_stages)
    if self.group_splits is not None and (not isinstance(self.group_splits, int) or self.group_splits < 1):
      raise ValueError(f"group_splits must be None or an int >= 1, got {self.group_splits!r}")

  def splits_for(self, groups: int, programs_per_split: int, device: str) -> int:
    """``group_splits`` for a GQA group of ``groups`` heads when one split gives
    ``programs_per_split`` dK/dV programs (explicit: checked to divide ``groups``)."""
    if self.group_splits is not None:
      if groups % self.group_splits:
        raise ValueError(f"group_splits={self.group_splits} must divide the {groups} query heads "
                         "per KV head")
      return self.group_splits
    target = num_programs_target(device)
    for s in range(1, groups + 1):
      if groups % s == 0 and programs_per_split * s >= target:
        return s
    return groups

  def smem_bytes(self, itemsize: int, head_dim: int, onepass: bool = False,
                 v_head_dim: int | None = None, mask_mod: bool = False) -> int:
    """Bytes of the larger of the two kernels (dK/dV and dQ). ``onepass``: the dK/dV
    kernel also stages dS^T for the dQ product and the dQ tile for its atomic adds, plus
    the pipelined LSE/delta rows (calibrated on the H200: fp32 head_dim 128, 32 x 128 tiles,
    2 stages requested 246,272 bytes; bf16 head_dim 128, 64 x 128, 3 stages compiled).
    ``v_head_dim``: the width of V and dO (None: ``head_dim``). ``mask_mod``: the call's mask
    has one; each kernel holds :func:`mask_mod_smem_bytes` more for its key tile."""
    dv = head_dim if v_head_dim is None else v_head_dim
    row = (head_dim + dv) * itemsize  # (Q, dO) or (K, V)
    dkv = (self.num_stages * self.block_q_dkv + self.block_kv_dkv) * row
    if onepass:
      dkv += (self.block_q_dkv * self.block_kv_dkv + 2 * self.block_q_dkv * head_dim) * itemsize
      dkv += self.num_stages * 2 * self.block_q_dkv * 4
    dq = (self.num_stages * self.block_kv_dq + self.block_q_dq) * row
    if mask_mod:
      dkv += mask_mod_smem_bytes(self.block_kv_dkv, itemsize, head_dim, dv)
      dq += mask_mod_smem_bytes(self.block_kv_dq, itemsize, head_dim, dv)
    return max(dkv, dq)


def mask_mod_smem_bytes(block_k: int, itemsize: int, head_dim: int, v_head_dim: int) -> int:
  """Shared memory a mask_mod adds to a kernel whose key tile has ``block_k`` rows.

  On PARTIAL tiles the kernels zero the key rows no query of the tile sees
  (:func:`tiles.unseen_keys_zeroed`: they may hold NaN, which a zero probability does not
  cancel). The zeroed K and V are new values, not the loaded tiles, and they are operands of
  the tile's products (``dS^T K`` for dQ, ``P V``, ``q K^T``), which the tensor cores read from
  shared memory: Triton stages both copies there, beside the loaded (or, in the dK/dV kernels,
  resident) K and V, so they are not covered by the stage count. The ``[block_k]`` int32 row of
  the ``seen`` reduction and its scratch take ``block_k * 4 + 24`` more.

  Calibrated on the H100 failure it explains: the bf16 head_dim-128 one-pass backward at
  64 x 128 dK/dV tiles and 3 stages requested 280,600 bytes with a mask_mod, where the model
  without one gives 214,528: the difference, 66,072, is ``128 * (128 + 128) * 2`` (65,536,
  the two copies) ``+ 128 * 4 + 24`` (536).
  """
  return block_k * (head_dim + v_head_dim) * itemsize + block_k * 4 + 24


@dataclasses.dataclass(frozen=True)
class SplitKVConfig:
  """Split-KV launch: ``block_k`` keys per step, ``num_splits`` key splits (None:
  enough to fill the device), packed query rows per program ``block_rows`` (None:
  all rows of a GQA group, at least 16, at most 128)."""
  block_k: int = 64
  num_warps: int = 4
  num_stages: int = 2
  num_splits: int | None = None
  block_rows: int | None = None
  fast_exp2: bool | None = None

  def __post_init__(self):
    _pow2("block_k", self.block_k)
    if self.block_rows is not None:
      _pow2("block_rows", self.block_rows)
    _warps_stages(self.num_warps, self.num_stages)
    if self.num_splits is not None and (not isinstance(self.num_splits, int) or self.num_splits < 1):
      raise ValueError(f"num_splits must be None or an int >= 1, got {self.num_splits!r}")

  def smem_bytes(self, itemsize: int, head_dim: int, block_rows: int, v_head_dim: int | None = None) -> int:
    dv = head_dim if v_head_dim is None else v_head_dim
    return (self.num_stages * self.block_k * (head_dim + dv) + block_rows * head_dim) * itemsize


# Tuned tables: (device, dtype, head_dim) -> config. Entries are the starting
# point; `fit_*` shrinks them to the device and to the sequence lengths.
# sm_90 bf16 and fp32 D64/D128 entries are the fastest forced configs of the H200 tile sweeps
# (bench/results/h200/tiles.json, B4 H8 T4096 non-causal; the row's variant is
# named beside each entry). bf16 and fp32 D64 come from the first sweep (its re-run with the
# current kernel has auto within 3% of the best), fp32 D128 from the re-run. The other
# entries are FlashAttention-2 Triton starting points, not swept.
_F, _B = ForwardConfig, BackwardConfig
FORWARD_TABLE = {
    ("sm_90", "bfloat16", 64): _F(128, 128, 4, 3),   # bq128_bk128_s3_w4
    ("sm_90", "bfloat16", 128): _F(128, 64, 4, 2),   # bq128_bk64_s2_w4
    ("sm_90", "bfloat16", 256): _F(64, 64, 8, 2),
    ("sm_90", "float32", 64): _F(128, 64, 4, 3),    # bq128_bk64_s3_w4
    ("sm_90", "float32", 128): _F(128, 64, 8, 2),   # bq128_bk64_s2_w8 (18 fit of 36)
    ("default", "bfloat16", 32): _F(128, 64, 4, 3),
    ("default", "bfloat16", 64): _F(128, 64, 4, 3),
    ("default", "bfloat16", 128): _F(128, 64, 8, 2),
    ("default", "bfloat16", 256): _F(64, 32, 8, 2),
    ("default", "float32", 32): _F(64, 64, 4, 2),
    ("default", "float32", 64): _F(64, 64, 4, 2),
    ("default", "float32", 128): _F(64, 32, 4, 2),
    ("default", "float32", 256): _F(32, 32, 4, 1),
}
BACKWARD_TABLE = {
    ("sm_90", "bfloat16", 64): _B(32, 128, 128, 64, 4, 3),    # dkv32x128_dq128x64_s3_w4
    ("sm_90", "bfloat16", 128): _B(64, 128, 128, 64, 8, 3),   # dkv64x128_dq128x64_s3_w8
    ("sm_90", "float32", 64): _B(64, 128, 128, 64, 8, 3),     # dkv64x128_dq128x64_s3_w8
    ("sm_90", "float32", 128): _B(32, 128, 128, 32, 8, 3),    # dkv32x128_dq128x32_s3_w8
    ("default", "bfloat16", 32): _B(64, 64, 64, 64, 4, 2),
    ("default", "bfloat16", 64): _B(64, 64, 64, 64, 4, 2),
    ("default", "bfloat16", 128): _B(32, 64, 64, 32, 4, 2),
    ("default", "bfloat16", 256): _B(32, 32, 32, 32, 4, 1),
    ("default", "float32", 32): _B(32, 64, 64, 32, 4, 2),
    ("default", "float32", 64): _B(32, 64, 64, 32, 4, 2),
    ("default", "float32", 128): _B(32, 32, 32, 32, 4, 2),
    ("default", "float32", 256): _B(16, 32, 32, 16, 4, 1),
}

# fast_exp2=None resolves to this per device kind (absent: False). sm_90: FlashAttention's
# and Triton's own kernels use ex2.approx; checked by the tile sweep's "auto_libdevice_exp2"
# rows (bench/results/h200/tiles.json), the auto tiles with libdevice's exp2f. The fused
# multiply-add before it (tiles.exp2_affine), which XLA's Triton kept apart: docs/dev/decisions.md,
# "Settled by probes", "The Triton exponent".
FAST_EXP2 = {"sm_90": True}


def with_fast_exp2(cfg, device: str):
  """``cfg`` with ``fast_exp2=None`` replaced by the device's :data:`FAST_EXP2` entry."""
  if cfg.fast_exp2 is not None:
    return cfg
  return dataclasses.replace(cfg, fast_exp2=FAST_EXP2.get(device, False))


# backward_pass_impl="auto": first matching rule wins. Each rule:
# (device, dtypes or None, max head_dim or None, max length ratio or None, impl, source).
BACKWARD_IMPL_RULES = (
    ("sm_86", None, 64, None, "triton_onepass", "spec RTX 3090 page"),
    ("sm_89", None, 64, None, "triton_onepass", "spec RTX 3090 page (same SMEM class)"),
    ("sm_86", ("bfloat16",), 128, None, "triton_onepass", "spec RTX 3090 page"),
    ("default", None, None, 4.0, "triton_fused", "spec generic rule: lengths within 4x"),
    ("default", None, None, None, "triton_split", "spec generic rule"),
)


def _dtype_key(dtype) -> str:
  name = np.dtype(dtype).name
  return "bfloat16" if name == "float16" else name


def _lookup(table, device, dtype, head_dim, v_head_dim=None):
  # The tables are tuned at one width. Values of another width take the entry of the wider
  # of the two: its tiles were chosen for every operand at that width, so they are no larger
  # than the narrower mix needs; the two-width shared-memory model then shrinks them to fit.
  head_dim = max(head_dim, head_dim if v_head_dim is None else v_head_dim)
  key = _dtype_key(dtype)
  for dev in (device, "default"):
    if (dev, key, head_dim) in table:
      return table[(dev, key, head_dim)]
  return table[("default", key, min(256, max(32, head_dim)))]


def _clamp(block: int, length: int) -> int:
  """Largest useful block for ``length`` rows: at most next_pow2(length), at least 16."""
  return max(MIN_BLOCK, min(block, 1 << max(0, int(length - 1).bit_length())))


def _shrink(cfg, fields, itemsize, head_dim, limit, **kw):
  """Stages first, then the largest block, until ``cfg`` fits ``limit`` bytes."""
  while limit is not None and cfg.smem_bytes(itemsize, head_dim, **kw) > limit:
    if cfg.num_stages > 1:
      cfg = dataclasses.replace(cfg, num_stages=cfg.num_stages - 1)
      continue
    name = max(fields, key=lambda f: getattr(cfg, f))
    if getattr(cfg, name) <= MIN_BLOCK:
      raise ValueError(f"no tile configuration fits {limit} bytes of shared memory "
                       f"(head_dim {head_dim}, itemsize {itemsize})")
    cfg = dataclasses.replace(cfg, **{name: getattr(cfg, name) // 2})
  return cfg


def _check(cfg, itemsize, head_dim, device, limit, what, **kw):
  need = cfg.smem_bytes(itemsize, head_dim, **kw)
  if limit is not None and need > limit:
    raise ValueError(f"{what} {cfg} needs {need} bytes of shared memory per block "
                     f"(head_dim {head_dim}, itemsize {itemsize}) but {device} has {limit}")
  return cfg


def fit_forward_config(cfg: ForwardConfig | None, dtype, head_dim: int, q_len: int,
                       kv_len: int, device: str, v_head_dim: int | None = None,
                       mask_mod: bool = False) -> ForwardConfig:
  """The forward config to launch: explicit ``cfg`` checked, or the table's shrunk to fit.

  ``head_dim`` and ``v_head_dim`` (None: ``head_dim``) are the padded query/key and value
  head_dims the kernel loads. ``mask_mod``: the call's mask has one (it costs shared memory:
  :func:`mask_mod_smem_bytes`).
  """
  itemsize, limit = np.dtype(dtype).itemsize, smem_limit(device)
  kw = {"v_head_dim": v_head_dim, "mask_mod": mask_mod}
  if cfg is not None:
    return with_fast_exp2(_check(cfg, itemsize, head_dim, device, limit, "forward_config", **kw), device)
  cfg = _lookup(FORWARD_TABLE, device, dtype, head_dim, v_head_dim)
  cfg = dataclasses.replace(cfg, block_q=_clamp(cfg.block_q, q_len), block_k=_clamp(cfg.block_k, kv_len))
  return with_fast_exp2(_shrink(cfg, ("block_q", "block_k"), itemsize, head_dim, limit, **kw), device)


def fit_backward_config(cfg: BackwardConfig | None, dtype, head_dim: int, q_len: int,
                        kv_len: int, device: str, impl: str | None = None,
                        v_head_dim: int | None = None, mask_mod: bool = False) -> BackwardConfig:
  """The backward config to launch for backward ``impl`` (None: the two-pass kernels;
  see :func:`fit_forward_config`, also for ``mask_mod``).

  With a mask_mod the sm_90 bf16 head_dim-128 entry (64 x 128 dK/dV tiles, 3 stages) still
  fits the two-pass kernels (229,912 of 232,448 bytes) but not the one-pass one (280,600):
  shrinking stages first gives 247,320 at 2 stages and 214,040 at 1."""
  itemsize, limit = np.dtype(dtype).itemsize, smem_limit(device)
  kw = {"onepass": impl == "triton_onepass", "v_head_dim": v_head_dim, "mask_mod": mask_mod}
  if cfg is not None:
    return with_fast_exp2(_check(cfg, itemsize, head_dim, device, limit, "backward_config", **kw),
                          device)
  cfg = _lookup(BACKWARD_TABLE, device, dtype, head_dim, v_head_dim)
  cfg = dataclasses.replace(
      cfg, block_q_dkv=_clamp(cfg.block_q_dkv, q_len), block_kv_dkv=_clamp(cfg.block_kv_dkv, kv_len),
      block_q_dq=_clamp(cfg.block_q_dq, q_len), block_kv_dq=_clamp(cfg.block_kv_dq, kv_len))
  return with_fast_exp2(_shrink(cfg, ("block_q_dkv", "block_kv_dkv", "block_q_dq", "block_kv_dq"),
                                itemsize, head_dim, limit, **kw), device)


def resolve_backward_impl(impl: str, device: str, dtype, head_dim: int, q_len: int,
                          kv_len: int) -> str:
  """``impl`` itself, or for ``"auto"`` the first matching :data:`BACKWARD_IMPL_RULES` entry."""
  if impl in BACKWARD_IMPLS:
    return impl
  if impl != "auto":
    raise ValueError(f"backward_pass_impl must be 'auto' or one of {BACKWARD_IMPLS}, got {impl!r}")
  ratio = max(q_len, kv_len) / max(1, min(q_len, kv_len))
  key = _dtype_key(dtype)
  for dev, dtypes, max_d, max_ratio, choice, _ in BACKWARD_IMPL_RULES:
    if dev not in (device, "default"):
      continue
    if (dtypes is None or key in dtypes) and (max_d is None or head_dim <= max_d) and (
        max_ratio is None or ratio <= max_ratio):
      return choice
  return "triton_split"
