"""Property tests: every attention path available on CPU against the float64 reference.

Hypothesis draws attention calls as data (:class:`probjax.testing.AttnCase`: lengths that
cross every XLA formulation boundary, GQA, masks and their ``&`` combinations, dense boolean
masks, bias, score modifiers, scales, dtypes) and checks each transform of the public API
against :mod:`probjax.ops.attention.reference` in float64, with the bounds of
:mod:`probjax.ops.attention.tolerances`:

=====================================  =========================================================
test_drawn_lengths_reach_every_...     the drawn lengths' regimes are the XLA path's formulations
test_values_and_gradients              output and vjp (q, k, v, bias), eager or jit
test_jvp                               jvp with any subset of q, k, v, bias tangents
test_second_order                      forward-over-reverse and reverse-over-reverse
test_jit_equals_eager, test_vmap       jit against eager; vmap over an extra leading axis
test_garbage_past_lengths              NaN/inf past kv/q lengths reaches no result
test_rows_without_keys_are_zero        rows with no valid key: exact zeros, zero gradients
test_traced_lengths_are_clamped        traced out-of-range lengths: exactly the clamped call
test_float64                           float64 inputs are computed in float64
test_triton_interpret                  the Triton kernel in Pallas interpret mode, small
test_triton_interpret_thorough (thor)  the same at more tiles, more examples
test_mosaic_interpret_thorough (thor)  the Mosaic GPU kernel in interpret mode (bf16/fp16, d 64)
=====================================  =========================================================

The XLA properties run ``implementation=None`` (the CPU default) and ``"xla"``; which
formulation runs (dense, decoding, one flash tile, 256-tiles) follows from the drawn lengths.
Explicit ``@example`` cases pin known regressions.

Profiles (registered here): "probjax-quick" by default, a few examples per property at small
sizes, no shrinking (the properties take about 75 s of CPU time: they are marked ``slow``);
"probjax-thorough" for the tests marked ``thorough`` (also slow), with more and larger examples
and shrinking. The thorough tests run only when selected: ``pytest -m slow
tests/ops/attention/test_properties.py``, or with
``PROBJAX_HYPOTHESIS_PROFILE=thorough``, which also gives the other properties the thorough
budget; PROBJAX_HYPOTHESIS_EXPLICIT=0 skips the pinned examples. Every example is
derandomized and nothing is stored in a database, so a run is repeatable; a failure prints
its ``AttnCase`` and the drawn arguments as a reproducer.
"""

from __future__ import annotations

import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, example, given, settings, strategies as st

from probjax.ops.attention import masks as M
from probjax.ops.attention.masks import round_up
from probjax.testing import (HEADS, KERNEL_SCORE_MODS, LENGTHS, REGIMES, AttnCase, MaskSpec, assert_matches,
                             attention_cases, lengths_pairs, poison, reference_apply, reference_grads,
                             reference_jvp, reference_valid, regime, length_formulations)

# Every drawn example compiles its own calls (2-10 s of CPU a property, whatever the sizes): the
# properties run in the slow step (make test-slow), the thorough ones by hand (marked thorough:
# CI's -k "not thorough" leaves them out).
SLOW = pytest.mark.slow

# -- hypothesis profiles ----------------------------------------------------------------------
_COMMON = dict(deadline=None, derandomize=True, database=None, print_blob=False,
               suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                      HealthCheck.filter_too_much, HealthCheck.function_scoped_fixture])
# PROBJAX_HYPOTHESIS_EXPLICIT=0 skips the pinned @example cases (to explore past a known failure).
_EXPLICIT = (Phase.explicit,) if os.environ.get("PROBJAX_HYPOTHESIS_EXPLICIT", "1") != "0" else ()
settings.register_profile("probjax-quick", max_examples=4, phases=_EXPLICIT + (Phase.generate,),
                          report_multiple_bugs=False, **_COMMON)
