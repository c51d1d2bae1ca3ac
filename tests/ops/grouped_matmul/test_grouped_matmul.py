"""The grouped matmul against the float64 reference: every backend, values and both gradients.

XLA runs natively on CPU; the Triton and Mosaic GPU kernels run in Pallas interpret mode at
small shapes (the Mosaic cases beyond one per product are marked slow). Dispatch rules are
checked on fake devices.
"""

import os

# Mosaic interpret mode runs a CTA's warpgroup as a thread whose barrier waits block a thread of
# XLA:CPU's pool; a pool larger than the cores keeps a free one (read when JAX creates its CPU
# client, so before any computation).
os.environ.setdefault("PJRT_NPROC", "8")

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from probjax.core.device import Device
from probjax.core.dispatch import Decision
from probjax.core.tolerances import max_error, tolerance
from probjax.ops.grouped_matmul import REGISTRY, explain_dispatch, grouped_matmul
from probjax.ops.grouped_matmul.call import clamp_group_sizes
from probjax.ops.grouped_matmul.reference import reference, reference_vjp
from probjax.ops.grouped_matmul.tiles import num_row_tiles, tile_table
from probjax.testing import float32_is_tf32, interpret_kernels

TF32 = float32_is_tf32()  # on a GPU, float32 matmuls run as TF32 (tolerances bound that)

H200 = Device("gpu", (9, 0), 140 << 30)
RTX3090 = Device("gpu", (8, 6), 24 << 30)
CPU = Device("cpu")
S = jax.ShapeDtypeStruct

# (M, K, N, group sizes): empty groups, rows past the groups, M/K/N off every tile, one group
# holding every row, a contraction shorter than a tile.
CASES = {
    "ragged": (150, 70, 40, [37, 0, 64, 30]),
    "one_group": (96, 48, 24, [0, 96, 0]),
    "tail_rows": (77, 20, 33, [10, 0, 0, 50]),
    "short_k": (40, 3, 17, [12, 28]),
}


def _inputs(m, k, n, sizes, dtype, transpose_rhs=False, seed=0):
  ks = jax.random.split(jax.random.key(seed), 3)
  g = len(sizes)
  lhs = jax.random.normal(ks[0], (m, k), jnp.float32)
  rhs = jax.random.normal(ks[1], (g, n, k) if transpose_rhs else (g, k, n), jnp.float32)
  d_out = jax.random.normal(ks[2], (m, n), jnp.float32)
  return lhs.astype(dtype), rhs.astype(dtype), jnp.asarray(sizes, jnp.int32), d_out.astype(dtype)


def _run(impl, lhs, rhs, sizes, d_out, *, transpose_rhs=False, jit=True, **kw):
  interpret = impl in ("triton", "mosaic") and interpret_kernels()

  def f(lhs, rhs, sizes, d_out):
    g = lambda a, b: grouped_matmul(a, b, sizes, implementation=impl, transpose_rhs=transpose_rhs,
                                    interpret=interpret, **kw)
    out, vjp = jax.vjp(g, lhs, rhs)
    return (out, *vjp(d_out))

  return (jax.jit(f) if jit else f)(lhs, rhs, sizes, d_out)


def _check(impl, m, k, n, sizes, dtype=jnp.float32, transpose_rhs=False, **kw):
  lhs, rhs, gs, d_out = _inputs(m, k, n, sizes, dtype, transpose_rhs)
  d_out = d_out.astype(kw.get("preferred_element_type") or dtype)
  out, d_lhs, d_rhs = _run(impl, lhs, rhs, gs, d_out, transpose_rhs=transpose_rhs, **kw)
  ref = reference(lhs, rhs, sizes, transpose_rhs=transpose_rhs)
  r_lhs, r_rhs = reference_vjp(lhs, rhs, sizes, d_out, transpose_rhs=transpose_rhs)
  assert out.dtype == (kw.get("preferred_element_type") or dtype)
  assert d_lhs.dtype == dtype and d_rhs.dtype == dtype
  assert max_error(out, ref) <= tolerance(dtype, tf32=TF32), max_error(out, ref)
  assert max_error(d_lhs, r_lhs) <= tolerance(dtype, grad=True, tf32=TF32)
  assert max_error(d_rhs, r_rhs) <= tolerance(dtype, grad=True, tf32=TF32)
  ends = np.cumsum(sizes)
  # Exact zeros: rows past the groups (output and d_lhs) and the weights of empty groups.
  assert not np.asarray(out[ends[-1]:]).any() and not np.asarray(d_lhs[ends[-1]:]).any()
  for g, s in enumerate(sizes):
    if s == 0:
      assert not np.asarray(d_rhs[g]).any()


