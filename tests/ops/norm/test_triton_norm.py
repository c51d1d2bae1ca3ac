"""The Pallas-Triton row kernels in interpret mode against the norm op's conformance suite,
and what only they have: the width they refuse, no forward mode, the row block's edge."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from probjax.core.device import Device
from probjax.ops.norm import NormCall, explain_dispatch, rms_norm
from probjax.ops.norm.backends.triton import MAX_WIDTH
from tests.ops.norm.conformance import NormConformance


class TestTritonNormConformance(NormConformance):
  implementation = "triton"
  interpret = True
  # A custom_vjp: no forward mode (test_jvp_is_not_defined).
  test_jvp = None
  # Every interpret-mode case compiles anew: make test keeps one float32 case of each kernel path
  # (row and column modulation, residual or not, the partial row block); the other dtypes and
  # shapes repeat those paths (slow: interpret-mode compilation).
  slow_cases = frozenset({"*-bfloat16-*", "*-float16-*", "*rms_wide*", "*adaln_b1d*", "*adaln_token*",
                          "test_values[*-nores]", "test_grads[rms-*]", "test_grads[layer-*]"})


def test_refuses_wider_rows_with_the_reason():
  call = NormCall(rows=4, d=MAX_WIDTH + 1, dtype=jnp.float32)
  with pytest.raises(ValueError, match="above the kernels"):
    explain_dispatch(call, implementation="triton", device=Device("gpu", (9, 0)))


def test_refuses_float64_and_a_cpu_device():
  with pytest.raises(ValueError, match="float64"):
    explain_dispatch(NormCall(rows=4, d=8, dtype=np.float64), implementation="triton", device=Device("gpu", (9, 0)))
  x = jax.random.normal(jax.random.key(0), (4, 8))
  with pytest.raises(ValueError, match="NVIDIA GPU"):
    rms_norm(x, jnp.ones(8), implementation="triton")


def test_jvp_is_not_defined():
  x = jax.random.normal(jax.random.key(0), (4, 8))
  with pytest.raises(TypeError, match="custom_vjp"):
    jax.jvp(lambda x: rms_norm(x, jnp.ones(8), implementation="triton", interpret=True), (x,), (x,))
