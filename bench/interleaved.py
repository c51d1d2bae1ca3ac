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

``--v-head-dim`` gives the values a width of their own (MLA's 192/128): v and dO are the
shared inputs' first columns, rows carry the variant ``dv<width>`` and their FLOPs count
both widths. The default, cuDNN, the Mosaic forward and backward, and the Triton backward
(after the Mosaic or the Triton forward) at B2 H16 T4096 causal, 192/128:

  python -m bench.interleaved --lengths 4096 --head-dims 192 --v-head-dim 128 --causal true \
      --batch 2 --heads 16 --modes fwd,fwd_bwd \
      --impls probjax_default,probjax_cudnn,probjax_mosaic_bwd,probjax_mosaic,probjax_triton
"""

from __future__ import annotations

import argparse
import dataclasses
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
  table = impls.timed_cases("interleaved", names, [
      impls.shape(dtype, b, h, h, t, t, d, causal or args.mask in MASK_IS_CAUSAL, mode, mask=args.mask)
      for b, h, t, d, causal, mode in shapes], timing)
  if args.v_head_dim and not args.quick:
    if args.v_head_dim > min(d for *_, d, _, _ in shapes):
      raise SystemExit(f"--v-head-dim {args.v_head_dim}: the values are the inputs' first columns, at most "
                       "--head-dims' smallest")
    table = [value_width(c, args.v_head_dim, timing) for c in table]
  return table


def value_width(case, dv: int, timing: dict):
  """``case`` (:func:`bench.impls.timed_case`, inputs ``[B, T, H, head_dim]``) with values
  ``dv`` wide: v and dO are the shared inputs' first ``dv`` columns (the output is
  ``[B, T, H, dv]``); the row is keyed by the variant ``dv<dv>`` and its FLOPs are
  ``2 B H Tq Tkv (head_dim + dv)`` (halved for causal, x3.5 with the backward), the
  convention's ``4 B H Tq Tkv D`` with D their mean. A forward row also gets
  ``max_abs_err`` against the float64 reference slice, as :func:`bench.impls.timed_case`'s."""
  def prepare():
    q, k, v, do = impls.inputs(case.batch, case.q_len, case.kv_len, case.q_heads, case.kv_heads, case.head_dim)
    arrays = (q, k, v[..., :dv], do[..., :dv])
    fn, sync = impls.build(case.impl, arrays, case.dtype, case.causal, case.mode, case.mask)

    def finish(res):
      flops = harness.attention_flops(case.batch, case.q_heads, case.q_len, case.kv_len,
                                      (case.head_dim + dv) / 2, case.causal, case.mode)
      res.update(flops=flops, tflops=harness.tflops(flops, res.get("ms")))
      if case.mode == "fwd":
        try:
          import numpy as np
          ref = impls.reference_slice(arrays, case.dtype, case.causal, case.mask)
          res["max_abs_err"] = float(np.max(np.abs(impls.output_slice(case.impl, fn(), ref.shape[0]) - ref)))
        except Exception as e:  # noqa: BLE001
          res["check_error"] = f"{type(e).__name__}: {e}"[:300]
      return res
    return (lambda: harness.time_fn(fn, sync, **timing, backend=harness.backend_of(case.impl))), finish

  return dataclasses.replace(case, run=impls.run_of(prepare), prepare=prepare, variant=f"dv{dv}", flops=False,
                             extra=dict(case.extra, v_head_dim=dv))


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
  p.add_argument("--v-head-dim", type=int, default=None,
                 help="the values' head_dim, at most --head-dims' smallest (default: as wide as queries and keys)")
  p.set_defaults(rounds=3)
  args = p.parse_args(argv)
  harness.run_cases(cases(args), args)
  return 0


if __name__ == "__main__":
  sys.exit(main())