settings.register_profile("probjax-thorough", max_examples=40,
                          phases=_EXPLICIT + (Phase.generate, Phase.shrink), **_COMMON)
PROFILE = os.environ.get("PROBJAX_HYPOTHESIS_PROFILE", "quick").removeprefix("probjax-")
if PROFILE not in ("quick", "thorough"):
  raise ValueError(f"PROBJAX_HYPOTHESIS_PROFILE must be 'quick' or 'thorough', got {PROFILE!r}")
THOROUGH = PROFILE == "thorough"


def budget(quick: int, thorough: int, *, slow: bool = False):
  """The settings of a property: ``quick`` examples under the quick profile, ``thorough``
  under the thorough one (always for ``slow`` tests)."""
  name = "thorough" if slow or THOROUGH else "quick"
  return settings(settings.get_profile(f"probjax-{name}"),
                  max_examples=thorough if name == "thorough" else quick)


def timeout(seconds: int, **kw):
  """pytest-timeout for a property: ``seconds`` under the quick profile, 20x under the thorough
  one (a hang fails the test instead of stalling the run)."""
  return pytest.mark.timeout(seconds * (20 if THOROUGH else 1), **kw)


@pytest.fixture
def selected_slow(request):
  """Skips a slow property unless selected (``-m slow`` or the thorough profile)."""
  if not (THOROUGH or "slow" in (request.config.getoption("markexpr") or "")):
    pytest.skip("slow property: run with -m slow or PROBJAX_HYPOTHESIS_PROFILE=thorough")


# -- what the XLA properties draw -------------------------------------------------------------
# Work bound b * h * q_len * kv_len * head_dim: the quick profile keeps the long regimes at one
# or two heads of head_dim <= 16.
WORK = 40_000_000 if THOROUGH else 1_000_000
DTYPES = ("float32", "bfloat16", "float16")
IMPLEMENTATIONS = st.sampled_from([None, "xla"])
APIS = st.sampled_from(["dot_product_attention", "flex_attention"])
POSITION_MASKS = ("none", "causal", "window", "kv_lengths", "lengths", "segments")
LENGTH_MASKS = ("kv_lengths", "lengths")

cases = attention_cases(dtypes=DTYPES, max_work=WORK)


@pytest.fixture(autouse=True, scope="module")
def _formulations_by_length():
  # The measured rule runs every test-sized call dense; the properties reach the flash tiles too.
  with length_formulations():
    yield


def api_for(case: AttnCase, api: str) -> str:
  """flex_attention where the call fits it (no bias, dense mask or is_causal)."""
  flex_ok = case.bias is None and case.mask.dense is None and not case.is_causal
  return api if flex_ok else "dot_product_attention"


def vjp_fn(f, do):
  """``run(q, k, v, bias, mask) -> (out, (dq, dk, dv, dbias))`` for cotangent ``do``."""
  def run(q, k, v, bias, mask):
    out, pull = jax.vjp(lambda q, k, v, b: f(q, k, v, b, mask), q, k, v, bias)
    return out, pull(do)
  return run


def named(out, grads):
  return dict(zip(("out", "dq", "dk", "dv", "dbias"), (out, *grads)))


def ref_named(case: AttnCase, x, bias):
  """The reference's output and gradients, ``named``."""
  r = reference_grads(x.q, x.k, x.v, x.do, bias=bias, **case.reference_kwargs())
  return named(r[0], r[1:])


# -- explicit examples: known regressions ----------------------------------------------------
SINGLE_TILE_CAUSAL = AttnCase(1, 300, 300, 2, 1, 16, mask=MaskSpec(causal=0), seed=1)
DENSE_INF_ROWS = AttnCase(2, 40, 53, 2, 1, 16, bias=(2, 2, 40, 53), bias_blocks_row=True, score_mod="block_row",
                          seed=2)  # rows at -inf from the bias (row 0) and from score_mod (row 20)
