"""probjax's FFI call of cuDNN (``probjax.ops.attention.backends.cudnn.ffi``).

On CPU: which call the route makes (opt-out, missing library) and how masks map to
cuDNN's graph attributes. On the GPU (``--gpu``, with the extension built): the FFI call
agrees with jax.nn's call of the same cuDNN kernels, output and gradients, for every
mask the route takes, GQA, odd lengths and fp16, under jit, grad and vmap.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from probjax.nn.layers.attention import explain_dispatch, flex_attention
from probjax.ops.attention.backends import cudnn
from probjax.ops.attention import masks as M
from probjax.ops.attention.backends.cudnn import ffi
from probjax.ops.attention.backends.cudnn.config import CudnnConfig
from probjax.ops.attention.dispatch import Device
from probjax.testing import check_against_reference, make_inputs, make_mask

H200 = Device("gpu", (9, 0), 140 << 30)
BIG = ((4, 4096, 8, 64), (4, 4096, 8, 64))  # on the cuDNN route of the sm_90 table


def test_route_opt_out_and_missing_library(tmp_path):
  assert cudnn.route({ffi.ENV: "0"}) == f"jax.nn ({ffi.ENV}=0)"
  missing = {ffi.LIBRARY_ENV: str(tmp_path / "none.so")}
  assert ffi.unavailable(missing).startswith("the FFI extension is not built")
  assert cudnn.route(missing).startswith("jax.nn (the FFI extension is not built")
  d = explain_dispatch(*BIG, jnp.bfloat16, device=H200, env=missing)
  assert d.implementation == "cudnn" and d.get("route", "") == cudnn.route(missing)
  assert "route=jax.nn" in str(d)
  assert explain_dispatch(*BIG, jnp.bfloat16, device=H200, env=missing, implementation="triton").get("route", "") == ""


@pytest.mark.parametrize("name,expect", [
    ("none", (False, 0, False)),
    ("causal", (True, 0, False)),
    ("window", (True, 4096 // 5 + 1, False)),  # LocalWindowMask(left, 0): keys j > i - (left + 1)
    ("kv_len", (False, 0, True)),
])
def test_mask_to_graph_attributes(monkeypatch, name, expect):
  seen = {}
  monkeypatch.setattr(ffi, "_sdpa", lambda q, k, v, lens, params: seen.update(lens=lens, params=params) or q)
  x = make_inputs(0, 3, 4096, 4096, 8, 2, 64, jnp.bfloat16)
  mask = make_mask(name, 3, 4096, 4096)
  ffi.attention(x.q, x.k, x.v, mask=mask, scale=0.125)
  scale, causal, left_bound, padding, config = seen["params"]
  assert (scale, (causal, left_bound, padding), config) == (0.125, expect, CudnnConfig())
  if not padding:
    assert seen["lens"] is None
    return
  seq_q, seq_kv = (np.asarray(a) for a in seen["lens"])
  assert seq_q.shape == seq_kv.shape == (3,) and seq_q.dtype == seq_kv.dtype == np.int32
  np.testing.assert_array_equal(seq_q, 4096)
  np.testing.assert_array_equal(seq_kv, np.broadcast_to(np.asarray(mask.kv_lengths), (3,)))


def test_library_that_does_not_load_falls_back_with_its_reason(tmp_path):
  bad = tmp_path / "bad.so"
  bad.write_bytes(b"not an ELF file")
  env = {ffi.LIBRARY_ENV: str(bad)}
  assert ffi.unavailable(env) is None  # built, not yet loaded
  why = ffi.ready(env)
  assert why.startswith(f"the FFI extension {bad} does not load")
  assert ffi.unavailable(env) == why and cudnn.route(env) == f"jax.nn ({why})"


def test_library_that_does_not_register_falls_back_with_its_reason(tmp_path, monkeypatch):
  """A library built with a newer jaxlib's FFI headers loads, but XLA refuses its handlers
  (their API version): the route says so and names the rebuild, instead of failing every call."""
  import ctypes
  import jax
  lib = tmp_path / "newer_api.so"
  lib.write_bytes(b"")
  monkeypatch.setattr(ctypes, "CDLL", lambda *a, **kw: type("Lib", (), {s: 0 for s in ffi._TARGETS.values()})())
  monkeypatch.setattr(jax.ffi, "pycapsule", lambda f: f)

  def register(*a, **kw):
    raise jax.errors.JaxRuntimeError("INVALID_ARGUMENT: XLA FFI handler registration failed because the "
                                     "handler's API version (0.5) is incompatible with the framework's (0.4)")
  monkeypatch.setattr(jax.ffi, "register_ffi_target", register)
  why = ffi._load(lib)
  assert why.startswith(f"the FFI extension {lib} does not register with this jaxlib") and "(0.5)" in why, why
  assert "--force" in why


def test_cudnn_config_is_validated_and_needs_the_cudnn_route(tmp_path):
  assert CudnnConfig(sdpa="unified", autotune=True).attributes() == dict(sdpa=2, autotune=True)
  with pytest.raises(ValueError, match="sdpa must be one of"):
    CudnnConfig(sdpa="fast")
  with pytest.raises(TypeError, match="autotune must be a bool"):
    CudnnConfig(autotune=1)
  x = make_inputs(0, 1, 128, 128, 2, 2, 32)
  with pytest.raises(ValueError, match="pass implementation='cudnn'"):
    flex_attention(x.q, x.k, x.v, forward_config=CudnnConfig())  # on CPU: the XLA path
  missing = {ffi.LIBRARY_ENV: str(tmp_path / "none.so")}
  with pytest.raises(ValueError, match="FFI call of cuDNN, which is unavailable"):
    cudnn.attention(x.q, x.k, x.v, scale=0.1, config=CudnnConfig(), env=missing)


def _present(tmp_path):
  """An environment where the extension counts as built (it is not loaded by ``supports``)."""
  lib = tmp_path / "lib.so"
  lib.write_bytes(b"")
  return {ffi.LIBRARY_ENV: str(lib)}


@pytest.mark.parametrize("d,dv", [(192, 128), (128, 64), (64, 128), (256, 256), (256, 128), (136, 136)])
def test_value_head_dim_and_wide_heads_need_the_extension(tmp_path, d, dv):
  """Widths jax.nn's route refuses: accepted through the FFI extension on sm_90 only, else the
  reason says how to build it."""
  q, kv = (2, 4096, 16, d), (2, 4096, 4, d)
  ask = lambda env, cc=(9, 0), **kw: cudnn.supports(q, kv, jnp.bfloat16, mask=M.CausalMask(), platform="gpu",
                                                    v_head_dim=dv, compute_capability=cc, env=env, **kw)
  assert ask(_present(tmp_path)) is None
  for env in ({ffi.LIBRARY_ENV: str(tmp_path / "none.so")}, {ffi.ENV: "0"}):
    why = ask(env)
    assert "needs probjax's cuDNN extension (python -m probjax.ops.attention.backends.cudnn.build)" in why
    assert ("value head_dim" in why) == (d != dv) and (f"head_dim {d} > 128" in why) == (d == dv)
  assert "sm_90 only (this GPU is sm_80)" in ask(_present(tmp_path), (8, 0))
  assert "sm_90 only" in ask(_present(tmp_path), (10, 0))
  assert ask(_present(tmp_path), None) is None  # no GPU here: the device's capability is not checked


@pytest.mark.parametrize("d,dv,why", [(264, 264, "head_dim 264 is not"), (192, 260, "value head_dim 260 is not"),
                                      (192, 132, "value head_dim 132 is not a multiple of 8 up to 256"),
                                      (100, None, "head_dim 100 is not")])
def test_widths_cudnn_never_takes(tmp_path, d, dv, why):
  got = cudnn.supports((1, 512, 2, d), (1, 512, 2, d), jnp.float16, platform="gpu", v_head_dim=dv,
                       compute_capability=(9, 0), env=_present(tmp_path))
  assert got is not None and got.startswith(why)


@pytest.mark.parametrize("d", [64, 128])
def test_one_width_up_to_128_keeps_the_jaxnn_fallback(tmp_path, d):
  missing = {ffi.LIBRARY_ENV: str(tmp_path / "none.so")}
  for dv in (None, d):
    for cc in ((9, 0), (8, 0), None):
      assert cudnn.supports((2, 1024, 8, d), (2, 1024, 8, d), jnp.bfloat16, platform="gpu", v_head_dim=dv,
                            compute_capability=cc, env=missing) is None


def test_dispatch_on_cpu_asks_about_another_device_without_crashing(tmp_path):
  """``supports`` for a GPU that is not there (dispatch with a described device): no device query."""
  assert jax.default_backend() == "cpu"
  assert cudnn.supports((2, 4096, 16, 192), (2, 4096, 16, 192), jnp.bfloat16, platform="gpu", v_head_dim=128,
                        env=_present(tmp_path)) is None
  assert cudnn.supports((2, 4096, 16, 192), (2, 4096, 16, 192), jnp.bfloat16, v_head_dim=128).startswith(
      "cuDNN needs an NVIDIA GPU")


def test_value_head_dim_without_the_extension_raises(tmp_path):
  x = make_inputs(0, 1, 64, 64, 2, 2, 32, jnp.bfloat16, v_head_dim=16)
  missing = {ffi.LIBRARY_ENV: str(tmp_path / "none.so")}
  with pytest.raises(ValueError, match=r"value head_dim 16 needs probjax's cuDNN extension \(python -m"):
    cudnn.attention(x.q, x.k, x.v, scale=0.1, env=missing)


@pytest.mark.parametrize("mask_name", ["none", "kv_len"])
def test_ffi_shapes_with_a_value_head_dim(mask_name):
  """The custom calls' result shapes: output and dv of the values' width, dq/dk of q's."""
  x = make_inputs(1, 2, 256, 384, 8, 2, 192, jnp.bfloat16, v_head_dim=128)
  mask = make_mask(mask_name, 2, 256, 384)
  f = lambda q, k, v: ffi.attention(q, k, v, mask=mask, scale=192 ** -0.5)
  def out_and_grads(q, k, v, do):
    out, vjp = jax.vjp(f, q, k, v)
    return (out,) + vjp(do)
  got = jax.eval_shape(out_and_grads, x.q, x.k, x.v, x.do)
  assert [g.shape for g in got] == [x.do.shape, x.q.shape, x.k.shape, x.v.shape]
  assert all(g.dtype == jnp.bfloat16 for g in got)


