"""probjax's own call of cuDNN's fused attention: XLA FFI custom calls (``csrc/sdpa_ffi.cc``).

The same cuDNN kernels as ``jax.nn.dot_product_attention(implementation="cudnn")``,
without what XLA's runtime adds around its fMHA custom calls: it zeroes every output
and the workspace before each launch (3 memsets per forward, 9 per forward+backward;
docs/dev/decisions.md, "Settled by probes": "Why jax.nn's cuDNN route trailed torch's, and
probjax's own FFI call"). The extension's library
(:mod:`~probjax.ops.attention.backends.cudnn.extension`: where it is looked for, how it is built)
is built on the first call on a GPU where the headers are installed (probjax's ``cuda13`` extra,
``extension.INSTALL``); without it the cuDNN route calls jax.nn, saying so once (a warning of the
``probjax`` logger), and with ``PROBJAX_ATTENTION_CUDNN_FFI=0`` silently. :func:`extension_status`
says which it is.

Inputs: q ``[B, Tq, H, D]``, k ``[B, Tkv, Hkv, D]``, v ``[B, Tkv, Hkv, Dv]`` (bf16/fp16,
``H % Hkv == 0``; ``D`` and ``Dv`` multiples of 8 up to 256, cuDNN's limits on sm_90),
masks as :func:`probjax.ops.attention.backends.cudnn.supports` allows them. Each custom call is
:func:`probjax.ops.attention.sharding.batch_head_parallel`: under automatic sharding each
device runs it on its shard of the batch and heads, and ``vmap`` folds into the batch.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import pathlib
import sys
import threading

import jax
import jax.numpy as jnp
import numpy as np

from probjax.core import config
from probjax.ops.attention import sharding
from probjax.ops.attention.backends.cudnn import extension
from probjax.ops.attention.backends.cudnn.config import CudnnConfig
from probjax.ops.attention.masks import Mask

ENV = config.ATTENTION_CUDNN_FFI.name
LIBRARY_ENV = config.CUDNN_FFI_LIBRARY.name
_TARGETS = {"probjax_cudnn_sdpa_fwd": "ProbjaxCudnnSdpaForward",
            "probjax_cudnn_sdpa_fwd_stats": "ProbjaxCudnnSdpaForwardStats",
            "probjax_cudnn_sdpa_bwd": "ProbjaxCudnnSdpaBackward"}
# Libraries the extension finds by soname at run time, as the NVIDIA pip packages lay them out.
_RUNTIME_LIBRARIES = (("cudnn", "lib/libcudnn.so.9"), ("cu13", "lib/libcudart.so.13"),
                      ("cuda_runtime", "lib/libcudart.so.13"))
_loaded: dict[str, str | None] = {}  # library -> None (targets registered) or why it does not load
_failed: dict[str, str] = {}  # library -> why building it failed: once per process, not per call
_noticed = False
_lock = threading.Lock()  # one first-use build and registration per process
_log = logging.getLogger("probjax")


def _disabled(env) -> bool:
  return not config.ATTENTION_CUDNN_FFI.enabled(env)


def _locate(env) -> tuple[pathlib.Path | None, bool, str | None]:
  """(the library calls load, whether it exists, why there is none to load or build)."""
  if config.CUDNN_FFI_LIBRARY.value(env):
    path = pathlib.Path(config.CUDNN_FFI_LIBRARY.value(env))
    return path, path.exists(), None if path.exists() else f"the FFI extension is not built ({path})"
  if extension.IN_TREE.exists():
    return extension.IN_TREE, True, None
  try:
    path = extension.cached_library(env)
    if path.exists():
      return path, True, None
    extension.compiler(env)
  except extension.BuildError as e:
    return None, False, f"the FFI extension is not built and cannot be built here: {e}"
  why = _failed.get(str(path)) or extension.last_failure(path)
  return path, False, None if why is None else f"the FFI extension is not built: {why}"


def unavailable(env=None) -> str | None:
  """None if calls go through the FFI extension (built, or to be built on first use), else why
  they go through jax.nn. Neither loads nor builds it."""
  env = os.environ if env is None else env
  if _disabled(env):
    return f"{ENV}=0"
  path, built, why = _locate(env)
  return why if why is not None or not built else _loaded.get(str(path))


def _notice(why: str) -> None:
  global _noticed
  if not _noticed:
    _noticed = True
    _log.warning("probjax: the cuDNN route runs through jax.nn's slower call because %s; %s gets the "
                 "FFI extension (built on first use); %s=0 silences this", why, extension.INSTALL, ENV)


def _progress(line: str) -> None:
  print(line, file=sys.stderr, flush=True)


def ready(env=None) -> str | None:
  """:func:`unavailable`, after building the extension where it is missing (on a GPU only),
  loading it and registering its targets, each once per process: a library that does not
  build or load gives its reason here, once in the log, and calls go through jax.nn."""
  env = os.environ if env is None else env
  why = unavailable(env)
  if why is not None:
    if not _disabled(env):
      _notice(why)
    return why
  with _lock:
    path, built, why = _locate(env)
    if why is None and not built:
      if jax.default_backend() != "gpu":  # nothing to run it on: no build for CPU tests
        return f"the FFI extension is built on first use on a GPU (platform is {jax.default_backend()})"
      try:
        extension.build(env, output=path, announce=_progress)
      except extension.BuildError as e:
        _failed[str(path)] = f"building it failed: {e}"
        why = f"the FFI extension is not built: {_failed[str(path)]}"
    if why is None and str(path) not in _loaded:
      _loaded[str(path)] = _load(path)
    why = why or _loaded[str(path)]
  if why is not None:
    _notice(why)
  return why


def _load(path: pathlib.Path) -> str | None:
  try:
    for sub, rel in _RUNTIME_LIBRARIES:
      for d in extension.nvidia_dirs(sub):
        if (d / rel).exists():
          ctypes.CDLL(str(d / rel), mode=os.RTLD_GLOBAL)  # so that dlopen by soname finds it
          break
    lib = ctypes.CDLL(str(path))
    for target, symbol in _TARGETS.items():
      jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)), platform="CUDA")
  except (OSError, AttributeError) as e:
    return f"the FFI extension {path} does not load: {e}"
  except RuntimeError as e:  # e.g. built with a newer jaxlib's FFI headers than this jaxlib's
    return (f"the FFI extension {path} does not register with this jaxlib ({str(e).splitlines()[0]}); "
            f"rebuild it: {extension.BUILD_COMMAND} --force")
  return None


def extension_status(env=None) -> str:
  """The extension's state, for :func:`~probjax.ops.attention.dispatch.explain_dispatch`:
  ``"loaded from <path>"``, ``"built at <path>, loads on first use"``, ``"builds on first use
  on a GPU into <path>"``, ``"disabled: PROBJAX_ATTENTION_CUDNN_FFI=0"`` or ``"missing: <why>"``."""
  env = os.environ if env is None else env
  if _disabled(env):
    return f"disabled: {ENV}=0"
  path, built, why = _locate(env)
  if why is None and built:
    why = _loaded.get(str(path))
    if why is None:
      return f"loaded from {path}" if str(path) in _loaded else f"built at {path}, loads on first use"
  if why is None:
    return f"builds on first use on a GPU into {path.parent}"
  return f"missing: {why}"


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
  out = [jax.ShapeDtypeStruct((b, tq, h, v.shape[-1]), q.dtype)]
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
  """q ``[B, Tq, H, D]``, k ``[B, Tkv, Hkv, D]``, v ``[B, Tkv, Hkv, Dv]`` → ``[B, Tq, H, Dv]``
  through the extension.

  ``mask``: None, key lengths, ``CausalMask()`` or ``LocalWindowMask(left, 0)`` (equal
  lengths), as :func:`probjax.ops.attention.backends.cudnn.supports` checks; ``config``: graph
  options (default ``CudnnConfig()``). Call :func:`ready` first."""
  b, tq = q.shape[:2]
  causal, left_bound, lens = False, 0, None
  if mask is not None:
    lower, upper = mask.band_bounds
    if upper == 0:
      causal = True
      if lower is not None:
        left_bound = 1 - lower  # cuDNN keeps keys j > i - left_bound
    kv_lens = mask.lengths(b)[1]
    if kv_lens is not None:
      lens = (jnp.full((b,), tq, jnp.int32), kv_lens)
  padding = lens is not None
  return _sdpa(q, k, v, lens, (float(scale), causal, int(left_bound), padding, config or CudnnConfig()))
