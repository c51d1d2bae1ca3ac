"""One conformance suite for every attention backend: the cases each backend must pass, once.

:class:`AttentionConformance` holds the cases; each backend's test file subclasses it
(``class TestXlaConformance(AttentionConformance)`` in test_xla_attention.py, and so on),
implements :meth:`~AttentionConformance.run` and describes the backend in class attributes:
the dtype and head_dim it is tested at, the masks and score modifiers it takes, its variants
(formulations, backward passes), the shapes that reach each of its code paths, and which
cases are slow. Every check is against the float64 reference
(:mod:`probjax.ops.attention.reference`) through :mod:`probjax.testing`, with the bounds of
:mod:`probjax.ops.attention.tolerances`.

The cases (``test_<name>[<variant>-<case>]``):

=============================  ==================================================================
test_values_and_grads          output, dq, dk, dv for every named mask at each of ``mask_shapes``
test_odd_lengths               bottom-right causal at ``odd_lengths`` (1x1, 7x7, 200x7, ...)
test_gqa                       MQA, MHA and GQA head groupings (``gqa``)
test_jvp                       jax.jvp against the reference's jvp (through :meth:`run_jvp`)
test_rows_without_keys         a batch element with no key, rows with none, queries past their
                               lengths: zeros and zero gradients, never NaN
test_never_read                NaN/inf planted past key (and query) lengths reach nothing
test_segment_ids_of_any_value  segment ids are compared, never used as indices
test_score_mod                 a score modifier and a scale (``takes_score_mod``)
test_same_precision            low precision within 2x the error of a same-precision reference
test_bad_inputs                refused with ValueError/TypeError naming the argument (public API)
=============================  ==================================================================

Case selection (``slow_cases``, ``fast_cases``, ``left_out``: ``fnmatch`` patterns on
``"test_<name>[<id>]"``) is :class:`tests.ops.conformance.Conformance`'s, as for every op's suite.
"""

from __future__ import annotations

import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from probjax.ops.attention import dot_product_attention
from probjax.ops.attention import masks as M
from probjax.ops.attention.tolerances import max_error, tolerance
from probjax.testing import (MASK_NAMES, check_against_reference, check_against_same_precision, make_inputs,
                             make_mask, poison, reference_jvp)
from tests.ops.conformance import Conformance

# probjax.testing's named masks and two more that the kernel files used: a causal band whose
# first rows see no key, and packed documents under a bottom-right causal band.
MASKS = MASK_NAMES + ("causal_neg", "segments&causal")


def conformance_mask(name: str, batch: int, q_len: int, kv_len: int, seed: int = 0) -> M.Mask | None:
  """:func:`probjax.testing.make_mask`, plus ``causal_neg`` and ``segments&causal``."""
  if name == "causal_neg":
    return M.CausalMask(-3)
  if name == "segments&causal":
    return make_mask("segments", batch, q_len, kv_len, seed) & M.CausalMask(kv_len - q_len)
  return make_mask(name, batch, q_len, kv_len, seed)


def alibi_softcap(s, b, h, q_idx, kv_idx):
  """A score modifier every backend lowers (no closed-over arrays): ALiBi-like, soft-capped."""
  return 20.0 * jnp.tanh((s - 0.25 * (h + 1) * jnp.abs(q_idx - kv_idx).astype(jnp.float32) / 8) / 20.0)


def _seed(*parts) -> int:
  return zlib.crc32(repr(parts).encode()) % 1000


def _shape_id(tq, tk, d=None):
  return f"{tq}x{tk}" + ("" if d is None else f"-d{d}")


