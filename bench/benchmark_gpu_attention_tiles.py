"""Tile sweep of the probjax Triton kernels (suite "tiles").

  python -m bench.benchmark_gpu_attention_tiles   # -> bench/results/<device>/tiles.json

For each (dtype, head_dim, T) at batch 4, 8 heads, non-causal (``--lengths``, default 4096;
1024 shows whether smaller tiles pay off where the grid is only ~2 programs per SM deep):

* forward (mode "fwd"): the auto configuration (variant "auto": default tiles)
  against every forced ``ForwardConfig(block_q, block_k, num_warps, num_stages)``;
* backward (mode "fwd_bwd", ``backward_pass_impl="triton_split"`` in every row so
  that only the tiles differ): the auto backward tiles against forced
  ``BackwardConfig``s with the default forward tiles;
* per mode, the auto tiles with libdevice's ``exp2f`` (``fast_exp2=False``, variant
  "auto_libdevice_exp2"), which checks the device's ``FAST_EXP2`` entry; the tile page
  reports it beside auto and does not count it as a forced config.

``--kernel mosaic``: the same for the Mosaic GPU forward (impl "probjax_mosaic", mode "fwd"):
auto against every forced ``MosaicForwardConfig(64, block_k, num_stages, compute_wgs, persistent)``
(variant ``mosaic_bk{block_k}_s{stages}_wg{wgs}``, ``_p`` when persistent).

``--kernel mosaic_bwd``: the Mosaic GPU backward (impl "probjax_mosaic_bwd", mode "fwd_bwd", the
default Mosaic forward before it): its default ``MosaicBackwardConfig`` (variant "auto") against
every forced (block_q, block_k, num_stages, compute_wgs) with dQ in its own kernel, and with
``fused_dq`` (block_k unused; at head_dim 128 also ``shared_dq``) (variant
``mbwd_bq{block_q}_bk{block_k}_s{stages}_wg{wgs}``, ``_fused`` / ``_shared``).

Configurations that do not fit shared memory are refused before launch
(status "unsupported" with the message).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import sys

import jax.numpy as jnp

from bench import harness, impls

BLOCKS_Q = (64, 128)
BLOCKS_K = (32, 64, 128)
STAGES = (2, 3, 4)
WARPS = (4, 8)
# Backward: (block_q_dkv, block_kv_dkv), (block_q_dq, block_kv_dq), warps, stages. The dK/dV
# kernel keeps its KV tile resident and streams query tiles (so it wants the larger KV
# block), the dQ kernel the reverse.
BWD_DKV = ((32, 128), (64, 128), (64, 64))
BWD_DQ = ((128, 32), (128, 64), (64, 64))
BWD_WARPS = (4, 8)
BWD_STAGES = (2, 3, 4)
MOSAIC_BLOCKS_K = (64, 128, 192)
MOSAIC_STAGES = (2, 3, 4)
MOSAIC_WGS = (1, 2, 3)  # one: 64-row CTAs, more of them at short T
MOSAIC_PERSISTENT = (False, True)
MBWD_BLOCKS = (64, 128)
MBWD_STAGES = (2, 3)
MBWD_WGS = (1, 2)


def mosaic_bwd_configs(d: int) -> list:
  """(block_q, block_k, stages, wgs, fused_dq, shared_dq) of the Mosaic backward sweep."""
  two = [(bq, bk, st, wg, False, False) for bq in MBWD_BLOCKS for bk in MBWD_BLOCKS
         for st in MBWD_STAGES for wg in MBWD_WGS]
  fused = [(bq, 64, st, wg, True, False) for bq in MBWD_BLOCKS for st in MBWD_STAGES for wg in MBWD_WGS]
  shared = [(bq, 64, st, 2, True, True) for bq in MBWD_BLOCKS for st in MBWD_STAGES] if d % 128 == 0 else []
  return two + fused + shared


def _auto_description(dtype, head_dim, t):
  """The forward and backward configs the kernel picks with default tiles on this device."""
  from probjax.ops.attention.backends.triton import config as C
  dt, dev = impls.jnp_dtype(dtype), C.device_kind()
  f = C.fit_forward_config(None, dt, head_dim, t, t, dev)
  b = C.fit_backward_config(None, dt, head_dim, t, t, dev)
  return {"forward": f.__dict__ if hasattr(f, "__dict__") else str(f),
          "backward": b.__dict__ if hasattr(b, "__dict__") else str(b)}


def tile_case(dtype, d, t, b, h, mode, cfg, timing):
  """One row: ``cfg`` None (auto), a forward tuple (bq, bk, stages, warps) or a backward
  tuple ((bq_dkv, bk_dkv), (bq_dq, bk_dq), warps, stages)."""
  from probjax.ops.attention.backends.triton import BackwardConfig, ForwardConfig
  if cfg is None:
    variant, kw = "auto", {}
  elif cfg == "libdevice_exp2":  # the auto tiles with libdevice's exp2f (checks FAST_EXP2)
    from probjax.ops.attention.backends.triton import config as C
    dt, dev = impls.jnp_dtype(dtype), C.device_kind()
    fc = C.fit_forward_config(None, dt, d, t, t, dev)
    bc = C.fit_backward_config(None, dt, d, t, t, dev)
    variant = "auto_libdevice_exp2"
    kw = {"forward_config": dataclasses.replace(fc, fast_exp2=False)}
    if mode == "fwd_bwd":
      kw["backward_config"] = dataclasses.replace(bc, fast_exp2=False)
  elif mode == "fwd":
    bq, bk, st, nw = cfg
    variant = f"bq{bq}_bk{bk}_s{st}_w{nw}"
    kw = {"forward_config": ForwardConfig(block_q=bq, block_k=bk, num_warps=nw, num_stages=st)}
  else:
    (bqd, bkd), (bqq, bkq), nw, st = cfg
    variant = f"dkv{bqd}x{bkd}_dq{bqq}x{bkq}_s{st}_w{nw}"
    kw = {"backward_config": BackwardConfig(bqd, bkd, bqq, bkq, nw, st)}

  def run():
    from probjax.nn.layers.attention import flex_attention
    attn = lambda q, k, v: flex_attention(q, k, v, implementation="triton",
                                          backward_pass_impl="triton_split", **kw)
    fn, sync = impls._jax_fn(attn, impls.inputs(b, t, t, h, h, d), dtype, mode)
    try:
      res = harness.time_fn(fn, sync, **timing)
      auto = _auto_description(dtype, d, t)
      if cfg is None:
        res["auto_config"] = auto
      elif mode == "fwd_bwd":  # forced backward rows run the default forward tiles
        res["forward_config"] = auto["forward"]
      return res
    finally:
      impls.free_memory()

  return harness.Case(suite="tiles", impl="probjax_triton", dtype=dtype, batch=b, q_heads=h,
                      kv_heads=h, q_len=t, kv_len=t, head_dim=d, causal=False, mode=mode,
                      run=run, variant=variant, extra={"config": variant})


def mosaic_auto_config(dtype: str, d: int, t: int, device: str) -> dict:
  """The forward config the Mosaic kernel picks by default on ``device`` for an unmasked call
  of ``t`` queries (recorded in auto rows)."""
  from probjax.ops.attention.backends.mosaic_gpu import config as MC
  itemsize = jnp.dtype(impls.jnp_dtype(dtype)).itemsize
  return {"forward": dataclasses.asdict(MC.fit(None, itemsize, d, device, q_len=t, kv_len=t))}


def mosaic_tile_case(dtype, d, t, b, h, cfg, timing):
  """One forward row of the Mosaic kernel: ``cfg`` None (auto) or (block_k, stages, compute_wgs,
  persistent)."""
  from probjax.ops.attention.backends.mosaic_gpu import MosaicForwardConfig
  if cfg is None:
    variant, kw = "auto", {}
  else:
    bk, st, wgs, persistent = cfg
    variant = f"mosaic_bk{bk}_s{st}_wg{wgs}" + ("_p" if persistent else "")
    kw = {"forward_config": MosaicForwardConfig(64, bk, st, wgs, persistent)}

  def run():
    from probjax.nn.layers.attention import flex_attention
    from probjax.ops.attention.backends.triton import config as C
    attn = lambda q, k, v: flex_attention(q, k, v, implementation="mosaic", **kw)
    fn, sync = impls._jax_fn(attn, impls.inputs(b, t, t, h, h, d), dtype, "fwd")
    try:
      res = harness.time_fn(fn, sync, **timing)
      if cfg is None:
        res["auto_config"] = mosaic_auto_config(dtype, d, t, C.device_kind())
      return res
    finally:
      impls.free_memory()

  return harness.Case(suite="tiles", impl="probjax_mosaic", dtype=dtype, batch=b, q_heads=h,
                      kv_heads=h, q_len=t, kv_len=t, head_dim=d, causal=False, mode="fwd",
                      run=run, variant=variant, extra={"config": variant})


def mosaic_bwd_case(dtype, d, t, b, h, cfg, timing):
  """One fwd+bwd row of the Mosaic backward: ``cfg`` None (its default) or a tuple of
  :func:`mosaic_bwd_configs`."""
  from probjax.ops.attention.backends.mosaic_gpu import MosaicBackwardConfig
  if cfg is None:
    variant, kw = "auto", {}
  else:
    bq, bk, st, wgs, fused, shared = cfg
    variant = f"mbwd_bq{bq}_bk{bk}_s{st}_wg{wgs}" + ("_shared" if shared else "_fused" if fused else "")
    kw = {"backward_config": MosaicBackwardConfig(bq, bk, st, wgs, fused_dq=fused, shared_dq=shared)}

  def run():
    from probjax.nn.layers.attention import flex_attention
    attn = lambda q, k, v: flex_attention(q, k, v, implementation="mosaic", backward_pass_impl="mosaic", **kw)
    fn, sync = impls._jax_fn(attn, impls.inputs(b, t, t, h, h, d), dtype, "fwd_bwd")
    try:
      return harness.time_fn(fn, sync, **timing)
    finally:
      impls.free_memory()

  return harness.Case(suite="tiles", impl="probjax_mosaic_bwd", dtype=dtype, batch=b, q_heads=h,
                      kv_heads=h, q_len=t, kv_len=t, head_dim=d, causal=False, mode="fwd_bwd",
                      run=run, variant=variant, extra={"config": variant})


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  harness.add_common_args(p)
  p.add_argument("--dtypes", default="bf16,fp32")
  p.add_argument("--head-dims", default="64,128")
  p.add_argument("--lengths", default="4096", help="comma-separated T (Lq = Lkv); one swept shape each")
  p.add_argument("--kernel", default="triton", choices=("triton", "mosaic", "mosaic_bwd"))
  p.add_argument("--modes", default="fwd,fwd_bwd", help="Triton sweep: the modes swept (fwd, fwd_bwd)")
  args = p.parse_args(argv)
  timing = harness.timing_kwargs(args)
  cases = []
  if args.kernel == "mosaic":
    shapes = [("bfloat16", 64, 128, 1, 2)] if args.quick else [
        (harness.DTYPE_NAMES[dt], d, int(t), 4, 8) for dt in args.dtypes.split(",")
        for d in map(int, args.head_dims.split(",")) for t in args.lengths.split(",") if t]
    configs = [None] + list(itertools.product(MOSAIC_BLOCKS_K, MOSAIC_STAGES, MOSAIC_WGS, MOSAIC_PERSISTENT))
    cases = [mosaic_tile_case(dtype, d, t, b, h, c, timing) for dtype, d, t, b, h in shapes
             for c in (configs[:2] if args.quick else configs)]
  elif args.kernel == "mosaic_bwd":
    shapes = [("bfloat16", 64, 128, 1, 2)] if args.quick else [
        (harness.DTYPE_NAMES[dt], d, int(t), 4, 8) for dt in args.dtypes.split(",")
        for d in map(int, args.head_dims.split(",")) for t in args.lengths.split(",") if t]
    cases = [mosaic_bwd_case(dtype, d, t, b, h, c, timing) for dtype, d, t, b, h in shapes
             for c in ([None] + mosaic_bwd_configs(d))[:2 if args.quick else None]]
  elif args.quick:
    cases = [tile_case("float32", 16, 64, 1, 2, "fwd", cfg, timing)
             for cfg in (None, "libdevice_exp2", (32, 32, 1, 4))]
    cases.append(tile_case("float32", 16, 64, 1, 2, "fwd_bwd", ((32, 32), (32, 32), 4, 1), timing))
  else:
    for dt in args.dtypes.split(","):
      for d in map(int, args.head_dims.split(",")):
        dtype = harness.DTYPE_NAMES[dt]
        fwd = [None, "libdevice_exp2"] + list(itertools.product(BLOCKS_Q, BLOCKS_K, STAGES, WARPS))
        bwd = [None, "libdevice_exp2"] + list(itertools.product(BWD_DKV, BWD_DQ, BWD_WARPS, BWD_STAGES))
        modes = args.modes.split(",")
        for t in (int(x) for x in args.lengths.split(",") if x):
          cases += [tile_case(dtype, d, t, 4, 8, "fwd", c, timing) for c in fwd if "fwd" in modes]
          cases += [tile_case(dtype, d, t, 4, 8, "fwd_bwd", c, timing) for c in bwd if "fwd_bwd" in modes]
  harness.run_cases(cases, args)


if __name__ == "__main__":
  sys.exit(main())
