"""The XLA backend's registry object (the formulation itself: :mod:`.flash`, :mod:`.dense`)."""

from __future__ import annotations

from probjax.ops.attention.backend import AttentionBackend


class Xla(AttentionBackend):
  """The exact XLA formulation (every platform, every argument)."""

  name = "xla"

  def supports(self, call, device):
    return None

  def __call__(self, q, k, v, mask, *, call, formulation="auto", **xla_args):
    from probjax.ops.attention.backends import xla
    return xla.attention(q, k, v, formulation=formulation, mask=mask, score_mod=call.score_mod,
                         scale=call.scale, precision=call.precision, **xla_args)
