"""One attention call as dispatch and every backend's ``supports`` see it."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax.numpy as jnp

from probjax.ops.attention.masks import Mask

# The mask predicate kinds the fused kernels (Triton, Mosaic GPU) compute; a call with another
# predicate (PrefixLMMask) is theirs to refuse and runs on the XLA path.
KERNEL_MASK_KINDS = ("band", "q_lengths", "kv_lengths", "segments")
# The Triton kernel also evaluates a mask_mod in its body (:meth:`Mask.tile_function`), where
# Pallas Triton lowers the function (``backends/triton``'s ``supports`` checks it).
TRITON_MASK_KINDS = KERNEL_MASK_KINDS + ("mask_mod",)


@dataclasses.dataclass(frozen=True)
class AttentionCall:
  """The static description of a call: everything but the arrays.

  Attributes:
    q_shape: ``(batch, q_len, heads, head_dim)``; kv_shape: ``(batch, kv_len, kv_heads, head_dim)``
      (the keys' shape).
    v_head_dim: the values' head_dim where it differs from ``head_dim`` (None: the same); the
      output is ``[batch, q_len, heads, v_head_dim]``.
    dtype: the inputs' dtype.
    mask: the position :class:`Mask`, or None.
    score_mod: ``f(score, b, h, q_idx, kv_idx) -> score``, or None.
    scale: the softmax scale (None: ``head_dim ** -0.5``).
    bias, dense_mask, dropout, module: whether the call has an additive bias, a dense boolean
      mask, dropout, or asks for the attention weights (only the XLA path takes those).
    precision: the matmul precision (non-default: XLA path only).
    backward_pass_impl: the kernels' backward ("auto" lets the backend or the device table choose).
    split_kv: the Triton split-KV forward request (None: automatic).
    forward_config, backward_config: explicit kernel configs.
    interpret: Pallas interpret mode.
    page_size: the page length of a paged KV cache (None: contiguous K/V). ``kv_shape`` is then
      the contiguous shape the pages stand for, ``(batch, pages_per_seq * page_size, kv_heads,
      head_dim)`` (:mod:`probjax.ops.attention.paged`); a backend that cannot read pages refuses.
  """

  q_shape: tuple[int, ...]
  kv_shape: tuple[int, ...]
  dtype: Any
  mask: Mask | None = None
  score_mod: Callable | None = None
  scale: float | None = None
  bias: bool = False
  dense_mask: bool = False
  dropout: bool = False
  module: bool = False
  precision: Any = None
  backward_pass_impl: str = "auto"
  split_kv: Any = None
  forward_config: Any = None
  backward_config: Any = None
  interpret: bool = False
  v_head_dim: int | None = None
  page_size: int | None = None

  def __post_init__(self):
    object.__setattr__(self, "q_shape", tuple(self.q_shape))
    object.__setattr__(self, "kv_shape", tuple(self.kv_shape))
    object.__setattr__(self, "dtype", jnp.dtype(self.dtype))
    if self.v_head_dim is not None and int(self.v_head_dim) == self.q_shape[3]:
      object.__setattr__(self, "v_head_dim", None)  # one spelling of "values as wide as keys"

  @property
  def batch(self) -> int:
    return self.q_shape[0]

  @property
  def q_len(self) -> int:
    return self.q_shape[1]

  @property
  def kv_len(self) -> int:
    return self.kv_shape[1]

  @property
  def heads(self) -> int:
    return self.q_shape[2]

  @property
  def kv_heads(self) -> int:
    return self.kv_shape[2]

  @property
  def head_dim(self) -> int:
    return self.q_shape[3]

  @property
  def value_head_dim(self) -> int:
    return self.head_dim if self.v_head_dim is None else int(self.v_head_dim)

  @property
  def work(self) -> int:
    """``batch * heads * q_len * kv_len``: the score count the dispatch thresholds compare."""
    return self.batch * self.heads * self.q_len * self.kv_len

  @property
  def kernel_args_default(self) -> bool:
    """Whether every kernel argument is at its default (then the device table applies)."""
    return (self.backward_pass_impl == "auto" and self.forward_config is None
            and self.backward_config is None and self.split_kv is None)

  def not_paged(self, backend: str) -> str | None:
    """The reason a backend that reads contiguous K/V only gives for a paged call, or None."""
    if self.page_size is None:
      return None
    return (f"a paged KV cache (page_table): {backend} reads contiguous K/V; the Triton split-KV decode "
            "kernel reads pages, and implementation='xla' gathers them")

  def not_for_kernels(self, mask_kinds: tuple[str, ...] = KERNEL_MASK_KINDS) -> str | None:
    """The first argument no fused kernel takes, or None; ``mask_kinds``: the mask predicate
    kinds the asking kernel computes (default: those every fused kernel does)."""
    for present, what in ((self.bias, "additive bias"), (self.dense_mask, "dense boolean mask"),
                          (self.dropout, "dropout"), (self.precision is not None, "non-default precision"),
                          (self.module, "attention weights requested (module)")):
      if present:
        return what
    return None if self.mask is None else self.mask.refusal(mask_kinds, "the fused kernels")
