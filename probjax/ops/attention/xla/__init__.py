"""The exact XLA formulation (every platform, every mask, bias and dropout).

Dense for sequences of at most 256 (``DENSE_MAX_LEN``), a single-tile flash
``custom_jvp`` up to 512 and 256 x 256 tiles with block-mask tile skipping
above; the flash backward recomputes from the log-sum-exp, so memory is linear
in the sequence length.
"""

from probjax.ops.attention.xla.dense import dense_attention
from probjax.ops.attention.xla.flash import choose_blocks, flash_attention

DENSE_MAX_LEN = 256


def attention(q, k, v, *, formulation: str = "auto", module=None, **kw):
  """Dispatches within the XLA path; see :func:`flash_attention` for the arguments.

  ``formulation``: ``"auto"`` (by length), ``"dense"`` or ``"flash"``.
  """
  if formulation not in ("auto", "dense", "flash"):
    raise ValueError(f"formulation must be 'auto', 'dense' or 'flash', got {formulation!r}")
  if formulation == "auto":
    dense = module is not None or max(q.shape[1], k.shape[1]) <= DENSE_MAX_LEN
    formulation = "dense" if dense else "flash"
  if formulation == "dense":
    kw.pop("block_q", None), kw.pop("block_k", None)  # one tile: block sizes do not apply
    return dense_attention(q, k, v, module=module, **kw)
  return flash_attention(q, k, v, **kw)


__all__ = ["attention", "dense_attention", "flash_attention", "choose_blocks", "DENSE_MAX_LEN"]
