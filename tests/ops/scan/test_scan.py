"""The scan room's ops against the float64 sequential references: every implementation, values
and the gradients of every floating input (A, D, dt_bias, the gate, the initial state) under
cotangents on both the output and the final state."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from probjax.core.tolerances import max_error, tolerance
from probjax.ops.scan import feature_map, mamba_scan, residual_linear_attention, ssd_scan
from probjax.ops.scan.reference import reference, reference_vjp
from probjax.testing import float32_is_tf32, interpret_kernels

TF32 = float32_is_tf32()  # on a GPU, float32 matmuls run as TF32 (tolerances bound that)

IMPLS = {"mamba": ["scan", "associative", "chunked", "triton"],
         "ssd": ["scan", "associative", "chunked", "triton"],
         "rla": ["scan", "chunked", "triton"]}
FNS = {"mamba": mamba_scan, "ssd": ssd_scan, "rla": residual_linear_attention}
CASES = [(op, impl) for op, impls in IMPLS.items() for impl in impls]
WINDOW = 5

# Each case compiles the op's forward and backward (the Triton kernels in interpret mode on
# CPU) and runs the float64 reference in NumPy: 1-4 s of CPU a case. make test runs every op
# and implementation once (test_matches_reference) and the bf16, optional-input and kernel
# checks once; the other lengths, chunk sizes and ops are slow, and the chunk sizes beyond the
# default and 16 are thorough (CI leaves them to make test-slow).
SLOW = pytest.mark.slow
THOROUGH = pytest.mark.thorough


def inputs(op, length, seed=0, *, decay=1.0, optional=True, channels=6, state=4):
  """Float32 inputs of ``op`` at ``length`` (small widths; GQA and groups > 1). ``decay``
  scales dt (a strong decay drives exp() to its limits); ``optional=False`` leaves out every
  optional input; ``channels`` and ``state`` are Mamba-1's."""
  rng = np.random.default_rng(seed)
  f = lambda *s: rng.standard_normal(s).astype(np.float32)
  if op == "mamba":
    b, d, n = 2, channels, state
    a = dict(x=f(b, length, d), dt=decay * f(b, length, d), A=-np.exp(0.5 * f(d, n)),
             B=f(b, length, n), C=f(b, length, n), D=f(d), z=f(b, length, d), dt_bias=0.1 * f(d),
             initial_state=f(b, d, n))
  elif op == "ssd":
    b, h, p, g, n = 2, 4, 6, 2, 5
    a = dict(x=f(b, length, h, p), dt=decay * f(b, length, h), A=-np.exp(0.5 * f(h)),
             B=f(b, length, g, n), C=f(b, length, g, n), D=f(h), z=f(b, length, h, p),
             dt_bias=0.1 * f(h), initial_state=f(b, h, p, n))
  else:
    b, h, hk, d, dv = 2, 4, 2, 6, 5
    a = dict(q=f(b, length, h, d), k=f(b, length, hk, d), v=f(b, length, hk, dv),
             initial_state=f(b, hk, 2 * d, dv))
  if not optional:
    a = {k: v for k, v in a.items() if k not in ("D", "z", "dt_bias", "initial_state")}
  return a


def static(op):
  return {"window_size": WINDOW} if op == "rla" else {}


@functools.partial(jax.jit, static_argnames=("op", "kw"))
def _values_and_grads(arrays, cts, *, op, kw):
  def loss(a):
    y, h = FNS[op](**a, **dict(kw), return_final_state=True, interpret=interpret_kernels())
    return jnp.sum(y.astype(jnp.float32) * cts[0]) + jnp.sum(h * cts[1]), (y, h)
  (_, outs), grads = jax.value_and_grad(loss, has_aux=True)(arrays)
  return outs, grads


def run(op, impl, arrays, **kw):
  """``(outputs, grads, reference outputs, reference grads)``; the reference sees the arrays
  as given (rounded to their dtype)."""
  kw = {**static(op), **kw, "implementation": impl}
  ref_kw = {k: v for k, v in kw.items() if k in ("window_size", "dt_softplus", "feature_map")}
  as64 = {k: np.asarray(jnp.asarray(v).astype(jnp.float32), np.float64) for k, v in arrays.items()}
  ref = reference(op, **as64, **ref_kw)
  rng = np.random.default_rng(1)
  cts = tuple(rng.standard_normal(r.shape).astype(np.float32) for r in ref)
  outs, grads = _values_and_grads({k: jnp.asarray(v) for k, v in arrays.items()}, cts, op=op,
                                  kw=tuple(sorted(kw.items())))
  return outs, grads, ref, reference_vjp(op, cts, **as64, **ref_kw)