# (id, arguments changed from good ones, exception, pattern the message must match)
BAD_INPUTS = [
    ("query_rank3", dict(q=lambda q: q[0]), ValueError, "key's batch axes"),
    ("query_list", dict(q=lambda q: np.asarray(q).tolist()), TypeError, "query must be an array"),
    ("query_int", dict(q=lambda q: q.astype(jnp.int32)), TypeError, "query must be a floating array"),
    ("key_int", dict(k=lambda k: k.astype(jnp.int32)), TypeError, "key must be a floating array"),
    ("value_int", dict(v=lambda v: v.astype(jnp.int32)), TypeError, "value must be a floating array"),
    ("heads_not_a_multiple", dict(q=lambda q: q[:, :, :3]), ValueError, r"query heads \(3\)"),
    ("value_length", dict(v=lambda v: v[:, :5]), ValueError, "key and value must have the same shape"),
    ("key_batch", dict(k=lambda k: k[:1], v=lambda v: v[:1]), ValueError, "key's batch axes"),
    ("key_head_dim", dict(k=lambda k: k[..., :16]), ValueError, "key/value head_dim 16"),
    ("mask_lengths_shape", dict(mask=M.KVLenMask(jnp.array([1, 2, 3]))), ValueError, "mask.kv_lengths"),
    ("scale_str", dict(scale="big"), TypeError, "scale"),
    ("bias_ambiguous", dict(bias=jnp.ones((3, 20, 24))), ValueError, "bias"),
    ("backward_pass_impl", dict(backward_pass_impl="nope"), ValueError, "backward_pass_impl"),
]


