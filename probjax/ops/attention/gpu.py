"""What the attention GPU kernels (Triton, Mosaic GPU) share, so neither imports the other: the
device kind a call is configured for, the shared-memory budget, the L2 group the heaviest-first
grids run across, the backward's ``delta``, whether Pallas lowers a ``score_mod`` and whether a
Mosaic GPU kernel call runs per shard.

Backends never import each other (``tests/test_import_rules.py``): what two of them need lives
here or in another module of the op (:mod:`.vjp` runs one backend's forward with another's
backward, which :func:`.registry.backward_kernel` finds by name)."""

from __future__ import annotations

from typing import Callable

import jax.numpy as jnp

from probjax.core import compat
# The device tables are the core's: one description of every device.
from probjax.core.device import (DEFAULT_L2_BYTES, L2_BYTES, SMEM_PER_BLOCK as SMEM_LIMIT,
                                 DEFAULT_SMEM_PER_BLOCK as DEFAULT_SMEM_LIMIT)
from probjax.ops.attention.base import score_mod_unlowerable
from probjax.ops.attention.masks import Mask


def device_kind(device=None) -> str:
  """``"sm_XY"`` of a CUDA device (default: the first device), or ``"cpu"``."""
  import jax  # local: config tables must import without initialising backends
  d = device if device is not None else jax.devices()[0]
  cc = getattr(d, "compute_capability", None)
  if d.platform != "gpu" or cc is None:
    return d.platform
  return "sm_" + str(cc).replace(".", "")


def kernel_device(interpret: bool) -> str:
  """The device kind a kernel call is configured for: ``"interpret"`` in interpret mode (no
  shared-memory limit, a small default L2), else :func:`device_kind`."""
  return "interpret" if interpret else device_kind()


def smem_limit(device: str) -> int | None:
  """Bytes per block for ``device``; None (unbounded) for interpret mode on CPU."""
  if not device.startswith("sm_"):
    return None
  return SMEM_LIMIT.get(device, DEFAULT_SMEM_LIMIT)


def order_group(device: str, bytes_per_pair: int) -> int:
  """(batch, head) pairs whose streamed operands (``bytes_per_pair`` each) fit half of
  ``device``'s L2: at most the group a causal-like grid runs heaviest-first across
  (:func:`probjax.ops.attention.masks.heavy_first_program`, groups of near-equal size): a
  group's K/V then stay in L2 while its heaviest tiles run, and no small last group ends the
  grid on a few heavy programs (the measurements: docs/dev/decisions.md, "Settled by probes")."""
  return max(1, (L2_BYTES.get(device, DEFAULT_L2_BYTES) // 2) // max(1, bytes_per_pair))


def mosaic_partitioned(st) -> bool:
  """Whether a Mosaic GPU kernel call (its forward with either backward; ``st`` has its
  ``score_mod`` and ``interpret``) runs per shard of batch and heads
  (:func:`probjax.ops.attention.sharding.masked_call`): not with a ``score_mod`` (it sees
  global batch and head indices) nor in interpret mode, whose simulated warpgroups can stall
  one another inside the partitioned call (CPU test runs)."""
  return st.score_mod is None and not st.interpret


def output_delta(out, do, mask: Mask | None):
  """The backward's ``delta = rowsum(dO * O)``, ``[batch, heads, q_len]`` float32, zero for the
  queries at or past a mask's ``q_lengths``: their outputs are zeros, but their cotangents may
  hold anything (NaN), and the kernels multiply delta by probabilities of zero there."""
  delta = jnp.einsum("bqhd,bqhd->bhq", out.astype(jnp.float32), do.astype(jnp.float32))
  if mask is None or mask.q_lengths is None:
    return delta
  lengths = jnp.broadcast_to(jnp.asarray(mask.q_lengths, jnp.int32), (out.shape[0],))
  return jnp.where(jnp.arange(out.shape[1]) < lengths[:, None, None], delta, 0.0)


def triton_lowerable(score_mod: Callable | None, *, grad: bool) -> str | None:
  """Why Pallas Triton cannot lower ``score_mod`` on a tile (``[bq, 1]``/``[1, bk]`` indices;
  with ``grad``, its vjp too, for the Triton backward), or None."""
  return score_mod_unlowerable(score_mod, compat.triton_lowering_rules(), "Pallas Triton",
                               ((64, 1), (1, 128)), grad=grad)


def mosaic_gpu_lowerable(score_mod: Callable | None, *, grad: bool) -> str | None:
  """Why Pallas Mosaic GPU cannot lower ``score_mod`` on a score tile (full index tiles; with
  ``grad``, its vjp too, for the Mosaic backward), or None."""
  return score_mod_unlowerable(score_mod, compat.mosaic_gpu_lowering_rules(), "Pallas Mosaic GPU",
                               ((64, 128), (64, 128)), grad=grad)
