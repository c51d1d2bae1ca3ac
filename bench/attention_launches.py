"""The kernels one differentiated default attention call launches, at the LM step's attention
shape (B8 T2048 H12 D64, causal, bf16): ``bench.harness.kernel_intervals`` over 10 calls of the
jitted forward and of forward + backward (``jax.vjp``), with the default's decision and the
count of custom calls in the compiled forward + backward (GPU only).

  python -m bench.attention_launches --output bench/results/<device>/attention_launches.json

It tells a kernel that runs twice per layer in the LM step (``bench/lm_step.py``'s
``top_kernels``) from one that a single call launches twice.
"""

from __future__ import annotations

import argparse
import json
import sys

import jax
import jax.numpy as jnp

from bench.harness import command_line, kernel_intervals, kernel_summary
from probjax.core.timing import device_info
from probjax.ops.attention import dot_product_attention, explain_dispatch
from probjax.ops.attention.masks import CausalMask

SHAPE = (8, 2048, 12, 64)


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--output", required=True)
  p.add_argument("--calls", type=int, default=10)
  args = p.parse_args(argv)
  if jax.default_backend() != "gpu":
    raise SystemExit("bench.attention_launches profiles GPU kernels: run it on a GPU")
  q, k, v, do = (jax.random.normal(kk, SHAPE, jnp.bfloat16) for kk in jax.random.split(jax.random.key(0), 4))
  f = lambda q, k, v: dot_product_attention(q, k, v, mask=CausalMask())
  fwd = jax.jit(f)
  fwd_bwd = jax.jit(lambda q, k, v, do: jax.vjp(f, q, k, v)[1](do))
  info = device_info()
  row = dict(suite="attention_launches", case="B8_T2048_H12_D64_causal_bf16",
             decision=str(explain_dispatch(q.shape, k.shape, q.dtype, mask=CausalMask())),
             device=info["device"], versions=info["versions"], commit=info["commit"], command=command_line(),
             status="ok")
  for name, fn in (("fwd", lambda: fwd(q, k, v)), ("fwd_bwd", lambda: fwd_bwd(q, k, v, do))):
    jax.block_until_ready(fn())
    row[name] = kernel_summary(kernel_intervals(fn, jax.block_until_ready, args.calls, "jax"), args.calls)
  row["hlo_custom_calls_fwd_bwd"] = fwd_bwd.lower(q, k, v, do).compile().as_text().count("custom_call_target")
  with open(args.output, "w") as out:
    out.write(json.dumps(row) + "\n")
  print(json.dumps({k: row[k] for k in ("decision", "hlo_custom_calls_fwd_bwd")}))
  return 0


if __name__ == "__main__":
  sys.exit(main())
