"""Sequence mixers: the Mamba-1 selective scan, Mamba-2's SSD and the linear branch of residual
linear attention (RLA).

The op's face is :mod:`probjax.ops.scan.api` (``mamba_scan``, ``ssd_scan``,
``residual_linear_attention``, ``explain_dispatch``, ``available_implementations``,
``feature_map``, ``Decision`` and the call types), whose names this package exports.

>>> import jax.numpy as jnp
>>> from probjax.ops.scan import mamba_scan
>>> x = jnp.ones((2, 10, 8)); B = jnp.ones((2, 10, 4))
>>> mamba_scan(x, x, -jnp.ones((8, 4)), B, B, jnp.ones(8)).shape
(2, 10, 8)
"""

from __future__ import annotations

from probjax.ops.scan.api import (Decision, MambaCall, RLACall, SSDCall, available_implementations,
                                  explain_dispatch, feature_map, mamba_scan, residual_linear_attention,
                                  ssd_scan)

__all__ = ["mamba_scan", "ssd_scan", "residual_linear_attention", "explain_dispatch",
           "available_implementations", "feature_map", "Decision", "MambaCall", "SSDCall", "RLACall"]
