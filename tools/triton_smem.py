"""Shared memory of the Triton attention kernels on sm_90, measured on a machine without a GPU.

Lowers a probjax Triton attention call (forward and backward, default tiles for sm_90) with
Pallas on CPU, keeps each kernel's Triton IR, and compiles it with the official Triton
compiler for a ``cuda:90`` target, which needs no GPU; prints the shared memory each kernel
requests beside the byte model of ``config.py`` and the device's 232,448. The official
compiler is not the one inside XLA, so its numbers can differ by a little from a GPU's error
message (the one-pass backward with a mask_mod at 64 x 128 tiles, 3 stages: 279,576 here,
280,600 on an H100); a kernel well under the limit here fits there.

The Triton compiler lives in its own interpreter (``pip install triton`` into any venv; it is
no dependency of probjax)::

  .venv/bin/python tools/triton_smem.py --triton-python /tmp/ttenv/bin/python \\
      --impl triton_onepass --mask-mod --shape 2,1000,1500,8,2,128
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile

LIMIT = 232448  # sm_90 shared memory per block


def _compile(files_json: str) -> None:
  """Runs under the Triton interpreter: ``[(path, warps, stages)]`` -> shared bytes each."""
  os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
  import triton
  from triton.backends.compiler import GPUTarget
  out = []
  for path, warps, stages in json.loads(files_json):
    k = triton.compile(path, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps, num_stages=stages))
    out.append(k.metadata.shared)
  print(json.dumps(out))


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--triton-python", help="an interpreter with the official triton package")
  ap.add_argument("--impl", default="triton_onepass")
  ap.add_argument("--mask-mod", action="store_true", help="a MaskMod sliding window & KVLenMask")
  ap.add_argument("--shape", default="2,1000,1500,8,2,128", help="batch,q_len,kv_len,heads,kv_heads,head_dim")
  ap.add_argument("--dtype", default="bfloat16")
  ap.add_argument("--compile", help=argparse.SUPPRESS)
  a = ap.parse_args()
  if a.compile:
    return _compile(a.compile)

  import jax
  import jax.numpy as jnp
  from jax._src.pallas.triton import lowering
  from probjax.ops.attention.backends import triton as pt
  from probjax.ops.attention.backends.triton import config as cfg
  from probjax.ops.attention.masks import KVLenMask, MaskMod

  from probjax.testing import pretend_h200

  class _ForTheRun:  # pretend_h200 takes pytest's monkeypatch; this script patches for its whole run
    setattr = staticmethod(setattr)

  pretend_h200(_ForTheRun())
  pt.supports = lambda *args, **kw: None
  cfg.kernel_device = lambda interpret: "sm_90"
  b, tq, tk, h, hkv, d = map(int, a.shape.split(","))
  dtype = jnp.dtype(a.dtype)
  q = jax.ShapeDtypeStruct((b, tq, h, d), dtype)
  kv = jax.ShapeDtypeStruct((b, tk, hkv, d), dtype)
  mask = None
  if a.mask_mod:
    mask = MaskMod(lambda b_, h_, i, j: (j <= i + tk // 3) & (i + tk // 3 - j < tk // 6 + 64 * h_),
                   heads=h) & KVLenMask(jnp.array([tk] * (b - 1) + [max(1, tk * 4 // 5)]))
  _, fc, impl, bc = pt._configs(q, kv, kv, None, None, a.impl, False, mask is not None)
  print(f"forward {fc}\nbackward {impl} {bc}")

  tmp = tempfile.mkdtemp(prefix="probjax_ttir_")
  files = []
  lower = lowering.lower_jaxpr_to_triton_module

  def keep(*args, **kw):
    r = lower(*args, **kw)
    text = r.module.operation.get_asm(enable_debug_info=False)
    name = re.search(r"module @(\w+)", text).group(1)
    c = fc if "_fwd" in name else bc
    path = os.path.join(tmp, f"{len(files)}_{name}.ttir")
    with open(path, "w") as f:
      f.write(text)
    files.append((path, c.num_warps, c.num_stages, name))
    return r

  lowering.lower_jaxpr_to_triton_module = keep

  def loss(q, k, v):
    out = pt.attention(q, k, v, mask=mask, backward_pass_impl=impl)
    return jnp.sum(out.astype(jnp.float32))

  jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(q, kv, kv).lower(lowering_platforms=("cuda",))
  if not a.triton_python:
    print("\n".join(f[0] for f in files))
    return
  res = subprocess.run([a.triton_python, __file__, "--compile", json.dumps([f[:3] for f in files])],
                       check=True, capture_output=True, text=True)
  shared = json.loads(res.stdout.strip().splitlines()[-1])
  isz = dtype.itemsize
  for (_, warps, stages, name), s in zip(files, shared):
    model = (fc.smem_bytes(isz, d, mask_mod=mask is not None) if "_fwd" in name else
             bc.smem_bytes(isz, d, onepass=impl == "triton_onepass", mask_mod=mask is not None))
    print(f"{name:40s} warps {warps} stages {stages}: shared {s:7d} (model {model}, limit {LIMIT})"
          f"{'' if s <= LIMIT else '  OVER'}")


if __name__ == "__main__":
  sys.exit(main())
