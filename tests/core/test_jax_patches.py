"""probjax.core.jax_patches registers rules on JAX's own ``linear_call`` primitive, for the whole
process, when probjax's attention autodiff is imported. Other users of
``jax.custom_derivatives.linear_call`` must see no difference wherever JAX computes their
call (values, jvp, transposes, grad, jit); the calls JAX rejects (vmap, a tangent in the
residuals, a jvp in only some of the linear inputs) compute with the user's own transpose.

Each side runs in its own interpreter: the patches cannot be undone in this one."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

PROBE = r'''
import json, sys
import jax, jax.numpy as jnp
from jax.custom_derivatives import linear_call
if sys.argv[1] == "patched":
  import probjax.ops.attention.autodiff  # noqa: F401  (applies probjax.core.jax_patches)
  from probjax.core import jax_patches
  assert jax_patches._applied

def f(r, lin):
  x, y = lin
  return r * x + 2.0 * y, jnp.sin(r) * y

def t(r, ct):  # deliberately ten times the true transpose: results must follow it, not f's
  a, b = ct
  return 10.0 * r * a, 10.0 * (2.0 * a + jnp.sin(r) * b)

def g(r, x, y):
  return linear_call(f, t, r, (x, y))

r = jnp.float32(0.7)
x = jnp.arange(3.0, dtype=jnp.float32) + 1.0
y = jnp.arange(3.0, dtype=jnp.float32) - 2.0
one = jnp.ones(3, jnp.float32)
loss = lambda r, x, y: sum(o.sum() for o in g(r, x, y))
cases = {
  "value": lambda: g(r, x, y),
  "jit_value": lambda: jax.jit(g)(r, x, y),
  "jvp_linear": lambda: jax.jvp(lambda x, y: g(r, x, y), (x, y), (one, 2.0 * one)),
  "jit_jvp_linear": lambda: jax.jit(lambda: jax.jvp(lambda x, y: g(r, x, y), (x, y), (one, one)))(),
  "linear_transpose": lambda: jax.linear_transpose(lambda x, y: g(r, x, y), x, y)((one, 3.0 * one)),
  "grad_linear": lambda: jax.grad(loss, (1, 2))(r, x, y),
  "jit_grad_linear": lambda: jax.jit(jax.grad(loss, (1, 2)))(r, x, y),
  "vjp_linear": lambda: jax.vjp(lambda x, y: g(r, x, y), x, y)[1]((one, one)),
  # JAX rejects these; with the patches they compute
  "grad_x_only": lambda: jax.grad(loss, 1)(r, x, y),
  "grad_y_only": lambda: jax.grad(loss, 2)(r, x, y),
  "jvp_x_only": lambda: jax.jvp(lambda x: g(r, x, y), (x,), (one,)),
  "jvp_residual": lambda: jax.jvp(lambda r: g(r, x, y), (r,), (jnp.float32(1.0),)),
  "vmap": lambda: jax.vmap(lambda x: g(r, x, y))(jnp.stack([x, 2.0 * x])),
}
out = {}
for name, case in cases.items():
  try:
    out[name] = jax.tree.map(lambda a: jnp.asarray(a, jnp.float32).tolist(), case())
  except Exception as e:  # noqa: BLE001
    out[name] = f"error: {type(e).__name__}"
print(json.dumps(out))
'''

REJECTED_BY_JAX = {"grad_x_only", "grad_y_only", "jvp_x_only", "jvp_residual", "vmap"}


def _probe(mode: str) -> dict:
  out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, timeout=300,
                       env={**__import__("os").environ, "JAX_PLATFORMS": "cpu"})
  assert out.returncode == 0, out.stderr
  return json.loads(out.stdout.splitlines()[-1])


def _close(a, b) -> bool:
  """Nested lists of numbers, equal to float32 rounding."""
  if isinstance(a, list) and isinstance(b, list):
    return len(a) == len(b) and all(_close(u, v) for u, v in zip(a, b))
  if isinstance(a, list) or isinstance(b, list):
    return _close(np.asarray(a).tolist(), np.asarray(b).tolist()) if np.shape(a) == np.shape(b) else False
  return bool(np.isclose(a, b, rtol=1e-6, atol=1e-6))


@pytest.fixture(scope="module")
def probes():
  return _probe("plain"), _probe("patched")


def test_plain_linear_call_unaffected(probes):
  plain, patched = probes
  assert set(plain) == set(patched)
  supported = {k for k, v in plain.items() if not isinstance(v, str)}
  # What this JAX computes without probjax: if JAX learns more of them, they join this side.
  assert supported >= set(plain) - REJECTED_BY_JAX, plain
  for name in supported:
    assert _close(patched[name], plain[name]), (name, plain[name], patched[name])  # same results


def test_rejected_calls_follow_the_users_transpose(probes):
  plain, patched = probes
  for name in REJECTED_BY_JAX:
    assert not isinstance(patched[name], str), (name, patched[name])
  # The transpose is the user's (ten times the true one) whichever inputs are differentiated.
  gx, gy = patched["grad_linear"]
  assert _close(patched["grad_x_only"], gx) and _close(patched["grad_y_only"], gy)
  # Tangents are f's own: in some linear inputs, and in the residual.
  r, x, y = np.float32(0.7), np.arange(3.0) + 1.0, np.arange(3.0) - 2.0
  assert _close(patched["jvp_x_only"], [patched["value"], [r * np.ones(3), np.zeros(3)]])
  assert _close(patched["jvp_residual"], [patched["value"], [x, np.cos(r) * y]])
  assert _close(patched["vmap"], [[r * x + 2 * y, 2 * r * x + 2 * y], [np.sin(r) * y] * 2])
