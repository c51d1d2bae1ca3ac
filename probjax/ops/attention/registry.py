"""Attention's backends, registered once: the names ``implementation=`` takes, what each
runs on, whether it computes a call exactly, the call itself, and the backward passes each
offers to other backends' forwards.

Each backend is a subclass of :class:`probjax.ops.attention.backend.AttentionBackend` in its
folder's ``backend.py``, registered by one line below; its module is imported only when the
backend is first asked for, so a CPU-only call never loads the Pallas kernels.

A fused forward saves the output and the natural log-sum-exp, so any backend's forward pairs
with any backend's backward (:mod:`probjax.ops.attention.vjp`): a backend that offers its
backward to others names the ``backward_pass_impl`` variants it computes
(``AttentionBackend.backward_variants``) and builds the pass
(``AttentionBackend.backward_kernel``); :func:`backward_kernel` finds it by variant, so a
forward asks for a backward by name and never imports the backend that computes it.
"""

from __future__ import annotations

from typing import Callable

from probjax.core.backend import Registry
from probjax.core.device import Device
from probjax.ops.attention.call import AttentionCall

REGISTRY: Registry[AttentionCall] = Registry("attention")

# One line per backend: its name, aliases and class (imported when first asked for).
REGISTRY.add("xla", "probjax.ops.attention.backends.xla.backend:Xla")
REGISTRY.add("triton", "probjax.ops.attention.backends.triton.backend:Triton", aliases=("pallas",))
REGISTRY.add("cudnn", "probjax.ops.attention.backends.cudnn.backend:Cudnn")
REGISTRY.add("mosaic", "probjax.ops.attention.backends.mosaic_gpu.backend:Mosaic")


def backward_kernel(variant: str, q, k, v, *, scale: float, score_mod: Callable | None = None, config=None,
                    interpret: bool = False):
  """The backward pass ``variant`` (a ``backward_pass_impl`` name) names, from the backend that
  offers it, for another backend's forward on these operands."""
  for name in REGISTRY.names():
    backend = REGISTRY.get(name)
    if variant in backend.backward_variants:
      return backend.backward_kernel(q, k, v, variant=variant, scale=scale, score_mod=score_mod, config=config,
                                     interpret=interpret)
  offered = [v for n in REGISTRY.names() for v in REGISTRY.get(n).backward_variants]
  raise ValueError(f"backward_pass_impl={variant!r} is not a backward another forward can pair with; "
                   f"expected one of {offered}")


def available(device: Device) -> list[str]:
  """Implementation names that can run on ``device``."""
  return REGISTRY.available(device)
