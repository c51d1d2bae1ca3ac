"""The fused forward + JVP Triton kernel (backends/triton/jvp.py) in interpret mode: primal and
tangent against the float64 reference, jvp against the XLA path, reverse over forward, second
derivatives through with_forward_mode."""

import collections
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from probjax.ops.attention import flex_attention
from probjax.ops.attention import masks as M
from probjax.ops.attention.reference import _attention64
from probjax.ops.attention.tolerances import max_error, tolerance
from probjax.ops.attention.backends.triton import jvp as jvp_lib
from probjax.ops.attention.backends.triton.config import BackwardConfig, ForwardConfig
from probjax.testing import make_inputs

CFG = dict(forward_config=ForwardConfig(16, 16, 4, 1), backward_config=BackwardConfig(16, 16, 16, 16, 4, 1))
pytestmark = pytest.mark.timeout(300, method="thread")


def _inputs(t, s, h, hkv, d=16):
  x = make_inputs(0, 2, t, s, h, hkv, d)
  tans = tuple(jax.random.normal(jax.random.key(i + 7), a.shape) for i, a in enumerate((x.q, x.k, x.v)))
  return (x.q, x.k, x.v), tans


def _reference(mask, prim, tans, d=16):
  with jax.enable_x64(True):
    up = lambda a: jnp.asarray(np.asarray(a, np.float64))
    ref = lambda q, k, v: _attention64(q, k, v, None, mask, None, None, d ** -0.5)
    out, dot = jax.jvp(ref, tuple(map(up, prim)), tuple(map(up, tans)))
  return np.asarray(out), np.asarray(dot)


MASKS = {
    "none_odd": (None, 19, 23, 4, 2),
    "causal_gqa": (M.CausalMask(), 33, 33, 4, 1),
    "window": (M.LocalWindowMask(8, 0), 33, 33, 2, 2),
    "kv_lengths_empty_row": (M.CausalMask() & M.KVLenMask(jnp.array([20, 0])), 33, 33, 2, 1),
    "q_lengths": (M.LengthMask(jnp.array([17, 30]), jnp.array([25, 33])), 33, 33, 2, 2),
}


@pytest.mark.parametrize("name", list(MASKS))
def test_kernel_matches_reference(name):
  mask, t, s, h, hkv = MASKS[name]
  prim, tans = _inputs(t, s, h, hkv)
  out, dot, lse, lse_dot = jvp_lib.forward_jvp(*prim, *tans, mask, scale=16 ** -0.5,
                                               config=ForwardConfig(16, 16, 4, 1), interpret=True)
  want_out, want_dot = _reference(mask, prim, tans)
  assert max_error(out, want_out) <= tolerance(jnp.float32)
  assert max_error(dot, want_dot) <= tolerance(jnp.float32, grad=True)
  assert np.all(np.isfinite(np.asarray(dot))) and np.all(np.isfinite(np.asarray(lse_dot)))
  if name == "kv_lengths_empty_row":  # batch element 1 has no valid key: zero output and tangent
    assert not np.any(np.asarray(out[1])) and not np.any(np.asarray(dot[1]))
    assert np.all(np.asarray(lse[1]) == np.inf) and not np.any(np.asarray(lse_dot[1]))


@pytest.mark.parametrize("d,dv", [(40, 40), pytest.param(96, 96, marks=pytest.mark.slow),
                                  pytest.param(192, 192, marks=pytest.mark.slow), (80, 48)])
def test_kernel_at_head_dims_off_the_tile(d, dv):
  """Primals and tangents read in place through tiles wider than their head_dims (the extra
  columns masked to zeros), the output and its tangent written at the value width."""
  mask = M.CausalMask(4) & M.KVLenMask(jnp.array([23, 11]))
  x = make_inputs(d + dv, 2, 19, 23, 4, 2, d, v_head_dim=dv)
  prim = (x.q, x.k, x.v)
  tans = tuple(jax.random.normal(jax.random.key(i + 7), a.shape) for i, a in enumerate(prim))
  out, dot, _, _ = jvp_lib.forward_jvp(*prim, *tans, mask, scale=d ** -0.5, config=ForwardConfig(16, 16, 4, 1),
                                       interpret=True)
  assert out.shape == dot.shape == (2, 19, 4, dv)
  want_out, want_dot = _reference(mask, prim, tans, d)
  assert max_error(out, want_out) <= tolerance(jnp.float32)
  assert max_error(dot, want_dot) <= tolerance(jnp.float32, grad=True)


