"""Times torch's CPU scaled_dot_product_attention on inputs saved as .npy.

Runs in its own interpreter (e.g. .torchenv/bin/python, which may be a different Python
than the JAX venv, without JAX); it loads only ``probjax/core/timing.py`` (standard library
only), so that torch is timed exactly as the JAX rows are.

  python bench/torch_cpu_worker.py DIR '{"dtype": "float32", "causal": false,
      "mode": "fwd_bwd", "warmup": 1, "repeats": 5, "min_repeat_s": 0.0}'

DIR holds q.npy, k.npy, v.npy, do.npy in [B, T, H, D]; torch gets [B, H, T, D].
Prints one JSON line: {"timing": {...}, "torch": version, "threads": n} (``timing``:
``probjax.core.timing.time_fn``'s result) or {"error": "..."}.
"""
import json
import os
import sys


def _timing():
  """probjax.core.timing from this checkout: it and what it imports (``probjax.core.config``)
  need only the standard library, and ``import probjax`` loads nothing else eagerly, so this
  interpreter needs no JAX."""
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  if root not in sys.path:
    sys.path.insert(0, root)
  from probjax.core import timing
  return timing


def main():
  d, spec = sys.argv[1], json.loads(sys.argv[2])
  try:
    import numpy as np
    import torch
    dt = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[spec["dtype"]]
    q, k, v, do = (torch.from_numpy(np.load(os.path.join(d, f"{n}.npy"))).to(dt).transpose(1, 2).contiguous()
                   for n in ("q", "k", "v", "do"))
    kw = {"is_causal": bool(spec["causal"])}
    if q.shape[1] != k.shape[1]:
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
    res = _timing().time_fn(fn, lambda _x: None, warmup=spec.get("warmup", 1), repeats=spec.get("repeats", 5),
                            min_repeat_s=spec.get("min_repeat_s", 0.0))
    print(json.dumps({"timing": res, "torch": torch.__version__, "threads": torch.get_num_threads()}))
  except Exception as e:  # noqa: BLE001
    print(json.dumps({"error": f"{type(e).__name__}: {e}"}))


if __name__ == "__main__":
  main()
