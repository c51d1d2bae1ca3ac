"""Regressions of the exact XLA path (fuzz report against ``dot_product_attention``), each
against the float64 reference: jitted jvp for every tangent subset, rows at -inf, garbage
past the mask's lengths, float64 inputs, empty key or query sets, second derivatives."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from probjax.nn.layers.attention import dot_product_attention
from probjax.ops.attention import masks as M
from probjax.ops.attention.backends import xla
from probjax.ops.attention.autodiff import with_forward_mode
from probjax.ops.attention.reference import _attention64, reference_attention, reference_vjp
from probjax.ops.attention.tolerances import max_error, tolerance
from probjax.testing import make_inputs

# (formulation, q_len, kv_len): dense, one flash tile per axis, several 256-tiles.
FORMULATIONS = [("dense", 40, 40), ("flash", 300, 300), ("flash", 600, 520)]

# Each case compiles forward, backward, tangents and their float64 references (every tangent
# subset: 30 compiles; second derivatives: four transforms in two precisions): 1-27 s of CPU on
# a 2-core machine, nearly all XLA compiling. make test keeps one case of each regression on
# the formulation it was found on; the others are slow.
SLOW = pytest.mark.slow
NAMES = ("q", "k", "v", "bias")


def _xla(formulation, mask=None, score_mod=None, scale=0.25):
  return lambda q, k, v, bias=None: xla.attention(q, k, v, formulation=formulation, bias=bias, mask=mask,
                                                  score_mod=score_mod, scale=scale)


def _ref(mask=None, score_mod=None, scale=0.25):
  """The float64 reference ``f(q, k, v, bias)``; call it (and transforms of it) under x64."""
  return lambda q, k, v, bias=None: _attention64(q, k, v, bias, mask, None, score_mod, scale)


def _up(tree):
  """float64 copies (inside ``jax.enable_x64``)."""
  return jax.tree.map(lambda a: jnp.asarray(np.asarray(a, np.float64)), tree)


def _normal(seed, shape):
  return jax.random.normal(jax.random.key(seed), shape)


def _jvp_of(f, primals: dict, tangents: dict, names):
  """Output tangent of ``f(**primals)`` for the tangents of ``names`` (the others constant)."""
  g = lambda *xs: f(**{**primals, **dict(zip(names, xs))})
  return jax.jvp(g, tuple(primals[n] for n in names), tuple(tangents[n] for n in names))[1]


def _assert_close(got, want, dtype=jnp.float32, grad=True, what=""):
  got = np.asarray(got)
  assert np.all(np.isfinite(got)), f"{what}: NaN/inf"
  err, tol = max_error(got, want), tolerance(dtype, grad=grad)
  assert err <= tol, f"{what}: max error {err:.3g} > {tol:.3g}"


# -- 1. jitted jvp: only the terms of present tangents ------------------------------------
@SLOW  # every subset of four tangents, jitted and eager: 30 compiles a case
@pytest.mark.parametrize("formulation,tq,tk", FORMULATIONS)
def test_jit_jvp_matches_eager_and_reference_for_every_tangent_subset(formulation, tq, tk):
  """A missing tangent used to be a zeros array feeding an einsum; under jax.jit XLA:CPU's
  YNNPACK fusion turned that dot with a broadcast zero into garbage (1e36, inf, NaN) on the
  single-tile flash path. Every subset of {q, k, v, bias} with tangents, jit = eager = reference."""
  x = make_inputs(tq + tk, 1, tq, tk, 2, 1, 16)
  primals = dict(q=x.q, k=x.k, v=x.v, bias=_normal(1, (1, 2, tq, tk)))
  tangents = {n: _normal(10 + i, a.shape) for i, (n, a) in enumerate(primals.items())}
  f = _xla(formulation)
  with jax.enable_x64(True):
    p64, t64 = _up(primals), _up(tangents)
  for r in range(1, 5):
    for names in itertools.combinations(NAMES, r):
      jitted = jax.jit(lambda p, t: _jvp_of(f, p, t, names))(primals, tangents)
      eager = _jvp_of(f, primals, tangents, names)
      with jax.enable_x64(True):
        want = np.asarray(_jvp_of(_ref(), p64, t64, names))
      _assert_close(jitted, want, what=f"jit jvp in {names}")
      _assert_close(eager, want, what=f"eager jvp in {names}")


@SLOW
def test_linearize_and_vmap_of_jvp_under_jit():
  """The fuzz report's other routes to the single-tile tangent pass: jax.linearize and
  vmap(jvp), jitted, with tangents on q only."""
  x = make_inputs(0, 2, 300, 300, 2, 1, 64)
  t = _normal(1, x.q.shape)
  f = lambda q: dot_product_attention(q, x.k, x.v)
  lin = jax.jit(lambda q, t: jax.linearize(f, q)[1](t))(x.q, t)
  one = lambda q, k, v, t: jax.jvp(lambda q: dot_product_attention(q[None], k[None], v[None])[0], (q,), (t,))[1]
  vj = jax.jit(jax.vmap(one))(x.q, x.k, x.v, t)
  with jax.enable_x64(True):
    k, v = _up((x.k, x.v))
    want = np.asarray(jax.jvp(lambda q: _ref(scale=0.125)(q, k, v), (_up(x.q),), (_up(t),))[1])
  _assert_close(lin, want, what="linearize")
  _assert_close(vj, want, what="vmap(jvp)")


# -- 2. rows at -inf from the bias or the score modifier ---------------------------------------
@pytest.mark.parametrize("source,formulation,tq,tk", [
    (s, *f) if (s, *f) in (("score_mod", "dense", 40, 40), ("score_mod", "flash", 300, 300)) else
    pytest.param(s, *f, marks=SLOW) for s in ("bias", "score_mod") for f in FORMULATIONS + [("dense", 4, 1500)]])
def test_rows_at_minus_inf_are_zero_with_zero_gradients(formulation, tq, tk, source):
  """A whole row at -inf (bias, or score_mod) has no valid key: zeros and zero gradients on
  every formulation (the dense one gave NaN through jax.nn.softmax), as in the reference."""
  x = make_inputs(7, 1, tq, tk, 2, 2, 16)
  dead = [0, tq // 2, tq - 1]
  if source == "bias":
    bias = _normal(2, (1, 2, tq, tk)).at[:, :, jnp.array(dead), :].set(-jnp.inf)
    mod = None
  else:
    bias = _normal(2, (1, 2, tq, tk))
    rows = jnp.array(dead)
    mod = lambda s, b, h, i, j: jnp.where(jnp.any(i[..., None] == rows, -1), -jnp.inf, s)
  f = _xla(formulation, score_mod=mod)
  out, vjp = jax.vjp(f, x.q, x.k, x.v, bias)
  got = (out, *vjp(x.do))
  tangents = tuple(_normal(20 + i, a.shape) for i, a in enumerate((x.q, x.k, x.v, bias)))
  tan = jax.jit(lambda *a: jax.jvp(f, a[:4], a[4:])[1])(x.q, x.k, x.v, bias, *tangents)
  ref = reference_vjp(x.q, x.k, x.v, x.do, bias=bias, score_mod=mod, scale=0.25)
  for name, r in zip(("out", "dq", "dk", "dv", "dbias"), ref):
    assert np.all(np.isfinite(r)), f"reference {name} has NaN"
  assert np.all(ref[0][:, dead] == 0)
  for name, g, r in zip(("out", "dq", "dk", "dv", "dbias"), got, ref):
    _assert_close(g, r, grad=name != "out", what=name)
  assert np.all(np.asarray(out)[:, dead] == 0) and np.all(np.asarray(got[1])[:, dead] == 0)
  assert np.all(np.asarray(got[4])[:, :, dead] == 0)  # dbias of the dead rows
  with jax.enable_x64(True):
    want = np.asarray(jax.jvp(_ref(score_mod=mod), _up((x.q, x.k, x.v, bias)), _up(tangents))[1])
  _assert_close(tan, want, what="jvp")
  assert np.all(np.asarray(tan)[:, dead] == 0)


def test_public_api_rows_at_minus_inf():
  """The fuzz report's reproducers through dot_product_attention."""
  q = _normal(0, (1, 64, 2, 16))
  bias = jnp.zeros((1, 1, 64, 64)).at[..., 3, :].set(-jnp.inf)
  assert np.all(np.asarray(dot_product_attention(q, q, q, bias=bias)[0, 3]) == 0)
  mod = lambda s, b, h, i, j: jnp.where(j <= i - 2, s, -jnp.inf)
  out = dot_product_attention(q, q, q, score_mod=mod)
  assert np.all(np.asarray(out[0, :2]) == 0)
  _assert_close(out, reference_attention(q, q, q, score_mod=mod), grad=False)