def _triton(mask):
  return lambda q, k, v: flex_attention(q, k, v, mask=mask, implementation="triton", interpret=True,
                                        backward_pass_impl="triton_split", **CFG)


def _xla(mask):
  return lambda q, k, v: flex_attention(q, k, v, mask=mask, implementation="xla")


def test_jvp_uses_fused_kernel_and_matches_xla():
  mask = M.CausalMask() & M.KVLenMask(jnp.array([20, 33]))
  prim, tans = _inputs(21, 33, 4, 2)
  jaxpr = str(jax.make_jaxpr(lambda p, t: jax.jvp(_triton(mask), p, t))(prim, tans))
  assert "probjax_attention_fwd_jvp" in jaxpr
  out, dot = jax.jvp(_triton(mask), prim, tans)
  want_out, want_dot = jax.jvp(_xla(mask), prim, tans)
  assert max_error(out, want_out) <= tolerance(jnp.float32)
  assert max_error(dot, want_dot) <= tolerance(jnp.float32, grad=True)


def test_grad_alone_keeps_kernel_backward():
  prim, _ = _inputs(17, 17, 2, 2)
  loss = lambda q, k, v: jnp.sum(_triton(M.CausalMask())(q, k, v) ** 2)
  jaxpr = str(jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(*prim))
  assert "probjax_attention_fwd_jvp" not in jaxpr


def test_meanflow_loss_grad_matches_xla():
  mask = M.CausalMask() & M.KVLenMask(jnp.array([11, 17]))
  prim, tans = _inputs(17, 17, 2, 1)

  def loss(attn):
    def f(q, k, v):
      out, dot = jax.jvp(attn(mask), (q, k, v), tans)
      return jnp.sum(jnp.tanh(out) * jax.lax.stop_gradient(dot)) + jnp.sum(dot ** 2)
    return f

  got = jax.grad(loss(_triton), argnums=(0, 1, 2))(*prim)
  want = jax.grad(loss(_xla), argnums=(0, 1, 2))(*prim)
  for g, w in zip(got, want):
    assert max_error(g, w) <= tolerance(jnp.float32, grad=True)


def test_score_mod_refused_by_jvp_kernel():
  assert "score_mod" in jvp_lib.supports(lambda s, b, h, i, j: s)
  assert jvp_lib.supports(None) is None


def test_linearize_and_jacfwd_use_fused_kernel():
  mask = M.CausalMask()
  prim, tans = _inputs(9, 9, 2, 1)
  f = lambda q: _triton(mask)(q, *prim[1:])
  g = lambda q: _xla(mask)(q, *prim[1:])
  _, lin = jax.linearize(f, prim[0])
  assert max_error(lin(tans[0]), jax.jvp(g, (prim[0],), (tans[0],))[1]) <= tolerance(jnp.float32, grad=True)
  col = lambda fn: jax.jacfwd(lambda x: fn(prim[0].at[0, 0, 0, :2].set(x)))(prim[0][0, 0, 0, :2])
  assert "probjax_attention_fwd_jvp" in str(jax.make_jaxpr(lambda: col(f))())
  assert max_error(col(f), col(g)) <= tolerance(jnp.float32, grad=True)


