"""The Mamba-1 Triton kernels (probjax/ops/scan/backends/triton/mamba.py) beyond the conformance
suite: their geometry (a pure function), the geometries the suite's small shapes do not reach
(16-channel blocks, a wide state with short groups) against the float64 reference in interpret
mode, the sm_90 lowering at the benchmark's shape, and that shape on the GPU."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from probjax.ops import scan
from probjax.ops.scan.backends.triton import mamba
from probjax.testing import float32_is_tf32
from tests.ops.scan.conformance import check, inputs

TF32 = float32_is_tf32()
S = jax.ShapeDtypeStruct


@pytest.mark.parametrize("shape, expect", [
    # The benchmark's call: 8-channel blocks (1536 one-warp programs), 16 positions a group.
    ((8, 1536, 16), mamba.Geometry(8, 16, 16, 8, 4)),
    # Enough programs at 16 channels a block; a lane then holds 8 values: shorter groups.
    ((32, 1536, 16), mamba.Geometry(16, 16, 8, 4, 2)),
    ((1, 6, 4), mamba.Geometry(8, 4, 16, 8, 4)),
    ((2, 64, 64), mamba.Geometry(8, 64, 4, 2, 1)),
    ((2, 64, 256), mamba.Geometry(8, 256, 1, 1, 1)),
])
def test_geometry(shape, expect):
  geo = mamba.geometry(*shape)
  assert geo == expect
  # The groups tile every chunk the backend takes (16 to 128), the backward's tile the forward's.
  assert 16 % geo.steps == 0 and 16 % geo.recompute_steps == 0 and geo.recompute_steps % geo.bwd_steps == 0


@pytest.mark.parametrize("length, channels, state, chunk, target", [
    # 16-channel blocks (every program count reaches a target of 1), the last block partial:
    # groups of 16 and the backward's of 4.
    (70, 37, 8, 16, 1),
    # A wide state in 8-channel blocks: groups of 4, the backward's of 1; a partial last chunk.
    (45, 6, 64, 32, mamba.TARGET_PROGRAMS),
])
def test_geometries_against_the_reference(monkeypatch, length, channels, state, chunk, target):
  """Values and every gradient (the initial state's included) at the geometries the
  conformance suite's shapes do not reach."""
  monkeypatch.setattr(mamba, "TARGET_PROGRAMS", target)
  a = inputs("mamba", length, seed=length, channels=channels, state=state)
  check("mamba", "triton", a, tf32=TF32, chunk_size=chunk)


# -- lowering for sm_90 (Pallas -> Triton IR; Triton's own compilation needs the GPU) ----------

@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_benchmark_shape_lowers_for_sm90(fake_h200, dtype):
  """B8 L2048 D1536 N16 (8-channel blocks, groups of 16), forward and differentiated."""
  x, A, B = S((8, 2048, 1536), dtype), S((1536, 16), jnp.float32), S((8, 2048, 16), dtype)
  fn = lambda x, A, B: scan.mamba_scan(x, x, A, B, B, z=x, implementation="triton")
  loss = lambda x, A, B: jnp.sum(fn(x, A, B).astype(jnp.float32))
  text = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(x, A, B).lower(lowering_platforms=("cuda",)).as_text()
  assert sorted(set(re.findall(r"probjax_mamba\w*", text))) == ["probjax_mamba_scan_bwd", "probjax_mamba_scan_fwd_res"]


# -- on the GPU ---------------------------------------------------------------------------------

def _full_size(dtype, seed=0):
  """The benchmark's call (B8 L2048 D1536 N16, z, D, dt_bias) with activations in ``dtype``."""
  rng = np.random.default_rng(seed)
  f = lambda *s, scale=1.0: (scale * rng.standard_normal(s)).astype(np.float32)
  b, length, d, n = 8, 2048, 1536, 16
  act = lambda a: jnp.asarray(a).astype(dtype)
  return dict(x=act(f(b, length, d)), dt=act(f(b, length, d, scale=0.5)),
              A=-np.broadcast_to(np.arange(1, n + 1, dtype=np.float32), (d, n)).copy(),
              B=act(f(b, length, n)), C=act(f(b, length, n)), D=np.ones(d, np.float32), z=act(f(b, length, d)),
              dt_bias=np.full(d, -4.0, np.float32), initial_state=f(b, d, n))


@pytest.mark.gpu
@pytest.mark.timeout(600)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_full_size(dtype):
  """The kernels at the benchmark's shape: values and every gradient against the float64
  reference."""
  check("mamba", "triton", _full_size(dtype), dtype=dtype, tf32=TF32)
