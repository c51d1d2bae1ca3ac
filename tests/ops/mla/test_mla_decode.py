"""MLA's absorbed-form decode kernel (Pallas Triton, interpret mode on CPU): contiguous and paged
latent caches against mla's XLA absorbed form and the float64 reference."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from probjax.core.device import Device
from probjax.core.tolerances import max_error, tolerance
from probjax.nn.layers.attention import CausalMask, KVLenMask
from probjax.ops.mla import explain_dispatch, forms, mla
from probjax.ops.mla.backends.triton import decode
from probjax.ops.mla.reference import reference_mla
from probjax.testing import float32_is_tf32

TF32 = float32_is_tf32()  # on a GPU, float32 matmuls run as TF32 (tolerances bound that)

H200 = Device("gpu", (9, 0), 140 << 30)
CPU = Device("cpu")


def inputs(seed, batch, tq, s, *, heads=4, d_nope=8, d_rope=16, d_c=64, d_v=8, dtype=jnp.float32):
  ks = jax.random.split(jax.random.key(seed), 6)
  shapes = [(batch, tq, heads, d_nope), (batch, tq, heads, d_rope), (batch, s, d_c), (batch, s, d_rope),
            (d_c, heads, d_nope), (d_c, heads, d_v)]
  args = [jax.random.normal(k, sh, jnp.float32).astype(dtype) for k, sh in zip(ks, shapes)]
  args[4], args[5] = args[4] * d_c ** -0.5, args[5] * d_c ** -0.5
  return args


def plant_nan(args, lengths):
  ok = (jnp.arange(args[2].shape[1])[None, :] < lengths[:, None])[:, :, None]
  args[2], args[3] = jnp.where(ok, args[2], jnp.nan), jnp.where(ok, args[3], jnp.nan)
  return args


def to_pages(x, page_size, seed):
  """A contiguous cache ``[B, S, d]`` (S a multiple of page_size) as a shuffled page pool and table."""
  b, s, d = x.shape
  n = s // page_size
  perm = np.random.default_rng(seed).permutation(b * n)
  pool = jnp.zeros((b * n, page_size, d), x.dtype).at[perm].set(x.reshape(b * n, page_size, d))
  return pool, jnp.asarray(perm.reshape(b, n), jnp.int32)


@pytest.mark.slow   # interpret mode
@pytest.mark.parametrize("tq,s,lengths", [(1, 1, [1, 0]), (2, 7, [7, 3]), (1, 48, [48, 5]),
                                          pytest.param(2, 600, [600, 0], marks=pytest.mark.slow)])
def test_kernel_matches_xla_form_and_reference(tq, s, lengths):
  lengths = jnp.array(lengths, jnp.int32)
  args = plant_nan(inputs(0, 2, tq, s), lengths)
  mask = KVLenMask(lengths)
  ref = reference_mla(*args, mask=mask)
  out = mla(*args, mask=mask, form="absorbed", implementation="triton")
  xla = mla(*args, mask=mask, form="absorbed")
  tol = tolerance(jnp.float32, tf32=TF32)
  assert not jnp.isnan(out).any()
  assert max_error(out, ref) <= tol and max_error(out, xla) <= tol
  assert jnp.all(out[lengths == 0] == 0)


@pytest.mark.slow   # interpret mode
@pytest.mark.parametrize("s,page_size,lengths", [(48, 16, [48, 17]), (64, 32, [0, 33])])
def test_paged_equals_contiguous(s, page_size, lengths):
  lengths = jnp.array(lengths, jnp.int32)
  args = plant_nan(inputs(1, 2, 2, s), lengths)
  mask = KVLenMask(lengths)
  (lat_pool, table), (rope_pool, _) = to_pages(args[2], page_size, 3), to_pages(args[3], page_size, 3)
  paged = [*args[:2], lat_pool, rope_pool, *args[4:]]
  contiguous = mla(*args, mask=mask, form="absorbed", implementation="triton")
  tol = tolerance(jnp.float32, tf32=TF32)
  for impl in ("triton", None):
    out = mla(*paged, mask=mask, form="absorbed", implementation=impl, page_table=table)
    assert max_error(out, contiguous) <= tol, impl


@pytest.mark.slow   # interpret mode
def test_kernel_lse_and_splits():
  lengths = jnp.array([48, 0], jnp.int32)
  args = plant_nan(inputs(2, 2, 1, 48), lengths)
  q_lat = jnp.einsum("bthd,chd->bthc", args[0], args[4])
  o1, lse1 = decode(q_lat, args[1], args[2], args[3], lengths, scale=0.1, num_splits=1, block_k=16, interpret=True)
  o3, lse3 = decode(q_lat, args[1], args[2], args[3], lengths, scale=0.1, num_splits=3, block_k=16, interpret=True)
  want = forms.log_sum_exp(args[0], args[1], jnp.nan_to_num(args[2]), jnp.nan_to_num(args[3]), args[4],
                           mask=KVLenMask(lengths), scale=0.1)
  tol = tolerance(jnp.float32, tf32=TF32)
  assert max_error(o1, o3) <= tol and max_error(lse1[0], want[0]) <= tol and max_error(lse3[0], want[0]) <= tol
  assert jnp.all(lse3[1] == -jnp.inf) and jnp.all(o3[1] == 0)


@pytest.mark.slow   # interpret mode
def test_gradient_is_the_xla_form_s():
  lengths = jnp.array([7, 3], jnp.int32)
  args = plant_nan(inputs(4, 2, 1, 7), lengths)
  mask = KVLenMask(lengths)
  f = lambda impl: lambda *a: mla(*a, mask=mask, form="absorbed", implementation=impl).sum()
  g_k = jax.grad(f("triton"), argnums=(0, 1, 4, 5))(*args)
  g_x = jax.grad(f(None), argnums=(0, 1, 4, 5))(*args)
  for a, b in zip(g_k, g_x):
    assert max_error(a, b) <= tolerance(jnp.float32, grad=True, tf32=TF32)


def test_dispatch_and_refusals():
  sds = lambda *s: jax.ShapeDtypeStruct(s, jnp.bfloat16)
  shapes = lambda tq, s: (sds(4, tq, 128, 128), sds(4, tq, 128, 64), sds(4, s, 512), sds(4, s, 64),
                          sds(512, 128, 128), sds(512, 128, 128))
  d = explain_dispatch(*shapes(1, 4096), device=H200)
  assert d.get("form") == "absorbed" and d.implementation == "triton" and "split-KV" in d.rule
  assert explain_dispatch(*shapes(1, 4096), device=CPU).implementation == "xla"
  assert explain_dispatch(*shapes(1, 4096), device=H200, mask=CausalMask()).implementation == "xla"
  assert explain_dispatch(*shapes(4096, 4096), device=H200).implementation == "xla"
  assert explain_dispatch(*shapes(2, 4096), device=H200).implementation == "xla"   # two queries: XLA is faster (measured)
  with pytest.raises(ValueError, match="implementation"):
    explain_dispatch(*shapes(1, 4096), device=H200, implementation="triton", form="absorbed", mask=CausalMask())
  bad = (sds(1, 1, 4, 8), sds(1, 1, 4, 12), sds(1, 16, 64), sds(1, 16, 12), sds(64, 4, 8), sds(64, 4, 8))
  with pytest.raises(ValueError, match="d_rope"):
    explain_dispatch(*bad, device=H200, implementation="triton", form="absorbed")
  args = inputs(5, 1, 1, 32)
  with pytest.raises(ValueError, match="KVLenMask"):
    mla(*args, form="absorbed", page_table=jnp.zeros((1, 2), jnp.int32))


@pytest.mark.quick  # the few-minute GPU selection (MARK='gpu and quick')
@pytest.mark.gpu
def test_gpu_h128_bf16():
  b, s = 4, 4096
  lengths = jnp.array([4096, 1000, 1, 0], jnp.int32)
  args = plant_nan(inputs(6, b, 1, s, heads=128, d_nope=128, d_rope=64, d_c=512, d_v=128, dtype=jnp.bfloat16), lengths)
  mask = KVLenMask(lengths)
  assert explain_dispatch(*args, mask=mask).implementation == "triton"
  out = mla(*args, mask=mask, form="absorbed")
  ref = reference_mla(*args, mask=mask)
  assert max_error(out, ref) <= tolerance(jnp.bfloat16)
  (lat, table), (rope, _) = to_pages(args[2], 64, 0), to_pages(args[3], 64, 0)
  paged = mla(*args[:2], lat, rope, *args[4:], mask=mask, form="absorbed", page_table=table)
  assert max_error(paged, out) <= tolerance(jnp.bfloat16)
