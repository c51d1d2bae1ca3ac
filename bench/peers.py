"""The process's peers and device, shared by :mod:`bench.harness` and :mod:`bench.impls`.

Which peer libraries import (:func:`peers_present`: torch only looked up, tokamax and
probjax imported), the lazily imported modules themselves (:func:`probjax_api`,
:func:`torch_mod`, :func:`tokamax_mod`; a missing one raises :class:`Unsupported`, which the
harness records as the row's status), :func:`require_gpu`, and :func:`free_memory` between
shapes. Both modules import this one and neither imports the other at module level
(``impls`` builds :class:`bench.harness.Case` objects; the harness never imports ``impls``).
"""

from __future__ import annotations

import functools
import importlib
import sys

from probjax.core.timing import Unsupported

__all__ = ["Unsupported", "free_memory", "peers_present", "probjax_api", "require_gpu",
           "tokamax_mod", "torch_mod"]


@functools.lru_cache(None)
def probjax_api():
  """(dot_product_attention, module) or raises Unsupported."""
  try:
    from probjax.nn.layers import attention as mod
    return mod.dot_product_attention, mod
  except Exception as e:  # noqa: BLE001
    raise Unsupported(f"probjax.nn.layers.attention not importable: {type(e).__name__}: {e}") from e


@functools.lru_cache(None)
def _peer_module(name: str):
  """The peer package ``name`` or raises Unsupported (the row records why)."""
  try:
    return importlib.import_module(name)
  except Exception as e:  # noqa: BLE001
    raise Unsupported(f"{name} not importable: {type(e).__name__}: {e}") from e


def torch_mod():
  return _peer_module("torch")


def tokamax_mod():
  return _peer_module("tokamax")


def peers_present() -> dict:
  """Which peers are usable. torch is only looked up (not imported: a JAX-side process
  must not load torch's CUDA runtime); tokamax and probjax are imported."""
  import importlib.util
  out = {"torch": True if importlib.util.find_spec("torch") is not None else "torch not installed"}
  for name, f in (("tokamax", tokamax_mod), ("probjax", probjax_api)):
    try:
      f()
      out[name] = True
    except Unsupported as e:
      out[name] = str(e)[:200]
  return out


def require_gpu(what: str) -> None:
  """Raises :class:`Unsupported` ("``what`` needs an NVIDIA GPU") unless JAX runs on a GPU."""
  import jax
  if jax.devices()[0].platform != "gpu":
    raise Unsupported(f"{what} needs an NVIDIA GPU")


def free_memory():
  """Drops cached compilations/buffers between shapes (best effort)."""
  import gc
  gc.collect()
  try:
    if "torch" in sys.modules:
      import torch
      if torch.cuda.is_available():
        torch.cuda.empty_cache()
  except Exception:  # noqa: BLE001
    pass