def check(op, impl, arrays, dtype=jnp.float32, **kw):
  outs, grads, ref, ref_grads = run(op, impl, arrays, **kw)
  for name, o, r in zip(("output", "final state"), outs, ref):
    assert max_error(o, r) <= tolerance(dtype, tf32=TF32), (name, max_error(o, r))
  for name, g in ref_grads.items():
    err = max_error(grads[name], g)
    assert err <= tolerance(dtype, grad=True, tf32=TF32), (f"d{name}", err)


def chunk_for(impl):
  """A chunk that puts chunk boundaries (and a partial last chunk) inside short sequences."""
  return 16 if impl in ("chunked", "triton") else None


@pytest.mark.timeout(300)
@pytest.mark.parametrize("op, impl", CASES)
def test_matches_reference(op, impl):
  check(op, impl, inputs(op, 65), chunk_size=chunk_for(impl))


@SLOW  # 42 cases
@pytest.mark.timeout(300)
@pytest.mark.parametrize("length", [1, 63, 64, 1000])
@pytest.mark.parametrize("op, impl", CASES)
def test_lengths(op, impl, length):
  check(op, impl, inputs(op, length, seed=length))


@SLOW  # 10 cases
@pytest.mark.timeout(300)
@pytest.mark.parametrize("length", [63, 64])
@pytest.mark.parametrize("op, impl", [c for c in CASES if c[1] in ("chunked", "triton")])
def test_chunk_boundaries(op, impl, length):
  check(op, impl, inputs(op, length, seed=3), chunk_size=chunk_for(impl))


@pytest.mark.parametrize("op", ["mamba", pytest.param("ssd", marks=SLOW), pytest.param("rla", marks=SLOW)])
def test_without_optional_inputs(op):
  kw = {"dt_softplus": False} if op != "rla" else {"feature_map": "relu"}
  a = inputs(op, 40, optional=False)
  if op != "rla":
    a["dt"] = np.abs(a["dt"])  # without softplus, a positive dt keeps the decay below one
  check(op, "chunked", a, **kw)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("length, channels, chunk, optional", [(101, 40, None, True), (97, 37, 16, False)])
def test_mamba_kernels_forward_and_backward(length, channels, chunk, optional):
  """The Mamba-1 kernels, differentiated: lengths past a partial last chunk (default chunk 32,
  or 16), channels past a partial block of the kernels' 32, with and without the optional
  inputs (the initial state's gradient is the backward's carry out of position 0)."""
  a = inputs("mamba", length, seed=length + channels, optional=optional, channels=channels, state=8)
  if not optional:
    a["dt"] = np.abs(a["dt"])  # without softplus, a positive dt keeps the decay below one
  check("mamba", "triton", a, chunk_size=chunk, **({} if optional else {"dt_softplus": False}))


def bf16_inputs(op, length, seed=0):
  """bfloat16 activations (float32 parameters) with strong decays: exp() of a chunk's segment
  sums at its limits, where a masked entry that overflowed would turn the backward into NaN."""
  return {k: (v if k in ("A", "D", "dt_bias") else v.astype(jnp.bfloat16))
          for k, v in inputs(op, length, seed, decay=8.0).items()}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("op", [pytest.param("mamba", marks=SLOW), "ssd", pytest.param("rla", marks=SLOW)])
def test_bfloat16_chunked_default_chunk(op):
  """At the default chunk (Mamba-1: 16 at this length, SSD and RLA: 64): within the bf16 bounds
  (so NaN-free) in values and gradients."""
  check(op, "chunked", bf16_inputs(op, 130), dtype=jnp.bfloat16)


@SLOW  # 30 cases at length 300; chunks 8, 32, 64 and 128 repeat the default's and 16's checks
@pytest.mark.timeout(300)
@pytest.mark.parametrize("chunk", [None, pytest.param(8, marks=THOROUGH), 16, pytest.param(32, marks=THOROUGH),
                                   pytest.param(64, marks=THOROUGH), pytest.param(128, marks=THOROUGH)])
@pytest.mark.parametrize("op, impl", [c for c in CASES if c[1] in ("chunked", "triton")])
def test_bfloat16_at_chunks(op, impl, chunk):
  if impl == "triton" and chunk == 8:
    pytest.skip("the kernels' chunks start at 16")
  check(op, impl, bf16_inputs(op, 300, seed=chunk or 0), dtype=jnp.bfloat16, chunk_size=chunk)


