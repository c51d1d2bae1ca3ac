"""Argument validation shared by the public API and every backend."""

from __future__ import annotations

import dataclasses
import weakref

import jax
import jax.numpy as jnp
import numpy as np

from probjax.ops.attention.masks import Mask

FLOAT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float64))


@dataclasses.dataclass(frozen=True)
class AttentionShape:
  """Static description of a call, what dispatch and ``supports`` look at."""

  batch: int
  q_len: int
  kv_len: int
  q_heads: int
  kv_heads: int
  head_dim: int
  dtype: jnp.dtype
  v_head_dim: int | None = None  # None: head_dim (values as wide as queries and keys)

  @property
  def groups(self) -> int:
    return self.q_heads // self.kv_heads

  @property
  def value_head_dim(self) -> int:
    return self.head_dim if self.v_head_dim is None else self.v_head_dim


def check_qkv(query, key, value) -> AttentionShape:
  """Validates q ``[batch, q_len, heads, d_qk]``, k ``[batch, kv_len, kv_heads, d_qk]`` and v
  ``[batch, kv_len, kv_heads, d_v]`` (``d_v`` may differ from ``d_qk``, as in multi-head latent
  attention; the output is ``[batch, q_len, heads, d_v]``); returns their :class:`AttentionShape`."""
  for name, x in (("query", query), ("key", key), ("value", value)):
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
      raise TypeError(f"{name} must be an array, got {type(x).__name__}")
    if x.ndim != 4:
      raise ValueError(f"{name} must have rank 4 [batch, seq, heads, head_dim], got shape {tuple(x.shape)}")
    if jnp.dtype(x.dtype) not in FLOAT_DTYPES:
      raise TypeError(f"{name} must be float32, bfloat16, float16 or float64, got {x.dtype}")
  if not (query.dtype == key.dtype == value.dtype):
    raise TypeError(f"query, key and value must share a dtype, got {query.dtype}, {key.dtype}, {value.dtype}")
  b, tq, h, d = query.shape
  if key.shape[:3] != value.shape[:3]:
    raise ValueError(f"key and value must have the same shape [batch, kv_len, kv_heads] before the head_dim "
                     f"(which may differ), got {tuple(key.shape)} and {tuple(value.shape)}")
  bk, tk, hk, dk = key.shape
  if bk != b:
    raise ValueError(f"key/value batch {bk} does not match query batch {b}")
  if dk != d:
    raise ValueError(f"key/value head_dim {dk} does not match query head_dim {d}")
  if hk == 0 or h % hk:
    raise ValueError(f"query heads ({h}) must be a multiple of key/value heads ({hk})")
  dv = value.shape[3]
  return AttentionShape(b, tq, tk, h, hk, d, jnp.dtype(query.dtype), None if dv == d else dv)


def check_broadcast(name: str, x, s: AttentionShape, *, boolean: bool):
  """Validates a bias (``boolean=False``) or dense mask broadcastable to ``[batch, heads, q_len, kv_len]``."""
  if x is None:
    return None
  if not hasattr(x, "shape"):
    raise TypeError(f"{name} must be an array broadcastable to [batch, heads, q_len, kv_len], got {type(x).__name__}")
  full = (s.batch, s.q_heads, s.q_len, s.kv_len)
  if x.ndim > 4:
    raise ValueError(f"{name} must have rank <= 4 and broadcast to {full}, got shape {tuple(x.shape)}")
  shape = (1,) * (4 - x.ndim) + tuple(x.shape)
  for got, want in zip(shape, full):
    if got not in (1, want):
      raise ValueError(f"{name} of shape {tuple(x.shape)} does not broadcast to [batch, heads, q_len, kv_len] = {full}")
  if boolean and x.dtype != jnp.bool_:
    if not (jnp.issubdtype(x.dtype, jnp.number)):
      raise TypeError(f"{name} must be a boolean array (True = attend), got {x.dtype}")
    x = x != 0  # Flax's make_*_mask helpers return 1.0 / 0.0 masks
  if not boolean and not jnp.issubdtype(x.dtype, jnp.floating):
    raise TypeError(f"{name} must be a floating array, got {x.dtype}")
  return jnp.reshape(x, shape)


