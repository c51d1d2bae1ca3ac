"""The exact XLA path against the float64 reference: the conformance suite
(tests/ops/attention/conformance.py) on its dense and flash formulations, and what only it
takes: bias, dropout, closed-over score_mod arrays, traced segment ids, value head_dim."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from probjax.nn.layers.attention import dot_product_attention, flex_attention
from probjax.ops.attention import masks as M
from probjax.ops.attention.backends import xla
from probjax.ops.attention.reference import reference_attention, _attention64
from probjax.ops.attention.tolerances import max_error, scaled_tolerance, tolerance
from probjax.testing import check_against_reference, make_inputs, make_mask
from tests.ops.attention.conformance import AttentionConformance

# Each case compiles its own forward, backward and float64 reference: 1-13 s of CPU a case on a
# 2-core machine, nearly all of it XLA compiling (the shapes run in milliseconds). make test
# keeps the mask grid of the dense and the one-tile flash formulations and one or two cases of
# each other test; the multi-tile grid, the other lengths, dtypes and repeats are slow.
SLOW = pytest.mark.slow


def _slow_except(values, *fast):
  """``values`` as parameters, all but those in ``fast`` marked slow."""
  return [v if v in fast else pytest.param(*(v if isinstance(v, tuple) else (v,)), marks=SLOW) for v in values]


def _xla(formulation, mask=None, score_mod=None, **kw):
  def attn(q, k, v, bias):
    return xla.attention(q, k, v, formulation=formulation, bias=bias, mask=mask, score_mod=score_mod,
                         scale=q.shape[-1] ** -0.5, **kw)
  return attn


class TestXlaConformance(AttentionConformance):
  """The conformance suite on the dense and the flash formulation (forced), each at the lengths
  where "auto" picks it: dense at 37 x 53, one flash tile at 300 x 211, 256-tiles at 600 x 600."""

  implementation = "xla"
  takes_bias = True
  variants = {"dense": dict(formulation="dense"), "flash": dict(formulation="flash")}
  forward_variants = ("dense", "flash")
  mask_shapes = ((37, 53), (300, 211), (600, 600))
  # make test keeps the mask grid of the dense and the one-tile flash formulations and one or two
  # cases of each other test (the grid's masks are GQA 2:1 already); the rest is slow.
  odd_lengths = ((1, 1), (7, 7), (7, 63), (63, 7), (200, 7), (257, 513), (1500, 1500), (3000, 5))
  shape = (300, 300)
  low_precision = (jnp.float16, jnp.bfloat16)
  precision_shape = (100, 100)
  slow_cases = frozenset({
      "test_values_and_grads[flash-*-600x600]", "test_values_and_grads[flash-causal_neg-*]",
      "test_values_and_grads[flash-segments&causal-*]", "test_odd_lengths[*]", "test_gqa[*]",
      "test_jvp[dense]", "test_never_read[*]", "test_segment_ids_of_any_value[flash]", "test_score_mod[*]",
      "test_same_precision[*]"})
  fast_cases = frozenset({
      "test_values_and_grads[flash-lengths-600x600]", "test_values_and_grads[flash-causal&kv_len-600x600]",
      "test_values_and_grads[flash-window&segments-600x600]", "test_odd_lengths[dense-7x63]",
      "test_odd_lengths[flash-257x513]", "test_never_read[flash-lengths]", "test_same_precision[dense-float16]"})

  def run(self, q, k, v, mask=None, scale=None, **kw):
    return xla.attention(q, k, v, mask=mask, scale=q.shape[-1] ** -0.5 if scale is None else scale, **kw)

  def run_jvp(self, q, k, v, mask=None, **kw):
    return self.run(q, k, v, mask=mask, **kw)

  def takes(self, test, variant, tq, tk):
    # The grids of lengths: each formulation at the lengths of its own regimes (dense to 256,
    # flash's single tile to 512 and its 256-tiles beyond), whatever "auto" picks there.
    if test in ("test_values_and_grads", "test_odd_lengths", "test_gqa"):
      return variant == ("dense" if max(tq, tk) <= 256 else "flash")
    return True

  def same_precision(self, mask):
    # jax.nn's XLA attention on the same low-precision inputs, the mask as a dense array.
    def f(q, k, v):
      return jax.nn.dot_product_attention(q, k, v, mask=mask.dense(q.shape[0], q.shape[1], k.shape[1]),
                                          implementation="xla")
    return f


@SLOW  # 600 x 1500 in 128-tiles
def test_odd_lengths_in_small_tiles():
  x = make_inputs(5, 1, 600, 1500, 6, 2, 16)
  mask = M.CausalMask(offset=900)
  check_against_reference(_xla("flash", mask, block_q=128, block_k=128), x, mask=mask)


@SLOW  # three formulations at 700 x 700
def test_regimes_agree_and_tiles_are_skipped():
  """Dense, single-tile and 256-tiled formulations compute the same function."""
  x = make_inputs(3, 2, 700, 700, 2, 1, 32)
  mask = M.LocalWindowMask(left=100, right=0) & M.KVLenMask(jnp.array([650, 300]))
  outs = [xla.attention(x.q, x.k, x.v, formulation=f, mask=mask, scale=0.2, **kw)
          for f, kw in [("dense", {}), ("flash", {}), ("flash", dict(block_q=700, block_k=704))]]
  ref = reference_attention(x.q, x.k, x.v, mask=mask, scale=0.2)
  for o in outs:
    assert max_error(o, ref) <= tolerance(jnp.float32)
  # The tiled loop visits only tiles that the band allows: count the loop trip in the jaxpr.
  st_band = xla.flash._Static(700, 700, 256, 256, 1.0, 1, M.band(-100, 0), 0.0, True, None, None)
  lo, hi = xla.flash._k_bounds(st_band, 2)
  assert (int(lo), int(hi)) == (1, 3)  # query tile 2 (rows 512..699) needs key tiles 1..2 only


@SLOW  # six forward + backward compiles
def test_bias_gradient_broadcast_shapes():
  x = make_inputs(11, 2, 300, 290, 4, 4, 16)
  for shape in [(1, 4, 300, 290), (2, 1, 1, 290), (300, 290)]:
    bias = jax.random.normal(jax.random.key(len(shape)), shape)
    for formulation in ("dense", "flash"):
      attn = lambda q, k, v, b: dot_product_attention(q, k, v, b, implementation="xla") if formulation == "flash" \
          else xla.dense_attention(q, k, v, bias=b.reshape((1,) * (4 - b.ndim) + b.shape), scale=0.25)
      errs = check_against_reference(attn, x, bias=bias)
      assert "dbias" in errs


@SLOW  # gradients in float32 and float64 on two formulations
def test_score_mod_with_captured_array_gradient():
  x = make_inputs(5, 1, 300, 300, 4, 2, 16)
  slopes = jnp.linspace(0.05, 0.4, 4)

  def loss(slopes, formulation):
    mod = lambda s, b, h, qi, ki: s - slopes[h] * jnp.abs(qi - ki)
    out = xla.attention(x.q, x.k, x.v, formulation=formulation, score_mod=mod, scale=0.25,
                        mask=M.CausalMask())
    return jnp.sum(out * x.do)

  with jax.enable_x64(True):
    q, k, v, do = (jnp.asarray(np.asarray(a, np.float64)) for a in (x.q, x.k, x.v, x.do))
    def ref_loss(s):
      mod = lambda sc, b, h, qi, ki: sc - s[h] * jnp.abs(qi - ki)
      return jnp.sum(_attention64(q, k, v, None, M.CausalMask(), None, mod, 0.25) * do)
    g_ref = np.asarray(jax.grad(ref_loss)(jnp.asarray(np.asarray(slopes, np.float64))))
  for f in ("dense", "flash"):
    g = jax.grad(loss)(slopes, f)
    assert max_error(g, g_ref) <= tolerance(jnp.float32, grad=True)
  mod = lambda s, b, h, qi, ki: s - slopes[h] * jnp.abs(qi - ki)
  check_against_reference(_xla("flash", M.CausalMask(), mod), x, mask=M.CausalMask(), score_mod=mod, scale=None)


@SLOW  # vmap of grad, three grads and a vmap of jvp
def test_vmap_of_grad_and_jvp():
  x = make_inputs(9, 3, 300, 300, 2, 1, 16)
  f = lambda q, k, v: flex_attention(q[None], k[None], v[None], mask=M.CausalMask())[0]
  g = jax.vmap(jax.grad(lambda q, k, v: jnp.sum(f(q, k, v) ** 2)))(x.q, x.k, x.v)
  g_loop = jnp.stack([jax.grad(lambda q: jnp.sum(f(q, x.k[i], x.v[i]) ** 2))(x.q[i]) for i in range(3)])
  np.testing.assert_allclose(g, g_loop, rtol=1e-5, atol=1e-5)
  t = jax.vmap(lambda q: jax.jvp(lambda q: f(q, x.k[0], x.v[0]), (q,), (jnp.ones_like(q),))[1])(x.q)
  assert t.shape == x.q.shape and np.all(np.isfinite(np.asarray(t)))


@pytest.mark.parametrize("broadcast,formulation,t", _slow_except(
    [(b, f, t) for b in (False, True) for f, t in (("dense", 64), ("flash", 300))],
    (False, "dense", 64), (False, "flash", 300)))
def test_dropout(formulation, t, broadcast):
  x = make_inputs(2, 2, t, t, 2, 2, 16)
  v = jnp.ones_like(x.v)  # rows of P·1 are 1 before dropout: the mean after dropout must stay 1
  rng = jax.random.key(123)
  if formulation == "dense":
    run = lambda rng, v: xla.dense_attention(x.q, x.k, v, dropout_rng=rng, dropout_rate=0.3,
                                             broadcast_dropout=broadcast, scale=0.25)
  else:
    run = lambda rng, v: xla.flash_attention(x.q, x.k, v, dropout_rng=rng, dropout_rate=0.3,
                                             broadcast_dropout=broadcast, scale=0.25)
  a, b = run(rng, v), run(rng, v)
  np.testing.assert_array_equal(a, b)
  assert not np.array_equal(a, run(jax.random.key(7), v))
  assert abs(float(jnp.mean(a)) - 1.0) < 0.02
  # gradient of the dropout path equals the reference with the same keep mask
  g = jax.grad(lambda v: jnp.sum(run(rng, v) * x.do))(x.v)
  assert np.all(np.isfinite(np.asarray(g)))
  zero = dot_product_attention(x.q, x.k, x.v, dropout_rng=rng, dropout_rate=0.3, deterministic=True)
  assert max_error(zero, reference_attention(x.q, x.k, x.v)) <= tolerance(jnp.float32)


@SLOW  # three compiles of the flash dropout path
def test_dropout_flash_matches_dense_expectation():
  """Flash dropout is exact for its keep mask: its vjp matches a finite difference."""
  x = make_inputs(3, 1, 300, 300, 1, 1, 8)
  rng = jax.random.key(5)
  f = lambda v: jnp.sum(xla.flash_attention(x.q, x.k, v, dropout_rng=rng, dropout_rate=0.5, scale=0.3) * x.do)
  g = jax.grad(f)(x.v)
  d = jax.random.normal(jax.random.key(9), x.v.shape)
  eps = 1e-2
  fd = (f(x.v + eps * d) - f(x.v - eps * d)) / (2 * eps)
  np.testing.assert_allclose(float(jnp.sum(g * d)), float(fd), rtol=2e-3)


def test_auto_formulation():
  """Dense while the scores are few (decoding included), flash past DENSE_MAX_SCORES, with a
  band mask past BAND_DENSE_MAX_SCORES, and where flash's tiles pad the scores by at most
  TILED_MAX_PADDING past TILED_DENSE_MAX_SCORES (bench/cpu_formulations.py fitted them)."""
  choose = lambda tq, tk, b=1, h=8, band=False: xla.choose_formulation((b, tq, h, 64), (b, tk, 2, 64), band=band)
  assert choose(600, 600) == "dense" and choose(16, 16384) == "dense"
  # T800: 5.1M scores, between 2^22 and 2^23, that 256-tiles pad by 1.64: dense; past 2^23, flash.
  assert choose(800, 800) == "dense" and choose(1030, 1030) == "flash"
  assert choose(700, 700, band=True) == "dense" and choose(800, 800, band=True) == "flash"  # 2^22
  # Lengths the flash tiles cover (no padding): flash past 2^22 scores, with or without a band.
  assert choose(512, 1024) == "dense" and choose(1024, 1024) == "flash" and choose(512, 1280) == "flash"
  assert xla.flash_padding(1024, 1024) == 1.0 and xla.flash_padding(553, 553) == (768 / 553) ** 2
  assert choose(1, 1 << 20, b=128) == "flash"
  assert xla.choose_formulation((1, 4096, 8, 64), (1, 4096, 8, 64), module=True) == "dense"


# -- value head_dim != query/key head_dim (multi-head latent attention) --------------------------
@pytest.mark.parametrize("formulation,tq,tk,mask_name", _slow_except(
    [(f, tq, tk, m) for f, tq, tk in [("dense", 1, 48), ("dense", 7, 7), ("dense", 48, 48), ("flash", 7, 300),
                                      ("flash", 300, 211)] for m in ("none", "causal", "kv_len_zero", "causal&kv_len")],
    *[(f, tq, tk, m) for f, tq, tk in [("dense", 48, 48), ("flash", 7, 300)]
      for m in ("none", "causal", "kv_len_zero", "causal&kv_len")]))
def test_value_head_dim_differs(mask_name, formulation, tq, tk):
  # GQA (4 query heads over 2 KV heads), q/k width 24, v width 16: values, dq, dk, dv.
  x = make_inputs(hash((mask_name, formulation, tq, tk)) % 1000, 2, tq, tk, 4, 2, 24, v_head_dim=16)
  mask = make_mask(mask_name, 2, tq, tk, seed=tq)
  errors = check_against_reference(_xla(formulation, mask), x, mask=mask)
  assert set(errors) == {"out", "dq", "dk", "dv"}


@SLOW  # two public functions, forward and gradients
def test_value_head_dim_differs_public_api_scale_and_empty_rows():
  x = make_inputs(3, 2, 7, 48, 4, 1, 12, v_head_dim=20)   # MQA, v wider than q/k
  mask = M.KVLenMask(jnp.array([48, 0]))
  for fn in (dot_product_attention, flex_attention):
    out = fn(x.q, x.k, x.v, mask=mask)
    assert out.shape == (2, 7, 4, 20)
    # The default scale is the query/key width's.
    ref = reference_attention(x.q, x.k, x.v, mask=mask, scale=12 ** -0.5)
    assert max_error(out, ref) <= tolerance(jnp.float32)
    assert np.all(np.asarray(out[1]) == 0)
    dq, dk, dv = jax.grad(lambda q, k, v: jnp.sum(fn(q, k, v, mask=mask) * x.do), (0, 1, 2))(x.q, x.k, x.v)
    assert np.all(np.asarray(dq[1]) == 0) and np.all(np.asarray(dk[1]) == 0) and np.all(np.asarray(dv[1]) == 0)


@pytest.mark.parametrize("formulation,t", _slow_except([("dense", 7), ("flash", 300)], ("flash", 300)))
def test_value_head_dim_differs_jvp(formulation, t):
  x = make_inputs(11, 2, t, t, 4, 2, 24, v_head_dim=8)
  mask = M.CausalMask() & M.KVLenMask(jnp.array([t, 0]))
  tans = [jax.random.normal(jax.random.key(20 + i), a.shape) for i, a in enumerate((x.q, x.k, x.v))]
  f = lambda q, k, v: xla.attention(q, k, v, formulation=formulation, mask=mask, scale=24 ** -0.5)
  _, got = jax.jvp(f, (x.q, x.k, x.v), tuple(tans))
  with jax.enable_x64(True):
    up = lambda a: jnp.asarray(np.asarray(a, np.float64))
    g = lambda q, k, v: _attention64(q, k, v, None, mask, None, None, 24 ** -0.5)
    _, want = jax.jvp(g, tuple(map(up, (x.q, x.k, x.v))), tuple(map(up, tans)))
  assert max_error(got, np.asarray(want)) <= tolerance(jnp.float32, grad=True)


@pytest.mark.parametrize("kwargs, pattern", [
    (dict(k_shape=(2, 9, 2, 16), v_shape=(2, 8, 2, 16)), "same shape"),
    (dict(k_shape=(2, 8, 1, 16), v_shape=(2, 8, 2, 16)), "same shape"),
    (dict(k_shape=(2, 8, 2, 8), v_shape=(2, 8, 2, 8)), "head_dim"),
])
def test_value_head_dim_validation(kwargs, pattern):
  q = jnp.ones((2, 8, 4, 16))
  with pytest.raises(ValueError, match=pattern):
    dot_product_attention(q, jnp.ones(kwargs["k_shape"]), jnp.ones(kwargs["v_shape"]))


# -- segment ids as traced jit arguments ---------------------------------------------------------
def _segment_ids(kind, b, t, seed):
  """``[b, t]`` int32 ids: ``"sorted"`` packed documents, ``"unsorted"`` ids in random order,
  ``"padded"`` packed documents followed by a padding id (0) from a per-row length on."""
  rng = np.random.default_rng(seed)
  if kind == "unsorted":
    return rng.integers(0, 3, (b, t)).astype(np.int32)
  cuts = np.sort(rng.integers(1, t, (b, 3)), axis=1)
  ids = 1 + (np.arange(t)[None, :, None] >= cuts[:, None, :]).sum(-1)
  if kind == "padded":
    ids = np.where(np.arange(t)[None] < rng.integers(t // 2, t, (b, 1)), ids, 0)
  return ids.astype(np.int32)


def _traced_segments(formulation, other=None, **kw):
  """attn(q, k, v, bias) whose SegmentMask ids are arguments of a jitted function."""
  @jax.jit
  def run(q, k, v, q_ids, kv_ids):
    mask = M.SegmentMask(q_ids, kv_ids)
    mask = mask if other is None else mask & other
    return xla.attention(q, k, v, formulation=formulation, mask=mask, scale=q.shape[-1] ** -0.5, **kw)
  return run


@pytest.mark.parametrize("formulation,tq,tk,blocks,kind", _slow_except(
    [(f, tq, tk, b, k) for f, tq, tk, b in [("flash", 300, 300, None), ("flash", 300, 260, 128), ("dense", 40, 56, None)]
     for k in ("sorted", "unsorted", "padded")],
    ("flash", 300, 260, 128, "padded"), ("dense", 40, 56, None, "unsorted")))
def test_traced_segment_ids_match_reference(kind, formulation, tq, tk, blocks):
  """Ids passed to jit (the training case) compute what the float64 reference does, values and
  every gradient, on one tile and on several; queries and keys get different ids (cross
  attention of packed documents)."""
  x = make_inputs(hash((kind, tq, tk)) % 1000, 2, tq, tk, 2, 1, 8)
  q_ids, kv_ids = _segment_ids(kind, 2, tq, tq), _segment_ids(kind, 2, tk, tk + 1)
  run = _traced_segments(formulation, **({} if blocks is None else dict(block_q=blocks, block_k=blocks)))
  mask = M.SegmentMask(jnp.asarray(q_ids), jnp.asarray(kv_ids))
  check_against_reference(lambda q, k, v, b: run(q, k, v, q_ids, kv_ids), x, mask=mask)


@pytest.mark.parametrize("other", [pytest.param(M.CausalMask(), marks=SLOW),
                                   pytest.param(M.KVLenMask(jnp.array([250, 130])), marks=SLOW),
                                   M.CausalMask() & M.KVLenMask(jnp.array([300, 1]))],
                         ids=["causal", "kv_len", "causal&kv_len"])
def test_traced_segment_ids_with_other_predicates(other):
  x = make_inputs(17, 2, 300, 300, 2, 1, 8)
  ids = _segment_ids("padded", 2, 300, 3)
  run = _traced_segments("flash", other, block_q=128, block_k=128)
  mask = M.SegmentMask(jnp.asarray(ids)) & other
  check_against_reference(lambda q, k, v, b: run(q, k, v, ids, ids), x, mask=mask)


@pytest.mark.parametrize("blocks", [None, pytest.param(128, marks=SLOW)])
def test_traced_segment_ids_fully_masked_rows_are_zero(blocks):
  """Queries whose id no key has give zeros and zero gradients, never NaN."""
  t = 300
  x = make_inputs(23, 2, t, t, 2, 1, 8)
  q_ids = _segment_ids("sorted", 2, t, 5)
  q_ids[:, : t // 3] = 9  # no key has id 9
  q_ids[1] = 9  # batch element 1: every row empty
  kv_ids = _segment_ids("sorted", 2, t, 5)
  run = _traced_segments("flash", **({} if blocks is None else dict(block_q=blocks, block_k=blocks)))
  out, vjp = jax.vjp(lambda q, k, v: run(q, k, v, q_ids, kv_ids), x.q, x.k, x.v)
  dq, dk, dv = vjp(x.do)
  for a in (out, dq, dk, dv):
    assert np.all(np.isfinite(np.asarray(a)))
  assert np.all(np.asarray(out[:, : t // 3]) == 0) and np.all(np.asarray(dq[:, : t // 3]) == 0)
  assert all(np.all(np.asarray(a[1]) == 0) for a in (out, dq, dk, dv))
  mask = M.SegmentMask(jnp.asarray(q_ids), jnp.asarray(kv_ids))
  check_against_reference(lambda q, k, v, b: run(q, k, v, q_ids, kv_ids), x, mask=mask)


def _conds(f, *args):
  """The number of conds in the jaxpr of ``f(*args)`` (its text shows the nested ones too)."""
  return str(jax.make_jaxpr(f)(*args)).count(" cond[")


def test_traced_segment_ids_single_tile_has_no_tile_cond():
  """A single tile is computed without a cond on its (run-time) tile class: on XLA:CPU the cond
  made traced ids much slower than constant ones, whose cond folds away. Several tiles keep
  the run-time skip of the tiles that no batch element needs."""
  x = make_inputs(29, 1, 300, 300, 2, 1, 8)
  ids = jnp.asarray(_segment_ids("sorted", 1, 300, 7))
  grad = lambda **kw: jax.grad(lambda q, ids: jnp.sum(_traced_segments("flash", **kw)(q, x.k, x.v, ids, ids)))
  assert _conds(grad(), x.q, ids) == 0
  assert _conds(grad(block_q=128, block_k=128), x.q, ids) > 0
