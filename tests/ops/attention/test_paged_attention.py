"""Attention over a paged KV cache (``dot_product_attention(..., page_table=)``): the XLA gather
path and the Triton split-KV decode kernel reading pages in place (Pallas interpret mode on
CPU), against the float64 reference on the contiguous cache the pages stand for.

Every case shuffles the pages (a sequence's pages are not in pool order) and plants NaN in the
pages no sequence uses and past each sequence's length: none may reach a value or a gradient.
The shapes are the smallest that reach each path of the kernel: pages of one key block (16),
of several blocks (48: blocks of 16; 128: blocks of 64), several splits, GQA and MQA, several
queries per step."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from probjax.core.device import Device
from probjax.ops.attention import KVLenMask, dot_product_attention, explain_dispatch
from probjax.ops.attention.backends.triton.config import SplitKVConfig
from probjax.ops.attention.reference import reference_attention, reference_vjp
from probjax.ops.attention.tolerances import max_error, tolerance

GPU = Device("gpu", (9, 0), 140 << 30)


def _case(seed, *, batch=3, heads=4, kv_heads=2, d=32, page_size=16, pages_per_seq=3, spare=2,
          lengths=(37, 5, 16), q_len=1):
  """Pools with the sequences' pages in shuffled pool order, NaN in the ``spare`` unused pages
  and past each length; returns ``(q, k_pool, v_pool, table, lengths, k, v)`` with ``k``/``v``
  the contiguous cache (zeros where the pools hold NaN)."""
  rng = np.random.default_rng(seed)
  num_pages = batch * pages_per_seq + spare
  order = rng.permutation(num_pages)
  table = order[:batch * pages_per_seq].reshape(batch, pages_per_seq).astype(np.int32)
  kp = rng.standard_normal((num_pages, page_size, kv_heads, d)).astype(np.float32)
  vp = rng.standard_normal((num_pages, page_size, kv_heads, d)).astype(np.float32)
  poison = np.ones((num_pages, page_size), bool)
  for b, n in enumerate(lengths):
    for p in range(pages_per_seq):
      valid = np.clip(n - p * page_size, 0, page_size)
      poison[table[b, p], :valid] = False
  kp[poison], vp[poison] = np.nan, np.nan
  q = rng.standard_normal((batch, q_len, heads, d)).astype(np.float32)
  contiguous = lambda pool: np.nan_to_num(pool[table].reshape(batch, pages_per_seq * page_size, kv_heads, d))
  return (jnp.asarray(q), jnp.asarray(kp), jnp.asarray(vp), jnp.asarray(table),
          jnp.asarray(lengths, jnp.int32), contiguous(kp), contiguous(vp))


IMPLS = {"xla": dict(implementation="xla"), "triton": dict(implementation="triton", interpret=True)}
CASES = {
    "gqa_page16": dict(),
    "mqa_page48_blocks16": dict(heads=3, kv_heads=1, page_size=48, pages_per_seq=2, lengths=(49, 96, 1)),
    "page128_blocks64": dict(batch=2, heads=2, kv_heads=2, page_size=128, pages_per_seq=2, lengths=(129, 200)),
    "three_queries": dict(q_len=3, lengths=(48, 17, 33)),
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("impl", sorted(IMPLS))
def test_paged_equals_contiguous_and_reference(impl, case):
  q, kp, vp, table, lengths, k, v = _case(0, **CASES[case])
  mask = KVLenMask(lengths)
  out = dot_product_attention(q, kp, vp, mask=mask, page_table=table, **IMPLS[impl])
  ref = reference_attention(q, k, v, mask=mask)
  assert max_error(out, ref) <= tolerance(jnp.float32)
  contiguous = dot_product_attention(q, jnp.asarray(k), jnp.asarray(v), mask=mask, implementation="xla")
  assert max_error(out, contiguous) <= tolerance(jnp.float32)


def test_triton_paged_several_splits_and_jit():
  """Explicit tiles: blocks of 16 in pages of 32, four splits over each sequence's blocks."""
  q, kp, vp, table, lengths, k, v = _case(1, page_size=32, pages_per_seq=4, lengths=(128, 3, 70))
  cfg = SplitKVConfig(block_k=16, num_splits=4)
  f = jax.jit(lambda q, kp, vp, t, n: dot_product_attention(
      q, kp, vp, mask=KVLenMask(n), page_table=t, implementation="triton", interpret=True, split_kv=cfg))
  out = f(q, kp, vp, table, lengths)
  assert max_error(out, reference_attention(q, k, v, mask=KVLenMask(lengths))) <= tolerance(jnp.float32)


