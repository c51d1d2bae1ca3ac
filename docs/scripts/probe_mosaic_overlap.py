"""The Mosaic forward with and without ``overlap`` (FA3's intra-warpgroup pipelining: each
step's Q K^T issued with the previous step's P V, the softmax run while P V is in flight),
by ring depth (sm_90 only).

  python -m docs.scripts.probe_mosaic_overlap --output docs/benchmarks/mosaic_overlap.json

bf16 B4 H8, T 3000, 4096 and 16384, head_dim 64 and 128, causal and not, persistent with two
compute warpgroups and block_k 128 (the defaults); ``num_stages`` 2, and 4 at head_dim 64 (at 128
only 2 fit beside the persistent output buffer). Forward ms (wall) and kernel ms (``device_ms``),
each variant of a shape timed one after the other in one process. Rows are written as they
are measured.
"""

from __future__ import annotations

import sys

from docs.scripts import harness, impls


def variants():
  """``(t, d, causal, stages, overlap)`` in measuring order."""
  for t in (4096, 16384, 3000):
    for d in (64, 128):
      for causal in (False, True):
        for stages in ((2, 4) if d == 64 else (2,)):
          for overlap in (False, True):
            yield t, d, causal, stages, overlap


def main(argv=None):
  args, out = harness.probe_start("probe_mosaic_overlap", __doc__, argv)
  from probjax.ops.attention import masks as M
  from probjax.ops.attention import mosaic_gpu as pm
  if out is None:
    return 0
  for t, d, causal, stages, overlap in variants():
    cfg = pm.MosaicForwardConfig(64, 128, stages, 2, True, overlap=overlap)
    mask = M.CausalMask() if causal else None
    attn = lambda q, k, v, cfg=cfg, mask=mask: pm.attention(q, k, v, mask=mask, forward_config=cfg)
    fn, sync = impls._jax_fn(attn, impls.inputs(4, t, t, 8, 8, d), "bfloat16", "fwd")
    r = harness.time_fn(fn, sync, device_time=True)
    harness.probe_add(out, args.output, dict(batch=4, heads=8, t=t, d=d, causal=causal, stages=stages,
                                             overlap=overlap, ms=r.get("ms"), device_ms=r.get("device_ms")))
  return 0


if __name__ == "__main__":
  sys.exit(main())
