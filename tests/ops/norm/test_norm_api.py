"""The norm op's face: bad inputs raise naming the argument, dispatch on fake devices, eager
calls equal jitted ones."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from probjax.core.device import Device
from probjax.ops.norm import NormCall, adaln_modulate, available_implementations, explain_dispatch, layer_norm, rms_norm

X = jnp.asarray(np.random.default_rng(0).standard_normal((2, 3, 8)), jnp.float32)
V = jnp.asarray(np.random.default_rng(1).standard_normal(8), jnp.float32)


@pytest.mark.parametrize("fn, err, match", [
    (lambda: rms_norm(X.astype(jnp.int32), V), TypeError, "x must be floating"),
    (lambda: rms_norm(np.float32(1.0).tolist(), V), TypeError, "x must be an array"),
    (lambda: rms_norm(X, V[:5]), ValueError, r"scale must be \[d\]"),
    (lambda: rms_norm(X, V.astype(jnp.int32)), TypeError, "scale must be floating"),
    (lambda: layer_norm(X, V, V[:3]), ValueError, r"bias must be \[d\]"),
    (lambda: rms_norm(X, V, residual=X[:, :2]), ValueError, "residual must have x's shape"),
    (lambda: rms_norm(X, V, residual=X.astype(jnp.bfloat16)), TypeError, "residual must have x's dtype"),
    (lambda: rms_norm(X, V, eps=-1.0), ValueError, "eps must be"),
    (lambda: rms_norm(X, V, eps="1e-6"), ValueError, "eps must be"),
    (lambda: adaln_modulate(X, X[:, 0], X[:, 0], norm="batch"), ValueError, "norm must be one of"),
    (lambda: adaln_modulate(X, X[:, 0, :5], X[:, 0]), ValueError, "shift must be"),
    (lambda: adaln_modulate(X, X[:, 0], jnp.ones((3, 3, 8))), ValueError, "scale must be"),
    (lambda: adaln_modulate(X, X[:, 0], X[:, 0].astype(jnp.int32)), TypeError, "scale must be floating"),
    (lambda: rms_norm(X, V, implementation="nope"), ValueError, "unknown implementation"),
    (lambda: rms_norm(X, V, implementation=3), TypeError, "implementation must be"),
])
def test_bad_inputs_name_the_argument(fn, err, match):
  with pytest.raises(err, match=match):
    fn()


def test_explain_dispatch_rules():
  call = NormCall(rows=4096, d=1024, dtype=jnp.bfloat16)
  cpu = explain_dispatch(call, device=Device("cpu"))
  assert cpu.implementation == "xla" and "not a GPU" in cpu.rule
  gpu = explain_dispatch(call, device=Device("gpu", (9, 0), 140 << 30))
  assert gpu.implementation == "xla" and "level with the Triton row kernels or ahead" in gpu.rule
  asked = explain_dispatch(call, implementation="pallas", device=Device("gpu", (9, 0)))
  assert (asked.implementation, asked.rule) == ("triton", "requested")
  with pytest.raises(TypeError, match="NormCall"):
    explain_dispatch(X)
  assert "xla" in available_implementations(Device("cpu"))
  assert "triton" not in available_implementations(Device("cpu"))


def test_call_description_checks_its_fields():
  with pytest.raises(ValueError, match="norm must be one of"):
    NormCall(rows=1, d=1, dtype=jnp.float32, kind="batch")


def test_eager_equals_jitted_and_returns_the_residual_stream_only_when_asked():
  y = rms_norm(X, V)
  assert not isinstance(y, tuple)
  np.testing.assert_array_equal(y, jax.jit(lambda x: rms_norm(x, V))(X))
  y2, h = rms_norm(X, V, residual=X)
  np.testing.assert_array_equal(h, X + X)
