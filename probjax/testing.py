"""Test helpers shared by every backend's tests: inputs, masks and the reference check.

Every check compares against :mod:`probjax.ops.attention.reference` (float64)
with bounds from :mod:`probjax.ops.attention.tolerances`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from probjax.ops.attention import masks as M
from probjax.ops.attention.reference import reference_vjp
from probjax.ops.attention.tolerances import max_error, scaled_tolerance, tolerance


@dataclasses.dataclass
class Inputs:
  q: jax.Array
  k: jax.Array
  v: jax.Array
  do: jax.Array


def make_inputs(seed: int, batch: int, q_len: int, kv_len: int, heads: int, kv_heads: int,
                head_dim: int, dtype=jnp.float32) -> Inputs:
  """Fresh standard-normal q ``[B, Tq, H, D]``, k/v ``[B, Tkv, Hkv, D]`` and output cotangent."""
  ks = jax.random.split(jax.random.key(seed), 4)
  q = jax.random.normal(ks[0], (batch, q_len, heads, head_dim), jnp.float32).astype(dtype)
  k = jax.random.normal(ks[1], (batch, kv_len, kv_heads, head_dim), jnp.float32).astype(dtype)
  v = jax.random.normal(ks[2], (batch, kv_len, kv_heads, head_dim), jnp.float32).astype(dtype)
  do = jax.random.normal(ks[3], (batch, q_len, heads, head_dim), jnp.float32).astype(dtype)
  return Inputs(q, k, v, do)


def make_mask(name: str, batch: int, q_len: int, kv_len: int, seed: int = 0) -> M.Mask | None:
  """Named masks used across tests and benchmarks.

  Names: none, causal, causal_offset, window, window_right, kv_len, kv_len_zero
  (one batch element has no keys), lengths, segments, causal&kv_len,
  window&segments.
  """
  rng = np.random.default_rng(seed)
  kv_lens = lambda: jnp.asarray(rng.integers(1, kv_len + 1, size=batch), jnp.int32)
  def segments(n):
    cuts = np.sort(rng.integers(0, 4, size=(batch, n)), axis=1)
    return jnp.asarray(cuts, jnp.int32)
  if name == "none":
    return None
  if name == "causal":
    return M.CausalMask()
  if name == "causal_offset":
    return M.CausalMask(offset=kv_len - q_len)
  if name == "window":
    return M.LocalWindowMask(left=max(1, kv_len // 5), right=0)
  if name == "window_right":
    return M.LocalWindowMask(left=max(1, kv_len // 7), right=max(1, kv_len // 9))
  if name == "kv_len":
    return M.KVLenMask(kv_lens())
  if name == "kv_len_zero":
    lens = np.array(kv_lens())
    lens[0] = 0
    return M.KVLenMask(jnp.asarray(lens))
  if name == "lengths":
    return M.LengthMask(jnp.asarray(rng.integers(0, q_len + 1, size=batch), jnp.int32), kv_lens())
  if name == "segments":
    qs = segments(q_len)
    return M.SegmentMask(qs, qs if q_len == kv_len else segments(kv_len))
  if name == "causal&kv_len":
    return M.CausalMask() & M.KVLenMask(kv_lens())
  if name == "window&segments":
    qs = segments(q_len)
    return M.LocalWindowMask(left=max(1, kv_len // 3), right=2) & M.SegmentMask(qs, qs if q_len == kv_len else segments(kv_len))
  raise ValueError(f"unknown mask name {name!r}")


MASK_NAMES = ("none", "causal", "causal_offset", "window", "window_right", "kv_len", "kv_len_zero",
              "lengths", "segments", "causal&kv_len", "window&segments")


def check_against_reference(attn, x: Inputs, *, mask=None, bias=None, score_mod=None, scale=None,
                            grads: bool = True, tf32: bool = False):
  """Runs ``attn(q, k, v, bias) -> out`` and its vjp; asserts values and gradients
  against the float64 reference. Returns the dict of errors."""
  dtype = x.q.dtype
  if bias is None:
    f = lambda q, k, v: attn(q, k, v, None)
    out, vjp = jax.vjp(f, x.q, x.k, x.v)
    got = (out,) + (vjp(x.do) if grads else ())
  else:
    out, vjp = jax.vjp(attn, x.q, x.k, x.v, bias)
    got = (out,) + (vjp(x.do) if grads else ())
  ref = reference_vjp(x.q, x.k, x.v, x.do, bias=bias, mask=mask, score_mod=score_mod, scale=scale)
  names = ("out", "dq", "dk", "dv", "dbias")
  errors = {}
  for name, g, r in zip(names, got, ref):
    if r is None:
      continue
    g = np.asarray(jnp.asarray(g, jnp.float32))
    assert np.all(np.isfinite(g)), f"{name} has NaN/inf"
    err = max_error(g, r)
    tol = tolerance(dtype, grad=name != "out", tf32=tf32)
    errors[name] = err
    assert err <= tol, f"{name}: max error {err:.3g} > {tol:.3g} ({jnp.dtype(dtype).name}); all: {errors}"
  return errors


def check_against_same_precision(attn, same_precision, x: Inputs, *, mask=None, factor: float = 2.0):
  """FlashAttention-style check: the output's and each gradient's error against the float64
  reference at most ``factor`` x that of ``same_precision`` (another exact implementation in
  the inputs' dtype, e.g. the XLA path). Tighter than the fixed per-dtype bound, which a wrong
  term of the backward can stay under. Both are ``f(q, k, v) -> out``. Returns the errors."""
  ref = reference_vjp(x.q, x.k, x.v, x.do, mask=mask)
  run = lambda f: (lambda out, vjp: (out, *vjp(x.do)))(*jax.vjp(f, x.q, x.k, x.v))
  errors = {}
  for name, got, same, r in zip(("out", "dq", "dk", "dv"), run(attn), run(same_precision), ref):
    err, bound = max_error(got, r), scaled_tolerance(max_error(same, r), x.q.dtype, factor=factor,
                                                      grad=name != "out")
    errors[name] = err
    assert err <= bound, f"{name}: error {err:.3g} > {bound:.3g} ({factor}x the same-precision one); {errors}"
  return errors
