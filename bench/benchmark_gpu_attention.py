"""Cross-library attention grid (suite "grid") and masked cases (suite "masked").

  python -m bench.benchmark_gpu_attention   # -> bench/results/<device>/grid.json and masked.json

Grid: bf16 and fp32, batch 4, 8 heads, head_dim 64/128, causal and not,
T in {600, 1024, 1500, 2048, 3000, 4096, 8192, 16384}, fwd and fwd_bwd; every
probjax implementation, jax.nn XLA/cuDNN, torch SDPA pinned to each backend,
torch flex_attention (compiled, one compiled entry per shape) and tokamax.
Masked: batch 1, 16 heads, head_dim 128, bf16, T = 16384, masks window512
(causal, 512 keys to the left), docs4 and docs4_causal (4 equal documents).
Split a long sweep with --max-minutes and --append (resumes where it stopped).
"""

from __future__ import annotations

import argparse
import sys

from bench import harness, impls

GRID_LENGTHS = (600, 1024, 1500, 2048, 3000, 4096, 8192, 16384)
PROBJAX_GRID = ("probjax_default", "probjax_xla", "probjax_triton", "probjax_cudnn", "probjax_mosaic",
                "probjax_triton_onepass", "probjax_triton_fused", "probjax_triton_split", "probjax_mosaic_bwd")
BWD_VARIANTS = ("probjax_triton_onepass", "probjax_triton_fused", "probjax_triton_split", "probjax_mosaic_bwd")
PEERS_GRID = ("jaxnn_xla", "jaxnn_cudnn", "tokamax_mosaic", "tokamax_triton", "tokamax_cudnn",
              "torch_sdpa_flash", "torch_sdpa_efficient", "torch_sdpa_cudnn", "torch_sdpa_math",
              "torch_flex")
MASKED_IMPLS = ("probjax_default", "probjax_triton", "probjax_mosaic", "probjax_mosaic_bwd", "torch_flex",
                "jaxnn_cudnn", "tokamax_mosaic", "tokamax_triton")


def _csv(s, conv=str):
  return tuple(conv(x) for x in str(s).split(",") if x)


def grid_cases(args):
  timing = harness.timing_kwargs(args)
  if args.quick:
    dtypes, dims, causals, lengths, modes, batch, heads = ("float32",), (16,), (False,), (64,), \
        ("fwd", "fwd_bwd"), 1, 2
    impl_list = ("probjax_default", "probjax_xla", "jaxnn_xla", "jaxnn_cudnn", "torch_sdpa_flash",
                 "tokamax_triton")
  else:
    dtypes = tuple(harness.DTYPE_NAMES[d] for d in _csv(args.dtypes))
    dims, lengths = _csv(args.head_dims, int), _csv(args.lengths, int)
    causals = tuple({"0": False, "1": True, "false": False, "true": True}[c.lower()]
                    for c in _csv(args.causal))
    modes, batch, heads = _csv(args.modes), args.batch, args.heads
    impl_list = PROBJAX_GRID + PEERS_GRID
  shapes = [impls.shape(dtype, batch, heads, heads, t, t, d, causal, mode) for dtype in dtypes
            for d in dims for causal in causals for t in lengths for mode in modes]
  # a backward variant's forward is probjax_triton's (probjax_mosaic's for the mosaic backward)
  return impls.timed_cases("grid", impl_list, shapes, timing,
                           skip=lambda impl, s: s["mode"] == "fwd" and impl in BWD_VARIANTS)


def masked_cases(args):
  timing = harness.timing_kwargs(args)
  if args.quick:
    shapes = [(1, 2, 64, 16)]
    masks = ("docs4",)
    impl_list = ("probjax_default", "torch_flex")
  else:
    shapes = [(1, 16, 16384, 128)]
    masks = ("window512", "docs4", "docs4_causal", "softcap30")
    impl_list = MASKED_IMPLS
  dtype = "float32" if args.quick else "bfloat16"
  table = [impls.shape(dtype, b, h, h, t, t, d, mask in ("window512", "docs4_causal", "softcap30"), mode,
                       mask=mask) for b, h, t, d in shapes for mask in masks for mode in ("fwd", "fwd_bwd")]

  def skip(impl, s):
    if s["mask"] == "softcap30" and impl == "jaxnn_cudnn":
      return True  # no score modifier in jax.nn
    return s["mask"] not in ("window512", "softcap30") and not (impl.startswith("probjax") or impl == "torch_flex")
  return impls.timed_cases("masked", impl_list, table, timing, skip=skip)


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  harness.add_common_args(p)
  p.add_argument("--suite", default="grid,masked", help="grid, masked (comma-separated)")
  p.add_argument("--dtypes", default="bf16,fp32")
  p.add_argument("--head-dims", default="64,128")
  p.add_argument("--causal", default="0,1")
  p.add_argument("--lengths", default=",".join(map(str, GRID_LENGTHS)))
  p.add_argument("--modes", default="fwd,fwd_bwd")
  p.add_argument("--batch", type=int, default=4)
  p.add_argument("--heads", type=int, default=8)
  args = p.parse_args(argv)
  cases = harness.select_cases(args.suite, {"grid": lambda: grid_cases(args),
                                            "masked": lambda: masked_cases(args)})
  harness.run_cases(cases, args)


if __name__ == "__main__":
  sys.exit(main())
