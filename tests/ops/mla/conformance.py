"""One conformance suite for every MLA backend: the cases each backend must pass, once.

:class:`MLAConformance` holds the cases; test_mla.py subclasses it once per backend of
:data:`probjax.ops.mla.REGISTRY` (``xla``: both forms through attention's face; ``triton``: the
absorbed form with MLA's decode kernel, in Pallas interpret mode off the GPU), naming the backend
(``implementation``), its forms, the widths it takes, the masks and shapes that reach each of its
code paths, and the calls it refuses. Every check is against the float64 reference that
materialises K and V (:mod:`probjax.ops.mla.reference`), with the bounds of
:mod:`probjax.core.tolerances`.

The cases (``test_<name>[<form>-...]``):

===============================  ================================================================
test_values_and_grads            output and the gradients of all six inputs for each of ``masks``
                                 at each of ``shapes``; NaN/inf planted past the key lengths (and
                                 on the cotangent of queries past their lengths) reach nothing;
                                 a batch element with no key gives zeros and zero gradients
test_paged                       a paged cache (shuffled pages; NaN past the lengths and in pages
                                 no sequence uses; a traced table whose unused entries lie outside
                                 the pool) equals the reference on the gathered cache, gradients
                                 included
test_page_table_out_of_range     a concrete table with an entry outside the pool: ValueError
test_jvp                         jax.jvp against the reference's
test_low_precision               ``low_precision`` inputs (bfloat16) within their bounds
test_bad_inputs                  refused with ValueError/TypeError naming the argument
test_refusals                    a call the backend cannot compute, requested: ValueError with why
===============================  ================================================================
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from probjax.core.tolerances import max_error, tolerance
from probjax.ops.attention import masks as M
from probjax.ops.mla import mla
from probjax.ops.mla.reference import NAMES, _mla64, reference_mla_vjp
from probjax.testing import poison
from tests.ops.conformance import Conformance

# (id, the argument changed: an index of the six inputs or a keyword, what it becomes (a shape
# whose None entries keep the good input's), exception, pattern the message must match)
BAD_INPUTS = [
    ("q_nope_rank", 0, (2, 5, 4), ValueError, "q_nope"), ("q_rope_heads", 1, (2, 5, 3, None), ValueError, "q_rope"),
    ("kv_latent_batch", 2, (3, 9, None), ValueError, "kv_latent"), ("kv_latent_rank", 2, (2, 9), ValueError, "kv_latent"),
    ("k_rope_length", 3, (2, 8, None), ValueError, "k_rope"), ("k_rope_width", 3, (2, 9, 5), ValueError, "k_rope"),
    ("w_uk_d_c", 4, (11, None, None), ValueError, "w_uk"), ("w_uk_d_nope", 4, (None, None, 7), ValueError, "w_uk"),
    ("w_uv_heads", 5, (None, 3, None), ValueError, "w_uv"),
    ("form", "form", "fast", ValueError, "form"),
    ("mask_dense", "mask", jnp.ones((1, 1, 5, 9), bool), TypeError, "mask"),
    ("mask_batch", "mask", M.KVLenMask(jnp.array([9])), ValueError, "kv_lengths"),
    ("page_table_float", "page_table", jnp.zeros((2, 1)), TypeError, "page_table"),
]


def inputs(seed, batch, tq, s, *, heads, d_nope, d_rope, d_c, d_v, dtype=jnp.float32):
  """The six inputs (fresh normals drawn by NumPy, projections at the usual init scale) and a
  cotangent."""
  rng = np.random.default_rng(seed)
  shapes = [(batch, tq, heads, d_nope), (batch, tq, heads, d_rope), (batch, s, d_c), (batch, s, d_rope),
            (d_c, heads, d_nope), (d_c, heads, d_v), (batch, tq, heads, d_v)]
  args = [rng.standard_normal(sh, np.float32) for sh in shapes]
  args[4], args[5] = args[4] * d_c ** -0.5, args[5] * d_c ** -0.5
  args = [jnp.asarray(a).astype(dtype) for a in args]
  return args[:6], args[6]


def to_pages(x, page_size, seed):
  """A contiguous cache ``[B, S, d]`` (S a multiple of page_size) as a shuffled pool with one
  more, unused page (NaN) and its table ``[B, S // page_size]``."""
  b, s, d = x.shape
  n = s // page_size
  perm = np.random.default_rng(seed).permutation(b * n + 1)[:b * n]
  pool = jnp.full((b * n + 1, page_size, d), jnp.nan, x.dtype).at[perm].set(x.reshape(b * n, page_size, d))
  return pool, perm.reshape(b, n)


class MLAConformance(Conformance):
  """The shared cases; subclass per backend and set the attributes."""

  implementation: str = ""
  forms = ("expanded", "absorbed")
  dims = dict(heads=4, d_nope=8, d_rope=4, d_c=12, d_v=6)
  masks = ("none", "causal", "kv_len", "causal&kv_len", "lengths")
  shapes = ((7, 48), (1, 48), (1, 1), (48, 48))   # (q_len, kv_len)
  page = (48, 16)                                 # (kv_len, page_size) of test_paged: 3 pages
  refusals: tuple = ()   # (id, form, edit(args) -> keyword arguments of mla (may change args), message pattern)
  tf32 = False
  dtype = jnp.float32     # the inputs of every case but test_low_precision
  low_precision = (jnp.bfloat16, 7, 48)   # test_low_precision's (dtype, q_len, kv_len)

  # -- the backend --------------------------------------------------------------------------
  def run(self, *args, form, **kw):
    return mla(*args, form=form, implementation=self.implementation, **kw)

  def inputs(self, seed, batch, tq, s, dtype=None):
    return inputs(seed, batch, tq, s, dtype=dtype or self.dtype, **self.dims)

  def check(self, args, do, mask, form, *, dtype=None, names=NAMES, **kw):
    """Values and the gradients of ``names`` against the reference; returns them."""
    dtype = dtype or self.dtype
    idx = [NAMES.index(n) for n in names]

    def f(*diff):
      a = list(args)
      for i, x in zip(idx, diff):
        a[i] = x
      return self.run(*a, mask=mask, form=form, **kw)
    out, pull = jax.vjp(f, *(args[i] for i in idx))
    grads = pull(do)
    want, want_grads = reference_mla_vjp(*args, do, mask=mask, scale=kw.get("scale"))
    errs = {"out": max_error(out, want)} | {n: max_error(g, want_grads[n]) for n, g in zip(names, grads)}
    for name, err in errs.items():
      tol = tolerance(dtype, grad=name != "out", tf32=self.tf32)
      assert err <= tol, f"{form} {name}: {err:.3g} > {tol:.3g}; all {errs}"
    return out, dict(zip(names, grads))

  def mask(self, name, tq, s):
    """The named mask over batch 2; element 0 has no key under ``kv_len``."""
    if name == "none":
      return None
    if name == "causal":
      return M.CausalMask(s - tq)   # the last tq positions of s, as a decode or prefill step
    if name == "kv_len":
      return M.KVLenMask(jnp.array([0, s], jnp.int32))
    if name == "causal&kv_len":
      return M.CausalMask(s - tq) & M.KVLenMask(jnp.array([max(1, s // 2), s], jnp.int32))
    if name == "lengths":   # queries past their lengths, keys past theirs
      return M.LengthMask(jnp.array([max(1, tq - 3), tq], jnp.int32), jnp.array([s // 3 + 1, s], jnp.int32))
    raise ValueError(name)

  def _grid(self, test):
    if test == "test_values_and_grads":
      return [(f"{f}-{m}-{tq}x{s}", (f, m, tq, s)) for f in self.forms for tq, s in self.shapes for m in self.masks]
    if test == "test_page_table_out_of_range":
      return [(f"{f}-{e}", (f, e)) for f in self.forms for e in (7, -1)]
    if test in ("test_paged", "test_jvp", "test_low_precision"):
      return [(f, f) for f in self.forms]
    if test == "test_bad_inputs":
      return [(c[0], c) for c in BAD_INPUTS]
    if test == "test_refusals":
      return [(c[0], c) for c in self.refusals]
    return None

  # -- the cases ----------------------------------------------------------------------------
  def test_values_and_grads(self, case):
    form, name, tq, s = case
    args, do = self.inputs(tq * 100 + s, 2, tq, s)
    mask = self.mask(name, tq, s)
    q_lens, kv_lens = (None, None) if mask is None else mask.lengths(2)
    if kv_lens is not None:
      args[2], args[3] = poison(args[2], kv_lens), poison(args[3], kv_lens)
    if q_lens is not None:
      do = poison(do, q_lens)   # a cotangent on padded query rows reaches nothing
    out, grads = self.check(args, do, mask, form)
    if name == "kv_len":   # element 0 has no key: zero output and zero gradients
      assert not np.asarray(out[0]).any()
      for n in ("q_nope", "q_rope", "kv_latent", "k_rope"):
        assert not np.asarray(grads[n][0]).any(), n
    if q_lens is not None:
      assert not np.asarray(out[0, int(q_lens[0]):]).any()

  def test_paged(self, case):
    s, page_size = self.page
    args, do = self.inputs(11, 2, 1, s)
    lengths = jnp.array([s - page_size // 2 - 1, page_size - 3], jnp.int32)   # element 1: one page
    args[2], args[3] = poison(args[2], lengths), poison(args[3], lengths)
    mask = M.KVLenMask(lengths)
    (lat, table), (rope, _) = to_pages(args[2], page_size, 3), to_pages(args[3], page_size, 3)
    table[1, 1:3] = [-5, 99]   # element 1's unused pages: outside the pool, never read under jit
    want, want_grads = reference_mla_vjp(*args, do, mask=mask)

    @jax.jit
    def values_and_grads(qn, qr, wuk, wuv, t):
      f = lambda qn, qr, wuk, wuv: self.run(qn, qr, lat, rope, wuk, wuv, mask=mask, form=case, page_table=t)
      out, pull = jax.vjp(f, qn, qr, wuk, wuv)
      return out, pull(do)
    out, grads = values_and_grads(*args[:2], *args[4:], jnp.asarray(table, jnp.int32))
    assert max_error(out, want) <= tolerance(self.dtype, tf32=self.tf32)
    for n, g in zip(("q_nope", "q_rope", "w_uk", "w_uv"), grads):
      assert max_error(g, want_grads[n]) <= tolerance(self.dtype, grad=True, tf32=self.tf32), n
    # the same rows read through pages or from the contiguous cache (a kernel may split the keys
    # differently, so equal up to the summation order)
    contiguous = jax.jit(lambda *a: self.run(*a, mask=mask, form=case))(*args)
    assert max_error(out, contiguous) <= tolerance(self.dtype, tf32=self.tf32)

  def test_page_table_out_of_range(self, case):
    form, entry = case
    args, _ = self.inputs(0, 2, 1, 32)
    pool = [x.reshape(4, 16, -1) for x in args[2:4]]
    with pytest.raises(ValueError, match=r"page_table .*\[0, 4\)"):
      self.run(*args[:2], *pool, *args[4:], form=form, mask=M.KVLenMask(jnp.array([20, 20], jnp.int32)),
               page_table=jnp.asarray([[0, 1], [2, entry]], jnp.int32))

  def test_jvp(self, case):
    args, _ = self.inputs(5, 2, 1 if case == "absorbed" else 7, 20)
    mask = M.KVLenMask(jnp.array([9, 20], jnp.int32))
    tans, _ = self.inputs(50, 2, args[0].shape[1], 20)   # fresh tangents
    scale = (self.dims["d_nope"] + self.dims["d_rope"]) ** -0.5
    with jax.enable_x64(True):
      up = lambda a: jnp.asarray(np.asarray(a, np.float64))
      _, want = jax.jvp(lambda *a: _mla64(*a, mask, scale)[0], tuple(map(up, args)), tuple(map(up, tans)))
      want = np.asarray(want)
    _, got = jax.jvp(lambda *a: self.run(*a, mask=mask, form=case), tuple(args), tuple(tans))
    assert max_error(got, want) <= tolerance(self.dtype, grad=True, tf32=self.tf32)

  def test_low_precision(self, case):
    dtype, tq, s = self.low_precision
    args, do = self.inputs(6, 2, tq, s, dtype=dtype)
    mask = M.KVLenMask(jnp.array([s * 5 // 8, s], jnp.int32))
    self.check(args, do, mask, case, dtype=dtype)

  def test_bad_inputs(self, case):
    _, which, bad, exc, pattern = case
    args, _ = self.inputs(0, 2, 5, 9)
    kw = {"form": self.forms[0]}
    if isinstance(which, int):
      args[which] = jnp.ones(tuple(args[which].shape[i] if n is None else n for i, n in enumerate(bad)))
    else:
      kw[which] = bad
    with pytest.raises(exc, match=pattern):
      self.run(*args, **kw)

  def test_refusals(self, case):
    _, form, edit, pattern = case
    args, _ = self.inputs(0, 2, 1, 32)
    kw = edit(args)
    with pytest.raises(ValueError, match=pattern):
      self.run(*args, form=form, **kw)
