"""Multi-head latent attention: the conformance suite (tests/ops/mla/conformance.py) on the
``xla`` backend's two forms, and what is not a backend's case: the scale, the log-sum-exp; the
form rule and the attention implementation it asks for on fake devices; which of attention's
kernels take a value head_dim other than the query/key head_dim."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from probjax.core.device import Device
from probjax.core.dispatch import Decision
from probjax.core.tolerances import max_error, tolerance
from probjax.nn.layers.attention import CausalMask, KVLenMask
from probjax.ops.attention import dispatch as attention_dispatch
from probjax.ops.attention.call import AttentionCall
from probjax.ops.attention.registry import REGISTRY
from probjax.ops.mla import REGISTRY as MLA_REGISTRY, explain, explain_dispatch, mla
from probjax.ops.attention.reference import reference_attention
from probjax.ops.mla.call import make_call
from probjax.ops.mla.reference import reference_mla
from probjax.testing import float32_is_tf32
from tests.ops.mla.conformance import MLAConformance

TF32 = float32_is_tf32()  # on a GPU, float32 matmuls run as TF32 (tolerances bound that)

H200 = Device("gpu", (9, 0), 140 << 30)
CPU = Device("cpu")


class TestXlaConformance(MLAConformance):
  """The conformance suite on both forms of the ``xla`` backend (attention's XLA path)."""

  implementation = "xla"
  tf32 = TF32
  # Each case runs one form eagerly (values and gradients) and the float64 reference: 1-5 s of
  # CPU a new shape, most of it compiling. make test keeps every mask at 7 queries over 48 keys
  # and the one-query decode under causal; the other shapes are slow.
  slow_cases = frozenset({"test_values_and_grads[*]", "test_jvp[*]", "test_low_precision[*]", "test_paged[expanded]"})
  fast_cases = frozenset({"test_values_and_grads[*-7x48]", "test_values_and_grads[*-causal-1x48]"})


@pytest.mark.slow  # four eager forms and two references at a shape of its own
def test_scale_is_the_model_key_width_in_both_forms():
  suite = TestXlaConformance()
  args, do = suite.inputs(1, 1, 5, 9)
  ref = reference_mla(*args, scale=(8 + 4) ** -0.5)
  for form in ("expanded", "absorbed"):
    assert max_error(mla(*args, form=form), ref) <= tolerance(jnp.float32, tf32=TF32)
    suite.check(args, do, CausalMask(offset=4), form, scale=0.3)


@pytest.mark.parametrize("mask", [pytest.param(CausalMask(offset=41), marks=pytest.mark.slow, id="causal"),
                                  pytest.param(KVLenMask(jnp.array([0, 48])), id="kv_len_zero")])
def test_return_lse(mask):
  args, _ = TestXlaConformance().inputs(3, 2, 7, 48)
  _, ref_lse = reference_mla(*args, mask=mask, return_lse=True)
  for form in ("expanded", "absorbed"):
    out, lse = mla(*args, mask=mask, form=form, return_lse=True)
    assert lse.shape == (2, 7, 4)
    finite = np.isfinite(ref_lse)
    assert np.array_equal(np.isfinite(np.asarray(lse)), finite)
    assert max_error(np.where(finite, lse, 0), np.where(finite, ref_lse, 0)) <= tolerance(jnp.float32, tf32=TF32)
  # Differentiable and finite, also through rows with no key.
  g = jax.grad(lambda q: jnp.sum(jnp.where(jnp.isfinite(lse := mla(q, *args[1:], mask=mask, return_lse=True)[1]),
                                           lse, 0.0)))(args[0])
  assert np.all(np.isfinite(np.asarray(g)))


def test_lse_over_several_key_blocks():
  from probjax.ops.mla import forms
  args, _ = TestXlaConformance().inputs(4, 1, 3, 41)
  _, ref_lse = reference_mla(*args, mask=CausalMask(offset=38), return_lse=True)
  lse = forms.log_sum_exp(*args[:5], mask=CausalMask(offset=38), scale=12 ** -0.5, block=8)
  assert max_error(lse, ref_lse) <= tolerance(jnp.float32, tf32=TF32)


# -- the form rule and the attention implementation ----------------------------------------
def shapes(b, tq, s, h=128, dn=128, dr=64, dc=512, dv=128, dtype=jnp.bfloat16):
  sd = lambda *sh: jax.ShapeDtypeStruct(sh, dtype)
  return (sd(b, tq, h, dn), sd(b, tq, h, dr), sd(b, s, dc), sd(b, s, dr), sd(dc, h, dn), sd(dc, h, dv))


@pytest.mark.parametrize("tq,s,form", [(4096, 4096, "expanded"), (1, 4096, "absorbed"), (16, 4096, "absorbed"),
                                       (64, 4096, "absorbed"), (512, 4096, "expanded"), (2048, 2048, "expanded"),
                                       (1, 1, "expanded")])
def test_auto_form(tq, s, form):
  d = explain_dispatch(*shapes(2, tq, s), device=CPU)
  assert d.get("form") == form and "queries over" in d.get("form_rule")
  assert d.implementation == "xla" and d.get("attention").implementation == "default"


def test_on_a_gpu_widths_that_differ_leave_it_to_attention():
  """Attention's dispatch sees the value width (test_default_dispatch_of_value_head_dim: where to)."""
  d = explain_dispatch(*shapes(2, 4096, 4096), device=H200)        # expanded: d_qk 192, d_v 128
  assert d.get("form") == "expanded" and d.get("attention").implementation == "default"
  assert "value head_dim 128" in d.get("attention").rule
  d = explain_dispatch(*shapes(64, 5, 4096), device=H200)          # absorbed: d_qk 576, d_v 512
  assert d.get("form") == "absorbed" and d.get("attention").implementation == "default"
  assert "head_dim 576" in d.get("attention").rule
  d = explain_dispatch(*shapes(2, 4096, 4096, dn=64, dv=128), device=H200)   # 64 + 64 = 128: one width
  assert d.get("attention") == Decision("default", "attention's default")
  d = explain_dispatch(*shapes(2, 64, 64), implementation="triton", device=H200)
  assert d.implementation == "xla" and d.get("attention") == Decision("triton", "requested")


# -- every decision against the one the dispatch gave before the registry (issue 40) ----------
# The rows were first computed by the previous dispatch (MLA's own Decision: form, rule, kernel,
# kernel_rule, attention_implementation, attention_rule) before it moved to the core Decision;
# they are data, so a change of any choice or reason shows here. Columns: device, widths, q_len,
# kv_len, form, implementation, mask, page_size -> implementation (the MLA backend), form, the
# form's reason, the backend's reason, what the form asks attention for and why (None on the
# kernel), or the ValueError's message.
DEVICES = {"h200": H200, "cpu": CPU, "rocm": Device("gpu", None, 64 << 30)}
WIDTHS = {  # batch, heads, d_nope, d_rope, d_c, d_v, dtype
    "deepseek": (4, 128, 128, 64, 512, 128, jnp.bfloat16),
    "small": (2, 4, 8, 4, 12, 6, jnp.float32),
    "equal": (2, 8, 64, 64, 512, 128, jnp.bfloat16),
}
ABSORBED = "{} queries over {} positions: attending over the shared latent does less work than forming K and V per head".format
EXPANDED = "{} queries over {} positions: forming K and V per head does less work than attending over the wide latent".format
WEIGHTED = " (the absorbed form's attention, at the latent widths on attention's XLA path, counted 2x per multiply-add)"
LIMITS = lambda q, heads=128: "; ".join(  # noqa: E731
    f"{k}: {q} queries x {heads} heads = {q * heads} rows > {m}, the kernel's tuned limit (another path was measured "
    "faster beyond it)" for k, m in (("triton", 64), ("mosaic", 512)))
SPLIT_KV = ("absorbed decode of 1 queries: the latent streamed once per head tile by split-KV (forward; the gradient is "
            "the XLA form's)")
SPLIT_KV_2 = SPLIT_KV.replace("of 1 queries", "of 2 queries")
NOT_GPU = "not an absorbed call on an NVIDIA GPU"
ATTENTION_REQUESTED = "an attention implementation was requested"
WIDE_576 = "attention's default at query/key head_dim 576, value head_dim 512"
NARROW_192 = "attention's default at query/key head_dim 192, value head_dim 128"
DISPATCH_TABLE = [
    (('h200', 'deepseek', 1, 4096, 'auto', None, None, None),
     ('mosaic', 'absorbed', ABSORBED(1, 4096), SPLIT_KV, None, None)),
    (('h200', 'deepseek', 1, 4096, 'auto', None, 'kv_len', None),
     ('mosaic', 'absorbed', ABSORBED(1, 4096), SPLIT_KV, None, None)),
    (('h200', 'deepseek', 1, 4096, 'auto', None, 'kv_len', 64),
     ('mosaic', 'absorbed', ABSORBED(1, 4096), SPLIT_KV, None, None)),
    (('h200', 'deepseek', 1, 4096, 'auto', None, 'kv_len', 8),
     ('xla', 'absorbed', ABSORBED(1, 4096) + WEIGHTED, LIMITS(1).split('; ')[0] + '; mosaic: page_size 8: the Mosaic GPU decode kernel takes a power of two >= 64', 'default', WIDE_576)),
    (('h200', 'deepseek', 1, 4096, 'auto', None, 'causal', None),
     ('mosaic', 'absorbed', ABSORBED(1, 4096), SPLIT_KV, None, None)),
    (('h200', 'deepseek', 1, 4096, 'auto', None, 'causal&kv_len', 64),
     ('mosaic', 'absorbed', ABSORBED(1, 4096), SPLIT_KV, None, None)),
    (('h200', 'deepseek', 2, 4096, 'auto', None, None, None),
     ('mosaic', 'absorbed', ABSORBED(2, 4096), SPLIT_KV_2, None, None)),
    (('h200', 'deepseek', 2, 4096, 'auto', None, 'kv_len', 64),
     ('mosaic', 'absorbed', ABSORBED(2, 4096), SPLIT_KV_2, None, None)),
    (('h200', 'deepseek', 16, 4096, 'auto', None, 'kv_len', None),
     ('xla', 'absorbed', ABSORBED(16, 4096) + WEIGHTED, LIMITS(16), 'default', WIDE_576)),
    (('h200', 'deepseek', 64, 4096, 'auto', None, None, None),
     ('xla', 'absorbed', ABSORBED(64, 4096) + WEIGHTED, LIMITS(64), 'default', WIDE_576)),
    (('h200', 'deepseek', 4096, 4096, 'auto', None, 'causal', None),
     ('xla', 'expanded', EXPANDED(4096, 4096), NOT_GPU, 'default', NARROW_192)),
    (('h200', 'deepseek', 4096, 4096, 'absorbed', None, None, None),
     ('xla', 'absorbed', 'requested', LIMITS(4096), 'default', WIDE_576)),
    (('h200', 'deepseek', 1, 4096, 'expanded', None, None, None),
     ('xla', 'expanded', 'requested', NOT_GPU, 'default', NARROW_192)),
    (('h200', 'deepseek', 1, 4096, 'absorbed', 'triton', None, None),
     ('triton', 'absorbed', 'requested', 'requested', None, None)),
    (('h200', 'deepseek', 1, 4096, 'absorbed', 'triton', 'kv_len', 64),
     ('triton', 'absorbed', 'requested', 'requested', None, None)),
    (('h200', 'deepseek', 1, 4096, 'auto', 'triton', 'kv_len', None),
     ('triton', 'absorbed', ABSORBED(1, 4096), 'requested', None, None)),
    (('h200', 'deepseek', 2, 4096, 'absorbed', 'triton', None, None),
     ('triton', 'absorbed', 'requested', 'requested', None, None)),
    (('h200', 'deepseek', 4096, 4096, 'auto', 'triton', 'causal', None),
     ('xla', 'expanded', EXPANDED(4096, 4096), ATTENTION_REQUESTED, 'triton', 'requested')),
    (('h200', 'deepseek', 4096, 4096, 'expanded', 'triton', None, None),
     ('xla', 'expanded', 'requested', ATTENTION_REQUESTED, 'triton', 'requested')),
    (('h200', 'deepseek', 1, 4096, 'absorbed', 'cudnn', None, None),
     ('xla', 'absorbed', 'requested', ATTENTION_REQUESTED, 'cudnn', 'requested')),
    (('h200', 'deepseek', 1, 4096, 'auto', 'xla', 'kv_len', 64),
     ('xla', 'absorbed', ABSORBED(1, 4096), ATTENTION_REQUESTED, 'xla', 'requested')),
    (('h200', 'deepseek', 1, 4096, 'auto', 'pallas', None, None),
     ('xla', 'absorbed', ABSORBED(1, 4096), ATTENTION_REQUESTED, 'pallas', 'requested')),
    (('h200', 'deepseek', 1, 4096, 'absorbed', 'triton', 'causal', None),
     (ValueError, "implementation='triton': mask predicates ('band',): the decode kernel takes KVLenMask only")),
    (('h200', 'deepseek', 1, 4096, 'absorbed', 'triton', 'kv_len', 8),
     (ValueError, "implementation='triton': page_size 8 must be a multiple of 16 (>= 16)")),
    (('h200', 'small', 1, 64, 'absorbed', 'triton', None, None),
     (ValueError, "implementation='triton': d_c 12 is not a multiple of 16")),
    (('h200', 'small', 1, 64, 'auto', None, None, None),
     ('xla', 'absorbed', ABSORBED(1, 64) + WEIGHTED, 'triton: d_c 12 is not a multiple of 16; mosaic: dtype float32: the Mosaic GPU decode kernel takes bfloat16 and float16', 'default', "attention's default at query/key head_dim 16, value head_dim 12")),
    (('h200', 'small', 4, 64, 'auto', None, 'causal', None),
     ('xla', 'absorbed', ABSORBED(4, 64) + WEIGHTED, "triton: mask predicates ('band',): the decode kernel takes KVLenMask only; mosaic: dtype float32: the Mosaic GPU decode kernel takes bfloat16 and float16", 'default', "attention's default at query/key head_dim 16, value head_dim 12")),
    (('h200', 'equal', 4096, 4096, 'auto', None, None, None),
     ('xla', 'expanded', EXPANDED(4096, 4096), NOT_GPU, 'default', "attention's default")),
    (('h200', 'equal', 1, 4096, 'auto', None, 'kv_len', 64),   # 8 heads: 8 rows
     ('triton', 'absorbed', ABSORBED(1, 4096), SPLIT_KV, None, None)),
    (('rocm', 'deepseek', 1, 4096, 'auto', None, None, None),
     ('xla', 'absorbed', ABSORBED(1, 4096) + WEIGHTED, NOT_GPU, 'default', WIDE_576)),
    (('cpu', 'deepseek', 1, 4096, 'auto', None, None, None),
     ('xla', 'absorbed', ABSORBED(1, 4096), NOT_GPU, 'default', WIDE_576)),
    (('cpu', 'deepseek', 1, 4096, 'auto', None, 'kv_len', 64),
     ('xla', 'absorbed', ABSORBED(1, 4096), NOT_GPU, 'default', WIDE_576)),
    (('cpu', 'deepseek', 4096, 4096, 'auto', None, 'causal', None),
     ('xla', 'expanded', EXPANDED(4096, 4096), NOT_GPU, 'default', NARROW_192)),
    (('cpu', 'deepseek', 1, 4096, 'absorbed', 'triton', 'kv_len', None),
     ('triton', 'absorbed', 'requested', 'requested (Pallas interpret mode off the GPU)', None, None)),
    (('cpu', 'deepseek', 1, 4096, 'absorbed', 'triton', 'kv_len', 64),
     ('triton', 'absorbed', 'requested', 'requested (Pallas interpret mode off the GPU)', None, None)),
    (('cpu', 'deepseek', 1, 4096, 'auto', 'triton', None, None),
     ('triton', 'absorbed', ABSORBED(1, 4096), 'requested (Pallas interpret mode off the GPU)', None, None)),
    (('cpu', 'deepseek', 4096, 4096, 'auto', 'triton', None, None),
     ('xla', 'expanded', EXPANDED(4096, 4096), ATTENTION_REQUESTED, 'triton', 'requested')),
    (('cpu', 'small', 1, 64, 'auto', None, None, None),
     ('xla', 'absorbed', ABSORBED(1, 64), NOT_GPU, 'default', "attention's default at query/key head_dim 16, value head_dim 12")),
    (('cpu', 'small', 1, 64, 'absorbed', 'triton', None, None),
     (ValueError, "implementation='triton': d_c 12 is not a multiple of 16")),
    (('cpu', 'small', 2, 9, 'expanded', None, 'causal', None),
     ('xla', 'expanded', 'requested', NOT_GPU, 'default', "attention's default at query/key head_dim 12, value head_dim 6")),
    (('cpu', 'small', 1, 1, 'auto', None, None, None),
     ('xla', 'expanded', EXPANDED(1, 1), NOT_GPU, 'default', "attention's default at query/key head_dim 12, value head_dim 6")),
    (('cpu', 'equal', 2048, 2048, 'auto', 'cudnn', None, None),
     ('xla', 'expanded', EXPANDED(2048, 2048), ATTENTION_REQUESTED, 'cudnn', 'requested')),
    (('cpu', 'deepseek', 1, 4096, 'sideways', None, None, None),
     (ValueError, "form must be one of ('auto', 'expanded', 'absorbed'), got 'sideways'")),
]


def table_arguments(widths, q_len, kv_len, mask, page_size):
  b, h, dn, dr, dc, dv, dt = WIDTHS[widths]
  sd = lambda *sh: jax.ShapeDtypeStruct(sh, dt)
  lengths = KVLenMask(jnp.full((b,), kv_len // 2, jnp.int32))
  kw = {"mask": {None: None, "kv_len": lengths, "causal": CausalMask(), "causal&kv_len": CausalMask() & lengths}[mask]}
  if page_size is None:
    lat, rope = sd(b, kv_len, dc), sd(b, kv_len, dr)
  else:
    pages = kv_len // page_size
    lat, rope = sd(b * pages, page_size, dc), sd(b * pages, page_size, dr)
    kw["page_table"] = jax.ShapeDtypeStruct((b, pages), jnp.int32)
  return (sd(b, q_len, h, dn), sd(b, q_len, h, dr), lat, rope, sd(dc, h, dn), sd(dc, h, dv)), kw


def test_every_decision_is_the_previous_dispatch_s():
  for (device, widths, q_len, kv_len, form, implementation, mask, page_size), want in DISPATCH_TABLE:
    args, kw = table_arguments(widths, q_len, kv_len, mask, page_size)
    ask = lambda: explain_dispatch(*args, form=form, implementation=implementation, device=DEVICES[device], **kw)
    if want[0] is ValueError:
      with pytest.raises(ValueError) as err:
        ask()
      assert str(err.value) == want[1], (device, widths, q_len, kv_len, form, implementation, mask, page_size)
      continue
    d = ask()
    attention = d.get("attention")
    got = (d.implementation, d.get("form"), d.get("form_rule"), d.rule,
           None if attention is None else attention.implementation, None if attention is None else attention.rule)
    assert got == want, (device, widths, q_len, kv_len, form, implementation, mask, page_size)
    assert d.implementation in MLA_REGISTRY.names() and isinstance(d, Decision)
    assert explain(*args, form=form, implementation=implementation, device=DEVICES[device], **kw) == d


def test_the_registry_names_and_requests():
  """Three backends; an explicit "triton" (or "mosaic") with the absorbed form is MLA's kernel (a
  ValueError with the kernel's reason where it cannot compute the call), any other name goes to
  attention."""
  assert MLA_REGISTRY.names() == ("xla", "triton", "mosaic") and explain is explain_dispatch
  call = shapes(4, 1, 4096)
  triton = MLA_REGISTRY.get("triton")
  assert triton.supports(make_call(*call), H200) is None
  assert "KVLenMask" in triton.supports(make_call(*call, mask_kinds=("band",)), H200)
  assert "page_size 8" in triton.supports(make_call(*call, page_size=8), H200)
  assert MLA_REGISTRY.get("xla").supports(make_call(*call, mask_kinds=("band",)), CPU) is None
  d = explain_dispatch(*call, device=CPU, implementation="flash")   # attention refuses it when called
  assert d.implementation == "xla" and d.get("attention") == Decision("flash", "requested")
  row = explain_dispatch(*call, device=H200).as_dict()
  assert row["implementation"] == "mosaic" and row["config"]["form"] == "absorbed" and row["rule"] == SPLIT_KV


@pytest.mark.parametrize("name", ["triton", "mosaic", "cudnn"])
def test_kernels_refuse_a_value_head_dim_of_their_own(name, monkeypatch):
  """The Triton kernels compute values of their own width; the Mosaic forward MLA's 192/128
  (not a value head_dim 32, below); cuDNN only through probjax's FFI extension, switched off
  here (tests/ops/attention/test_cudnn_ffi.py checks it with the extension)."""
  monkeypatch.setenv("PROBJAX_ATTENTION_CUDNN_FFI", "0")
  call = AttentionCall((2, 4096, 16, 192), (2, 4096, 16, 192), jnp.bfloat16, mask=CausalMask(), v_head_dim=128)
  why = REGISTRY.get(name).supports(call, H200)
  if name in ("triton", "mosaic"):
    assert why is None
  else:
    assert why is not None and "value head_dim" in why
  assert REGISTRY.get("xla").supports(call, H200) is None
  same = AttentionCall((2, 4096, 16, 128), (2, 4096, 16, 128), jnp.bfloat16, v_head_dim=128)
  assert same.v_head_dim is None
  d, dv = (64, 32) if name == "mosaic" else (16, 8)
  ks = jax.random.split(jax.random.key(3), 2)
  q = jax.random.normal(ks[0], (1, 8, 2, d), jnp.float32).astype(jnp.bfloat16)
  v = jax.random.normal(ks[1], (1, 8, 2, dv), jnp.float32).astype(jnp.bfloat16)
  # A call description without the value width: each kernel reads v's.
  plain = AttentionCall(q.shape, q.shape, q.dtype, interpret=name != "cudnn")
  if name == "triton":
    out = REGISTRY.get(name)(q, q, v, None, call=plain)
    assert out.shape == (1, 8, 2, dv)
    assert max_error(out, reference_attention(q, q, v)) <= tolerance(jnp.bfloat16)
    return
  with pytest.raises(ValueError, match="value head_dim"):
    REGISTRY.get(name)(q, q, v, None, call=plain)


def test_explicit_kernel_with_value_head_dim():
  """implementation="triton" computes values of their own width (against the reference) and
  refuses one wider than its kernels load."""
  from probjax.nn.layers.attention import dot_product_attention
  ks = jax.random.split(jax.random.key(4), 3)
  q, k = (jax.random.normal(key, (1, 8, 2, 16), jnp.float32) for key in ks[:2])
  v = jax.random.normal(ks[2], (1, 8, 2, 8), jnp.float32)
  out = dot_product_attention(q, k, v, mask=CausalMask(), implementation="triton", interpret=True)
  assert max_error(out, reference_attention(q, k, v, mask=CausalMask())) <= tolerance(jnp.float32, tf32=TF32)
  with pytest.raises(ValueError, match="value head_dim 300"):
    dot_product_attention(q, k, jnp.ones((1, 8, 2, 300)), implementation="triton", interpret=True)


def test_default_dispatch_of_value_head_dim(monkeypatch):
  """MLA's 192/128 runs cuDNN by default where probjax's FFI extension is there (rule 4: its
  backward is 3-4x ahead of the Triton one), else the Mosaic forward with the Triton backward
  (rule 9)."""
  from probjax.ops.attention.backends.cudnn import ffi
  shapes = ((2, 4096, 16, 192), (2, 4096, 16, 192), jnp.bfloat16)
  for mask in (CausalMask(), None):
    if ffi.unavailable() is None:
      d = attention_dispatch.explain_dispatch(*shapes, mask=mask, device=H200, env={}, v_head_dim=128)
      assert (d.implementation, d.grad) == ("cudnn", None), d
    monkeypatch.setenv("PROBJAX_ATTENTION_CUDNN_FFI", "0")
    d = attention_dispatch.explain_dispatch(*shapes, mask=mask, device=H200, env={}, v_head_dim=128)
    assert (d.implementation, d.grad) == ("mosaic", None), d
    assert d.backward.startswith("triton"), d
    monkeypatch.delenv("PROBJAX_ATTENTION_CUDNN_FFI")
  # the absorbed form's 576-wide keys are wider than every kernel's tiles: XLA
  d = attention_dispatch.explain_dispatch((64, 1, 128, 576), (64, 4096, 1, 576), jnp.bfloat16,
                                          device=H200, env={}, v_head_dim=512)
  assert d.implementation == "xla", d


def test_the_absorbed_form_counts_its_xla_attention_at_the_tuned_cost():
  """On a GPU, an absorbed call that no MLA kernel takes attends at the latent widths on
  attention's XLA path: ``absorbed_attention_cost`` (``tuning/gpu.json``) weights that work, so a
  chunk of 160 queries over 11290 cached positions, about even in multiply-adds, expands there;
  off the GPU the unweighted count keeps it absorbed."""
  call = shapes(13, 160, 11290, h=64, dtype=jnp.float16)
  d = explain_dispatch(*call, device=H200)
  assert (d.implementation, d.get("form")) == ("xla", "expanded") and WEIGHTED in d.get("form_rule"), d
  assert explain_dispatch(*call, device=CPU).get("form") == "absorbed"
  assert explain_dispatch(*call, device=H200, implementation="xla").get("form") == "absorbed"   # a request: unweighted
  assert explain_dispatch(*shapes(4, 1, 4096), device=H200).get("form_rule") == ABSORBED(1, 4096)   # a kernel takes it


def test_decode_kernels_are_tried_in_the_tuned_order(tmp_path, monkeypatch):
  """``decode_kernels`` lists ``(kernel, max_rows)`` fastest first: the first that takes the
  call and holds its heads x queries runs it; the XLA path runs where none does, with every
  kernel's reason."""
  from probjax.ops.mla import dispatch as mla_dispatch
  (tmp_path / "gpu.json").write_text('{"decode_kernels": [["mosaic", 512], ["triton", 128]]}')
  monkeypatch.setattr(mla_dispatch, "TUNING", str(tmp_path))
  a100 = Device("gpu", (8, 0), 80 << 30)
  assert explain_dispatch(*shapes(4, 1, 4096), device=H200).implementation == "mosaic"
  assert explain_dispatch(*shapes(4, 3, 4096), device=H200).implementation == "mosaic"
  assert explain_dispatch(*shapes(4, 1, 4096), device=a100).implementation == "triton"  # Mosaic: sm_90 only
  d = explain_dispatch(*shapes(4, 3, 4096), device=a100)
  assert d.implementation == "xla" and d.get("form") == "absorbed", d
  assert "mosaic: " in d.rule and "triton: 3 queries x 128 heads = 384 rows > 128" in d.rule, d.rule
