"""One conformance suite for every scan backend: the cases each backend must pass, once, for each
of the scan room's ops it computes (``mamba``: :func:`~probjax.ops.scan.mamba_scan`, ``ssd``:
:func:`~probjax.ops.scan.ssd_scan`, ``rla``: :func:`~probjax.ops.scan.residual_linear_attention`).

:class:`ScanConformance` holds the cases; test_scan.py subclasses it once per backend of the
registries in :mod:`probjax.ops.scan.registry` (``class TestChunkedConformance(...)``), naming the
backend (``implementation``), the ops it computes, its (length, chunk) pairs (a partial last
chunk, lengths off the chunk) and the calls it refuses. Every check is against the float64
sequential references (:mod:`probjax.ops.scan.reference`), with the bounds of
:mod:`probjax.core.tolerances`; the Triton kernels run in Pallas interpret mode off the GPU.

The cases (``test_<name>[<op>-...]``):

===============================  ================================================================
test_values_and_grads            output and final state, and the gradients of every floating input
                                 (A, D, dt_bias, the gate, the initial state) under cotangents on
                                 both, at each of ``lengths`` (length, chunk_size)
test_without_optional_inputs     no D, gate, dt_bias or initial state (no softplus; RLA: relu)
test_bfloat16                    bfloat16 activations with strong decays at each of ``bf16_chunks``:
                                 within the bfloat16 bounds (so NaN-free), gradients included
test_bad_inputs                  refused with ValueError/TypeError naming the argument
test_refusals                    a call the backend cannot compute, requested: ValueError with why
===============================  ================================================================
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from probjax.core.tolerances import max_error, tolerance
from probjax.ops.scan import mamba_scan, residual_linear_attention, ssd_scan
from probjax.ops.scan.reference import reference, reference_vjp
from probjax.testing import interpret_kernels
from tests.ops.conformance import Conformance

FNS = {"mamba": mamba_scan, "ssd": ssd_scan, "rla": residual_linear_attention}
WINDOW = 5


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


def bf16_inputs(op, length, seed=0):
  """bfloat16 activations (float32 parameters) with strong decays: exp() of a chunk's segment
  sums at its limits, where a masked entry that overflowed would turn the backward into NaN."""
  return {k: (v if k in ("A", "D", "dt_bias") else v.astype(jnp.bfloat16))
          for k, v in inputs(op, length, seed, decay=8.0).items()}


def static(op):
  return {"window_size": WINDOW} if op == "rla" else {}


@functools.partial(jax.jit, static_argnames=("op", "kw"))
def _values_and_grads(arrays, cts, *, op, kw):
  def loss(a):
    y, h = FNS[op](**a, **dict(kw), return_final_state=True, interpret=interpret_kernels())
    return jnp.sum(y.astype(jnp.float32) * cts[0]) + jnp.sum(h * cts[1]), (y, h)
  (_, outs), grads = jax.value_and_grad(loss, has_aux=True)(arrays)
  return outs, grads


def check(op, impl, arrays, dtype=jnp.float32, tf32=False, **kw):
  """Output, final state and the gradient of every input of ``op`` on ``impl`` against the
  reference, which sees the arrays as given (rounded to their dtype)."""
  kw = {**static(op), **kw, "implementation": impl}
  ref_kw = {k: v for k, v in kw.items() if k in ("window_size", "dt_softplus", "feature_map")}
  as64 = {k: np.asarray(jnp.asarray(v).astype(jnp.float32), np.float64) for k, v in arrays.items()}
  ref = reference(op, **as64, **ref_kw)
  rng = np.random.default_rng(1)
  cts = tuple(rng.standard_normal(r.shape).astype(np.float32) for r in ref)
  outs, grads = _values_and_grads({k: jnp.asarray(v) for k, v in arrays.items()}, cts, op=op,
                                  kw=tuple(sorted(kw.items())))
  for name, o, r in zip(("output", "final state"), outs, ref):
    assert max_error(o, r) <= tolerance(dtype, tf32=tf32), (name, max_error(o, r))
  for name, g in reference_vjp(op, cts, **as64, **ref_kw).items():
    err = max_error(grads[name], g)
    assert err <= tolerance(dtype, grad=True, tf32=tf32), (f"d{name}", err)


# (op, the argument named, edit of the call's keyword arguments)
BAD_INPUTS = [
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
    ("ssd", "chunk_size", lambda a: a.update(chunk_size=0)),
    ("rla", "k", lambda a: a.update(k=np.concatenate([a["k"]] * 3, axis=2))),  # 6 kv heads, 4 heads
    ("rla", "v", lambda a: a.update(v=a["v"][:, :-1])),
    ("rla", "initial_state", lambda a: a.update(initial_state=a["initial_state"][..., :-1])),
    ("rla", "window_size", lambda a: a.update(window_size=-1)),
    ("rla", "feature_map", lambda a: a.update(feature_map="elu")),
    ("rla", "chunk_size", lambda a: a.update(chunk_size=0)),
]


class ScanConformance(Conformance):
  """The shared cases; subclass per backend and set the attributes."""

  implementation: str = ""
  ops = ("mamba", "ssd", "rla")
  lengths = ((65, None), (1, None), (63, None), (64, None), (1000, None))   # (length, chunk_size)
  bf16_chunks = (None,)
  refusals: tuple = ()   # (id, op, keyword arguments, message pattern)
  tf32 = False

  def _grid(self, test):
    chunk = lambda c: "" if c is None else f"-c{c}"
    if test == "test_values_and_grads":
      return [(f"{op}-{n}{chunk(c)}", (op, n, c)) for op in self.ops for n, c in self.lengths]
    if test == "test_without_optional_inputs":
      return [(op, op) for op in self.ops]
    if test == "test_bfloat16":
      return [(f"{op}{chunk(c)}", (op, c)) for op in self.ops for c in self.bf16_chunks]
    if test == "test_bad_inputs":
      return [(f"{op}-{name}", (op, name, edit)) for op, name, edit in BAD_INPUTS if op in self.ops]
    if test == "test_refusals":
      return [(c[0], c) for c in self.refusals]
    return None

  # -- the cases ----------------------------------------------------------------------------
  def test_values_and_grads(self, case):
    op, length, chunk = case
    check(op, self.implementation, inputs(op, length, seed=length), tf32=self.tf32, chunk_size=chunk)

  def test_without_optional_inputs(self, case):
    kw = {"dt_softplus": False} if case != "rla" else {"feature_map": "relu"}
    a = inputs(case, 40, optional=False)
    if case != "rla":
      a["dt"] = np.abs(a["dt"])  # without softplus, a positive dt keeps the decay below one
    check(case, self.implementation, a, tf32=self.tf32, **kw)

  def test_bfloat16(self, case):
    """At the default chunk (Mamba-1: 16 at this length, SSD and RLA: 64) and the others."""
    op, chunk = case
    check(op, self.implementation, bf16_inputs(op, 130 if chunk is None else 300, seed=chunk or 0),
          dtype=jnp.bfloat16, chunk_size=chunk)

  def test_bad_inputs(self, case):
    op, name, edit = case
    a = {**static(op), **inputs(op, 8)}
    edit(a)
    with pytest.raises(ValueError, match=rf"\b{name}\b"):
      FNS[op](**a, implementation=self.implementation, interpret=interpret_kernels())

  def test_refusals(self, case):
    _, op, kw, pattern = case
    with pytest.raises(ValueError, match=pattern):
      FNS[op](**{**static(op), **inputs(op, 8), **kw}, implementation=self.implementation,
              interpret=interpret_kernels())