@pytest.mark.parametrize("case, transpose_rhs", [
    ("ragged", True), pytest.param("short_k", False, marks=pytest.mark.slow),
    pytest.param("one_group", False, marks=pytest.mark.slow), pytest.param("tail_rows", True, marks=pytest.mark.slow)])
def test_xla_float32(case, transpose_rhs):
  _check("xla", *CASES[case], transpose_rhs=transpose_rhs)


def test_xla_float64():
  with jax.enable_x64(True):
    _check("xla", *CASES["ragged"], dtype=jnp.float64)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("impl", ["xla", "triton"])
def test_bfloat16(impl):
  _check(impl, *CASES["ragged"], dtype=jnp.bfloat16)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("impl", ["xla", pytest.param("triton", marks=pytest.mark.slow)])
def test_float32_output_of_bfloat16(impl):
  _check(impl, *CASES["tail_rows"], dtype=jnp.bfloat16, preferred_element_type=jnp.float32)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", ["ragged", "short_k"])
def test_triton_float32(case):
  _check("triton", *CASES[case], transpose_rhs=case == "ragged")


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", ["one_group", "tail_rows"])
@pytest.mark.parametrize("transpose_rhs", [False, True])
def test_triton_float32_more(case, transpose_rhs):
  _check("triton", *CASES[case], transpose_rhs=transpose_rhs)


# Mosaic: 16-bit operands, K and N multiples of 64; M off the 8-row TMA tiling is padded.
MOSAIC_CASES = {"ragged": (150, 128, 64, [37, 0, 64, 30]), "one_group": (64, 64, 128, [0, 64]),
                "tail_rows": (200, 64, 192, [10, 0, 120])}


@pytest.mark.timeout(300)
def test_mosaic_bfloat16():
  _check("mosaic", *MOSAIC_CASES["ragged"], dtype=jnp.bfloat16)


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("case, transpose_rhs, out", [("ragged", True, None), ("one_group", False, jnp.float32),
                                                      ("tail_rows", True, None)])
def test_mosaic_more(case, transpose_rhs, out):
  _check("mosaic", *MOSAIC_CASES[case], dtype=jnp.float16 if out is None else jnp.bfloat16,
         transpose_rhs=transpose_rhs, preferred_element_type=out)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("impl", ["xla", "triton", "mosaic"])
@pytest.mark.parametrize("shape", [(10, 0, 64, [4, 6]), (0, 64, 64, [0, 0]), (10, 64, 0, [4, 6]),
                                   (10, 64, 64, [])])
def test_zero_sizes(impl, shape):
  """K = 0 (and any other zero dimension): zeros and zero gradients, no kernel to hang."""
  m, k, n, sizes = shape
  lhs, rhs, gs, d_out = _inputs(m, k, n, sizes, jnp.bfloat16)
  out, d_lhs, d_rhs = _run(impl, lhs, rhs, gs, d_out)
  assert out.shape == (m, n) and d_lhs.shape == lhs.shape and d_rhs.shape == rhs.shape
  assert not any(np.asarray(x, np.float32).any() for x in (out, d_lhs, d_rhs))


@pytest.mark.parametrize("impl", ["xla", "triton"])
def test_traced_group_sizes_are_clamped(impl):
  """Under jit negative sizes count as zero and the groups are cut at row M."""
  m, k, n = 20, 8, 16
  lhs, rhs, _, d_out = _inputs(m, k, n, [0, 0, 0], jnp.float32)
  bad = jnp.array([8, -5, 30], jnp.int32)
  clamped = [8, 0, 12]
  np.testing.assert_array_equal(clamp_group_sizes(bad, m), clamped)
  out, d_lhs, d_rhs = _run(impl, lhs, rhs, bad, d_out)
  assert max_error(out, reference(lhs, rhs, clamped)) <= tolerance(jnp.float32, tf32=TF32)
  r_lhs, r_rhs = reference_vjp(lhs, rhs, clamped, d_out)
  assert max_error(d_rhs, r_rhs) <= tolerance(jnp.float32, grad=True, tf32=TF32)


