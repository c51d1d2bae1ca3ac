"""Per-device defaults for ``implementation=None``, loaded from data.

One JSON file per CUDA compute capability in this folder
(``sm_90.json``): each entry is a :class:`DeviceDefaults` field, its ``value`` and its
``evidence`` (the benchmark rows it was chosen from, as ``[results file, row key,
commit]``). Why each value is what it is and how to measure it again:
``docs/decisions.md``.

The dispatch (:mod:`probjax.ops.attention.dispatch`) consults the table only when
every kernel argument of the call is at its default (no explicit implementation,
``backward_pass_impl="auto"``, no explicit tile configs) and
``PROBJAX_ATTENTION_DEVICE_DEFAULTS`` is not ``0``; devices without a file keep the
generic rules. Work thresholds are ``batch * q_heads * q_len * kv_len``.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import types

TUNING_DIR = os.path.dirname(os.path.abspath(__file__))


@dataclasses.dataclass(frozen=True)
class DeviceDefaults:
  """Defaults for one compute capability.

  Attributes:
    cudnn_min_work: cuDNN is used for eligible bf16/fp16 calls with
      ``batch * q_heads * q_len * kv_len >= cudnn_min_work``.
    cudnn_min_head_dim: and ``head_dim >= cudnn_min_head_dim``.
    backward_pass_impl: what ``backward_pass_impl="auto"`` resolves to.
    backward_pass_impl_band: the same for masks with a diagonal band (causal, windows).
    fp32_dense_max_len: float32 calls with ``max(q_len, kv_len)`` up to this use
      XLA's dense formulation (TF32 matmuls) while it fits in memory.
    fp32_band_dense_max_len: the same limit for masks with a diagonal band (causal,
      windows), whose empty tiles the kernel skips and the dense formulation computes.
    fp32_kernel_max_head_dim: float32 calls with ``head_dim`` up to this always run the
      kernel.
    grad_triton_max_head_dim, grad_triton_max_work, grad_triton_max_kv_len: differentiated
      calls the cuDNN rule takes with ``head_dim <= grad_triton_max_head_dim``, work below
      ``grad_triton_max_work`` and at most ``grad_triton_max_kv_len`` keys run the Triton
      kernel's forward and backward instead (the primal, e.g. at inference, stays on cuDNN).
    grad_mosaic_band_max_work: ``((head_dim, work), ...)``: differentiated calls the cuDNN
      rule takes with a causal mask (``CausalMask()`` alone), that ``head_dim`` and at most
      that work run the Mosaic GPU forward with the Triton backward instead (before the
      rule above; ``PROBJAX_ATTENTION_MOSAIC=0`` turns it off).
    mosaic_forward_work: ``((mask, head_dim, min_work, max_work), ...)``: calls that the
      cuDNN rule takes, with ``mask`` ``"none"`` (no mask), ``"causal"`` (``CausalMask()``
      alone) or ``"window"`` (``LocalWindowMask(left, 0)`` alone), that ``head_dim``, work in
      ``[min_work, max_work]`` (``max_work`` None: no limit) and lengths that are multiples
      of 128, run the Mosaic GPU forward (differentiated calls keep what the rules above give
      them: cuDNN, or the Mosaic forward with the Triton backward).
    mosaic_forward_ragged_work: the same for lengths that are not multiples of 128 (a
      partial last tile, which the two kernels handle differently).
    mosaic_min_len: 16-bit calls whose default would run the Triton kernel's forward (as the
      call, or as the forward of a differentiated call by the rule above) run the Mosaic
      GPU forward instead when ``q_len`` and ``kv_len`` are both at least this
      (``PROBJAX_ATTENTION_MOSAIC=0`` turns it off).
    mosaic_backward_min_work: ``((head_dim, work), ...)``: calls that rule gives the Mosaic
      forward, with that ``head_dim`` and at least that work, run the Mosaic backward too
      (else the Triton backward chosen by ``backward_pass_impl*``).
    decode_max_q_len, decode_min_kv_len: calls with at most ``decode_max_q_len`` queries
      against at least ``decode_min_kv_len`` keys (decoding) skip the cuDNN rule and run
      the Triton kernel, whose split-KV forward spreads the keys over the device.
    evidence: field name -> its ``(results file, row key, commit)`` rows.
  """

  cudnn_min_work: int
  cudnn_min_head_dim: int
  backward_pass_impl: str
  backward_pass_impl_band: str
  fp32_dense_max_len: int
  fp32_band_dense_max_len: int
  fp32_kernel_max_head_dim: int
  grad_triton_max_head_dim: int
  grad_triton_max_work: int
  grad_triton_max_kv_len: int
  grad_mosaic_band_max_work: tuple[tuple[int, int], ...]
  mosaic_forward_work: tuple[tuple[str, int, int, int | None], ...]
  mosaic_forward_ragged_work: tuple[tuple[str, int, int, int | None], ...]
  mosaic_min_len: int
  mosaic_backward_min_work: tuple[tuple[int, int], ...]
  decode_max_q_len: int
  decode_min_kv_len: int
  evidence: types.MappingProxyType = dataclasses.field(compare=False, repr=False)


def _frozen(value):
  """JSON lists as the tuples the dispatch compares and hashes."""
  return tuple(_frozen(v) for v in value) if isinstance(value, list) else value


def load(path: str) -> tuple[tuple[int, int], DeviceDefaults]:
  """``(compute capability, DeviceDefaults)`` of one tuning file; every field must be there."""
  with open(path) as f:
    doc = json.load(f)
  entries = doc["entries"]
  fields = [f.name for f in dataclasses.fields(DeviceDefaults) if f.name != "evidence"]
  missing, extra = set(fields) - set(entries), set(entries) - set(fields)
  if missing or extra:
    raise ValueError(f"{path}: missing entries {sorted(missing)}, unknown entries {sorted(extra)}")
  evidence = types.MappingProxyType({k: tuple(tuple(e) for e in entries[k]["evidence"]) for k in fields})
  values = {k: _frozen(entries[k]["value"]) for k in fields}
  return tuple(doc["compute_capability"]), DeviceDefaults(**values, evidence=evidence)


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
