"""The description of one norm call: everything but the arrays."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

KINDS = ("rms", "layer", "none")
AFFINES = ("none", "columns", "rows")


@dataclasses.dataclass(frozen=True)
class NormCall:
  """One call on ``rows`` rows of width ``d``.

  Attributes:
    rows, d: the number of rows (product of the leading axes) and the normalised width.
    dtype: the input's dtype (the output's).
    kind: ``"rms"``, ``"layer"`` or ``"none"`` (:func:`qk_norm_rotary` without its norm).
    residual: whether ``h = x + residual`` is formed (and returned) before the norm.
    affine: ``"columns"``: a ``[d]`` multiplier (and offset), ``"rows"``: one per row (adaLN's
      ``1 + scale`` and ``shift``), ``"none"``.
    offset: whether an additive term (bias or shift) follows the multiplier.
    eps: added to the variance (mean square for RMS).
    interpret: Pallas interpret mode for the kernels.
    rotary: RoPE (rotate-half) applied after the norm (:func:`qk_norm_rotary`; rows are
      ``[batch * seq * heads]`` of ``d = head_dim``).
    rotary_base: RoPE's base.
  """

  rows: int
  d: int
  dtype: object
  kind: str = "rms"
  residual: bool = False
  affine: str = "columns"
  offset: bool = False
  eps: float = 1e-6
  interpret: bool = False
  rotary: bool = False
  rotary_base: float = 10000.0

  def __post_init__(self):
    object.__setattr__(self, "dtype", jnp.dtype(self.dtype))
    if self.kind not in KINDS:
      raise ValueError(f"norm must be one of {KINDS}, got {self.kind!r}")
    if self.affine not in AFFINES:
      raise ValueError(f"affine must be one of {AFFINES}, got {self.affine!r}")