@pytest.mark.parametrize("impl", [pytest.param("xla", marks=pytest.mark.slow), "triton"])  # xla: test_moe too
def test_vmap(impl):
  lhs, rhs, _, _ = _inputs(30, 16, 8, [0, 0], jnp.float32)
  sizes = jnp.array([[10, 20], [30, 0], [0, 5]], jnp.int32)
  f = jax.vmap(lambda gs: grouped_matmul(lhs, rhs, gs, implementation=impl, interpret=impl == "triton"))
  out = jax.jit(f)(sizes)
  for b in range(3):
    assert max_error(out[b], reference(lhs, rhs, sizes[b])) <= tolerance(jnp.float32, tf32=TF32)


def test_bad_arguments():
  lhs, rhs, gs, _ = _inputs(10, 4, 6, [3, 7], jnp.float32)
  with pytest.raises(ValueError, match="group_sizes must have shape"):
    grouped_matmul(lhs, rhs, jnp.array([3, 3, 4], jnp.int32))
  with pytest.raises(ValueError, match="group_sizes must have rank 1"):
    grouped_matmul(lhs, rhs, jnp.array([[3, 7]], jnp.int32))
  with pytest.raises(TypeError, match="group_sizes must be an integer"):
    grouped_matmul(lhs, rhs, jnp.array([3.0, 7.0]))
  with pytest.raises(ValueError, match="group_sizes must be non-negative"):
    grouped_matmul(lhs, rhs, jnp.array([-1, 7], jnp.int32))
  with pytest.raises(ValueError, match="group_sizes sum to 11"):
    grouped_matmul(lhs, rhs, jnp.array([4, 7], jnp.int32))
  with pytest.raises(TypeError, match="lhs must be a floating"):
    grouped_matmul(jnp.ones((10, 4), jnp.int32), rhs, gs)
  with pytest.raises(ValueError, match="rhs must have rank 3"):
    grouped_matmul(lhs, rhs[0], gs)
  with pytest.raises(ValueError, match="does not contract"):
    grouped_matmul(lhs, rhs, gs, transpose_rhs=True)
  with pytest.raises(ValueError, match="unknown .*cuda"):
    grouped_matmul(lhs, rhs, gs, implementation="cuda")
  with pytest.raises(ValueError, match="wgmma kernels take bfloat16"):
    grouped_matmul(lhs, rhs, gs, implementation="mosaic", interpret=True)
  if interpret_kernels():  # a kernel without a GPU and not interpreted
    with pytest.raises(ValueError, match="interpret mode"):
      grouped_matmul(lhs, rhs, gs, implementation="triton")


def test_mixed_dtypes_promote():
  lhs, rhs, gs, _ = _inputs(10, 4, 6, [3, 7], jnp.float32)
  out = grouped_matmul(lhs.astype(jnp.bfloat16), rhs, gs)
  assert out.dtype == jnp.float32


@pytest.mark.parametrize("m, bm", [(1, 16), (64, 16), (200, 64), (257, 32)])
def test_tile_table_covers_every_row_once(m, bm):
  rng = np.random.default_rng(m)
  g = 5
  cuts = np.sort(rng.integers(0, m + 1, (16, g)), axis=1)
  cuts[::4, -1] = m  # some with every row in a group
  sizes = np.diff(cuts, axis=1, prepend=0)
  tables = np.asarray(jax.jit(jax.vmap(lambda s: tile_table(s, m, bm)))(jnp.asarray(sizes, jnp.int32)))
  for sz, tbl in zip(sizes, tables):
    assert tbl.shape == (4, num_row_tiles(m, bm, g))
    owner = np.full(m, -1)
    group_of_row = np.concatenate([np.repeat(np.arange(g), sz), np.full(m - sz.sum(), g)])
    for grp, row0, lo, hi in tbl.T:
      if lo == hi:
        continue
      assert row0 % bm == 0 and row0 <= lo < hi <= row0 + bm
      assert (owner[lo:hi] == -1).all() and (group_of_row[lo:hi] == grp).all()
      owner[lo:hi] = grp
    assert (owner >= 0).all()