# --- GPU ----------------------------------------------------------------------------------------

AGREE = 0.004  # bf16 precision, as tests/ops/attention/test_attention_device_defaults.py


def _ffi_built():
  why = ffi.unavailable()
  if why is not None:
    pytest.skip(f"cuDNN FFI extension: {why}")


def _out_and_grads(x, mask, env, config=None):
  f = jax.jit(lambda q, k, v: cudnn.attention(q, k, v, mask=mask, scale=x.q.shape[-1] ** -0.5, env=env,
                                              config=config))
  # Leave freed NaN blocks of the outputs' sizes for the allocator to hand out: an element the
  # call does not write shows up.
  jax.block_until_ready([jnp.full(a.shape, jnp.nan, a.dtype) for a in (x.q, x.k, x.v, x.q)])
  out, vjp = jax.vjp(f, x.q, x.k, x.v)
  return (out,) + vjp(x.do)


@pytest.mark.gpu
@pytest.mark.parametrize("mask_name", ["none", "causal", "window", "kv_len", "kv_len_zero"])
@pytest.mark.parametrize("t,heads,kv_heads,d,dtype", [
    (1024, 8, 8, 128, jnp.bfloat16), (600, 16, 4, 64, jnp.bfloat16), (1500, 8, 2, 128, jnp.float16)])
