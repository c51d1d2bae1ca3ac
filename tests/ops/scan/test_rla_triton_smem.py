"""The RLA Triton kernels' shared-memory estimate (backends/triton/rla.smem_bytes) against the
compiler, and the support check and chunk that follow from it on sm_90 (CPU only)."""

import pytest

from probjax.core.device import Device
from probjax.ops import scan
from probjax.ops.scan.backends.triton import RLATriton
from probjax.ops.scan.backends.triton import rla
from probjax.ops.scan.calls import RLACall

H100 = Device("gpu", (9, 0), 80 << 30)
LIMIT = 232448  # sm_90's shared memory per block
KERNELS = (rla.FWD_STATES, rla.FWD, rla.BWD_STATES, rla.BWD)

# Shared bytes per kernel (forward states, forward output, backward states, backward gradients)
# that the official Triton compiler allocates for sm_90, keyed (dtype, features, v_head_dim,
# groups (heads per key/value head), chunk); each row from
#   .venv/bin/python tests/ops/scan/rla_triton_smem_probe.py --triton-python TRITON_VENV/bin/python \
#       --dtype DTYPE --features F --v-head-dim DV --groups G --chunk C
# (TRITON_VENV: a virtualenv with `pip install triton`; these with triton 3.9.0).
MEASURED = {
    ("float32", 128, 128, 4, 64): (36864, 163840, 32768, 294912),
    ("float32", 128, 128, 4, 32): (20480, 98304, 16384, 147456),
    ("float32", 128, 128, 4, 16): (12288, 81920, 8192, 122880),
    ("float32", 128, 128, 1, 64): (36864, 163840, 36864, 294912),
    ("float32", 64, 64, 4, 64): (36864, 65536, 32768, 131072),
    ("float32", 128, 64, 4, 64): (36864, 114688, 32768, 212992),
    ("float32", 128, 64, 4, 32): (20480, 57344, 16384, 98304),
    ("float32", 256, 128, 4, 32): (20480, 180224, 16384, 262144),
    ("float32", 256, 128, 4, 16): (12288, 155648, 8192, 204800),
    ("bfloat16", 64, 64, 4, 64): (12288, 32768, 12288, 65536),
    ("bfloat16", 64, 64, 1, 64): (12288, 32768, 12288, 40960),
    ("bfloat16", 64, 64, 4, 32): (6144, 16384, 6144, 38912),
    ("bfloat16", 128, 64, 4, 64): (12288, 57344, 12288, 106496),
    ("bfloat16", 128, 128, 4, 64): (12288, 81920, 12288, 131072),
    ("bfloat16", 128, 128, 1, 64): (12288, 81920, 12288, 98304),
    ("bfloat16", 256, 128, 4, 32): (6144, 90112, 6144, 149504),
    ("bfloat16", 256, 64, 4, 64): (12288, 106496, 12288, 188416),
    ("bfloat16", 256, 256, 4, 32): (6144, 163840, 6144, 231424),
    ("bfloat16", 256, 256, 4, 16): (4096, 147456, 4096, 188928),
}
# What the Triton inside XLA asked for on an H100 for the gradient kernel of float32, head_dim
# 128, relu, 8 heads over 2 key/value heads, chunk 64: the launch failed (the compiler above
# gives 294,912 for the same kernel).
H100_FAILED = (("float32", 128, 128, 4, 64), rla.BWD, 327680)


@pytest.mark.parametrize("key", list(MEASURED))
def test_estimate_bounds_the_compiled_kernels(key):
  dtype, f, dv, _, chunk = key
  est = rla.smem_bytes(dtype, f, dv, chunk)
  for name, measured in zip(KERNELS, MEASURED[key]):
    assert est[name] >= measured, (name, est[name], measured)


def test_estimate_bounds_the_failed_h100_launch():
  (dtype, f, dv, _, chunk), name, asked = H100_FAILED
  assert rla.smem_bytes(dtype, f, dv, chunk)[name] >= asked > LIMIT


