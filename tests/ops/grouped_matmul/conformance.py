"""One conformance suite for every grouped matmul backend: the cases each backend must pass, once.

:class:`GroupedMatmulConformance` holds the cases; test_grouped_matmul.py subclasses it once per
backend of :data:`probjax.ops.grouped_matmul.REGISTRY` (``class TestXlaConformance(...)``), naming
the backend (``implementation``), the dtype it is tested at, the shapes that reach each of its
code paths and the calls it refuses. Every check is against the float64 reference
(:mod:`probjax.ops.grouped_matmul.reference`), with the bounds of :mod:`probjax.core.tolerances`.
Kernels run in Pallas interpret mode off the GPU.

The cases (``test_<name>[<id>]``):

=========================  ======================================================================
test_values_and_grads      out, d_lhs, d_rhs at each of ``shapes`` (odd M, K, N; empty groups;
                           rows past the groups), both rhs layouts; inf in an empty group's
                           weights and NaN in the rows past the groups are never read: exact
                           zeros there (output, d_lhs, the empty group's d_rhs)
test_low_precision         ``low_precision`` operands, and float32 output of them
test_jvp                   jax.jvp against the reference's (linear in each operand)
test_zero_sizes            a zero dimension (K, M, N or no group): zeros and zero gradients
test_traced_group_sizes    under jit negative sizes count as zero, groups are cut at row M
test_vmap                  vmap over the group sizes
test_bad_inputs            refused with ValueError/TypeError naming the argument
test_refusals              a call the backend cannot compute, requested: ValueError with the reason
=========================  ======================================================================
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from probjax.core.tolerances import max_error, tolerance
from probjax.ops.grouped_matmul import grouped_matmul
from probjax.ops.grouped_matmul.reference import reference, reference_vjp
from probjax.testing import interpret_kernels
from tests.ops.conformance import Conformance

# (id, arguments of grouped_matmul changed from good ones, exception, pattern of the message)
BAD_INPUTS = [
    ("group_sizes_length", dict(group_sizes=[3, 3, 4]), ValueError, "group_sizes must have shape"),
    ("group_sizes_rank", dict(group_sizes=[[3, 7]]), ValueError, "group_sizes must have rank 1"),
    ("group_sizes_float", dict(group_sizes=np.array([3.0, 7.0], np.float32)), TypeError, "group_sizes must be an integer"),
    ("group_sizes_negative", dict(group_sizes=[-1, 7]), ValueError, "group_sizes must be non-negative"),
    ("group_sizes_sum", dict(group_sizes=[4, 7]), ValueError, "group_sizes sum to 11"),
    ("lhs_int", dict(lhs=np.ones((10, 4), np.int32)), TypeError, "lhs must be a floating"),
    ("rhs_rank", dict(rhs=np.ones((4, 6), np.float32)), ValueError, "rhs must have rank 3"),
    ("transpose_rhs", dict(transpose_rhs=True), ValueError, "does not contract"),
    ("preferred_element_type", dict(preferred_element_type=jnp.int32), TypeError, "preferred_element_type"),
    ("implementation", dict(implementation="cuda"), ValueError, "unknown .*cuda"),
]


def inputs(m, k, n, sizes, dtype, transpose_rhs=False, seed=0):
  """``lhs, rhs, group_sizes, d_out`` (fresh normals, drawn by NumPy: no compilation per shape;
  float32 cast to ``dtype``)."""
  rng = np.random.default_rng(seed)
  g = len(sizes)
  normal = lambda *shape: jnp.asarray(rng.standard_normal(shape, np.float32)).astype(dtype)
  lhs, rhs = normal(m, k), normal(*((g, n, k) if transpose_rhs else (g, k, n)))
  return lhs, rhs, jnp.asarray(sizes, jnp.int32), normal(m, n)


def plant(lhs, rhs, sizes):
  """inf in every empty group's weights, NaN in the rows of ``lhs`` past the groups."""
  for g, s in enumerate(sizes):
    if s == 0:
      rhs = rhs.at[g].set(jnp.inf)
  return lhs.at[sum(sizes):].set(jnp.nan), rhs


