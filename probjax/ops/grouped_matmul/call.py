"""The static description of one grouped matmul, and the validation of its arguments.

``out[i] = lhs[i] @ rhs[g]`` for the rows ``i`` of group ``g``; groups own consecutive rows in
order, group ``g`` the ``group_sizes[g]`` rows after those of groups ``0 .. g-1``. Rows past
``sum(group_sizes)`` belong to no group: their output (and their ``lhs`` gradient) is zero.

Group sizes: concrete values are checked (negative sizes or a sum above ``M`` raise
ValueError). Traced values cannot be checked; they are *clamped*, on every backend alike
(:func:`clamp_group_sizes`): a negative size counts as zero, and the groups that run past row
``M`` are cut at ``M`` (so a group that starts at or after ``M`` is empty).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from probjax.core.values import concrete_values


@dataclasses.dataclass(frozen=True)
class GroupedMatmulCall:
  """Everything but the arrays of ``grouped_matmul(lhs [m, k], rhs, group_sizes [num_groups])``.

  ``rhs`` is ``[num_groups, k, n]``, or ``[num_groups, n, k]`` when ``transpose_rhs`` (the
  product then reads each group's matrix transposed, without a transposed copy). ``dtype``
  is the operands' dtype (both are promoted to it), ``out_dtype`` the result's.
  """

  m: int
  k: int
  n: int
  num_groups: int
  dtype: str
  out_dtype: str
  transpose_rhs: bool = False
  interpret: bool = False

  def __post_init__(self):
    for f in ("m", "k", "n", "num_groups"):
      v = getattr(self, f)
      if not isinstance(v, (int, np.integer)) or v < 0:
        raise ValueError(f"GroupedMatmulCall.{f} must be a non-negative int, got {v!r}")
    for f in ("dtype", "out_dtype"):
      if not jnp.issubdtype(np.dtype(getattr(self, f)), jnp.floating):
        raise TypeError(f"GroupedMatmulCall.{f} must be a floating dtype, got {getattr(self, f)!r}")

  @property
  def rhs_shape(self) -> tuple[int, int, int]:
    g = self.num_groups
    return (g, self.n, self.k) if self.transpose_rhs else (g, self.k, self.n)

  @property
  def empty(self) -> bool:
    """No product to compute: the output (and every gradient) is zeros."""
    return 0 in (self.m, self.k, self.n, self.num_groups)

  def d_lhs_call(self) -> "GroupedMatmulCall":
    """The call computing ``d_lhs [m, k] = grouped_matmul(d_out [m, n], rhs)`` with rhs read
    in the other layout: the same weights, contracted over ``n``."""
    return dataclasses.replace(self, k=self.n, n=self.k, out_dtype=self.dtype,
                               transpose_rhs=not self.transpose_rhs)

  @property
  def flops(self) -> int:
    """Of the forward at full occupancy (every row in a group)."""
    return 2 * self.m * self.k * self.n


def _shape(x) -> tuple[int, ...]:
  return tuple(x.shape) if hasattr(x, "shape") else np.shape(x)


def _dtype(x):
  return np.dtype(x.dtype) if hasattr(x, "dtype") else jnp.result_type(x)


def make_call(lhs, rhs, group_sizes, *, preferred_element_type=None, transpose_rhs: bool = False,
              interpret: bool = False) -> GroupedMatmulCall:
  """Validates the arguments of ``grouped_matmul`` and describes the call.

  Raises TypeError for non-float operands or non-integer group sizes, ValueError (naming the
  argument) for wrong ranks or shapes and, when ``group_sizes`` is concrete, for negative
  sizes or a sum above ``lhs.shape[0]``."""
  for name, x, rank in (("lhs", lhs, 2), ("rhs", rhs, 3), ("group_sizes", group_sizes, 1)):
    if len(_shape(x)) != rank:
      raise ValueError(f"{name} must have rank {rank}, got shape {_shape(x)}")
  for name, x in (("lhs", lhs), ("rhs", rhs)):
    if not jnp.issubdtype(_dtype(x), jnp.floating):
      raise TypeError(f"{name} must be a floating array, got dtype {_dtype(x)}")
  if not jnp.issubdtype(_dtype(group_sizes), jnp.integer):
    raise TypeError(f"group_sizes must be an integer array, got dtype {_dtype(group_sizes)}")
  (m, k), (g, *rest) = _shape(lhs), _shape(rhs)
  rk, n = rest[::-1] if transpose_rhs else rest
  if rk != k:
    layout = "[G, N, K]" if transpose_rhs else "[G, K, N]"
    raise ValueError(f"rhs {layout} = {_shape(rhs)} does not contract with lhs [M, K] = {_shape(lhs)}")
  if _shape(group_sizes) != (g,):
    raise ValueError(f"group_sizes must have shape ({g},) (one size per rhs group), got {_shape(group_sizes)}")
  sizes = concrete_values(group_sizes)
  if sizes is not None:
    sizes = sizes.astype(np.int64)
    if (sizes < 0).any():
      raise ValueError(f"group_sizes must be non-negative, got {sizes[sizes < 0][:4].tolist()} ...")
    if sizes.sum() > m:
      raise ValueError(f"group_sizes sum to {int(sizes.sum())}, more than the {m} rows of lhs")
  dtype = jnp.promote_types(_dtype(lhs), _dtype(rhs))
  out = dtype if preferred_element_type is None else _out_dtype(preferred_element_type)
  return GroupedMatmulCall(int(m), int(k), int(n), int(g), np.dtype(dtype).name, np.dtype(out).name,
                           bool(transpose_rhs), bool(interpret))


def _out_dtype(preferred_element_type):
  try:
    out = np.dtype(preferred_element_type)
  except TypeError:
    out = None
  if out is None or not jnp.issubdtype(out, jnp.floating):
    raise TypeError(f"preferred_element_type must be a floating dtype (e.g. jnp.float32) or None, "
                    f"got {preferred_element_type!r}")
  return out


def clamp_group_sizes(group_sizes, m: int):
  """``group_sizes`` as int32 with negative sizes counted as zero and the groups cut at row
  ``m`` (see the module docstring); valid sizes pass unchanged."""
  # Each size clipped to [0, m] first, so the running sum cannot overflow int32.
  ends = jnp.minimum(jnp.cumsum(jnp.clip(group_sizes, 0, m).astype(jnp.int32)), m)
  return jnp.diff(ends, prepend=jnp.zeros((1,), jnp.int32))


@dataclasses.dataclass(frozen=True)
class MoECall:
  """The static description of one MoE expert block (the routed experts of
  :class:`~probjax.nn.layers.moe.MoELayer`): what the MoE dispatch
  (:func:`~probjax.ops.grouped_matmul.moe_dispatch.decide_moe`) and the strategies'
  ``supports`` read, and what the strategies compute with.

  ``dtype``: the compute dtype (operands of the grouped matmuls). ``sizes``: the K and N of the
  block's grouped matmuls (``d_model``, the up projection's width, ``d_hidden``: forward and
  backward read the same ones). ``num_experts``, ``top_k``, ``activation`` (one of
  :data:`~probjax.ops.grouped_matmul.activations.ACTIVATIONS`) and ``interpret`` (the Pallas
  kernels in interpret mode) are what the strategies run with; the dispatch rules read
  ``dtype`` and ``sizes`` only.
  """

  dtype: str
  sizes: tuple[int, ...] = ()
  num_experts: int = 1
  top_k: int = 1
  activation: str = "swiglu"
  interpret: bool = False

  def __post_init__(self):
    object.__setattr__(self, "dtype", np.dtype(self.dtype).name)
    object.__setattr__(self, "sizes", tuple(int(s) for s in self.sizes))

  def products(self) -> tuple[GroupedMatmulCall, ...]:
    """One grouped-matmul call per size ``s`` with ``K = N = s`` in the compute dtype (no
    sizes: one call of size zero, so that the dtypes alone are read): what the grouped-matmul
    rules are asked of for the block (they read K, N and the dtypes, not the rows)."""
    return tuple(GroupedMatmulCall(0, s, s, max(1, self.num_experts), self.dtype, self.dtype)
                 for s in self.sizes or (0,))
