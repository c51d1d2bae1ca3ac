"""``mask_mod(b, h, q_idx, kv_idx) -> bool`` masks (PyTorch flex's mask_mod): the element
predicate, the tile classes found at trace time, values and every gradient against the
equivalent dense boolean mask and the float64 reference on both XLA formulations, and the
refusal of the kernels that do not compute it (the Triton kernel does:
test_triton_mask_mod.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from probjax.ops.attention import dot_product_attention, explain_dispatch, flex_attention
from probjax.ops.attention import masks as M
from probjax.ops.attention.backends import triton, xla
from probjax.ops.attention.call import AttentionCall
from probjax.ops.attention.dispatch import Device
from probjax.ops.attention.masks import CausalMask, KVLenMask, MaskMod
from probjax.ops.attention.tolerances import max_error, tolerance
from probjax.testing import check_against_reference, make_inputs

B, TQ, TK, H, HKV, D = 2, 37, 45, 4, 2, 16  # odd lengths, GQA (2 query heads per KV head)
DOC = jnp.array([[0] * 10 + [1] * 20 + [2] * 15, [0] * 30 + [1] * 15], jnp.int32)  # key documents


def sliding(b, h, q, k):  # head-independent: causal window of 9 keys, query 3 sees nothing
  return (k <= q) & (q - k < 9) & (q != 3)


def per_head(b, h, q, k):  # head 1 sees no key at all; the others a head-wide causal window
  return (k <= q + 2) & (q - k < 6 + 4 * h) & (h != 1)


def documents(b, h, q, k):  # packed documents (query q is document position q), causal
  return (DOC[b, q] == DOC[b, k]) & (k <= q + 8)


def _dense(fn, batch=B, heads=H, tq=TQ, tk=TK):
  """The function on the whole grid, ``[batch, heads, tq, tk]`` (numpy, independent of Mask)."""
  b, h = np.arange(batch)[:, None, None, None], np.arange(heads)[None, :, None, None]
  q, k = np.arange(tq)[None, None, :, None], np.arange(tk)[None, None, None, :]
  return np.broadcast_to(np.asarray(fn(jnp.asarray(b), jnp.asarray(h), jnp.asarray(q), jnp.asarray(k))),
                         (batch, heads, tq, tk))


MASKS = {"sliding": (sliding, {}), "per_head": (per_head, dict(heads=H)), "documents": (documents, dict(batch=B))}


def test_element_dense_and_reads():
  for name, (fn, kw) in MASKS.items():
    m = MaskMod(fn, **kw)
    assert m.kinds == ("mask_mod",) and m.name == "mask_mod" and m.heads == kw.get("heads")
    dense = np.asarray(m.dense(B, TQ, TK))
    want = _dense(fn)
    assert np.array_equal(np.broadcast_to(dense, want.shape), want), name
    b = 1
    e = np.asarray(m.element(jnp.arange(TQ)[:, None], jnp.arange(TK)[None], b))
    assert np.array_equal(np.broadcast_to(e, want.shape[1:]), want[b]), name
  assert M.mask_mod.reads(sliding) == (False, False)
  assert M.mask_mod.reads(per_head) == (False, True)
  assert M.mask_mod.reads(documents) == (True, False)
  with pytest.raises(ValueError, match="reads its h argument"):
    MaskMod(per_head)
  with pytest.raises(ValueError, match="reads its b argument"):
    MaskMod(documents)
  with pytest.raises(TypeError, match="callable"):
    MaskMod(3)


@pytest.mark.parametrize("chunk", [None, 1])  # 1: one query tile per evaluation step
@pytest.mark.parametrize("name", list(MASKS))
@pytest.mark.parametrize("tq, tk, bq, bk", [(TQ, TK, 8, 16), (9, 9, 4, 4), (5, 11, 3, 2)])
def test_tile_classes_are_exact(name, tq, tk, bq, bk, chunk, monkeypatch):
  """EMPTY and FULL exactly where the grid says so (over the heads: EMPTY for every head,
  FULL for every head), from one evaluation at trace time (concrete under jit)."""
  if chunk is not None:
    monkeypatch.setattr(M.mask_mod, "_CHUNK", chunk)
    M.mask_mod._tile_classes.cache_clear()
  fn, kw = MASKS[name]
  m = MaskMod(fn, **kw) & KVLenMask(jnp.array([tk, tk - 2]))
  cls = np.asarray(m.classify_tiles(B, tq, tk, bq, bk))
  dense = _dense(fn, tq=tq, tk=tk) & (np.arange(tk) < np.array([tk, tk - 2])[:, None])[:, None, None, :]
  for b, i, j in np.ndindex(cls.shape):
    t = dense[b, :, i * bq:(i + 1) * bq, j * bk:(j + 1) * bk]
    whole = t.shape[1:] == (bq, bk)
    assert cls[b, i, j] == (M.EMPTY if not t.any() else M.FULL if t.all() and whole else M.PARTIAL), (b, i, j)
  traced = jax.jit(lambda: jnp.zeros(()) + MaskMod(fn, **kw).get("mask_mod").classify(
      M.TileGrid(B, tq, tk, bq, bk))[0].sum())
  traced()  # classified at trace time: no tracer reaches the cached classes
  assert M.mask_mod._tile_classes.cache_info().hits + M.mask_mod._tile_classes.cache_info().misses > 0


def _vjp(f, x):
  out, vjp = jax.vjp(f, x.q, x.k, x.v)
  return (out,) + vjp(x.do)


@pytest.mark.parametrize("formulation", ["dense", "flash"])
@pytest.mark.parametrize("name", list(MASKS))
def test_values_and_gradients_match_the_dense_mask(name, formulation):
  """Values and the gradients of q, k and v against the same call with the equivalent dense
  boolean mask, and against the float64 reference; rows with no valid key (query 3, head 1)
  give zeros and no NaN."""
  fn, kw = MASKS[name]
  x = make_inputs(11, B, TQ, TK, H, HKV, D)
  m = MaskMod(fn, **kw)
  blocks = dict(block_q=8, block_k=16) if formulation == "flash" else {}  # several tiles at odd lengths
  f = lambda q, k, v, bias=None: xla.attention(q, k, v, mask=m, formulation=formulation, scale=0.3, **blocks)
  check_against_reference(f, x, mask=m, scale=0.3)
  dense = jnp.asarray(_dense(fn))
  got = _vjp(lambda q, k, v: f(q, k, v), x)
  want = _vjp(lambda q, k, v: dot_product_attention(q, k, v, mask=dense, scale=0.3, implementation="xla"), x)
  for g, w, what in zip(got, want, ("out", "dq", "dk", "dv")):
    assert np.all(np.isfinite(np.asarray(g))), what
    assert max_error(g, w) <= tolerance(jnp.float32, grad=what != "out"), what
  empty = ~dense.any(-1)  # [B, H, TQ]
  assert bool(empty.any()) == (name != "documents")
  out_rows = jnp.transpose(got[0], (0, 2, 1, 3))[empty]
  dq_rows = jnp.transpose(got[1], (0, 2, 1, 3))[empty]
  assert not np.any(np.asarray(out_rows)) and not np.any(np.asarray(dq_rows))


def test_composes_with_other_masks_and_itself():
  x = make_inputs(12, B, TQ, TK, H, HKV, D)
  lens = jnp.array([TK, 20])
  m = MaskMod(documents, batch=B) & CausalMask(4) & KVLenMask(lens) & MaskMod(per_head, heads=H)
  assert m.kinds == ("band", "kv_lengths", "mask_mod") and m.heads == H
  want = (_dense(documents) & _dense(per_head) & (np.arange(TK) <= np.arange(TQ)[:, None] + 4)
          & (np.arange(TK) < np.asarray(lens)[:, None, None, None]))
  assert np.array_equal(np.asarray(m.dense(B, TQ, TK)), want)
  for formulation in ("dense", "flash"):
    f = lambda q, k, v, bias=None: xla.attention(q, k, v, mask=m, formulation=formulation, scale=0.3,
                                                 block_q=8, block_k=16)
    check_against_reference(f, x, mask=m, scale=0.3)
  with pytest.raises(ValueError, match="heads=4 and heads=2"):
    MaskMod(per_head, heads=H) & MaskMod(per_head, heads=2)
  # A function on either side of & is MaskMod(fn) (the same for every b and h).
  assert CausalMask() & sliding == sliding & CausalMask() == CausalMask() & MaskMod(sliding)
  with pytest.raises(ValueError, match="reads its h argument"):
    CausalMask() & per_head


def test_flash_skips_empty_tiles_and_full_tiles_skip_the_predicate():
  """The flash passes branch on the tile classes (EMPTY: skipped, FULL: no element predicate),
  and the classes are constants of the program (found at trace time)."""
  x = make_inputs(13, 1, 64, 64, 2, 2, 16)
  calls = []

  def band(b, h, q, k):
    calls.append(jnp.shape(q))
    return (k <= q) & (q // 16 - k // 16 < 2)  # causal, the diagonal tile and the one before

  m = MaskMod(band)
  cls = np.asarray(m.classify_tiles(1, 64, 64, 16, 16))[0]
  assert cls.tolist() == [[1, 0, 0, 0], [2, 1, 0, 0], [0, 2, 1, 0], [0, 0, 2, 1]]  # FULL below, PARTIAL on the diagonal
  f = lambda q: xla.flash_attention(q, x.k, x.v, mask=m, scale=0.25, block_q=16, block_k=16)
  jaxpr = str(jax.make_jaxpr(lambda q: jax.vjp(f, q)[1](x.do))(x.q))
  assert jaxpr.count("cond[") >= 2 and "branches=(" in jaxpr
  calls.clear()
  jax.make_jaxpr(f)(x.q)
  assert calls and all(s in ((16, 1), (64, 1)) for s in calls)  # per PARTIAL tile (16 queries) or the grid


def test_traced_closure_is_exact_with_every_tile_partial():
  """A mask_mod closing over arrays passed to jax.jit cannot be classified at trace time:
  every tile PARTIAL, still exact."""
  x = make_inputs(14, B, 300, 300, 2, 2, 16)
  doc = jnp.repeat(jnp.array([[0, 1, 2], [0, 0, 1]]), 100, axis=1)

  def attend(q, k, v, doc):
    return flex_attention(q, k, v, mask=lambda b, h, i, j: doc[b, i] == doc[b, j])

  got = jax.jit(attend)(x.q, x.k, x.v, doc)
  want = dot_product_attention(x.q, x.k, x.v, mask=(doc[:, :, None] == doc[:, None, :])[:, None])
  assert max_error(got, want) <= tolerance(jnp.float32)
  assert max_error(attend(x.q, x.k, x.v, doc), want) <= tolerance(jnp.float32)  # concrete: classified


def test_a_function_as_mask_through_the_face():
  """``mask=fn`` to dot_product_attention / flex_attention: a MaskMod for the call's batch and
  heads where the function reads them."""
  x = make_inputs(15, B, TQ, TK, H, HKV, D)
  for fn in (sliding, per_head, documents):
    want = dot_product_attention(x.q, x.k, x.v, mask=jnp.asarray(_dense(fn)))
    assert max_error(dot_product_attention(x.q, x.k, x.v, mask=fn), want) <= tolerance(jnp.float32)
    assert max_error(flex_attention(x.q, x.k, x.v, mask=fn), want) <= tolerance(jnp.float32)
  want = dot_product_attention(x.q, x.k, x.v, mask=jnp.asarray(_dense(sliding)) & jnp.tril(jnp.ones((TQ, TK), bool)))
  got = dot_product_attention(x.q, x.k, x.v, mask=sliding, is_causal=True)
  assert max_error(got, want) <= tolerance(jnp.float32)
  _, lse = dot_product_attention(x.q, x.k, x.v, mask=per_head, return_lse=True)
  assert np.all(np.asarray(lse[:, :, 1]) == -np.inf)
  with pytest.raises(ValueError, match="query heads"):
    flex_attention(x.q, x.k, x.v, mask=MaskMod(per_head, heads=2))
  with pytest.raises(ValueError, match="batch=3"):
    dot_product_attention(x.q, x.k, x.v, mask=MaskMod(documents, batch=3))


def test_kernels_refuse_and_the_default_runs_xla():
  """The Triton kernel computes a mask_mod (tests/ops/attention/test_triton_mask_mod.py); the
  other fused kernels do not: their supports name it and an explicit request raises. The
  default picks the XLA path on every device."""
  m = MaskMod(sliding) & CausalMask()
  assert triton.supports((2, 256, 4, 64), (2, 256, 4, 64), jnp.bfloat16, mask=m, interpret=True) is None
  call = AttentionCall((2, 256, 4, 64), (2, 256, 4, 64), jnp.bfloat16, mask=m, interpret=True)
  assert "'mask_mod'" in call.not_for_kernels()
  from probjax.ops.attention.backends import cudnn
  assert cudnn.supports((2, 256, 4, 64), (2, 256, 4, 64), jnp.bfloat16, mask=m, platform="gpu")
  for device in (Device("gpu", (9, 0), 140 << 30), Device("gpu", (8, 6), 24 << 30), Device.interpreter()):
    for shape in ((2, 4096, 8, 128), (1, 16, 2, 64)):
      assert explain_dispatch(shape, shape, jnp.bfloat16, mask=m, device=device).implementation == "xla"
  x = make_inputs(1, 1, 16, 16, 2, 1, 32, dtype=jnp.bfloat16)  # the smallest call the kernel would take
  with pytest.raises(ValueError, match="mask_mod"):
    dot_product_attention(x.q, x.k, x.v, mask=m, implementation="mosaic", interpret=True)


def test_repeated_eager_calls_compile_once():
  """The function is part of the mask's static description: the same function (and equal
  conjunctions of it) share one compiled computation across eager calls."""
  from probjax.ops.attention import api
  x = make_inputs(16, B, 300, 300, 2, 2, 16)  # the flash formulation
  calls = lambda: (dot_product_attention(x.q, x.k, x.v, mask=sliding),
                   flex_attention(x.q, x.k, x.v, mask=MaskMod(per_head, heads=2) & MaskMod(sliding)))
  jax.block_until_ready(calls())
  before = api._compute_once.cache_info()
  for _ in range(3):
    jax.block_until_ready(calls())
  after = api._compute_once.cache_info()
  assert after.misses == before.misses and after.hits == before.hits + 6
