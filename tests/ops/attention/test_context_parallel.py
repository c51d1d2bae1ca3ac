"""Context-parallel attention (``probjax.ops.attention.context_parallel``) on 2, 4 and 8 CPU
devices: every schedule and layout equals single-device ``dot_product_attention(implementation=
"xla")`` in values and gradients, with the blocks on XLA or on the Triton kernels (interpret
mode, through the attention registry). The multi-device cases run in one subprocess with
``--xla_force_host_platform_device_count=8`` that prints one result row per case."""

import textwrap

import jax.numpy as jnp
import numpy as np
import pytest

from probjax.ops.attention.context_parallel import from_zigzag, to_zigzag
from probjax.testing import run_on_fake_devices


_SCRIPT = textwrap.dedent("""
    import functools, json, sys
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    from probjax.nn.layers.attention import dot_product_attention
    from probjax.ops.attention import masks as M
    from probjax.ops.attention.context_parallel import context_parallel_attention as cpa, from_zigzag, to_zigzag
    from probjax.ops.attention.tolerances import max_error, tolerance
    from probjax.testing import make_inputs

    def segments(seed, batch, t):
      # sorted document ids, documents of about 4 positions (some shorter, some longer)
      return jnp.asarray(np.random.RandomState(seed).randint(0, 3, (batch, t)).cumsum(1) // 4, jnp.int32)

    def mask_of(name, batch, t, seed):
      if name == "none": return None
      if name == "causal": return M.CausalMask()
      if name == "window": return M.LocalWindowMask(5, 2)
      if name == "causal_window": return M.LocalWindowMask(3, 0)
      if name == "segments": return M.SegmentMask(segments(seed, batch, t)) & M.CausalMask()
      if name == "kv_lengths": return M.KVLenMask(jnp.asarray([t - 3, t // 3][:batch], jnp.int32))
      if name == "lengths": return M.LengthMask(jnp.asarray([t - 2, 5][:batch], jnp.int32),
                                                jnp.asarray([t, 7][:batch], jnp.int32)) & M.CausalMask()
      raise ValueError(name)

    def zigzag_mask(m, n):
      if m is None or m.q_segment_ids is None: return m
      return M.Mask(lower=m.lower, upper=m.upper, q_segment_ids=to_zigzag(m.q_segment_ids, n),
                    kv_segment_ids=to_zigzag(m.kv_segment_ids, n))

    def compare(got, want):
      errs = [max_error(a, b) for a, b in zip(got, want)]
      return errs, all(e <= tolerance(jnp.float32, grad=i > 0) for i, e in enumerate(errs))

    # (devices, schedule, load_balance, mask, seq, heads, kv_heads)
    CASES = [
      (4, "ring", None, "causal", 20, 4, 2),
      (4, "ring", "zigzag", "causal", 24, 4, 2),
      (8, "allgather", None, "causal", 40, 2, 2),
      (2, "ring", None, "window", 14, 4, 2),
      (8, "ring", "zigzag", "causal_window", 48, 2, 1),
      (8, "ring", None, "segments", 40, 2, 2),
      (4, "allgather", "zigzag", "segments", 24, 4, 2),
      (4, "ring", None, "kv_lengths", 20, 4, 2),
      (2, "allgather", None, "kv_lengths", 14, 2, 1),
      (4, "ring", None, "none", 20, 4, 1),
      (2, "allgather", None, "none", 14, 4, 4),
      (8, "auto", None, "lengths", 40, 2, 2),
      # the blocks on the Triton kernels (interpret mode): forward with its lse, backward by name
      (4, "ring", "zigzag", "causal", 24, 4, 2, "triton"),
      (2, "allgather", None, "kv_lengths", 14, 2, 1, "triton"),
      (4, "ring", None, "segments", 24, 2, 2, "triton"),
    ]
    rows = []
    for i, (n, schedule, lb, mname, t, h, hkv, *impl) in enumerate(CASES):
      kw = dict(implementation=impl[0], interpret=True) if impl else {}
      mesh = Mesh(np.array(jax.devices()[:n]), ("seq",))
      x = make_inputs(100 + i, 2, t, t, h, hkv, 8)
      m = mask_of(mname, 2, t, i)
      ref_f = lambda q, k, v: dot_product_attention(q, k, v, mask=m, implementation="xla")
      want = (ref_f(x.q, x.k, x.v),) + jax.vjp(ref_f, x.q, x.k, x.v)[1](x.do)
      if lb == "zigzag":
        zm, z, uz = zigzag_mask(m, n), functools.partial(to_zigzag, num_devices=n), functools.partial(from_zigzag, num_devices=n)
        f = lambda q, k, v: uz(cpa(z(q), z(k), z(v), zm, mesh=mesh, axis_name="seq", schedule=schedule, load_balance=lb,
                                   **kw))
      else:
        f = lambda q, k, v: cpa(q, k, v, m, mesh=mesh, axis_name="seq", schedule=schedule, **kw)
      got = jax.jit(lambda q, k, v, do: (f(q, k, v),) + jax.vjp(f, q, k, v)[1](do))(x.q, x.k, x.v, x.do)
      errs, ok = compare(got, want)
      rows.append(dict(case=f"{n}/{schedule}/{lb}/{mname}/T{t}/H{h}/{hkv}{'/' + impl[0] if impl else ''}", errors=errs,
                       ok=ok))

    # A 2-D mesh: the batch sharded over "data" stays with XLA, the sequence over "seq".
    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "seq"))
    x = make_inputs(7, 2, 20, 20, 4, 2, 8)
    put = lambda a: jax.device_put(a, NamedSharding(mesh, P("data", "seq")))
    ref_f = lambda q, k, v: dot_product_attention(q, k, v, mask=M.CausalMask(), implementation="xla")
    want = (ref_f(x.q, x.k, x.v),) + jax.vjp(ref_f, x.q, x.k, x.v)[1](x.do)
    f = lambda q, k, v: cpa(q, k, v, M.CausalMask(), mesh=mesh, axis_name="seq", schedule="ring")
    got = jax.jit(lambda q, k, v, do: (f(q, k, v),) + jax.vjp(f, q, k, v)[1](do))(*map(put, (x.q, x.k, x.v, x.do)))
    rows.append(dict(case="2d_mesh", errors=compare(got, want)[0], ok=compare(got, want)[1],
                     spec=str(got[0].sharding.spec)))

    # Inside the caller's shard_map (local shards in, as an attention_fn inside a sharded model).
    mesh = Mesh(np.array(jax.devices()[:4]), ("seq",))
    x = make_inputs(8, 2, 20, 20, 4, 2, 8)
    inner = functools.partial(cpa, mesh=mesh, axis_name="seq", schedule="ring")
    f = jax.shard_map(lambda q, k, v: inner(q, k, v, is_causal=True), mesh=mesh, in_specs=P(None, "seq"),
                      out_specs=P(None, "seq"))
    ref_f = lambda q, k, v: dot_product_attention(q, k, v, is_causal=True, implementation="xla")
    want = (ref_f(x.q, x.k, x.v),) + jax.vjp(ref_f, x.q, x.k, x.v)[1](x.do)
    got = jax.jit(lambda q, k, v, do: (f(q, k, v),) + jax.vjp(f, q, k, v)[1](do))(x.q, x.k, x.v, x.do)
    errs, ok = compare(got, want)
    rows.append(dict(case="inside_shard_map", errors=errs, ok=ok))

    # As a TransformerBlock's attention_fn, on global arrays (RoPE sees global positions).
    from flax import nnx
    from probjax.nn.layers.transformer import TransformerBlock
    kw = dict(features=32, num_heads=4, num_kv_heads=2, is_causal=True, rotary=True)
    attn = functools.partial(cpa, mesh=mesh, axis_name="seq", schedule="ring")
    y = jax.random.normal(jax.random.key(11), (2, 20, 32))
    want = TransformerBlock(**kw, rngs=nnx.Rngs(0))(y)
    got = TransformerBlock(**kw, attention_fn=attn, rngs=nnx.Rngs(0))(y)
    rows.append(dict(case="transformer_block", errors=[max_error(got, want)],
                     ok=max_error(got, want) <= tolerance(jnp.float32)))

    # Rows with no valid key anywhere (key length 0): zeros, never NaN, also in the gradients.
    x = make_inputs(9, 2, 20, 20, 2, 2, 8)
    m = M.KVLenMask(jnp.asarray([0, 9], jnp.int32))
    f = lambda q, k, v: cpa(q, k, v, m, mesh=mesh, axis_name="seq", schedule="ring")
    got = jax.jit(lambda q, k, v, do: (f(q, k, v),) + jax.vjp(f, q, k, v)[1](do))(x.q, x.k, x.v, x.do)
    rows.append(dict(case="empty_rows", ok=bool(all(np.isfinite(np.asarray(g)).all() for g in got)
                                                and not np.asarray(got[0][0]).any())))

    # Errors: each names its argument.
    errors = {}
    def error(name, fn):
      try:
        fn()
        errors[name] = None
      except (ValueError, TypeError) as e:
        errors[name] = f"{type(e).__name__}: {e}"
    x = make_inputs(10, 2, 20, 20, 2, 2, 8)
    error("axis_name", lambda: cpa(x.q, x.k, x.v, mesh=mesh, axis_name="model"))
    error("divisible", lambda: cpa(x.q[:, :18], x.k[:, :18], x.v[:, :18], mesh=mesh, axis_name="seq"))
    error("zigzag_divisible", lambda: cpa(x.q, x.k, x.v, mesh=mesh, axis_name="seq", load_balance="zigzag"))
    error("schedule", lambda: cpa(x.q, x.k, x.v, mesh=mesh, axis_name="seq", schedule="tree"))
    error("load_balance", lambda: cpa(x.q, x.k, x.v, mesh=mesh, axis_name="seq", load_balance="stripe"))
    error("key_len", lambda: cpa(x.q, x.k[:, :16], x.v[:, :16], mesh=mesh, axis_name="seq"))
    error("dense_mask", lambda: cpa(x.q, x.k, x.v, jnp.ones((2, 1, 20, 20), bool), mesh=mesh, axis_name="seq"))
    error("implementation", lambda: cpa(x.q, x.k, x.v, mesh=mesh, axis_name="seq", implementation="triton"))
    error("no_kernel", lambda: cpa(x.q, x.k, x.v, mesh=mesh, axis_name="seq", implementation="cudnn"))
    error("backward_xla", lambda: cpa(x.q, x.k, x.v, mesh=mesh, axis_name="seq", backward_pass_impl="triton_fused"))
    heads = jax.device_put(x.q, NamedSharding(Mesh(np.array(jax.devices()[:2]), ("seq",)), P(None, None, "seq")))
    error("sharding", lambda: cpa(heads, x.k, x.v, mesh=Mesh(np.array(jax.devices()[:2]), ("seq",)), axis_name="seq"))
    rows.append(dict(case="errors", errors=errors))
    json.dump(rows, sys.stdout)
""")