@pytest.mark.parametrize("impl", sorted(IMPLS))
def test_paged_gradients_and_tangents_are_the_gather_paths(impl):
  """Gradients of the queries and the pools (NaN pages get zero gradient) against the float64
  reference's, and a forward-mode tangent through the kernel's custom_jvp."""
  q, kp, vp, table, lengths, k, v = _case(2, lengths=(20, 48, 9))
  mask = KVLenMask(lengths)
  f = lambda q, kp, vp: dot_product_attention(q, kp, vp, mask=mask, page_table=table, **IMPLS[impl])
  out, pull = jax.vjp(f, q, kp, vp)
  do = jnp.asarray(np.random.default_rng(3).standard_normal(out.shape), jnp.float32)
  dq, dkp, dvp = pull(do)
  _, rdq, rdk, rdv, _ = reference_vjp(q, k, v, do, mask=mask)
  assert max_error(dq, rdq) <= tolerance(jnp.float32, grad=True)
  # The pools' gradients, gathered through the table, are the contiguous cache's.
  valid = (np.arange(k.shape[1])[None, :] < np.asarray(lengths)[:, None])[:, :, None, None]
  gathered = lambda g: np.asarray(g)[np.asarray(table)].reshape(k.shape)
  assert max_error(np.where(valid, gathered(dkp), 0), rdk) <= tolerance(jnp.float32, grad=True)
  assert max_error(np.where(valid, gathered(dvp), 0), rdv) <= tolerance(jnp.float32, grad=True)
  assert np.all(np.isfinite(np.asarray(dkp))) and np.all(np.isfinite(np.asarray(dvp)))
  _, tangent = jax.jvp(lambda q: f(q, kp, vp), (q,), (do[:, :, :, :q.shape[-1]],))
  assert np.all(np.isfinite(np.asarray(tangent)))


@pytest.mark.parametrize("impl", sorted(IMPLS))
@pytest.mark.parametrize("entry", [11, 99, -1])
def test_concrete_page_table_out_of_range_is_refused(impl, entry):
  q, kp, vp, table, lengths, *_ = _case(0)   # 11 pages
  table = table.at[1, 2].set(entry)
  with pytest.raises(ValueError, match=r"page_table entries .*\[0, 11\)"):
    dot_product_attention(q, kp, vp, mask=KVLenMask(lengths), page_table=table, **IMPLS[impl])


@pytest.mark.parametrize("impl", sorted(IMPLS))
def test_traced_out_of_range_entries_read_page_zero_with_zero_weight(impl):
  """Under jit the table cannot be checked: an entry outside the pool reads page 0 (the clamp
  page, NaN-poisoned here) and its positions get zero weight, on both paths."""
  q, kp, vp, table, lengths, k, v = _case(4, lengths=(48, 40, 33))
  kp, vp = kp.at[0].set(jnp.nan), vp.at[0].set(jnp.nan)
  bad = table.at[0, 1].set(-3).at[1, 0].set(99)
  f = jax.jit(lambda t: dot_product_attention(q, kp, vp, mask=KVLenMask(lengths), page_table=t, **IMPLS[impl]))
  out = f(bad)
  dense = np.ones((3, 1, 1, 48), bool)
  dense[0, ..., 16:32] = dense[1, ..., :16] = False     # the bad entries' positions
  page0 = np.asarray(table) == 0                        # and the pages that were page 0 (now NaN)
  dense[np.repeat(page0, 16, axis=1)[:, None, None, :]] = False
  k, v = np.where(dense[:, 0, 0, :, None, None], k, 0), np.where(dense[:, 0, 0, :, None, None], v, 0)
  ref = reference_attention(q, k, v, mask=KVLenMask(lengths), dense_mask=dense)
  assert max_error(out, ref) <= tolerance(jnp.float32)


def test_paged_needs_key_lengths_and_a_valid_table():
  q, kp, vp, table, lengths, *_ = _case(0)
  with pytest.raises(ValueError, match="page_table needs the key lengths"):
    dot_product_attention(q, kp, vp, page_table=table)
  out = dot_product_attention(q, kp, vp, key_value_seq_lengths=lengths, page_table=table)
  assert out.shape == q.shape
  with pytest.raises(ValueError, match="page_table's batch"):
    dot_product_attention(q, kp, vp, mask=KVLenMask(lengths), page_table=table[:2])
  with pytest.raises(TypeError, match="page_table must be an integer"):
    dot_product_attention(q, kp, vp, mask=KVLenMask(lengths), page_table=table.astype(jnp.float32))
  with pytest.raises(ValueError, match="page pool"):
    dot_product_attention(q, kp[None], vp[None], mask=KVLenMask(lengths), page_table=table)


