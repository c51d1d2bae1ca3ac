"""Eager (un-jitted) calls of the ops compile once per call description (probjax.core.eager):
a repeated call of the same shapes and configuration compiles nothing, different shapes, masks
and mask values still compute their own (correct) values, traced calls are unchanged, and the
checks that read concrete values still run on every eager call."""

from __future__ import annotations

import contextlib

import jax
import jax.monitoring
import jax.numpy as jnp
import numpy as np
import pytest

from probjax.core import eager
from probjax.ops.attention import (CausalMask, KVLenMask, LocalWindowMask, SegmentMask, dot_product_attention,
                                   flex_attention)
from probjax.ops.attention import api
from probjax.ops.attention.reference import reference_attention

COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


@contextlib.contextmanager
def compilations():
  """A list that collects one entry per XLA compilation while the block runs."""
  seen: list[str] = []

  def listener(event, duration, **kw):
    if event == COMPILE_EVENT:
      seen.append(event)
  jax.monitoring.register_event_duration_secs_listener(listener)
  try:
    yield seen
  finally:
    jax.monitoring.unregister_event_duration_listener(listener)


def _inputs(seed, b, tq, tk, h, hkv, d, dtype=jnp.float32):
  ks = jax.random.split(jax.random.key(seed), 3)
  return (jax.random.normal(ks[0], (b, tq, h, d), dtype), jax.random.normal(ks[1], (b, tk, hkv, d), dtype),
          jax.random.normal(ks[2], (b, tk, hkv, d), dtype))


def _repeat_compiles(f, n=3):
  """Compilations during ``n`` calls of ``f`` after two warm-up calls (the first Pallas call of
  a process registers a config option that jit keys on, so a kernel may compile twice)."""
  jax.block_until_ready(f())
  jax.block_until_ready(f())
  with compilations() as seen:
    for _ in range(n):
      jax.block_until_ready(f())
  return len(seen)


# -- attention ------------------------------------------------------------------------------
@pytest.mark.parametrize("mask", [None, CausalMask(), KVLenMask(jnp.array([300, 170]))], ids=["none", "causal", "kv_len"])
def test_repeated_eager_attention_compiles_nothing(mask):
  q, k, v = _inputs(0, 2, 300, 300, 4, 2, 32)  # the flash formulation (lax.map over tiles)
  before = api._compute_once.cache_info()
  assert _repeat_compiles(lambda: dot_product_attention(q, k, v, mask=mask)) == 0
  after = api._compute_once.cache_info()
  assert after.traces - before.traces <= 1 and after.hits - before.hits >= 4


def test_repeated_eager_flex_attention_and_lse_compile_nothing():
  q, k, v = _inputs(1, 1, 260, 260, 2, 2, 16)
  capped = lambda: dot_product_attention(q, k, v, is_causal=True, logits_soft_cap=30.0)  # a new modifier per call
  assert _repeat_compiles(capped) == 0
  assert _repeat_compiles(lambda: dot_product_attention(q, k, v, return_lse=True)) == 0
  assert _repeat_compiles(lambda: flex_attention(q, k, v, mask=LocalWindowMask(40, 0))) == 0


def test_shapes_masks_and_mask_values_compute_their_own_values():
  # One description, several mask values (the arrays are arguments, never baked in); then other
  # shapes and masks: each result is the reference's.
  cases = [((2, 300, 300, 4, 2, 32), KVLenMask(jnp.array([300, 120]))),
           ((2, 300, 300, 4, 2, 32), KVLenMask(jnp.array([7, 299]))),
           ((2, 300, 300, 4, 2, 32), KVLenMask(np.array([150, 0], np.int32))),
           ((2, 300, 300, 4, 2, 32), CausalMask()),
           ((2, 300, 300, 4, 2, 32), None),
           ((1, 320, 280, 2, 1, 16), CausalMask() & KVLenMask(jnp.array([200]))),
           ((1, 320, 280, 2, 1, 16), LocalWindowMask(30, 10)),
           ((2, 300, 300, 2, 2, 16), SegmentMask(jnp.repeat(jnp.arange(6)[None], 2, 0).repeat(50, 1))),
           ((2, 40, 50, 2, 2, 8), None)]  # dense formulation
  for i, (shape, mask) in enumerate(cases):
    q, k, v = _inputs(i, *shape)
    got = np.asarray(dot_product_attention(q, k, v, mask=mask))
    want = reference_attention(q, k, v, mask=mask)
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=2e-5, err_msg=f"case {i}: {shape} {mask}")
    if i in (1, 5):
      jitted = jax.jit(lambda q, k, v: dot_product_attention(q, k, v, mask=mask))(q, k, v)
      np.testing.assert_allclose(got, np.asarray(jitted), atol=2e-6, rtol=2e-6, err_msg=f"case {i}: eager against jitted")


