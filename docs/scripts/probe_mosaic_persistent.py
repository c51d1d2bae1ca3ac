"""Schedules of the Mosaic forward: persistent or one CTA per tile, heaviest tiles first or
not (sm_90 only).

  python -m docs.scripts.probe_mosaic_persistent --output docs/benchmarks/mosaic_schedule.json

bf16, ``MosaicForwardConfig(64, 128, 2, 2, persistent, heavy_first)``: causal at B4 H8 T 2048, 4096
and 16384 and B1 H16 T16384 (the masked suite's shape), head_dim 64 and 128, every
schedule; unmasked, where ``heavy_first`` changes nothing, both ``persistent`` settings.
Forward ms (wall) and kernel ms (``device_ms``). The file records the command, commit and
device with the rows; rows are written as they are measured.
(``mosaic_causal_persistent.json``: this probe's first version, causal without
``heavy_first``, at 526b612.)
"""

from __future__ import annotations

import sys

from docs.scripts import harness, impls

SHAPES = ((4, 8, 2048), (4, 8, 4096), (4, 8, 16384), (1, 16, 16384))


def variants():
  """``(batch, heads, t, d, causal, persistent, heavy_first)`` in measuring order."""
  for b, h, t in SHAPES:
    for d in (64, 128):
      for causal in (True, False):
        if not causal and (b == 1 or t == 2048):
          continue
        for persistent in (False, True):
          for heavy_first in ((False, True) if causal else (True,)):
            yield b, h, t, d, causal, persistent, heavy_first


def main(argv=None):
  args, out = harness.probe_start("probe_mosaic_persistent", __doc__, argv)
  from probjax.ops.attention import masks as M
  from probjax.ops.attention import mosaic_gpu as pm
  if out is None:
    return 0
  for b, h, t, d, causal, persistent, heavy_first in variants():
    cfg = pm.MosaicForwardConfig(64, 128, 2, 2, persistent, heavy_first)
    mask = M.CausalMask() if causal else None
    attn = lambda q, k, v, cfg=cfg, mask=mask: pm.attention(q, k, v, mask=mask, forward_config=cfg)
    fn, sync = impls._jax_fn(attn, impls.inputs(b, t, t, h, h, d), "bfloat16", "fwd")
    r = harness.time_fn(fn, sync, device_time=True)
    harness.probe_add(out, args.output, dict(batch=b, heads=h, t=t, d=d, causal=causal, persistent=persistent,
                                             heavy_first=heavy_first, ms=r.get("ms"), device_ms=r.get("device_ms")))
  return 0


if __name__ == "__main__":
  sys.exit(main())
