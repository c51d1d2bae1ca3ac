"""MultiHeadLatentAttention: the float64 op reference on its own projections, the two forms,
and latent-cache decoding against the full forward."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from probjax.core.tolerances import max_error, tolerance
from probjax.nn.layers import MultiHeadLatentAttention
from probjax.nn.layers.rotary import default_positions
from probjax.ops.attention.masks import CausalMask
from probjax.ops.mla.reference import reference_mla

SMALL = dict(num_heads=4, in_features=24, kv_lora_rank=12, qk_nope_head_dim=8, qk_rope_head_dim=4,
             v_head_dim=6)


def layer(seed=0, **kw):
  return MultiHeadLatentAttention(**(SMALL | kw), rngs=nnx.Rngs(seed))


def x_of(seed, b, t, f=24):
  return jax.random.normal(jax.random.key(seed), (b, t, f))


# The layer runs eagerly: every op compiles on its first use, 2-6 s of CPU a new shape. make
# test keeps one shape with each projection of the queries; the others are slow.
@pytest.mark.parametrize("t,q_lora_rank", [
    (t, r) if (t, r) in ((7, None), (48, 10)) else pytest.param(t, r, marks=pytest.mark.slow)
    for t in (1, 7, 48) for r in (None, 10)])
def test_forward_matches_reference_in_both_forms(q_lora_rank, t):
  m = layer(q_lora_rank=q_lora_rank)
  x = x_of(t, 2, t)
  pos = default_positions(2, t)
  q_nope, q_rope = m._queries(x, pos)
  latent, k_rope = m._latents(x, pos)
  ref = reference_mla(q_nope, q_rope, latent, k_rope, m.w_uk[...], m.w_uv[...], mask=CausalMask())
  want = np.asarray(ref.reshape(2, t, -1), np.float64) @ np.asarray(m.out.kernel[...], np.float64)
  for form in ("expanded", "absorbed"):
    m.form = form
    assert max_error(m(x), want) <= tolerance(jnp.float32)


def test_forms_have_the_same_gradients():
  x = x_of(1, 2, 7)
  grads = {}
  for form in ("expanded", "absorbed"):
    m = layer(q_lora_rank=10, form=form)
    loss = lambda m, x: jnp.sum(m(x) * jnp.cos(jnp.arange(24.0)))
    g_params, g_x = nnx.grad(loss, argnums=(0, 1))(m, x)
    grads[form] = (jax.tree.leaves(nnx.state(g_params)), g_x)
  (pe, xe), (pa, xa) = grads["expanded"], grads["absorbed"]
  assert len(pe) == len(pa) == 8   # q_a, q_norm, q_b, kv_a, kv_norm, w_uk, w_uv, out
  for a, b in zip(pe + [xe], pa + [xa]):
    assert np.all(np.isfinite(np.asarray(a)))
    assert max_error(a, b) <= tolerance(jnp.float32, grad=True)


@pytest.mark.parametrize("form", [pytest.param("auto", marks=pytest.mark.slow),  # auto: absorbed, as below
                                  pytest.param("expanded", marks=pytest.mark.slow), "absorbed"])
def test_decode_step_by_step_equals_the_full_forward(form):
  b, t, max_len = 2, 7, 9
  m = layer(q_lora_rank=10, form=form)
  x = x_of(2, b, t)
  full = m(x)
  lens = jnp.array([1, 4])                       # right-padded prompts of different lengths
  prompt = jnp.where(jnp.arange(4)[None, :, None] < lens[:, None, None], x[:, :4], 7.0)
  cache = m.init_cache(b, max_len)
  y, cache = m.prefill(prompt, cache, lens)
  assert max_error(y[0, :1], full[0, :1]) <= tolerance(jnp.float32)
  assert max_error(y[1, :4], full[1, :4]) <= tolerance(jnp.float32)
  for i in range(3):                             # element b decodes its token lens[b] + i
    tok = jnp.stack([x[0, 1 + i], x[1, 4 + i]])[:, None]
    y, cache = nnx.jit(lambda m, tok, c: m.decode_step(tok, c))(m, tok, cache)
    want = jnp.stack([full[0, 1 + i], full[1, 4 + i]])[:, None]
    assert max_error(y, want) <= tolerance(jnp.float32)
  assert cache.lengths.tolist() == [4, 7]


@pytest.mark.slow  # a prefill and decode steps of several tokens, eagerly
def test_decode_several_tokens_at_once():
  m = layer()
  x = x_of(3, 1, 7)
  full = m(x)
  cache = m.init_cache(1, 8)
  _, cache = m.prefill(x[:, :3], cache, jnp.array([3]))
  y, cache = m.decode_step(x[:, 3:], cache)
  assert y.shape == (1, 4, 24) and cache.lengths.tolist() == [7]
  assert max_error(y, full[:, 3:]) <= tolerance(jnp.float32)


def test_cache_holds_only_the_latent():
  m = layer()
  c = m.init_cache(3, 5)
  assert c.k.shape == (3, 5, 1, 12) and c.v.shape == (3, 5, 1, 4) and c.lengths.shape == (3,)
  _, c = m.prefill(x_of(4, 3, 5), c, jnp.array([5, 5, 5]))
  with pytest.raises(ValueError, match="max_len"):
    m.decode_step(x_of(5, 3, 1), c)


def test_bfloat16_layer():
  m = MultiHeadLatentAttention(**SMALL, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
  y = m(x_of(6, 2, 7).astype(jnp.bfloat16))
  assert y.dtype == jnp.bfloat16 and np.all(np.isfinite(np.asarray(y, np.float32)))


@pytest.mark.parametrize("kw,name", [(dict(kv_lora_rank=0), "kv_lora_rank"), (dict(qk_rope_head_dim=3), "qk_rope_head_dim"),
                                     (dict(q_lora_rank=0), "q_lora_rank"), (dict(form="fast"), "form"),
                                     (dict(v_head_dim=0), "v_head_dim")])
def test_bad_arguments_name_themselves(kw, name):
  with pytest.raises(ValueError, match=name):
    layer(**kw)


def test_decoding_needs_a_latent_cache_and_a_causal_layer():
  from probjax.nn.layers.kv_cache import KVCache
  m = layer()
  with pytest.raises(ValueError, match="cache"):
    m.decode_step(x_of(0, 1, 1), KVCache.init(1, 4, kv_heads=4, head_dim=8))
  with pytest.raises(ValueError, match="causal"):
    layer(is_causal=False).decode_step(x_of(0, 1, 1), m.init_cache(1, 4))
