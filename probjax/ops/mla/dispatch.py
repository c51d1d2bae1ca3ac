"""Which form computes a call, and which attention implementation it asks for: pure rules
over the call and a :class:`Device`, each with its reason (tested on CPU with fake devices).

The two forms compute the same function (see :mod:`probjax.ops.mla`) and differ in work: the
expanded form forms K and V per head once per cached position and then attends at the narrow
widths ``d_nope + d_rope`` / ``d_v``; the absorbed form never forms them but attends at the latent
widths ``d_c + d_rope`` / ``d_c`` and reads one latent row that all heads share.
"""

from __future__ import annotations

import dataclasses

from probjax.core.device import Device
from probjax.ops.mla.call import FORMS, MLACall


@dataclasses.dataclass(frozen=True)
class Decision:
  """The form, the attention implementation it asks for (None: attention's default), and why."""

  form: str
  rule: str
  attention_implementation: str | None = None
  attention_rule: str = "attention's default"
  kernel: str | None = None       # MLA's own kernel ("triton": the absorbed decode), None: attention
  kernel_rule: str = ""

  def __str__(self):
    if self.kernel is not None:
      return f"{self.form} ({self.rule}); mla kernel {self.kernel} ({self.kernel_rule})"
    impl = self.attention_implementation or "default"
    return f"{self.form} ({self.rule}); attention {impl} ({self.attention_rule})"


def absorbed_is_cheaper(call: MLACall) -> bool:
  """Whether the absorbed form does less arithmetic than the expanded one.

  Multiply-adds per batch element and head, with ``P = d_c * (d_nope + d_v)``:

  * expanded: ``S * P`` to form K and V, plus ``Tq * S * (d_nope + d_rope + d_v)`` to attend;
  * absorbed: ``Tq * P`` to absorb q_nope and project the output, plus ``Tq * S * (2 d_c + d_rope)``.

  At DeepSeek-V2's widths (d_c 512, d_rope 64, d_nope = d_v = 128; P = 131072) over S = 4096
  positions: one decoded query costs 538M expanded against 4.6M absorbed, so decoding absorbs
  (it also reads 576 shared latent values per position instead of H * 320 expanded ones). With
  Tq = S = 4096 (prefill, training) it is 5.9G expanded against 18.8G absorbed, so it expands.
  The forms break even where ``Tq * S * 768 = P * (S - Tq)``: about 170 queries over a long
  cache, fewer over a short one.
  """
  s, tq = call.kv_len, call.q_len
  proj = call.d_c * (call.d_nope + call.d_v)
  expanded = s * proj + tq * s * (call.d_nope + call.d_rope + call.d_v)
  absorbed = tq * proj + tq * s * (2 * call.d_c + call.d_rope)
  return absorbed < expanded


def choose_form(call: MLACall, form: str = "auto") -> tuple[str, str]:
  """``(form, reason)``; ``form`` "auto" picks by :func:`absorbed_is_cheaper`."""
  if form not in FORMS:
    raise ValueError(f"form must be one of {FORMS}, got {form!r}")
  if form != "auto":
    return form, "requested"
  if absorbed_is_cheaper(call):
    return "absorbed", (f"{call.q_len} queries over {call.kv_len} positions: attending over the shared "
                        "latent does less work than forming K and V per head")
  return "expanded", (f"{call.q_len} queries over {call.kv_len} positions: forming K and V per head "
                      "does less work than attending over the wide latent")


def attention_widths(call: MLACall, form: str) -> tuple[int, int]:
  """``(d_qk, d_v)`` of the attention call that ``form`` makes."""
  if form == "expanded":
    return call.d_nope + call.d_rope, call.d_v
  return call.d_c + call.d_rope, call.d_c


def attention_implementation(call: MLACall, form: str, device: Device,
                             implementation: str | None = None) -> tuple[str | None, str]:
  """The ``implementation`` the form passes to attention, and why: an explicit one as given
  (attention refuses what it cannot compute), else attention's default, whose dispatch sees the
  value width (:func:`probjax.nn.layers.attention.explain_dispatch` says which kernel)."""
  if implementation is not None:
    return implementation, "requested"
  d_qk, d_v = attention_widths(call, form)
  if d_qk != d_v:
    return None, f"attention's default at query/key head_dim {d_qk}, value head_dim {d_v}"
  return None, "attention's default"


KERNELS = ("triton",)
# auto: the decode kernel for at most this many queries per step. Its row tiles hold heads x
# queries and each reads the step's latent, so its time grows with the queries: at 128 heads it
# is ahead of attention's XLA path with one query and behind it with two (docs/dev/decisions.md,
# "MLA: values of their own width and decoding").
DECODE_MAX_QUERIES = 1


def decode_kernel(call: MLACall, form: str, device: Device, implementation: str | None = None, *,
                  mask_kinds: tuple[str, ...] = (), page_size: int | None = None) -> tuple[str | None, str]:
  """MLA's own absorbed-decode kernel for the call (``"triton"``) or None (attention computes
  it), and why. ``implementation="triton"`` with the absorbed form asks for it: ValueError naming
  the argument if it cannot compute the call. By default it runs on an NVIDIA GPU for absorbed
  calls of at most ``DECODE_MAX_QUERIES`` queries it supports (forward only: its gradient is
  the XLA form's). A paged cache that the kernel does not take runs gathered on XLA."""
  from probjax.ops.mla.backends.triton import why_not
  why = why_not(q_len=call.q_len, heads=call.heads, d_c=call.d_c, d_rope=call.d_rope,
                mask_kinds=mask_kinds, page_size=page_size)
  if implementation in KERNELS and form == "absorbed":
    if why:
      raise ValueError(f"implementation={implementation!r}: {why}")
    return implementation, "requested" + ("" if device.platform == "gpu" else " (Pallas interpret mode off the GPU)")
  if implementation is not None:
    return None, "an attention implementation was requested"
  if form != "absorbed" or device.platform != "gpu" or device.compute_capability is None:
    return None, "not an absorbed call on an NVIDIA GPU"
  if call.q_len > DECODE_MAX_QUERIES:
    return None, (f"{call.q_len} queries > {DECODE_MAX_QUERIES}: the kernel is slower than attention's "
                  "XLA path here")
  if why:
    return None, why
  return "triton", (f"absorbed decode of {call.q_len} queries: the latent streamed once per head tile "
                    "by split-KV (forward; the gradient is the XLA form's)")


def decide(call: MLACall, device: Device, form: str = "auto", implementation: str | None = None, *,
           mask_kinds: tuple[str, ...] = (), page_size: int | None = None) -> Decision:
  form, rule = choose_form(call, form)
  kernel, kernel_rule = decode_kernel(call, form, device, implementation, mask_kinds=mask_kinds,
                                      page_size=page_size)
  impl, why = attention_implementation(call, form, device, implementation)
  return Decision(form, rule, impl, why, kernel, kernel_rule)