def test_gpu_ffi_agrees_with_jaxnn(mask_name, t, heads, kv_heads, d, dtype):
  _ffi_built()
  x = make_inputs(t + d, 2, t, t, heads, kv_heads, d, dtype)
  x.q, x.k = x.q * 0.5, x.k * 0.5
  x.v, x.do = x.v * 0.1, x.do * 0.1
  mask = make_mask(mask_name, 2, t, t, seed=t)
  a = _out_and_grads(x, mask, None)
  b = _out_and_grads(x, mask, {ffi.ENV: "0"})
  for name, u, w in zip(("out", "dq", "dk", "dv"), a, b):
    u, w = np.asarray(u, np.float32), np.asarray(w, np.float32)
    assert np.all(np.isfinite(u)), name
    diff = np.max(np.abs(u - w))
    assert diff <= AGREE * max(1.0, np.max(np.abs(w))), f"{name}: max |ffi - jax.nn| = {diff}"
  if mask_name == "kv_len_zero":  # batch element 0 has no key: zeros, as on every path
    assert not np.any(np.asarray(a[0][0], np.float32))


@pytest.mark.gpu
@pytest.mark.parametrize("config", [CudnnConfig(sdpa="composite"), CudnnConfig(sdpa="unified"),
                                    CudnnConfig(autotune=True)])
