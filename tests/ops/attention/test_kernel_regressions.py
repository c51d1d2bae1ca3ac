"""Regression tests of the Triton, Mosaic GPU and cuDNN kernels, one section per bug.

* Garbage past the lengths: K/V rows at or past ``kv_lengths[b]`` and Q/dO rows at or past
  ``q_lengths[b]`` hold NaN and inf (a KV cache's unwritten tail, padded queries). Every
  kernel's output and gradients equal the float64 reference on the clean inputs. CPU:
  interpret mode at small shapes; ``gpu``: realistic sizes, every kernel and backward and the
  cuDNN route, each case naming what leaked.
* The all-Mosaic gradient under ``jax.jit`` in interpret mode (``KeyError: OrderedIOEffect``):
  see :mod:`probjax.ops.attention.autodiff`.
* Mosaic interpret-mode runs that hung at 0% CPU: see ``PJRT_NPROC`` below.
"""

import os

# Interpret mode's warpgroup threads block XLA:CPU's thread pool (one thread per core by
# default) in their barrier waits and can hang on a small machine, at 0% CPU (every time with
# PJRT_NPROC=1): see probjax.ops.attention.backends.mosaic_gpu.config.INTERPRET_WGS. Read when JAX
# creates its CPU client.
os.environ.setdefault("PJRT_NPROC", "8")

import dataclasses  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import pytest  # noqa: E402

from probjax.nn.layers.attention import dot_product_attention  # noqa: E402
from probjax.ops.attention import flex_attention  # noqa: E402
from probjax.ops.attention import masks as M  # noqa: E402
from probjax.ops.attention.backends import mosaic_gpu as pm  # noqa: E402
from probjax.ops.attention.backends import triton as pt  # noqa: E402
from probjax.ops.attention.reference import reference_attention, reference_vjp  # noqa: E402
from probjax.testing import assert_matches, make_inputs, poison, reference_jvp  # noqa: E402

# Interpret mode can hang (above) or crawl on a loaded machine: fail loudly instead of stalling
# CI. "thread": a hung test sits in XLA, where a signal would never reach Python.
pytestmark = pytest.mark.timeout(300, method="thread")

IMPLS = ("triton_split", "triton_fused", "triton_onepass")
# The interpret-mode cases compile their kernels (Triton: 2-7 s of CPU a case) or, for Mosaic
# GPU, compile anew at every call and interpret its warpgroups (4-11 s with gradients). make
# test keeps one case of each kernel's regression; the other variants are slow.
SLOW = pytest.mark.slow
# Lengths that cut tiles of 32, 64 and 128 rows inside (and, at 128, either 64-row half).
KV_LENS, Q_LENS = (100, 37), (90, 41)


def _mask(name, q_lens=Q_LENS, kv_lens=KV_LENS, q_len=None, kv_len=None):
  lengths = lambda x: jnp.asarray(x, jnp.int32)
  return {"kv_lengths": lambda: M.KVLenMask(lengths(kv_lens)),
          "lengths": lambda: M.LengthMask(lengths(q_lens), lengths(kv_lens)),
          "causal&lengths": lambda: M.CausalMask(kv_len - q_len) & M.LengthMask(lengths(q_lens),
                                                                                lengths(kv_lens))}[name]()


def _check_garbage_ignored(attn, x, mask, *, grads=True, what=""):
  """``attn(q, k, v)`` on inputs (and output cotangent) holding NaN/inf past ``mask``'s lengths
  matches the float64 reference on the clean inputs: the output and, with ``grads``, dq, dk, dv
  (zero past the lengths), NaN-free."""
  batch, q_len, kv_len = x.q.shape[0], x.q.shape[1], x.k.shape[1]
  kv_lens = mask.kv_lengths if mask.kv_lengths is not None else jnp.full((batch,), kv_len)
  k, v = poison(x.k, kv_lens), poison(x.v, kv_lens)
  q, do = (x.q, x.do) if mask.q_lengths is None else (poison(x.q, mask.q_lengths), poison(x.do, mask.q_lengths))
  names = ("out", "dq", "dk", "dv") if grads else ("out",)
  if grads:
    out, vjp = jax.vjp(attn, q, k, v)
    got = (out, *vjp(do))
    want = reference_vjp(x.q, x.k, x.v, x.do, mask=mask)[:4]
  else:
    got, want = (attn(q, k, v),), (reference_attention(x.q, x.k, x.v, mask=mask),)
  return assert_matches(dict(zip(names, got)), dict(zip(names, want)), x.q.dtype, what=what)


