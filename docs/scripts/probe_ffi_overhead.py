"""Per-executable overhead of the cuDNN route: one attention call per jitted program against
eight independent calls in one program, and torch's call of the same cuDNN kernel (sm_90).

  python -m docs.scripts.probe_ffi_overhead --output docs/benchmarks/ffi_overhead_probe.json

bf16 B4 H8 T4096, head_dim 64 and 128, forward. If the eight-call program runs each call in the
kernel's time while the one-call program does not, the difference is per program (dispatch),
not per call. Rows: ms per attention call, rounds rotated as in probe_interleaved; then, per
head_dim, the attention kernel's launch as torch's profiler records it (grid, block, shared
memory, registers) for torch's call and probjax's, the device address of their output modulo
4096 (buffer placement), and the GPU's busy and idle time per call over 64 back-to-back calls
(after the first).
"""

from __future__ import annotations

import statistics
import sys

from docs.scripts import harness, impls

K = 8
CALLS = 64  # back-to-back calls in the launch profile


def jax_fns(d, implementation):
  import jax
  import jax.numpy as jnp
  from probjax.nn.layers.attention import dot_product_attention
  arrays = [impls.inputs(4, 4096, 4096, 8, 8, d, seed=i) for i in range(K)]
  qkv = [tuple(jnp.asarray(a, jnp.bfloat16) for a in arr[:3]) for arr in arrays]
  if implementation == "jaxnn":
    attn = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, implementation="cudnn")
  else:
    attn = lambda q, k, v: dot_product_attention(q, k, v, implementation="cudnn")
  one = jax.jit(attn)
  many = jax.jit(lambda xs: [attn(*x) for x in xs])
  return {f"{implementation}_one": ((lambda: one(*qkv[0])), 1),
          f"{implementation}_x{K}_one_program": ((lambda: many(qkv)), K)}


def torch_fns(d):
  torch = impls.torch_mod()
  arrays = [impls.inputs(4, 4096, 4096, 8, 8, d, seed=i) for i in range(K)]
  qkv = [tuple(torch.from_numpy(a).to("cuda", torch.bfloat16).transpose(1, 2).contiguous() for a in arr[:3])
         for arr in arrays]
  from torch.nn.attention import SDPBackend, sdpa_kernel
  def call(xs):
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
      return [torch.nn.functional.scaled_dot_product_attention(*x) for x in xs]
  return {"torch_sdpa_cudnn_one": ((lambda: call(qkv[:1])), 1), f"torch_sdpa_cudnn_x{K}": ((lambda: call(qkv)), K)}


def launch(fn, torch) -> dict:
  """The attention kernel's launch attributes in torch's profiler trace, and the addresses of the
  call's first input and output modulo 4096."""
  import json
  import os
  import tempfile
  from torch.profiler import ProfilerActivity, profile
  with profile(activities=[ProfilerActivity.CUDA]) as prof:
    for _ in range(CALLS):
      res = fn()
    torch.cuda.synchronize()
  path = os.path.join(tempfile.mkdtemp(), "trace.json")
  prof.export_chrome_trace(path)
  events = json.load(open(path))["traceEvents"]
  gpu = sorted((e for e in events if e.get("cat") in ("kernel", "gpu_memset", "gpu_memcpy")), key=lambda e: e["ts"])
  kernels = [e for e in gpu if e.get("cat") == "kernel" and "sdpa" in e.get("name", "")]
  # the idle time before each GPU operation after the first call's (us)
  idle = [e["ts"] - (p["ts"] + p["dur"]) for p, e in zip(gpu[1:-1], gpu[2:])]
  ops = dict(calls=CALLS, operations=len(gpu), busy_us_per_call=sum(e["dur"] for e in gpu[2:]) / (CALLS - 1),
             idle_us_per_call=sum(idle) / (CALLS - 1), max_idle_us=max(idle, default=None),
             idles_over_10us=sum(i > 10 for i in idle))
  out = res[0] if isinstance(res, (list, tuple)) else res
  ptr = out.data_ptr() if hasattr(out, "data_ptr") else out.unsafe_buffer_pointer()
  return dict(kernel=kernels[0]["name"][:90] if kernels else None,
              args={k: v for k, v in (kernels[0].get("args", {}) if kernels else {}).items()
                    if k in ("grid", "block", "shared memory", "registers per thread", "blocks per SM",
                             "warps per SM", "est. achieved occupancy %")},
              out_address_mod_4096=ptr % 4096, dur_us=kernels[0].get("dur") if kernels else None,
              ops=ops)


def main(argv=None):
  def add_args(ap):
    ap.add_argument("--rounds", type=int, default=3)
  args, out = harness.probe_start("probe_ffi_overhead", __doc__, argv, add_args)
  if out is None:
    return 0
  import jax
  torch = impls.torch_mod()
  for d in (64, 128):
    fns = {**jax_fns(d, "probjax"), **jax_fns(d, "jaxnn"), **torch_fns(d)}
    rounds = {name: [] for name in fns}
    for order in harness.rotations(list(fns), args.rounds):
      for name in order:
        fn, k = fns[name]
        sync = (lambda _x: torch.cuda.synchronize()) if name.startswith("torch") else jax.block_until_ready
        rounds[name].append(harness.time_fn(fn, sync, repeats=7)["ms"] / k)
    for name in fns:
      harness.probe_add(out, args.output, dict(case=name, d=d, ms_per_call=statistics.median(rounds[name]),
                                               round_ms=rounds[name]))
    for name in ("torch_sdpa_cudnn_one", "probjax_one"):  # torch's profiler first: it then sees JAX's kernels
      harness.probe_add(out, args.output, dict(case=name, d=d, launch=launch(fns[name][0], torch)))
    impls.free_memory()
  return 0


if __name__ == "__main__":
  sys.exit(main())