def check_mask(mask, s: AttentionShape):
  """Splits the ``mask`` argument into a :class:`Mask` and/or a dense boolean array."""
  if mask is None:
    return None, None
  if isinstance(mask, Mask):
    mask.validate(s.batch, s.q_len, s.kv_len)
    return mask, None
  return None, check_broadcast("mask", mask, s, boolean=True)


# What a fused kernel whose tiles and buffers are sized by one head_dim says of a value
# head_dim other than the query/key head_dim (each backend's ``supports`` decides).
V_HEAD_DIM_REASON = ("value head_dim != query/key head_dim: this kernel assumes one head_dim "
                     "(the XLA path computes it)")


def v_head_dim_reason(head_dim: int, v_head_dim: int | None) -> str | None:
  """Why a fused kernel refuses values of width ``v_head_dim`` (None: ``head_dim``), or None."""
  if v_head_dim is None or v_head_dim == head_dim:
    return None
  return f"{V_HEAD_DIM_REASON} (q/k head_dim {head_dim}, value head_dim {v_head_dim})"


def check_kernel_call(backend: str, reason: str | None, q, k, v, mask) -> None:
  """Raises ``ValueError`` where a kernel backend cannot compute the call (``reason``, from
  its ``supports``, which sees the value width) or k/v do not match q in batch, length, heads
  and dtype; validates the mask's arrays."""
  if reason is not None:
    raise ValueError(f"{backend} attention cannot compute this call: {reason}")
  if k.shape[:3] != v.shape[:3] or k.dtype != q.dtype or v.dtype != q.dtype:
    raise ValueError(f"k and v must match in [batch, kv_len, kv_heads] and q's dtype; got q {q.shape} "
                     f"{q.dtype}, k {k.shape} {k.dtype}, v {v.shape} {v.dtype}")
  if mask is not None:
    mask.validate(q.shape[0], q.shape[1], k.shape[1])


def check_dropout(dropout_rate, dropout_rng, deterministic):
  if not 0.0 <= float(dropout_rate) < 1.0:
    raise ValueError(f"dropout_rate must be in [0, 1), got {dropout_rate}")
  if deterministic or dropout_rate == 0.0:
    return 0.0, None
  if dropout_rng is None:
    raise ValueError("dropout_rng is required when dropout_rate > 0 and deterministic is False")
  return float(dropout_rate), dropout_rng


def score_mod_reason(score_mod) -> str | None:
  """Why a kernel cannot trace ``score_mod`` on a tile (it closes over arrays, or fails on
  float32 ``[16, 16]`` scores with scalar ``b``, ``h`` and broadcast indices), or None."""
  if score_mod is None:
    return None
  args = (jax.ShapeDtypeStruct((16, 16), jnp.float32), jax.ShapeDtypeStruct((), jnp.int32),
          jax.ShapeDtypeStruct((), jnp.int32), jax.ShapeDtypeStruct((16, 1), jnp.int32),
          jax.ShapeDtypeStruct((1, 16), jnp.int32))
  try:
    if jax.closure_convert(score_mod, *args)[1]:
      return "score_mod closes over traced arrays"
    if jax.make_jaxpr(score_mod)(*args).consts:
      return "score_mod closes over arrays"
  except Exception as e:  # noqa: BLE001 -- any tracing failure means "not this kernel"
    return f"score_mod not traceable on a tile ({type(e).__name__})"
  return None


_UNLOWERABLE = weakref.WeakKeyDictionary()  # score_mod -> {(backend, index_shapes, grad): reason}


