"""Linear memory of the XLA flash path, and property tests over random shapes and masks."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from probjax.ops.attention import masks as M
from probjax.ops.attention.backends import xla
from probjax.testing import check_against_reference, make_inputs


def _fwd_bwd_temp_bytes(t, d=64, heads=8):
  q = jax.ShapeDtypeStruct((1, t, heads, d), jnp.float32)
  def loss(q, k, v):
    return jnp.sum(xla.attention(q, k, v, scale=0.125, mask=M.CausalMask()))
  compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, q, q).compile()
  return compiled.memory_analysis().temp_size_in_bytes


def test_fwd_bwd_temporaries_grow_linearly():
  small, large = _fwd_bwd_temp_bytes(8192), _fwd_bwd_temp_bytes(16384)
  ratio = large / small
  # Linear growth doubles the temporaries; a T x T intermediate would quadruple them.
  assert 1.5 < ratio < 2.6, (small, large)
  dense_scores = 8 * 8192 * 8192 * 4
  assert small < dense_scores / 8, (small, dense_scores)


_MASKS = st.sampled_from(["none", "causal", "window", "kv_len", "segments", "causal&kv_len"])


@pytest.mark.slow  # 8 hypothesis examples, each compiling its own forward, backward and reference
@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(tq=st.integers(1, 40), tk=st.integers(1, 40), hkv=st.sampled_from([1, 2]), groups=st.sampled_from([1, 3]),
       d=st.sampled_from([4, 8]), mask_name=_MASKS, seed=st.integers(0, 10_000), block=st.sampled_from([8, 16]))
def test_flash_tiles_match_reference_on_random_problems(tq, tk, hkv, groups, d, mask_name, seed, block):
  """Small blocks make every tile-boundary case reachable at small sizes."""
  from probjax.testing import make_mask
  x = make_inputs(seed, 2, tq, tk, hkv * groups, hkv, d)
  mask = make_mask(mask_name, 2, tq, tk, seed)
  attn = lambda q, k, v, bias: xla.flash_attention(q, k, v, mask=mask, scale=d ** -0.5, block_q=block, block_k=block)
  check_against_reference(attn, x, mask=mask)
