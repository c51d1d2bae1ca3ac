"""How much of the Triton forward's gap to torch flex is the memory layout (sm_90 only).

  python -m docs.scripts.probe_layout --output docs/benchmarks/layout_probe.json

The benchmarks give each library its own layout: probjax ``[B, T, H, D]`` (a key tile's
rows ``H * D`` elements apart), torch ``[B, H, T, D]`` contiguous (a tile is one block).
This probe times the same work both ways on each side, bf16 forward, non-causal, B4 H8,
T 4096 and 8192, head_dim 64 and 128:
- probjax's Triton kernel on ``[B, T, H, D]`` (``bthd``) and on ``[B*H, T, 1, D]``
  (``contiguous``: one head per batch element, the same computation with contiguous rows);
- torch flex (compiled) on ``[B, H, T, D]`` contiguous (``contiguous``, the benchmark's
  case) and on the transposed view of a ``[B, T, H, D]`` tensor (``bthd``).
Wall ms and kernel ms (``device_ms``) per row; rows are written as they are measured.
"""

from __future__ import annotations

import sys

from docs.scripts import harness, impls

CASES = [(t, d) for t in (4096, 8192) for d in (64, 128)]


def _jax_rows(b, h, t, d):
  from probjax.nn.layers.attention import dot_product_attention
  arrays = impls.inputs(b, t, t, h, h, d)
  merged = tuple(x.transpose(0, 2, 1, 3).reshape(b * h, t, 1, d) for x in arrays)  # [B*H, T, 1, D]
  attn = lambda q, k, v: dot_product_attention(q, k, v, implementation="triton")
  for layout, arr in (("bthd", arrays), ("contiguous", merged)):
    fn, sync = impls._jax_fn(attn, arr, "bfloat16", "fwd")
    yield layout, harness.time_fn(fn, sync, device_time=True)


def _torch_rows(b, h, t, d):
  import numpy as np
  import torch
  from torch.nn.attention.flex_attention import flex_attention
  compiled = torch.compile(flex_attention, dynamic=False)
  arrays = impls.inputs(b, t, t, h, h, d)[:3]
  bthd = [torch.from_numpy(np.asarray(a)).to("cuda", torch.bfloat16) for a in arrays]
  for layout, (q, k, v) in (("contiguous", [x.transpose(1, 2).contiguous() for x in bthd]),
                            ("bthd", [x.transpose(1, 2) for x in bthd])):
    def fn(q=q, k=k, v=v):
      with torch.no_grad():
        return compiled(q, k, v)
    yield layout, harness.time_fn(fn, lambda _x: torch.cuda.synchronize(), device_time=True, backend="torch")


def main(argv=None):
  args, out = harness.probe_start("probe_layout", __doc__, argv)
  if out is None:
    return 0
  for impl, rows in (("probjax_triton", _jax_rows), ("torch_flex", _torch_rows)):
    for t, d in CASES:
      for layout, r in rows(4, 8, t, d):
        harness.probe_add(out, args.output, dict(impl=impl, layout=layout, batch=4, heads=8, t=t, d=d,
                                                 ms=r.get("ms"), device_ms=r.get("device_ms")))
  return 0


if __name__ == "__main__":
  sys.exit(main())
