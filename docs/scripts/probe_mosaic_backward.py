"""The Mosaic backward with dQ fused into the dK/dV kernel (``fused_dq``, TMA reduce-add; with
``shared_dq`` one dQ partial per CTA) against its two-kernel form and jax.nn's cuDNN route
(sm_90 only).

  python -m docs.scripts.probe_mosaic_backward --output docs/benchmarks/mosaic_backward.json

bf16 B4 H8, forward + backward (the Mosaic forward before both Mosaic backwards), head_dim
64 and 128, T 3000, 4096 and 8192, no mask and causal; ms (wall) per call, rows written as
they are measured.
"""

from __future__ import annotations

import sys

from docs.scripts import harness, impls

# (fused_dq, shared_dq, registers) per head_dim: two kernels, dQ fused with a partial per
# warpgroup, and (head_dim 128: two slices of 64 columns) one partial per CTA; registers > 0:
# the compute warpgroups' count in every kernel of the call, the Mosaic forward's too (the
# producer keeps 24; default: common.registers).
VARIANTS = {64: ((False, False, 0), (True, False, 0)),
            128: ((False, False, 0), (True, False, 0), (True, True, 0), (True, True, 240))}


def variant_config(pm, d: int, fused: bool, shared: bool):
  """The backward config of a variant: the default tiles for two kernels; for the fused dQ the
  tile sweep's best fused tiles (gpu_attention_tiles.json, 14a595c: 64x64, 2 stages, 2 warpgroups)."""
  if not fused:
    return pm.backward.DEFAULTS[d]
  return pm.MosaicBackwardConfig(64, 64, 2, 2, fused_dq=True, shared_dq=shared)


def compute_registers(n: int):
  """Within: ``n`` registers per compute warpgroup in the Mosaic kernels traced (producer 24);
  ``n == 0``: the default, :func:`probjax.ops.attention.mosaic_gpu.common.registers`."""
  from probjax.ops.attention.mosaic_gpu import common as C
  return harness.patched(C, "registers", (lambda wgs: (n, 24)) if n else None)


def main(argv=None):
  def add_args(ap):
    ap.add_argument("--lengths", default="3000,4096,8192")
    ap.add_argument("--head-dims", default="64,128")
  args, out = harness.probe_start("probe_mosaic_backward", __doc__, argv, add_args)
  from probjax.ops.attention import masks as M
  from probjax.ops.attention import mosaic_gpu as pm
  if out is None:
    return 0
  for t in map(int, args.lengths.split(",")):
    for d in map(int, args.head_dims.split(",")):
      for causal in (False, True):
        x = impls.inputs(4, t, t, 8, 8, d)
        mask = M.CausalMask() if causal else None
        row = dict(batch=4, heads=8, t=t, d=d, causal=causal)
        for fused, shared, regs in VARIANTS[d]:
          bcfg = variant_config(pm, d, fused, shared)
          attn = lambda q, k, v, bcfg=bcfg: pm.attention(q, k, v, mask=mask, backward_pass_impl="mosaic",
                                                         backward_config=bcfg)
          fn, sync = impls._jax_fn(attn, x, "bfloat16", "fwd_bwd")
          with compute_registers(regs):  # traced and compiled on the first call
            sync(fn())
          harness.probe_add(out, args.output, dict(impl="probjax_mosaic_bwd", fused_dq=fused, shared_dq=shared,
                                                   registers=regs or None, **row,
                                                   ms=harness.time_fn(fn, sync)["ms"]))
        fn, sync = impls.build("jaxnn_cudnn", x, "bfloat16", causal, "fwd_bwd")
        harness.probe_add(out, args.output, dict(impl="jaxnn_cudnn", **row, ms=harness.time_fn(fn, sync)["ms"]))
  return 0


if __name__ == "__main__":
  sys.exit(main())