KV_CACHE = AttnCase(2, 16, 300, 4, 2, 16, mask=MaskSpec(kv_lengths=(300, 37)), seed=4)  # decoding
EMPTY_KV_FLASH = AttnCase(1, 300, 0, 2, 1, 16, seed=6)


# -- properties ------------------------------------------------------------------------------
def test_drawn_lengths_reach_every_formulation():
  """The strategies' regimes are the formulations the XLA path runs under the test rule
  (:func:`probjax.testing.length_formulations`), and reach each one: dense, decoding, flash's
  single tile and its 256-tiles."""
  from probjax.ops.attention.backends import xla
  pairs = lengths_pairs()
  for tq, tk in pairs:
    want = xla.choose_formulation((1, tq, 1, 8), (1, tk, 1, 8))
    assert (regime(tq, tk) in ("dense", "decode")) == (want == "dense"), (tq, tk, want)
    if want == "flash":
      single = xla.choose_blocks(tq, tk) == (round_up(tq, 8), round_up(tk, 8))
      assert single == (regime(tq, tk) == "flash"), (tq, tk)
  assert {regime(*p) for p in pairs} == set(REGIMES)


@SLOW
@timeout(150)
@budget(2, 60)
@given(case=cases, api=APIS, implementation=IMPLEMENTATIONS, jit=st.booleans())
def test_values_and_gradients(case, api, implementation, jit):
  """Output and the gradients in q, k, v and bias match the float64 reference, NaN-free."""
  x, bias = case.inputs(), case.bias_array()
  run = vjp_fn(case.attention_fn(api=api_for(case, api), implementation=implementation), x.do)
  got = named(*(jax.jit(run) if jit else run)(x.q, x.k, x.v, bias, case.mask_arg()))
  assert_matches(got, ref_named(case, x, bias), case.dtype, what=f"{case.regime} {case}")


@SLOW
@timeout(150)
@budget(2, 60)
@given(case=cases, tangents=st.sets(st.sampled_from(["q", "k", "v", "bias"]), min_size=1),
       implementation=IMPLEMENTATIONS, jit=st.booleans())
@example(case=SINGLE_TILE_CAUSAL, tangents={"q", "k"}, implementation=None, jit=True)
def test_jvp(case, tangents, implementation, jit):
  """jax.jvp with tangents for any subset of (q, k, v, bias), the others constant."""
  x, bias = case.inputs(), case.bias_array()
  active = sorted(n for n in tangents if n != "bias" or bias is not None) or ["q"]
  primal = dict(q=x.q, k=x.k, v=x.v, bias=bias)
  keys = jax.random.split(jax.random.key(case.seed + 7), 4)
  tan = {n: jax.random.normal(kk, primal[n].shape, jnp.float32).astype(primal[n].dtype)
         for n, kk in zip(active, keys)}
  f = case.attention_fn(implementation=implementation)
  mask = case.mask_arg()

  def run(primal, tan, mask):
    def g(*xs):
      env = {**primal, **dict(zip(active, xs))}
      return f(env["q"], env["k"], env["v"], env["bias"], mask)
    return jax.jvp(g, tuple(primal[n] for n in active), tuple(tan[n] for n in active))
  out, t = (jax.jit(run) if jit else run)(primal, tan, mask)
  ref_out, ref_t = reference_jvp(x.q, x.k, x.v, tan, bias=bias, **case.reference_kwargs())
  assert_matches(dict(out=out, tangent=t), dict(out=ref_out, tangent=ref_t), case.dtype,
                 what=f"{case.regime} jvp in {active}{' (jit)' if jit else ''}: {case}")


