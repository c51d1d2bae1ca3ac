"""``probjax.ops.norm``: fused residual add + RMS/layer norm and DiT's adaLN modulation."""

from probjax.ops.norm.api import (NormCall, adaln_modulate, available_implementations, explain_dispatch, layer_norm,
                                  rms_norm)

__all__ = ["rms_norm", "layer_norm", "adaln_modulate", "explain_dispatch", "available_implementations", "NormCall"]
