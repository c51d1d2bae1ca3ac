"""The exact XLA formulation (every platform, every mask, bias and dropout).

Two formulations compute every call: ``dense`` (one array of scores per call) and ``flash``
(256 x 256 tiles with block-mask tile skipping; a single tile up to 512). The flash backward
recomputes from the log-sum-exp, so its memory is linear in the sequence length. Both compute
in float32 (float64 for float64 inputs), take derivatives of any order, give zeros (and zero
gradients) for rows with no valid key, and ignore whatever lies past the mask's lengths.
``formulation="auto"`` picks by :func:`choose_formulation`.
"""

from probjax.ops.attention.backends.xla.dense import dense_attention
from probjax.ops.attention.backends.xla.flash import choose_blocks, flash_attention

# Fitted on CPU over calls drawn at random, validated on a sample drawn after the fit
# (bench/cpu_formulations.py; the record: bench/tuning/cpu_formulations/).
DENSE_MAX_SCORES = 1 << 23        # batch * heads * q_len * kv_len
BAND_DENSE_MAX_SCORES = 1 << 22   # the same, under a band (causal or window) mask
TILED_DENSE_MAX_SCORES = 1 << 22  # the same, where flash's tiles cover the lengths ...
TILED_MAX_PADDING = 1.1           # ... padding the scores by at most this factor


def flash_padding(q_len: int, kv_len: int) -> float:
  """The flash loop's scores over the call's: both lengths rounded up to :func:`choose_blocks`'
  tiles. 1.0 at T512 (one tile) or T1024 (four 256-tiles); 1.93 at T553 (three 256-tiles a
  side, 768 x 768 computed for 553 x 553)."""
  bq, bk = choose_blocks(q_len, kv_len)
  return (-(-q_len // bq) * bq) * (-(-kv_len // bk) * bk) / (q_len * kv_len)


def choose_formulation(q_shape, kv_shape, *, module: bool = False, band: bool = False) -> str:
  """``"dense"`` or ``"flash"`` for ``formulation="auto"``: dense while the call's scores
  (``B·H·Tq·Tkv``) are at most ``DENSE_MAX_SCORES``, or ``BAND_DENSE_MAX_SCORES`` with a band
  mask (``band``: causal or a window), or ``TILED_DENSE_MAX_SCORES`` where flash's tiles pad
  the scores by at most ``TILED_MAX_PADDING`` (:func:`flash_padding`); dense always for
  ``module`` (the weights are sown).

  Dense does one matmul pair over the whole score array, flash a loop of tiles: while the
  scores are few the loop's per-tile cost dominates, so B5 H1 T1603/23 D128 (184k scores) runs
  dense about twice as fast on CPU. Past a few million scores the arrays leave the caches and
  flash wins, the sooner the less its tiles pad: B1 H8 T1024 (8M scores, no padding) runs flash
  about 2.5x faster forward, while B4 H2 T776 (4.8M scores, 256-tiles padding them by 1.8x)
  runs dense 1.5x faster. A band lets flash skip the tiles past the diagonal, so it wins
  earlier there: B1 H4 T1996 causal (16M scores) runs flash 4x faster, while B1 H1 T519 causal
  (269k) still runs dense 3x faster."""
  b, tq, h, _ = q_shape
  tk = kv_shape[1]
  if module:
    return "dense"
  scores = b * h * tq * tk
  if scores > TILED_DENSE_MAX_SCORES and flash_padding(tq, tk) <= TILED_MAX_PADDING:
    return "flash"
  return "flash" if scores > (BAND_DENSE_MAX_SCORES if band else DENSE_MAX_SCORES) else "dense"


def attention(q, k, v, *, formulation: str = "auto", module=None, **kw):
  """Dispatches within the XLA path; see :func:`flash_attention` for the arguments.

  ``formulation``: ``"auto"`` (:func:`choose_formulation`), ``"dense"`` or ``"flash"``.
  """
  if formulation not in ("auto", "dense", "flash"):
    raise ValueError(f"formulation must be 'auto', 'dense' or 'flash', got {formulation!r}")
  if formulation == "auto":
    mask = kw.get("mask")
    formulation = choose_formulation(q.shape, k.shape, module=module is not None,
                                     band=mask is not None and mask.has_band)
  if formulation == "dense":
    kw.pop("block_q", None), kw.pop("block_k", None)  # one tile: block sizes do not apply
    return dense_attention(q, k, v, module=module, **kw)
  return flash_attention(q, k, v, **kw)


__all__ = ["attention", "dense_attention", "flash_attention", "choose_blocks", "choose_formulation",
           "flash_padding", "DENSE_MAX_SCORES", "BAND_DENSE_MAX_SCORES", "TILED_DENSE_MAX_SCORES",
           "TILED_MAX_PADDING"]
