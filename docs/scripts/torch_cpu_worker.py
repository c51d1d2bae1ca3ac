"""Times torch's CPU scaled_dot_product_attention on inputs saved as .npy.

Runs in its own interpreter (e.g. .torchenv/bin/python, which may be a
different Python than the JAX venv); imports nothing from probjax or jax.

  python docs/scripts/torch_cpu_worker.py DIR '{"dtype": "float32", "causal": false,
      "mode": "fwd_bwd", "warmup": 1, "repeats": 5, "min_repeat_s": 0.0}'

DIR holds q.npy, k.npy, v.npy, do.npy in [B, T, H, D]; torch gets [B, H, T, D].
Prints one JSON line: {"times_ms": [...], "torch": version, "threads": n} or
{"error": "..."}.
"""
import json
import math
import os
import sys
import time


def main():
  d, spec = sys.argv[1], json.loads(sys.argv[2])
  try:
    import numpy as np
    import torch
    dt = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[spec["dtype"]]
    q, k, v, do = (torch.from_numpy(np.load(os.path.join(d, f"{n}.npy"))).to(dt).transpose(1, 2).contiguous()
                   for n in ("q", "k", "v", "do"))
    gqa = q.shape[1] != k.shape[1]
    kw = {"is_causal": bool(spec["causal"])}
    if gqa:
      kw["enable_gqa"] = True
    F = torch.nn.functional
    if spec["mode"] == "fwd":
      def fn():
        with torch.no_grad():
          return F.scaled_dot_product_attention(q, k, v, **kw)
    else:
      for t in (q, k, v):
        t.requires_grad_(True)

      def fn():
        out = F.scaled_dot_product_attention(q, k, v, **kw)
        return torch.autograd.grad(out, (q, k, v), do)
    t0 = time.perf_counter()
    fn()
    first = time.perf_counter() - t0
    for _ in range(spec.get("warmup", 1)):
      fn()
    t0 = time.perf_counter()
    fn()
    one = max(time.perf_counter() - t0, 1e-7)
    n = int(max(1, math.ceil(spec.get("min_repeat_s", 0.0) / one)))
    times = []
    for _ in range(spec.get("repeats", 5)):
      t0 = time.perf_counter()
      for _ in range(n):
        fn()
      times.append((time.perf_counter() - t0) / n * 1e3)
    print(json.dumps({"times_ms": times, "calls_per_repeat": n, "first_call_s": first,
                      "torch": torch.__version__, "threads": torch.get_num_threads()}))
  except Exception as e:  # noqa: BLE001
    print(json.dumps({"error": f"{type(e).__name__}: {e}"}))


if __name__ == "__main__":
  main()
