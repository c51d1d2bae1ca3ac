"""How probjax's FFI call builds cuDNN's attention graph (:class:`CudnnConfig`)."""

from __future__ import annotations

import dataclasses

SDPA_LOWERINGS = ("auto", "composite", "unified")


@dataclasses.dataclass(frozen=True)
class CudnnConfig:
  """Options of the FFI call of cuDNN (``implementation="cudnn"``, ``forward_config=``).

  Attributes:
    sdpa: cudnn-frontend's lowering of the SDPA node: "auto" (its choice), "composite"
      (a graph of matmuls, masks and softmax) or "unified" (cuDNN's own SDPA operation).
    autotune: time every plan cuDNN's heuristics offer on the graph's first call (that call
      synchronizes the device) and keep the fastest; False: the heuristics' first plan.
  """

  sdpa: str = "auto"
  autotune: bool = False

  def __post_init__(self):
    if self.sdpa not in SDPA_LOWERINGS:
      raise ValueError(f"CudnnConfig.sdpa must be one of {SDPA_LOWERINGS}, got {self.sdpa!r}")
    if not isinstance(self.autotune, bool):
      raise TypeError(f"CudnnConfig.autotune must be a bool, got {type(self.autotune).__name__}")

  def attributes(self) -> dict:
    """The custom calls' attributes for these options."""
    return dict(sdpa=SDPA_LOWERINGS.index(self.sdpa), autotune=self.autotune)
