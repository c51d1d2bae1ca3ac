"""MoELayer: routing, and every dispatch against "dense" (values and the gradients of the input,
the router, the experts and the shared expert).

The kernel dispatches run in Pallas interpret mode at small sizes; the ones beyond one case
per dispatch are marked slow.
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
from flax import nnx

from probjax.core.device import Device
from probjax.core.dispatch import Decision
from probjax.core.tolerances import max_error, tolerance
from probjax.nn.layers import moe as moe_module
from probjax.nn.layers.moe import MoELayer, resolve_dispatch, route
from probjax.ops.grouped_matmul import DISPATCHES, STRATEGIES, MoECall, explain_moe_dispatch
from probjax.ops.grouped_matmul.permute import expand_sorted, permute_rows, sort_assignments
from probjax.testing import float32_is_tf32, interpret_kernels

TF32 = float32_is_tf32()  # on a GPU, float32 matmuls run as TF32 (tolerances bound that)

H200 = Device("gpu", (9, 0), 140 << 30)
RTX3090 = Device("gpu", (8, 6), 24 << 30)
KERNELS = ("triton", "fused_gsum", "mosaic", "pallas")
T, D, H, E, K = 24, 16, 8, 4, 2


def _layer(dispatch, d=D, h=H, e=E, k=K, **kw):
  return MoELayer(d, h, e, k, shared_hidden=8, dispatch=dispatch, interpret=dispatch in KERNELS and interpret_kernels(),
                  rngs=nnx.Rngs(0), **kw)


def _x(shape, dtype=jnp.float32, seed=1):
  # Values exact in bfloat16, so every dtype routes the same tokens to the same experts.
  return jax.random.normal(jax.random.key(seed), shape).astype(jnp.bfloat16).astype(dtype)


def _run(layer, x):
  """``(y, aux, grads by parameter path, d_x)`` of a fixed scalar loss, jitted."""
  graph, state = nnx.split(layer)
  ct = jnp.cos(jnp.arange(x.size, dtype=jnp.float32)).reshape(x.shape)

  def loss(state, x):
    y, aux = nnx.merge(graph, state)(x)
    return jnp.sum(y.astype(jnp.float32) * ct) + 0.1 * aux.load_balancing_loss + 0.01 * aux.router_z_loss, (y, aux)

  (_, (y, aux)), (g, gx) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(state, x)
  grads = {".".join(map(str, p)): v[...] for p, v in nnx.to_flat_state(g)}
  return y, aux, grads, gx


def _compare(got, want, dtype):
  y, aux, grads, gx = got
  y0, aux0, grads0, gx0 = want
  assert max_error(y, y0) <= tolerance(dtype, tf32=TF32), max_error(y, y0)
  assert max_error(gx, gx0) <= tolerance(dtype, grad=True, tf32=TF32)
  np.testing.assert_array_equal(aux.expert_counts, aux0.expert_counts)
  assert set(grads) == set(grads0) and {"router", "w_in", "w_out"} <= set(grads)
  for name in grads:
    assert max_error(grads[name], grads0[name]) <= tolerance(dtype, grad=True, tf32=TF32), name


CONFIGS = {
    "swiglu_softmax": dict(),
    "gelu_sigmoid_capacity": dict(activation="gelu", router="sigmoid", renormalize=True, capacity_factor=0.75),
}


# Each case builds two layers and runs them eagerly with their gradients (3-6 s of CPU; the
# kernels in interpret mode): make test keeps one case of each dispatch and check; the other
# configurations, dtypes and shapes are slow.
@pytest.mark.parametrize("config", ["swiglu_softmax", pytest.param("gelu_sigmoid_capacity", marks=pytest.mark.slow)])
def test_sorted_matches_dense(config):
  x = _x((2, T // 2, D))
  _compare(_run(_layer("sorted", **CONFIGS[config]), x), _run(_layer("dense", **CONFIGS[config]), x), jnp.float32)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("dispatch, config", [
    ("triton", "swiglu_softmax"), pytest.param("fused_gsum", "gelu_sigmoid_capacity", marks=pytest.mark.slow),
    pytest.param("triton", "gelu_sigmoid_capacity", marks=pytest.mark.slow),
    pytest.param("fused_gsum", "swiglu_softmax", marks=pytest.mark.slow),
])
def test_kernel_dispatch_matches_dense(dispatch, config):
  x = _x((T, D))
  _compare(_run(_layer(dispatch, **CONFIGS[config]), x), _run(_layer("dense", **CONFIGS[config]), x), jnp.float32)


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("dispatch", ["mosaic", "triton", "fused_gsum"])
def test_bfloat16_kernel_dispatch(dispatch):
  """16-bit compute (Mosaic needs sizes in multiples of 64) against dense at float32."""
  x = _x((32, 64))
  got = _run(_layer(dispatch, d=64, h=64, dtype=jnp.bfloat16), x)
  _compare(got, _run(_layer("dense", d=64, h=64), x), jnp.bfloat16)


def test_bfloat16_sorted():
  x = _x((T, D))
  _compare(_run(_layer("sorted", dtype=jnp.bfloat16), x), _run(_layer("dense"), x), jnp.bfloat16)


@pytest.mark.slow
def test_float64_sorted():
  with jax.enable_x64(True):
    x = _x((T, D), jnp.float64)
    kw = dict(dtype=jnp.float64, param_dtype=jnp.float64)
    _compare(_run(_layer("sorted", **kw), x), _run(_layer("dense", **kw), x), jnp.float64)


def _one_expert(layer):
  """Router weights sending every (positive) token first to expert 0, then, on a tie of the
  others at zero, to expert 1: experts 2 and 3 get no token."""
  r = np.zeros(layer.router[...].shape, np.float32)
  r[:, 0] = 1.0
  layer.router[...] = jnp.asarray(r)
  return layer


@pytest.mark.timeout(300)
@pytest.mark.parametrize("dispatch", ["sorted", pytest.param("fused_gsum", marks=pytest.mark.slow),
                                      pytest.param("triton", marks=pytest.mark.slow)])
def test_all_tokens_to_one_expert(dispatch):
  x = jnp.abs(_x((T, D))) + 0.1
  got = _run(_one_expert(_layer(dispatch)), x)
  _compare(got, _run(_one_expert(_layer("dense")), x), jnp.float32)
  np.testing.assert_array_equal(got[1].expert_counts, [T, T, 0, 0])
  for name in ("w_in", "w_out"):
    g = np.asarray(got[2][name])
    assert np.isfinite(g).all() and not g[2:].any(), name  # empty experts: exactly zero


@pytest.mark.slow  # jit, vmap and three input ranks
def test_vmap_and_input_shapes():
  layer = _layer("sorted")
  call = jax.jit(lambda x: layer(x))
  x = _x((3, 8, D))
  y, aux = call(x)
  y2, _ = call(x.reshape(-1, D))
  np.testing.assert_allclose(y.reshape(-1, D), y2, rtol=1e-6, atol=1e-6)
  yb, auxb = jax.jit(jax.vmap(call))(x)  # each batch element routed on its own
  for b in range(3):
    yi, auxi = call(x[b])
    assert max_error(yb[b], yi) <= tolerance(jnp.float32, tf32=TF32)
    np.testing.assert_array_equal(auxb.expert_counts[b], auxi.expert_counts)
  with pytest.raises(ValueError, match="d_model"):
    layer(jnp.ones((4, D + 1)))


def test_routing_ties_go_to_the_lowest_expert():
  logits = jnp.array([[0.0, 0, 0, 0], [1, 3, 3, 1], [2, 1, 2, 2]])
  r = route(logits, 2)
  np.testing.assert_array_equal(r.expert_ids, [[0, 1], [1, 2], [0, 2]])
  p = jax.nn.softmax(logits, axis=-1)
  np.testing.assert_allclose(r.weights, jnp.take_along_axis(p, r.expert_ids, 1), rtol=1e-6)


def test_routing_weights_and_losses():
  logits = jax.random.normal(jax.random.key(0), (50, 6))
  r = route(logits, 3, router="sigmoid", renormalize=True)
  np.testing.assert_allclose(r.weights.sum(-1), 1.0, rtol=1e-6)
  s = route(logits, 3, router="sigmoid")
  np.testing.assert_allclose(s.weights, jax.nn.sigmoid(jnp.take_along_axis(logits, s.expert_ids, 1)), rtol=1e-6)
  assert int(s.aux.expert_counts.sum()) == 150 and int(s.aux.dropped) == 0
  np.testing.assert_allclose(s.aux.router_z_loss, jnp.mean(jax.nn.logsumexp(logits, -1) ** 2), rtol=1e-6)
  # Uniform router: ties send everything to experts 0 and 1; f = (1/2, 1/2, 0, 0), P = 1/4.
  u = route(jnp.zeros((8, 4)), 2)
  np.testing.assert_array_equal(u.aux.expert_counts, [8, 8, 0, 0])
  np.testing.assert_allclose(u.aux.load_balancing_loss, 1.0, rtol=1e-6)
  np.testing.assert_allclose(u.aux.router_z_loss, np.log(4.0) ** 2, rtol=1e-6)


def test_capacity_keeps_the_earliest_tokens():
  r = route(jnp.zeros((8, 4)), 2, capacity_factor=0.5)  # capacity ceil(0.5 * 16 / 4) = 2
  keep = np.zeros((8, 2), bool)
  keep[:2] = True
  np.testing.assert_array_equal(r.keep, keep)
  assert int(r.aux.dropped) == 12 and not np.asarray(r.weights)[~keep].any()


def test_bad_arguments():
  with pytest.raises(ValueError, match="top_k"):
    MoELayer(D, H, 4, 5, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="top_k"):
    route(jnp.zeros((3, 4)), 0)
  for kw, match in ((dict(dispatch="gather"), "dispatch"), (dict(router="relu"), "router"),
                    (dict(activation="relu"), "activation"), (dict(capacity_factor=0.0), "capacity_factor")):
    with pytest.raises(ValueError, match=match):
      MoELayer(D, H, E, K, rngs=nnx.Rngs(0), **kw)


def test_sorted_permutations_are_exact_and_scatter_free():
  """The expansion's and the combine's gradients are gathers by the inverse permutation."""
  x = jax.random.normal(jax.random.key(0), (5, 3))
  ids = jnp.array([[2, 0], [1, 2], [0, 1], [2, 1], [0, 2]])
  s = sort_assignments(ids.reshape(-1), 3)
  np.testing.assert_array_equal(s.group_sizes, [3, 3, 4])

  def f(x):
    xs = expand_sorted(x, s, 2)
    return permute_rows(xs * 2.0, s.inverse, s.order).reshape(5, 2, 3).sum(1)

  np.testing.assert_allclose(f(x), 4 * x, rtol=1e-6)
  np.testing.assert_allclose(jax.grad(lambda x: f(x).sum())(x), 4 * np.ones((5, 3)), rtol=1e-6)
  assert "scatter" not in str(jax.make_jaxpr(jax.grad(lambda x: f(x).sum()))(x))


@pytest.mark.parametrize("dispatch, device, dtype, sizes, expected", [
    ("auto", Device("cpu"), jnp.bfloat16, (512, 256), ("sorted", "xla")),
    ("auto", Device.interpreter(), jnp.float32, (16,), ("sorted", "triton")),
    ("auto", H200, jnp.bfloat16, (512, 256, 128), ("sorted", "mosaic")),
    ("pallas", H200, jnp.bfloat16, (512, 256, 128), ("sorted", "mosaic")),
    ("pallas", H200, jnp.float32, (512, 256, 128), ("sorted", "triton")),
    ("pallas", H200, jnp.bfloat16, (520, 256, 128), ("sorted", "triton")),
    ("auto", RTX3090, jnp.bfloat16, (512, 256, 128), ("sorted", "triton")),
    ("mosaic", RTX3090, jnp.bfloat16, (512,), ("sorted", "mosaic")),
    ("sorted", H200, jnp.bfloat16, (512,), ("sorted", None)),
    ("dense", H200, jnp.bfloat16, (512,), ("dense", None)),
    ("fused_gsum", RTX3090, jnp.bfloat16, (512,), ("fused_gsum", None)),
])
def test_resolve_dispatch(dispatch, device, dtype, sizes, expected):
  mode, impl, reason = resolve_dispatch(dispatch, device, dtype, sizes=sizes)
  assert (mode, impl) == expected and reason


def test_resolve_dispatch_refusals():
  with pytest.raises(ValueError, match="fused_gsum"):
    resolve_dispatch("fused_gsum", Device("cpu"), jnp.float32)
  with pytest.raises(ValueError, match="dispatch must be one of"):
    resolve_dispatch("scatter", Device("cpu"), jnp.float32)


# resolve_dispatch's answers recorded before the MoE dispatch moved into the grouped-matmul op
# (issue 40, at 51f288f): every dispatch on CPU, the interpreter, an H200 and an RTX 3090, in
# bfloat16 and float32, for the spec's sizes, sizes off 64 and no sizes. "dispatch device dtype
# sizes": (mode, grouped-matmul implementation, reason), or the ValueError's message.
DEVICES = {"cpu": Device("cpu"), "interpret": Device.interpreter(), "h200": H200, "rtx3090": RTX3090}
DTYPES = {"bf16": jnp.bfloat16, "f32": jnp.float32}
SIZES = {"spec": (512, 256, 128), "off64": (520, 256, 128), "none": ()}
RECORDED = {
    'auto cpu bf16 spec': ('sorted', 'xla', 'cpu: the sorted dispatch on the XLA grouped matmul'),
    'auto cpu bf16 off64': ('sorted', 'xla', 'cpu: the sorted dispatch on the XLA grouped matmul'),
    'auto cpu bf16 none': ('sorted', 'xla', 'cpu: the sorted dispatch on the XLA grouped matmul'),
    'auto cpu f32 spec': ('sorted', 'xla', 'cpu: the sorted dispatch on the XLA grouped matmul'),
    'auto cpu f32 off64': ('sorted', 'xla', 'cpu: the sorted dispatch on the XLA grouped matmul'),
    'auto cpu f32 none': ('sorted', 'xla', 'cpu: the sorted dispatch on the XLA grouped matmul'),
    'auto interpret bf16 spec': ('sorted', 'triton', 'interpret mode: the sorted dispatch on the Triton kernel'),
    'auto interpret bf16 off64': ('sorted', 'triton', 'interpret mode: the sorted dispatch on the Triton kernel'),
    'auto interpret bf16 none': ('sorted', 'triton', 'interpret mode: the sorted dispatch on the Triton kernel'),
    'auto interpret f32 spec': ('sorted', 'triton', 'interpret mode: the sorted dispatch on the Triton kernel'),
    'auto interpret f32 off64': ('sorted', 'triton', 'interpret mode: the sorted dispatch on the Triton kernel'),
    'auto interpret f32 none': ('sorted', 'triton', 'interpret mode: the sorted dispatch on the Triton kernel'),
    'auto h200 bf16 spec': ('sorted', 'mosaic', 'sm_90, 16-bit compute: the sorted dispatch on the Mosaic GPU kernels'),
    'auto h200 bf16 off64': ('sorted', 'triton', 'the sorted dispatch on the Triton kernel (sizes off 64)'),
    'auto h200 bf16 none': ('sorted', 'mosaic', 'sm_90, 16-bit compute: the sorted dispatch on the Mosaic GPU kernels'),
    'auto h200 f32 spec': ('sorted', 'triton', 'the sorted dispatch on the Triton kernel (32-bit compute)'),
    'auto h200 f32 off64': ('sorted', 'triton', 'the sorted dispatch on the Triton kernel (32-bit compute)'),
    'auto h200 f32 none': ('sorted', 'triton', 'the sorted dispatch on the Triton kernel (32-bit compute)'),
    'auto rtx3090 bf16 spec': ('sorted', 'triton', 'the sorted dispatch on the Triton kernel (not sm_90)'),
    'auto rtx3090 bf16 off64': ('sorted', 'triton', 'the sorted dispatch on the Triton kernel (not sm_90)'),
    'auto rtx3090 bf16 none': ('sorted', 'triton', 'the sorted dispatch on the Triton kernel (not sm_90)'),
    'auto rtx3090 f32 spec': ('sorted', 'triton', 'the sorted dispatch on the Triton kernel (not sm_90)'),
    'auto rtx3090 f32 off64': ('sorted', 'triton', 'the sorted dispatch on the Triton kernel (not sm_90)'),
    'auto rtx3090 f32 none': ('sorted', 'triton', 'the sorted dispatch on the Triton kernel (not sm_90)'),
    'dense cpu bf16 spec': ('dense', None, 'requested'),
    'dense cpu bf16 off64': ('dense', None, 'requested'),
    'dense cpu bf16 none': ('dense', None, 'requested'),
    'dense cpu f32 spec': ('dense', None, 'requested'),
    'dense cpu f32 off64': ('dense', None, 'requested'),
    'dense cpu f32 none': ('dense', None, 'requested'),
    'dense interpret bf16 spec': ('dense', None, 'requested'),
    'dense interpret bf16 off64': ('dense', None, 'requested'),
    'dense interpret bf16 none': ('dense', None, 'requested'),
    'dense interpret f32 spec': ('dense', None, 'requested'),
    'dense interpret f32 off64': ('dense', None, 'requested'),
    'dense interpret f32 none': ('dense', None, 'requested'),
    'dense h200 bf16 spec': ('dense', None, 'requested'),
    'dense h200 bf16 off64': ('dense', None, 'requested'),
    'dense h200 bf16 none': ('dense', None, 'requested'),
    'dense h200 f32 spec': ('dense', None, 'requested'),
    'dense h200 f32 off64': ('dense', None, 'requested'),
    'dense h200 f32 none': ('dense', None, 'requested'),
    'dense rtx3090 bf16 spec': ('dense', None, 'requested'),
    'dense rtx3090 bf16 off64': ('dense', None, 'requested'),
    'dense rtx3090 bf16 none': ('dense', None, 'requested'),
    'dense rtx3090 f32 spec': ('dense', None, 'requested'),
    'dense rtx3090 f32 off64': ('dense', None, 'requested'),
    'dense rtx3090 f32 none': ('dense', None, 'requested'),
    'sorted cpu bf16 spec': ('sorted', None, 'requested'),
    'sorted cpu bf16 off64': ('sorted', None, 'requested'),
    'sorted cpu bf16 none': ('sorted', None, 'requested'),
    'sorted cpu f32 spec': ('sorted', None, 'requested'),
    'sorted cpu f32 off64': ('sorted', None, 'requested'),
    'sorted cpu f32 none': ('sorted', None, 'requested'),
    'sorted interpret bf16 spec': ('sorted', None, 'requested'),
    'sorted interpret bf16 off64': ('sorted', None, 'requested'),
    'sorted interpret bf16 none': ('sorted', None, 'requested'),
    'sorted interpret f32 spec': ('sorted', None, 'requested'),
    'sorted interpret f32 off64': ('sorted', None, 'requested'),
    'sorted interpret f32 none': ('sorted', None, 'requested'),
    'sorted h200 bf16 spec': ('sorted', None, 'requested'),
    'sorted h200 bf16 off64': ('sorted', None, 'requested'),
    'sorted h200 bf16 none': ('sorted', None, 'requested'),
    'sorted h200 f32 spec': ('sorted', None, 'requested'),
    'sorted h200 f32 off64': ('sorted', None, 'requested'),
    'sorted h200 f32 none': ('sorted', None, 'requested'),
    'sorted rtx3090 bf16 spec': ('sorted', None, 'requested'),
    'sorted rtx3090 bf16 off64': ('sorted', None, 'requested'),
    'sorted rtx3090 bf16 none': ('sorted', None, 'requested'),
    'sorted rtx3090 f32 spec': ('sorted', None, 'requested'),
    'sorted rtx3090 f32 off64': ('sorted', None, 'requested'),
    'sorted rtx3090 f32 none': ('sorted', None, 'requested'),
    'fused_gsum cpu bf16 spec': "ValueError: dispatch='fused_gsum' runs Triton kernels: Pallas Triton needs an NVIDIA GPU or interpret mode, not cpu",
    'fused_gsum cpu bf16 off64': "ValueError: dispatch='fused_gsum' runs Triton kernels: Pallas Triton needs an NVIDIA GPU or interpret mode, not cpu",
    'fused_gsum cpu bf16 none': "ValueError: dispatch='fused_gsum' runs Triton kernels: Pallas Triton needs an NVIDIA GPU or interpret mode, not cpu",
    'fused_gsum cpu f32 spec': "ValueError: dispatch='fused_gsum' runs Triton kernels: Pallas Triton needs an NVIDIA GPU or interpret mode, not cpu",
    'fused_gsum cpu f32 off64': "ValueError: dispatch='fused_gsum' runs Triton kernels: Pallas Triton needs an NVIDIA GPU or interpret mode, not cpu",
    'fused_gsum cpu f32 none': "ValueError: dispatch='fused_gsum' runs Triton kernels: Pallas Triton needs an NVIDIA GPU or interpret mode, not cpu",
    'fused_gsum interpret bf16 spec': ('fused_gsum', None, 'requested'),
    'fused_gsum interpret bf16 off64': ('fused_gsum', None, 'requested'),
    'fused_gsum interpret bf16 none': ('fused_gsum', None, 'requested'),
    'fused_gsum interpret f32 spec': ('fused_gsum', None, 'requested'),
    'fused_gsum interpret f32 off64': ('fused_gsum', None, 'requested'),
    'fused_gsum interpret f32 none': ('fused_gsum', None, 'requested'),
    'fused_gsum h200 bf16 spec': ('fused_gsum', None, 'requested'),
    'fused_gsum h200 bf16 off64': ('fused_gsum', None, 'requested'),
    'fused_gsum h200 bf16 none': ('fused_gsum', None, 'requested'),
    'fused_gsum h200 f32 spec': ('fused_gsum', None, 'requested'),
    'fused_gsum h200 f32 off64': ('fused_gsum', None, 'requested'),
    'fused_gsum h200 f32 none': ('fused_gsum', None, 'requested'),
    'fused_gsum rtx3090 bf16 spec': ('fused_gsum', None, 'requested'),
    'fused_gsum rtx3090 bf16 off64': ('fused_gsum', None, 'requested'),
    'fused_gsum rtx3090 bf16 none': ('fused_gsum', None, 'requested'),
    'fused_gsum rtx3090 f32 spec': ('fused_gsum', None, 'requested'),
    'fused_gsum rtx3090 f32 off64': ('fused_gsum', None, 'requested'),
    'fused_gsum rtx3090 f32 none': ('fused_gsum', None, 'requested'),
    'triton cpu bf16 spec': ('sorted', 'triton', 'requested'),
    'triton cpu bf16 off64': ('sorted', 'triton', 'requested'),
    'triton cpu bf16 none': ('sorted', 'triton', 'requested'),
    'triton cpu f32 spec': ('sorted', 'triton', 'requested'),
    'triton cpu f32 off64': ('sorted', 'triton', 'requested'),
    'triton cpu f32 none': ('sorted', 'triton', 'requested'),
    'triton interpret bf16 spec': ('sorted', 'triton', 'requested'),
    'triton interpret bf16 off64': ('sorted', 'triton', 'requested'),
    'triton interpret bf16 none': ('sorted', 'triton', 'requested'),
    'triton interpret f32 spec': ('sorted', 'triton', 'requested'),
    'triton interpret f32 off64': ('sorted', 'triton', 'requested'),
    'triton interpret f32 none': ('sorted', 'triton', 'requested'),
    'triton h200 bf16 spec': ('sorted', 'triton', 'requested'),
    'triton h200 bf16 off64': ('sorted', 'triton', 'requested'),
    'triton h200 bf16 none': ('sorted', 'triton', 'requested'),
    'triton h200 f32 spec': ('sorted', 'triton', 'requested'),
    'triton h200 f32 off64': ('sorted', 'triton', 'requested'),
    'triton h200 f32 none': ('sorted', 'triton', 'requested'),
    'triton rtx3090 bf16 spec': ('sorted', 'triton', 'requested'),
    'triton rtx3090 bf16 off64': ('sorted', 'triton', 'requested'),
    'triton rtx3090 bf16 none': ('sorted', 'triton', 'requested'),
    'triton rtx3090 f32 spec': ('sorted', 'triton', 'requested'),
    'triton rtx3090 f32 off64': ('sorted', 'triton', 'requested'),
    'triton rtx3090 f32 none': ('sorted', 'triton', 'requested'),
    'pallas cpu bf16 spec': ('sorted', 'triton', 'the sorted dispatch on the Triton kernel (not sm_90)'),
    'pallas cpu bf16 off64': ('sorted', 'triton', 'the sorted dispatch on the Triton kernel (not sm_90)'),
    'pallas cpu bf16 none': ('sorted', 'triton', 'the sorted dispatch on the Triton kernel (not sm_90)'),
    'pallas cpu f32 spec': ('sorted', 'triton', 'the sorted dispatch on the Triton kernel (not sm_90)'),
    'pallas cpu f32 off64': ('sorted', 'triton', 'the sorted dispatch on the Triton kernel (not sm_90)'),
    'pallas cpu f32 none': ('sorted', 'triton', 'the sorted dispatch on the Triton kernel (not sm_90)'),
    'pallas interpret bf16 spec': ('sorted', 'triton', 'the sorted dispatch on the Triton kernel (not sm_90)'),
    'pallas interpret bf16 off64': ('sorted', 'triton', 'the sorted dispatch on the Triton kernel (not sm_90)'),
    'pallas interpret bf16 none': ('sorted', 'triton', 'the sorted dispatch on the Triton kernel (not sm_90)'),
    'pallas interpret f32 spec': ('sorted', 'triton', 'the sorted dispatch on the Triton kernel (not sm_90)'),
    'pallas interpret f32 off64': ('sorted', 'triton', 'the sorted dispatch on the Triton kernel (not sm_90)'),
    'pallas interpret f32 none': ('sorted', 'triton', 'the sorted dispatch on the Triton kernel (not sm_90)'),
    'pallas h200 bf16 spec': ('sorted', 'mosaic', 'sm_90, 16-bit compute: the sorted dispatch on the Mosaic GPU kernels'),
    'pallas h200 bf16 off64': ('sorted', 'triton', 'the sorted dispatch on the Triton kernel (sizes off 64)'),
    'pallas h200 bf16 none': ('sorted', 'mosaic', 'sm_90, 16-bit compute: the sorted dispatch on the Mosaic GPU kernels'),
    'pallas h200 f32 spec': ('sorted', 'triton', 'the sorted dispatch on the Triton kernel (32-bit compute)'),
    'pallas h200 f32 off64': ('sorted', 'triton', 'the sorted dispatch on the Triton kernel (32-bit compute)'),
    'pallas h200 f32 none': ('sorted', 'triton', 'the sorted dispatch on the Triton kernel (32-bit compute)'),
    'pallas rtx3090 bf16 spec': ('sorted', 'triton', 'the sorted dispatch on the Triton kernel (not sm_90)'),
    'pallas rtx3090 bf16 off64': ('sorted', 'triton', 'the sorted dispatch on the Triton kernel (not sm_90)'),
    'pallas rtx3090 bf16 none': ('sorted', 'triton', 'the sorted dispatch on the Triton kernel (not sm_90)'),
    'pallas rtx3090 f32 spec': ('sorted', 'triton', 'the sorted dispatch on the Triton kernel (not sm_90)'),
    'pallas rtx3090 f32 off64': ('sorted', 'triton', 'the sorted dispatch on the Triton kernel (not sm_90)'),
    'pallas rtx3090 f32 none': ('sorted', 'triton', 'the sorted dispatch on the Triton kernel (not sm_90)'),
    'mosaic cpu bf16 spec': ('sorted', 'mosaic', 'requested'),
    'mosaic cpu bf16 off64': ('sorted', 'mosaic', 'requested'),
    'mosaic cpu bf16 none': ('sorted', 'mosaic', 'requested'),
    'mosaic cpu f32 spec': ('sorted', 'mosaic', 'requested'),
    'mosaic cpu f32 off64': ('sorted', 'mosaic', 'requested'),
    'mosaic cpu f32 none': ('sorted', 'mosaic', 'requested'),
    'mosaic interpret bf16 spec': ('sorted', 'mosaic', 'requested'),
    'mosaic interpret bf16 off64': ('sorted', 'mosaic', 'requested'),
    'mosaic interpret bf16 none': ('sorted', 'mosaic', 'requested'),
    'mosaic interpret f32 spec': ('sorted', 'mosaic', 'requested'),
    'mosaic interpret f32 off64': ('sorted', 'mosaic', 'requested'),
    'mosaic interpret f32 none': ('sorted', 'mosaic', 'requested'),
    'mosaic h200 bf16 spec': ('sorted', 'mosaic', 'requested'),
    'mosaic h200 bf16 off64': ('sorted', 'mosaic', 'requested'),
    'mosaic h200 bf16 none': ('sorted', 'mosaic', 'requested'),
    'mosaic h200 f32 spec': ('sorted', 'mosaic', 'requested'),
    'mosaic h200 f32 off64': ('sorted', 'mosaic', 'requested'),
    'mosaic h200 f32 none': ('sorted', 'mosaic', 'requested'),
    'mosaic rtx3090 bf16 spec': ('sorted', 'mosaic', 'requested'),
    'mosaic rtx3090 bf16 off64': ('sorted', 'mosaic', 'requested'),
    'mosaic rtx3090 bf16 none': ('sorted', 'mosaic', 'requested'),
    'mosaic rtx3090 f32 spec': ('sorted', 'mosaic', 'requested'),
    'mosaic rtx3090 f32 off64': ('sorted', 'mosaic', 'requested'),
    'mosaic rtx3090 f32 none': ('sorted', 'mosaic', 'requested'),
}


def _recorded_case(key):
  dispatch, device, dtype, sizes = key.split()
  return dispatch, DEVICES[device], DTYPES[dtype], SIZES[sizes]


def test_dispatch_decisions_unchanged():
  """The op's MoE dispatch gives every recorded decision, reason and refusal unchanged, and
  resolve_dispatch is its decision as a tuple."""
  assert {k.split()[0] for k in RECORDED} == set(DISPATCHES)
  for key, want in RECORDED.items():
    dispatch, device, dtype, sizes = _recorded_case(key)
    try:
      got = resolve_dispatch(dispatch, device, dtype, sizes=sizes)
    except ValueError as e:
      got = f"ValueError: {e}"
    assert got == want, key
    if isinstance(want, str):
      with pytest.raises(ValueError):
        explain_moe_dispatch(MoECall(dtype, sizes), dispatch, device=device)
      continue
    d = explain_moe_dispatch(MoECall(dtype, sizes), dispatch, device=device)
    assert isinstance(d, Decision) and d.implementation in STRATEGIES.names(), key
    assert (d.implementation, d.get("grouped_matmul"), d.rule) == want, key


def test_layer_asks_the_op():
  layer = MoELayer(64, 64, 4, 2, dispatch="pallas", rngs=nnx.Rngs(0))
  call = layer.moe_call(jnp.bfloat16)
  assert call.sizes == (64, 128, 64) and (call.num_experts, call.top_k, call.activation) == (4, 2, "swiglu")
  d = layer.explain_dispatch(jnp.bfloat16, H200)
  assert d == explain_moe_dispatch(call, "pallas", device=H200)
  assert str(d) == "sorted, grouped_matmul=mosaic (sm_90, 16-bit compute: the sorted dispatch on the Mosaic GPU kernels)"
  assert layer.plan(jnp.bfloat16, H200) == resolve_dispatch("pallas", H200, jnp.bfloat16, sizes=call.sizes)
  assert layer.plan(jnp.float32, Device("cpu"))[1] == "triton"  # "pallas" names the kernels everywhere


def test_fused_gsum_is_a_registered_strategy():
  assert STRATEGIES.names() == ("dense", "sorted", "fused_gsum")
  assert STRATEGIES.available(Device("cpu")) == ["dense", "sorted"]
  assert STRATEGIES.available(H200) == STRATEGIES.available(Device.interpreter()) == ["dense", "sorted", "fused_gsum"]
  why = STRATEGIES.get("fused_gsum").supports(MoECall("float32", (16,)), Device("cpu"))
  assert why == "runs Triton kernels: Pallas Triton needs an NVIDIA GPU or interpret mode, not cpu"


def test_activation_math_is_written_once():
  """The layer and the strategies read the op's activations; no other module of the op or the
  layer computes them."""
  import pathlib
  import probjax.ops.grouped_matmul as op
  from probjax.ops.grouped_matmul import activations, fused
  assert fused.activate is activations.activate and moe_module.ACTIVATIONS is activations.ACTIVATIONS
  sources = [*pathlib.Path(op.__file__).parent.rglob("*.py"), pathlib.Path(moe_module.__file__)]
  writers = sorted(p.name for p in sources if any(f in p.read_text() for f in ("nn.silu", "nn.gelu")))
  assert writers == ["activations.py"], writers
