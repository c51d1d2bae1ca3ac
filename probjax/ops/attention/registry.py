"""Attention's backends, registered once: the names ``implementation=`` takes, what each
runs on, whether it computes a call exactly, the call itself, and the backward passes each
offers to other backends' forwards.

Each backend module keeps its own ``supports`` and ``attention``; the classes here adapt
them to :class:`AttentionBackend` over one :class:`AttentionCall`. The Pallas
backends are imported only when asked for, so CPU-only installs never load them.

A fused forward saves the output and the natural log-sum-exp, so any backend's forward pairs
with any backend's backward (:mod:`probjax.ops.attention.vjp`): a backend that offers its
backward to others names the ``backward_pass_impl`` variants it computes
(:attr:`AttentionBackend.backward_variants`) and builds the pass
(:meth:`AttentionBackend.backward_kernel`); :func:`backward_kernel` finds it by variant, so a
forward asks for a backward by name and never imports the backend that computes it.
"""

from __future__ import annotations

from typing import Callable, ClassVar

from probjax.core.backend import Backend, Registry
from probjax.core.device import Device
from probjax.ops.attention.base import check_kernel_call
from probjax.ops.attention.call import AttentionCall



class AttentionBackend(Backend[AttentionCall]):
  """An attention backend: :class:`probjax.core.backend.Backend` over :class:`AttentionCall`,
  plus the backward passes it offers to other backends' forwards."""

  backward_variants: ClassVar[tuple[str, ...]] = ()

  def backward_kernel(self, q, k, v, *, variant: str, scale: float, score_mod: Callable | None,
                      config, interpret: bool):
    """The :class:`probjax.ops.attention.vjp.Kernel` of the backward ``variant`` (one of
    :attr:`backward_variants`) for these operands."""
    raise NotImplementedError(f"{self.name} offers no backward pass to other backends")


REGISTRY: Registry[AttentionCall] = Registry("attention")


def _flags(call: AttentionCall) -> dict:
  return dict(mask=call.mask, score_mod=call.score_mod, bias=call.bias, dense_mask=call.dense_mask,
              dropout=call.dropout, v_head_dim=call.v_head_dim)


class Xla(AttentionBackend):
  """The exact XLA formulation (every platform, every argument)."""

  name = "xla"

  def supports(self, call, device):
    return None

  def __call__(self, q, k, v, mask, *, call, formulation="auto", **xla_args):
    from probjax.ops.attention.backends import xla
    return xla.attention(q, k, v, formulation=formulation, mask=mask, score_mod=call.score_mod,
                         scale=call.scale, precision=call.precision, **xla_args)


class Triton(AttentionBackend):
  """The fused Pallas-Triton kernels (NVIDIA GPUs; anywhere in interpret mode)."""

  name = "triton"
  aliases = ("pallas",)
  backward_variants = ("auto", "triton_onepass", "triton_fused", "triton_split")

  def available(self, device):
    if device.platform != "gpu":
      return f"the Triton kernel needs an NVIDIA GPU (platform is {device.platform}); use interpret=True to run it on CPU"
    return None

  def supports(self, call, device):
    from probjax.ops.attention.backends import triton
    return (self.available(device) or call.not_for_kernels()
            or triton.supports(call.q_shape, call.kv_shape, call.dtype, interpret=True, **_flags(call)))

  def __call__(self, q, k, v, mask, *, call, backward_pass_impl=None):
    from probjax.ops.attention.backends import triton
    return triton.attention(q, k, v, mask=mask, score_mod=call.score_mod, scale=call.scale,
                            backward_pass_impl=backward_pass_impl or call.backward_pass_impl,
                            forward_config=call.forward_config, backward_config=call.backward_config,
                            split_kv=call.split_kv, interpret=call.interpret)

  def backward_kernel(self, q, k, v, *, variant, scale, score_mod, config, interpret):
    from probjax.ops.attention.backends import triton
    return triton.backward_kernel(q, k, v, scale=scale, score_mod=score_mod, variant=variant, config=config,
                                  interpret=interpret)


class Mosaic(AttentionBackend):
  """The Pallas Mosaic GPU kernels (sm_90; anywhere in interpret mode)."""

  name = "mosaic"

  def available(self, device):
    if device.platform != "gpu":
      return f"the Mosaic GPU kernel needs an sm_90 GPU (platform is {device.platform}); use interpret=True to run it on CPU"
    if device.compute_capability not in (None, (9, 0)):
      return "the Mosaic GPU kernel needs an sm_90 (Hopper) GPU, this is " + device.kind
    return None

  def supports(self, call, device):
    why = self.available(device) or call.not_for_kernels()
    if why:
      return why
    from probjax.ops.attention.backends import mosaic_gpu
    # The only backend whose answer depends on the scale (a non-positive one without score_mod).
    return mosaic_gpu.supports(call.q_shape, call.kv_shape, call.dtype, scale=call.scale, interpret=True,
                               **_flags(call))

  def __call__(self, q, k, v, mask, *, call, backward_pass_impl=None):
    from probjax.ops.attention.backends import mosaic_gpu
    return mosaic_gpu.attention(q, k, v, mask=mask, score_mod=call.score_mod, scale=call.scale,
                                backward_pass_impl=backward_pass_impl or call.backward_pass_impl,
                                forward_config=call.forward_config, backward_config=call.backward_config,
                                interpret=call.interpret)


class Cudnn(AttentionBackend):
  """cuDNN's fused attention, for the calls it computes exactly (NVIDIA GPUs, 16-bit)."""

  name = "cudnn"

  def available(self, device):
    if device.interpret:
      return "cuDNN has no interpret mode (interpret=True emulates only the Pallas kernels, Triton and Mosaic)"
    if device.platform != "gpu":
      return f"cuDNN needs an NVIDIA GPU (platform is {device.platform})"
    return None

  def supports(self, call, device):
    from probjax.ops.attention.backends import cudnn
    return (self.available(device) or call.not_for_kernels()
            or cudnn.supports(call.q_shape, call.kv_shape, call.dtype, platform="gpu",
                              compute_capability=device.compute_capability, **_flags(call)))

  def __call__(self, q, k, v, mask, *, call, backward_pass_impl=None):
    from probjax.ops.attention.backends import cudnn
    from probjax.ops.attention.backends.cudnn.config import CudnnConfig
    # A caller whose call description did not carry the value width must not reach cuDNN with
    # values it refuses (the Pallas backends check inside their own ``attention``).
    check_kernel_call(self.name, cudnn.supports(q.shape, k.shape, q.dtype, mask=mask, v_head_dim=v.shape[-1],
                                                platform="gpu"), q, k, v, mask)
    config = call.forward_config if isinstance(call.forward_config, CudnnConfig) else None
    return cudnn.attention(q, k, v, mask=mask, scale=call.scale, config=config)


for _backend in (Xla(), Triton(), Cudnn(), Mosaic()):
  REGISTRY.register(_backend)


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