def test_other_arguments_are_part_of_the_description():
  # A scale, a bias, a dense mask, dropout: each its own computation, each correct.
  q, k, v = _inputs(3, 1, 270, 270, 2, 2, 16)
  out = lambda **kw: np.asarray(dot_product_attention(q, k, v, **kw))
  np.testing.assert_allclose(out(scale=0.1), reference_attention(q, k, v, scale=0.1), atol=2e-5)
  np.testing.assert_allclose(out(scale=0.2), reference_attention(q, k, v, scale=0.2), atol=2e-5)
  bias = jax.random.normal(jax.random.key(9), (1, 2, 270, 270))
  np.testing.assert_allclose(out(bias=bias), reference_attention(q, k, v, bias=bias), atol=2e-5)
  np.testing.assert_allclose(out(bias=2 * bias), reference_attention(q, k, v, bias=2 * bias), atol=2e-5)
  dense = jax.random.bernoulli(jax.random.key(5), 0.7, (1, 1, 270, 270))
  np.testing.assert_allclose(out(mask=dense), reference_attention(q, k, v, dense_mask=dense), atol=2e-5)
  drop = lambda seed: out(dropout_rate=0.3, dropout_rng=jax.random.key(seed))
  assert not np.allclose(drop(0), drop(1))  # the rng is an argument, not a constant
  np.testing.assert_array_equal(drop(0), drop(0))


def test_concrete_values_are_still_checked_on_every_eager_call():
  q, k, v = _inputs(4, 2, 300, 300, 2, 2, 16)
  dot_product_attention(q, k, v, mask=KVLenMask(jnp.array([300, 10])))
  with pytest.raises(ValueError, match="kv_lengths"):
    dot_product_attention(q, k, v, mask=KVLenMask(jnp.array([301, 10])))


def test_traced_calls_run_as_they_are():
  q, k, v = _inputs(5, 1, 300, 300, 2, 2, 16)
  before = api._compute_once.cache_info()
  jax.jit(lambda q: dot_product_attention(q, k, v, mask=CausalMask()))(q).block_until_ready()
  jax.grad(lambda q: dot_product_attention(q, k, v).sum())(q).block_until_ready()
  after = api._compute_once.cache_info()
  assert after.entries == before.entries and after.misses == before.misses and after.bypassed >= before.bypassed + 2


def test_a_modifier_closing_over_a_traced_array_is_differentiated():
  # q, k, v concrete, the ALiBi slopes traced by grad (closed over by score_mod): the call is
  # under a transformation, so it runs as it is, and the slopes' gradient is the reference's.
  q, k, v = _inputs(6, 1, 280, 280, 2, 2, 16)
  def loss(slopes, f):
    mod = lambda s, b, h, qi, ki: s - slopes[h] * jnp.abs(qi - ki)
    return f(q, k, v, mod).sum()
  ours = lambda q, k, v, mod: dot_product_attention(q, k, v, score_mod=mod)
  ref = lambda q, k, v, mod: jnp.asarray(reference_attention(q, k, v, score_mod=mod), jnp.float32)
  slopes = jnp.array([0.1, 0.02])
  g = jax.grad(loss)(slopes, ours)
  eps = 1e-3
  for h in range(2):
    e = jnp.zeros(2).at[h].set(eps)
    fd = (loss(slopes + e, ref) - loss(slopes - e, ref)) / (2 * eps)
    np.testing.assert_allclose(float(g[h]), float(fd), rtol=2e-2, atol=2e-2)


# -- the other ops ---------------------------------------------------------------------------
def test_repeated_eager_mla_compiles_nothing():
  from probjax.ops.mla import mla
  ks = jax.random.split(jax.random.key(0), 6)
  b, t, s, h, dn, dr, dc, dv = 1, 280, 280, 2, 16, 8, 32, 16
  args = [jax.random.normal(kk, sh) for kk, sh in zip(ks, [(b, t, h, dn), (b, t, h, dr), (b, s, dc), (b, s, dr),
                                                          (dc, h, dn), (dc, h, dv)])]
  mask = CausalMask() & KVLenMask(jnp.array([250]))
  for form in ("expanded", "absorbed"):
    assert _repeat_compiles(lambda: mla(*args, mask=mask, form=form, return_lse=True)) == 0, form
  out, lse = mla(*args, mask=mask, return_lse=True)
  want = jax.jit(lambda *a: mla(*a, mask=mask, return_lse=True))(*args)
  np.testing.assert_allclose(np.asarray(out), np.asarray(want[0]), atol=1e-5)
  np.testing.assert_allclose(np.asarray(lse), np.asarray(want[1]), atol=1e-5)


