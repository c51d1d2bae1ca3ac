"""One backend's forward with another backend's backward, on the residuals every attention
kernel saves (the output and the natural log-sum-exp), so the backends themselves never
import each other (``tests/test_import_rules.py``).

:func:`mosaic_forward_triton_backward`: the Mosaic GPU forward with the Triton backward,
what :func:`probjax.ops.attention.backends.mosaic_gpu.attention` runs for every ``backward_pass_impl``
but ``"mosaic"`` (the Triton backward is faster at head_dim 64: docs/decisions.md).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax

from probjax.ops.attention import gpu, sharding
from probjax.ops.attention.masks import Mask
from probjax.ops.attention.backends.mosaic_gpu import forward as mosaic_forward
from probjax.ops.attention.backends.mosaic_gpu.config import MosaicForwardConfig
from probjax.ops.attention.backends.triton import backward as triton_backward
from probjax.ops.attention.backends.triton import config as triton_config
from probjax.ops.attention.backends.triton.config import BackwardConfig
from probjax.ops.attention.backends.triton.tiles import padded_head_dim

__all__ = ["mosaic_forward_triton_backward", "BackwardConfig"]


def mosaic_forward_triton_backward(q, k, v, mask: Mask | None, *, scale: float,
                                   mosaic_config: MosaicForwardConfig, score_mod: Callable | None = None,
                                   backward_pass_impl: str = "auto",
                                   backward_config: BackwardConfig | None = None, interpret: bool = False):
  """Attention whose forward is the Mosaic GPU kernel (``mosaic_config``, fitted by the
  caller) and whose backward is the Triton kernels' (``backward_pass_impl``: ``"auto"`` or a
  ``"triton_*"`` variant; ``backward_config`` fitted here to the device). Inputs are
  validated by the caller."""
  device = gpu.kernel_device(interpret)
  d, d_v, q_len, kv_len = q.shape[-1], v.shape[-1], q.shape[1], k.shape[1]
  # Values of their own width: the variant rules read the wider width (their tables were tuned
  # with every operand that wide) and the tiles fit both widths' shared memory.
  impl = triton_config.resolve_backward_impl(backward_pass_impl, device, q.dtype, max(d, d_v), q_len, kv_len)
  bcfg = triton_config.fit_backward_config(backward_config, q.dtype, padded_head_dim(d), q_len, kv_len,
                                           device, impl, v_head_dim=padded_head_dim(d_v))
  return _attention(_Static(score_mod, float(scale), mosaic_config, bcfg, impl, bool(interpret)), q, k, v, mask)


@dataclasses.dataclass(frozen=True)
class _Static:
  """Hashable non-array arguments of the composed custom_vjp."""
  score_mod: Callable | None
  scale: float
  fcfg: MosaicForwardConfig
  bcfg: BackwardConfig
  impl: str
  interpret: bool


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attention(st: _Static, q, k, v, mask):
  return _fwd(st, q, k, v, mask)[0]


def _forward_shard(st: _Static, q, k, v, mask):
  return mosaic_forward.forward(q, k, v, mask, scale=st.scale, config=st.fcfg, interpret=st.interpret,
                                score_mod=st.score_mod)


def _backward_shard(st: _Static, q, k, v, out, lse, do, mask):
  return triton_backward.backward(q, k, v, out, lse, do, mask, scale=st.scale, score_mod=st.score_mod,
                                  impl=st.impl, config=st.bcfg, interpret=st.interpret)


_fwd, _bwd = sharding.attention_vjp(_forward_shard, _backward_shard, gpu.mosaic_partitioned)
_attention.defvjp(_fwd, _bwd)