def _second_order(attn, prim, tans, w):
  """jvp of grad (a Hessian-vector product in q), grad of grad (in q of |dL/dk|^2) and grad of jvp
  (in q of a loss of the tangent for q and k) of ``L = sum(sin(attn(q, k, v)) * w)``."""
  (q, k, v), (tq, tk, _) = prim, tans
  loss = lambda q, k: jnp.sum(jnp.sin(attn(q, k, v)) * w)
  hvp = jax.jvp(jax.grad(lambda q: loss(q, k)), (q,), (tq,))[1]
  gg = jax.grad(lambda q: jnp.sum(jax.grad(loss, argnums=1)(q, k) ** 2))(q)
  gj = jax.grad(lambda q: jnp.sum(jnp.sin(jax.jvp(lambda q, k: attn(q, k, v), (q, k), (tq, tk))[1]) * w))(q)
  return hvp, gg, gj


@pytest.mark.parametrize("mask,t,h,hkv", [(M.CausalMask(), 17, 2, 1),
                                          (M.CausalMask() & M.KVLenMask(jnp.array([11, 17])), 17, 2, 2)])
def test_second_derivatives_match_reference(mask, t, h, hkv):
  """Through with_forward_mode on the kernels: jvp of grad (which raised TypeError), grad of grad
  and grad of jvp against the float64 reference; the Hessian-vector product's tangent of the
  attention output is the fused kernel's."""
  prim, tans = _inputs(t, t, h, hkv)
  w = jax.random.normal(jax.random.key(3), prim[0].shape[:3] + prim[2].shape[3:])
  hvp = lambda q: jax.jvp(jax.grad(lambda q: jnp.sum(jnp.sin(_triton(mask)(q, *prim[1:])) * w)), (q,), (tans[0],))
  assert "probjax_attention_fwd_jvp" in str(jax.make_jaxpr(hvp)(prim[0]))
  got = _second_order(_triton(mask), prim, tans, w)
  with jax.enable_x64(True):
    up = lambda a: jnp.asarray(np.asarray(a, np.float64))
    ref = lambda q, k, v: _attention64(q, k, v, None, mask, None, None, 16 ** -0.5)
    want = _second_order(ref, *jax.tree.map(up, (prim, tans, w)))
  for name, g, r in zip(("jvp of grad", "grad of grad", "grad of jvp"), got, want):
    assert np.all(np.isfinite(np.asarray(g))), name
    assert max_error(g, np.asarray(r)) <= tolerance(jnp.float32, grad=True), name


def test_jvp_of_jvp_matches_reference():
  """Forward over forward: the tangent of the fused tangent (in q, the inner tangents fixed) is
  the jvp of the XLA formulation's jvp; it raised TypeError while the fused tangent was a
  custom_vjp, which JAX cannot differentiate in forward mode."""
  mask = M.CausalMask() & M.KVLenMask(jnp.array([11, 17]))
  prim, tans = _inputs(17, 17, 2, 1)
  s = jax.random.normal(jax.random.key(5), prim[0].shape)

  def nested(attn, prim, tans, s):
    inner = lambda q: jax.jvp(attn, (q, *prim[1:]), tans)[1]
    return jax.jvp(inner, (prim[0],), (s,))[1]
  assert "probjax_attention_fwd_jvp" in str(jax.make_jaxpr(lambda: nested(_triton(mask), prim, tans, s))())
  got = nested(_triton(mask), prim, tans, s)
  with jax.enable_x64(True):
    up = lambda a: jnp.asarray(np.asarray(a, np.float64))
    ref = lambda q, k, v: _attention64(q, k, v, None, mask, None, None, 16 ** -0.5)
    want = nested(ref, *jax.tree.map(up, (prim, tans, s)))
  assert np.all(np.isfinite(np.asarray(got)))
  assert max_error(got, np.asarray(want)) <= tolerance(jnp.float32, grad=True)


def _kernels(fn, *args):
  """The attention kernels (pallas_call names) in ``fn``'s jaxpr, counted."""
  text = str(jax.make_jaxpr(fn)(*args))
  names = re.findall(r"\bname=(probjax_attention_\w+)", text)
  assert len(names) == text.count("pallas_call[")
  return collections.Counter(names)


FUSED = collections.Counter(["probjax_attention_fwd_jvp"])


