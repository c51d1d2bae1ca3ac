"""Callables for every implementation the suites time, built on the same inputs.

``build(impl, arrays, dtype, causal, mode, mask)`` returns ``(fn, sync)`` for
:func:`bench.harness.time_fn`. ``arrays`` are the numpy float32 arrays
``q, k, v, do`` in [B, T, H, D]; they are cast to ``dtype`` for every library,
and torch receives them transposed to [B, H, T, D]. Missing libraries or
entry points raise :class:`harness.Unsupported` (-> status "unsupported").

Mask names: "none", "window512" (causal, 512 keys to the left), "docs4"
(4 equal packed documents), "docs4_causal", "softcap30" (causal, with the score modifier
``30 * tanh(score / 30)``: a functional bias, Gemma-2's logit soft-capping).
"""

from __future__ import annotations

from bench.harness import Case, backend_of, time_fn
from bench.peers import (Unsupported, free_memory, peers_present, probjax_api, require_gpu,  # noqa: F401
                         tokamax_mod, torch_mod)

PROBJAX_IMPLS = {
    # impl name -> kwargs of probjax dot_product_attention
    "probjax_default": {},
    "probjax_xla": {"implementation": "xla"},
    "probjax_triton": {"implementation": "triton"},
    "probjax_pallas": {"implementation": "pallas"},
    "probjax_cudnn": {"implementation": "cudnn"},
    # probjax's FFI call of cuDNN with other graph options (CudnnConfig fields)
    "probjax_cudnn_composite": {"implementation": "cudnn", "forward_config": {"sdpa": "composite"}},
    "probjax_cudnn_unified": {"implementation": "cudnn", "forward_config": {"sdpa": "unified"}},
    "probjax_cudnn_autotune": {"implementation": "cudnn", "forward_config": {"autotune": True}},
    "probjax_mosaic": {"implementation": "mosaic"},
    "probjax_mosaic_bwd": {"implementation": "mosaic", "backward_pass_impl": "mosaic"},
    # the Mosaic forward's default config for the call with overlap on / off (mosaic_overlap_config)
    "probjax_mosaic_overlap": {"implementation": "mosaic", "forward_config": "overlap"},
    "probjax_mosaic_no_overlap": {"implementation": "mosaic", "forward_config": "no_overlap"},
    "probjax_triton_onepass": {"implementation": "triton", "backward_pass_impl": "triton_onepass"},
    "probjax_triton_fused": {"implementation": "triton", "backward_pass_impl": "triton_fused"},
    "probjax_triton_split": {"implementation": "triton", "backward_pass_impl": "triton_split"},
    "probjax_triton_nosplit": {"implementation": "triton", "split_kv": False},  # regular forward
}
JAXNN_IMPLS = {"jaxnn_xla": "xla", "jaxnn_cudnn": "cudnn"}
TORCH_SDPA_IMPLS = {"torch_sdpa_flash": "FLASH_ATTENTION", "torch_sdpa_efficient": "EFFICIENT_ATTENTION",
                    "torch_sdpa_cudnn": "CUDNN_ATTENTION", "torch_sdpa_math": "MATH"}
TOKAMAX_IMPLS = {"tokamax_mosaic": "mosaic", "tokamax_triton": "triton", "tokamax_cudnn": "cudnn",
                 "tokamax_xla_chunked": "xla_chunked"}
NO_FP32 = {"jaxnn_cudnn", "torch_sdpa_flash", "torch_sdpa_cudnn", "tokamax_cudnn", "probjax_cudnn",
           "probjax_cudnn_composite", "probjax_cudnn_unified", "probjax_cudnn_autotune",
           "probjax_mosaic", "probjax_mosaic_bwd", "probjax_mosaic_overlap",
           "probjax_mosaic_no_overlap"}
MASKS = ("none", "window512", "docs4", "docs4_causal", "softcap30")
SOFTCAP = 30.0


# ---------------------------------------------------------------------------
# availability: bench/peers.py (probjax_api, torch_mod, tokamax_mod, peers_present,
# require_gpu, free_memory; shared with the harness)
# ---------------------------------------------------------------------------
def jnp_dtype(dtype: str):
  import jax.numpy as jnp
  return {"bfloat16": jnp.bfloat16, "float32": jnp.float32, "float16": jnp.float16}[dtype]


