"""Chosen implementations timed in one process, in rotating rounds (suite "interleaved").

  python -m bench.interleaved --lengths 4096 --head-dims 64,128 \\
      --impls probjax_default,probjax_cudnn,jaxnn_cudnn,torch_sdpa_cudnn   # -> bench/results/<device>/interleaved.json

The grid times torch in a process of its own after the JAX side; callers of the same cuDNN
kernel then differ by more than the 2% a dispatch rule is judged by, because clocks and
power throttling follow what ran just before. Here every implementation of ``--impls`` is
built once per shape (bf16, ``--batch`` x ``--heads``, T in ``--lengths``, ``--head-dims``,
``--causal``, ``--modes``, a benchmark ``--mask`` such as ``docs4`` or ``window512``) and
timed once per round in a rotated order for ``--rounds`` rounds (the harness's rounds: a
row's ``ms`` is the median of its rounds' medians, ``round_ms`` each round's). The way to
re-measure a dispatch rule between two implementations; an implementation that fails gets
its status and error in its row.
"""

from __future__ import annotations

import argparse
import sys

from bench import harness, impls

IMPLS = ("probjax_default", "jaxnn_cudnn", "torch_sdpa_cudnn")
CAUSAL = {"both": (False, True), "false": (False,), "true": (True,)}
MASK_IS_CAUSAL = ("window512", "docs4_causal", "softcap30")


def cases(args) -> list[harness.Case]:
  timing = harness.timing_kwargs(args)
  ints = lambda s: tuple(int(x) for x in str(s).split(",") if x)
  if args.quick:
    dtype, shapes, names = "float32", [(1, 2, 64, 16, False, "fwd")], ("probjax_default", "jaxnn_xla")
  else:
    dtype, names = "bfloat16", tuple(x for x in args.impls.split(",") if x)
    shapes = [(args.batch, args.heads, t, d, c, mode) for t in ints(args.lengths) for d in ints(args.head_dims)
              for c in CAUSAL[args.causal] for mode in args.modes.split(",") if mode]
  return impls.timed_cases("interleaved", names, [
      impls.shape(dtype, b, h, h, t, t, d, causal or args.mask in MASK_IS_CAUSAL, mode, mask=args.mask)
      for b, h, t, d, causal, mode in shapes], timing)


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  harness.add_common_args(p)
  p.add_argument("--lengths", default="4096,3000")
  p.add_argument("--head-dims", default="64,128")
  p.add_argument("--causal", default="both", choices=sorted(CAUSAL))
  p.add_argument("--modes", default="fwd,fwd_bwd")
  p.add_argument("--impls", default=",".join(IMPLS))
  p.add_argument("--batch", type=int, default=4)
  p.add_argument("--heads", type=int, default=8)
  p.add_argument("--mask", default="none", help="a benchmark mask name (bench.impls.MASKS)")
  p.set_defaults(rounds=3)
  args = p.parse_args(argv)
  harness.run_cases(cases(args), args)
  return 0


if __name__ == "__main__":
  sys.exit(main())
