"""probjax's own call of cuDNN's fused attention: XLA FFI custom calls (``csrc/sdpa_ffi.cc``).

The same cuDNN kernels as ``jax.nn.dot_product_attention(implementation="cudnn")``,
without what XLA's runtime adds around its fMHA custom calls: it zeroes every output
and the workspace before each launch (3 memsets per forward, 9 per forward+backward;
docs/decisions.md, "Settled by probes": "Why jax.nn's cuDNN route trailed torch's, and
probjax's own FFI call"). The extension is built
by ``python -m probjax.ops.attention.backends.cudnn.build``; without it (or with
``PROBJAX_ATTENTION_CUDNN_FFI=0``) the cuDNN route calls jax.nn.

Inputs: q ``[B, Tq, H, D]``, k/v ``[B, Tkv, Hkv, D]`` (bf16/fp16, ``H % Hkv == 0``),
masks as :func:`probjax.ops.attention.backends.cudnn.supports` allows them. Each custom call is
:func:`probjax.ops.attention.sharding.batch_head_parallel`: under automatic sharding each
device runs it on its shard of the batch and heads, and ``vmap`` folds into the batch.
"""

from __future__ import annotations

import ctypes
import functools
import os
import pathlib

import jax
import jax.numpy as jnp
import numpy as np

from probjax.ops.attention import sharding
from probjax.ops.attention.backends.cudnn import build
from probjax.ops.attention.backends.cudnn.config import CudnnConfig
from probjax.ops.attention.masks import Mask

ENV = "PROBJAX_ATTENTION_CUDNN_FFI"
LIBRARY_ENV = "PROBJAX_CUDNN_FFI_LIBRARY"
_TARGETS = {"probjax_cudnn_sdpa_fwd": "ProbjaxCudnnSdpaForward",
            "probjax_cudnn_sdpa_fwd_stats": "ProbjaxCudnnSdpaForwardStats",
            "probjax_cudnn_sdpa_bwd": "ProbjaxCudnnSdpaBackward"}
# Libraries the extension finds by soname at run time, as the NVIDIA pip packages lay them out.
_RUNTIME_LIBRARIES = (("cudnn", "lib/libcudnn.so.9"), ("cu13", "lib/libcudart.so.13"),
                      ("cuda_runtime", "lib/libcudart.so.13"))
_loaded: dict[str, str | None] = {}


def library_path(env=None) -> pathlib.Path:
  env = os.environ if env is None else env
  return pathlib.Path(env.get(LIBRARY_ENV) or build.LIBRARY)


def unavailable(env=None) -> str | None:
  """None if calls go through the FFI extension, else why they go through jax.nn.

  Checks the opt-out and that the library is built; does not load it."""
  env = os.environ if env is None else env
  if env.get(ENV, "1").strip().lower() in ("0", "false", "off", "no"):
    return f"{ENV}=0"
  path = library_path(env)
  if not path.exists():
    return f"the FFI extension is not built ({path}; python -m probjax.ops.attention.backends.cudnn.build)"
  return _loaded.get(str(path))


def ready(env=None) -> str | None:
  """:func:`unavailable`, after loading the extension and registering its targets (once per
  process): a library that does not load gives its reason here, and calls go through jax.nn."""
  why = unavailable(env)
  path = library_path(env)
  if why is not None or str(path) in _loaded:
    return why
  try:
    for sub, rel in _RUNTIME_LIBRARIES:
      d = build.nvidia_dir(sub)
      if d is not None and (d / rel).exists():
        ctypes.CDLL(str(d / rel), mode=os.RTLD_GLOBAL)  # so that dlopen by soname finds it
    lib = ctypes.CDLL(str(path))
    for target, symbol in _TARGETS.items():
      jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)), platform="CUDA")
  except (OSError, AttributeError) as e:
    _loaded[str(path)] = f"the FFI extension {path} does not load: {e}"
  else:
    _loaded[str(path)] = None
  return _loaded[str(path)]