# -- 3. garbage past the mask's lengths -----------------------------------------------------
def _poison(x, lengths):
  """``x [B, T, ...]`` with positions ``t >= lengths[b]`` set to NaN, +inf and -inf in turn."""
  bad = jnp.arange(x.shape[1])[None, :] >= jnp.asarray(lengths)[:, None]
  junk = jnp.asarray([np.nan, np.inf, -np.inf], x.dtype)[jnp.arange(x.shape[-1]) % 3]
  return jnp.where(bad[:, :, None, None], junk, x)


@pytest.mark.parametrize("mask_kind,t", [
    (m, t) if (m, t) in (("lengths", 64), ("lengths", 300), ("causal&kv_lengths", 600)) else
    pytest.param(m, t, marks=SLOW) for m in ("kv_lengths", "lengths", "causal&kv_lengths") for t in (64, 300, 600)])
def test_garbage_past_lengths_never_reaches_outputs_or_gradients(t, mask_kind):
  """NaN/inf in K, V past kv_lengths (one batch element with none valid) and in Q, dO and the
  tangents past q_lengths: outputs, gradients and tangents equal the reference's on clean
  inputs, and the gradients at those positions are zero."""
  x = make_inputs(t, 3, t, t, 2, 1, 16)
  kv_lens, q_lens = jnp.array([t // 3, 0, t]), jnp.array([t, t // 2, t - 5])
  mask = {"kv_lengths": M.KVLenMask(kv_lens), "lengths": M.LengthMask(q_lens, kv_lens),
          "causal&kv_lengths": M.CausalMask() & M.KVLenMask(kv_lens)}[mask_kind]
  q_pad = q_lens if mask.q_lengths is not None else jnp.full(3, t)
  q, do = _poison(x.q, q_pad), _poison(x.do, q_pad)
  k, v = _poison(x.k, kv_lens), _poison(x.v, kv_lens)
  f = lambda q, k, v: dot_product_attention(q, k, v, mask=mask)
  out, vjp = jax.vjp(f, q, k, v)
  dq, dk, dv = vjp(do)
  ref = reference_vjp(x.q, x.k, x.v, x.do, mask=mask)
  for name, g, r in zip(("out", "dq", "dk", "dv"), (out, dq, dk, dv), ref):
    _assert_close(g, r, grad=name != "out", what=name)
  # The reference itself ignores the garbage.
  for name, r, r_bad in zip(("out", "dq", "dk", "dv"), ref, reference_vjp(q, k, v, do, mask=mask)):
    np.testing.assert_array_equal(r, r_bad, err_msg=f"reference {name}")
  past = np.asarray(jnp.arange(t)[None, :] >= kv_lens[:, None])
  assert np.all(np.asarray(dk)[past] == 0) and np.all(np.asarray(dv)[past] == 0)
  tangents = (_poison(_normal(1, q.shape), q_pad), _poison(_normal(2, k.shape), kv_lens),
              _poison(_normal(3, v.shape), kv_lens))
  tan = jax.jit(lambda p, t: jax.jvp(f, p, t)[1])((q, k, v), tangents)
  with jax.enable_x64(True):
    clean = lambda a, lens: jnp.where((jnp.arange(t)[None, :] < lens[:, None])[:, :, None, None], a, 0.0)
    want = np.asarray(jax.jvp(_ref(mask, scale=0.25), _up((x.q, x.k, x.v)),
                              _up((clean(tangents[0], q_pad), clean(tangents[1], kv_lens),
                                   clean(tangents[2], kv_lens))))[1])
  _assert_close(tan, want, what="jvp")


# -- 4. float64 inputs compute in float64 ---------------------------------------------------
@SLOW  # float64 forward, backward and tangent compiles
@pytest.mark.parametrize("formulation,tq,tk", FORMULATIONS)
def test_float64_inputs_compute_in_float64(formulation, tq, tk):
  """Output, gradients (bias too) and tangent within the float64 tolerance (they were
  computed in float32: error 8e-8)."""
  with jax.enable_x64(True):
    x = make_inputs(3, 2, tq, tk, 2, 1, 16, jnp.float64)
    bias = _normal(4, (1, 2, tq, tk)).astype(jnp.float64)
    mask = M.CausalMask(offset=tk - tq) & M.KVLenMask(jnp.array([tk, tk // 2]))
    f = _xla(formulation, mask)
    out, vjp = jax.vjp(f, x.q, x.k, x.v, bias)
    got = (out, *vjp(x.do))
    tangents = tuple(_normal(30 + i, a.shape).astype(jnp.float64) for i, a in enumerate((x.q, x.k, x.v, bias)))
    tan = jax.jvp(f, (x.q, x.k, x.v, bias), tangents)[1]
    want = np.asarray(jax.jvp(_ref(mask), (x.q, x.k, x.v, bias), tangents)[1])
  assert all(g.dtype == jnp.float64 for g in got) and tan.dtype == jnp.float64
  ref = reference_vjp(x.q, x.k, x.v, x.do, bias=bias, mask=mask, scale=0.25)
  for name, g, r in zip(("out", "dq", "dk", "dv", "dbias"), got, ref):
    _assert_close(g, r, jnp.float64, grad=name != "out", what=name)
  _assert_close(tan, want, jnp.float64, what="jvp")


# -- 5. empty key or query sets ---------------------------------------------------------------
@pytest.mark.parametrize("tq,tk", [(300, 0), (5, 0), (0, 5), (0, 300), (0, 0)])
@pytest.mark.parametrize("formulation", ["auto", "dense", "flash"])
def test_empty_key_or_query_sets(tq, tk, formulation):
  """No key: every row zero, zero gradients (Tq 300 crashed in lax.dynamic_slice on the flash
  path); no query: an empty output. Values, gradients and tangents."""
  x = make_inputs(5, 2, tq, tk, 2, 1, 16)
  bias = _normal(6, (1, 2, tq, tk))
  f = _xla(formulation, M.CausalMask()) if formulation != "auto" else \
      (lambda q, k, v, bias: dot_product_attention(q, k, v, bias, is_causal=True))
  out, vjp = jax.vjp(f, x.q, x.k, x.v, bias)
  grads = vjp(x.do)
  tan = jax.jit(lambda p, t: jax.jvp(f, p, t)[1])((x.q, x.k, x.v, bias), (x.q, x.k, x.v, bias))
  assert out.shape == tan.shape == x.q.shape
  assert [g.shape for g in grads] == [a.shape for a in (x.q, x.k, x.v, bias)]
  for a in (out, tan, *grads):
    assert np.all(np.asarray(a) == 0)


# -- 6. second derivatives -------------------------------------------------------------------
def _loss(f, w):
  """A scalar loss whose second derivative is not zero: sum(sin(attention) * w)."""
  return lambda q, k, v: jnp.sum(jnp.sin(f(q, k, v)) * w)


def _second_order(f, x, t):
  """Hessian-vector product in q (jvp of grad) and grad in q of |dL/dk|^2 (grad of grad)."""
  loss = _loss(f, x.do)
  hvp = jax.jvp(jax.grad(lambda q: loss(q, x.k, x.v)), (x.q,), (t,))[1]
  gg = jax.grad(lambda q: jnp.sum(jax.grad(loss, argnums=1)(q, x.k, x.v) ** 2))(x.q)
  return hvp, gg


@pytest.mark.parametrize("formulation,t,mask", [
    pytest.param("dense", 40, None, marks=SLOW), pytest.param("flash", 300, None, marks=SLOW),
    ("flash", 300, M.CausalMask()),
    pytest.param("flash", 600, None, marks=SLOW),
    pytest.param("flash", 600, M.LocalWindowMask(left=200, right=0) & M.KVLenMask(jnp.array([550])), marks=SLOW)])
def test_second_derivatives_match_reference(formulation, t, mask):
  """The flash path is a custom_jvp whose tangent is a linear_call, whose JVP rule asserted
  the residuals had no tangent (a bare AssertionError for any second derivative), and its tile
  loops had traced bounds (while loops, which reverse over reverse cannot transpose)."""
  x = make_inputs(t, 1, t, t, 2, 1, 8)
  tng = _normal(1, x.q.shape)
  hvp, gg = _second_order(_xla(formulation, mask, scale=8 ** -0.5), x, tng)
  with jax.enable_x64(True):
    x64 = type(x)(*_up((x.q, x.k, x.v, x.do)))
    want = _second_order(_ref(mask, scale=8 ** -0.5), x64, _up(tng))
  _assert_close(hvp, want[0], what="hvp")
  _assert_close(gg, want[1], what="grad of grad")


@SLOW
@pytest.mark.parametrize("blocks", [None, 128])
def test_second_derivatives_with_traced_segment_ids(blocks):
  """Segment ids as arguments of a jitted function: the tile skip decided from them at run
  time (a cond in a loop of static trip count) is transposed by reverse over reverse."""
  x = make_inputs(31, 1, 300, 300, 2, 1, 8)
  ids = np.repeat(np.arange(4, dtype=np.int32), [90, 40, 150, 20])[None]
  run = jax.jit(lambda q, k, v, ids: xla.attention(q, k, v, formulation="flash", mask=M.SegmentMask(ids),
                                                   scale=8 ** -0.5, block_q=blocks, block_k=blocks))
  tng = _normal(2, x.q.shape)
  hvp, gg = _second_order(lambda q, k, v: run(q, k, v, ids), x, tng)
  with jax.enable_x64(True):
    x64 = type(x)(*_up((x.q, x.k, x.v, x.do)))
    want = _second_order(_ref(M.SegmentMask(jnp.asarray(ids)), scale=8 ** -0.5), x64, _up(tng))
  _assert_close(hvp, want[0], what="hvp")
  _assert_close(gg, want[1], what="grad of grad")


@SLOW  # jax.hessian in float32 and float64
def test_hessian_in_score_mod_array():
  """jax.hessian (forward over reverse) in an array the score modifier closes over (ALiBi
  slopes), on the single-tile flash path with a causal mask."""
  x = make_inputs(2, 1, 300, 300, 2, 1, 8)
  alibi = lambda slopes: (lambda s, b, h, i, j: s - slopes[h] * jnp.abs(i - j))

  def loss(ref):
    def at(slopes):
      f = (_ref if ref else lambda **kw: _xla("flash", **kw))(mask=M.CausalMask(), score_mod=alibi(slopes))
      qkv = _up((x.q, x.k, x.v)) if ref else (x.q, x.k, x.v)
      return _loss(f, x.do)(*qkv)
    return at
  slopes = jnp.array([0.3, 0.05])
  got = jax.hessian(loss(False))(slopes)
  with jax.enable_x64(True):
    want = np.asarray(jax.hessian(loss(True))(_up(slopes)))
  _assert_close(got, want, what="hessian")


def _grad_of_jvp(f, x, t, tk):
  """Gradient in q of a loss of the output tangent for tangents in q and k (reverse over forward)."""
  dot = lambda q: jax.jvp(lambda q, k: f(q, k, x.v), (q, x.k), (t, tk))[1]
  return jax.grad(lambda q: jnp.sum(jnp.sin(dot(q)) * x.do))(x.q)


@SLOW
def test_second_derivatives_through_with_forward_mode():
  """with_forward_mode's linear_call (a kernel's vjp as the transpose, an exact jvp as the
  tangent), with the XLA flash path in both roles: jvp of grad raised TypeError (the output was
  tied to its gradient by a custom_vjp, which JAX cannot jvp), and grad of grad was wrong (the
  kernel's vjp, computed at stopped inputs, had no derivative in them). Each second derivative
  against the float64 reference."""
  x = make_inputs(4, 1, 300, 300, 2, 1, 8)
  flash = lambda q, k, v, mask: xla.attention(q, k, v, formulation="flash", mask=mask, scale=8 ** -0.5)
  f = with_forward_mode(flash, flash)
  g = lambda q, k, v: f(q, k, v, M.CausalMask())
  tng, tk = _normal(1, x.q.shape), _normal(2, x.k.shape)
  hvp, gg = _second_order(g, x, tng)
  gj = _grad_of_jvp(g, x, tng, tk)
  with jax.enable_x64(True):
    x64 = type(x)(*_up((x.q, x.k, x.v, x.do)))
    ref = _ref(M.CausalMask(), scale=8 ** -0.5)
    want = _second_order(ref, x64, _up(tng))
    want_gj = _grad_of_jvp(ref, x64, *_up((tng, tk)))
  _assert_close(hvp, want[0], what="hvp")
  _assert_close(gg, want[1], what="grad of grad")
  _assert_close(gj, want_gj, what="grad of jvp")


def test_jvp_of_jvp_in_one_of_its_tangents():
  """jvp of a jvp in one of its two tangents (q's): the linear_call's linear inputs get a
  tangent for q's and a zero one for k's, which the JVP rule differentiates with symbolic
  zeros (a zero array there would be a constant linear input, and a dot with a zero operand)."""
  x = make_inputs(6, 1, 300, 300, 2, 1, 8)
  tk, s = _normal(1, x.k.shape), _normal(2, x.q.shape)
  inner = lambda f, q, k, v: (lambda a: jax.jvp(lambda q, k: f(q, k, v), (q, k), (a, tk))[1])
  nested = lambda f, q, k, v, a: jax.jvp(inner(f, q, k, v), (a,), (s,))[1]
  got = jax.jit(lambda a: nested(_xla("flash", M.CausalMask()), x.q, x.k, x.v, a))(x.do)
  with jax.enable_x64(True):
    q, k, v, a = _up((x.q, x.k, x.v, x.do))
    tk, s = _up((tk, s))
    want = np.asarray(nested(_ref(M.CausalMask()), q, k, v, a))
  _assert_close(got, want, what="jvp of jvp")
