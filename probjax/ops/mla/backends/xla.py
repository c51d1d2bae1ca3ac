"""MLA's ``xla`` backend: the expanded or absorbed form (:mod:`probjax.ops.mla.forms`), the
projections in XLA around one call of attention's public ``dot_product_attention``, which
dispatches the attention itself (the decision's ``attention`` entry: what it asks attention for).

It computes every call: a paged cache is gathered to a contiguous one first, and positions past
the mask's lengths are zeroed before any projection (see :func:`probjax.ops.mla.forms.valid_inputs`).
"""

from __future__ import annotations

import jax.numpy as jnp

from probjax.core.backend import Backend
from probjax.core.device import Device
from probjax.core.eager import compile_once
from probjax.core.dispatch import Decision
from probjax.ops.mla import forms
from probjax.ops.mla.call import MLACall

# The nested attention decision's name where MLA leaves the implementation to attention's dispatch.
ATTENTION_DEFAULT = "default"


def attention_implementation(decision: Decision) -> str | None:
  """The ``implementation`` the decision passes to attention (None: attention's default)."""
  attention = decision.get("attention")
  name = attention.implementation if isinstance(attention, Decision) else attention
  return None if name == ATTENTION_DEFAULT else name


class XlaBackend(Backend[MLACall]):
  """The forms through attention's face (whose dispatch picks the attention kernel)."""

  name = "xla"

  def supports(self, call: MLACall, device: Device) -> str | None:
    return None  # attention refuses, with its reason, an implementation that cannot compute the call

  def __call__(self, q_nope, q_rope, kv_latent, k_rope, w_uk, w_uv, *, call: MLACall, decision: Decision,
               mask=None, page_table=None, **_):
    """``[B, Tq, H, d_v]`` in the form ``decision.get("form")``."""
    return _compute(q_nope, q_rope, kv_latent, k_rope, w_uk, w_uv, call=call, form=decision.get("form"),
                    implementation=attention_implementation(decision), mask=mask, page_table=page_table)


@compile_once  # eager calls: the projections and attention compiled once per call description
def _compute(q_nope, q_rope, kv_latent, k_rope, w_uk, w_uv, *, call: MLACall, form: str, implementation: str | None,
             mask, page_table):
  q_nope, q_rope, kv_latent, k_rope, q_ok = forms.valid_inputs(
      q_nope, q_rope, kv_latent, k_rope, call=call, mask=mask, page_table=page_table)
  run = forms.expanded if form == "expanded" else forms.absorbed
  out = run(q_nope, q_rope, kv_latent, k_rope, w_uk, w_uv, mask=mask, scale=call.softmax_scale,
            implementation=implementation)
  if q_ok is not None:
    out = jnp.where(q_ok, out, 0)  # also drops a NaN cotangent on padded rows before w_uv's gradient
  return out
