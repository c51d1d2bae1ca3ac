"""CPU attention timings (suite "cpu") and XLA compile-time memory (suite "cpu_memory").

  JAX_PLATFORMS=cpu python -m bench.benchmark_kernel_attn_cpu --device cpu
      # -> bench/results/cpu/cpu.json and cpu_memory.json

(The spec's module name ``benchmark_kernel_attn-cpu`` is not importable with a
hyphen; this is the same suite.) fp32, batch 1, 8 heads, head_dim 64: the
probjax default and implementation="xla" against jax.nn.dot_product_attention
(implementation="xla") and torch's CPU scaled_dot_product_attention
(``torch_cpu``) on the same inputs and cotangents. torch runs in its own
interpreter (--torch-python; default ``.torchenv/bin/python`` if present, else
this interpreter if it has torch): the inputs are saved as .npy in a temporary
folder and bench/torch_cpu_worker.py times them. Without torch the
torch_cpu rows are "unsupported" with a note.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

from bench import harness, impls

JAX_IMPLS = ("probjax_default", "probjax_xla", "jaxnn_xla")
TORCHENV_HINT = ("create it with: python3 -m venv .torchenv && "
                 ".torchenv/bin/pip install torch==2.13.0 numpy")


def find_torch_python(explicit: str | None) -> tuple[str | None, str]:
  if explicit:
    return explicit, "given by --torch-python"
  cand = os.path.join(harness.ROOT, ".torchenv", "bin", "python")
  if os.path.exists(cand):
    return cand, ".torchenv"
  try:
    import importlib.util
    if importlib.util.find_spec("torch") is not None:
      return sys.executable, "this interpreter"
  except Exception:  # noqa: BLE001
    pass
  return None, "no torch found (.torchenv absent, torch not importable); " + TORCHENV_HINT


def torch_cpu_case(args, dtype, b, h, hk, tq, tk, d, causal, mode, timing, torch_py, note, suite="cpu"):
  extra = {"torch_python": note}

  def run():
    if torch_py is None:
      raise harness.Unsupported(note)
    if not os.path.exists(torch_py):
      raise harness.Unsupported(f"torch interpreter {torch_py} does not exist; " + TORCHENV_HINT)
    arrays = impls.inputs(b, tq, tk, h, hk, d)
    with tempfile.TemporaryDirectory() as tmp:
      import numpy as np
      for n, a in zip(("q", "k", "v", "do"), arrays):
        np.save(os.path.join(tmp, f"{n}.npy"), a)
      spec = {"dtype": dtype, "causal": causal, "mode": mode, "warmup": timing["warmup"],
              "repeats": timing["repeats"], "min_repeat_s": timing["min_repeat_s"]}
      worker = os.path.join(os.path.dirname(os.path.abspath(__file__)), "torch_cpu_worker.py")
      p = subprocess.run([torch_py, worker, tmp, json.dumps(spec)], capture_output=True, text=True,
                         timeout=args.child_timeout)
    lines = [l for l in p.stdout.splitlines() if l.startswith("{")]
    if not lines:
      return {"status": "error", "error": f"torch worker failed: {p.stderr[-1500:]}"}
    r = json.loads(lines[-1])
    if "error" in r:
      status, _ = harness.classify_error(RuntimeError(r["error"]))
      return {"status": status, "error": r["error"]}
    return dict(r["timing"], torch_version=r["torch"], torch_threads=r["threads"])

  return harness.Case(suite=suite, impl="torch_cpu", dtype=dtype, batch=b, q_heads=h, kv_heads=hk,
                      q_len=tq, kv_len=tk, head_dim=d, causal=causal, mode=mode, run=run,
                      extra=extra)


def cpu_cases(args, torch_py, note):
  timing = harness.timing_kwargs(args)
  if not args.quick:
    timing.update(min_repeat_s=0.0)  # calls last 10 ms .. seconds; 5 repeats of 1+ call
  if args.quick:
    shapes = [(64, False, ("fwd", "fwd_bwd"))]
    b, h, d = 1, 2, 16
  else:
    b, h, d = 1, 8, 64
    lengths = [int(x) for x in args.lengths.split(",") if x]
    shapes = [(t, False, ("fwd", "fwd_bwd")) for t in lengths] + [(4096, True, ("fwd_bwd",))]
  cases = []
  for t, causal, modes in shapes:
    for mode in modes:  # the JAX implementations, then torch in its own interpreter
      cases += impls.timed_cases("cpu", JAX_IMPLS, [impls.shape("float32", b, h, h, t, t, d, causal, mode)], timing)
      cases.append(torch_cpu_case(args, "float32", b, h, h, t, t, d, causal, mode, timing,
                                  torch_py, note))
  return cases


def memory_cases(args):
  b, h, d = (1, 2, 16) if args.quick else (1, 8, 64)
  lengths = (64,) if args.quick else (1024, 2048, 4096, 8192, 16384, 32768)
  cases = []
  for t in lengths:
    for impl in JAX_IMPLS:
      cases.append(impls.memory_case("cpu_memory", impl, "float32", b, h, h, t, d, _memory_and_host_ram))
  return cases


def _memory_and_host_ram(impl, arrays, dtype) -> dict:
  out = impls.fwd_bwd_memory(impl, arrays, dtype)
  try:
    out["host_ram_bytes"] = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
  except (ValueError, OSError, AttributeError):
    pass
  return out


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  harness.add_common_args(p)
  p.add_argument("--device", default="cpu", choices=("cpu",))
  p.add_argument("--suite", default="cpu,cpu_memory")
  p.add_argument("--lengths", default="512,1024,2048,4096")
  p.add_argument("--torch-python", default=None, help="interpreter with torch for the torch_cpu rows")
  p.add_argument("--child-timeout", type=float, default=600)
  p.set_defaults(repeats=5, warmup=1)
  args = p.parse_args(argv)
  torch_py, note = find_torch_python(args.torch_python)
  print(f"[cpu] torch side: {torch_py or 'none'} ({note})", file=sys.stderr)
  cases = harness.select_cases(args.suite, {"cpu": lambda: cpu_cases(args, torch_py, note),
                                            "cpu_memory": lambda: memory_cases(args)})
  harness.run_cases(cases, args)
  return 0


if __name__ == "__main__":
  sys.exit(main())
