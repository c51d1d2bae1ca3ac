"""torch's attention at MLA's expanded widths (q/k head_dim 192, values 128), in its own process:
SDPA with each backend forced (cuDNN, flash, memory-efficient) and torch.compile'd flex_attention,
bf16, causal and not, forward and forward + backward (gradients of q, k, v).

  python bench/torch_mla_worker.py '{"cases": [[2, 16, 4096, 192, 128]], "repeats": 7}'

Prints one JSON line per (case, causal, mode, backend): ``{"case": [...], "causal", "mode",
"impl", "status", "timing" | "error"}``; bench/mla.py turns them into rows beside its own."""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # run as a script, beside its sibling
from torch_cpu_worker import _timing  # noqa: E402


def _runner(torch, impl, q, k, v, causal):
  F = torch.nn.functional
  if impl == "torch_flex":
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    t = q.shape[2]
    block = create_block_mask(lambda b, h, qi, ki: qi >= ki, None, None, t, t) if causal else None
    flex = torch.compile(flex_attention)
    return lambda q, k, v: flex(q, k, v, block_mask=block)
  from torch.nn.attention import SDPBackend, sdpa_kernel
  backend = {"torch_sdpa_cudnn": SDPBackend.CUDNN_ATTENTION, "torch_sdpa_flash": SDPBackend.FLASH_ATTENTION,
             "torch_sdpa_efficient": SDPBackend.EFFICIENT_ATTENTION}[impl]

  def run(q, k, v):
    with sdpa_kernel(backend):
      return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
  return run


def main():
  spec = json.loads(sys.argv[1])
  import torch
  timing = _timing()
  sync = lambda _x: torch.cuda.synchronize()
  for b, h, t, d, dv in spec["cases"]:
    g = torch.Generator(device="cuda").manual_seed(0)
    mk = lambda w: torch.randn(b, h, t, w, device="cuda", generator=g, dtype=torch.bfloat16)
    q, k, v, do = mk(d), mk(d), mk(dv), mk(dv)
    for causal in (False, True):
      for mode in ("fwd", "fwd_bwd"):
        for impl in ("torch_sdpa_cudnn", "torch_sdpa_flash", "torch_sdpa_efficient", "torch_flex"):
          row = dict(case=[b, h, t, d, dv], causal=causal, mode=mode, impl=impl)
          try:
            run = _runner(torch, impl, q, k, v, causal)
            if mode == "fwd":
              def fn():
                with torch.no_grad():
                  return run(q, k, v)
            else:
              qg, kg, vg = (x.detach().requires_grad_(True) for x in (q, k, v))

              def fn():
                return torch.autograd.grad(run(qg, kg, vg), (qg, kg, vg), do)
            row.update(status="ok", timing=timing.time_fn(fn, sync, warmup=2, repeats=spec.get("repeats", 7)),
                       torch=torch.__version__)
          except Exception as e:  # noqa: BLE001 (a backend that refuses the widths is a row too)
            row.update(status="unsupported" if "No available kernel" in str(e) or "not supported" in str(e)
                       else "error", error=f"{type(e).__name__}: {str(e)[:300]}")
          print(json.dumps(row), flush=True)


if __name__ == "__main__":
  main()