class AttentionConformance(Conformance):
  """The shared cases; subclass per backend, implement :meth:`run`, set the attributes."""

  implementation: str = ""        # the public API's name of the backend (bad inputs, jvp)
  dtype = jnp.float32             # inputs of the value and gradient cases
  head_dim = 32
  heads = (4, 2)                  # (query heads, key/value heads) of the cases
  takes_score_mod = True
  takes_bias = False              # the jvp case also gives the bias a tangent
  masks = MASKS                   # the named masks it takes
  variants: dict = {"default": {}}  # name -> keyword arguments of run (formulation, backward pass)
  forward_variants: tuple | None = None  # the variants of forward-only cases (jvp); None: the first
  mask_shapes = ((63, 100),)      # (q_len, kv_len) of the mask grid: one per code path
  odd_lengths = ((1, 1), (7, 7), (200, 7), (7, 100), (63, 63), (1, 200))  # (q_len, kv_len[, head_dim])
  gqa = ((4, 1), (4, 4), (6, 2))  # (heads, kv_heads)
  gqa_shape = (50, 70)
  shape = (40, 40)                # (q_len, kv_len) of the single-shape cases
  low_precision = (jnp.bfloat16,)  # dtypes of test_same_precision
  precision_shape = (150, 200)
  tf32 = False                    # float32 matmuls run as TF32 (the tolerance bounds that)

  # -- the backend --------------------------------------------------------------------------
  def run(self, q, k, v, mask=None, **kw):
    """The backend on ``q, k, v`` (``kw``: a variant's arguments, ``score_mod``, ``scale``)."""
    raise NotImplementedError

  def public(self, q, k, v, **kw):
    """The public :func:`dot_product_attention` with this backend."""
    return dot_product_attention(q, k, v, implementation=self.implementation, interpret=True, **kw)

  def run_jvp(self, q, k, v, mask=None, **kw):
    """What jax.jvp is taken of (``kw``: a forward variant's arguments, ``bias``): the public
    API, whose forward mode is the XLA formulation's (a kernel defines only a vjp)."""
    return self.public(q, k, v, mask=mask, **kw)

  def takes(self, test: str, variant: str, tq: int, tk: int) -> bool:
    """Whether ``variant`` runs at these lengths (e.g. XLA's dense formulation: short ones)."""
    return True

  def same_precision(self, mask):
    """``f(q, k, v)``: an exact implementation in the inputs' dtype (the XLA path)."""
    return lambda q, k, v: dot_product_attention(q, k, v, mask=mask, implementation="xla")

  # -- helpers ------------------------------------------------------------------------------
  def attn(self, mask=None, variant=None, **kw):
    """``attn(q, k, v, bias)`` for :func:`check_against_reference`."""
    extra = self.variants[variant or next(iter(self.variants))]
    return lambda q, k, v, bias: self.run(q, k, v, mask=mask, **extra, **kw)

  def inputs(self, seed, tq, tk, *, heads=None, head_dim=None, dtype=None, batch=2):
    h, hkv = heads or self.heads
    return make_inputs(seed, batch, tq, tk, h, hkv, head_dim or self.head_dim, dtype or self.dtype)

  def _grid(self, test):
    """``[(id, case)]`` of ``test`` (before the slow and left-out patterns)."""
    variants = list(self.variants)
    fwd = list(self.forward_variants or variants[:1])
    if test == "test_values_and_grads":
      return [(f"{v}-{m}-{_shape_id(tq, tk)}", (v, m, tq, tk)) for v in variants for tq, tk in self.mask_shapes
              if self.takes(test, v, tq, tk) for m in self.masks]
    if test == "test_odd_lengths":
      return [(f"{v}-{_shape_id(*c)}", (v, *c[:2], c[2] if len(c) > 2 else None)) for v in variants
              for c in self.odd_lengths if self.takes(test, v, c[0], c[1])]
    if test == "test_gqa":
      return [(f"{v}-{h}x{hkv}", (v, h, hkv)) for v in variants for h, hkv in self.gqa
              if self.takes(test, v, *self.gqa_shape)]
    if test in ("test_rows_without_keys", "test_score_mod"):
      if test == "test_score_mod" and not self.takes_score_mod:
        return []
      return [(v, v) for v in variants if self.takes(test, v, *self.shape)]
    if test in ("test_jvp", "test_segment_ids_of_any_value"):
      return [(v, v) for v in fwd if self.takes(test, v, *self.shape)]
    if test == "test_never_read":
      return [(f"{v}-{m}", (v, m)) for v in variants for m in ("kv_len", "lengths") if self.takes(test, v, *self.shape)]
    if test == "test_same_precision":
      return [(f"{v}-{jnp.dtype(d).name}", (v, d)) for v in variants for d in self.low_precision
              if self.takes(test, v, *self.precision_shape)]
    if test == "test_bad_inputs":
      return [(c[0], c) for c in BAD_INPUTS]
    return None

  # -- the cases ----------------------------------------------------------------------------
  def test_values_and_grads(self, case):
    variant, name, tq, tk = case
    x = self.inputs(_seed(name, tq, tk), tq, tk)
    mask = conformance_mask(name, 2, tq, tk, seed=tq)
    check_against_reference(self.attn(mask, variant), x, mask=mask, tf32=self.tf32)

  def test_odd_lengths(self, case):
    variant, tq, tk, d = case
    x = self.inputs(_seed(tq, tk, d), tq, tk, head_dim=d)
    mask = M.CausalMask(tk - tq)  # bottom-right: with tq > tk the first rows see no key
    check_against_reference(self.attn(mask, variant), x, mask=mask, tf32=self.tf32)

  def test_gqa(self, case):
    variant, h, hkv = case
    tq, tk = self.gqa_shape
    x = self.inputs(_seed(h, hkv), tq, tk, heads=(h, hkv))
    mask = M.CausalMask(20)
    check_against_reference(self.attn(mask, variant), x, mask=mask, tf32=self.tf32)

  def test_jvp(self, case):
    tq, tk = self.shape
    x = self.inputs(8, tq, tk)
    mask = M.CausalMask() & M.KVLenMask(jnp.array([tk, 0]))  # batch element 1: no key
    primals = {"q": x.q, "k": x.k, "v": x.v}
    if self.takes_bias:
      primals["bias"] = jax.random.normal(jax.random.key(2), (1, self.heads[0], tq, tk), self.dtype)
    tangents = {n: jax.random.normal(jax.random.key(10 + i), a.shape, a.dtype) for i, (n, a) in enumerate(primals.items())}
    kw = dict(self.variants[case])
    f = lambda *a: self.run_jvp(*a[:3], mask=mask, **({"bias": a[3]} if len(a) > 3 else {}), **kw)
    _, got = jax.jvp(f, tuple(primals.values()), tuple(tangents.values()))
    _, want = reference_jvp(x.q, x.k, x.v, tangents, bias=primals.get("bias"), mask=mask)
    got = np.asarray(jnp.asarray(got, jnp.float32))
    assert np.all(np.isfinite(got))
    err, tol = max_error(got, want), tolerance(self.dtype, grad=True, tf32=self.tf32)
    assert err <= tol, f"jvp: max error {err:.3g} > {tol:.3g}"

  def test_rows_without_keys(self, case):
    """Batch element 0 has no key; the first 3 rows of element 1 none (causal -3) and its last 10
    queries lie past its length: zeros and zero gradients there, no NaN anywhere."""
    tq, tk = self.shape
    x = self.inputs(15, tq, tk)
    mask = M.LengthMask(jnp.array([tq, tq - 10]), jnp.array([0, tk])) & M.CausalMask(-3)
    attn = self.attn(mask, case)
    check_against_reference(attn, x, mask=mask, tf32=self.tf32)
    out, vjp = jax.vjp(lambda q, k, v: attn(q, k, v, None), x.q, x.k, x.v)
    dq, dk, dv = vjp(x.do)
    for a in (out, dq, dk, dv):
      assert bool(jnp.isfinite(a.astype(jnp.float32)).all())
    zero = lambda a: not np.any(np.asarray(a.astype(jnp.float32)))
    assert zero(out[0]) and zero(out[1, :3]) and zero(out[1, tq - 10:])
    assert zero(dq[0]) and zero(dk[0]) and zero(dv[0]) and zero(dq[1, tq - 10:])

  def test_never_read(self, case):
    """NaN, +inf and -inf past each element's key lengths (``lengths``: and past its query
    lengths) reach no value or gradient (dK/dV there are zero)."""
    variant, kind = case
    tq, tk = self.shape
    x = self.inputs(16, tq, tk)
    kv_lens = jnp.array([tk // 2 + 3, 5], jnp.int32)
    if kind == "kv_len":
      mask = M.KVLenMask(kv_lens)
    else:
      q_lens = jnp.array([tq - 7, tq // 3], jnp.int32)
      mask = M.LengthMask(q_lens, kv_lens)
      x.q = poison(x.q, q_lens)
    x.k, x.v = poison(x.k, kv_lens), poison(x.v, kv_lens)
    check_against_reference(self.attn(mask, variant), x, mask=mask, tf32=self.tf32)

  def test_segment_ids_of_any_value(self, case):
    """Segment ids are compared, never used as indices: negative and huge ids give the call
    with the ids relabelled 0..n-1."""
    tq, tk = self.shape
    x = self.inputs(2, tq, tk)
    # Two documents per element: ids 0 and 1 (relabelled), -7 and 2**30, 5 and -1 (raw).
    ids = lambda n, at, a, b: jnp.where(jnp.arange(n) >= at, b, a).astype(jnp.int32)
    relabelled = [jnp.stack([ids(n, 10, 0, 1), ids(n, n // 2, 0, 1)]) for n in (tq, tk)]
    raw = [jnp.stack([ids(n, 10, -7, 2**30), ids(n, n // 2, 5, -1)]) for n in (tq, tk)]
    kw = self.variants[case]
    f = jax.jit(lambda q_ids, kv_ids: self.run(x.q, x.k, x.v, mask=M.SegmentMask(q_ids, kv_ids), **kw))
    np.testing.assert_array_equal(np.asarray(f(*raw), np.float32), np.asarray(f(*relabelled), np.float32))

  def test_score_mod(self, case):
    tq, tk = self.shape
    x = self.inputs(13, tq, tk)
    mask = conformance_mask("window&segments", 2, tq, tk)
    check_against_reference(self.attn(mask, case, score_mod=alibi_softcap, scale=0.3), x, mask=mask,
                            score_mod=alibi_softcap, scale=0.3, tf32=self.tf32)

  def test_same_precision(self, case):
    """Output and gradients within 2x the error of an exact implementation in the same dtype
    (tighter than the fixed bound, which a wrong term of the backward can stay under)."""
    variant, dtype = case
    tq, tk = self.precision_shape
    x = self.inputs(13, tq, tk, dtype=dtype)
    mask = M.CausalMask(50)
    attn = self.attn(mask, variant)
    check_against_same_precision(lambda q, k, v: attn(q, k, v, None), self.same_precision(mask), x, mask=mask)

  def test_bad_inputs(self, case):
    _, bad, exc, pattern = case
    x = make_inputs(0, 2, 20, 24, 4, 2, self.head_dim, self.dtype)
    args = dict(q=x.q, k=x.k, v=x.v)
    kw = {}
    for name, change in bad.items():
      if name in args:
        args[name] = change(args[name])
      else:
        kw[name] = change
    with pytest.raises(exc, match=pattern):
      self.public(args["q"], args["k"], args["v"], **kw)
