"""Grouped-query attention (suite "gqa") and few-query decoding (suite "decode").

  python -m bench.benchmark_kernel_attn_ext --device gpu --suite gqa,decode   # -> bench/results/<device>/gqa.json,
                                                                             #    gqa_memory.json, decode.json
  JAX_PLATFORMS=cpu python -m bench.benchmark_kernel_attn_ext --device cpu --suite decode   # -> bench/results/cpu/decode.json

gqa: 32 query heads, 8 KV heads, head_dim 128, batch 1, Lq = Lkv = T, fwd and
  fwd_bwd: probjax native GQA against the same kernel on K/V repeated to 32
  heads (probjax_repeat_kv), plus peers that take GQA natively; "gqa_memory"
  rows hold XLA's compile-time memory of native vs repeated.
decode: 32 query heads, head_dim 128, 8 or 32 KV heads, Lq in {1, 16}, long KV,
  forward only (bf16 on GPU, fp32 on CPU); probjax_triton picks the split-KV
  forward by itself, probjax_triton_nosplit is the regular forward on the same call.
"""

from __future__ import annotations

import argparse
import sys

from bench import harness, impls

GQA_IMPLS = ("probjax_default", "probjax_repeat_kv", "probjax_triton", "jaxnn_cudnn", "jaxnn_xla",
             "tokamax_mosaic", "torch_sdpa_flash", "torch_sdpa_efficient", "torch_flex")
DECODE_IMPLS = ("probjax_default", "probjax_triton", "probjax_triton_nosplit", "probjax_xla",
                "jaxnn_cudnn", "jaxnn_xla",
                "tokamax_mosaic", "torch_sdpa_flash", "torch_sdpa_efficient")
CPU_IMPLS = ("probjax_default", "probjax_xla", "jaxnn_xla")


def gqa_cases(args):
  timing = harness.timing_kwargs(args)
  if args.quick:
    dtype, b, hq, hk, d, lengths, impl_list = "float32", 1, 4, 2, 16, (64,), \
        ("probjax_default", "probjax_repeat_kv", "jaxnn_xla")
  else:
    dtype = "float32" if args.device == "cpu" else harness.DTYPE_NAMES[args.dtype]
    b, hq, hk, d = 1, 32, 8, 128
    lengths = (1024, 2048, 4096, 8192, 16384) if args.device == "gpu" else (512, 1024, 2048)
    impl_list = GQA_IMPLS if args.device == "gpu" else CPU_IMPLS + ("probjax_repeat_kv",)
  cases = []
  for t in lengths:
    cases += impls.timed_cases("gqa", impl_list, [impls.shape(dtype, b, hq, hk, t, t, d, False, mode)
                                                  for mode in ("fwd", "fwd_bwd")], timing)
    for impl in ("probjax_default", "probjax_repeat_kv"):
      cases.append(impls.memory_case("gqa_memory", impl, dtype, b, hq, hk, t, d, impls.fwd_bwd_memory))
  return cases


def decode_cases(args):
  timing = harness.timing_kwargs(args)
  if args.quick:
    combos = [("float32", 1, 4, 2, 16, 1, 256)]
    impl_list = ("probjax_default", "jaxnn_xla")
  else:
    if args.device == "gpu":
      dtype, batches, lqs, lkvs, impl_list = harness.DTYPE_NAMES[args.dtype], (1, 8), (1, 16), \
          (8192, 65536), DECODE_IMPLS
    else:
      dtype, batches, lqs, lkvs, impl_list = "float32", (1,), (1, 16), (4096, 16384), CPU_IMPLS
    combos = [(dtype, b, 32, hk, 128, lq, lkv) for hk in (8, 32) for b in batches
              for lkv in lkvs for lq in lqs]
    if args.device == "gpu":  # a cache whose length is not a multiple of the kernel's tiles
      combos += [(dtype, 8, 32, 8, 128, lq, 65000) for lq in lqs]
  return impls.timed_cases("decode", impl_list, [impls.shape(dtype, b, hq, hk, lq, lkv, d, False, "fwd")
                                                 for dtype, b, hq, hk, d, lq, lkv in combos], timing)


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  harness.add_common_args(p)
  p.add_argument("--device", default="gpu", choices=("gpu", "cpu"))
  p.add_argument("--suite", default="gqa,decode")
  p.add_argument("--dtype", default="bf16")
  args = p.parse_args(argv)
  cases = harness.select_cases(args.suite, {"gqa": lambda: gqa_cases(args),
                                            "decode": lambda: decode_cases(args)})
  harness.run_cases(cases, args)
  return 0


if __name__ == "__main__":
  sys.exit(main())