def score_mod_unlowerable(score_mod, rules, backend: str, index_shapes, *, grad: bool) -> str | None:
  """The first operation of ``score_mod`` (and of its vjp when ``grad``), traced on a float32
  ``[64, 128]`` tile with int32 indices of ``index_shapes``, that has no entry in a Pallas
  backend's lowering ``rules``, or None. Such a call is refused by ``supports`` (and the
  default picks another path) rather than failing when the kernel lowers. Necessary, not
  sufficient: a rule may still reject a dtype or layout. Cached per function (a trace per call
  would cost more than a small call)."""
  if score_mod is None:
    return None
  key = (backend, tuple(index_shapes), grad)
  try:
    cache = _UNLOWERABLE.setdefault(score_mod, {})
  except TypeError:  # not weakly referenceable (e.g. a functools.partial of a builtin)
    cache = {}
  if key not in cache:
    cache[key] = _first_unlowerable(score_mod, rules, backend, index_shapes, grad)
  return cache[key]


def _first_unlowerable(score_mod, rules, backend: str, index_shapes, grad: bool) -> str | None:
  tile = jax.ShapeDtypeStruct((64, 128), jnp.float32)
  scalar = jax.ShapeDtypeStruct((), jnp.int32)
  idx = [jax.ShapeDtypeStruct(shape, jnp.int32) for shape in index_shapes]
  fn = score_mod
  if grad:
    fn = lambda s, b, h, qi, ki: score_mod_pullback(score_mod, s, s, b, h, qi, ki)
  name = first_unlowerable(jax.make_jaxpr(fn)(tile, scalar, scalar, *idx).jaxpr, rules)
  if name is not None:
    return f"score_mod{' (its gradient)' if grad else ''} uses {name}, which {backend} cannot lower"
  return None


def first_unlowerable(jaxpr, rules) -> str | None:
  """The name of the first primitive of ``jaxpr`` (or of a jaxpr nested in its equations) that
  has no entry in a Pallas backend's lowering ``rules``, or None."""
  from jax.extend import core as jex_core
  jaxprs = [jaxpr]
  while jaxprs:
    for eqn in jaxprs.pop().eqns:
      if eqn.primitive not in rules:
        return eqn.primitive.name
      for p in eqn.params.values():
        jaxprs += [j.jaxpr if isinstance(j, jex_core.ClosedJaxpr) else j
                   for j in (p if isinstance(p, (tuple, list)) else (p,))
                   if isinstance(j, (jex_core.Jaxpr, jex_core.ClosedJaxpr))]
  return None


def score_mod_pullback(score_mod, s, ds, b, h, qi, ki):
  """``ds`` (w.r.t. ``score_mod(s, b, h, qi, ki)``) pulled back to ``s``: ``jax.vjp`` of the
  elementwise modifier, its ``add_any`` (cotangent sums; no Pallas Mosaic GPU lowering) written
  as ``add`` and nested ``jit`` calls inlined."""
  from probjax.core.compat import ad_util, pjit
  from jax.extend import core as jex_core
  closed = jax.make_jaxpr(lambda s, ds, b, h, qi, ki: jax.vjp(lambda s: score_mod(s, b, h, qi, ki), s)[1](ds))(
      s, ds, b, h, qi, ki)

  def run(jaxpr, consts, args):
    env = dict(zip(jaxpr.constvars, consts)) | dict(zip(jaxpr.invars, args))
    read = lambda v: v.val if isinstance(v, jex_core.Literal) else env[v]
    for eqn in jaxpr.eqns:
      ins = [read(v) for v in eqn.invars]
      if eqn.primitive is ad_util.add_jaxvals_p:
        outs = [jax.lax.add(*ins)]
      elif eqn.primitive is pjit.jit_p:
        inner = eqn.params["jaxpr"]
        outs = run(inner.jaxpr, inner.consts, ins)
      else:
        outs = eqn.primitive.bind(*ins, **eqn.params)
        outs = outs if eqn.primitive.multiple_results else [outs]
      env.update(zip(eqn.outvars, outs))
    return [read(v) for v in jaxpr.outvars]
  return run(closed.jaxpr, closed.consts, (s, ds, b, h, qi, ki))[0]
