"""Which MLA backend computes a call, in which form, and what it asks attention for: pure rules
over the call and a :class:`Device`, each with its reason (tested on CPU with fake devices).

The two forms compute the same function (see :mod:`probjax.ops.mla`) and differ in work: the
expanded form forms K and V per head once per cached position and then attends at the narrow
widths ``d_nope + d_rope`` / ``d_v``; the absorbed form never forms them but attends at the latent
widths ``d_c + d_rope`` / ``d_c`` and reads one latent row that all heads share.

The :class:`~probjax.core.dispatch.Decision` names the backend of :data:`~probjax.ops.mla.registry.REGISTRY`
(``"xla"``: the form through attention's face; ``"mosaic"`` / ``"triton"``: the absorbed form with one of
MLA's decode kernels, the first of the device's tuned ``decode_kernels`` that takes the call) with the reason it was chosen, or the other not (``rule``), and carries

* ``("form", "absorbed" | "expanded")`` and ``("form_rule", why that form)``;
* on the ``xla`` backend, ``("attention", Decision(name, why))``: the implementation the form
  passes to attention, ``"default"`` for attention's own dispatch.

An explicit ``implementation`` naming an MLA kernel (``"mosaic"``, ``"triton"``) with the absorbed form asks
for that backend (ValueError with its reason where it cannot compute the call); any other name,
or that one with the expanded form, is passed to attention, which refuses what it cannot compute.
"""

from __future__ import annotations

import os

from probjax.core import tuning
from probjax.core.device import Device
from probjax.core.dispatch import Decision
from probjax.ops.mla.backends.xla import ATTENTION_DEFAULT
from probjax.ops.mla.call import FORMS, MLACall
from probjax.ops.mla.registry import REGISTRY


def absorbed_is_cheaper(call: MLACall, attend_cost: float = 1.0) -> bool:
  """Whether the absorbed form does less arithmetic than the expanded one, its attention's
  multiply-adds weighted by ``attend_cost`` (the time of one against one of the expanded form's).

  Multiply-adds per batch element and head, with ``P = d_c * (d_nope + d_v)``:

  * expanded: ``S * P`` to form K and V, plus ``Tq * S * (d_nope + d_rope + d_v)`` to attend;
  * absorbed: ``Tq * P`` to absorb q_nope and project the output, plus ``Tq * S * (2 d_c + d_rope)``.

  At DeepSeek-V2's widths (d_c 512, d_rope 64, d_nope = d_v = 128; P = 131072) over S = 4096
  positions: one decoded query costs 538M expanded against 4.6M absorbed, so decoding absorbs
  (it also reads 576 shared latent values per position instead of H * 320 expanded ones). With
  Tq = S = 4096 (prefill, training) it is 5.9G expanded against 18.8G absorbed, so it expands.
  At equal cost the forms break even where ``Tq * S * 768 = P * (S - Tq)``: about 170 queries
  over a long cache, fewer over a short one; at ``attend_cost`` 2 about 70.
  """
  s, tq = call.kv_len, call.q_len
  proj = call.d_c * (call.d_nope + call.d_v)
  expanded = s * proj + tq * s * (call.d_nope + call.d_rope + call.d_v)
  absorbed = tq * proj + attend_cost * tq * s * (2 * call.d_c + call.d_rope)
  return absorbed < expanded


def choose_form(call: MLACall, form: str = "auto", attend_cost: float = 1.0) -> tuple[str, str]:
  """``(form, reason)``; ``form`` "auto" picks by :func:`absorbed_is_cheaper` at ``attend_cost``."""
  if form not in FORMS:
    raise ValueError(f"form must be one of {FORMS}, got {form!r}")
  if form != "auto":
    return form, "requested"
  weighted = "" if attend_cost == 1 else (
      f" (the absorbed form's attention, at the latent widths on attention's XLA path, counted "
      f"{attend_cost:g}x per multiply-add)")
  if absorbed_is_cheaper(call, attend_cost):
    return "absorbed", (f"{call.q_len} queries over {call.kv_len} positions: attending over the shared "
                        f"latent does less work than forming K and V per head{weighted}")
  return "expanded", (f"{call.q_len} queries over {call.kv_len} positions: forming K and V per head "
                      f"does less work than attending over the wide latent{weighted}")


def attention_widths(call: MLACall, form: str) -> tuple[int, int]:
  """``(d_qk, d_v)`` of the attention call that ``form`` makes."""
  if form == "expanded":
    return call.d_nope + call.d_rope, call.d_v
  return call.d_c + call.d_rope, call.d_c


def attention_implementation(call: MLACall, form: str, device: Device,
                             implementation: str | None = None) -> tuple[str | None, str]:
  """The ``implementation`` the form passes to attention, and why: an explicit one as given
  (attention refuses what it cannot compute), else attention's default, whose dispatch sees the
  value width (:func:`probjax.ops.attention.explain_dispatch` says which kernel)."""
  if implementation is not None:
    return implementation, "requested"
  d_qk, d_v = attention_widths(call, form)
  if d_qk != d_v:
    return None, f"attention's default at query/key head_dim {d_qk}, value head_dim {d_v}"
  return None, "attention's default"


