"""Multi-head latent attention (MLA, DeepSeek-V2): attention whose keys and values are
expanded per head from one shared latent.

Shapes: ``q_nope [B, Tq, H, d_nope]``, ``q_rope [B, Tq, H, d_rope]``, ``kv_latent [B, S, d_c]``,
``k_rope [B, S, d_rope]`` (shared by all heads), ``w_uk [d_c, H, d_nope]``, ``w_uv [d_c, H, d_v]``.
Head ``h`` attends with query ``[q_nope_h, q_rope_h]`` over keys ``[latent @ w_uk_h, k_rope]``
and values ``latent @ w_uv_h``; the output is ``[B, Tq, H, d_v]``. The softmax scale defaults to
``(d_nope + d_rope) ** -0.5`` (the model's key width) in both forms:

* ``"expanded"``: K and V are formed, then one attention call with ``d_qk = d_nope + d_rope``;
* ``"absorbed"``: ``w_uk`` is absorbed into the queries and ``w_uv`` applied after: multi-query
  attention of the H heads over the latent (``d_qk = d_c + d_rope``, values the latent itself);
* ``"auto"``: by arithmetic (:func:`probjax.ops.mla.dispatch.absorbed_is_cheaper`): expanded for
  training and prefill, absorbed for a few queries over a long cache.

>>> import jax, jax.numpy as jnp
>>> from probjax.ops.mla import mla
>>> ks = jax.random.split(jax.random.key(0), 6)
>>> B, T, S, H, dn, dr, dc, dv = 1, 5, 9, 2, 8, 4, 16, 8
>>> args = [jax.random.normal(k, s) for k, s in zip(ks, [(B, T, H, dn), (B, T, H, dr), (B, S, dc),
...         (B, S, dr), (dc, H, dn), (dc, H, dv)])]
>>> e, a = mla(*args, form="expanded"), mla(*args, form="absorbed")
>>> e.shape, bool(jnp.allclose(e, a, atol=1e-4))
((1, 5, 2, 8), True)
"""

from __future__ import annotations

import jax.numpy as jnp

from probjax.core.device import Device
from probjax.core.values import concrete_values
from probjax.ops.attention import Mask
from probjax.ops.mla import forms
from probjax.ops.mla.call import FORMS, MLACall, make_call
from probjax.ops.mla.dispatch import Decision, decide

__all__ = ["mla", "explain", "Decision", "MLACall", "FORMS"]


def explain(q_nope, q_rope, kv_latent, k_rope, w_uk, w_uv, *, form: str = "auto", scale=None,
            implementation: str | None = None, device: Device | None = None, mask: Mask | None = None,
            page_table=None) -> Decision:
  """The form :func:`mla` runs for these arguments (arrays or ``jax.ShapeDtypeStruct``), the
  kernel or attention implementation it asks for, and why, on ``device`` (default: the current one)."""
  page_size = None
  if page_table is not None:
    page_size = int(kv_latent.shape[1])
    kv_latent, k_rope = _paged_shapes(kv_latent, k_rope, page_table)
  call = make_call(q_nope, q_rope, kv_latent, k_rope, w_uk, w_uv, scale=scale)
  return decide(call, device or Device.current(), form, implementation,
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
    form: "auto", "expanded" or "absorbed" (the same function; :func:`explain` says which runs).
    implementation: "triton" with the absorbed form: MLA's decode kernel (ValueError where it
      cannot compute the call); other names are passed to attention (None: see :func:`explain`).
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
  page_size = None
  if page_table is not None:
    page_size = int(kv_latent.shape[1])
    lat_s, rope_s = _paged_shapes(kv_latent, k_rope, page_table)
    call = make_call(q_nope, q_rope, lat_s, rope_s, w_uk, w_uv, scale=scale)
    if mask is None or mask.lengths(call.batch)[1] is None:
      raise ValueError("page_table needs a mask with KVLenMask(lengths): the sequence lengths")
  else:
    call = make_call(q_nope, q_rope, kv_latent, k_rope, w_uk, w_uv, scale=scale)
  if mask is not None and not isinstance(mask, Mask):
    raise TypeError(f"mask must be a probjax Mask (e.g. CausalMask() & KVLenMask(lengths)), got {type(mask).__name__}")
  if mask is not None:
    mask.validate(call.batch, call.q_len, call.kv_len)
    mask = mask.clamped(call.q_len, call.kv_len)
  device = Device.current()
  decision = decide(call, device, form, implementation, mask_kinds=() if mask is None else mask.kinds,
                    page_size=page_size)
  if decision.kernel is not None:
    kv_lens = mask.lengths(call.batch)[1] if mask is not None else jnp.full((call.batch,), call.kv_len, jnp.int32)
    out = forms.absorbed_decode(q_nope, q_rope, kv_latent, k_rope, w_uk, w_uv, lengths=kv_lens,
                                page_table=page_table, scale=call.softmax_scale,
                                interpret=device.platform != "gpu")
    if not return_lse:
      return out
  if page_table is not None:
    kv_latent, k_rope = forms.gather_pages(kv_latent, page_table), forms.gather_pages(k_rope, page_table)
  # Positions past the lengths may hold NaN (a cache's unwritten tail). Attention zeroes its own
  # inputs there, but the projections around it would still meet them (dw_uk = latent^T dk with
  # a zero dk is NaN where the latent is), so they are zeroed before any projection.
  q_ok = None
  q_lens, kv_lens = (None, None) if mask is None else mask.lengths(call.batch)
  if kv_lens is not None:
    k_ok = forms.valid_positions(kv_lens, call.kv_len)
    kv_latent, k_rope = jnp.where(k_ok, kv_latent, 0), jnp.where(k_ok, k_rope, 0)
  if q_lens is not None:
    q_ok = forms.valid_positions(q_lens, call.q_len)[..., None]
    q_nope, q_rope = jnp.where(q_ok, q_nope, 0), jnp.where(q_ok, q_rope, 0)
  if decision.kernel is None:
    run = forms.expanded if decision.form == "expanded" else forms.absorbed
    out = run(q_nope, q_rope, kv_latent, k_rope, w_uk, w_uv, mask=mask, scale=call.softmax_scale,
              implementation=decision.attention_implementation)
    if q_ok is not None:
      out = jnp.where(q_ok, out, 0)  # also drops a NaN cotangent on padded rows before w_uv's gradient
    if not return_lse:
      return out
  lse = forms.log_sum_exp(q_nope, q_rope, kv_latent, k_rope, w_uk, mask=mask, scale=call.softmax_scale)
  return out, lse
