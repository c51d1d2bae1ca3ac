"""The Mosaic forward's intra-warpgroup overlap, and a register fence before its wgmmas (sm_90).

  python -m docs.scripts.probe_mosaic_overlap --output docs/benchmarks/mosaic_overlap_fence.json

With a masked loop compiled in, ptxas serializes every wgmma of the overlapped kernel (C7513,
``mosaic_ptxas_overlap.json``) and causal forwards run 38-55% slower than without overlap.
Hypothesis: the previous step's rescale of the accumulator lands between the fence of the
first wgmma and the second, defining the second's input registers inside its pipeline stage.
Variant "fenced" passes the accumulator and P through ``lax.optimization_barrier`` (a
side-effecting asm, as FA3's register fence) before each overlapped step issues its wgmmas
(:func:`fenced`, patched in while the call is traced). Per shape (bf16 B4 H8, ``--lengths``,
head_dim 64 and 128, causal or not, forward), the default config with overlap off / on /
fenced is timed in rotating rounds in one process; ``probe_mosaic_ptxas`` takes the same
fence (its cases' fifth field) for the C7513 check.
"""

from __future__ import annotations

import statistics
import sys

from docs.scripts import harness, impls

VARIANTS = ("off", "on", "fenced")


def fenced(on: bool = True):
  """Within: each overlapped step passes its accumulator and P through an optimization
  barrier before issuing its two wgmmas (``common.mma_overlap`` patched)."""
  from jax import lax
  from probjax.ops.attention.mosaic_gpu import common as C
  orig = C.mma_overlap

  def mma_overlap(acc, a, b, *args, **kw):
    acc, a = lax.optimization_barrier((acc, a))
    return orig(acc, a, b, *args, **kw)
  return harness.patched(C, "mma_overlap", mma_overlap if on else None)


def main(argv=None):
  def add_args(ap):
    ap.add_argument("--lengths", default="4096,16384")
    ap.add_argument("--rounds", type=int, default=3)
  args, out = harness.probe_start("probe_mosaic_overlap", __doc__, argv, add_args)
  if out is None:
    return 0
  # The default Mosaic config of each call with overlap off / on (impls.mosaic_overlap_config).
  builds = {"off": "probjax_mosaic_no_overlap", "on": "probjax_mosaic_overlap", "fenced": "probjax_mosaic_overlap"}
  for t in map(int, args.lengths.split(",")):
    for d in (64, 128):
      for causal in (False, True):
        x = impls.inputs(4, t, t, 8, 8, d)
        fns = {}
        for v in VARIANTS:
          fn, sync = impls.build(builds[v], x, "bfloat16", causal, "fwd")
          with fenced(v == "fenced"):  # traced and compiled on the first call
            sync(fn())
          fns[v] = (fn, sync)
        rounds = {v: [] for v in VARIANTS}
        for order in harness.rotations(VARIANTS, args.rounds):
          for v in order:
            rounds[v].append(harness.time_fn(*fns[v], repeats=5)["ms"])
        for v in VARIANTS:
          harness.probe_add(out, args.output, dict(variant=v, batch=4, heads=8, t=t, d=d, causal=causal,
                                                   ms=statistics.median(rounds[v]), round_ms=rounds[v]))
        impls.free_memory()
  return 0


if __name__ == "__main__":
  sys.exit(main())
