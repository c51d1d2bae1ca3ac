"""Per-device defaults for ``implementation=None``, loaded from data.

One JSON file per CUDA compute capability in this folder (``sm_90.json``), values only::

    {"compute_capability": [9, 0], "measured_on": "NVIDIA H200",
     "entries": {"cudnn.min_work": 50331648, "cudnn.min_head_dim": 40, ...}}

Each entry is named ``group.field`` after a field of one rule's group of :class:`DeviceDefaults`
(``"cudnn.min_work"`` is ``DeviceDefaults.cudnn.min_work``); every field has one, and JSON lists
are read as tuples. The files are generated (``python -m bench.tuning_table --write``) from the
evidence in the repository's ``bench/tuning/sm_*.json``, which holds each value with the
benchmark rows it was chosen from (``[results file, row key, commit]``); the wheel ships the
values only. The rules that read each group are numbered as in
:mod:`probjax.ops.attention.dispatch`; why each value is what it is and how to measure it again:
``docs/dev/decisions.md``.

The dispatch consults the table only when every kernel argument of the call is at its default
(no explicit implementation, ``backward_pass_impl="auto"``, no explicit tile configs) and
``PROBJAX_ATTENTION_DEVICE_DEFAULTS`` is not ``0``; devices without a file keep the generic
rules. Work thresholds are ``batch * q_heads * q_len * kv_len``.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import types

TUNING_DIR = os.path.dirname(os.path.abspath(__file__))


@dataclasses.dataclass(frozen=True)
class Decode:
  """Rule 4's exception (and so rule 3's): calls with at most ``max_q_len`` queries against at
  least ``min_kv_len`` keys (decoding) are not cuDNN's; the Triton kernel's split-KV forward
  spreads their keys over the device (rule 10)."""

  max_q_len: int
  min_kv_len: int


@dataclasses.dataclass(frozen=True)
class Cudnn:
  """Rule 4: eligible bf16/fp16 calls with at least ``min_work`` work and ``min_head_dim <=
  head_dim <= max_head_dim`` run cuDNN (values of their own width, MLA's 192/128, at any
  head_dim cuDNN takes); ``min_work_at``, ``((mask, head_dim, min_work), ...)``, replaces
  ``min_work`` for calls of that mask kind (as :class:`MosaicPrimal`'s; ``"any"``: every mask
  cuDNN takes, key lengths included) and head_dim, the first matching entry winning;
  ``triton_forward_work``, ``((mask, head_dim, min_work, max_work), ...)``: calls of rule 4 in
  one of these ranges run the Triton forward instead (differentiated calls as rule 4 says)."""

  min_work: int
  min_head_dim: int
  max_head_dim: int
  min_work_at: tuple[tuple[str, int, int], ...]
  triton_forward_work: tuple[tuple[str, int, int, int], ...]

  def threshold(self, mask_kind: str | None, head_dim: int) -> int:
    """The least work at which a call of this mask kind and head_dim runs cuDNN."""
    return next((w for m, d, w in self.min_work_at if m in (mask_kind, "any") and d == head_dim),
                self.min_work)


@dataclasses.dataclass(frozen=True)
class MosaicPrimal:
  """Rule 3: ``((mask, head_dim, min_work, max_work), ...)``: calls rule 4 would give cuDNN,
  with ``mask`` ``"none"`` (no mask), ``"causal"`` (``CausalMask()`` alone) or ``"window"``
  (``LocalWindowMask(left, 0)`` alone), that ``head_dim`` and work in ``[min_work, max_work]``
  (``max_work`` None: no limit), run the Mosaic GPU forward: ``work`` for lengths that are
  multiples of 128, ``ragged_work`` for the others (a partial last tile, which the two kernels
  handle differently)."""

  work: tuple[tuple[str, int, int, int | None], ...]
  ragged_work: tuple[tuple[str, int, int, int | None], ...]


@dataclasses.dataclass(frozen=True)
class GradMosaic:
  """Rule 5: ``causal_max_work``, ``((head_dim, work), ...)``: differentiated calls of rules 3
  and 4 with ``CausalMask()`` alone, that ``head_dim`` and at most that work run the Mosaic
  GPU forward with the Triton backward; ``ragged_causal_max_work`` the same for lengths that
  are not multiples of 128 (a partial last tile)."""

  causal_max_work: tuple[tuple[int, int], ...]
  ragged_causal_max_work: tuple[tuple[int, int], ...]


@dataclasses.dataclass(frozen=True)
class GradTriton:
  """Rule 6: differentiated calls of rules 3 and 4 with ``head_dim <= max_head_dim``, work
  below ``max_work`` and at most ``max_kv_len`` keys run the Triton kernel's forward and
  backward (their primal keeps rule 3's or 4's kernel)."""

  max_head_dim: int
  max_work: int
  max_kv_len: int


@dataclasses.dataclass(frozen=True)
class Fp32Dense:
  """Rule 7: float32 calls with ``head_dim > kernel_max_head_dim`` and ``max(q_len, kv_len)``
  up to ``max_len`` (``band_max_len`` under a diagonal band: causal, windows) run XLA's dense
  formulation (TF32 matmuls) while it fits in memory."""

  max_len: int
  band_max_len: int
  kernel_max_head_dim: int


@dataclasses.dataclass(frozen=True)
class MosaicLong:
  """Rule 9: 16-bit calls the Triton kernel would run (rule 10) with both lengths at least
  ``min_len`` run the Mosaic GPU forward (rule 3 asks for the same lengths), except calls of a
  ``triton_masks`` entry, ``((mask, head_dim), ...)`` (mask kinds as :class:`MosaicPrimal`'s),
  which keep the Triton kernel; with the Mosaic backward too at a ``head_dim`` of
  ``backward_min_work``, ``((head_dim, work), ...)``, from that work. Cross-attention from
  ``cross_min_head_dim``, with at least ``cross_min_q_len`` queries and ``cross_min_kv_per_q``
  times as many keys, without a window or key lengths (no mask, or causal from the
  bottom-right diagonal on), runs the Mosaic forward whatever its lengths, with the Triton
  backward."""

  min_len: int
  triton_masks: tuple[tuple[str, int], ...]
  backward_min_work: tuple[tuple[int, int], ...]
  cross_min_head_dim: int
  cross_min_q_len: int
  cross_min_kv_per_q: int


@dataclasses.dataclass(frozen=True)
class Backward:
  """What ``backward_pass_impl="auto"`` resolves to on the table's Triton backwards (rules 5,
  6, 9, 10): ``impl``, and ``band_impl`` for masks with a diagonal band (causal, windows);
  ``short_impl_max_kv_len``, ``((head_dim, max_kv_len), ...)``: calls without a band at that
  head_dim with at most that many keys take ``band_impl`` too."""

  impl: str
  band_impl: str
  short_impl_max_kv_len: tuple[tuple[int, int], ...]


# The field names before the per-rule groups, kept readable for callers that used them.
_FLAT_NAMES = types.MappingProxyType({
    "cudnn_min_work": "cudnn.min_work", "cudnn_min_head_dim": "cudnn.min_head_dim",
    "decode_max_q_len": "decode.max_q_len", "decode_min_kv_len": "decode.min_kv_len",
    "mosaic_forward_work": "mosaic_primal.work", "mosaic_forward_ragged_work": "mosaic_primal.ragged_work",
    "grad_mosaic_band_max_work": "grad_mosaic.causal_max_work",
    "grad_triton_max_head_dim": "grad_triton.max_head_dim", "grad_triton_max_work": "grad_triton.max_work",
    "grad_triton_max_kv_len": "grad_triton.max_kv_len",
    "fp32_dense_max_len": "fp32_dense.max_len", "fp32_band_dense_max_len": "fp32_dense.band_max_len",
    "fp32_kernel_max_head_dim": "fp32_dense.kernel_max_head_dim",
    "mosaic_min_len": "mosaic_long.min_len", "mosaic_backward_min_work": "mosaic_long.backward_min_work",
    "backward_pass_impl": "backward.impl", "backward_pass_impl_band": "backward.band_impl",
})


@dataclasses.dataclass(frozen=True)
class DeviceDefaults:
  """Defaults for one compute capability, one group per rule (the classes above say which).

  The dispatch sets ``cudnn`` to None under ``PROBJAX_ATTENTION_CUDNN=0`` and the Mosaic
  groups (``mosaic_primal``, ``grad_mosaic``, ``mosaic_long``) under
  ``PROBJAX_ATTENTION_MOSAIC=0``: a rule whose group is None does not apply. The flat names of
  the fields before the groups (``cudnn_min_work`` for ``cudnn.min_work``, ...) read the same
  values.
  """

  decode: Decode
  cudnn: Cudnn | None
  mosaic_primal: MosaicPrimal | None
  grad_mosaic: GradMosaic | None
  grad_triton: GradTriton
  fp32_dense: Fp32Dense
  mosaic_long: MosaicLong | None
  backward: Backward

  def __getattr__(self, name):
    # Only reached for names that are not fields: the flat names.
    if name not in _FLAT_NAMES:
      raise AttributeError(f"{type(self).__name__} has no attribute {name!r}")
    group, field = _FLAT_NAMES[name].split(".")
    return getattr(getattr(self, group), field)


_GROUPS = {"decode": Decode, "cudnn": Cudnn, "mosaic_primal": MosaicPrimal, "grad_mosaic": GradMosaic,
           "grad_triton": GradTriton, "fp32_dense": Fp32Dense, "mosaic_long": MosaicLong,
           "backward": Backward}


def entry_names() -> list[str]:
  """Every entry a tuning file holds, ``group.field``, in the order of the groups."""
  return [f"{g}.{f.name}" for g, cls in _GROUPS.items() for f in dataclasses.fields(cls)]


def _frozen(value):
  """JSON lists as the tuples the dispatch compares and hashes."""
  return tuple(_frozen(v) for v in value) if isinstance(value, list) else value


def load(path: str) -> tuple[tuple[int, int], DeviceDefaults]:
  """``(compute capability, DeviceDefaults)`` of one tuning file; every entry must be there."""
  with open(path) as f:
    doc = json.load(f)
  entries = doc["entries"]
  names = entry_names()
  missing, extra = set(names) - set(entries), set(entries) - set(names)
  if missing or extra:
    raise ValueError(f"{path}: missing entries {sorted(missing)}, unknown entries {sorted(extra)}")
  groups = {g: cls(**{f.name: _frozen(entries[f"{g}.{f.name}"]) for f in dataclasses.fields(cls)})
            for g, cls in _GROUPS.items()}
  return tuple(doc["compute_capability"]), DeviceDefaults(**groups)


@functools.cache
def _table() -> dict[tuple[int, int], DeviceDefaults]:
  table = {}
  for name in sorted(os.listdir(TUNING_DIR)):
    if name.startswith("sm_") and name.endswith(".json"):
      cc, entry = load(os.path.join(TUNING_DIR, name))
      table[cc] = entry
  return table


DEVICE_DEFAULTS: dict[tuple[int, int], DeviceDefaults] = _table()


def lookup(compute_capability: tuple[int, int] | None) -> DeviceDefaults | None:
  """The table entry for a compute capability, or None."""
  if compute_capability is None:
    return None
  return DEVICE_DEFAULTS.get(tuple(compute_capability))
