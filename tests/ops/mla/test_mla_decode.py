"""MLA's absorbed-form decode kernel (Pallas Triton, interpret mode on CPU): the conformance
suite (tests/ops/mla/conformance.py) on the ``triton`` backend, contiguous and paged latent
caches; the kernel's split-KV combine and log-sum-exp; a full-size GPU case."""

import jax
import jax.numpy as jnp
import pytest

from probjax.core.device import Device
from probjax.core.tolerances import max_error, tolerance
from probjax.nn.layers.attention import CausalMask, KVLenMask
from probjax.ops.mla import explain_dispatch, forms, mla
from probjax.ops.mla.backends.triton import decode
from probjax.ops.mla.reference import reference_mla
from probjax.testing import float32_is_tf32
from tests.ops.mla.conformance import MLAConformance, inputs, to_pages

TF32 = float32_is_tf32()  # on a GPU, float32 matmuls run as TF32 (tolerances bound that)

H200 = Device("gpu", (9, 0), 140 << 30)
A100 = Device("gpu", (8, 0), 80 << 30)
CPU = Device("cpu")
DIMS = dict(heads=4, d_nope=8, d_rope=16, d_c=64, d_v=8)


def plant_nan(args, lengths):
  ok = (jnp.arange(args[2].shape[1])[None, :] < lengths[:, None])[:, :, None]
  args[2], args[3] = jnp.where(ok, args[2], jnp.nan), jnp.where(ok, args[3], jnp.nan)
  return args


def _paged_by_8(args):
  """The cache as a pool of 8-position pages (the kernel's pages are multiples of 16)."""
  args[2], args[3] = (x.reshape(-1, 8, x.shape[-1]) for x in args[2:4])
  return dict(mask=KVLenMask(jnp.array([20, 32], jnp.int32)), page_table=jnp.arange(8, dtype=jnp.int32).reshape(2, 4))


class TestTritonConformance(MLAConformance):
  """The conformance suite on the decode kernel: the absorbed form, KVLenMask (or none), widths
  a multiple of 16. Its gradient is the XLA absorbed form's (a custom_vjp)."""

  implementation = "triton"
  tf32 = TF32
  forms = ("absorbed",)
  dims = DIMS
  masks = ("none", "kv_len")
  shapes = ((1, 48), (2, 7), (1, 1))
  refusals = (("causal", "absorbed", lambda args: dict(mask=CausalMask()), "KVLenMask only"),
              ("page_size_8", "absorbed", _paged_by_8, "page_size 8"))
  # Interpret mode: every call of a new shape compiles the kernel anew (about a second of CPU):
  # make test runs it in tests/ops/test_never_read.py (a paged decode step under jit), its gradient
  # is the XLA absorbed form's (TestXlaConformance), and here the refusals and the concrete page
  # tables; the bad inputs are refused by mla's validation before any backend (test_mla.py).
  slow_cases = frozenset({"test_values_and_grads[*]", "test_paged[*]", "test_low_precision[*]", "test_jvp[*]",
                          "test_bad_inputs[*]"})

  @pytest.mark.xfail(strict=True, raises=TypeError,
                     reason="forward mode missing: the kernel's gradient is a custom_vjp (backends/triton/backend.py)")
  def test_jvp(self, case):
    super().test_jvp(case)


@pytest.mark.slow   # interpret mode
def test_kernel_lse_and_splits():
  lengths = jnp.array([48, 0], jnp.int32)
  args = plant_nan(inputs(2, 2, 1, 48, **DIMS)[0], lengths)
  q_lat = jnp.einsum("bthd,chd->bthc", args[0], args[4])
  o1, lse1 = decode(q_lat, args[1], args[2], args[3], lengths, scale=0.1, num_splits=1, block_k=16, interpret=True)
  o3, lse3 = decode(q_lat, args[1], args[2], args[3], lengths, scale=0.1, num_splits=3, block_k=16, interpret=True)
  want = forms.log_sum_exp(args[0], args[1], jnp.nan_to_num(args[2]), jnp.nan_to_num(args[3]), args[4],
                           mask=KVLenMask(lengths), scale=0.1)
  tol = tolerance(jnp.float32, tf32=TF32)
  assert max_error(o1, o3) <= tol and max_error(lse1[0], want[0]) <= tol and max_error(lse3[0], want[0]) <= tol
  assert jnp.all(lse3[1] == -jnp.inf) and jnp.all(o3[1] == 0)


def test_dispatch_and_refusals():
  sds = lambda *s: jax.ShapeDtypeStruct(s, jnp.bfloat16)
  shapes = lambda tq, s: (sds(4, tq, 128, 128), sds(4, tq, 128, 64), sds(4, s, 512), sds(4, s, 64),
                          sds(512, 128, 128), sds(512, 128, 128))
  d = explain_dispatch(*shapes(1, 4096), device=A100)   # sm_90 picks the Mosaic kernel (test_mla_mosaic)
  assert d.get("form") == "absorbed" and d.implementation == "triton" and "split-KV" in d.rule
  assert explain_dispatch(*shapes(1, 4096), device=CPU).implementation == "xla"
  assert explain_dispatch(*shapes(1, 4096), device=A100, mask=CausalMask()).implementation == "xla"
  assert explain_dispatch(*shapes(4096, 4096), device=H200).implementation == "xla"
  assert explain_dispatch(*shapes(2, 4096), device=A100).implementation == "xla"   # 256 rows: beyond the Triton kernel's 128
  assert explain_dispatch(*shapes(2, 4096), device=H200).implementation == "mosaic"  # ... and within the Mosaic kernel's 512
  with pytest.raises(ValueError, match="implementation"):
    explain_dispatch(*shapes(1, 4096), device=H200, implementation="triton", form="absorbed", mask=CausalMask())
  bad = (sds(1, 1, 4, 8), sds(1, 1, 4, 12), sds(1, 16, 64), sds(1, 16, 12), sds(64, 4, 8), sds(64, 4, 8))
  with pytest.raises(ValueError, match="d_rope"):
    explain_dispatch(*bad, device=H200, implementation="triton", form="absorbed")
  args, _ = inputs(5, 1, 1, 32, **DIMS)
  with pytest.raises(ValueError, match="KVLenMask"):
    mla(*args, form="absorbed", page_table=jnp.zeros((1, 2), jnp.int32))


@pytest.mark.quick  # the few-minute GPU selection (MARK='gpu and quick')
@pytest.mark.gpu
def test_gpu_h128_bf16():
  b, s = 4, 4096
  lengths = jnp.array([4096, 1000, 1, 0], jnp.int32)
  args = plant_nan(inputs(6, b, 1, s, heads=128, d_nope=128, d_rope=64, d_c=512, d_v=128, dtype=jnp.bfloat16)[0], lengths)
  mask = KVLenMask(lengths)
  assert explain_dispatch(*args, mask=mask).implementation == "mosaic"   # tuning/sm_90.json
  ref = reference_mla(*args, mask=mask)
  (lat, table), (rope, _) = to_pages(args[2], 64, 0), to_pages(args[3], 64, 0)
  for implementation in (None, "triton"):   # the default (Mosaic) and the Triton kernel
    out = mla(*args, mask=mask, form="absorbed", implementation=implementation)
    assert max_error(out, ref) <= tolerance(jnp.bfloat16), implementation
    paged = mla(*args[:2], lat, rope, *args[4:], mask=mask, form="absorbed", implementation=implementation,
                page_table=jnp.asarray(table, jnp.int32))
    assert max_error(paged, out) <= tolerance(jnp.bfloat16), implementation