# ---------------------------------------------------------------------------
# masks
# ---------------------------------------------------------------------------
def doc_ids(batch: int, t: int, docs: int = 4):
  import numpy as np
  ids = (np.arange(t) * docs // t).astype(np.int32)
  return np.broadcast_to(ids, (batch, t)).copy()


def probjax_mask(mask: str, causal: bool, batch: int, q_len: int, kv_len: int):
  """Returns (mask_obj or None, is_causal flag) for probjax."""
  if mask == "none":
    return None, causal
  if mask == "softcap30":
    from probjax.ops.attention import masks as M
    return M.CausalMask(), False
  from probjax.ops.attention import masks as M
  if mask == "window512":
    return M.LocalWindowMask(left=512, right=0), False
  if mask in ("docs4", "docs4_causal"):
    import jax.numpy as jnp
    m = M.SegmentMask(jnp.asarray(doc_ids(batch, q_len)), jnp.asarray(doc_ids(batch, kv_len)))
    if mask == "docs4_causal":
      m = m & M.CausalMask()
    return m, False
  raise Unsupported(f"unknown mask {mask}")


# ---------------------------------------------------------------------------
# JAX-side builders
# ---------------------------------------------------------------------------
def _jax_fn(attn, arrays, dtype, mode, compile_only=False):
  import jax
  import jax.numpy as jnp
  dt = jnp_dtype(dtype)
  q, k, v, do = (jnp.asarray(a, dtype=dt) for a in arrays)
  if mode == "fwd":
    f, args = jax.jit(attn), (q, k, v)
  else:
    def fb(q, k, v, do):
      out, vjp = jax.vjp(attn, q, k, v)
      return (out,) + tuple(vjp(do))
    f, args = jax.jit(fb), (q, k, v, do)
  if compile_only:
    return f.lower(*args).compile(), None
  call = lambda: f(*args)
  call.lower = lambda: f.lower(*args)   # for memory_of: the executable the calls ran (jit's cache)
  return call, jax.block_until_ready


def memory_of(compiled) -> dict:
  """XLA's memory analysis of a compiled program (bytes): temporaries, arguments, outputs,
  aliases and ``compiled_total_bytes``, what the program holds on the device while it runs."""
  ma = compiled.memory_analysis()
  if ma is None:
    raise Unsupported("memory_analysis() returned None on this backend")
  get = lambda n: int(getattr(ma, n, 0) or 0)
  out = {"temp_bytes": get("temp_size_in_bytes"), "argument_bytes": get("argument_size_in_bytes"),
         "output_bytes": get("output_size_in_bytes"), "alias_bytes": get("alias_size_in_bytes")}
  out["compiled_total_bytes"] = out["temp_bytes"] + out["argument_bytes"] + out["output_bytes"] - out["alias_bytes"]
  return out


def program_memory(compiled) -> dict:
  """A row's memory fields: :func:`memory_of` the compiled program (``memory_error`` where XLA
  gives none) and ``device_peak_bytes``, the device's ``peak_bytes_in_use`` so far in the
  process (a high-water mark over every row before; GPU only)."""
  import jax
  out = {}
  try:
    out.update(memory_of(compiled))
  except Exception as e:  # noqa: BLE001 (the timing stands without it)
    out["memory_error"] = f"{type(e).__name__}: {e}"[:200]
  try:
    peak = (jax.devices()[0].memory_stats() or {}).get("peak_bytes_in_use")
  except Exception:  # noqa: BLE001 (a backend without memory stats)
    peak = None
  if peak is not None:
    out["device_peak_bytes"] = int(peak)
  return out


def probjax_attn(impl: str, causal: bool, mask_obj=None, extra_kwargs=None):
  dpa, _ = probjax_api()
  kw = dict(PROBJAX_IMPLS[impl]) if impl in PROBJAX_IMPLS else {}
  kw.update(extra_kwargs or {})
  if causal:
    kw["is_causal"] = True

  def attn(q, k, v):
    kw_call = dict(kw)
    if kw_call.get("forward_config") is not None:  # flex_attention takes configs
      _, mod = probjax_api()
      mask = mask_obj if mask_obj is not None else (mod.CausalMask() if kw_call.pop("is_causal", False) else None)
      cfg = kw_call["forward_config"]
      if cfg in ("overlap", "no_overlap"):
        kw_call["forward_config"] = mosaic_overlap_config(q, mask, cfg == "overlap")
      else:
        kw_call["forward_config"] = mod.CudnnConfig(**cfg)
      return mod.flex_attention(q, k, v, mask=mask, **kw_call)
    if mask_obj is not None:
      return dpa(q, k, v, mask=mask_obj, **kw_call)
    return dpa(q, k, v, **kw_call)
  return attn


def mosaic_overlap_config(q, mask, overlap: bool):
  """The Mosaic forward's default config for a call on ``q`` (``[batch, seq, heads, head_dim]``)
  with ``mask`` on this device, with ``overlap`` set."""
  import dataclasses
  from probjax.ops.attention.backends.mosaic_gpu import config as MC
  from probjax.ops.attention.backends.triton import config as C
  cfg = MC.fit(None, q.dtype.itemsize, q.shape[-1], C.device_kind(), mask=mask, q_len=q.shape[1])
  return dataclasses.replace(cfg, overlap=overlap)


def build_jax_side(impl, arrays, dtype, causal, mode, mask="none", compile_only=False):
  import jax
  if dtype == "float32" and impl in NO_FP32:
    raise Unsupported(f"{impl} has no float32 path")
  b, tq = arrays[0].shape[:2]
  tk = arrays[1].shape[1]
  if impl == "probjax_repeat_kv":  # the default kernel on K/V repeated to the query heads
    hq, hk = arrays[0].shape[2], arrays[1].shape[2]
    base = probjax_attn("probjax_default", causal)

    def attn(q, k, v):
      import jax.numpy as jnp
      return base(q, jnp.repeat(k, hq // hk, axis=2), jnp.repeat(v, hq // hk, axis=2))
    return _jax_fn(attn, arrays, dtype, mode, compile_only)
  if impl.startswith("probjax_"):
    if impl not in PROBJAX_IMPLS:
      raise Unsupported(f"unknown probjax impl {impl}")
    mobj, is_causal = probjax_mask(mask, causal, b, tq, tk)
    extra = {"score_mod": softcap_score_mod(jnp_tanh())} if mask == "softcap30" else None
    return _jax_fn(probjax_attn(impl, is_causal, mobj, extra), arrays, dtype, mode, compile_only)
  if mask not in ("none", "window512") and not (mask == "softcap30" and impl in TOKAMAX_IMPLS):
    raise Unsupported(f"{impl} is not run with mask {mask}")
  kw = {"is_causal": causal}
  if mask == "window512":  # causal, 512 keys to the left (local_window_size=(left, right))
    kw = {"is_causal": True, "local_window_size": (512, 0)}
  if mask == "softcap30":  # tokamax's own soft-capping argument
    kw = {"is_causal": True, "logits_soft_cap": SOFTCAP}
  if impl in JAXNN_IMPLS:
    which = JAXNN_IMPLS[impl]
    if which == "cudnn":
      require_gpu("cuDNN")
    attn = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, implementation=which, **kw)
    return _jax_fn(attn, arrays, dtype, mode, compile_only)
  if impl in TOKAMAX_IMPLS:
    tk_mod = tokamax_mod()
    which = TOKAMAX_IMPLS[impl]
    attn = lambda q, k, v: tk_mod.dot_product_attention(q, k, v, implementation=which, **kw)
    return _jax_fn(attn, arrays, dtype, mode, compile_only)
  raise Unsupported(f"unknown jax impl {impl}")


# ---------------------------------------------------------------------------
# torch builders (GPU, in-process)
# ---------------------------------------------------------------------------
_FLEX_CACHE = {}


def _torch_setup(torch):
  try:
    import torch._dynamo
    cfg = torch._dynamo.config
    cfg.cache_size_limit = 4096
    if hasattr(cfg, "recompile_limit"):
      cfg.recompile_limit = 4096
    if hasattr(cfg, "accumulated_cache_size_limit"):
      cfg.accumulated_cache_size_limit = 65536
    if hasattr(cfg, "accumulated_recompile_limit"):
      cfg.accumulated_recompile_limit = 65536
  except Exception:  # noqa: BLE001
    pass


def build_torch(impl, arrays, dtype, causal, mode, mask="none", device="cuda"):
  torch = torch_mod()
  _torch_setup(torch)
  if device == "cuda" and not torch.cuda.is_available():
    raise Unsupported("torch sees no CUDA device")
  if dtype == "float32" and impl in NO_FP32:
    raise Unsupported(f"{impl} has no float32 path")
  dev = device
  tdt = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}[dtype]
  need_grad = mode == "fwd_bwd"
  # [B, T, H, D] -> [B, H, T, D]
  q, k, v, do = (torch.from_numpy(a).to(dev, tdt).transpose(1, 2).contiguous() for a in arrays)
  for t in (q, k, v):
    t.requires_grad_(need_grad)
  b, hq, tq, _ = q.shape
  hk, tk = k.shape[1], k.shape[2]
  gqa = hq != hk
  sync = (lambda _x: torch.cuda.synchronize()) if dev == "cuda" else (lambda _x: None)

  if impl in TORCH_SDPA_IMPLS:
    if mask not in ("none",):
      raise Unsupported(f"{impl}: masked cases are run for probjax and torch flex only")
    from torch.nn.attention import SDPBackend, sdpa_kernel
    backend = getattr(SDPBackend, TORCH_SDPA_IMPLS[impl])
    F = torch.nn.functional
    kw = {"is_causal": causal}
    if gqa:
      kw["enable_gqa"] = True

    def fwd():
      with sdpa_kernel(backend):
        return F.scaled_dot_product_attention(q, k, v, **kw)
  elif impl == "torch_flex":
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    key = (b, hq, hk, tq, tk, q.shape[-1], dtype, causal, mask, mode)
    compiled = torch.compile(flex_attention, dynamic=False)
    mm = _flex_mask_mod(torch, mask, causal, tq, tk, dev)
    bm = None if mm is None else create_block_mask(mm, B=None, H=None, Q_LEN=tq, KV_LEN=tk, device=dev)
    _FLEX_CACHE[key] = (compiled, bm)
    kw = {"block_mask": bm}
    if mask == "softcap30":
      kw["score_mod"] = softcap_score_mod(torch.tanh)
    if gqa:
      kw["enable_gqa"] = True

    def fwd():
      return compiled(q, k, v, **kw)
  else:
    raise Unsupported(f"unknown torch impl {impl}")

  if mode == "fwd":
    def fn():
      with torch.no_grad():
        return fwd()
    return fn, sync

  def fn():
    out = fwd()
    return torch.autograd.grad(out, (q, k, v), do)
  return fn, sync


def softcap_score_mod(tanh):
  """The "softcap30" score modifier, ``f(score, b, h, q_idx, kv_idx)``, with ``tanh`` of the
  framework (jnp or torch)."""
  return lambda s, b, h, qi, ki: SOFTCAP * tanh(s / SOFTCAP)


def jnp_tanh():
  import jax.numpy as jnp
  return jnp.tanh


def _flex_mask_mod(torch, mask, causal, tq, tk, dev):
  if mask == "none" or mask == "softcap30":
    if not (causal or mask == "softcap30"):
      return None
    return lambda b, h, qi, ki: qi >= ki
  if mask == "window512":
    return lambda b, h, qi, ki: (qi >= ki) & (qi - ki <= 512)
  if mask in ("docs4", "docs4_causal"):
    qd = torch.arange(tq, device=dev) * 4 // tq
    kd = torch.arange(tk, device=dev) * 4 // tk
    if mask == "docs4":
      return lambda b, h, qi, ki: qd[qi] == kd[ki]
    return lambda b, h, qi, ki: (qd[qi] == kd[ki]) & (qi >= ki)
  raise Unsupported(f"unknown mask {mask}")


def build(impl, arrays, dtype, causal, mode, mask="none"):
  if impl.startswith("torch_") and impl != "torch_cpu":
    return build_torch(impl, arrays, dtype, causal, mode, mask)
  return build_jax_side(impl, arrays, dtype, causal, mode, mask)


# ---------------------------------------------------------------------------
# Cases
# ---------------------------------------------------------------------------
_INPUTS = {}


def inputs(batch, q_len, kv_len, q_heads, kv_heads, head_dim, seed=0):
  """The same float32 numpy q, k, v, do ``[B, T, H, D]`` for every implementation of a shape
  (:func:`probjax.testing.make_inputs`, the tests' inputs; a 1-entry cache)."""
  key = (batch, q_len, kv_len, q_heads, kv_heads, head_dim, seed)
  if key not in _INPUTS:
    import jax
    import numpy as np
    from probjax.testing import make_inputs
    _INPUTS.clear()
    with jax.default_device(jax.devices("cpu")[0]):  # none of JAX's GPU pool is kept for torch
      x = make_inputs(seed, batch, q_len, kv_len, q_heads, kv_heads, head_dim)
      _INPUTS[key] = tuple(np.asarray(a) for a in (x.q, x.k, x.v, x.do))
  return _INPUTS[key]


CHECK_ROWS = 64
_REFS = {}


def reference_slice(arrays, dtype, causal, mask, n=CHECK_ROWS):
  """float64 numpy attention output for batch 0, query head 0, the first n queries.

  Inputs are first rounded to ``dtype`` (as every library receives them).
  """
  import numpy as np
  key = (tuple(a.shape for a in arrays), id(arrays[0]), dtype, causal, mask, n)
  if key in _REFS:
    return _REFS[key]
  q, k, v = arrays[:3]
  if dtype == "bfloat16":
    import ml_dtypes
    rnd = lambda x: np.asarray(x, dtype=ml_dtypes.bfloat16).astype(np.float64)
  else:
    rnd = lambda x: np.asarray(x, dtype=np.dtype(dtype)).astype(np.float64)
  tq, tk, d = q.shape[1], k.shape[1], q.shape[3]
  n = min(n, tq)
  q0, k0, v0 = rnd(q[0, :n, 0, :]), rnd(k[0, :, 0, :]), rnd(v[0, :, 0, :])
  s = q0 @ k0.T / np.sqrt(d)
  qi, ki = np.arange(n)[:, None], np.arange(tk)[None, :]
  valid = np.ones((n, tk), bool)
  if mask == "softcap30":
    s = SOFTCAP * np.tanh(s / SOFTCAP)
  if causal or mask in ("window512", "docs4_causal", "softcap30"):
    valid &= ki <= qi
  if mask == "window512":
    valid &= ki >= qi - 512
  if mask in ("docs4", "docs4_causal"):
    valid &= (qi * 4 // tq) == (ki * 4 // tk)
  s = np.where(valid, s, -np.inf)
  m = np.max(s, axis=1, keepdims=True)
  m = np.where(np.isfinite(m), m, 0.0)
  p = np.where(valid, np.exp(s - m), 0.0)
  den = p.sum(axis=1, keepdims=True)
  out = np.where(den > 0, (p @ v0) / np.where(den > 0, den, 1.0), 0.0)
  _REFS.clear()
  _REFS[key] = out
  return out


def output_slice(impl, out, n):
  """The batch-0, head-0, first-n-queries slice of an output, as float64 numpy."""
  import numpy as np
  if isinstance(out, (tuple, list)):
    out = out[0]
  if impl.startswith("torch_"):
    return out[0, 0, :n, :].float().cpu().numpy().astype(np.float64)  # [B, H, T, D]
  return np.asarray(out[0, :n, 0, :].astype("float32")).astype(np.float64)  # [B, T, H, D]


def timed_case(suite, impl, dtype, batch, q_heads, kv_heads, q_len, kv_len, head_dim, causal,
               mode, timing, mask="none", extra=None, variant=""):
  """A harness.Case that builds ``impl`` on the shared inputs and times it.

  Forward rows also get ``max_abs_err``: the largest |difference| of the
  output slice (batch 0, head 0, first 64 queries) from a float64 reference.
  """
  def prepare():
    arrays = inputs(batch, q_len, kv_len, q_heads, kv_heads, head_dim)
    fn, sync = build(impl, arrays, dtype, causal, mode, mask)

    def finish(res):
      if mode == "fwd":
        try:
          import numpy as np
          ref = reference_slice(arrays, dtype, causal, mask)
          got = output_slice(impl, fn(), ref.shape[0])
          res["max_abs_err"] = float(np.max(np.abs(got - ref)))
        except Exception as e:  # noqa: BLE001
          res["check_error"] = f"{type(e).__name__}: {e}"[:300]
      return res
    return (lambda: time_fn(fn, sync, **timing, backend=backend_of(impl))), finish

  return Case(suite=suite, impl=impl, dtype=dtype, batch=batch, q_heads=q_heads,
              kv_heads=kv_heads, q_len=q_len, kv_len=kv_len, head_dim=head_dim,
              causal=causal, mode=mode, mask=mask, run=run_of(prepare), extra=dict(extra or {}),
              variant=variant, flops=(mask == "none"), prepare=prepare)


def shape(dtype, batch, q_heads, kv_heads, q_len, kv_len, head_dim, causal, mode, mask="none") -> dict:
  """One shape of a suite's table: the :func:`timed_case` arguments besides the implementation."""
  return dict(dtype=dtype, batch=batch, q_heads=q_heads, kv_heads=kv_heads, q_len=q_len, kv_len=kv_len,
              head_dim=head_dim, causal=causal, mode=mode, mask=mask)


def timed_cases(suite, names, shapes, timing, skip=None) -> list:
  """A suite as data: a :func:`timed_case` per shape (:func:`shape`) and implementation, the
  implementations of a shape together (the order the harness runs and ``--rounds`` groups),
  leaving out the pairs ``skip(impl, shape)`` rejects."""
  return [timed_case(suite, impl, timing=timing, **s) for s in shapes for impl in names
          if skip is None or not skip(impl, s)]


def run_of(prepare):
  """A case's ``run``: ``prepare()`` gives ``(timer, finish)``; the row is ``finish(timer())``,
  and the case's arrays are freed whatever happens (references dropped first)."""
  def run():
    try:
      timer, finish = prepare()
      return finish(timer())
    finally:
      timer = finish = None
      free_memory()
  return run


def memory_case(suite, impl, dtype, batch, q_heads, kv_heads, t, head_dim, measure):
  """A harness.Case (non-causal fwd_bwd, no FLOPs) whose row is ``measure(impl, arrays, dtype)``
  on the shared inputs of the shape (a dict of byte counts)."""
  def run():
    try:
      return measure(impl, inputs(batch, t, t, q_heads, kv_heads, head_dim), dtype)
    finally:
      free_memory()
  return Case(suite=suite, impl=impl, dtype=dtype, batch=batch, q_heads=q_heads, kv_heads=kv_heads,
              q_len=t, kv_len=t, head_dim=head_dim, causal=False, mode="fwd_bwd", run=run, flops=False)


def fwd_bwd_memory(impl, arrays, dtype) -> dict:
  """:func:`compiled_memory` of a non-causal fwd_bwd call (a :func:`memory_case` measure)."""
  return compiled_memory(impl, arrays, dtype, False, "fwd_bwd")


def compiled_memory(impl, arrays, dtype, causal, mode, mask="none") -> dict:
  """XLA's compile-time memory analysis of the jitted call (bytes)."""
  if impl.startswith("torch"):
    raise Unsupported("compile-time memory analysis is JAX-only")
  compiled, _ = build_jax_side(impl, arrays, dtype, causal, mode, mask, compile_only=True)
  return memory_of(compiled)


def residual_bytes(impl, arrays, dtype, causal, mask="none") -> dict:
  """Bytes of the jax.vjp residuals kept for the backward (with and without the inputs)."""
  import jax
  import jax.numpy as jnp
  if impl.startswith("torch"):
    raise Unsupported("jax.vjp residuals are JAX-only")
  dt = jnp_dtype(dtype)
  q, k, v = (jnp.asarray(a, dtype=dt) for a in arrays[:3])
  b, tq = arrays[0].shape[:2]
  tk = arrays[1].shape[1]
  if impl == "probjax_repeat_kv" or impl.startswith("probjax_"):
    mobj, is_causal = probjax_mask(mask, causal, b, tq, tk)
    attn = probjax_attn(impl if impl in PROBJAX_IMPLS else "probjax_default", is_causal, mobj)
  elif impl in JAXNN_IMPLS:
    attn = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal,
                                                        implementation=JAXNN_IMPLS[impl])
  elif impl in TOKAMAX_IMPLS:
    tk_mod = tokamax_mod()
    attn = lambda q, k, v: tk_mod.dot_product_attention(q, k, v, is_causal=causal,
                                                        implementation=TOKAMAX_IMPLS[impl])
  else:
    raise Unsupported(impl)
  _, vjp_fn = jax.vjp(jax.jit(attn), q, k, v)
  leaves = [x for x in jax.tree_util.tree_leaves(vjp_fn) if hasattr(x, "nbytes")]
  ids = {id(q), id(k), id(v)}
  total = sum(int(x.nbytes) for x in leaves)
  excl = sum(int(x.nbytes) for x in leaves if id(x) not in ids)
  jax.block_until_ready(leaves)
  return {"residual_bytes": total, "residual_bytes_excl_inputs": excl, "n_residuals": len(leaves)}
