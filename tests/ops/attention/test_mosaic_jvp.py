"""The fused forward + JVP Mosaic GPU kernel (backends/mosaic_gpu/jvp.py): out, out_dot, lse and
lse_dot against the float64 reference under every position mask, GQA and odd lengths; jax.jvp,
linearize and jacfwd of ``implementation="mosaic"`` through it; reverse over forward and the jvp
of a jvp against the XLA path; its refusals, tiles and sm_90 lowering.

Interpret mode (simulated warpgroups, TMA and barriers on CPU) at the smallest shapes that
reach each path: 64-row query tiles and 64-key tiles, so 70 queries are a full and a partial
query tile and 150 keys two full key tiles and a partial one. Full-size cases are marked ``gpu``.
"""

import os

# Interpret mode's warpgroup threads block XLA:CPU's thread pool in their barrier waits: see
# tests/ops/attention/test_mosaic_attention.py. Read when JAX creates its CPU client.
os.environ.setdefault("PJRT_NPROC", "8")

import dataclasses  # noqa: E402
import re  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from probjax.ops.attention import flex_attention, gpu  # noqa: E402
from probjax.ops.attention import masks as M  # noqa: E402
from probjax.ops.attention.backends import mosaic_gpu as pm  # noqa: E402
from probjax.ops.attention.backends.mosaic_gpu import jvp as jvp_lib  # noqa: E402
from probjax.ops.attention.call import AttentionCall  # noqa: E402
from probjax.ops.attention.tolerances import max_error, tolerance  # noqa: E402
from probjax.testing import make_inputs, make_mask, poison, reference_jvp, reference_valid  # noqa: E402

pytestmark = pytest.mark.timeout(300, method="thread")

BF16 = jnp.bfloat16
# One compute warpgroup (the fewest interpreted threads), 64-key tiles, two ring slots.
SMALL = pm.MosaicForwardConfig(block_q=64, block_k=64, num_stages=2, compute_wgs=1)
KERNEL = "probjax_attention_fwd_jvp_mosaic"


def _inputs(seed, t, s, h, hkv, d=64, dv=None, batch=2):
  x = make_inputs(seed, batch, t, s, h, hkv, d, BF16, v_head_dim=dv)
  prim = (x.q, x.k, x.v)
  tans = tuple(jax.random.normal(jax.random.key(seed + 10 + i), a.shape).astype(BF16) for i, a in enumerate(prim))
  return prim, tans


