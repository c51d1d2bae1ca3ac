"""Shared memory of the RLA Triton kernels on sm_90, measured on a machine without a GPU.

Lowers :func:`probjax.ops.scan.backends.triton.rla.forward` and ``backward`` for CUDA on the
CPU, keeps each kernel's Triton IR with its launch's warps and stages, and compiles it with the
official Triton compiler (``tools/triton_smem.py --compile`` under an interpreter with the
``triton`` package) for a ``cuda:90`` target; prints each kernel's shared memory beside
:func:`probjax.ops.scan.backends.triton.rla.smem_bytes`, the estimate. The constants of
``test_rla_triton_smem.py`` come from here::

  .venv/bin/python tests/ops/scan/rla_triton_smem_probe.py --triton-python /tmp/ttenv/bin/python \\
      --dtype float32 --features 128 --v-head-dim 128 --groups 4 --chunk 64

(not a test module: pytest collects ``test_*.py`` only).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def measure(dtype: str, features: int, v_head_dim: int, groups: int, chunk: int, triton_python: str,
            batch: int = 2, length: int = 300, kv_heads: int = 2, stages: int | None = None):
  """``{kernel name: (warps, stages, shared bytes)}`` of one call's four kernels.
  ``stages``: the grads/output kernels' stages instead of the launch's (what-if probes)."""
  import jax
  import jax.numpy as jnp
  from jax._src import gpu_info
  from jax._src.pallas.triton import lowering, pallas_call_registration as reg
  from probjax.ops.scan.backends.triton import rla

  gpu_info.get_gpu_info = lambda: gpu_info.get_gpu_info_from_version(gpu_info.GpuVersion.H200)
  tmp = tempfile.mkdtemp(prefix="probjax_rla_ttir_")
  files = []
  lower = lowering.lower_jaxpr_to_triton_module

  def keep(*args, **kw):
    r = lower(*args, **kw)
    caller = sys._getframe(1).f_locals  # pallas_call_lowering's launch parameters
    text = r.module.operation.get_asm(enable_debug_info=False)
    name = re.search(r"module @(\w+)", text).group(1)
    path = os.path.join(tmp, f"{len(files)}_{name}.ttir")
    with open(path, "w") as f:
      f.write(text)
    st = caller["num_stages"]
    if stages is not None and "states" not in name:
      st = stages
    files.append((path, caller["num_warps"], st, name))
    return r

  reg.lowering.lower_jaxpr_to_triton_module = keep
  try:
    dt = jnp.dtype(dtype)
    h = kv_heads * groups
    q = jax.ShapeDtypeStruct((batch, length, h, features), dt)
    k = jax.ShapeDtypeStruct((batch, length, kv_heads, features), dt)
    v = jax.ShapeDtypeStruct((batch, length, kv_heads, v_head_dim), dt)
    s0 = jax.ShapeDtypeStruct((batch, kv_heads, features, v_head_dim), jnp.float32)

    def fb(q, k, v, s0):
      o, final, hs = rla.forward(q, k, v, s0, chunk=chunk, out_dtype=dt, interpret=False)
      return rla.backward(q, k, v, hs, o, final, chunk=chunk, dv_dtype=dt, interpret=False)

    jax.jit(fb).trace(q, k, v, s0).lower(lowering_platforms=("cuda",))
  finally:
    reg.lowering.lower_jaxpr_to_triton_module = lower
  res = subprocess.run([triton_python, os.path.join(ROOT, "tools", "triton_smem.py"), "--compile",
                        json.dumps([f[:3] for f in files])], check=True, capture_output=True, text=True)
  shared = json.loads(res.stdout.strip().splitlines()[-1])
  return {f[3]: (f[1], f[2], s) for f, s in zip(files, shared)}


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--triton-python", required=True, help="an interpreter with the official triton package")
  ap.add_argument("--dtype", default="float32")
  ap.add_argument("--features", type=int, default=128)
  ap.add_argument("--v-head-dim", type=int, default=128)
  ap.add_argument("--groups", type=int, default=4)
  ap.add_argument("--chunk", type=int, default=64)
  ap.add_argument("--stages", type=int, default=None)
  a = ap.parse_args()
  sys.path.insert(0, ROOT)
  out = measure(a.dtype, a.features, a.v_head_dim, a.groups, a.chunk, a.triton_python, stages=a.stages)
  from probjax.ops.scan.backends.triton import rla
  model = rla.smem_bytes(a.dtype, a.features, a.v_head_dim, a.chunk)
  for name, (warps, stages, s) in out.items():
    m = model[name]
    print(f"{a.dtype} F{a.features} Dv{a.v_head_dim} G{a.groups} C{a.chunk} {name:28s} warps {warps} "
          f"stages {stages}: shared {s:7d} model {m}")


if __name__ == "__main__":
  sys.exit(main())
