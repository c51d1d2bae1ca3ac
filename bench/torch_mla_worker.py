"""torch's attention for MLA, in its own process, bf16.

* ``cases``: the expanded widths (q/k head_dim 192, values 128): SDPA with each backend forced
  (cuDNN, flash, memory-efficient) and torch.compile'd flex_attention, causal and not, forward
  and forward + backward (gradients of q, k, v).
* ``decode_cases``: the absorbed decode, ``[b, s, heads, tq, d_c, d_rope]``: every query head
  of a sequence packed as a query row of one MQA call over the cached latent (keys the
  ``d_c + d_rope`` wide rows, values their first ``d_c`` columns), ``tq`` queries per sequence
  under a causal band among them (query ``i`` sees positions ``< s - tq + 1 + i``). Impls:
  ``torch_bmm`` (bmm, a float32 softmax, bmm) and ``torch_sdpa`` (``scaled_dot_product_attention``,
  backend of torch's choosing; a boolean mask when ``tq > 1``). Forward only.

  python bench/torch_mla_worker.py '{"cases": [[2, 16, 4096, 192, 128]], "repeats": 7}'
  python bench/torch_mla_worker.py '{"decode_cases": [[64, 4096, 128, 1, 512, 64]], "decode_scale": 0.0722}'

Prints one JSON line per (case, causal, mode, backend): ``{"case": [...], "causal", "mode",
"impl", "status", "timing" | "error"}`` (decode rows add ``"decode": true`` and ``peak_bytes``, the
device's peak allocation while the call ran beyond its inputs); bench/mla.py turns them into rows beside its own."""

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


def _decode_runner(torch, impl, q, kv, d_c, mask, scale):
  """``q [b, rows, w]`` (the heads of each query packed as rows), ``kv [b, s, w]``; ``mask``
  ``[rows, s]`` boolean or None -> ``[b, rows, d_c]``."""
  F = torch.nn.functional
  v = kv[..., :d_c]
  if impl == "torch_bmm":
    def run():
      scores = torch.bmm(q, kv.transpose(1, 2)).float() * scale
      if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
      return torch.bmm(torch.softmax(scores, -1).to(q.dtype), v)
    return run
  return lambda: F.scaled_dot_product_attention(q[:, None], kv[:, None], v[:, None], attn_mask=mask, scale=scale)[:, 0]


def decode(torch, timing, spec):
  sync = lambda _x: torch.cuda.synchronize()
  for b, s, h, tq, d_c, d_rope in spec.get("decode_cases", ()):
    g = torch.Generator(device="cuda").manual_seed(0)
    w = d_c + d_rope
    q = torch.randn(b, tq * h, w, device="cuda", generator=g, dtype=torch.bfloat16)
    kv = torch.randn(b, s, w, device="cuda", generator=g, dtype=torch.bfloat16)
    mask = None
    if tq > 1:   # rows ordered (query, head): row r is query r // h
      last = s - tq + torch.arange(tq * h, device="cuda") // h
      mask = torch.arange(s, device="cuda")[None, :] <= last[:, None]
    scale = spec["decode_scale"]
    for impl in ("torch_bmm", "torch_sdpa"):
      row = dict(case=[b, s, h, tq, d_c, d_rope], decode=True, causal=False, mode="fwd", impl=impl)
      try:
        run = _decode_runner(torch, impl, q, kv, d_c, mask, scale)
        with torch.no_grad():
          torch.cuda.reset_peak_memory_stats()
          base = torch.cuda.memory_allocated()
          run()
          torch.cuda.synchronize()
          peak = torch.cuda.max_memory_allocated() - base
          row.update(status="ok", timing=timing.time_fn(run, sync, warmup=2, repeats=spec.get("repeats", 7)),
                     peak_bytes=int(peak), torch=torch.__version__)
      except Exception as e:  # noqa: BLE001 (a refusal is a row too)
        row.update(status="error", error=f"{type(e).__name__}: {str(e)[:300]}")
      print(json.dumps(row), flush=True)


def main():
  spec = json.loads(sys.argv[1])
  import torch
  timing = _timing()
  decode(torch, timing, spec)
  sync = lambda _x: torch.cuda.synchronize()
  for b, h, t, d, dv in spec.get("cases", ()):
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
