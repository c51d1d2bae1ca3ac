"""The one module of the library that imports JAX internals (``jax._src``).

Each name below is an internal that no public JAX API exposes (JAX 0.11.2 and 0.12), with why the
library needs it. When JAX moves one, this is the only file to change; the rest of the
library imports these names from here (``tests/test_import_rules.py`` holds the rule).
The patches that register rules on JAX's primitives are :mod:`probjax.core.jax_patches`.
"""

from __future__ import annotations

# add_jaxvals_p: score_mod's pullback writes cotangent sums (add_any) as add, which Pallas Mosaic
# GPU has no lowering for; Zero: the symbolic zero tangent linear_call's jvp rule receives.
from jax._src import ad_util  # noqa: F401
# jaxpr_as_fun: linear_call's callee and transpose, stored as jaxprs, called as functions.
from jax._src import core  # noqa: F401
# ordered_effects: linear_call's abstract eval reports its callee's ordered effects.
from jax._src import effects  # noqa: F401
# jit_p: score_mod's pullback inlines nested jit calls before a kernel lowers it.
from jax._src import pjit  # noqa: F401
# The primitive of jax.custom_derivatives.linear_call, which the patches give rules.
from jax._src.custom_derivatives import linear_call_p  # noqa: F401
# primitive_jvps: where linear_call's jvp rule is registered.
from jax._src.interpreters import ad  # noqa: F401
# fancy_primitive_batchers, bdim_at_front: linear_call's batching rule.
from jax._src.interpreters import batching  # noqa: F401
# ir.RankedTensorType: the types a Shardy rule callback of custom_partitioning receives.
from jax._src.lib.mlir import ir  # noqa: F401


def triton_lowering_rules() -> dict:
  """Pallas Triton's lowering rules by primitive: which operations of a ``score_mod`` a Triton
  kernel can lower (checked before the kernel is traced). Imported on use: it loads Pallas."""
  from jax._src.pallas.triton import lowering
  return lowering.triton_lowering_rules


def mosaic_gpu_lowering_rules() -> dict:
  """Pallas Mosaic GPU's lowering rules by primitive, for warpgroup semantics (the attention
  kernels'): which operations of a ``score_mod`` a Mosaic kernel can lower. Imported on use."""
  from jax._src.pallas.mosaic_gpu import core as mgpu_core
  from jax._src.pallas.mosaic_gpu import lowering as mgpu_lowering
  return mgpu_lowering.mosaic_lowering_rules[mgpu_core.WGxWG_SEMANTICS]
