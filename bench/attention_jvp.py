"""GPU benchmark of forward-mode AD through attention (``jax.jvp``).

Implementations (``--impls``, default all), each the primal and tangent of one call:
  fused        the Triton backend's fused forward + JVP kernel (backends/triton/jvp.py),
               ``implementation="triton"`` under ``jax.jvp``
  xla_tangent  the Triton backend with the tangent from the exact XLA formulation's jvp (the
               path before the fused kernel; also what a ``score_mod`` call takes)
  jax_nn       ``jax.jvp`` of ``jax.nn.dot_product_attention(implementation="xla")``
  two_fwd      two Triton forward calls, the floor a fused jvp can approach
  mosaic       the Mosaic GPU backend's fused forward + JVP kernel (backends/mosaic_gpu/jvp.py),
               ``implementation="mosaic"`` under ``jax.jvp`` (sm_90; head_dim 64 and 128)
Cases: B4 H8, D64 and D128, T 1024 to 16384 (``--lengths``), causal and not, bfloat16.

Rows: one JSON object per line in ``bench/results/<device>/attention_jvp.json`` (``--output``):
the median/p10/p90 milliseconds per call (``probjax.core.timing.time_fn``), the compiled
program's temporary memory (``temp_bytes``), the device's peak bytes in use after the row,
the device, versions, commit and command line; a failure (out of memory, a refusal) is a row
with its status.

GPU: ``python -m bench.attention_jvp``; CPU smoke (tiny shapes, interpret mode):
``python -m bench.attention_jvp --cpu-smoke --output /tmp/attention_jvp_smoke.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import jax
import jax.numpy as jnp

from bench import harness
from probjax.core import timing
from probjax.ops import attention
from probjax.ops.attention import masks
from probjax.ops.attention.autodiff import with_forward_mode

IMPLS = ("fused", "xla_tangent", "jax_nn", "two_fwd", "mosaic")


def _triton(causal: bool, interpret: bool):
  mask = masks.CausalMask() if causal else None
  return lambda q, k, v: attention.flex_attention(q, k, v, mask=mask, implementation="triton", interpret=interpret)


def build(impl: str, causal: bool, interpret: bool):
  """A jitted ``f(q, k, v, qd, kd, vd)`` returning the output and its tangent."""
  triton = _triton(causal, interpret)
  if impl == "mosaic":
    mask = masks.CausalMask() if causal else None
    mosaic = lambda q, k, v: attention.flex_attention(q, k, v, mask=mask, implementation="mosaic",
                                                      interpret=interpret)
    return jax.jit(lambda q, k, v, qd, kd, vd: jax.jvp(mosaic, (q, k, v), (qd, kd, vd)))
  if impl == "fused":
    return jax.jit(lambda q, k, v, qd, kd, vd: jax.jvp(triton, (q, k, v), (qd, kd, vd)))
  if impl == "xla_tangent":
    mask = masks.CausalMask() if causal else None
    exact = lambda q, k, v, m: attention.flex_attention(q, k, v, mask=m, implementation="xla")
    f = with_forward_mode(lambda q, k, v, m: triton(q, k, v), exact)
    return jax.jit(lambda q, k, v, qd, kd, vd: jax.jvp(lambda q, k, v: f(q, k, v, mask), (q, k, v), (qd, kd, vd)))
  if impl == "jax_nn":
    nn = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="xla")
    return jax.jit(lambda q, k, v, qd, kd, vd: jax.jvp(nn, (q, k, v), (qd, kd, vd)))
  return jax.jit(lambda q, k, v, qd, kd, vd: (triton(q, k, v), triton(qd, kd, vd)))


def measure(impl, b, h, t, d, causal, interpret, meta) -> dict:
  keys = jax.random.split(jax.random.key(0), 6)
  args = [jax.random.normal(kk, (b, t, h, d), jnp.bfloat16) for kk in keys]
  row = dict(meta, suite="attention_jvp", impl=impl, batch=b, heads=h, seq=t, head_dim=d, causal=causal,
             dtype="bfloat16")
  try:
    fn = build(impl, causal, interpret)
    compiled = fn.lower(*args).compile()
    mem = compiled.memory_analysis()
    row["temp_bytes"] = None if mem is None else int(mem.temp_size_in_bytes)
    res = harness.time_fn(lambda: fn(*args), jax.block_until_ready)
    row.update(status="ok", ms=res["ms"], p10_ms=res.get("p10_ms"), p90_ms=res.get("p90_ms"))
    stats = jax.devices()[0].memory_stats() or {}
    row["peak_bytes_in_use"] = stats.get("peak_bytes_in_use")
  except Exception as e:  # noqa: BLE001 (a failure is a row)
    row.update(status=timing.classify_error(e)[0], error=f"{type(e).__name__}: {e}"[:2000])
  return row


def main(argv=None) -> None:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--impls", default=",".join(IMPLS))
  p.add_argument("--lengths", default="1024,2048,4096,8192,16384")
  p.add_argument("--head-dims", default="64,128")
  p.add_argument("--output", default=None)
  p.add_argument("--cpu-smoke", action="store_true", help="tiny shapes, kernels in interpret mode")
  args = p.parse_args(argv)
  device = jax.devices()[0]
  if not args.cpu_smoke and device.platform != "gpu":
    sys.exit("bench/attention_jvp.py times GPUs; pass --cpu-smoke to run tiny shapes on this device")
  b, h = (1, 2) if args.cpu_smoke else (4, 8)
  lengths = [40] if args.cpu_smoke else [int(x) for x in args.lengths.split(",")]
  dims = [16] if args.cpu_smoke else [int(x) for x in args.head_dims.split(",")]
  output = args.output or harness.results_file("attention_jvp")
  os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
  meta = dict(device=device.device_kind, platform=device.platform, versions=timing.library_versions(),
              commit=timing.code_commit(), interpret=args.cpu_smoke,
              command=" ".join([os.path.basename(sys.executable), "-m", "bench.attention_jvp", *sys.argv[1:]]))
  with open(output, "w") as f:
    for d in dims:
      for t in lengths:
        for causal in (False, True):
          for impl in args.impls.split(","):
            row = measure(impl, b, h, t, d, causal, args.cpu_smoke, meta)
            row["timestamp"] = time.strftime("%Y-%m-%dT%H:%M:%S")
            print(json.dumps({k: row.get(k) for k in ("impl", "seq", "head_dim", "causal", "status", "ms",
                                                      "temp_bytes")}))
            f.write(json.dumps(row) + "\n")
            f.flush()


if __name__ == "__main__":
  main()
