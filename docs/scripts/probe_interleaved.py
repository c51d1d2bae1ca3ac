"""The default, jax.nn cuDNN and torch SDPA cuDNN timed in one process, in alternation (sm_90).

  python -m docs.scripts.probe_interleaved --output docs/benchmarks/interleaved_probe.json

The grid times torch in its own process after the JAX side; the same cuDNN kernel then
measured 9% apart (B4 H8 T4096 D128 forward: jax.nn 0.447 ms, torch 0.411) where one
process gave 2% (``dispatch_gap.json``). Here, per shape (bf16 B4 H8, T 3000 and 4096 or ``--lengths``,
head_dim 64 and 128, causal or not, forward and forward+backward), every implementation is
timed once per round, in a rotated order, for ``--rounds`` rounds; a row holds each round's
median ms and their median. Rows are written as they are measured.
"""

from __future__ import annotations

import statistics
import sys

from docs.scripts import harness, impls

IMPLS = ("probjax_default", "jaxnn_cudnn", "torch_sdpa_cudnn")


def shapes(lengths=(4096, 3000)):
  for t in lengths:
    for d in (64, 128):
      for causal in (False, True):
        for mode in ("fwd", "fwd_bwd"):
          yield t, d, causal, mode


def main(argv=None):
  def add_args(ap):
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--lengths", default="4096,3000")
  args, out = harness.probe_start("probe_interleaved", __doc__, argv, add_args)
  if out is None:
    return 0
  for t, d, causal, mode in shapes(tuple(map(int, args.lengths.split(",")))):
    arrays = impls.inputs(4, t, t, 8, 8, d)
    fns = {impl: impls.build(impl, arrays, "bfloat16", causal, mode) for impl in IMPLS}
    rounds = {impl: [] for impl in IMPLS}
    for r in range(args.rounds):
      order = IMPLS[r % len(IMPLS):] + IMPLS[:r % len(IMPLS)]
      for impl in order:
        fn, sync = fns[impl]
        rounds[impl].append(harness.time_fn(fn, sync, repeats=5)["ms"])
    for impl in IMPLS:
      harness.probe_add(out, args.output, dict(impl=impl, batch=4, heads=8, t=t, d=d, causal=causal, mode=mode,
                                               ms=statistics.median(rounds[impl]), round_ms=rounds[impl]))
    impls.free_memory()
  return 0


if __name__ == "__main__":
  sys.exit(main())
