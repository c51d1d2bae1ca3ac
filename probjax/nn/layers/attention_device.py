"""Per-device defaults for ``implementation=None``, kept as data.

The table is keyed by CUDA compute capability. It is consulted only when every
kernel argument of the call is at its default (no explicit implementation,
``backward_pass_impl="auto"``, no explicit tile configs) and
``PROBJAX_ATTENTION_DEVICE_DEFAULTS`` is not ``0``. Devices without an entry
keep the generic rules of :mod:`probjax.ops.attention.dispatch`.

Each entry cites the measurement that justifies it (file under
``docs/benchmarks/`` or ``../shared/anchors/``). Thresholds are the work
``batch * q_heads * q_len * kv_len`` above which cuDNN wins.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class DeviceDefaults:
  """Defaults for one compute capability.

  Attributes:
    cudnn_min_work: cuDNN is used for eligible bf16/fp16 calls with
      ``batch * q_heads * q_len * kv_len >= cudnn_min_work``.
    cudnn_min_head_dim: and ``head_dim >= cudnn_min_head_dim``.
    backward_pass_impl: what ``backward_pass_impl="auto"`` resolves to.
    fp32_dense_max_len: float32 calls with ``max(q_len, kv_len)`` up to this use
      XLA's dense formulation (TF32 matmuls) while it fits in memory.
    evidence: where the numbers come from.
  """

  cudnn_min_work: int
  cudnn_min_head_dim: int
  backward_pass_impl: str
  fp32_dense_max_len: int
  evidence: tuple[str, ...]


DEVICE_DEFAULTS: dict[tuple[int, int], DeviceDefaults] = {
    (9, 0): DeviceDefaults(
        # docs/benchmarks/gpu_attention.json (bf16 B4 H8 D64): fwd+bwd at T=1024 Triton split
        # 0.149 ms vs jax.nn cuDNN 0.156 ms; at T=4096 cuDNN 1.19 ms vs Triton 2.19 ms.
        # docs/benchmarks/kernel_attn_gpu_dispatch.json (batch 64, H8, D64): cuDNN wins from
        # T=384 (work 75M) on; D32: the Triton kernel wins at every length (64..1024).
        cudnn_min_work=48 * 2**20,
        cudnn_min_head_dim=64,
        # gpu_attention.json (bf16 B4 H8, fwd+bwd, ms, split / fused / onepass): D64 T16384
        # 30.9 / 37.8 / 77.2; D128 T4096 4.35 / 4.37 / 8.78; D64 causal T4096 1.46 / 1.32 / 2.83.
        # Split is never more than 10% slower and up to 22% faster than fused; onepass's
        # atomics cost 2x on sm_90. (H100 page "Why" agrees: split within 1% of the best.)
        backward_pass_impl="triton_split",
        # anchors: fp32 D128 T=4096 fwd+bwd jax.nn XLA 7.95 ms; spec: Triton fp32 is ~1.95x slower.
        fp32_dense_max_len=16384,
        evidence=("../shared/anchors/h200_jax_peers.jsonl", "../shared/anchors/h200_torch_peers.jsonl",
                  "spec 002 (H100 page): Device-specific defaults, Why, Known issues"),
    ),
}


def lookup(compute_capability: tuple[int, int] | None) -> DeviceDefaults | None:
  """The table entry for a compute capability, or None."""
  if compute_capability is None:
    return None
  return DEVICE_DEFAULTS.get(tuple(compute_capability))
