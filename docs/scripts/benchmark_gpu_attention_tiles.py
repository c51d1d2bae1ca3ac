"""Tile sweep of the probjax Triton forward (suite "tiles").

  python -m docs.scripts.benchmark_gpu_attention_tiles --output docs/benchmarks/gpu_attention_tiles.json

For each (dtype, head_dim) at batch 4, 8 heads, T = 4096, non-causal forward:
the auto configuration (variant "auto", implementation="triton" with default
tiles) against every forced ``ForwardConfig(block_q, block_k, num_warps,
num_stages)`` from ``probjax.ops.attention.triton``. Configurations Triton
rejects (shared memory) get status "unsupported"/"error" with the message.
If the config API does not exist, every forced row is "unsupported".
"""

from __future__ import annotations

import argparse
import itertools
import sys

from docs.scripts import harness, impls

BLOCKS_Q = (32, 64, 128)
BLOCKS_K = (32, 64, 128)
STAGES = (2, 3, 4)
WARPS = (4, 8)


def forward_config_api():
  """Returns (ForwardConfig class, how-to-call function) or raises Unsupported."""
  try:
    import probjax.ops.attention.triton as T
  except Exception as e:  # noqa: BLE001
    raise harness.Unsupported(f"probjax.ops.attention.triton not importable: {e}") from e
  cls = getattr(T, "ForwardConfig", None)
  if cls is None:
    try:
      from probjax.ops.attention.triton import config as C
      cls = getattr(C, "ForwardConfig", None)
    except Exception:  # noqa: BLE001
      cls = None
  if cls is None:
    raise harness.Unsupported("probjax.ops.attention.triton.ForwardConfig does not exist")
  dpa, mod = impls.probjax_api()
  for fn in (dpa, getattr(mod, "flex_attention", None), getattr(mod, "mha", None)):
    if fn is None:
      continue
    for kw in ("forward_config", "config", "fwd_config"):
      if kw in _params(fn):
        return cls, fn, kw
  raise harness.Unsupported("no probjax entry point takes a forward config (forward_config=)")


def _params(fn):
  import inspect
  try:
    return inspect.signature(fn).parameters
  except (TypeError, ValueError):
    return {}


def auto_config_description(dtype, head_dim, t):
  """Best effort: the forward config the kernel picks with default tiles."""
  try:
    from probjax.ops.attention.triton import config as C
    cfg = C.fit_forward_config(None, impls.jnp_dtype(dtype), head_dim, t, t, C.device_kind())
    return "bq{}_bk{}_s{}_w{}".format(cfg.block_q, cfg.block_k, cfg.num_stages, cfg.num_warps)
  except Exception as e:  # noqa: BLE001
    return f"unknown ({type(e).__name__}: {str(e)[:100]})"


def tile_case(args, dtype, d, t, b, h, cfg, timing):
  variant = "auto" if cfg is None else "bq{}_bk{}_s{}_w{}".format(*cfg)
  extra = {"config": "auto" if cfg is None else dict(zip(("block_q", "block_k", "num_stages",
                                                          "num_warps"), cfg))}

  def run():
    arrays = impls.inputs(b, t, t, h, h, d)
    if cfg is None:
      fn, sync = impls.build("probjax_triton", arrays, dtype, False, "fwd")
      res = harness.time_fn(fn, sync, **timing)
      desc = auto_config_description(dtype, d, t)
      if desc:
        res["auto_config"] = desc
      return res
    cls, entry, kw = forward_config_api()
    bq, bk, st, nw = cfg
    conf = cls(block_q=bq, block_k=bk, num_warps=nw, num_stages=st)
    import jax
    import jax.numpy as jnp
    q, k, v = (jnp.asarray(a, impls.jnp_dtype(dtype)) for a in arrays[:3])
    call_kw = {kw: conf}
    if "implementation" in _params(entry):
      call_kw["implementation"] = "triton"
    f = jax.jit(lambda q, k, v: entry(q, k, v, **call_kw))
    try:
      return harness.time_fn(lambda: f(q, k, v), jax.block_until_ready, **timing)
    finally:
      impls.free_memory()

  return harness.Case(suite="tiles", impl="probjax_triton", dtype=dtype, batch=b, q_heads=h,
                      kv_heads=h, q_len=t, kv_len=t, head_dim=d, causal=False, mode="fwd",
                      run=run, variant=variant, extra=extra)


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  harness.add_common_args(p)
  p.add_argument("--dtypes", default="bf16,fp32")
  p.add_argument("--head-dims", default="64,128")
  p.add_argument("--length", type=int, default=4096)
  args = p.parse_args(argv)
  timing = harness.timing_kwargs(args)
  cases = []
  if args.quick:
    combos = [("float32", 16, 64, 1, 2, [None, (32, 32, 1, 4)])]
  else:
    combos = []
    for dt in args.dtypes.split(","):
      for d in map(int, args.head_dims.split(",")):
        cfgs = [None] + list(itertools.product(BLOCKS_Q, BLOCKS_K, STAGES, WARPS))
        combos.append((harness.DTYPE_NAMES[dt], d, args.length, 4, 8, cfgs))
  for dtype, d, t, b, h, cfgs in combos:
    for cfg in cfgs:
      cases.append(tile_case(args, dtype, d, t, b, h, cfg, timing))
  harness.run_cases(cases, args)


if __name__ == "__main__":
  sys.exit(main())
