"""The exact XLA formulation (every platform, every mask, bias and dropout).

Dense for sequences of at most 256 (``DENSE_MAX_LEN``) and for decoding (at most
``DENSE_MAX_QUERIES`` queries, whose scores grow only linearly with the keys, while they
stay under ``DENSE_MAX_SCORES``); otherwise a single-tile flash ``custom_jvp`` up to 512
and 256 x 256 tiles with block-mask tile skipping above. The flash backward recomputes
from the log-sum-exp, so memory is linear in the sequence length. Both compute in float32
(float64 for float64 inputs), take derivatives of any order, give zeros (and zero
gradients) for rows with no valid key, and ignore whatever lies past the mask's lengths.
"""

from probjax.ops.attention.backends.xla.dense import dense_attention
from probjax.ops.attention.backends.xla.flash import choose_blocks, flash_attention

DENSE_MAX_LEN = 256
# Decoding: with this rule the CPU default matches jax.nn XLA's dense product
# (kernel_attn_ext_cpu.json, B1 H32, fp32, 1 and 16 queries); the flash loop over key tiles
# it replaces was slower there (a run before the change, not committed) and, in an ad hoc
# fwd+bwd check, was faster from 64 queries on.
DENSE_MAX_QUERIES = 16
DENSE_MAX_SCORES = 1 << 26  # batch * heads * q_len * kv_len (256 MB of float32 scores)


def choose_formulation(q_shape, kv_shape, *, module: bool = False) -> str:
  """``"dense"`` or ``"flash"`` for ``formulation="auto"``."""
  b, tq, h, _ = q_shape
  tk = kv_shape[1]
  if module or max(tq, tk) <= DENSE_MAX_LEN:
    return "dense"
  if tq <= DENSE_MAX_QUERIES and b * h * tq * tk <= DENSE_MAX_SCORES:
    return "dense"
  return "flash"


def attention(q, k, v, *, formulation: str = "auto", module=None, **kw):
  """Dispatches within the XLA path; see :func:`flash_attention` for the arguments.

  ``formulation``: ``"auto"`` (by length), ``"dense"`` or ``"flash"``.
  """
  if formulation not in ("auto", "dense", "flash"):
    raise ValueError(f"formulation must be 'auto', 'dense' or 'flash', got {formulation!r}")
  if formulation == "auto":
    formulation = choose_formulation(q.shape, k.shape, module=module is not None)
  if formulation == "dense":
    kw.pop("block_q", None), kw.pop("block_k", None)  # one tile: block sizes do not apply
    return dense_attention(q, k, v, module=module, **kw)
  return flash_attention(q, k, v, **kw)


__all__ = ["attention", "dense_attention", "flash_attention", "choose_blocks", "choose_formulation",
           "DENSE_MAX_LEN", "DENSE_MAX_QUERIES", "DENSE_MAX_SCORES"]
