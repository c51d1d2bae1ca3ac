"""The description of one ``linear_cross_entropy`` call: everything but the arrays."""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp

from probjax.core.values import is_traced

LAYOUTS = ("d_vocab", "vocab_d")
REDUCTIONS = ("mean", "sum", "none")


@dataclasses.dataclass(frozen=True)
class LinearCrossEntropyCall:
  """One call: ``tokens`` hidden states of width ``d`` against a ``vocab``-wide head.

  Attributes:
    tokens: the number of positions (the product of the hidden states' leading axes).
    d, vocab: the hidden width and the vocabulary size.
    dtype: the hidden states' dtype (the head's is promoted with it).
    w_layout: ``"d_vocab"`` (``w [d, vocab]``, a Linear's kernel) or ``"vocab_d"`` (``w [vocab,
      d]``, a tied embedding table).
    bias: whether a ``[vocab]`` bias is added to the logits.
    ignore_index: the label that contributes nothing (None: every label counts).
    z_loss: the weight of ``logsumexp(logits) ** 2`` per token.
    label_smoothing: ``eps`` of ``(1 - eps) * nll + eps * mean_j(-log p_j)``.
    reduction: ``"mean"`` (over counted tokens), ``"sum"`` or ``"none"`` (per token).
    chunk_tokens, chunk_vocab: the tiles the logits are computed in (None: the backend's).
    interpret: run Pallas kernels in interpret mode (any platform; the kernels' CPU tests).
  """

  tokens: int
  d: int
  vocab: int
  dtype: object
  w_layout: str = "d_vocab"
  bias: bool = False
  ignore_index: int | None = -100
  z_loss: float = 0.0
  label_smoothing: float = 0.0
  reduction: str = "mean"
  chunk_tokens: int | None = None
  chunk_vocab: int | None = None
  interpret: bool = False

  @classmethod
  def of(cls, x, w, labels, *, bias=None, w_layout: str = "d_vocab", ignore_index: int | None = -100,
         z_loss: float = 0.0, label_smoothing: float = 0.0, reduction: str = "mean",
         chunk_tokens: int | None = None, chunk_vocab: int | None = None,
         interpret: bool = False) -> "LinearCrossEntropyCall":
    """The call of these arrays (or ``jax.ShapeDtypeStruct``), after checking them: ValueError
    or TypeError naming the argument and the expected form."""
    if not hasattr(x, "shape") or len(x.shape) < 1:
      raise ValueError(f"x must be hidden states [..., d], got {getattr(x, 'shape', type(x).__name__)}")
    if not jnp.issubdtype(x.dtype, jnp.floating):
      raise TypeError(f"x must be floating point, got {x.dtype}")
    if w_layout not in LAYOUTS:
      raise ValueError(f"w_layout must be one of {LAYOUTS}, got {w_layout!r}")
    if not hasattr(w, "shape") or len(w.shape) != 2:
      raise ValueError(f"w must be a 2-D head ({'[d, vocab]' if w_layout == 'd_vocab' else '[vocab, d]'}), "
                       f"got {getattr(w, 'shape', type(w).__name__)}")
    if not jnp.issubdtype(w.dtype, jnp.floating):
      raise TypeError(f"w must be floating point, got {w.dtype}")
    d = x.shape[-1]
    wd, vocab = w.shape if w_layout == "d_vocab" else w.shape[::-1]
    if wd != d:
      raise ValueError(f"w {tuple(w.shape)} ({w_layout}) does not match x's width {d}")
    if not hasattr(labels, "shape") or tuple(labels.shape) != tuple(x.shape[:-1]):
      raise ValueError(f"labels must have x's leading shape {tuple(x.shape[:-1])}, got "
                       f"{getattr(labels, 'shape', type(labels).__name__)}")
    if not jnp.issubdtype(labels.dtype, jnp.integer):
      raise TypeError(f"labels must be integers, got {labels.dtype}")
    if bias is not None and (not hasattr(bias, "shape") or tuple(bias.shape) != (vocab,)):
      raise ValueError(f"bias must be [vocab] = ({vocab},), got {getattr(bias, 'shape', type(bias).__name__)}")
    if reduction not in REDUCTIONS:
      raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    for name, v in (("z_loss", z_loss), ("label_smoothing", label_smoothing)):
      if is_traced(v) or not isinstance(v, (int, float)) or isinstance(v, bool):
        raise TypeError(f"{name} must be a Python float, got {type(v).__name__}")
    if not 0.0 <= label_smoothing <= 1.0:
      raise ValueError(f"label_smoothing must lie in [0, 1], got {label_smoothing}")
    if z_loss < 0:
      raise ValueError(f"z_loss must be >= 0, got {z_loss}")
    for name, v in (("chunk_tokens", chunk_tokens), ("chunk_vocab", chunk_vocab)):
      if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
        raise ValueError(f"{name} must be a positive int or None, got {v!r}")
    if ignore_index is not None and (not isinstance(ignore_index, int) or isinstance(ignore_index, bool)):
      raise TypeError(f"ignore_index must be an int or None, got {type(ignore_index).__name__}")
    if not isinstance(interpret, bool):
      raise TypeError(f"interpret must be a bool, got {type(interpret).__name__}")
    return cls(math.prod(x.shape[:-1]), int(d), int(vocab), jnp.dtype(x.dtype), w_layout, bias is not None,
               ignore_index, float(z_loss), float(label_smoothing), reduction, chunk_tokens, chunk_vocab, interpret)
