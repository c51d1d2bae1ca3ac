"""The grouped matmul: the conformance suite (tests/ops/grouped_matmul/conformance.py) on every
backend of the registry, and what is not a backend's case: float64 on XLA, dtype promotion, the
row-tile table, the registry and the dispatch rules (on fake devices).

XLA runs natively on CPU; the Triton and Mosaic GPU kernels run in Pallas interpret mode at
small shapes (the smallest case of each code path in make test, the rest slow).
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
from probjax.ops.grouped_matmul import REGISTRY, explain_dispatch, grouped_matmul
from probjax.ops.grouped_matmul.reference import reference, reference_vjp
from probjax.ops.grouped_matmul.tiles import num_row_tiles, tile_table
from probjax.core.tolerances import max_error, tolerance
from probjax.testing import float32_is_tf32, interpret_kernels
from tests.ops.grouped_matmul.conformance import GroupedMatmulConformance, inputs

TF32 = float32_is_tf32()  # on a GPU, float32 matmuls run as TF32 (tolerances bound that)

H200 = Device("gpu", (9, 0), 140 << 30)
RTX3090 = Device("gpu", (8, 6), 24 << 30)
CPU = Device("cpu")
S = jax.ShapeDtypeStruct


class TestXlaConformance(GroupedMatmulConformance):
  """The conformance suite on the XLA backend (natively on CPU), and float64 operands."""

  implementation = "xla"
  tf32 = TF32
  # make test: one shape beside the cheap cases; vmap also runs in test_moe.
  slow_cases = frozenset({"test_values_and_grads[*]", "test_vmap[*]"})
  fast_cases = frozenset({"test_values_and_grads[ragged-T]"})

  def test_float64(self):
    with jax.enable_x64(True):
      self.check(*self.shapes["ragged"], dtype=jnp.float64)


# Interpret mode: each new shape compiles the forward and both backward kernels (seconds of CPU
# a case); make test keeps the smallest case of each code path.
class TestTritonConformance(GroupedMatmulConformance):
  """The conformance suite on the Triton kernels (interpret mode off the GPU)."""

  implementation = "triton"
  tf32 = TF32
  refusals = (("not_interpreted", dict(interpret=False), (64, 16, 16), jnp.float32, "interpret mode"),) * interpret_kernels()
  # jvp and bad inputs: the custom_vjp and the validation are XLA's (TestXlaConformance's cases
  # run in make test).
  slow_cases = frozenset({"test_values_and_grads[*]", "test_low_precision[*-f32out]", "test_jvp[*]",
                          "test_bad_inputs[*]"})
  fast_cases = frozenset({"test_values_and_grads[ragged-T]", "test_values_and_grads[short_k-N]"})


class TestMosaicConformance(GroupedMatmulConformance):
  """The conformance suite on the Mosaic GPU kernels (interpret mode off the GPU): 16-bit
  operands, K and N multiples of 64; M off the 8-row TMA tiling is padded."""

  implementation = "mosaic"
  dtype = jnp.bfloat16
  shapes = {"ragged": (150, 128, 64, [37, 0, 64, 30]), "one_group": (64, 64, 128, [0, 64]),
            "tail_rows": (200, 64, 192, [10, 0, 120])}
  low_precision = (jnp.float16,)
  small = (30, 64, 64)
  refusals = (("float32", {}, (64, 64, 64), jnp.float32, "wgmma kernels take bfloat16"),
              ("k_off_64", {}, (64, 100, 64), jnp.bfloat16, "multiples of 64"))
  # Mosaic interpret mode runs a CTA's warpgroups as threads: the slowest of the three.
  slow_cases = frozenset({"test_values_and_grads[*]", "test_low_precision[*]", "test_traced_group_sizes[*]",
                          "test_vmap[*]", "test_jvp[*]", "test_bad_inputs[*]"})
  fast_cases = frozenset({"test_values_and_grads[ragged-N]"})


def test_mixed_dtypes_promote():
  lhs, rhs, gs, _ = inputs(10, 4, 6, [3, 7], jnp.float32)
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
    (H200, jnp.bfloat16, 512, 256, "triton"),   # forward and small differentiated calls: Triton
    (H200, jnp.float16, 128, 512, "triton"),
    (H200, jnp.float32, 512, 256, "triton"),
    (H200, jnp.bfloat16, 520, 256, "triton"),
    (RTX3090, jnp.bfloat16, 512, 256, "triton"),
    (RTX3090, jnp.float64, 512, 256, "xla"),
])
def test_default_dispatch(device, dtype, k, n, expected):
  d = explain_dispatch(S((1000, k), dtype), S((8, k, n), dtype), device=device)
  assert d.implementation == expected, d
  assert d.rule


def test_sm90_differentiated_calls_from_the_tuned_sizes_run_the_wgmma_kernels():
  """``tuning/sm_90.json`` "wgmma_grad_from": a differentiated call of K >= 7168 over M >= 2048
  rows runs the wgmma kernels (``grad``); below either size, and undifferentiated, the Triton
  kernel; the Triton kernel cannot take float64 but neither can Mosaic, and a call Mosaic cannot
  compute stays on Triton throughout."""
  big = explain_dispatch(S((4096, 7168), jnp.bfloat16), S((8, 7168, 2048), jnp.bfloat16), device=H200)
  assert big.implementation == "triton" and big.grad.implementation == "mosaic", big
  assert "K 7168 >= 7168 over M 4096 >= 2048" in big.grad.rule
  for m, k in ((1000, 7168), (4096, 5120)):
    d = explain_dispatch(S((m, k), jnp.bfloat16), S((8, k, 2048), jnp.bfloat16), device=H200)
    assert d.implementation == "triton" and d.grad is None, d
  d = explain_dispatch(S((4096, 7168), jnp.bfloat16), S((8, 7168, 2048), jnp.bfloat16), device=RTX3090)
  assert d.implementation == "triton" and d.grad is None, d


class _Spy:
  """A backend that records which product it computed and delegates to XLA's."""

  def __init__(self, name):
    self.name, self.calls, self.xla = name, [], REGISTRY.get("xla")

  def gmm(self, *a, **kw):
    self.calls.append("gmm")
    return self.xla.gmm(*a, **kw)

  def tgmm(self, *a, **kw):
    self.calls.append("tgmm")
    return self.xla.tgmm(*a, **kw)


