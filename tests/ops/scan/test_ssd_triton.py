"""The SSD Triton kernels (probjax/ops/scan/backends/triton/ssd.py) beyond the conformance suite:
the backward's partial sums that the suite's small shapes do not reach (several head_dim blocks,
a whole group of heads on one B and C) against the float64 reference in interpret mode, that a
differentiated call asking for the kernels runs their backward and saves only chunk-boundary
states, the sm_90 lowering at the benchmark's shape, and that shape on the GPU."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from probjax.ops import scan
from probjax.ops.scan import dispatch
from probjax.ops.scan.calls import SSDCall
from probjax.testing import float32_is_tf32, interpret_kernels
from tests.ops.scan.conformance import check

TF32 = float32_is_tf32()
S = jax.ShapeDtypeStruct


def _inputs(b, length, h, p, g, n, dtype=jnp.float32, seed=0):
  """SSD inputs with every optional one; activations in ``dtype``, parameters float32. Per head
  ``A`` from -1 to -16 and ``Δ = softplus(dt - 4)`` about 0.02 (Mamba-2's ranges)."""
  rng = np.random.default_rng(seed)
  f = lambda *s, scale=1.0: (scale * rng.standard_normal(s)).astype(np.float32)
  act = lambda a: jnp.asarray(a).astype(dtype)
  return dict(x=act(f(b, length, h, p)), dt=act(f(b, length, h, scale=0.5)),
              A=-np.linspace(1.0, 16.0, h, dtype=np.float32), B=act(f(b, length, g, n)),
              C=act(f(b, length, g, n)), D=np.ones(h, np.float32), z=act(f(b, length, h, p)),
              dt_bias=np.full(h, -4.0, np.float32), initial_state=f(b, h, p, n))


def test_head_dim_blocks_and_a_group_against_the_reference():
  """head_dim 40 (the forward's two blocks of 32, the last partial; the backward's chunk
  kernels' one masked block of 64, its state pass's three of 16) and four heads on one group:
  dB and dC are sums of four partials (one per head); state 20 in a masked block of 32; three
  chunks of 16, the last partial. Values and every gradient, the initial state's included."""
  a = _inputs(1, 37, 4, 40, 1, 20, seed=37)
  a["dt"] = 4.0 * a["dt"] + 4.0  # Δ about 1: strong decays inside a chunk
  check("ssd", "triton", a, tf32=TF32, chunk_size=16)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_backward_head_dim_split_and_groups_against_the_reference(dtype):
  """The backward's chunk kernels split head_dim 80 into two blocks of 64 (the last partial):
  ddt and dA sum two partials per head, dB and dC four per group (two heads x two blocks); two
  batches, four heads on two groups, state 24, four chunks of 16 (the last two rows long), so
  the state cotangent's pass crosses three chunk boundaries in five blocks of 16."""
  a = _inputs(2, 50, 4, 80, 2, 24, dtype, seed=50)
  a["dt"] = 2.0 * a["dt"] + 3.0  # Δ about 0.3 to 3: the decays differ between chunks
  check("ssd", "triton", a, dtype=dtype, tf32=TF32, chunk_size=16)


def _grad_of(call_kw):
  def loss(x, dt, A, B, C, h0):
    y, h = scan.ssd_scan(x, dt, A, B, C, initial_state=h0, return_final_state=True, **call_kw)
    return jnp.sum(y.astype(jnp.float32)) + jnp.sum(h)
  return jax.grad(loss, argnums=tuple(range(6)))


def _arrays(b, length, h, p, g, n):
  rng = np.random.default_rng(0)
  shapes = [(b, length, h, p), (b, length, h), (h,), (b, length, g, n), (b, length, g, n), (b, h, p, n)]
  return [jnp.asarray(rng.standard_normal(s), jnp.float32) for s in shapes]


BWD = ["probjax_ssd_scan_bwd_grads", "probjax_ssd_scan_bwd_local", "probjax_ssd_scan_bwd_pass"]


def _largest_array(jaxpr) -> int:
  """The most elements of any value the jaxpr (and those inside it) computes."""
  size = 0
  for eqn in jaxpr.eqns:
    size = max([size, *(v.aval.size for v in eqn.outvars if hasattr(v.aval, "size"))])
    for param in eqn.params.values():
      for sub in param if isinstance(param, (tuple, list)) else (param,):
        sub = getattr(sub, "jaxpr", sub)   # a closed jaxpr's own
        if hasattr(sub, "eqns"):
          size = max(size, _largest_array(sub))
  return size


def test_asked_for_the_kernels_differentiate_themselves():
  """``implementation="triton"``, differentiated: the kernels' forward with residuals and their
  backward (a chunk-parallel kernel of each chunk's own share of the state cotangent, a pass
  over the chunks carrying that cotangent, a chunk-parallel kernel of the gradients) run, no
  chunked XLA form; what the call saves is its inputs and the states entering its chunks, and
  what the backward writes are chunk-boundary cotangents, never a state per position."""
  b, length, h, p, g, n, chunk = 1, 64, 2, 16, 1, 16, 16
  args = _arrays(b, length, h, p, g, n)
  kw = dict(implementation="triton", chunk_size=chunk, interpret=interpret_kernels())
  jaxpr = jax.make_jaxpr(_grad_of(kw))(*args)
  assert sorted(set(re.findall(r"probjax_ssd\w*", str(jaxpr)))) == [*BWD, "probjax_ssd_scan_fwd_res"]
  chunk_states = (length // chunk + 1) * h * p * n   # with the final state's cotangent
  assert _largest_array(jaxpr.jaxpr) <= chunk_states < length * h * p * n
  call = SSDCall(b, length, h, p, g, n, "float32", chunk_size=chunk, interpret=True)
  _, vjp = jax.vjp(dispatch.resolve(call, "triton"), *args)
  saved = sum(leaf.size for leaf in jax.tree.leaves(vjp))
  given, chunk_states = sum(x.size for x in args[:5]), (length // chunk) * h * p * n
  assert saved <= given + chunk_states < length * h * p * n


# -- lowering for sm_90 (Pallas -> Triton IR; Triton's own compilation needs the GPU) ----------

@pytest.mark.parametrize("chunk", [None, 64])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_full_size_lowers_for_sm90(fake_h200, dtype, chunk):
  """B2 L4096 H32 P64 N128 (the forward's two head_dim blocks of 32, the backward's one of 64;
  one group), forward and differentiated with the kernels asked for, at the default chunk and
  at 64."""
  x, dt = S((2, 4096, 32, 64), dtype), S((2, 4096, 32), dtype)
  A, B = S((32,), jnp.float32), S((2, 4096, 1, 128), dtype)
  fn = lambda x, dt, A, B: scan.ssd_scan(x, dt, A, B, B, z=x, implementation="triton",
                                         chunk_size=chunk)
  loss = lambda *a: jnp.sum(fn(*a).astype(jnp.float32))
  lower = lambda f: jax.jit(f).trace(x, dt, A, B).lower(lowering_platforms=("cuda",)).as_text()
  assert sorted(set(re.findall(r"probjax_ssd\w*", lower(fn)))) == ["probjax_ssd_scan_fwd"]
  assert sorted(set(re.findall(r"probjax_ssd\w*", lower(jax.grad(loss, argnums=(0, 1, 2, 3)))))) == [
      *BWD, "probjax_ssd_scan_fwd_res"]


# -- on the GPU ---------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.timeout(600)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_full_size(dtype):
  """B1 L4096 H8 P64 N128, one group (z, D, dt_bias, an initial state), the kernels asked for:
  values and every gradient against the float64 reference. The issue's B4 H32 would add only
  more programs of the same kernel; the sequential float64 reference's backward keeps a
  ``[b, h, p, n]`` state per position, 2 GB here against 34 GB there."""
  check("ssd", "triton", _inputs(1, 4096, 8, 64, 1, 128, dtype), dtype=dtype, tf32=TF32)