class GroupedMatmulConformance(Conformance):
  """The shared cases; subclass per backend and set the attributes."""

  implementation: str = ""
  dtype = jnp.float32              # operands of the value and gradient cases
  # id -> (M, K, N, group sizes): the shapes of test_values_and_grads, one per code path.
  shapes = {
      "ragged": (150, 70, 40, [37, 0, 64, 30]),    # M, K, N off every tile, an empty group, a tail
      "one_group": (96, 48, 24, [0, 96, 0]),        # one group holding every row
      "tail_rows": (77, 20, 33, [10, 0, 0, 50]),    # rows past the groups, two empty groups
      "short_k": (40, 3, 17, [12, 28]),             # a contraction shorter than a tile
  }
  low_precision = (jnp.bfloat16,)
  low_precision_shape = "ragged"
  small = (30, 16, 8)              # M, K, N of the traced-sizes and vmap cases
  refusals: tuple = ()             # (id, keyword arguments, (M, K, N), dtype, message pattern)
  tf32 = False

  # -- the backend --------------------------------------------------------------------------
  def gmm(self, lhs, rhs, group_sizes, **kw):
    kw.setdefault("implementation", self.implementation)
    kw.setdefault("interpret", kw["implementation"] != "xla" and interpret_kernels())
    return grouped_matmul(lhs, rhs, group_sizes, **kw)

  def values_and_grads(self, lhs, rhs, sizes, d_out, **kw):
    def f(lhs, rhs, sizes, d_out):
      out, pull = jax.vjp(lambda a, b: self.gmm(a, b, sizes, **kw), lhs, rhs)
      return (out, *pull(d_out))
    return jax.jit(f)(lhs, rhs, sizes, d_out)

  def check(self, m, k, n, sizes, *, dtype=None, transpose_rhs=False, planted=False, **kw):
    dtype = dtype or self.dtype
    out_dtype = kw.get("preferred_element_type") or dtype
    lhs, rhs, gs, d_out = inputs(m, k, n, sizes, dtype, transpose_rhs, seed=m + k + n)
    d_out = d_out.astype(out_dtype)
    if planted:
      lhs, rhs = plant(lhs, rhs, sizes)
    out, d_lhs, d_rhs = self.values_and_grads(lhs, rhs, gs, d_out, transpose_rhs=transpose_rhs, **kw)
    assert out.dtype == out_dtype and d_lhs.dtype == dtype and d_rhs.dtype == dtype
    want = reference(lhs, rhs, sizes, transpose_rhs=transpose_rhs)
    w_lhs, w_rhs = reference_vjp(lhs, rhs, sizes, d_out, transpose_rhs=transpose_rhs)
    for name, got, ref in (("out", out, want), ("d_lhs", d_lhs, w_lhs), ("d_rhs", d_rhs, w_rhs)):
      err, tol = max_error(got, ref), tolerance(dtype, grad=name != "out", tf32=self.tf32)
      assert err <= tol, f"{name}: max error {err:.3g} > {tol:.3g}"
    # Exact zeros: rows past the groups (output and d_lhs) and the weights of empty groups.
    end = sum(sizes)
    assert not np.asarray(out[end:], np.float32).any() and not np.asarray(d_lhs[end:], np.float32).any()
    for g, s in enumerate(sizes):
      if s == 0:
        assert not np.asarray(d_rhs[g], np.float32).any(), f"d_rhs of empty group {g}"

  def _grid(self, test):
    if test == "test_values_and_grads":
      return [(f"{s}-{'T' if t else 'N'}", (s, t)) for s in self.shapes for t in (False, True)]
    if test == "test_low_precision":
      return [(f"{jnp.dtype(d).name}{'-f32out' * o}", (d, o)) for d in self.low_precision for o in (False, True)]
    if test == "test_zero_sizes":
      return [(f"{m}x{k}x{n}-g{len(s)}", (m, k, n, s)) for m, k, n, s in
              [(10, 0, 64, [4, 6]), (0, 64, 64, [0, 0]), (10, 64, 0, [4, 6]), (10, 64, 64, [])]]
    if test == "test_bad_inputs":
      return [(c[0], c) for c in BAD_INPUTS]
    if test == "test_refusals":
      return [(c[0], c) for c in self.refusals]
    if test in ("test_jvp", "test_traced_group_sizes", "test_vmap"):
      return [("f", None)]
    return None

  # -- the cases ----------------------------------------------------------------------------
  def test_values_and_grads(self, case):
    shape, transpose_rhs = case
    self.check(*self.shapes[shape], transpose_rhs=transpose_rhs, planted=True)

  def test_low_precision(self, case):
    dtype, f32_out = case
    self.check(*self.shapes[self.low_precision_shape], dtype=dtype,
               **({"preferred_element_type": jnp.float32} if f32_out else {}))

  @pytest.mark.xfail(strict=True, raises=TypeError,
                     reason="reverse mode only: the product is a custom_vjp (ops/grouped_matmul/base.py)")
  def test_jvp(self, case):
    m, k, n, sizes = self.shapes["ragged"]
    lhs, rhs, gs, _ = inputs(m, k, n, sizes, self.dtype)
    t_lhs, t_rhs, _, _ = inputs(m, k, n, sizes, self.dtype, seed=1)  # fresh tangents
    _, got = jax.jvp(lambda a, b: self.gmm(a, b, gs), (lhs, rhs), (t_lhs, t_rhs))
    want = reference(t_lhs, rhs, sizes) + reference(lhs, t_rhs, sizes)
    assert max_error(got, want) <= tolerance(self.dtype, grad=True, tf32=self.tf32)

  def test_zero_sizes(self, case):
    """K = 0 (and any other zero dimension): zeros and zero gradients, no kernel to hang."""
    m, k, n, sizes = case
    lhs, rhs, gs, d_out = inputs(m, k, n, sizes, self.dtype)
    out, d_lhs, d_rhs = self.values_and_grads(lhs, rhs, gs, d_out)
    assert out.shape == (m, n) and d_lhs.shape == lhs.shape and d_rhs.shape == rhs.shape
    assert not any(np.asarray(x, np.float32).any() for x in (out, d_lhs, d_rhs))

  def test_traced_group_sizes(self, case):
    """Under jit negative sizes count as zero and the groups are cut at row M."""
    m, k, n = self.small
    lhs, rhs, _, d_out = inputs(m, k, n, [0, 0, 0], self.dtype)
    bad, clamped = jnp.array([8, -5, m + 10], jnp.int32), [8, 0, m - 8]
    out, d_lhs, d_rhs = self.values_and_grads(lhs, rhs, bad, d_out)
    w_lhs, w_rhs = reference_vjp(lhs, rhs, clamped, d_out)
    assert max_error(out, reference(lhs, rhs, clamped)) <= tolerance(self.dtype, tf32=self.tf32)
    assert max_error(d_lhs, w_lhs) <= tolerance(self.dtype, grad=True, tf32=self.tf32)
    assert max_error(d_rhs, w_rhs) <= tolerance(self.dtype, grad=True, tf32=self.tf32)

  def test_vmap(self, case):
    m, k, n = self.small
    lhs, rhs, _, _ = inputs(m, k, n, [0, 0], self.dtype)
    sizes = jnp.array([[10, 20], [m, 0], [0, 5]], jnp.int32)
    out = jax.jit(jax.vmap(lambda gs: self.gmm(lhs, rhs, gs)))(sizes)
    for b in range(3):
      assert max_error(out[b], reference(lhs, rhs, sizes[b])) <= tolerance(self.dtype, tf32=self.tf32)

  def test_bad_inputs(self, case):
    _, bad, exc, pattern = case
    lhs, rhs, _, _ = inputs(10, 4, 6, [3, 7], self.dtype)
    args = dict(lhs=lhs, rhs=rhs, group_sizes=[3, 7])
    kw = {n: v for n, v in bad.items() if n not in args}
    args |= {n: v for n, v in bad.items() if n in args}
    with pytest.raises(exc, match=pattern):
      self.gmm(args["lhs"], args["rhs"], jnp.asarray(args["group_sizes"]), **kw)

  def test_refusals(self, case):
    _, kw, (m, k, n), dtype, pattern = case
    lhs, rhs, gs, _ = inputs(m, k, n, [m // 2, m - m // 2], dtype)
    with pytest.raises(ValueError, match=pattern):
      self.gmm(lhs, rhs, gs, **kw)