@pytest.mark.parametrize("mask_name", ["none", "causal", "kv_len"])
def test_gpu_ffi_configs_agree(config, mask_name):
  _ffi_built()
  x = make_inputs(11, 2, 1024, 1024, 8, 4, 128, jnp.bfloat16)
  x.v, x.do = x.v * 0.1, x.do * 0.1
  mask = make_mask(mask_name, 2, 1024, 1024)
  try:
    got = jax.block_until_ready(_out_and_grads(x, mask, None, config))
  except jax.errors.JaxRuntimeError as e:  # cuDNN's unified SDPA takes masks from 9.21 (the H200 has 9.19)
    assert config.sdpa == "unified" and mask_name == "causal" and "requires cuDNN 9.21" in str(e), e
    return
  for name, u, w in zip(("out", "dq", "dk", "dv"), got, _out_and_grads(x, mask, None)):
    u, w = np.asarray(u, np.float32), np.asarray(w, np.float32)
    assert np.all(np.isfinite(u)) and np.max(np.abs(u - w)) <= AGREE * max(1.0, np.max(np.abs(w))), name


@pytest.mark.quick  # the few-minute GPU selection (MARK='gpu and quick')
@pytest.mark.gpu
@pytest.mark.parametrize("mask_name", ["none", "causal", "kv_len"])
def test_gpu_ffi_is_exact(mask_name):
  _ffi_built()
  x = make_inputs(3, 2, 2048, 2048, 8, 8, 128, jnp.bfloat16)
  mask = make_mask(mask_name, 2, 2048, 2048)
  check_against_reference(lambda q, k, v, b: cudnn.attention(q, k, v, mask=mask, scale=128 ** -0.5), x, mask=mask)


@pytest.mark.gpu
def test_gpu_ffi_vmap_and_repeat_calls():
  _ffi_built()
  x = make_inputs(4, 2, 512, 512, 4, 4, 64, jnp.bfloat16)
  f = lambda q, k, v: cudnn.attention(q, k, v, mask=M.CausalMask(), scale=0.125)
  stacked = jax.vmap(f)(*(jnp.stack([a, a * 0.5]) for a in (x.q, x.k, x.v)))
  np.testing.assert_array_equal(np.asarray(stacked[0], np.float32), np.asarray(f(x.q, x.k, x.v), np.float32))
  # vmap folds into the batch (one call); gradients under vmap, k/v not batched
  g = jax.grad(lambda q, k, v: jnp.sum(f(q, k, v).astype(jnp.float32) * x.do), argnums=(0, 1, 2))
  batched = jax.jit(jax.vmap(g, in_axes=(0, None, None)))(jnp.stack([x.q, -x.q]), x.k, x.v)
  for i, sign in enumerate((1, -1)):
    for u, w in zip(batched, g(sign * x.q, x.k, x.v)):
      u, w = np.asarray(u[i], np.float32), np.asarray(w, np.float32)
      assert np.max(np.abs(u - w)) <= AGREE * max(1.0, np.max(np.abs(w)))
  np.testing.assert_array_equal(np.asarray(jax.jit(f)(x.q, x.k, x.v), np.float32),
                                np.asarray(jax.jit(f)(x.q, x.k, x.v), np.float32))


