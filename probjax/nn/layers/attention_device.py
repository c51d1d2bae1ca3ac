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
    backward_pass_impl_band: the same for masks with a diagonal band (causal, windows).
    fp32_dense_max_len: float32 calls with ``max(q_len, kv_len)`` up to this use
      XLA's dense formulation (TF32 matmuls) while it fits in memory.
    evidence: where the numbers come from.
  """

  cudnn_min_work: int
  cudnn_min_head_dim: int
  backward_pass_impl: str
  backward_pass_impl_band: str
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
        # gpu_attention.json (bf16 B4 H8, fwd+bwd, ms, split / fused / onepass):
        #   non-causal: D64 T16384 30.9 / 37.8 / 77.2; D64 T4096 2.21 / 2.24 / 5.12;
        #               D128 T4096 4.35 / 4.37 / 8.78; D64 T1024 0.149 / 0.159 / 0.353
        #   causal:     D64 T4096 1.46 / 1.32 / 2.83; D128 T4096 2.44 / 2.32 / 5.01;
        #               D64 T1024 0.157 / 0.124 / 0.284
        # Split is fastest without a band, fused with one; onepass's atomics cost ~2x on sm_90.
        backward_pass_impl="triton_split",
        backward_pass_impl_band="triton_fused",
        # anchors: fp32 D128 T=4096 fwd+bwd jax.nn XLA 7.95 ms; spec: Triton fp32 is ~1.95x slower.
        fp32_dense_max_len=16384,
        evidence=("docs/benchmarks/gpu_attention.json (H200 grid, bf16 B4 H8, peers in the same run)",
                  "docs/benchmarks/kernel_attn_gpu_dispatch.json (H200 short-sequence sweep, batch 64)",
                  "../shared/anchors/h200_jax_peers.jsonl (fp32 D128 T4096 fwd+bwd: jax.nn XLA 7.95 ms)",
                  "spec 002 (H100 page): Device-specific defaults, Why, Known issues"),
    ),
}


def lookup(compute_capability: tuple[int, int] | None) -> DeviceDefaults | None:
  """The table entry for a compute capability, or None."""
  if compute_capability is None:
    return None
  return DEVICE_DEFAULTS.get(tuple(compute_capability))