# -- garbage past the lengths: interpret mode (CPU) -------------------------------------------
TRITON_FWD, TRITON_BWD = pt.ForwardConfig(32, 32, 4, 1), pt.BackwardConfig(32, 32, 32, 32, 4, 1)


def _triton(mask, impl):
  return lambda q, k, v: pt.attention(q, k, v, mask=mask, backward_pass_impl=impl, forward_config=TRITON_FWD,
                                      backward_config=TRITON_BWD, interpret=True)


@pytest.mark.parametrize("impl,mask_name", [
    pytest.param("triton_split", "lengths", marks=SLOW), ("triton_fused", "kv_lengths"),
    ("triton_onepass", "causal&lengths"), pytest.param("triton_split", "kv_lengths", marks=SLOW),
    pytest.param("triton_fused", "lengths", marks=SLOW), pytest.param("triton_onepass", "lengths", marks=SLOW)])
def test_triton_garbage_past_lengths(impl, mask_name):
  """The Triton forward and each backward variant: K/V rows past the tile a key length cuts,
  Q/dO rows past the tile a query length cuts, load as zeros; tiles past the lengths are
  never loaded."""
  x = make_inputs(0, 2, 100, 130, 2, 1, 64)
  mask = _mask(mask_name, q_len=100, kv_len=130)
  _check_garbage_ignored(_triton(mask, impl), x, mask, what=f"triton {impl} {mask_name}")


@pytest.mark.parametrize("mask_name", [pytest.param("kv_lengths", marks=SLOW), "lengths"])
def test_triton_split_kv_garbage_past_lengths(mask_name):
  """The split-KV decoding forward: the key split a length cuts loads zeros past it."""
  x = make_inputs(1, 2, 3, 200, 4, 2, 64)
  mask = _mask(mask_name, q_lens=(3, 2))
  cfg = pt.SplitKVConfig(block_k=32, num_splits=3)
  _check_garbage_ignored(lambda q, k, v: pt.attention(q, k, v, mask=mask, split_kv=cfg, interpret=True), x, mask,
                         grads=False, what=f"triton split-KV {mask_name}")


# One compute warpgroup, as in tests/ops/attention/test_mosaic_attention.py.
MOSAIC_FWD = pm.MosaicForwardConfig(block_q=64, block_k=64, num_stages=2, compute_wgs=1)
MOSAIC_BWD = pm.MosaicBackwardConfig(block_q=64, block_k=64, num_stages=2, compute_wgs=1)


@pytest.mark.parametrize("backward,bcfg", [  # auto: the Triton backward (the Mosaic one is slower to interpret)
    pytest.param("mosaic", MOSAIC_BWD, marks=SLOW), ("auto", None),
    pytest.param("mosaic", dataclasses.replace(MOSAIC_BWD, fused_dq=True), marks=SLOW)])
def test_mosaic_garbage_past_lengths(backward, bcfg):
  """The Mosaic forward (V's rows past the key length zeroed in shared memory) with the Mosaic
  backward (K, V, Q, dO rows likewise; ``fused_dq`` also multiplies dS by the resident K rows)
  or the Triton backward on the Mosaic forward's residuals."""
  x = make_inputs(2, 2, 150, 200, 2, 1, 64, jnp.bfloat16)
  mask = _mask("lengths")
  attn = lambda q, k, v: pm.attention(q, k, v, mask=mask, forward_config=MOSAIC_FWD, backward_pass_impl=backward,
                                      backward_config=bcfg, interpret=True)
  _check_garbage_ignored(attn, x, mask, what=f"mosaic forward, backward {backward} {bcfg}")


@SLOW
@pytest.mark.parametrize("cfg", [pm.MosaicForwardConfig(64, 128, 2, 1, overlap=True),
                                 pm.MosaicForwardConfig(64, 128, 3, 1, persistent=True)])
def test_mosaic_forward_variants_garbage_past_lengths(cfg):
  """The overlapped forward (V zeroed before each delayed P V) and the persistent one, at
  128-key tiles (the lengths cut the first and the second 64-row half of a tile)."""
  x = make_inputs(3, 2, 150, 200, 2, 1, 64, jnp.bfloat16)
  mask = _mask("causal&lengths", q_len=150, kv_len=200)
  _check_garbage_ignored(lambda q, k, v: pm.attention(q, k, v, mask=mask, forward_config=cfg, interpret=True),
                         x, mask, grads=False, what=f"mosaic forward {cfg}")


