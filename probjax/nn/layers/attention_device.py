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
    fp32_band_dense_max_len: the same limit for masks with a diagonal band (causal,
      windows), whose empty tiles the kernel skips and the dense formulation computes.
    decode_max_q_len, decode_min_kv_len: calls with at most ``decode_max_q_len`` queries
      against at least ``decode_min_kv_len`` keys (decoding) skip the cuDNN rule and run
      the Triton kernel, whose split-KV forward spreads the keys over the device.
    evidence: where the numbers come from.
  """

  cudnn_min_work: int
  cudnn_min_head_dim: int
  backward_pass_impl: str
  backward_pass_impl_band: str
  fp32_dense_max_len: int
  fp32_band_dense_max_len: int
  decode_max_q_len: int
  decode_min_kv_len: int
  evidence: tuple[str, ...]


DEVICE_DEFAULTS: dict[tuple[int, int], DeviceDefaults] = {
    (9, 0): DeviceDefaults(
        # gpu_attention.json (bf16 B4 H8, fwd+bwd ms, default cuDNN / Triton): T=1024 (work 33.5M)
        # the Triton kernel: D64 jax.nn cuDNN 0.155 vs Triton 0.118, D128 0.296 vs 0.185;
        # T=4096 (work 537M) cuDNN: D64 1.188 vs 1.412, D128 1.866 vs 2.433.
        # Short-sequence sweep (batch 64, H8) with the previous Triton backward (its rows are in
        # git history at 0b3d622, removed from kernel_attn_gpu_dispatch.json as stale): D64 cuDNN
        # from T=384 (work 75M) on; D32 the Triton kernel at every length (64..1024). Re-measure
        # with the transposed dK/dV kernel, which moves the crossover up.
        cudnn_min_work=48 * 2**20,
        cudnn_min_head_dim=64,
        # gpu_attention.json (bf16 B4 H8, fwd+bwd ms, split / fused / onepass):
        #   non-causal: D64 T4096 1.383 / 1.378 / 2.889; D128 T4096 2.402 / 2.375 / 5.603;
        #               D64 T8192 5.483 / 5.207 / 11.59; D128 T8192 9.312 / 9.462 / 21.45;
        #               D128 T16384 37.26 / 37.91 / 84.89; D128 T1024 0.178 / 0.184 / 0.394
        #   causal:     D64 T4096 1.006 / 0.898 / 1.992; D128 T4096 1.511 / 1.439 / 3.207;
        #               D128 T1024 0.182 / 0.160 / 0.348; D128 T8192 5.193 / 5.191 / 10.97
        # Without a band split and fused are within 3% (split ahead at D128 T8192-16384); with
        # a band fused is ahead up to 12%. Onepass's atomics cost 2x or more on sm_90.
        backward_pass_impl="triton_split",
        backward_pass_impl_band="triton_fused",
        # gpu_attention.json (fp32 B4 H8 D128 T4096, ms, fwd / fwd+bwd): non-causal XLA dense
        # 2.57 / 8.48, Triton 3.24 / 14.19, jax.nn XLA 2.64 / 8.57; causal XLA dense
        # 3.55 / 8.88, Triton 1.78 / 7.50, jax.nn XLA 3.74 / 10.41. Causal halves the
        # kernel's work but not the dense formulation's; both are matmul-bound at these
        # lengths, so the band limit is set at the first length where the kernel's tiles are
        # busy (1024 and below are launch-bound and unmeasured in fp32).
        fp32_dense_max_len=16384,
        fp32_band_dense_max_len=1024,
        # kernel_attn_ext_gpu.json (decode suite, bf16 H32 D128, fwd ms, jax.nn cuDNN /
        # probjax Triton with split-KV): B8 KV8 Lq16 Lkv65536 1.650 / 0.753 (the default took
        # cuDNN there: 1.581); B1 KV8 Lq16 Lkv65536 0.792 / 0.087; B8 KV8 Lq16 Lkv8192
        # 0.224 / 0.112; B8 KV32 Lq16 Lkv65536 2.002 / 1.954. Split-KV is never more than 1%
        # slower than cuDNN in the 16 decode rows but one (B1 KV32 Lq1 Lkv65536, 0.259 / 0.276,
        # below the cuDNN work threshold).
        decode_max_q_len=64,
        decode_min_kv_len=1024,
        evidence=("docs/benchmarks/gpu_attention.json (H200 grid, B4 H8, peers in the same run)",
                  "docs/benchmarks/kernel_attn_ext_gpu.json (H200 decode and GQA suites)",
                  "git 0b3d622:docs/benchmarks/kernel_attn_gpu_dispatch.json (H200 short-sequence "
                  "sweep, batch 64, previous Triton backward)",
                  "../shared/anchors/h200_jax_peers.jsonl (fp32 D128 T4096 fwd+bwd: jax.nn XLA 7.95 ms)",
                  "spec 002 (H100 page): Device-specific defaults, Why, Known issues"),
    ),
}


def lookup(compute_capability: tuple[int, int] | None) -> DeviceDefaults | None:
  """The table entry for a compute capability, or None."""
  if compute_capability is None:
    return None
  return DEVICE_DEFAULTS.get(tuple(compute_capability))
