"""The default attention under automatic sharding on two GPUs, against one GPU.

  python -m docs.scripts.probe_sharding --output docs/benchmarks/sharding_probe.json

Per shape (bf16, ``--batch`` 8 x ``--heads`` 8 at T4096: unmasked D128 on the cuDNN route,
causal D64, packed documents ``docs4`` D128 on the Mosaic/Triton kernels) and mode (fwd,
fwd+bwd), each implementation of ``--impls`` is timed with its inputs on one GPU ("one"), and
sharded over two GPUs along the batch ("batch") and along the heads ("heads"), in ``--rounds``
rotating rounds. A row holds the median ms, the speedup over "one" and the all-gathers in the
compiled program (0: every GPU ran the kernels on its own shard,
``probjax.ops.attention.sharding``). jax.nn's cuDNN call, which has its own partitioning rules,
is the peer where it takes the mask. Needs two GPUs.
"""

from __future__ import annotations

import statistics
import sys

from docs.scripts import harness, impls

SHAPES = ((4096, 128, False, "none"), (4096, 64, True, "none"), (4096, 128, False, "docs4"))
SETTINGS = ("one", "batch", "heads")


def build(impl, arrays, causal, mode, mask, setting, mesh):
  """``(fn, sync, all-gathers in the compiled program)`` with the inputs placed per ``setting``."""
  import jax
  import jax.numpy as jnp
  from jax.sharding import NamedSharding, PartitionSpec as P
  b, t = arrays[0].shape[:2]
  if impl == "jaxnn_cudnn":
    if mask != "none":
      raise harness.Unsupported("jax.nn's cuDNN call takes no segment ids")
    attn = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="cudnn")
  else:
    mask_obj, is_causal = impls.probjax_mask(mask, causal, b, t, t)
    attn = impls.probjax_attn(impl, is_causal, mask_obj)
  spec = {"one": None, "batch": P("x"), "heads": P(None, None, "x")}[setting]
  put = (lambda a: jax.device_put(a, jax.devices()[0])) if spec is None else (
      lambda a: jax.device_put(a, NamedSharding(mesh, spec)))
  q, k, v, do = (put(jnp.asarray(a, jnp.bfloat16)) for a in arrays)
  if mode == "fwd":
    f, args = jax.jit(attn), (q, k, v)
  else:
    f, args = jax.jit(lambda q, k, v, do: (lambda o, vjp: (o, *vjp(do)))(*jax.vjp(attn, q, k, v))), (q, k, v, do)
  gathers = f.lower(*args).compile().as_text().count("all-gather")
  return (lambda: f(*args)), jax.block_until_ready, gathers


def main(argv=None):
  def add_args(ap):
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--impls", default="probjax_default,jaxnn_cudnn")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--heads", type=int, default=8)
  args, out = harness.probe_start("probe_sharding", __doc__, argv, add_args)
  if out is None:
    return 0
  import jax
  import numpy as np
  from jax.sharding import Mesh
  if len(jax.devices()) < 2:
    print("[probe] needs two GPUs: nothing measured", flush=True)
    out["skipped"] = "needs two GPUs"
    harness.probe_add(out, args.output, {"status": "unsupported", "error": "needs two GPUs"})
    return 0
  mesh = Mesh(np.array(jax.devices()[:2]), ("x",))
  for t, d, causal, mask in SHAPES:
    arrays = impls.inputs(args.batch, t, t, args.heads, args.heads, d)
    for mode in ("fwd", "fwd_bwd"):
      fns, failed = {}, {}
      for impl in args.impls.split(","):
        for setting in SETTINGS:
          try:
            fns[impl, setting] = build(impl, arrays, causal, mode, mask, setting, mesh)
          except Exception as e:  # noqa: BLE001 (recorded as the row's status)
            failed[impl, setting] = harness.classify_error(e)
      rounds = {key: [] for key in fns}
      for order in harness.rotations(list(fns), args.rounds):
        for key in order:
          if key in failed:
            continue
          fn, sync, _ = fns[key]
          try:
            rounds[key].append(harness.time_fn(fn, sync, repeats=5)["ms"])
          except Exception as e:  # noqa: BLE001
            failed[key] = harness.classify_error(e)
      for impl, setting in list(fns) + [k for k in failed if k not in fns]:
        row = dict(impl=impl, setting=setting, batch=args.batch, heads=args.heads, t=t, d=d, causal=causal,
                   mask=mask, mode=mode)
        if (impl, setting) in failed:
          row.update(ms=None, status=failed[impl, setting][0], error=failed[impl, setting][1])
        else:
          ms = statistics.median(rounds[impl, setting])
          one = rounds.get((impl, "one"))
          row.update(ms=ms, round_ms=rounds[impl, setting], all_gathers=fns[impl, setting][2],
                     speedup=statistics.median(one) / ms if one else None)
        harness.probe_add(out, args.output, row)
      fns.clear()
      impls.free_memory()
  return 0


if __name__ == "__main__":
  sys.exit(main())