def test_dispatch_of_paged_calls():
  """The default reads pages with the decode kernel on a GPU where it computes the call; every
  other backend refuses paged calls with the reason, and XLA gathers."""
  s = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.bfloat16)
  q, kv = (8, 1, 32, 128), (8, 4096, 8, 128)
  d = explain_dispatch(q, kv, jnp.bfloat16, mask=KVLenMask(jnp.ones(8, jnp.int32)), page_size=64, device=GPU)
  assert d.implementation == "triton" and d.get("split_kv") is not None
  d = explain_dispatch(q, kv, jnp.bfloat16, mask=KVLenMask(jnp.ones(8, jnp.int32)), page_size=8, device=GPU)
  assert d.implementation == "xla" and "page_size 8" in d.rule
  d = explain_dispatch((8, 100, 32, 128), kv, jnp.bfloat16, mask=KVLenMask(jnp.ones(8, jnp.int32)),
                       page_size=64, device=GPU)
  assert d.implementation == "xla"
  assert explain_dispatch(q, kv, jnp.bfloat16, mask=KVLenMask(jnp.ones(8, jnp.int32)), page_size=64,
                          device=Device("cpu")).implementation == "xla"
  for impl in ("cudnn", "mosaic"):
    with pytest.raises(ValueError, match="paged KV cache"):
      explain_dispatch(q, kv, jnp.bfloat16, mask=KVLenMask(jnp.ones(8, jnp.int32)), page_size=64, device=GPU,
                       implementation=impl)
  with pytest.raises(ValueError, match="page_size 8"):
    explain_dispatch(q, kv, jnp.bfloat16, mask=KVLenMask(jnp.ones(8, jnp.int32)), page_size=8, device=GPU,
                     implementation="triton")
  del s


def test_triton_refuses_what_its_kernel_cannot_read():
  q, kp, vp, table, lengths, *_ = _case(0, page_size=8, pages_per_seq=6)
  with pytest.raises(ValueError, match="page_size 8 is not a multiple of 16"):
    dot_product_attention(q, kp, vp, mask=KVLenMask(lengths), page_table=table, implementation="triton",
                          interpret=True)
  with pytest.raises(ValueError, match="score_mod"):
    q, kp, vp, table, lengths, *_ = _case(0)
    dot_product_attention(q, kp, vp, mask=KVLenMask(lengths), page_table=table, implementation="triton",
                          interpret=True, logits_soft_cap=30.0)
  # The gather path computes what the kernel does not: a soft cap, exactly.
  out = dot_product_attention(q, kp, vp, mask=KVLenMask(lengths), page_table=table, logits_soft_cap=30.0)
  assert np.all(np.isfinite(np.asarray(out)))


@pytest.mark.parametrize("page_size", [16, 48, 128])
def test_paged_decode_kernel_lowers_for_sm90(monkeypatch, page_size):
  """The page reads (a scalar load of the table per key block, a traced page as the pool's
  leading index) lower for sm_90 and pass MLIR's verifier, at bfloat16 decoding shapes."""
  import probjax.ops.attention.backends.triton as pt
  from probjax.ops.attention import gpu
  from probjax.testing import pretend_h200, verify_triton_lowering
  pretend_h200(monkeypatch)
  monkeypatch.setattr(pt, "supports", lambda *a, **kw: None)
  monkeypatch.setattr(gpu, "device_kind", lambda device=None: "sm_90")
  verify_triton_lowering(monkeypatch)
  q = jax.ShapeDtypeStruct((2, 1, 32, 128), jnp.bfloat16)
  pool = jax.ShapeDtypeStruct((64, page_size, 8, 128), jnp.bfloat16)
  table = jax.ShapeDtypeStruct((2, 4096 // page_size // 2), jnp.int32)
  lengths = jax.ShapeDtypeStruct((2,), jnp.int32)
  f = lambda q, k, v, t, n: pt.paged_attention(q, k, v, t, mask=KVLenMask(n))
  text = jax.jit(f).trace(q, pool, pool, table, lengths).lower(lowering_platforms=("cuda",)).as_text()
  assert "probjax_attention_fwd_split_kv" in text


@pytest.mark.gpu
@pytest.mark.parametrize("page_size", [16, 64, 256])
def test_gpu_paged_decode_at_full_size(page_size):
  """bfloat16 decoding at a serving shape (B8, H32/8, D128, 4096 positions per sequence in
  shuffled pages, ragged lengths, NaN past them): the default picks the decode kernel and
  matches the float64 reference on the contiguous cache."""
  pages_per_seq = 4096 // page_size
  q, kp, vp, table, lengths, k, v = _case(7, batch=8, heads=32, kv_heads=8, d=128, page_size=page_size,
                                          pages_per_seq=pages_per_seq, spare=pages_per_seq,
                                          lengths=(4096, 1, 1000, 4095, 17, 2048, 3333, 64))
  q, kp, vp = (x.astype(jnp.bfloat16) for x in (q, kp, vp))
  mask = KVLenMask(lengths)
  assert explain_dispatch(q.shape, (8, 4096, 8, 128), jnp.bfloat16, mask=mask,
                          page_size=page_size).implementation == "triton"
  out = jax.jit(lambda q, kp, vp, t: dot_product_attention(q, kp, vp, mask=mask, page_table=t))(q, kp, vp, table)
  rounded = lambda x: np.asarray(jnp.asarray(x, jnp.bfloat16), np.float32)   # the kernel's inputs
  ref = reference_attention(q.astype(jnp.float32), rounded(k), rounded(v), mask=mask)
  assert max_error(out, ref) <= tolerance(jnp.bfloat16)
