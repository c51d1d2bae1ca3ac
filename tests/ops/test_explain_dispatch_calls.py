"""Every op's explain_dispatch takes its call object and gives the decision of its other
spelling (attention: shapes and flags; MLA and grouped matmul: arrays), on CPU and on a fake
sm_90 GPU; wrong mixes raise TypeError naming what to drop."""

import itertools

import jax
import jax.numpy as jnp
import pytest

from probjax.core.device import Device
from probjax.ops import attention, grouped_matmul, mla
from probjax.ops.attention import CausalMask, KVLenMask, LocalWindowMask
from probjax.ops.attention.call import AttentionCall
from probjax.ops.scan import RLACall
from probjax.ops.scan import explain_dispatch as scan_explain

DEVICES = (Device("cpu"), Device("gpu", compute_capability=(9, 0)), Device("gpu", compute_capability=(8, 6)))
S = jax.ShapeDtypeStruct


@pytest.mark.parametrize("device", DEVICES, ids=lambda d: f"{d.platform}{d.compute_capability or ''}")
def test_attention(device):
  masks = (None, CausalMask(), LocalWindowMask(128, 0), KVLenMask(jnp.array([900, 300], jnp.int32)))
  for (tq, tk, d, dtype), mask in itertools.product(
      ((4096, 4096, 128, "bfloat16"), (1, 8192, 64, "float16"), (300, 700, 96, "float32")), masks):
    q, kv = (2, tq, 8, d), (2, tk, 2, d)
    call = AttentionCall(q, kv, dtype, mask=mask)
    want = attention.explain_dispatch(q, kv, dtype, mask=mask, device=device)
    assert attention.explain_dispatch(call, device=device) == want, (q, kv, dtype, mask)
  with pytest.raises(TypeError, match="kv_shape"):
    attention.explain_dispatch(call, kv, device=device)
  with pytest.raises(TypeError, match="is_causal"):
    attention.explain_dispatch(call, is_causal=True, device=device)


@pytest.mark.parametrize("device", DEVICES, ids=lambda d: f"{d.platform}{d.compute_capability or ''}")
def test_mla(device):
  for b, tq, tk in ((4, 1, 4096), (2, 512, 512), (8, 2, 16384)):
    arrays = (S((b, tq, 16, 128), jnp.bfloat16), S((b, tq, 16, 64), jnp.bfloat16), S((b, tk, 512), jnp.bfloat16),
              S((b, tk, 64), jnp.bfloat16), S((512, 16, 128), jnp.bfloat16), S((512, 16, 128), jnp.bfloat16))
    for form in ("auto", "expanded", "absorbed"):
      want = mla.explain_dispatch(*arrays, form=form, device=device)
      assert mla.explain_dispatch(mla.make_call(*arrays), form=form, device=device) == want
  with pytest.raises(TypeError, match="q_rope"):
    mla.explain_dispatch(mla.make_call(*arrays), arrays[1], device=device)
  with pytest.raises(TypeError, match="six arrays"):
    mla.explain_dispatch(arrays[0], device=device)


@pytest.mark.parametrize("device", DEVICES, ids=lambda d: f"{d.platform}{d.compute_capability or ''}")
def test_grouped_matmul(device):
  for m, k, n, dtype in ((512, 256, 128, jnp.bfloat16), (100, 37, 12, jnp.float32), (4096, 1024, 512, jnp.float16)):
    lhs, rhs, sizes = S((m, k), dtype), S((8, k, n), dtype), S((8,), jnp.int32)
    want = grouped_matmul.explain_dispatch(lhs, rhs, sizes, device=device)
    assert grouped_matmul.explain_dispatch(grouped_matmul.make_call(lhs, rhs, sizes), device=device) == want
  with pytest.raises(TypeError, match="the call carries"):
    grouped_matmul.explain_dispatch(grouped_matmul.make_call(lhs, rhs, sizes), rhs, device=device)
  with pytest.raises(TypeError, match="lhs and rhs"):
    grouped_matmul.explain_dispatch(lhs, device=device)


def test_scans_take_their_call_already():
  x = jnp.ones((1, 6, 2, 4))
  assert scan_explain(RLACall.of(x, x, x, window_size=2), device=Device("cpu")).implementation == "chunked"


def test_attention_call_takes_only_implementation_device_env():
  call = AttentionCall((1, 64, 2, 32), (1, 64, 2, 32), "float32")
  with pytest.raises(TypeError, match="implementation=, device= and env="):
    attention.explain_dispatch(call, bias=True, device=DEVICES[0])
  assert attention.explain_dispatch(call, implementation="xla", device=DEVICES[0]).implementation == "xla"
