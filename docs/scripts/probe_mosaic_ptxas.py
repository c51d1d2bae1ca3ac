"""ptxas's register and spill report for the Mosaic GPU forward kernels, and with
``--bwd-cases`` the backward's (sm_90 only).

  python -m docs.scripts.probe_mosaic_ptxas --output docs/benchmarks/mosaic_ptxas.json

Compiles the forward (bf16, B4 H8 T4096) for each head_dim, mask (none, causal) and
persistent setting in a child process with ``MOSAIC_GPU_DUMP_PTXAS=1`` (ptxas writes to
the process's stdout) and records ptxas's lines on registers, spill stores/loads, stack
frames and wgmma serialization warnings. ``--dump DIR``: each case's PTX and SASS too, in
``DIR/<case>.log.gz`` (``MOSAIC_GPU_DUMP_PTX``/``_SASS``: the child's whole output). One JSON object per case; a case that does not compile records its error.
"""

from __future__ import annotations

import gzip
import json
import os
import re
import subprocess
import sys

CHILD = r"""
import jax, jax.numpy as jnp
from probjax.ops.attention import mosaic_gpu as pm
from probjax.ops.attention import masks as M
d, causal, persistent, overlap = {d}, {causal}, {persistent}, {overlap}
cfg = pm.MosaicForwardConfig(64, 128, 2, 2, persistent, overlap=overlap)
x = jax.ShapeDtypeStruct((4, 4096, 8, d), jnp.bfloat16)
f = lambda q, k, v: pm.attention(q, k, v, mask=M.CausalMask() if causal else None, forward_config=cfg)
jax.jit(f).trace(x, x, x).lower().compile()
print("PROBE-DONE", flush=True)
"""

# The backward with dQ fused (``--bwd-cases``): forward and dK/dV kernel compiled together;
# ``regs`` > 0 sets the compute warpgroups' registers (``probe_mosaic_backward.compute_registers``).
CHILD_BWD = r"""
import jax, jax.numpy as jnp
from probjax.ops.attention import mosaic_gpu as pm
from docs.scripts.probe_mosaic_backward import compute_registers, variant_config
d, fused, shared, regs = {d}, {fused}, {shared}, {regs}
bcfg = variant_config(pm, d, fused, shared)
x = jax.ShapeDtypeStruct((4, 4096, 8, d), jnp.bfloat16)
f = lambda q, k, v: jnp.sum(pm.attention(q, k, v, backward_pass_impl="mosaic", backward_config=bcfg))
with compute_registers(regs):
  jax.jit(jax.grad(f, argnums=(0, 1, 2))).trace(x, x, x).lower().compile()
print("PROBE-DONE", flush=True)
"""


def probe(d: int, causal: bool, persistent: bool, dump: str | None = None, child: str | None = None,
          overlap: bool = False) -> dict:
  env = dict(os.environ, MOSAIC_GPU_DUMP_PTXAS="1")
  if dump:
    env.update(MOSAIC_GPU_DUMP_PTX="1", MOSAIC_GPU_DUMP_SASS="1")
  child = child or CHILD.format(d=d, causal=causal, persistent=persistent, overlap=overlap)
  p = subprocess.run([sys.executable, "-c", child], env=env, capture_output=True, text=True, timeout=300)
  if dump:
    os.makedirs(os.path.dirname(dump), exist_ok=True)
    with gzip.open(dump + ".log.gz", "wt") as f:
      f.write(p.stdout + p.stderr)
  lines = [l.strip() for l in (p.stdout + p.stderr).splitlines()
           if re.search(r"registers|spill|stack frame|Compiling entry|ptxas.*serializ", l)]
  row = {"head_dim": d, "causal": causal, "persistent": persistent, "overlap": overlap,
         "ok": "PROBE-DONE" in p.stdout,
         "ptxas": lines}
  if not row["ok"]:
    row["error"] = (p.stderr or p.stdout)[-1500:]
  return row


def main(argv=None):
  from docs.scripts import harness
  def add_args(ap):
    ap.add_argument("--cases", default="64:0:0,64:1:0,128:0:0,128:1:0,64:0:1,128:0:1",
                    help="head_dim:causal:persistent[:overlap], comma-separated")
    ap.add_argument("--bwd-cases", default="",
                    help="backward cases head_dim:fused_dq:shared_dq:registers, comma-separated")
    ap.add_argument("--dump", help="a folder for each case's PTX and SASS")
  args, out = harness.probe_start("probe_mosaic_ptxas", __doc__, argv, add_args)
  if out is None:
    return 0
  rows = out["rows"]
  for case in filter(None, args.cases.split(",")):
    d, causal, persistent, overlap = (int(v) for v in (case + ":0").split(":")[:4])
    dump = args.dump and os.path.join(args.dump, case.replace(":", "_"))
    row = probe(d, bool(causal), bool(persistent), dump, overlap=bool(overlap))
    rows.append(row)
    print(f"[ptxas] {case}: " + " | ".join(row["ptxas"])[:600], flush=True)
    with open(args.output, "w") as f:  # after every case: a cut-short run keeps what it has
      json.dump(out, f, indent=1)
  for case in filter(None, args.bwd_cases.split(",")):
    d, fused, shared, regs = (int(v) for v in case.split(":"))
    dump = args.dump and os.path.join(args.dump, "bwd_" + case.replace(":", "_"))
    row = probe(d, False, False, dump, CHILD_BWD.format(d=d, fused=bool(fused), shared=bool(shared), regs=regs))
    row.update(kernel="backward", fused_dq=bool(fused), shared_dq=bool(shared), registers=regs or None)
    rows.append(row)
    print(f"[ptxas] bwd {case}: " + " | ".join(row["ptxas"])[:900], flush=True)
    with open(args.output, "w") as f:
      json.dump(out, f, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main())