# The backend that runs a form through attention's face; every other backend is MLA's own kernel
# of the absorbed form.
ATTENTION_ROUTE = "xla"
# Tuned values (``tuning/gpu.json``, ``tuning/sm_90.json``; values only: :mod:`probjax.core.tuning`).
# "decode_kernels": ``(kernel, max_rows)`` pairs, tried in order. A kernel's row tiles hold
# heads x queries of one sequence and each tile reads the step's latent, where the XLA path
# reads it once for all of them. E.g. at 128 heads the Triton kernel is ahead of the XLA path
# with one query (128 rows) and behind it with two (256), so it stops at 128. On sm_90 the
# Triton kernel is ahead of the Mosaic one at 16 heads with 3-4 queries (48-64 rows), and the
# Mosaic kernel (64-row wgmma tiles, TMA) ahead of both from 128 rows to 512 (128 heads x 4
# queries), so sm_90 tries Triton up to 64 rows, then Mosaic up to 512.
# "absorbed_attention_cost": no kernel attends at the absorbed form's latent widths (576/512),
# so where no MLA kernel takes it the absorbed form runs on attention's XLA path, at about
# half the rate per multiply-add of the expanded form's kernels or less: e.g. a chunk of 160
# queries over 11290 positions, even in multiply-adds, runs faster expanded
# (docs/dev/decisions.md, "MLA: values of their own width and decoding").
TUNING = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tuning")


def requested_kernel(implementation) -> str | None:
  """The MLA kernel backend an explicit ``implementation`` names (through the registry, aliases
  resolved), or None: a name MLA passes to attention (``"xla"``, ``"cudnn"``, ...)."""
  try:
    name = REGISTRY.canonical(implementation)
  except (TypeError, ValueError):
    return None
  return None if name in (None, ATTENTION_ROUTE) else name


def decode_kernel(call: MLACall, form: str, device: Device, implementation: str | None = None) -> tuple[str | None, str]:
  """MLA's own absorbed-decode kernel for the call (a registry name) or None (attention computes
  it), and why. ``implementation="triton"`` (or ``"mosaic"``) with the absorbed form asks for it:
  ValueError naming the argument if it cannot compute the call (with the absorbed form not
  chosen, the name is attention's). By default, on an NVIDIA GPU, the first of ``tuning``'s
  ``decode_kernels`` -- ``(kernel, max_rows)`` pairs, fastest first -- that takes the call and
  whose ``max_rows`` holds its heads x queries (forward only: the gradient is the XLA form's). A
  paged cache that no kernel takes runs gathered on XLA.

  Example: with ``[["triton", 64], ["mosaic", 512]]`` on sm_90 a one-query call of 128 heads
  runs the Mosaic kernel and three queries of 16 heads (48 rows) the Triton one; with
  ``[["triton", 128]]`` on an A100 (the Mosaic kernel needs sm_90) one query of 128 heads runs
  the Triton kernel and three (384 rows) the XLA path, where the measured Triton kernel is
  slower than it."""
  kernel = requested_kernel(implementation)
  if kernel is not None and form == "absorbed":
    why = REGISTRY.get(kernel).supports(call, device)
    if why:
      raise ValueError(f"implementation={implementation!r}: {why}")
    return kernel, "requested" + ("" if device.platform == "gpu" else " (Pallas interpret mode off the GPU)")
  if implementation is not None:
    return None, "an attention implementation was requested"
  if form != "absorbed" or device.platform != "gpu" or device.compute_capability is None:
    return None, "not an absorbed call on an NVIDIA GPU"
  kernels = tuning.values(TUNING, device).get("decode_kernels", ())
  refusals = []
  for kernel, max_rows in kernels:
    name = f"{kernel}: " if len(kernels) > 1 else ""
    rows = call.q_len * call.heads
    if rows > max_rows:
      refusals.append(f"{name}{call.q_len} queries x {call.heads} heads = {rows} rows > {max_rows}, the "
                      "kernel's tuned limit (another path was measured faster beyond it)")
      continue
    why = REGISTRY.get(kernel).supports(call, device)
    if why is None:
      return kernel, (f"absorbed decode of {call.q_len} queries: the latent streamed once per head tile "
                      "by split-KV (forward; the gradient is the XLA form's)")
    refusals.append(f"{name}{why}")
  return None, "; ".join(refusals) or "no decode kernel is tuned for this device"


def decide(call: MLACall, device: Device, form: str = "auto", implementation: str | None = None) -> Decision:
  """The backend, form and attention request for ``call`` on ``device`` (see the module
  docstring); raises ValueError for an unknown form or an explicit kernel that cannot compute
  the call."""
  requested_form = form
  form, form_rule = choose_form(call, form)
  kernel, rule = decode_kernel(call, form, device, implementation)
  cost = tuning.values(TUNING, device).get("absorbed_attention_cost", 1.0)
  if requested_form == "auto" and implementation is None and form == "absorbed" and kernel is None and cost != 1:
    # No MLA kernel takes it: the absorbed form attends at 576/512 on attention's XLA path.
    form, form_rule = choose_form(call, attend_cost=cost)
    if form == "expanded":
      kernel, rule = decode_kernel(call, form, device, implementation)
  config = (("form", form), ("form_rule", form_rule))
  if kernel is not None:
    return Decision(kernel, rule, config=config)
  attention, attention_rule = attention_implementation(call, form, device, implementation)
  return Decision(ATTENTION_ROUTE, rule,
                  config=config + (("attention", Decision(attention or ATTENTION_DEFAULT, attention_rule)),))