def _attrs(params) -> dict:
  scale, causal, left_bound, padding, config = params
  attrs = config.attributes()
  return dict(scale=np.float32(scale), causal=causal, left_bound=np.int64(left_bound), padding=padding,
              sdpa=np.int64(attrs["sdpa"]), autotune=attrs["autotune"])


def _operands(q, lens):
  """The sequence-length operands and their roles; without a padding mask the graph reads
  none, and q stands in for both (no buffers or kernels to make them)."""
  if lens is None:
    return (q, q), (sharding.Q, sharding.Q)
  return lens, (sharding.BATCH, sharding.BATCH)


def _forward_call(static, q, k, v, seq_q, seq_kv):
  params, stats = static
  b, tq, h, _ = q.shape
  out = [jax.ShapeDtypeStruct(q.shape, q.dtype)]
  if stats:
    out.append(jax.ShapeDtypeStruct((b, h, tq), jnp.float32))
  target = "probjax_cudnn_sdpa_fwd_stats" if stats else "probjax_cudnn_sdpa_fwd"
  return jax.ffi.ffi_call(target, out)(q, k, v, seq_q, seq_kv, **_attrs(params))


def _backward_call(params, q, k, v, o, do, stats, seq_q, seq_kv):
  return jax.ffi.ffi_call("probjax_cudnn_sdpa_bwd", [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (q, k, v)])(
      q, k, v, o, do, stats, seq_q, seq_kv, **_attrs(params))


def _forward(q, k, v, lens, params, stats: bool):
  seq, seq_roles = _operands(q, lens)
  roles_out = (sharding.Q, sharding.STATS) if stats else (sharding.Q,)
  call = sharding.batch_head_parallel(_forward_call, (params, stats),
                                      (sharding.Q, sharding.KV, sharding.KV, *seq_roles), roles_out)
  return call(q, k, v, *seq)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _sdpa(q, k, v, lens, params):
  return _forward(q, k, v, lens, params, stats=False)[0]


def _sdpa_fwd(q, k, v, lens, params):
  o, stats = _forward(q, k, v, lens, params, stats=True)
  return o, (q, k, v, lens, o, stats)


def _sdpa_bwd(params, res, do):
  q, k, v, lens, o, stats = res
  seq, seq_roles = _operands(q, lens)
  q_, kv_ = sharding.Q, sharding.KV
  call = sharding.batch_head_parallel(_backward_call, params, (q_, kv_, kv_, q_, q_, sharding.STATS, *seq_roles),
                                      (q_, kv_, kv_))
  grads = call(q, k, v, o, do.astype(o.dtype), stats, *seq)
  return (*grads, None if lens is None else (None, None))


_sdpa.defvjp(_sdpa_fwd, _sdpa_bwd)


def attention(q, k, v, *, mask: Mask | None, scale: float, config: CudnnConfig | None = None, env=None):
  """q ``[B, Tq, H, D]``, k/v ``[B, Tkv, Hkv, D]`` → ``[B, Tq, H, D]`` through the extension.

  ``mask``: None, key lengths, ``CausalMask()`` or ``LocalWindowMask(left, 0)`` (equal
  lengths), as :func:`probjax.ops.attention.backends.cudnn.supports` checks; ``config``: graph
  options (default ``CudnnConfig()``). Call :func:`ready` first."""
  b, tq = q.shape[:2]
  causal, left_bound, lens = False, 0, None
  if mask is not None:
    if mask.upper == 0:
      causal = True
      if mask.lower is not None:
        left_bound = 1 - mask.lower  # cuDNN keeps keys j > i - left_bound
    if mask.kv_lengths is not None:
      lens = (jnp.full((b,), tq, jnp.int32), jnp.broadcast_to(mask.kv_lengths, (b,)).astype(jnp.int32))
  padding = lens is not None
  return _sdpa(q, k, v, lens, (float(scale), causal, int(left_bound), padding, config or CudnnConfig()))
