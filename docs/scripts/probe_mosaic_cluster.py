"""The Mosaic forward with CTA pairs sharing K/V tiles by TMA multicast (``cluster=2``) against
single CTAs, with and without persistence (sm_90 only).

  python -m docs.scripts.probe_mosaic_cluster --output docs/benchmarks/mosaic_cluster.json

bf16 B4 H8, head_dim 64 and 128, T 4096, 8192 and 16384, no mask and causal:
``MosaicForwardConfig(64, 128, 2, 2, persistent, cluster=cluster)`` for both settings of
each (causal: persistent only, the default), and jax.nn's cuDNN forward on the same inputs,
one after the other per shape. Forward ms (wall) and kernel ms (``device_ms``); rows are
written as they are measured.
"""

from __future__ import annotations

import sys

from docs.scripts import harness, impls

SHAPES = ((4, 8, 4096), (4, 8, 8192), (4, 8, 16384))


def main(argv=None):
  args, out = harness.probe_start("probe_mosaic_cluster", __doc__, argv)
  from probjax.ops.attention import masks as M
  from probjax.ops.attention import mosaic_gpu as pm
  if out is None:
    return 0
  for causal in (False, True):
    mask = M.CausalMask() if causal else None
    for b, h, t in SHAPES:
      for d in (64, 128):
        x = impls.inputs(b, t, t, h, h, d)
        row = dict(batch=b, heads=h, t=t, d=d, causal=causal)
        for persistent in ((True,) if causal else (False, True)):
          for cluster in (1, 2):
            cfg = pm.MosaicForwardConfig(64, 128, 2, 2, persistent, cluster=cluster)
            attn = lambda q, k, v, cfg=cfg: pm.attention(q, k, v, mask=mask, forward_config=cfg)
            fn, sync = impls._jax_fn(attn, x, "bfloat16", "fwd")
            r = harness.time_fn(fn, sync, device_time=True)
            harness.probe_add(out, args.output, dict(impl="probjax_mosaic", **row, persistent=persistent,
                                                     cluster=cluster, ms=r.get("ms"), device_ms=r.get("device_ms")))
        fn, sync = impls.build("jaxnn_cudnn", x, "bfloat16", causal, "fwd")
        r = harness.time_fn(fn, sync, device_time=True)
        harness.probe_add(out, args.output, dict(impl="jaxnn_cudnn", **row, ms=r.get("ms"),
                                                 device_ms=r.get("device_ms")))
  return 0


if __name__ == "__main__":
  sys.exit(main())
