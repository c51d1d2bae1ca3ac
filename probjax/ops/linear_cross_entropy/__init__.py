"""``linear_cross_entropy``: the cross-entropy of a linear head without its logits (the face,
:mod:`probjax.ops.linear_cross_entropy.api`, whose names this package exports)."""

from __future__ import annotations

from probjax.ops.linear_cross_entropy.api import (REGISTRY, Decision, LinearCrossEntropyCall,
                                                  available_implementations, explain_dispatch,
                                                  linear_cross_entropy)

__all__ = ["linear_cross_entropy", "explain_dispatch", "available_implementations", "LinearCrossEntropyCall",
           "Decision", "REGISTRY"]