# -- the all-Mosaic gradient under jit, and interpret runs that hung ---------------------------
def _mosaic_loss(x, mask, backward):
  f = lambda q, k, v: dot_product_attention(q, k, v, mask=mask, implementation="mosaic", backward_pass_impl=backward,
                                            interpret=True)
  return lambda q, k, v: jnp.sum(f(q, k, v).astype(jnp.float32) * x.do.astype(jnp.float32))


def _check_grads(got, x, mask, what):
  names = ("dq", "dk", "dv")
  want = reference_vjp(x.q, x.k, x.v, x.do, mask=mask)[1:4]
  assert_matches(dict(zip(names, got)), dict(zip(names, want)), x.q.dtype, what=what)


@SLOW  # the Mosaic backward interpreted, jitted and eager
def test_mosaic_backward_under_jit_in_interpret_mode():
  """``jax.jit(jax.grad(f))`` through dot_product_attention (with_forward_mode: the kernel's vjp
  is linear_call's transpose) with the Mosaic backward in interpret mode, whose kernels carry
  an ordered effect: it raised ``KeyError: OrderedIOEffect``. The same gradient as eager."""
  x = make_inputs(4, 1, 64, 64, 1, 1, 64, jnp.bfloat16)
  mask = M.CausalMask()
  grad = jax.grad(_mosaic_loss(x, mask, "mosaic"), argnums=(0, 1, 2))
  jitted = jax.jit(grad)(x.q, x.k, x.v)
  _check_grads(jitted, x, mask, "jit(grad), Mosaic backward")
  for a, b in zip(jitted, grad(x.q, x.k, x.v)):
    assert bool(jnp.all(a == b))


@SLOW  # interpret-mode Mosaic forward and the Triton backward, jitted
def test_mosaic_interpret_jitted_forward_and_gradient_complete():
  """The jitted forward and gradient of B1 T70 H2/1 (a partial query and key tile) that hung in
  interpret mode (see PJRT_NPROC above; the module's timeout fails it if it stalls)."""
  x = make_inputs(5, 1, 70, 70, 2, 1, 64, jnp.bfloat16)
  mask = M.CausalMask()
  _, got = jax.jit(jax.value_and_grad(_mosaic_loss(x, mask, "auto"), argnums=(0, 1, 2)))(x.q, x.k, x.v)
  _check_grads(got, x, mask, "jit(value_and_grad), Triton backward")


def test_interpret_mode_warns_when_the_cpu_pool_is_too_small(monkeypatch):
  """The hang's condition, named before it happens: fewer pool threads than an interpreted
  kernel's warpgroups and its launch."""
  import warnings
  from probjax.ops.attention.backends.mosaic_gpu import config as mcfg
  monkeypatch.setenv("PJRT_NPROC", "2")
  with pytest.warns(RuntimeWarning, match="PJRT_NPROC=3"):
    mcfg.warn_if_interpret_may_hang(2)
  monkeypatch.setenv("PJRT_NPROC", "3")
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    mcfg.warn_if_interpret_may_hang(2)


# -- garbage past the lengths at realistic sizes (GPU) -----------------------------------------
GPU_KV_LENS, GPU_Q_LENS = (3001, 1157), (2890, 700)


