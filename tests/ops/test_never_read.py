"""What no op may read, and indices out of range, for every op that takes indices.

* attention: rows with no valid key under a mask that is a constant of the jitted program
  (XLA:CPU folded it and miscomputed the empty tile's dq). NaN past the lengths, segment ids
  of any value and bad arguments are cases of the attention conformance suite
  (tests/ops/attention/conformance.py), run for every backend;
* mla: ``page_table`` entries outside the pool (concrete: ValueError; traced: clamped, never
  read outside the pool, on the XLA path and the decode kernel alike); NaN past the lengths;
* grouped matmul: inf/NaN weights of a group that gets no rows, NaN rows past the groups,
  traced group sizes out of range;
* bad arguments that must be refused with the argument named.

Values are checked against the float64 references of the ops; bounds come from
:mod:`probjax.core.tolerances`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from probjax.core.tolerances import max_error, tolerance
from probjax.ops.attention import masks as M
from probjax.ops.grouped_matmul import grouped_matmul
from probjax.ops.grouped_matmul.reference import reference as grouped_matmul_reference
from probjax.ops.mla import mla
from probjax.ops.mla.reference import reference_mla


def _normal(rng, *shape, dtype=jnp.float32):
  return jnp.asarray(rng.standard_normal(shape), dtype)


# -- attention ------------------------------------------------------------------------------
def test_attention_empty_rows_with_a_constant_mask_have_zero_finite_gradients():
  """Every row empty (kv length 0) under a mask closed over by jit, one 512-row flash tile:
  each fresh compilation (the miscompile showed in about half of them) gives zero gradients."""
  from probjax.nn.layers.attention import dot_product_attention
  rng = np.random.default_rng(1)
  ids = jnp.asarray(np.sort(rng.integers(0, 22, 512))[None], jnp.int32)
  mask = M.SegmentMask(ids) & M.KVLenMask(jnp.asarray([0], jnp.int32)) & M.LocalWindowMask(1, 10)
  q, do = _normal(rng, 1, 512, 6, 64), _normal(rng, 1, 512, 6, 64)
  k, v = _normal(rng, 1, 512, 2, 64), _normal(rng, 1, 512, 2, 64)
  for _ in range(3):  # a new program each time
    attn = lambda q, k, v: dot_product_attention(q, k, v, mask=mask, implementation="xla")
    grads = jax.jit(lambda q, k, v, do: jax.vjp(attn, q, k, v)[1](do))(q, k, v, do)
    for name, g in zip(("dq", "dk", "dv"), grads):
      assert np.all(np.asarray(g) == 0), f"{name}: max |.| {np.nanmax(np.abs(np.asarray(g)))}"


# -- mla ------------------------------------------------------------------------------------
def _mla_pool(rng, batch=2, pages=4, page_size=16, dc=16, dr=16, heads=2, dn=4, dv=3):
  qn, qr = _normal(rng, batch, 1, heads, dn), _normal(rng, batch, 1, heads, dr)
  wuk, wuv = _normal(rng, dc, heads, dn), _normal(rng, dc, heads, dv)
  return qn, qr, _normal(rng, pages, page_size, dc), _normal(rng, pages, page_size, dr), wuk, wuv


@pytest.mark.parametrize("entry", [7, 4, -1])
def test_mla_concrete_page_table_out_of_range_is_refused(entry):
  args = _mla_pool(np.random.default_rng(0))
  mask = M.KVLenMask(jnp.asarray([20, 20], jnp.int32))
  with pytest.raises(ValueError, match=r"page_table .*\[0, 4\)"):
    mla(*args, mask=mask, page_table=jnp.asarray([[0, 1], [2, entry]], jnp.int32))


@pytest.mark.parametrize("implementation", [None, "triton"])
def test_mla_traced_page_table_is_clamped_into_the_pool(implementation):
  """Under jit an entry below 0 reads page 0 and one past the pool its last page, on the XLA
  path and in the decode kernel (interpret mode here) alike."""
  args = _mla_pool(np.random.default_rng(1))
  mask = M.KVLenMask(jnp.asarray([20, 30], jnp.int32))
  kw = {} if implementation is None else dict(form="absorbed", implementation=implementation)
  f = jax.jit(lambda t: mla(*args, mask=mask, page_table=t, **kw))
  bad = f(jnp.asarray([[0, -5], [2, 9]], jnp.int32))
  clamped = f(jnp.asarray([[0, 0], [2, 3]], jnp.int32))
  np.testing.assert_array_equal(bad, clamped)


def test_mla_paged_nan_past_lengths_is_never_read():
  """NaN in the pool's pages past each sequence's length (and in pages no sequence uses)
  reaches no output or gradient; values match the float64 reference on the gathered cache."""
  rng = np.random.default_rng(3)
  qn, qr, lat, rope, wuk, wuv = _mla_pool(rng, pages=5)
  lengths = jnp.asarray([20, 7], jnp.int32)
  table = jnp.asarray([[3, 1], [0, 2]], jnp.int32)
  poison = np.zeros((5, 16, 1), bool)
  poison[1, 4:] = poison[0, 7:] = poison[2] = poison[4] = True  # past 20 in seq 0, past 7 in seq 1
  lat, rope = (jnp.where(poison, jnp.nan, x) for x in (lat, rope))
  mask = M.KVLenMask(lengths)
  f = lambda qn, qr, wuk, wuv: mla(qn, qr, lat, rope, wuk, wuv, mask=mask, page_table=table)
  out, pull = jax.vjp(f, qn, qr, wuk, wuv)
  grads = pull(jnp.ones_like(out))
  for x in (out, *grads):
    assert np.all(np.isfinite(np.asarray(x)))
  gather = lambda p: jnp.nan_to_num(p[table.reshape(-1)].reshape(2, 32, -1))
  ref = reference_mla(qn, qr, gather(lat), gather(rope), wuk, wuv, mask=mask)
  assert max_error(out, ref) <= tolerance(jnp.float32)


@pytest.mark.parametrize("bad, exc, name", [(dict(scale="big"), TypeError, "scale"),
                                            (dict(scale=float("inf")), ValueError, "scale")])
def test_mla_bad_scale_names_the_argument(bad, exc, name):
  args = _mla_pool(np.random.default_rng(0))
  with pytest.raises(exc, match=name):
    mla(*args, mask=M.KVLenMask(jnp.asarray([20, 20], jnp.int32)),
        page_table=jnp.asarray([[0, 1], [2, 3]], jnp.int32), **bad)


# -- grouped matmul -------------------------------------------------------------------------
IMPLS = [pytest.param("xla", id="xla"), pytest.param("triton", id="triton-interpret")]


def _gmm(impl, *a, **kw):
  return grouped_matmul(*a, implementation=impl, interpret=impl == "triton", **kw)


@pytest.mark.parametrize("impl", IMPLS)
def test_grouped_matmul_nonfinite_weights_of_an_empty_group_are_never_read(impl):
  """The reproducer: group 1 gets no rows and holds inf; rows of group 0 are 3, the rows past
  the groups 0, and d_lhs finite."""
  rhs = jnp.ones((2, 3, 2)).at[1].set(jnp.inf)
  sizes = jnp.asarray([4, 0], jnp.int32)
  out = _gmm(impl, jnp.ones((6, 3)), rhs, sizes)
  np.testing.assert_array_equal(out[:, 0], [3, 3, 3, 3, 0, 0])
  d_lhs, d_rhs = jax.grad(lambda l, r: _gmm(impl, l, r, sizes).sum(), argnums=(0, 1))(jnp.ones((6, 3)), rhs)
  np.testing.assert_array_equal(d_lhs, np.r_[np.full((4, 3), 2.0), np.zeros((2, 3))])
  np.testing.assert_array_equal(d_rhs[1], 0)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("transpose_rhs", [False, True])
def test_grouped_matmul_nonfinite_group_reaches_only_its_own_rows(impl, transpose_rhs):
  """NaN weights in a group that has rows make those rows NaN and no other; NaN rows of lhs
  past the groups reach no output or gradient. Other rows match the float64 reference."""
  rng = np.random.default_rng(4)
  m, k, n, sizes = 45, 8, 16, np.asarray([10, 0, 17, 12], np.int32)  # 6 rows past the groups
  lhs = _normal(rng, m, k).at[39:].set(jnp.nan)
  rhs = _normal(rng, 4, n, k) if transpose_rhs else _normal(rng, 4, k, n)
  rhs = rhs.at[1].set(jnp.inf).at[2, 0, 0].set(jnp.nan)  # empty group 1; group 2 has rows
  out = np.asarray(_gmm(impl, lhs, rhs, jnp.asarray(sizes), transpose_rhs=transpose_rhs))
  assert np.isnan(out[10:27, 0]).all()                   # group 2's rows meet its NaN weight (column 0)
  w = np.asarray(rhs, np.float64)
  ref = grouped_matmul_reference(np.nan_to_num(np.asarray(lhs, np.float64)), np.nan_to_num(w, posinf=0), sizes,
                                 transpose_rhs=transpose_rhs)
  keep = np.r_[np.ones(10, bool), np.zeros(17, bool), np.ones(18, bool)]  # groups 0, 3 and past
  assert max_error(out[keep], np.asarray(ref)[keep]) <= tolerance(jnp.float32)
  np.testing.assert_array_equal(out[39:], 0)


@pytest.mark.parametrize("impl", IMPLS)
def test_grouped_matmul_traced_group_sizes_out_of_range_are_clamped(impl):
  """Under jit, negative sizes count as zero and groups are cut at the last row."""
  rng = np.random.default_rng(5)
  lhs, rhs = _normal(rng, 20, 8), _normal(rng, 3, 8, 16)
  f = jax.jit(lambda s: _gmm(impl, lhs, rhs, s))
  np.testing.assert_array_equal(f(jnp.asarray([-4, 12, 30], jnp.int32)), f(jnp.asarray([0, 12, 8], jnp.int32)))


@pytest.mark.parametrize("kw, exc, name", [
    (dict(preferred_element_type=jnp.int32), TypeError, "preferred_element_type"),
    (dict(preferred_element_type="nonsense"), TypeError, "preferred_element_type"),
])
def test_grouped_matmul_bad_arguments_name_the_argument(kw, exc, name):
  with pytest.raises(exc, match=name):
    grouped_matmul(jnp.ones((6, 3)), jnp.ones((2, 3, 2)), jnp.asarray([4, 0], jnp.int32), **kw)


def test_grouped_matmul_concrete_group_sizes_out_of_range_are_refused():
  for sizes, msg in (([-1, 3], "non-negative"), ([4, 3], "sum to 7")):
    with pytest.raises(ValueError, match=msg):
      grouped_matmul(jnp.ones((6, 3)), jnp.ones((2, 3, 2)), jnp.asarray(sizes, jnp.int32))
