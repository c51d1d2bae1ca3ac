"""Batch/head-parallel partitioning and vmap folding of a kernel call
(``probjax.ops.attention.sharding``), with XLA's dense attention standing in for the kernel.

On CPU: vmap folds into the batch (the call sees rank-4 operands), and on 4 CPU devices
(a subprocess with ``--xla_force_host_platform_device_count=4``) each device runs the call on
its shard of batch and heads, GQA included, with no gather; sequence shardings are gathered,
and heads are replicated where key/value heads do not divide. The cuDNN FFI call itself is
checked on two GPUs in ``tests/ops/attention/test_cudnn_ffi.py``; the Triton kernel's calls (interpret
mode), with a mask's segment ids as operands, on the 4 CPU devices here.
"""

import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from probjax.ops.attention import masks as M
from probjax.ops.attention import sharding
from probjax.ops.attention.reference import reference_attention
from probjax.ops.attention.tolerances import max_error, tolerance
from probjax.ops.attention.backends.xla.dense import dense_attention
from probjax.testing import make_inputs, run_on_fake_devices

SEEN: list[tuple] = []


def _kernel(static, q, k, v, lens):
  """A stand-in kernel: attention over the first ``lens[b]`` keys, and the scores' row
  logsumexp ``[B, H, Tq]``; records the shapes it is traced with."""
  SEEN.append((q.shape, k.shape, lens.shape))
  group = q.shape[2] // k.shape[2]
  s = jnp.einsum("bthd,bshd->bhts", q, jnp.repeat(k, group, axis=2)) * static
  return dense_attention(q, k, v, mask=M.KVLenMask(lens), scale=static), jax.nn.logsumexp(s, axis=-1)


def _call(q, k, v, lens, scale=0.25):
  roles = (sharding.Q, sharding.KV, sharding.KV, sharding.BATCH)
  return sharding.batch_head_parallel(_kernel, scale, roles, (sharding.Q, sharding.STATS))(q, k, v, lens)


def _check(out, x, lens, scale=0.25):
  ref = reference_attention(x.q, x.k, x.v, mask=M.KVLenMask(lens), scale=scale)
  assert max_error(out, ref) <= tolerance(jnp.float32)


def test_roles_are_validated():
  with pytest.raises(ValueError, match="batch .* first"):
    sharding.batch_head_parallel(_kernel, 1.0, ("tbhd",), (sharding.Q,))
  with pytest.raises(ValueError, match="letters"):
    sharding.batch_head_parallel(_kernel, 1.0, ("bthx",), (sharding.Q,))


def test_vmap_folds_into_the_batch():
  x = make_inputs(0, 2, 24, 40, 4, 2, 16)
  lens = jnp.asarray([40, 17], jnp.int32)
  SEEN.clear()
  out, lse = jax.vmap(_call, in_axes=(0, None, None, None))(jnp.stack([x.q, 2 * x.q, -x.q]), x.k, x.v, lens)
  assert SEEN[-1] == ((6, 24, 4, 16), (6, 40, 2, 16), (6,)), SEEN  # one call, vmap's axis in the batch
  assert out.shape == (3, 2, 24, 4, 16) and lse.shape == (3, 2, 4, 24)
  for i, c in enumerate((1, 2, -1)):
    x_i = make_inputs(0, 2, 24, 40, 4, 2, 16)
    x_i.q = c * x.q
    _check(out[i], x_i, lens)
  # nested, every operand batched
  both = jax.jit(jax.vmap(jax.vmap(_call)))(*(jnp.stack([jnp.stack([a, a])]) for a in (x.q, x.k, x.v, lens)))
  np.testing.assert_allclose(np.asarray(both[0][0, 1]), np.asarray(out[0]), rtol=1e-5, atol=1e-5)


_SHARDED = textwrap.dedent("""
    import json, sys
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    from tests.ops.attention import test_sharding as T
    from probjax.testing import make_inputs, run_on_fake_devices
    mesh = Mesh(np.array(jax.devices()).reshape(2, 2), ("data", "model"))
    results = []
    for kv_heads, spec in [(2, P("data", None, "model")), (2, P(None, None, "model")),
                           (1, P("data", None, "model")), (2, P("data", "model")),
                           (2, P(("data", "model")))]:
      x = make_inputs(kv_heads, 4, 16, 24, 4, kv_heads, 8)
      lens = jnp.asarray([24, 5, 0, 13], jnp.int32)
      put = lambda a, sp: jax.device_put(a, NamedSharding(mesh, P(*sp[:a.ndim])))
      kv_spec = spec if kv_heads > 1 else P(*spec[:2])  # one key/value head: not split
      args = [put(x.q, spec), put(x.k, kv_spec), put(x.v, kv_spec), put(lens, spec)]
      T.SEEN.clear()
      f = jax.jit(T._call)
      out, lse = f(*args)
      T._check(out, x, lens)
      hlo = f.lower(*args).compile().as_text()
      results.append(dict(kv_heads=kv_heads, spec=str(spec), local=[list(s) for s in T.SEEN[-1]],
                          gathers=hlo.count("all-gather"), out_spec=str(out.sharding.spec)))
    # The Triton kernel (interpret mode) with a mask's arrays as operands, values and gradients.
    from probjax.ops.attention import masks as M
    from probjax.ops.attention.backends import triton
    from probjax.ops.attention.reference import reference_vjp
    from probjax.ops.attention.tolerances import max_error, tolerance
    x = make_inputs(7, 4, 32, 32, 4, 2, 16)
    mask = M.CausalMask() & M.SegmentMask(jnp.asarray(np.repeat([[0, 1]], 16, axis=1).repeat(4, 0), jnp.int32))
    f = lambda q, k, v: triton.attention(q, k, v, mask=mask, interpret=True)
    g = jax.jit(lambda q, k, v, do: (f(q, k, v),) + jax.vjp(f, q, k, v)[1](do))
    put = lambda a, sp: jax.device_put(a, NamedSharding(mesh, sp))
    args = [put(x.q, P("data", None, "model")), put(x.k, P("data", None, "model")),
            put(x.v, P("data", None, "model")), put(x.do, P("data", None, "model"))]
    got = g(*args)
    ref = reference_vjp(x.q, x.k, x.v, x.do, mask=mask)
    errs = [max_error(a, b) for a, b in zip(got, ref)]
    hlo = g.lower(*args).compile().as_text()
    results.append(dict(kernel="triton", errors=errs, ok=all(e <= tolerance(jnp.float32, grad=i > 0)
                                                             for i, e in enumerate(errs)),
                        gathers=hlo.count("all-gather"), out_spec=str(got[0].sharding.spec)))
    json.dump(results, sys.stdout)
""")