@pytest.fixture(scope="module")
def results():  # a minute or two of CPU: the tests that use it are slow
  return {r["case"]: r for r in run_on_fake_devices(_SCRIPT, 8)}


# One subprocess on 8 fake CPU devices compiling 16 sharded programs with their gradients
# (about a minute of CPU); each xdist worker that runs a test of it starts its own.
@pytest.mark.slow
def test_every_schedule_matches_one_device_values_and_gradients(results):
  cases = [r for r in results.values() if r["case"] != "errors"]
  assert len(cases) == 19, sorted(results)
  bad = [(r["case"], r.get("errors")) for r in cases if not r["ok"]]
  assert not bad, bad
  assert results["2d_mesh"]["spec"] == "P('data', 'seq')", results["2d_mesh"]


@pytest.mark.slow  # the same subprocess (results)
def test_errors_name_the_argument(results):
  e = results["errors"]["errors"]
  assert "axis_name 'model'" in e["axis_name"], e
  assert "query's sequence length 18 must be divisible by 4" in e["divisible"], e
  assert "divisible by 8" in e["zigzag_divisible"] and "zigzag" in e["zigzag_divisible"], e
  assert e["schedule"].startswith("ValueError: schedule"), e
  assert e["load_balance"].startswith("ValueError: load_balance"), e
  assert "key's [batch, seq]" in e["key_len"], e
  assert e["dense_mask"].startswith("ValueError: mask must be a probjax Mask"), e
  assert e["implementation"].startswith("ValueError: implementation='triton' cannot run context-parallel blocks: "
                                        "the Triton kernel needs an NVIDIA GPU"), e
  assert e["no_kernel"].startswith("ValueError: implementation='cudnn' cannot run context-parallel blocks"), e
  assert e["backward_xla"].startswith("ValueError: backward_pass_impl='triton_fused'"), e
  assert e["sharding"].startswith("ValueError: query is sharded over 'seq' on axis 2"), e