@pytest.mark.gpu
@pytest.mark.parametrize("mask_name", ["causal", "kv_len"])
def test_gpu_ffi_is_partitioned_over_batch_and_heads(mask_name):
  """Under automatic sharding each GPU runs the call on its shard (no gather), and the
  results match one GPU's."""
  _ffi_built()
  if len(jax.devices()) < 2:
    pytest.skip("needs 2 GPUs")
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
  mesh = Mesh(np.array(jax.devices()[:2]), ("x",))
  x = make_inputs(6, 4, 1024, 1024, 8, 4, 128, jnp.bfloat16)
  x.v, x.do = x.v * 0.1, x.do * 0.1
  mask = make_mask(mask_name, 4, 1024, 1024, seed=6)
  f = lambda q, k, v: cudnn.attention(q, k, v, mask=mask, scale=128 ** -0.5)
  def out_and_grads(q, k, v, do):
    out, vjp = jax.vjp(f, q, k, v)
    return (out,) + vjp(do)
  one = jax.jit(out_and_grads)(x.q, x.k, x.v, x.do)
  for spec in (P("x"), P(None, None, "x")):
    args = [jax.device_put(a, NamedSharding(mesh, spec)) for a in (x.q, x.k, x.v, x.do)]
    g = jax.jit(out_and_grads)
    assert "all-gather" not in g.lower(*args).compile().as_text(), spec
    for name, u, w in zip(("out", "dq", "dk", "dv"), g(*args), one):
      assert u.sharding.is_equivalent_to(NamedSharding(mesh, spec), u.ndim), (name, u.sharding)
      u, w = np.asarray(u, np.float32), np.asarray(w, np.float32)
      assert np.max(np.abs(u - w)) <= AGREE * max(1.0, np.max(np.abs(w))), (spec, name)


@pytest.mark.gpu
@pytest.mark.parametrize("mask_name", ["none", "causal", "kv_len"])
@pytest.mark.parametrize("d,dv", [(192, 128), (128, 64), (64, 128), (256, 256), (256, 128)])
def test_gpu_ffi_value_head_dim_is_exact(mask_name, d, dv):
  """q/k and v widths of their own (MLA's 192/128) and head_dim up to 256, GQA, bf16: output
  and every gradient against the float64 reference."""
  _ffi_built()
  assert cudnn.supports((2, 1024, 8, d), (2, 1024, 2, d), jnp.bfloat16, mask=make_mask(mask_name, 2, 1024, 1024),
                        v_head_dim=dv) is None
  x = make_inputs(d + dv, 2, 1024, 1024, 8, 2, d, jnp.bfloat16, v_head_dim=dv)
  mask = make_mask(mask_name, 2, 1024, 1024, seed=d)
  scale = d ** -0.5
  check_against_reference(lambda q, k, v, b: cudnn.attention(q, k, v, mask=mask, scale=scale), x, mask=mask,
                          scale=scale)


@pytest.mark.quick  # the few-minute GPU selection (MARK='gpu and quick')
@pytest.mark.gpu
def test_gpu_ffi_value_head_dim_through_the_registry():
  """The cuDNN backend's call with values of their own width: the FFI call, not jax.nn's."""
  _ffi_built()
  from probjax.ops.attention.call import AttentionCall
  from probjax.ops.attention.registry import REGISTRY
  x = make_inputs(7, 2, 512, 512, 4, 4, 192, jnp.bfloat16, v_head_dim=128)
  call = AttentionCall(x.q.shape, x.k.shape, x.q.dtype, mask=M.CausalMask(), v_head_dim=128)
  check_against_reference(lambda q, k, v, b: REGISTRY.get("cudnn")(q, k, v, M.CausalMask(), call=call), x,
                          mask=M.CausalMask())