def test_repeated_eager_grouped_matmul_compiles_nothing():
  from probjax.ops.grouped_matmul import grouped_matmul
  lhs = jax.random.normal(jax.random.key(0), (64, 32))
  rhs = jax.random.normal(jax.random.key(1), (4, 32, 16))
  sizes = jnp.array([10, 20, 30, 4], jnp.int32)
  assert _repeat_compiles(lambda: grouped_matmul(lhs, rhs, sizes)) == 0
  # New sizes, same description: the sizes are an argument.
  for s in ([0, 64, 0, 0], [5, 5, 5, 5], [30, 0, 30, 4]):
    s = jnp.array(s, jnp.int32)
    want = jax.jit(grouped_matmul)(lhs, rhs, s)
    np.testing.assert_allclose(np.asarray(grouped_matmul(lhs, rhs, s)), np.asarray(want), atol=1e-5)
    rows = np.repeat(np.arange(4), np.asarray(s))
    ref = np.zeros((64, 16), np.float32)
    ref[:len(rows)] = np.einsum("mk,mkn->mn", np.asarray(lhs)[:len(rows)], np.asarray(rhs)[rows])
    np.testing.assert_allclose(np.asarray(grouped_matmul(lhs, rhs, s)), ref, atol=1e-4)


@pytest.mark.parametrize("implementation", [None, "scan", "chunked"])
def test_repeated_eager_scans_compile_nothing(implementation):
  from probjax.ops.scan import mamba_scan, residual_linear_attention, ssd_scan
  r = lambda i, s: jax.random.normal(jax.random.key(i), s)
  x, b_ = r(0, (2, 64, 8)), r(1, (2, 64, 4))
  a = -jnp.exp(r(2, (8, 4)))
  xs, dts, bs = r(3, (2, 64, 2, 8)), r(4, (2, 64, 2)), r(5, (2, 64, 1, 4))
  calls = {
      "mamba": lambda: mamba_scan(x, x, a, b_, b_, jnp.ones(8), implementation=implementation),
      "ssd": lambda: ssd_scan(xs, dts, -jnp.ones(2), bs, bs, implementation=implementation),
      "rla": lambda: residual_linear_attention(xs, xs, xs, window_size=4, implementation=implementation),
  }
  for name, f in calls.items():
    assert _repeat_compiles(f) == 0, name
  # Other inputs of the same shapes: their own values (the jitted call's).
  x2 = r(9, x.shape)
  np.testing.assert_allclose(np.asarray(mamba_scan(x2, x, a, b_, b_, implementation=implementation)),
                             np.asarray(jax.jit(lambda x2: mamba_scan(x2, x, a, b_, b_, implementation=implementation))(x2)),
                             atol=1e-5)


def test_an_invalid_implementation_still_raises_eagerly():
  from probjax.ops.scan import mamba_scan
  x = jnp.ones((1, 8, 4))
  for _ in range(2):
    with pytest.raises(ValueError, match="implementation"):
      mamba_scan(x, x, -jnp.ones((4, 2)), jnp.ones((1, 8, 2)), jnp.ones((1, 8, 2)), implementation="nope")


# -- the helper itself ----------------------------------------------------------------------
def test_compile_once_keys_on_the_static_description():
  @eager.compile_once
  def f(n, x, *, scale=1.0, mask=None, note=None):
    del note
    y = jax.lax.scan(lambda c, xi: (c + xi * scale, c), 0.0, x)[0]
    return y * n if mask is None else y * n + mask.sum()

  x = jnp.arange(5.0)
  assert float(f(2, x)) == float(f(2, x)) == 20.0
  assert f.cache_info().traces == 1 and f.cache_info().hits == 1
  assert float(f(2, x + 1)) == 30.0 and f.cache_info().traces == 1  # new values: no new trace
  assert float(f(2, np.arange(5.0))) == 20.0  # numpy arrays are arguments too
  assert float(f(2.0, x)) == 20.0 and f.cache_info().entries == 2  # 2.0 is not 2 (the type is in the key)
  assert float(f(2, x, scale=0.5)) == 10.0 and f.cache_info().entries == 3
  assert float(f(2, x, mask=jnp.ones(3))) == 23.0 and float(f(2, x, mask=jnp.zeros(3))) == 20.0
  assert f.cache_info().entries == 4
  assert float(f(2, jnp.arange(6.0))) == 30.0 and f.cache_info().entries == 4  # a new shape: jit retraces
  bypassed = f.cache_info().bypassed
  assert float(jax.jit(lambda x: f(2, x))(x)) == 20.0  # traced: runs as it is
  assert float(f(2, x, note={"a set is not hashable"})) == 20.0
  assert f.cache_info().bypassed == bypassed + 2 and f.cache_info().entries == 4
  f.cache_clear()
  assert f.cache_info() == eager.CacheInfo(0, 0, 0, 0, 0)
  assert f.__wrapped__.__name__ == "f"


def test_compile_once_drops_the_least_recently_used():
  @eager.compile_once(max_entries=2)
  def f(n, x):
    return x * n

  x = jnp.ones(2)
  for n in (1, 2, 1, 3):
    f(n, x)
  assert f.cache_info().entries == 2
  f(2, x)  # dropped when 3 came: traced again
  assert f.cache_info().traces == 4 and f.cache_info().misses == 4
  name = "test_eager_cache.test_compile_once_drops_the_least_recently_used.<locals>.f"
  assert eager.caches()[name] == f.cache_info()