def test_registry():
  assert REGISTRY.names() == ("xla", "triton", "mosaic")
  assert REGISTRY.canonical("pallas_triton") == "triton" and REGISTRY.canonical("mosaic_gpu") == "mosaic"
  assert REGISTRY.available(CPU) == ["xla"]
  assert REGISTRY.available(RTX3090) == ["xla", "triton"]
  assert REGISTRY.available(H200) == ["xla", "triton", "mosaic"]
  assert REGISTRY.available(Device.interpreter()) == ["xla", "triton", "mosaic"]


@pytest.mark.parametrize("device, dtype, k, n, expected", [
    (CPU, jnp.bfloat16, 512, 256, "xla"),
    (Device.interpreter(), jnp.float32, 512, 256, "triton"),
    (H200, jnp.bfloat16, 512, 256, "mosaic"),
    (H200, jnp.float16, 128, 512, "mosaic"),
    (H200, jnp.float32, 512, 256, "triton"),
    (H200, jnp.bfloat16, 520, 256, "triton"),
    (RTX3090, jnp.bfloat16, 512, 256, "triton"),
    (RTX3090, jnp.float64, 512, 256, "xla"),
])
def test_default_dispatch(device, dtype, k, n, expected):
  d = explain_dispatch(S((1000, k), dtype), S((8, k, n), dtype), device=device)
  assert d.implementation == expected, d
  assert d.rule


@pytest.mark.parametrize("impl, device, match", [
    ("mosaic", RTX3090, "need sm_90"),
    ("mosaic", H200, "multiples of 64"),
    ("triton", CPU, "NVIDIA GPU or interpret"),
    ("triton", H200, "float64"),
])
def test_explicit_dispatch_refusals(impl, device, match):
  k = 100 if match == "multiples of 64" else 128
  dtype = jnp.float64 if match == "float64" else jnp.bfloat16
  with pytest.raises(ValueError, match=match):
    explain_dispatch(S((64, k), dtype), S((2, k, 64), dtype), implementation=impl, device=device)


