"""Implementations timed in one process, in alternation (sm_90).

  python -m docs.scripts.probe_interleaved --output docs/benchmarks/interleaved_probe.json

The grid times torch in its own process after the JAX side; the same cuDNN kernel then
measured 9% apart (B4 H8 T4096 D128 forward: jax.nn 0.447 ms, torch 0.411) where one
process gave 2% (``dispatch_gap.json``). Here, per shape (bf16 B4 H8, T 3000 and 4096 or
``--lengths``, ``--head-dims``, ``--causal``, ``--modes``; ``--batch``/``--heads`` and a benchmark
``--mask`` such as ``docs4`` or ``window512`` for the masked suite's rows), every implementation of ``--impls``
(default: the default, jax.nn cuDNN and torch SDPA cuDNN; issue 3's rows: ``probjax_triton,
torch_flex,torch_sdpa_flash``) is timed once per round, in a rotated order, for ``--rounds``
rounds; a row holds each round's median ms and their median. An implementation that fails
(to build or to run) gets a row with ``ms`` None and the harness's status and error instead of
ending the probe. Rows are written as they are measured.
"""

from __future__ import annotations

import statistics
import sys

from docs.scripts import harness, impls

IMPLS = ("probjax_default", "jaxnn_cudnn", "torch_sdpa_cudnn")
CAUSAL = {"both": (False, True), "false": (False,), "true": (True,)}


def shapes(lengths=(4096, 3000), head_dims=(64, 128), causal=(False, True), modes=("fwd", "fwd_bwd")):
  for t in lengths:
    for d in head_dims:
      for c in causal:
        for mode in modes:
          yield t, d, c, mode


def main(argv=None):
  def add_args(ap):
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--lengths", default="4096,3000")
    ap.add_argument("--head-dims", default="64,128")
    ap.add_argument("--causal", default="both", choices=sorted(CAUSAL))
    ap.add_argument("--modes", default="fwd,fwd_bwd")
    ap.add_argument("--impls", default=",".join(IMPLS))
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--mask", default="none", help="a benchmark mask name (impls.probjax_mask)")
    ap.add_argument("--differenced", action="store_true", help="harness.time_fn's differenced timing")
  args, out = harness.probe_start("probe_interleaved", __doc__, argv, add_args)
  if out is None:
    return 0
  names = tuple(args.impls.split(","))
  ints = lambda s: tuple(map(int, s.split(",")))
  for t, d, causal, mode in shapes(ints(args.lengths), ints(args.head_dims), CAUSAL[args.causal],
                                   tuple(args.modes.split(","))):
    arrays = impls.inputs(args.batch, t, t, args.heads, args.heads, d)
    fns, failed = {}, {}  # failed: impl -> (status, error) of harness.classify_error
    for impl in names:
      try:
        fns[impl] = impls.build(impl, arrays, "bfloat16", causal, mode, args.mask)
      except Exception as e:  # noqa: BLE001 (recorded as the row's status, as the suites do)
        failed[impl] = harness.classify_error(e)
    rounds = {impl: [] for impl in fns}
    for order in harness.rotations(list(fns), args.rounds):
      for impl in order:
        if impl in failed:  # failed in an earlier round
          continue
        fn, sync = fns[impl]
        try:
          rounds[impl].append(harness.time_fn(fn, sync, repeats=5, differenced=args.differenced)["ms"])
        except Exception as e:  # noqa: BLE001
          failed[impl] = harness.classify_error(e)
    for impl in names:
      row = dict(impl=impl, batch=args.batch, heads=args.heads, t=t, d=d, causal=causal, mode=mode, mask=args.mask,
                 timing="differenced" if args.differenced else "plain")
      if impl in failed:
        row.update(ms=None, status=failed[impl][0], error=failed[impl][1])
      else:
        row.update(ms=statistics.median(rounds[impl]), round_ms=rounds[impl])
      harness.probe_add(out, args.output, row)
    impls.free_memory()
  return 0


if __name__ == "__main__":
  sys.exit(main())