def test_jvp_runs_one_kernel():
  """A jvp's primal and tangent both come from the one fused kernel call (no forward kernel),
  under jit, vmap and jacfwd too; jax.grad runs the forward and backward kernels, and jax.grad of
  a jvp the fused kernel once (its tangent) beside them."""
  mask = M.CausalMask() & M.KVLenMask(jnp.array([20, 0]))
  prim, tans = _inputs(21, 33, 4, 2)
  jvp = lambda attn: lambda p, t: jax.jvp(attn(mask), p, t)
  assert _kernels(jvp(_triton), prim, tans) == FUSED
  assert _kernels(jax.jit(jvp(_triton)), prim, tans) == FUSED
  batched = jax.tree.map(lambda a: jnp.stack([a, -a]), (prim, tans))
  assert _kernels(jax.vmap(jvp(_triton)), *batched) == FUSED
  col = lambda attn: jax.jacfwd(lambda x: attn(mask)(prim[0].at[0, 0, 0, :2].set(x), *prim[1:]))(prim[0][0, 0, 0, :2])
  assert _kernels(lambda: col(_triton)) == FUSED
  out, dot = jax.vmap(jvp(_triton))(*batched)
  want_out, want_dot = jax.vmap(jvp(_xla))(*batched)
  assert max_error(out, want_out) <= tolerance(jnp.float32)
  assert max_error(dot, want_dot) <= tolerance(jnp.float32, grad=True)
  assert not np.any(np.asarray(dot[:, 1])) and np.all(np.isfinite(np.asarray(dot)))  # no valid key: zero

  loss = lambda q, k, v: jnp.sum(_triton(mask)(q, k, v) ** 2)
  grad = _kernels(jax.grad(loss, argnums=(0, 1, 2)), *prim)
  assert grad["probjax_attention_fwd"] == 1 and "probjax_attention_fwd_jvp" not in grad

  def meanflow(q, k, v):
    out, dot = jax.jvp(_triton(mask), (q, k, v), tans)
    return jnp.sum(jnp.tanh(out) * dot) + jnp.sum(dot ** 2)
  grad_jvp = _kernels(jax.grad(meanflow, argnums=(0, 1, 2)), *prim)
  assert grad_jvp["probjax_attention_fwd_jvp"] == 1 and grad_jvp["probjax_attention_fwd"] == 1
  assert grad_jvp - FUSED - collections.Counter(["probjax_attention_fwd"]) == grad - collections.Counter(
      ["probjax_attention_fwd"])  # the same backward kernels as jax.grad's


def test_reverse_mode_through_checkpoint_and_scan_matches_xla():
  """jax.checkpoint and lax.scan linearize the jvp rule apart from jax.grad's own path (the
  fused call partially evaluated inside their jaxprs): the forward kernel for the primal, the
  kernel backward for its gradient."""
  mask = M.CausalMask()
  prim, tans = _inputs(9, 9, 2, 1)

  def losses(attn):
    a = lambda q: attn(mask)(q, *prim[1:])
    remat = jax.grad(lambda q: jnp.sum(jnp.sin(jax.checkpoint(a)(q))))(prim[0])
    scan = jax.grad(lambda q: jnp.sum(jax.lax.scan(lambda c, _: (jnp.tanh(a(c)), None), q, length=2)[0]))(prim[0])
    inner = lambda q: jax.jvp(a, (q,), (tans[0],))[1]
    remat_jvp = jax.grad(lambda q: jnp.sum(jax.checkpoint(inner)(q) ** 2))(prim[0])
    return remat, scan, remat_jvp

  assert "probjax_attention_fwd_jvp" not in _kernels(
      jax.grad(lambda q: jnp.sum(jax.checkpoint(lambda q: _triton(mask)(q, *prim[1:]))(q))), prim[0])
  for name, g, w in zip(("checkpoint", "scan", "checkpoint of jvp"), losses(_triton), losses(_xla)):
    assert max_error(g, w) <= tolerance(jnp.float32, grad=True), name
