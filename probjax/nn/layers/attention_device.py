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
    fp32_kernel_max_head_dim: float32 calls with ``head_dim`` up to this always run the
      kernel (its TF32 tiles beat the dense formulation there at every measured length).
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
    evidence: where the numbers come from.
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
  evidence: tuple[str, ...]


DEVICE_DEFAULTS: dict[tuple[int, int], DeviceDefaults] = {
    (9, 0): DeviceDefaults(
        # gpu_attention.json (bf16 B4 H8, ms, jax.nn cuDNN / probjax Triton, same run):
        #   T=1024 (work 33.5M) fwd D64 0.085 / 0.052, D128 0.060 / 0.045; fwd+bwd D64
        #   0.228 / 0.114, D128 0.200 / 0.181 -> the Triton kernel below the threshold;
        #   T=2048 (134M) fwd D64 0.092 / 0.105, D128 0.128 / 0.164; fwd+bwd D64 0.360 / 0.348,
        #   D128 0.525 / 0.617; T=4096 (537M) fwd D128 0.449 / 0.599 -> cuDNN above it.
        # kernel_attn_gpu_dispatch.json (batch 64, H8, fwd+bwd ms, jax.nn cuDNN / Triton): D64
        #   T384 (75M) 0.337 / 0.272 ... T1024 (537M) 1.473 / 1.405: the Triton backward wins
        #   at D64 up to 537M while cuDNN's forward wins from 134M: differentiated calls have
        #   their own rule (grad_triton_* below).
        #   D32: Triton at every length (cuDNN min head_dim 64).
        cudnn_min_work=48 * 2**20,
        cudnn_min_head_dim=64,
        # Differentiated D64 calls (fwd+bwd ms, default on cuDNN / probjax Triton, same runs):
        # kernel_attn_gpu_dispatch.json B64 H8 T384 (75M) 0.344 / 0.272, T512 (134M)
        # 0.501 / 0.437, T768 (302M) 0.913 / 0.850, T1024 (537M) 1.441 / 1.405;
        # gpu_attention.json B4 H8 T2048 (134M) 0.354 / 0.348, causal 0.272 / 0.259;
        # T4096 (537M) 1.223 / 1.259, causal 0.887 / 0.785. Their forwards stay on cuDNN
        # (T2048 D64 fwd 0.092 / 0.105). D128 keeps cuDNN (T2048 fwd+bwd 0.525 / 0.617).
        # Measured as the default (fwd+bwd ms, default / jax.nn cuDNN, same run): dispatch
        # sweep B64 T384 0.282 / 0.346, T512 0.445 / 0.520, T768 0.868 / 0.910; grid B4 H8
        # T2048 0.351 / 0.360, causal 0.259 / 0.296; T3000 0.770 / 0.766, causal 0.502 / 0.494.
        # Through probjax's FFI call of cuDNN (no XLA memsets), the cuDNN route is ahead from
        # 2048 keys and the Triton kernel only for short, wide batches (fwd+bwd ms, the default
        # then on Mosaic forward + Triton backward or Triton alone / FFI cuDNN / Triton / torch
        # SDPA cuDNN, one process, a24ea77 interleaved_ffi_grad_d64_b4.json and _b64.json):
        # B4 H8 T2048 0.333 / 0.319 / - / 0.378, T3000 0.731 / 0.710 / - / 0.692 (24537c3 interleaved_ffi_3000_d64.json:
        # 0.726 / 0.708 / - / 0.683); B64 H8 T512 0.429 / 0.438 / 0.411, T768 0.850 / 0.832 /
        # 0.827, T1024 (2^29, cuDNN already) 1.325 / 1.328 / 1.372 -> up to 1536 keys.
        grad_triton_max_head_dim=64,
        grad_triton_max_work=2**29,
        grad_triton_max_kv_len=1536,
        # Causal fwd+bwd (gpu_attention.json, bf16 B4 H8, ms, default on cuDNN or the Triton
        # grad rule / Mosaic forward + Triton backward / jax.nn cuDNN, same runs):
        #   D64:  T2048 (2^27) 0.259 / 0.233 / 0.296; T4096 (2^29) 0.779 / 0.709 / 0.819;
        #         T8192 2.484 / 2.552 / 2.698 -> up to 2^29;
        #   D128: T2048 0.405 / 0.377 / 0.403; T4096 1.162 / 1.264 / 1.164 -> up to 2^27.
        #   (T1024, below the cuDNN threshold: D64 0.106 / 0.100, D128 0.147 / 0.136 -- left
        #   to the Triton rule.) Mosaic's forward is what differs: T4096 D64 causal forward
        #   0.201 against Triton's 0.265. Measured with one CTA per tile; the default Mosaic
        #   config has since become persistent, 4-8% faster on causal forwards
        #   (mosaic_causal_persistent.json), so these limits are conservative.
        grad_mosaic_band_max_work=((64, 2**29), (128, 2**27)),
        # Forward only (gpu_attention.json, bf16 B4 H8, ms, Mosaic / the default on the cuDNN
        # route / jax.nn cuDNN, same runs: 65d300a for D128, 3257396 for D64, both with the
        # heaviest-first schedules):
        #   no mask, D128: T2048 (2^27) 0.123 / 0.157 / 0.139 (ab80354: 0.129 / 0.137 / 0.138);
        #     T4096 0.440 / 0.435 / 0.462 and T8192 1.783 / 1.779 / 1.775: level -> cuDNN;
        #     T16384 (2^33) 7.194 / 7.465 / 7.290 (11e7a28: 7.398 / 6.859 / 7.240, 3860852:
        #     6.745 / - / 7.223; 59c9d63: Mosaic 6.969, jax.nn cuDNN 7.458, torch SDPA cuDNN
        #     7.116). D64 behind from T4096 (T16384 5.051 / 4.799 / 4.594).
        #   causal, D128: T2048 0.088 / 0.102 / 0.109; T4096 0.256 / 0.298 / 0.292; T8192 (2^31)
        #     0.953 / 0.978 / 0.975; T16384 3.656 / 3.558 / 3.559 -> up to 2^31.
        #   causal, D64: T2048 (2^27) 0.073 / 0.072 / 0.074 (level; 176367c, after the
        #     heaviest-first Triton grids: Mosaic 0.065, Triton 0.063, the cuDNN route 0.105
        #     (p10 0.084), jax.nn cuDNN 0.085, torch SDPA cuDNN 0.081); T4096 (2^29) 0.188 /
        #     0.207 / 0.204; T8192 0.650 / 0.665 / 0.676; T16384 2.523 / 2.514 / 2.470 -> from
        #     2^27 (Mosaic and Triton are level at T2048: one kernel for the whole range).
        #   causal window (LocalWindowMask(512, 0)), D128, B1 H16 T16384 (2^32; masked suite,
        #     86cfc22): 0.206 / 0.239 / 0.234 -> from 2^31 to 2^33 (the one measured shape).
        #   With the intra-warpgroup overlap (unmasked whole tiles, MosaicForwardConfig.overlap;
        #   785f033 interleaved_mosaic_overlap.json, one process, fwd ms without / with): T4096
        #   D128 0.491 / 0.477, T16384 7.367 / 7.219 (jax.nn cuDNN 7.259, torch SDPA cuDNN
        #   7.264); the grid in one process (54a36f8, gridr) has the cuDNN route at T4096 0.501
        #   and T8192 1.885 -> unmasked D128 from 2^27 with no upper limit. Measured as the
        #   default (interleaved_mosaic_default_d128.json, 0154c01, default / jax.nn cuDNN /
        #   torch SDPA cuDNN): T2048 0.132 / 0.133 / 0.116, T4096 0.492 / 0.462 / 0.424, T8192
        #   1.793 / 1.806 / 1.789: level with jax.nn's cuDNN call within the rounds' spread.
        #   The cuDNN route through probjax's FFI call (no XLA memsets) is ahead of it
        #   (interleaved_cudnn_ffi_configs.json, ea988bf, one process, fwd ms, FFI cuDNN / the
        #   default on the Mosaic forward / jax.nn cuDNN / torch SDPA cuDNN): T4096 D128 0.4625 /
        #   0.4807 / 0.4794 / 0.4642; T16384 (dispatch_gap_ffi.json) FFI 7.316, jax.nn 7.191,
        #   torch 7.300 -> unmasked D128 on the cuDNN route again.
        mosaic_forward_work=(("causal", 128, 2**27, 2**31), ("causal", 64, 2**27, 2**31),
                             ("window", 128, 2**31, 2**33)),
        # Lengths off the 128-row tiles (86cfc22, B4 H8 T3000, work 2^28.1, fwd ms, Mosaic /
        # the default on the cuDNN route / jax.nn cuDNN / torch SDPA cuDNN, same run): D64
        # 0.190 / 0.217 / 0.217 / 0.190, causal 0.120 / 0.136 / 0.126 / 0.111; D128 0.258 /
        # 0.288 / 0.281 / 0.259, causal 0.166 / 0.180 / 0.242 / 0.161. The Mosaic kernel reads
        # the partial tile with TMA's zero fill (no copies); with padded copies it lost there
        # (D128 causal 0.226 against jax.nn cuDNN's 0.180, interleaved_probe.json).
        mosaic_forward_ragged_work=tuple((kind, d, 2**28, 3 * 2**27) for kind in ("none", "causal")
                                         for d in (64, 128)),
        # Where the Triton kernel runs (masks cuDNN cannot take, PROBJAX_ATTENTION_CUDNN=0,
        # the D64 grad rule), the Mosaic forward is ahead from T2048 (gpu_attention.json, bf16,
        # ms, Mosaic forward / Triton forward, same runs: 3860852 B4 H8 unless said):
        #   fwd: T2048 D64 0.102 / 0.101, causal 0.089 / 0.096; D128 0.128 / 0.166, causal
        #   0.110 / 0.142; T4096 D64 0.338 / 0.374, D128 0.462 / 0.604; 5e15f6d masked suite
        #   (B1 H16 T16384 D128): documents 0.928 / 1.217, causal documents 0.597 / 0.717.
        #   fwd+bwd with the Triton backward: T2048 D64 0.347 / 0.367, causal 0.249 / 0.254.
        #   (T1024, 5e15f6d, kernel time: D64 0.0257 / 0.0255, D128 0.0337 / 0.0392 -- left to
        #   Triton: its wall clock is host-bound and unresolved there.)
        #   176367c, after the heaviest-first Triton grids, causal fwd: T2048 D64 0.065 / 0.063
        #   (level), D128 0.084 / 0.102; T4096 D64 0.188 / 0.210, D128 0.251 / 0.349.
        #   With a score modifier (masked suite softcap30: causal, 30 tanh(s / 30), B1 H16
        #   T16384 D128, 176367c): fwd 2.212 / 3.845; fwd+bwd 11.039 with the Mosaic backward,
        #   12.745 with the Triton one, 14.335 Triton alone (torch flex 5.995 / 20.454, tokamax
        #   mosaic 1.913 / 10.171) -> score modifiers take this rule too.
        mosaic_min_len=2048,
        # Odd lengths (86cfc22, B4 H8 T3000, ms, Mosaic / Triton, same run; the Mosaic kernel
        # without padded copies): fwd D64 0.190 / 0.217, causal 0.120 / 0.174; D128 0.258 /
        # 0.393, causal 0.166 / 0.274; fwd+bwd with the Triton backward D64 0.750 / 0.776,
        # causal 0.437 / 0.507 (ab80354, with copies: D64 behind in every row).
        # fwd+bwd ms, Mosaic backward / Triton backward, both after the Mosaic forward (same
        # runs): D128 T4096 2.088 / 2.185, causal 1.253 / 1.266; T8192 8.07 / 8.99, causal
        # 4.39 / 4.71; T16384 33.96 / 35.47; documents (B1 H16 T16384) 4.134 / 4.740, causal
        # documents 2.512 / 2.688. Slower at T2048 D128 (0.591 / 0.584, causal 0.429 / 0.384)
        # and at every D64 row (T4096 1.423 / 1.216).
        mosaic_backward_min_work=((128, 2**29),),
        # gpu_attention.json (bf16 B4 H8, fwd+bwd ms, split / fused / onepass, same run):
        #   non-causal: D64 T4096 1.288 / 1.275 / 2.773; D128 T4096 2.349 / 2.354 / 5.475;
        #               D64 T16384 19.81 / 19.20 / 40.93; D128 T16384 36.52 / 36.97 / 84.73;
        #               D64 T1024 0.101 / 0.115 / 0.205; D128 T1024 0.190 / 0.186 / 0.389
        #   causal:     D64 T4096 0.905 / 0.784 / 1.909; D128 T4096 1.522 / 1.416 / 3.203;
        #               D64 T2048 0.300 / 0.259 / 0.618; D128 T8192 5.235 / 5.308 / 11.01
        # Without a band split and fused are within 3% either way (split ahead at T1024 D64);
        # with a band fused is ahead up to 14% (D128 T8192-16384 within 2%). Onepass's atomics
        # cost 2x or more on sm_90.
        backward_pass_impl="triton_split",
        backward_pass_impl_band="triton_fused",
        # gpu_attention.json (fp32 B4 H8, ms, fwd / fwd+bwd, XLA dense / Triton / jax.nn
        # XLA, same run):
        #   D128 T4096 non-causal 2.62 / 8.44, 3.06 / 14.03, 2.65 / 8.59 -> dense;
        #   D128 T4096 causal 3.47 / 8.64, 1.67 / 7.41, 3.75 / 10.64 -> the kernel;
        #   D128 T1024 non-causal 0.226 / 0.726, 0.211 / 0.921, 0.223 / 0.744 -> dense;
        #   D128 T1024 causal 0.301 / 0.716, 0.189 / 0.671 -> the kernel (band limit below
        #   1024; shorter fp32 calls are unmeasured);
        #   D64: the kernel at every measured shape: T1024 0.192 / 0.647, 0.078 / 0.333;
        #   T4096 2.34 / 7.29, 1.01 / 4.94; causal T4096 3.25 / 7.53, 0.64 / 2.61.
        # Causal halves the kernel's work but not the dense formulation's.
        fp32_dense_max_len=16384,
        fp32_band_dense_max_len=512,
        fp32_kernel_max_head_dim=64,
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
