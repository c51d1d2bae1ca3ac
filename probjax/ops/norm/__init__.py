"""``probjax.ops.norm``: fused residual add + RMS/layer norm, DiT's adaLN modulation and
attention's fused q/k RMS norm + RoPE."""

from probjax.ops.norm.api import (NormCall, adaln_modulate, available_implementations, explain_dispatch, layer_norm,
                                  qk_norm_rotary, rms_norm)

__all__ = ["rms_norm", "layer_norm", "adaln_modulate", "qk_norm_rotary", "explain_dispatch",
           "available_implementations", "NormCall"]
