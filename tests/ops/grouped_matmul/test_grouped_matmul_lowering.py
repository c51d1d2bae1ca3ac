"""The grouped-matmul kernels lower for sm_90 on CPU (no GPU needed).

Interpret mode checks the kernels' arithmetic but not what the GPU compilers accept (Mosaic's
TMA windows must tile an array's minor axis, which interpret mode does not enforce); this
lowers the differentiated calls and the MoE train step for an H200, so a lowering regression
fails here rather than on the device. Triton's and Mosaic's own compilation to machine code
still need the GPU.
"""

import re

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from probjax.core.device import Device
from probjax.nn.layers.moe import MoELayer
from probjax.ops.grouped_matmul import grouped_matmul
from probjax.testing import pretend_h200, verify_triton_lowering

H200 = Device("gpu", (9, 0), 140 << 30)
S = jax.ShapeDtypeStruct
TRITON = "__gpu$xla.gpu.triton"
MOSAIC = "mosaic_gpu_v2"


@pytest.fixture
def sm90(monkeypatch):
  """Dispatch and the kernels' configs see an H200; Pallas Triton lowers for one."""
  monkeypatch.setattr(Device, "current", classmethod(lambda cls: H200))
  pretend_h200(monkeypatch)
  verify_triton_lowering(monkeypatch)


def _calls(fn, *args) -> list[str]:
  text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  return re.findall(r"custom_call @([\w$.]+)", text)


@pytest.mark.parametrize("impl, dtype, k, n", [
    ("triton", jnp.bfloat16, 200, 72), ("triton", jnp.float32, 512, 256),
    ("triton", jnp.float32, 3, 17),  # k within one block: a one-step contraction loop ("mosaic", jnp.bfloat16, 512, 256),
    pytest.param("mosaic", jnp.float16, 192, 320, marks=pytest.mark.slow)])
@pytest.mark.parametrize("transpose_rhs", [False, True])
def test_grad_lowers(sm90, impl, dtype, k, n, transpose_rhs):
  """Forward, d_lhs and d_rhs: three kernels, nothing else."""
  lhs = S((1000, k), dtype)
  rhs = S((8, n, k) if transpose_rhs else (8, k, n), dtype)
  sizes = S((8,), jnp.int32)
  loss = lambda a, b, g: jnp.sum(grouped_matmul(a, b, g, implementation=impl, transpose_rhs=transpose_rhs)
                                 .astype(jnp.float32))
  calls = _calls(jax.value_and_grad(loss, argnums=(0, 1)), lhs, rhs, sizes)
  assert calls == [TRITON if impl == "triton" else MOSAIC] * 3, calls


@pytest.mark.parametrize("dispatch, kernel, count", [("pallas", MOSAIC, 6), ("triton", TRITON, 6),
                                                     ("fused_gsum", TRITON, 6)])
def test_moe_train_step_lowers(sm90, dispatch, kernel, count):
  """The spec's MoE (d_model 512, 64 experts, top-8, width 128, shared 1024, bf16): two
  grouped matmuls forward, four backward, all on the dispatch's kernels."""
  layer = MoELayer(512, 128, 64, 8, shared_hidden=1024, dispatch=dispatch, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
  graph, state = nnx.split(layer)

  def loss(state, x):
    y, aux = nnx.merge(graph, state)(x)
    return jnp.sum(y.astype(jnp.float32)) + aux.load_balancing_loss

  calls = _calls(jax.value_and_grad(loss, argnums=(0, 1)), state, S((2, 64, 512), jnp.bfloat16))
  assert calls.count(kernel) == count and set(calls) <= {kernel}, calls


@pytest.mark.parametrize("m, k, kernels", [(2048, 7168, [MOSAIC] * 3), (1000, 7168, [TRITON] * 3)])
def test_default_lowers_the_decisions_kernels(sm90, m, k, kernels):
  """sm_90's default (``tuning/sm_90.json``): undifferentiated, the Triton kernel; under
  ``jax.grad`` from K 7168 over 2048 rows, the wgmma kernels for the forward and both backward
  products, below that the Triton kernel's three."""
  lhs, rhs, sizes = S((m, k), jnp.bfloat16), S((8, k, 256), jnp.bfloat16), S((8,), jnp.int32)
  assert _calls(grouped_matmul, lhs, rhs, sizes) == [TRITON]
  loss = lambda a, b, g: jnp.sum(grouped_matmul(a, b, g).astype(jnp.float32))
  assert _calls(jax.value_and_grad(loss, argnums=(0, 1)), lhs, rhs, sizes) == kernels