def _gpu_inputs(seed, q_len, kv_len, d=128):
  return make_inputs(seed, 2, q_len, kv_len, 8, 2, d, jnp.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("mask_name,d", [("kv_lengths", 128), ("lengths", 64), ("causal&lengths", 128)])
def test_gpu_triton_garbage_past_lengths(impl, mask_name, d):
  x = _gpu_inputs(10, 4096, 4096, d)
  mask = _mask(mask_name, GPU_Q_LENS, GPU_KV_LENS, 4096, 4096)
  attn = lambda q, k, v: pt.attention(q, k, v, mask=mask, backward_pass_impl=impl)
  _check_garbage_ignored(attn, x, mask, what=f"triton {impl} {mask_name} d{d}")


@pytest.mark.quick  # the few-minute GPU selection (MARK='gpu and quick')
@pytest.mark.gpu
@pytest.mark.parametrize("q_len,mask_name", [(1, "kv_lengths"), (4, "lengths"), (16, "kv_lengths")])
def test_gpu_triton_split_kv_garbage_past_lengths(q_len, mask_name):
  x = _gpu_inputs(11, q_len, 4096)
  mask = _mask(mask_name, (q_len, max(1, q_len // 2)), GPU_KV_LENS)
  _check_garbage_ignored(lambda q, k, v: pt.attention(q, k, v, mask=mask, split_kv=True), x, mask, grads=False,
                         what=f"triton split-KV Tq{q_len} {mask_name}")


# (config, head_dim): three compute warpgroups have the registers for head_dim 64.
MOSAIC_GPU_FWD = {"default": (None, 128), "one-cta-per-tile": (pm.MosaicForwardConfig(64, 128, 2, 2), 128),
                  "overlap": (pm.MosaicForwardConfig(64, 128, 2, 2, True, overlap=True), 128),
                  "clusters": (pm.MosaicForwardConfig(64, 128, 2, 2, True, cluster=2), 128),
                  "three-warpgroups": (pm.MosaicForwardConfig(64, 128, 2, 3), 64)}
MOSAIC_GPU_BWD = {"auto": None, "mosaic": None,
                  "mosaic fused_dq": dataclasses.replace(pm.backward.DEFAULTS[128], fused_dq=True),
                  "mosaic shared_dq": dataclasses.replace(pm.backward.DEFAULTS[128], fused_dq=True, shared_dq=True)}


@pytest.mark.gpu
@pytest.mark.parametrize("fwd,bwd", [(f, "auto") for f in MOSAIC_GPU_FWD]
                         + [("default", b) for b in MOSAIC_GPU_BWD if b != "auto"])
@pytest.mark.parametrize("mask_name", ["kv_lengths", "causal&lengths"])
def test_gpu_mosaic_garbage_past_lengths(fwd, bwd, mask_name):
  """Every forward variant (with the Triton backward) and every Mosaic backward (with the
  default forward), two warpgroups as on the device."""
  cfg, d = MOSAIC_GPU_FWD[fwd]
  x = _gpu_inputs(12, 4096, 4096, d)
  mask = _mask(mask_name, GPU_Q_LENS, GPU_KV_LENS, 4096, 4096)
  attn = lambda q, k, v: pm.attention(q, k, v, mask=mask, forward_config=cfg, backward_pass_impl=bwd.split()[0],
                                      backward_config=MOSAIC_GPU_BWD[bwd])
  _check_garbage_ignored(attn, x, mask, what=f"mosaic forward {fwd}, backward {bwd}, {mask_name}")


@pytest.mark.parametrize("q_len, kv_len", [(40, 70), (1, 71), (7, 70)])
@pytest.mark.parametrize("grads", [pytest.param(False, marks=SLOW), True])  # True checks the output too
def test_cudnn_route_zeroes_kv_past_lengths(monkeypatch, grads, q_len, kv_len):
  """The cuDNN route on CPU, its cuDNN call replaced by jax.nn's XLA attention with the same
  arguments: like cuDNN, that masks the scores past the key lengths but multiplies the rows
  there by zero weights, so NaN/inf left in K/V would reach every output (what the H200 run
  of the test below showed for cuDNN itself). The route zeroes those rows first. Odd lengths
  run padded to even ones (jax.nn's cuDNN call refuses to differentiate them with lengths)."""
  import jax.nn
  from probjax.ops.attention.backends import cudnn
  monkeypatch.setattr(cudnn.ffi, "ready", lambda env=None: "replaced in this test")
  xla = jax.nn.dot_product_attention
  monkeypatch.setattr(jax.nn, "dot_product_attention",
                      lambda *a, implementation=None, **kw: xla(*a, implementation="xla", **kw))
  x = make_inputs(13, 2, q_len, kv_len, 4, 2, 16, jnp.float32)
  mask = M.KVLenMask(jnp.asarray((kv_len - 5, 0), jnp.int32))
  attn = lambda q, k, v: cudnn.attention(q, k, v, mask=mask, scale=16 ** -0.5)
  _check_garbage_ignored(attn, x, mask, grads=grads, what="cuDNN route, XLA in place of cuDNN")


@pytest.mark.gpu
@pytest.mark.parametrize("q_len,kv_len", [(1024, 1024), (4096, 4096), (2048, 4096), (1, 4096), (16, 4096)])
@pytest.mark.parametrize("grads", [False, True])
def test_gpu_cudnn_garbage_past_kv_lengths(q_len, kv_len, grads):
  """The cuDNN route with KVLenMask (bf16) on the GPU: no NaN/inf from K/V rows past the
  lengths reaches the output or a gradient (cuDNN itself lets them through; the route zeroes
  those rows)."""
  from probjax.ops.attention.backends import cudnn
  x = _gpu_inputs(13, q_len, kv_len)
  mask = M.KVLenMask(jnp.asarray((kv_len - 5, kv_len // 3 + 1), jnp.int32))
  attn = lambda q, k, v: dot_product_attention(q, k, v, mask=mask, implementation="cudnn")
  _check_garbage_ignored(attn, x, mask, grads=grads,
                         what=f"cuDNN via {cudnn.route()} Tq{q_len} Tkv{kv_len} {'grads' if grads else 'forward'}")


# -- tiny lengths: no CTA past the tiles of the mask -----------------------------------------
# Each Mosaic kernel indexes its precomputed per-tile ranges (segment ids) by its grid position,
# so its grid may not reach past the mask's tiles. Backward tiles of 128 queries and keys over
# CTAs of one 64-row warpgroup (the interpret-mode default) are where a grid rounded to the
# other kernel's tiles would have such CTAs: at q_len = kv_len = 1 a second key-tile CTA of the
# dK/dV kernel, reading the segment ranges past their end (interpret mode raises "Out-of-bounds
# read"; a GPU reads whatever lies there). Lengths and bands, whose ranges the kernels compute,
# and the lengths' NaN/inf tails (planted past them) at the same tiny shapes.
MOSAIC_BWD_128 = pm.MosaicBackwardConfig(block_q=128, block_k=128, num_stages=2, compute_wgs=1)
TINY_BWD = {"two kernels": MOSAIC_BWD_128, "fused_dq": dataclasses.replace(MOSAIC_BWD_128, fused_dq=True)}


def _tiny_mask(kind, t):
  if kind == "segments":  # one document, and two (one at t = 1)
    ids = jnp.stack([jnp.zeros(t, jnp.int32), (jnp.arange(t) >= t // 2).astype(jnp.int32)])
    return M.SegmentMask(ids, ids)
  if kind == "lengths":  # batch element 0 has no key at t = 1
    lengths = lambda *x: jnp.asarray(x, jnp.int32)
    return M.LengthMask(lengths(t, (t + 1) // 2), lengths(t // 2, t))
  return M.LocalWindowMask(left=1, right=0)


def _tiny_cases(fast):
  cases = [(t, kind) for t in (1, 2, 65) for kind in ("segments", "lengths", "band")]
  return [pytest.param(*c, marks=() if c in fast else SLOW) for c in cases]


@pytest.mark.parametrize("bwd", list(TINY_BWD))
@pytest.mark.parametrize("t,kind", _tiny_cases(fast=[(1, "segments")]))
def test_mosaic_backward_at_tiny_lengths(t, kind, bwd):
  """Output and gradients of the Mosaic forward and backward (both kernels, and the dK/dV
  kernel with the fused dQ) against the float64 reference at q_len = kv_len = t."""
  x = make_inputs(14, 2, t, t, 2, 1, 64, jnp.bfloat16)
  mask = _tiny_mask(kind, t)
  attn = lambda q, k, v: pm.attention(q, k, v, mask=mask, backward_pass_impl="mosaic", backward_config=TINY_BWD[bwd],
                                      interpret=True)
  _check_garbage_ignored(attn, x, mask, what=f"mosaic backward {bwd}, T{t} {kind}")


@pytest.mark.parametrize("t,kind", _tiny_cases(fast=[(1, "segments")]))
def test_mosaic_jvp_at_tiny_lengths(t, kind):
  """The fused forward + JVP kernel's output and tangent against the float64 reference at
  q_len = kv_len = t."""
  x = make_inputs(15, 2, t, t, 2, 1, 64, jnp.bfloat16)
  mask = _tiny_mask(kind, t)
  tans = tuple(jax.random.normal(jax.random.key(16 + i), a.shape).astype(a.dtype) for i, a in enumerate((x.q, x.k, x.v)))
  f = lambda q, k, v: flex_attention(q, k, v, mask=mask, implementation="mosaic", interpret=True)
  assert "probjax_attention_fwd_jvp_mosaic" in str(jax.make_jaxpr(lambda p, d: jax.jvp(f, p, d))((x.q, x.k, x.v), tans))
  out, dot = jax.jvp(f, (x.q, x.k, x.v), tans)
  want_out, want_dot = reference_jvp(x.q, x.k, x.v, dict(zip("qkv", tans)), mask=mask)
  assert_matches(dict(out=out, tangent=dot), dict(out=want_out, tangent=want_dot), x.q.dtype,
                 what=f"mosaic jvp T{t} {kind}")
