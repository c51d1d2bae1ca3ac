"""Multi-head latent attention's public face: :func:`mla` and :func:`explain_dispatch`
(re-exported by :mod:`probjax.ops.mla`; :func:`explain` is the same function under its older
name). A call validates its arguments, asks :func:`~probjax.ops.mla.dispatch.decide` once for a
:class:`~probjax.core.dispatch.Decision` and runs the backend of
:data:`~probjax.ops.mla.registry.REGISTRY` it names.

>>> import jax, jax.numpy as jnp
>>> from probjax.core.device import Device
>>> from probjax.ops.mla import explain_dispatch
>>> sd = lambda *s: jax.ShapeDtypeStruct(s, jnp.bfloat16)
>>> decode = (sd(4, 1, 128, 128), sd(4, 1, 128, 64), sd(4, 4096, 512), sd(4, 4096, 64),
...           sd(512, 128, 128), sd(512, 128, 128))
>>> d = explain_dispatch(*decode, device=Device("gpu", (9, 0), 140 << 30))
>>> d.implementation, d.get("form")
('mosaic', 'absorbed')
>>> d = explain_dispatch(*decode, device=Device("cpu"))
>>> d.implementation, d.get("form"), d.get("attention").implementation, d.rule
('xla', 'absorbed', 'default', 'not an absorbed call on an NVIDIA GPU')
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from probjax.core.device import Device
from probjax.core.dispatch import Decision
from probjax.core.eager import compile_once
from probjax.core.values import concrete_values
from probjax.ops.attention import Mask
from probjax.ops.mla import forms
from probjax.ops.mla.call import FORMS, MLACall, make_call
from probjax.ops.mla.dispatch import decide
from probjax.ops.mla.registry import REGISTRY

__all__ = ["mla", "explain_dispatch", "explain", "Decision", "MLACall", "make_call", "FORMS", "REGISTRY"]


def explain_dispatch(q_nope, q_rope=None, kv_latent=None, k_rope=None, w_uk=None, w_uv=None, *, form: str = "auto",
                     scale=None, implementation: str | None = None, device: Device | None = None,
                     mask: Mask | None = None, page_table=None) -> Decision:
  """What :func:`mla` runs for these arguments (arrays or ``jax.ShapeDtypeStruct``) on
  ``device`` (default: the current one), and why: the backend (``implementation``: ``"xla"``,
  the form through attention, or ``"mosaic"`` / ``"triton"``, MLA's absorbed decode kernels) and its reason
  (``rule``), the form (``get("form")``, why: ``get("form_rule")``) and, on ``xla``, what the
  form asks attention for (``get("attention")``, a Decision: ``"default"`` or the requested name,
  and why).

  ``q_nope`` may instead be the call's description, an :class:`MLACall` (``make_call`` builds
  one from the arrays' shapes; then no other array, ``scale``, ``mask`` or ``page_table``):

  >>> import jax, jax.numpy as jnp
  >>> s = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.bfloat16)
  >>> arrays = (s(4, 1, 16, 128), s(4, 1, 16, 64), s(4, 2048, 512), s(4, 2048, 64), s(512, 16, 128),
  ...           s(512, 16, 128))
  >>> cpu = Device("cpu")
  >>> explain_dispatch(make_call(*arrays), device=cpu) == explain_dispatch(*arrays, device=cpu)
  True"""
  if isinstance(q_nope, MLACall):
    given = [n for n, v in (("q_rope", q_rope), ("kv_latent", kv_latent), ("k_rope", k_rope), ("w_uk", w_uk),
                            ("w_uv", w_uv), ("scale", scale), ("mask", mask), ("page_table", page_table))
             if v is not None]
    if given:
      raise TypeError(f"explain_dispatch(call): the call describes the arrays; pass none of {given}")
    return decide(q_nope, device or Device.current(), form, implementation)
  if any(a is None for a in (q_rope, kv_latent, k_rope, w_uk, w_uv)):
    raise TypeError("explain_dispatch takes an MLACall or the six arrays (q_nope, q_rope, kv_latent, "
                    "k_rope, w_uk, w_uv)")
  call = _describe(q_nope, q_rope, kv_latent, k_rope, w_uk, w_uv, scale=scale, mask=mask, page_table=page_table)
  return decide(call, device or Device.current(), form, implementation)


explain = explain_dispatch  # the older name, kept (the same function)


def _describe(q_nope, q_rope, kv_latent, k_rope, w_uk, w_uv, *, scale, mask, page_table) -> MLACall:
  """The call description (a paged cache as the contiguous shapes it stands for)."""
  page_size = None
  if page_table is not None:
    page_size = int(kv_latent.shape[1])
    kv_latent, k_rope = _paged_shapes(kv_latent, k_rope, page_table)
  return make_call(q_nope, q_rope, kv_latent, k_rope, w_uk, w_uv, scale=scale,
                   mask_kinds=() if mask is None else mask.kinds, page_size=page_size)


def _paged_shapes(kv_latent, k_rope, page_table):
  """The contiguous cache shapes a paged call stands for (``[B, pages * page_size, d]``), after
  checking ``page_table``: rank 2, integer, and (when its values are known) every entry a page
  of the pool, in ``[0, num_pages)``."""
  import jax
  if not hasattr(page_table, "shape") or len(page_table.shape) != 2:
    raise ValueError(f"page_table must be [batch, pages_per_seq] int32, got shape {tuple(getattr(page_table, 'shape', ()))}")
  if not jnp.issubdtype(page_table.dtype, jnp.integer):
    raise TypeError(f"page_table must be an integer array [batch, pages_per_seq], got {page_table.dtype}")
  num_pages = int(kv_latent.shape[0])
  table = concrete_values(page_table)
  if table is not None and table.size and (table.min() < 0 or table.max() >= num_pages):
    bad = table[(table < 0) | (table >= num_pages)]
    raise ValueError(f"page_table entries must be pages of the pool, in [0, {num_pages}); got "
                     f"{bad[:4].tolist()}{' ...' if bad.size > 4 else ''} (pad unused entries with any "
                     "valid page, e.g. 0: positions past the lengths are never read)")
  b, n = page_table.shape
  return tuple(jax.ShapeDtypeStruct((b, n * x.shape[1], x.shape[2]), x.dtype) for x in (kv_latent, k_rope))


def mla(q_nope, q_rope, kv_latent, k_rope, w_uk, w_uv, *, mask: Mask | None = None, scale=None,
        form: str = "auto", implementation: str | None = None, return_lse: bool = False,
        page_table=None):
  """Multi-head latent attention (see the module docstring for shapes and forms).

  Args:
    mask: a probjax :class:`Mask` over ``[Tq, S]`` (causal, windows, ``KVLenMask`` over a cache,
      segments). Rows with no valid key are zero, with zero gradients; positions past its
      lengths may hold anything (NaN included).
    scale: softmax scale, default ``(d_nope + d_rope) ** -0.5``.
    form: "auto", "expanded" or "absorbed" (the same function; :func:`explain_dispatch` says which runs).
    implementation: "mosaic" or "triton" with the absorbed form: an MLA decode kernel (ValueError where it
      cannot compute the call); other names are passed to attention (None: see :func:`explain_dispatch`).
    page_table: ``[B, pages_per_seq]`` int32: ``kv_latent`` / ``k_rope`` are then page pools
      ``[num_pages, page_size, d]`` and the mask's ``KVLenMask`` gives the sequence lengths.
      Entries must be in ``[0, num_pages)``: a concrete table is checked (ValueError); in a
      traced one an entry below 0 reads page 0 and one past the pool its last page, so no path
      reads outside the pool.
    return_lse: also return the softmax's log-sum-exp ``[B, Tq, H]`` (float32, ``-inf`` for rows
      with no valid key), computed on XLA beside the attention call.
  Returns:
    ``[B, Tq, H, d_v]`` in the inputs' dtype (and the lse with ``return_lse``).
  """
  if page_table is not None:
    call = _describe(q_nope, q_rope, kv_latent, k_rope, w_uk, w_uv, scale=scale, mask=None, page_table=page_table)
    if mask is None or mask.lengths(call.batch)[1] is None:
      raise ValueError("page_table needs a mask with KVLenMask(lengths): the sequence lengths")
  else:
    call = make_call(q_nope, q_rope, kv_latent, k_rope, w_uk, w_uv, scale=scale)
  if mask is not None and not isinstance(mask, Mask):
    raise TypeError(f"mask must be a probjax Mask (e.g. CausalMask() & KVLenMask(lengths)), got {type(mask).__name__}")
  if mask is not None:
    mask.validate(call.batch, call.q_len, call.kv_len)
    mask = mask.clamped(call.q_len, call.kv_len)
    call = dataclasses.replace(call, mask_kinds=mask.kinds)
  device = Device.current()
  decision = decide(call, device, form, implementation)
  out = REGISTRY.get(decision.implementation)(q_nope, q_rope, kv_latent, k_rope, w_uk, w_uv, call=call,
                                              decision=decision, mask=mask, page_table=page_table, device=device)
  if not return_lse:
    return out
  return out, _log_sum_exp(q_nope, q_rope, kv_latent, k_rope, w_uk, call=call, mask=mask, page_table=page_table)


@compile_once  # eager calls: compiled once per call description
def _log_sum_exp(q_nope, q_rope, kv_latent, k_rope, w_uk, *, call, mask, page_table):
  """The softmax's log-sum-exp ``[B, Tq, H]`` (float32) of the call, on XLA."""
  q_nope, q_rope, kv_latent, k_rope, _ = forms.valid_inputs(q_nope, q_rope, kv_latent, k_rope, call=call, mask=mask,
                                                            page_table=page_table)
  return forms.log_sum_exp(q_nope, q_rope, kv_latent, k_rope, w_uk, mask=mask, scale=call.softmax_scale)