@pytest.mark.parametrize("key", [("bfloat16", 64, 64, 4, 64), ("bfloat16", 128, 64, 4, 64),
                                 ("bfloat16", 128, 128, 4, 64), ("bfloat16", 256, 128, 4, 32)])
def test_estimate_is_not_far_above_the_bf16_defaults(key):
  # bfloat16 head_dim 64 (relu and softmax) and 128 at their default chunks: the kernel that
  # needs the most stays within 1.5x of the compiler's figure, and under the limit.
  dtype, f, dv, _, chunk = key
  est = rla.smem_bytes(dtype, f, dv, chunk)
  name = max(est, key=est.get)
  measured = dict(zip(KERNELS, MEASURED[key]))[name]
  assert measured <= est[name] <= 1.5 * measured and est[name] <= LIMIT


def _call(head_dim, feature_map, dtype, chunk_size=None):
  return RLACall(18, 994, 8, 2, head_dim, head_dim, 176, feature_map, dtype, chunk_size)


def test_the_failed_h100_call_runs_in_smaller_chunks():
  call = _call(128, "relu", "float32")
  assert RLATriton().supports(call, H100) is None
  assert rla.default_chunk(call, H100.smem_per_block) == 32
  assert rla.default_chunk(call) == 64  # no limit (interpret mode)
  name, need = rla.call_smem(call, 32)
  assert name == rla.BWD and need <= LIMIT


def test_a_chunk_that_overflows_is_refused_with_the_bytes():
  call = _call(128, "relu", "float32", chunk_size=64)
  why = RLATriton().supports(call, H100)
  assert why == ("the probjax_rla_bwd kernel needs 360448 bytes of shared memory (estimated, float32 at "
                 "features 128, v_head_dim 128, the call's chunk_size 64), the device has 232448")
  with pytest.raises(ValueError, match="needs 360448 bytes of shared memory"):
    scan.explain_dispatch(call, implementation="triton", device=H100)
  # Interpret mode has no limit.
  assert RLATriton().supports(_call(128, "relu", "float32", 64), Device.interpreter()) is None


@pytest.mark.parametrize("head_dim, feature_map, chunk", [(64, "relu", 64), (64, "softmax", 32),
                                                          (128, "relu", 32)])
def test_float32_below_feature_width_256_fits(head_dim, feature_map, chunk):
  call = _call(head_dim, feature_map, "float32")
  assert RLATriton().supports(call, H100) is None
  assert rla.default_chunk(call, H100.smem_per_block) == chunk


@pytest.mark.parametrize("head_dim, feature_map", [(128, "softmax"), (256, "relu")])
def test_float32_at_feature_width_256_is_refused(head_dim, feature_map):
  why = RLATriton().supports(_call(head_dim, feature_map, "float32"), H100)
  assert why is not None and "bytes of shared memory" in why and why.endswith("the device has 232448")
  assert "the smallest chunk 16" in why


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("head_dim, feature_map, chunk", [(64, "relu", 64), (64, "softmax", 64),
                                                          (128, "relu", 64), (128, "softmax", 32)])
def test_half_precision_d64_d128_keep_their_chunk(dtype, head_dim, feature_map, chunk):
  call = _call(head_dim, feature_map, dtype)
  assert RLATriton().supports(call, H100) is None
  assert rla.default_chunk(call, H100.smem_per_block) == rla.default_chunk(call) == chunk


def test_the_kernels_run_at_the_current_devices_chunk(monkeypatch):
  call = _call(128, "relu", "float32")
  monkeypatch.setattr(Device, "current", classmethod(lambda cls: H100))
  assert RLATriton().chunk_size(call) == 32
  interp = RLACall(18, 994, 8, 2, 128, 128, 176, "relu", "float32", interpret=True)
  assert RLATriton().chunk_size(interp) == 64
