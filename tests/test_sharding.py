"""Batch/head-parallel partitioning and vmap folding of a kernel call
(``probjax.ops.attention.sharding``), with XLA's dense attention standing in for the kernel.

On CPU: vmap folds into the batch (the call sees rank-4 operands), and on 4 CPU devices
(a subprocess with ``--xla_force_host_platform_device_count=4``) each device runs the call on
its shard of batch and heads, GQA included, with no gather; sequence shardings are gathered,
and heads are replicated where key/value heads do not divide. The cuDNN FFI call itself is
checked on two GPUs in ``tests/test_cudnn_ffi.py``.
"""

import json
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from probjax.ops.attention import masks as M
from probjax.ops.attention import sharding
from probjax.ops.attention.reference import reference_attention
from probjax.ops.attention.tolerances import max_error, tolerance
from probjax.ops.attention.xla.dense import dense_attention
from probjax.testing import make_inputs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
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
    from tests import test_sharding as T
    from probjax.testing import make_inputs
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
    json.dump(results, sys.stdout)
""")


def test_partitioned_over_batch_and_heads_on_four_devices():
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu",
             PYTHONPATH=ROOT)
  p = subprocess.run([sys.executable, "-c", _SHARDED], cwd=ROOT, env=env, capture_output=True, text=True,
                     timeout=300)
  assert p.returncode == 0, p.stderr[-3000:]
  got = {(r["kv_heads"], r["spec"]): r for r in json.loads(p.stdout.strip().splitlines()[-1])}
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