# explain_dispatch's answers recorded before the op took the shared Decision (issue 40, at
# 51f288f): every implementation name (aliases too) and the default on CPU, the interpreter,
# an H200 and an RTX 3090, bfloat16 and float32, K x N on and off 64. "implementation device
# dtype KxN": (implementation, rule), or the ValueError's message.
DEVICES = {"cpu": CPU, "interpret": Device.interpreter(), "h200": H200, "rtx3090": RTX3090}
DTYPES = {"bf16": jnp.bfloat16, "f32": jnp.float32}
RECORDED = {
    'None cpu bf16 512x256': ('xla', 'cpu: XLA (row tiles by group), the only backend off the GPU'),
    'None cpu bf16 520x256': ('xla', 'cpu: XLA (row tiles by group), the only backend off the GPU'),
    'None cpu f32 512x256': ('xla', 'cpu: XLA (row tiles by group), the only backend off the GPU'),
    'None cpu f32 520x256': ('xla', 'cpu: XLA (row tiles by group), the only backend off the GPU'),
    'None interpret bf16 512x256': ('triton', 'interpret mode: the Triton kernel, emulated'),
    'None interpret bf16 520x256': ('triton', 'interpret mode: the Triton kernel, emulated'),
    'None interpret f32 512x256': ('triton', 'interpret mode: the Triton kernel, emulated'),
    'None interpret f32 520x256': ('triton', 'interpret mode: the Triton kernel, emulated'),
    'None h200 bf16 512x256': ('mosaic', 'sm_90, 16-bit operands, K and N multiples of 64: the wgmma kernels'),
    'None h200 bf16 520x256': ('triton', "sm_90: the Triton kernel (Mosaic GPU: K = 520, N = 256: both must be multiples of 64 (the TMA copies' 128-byte swizzle tile))"),
    'None h200 f32 512x256': ('triton', 'sm_90: the Triton kernel (Mosaic GPU: float32 operands: the wgmma kernels take bfloat16 or float16)'),
    'None h200 f32 520x256': ('triton', 'sm_90: the Triton kernel (Mosaic GPU: float32 operands: the wgmma kernels take bfloat16 or float16)'),
    'None rtx3090 bf16 512x256': ('triton', 'sm_86: the Triton kernel'),
    'None rtx3090 bf16 520x256': ('triton', 'sm_86: the Triton kernel'),
    'None rtx3090 f32 512x256': ('triton', 'sm_86: the Triton kernel'),
    'None rtx3090 f32 520x256': ('triton', 'sm_86: the Triton kernel'),
    'xla cpu bf16 512x256': ('xla', 'requested'),
    'xla cpu bf16 520x256': ('xla', 'requested'),
    'xla cpu f32 512x256': ('xla', 'requested'),
    'xla cpu f32 520x256': ('xla', 'requested'),
    'xla interpret bf16 512x256': ('xla', 'requested'),
    'xla interpret bf16 520x256': ('xla', 'requested'),
    'xla interpret f32 512x256': ('xla', 'requested'),
    'xla interpret f32 520x256': ('xla', 'requested'),
    'xla h200 bf16 512x256': ('xla', 'requested'),
    'xla h200 bf16 520x256': ('xla', 'requested'),
    'xla h200 f32 512x256': ('xla', 'requested'),
    'xla h200 f32 520x256': ('xla', 'requested'),
    'xla rtx3090 bf16 512x256': ('xla', 'requested'),
    'xla rtx3090 bf16 520x256': ('xla', 'requested'),
    'xla rtx3090 f32 512x256': ('xla', 'requested'),
    'xla rtx3090 f32 520x256': ('xla', 'requested'),
    'triton cpu bf16 512x256': "ValueError: grouped_matmul implementation='triton' cannot compute this call: Pallas Triton needs an NVIDIA GPU or interpret mode, not cpu",
    'triton cpu bf16 520x256': "ValueError: grouped_matmul implementation='triton' cannot compute this call: Pallas Triton needs an NVIDIA GPU or interpret mode, not cpu",
    'triton cpu f32 512x256': "ValueError: grouped_matmul implementation='triton' cannot compute this call: Pallas Triton needs an NVIDIA GPU or interpret mode, not cpu",
    'triton cpu f32 520x256': "ValueError: grouped_matmul implementation='triton' cannot compute this call: Pallas Triton needs an NVIDIA GPU or interpret mode, not cpu",
    'triton interpret bf16 512x256': ('triton', 'requested'),
    'triton interpret bf16 520x256': ('triton', 'requested'),
    'triton interpret f32 512x256': ('triton', 'requested'),
    'triton interpret f32 520x256': ('triton', 'requested'),
    'triton h200 bf16 512x256': ('triton', 'requested'),
    'triton h200 bf16 520x256': ('triton', 'requested'),
    'triton h200 f32 512x256': ('triton', 'requested'),
    'triton h200 f32 520x256': ('triton', 'requested'),
    'triton rtx3090 bf16 512x256': ('triton', 'requested'),
    'triton rtx3090 bf16 520x256': ('triton', 'requested'),
    'triton rtx3090 f32 512x256': ('triton', 'requested'),
    'triton rtx3090 f32 520x256': ('triton', 'requested'),
    'mosaic cpu bf16 512x256': "ValueError: grouped_matmul implementation='mosaic' cannot compute this call: Mosaic GPU's wgmma and TMA kernels need sm_90 (or interpret mode), not cpu",
    'mosaic cpu bf16 520x256': "ValueError: grouped_matmul implementation='mosaic' cannot compute this call: Mosaic GPU's wgmma and TMA kernels need sm_90 (or interpret mode), not cpu",
    'mosaic cpu f32 512x256': "ValueError: grouped_matmul implementation='mosaic' cannot compute this call: Mosaic GPU's wgmma and TMA kernels need sm_90 (or interpret mode), not cpu",
    'mosaic cpu f32 520x256': "ValueError: grouped_matmul implementation='mosaic' cannot compute this call: Mosaic GPU's wgmma and TMA kernels need sm_90 (or interpret mode), not cpu",
    'mosaic interpret bf16 512x256': ('mosaic', 'requested'),
    'mosaic interpret bf16 520x256': "ValueError: grouped_matmul implementation='mosaic' cannot compute this call: K = 520, N = 256: both must be multiples of 64 (the TMA copies' 128-byte swizzle tile)",
    'mosaic interpret f32 512x256': "ValueError: grouped_matmul implementation='mosaic' cannot compute this call: float32 operands: the wgmma kernels take bfloat16 or float16",
    'mosaic interpret f32 520x256': "ValueError: grouped_matmul implementation='mosaic' cannot compute this call: float32 operands: the wgmma kernels take bfloat16 or float16",
    'mosaic h200 bf16 512x256': ('mosaic', 'requested'),
    'mosaic h200 bf16 520x256': "ValueError: grouped_matmul implementation='mosaic' cannot compute this call: K = 520, N = 256: both must be multiples of 64 (the TMA copies' 128-byte swizzle tile)",
    'mosaic h200 f32 512x256': "ValueError: grouped_matmul implementation='mosaic' cannot compute this call: float32 operands: the wgmma kernels take bfloat16 or float16",
    'mosaic h200 f32 520x256': "ValueError: grouped_matmul implementation='mosaic' cannot compute this call: float32 operands: the wgmma kernels take bfloat16 or float16",
    'mosaic rtx3090 bf16 512x256': "ValueError: grouped_matmul implementation='mosaic' cannot compute this call: Mosaic GPU's wgmma and TMA kernels need sm_90 (or interpret mode), not sm_86",
    'mosaic rtx3090 bf16 520x256': "ValueError: grouped_matmul implementation='mosaic' cannot compute this call: Mosaic GPU's wgmma and TMA kernels need sm_90 (or interpret mode), not sm_86",
    'mosaic rtx3090 f32 512x256': "ValueError: grouped_matmul implementation='mosaic' cannot compute this call: Mosaic GPU's wgmma and TMA kernels need sm_90 (or interpret mode), not sm_86",
    'mosaic rtx3090 f32 520x256': "ValueError: grouped_matmul implementation='mosaic' cannot compute this call: Mosaic GPU's wgmma and TMA kernels need sm_90 (or interpret mode), not sm_86",
    'pallas_triton cpu bf16 512x256': "ValueError: grouped_matmul implementation='pallas_triton' cannot compute this call: Pallas Triton needs an NVIDIA GPU or interpret mode, not cpu",
    'pallas_triton cpu bf16 520x256': "ValueError: grouped_matmul implementation='pallas_triton' cannot compute this call: Pallas Triton needs an NVIDIA GPU or interpret mode, not cpu",
    'pallas_triton cpu f32 512x256': "ValueError: grouped_matmul implementation='pallas_triton' cannot compute this call: Pallas Triton needs an NVIDIA GPU or interpret mode, not cpu",
    'pallas_triton cpu f32 520x256': "ValueError: grouped_matmul implementation='pallas_triton' cannot compute this call: Pallas Triton needs an NVIDIA GPU or interpret mode, not cpu",
    'pallas_triton interpret bf16 512x256': ('triton', 'requested'),
    'pallas_triton interpret bf16 520x256': ('triton', 'requested'),
    'pallas_triton interpret f32 512x256': ('triton', 'requested'),
    'pallas_triton interpret f32 520x256': ('triton', 'requested'),
    'pallas_triton h200 bf16 512x256': ('triton', 'requested'),
    'pallas_triton h200 bf16 520x256': ('triton', 'requested'),
    'pallas_triton h200 f32 512x256': ('triton', 'requested'),
    'pallas_triton h200 f32 520x256': ('triton', 'requested'),
    'pallas_triton rtx3090 bf16 512x256': ('triton', 'requested'),
    'pallas_triton rtx3090 bf16 520x256': ('triton', 'requested'),
    'pallas_triton rtx3090 f32 512x256': ('triton', 'requested'),
    'pallas_triton rtx3090 f32 520x256': ('triton', 'requested'),
    'mosaic_gpu cpu bf16 512x256': "ValueError: grouped_matmul implementation='mosaic_gpu' cannot compute this call: Mosaic GPU's wgmma and TMA kernels need sm_90 (or interpret mode), not cpu",
    'mosaic_gpu cpu bf16 520x256': "ValueError: grouped_matmul implementation='mosaic_gpu' cannot compute this call: Mosaic GPU's wgmma and TMA kernels need sm_90 (or interpret mode), not cpu",
    'mosaic_gpu cpu f32 512x256': "ValueError: grouped_matmul implementation='mosaic_gpu' cannot compute this call: Mosaic GPU's wgmma and TMA kernels need sm_90 (or interpret mode), not cpu",
    'mosaic_gpu cpu f32 520x256': "ValueError: grouped_matmul implementation='mosaic_gpu' cannot compute this call: Mosaic GPU's wgmma and TMA kernels need sm_90 (or interpret mode), not cpu",
    'mosaic_gpu interpret bf16 512x256': ('mosaic', 'requested'),
    'mosaic_gpu interpret bf16 520x256': "ValueError: grouped_matmul implementation='mosaic_gpu' cannot compute this call: K = 520, N = 256: both must be multiples of 64 (the TMA copies' 128-byte swizzle tile)",
    'mosaic_gpu interpret f32 512x256': "ValueError: grouped_matmul implementation='mosaic_gpu' cannot compute this call: float32 operands: the wgmma kernels take bfloat16 or float16",
    'mosaic_gpu interpret f32 520x256': "ValueError: grouped_matmul implementation='mosaic_gpu' cannot compute this call: float32 operands: the wgmma kernels take bfloat16 or float16",
    'mosaic_gpu h200 bf16 512x256': ('mosaic', 'requested'),
    'mosaic_gpu h200 bf16 520x256': "ValueError: grouped_matmul implementation='mosaic_gpu' cannot compute this call: K = 520, N = 256: both must be multiples of 64 (the TMA copies' 128-byte swizzle tile)",
    'mosaic_gpu h200 f32 512x256': "ValueError: grouped_matmul implementation='mosaic_gpu' cannot compute this call: float32 operands: the wgmma kernels take bfloat16 or float16",
    'mosaic_gpu h200 f32 520x256': "ValueError: grouped_matmul implementation='mosaic_gpu' cannot compute this call: float32 operands: the wgmma kernels take bfloat16 or float16",
    'mosaic_gpu rtx3090 bf16 512x256': "ValueError: grouped_matmul implementation='mosaic_gpu' cannot compute this call: Mosaic GPU's wgmma and TMA kernels need sm_90 (or interpret mode), not sm_86",
    'mosaic_gpu rtx3090 bf16 520x256': "ValueError: grouped_matmul implementation='mosaic_gpu' cannot compute this call: Mosaic GPU's wgmma and TMA kernels need sm_90 (or interpret mode), not sm_86",
    'mosaic_gpu rtx3090 f32 512x256': "ValueError: grouped_matmul implementation='mosaic_gpu' cannot compute this call: Mosaic GPU's wgmma and TMA kernels need sm_90 (or interpret mode), not sm_86",
    'mosaic_gpu rtx3090 f32 520x256': "ValueError: grouped_matmul implementation='mosaic_gpu' cannot compute this call: Mosaic GPU's wgmma and TMA kernels need sm_90 (or interpret mode), not sm_86",
}


def test_dispatch_decisions_unchanged():
  for key, want in RECORDED.items():
    impl, device, dtype, shape = key.split()
    k, n = map(int, shape.split("x"))
    dt = DTYPES[dtype]
    try:
      d = explain_dispatch(S((1000, k), dt), S((8, k, n), dt), implementation=None if impl == "None" else impl,
                           device=DEVICES[device])
    except ValueError as e:
      assert f"ValueError: {e}" == want, key
      continue
    assert isinstance(d, Decision) and d.config == () and d.backward is None and d.grad is None, key
    assert (d.implementation, d.rule) == want, key


def test_the_face():
  """The package exports the api module's names, the same objects; the decision is the core one."""
  import probjax.ops.grouped_matmul as op
  from probjax.ops.grouped_matmul import api, dispatch
  assert sorted(op.__all__) == sorted(api.__all__)
  for name in api.__all__:
    assert getattr(op, name) is getattr(api, name), name
  assert op.Decision is dispatch.Decision is Decision
  assert str(explain_dispatch(S((6, 4), jnp.float32), S((2, 4, 3), jnp.float32), device=CPU)) == (
      "xla (cpu: XLA (row tiles by group), the only backend off the GPU)")
