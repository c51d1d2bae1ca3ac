"""Why is jax.nn's cuDNN route slower than torch SDPA's cuDNN backend? (suite "cudnn_probe")

  python -m docs.scripts.probe_cudnn --output docs/benchmarks/cudnn_probe.json

Times one cuDNN flash-attention call four ways on the same inputs, bf16, batch 4, 8 heads:
``jaxnn_cudnn`` (variant "btnh": the grid's route, ``[batch, seq, heads, head_dim]``;
"bnth": the same custom call on inputs already in ``[batch, heads, seq, head_dim]``) and
``torch_sdpa_cudnn`` (variant "bhtd": contiguous ``[batch, heads, seq, head_dim]`` as in the
grid; "bthd": the transposed view of ``[batch, seq, heads, head_dim]``), and "btnh_knobs_*":
the jax.nn call with other cuDNN tuning knobs in the custom call (:data:`KNOBS`). Every row records
the cuDNN version each library loaded. JAX and torch run in one process here (small shapes).
"""

from __future__ import annotations

import contextlib
import sys

from docs.scripts import harness, impls


def _versions() -> dict:
  out = {}
  try:
    from jax._src.lib import cuda_versions
    out["jax_cudnn"] = cuda_versions.cudnn_get_version() if cuda_versions else None
  except Exception as e:  # noqa: BLE001
    out["jax_cudnn"] = f"{type(e).__name__}: {e}"[:120]
  try:
    out["torch_cudnn"] = impls.torch_mod().backends.cudnn.version()
  except Exception as e:  # noqa: BLE001
    out["torch_cudnn"] = f"{type(e).__name__}: {e}"[:120]
  return out


# Variants "btnh_knobs_<name>": JAX's lowering writes a fixed cuDNN engine config into the
# custom call (algo_id 0, tuning knobs {"17": "1", "24": "0"}); these replace the knobs.
KNOBS = {"none": {}, "k17_0": {"17": "0", "24": "0"}, "k24_1": {"17": "1", "24": "1"}}


@contextlib.contextmanager
def _tuning_knobs(knobs):
  """Patches JAX's cuDNN backend-config builder to write ``knobs`` (None: unchanged)."""
  if knobs is None:
    yield
    return
  from jax._src.cudnn import fused_attention_stablehlo as fa
  orig = fa.create_dot_product_attention_backend_config_base

  def patched(*a, **k):
    cfg = orig(*a, **k)
    cfg["cudnn_fmha_backend_config"]["algorithm"]["tuning_knobs"] = dict(knobs)
    return cfg
  fa.create_dot_product_attention_backend_config_base = patched
  try:
    yield
  finally:
    fa.create_dot_product_attention_backend_config_base = orig


def _jax(arrays, layout, causal, mode):
  import jax.numpy as jnp
  from jax._src.cudnn.fused_attention_stablehlo import MaskType, dot_product_attention
  layout = layout.split("_")[0]
  d = arrays[0].shape[-1]
  mt = MaskType.CAUSAL if causal else MaskType.NO_MASK
  if layout == "bnth":
    arrays = [a.transpose(0, 2, 1, 3).copy() for a in arrays]
  attn = lambda q, k, v: dot_product_attention(q, k, v, scale=d ** -0.5, mask_type=mt,
                                               qkv_layout=layout.upper())
  return impls._jax_fn(attn, arrays, "bfloat16", mode)


def _torch(arrays, layout, causal, mode):
  torch = impls.torch_mod()
  from torch.nn.attention import SDPBackend, sdpa_kernel
  need = mode == "fwd_bwd"
  ts = [torch.from_numpy(a).to("cuda", torch.bfloat16) for a in arrays]
  ts = [t.transpose(1, 2).contiguous() if layout == "bhtd" else t.transpose(1, 2) for t in ts]
  q, k, v, do = ts
  for t in (q, k, v):
    t.requires_grad_(need)
  sync = lambda _x: torch.cuda.synchronize()
  F = torch.nn.functional

  def fwd():
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
      return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
  if mode == "fwd":
    def fn():
      with torch.no_grad():
        return fwd()
    return fn, sync
  return (lambda: torch.autograd.grad(fwd(), (q, k, v), do)), sync


def cases(args):
  timing = harness.timing_kwargs(args)
  shapes = [(1, 2, 128, 64)] if args.quick else [(4, 8, t, d) for t in (4096, 8192) for d in (64, 128)]
  variants = [("jaxnn_cudnn", "btnh", _jax), ("jaxnn_cudnn", "bnth", _jax),
              ("torch_sdpa_cudnn", "bhtd", _torch), ("torch_sdpa_cudnn", "bthd", _torch)]
  variants += [("jaxnn_cudnn", f"btnh_knobs_{k}", _jax) for k in KNOBS]
  out = []
  for b, h, t, d in shapes:
    for causal in (False, True):
      for mode in ("fwd", "fwd_bwd"):
        for impl, layout, build in variants:
          def run(b=b, h=h, t=t, d=d, causal=causal, mode=mode, layout=layout, build=build):
            harness.require_gpu("cuDNN")
            arrays = impls.inputs(b, t, t, h, h, d)
            knobs = KNOBS[layout.split("_knobs_", 1)[1]] if "_knobs_" in layout else None
            try:
              with _tuning_knobs(knobs):  # lowering happens at the first (warm-up) call
                fn, sync = build(arrays, layout, causal, mode)
                res = harness.time_fn(fn, sync, **timing, backend=harness.backend_of(impl))
              res.update(_versions())
              return res
            finally:
              impls.free_memory()
          out.append(harness.Case(suite="cudnn_probe", impl=impl, dtype="bfloat16", batch=b,
                                  q_heads=h, kv_heads=h, q_len=t, kv_len=t, head_dim=d,
                                  causal=causal, mode=mode, run=run, variant=layout,
                                  extra={"layout": layout}))
  return out


def main(argv=None):
  harness.main_for(__doc__, cases, argv)


if __name__ == "__main__":
  sys.exit(main())