def test_zigzag_layout_round_trips():
  x = jnp.arange(2 * 16 * 3).reshape(2, 16, 3)
  z = to_zigzag(x, 4)
  # device i's contiguous shard of 4 positions: chunks i and 7 - i of 8 chunks of 2
  assert np.asarray(z[0, :4, 0] // 3).tolist() == [0, 1, 14, 15]
  assert np.asarray(z[0, 12:, 0] // 3).tolist() == [6, 7, 8, 9]
  np.testing.assert_array_equal(np.asarray(from_zigzag(z, 4)), np.asarray(x))
  with pytest.raises(ValueError, match="divisible into 8 chunks"):
    to_zigzag(x[:, :12], 4)


def test_exported_from_the_public_attention_module():
  from probjax.nn.layers import attention
  from probjax.ops.attention import context_parallel
  assert attention.context_parallel_attention is context_parallel.context_parallel_attention
  assert "context_parallel_attention" in attention.__all__


@pytest.mark.gpu
def test_gpu_kernel_blocks_on_a_one_device_mesh():
  # The Triton and Mosaic kernels inside the shard_map body, on one GPU: values and gradients
  # against the float64 reference.
  import jax
  from jax.sharding import Mesh
  from probjax.ops.attention import CausalMask, KVLenMask, context_parallel_attention as cpa
  from probjax.testing import check_against_reference, make_inputs
  mesh = Mesh(np.array(jax.devices()[:1]), ("seq",))
  x = make_inputs(0, 2, 1024, 1024, 8, 2, 128, dtype=jnp.bfloat16)
  for impl in ("triton", "mosaic"):
    for schedule in ("ring", "allgather"):
      for mask in (CausalMask(), CausalMask() & KVLenMask(jnp.asarray([1000, 300], jnp.int32))):
        f = lambda q, k, v, _: cpa(q, k, v, mask, mesh=mesh, axis_name="seq", schedule=schedule,
                                   implementation=impl)
        check_against_reference(f, x, mask=mask)