@pytest.mark.slow  # a subprocess on 4 fake CPU devices compiling every partitioning (and the Triton kernel)
def test_partitioned_over_batch_and_heads_on_four_devices():
  rows = run_on_fake_devices(_SHARDED, 4, timeout=300)
  got = {(r["kv_heads"], r["spec"]): r for r in rows if "spec" in r}
  # batch over "data", heads over "model" (GQA: 4 query heads, 2 key/value heads): local shards, no gather
  r = got[(2, "P('data', None, 'model')")]
  assert r["local"] == [[2, 16, 2, 8], [2, 24, 1, 8], [2]] and r["gathers"] == 0, r
  assert r["out_spec"] == "P('data', None, 'model')"
  r = got[(2, "P(None, None, 'model')")]
  assert r["local"] == [[4, 16, 2, 8], [4, 24, 1, 8], [4]] and r["gathers"] == 0, r
  # one key/value head cannot be split over 2 devices: heads replicated, batch still split
  r = got[(1, "P('data', None, 'model')")]
  assert r["local"] == [[2, 16, 4, 8], [2, 24, 1, 8], [2]], r
  # query positions sharded: gathered (the result is still exact, checked in the subprocess)
  r = got[(2, "P('data', 'model')")]
  assert r["local"] == [[2, 16, 4, 8], [2, 24, 2, 8], [2]] and r["gathers"] > 0, r
  # the batch over both mesh axes
  r = got[(2, "P(('data', 'model'),)")]
  assert r["local"] == [[1, 16, 4, 8], [1, 24, 2, 8], [1]] and r["gathers"] == 0, r
  # the Triton kernel's forward and backward, per shard with the mask's segment ids
  r = next(r for r in rows if r.get("kernel") == "triton")
  assert r["ok"] and r["gathers"] == 0 and r["out_spec"] == "P('data', None, 'model')", r


@pytest.mark.gpu
@pytest.mark.parametrize("t,mask_name", [(1024, "segments"), (2048, "segments"), (2048, "causal"),
                                         (4096, "none")])
def test_gpu_default_is_partitioned_over_batch_and_heads(t, mask_name):
  """The default path on 2 GPUs (Triton at T1024, Mosaic forward from T2048, cuDNN unmasked):
  each GPU runs the kernels on its shard of batch and heads, values and gradients as on one GPU."""
  if len(jax.devices()) < 2:
    pytest.skip("needs 2 GPUs")
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
  from probjax.nn.layers.attention import dot_product_attention, explain_dispatch
  from probjax.testing import make_mask
  mesh = Mesh(np.array(jax.devices()[:2]), ("x",))
  x = make_inputs(t, 4, t, t, 8, 4, 64, jnp.bfloat16)
  x.v, x.do = x.v * 0.1, x.do * 0.1
  mask = make_mask(mask_name, 4, t, t, seed=t)
  f = lambda q, k, v: dot_product_attention(q, k, v, mask=mask)
  g = lambda q, k, v, do: (f(q, k, v),) + jax.vjp(f, q, k, v)[1](do)
  one = jax.jit(g)(x.q, x.k, x.v, x.do)
  for spec in (P("x"), P(None, None, "x")):
    args = [jax.device_put(a, NamedSharding(mesh, spec)) for a in (x.q, x.k, x.v, x.do)]
    h = jax.jit(g)
    assert "all-gather" not in h.lower(*args).compile().as_text(), (spec, explain_dispatch(x.q.shape, x.k.shape,
                                                                                          x.q.dtype, mask=mask))
    for name, u, w in zip(("out", "dq", "dk", "dv"), h(*args), one):
      assert u.sharding.is_equivalent_to(NamedSharding(mesh, spec), u.ndim), (name, u.sharding)
      u, w = np.asarray(u, np.float32), np.asarray(w, np.float32)
      assert np.max(np.abs(u - w)) <= 0.004 * max(1.0, np.max(np.abs(w))), (spec, name)