def test_rla_window_covers_everything():
  """With the window over the whole sequence the linear branch reads the initial state only."""
  a = {k: jnp.asarray(v) for k, v in inputs("rla", 20).items()}
  rla = jax.jit(functools.partial(residual_linear_attention, window_size=50, return_final_state=True))
  o, s = rla(**a)
  expect = jnp.einsum("blhf,bhfd->blhd", feature_map(a["q"], "softmax"),
                      jnp.repeat(a["initial_state"], 2, axis=1))
  np.testing.assert_allclose(o, expect, rtol=1e-5, atol=1e-5)
  np.testing.assert_array_equal(s, a["initial_state"])


BAD = [
    ("mamba", "dt", lambda a: a.update(dt=a["dt"][:, :-1])),
    ("mamba", "A", lambda a: a.update(A=a["A"][:-1])),
    ("mamba", "B", lambda a: a.update(B=a["B"][..., :-1])),
    ("mamba", "C", lambda a: a.update(C=a["C"][:, :, None])),
    ("mamba", "D", lambda a: a.update(D=a["D"][:-1])),
    ("mamba", "z", lambda a: a.update(z=a["z"][:1])),
    ("mamba", "dt_bias", lambda a: a.update(dt_bias=a["dt_bias"][None])),
    ("mamba", "initial_state", lambda a: a.update(initial_state=a["initial_state"][..., :-1])),
    ("mamba", "x", lambda a: a.update(x=a["x"].astype(np.int32))),
    ("ssd", "B", lambda a: a.update(B=np.concatenate([a["B"]] * 3, axis=2))),  # 6 groups, 4 heads
    ("ssd", "C", lambda a: a.update(C=a["C"][:, :, :1])),
    ("ssd", "dt", lambda a: a.update(dt=a["dt"][..., :-1])),
    ("ssd", "A", lambda a: a.update(A=a["A"][:, None])),
    ("ssd", "initial_state", lambda a: a.update(initial_state=a["initial_state"][:, :-1])),
    ("rla", "k", lambda a: a.update(k=np.concatenate([a["k"]] * 3, axis=2))),  # 6 kv heads, 4 heads
    ("rla", "v", lambda a: a.update(v=a["v"][:, :-1])),
    ("rla", "initial_state", lambda a: a.update(initial_state=a["initial_state"][..., :-1])),
]


@pytest.mark.parametrize("op, name, edit", BAD, ids=[f"{op}-{name}" for op, name, _ in BAD])
def test_bad_shapes_name_the_argument(op, name, edit):
  a = inputs(op, 8)
  edit(a)
  with pytest.raises(ValueError, match=rf"\b{name}\b"):
    FNS[op](**a, **static(op))


@pytest.mark.parametrize("kw, match", [({"window_size": -1}, "window_size"),
                                        ({"window_size": 2, "feature_map": "elu"}, "feature_map"),
                                        ({"window_size": 2, "chunk_size": 0}, "chunk_size")])
def test_bad_rla_arguments(kw, match):
  with pytest.raises(ValueError, match=match):
    residual_linear_attention(**inputs("rla", 8), **kw)


@pytest.mark.timeout(300)
def test_saved_for_the_backward():
  """A differentiated chunked or Triton Mamba-1 call saves no state per position: the
  sequential scan saves ``length × channels × state`` floats, the chunked form its inputs,
  cumulative decays and chunk-boundary states, the kernels their inputs and chunk-boundary
  states."""
  from probjax.ops.scan import dispatch
  from probjax.ops.scan.calls import MambaCall
  b, length, d, n = 1, 512, 8, 64
  call = MambaCall(b, length, d, n, "float32", chunk_size=16, interpret=True)
  rng = np.random.default_rng(0)
  args = [jnp.asarray(rng.standard_normal(s), jnp.float32) for s in
          [(b, length, d), (b, length, d), (d, n), (b, length, n), (b, length, n), (b, d, n)]]
  saved = {}
  for name in ("scan", "chunked", "triton"):
    _, vjp = jax.vjp(dispatch.resolve(call, name), *args)
    saved[name] = sum(leaf.size for leaf in jax.tree.leaves(vjp))
  states, given = length * d * n, sum(x.size for x in args)
  assert saved["scan"] >= states
  assert saved["chunked"] <= 2 * given + 4 * (length // 16) * d * n < states
  assert saved["triton"] <= given + (length // 16) * d * n < states