def test_a_differentiated_call_runs_the_grad_backend_throughout():
  """``backend(..., grad=other)``: undifferentiated, ``backend``'s forward product; under
  ``jax.grad``, ``other``'s forward (with the residuals) and both backward products, exact."""
  from probjax.ops.grouped_matmul.base import GroupedMatmulBackend
  from probjax.ops.grouped_matmul.call import make_call
  lhs, rhs, gs, d_out = inputs(13, 8, 6, [5, 0, 6], jnp.float32, seed=3)
  call = make_call(lhs, rhs, gs)
  primal, grad = _Spy("primal"), _Spy("grad")
  run = lambda a, b: GroupedMatmulBackend.__call__(primal, a, b, gs, call=call, grad=grad)
  assert max_error(run(lhs, rhs), reference(lhs, rhs, gs)) <= tolerance(jnp.float32)
  assert (primal.calls, grad.calls) == (["gmm"], [])
  out, vjp = jax.vjp(run, lhs, rhs)
  d_lhs, d_rhs = vjp(d_out)
  w_lhs, w_rhs = reference_vjp(lhs, rhs, gs, d_out)
  assert max_error(d_lhs, w_lhs) <= tolerance(jnp.float32, grad=True)
  assert max_error(d_rhs, w_rhs) <= tolerance(jnp.float32, grad=True)
  assert primal.calls == ["gmm"] and grad.calls == ["gmm", "gmm", "tgmm"], (primal.calls, grad.calls)


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
    'None h200 bf16 512x256': ('triton', 'sm_90: the Triton kernel, ahead of the wgmma kernels on the forward product and, differentiated, below K 7168 or M 2048'),
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


@pytest.mark.gpu
def test_gpu_default_pairs_triton_and_wgmma_exactly():
  """On the device, the default of a call whose decision pairs the Triton forward with the
  wgmma kernels under ``jax.grad`` (sm_90: K 7168 over 2048 rows; elsewhere the Triton kernel
  throughout): values and both gradients against the float64 reference, with an empty group."""
  sizes = [700, 0, 900, 400, 48]   # 2048 rows
  lhs, rhs, gs, d_out = inputs(2048, 7168, 256, sizes, jnp.bfloat16, seed=11)
  d = explain_dispatch(lhs, rhs, gs)
  assert d.implementation == "triton", d
  out, vjp = jax.vjp(lambda a, b: grouped_matmul(a, b, gs), lhs, rhs)
  d_lhs, d_rhs = vjp(d_out)
  w_lhs, w_rhs = reference_vjp(lhs, rhs, sizes, d_out)
  assert max_error(out, reference(lhs, rhs, sizes)) <= tolerance(jnp.bfloat16)
  assert max_error(d_lhs, w_lhs) <= tolerance(jnp.bfloat16, grad=True)
  assert max_error(d_rhs, w_rhs) <= tolerance(jnp.bfloat16, grad=True)
  assert not np.any(np.asarray(d_rhs[1], np.float32))   # the empty group's gradient: exactly zero
