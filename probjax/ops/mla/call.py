"""One multi-head latent attention call as the form rule, the backends and the tests see it."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

from probjax.core.values import check_scale

FORMS = ("auto", "expanded", "absorbed")
_FLOATS = tuple(jnp.dtype(t) for t in (jnp.float32, jnp.bfloat16, jnp.float16, jnp.float64))


@dataclasses.dataclass(frozen=True)
class MLACall:
  """The static description of a call: everything but the arrays.

  ``q_len`` queries of ``heads`` heads over ``kv_len`` cached positions; per head the query
  has ``d_nope`` + ``d_rope`` features, the latent ``d_c``, the output ``d_v``. ``mask_kinds``
  are the mask's predicates (``Mask.kinds``, empty without a mask); ``page_size`` is the page
  length of a paged cache (None: contiguous; ``kv_len`` is then pages x page_size).
  """

  batch: int
  q_len: int
  kv_len: int
  heads: int
  d_nope: int
  d_rope: int
  d_c: int
  d_v: int
  dtype: Any
  scale: float | None = None
  mask_kinds: tuple[str, ...] = ()
  page_size: int | None = None

  @property
  def key_width(self) -> int:
    """The model's key width ``d_nope + d_rope`` (whose ``** -0.5`` is the default scale)."""
    return self.d_nope + self.d_rope

  @property
  def softmax_scale(self):
    return self.key_width ** -0.5 if self.scale is None else self.scale


def _array(name, x, ndim, form):
  if not hasattr(x, "shape") or not hasattr(x, "dtype"):
    raise TypeError(f"{name} must be an array {form}, got {type(x).__name__}")
  if len(x.shape) != ndim:
    raise ValueError(f"{name} must have rank {ndim} {form}, got shape {tuple(x.shape)}")
  if jnp.dtype(x.dtype) not in _FLOATS:
    raise TypeError(f"{name} must be float32, bfloat16, float16 or float64, got {x.dtype}")
  return tuple(int(n) for n in x.shape)


def make_call(q_nope, q_rope, kv_latent, k_rope, w_uk, w_uv, *, scale=None, mask_kinds: tuple[str, ...] = (),
              page_size: int | None = None) -> MLACall:
  """Validates the arrays (ValueError / TypeError naming the argument) and describes the call
  (``kv_latent`` / ``k_rope`` as the contiguous ``[B, S, d]`` a paged cache stands for)."""
  b, t, h, dn = _array("q_nope", q_nope, 4, "[batch, q_len, heads, d_nope]")
  qr = _array("q_rope", q_rope, 4, "[batch, q_len, heads, d_rope]")
  lat = _array("kv_latent", kv_latent, 3, "[batch, kv_len, d_c]")
  kr = _array("k_rope", k_rope, 3, "[batch, kv_len, d_rope]")
  uk = _array("w_uk", w_uk, 3, "[d_c, heads, d_nope]")
  uv = _array("w_uv", w_uv, 3, "[d_c, heads, d_v]")
  if qr[:3] != (b, t, h):
    raise ValueError(f"q_rope must be [batch, q_len, heads, d_rope] = [{b}, {t}, {h}, d_rope] like q_nope, got {qr}")
  dr = qr[3]
  s, dc = lat[1], lat[2]
  if lat[0] != b:
    raise ValueError(f"kv_latent's batch {lat[0]} does not match q_nope's batch {b}")
  if kr != (b, s, dr):
    raise ValueError(f"k_rope must be [batch, kv_len, d_rope] = {(b, s, dr)} (kv_latent's batch and length, "
                     f"q_rope's d_rope), got {kr}")
  if uk != (dc, h, dn):
    raise ValueError(f"w_uk must be [d_c, heads, d_nope] = {(dc, h, dn)}, got {uk}")
  if uv[:2] != (dc, h):
    raise ValueError(f"w_uv must be [d_c, heads, d_v] = ({dc}, {h}, d_v), got {uv}")
  for name, n in (("q_nope (heads)", h), ("q_nope (d_nope)", dn), ("q_rope (d_rope)", dr),
                  ("kv_latent (d_c)", dc), ("w_uv (d_v)", uv[2])):
    if n < 1:
      raise ValueError(f"{name} must be >= 1, got {n}")
  dtypes = {jnp.dtype(x.dtype) for x in (q_nope, q_rope, kv_latent, k_rope)}
  if len(dtypes) != 1:
    raise TypeError(f"q_nope, q_rope, kv_latent and k_rope must share a dtype, got {sorted(map(str, dtypes))}")
  if scale is not None:
    scale = check_scale(scale, dn + dr)
  return MLACall(b, t, s, h, dn, dr, dc, uv[2], dtypes.pop(), scale, tuple(mask_kinds), page_size)
