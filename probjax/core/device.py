"""The one description of a device that dispatch, tile fitting and the kernels read.

Dispatch is a pure function of a :class:`Device` (and the call), so tests build fake ones
(``Device("gpu", (9, 0), 140 << 30)`` is an H200) and run every rule on CPU.
"""

from __future__ import annotations

import dataclasses

# Max dynamic shared memory per block (bytes) by device kind.
SMEM_PER_BLOCK = {
    "sm_90": 232448,   # 227 KiB (H100/H200)
    "sm_100": 232448,
    "sm_80": 166912,   # 163 KiB (A100)
    "sm_86": 101376,   # 99 KiB (RTX 30)
    "sm_89": 101376,   # 99 KiB (RTX 40, L4/L40)
    "sm_120": 101376,
}
DEFAULT_SMEM_PER_BLOCK = 101376  # unknown GPUs: assume the small-SMEM class
# L2 bytes (vendor data sheets: H100/H200 50 MB, A100 40 MB, RTX 3090 6 MB, L4 48 MB); unknown
# devices assume the smallest.
L2_BYTES = {"sm_90": 50 << 20, "sm_80": 40 << 20, "sm_86": 6 << 20, "sm_89": 48 << 20}
DEFAULT_L2_BYTES = 6 << 20
# Streaming multiprocessors, where the device does not report them (fake devices, interpret mode).
SM_COUNT = {"sm_90": 132, "sm_80": 108, "sm_86": 82, "sm_89": 128}
DEFAULT_SM_COUNT = 132


@dataclasses.dataclass(frozen=True)
class Device:
  """A device as dispatch and the kernels see it.

  Attributes:
    platform: ``"gpu"``, ``"cpu"`` or ``"tpu"``.
    compute_capability: ``(major, minor)`` of an NVIDIA GPU, else None.
    memory_bytes: device memory, where known.
    interpret: Pallas interpret mode, which emulates the Pallas kernels on any platform.
    sm_count: streaming multiprocessors (default: the table for the kind).
  """

  platform: str
  compute_capability: tuple[int, int] | None = None
  memory_bytes: int | None = None
  interpret: bool = False
  sm_count: int | None = None

  @classmethod
  def current(cls) -> "Device":
    """The first device JAX sees."""
    import jax  # local: the tables above import without initialising a backend
    d = jax.devices()[0]
    cc = getattr(d, "compute_capability", None)
    cc = tuple(int(x) for x in str(cc).split(".")) if cc else None
    mem = None
    try:
      mem = (d.memory_stats() or {}).get("bytes_limit")
    except Exception:  # noqa: BLE001 (memory_stats is optional per backend)
      pass
    return cls(d.platform, cc, mem, sm_count=getattr(d, "core_count", None) if d.platform == "gpu" else None)

  @classmethod
  def interpreter(cls) -> "Device":
    """The device a Pallas kernel sees in interpret mode: a GPU of no particular kind."""
    return cls("gpu", None, None, interpret=True)

  @property
  def kind(self) -> str:
    """``"sm_90"`` etc. for a GPU, ``"interpret"`` in interpret mode, else the platform."""
    if self.interpret:
      return "interpret"
    if self.platform == "gpu" and self.compute_capability is not None:
      return "sm_%d%d" % self.compute_capability
    return self.platform

  @property
  def smem_per_block(self) -> int | None:
    """Shared-memory bytes a kernel block may use; None (unbounded) off a real GPU."""
    if not self.kind.startswith("sm_"):
      return None
    return SMEM_PER_BLOCK.get(self.kind, DEFAULT_SMEM_PER_BLOCK)

  @property
  def l2_bytes(self) -> int:
    return L2_BYTES.get(self.kind, DEFAULT_L2_BYTES)

  @property
  def num_sms(self) -> int:
    return self.sm_count or SM_COUNT.get(self.kind, DEFAULT_SM_COUNT)
