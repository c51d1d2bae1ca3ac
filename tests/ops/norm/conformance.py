"""The norm op's conformance suite: every backend against the float64 reference, values and
the gradient of every input (x, residual, scale, bias, adaLN's shift and scale), at odd widths
and row counts off the kernels' row block, in each dtype, with and without the residual add."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from probjax.core.tolerances import max_error, tolerance
from probjax.ops.norm import adaln_modulate, layer_norm, rms_norm
from probjax.ops.norm.reference import reference, reference_grads, reference_jvp
from tests.ops.conformance import Conformance

# (id, op, leading shape, d, modulation form)
SHAPES = [("rms", "rms", (3, 5), 37, None), ("layer", "layer", (2, 7), 37, None),
          ("adaln_sample", "adaln_layer", (2, 5), 37, "sample"), ("adaln_token", "adaln_rms", (2, 3), 20, "token"),
          ("adaln_b1d", "adaln_layer", (2, 3), 16, "b1d"), ("rms_wide", "rms", (3,), 200, None),
          # 70 rows of width 100: three of the kernels' 32-row blocks, the last one partial.
          ("layer_blocks", "layer", (70,), 100, None), ("adaln_blocks", "adaln_layer", (5, 14), 100, "sample")]
DTYPES = ("float32", "bfloat16", "float16")


def inputs(seed, op, lead, d, form, dtype, residual):
  """The op's arrays: fresh normal draws (modulation and affine terms around their identity)."""
  r = np.random.default_rng(seed)
  draw = lambda shape, s=1.0, c=0.0: jnp.asarray(c + s * r.standard_normal(shape), dtype)
  a = dict(x=draw((*lead, d)))
  if residual:
    a["residual"] = draw((*lead, d))
  if op.startswith("adaln"):
    b = lead[0]
    shape = {"sample": (b, d), "token": (*lead, d), "b1d": (b, 1, d)}[form]
    a["shift"], a["mod_scale"] = draw(shape, 0.5), draw(shape, 0.5)
  else:
    a["scale"] = draw((d,), 0.2, 1.0)
    if op == "layer":
      a["bias"] = draw((d,), 0.5)
  return a


def kind_of(op):
  return op.split("_")[-1] if op.startswith("adaln") else op


def call(op, a, **kw):
  """The op on the arrays of :func:`inputs`: ``(y, h)`` (``h`` None without a residual)."""
  r = a.get("residual")
  if op == "rms":
    out = rms_norm(a["x"], a["scale"], residual=r, **kw)
  elif op == "layer":
    out = layer_norm(a["x"], a["scale"], a["bias"], residual=r, **kw)
  else:
    out = adaln_modulate(a["x"], a["shift"], a["mod_scale"], norm=kind_of(op), residual=r, **kw)
  return out if r is not None else (out, None)


class NormConformance(Conformance):
  implementation: str
  interpret: bool = False

  def _grid(self, test):
    if test in ("test_values", "test_grads"):
      return [(f"{sid}-{dt}-{'res' if res else 'nores'}", (sid, op, lead, d, form, dt, res))
              for sid, op, lead, d, form in SHAPES for dt in DTYPES for res in (False, True)]
    if test == "test_jvp":
      return [(sid, (sid, op, lead, d, form, "float32", True)) for sid, op, lead, d, form in SHAPES[:4]]
    return None

  def run(self, op, a):
    return call(op, a, implementation=self.implementation, interpret=self.interpret)

  def test_values(self, case):
    _, op, lead, d, form, dt, res = case
    a = inputs(0, op, lead, d, form, dt, res)
    y, h = self.run(op, a)
    want_y, want_h = reference(kind=kind_of(op), eps=1e-6, **a)
    assert y.dtype == a["x"].dtype and y.shape == a["x"].shape
    assert max_error(y, want_y) <= tolerance(dt), max_error(y, want_y)
    if res:
      assert h.dtype == a["x"].dtype
      assert max_error(h, want_h) <= tolerance(dt)

  def test_grads(self, case):
    _, op, lead, d, form, dt, res = case
    a = inputs(1, op, lead, d, form, dt, res)
    r = np.random.default_rng(2)
    dy = jnp.asarray(r.standard_normal(a["x"].shape), dt)
    dh = jnp.asarray(r.standard_normal(a["x"].shape), dt) if res else None

    def loss(arrays):
      y, h = self.run(op, arrays)
      total = jnp.sum(y.astype(jnp.float32) * dy.astype(jnp.float32))
      return total if h is None else total + jnp.sum(h.astype(jnp.float32) * dh.astype(jnp.float32))

    got = jax.grad(loss)(a)
    want = reference_grads(dy, dh, kind=kind_of(op), eps=1e-6, **a)
    assert set(got) == set(want)
    for name in want:
      assert got[name].dtype == a[name].dtype, name
      err = max_error(got[name], want[name])
      assert err <= tolerance(dt, grad=True), (name, err)

  def test_jvp(self, case):
    _, op, lead, d, form, dt, res = case
    a = inputs(3, op, lead, d, form, dt, res)
    t = {k: jnp.asarray(np.random.default_rng(4).standard_normal(v.shape), v.dtype) for k, v in a.items()}
    _, (ty, th) = jax.jvp(lambda p: self.run(op, p), (a,), (t,))
    want_y, want_h = reference_jvp(t, kind=kind_of(op), eps=1e-6, **a)
    assert max_error(ty, want_y) <= tolerance(dt, grad=True)
    assert max_error(th, want_h) <= tolerance(dt, grad=True)
