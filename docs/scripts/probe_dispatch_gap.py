"""Where a JAX call's wall clock exceeds its kernel time (sm_90 probe).

  python -m docs.scripts.probe_dispatch_gap --output docs/benchmarks/dispatch_gap.json

JAX attention rows take ~19 us per call more wall clock than their summed kernel time, torch
SDPA's ~3 us (``device_ms`` rows of gpu_attention.json): at T4096 that is the whole issue-4
gap to torch's cuDNN. This probe separates the candidates, per case and per runtime setting:

* ``launch_ms``: the host's time to return from a call (no sync), per call of a long loop.
  Near ``ms`` means the host is the bottleneck (the call blocks or is slow to enqueue).
* ``idle_us`` / ``max_gap_us``: the device waiting between kernels, from a profile
  (:func:`harness.idle_profile`); ``kernels``: kernels per call; ``by_kernel``: each
  kernel's count and time per call.
* cases: one bf16 4096^3 matmul (no attention at all), 8 dependent matmuls in one jit (the
  per-executable cost amortized), the default, jax.nn cuDNN and the Triton kernel at T4096
  D64 forward, the default and jax.nn cuDNN at T4096 D128 forward+backward, jax.nn cuDNN's
  D128 forwards of :data:`D128_FORWARDS`, and torch's matmul and SDPA cuDNN on the same inputs.
* ``*_hlo.txt`` beside the output: XLA's optimized HLO of the cases that call cuDNN.
* settings (one child process each, JAX cases only for the last two): the suites' allocator
  setting (``XLA_PYTHON_CLIENT_PREALLOCATE=false``), without CUDA graphs
  (``--xla_gpu_enable_command_buffer=``), and JAX's default preallocation.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from docs.scripts import harness, impls

SETTINGS = {
    "suites": {"XLA_PYTHON_CLIENT_PREALLOCATE": "false"},
    "no_command_buffer": {"XLA_PYTHON_CLIENT_PREALLOCATE": "false",
                          "XLA_FLAGS": "--xla_gpu_enable_command_buffer="},
    "preallocate": {"XLA_PYTHON_CLIENT_PREALLOCATE": "true"},
}
N_PROFILE = 40
# Forward-only head_dim 128 cases (T, causal), jax.nn and torch cuDNN: where torch's forward is
# 9-12% faster (gpu_attention.json, 65d300a), whether the two run the same cuDNN kernel.
D128_FORWARDS = ((4096, False), (16384, False), (4096, True))


def _cases(with_torch: bool):
  """(name, backend, fn, sync) for every case of one process."""
  import jax
  import jax.numpy as jnp
  key = jax.random.PRNGKey(0)
  a = jax.random.normal(key, (4096, 4096), jnp.bfloat16)
  b = jax.random.normal(jax.random.fold_in(key, 1), (4096, 4096), jnp.bfloat16) / 64
  mm = jax.jit(lambda a, b: a @ b)

  def chain(a, b):
    for _ in range(8):
      a = a @ b
    return a
  mm8 = jax.jit(chain)
  yield "jax_matmul", "jax", (lambda: mm(a, b)), jax.block_until_ready
  yield "jax_matmul_x8_one_jit", "jax", (lambda: mm8(a, b)), jax.block_until_ready
  arrays = impls.inputs(4, 4096, 4096, 8, 8, 64)
  arrays128 = impls.inputs(4, 4096, 4096, 8, 8, 128)
  for impl in ("probjax_default", "probjax_triton", "probjax_cudnn", "jaxnn_cudnn"):
    fn, sync = impls.build(impl, arrays, "bfloat16", False, "fwd")
    yield f"{impl}_t4096_d64_fwd", "jax", fn, sync
  for impl in ("probjax_default", "probjax_cudnn", "jaxnn_cudnn"):
    fn, sync = impls.build(impl, arrays128, "bfloat16", False, "fwd_bwd")
    yield f"{impl}_t4096_d128_fwd_bwd", "jax", fn, sync
  for t, causal in D128_FORWARDS:
    for impl in ("probjax_cudnn", "jaxnn_cudnn"):
      fn, sync = impls.build(impl, impls.inputs(4, t, t, 8, 8, 128), "bfloat16", causal, "fwd")
      yield f"{impl}_t{t}_d128_fwd" + ("_causal" if causal else ""), "jax", fn, sync
  if not with_torch:
    return
  torch = impls.torch_mod()
  ta = torch.from_numpy(jax.device_get(a).astype("float32")).cuda().to(torch.bfloat16)
  tb = torch.from_numpy(jax.device_get(b).astype("float32")).cuda().to(torch.bfloat16)
  tsync = lambda _x: torch.cuda.synchronize()
  yield "torch_matmul", "torch", (lambda: ta @ tb), tsync
  fn, sync = impls.build("torch_sdpa_cudnn", arrays, "bfloat16", False, "fwd")
  yield "torch_sdpa_cudnn_t4096_d64_fwd", "torch", fn, sync
  fn, sync = impls.build("torch_sdpa_cudnn", arrays128, "bfloat16", False, "fwd_bwd")
  yield "torch_sdpa_cudnn_t4096_d128_fwd_bwd", "torch", fn, sync
  for t, causal in D128_FORWARDS:
    fn, sync = impls.build("torch_sdpa_cudnn", impls.inputs(4, t, t, 8, 8, 128), "bfloat16", causal, "fwd")
    yield f"torch_sdpa_cudnn_t{t}_d128_fwd" + ("_causal" if causal else ""), "torch", fn, sync


def measure(setting: str, with_torch: bool) -> list[dict]:
  rows = []
  for name, backend, fn, sync in _cases(with_torch):
    r = harness.time_fn(fn, sync)
    n = max(50, r["calls_per_repeat"])
    t0 = time.perf_counter()
    out = None
    for _ in range(n):
      out = fn()
    launch = (time.perf_counter() - t0) / n * 1e3
    sync(out)
    prof = harness.idle_profile(harness.kernel_intervals(fn, sync, N_PROFILE, backend), N_PROFILE)
    rows.append(dict(setting=setting, case=name, ms=r["ms"], p10_ms=r["p10_ms"], p90_ms=r["p90_ms"],
                     launch_ms=launch, **prof))
    print(rows[-1], flush=True)
  return rows


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--output", required=True)
  ap.add_argument("--child", choices=sorted(SETTINGS), help=argparse.SUPPRESS)
  ap.add_argument("--settings", default=",".join(SETTINGS),
                  help="comma-separated runtime settings to measure (default: all)")
  args, _ = ap.parse_known_args(argv)
  if args.child:
    rows = measure(args.child, with_torch=args.child == "suites")
    with open(args.output, "w") as f:
      json.dump(rows, f)
    return 0
  out = harness.gpu_probe_head("probe_dispatch_gap", args.output, argv)
  if out is None:
    return 0
  dump = "/tmp/probe_dispatch_gap_hlo"
  for setting in args.settings.split(","):
    env = SETTINGS[setting]
    part = args.output + f".{setting}.part"
    if setting == "suites":  # XLA's optimized HLO of every case: where its Memset kernels come from
      env = {**env, "XLA_FLAGS": f"--xla_dump_to={dump} --xla_dump_hlo_as_text"}
    p = subprocess.run([sys.executable, "-m", "docs.scripts.probe_dispatch_gap", "--output", part,
                        "--child", setting], env={**os.environ, **env}, timeout=300)
    if p.returncode == 0 and os.path.exists(part):
      with open(part) as f:
        out["rows"] += json.load(f)
      os.remove(part)
    else:
      out["rows"].append(dict(setting=setting, status="error", rc=p.returncode))
    with open(args.output, "w") as f:
      json.dump(out, f, indent=1)
  _collect_hlo(dump, os.path.splitext(args.output)[0] + "_hlo.txt")
  return 0


def _collect_hlo(dump: str, path: str) -> None:
  """The optimized HLO modules of ``dump`` that call cuDNN, in one text file."""
  import glob
  with open(path, "w") as out:
    for name in sorted(glob.glob(os.path.join(dump, "*after_optimizations.txt"))):
      with open(name) as f:
        text = f.read()
      if "cudnn" in text:
        out.write(f"===== {os.path.basename(name)}\n{text}\n")


if __name__ == "__main__":
  sys.exit(main())
