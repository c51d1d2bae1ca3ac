"""Persistent against one-CTA-per-tile Mosaic forward with a causal mask (sm_90 only).

  python -m docs.scripts.probe_mosaic_persistent --output docs/benchmarks/mosaic_causal_persistent.json

bf16 B4 H8, T 4096 and 16384, head_dim 64 and 128, ``MosaicForwardConfig(64, 128, 2, 2,
persistent)``; forward ms (wall) and kernel ms where the profile gives it. The file records
the command, commit and device with the rows.
"""

from __future__ import annotations

import argparse
import json
import sys

from docs.scripts import harness, impls


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--output", required=True)
  args = ap.parse_args(argv)
  from probjax.ops.attention import masks as M
  from probjax.ops.attention import mosaic_gpu as pm
  out = harness.gpu_probe_head("probe_mosaic_persistent", args.output, argv)
  if out is None:
    return 0
  for t in (4096, 16384):
    for d in (64, 128):
      for persistent in (False, True):
        cfg = pm.MosaicForwardConfig(64, 128, 2, 2, persistent)
        attn = lambda q, k, v, cfg=cfg: pm.attention(q, k, v, mask=M.CausalMask(), forward_config=cfg)
        fn, sync = impls._jax_fn(attn, impls.inputs(4, t, t, 8, 8, d), "bfloat16", "fwd")
        r = harness.time_fn(fn, sync, device_time=True)
        out["rows"].append(dict(t=t, d=d, persistent=persistent, ms=r.get("ms"), device_ms=r.get("device_ms")))
        print(out["rows"][-1], flush=True)
        with open(args.output, "w") as f:
          json.dump(out, f, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main())