def _lse_jvp64(prim, tans, mask, scale):
  """float64 ``(lse, lse_dot) [batch, heads, q_len]`` of the masked scores (``-inf`` and NaN in
  rows without a valid key) and whether each row has one."""
  valid = np.asarray(reference_valid(prim[0], prim[1], mask=mask, scale=scale))
  up = lambda a: jnp.asarray(np.asarray(a, np.float64))
  with jax.enable_x64(True):
    ok = jnp.asarray(valid)

    def lse(q, k):
      k = jnp.repeat(k, q.shape[2] // k.shape[2], axis=2)
      s = jnp.where(ok, jnp.einsum("bqhd,bkhd->bhqk", q, k) * scale, -jnp.inf)
      m = jax.lax.stop_gradient(jnp.max(s, axis=-1, keepdims=True))
      m = jnp.where(jnp.isfinite(m), m, 0.0)
      return m[..., 0] + jnp.log(jnp.sum(jnp.where(ok, jnp.exp(s - m), 0.0), axis=-1))
    val, dot = jax.jvp(lse, (up(prim[0]), up(prim[1])), (up(tans[0]), up(tans[1])))
  return np.asarray(val), np.asarray(dot), valid.any(-1)


def _check_kernel(mask, prim, tans, cfg=SMALL):
  """Runs the kernel and checks its four results against the reference; returns them."""
  d = prim[0].shape[-1]
  got = jvp_lib.forward_jvp(*prim, *tans, mask, scale=d ** -0.5, config=cfg, interpret=True)
  out, dot, lse, lse_dot = (np.asarray(jnp.asarray(a, jnp.float32)) for a in got)
  want_out, want_dot = reference_jvp(*prim, dict(zip("qkv", tans)), mask=mask)
  assert max_error(out, want_out) <= tolerance(BF16)
  assert max_error(dot, want_dot) <= tolerance(BF16, grad=True)
  want_lse, want_lse_dot, rows = _lse_jvp64(prim, tans, mask, d ** -0.5)
  assert max_error(lse[rows], want_lse[rows]) <= tolerance(BF16)
  assert max_error(lse_dot[rows], want_lse_dot[rows]) <= tolerance(BF16, grad=True)
  # Rows without a valid key: zero output and tangents, +inf lse, never NaN.
  assert np.all(lse[~rows] == np.inf) and not np.any(lse_dot[~rows])
  empty = np.moveaxis(~rows, 1, 2)  # [batch, q_len, heads]
  assert not np.any(out[empty]) and not np.any(dot[empty])
  assert np.all(np.isfinite(dot)) and np.all(np.isfinite(lse_dot))
  return out, dot, lse, lse_dot


# (mask, q_len, kv_len, heads, kv_heads): each a path of the kernel's loops.
MASKS = {
    # a partial query tile and a partial last key tile (masked) after full ones; GQA 4:2
    "none_odd_gqa": (None, 70, 150, 4, 2),
    # a band: masked diagonal tiles, full tiles before them, query tiles heaviest first
    "causal_gqa": (M.CausalMask(), 130, 130, 4, 1),
    # a two-sided window: masked tiles on both sides of a full run, tiles outside never loaded
    "window_right": (M.LocalWindowMask(40, 20), 130, 150, 2, 2),
    # per-batch lengths: a batch element without keys, queries past their length, a cut key tile
    "lengths_empty": (M.LengthMask(jnp.array([70, 40]), jnp.array([0, 100])) & M.CausalMask(30), 70, 150, 2, 1),
    # segment ids under a band: the precomputed tile ranges and the ids' predicate
    "window&segments": ("window&segments", 130, 130, 2, 1),
}


@pytest.mark.parametrize("name", list(MASKS))
def test_kernel_matches_reference(name):
  mask, t, s, h, hkv = MASKS[name]
  if isinstance(mask, str):
    mask = make_mask(mask, 2, t, s)
  prim, tans = _inputs(len(name), t, s, h, hkv)
  _check_kernel(mask, prim, tans)


@pytest.mark.parametrize("d,dv,mask", [
    (128, 128, M.CausalMask() & M.KVLenMask(jnp.array([90, 150]))),  # key tiles of 64 beside 128-wide accumulators
    (128, 64, None),   # values narrower than keys: the outputs' own buffers
])
def test_head_dim_128(d, dv, mask):
  prim, tans = _inputs(d + dv, 70, 150, 2, 1, d, dv)
  _check_kernel(mask, prim, tans, jvp_lib.fit(SMALL, 2, d, "interpret", v_head_dim=dv))


def test_two_compute_warpgroups_share_the_ring():
  # Two 64-row warpgroups per CTA (the GPU default): each releases a slot (two arrivals).
  mask = M.CausalMask() & M.KVLenMask(jnp.array([100, 150]))
  prim, tans = _inputs(5, 130, 150, 2, 1)
  _check_kernel(mask, prim, tans, dataclasses.replace(SMALL, compute_wgs=2))


def test_positions_past_the_lengths_are_never_read():
  # NaN and inf past the key lengths (keys, values and their tangents) and past the query
  # lengths (queries and their tangents) reach no result.
  mask = M.LengthMask(jnp.array([70, 33]), jnp.array([150, 77]))
  prim, tans = _inputs(6, 70, 150, 2, 2)
  q_lens, kv_lens = mask.lengths(2)
  bad = lambda xs: (poison(xs[0], q_lens), poison(xs[1], kv_lens), poison(xs[2], kv_lens))
  got = jvp_lib.forward_jvp(*bad(prim), *bad(tans), mask, scale=0.125, config=SMALL, interpret=True)
  want_out, want_dot = reference_jvp(*prim, dict(zip("qkv", tans)), mask=mask)
  assert max_error(got[0], want_out) <= tolerance(BF16)
  assert max_error(got[1], want_dot) <= tolerance(BF16, grad=True)
  assert np.all(np.isfinite(np.asarray(got[3])))


def _mosaic(mask, **kw):
  return lambda q, k, v: flex_attention(q, k, v, mask=mask, implementation="mosaic", interpret=True,
                                        forward_config=SMALL, **kw)


def _xla(mask):
  return lambda q, k, v: flex_attention(q, k, v, mask=mask, implementation="xla")


def _close(got, want, grad=True):
  got, want = np.asarray(jnp.asarray(got, jnp.float32)), np.asarray(jnp.asarray(want, jnp.float32))
  assert np.all(np.isfinite(got))
  assert max_error(got, want) <= tolerance(BF16, grad=grad)


def test_jvp_uses_fused_kernel_and_matches_reference():
  mask = M.CausalMask() & M.KVLenMask(jnp.array([0, 70]))  # batch element 0: no key
  prim, tans = _inputs(7, 70, 70, 2, 1)
  assert KERNEL in str(jax.make_jaxpr(lambda p, t: jax.jvp(_mosaic(mask), p, t))(prim, tans))
  out, dot = jax.jvp(_mosaic(mask), prim, tans)
  want_out, want_dot = reference_jvp(*prim, dict(zip("qkv", tans)), mask=mask)
  _close(out, want_out, grad=False)
  _close(dot, want_dot)
  assert not np.any(np.asarray(dot[0], np.float32))


def test_grad_alone_keeps_kernel_backward():
  prim, _ = _inputs(8, 70, 70, 2, 1)
  loss = lambda q, k, v: jnp.sum(_mosaic(M.CausalMask())(q, k, v).astype(jnp.float32) ** 2)
  assert KERNEL not in str(jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(*prim))


def test_linearize_uses_fused_kernel():
  mask = M.CausalMask()
  prim, tans = _inputs(9, 70, 70, 2, 1)
  f = lambda q: _mosaic(mask)(q, *prim[1:])
  g = lambda q: _xla(mask)(q, *prim[1:])
  assert KERNEL in str(jax.make_jaxpr(lambda q, t: jax.linearize(f, q)[1](t))(prim[0], tans[0]))
  _, lin = jax.linearize(f, prim[0])
  _close(lin(tans[0]), jax.jvp(g, (prim[0],), (tans[0],))[1])


def test_jacfwd_uses_fused_kernel():
  mask = M.CausalMask()
  prim, _ = _inputs(10, 70, 70, 2, 1)
  col = lambda fn: jax.jacfwd(lambda x: fn(prim[0].at[0, 0, 0, :2].set(x), *prim[1:]))(prim[0][0, 0, 0, :2])
  assert KERNEL in str(jax.make_jaxpr(lambda: col(_mosaic(mask)))())
  _close(col(_mosaic(mask)), col(_xla(mask)))


def _meanflow(attn, tans):
  """A MeanFlow-style loss: the output and its tangent, the tangent also in the loss."""
  def loss(q, k, v):
    out, dot = jax.jvp(attn, (q, k, v), tans)
    out, dot = out.astype(jnp.float32), dot.astype(jnp.float32)
    return jnp.sum(jnp.tanh(out) * jax.lax.stop_gradient(dot)) + jnp.sum(dot ** 2)
  return loss


def test_meanflow_loss_grad_matches_xla():
  mask = M.CausalMask() & M.KVLenMask(jnp.array([50, 70]))
  prim, tans = _inputs(11, 70, 70, 2, 1)
  bwd = dict(backward_pass_impl="mosaic", backward_config=pm.MosaicBackwardConfig(64, 64, 2, 1))
  got = jax.grad(_meanflow(_mosaic(mask, **bwd), tans), argnums=(0, 1, 2))(*prim)
  want = jax.grad(_meanflow(_xla(mask), tans), argnums=(0, 1, 2))(*prim)
  for g, w in zip(got, want):
    _close(g, w)


def test_jvp_of_jvp_matches_xla():
  # The second-order tangent of the fused tangent is the XLA formulation's (a custom_vjp there
  # raised TypeError: JAX cannot take its jvp).
  mask = M.CausalMask()
  prim, tans = _inputs(12, 70, 70, 2, 1)
  s = jax.random.normal(jax.random.key(3), prim[0].shape).astype(BF16)

  def nested(attn):
    inner = lambda q: jax.jvp(attn, (q, *prim[1:]), tans)[1]
    return jax.jvp(inner, (prim[0],), (s,))
  (dot, ddot), (want_dot, want_ddot) = nested(_mosaic(mask)), nested(_xla(mask))
  assert KERNEL in str(jax.make_jaxpr(lambda: nested(_mosaic(mask)))())
  _close(dot, want_dot)
  _close(ddot, want_ddot)


def test_refusals_take_the_xla_tangent():
  assert "score_mod" in jvp_lib.supports(lambda s, b, h, i, j: s, 64)
  for d, dv in ((192, 128), (256, 256), (64, 192), (128, 256)):
    assert "takes (64, 128)" in jvp_lib.supports(None, d, dv)
  assert jvp_lib.supports(None, 64) is None and jvp_lib.supports(None, 128, 64) is None
  call = lambda d, dv=None, score_mod=None: AttentionCall(
      (1, 128, 2, d), (1, 128, 2, d), BF16, score_mod=score_mod, v_head_dim=dv or d, interpret=True)
  assert pm.tangent_kernel(call(192, 128), None) is None
  assert pm.tangent_kernel(call(64, score_mod=lambda s, b, h, i, j: s), None) is None
  assert pm.tangent_kernel(call(128), None) is not None


def test_fit_keeps_the_registers_and_the_shared_memory():
  for d, dv, block_k in ((64, 64, 128), (128, 128, 64), (64, 128, 64), (128, 64, 64)):
    cfg = jvp_lib.fit(None, 2, d, "sm_90", v_head_dim=dv)
    assert cfg.compute_wgs == 2 and cfg.block_k == block_k, (d, dv, cfg)
    assert dv + cfg.block_k <= jvp_lib.TILE_REGISTERS
    assert jvp_lib.smem_bytes(cfg, 2, d, dv) <= gpu.smem_limit("sm_90")
  # The forward's own schedules are dropped, its tiles fitted (never refused).
  fwd = pm.MosaicForwardConfig(64, 128, 3, 3, persistent=True, cluster=2, overlap=True)
  cfg = jvp_lib.fit(fwd, 2, 128, "sm_90")
  assert cfg == pm.MosaicForwardConfig(64, 64, 2, 2)
  assert jvp_lib.fit(None, 2, 128, "interpret").compute_wgs == 1


@pytest.mark.parametrize("mask_name,d,dv", [("none", 64, 64), ("causal&kv_len", 128, 128),
                                            ("window&segments", 64, 64), ("lengths", 128, 64)])
def test_lowers_for_sm90(monkeypatch, mask_name, d, dv):
  """Lowering only (no interpret run): two compute warpgroups, registers as wgmma's A operand
  and in-place accumulation, paths interpret mode cannot run."""
  monkeypatch.setattr(gpu, "device_kind", lambda device=None: "sm_90")
  mask = make_mask(mask_name, 2, 300, 300)
  cfg = jvp_lib.fit(None, 2, d, "sm_90", v_head_dim=dv)
  q = jax.ShapeDtypeStruct((2, 300, 4, d), BF16)
  k = jax.ShapeDtypeStruct((2, 300, 2, d), BF16)
  v = jax.ShapeDtypeStruct((2, 300, 2, dv), BF16)
  f = lambda q, k, v: jvp_lib.forward_jvp(q, k, v, q, k, v, mask, scale=0.1, config=cfg, interpret=False)
  text = jax.jit(f).trace(q, k, v).lower(lowering_platforms=("cuda",)).as_text()
  assert set(re.findall(r"custom_call @([\w$.]+)", text)) == {"mosaic_gpu_v2"}
  assert KERNEL in text


def test_jvp_runs_one_kernel():
  """A jvp's primal and tangent both come from the one fused kernel call: no forward kernel."""
  mask = M.CausalMask() & M.KVLenMask(jnp.array([0, 70]))
  prim, tans = _inputs(13, 70, 70, 2, 1)
  jvp = lambda p, t: jax.jvp(_mosaic(mask), p, t)
  for fn, args in ((jvp, (prim, tans)), (jax.vmap(jvp), jax.tree.map(lambda a: a[None], (prim, tans)))):
    text = str(jax.make_jaxpr(fn)(*args))
    # the kernels' names, one per kernel call (Mosaic GPU's kernels are mpmd_map calls)
    assert re.findall(r"\bname=(probjax_attention_\w+)", text) == [KERNEL]


def test_jvp_lowers_to_one_kernel_for_sm90(monkeypatch):
  """jax.jit of a jvp lowered for an sm_90 GPU: one Mosaic GPU custom call, the fused kernel's
  (its primal output is the jvp's primal); of a grad of a jvp: the fused kernel once."""
  from probjax.ops.attention import dispatch
  monkeypatch.setattr(gpu, "device_kind", lambda device=None: "sm_90")
  monkeypatch.setattr(dispatch.Device, "current", classmethod(lambda cls: dispatch.Device("gpu", (9, 0), 140 << 30)))
  q = jax.ShapeDtypeStruct((2, 300, 4, 128), BF16)
  kv = jax.ShapeDtypeStruct((2, 300, 2, 128), BF16)
  attn = lambda q, k, v: flex_attention(q, k, v, mask=M.CausalMask(), implementation="mosaic")
  text = jax.jit(lambda p, t: jax.jvp(attn, p, t)).trace((q, kv, kv), (q, kv, kv)).lower(
      lowering_platforms=("cuda",)).as_text()
  assert text.count("custom_call @mosaic_gpu_v2") == 1 and KERNEL in text
  assert "probjax_attention_fwd_mosaic" not in text.replace(KERNEL, "")
  # jax.grad of a MeanFlow loss: the forward kernel (the backward's residuals), the fused kernel
  # once (the tangent) and the backward kernels. Its jaxpr shows the fused kernel a second time,
  # as the transpose of the transposed linear_call, which never runs.
  attn = lambda q, k, v: flex_attention(q, k, v, mask=M.CausalMask(), implementation="mosaic",
                                        backward_pass_impl="mosaic")
  tans = tuple(jnp.ones(x.shape, x.dtype) for x in (q, kv, kv))
  text = jax.jit(jax.grad(_meanflow(attn, tans), argnums=(0, 1, 2))).trace(q, kv, kv).lower(
      lowering_platforms=("cuda",)).as_text()
  kernels = re.findall(r"(probjax_attention_\w+?)_mosaic_gpu\b", text)  # each kernel's module name
  assert text.count("custom_call @mosaic_gpu_v2") == 4
  assert sorted(kernels) == sorted([KERNEL, "probjax_attention_fwd_mosaic", "probjax_attention_bwd_dkv_mosaic",
                                    "probjax_attention_bwd_dq_mosaic"])


@pytest.mark.gpu
@pytest.mark.parametrize("mask_name,tq,tk,d", [("none", 4096, 4096, 128), ("causal", 3000, 3000, 64),
                                               ("causal&kv_len", 2048, 3000, 128), ("window&segments", 3000, 3000, 64),
                                               ("lengths", 1500, 600, 128)])
def test_gpu_full_size(mask_name, tq, tk, d):
  """jax.jvp of implementation="mosaic" (the fused kernel at its default tiles) against the
  float64 reference, and a MeanFlow loss's gradient against the XLA path's."""
  x = make_inputs(tq + d, 2, tq, tk, 8, 2, d, BF16)
  mask = make_mask(mask_name, 2, tq, tk)
  prim = (x.q, x.k, x.v)
  tans = tuple(jax.random.normal(jax.random.key(i), a.shape).astype(BF16) for i, a in enumerate(prim))
  attn = lambda q, k, v: flex_attention(q, k, v, mask=mask, implementation="mosaic")
  f = jax.jit(lambda p, t: jax.jvp(attn, p, t))
  assert KERNEL in f.lower(prim, tans).as_text()
  out, dot = f(prim, tans)
  want_out, want_dot = reference_jvp(*prim, dict(zip("qkv", tans)), mask=mask)
  _close(out, want_out, grad=False)
  _close(dot, want_dot)
  grad = lambda fn: jax.jit(jax.grad(_meanflow(fn, tans), argnums=(0, 1, 2)))(*prim)
  for g, w in zip(grad(attn), grad(lambda q, k, v: flex_attention(q, k, v, mask=mask, implementation="xla"))):
    _close(g, w)