@SLOW
@timeout(150)
@budget(2, 30)
@given(case=attention_cases(max_work=WORK // 2, biases=()), mode=st.sampled_from(["fwd-over-rev", "rev-over-rev"]),
       jit=st.booleans())
@example(case=SINGLE_TILE_CAUSAL, mode="fwd-over-rev", jit=False)
def test_second_order(case, mode, jit):
  """Second derivatives: the jvp of the vjp, and the gradient of <vjp, w>."""
  x = case.inputs()
  keys = jax.random.split(jax.random.key(case.seed + 11), 3)
  w = tuple(jax.random.normal(kk, a.shape, a.dtype) for kk, a in zip(keys, (x.q, x.k, x.v)))
  do, mask = x.do, case.mask_arg()
  impl = case.attention_fn()

  def transform(f, q, k, v, do, w):
    grads = lambda q, k, v: jax.vjp(f, q, k, v)[1](do)
    if mode == "fwd-over-rev":
      return jax.jvp(grads, (q, k, v), w)[1]
    return jax.grad(lambda q, k, v: sum(jnp.vdot(g, t) for g, t in zip(grads(q, k, v), w)),
                    argnums=(0, 1, 2))(q, k, v)
  run = lambda q, k, v, do, w, mask: transform(lambda q, k, v: impl(q, k, v, None, mask), q, k, v, do, w)
  got = (jax.jit(run) if jit else run)(x.q, x.k, x.v, do, w, mask)
  ref = reference_apply(lambda f, *a: transform(lambda q, k, v: f(q, k, v, None), *a), x.q, x.k, x.v, do, w,
                        **case.reference_kwargs())
  assert_matches(dict(zip(("q", "k", "v"), got)), dict(zip(("q", "k", "v"), ref)), case.dtype,
                 what=f"{case.regime} {mode}: {case}")


@SLOW
@timeout(150)
@budget(2, 30)
@given(case=cases, api=APIS, implementation=IMPLEMENTATIONS)
def test_jit_equals_eager(case, api, implementation):
  """The jitted call computes what the eager one does (values and gradients)."""
  x, bias = case.inputs(), case.bias_array()
  run = vjp_fn(case.attention_fn(api=api_for(case, api), implementation=implementation), x.do)
  eager = named(*run(x.q, x.k, x.v, bias, case.mask_arg()))
  jitted = named(*jax.jit(run)(x.q, x.k, x.v, bias, case.mask_arg()))
  assert_matches(jitted, {n: None if v is None else np.asarray(jnp.asarray(v, jnp.float32))
                          for n, v in eager.items()}, case.dtype, what=f"{case.regime} jit vs eager: {case}")


def _flipped(mask):
  """The mask with its per-batch arrays in reverse batch order (another valid mask)."""
  return jax.tree.map(lambda a: a[::-1], mask)


@SLOW
@timeout(150)
@budget(2, 30)
@given(case=attention_cases(dtypes=DTYPES, max_work=WORK // 2, masks=POSITION_MASKS),
       implementation=IMPLEMENTATIONS, jit=st.booleans())
def test_vmap(case, implementation, jit):
  """vmap over an extra leading axis of q, k, v and the mask's arrays (the bias shared):
  each slice's output and gradients match the reference of that slice."""
  x, bias = case.inputs(), case.bias_array()
  run = vjp_fn(case.attention_fn(implementation=implementation), x.do)
  mask = case.mask_arg()
  masks = [mask, _flipped(mask)]
  stack = lambda a: jnp.stack([a, a[::-1] * 0.5])  # a second, different slice
  qs, ks, vs = stack(x.q), stack(x.k), stack(x.v)
  batched = jax.vmap(run, in_axes=(0, 0, 0, None, 0))
  stacked_mask = None if mask is None else jax.tree.map(lambda a, b: jnp.stack([a, b]), *masks)
  got = named(*(jax.jit(batched) if jit else batched)(qs, ks, vs, bias, stacked_mask))
  for i in range(2):
    kw = case.reference_kwargs()
    if mask is not None:
      kw["mask"] = masks[i] if not case.is_causal else masks[i] & M.CausalMask()
      kw["mask"] = kw["mask"].clamped(case.q_len, case.kv_len)
    r = reference_grads(qs[i], ks[i], vs[i], x.do, bias=bias, **kw)
    assert_matches({n: None if g is None else g[i] for n, g in got.items()},
                   named(r[0], r[1:]), case.dtype, what=f"{case.regime} vmap slice {i}: {case}")


@SLOW
@timeout(150)
@budget(2, 40)
@given(case=attention_cases(dtypes=("float32", "bfloat16"), max_work=WORK, masks=LENGTH_MASKS),
       implementation=IMPLEMENTATIONS, jit=st.booleans())
@example(case=KV_CACHE, implementation=None, jit=False)
def test_garbage_past_lengths(case, implementation, jit):
  """K/V rows at or past kv_lengths[b] and Q rows at or past q_lengths[b] hold NaN/inf (a KV
  cache's unwritten tail): the output and every gradient equal the reference on clean inputs,
  NaN-free."""
  x, bias = case.inputs(), case.bias_array()
  spec = case.mask
  kv_lens = spec.kv_lengths or (case.kv_len,) * case.batch
  q = x.q if spec.q_lengths is None else poison(x.q, spec.q_lengths)
  k, v = poison(x.k, kv_lens), poison(x.v, kv_lens)
  run = vjp_fn(case.attention_fn(implementation=implementation), x.do)
  got = named(*(jax.jit(run) if jit else run)(q, k, v, bias, case.mask_arg()))
  assert_matches(got, ref_named(case, x, bias), case.dtype,
                 what=f"{case.regime} garbage past lengths{' (jit)' if jit else ''}: {case}")


EMPTIERS = ("kv_zero", "q_lengths", "causal_neg", "bias_row", "score_row", "no_keys")


@st.composite
def empty_row_cases(draw):
  """A case with rows that have no valid key, made so by one of ``EMPTIERS``."""
  how = draw(st.sampled_from(EMPTIERS))
  pairs = [(t, 0) for t in LENGTHS] if how == "no_keys" else None
  case = draw(attention_cases(max_work=WORK, masks=POSITION_MASKS, pairs=pairs,
                              biases=("full", "heads", "keys", "2d"), bias_blocks_row=False))
  spec = case.mask
  if how == "kv_zero":
    kv = spec.kv_lengths or (case.kv_len,) * case.batch
    spec = dataclasses.replace(spec, kv_lengths=(0,) + tuple(kv[1:]))
  elif how == "q_lengths":
    ql = spec.q_lengths or (case.q_len,) * case.batch
    spec = dataclasses.replace(spec, q_lengths=(case.q_len // 2,) + tuple(ql[1:]))
  elif how == "causal_neg":
    spec = dataclasses.replace(spec, causal=-3)
  if how == "bias_row":
    bias = case.bias or (case.batch, case.heads, case.q_len, case.kv_len)
    case = dataclasses.replace(case, bias=bias, bias_blocks_row=True)
  if how == "score_row":
    case = dataclasses.replace(case, score_mod="block_row")
  return dataclasses.replace(case, mask=spec)


def _exactly_zero_where(name, a, where):
  a = np.asarray(jnp.asarray(a, jnp.float32))
  bad = where & (a != 0)
  assert not bad.any(), f"{name}: {int(bad.sum())} entries that must be exactly 0 are not (max |.| {np.abs(a[where]).max():.3g})"


# Every mask component empties every row (kv length 0) on one flash tile, the mask a constant
# of the jitted program: XLA:CPU once folded the empty tile's probabilities into a constant
# and its YNNPACK dot fusion returned garbage (non-finite dq) for them.
CONSTANT_EMPTY_MASK = AttnCase(1, 512, 512, 6, 2, 64, mask=MaskSpec(kv_lengths=(0,), window=(1, 10),
                                                                     segments=(22, 0)), seed=5)


@SLOW
@timeout(150)
@budget(2, 50)
@given(case=empty_row_cases(), implementation=IMPLEMENTATIONS,
       jit=st.sampled_from(["eager", "jit", "jit_constant_mask"]))
@example(case=DENSE_INF_ROWS, implementation=None, jit="eager")
@example(case=EMPTY_KV_FLASH, implementation=None, jit="eager")
@example(case=CONSTANT_EMPTY_MASK, implementation="xla", jit="jit_constant_mask")
def test_rows_without_keys_are_zero(case, implementation, jit):
  """A query row with no valid key (masked, lengths, -inf bias or score_mod, no keys at all)
  outputs exact zeros and gets a zero dq; a key no query sees gets zero dk and dv; a bias entry
  at no valid position gets a zero gradient. Under jit the mask is an argument, or a constant
  of the program (closed over), which XLA may fold."""
  x, bias = case.inputs(), case.bias_array()
  run = vjp_fn(case.attention_fn(implementation=implementation), x.do)
  if jit == "jit_constant_mask":  # the cotangent an argument: folded with the mask, it hid the bug
    mask, f = case.mask_arg(), case.attention_fn(implementation=implementation)
    got = named(*jax.jit(lambda q, k, v, b, do: vjp_fn(f, do)(q, k, v, b, mask))(x.q, x.k, x.v, bias, x.do))
  else:
    got = named(*(jax.jit(run) if jit == "jit" else run)(x.q, x.k, x.v, bias, case.mask_arg()))
  assert_matches(got, ref_named(case, x, bias), case.dtype, what=f"{case.regime} {case}")
  kw = case.reference_kwargs()
  valid = reference_valid(x.q, x.k, bias=bias, **kw)             # [b, h, q, k]
  empty_rows = ~valid.any(-1)                                    # [b, h, q]
  assert empty_rows.any(), f"the case has no empty row: {case}"
  rows = np.transpose(empty_rows, (0, 2, 1))[..., None]          # [b, q, h, 1]
  _exactly_zero_where("out", got["out"], np.broadcast_to(rows, x.q.shape))
  _exactly_zero_where("dq", got["dq"], np.broadcast_to(rows, x.q.shape))
  g = case.heads // case.kv_heads
  unseen = ~valid.reshape(case.batch, case.kv_heads, g, case.q_len, case.kv_len).any((2, 3))  # [b, hkv, k]
  unseen = np.broadcast_to(np.transpose(unseen, (0, 2, 1))[..., None], x.k.shape)
  _exactly_zero_where("dk", got["dk"], unseen)
  _exactly_zero_where("dv", got["dv"], unseen)
  if bias is not None:
    shape = (1,) * (4 - bias.ndim) + tuple(bias.shape)
    axes = tuple(i for i, n in enumerate(shape) if n == 1)
    dead = (~valid).all(axis=axes, keepdims=True).reshape(bias.shape)
    _exactly_zero_where("dbias", got["dbias"], dead)


@SLOW
@timeout(150)
@budget(2, 40)
@given(case=attention_cases(dtypes=("float32", "bfloat16"), max_work=WORK, masks=LENGTH_MASKS,
                            out_of_range=True),
       implementation=IMPLEMENTATIONS)
@example(case=AttnCase(2, 300, 300, 2, 1, 16, mask=MaskSpec(kv_lengths=(-3, 345), q_lengths=(301, -1))),
         implementation="xla")
def test_traced_lengths_are_clamped(case, implementation):
  """Under jit, lengths outside [0, len] compute exactly (bit for bit) the call with the
  lengths clamped to [0, len], which matches the reference."""
  x, bias = case.inputs(), case.bias_array()
  run = jax.jit(vjp_fn(case.attention_fn(implementation=implementation), x.do))
  raw = named(*run(x.q, x.k, x.v, bias, case.mask_arg()))
  clamped = named(*run(x.q, x.k, x.v, bias, case.mask_arg(clamp=True)))
  for name in raw:
    if raw[name] is not None:
      np.testing.assert_array_equal(np.asarray(raw[name]), np.asarray(clamped[name]),
                                    err_msg=f"{name}: out-of-range lengths differ from clamped ones: {case}")
  assert_matches(raw, ref_named(case, x, bias), case.dtype, what=f"{case.regime} clamped lengths: {case}")


@SLOW
@timeout(150)
@budget(2, 30)
@given(case=attention_cases(max_work=WORK // 2, dtypes=("float64",)), api=APIS,
       implementation=IMPLEMENTATIONS, jvp=st.booleans())
@example(case=AttnCase(1, 40, 40, 2, 1, 16, dtype="float64", mask=MaskSpec(causal=0)),
         api="dot_product_attention", implementation=None, jvp=False)
@example(case=AttnCase(1, 300, 300, 1, 1, 8, dtype="float64", score_mod="block_row"),  # flash: int64 indices
         api="flex_attention", implementation=None, jvp=False)
def test_float64(case, api, implementation, jvp):
  """Under jax.enable_x64, float64 inputs are computed in float64 (float64 bounds, 1e-9)."""
  with jax.enable_x64(True):
    x, bias = case.inputs(), case.bias_array()
    f = case.attention_fn(api=api_for(case, api), implementation=implementation)
    if jvp:
      tan = {"q": x.do}
      out, t = jax.jvp(lambda q: f(q, x.k, x.v, bias, case.mask_arg()), (x.q,), (x.do,))
      assert out.dtype == jnp.float64 and t.dtype == jnp.float64
      ref_out, ref_t = reference_jvp(x.q, x.k, x.v, tan, bias=bias, **case.reference_kwargs())
      assert_matches(dict(out=out, tangent=t), dict(out=ref_out, tangent=ref_t), "float64",
                     what=f"{case.regime} float64 jvp: {case}")
      return
    got = named(*vjp_fn(f, x.do)(x.q, x.k, x.v, bias, case.mask_arg()))
    assert got["out"].dtype == jnp.float64
    assert_matches(got, ref_named(case, x, bias), "float64", what=f"{case.regime} float64: {case}")


# -- the kernels in Pallas interpret mode -----------------------------------------------------
SMALL = (1, 5, 16, 63, 64, 65)


def kernel_check(case: AttnCase, *, implementation, transform: str, jit: bool, **kw):
  """The kernel call (``kw``: interpret, backward_pass_impl) against the reference: its output
  and vjp, or its output and jvp in q (through the exact XLA formulation's tangent)."""
  x = case.inputs()
  f = case.attention_fn(api="flex_attention" if case.mask.dense is None and not case.is_causal
                        else "dot_product_attention", implementation=implementation, **kw)
  mask = case.mask_arg()
  what = f"{implementation or 'default'} {transform}{' (jit)' if jit else ''} {kw}: {case}"
  if transform == "vjp":
    run = jax.jit(vjp_fn(f, x.do)) if jit else vjp_fn(f, x.do)
    got = named(*run(x.q, x.k, x.v, None, mask))
    assert got["out"].dtype == x.q.dtype
    assert_matches(got, ref_named(case, x, None), case.dtype, what=what)
    if jit and case.mask.has_lengths:  # traced lengths (drawn in [-5, len + 5]): exactly the clamped call
      clamped = named(*run(x.q, x.k, x.v, None, case.mask_arg(clamp=True)))
      for name, g in got.items():
        np.testing.assert_array_equal(np.asarray(g), np.asarray(clamped[name]),
                                      err_msg=f"{name}: out-of-range lengths differ from clamped ones: {what}")
  else:
    run = lambda q, k, v, t, mask: jax.jvp(lambda q: f(q, k, v, None, mask), (q,), (t,))
    out, t = (jax.jit(run) if jit else run)(x.q, x.k, x.v, x.do, mask)
    ref_out, ref_t = reference_jvp(x.q, x.k, x.v, {"q": x.do}, **case.reference_kwargs())
    assert_matches(dict(out=out, tangent=t), dict(out=ref_out, tangent=ref_t), case.dtype, what=what)


@st.composite
def kernel_calls(draw, *, lengths, dtypes, head_dims, max_work, heads=HEADS, scales=(None, 0.3, -0.2, 1.0)):
  """``(case, jit)`` for a kernel: position masks only, no bias, score modifiers the kernels
  trace; under jit, lengths may lie out of range (clamped)."""
  jit = draw(st.booleans())
  case = draw(attention_cases(lengths=lengths, dtypes=dtypes, head_dims=head_dims, heads=heads,
                              masks=POSITION_MASKS, biases=(), score_mods=KERNEL_SCORE_MODS,
                              is_causal=True, max_work=max_work, out_of_range=jit, scales=scales))
  return case, jit


@SLOW
@timeout(150)
@budget(2, 12)
@given(call=kernel_calls(lengths=SMALL, dtypes=("float32", "bfloat16"), head_dims=(16, 32),
                         max_work=65 * 65 * 4 * 32),
       implementation=st.sampled_from(["triton", None]), transform=st.sampled_from(["vjp", "jvp"]))
def test_triton_interpret(call, implementation, transform):
  """The Triton kernel (explicit, or the default's pick with interpret=True) in interpret mode."""
  case, jit = call
  kernel_check(case, implementation=implementation, transform=transform, jit=jit, interpret=True)


@pytest.mark.thorough
@pytest.mark.timeout(1800)
@budget(0, 40, slow=True)
@given(call=kernel_calls(lengths=(1, 5, 16, 63, 64, 65, 127, 200, 257, 300), dtypes=("float32", "bfloat16", "float16"),
                         head_dims=(8, 16, 32, 64), max_work=300 * 300 * 4 * 32),
       implementation=st.sampled_from(["triton", None]), transform=st.sampled_from(["vjp", "jvp"]),
       backward=st.sampled_from(["auto", "triton_split", "triton_fused", "triton_onepass"]))
def test_triton_interpret_thorough(selected_slow, call, implementation, transform, backward):
  case, jit = call
  kernel_check(case, implementation=implementation, transform=transform, jit=jit, interpret=True,
               backward_pass_impl=backward)


MOSAIC_KV_CACHE = AttnCase(1, 64, 64, 2, 1, 64, dtype="bfloat16", mask=MaskSpec(causal=0))
# Segment ids at q_len = kv_len = 1: the backward's grids may not reach past the mask's tiles,
# whose precomputed segment ranges the kernels index by grid position.
MOSAIC_ONE_TOKEN_DOCS = AttnCase(2, 1, 1, 2, 1, 64, dtype="bfloat16", mask=MaskSpec(segments=(2, 0)))


# Interpret-mode Mosaic runs warpgroups as threads that can deadlock inside XLA callbacks, where a
# signal cannot interrupt them: the thread method ends the run loudly instead of hanging it.
@pytest.mark.thorough
@pytest.mark.timeout(900, method="thread")
@budget(0, 8, slow=True)
@given(call=kernel_calls(lengths=(1, 64, 65, 150), dtypes=("bfloat16", "float16"), head_dims=(64,),
                         heads=((1, 1), (2, 1), (2, 2)), max_work=150 * 150 * 2 * 64,
                         scales=(None, 0.3, 1.0)),  # the Mosaic kernel refuses a negative scale
       transform=st.sampled_from(["vjp", "jvp"]), backward=st.sampled_from(["auto", "mosaic"]))
@example(call=(MOSAIC_KV_CACHE, True), transform="vjp", backward="mosaic")
@example(call=(MOSAIC_ONE_TOKEN_DOCS, False), transform="vjp", backward="mosaic")
def test_mosaic_interpret_thorough(selected_slow, call, transform, backward):
  """The Mosaic GPU forward (with the Triton or the Mosaic backward) in interpret mode."""
  case, jit = call
  kernel_check(case, implementation="mosaic", transform=transform, jit=jit, interpret=True,
               backward_pass_impl=backward)
