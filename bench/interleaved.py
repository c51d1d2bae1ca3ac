"""Chosen implementations timed in one process, in rotating rounds (suite "interleaved").

  python -m bench.interleaved --lengths 4096 --head-dims 64,128 \\
      --impls probjax_default,probjax_cudnn,jaxnn_cudnn,torch_sdpa_cudnn   # -> bench/results/<device>/interleaved.json

The grid times torch in a process of its own after the JAX side; callers of the same cuDNN
kernel then differ by more than the 2% a dispatch rule is judged by, because clocks and
power throttling follow what ran just before. Here every implementation of ``--impls`` is
built once per shape (bf16, ``--batch`` x ``--heads``, T in ``--lengths``, ``--head-dims``,
``--causal``, ``--modes``, a benchmark ``--mask`` such as ``docs4`` or ``window512``) and
timed once per round in a rotated order for ``--rounds`` rounds (the harness's rounds: a
row's ``ms`` is the median of its rounds' medians, ``round_ms`` each round's). The way to
re-measure a dispatch rule between two implementations; an implementation that fails gets
its status and error in its row.

``--v-head-dim`` gives the values a width of their own (MLA's 192/128): v and dO are the
shared inputs' first columns, rows carry the variant ``dv<width>`` and their FLOPs count
both widths, ``2 B H Tq Tkv (head_dim + v_head_dim)`` (halved for causal, x3.5 with the
backward). There ``jaxnn_cudnn_padded_v`` is what jax.nn offers (its cuDNN call takes values
as wide as the keys): v zero-padded to head_dim inside the timed call, the output sliced.
``probjax_mosaic`` is the Mosaic forward with the Triton backward (``backward_pass_impl="auto"``),
``probjax_mosaic_bwd`` the Mosaic forward and backward (``backward_pass_impl="mosaic"``); the
forward of the two is one kernel, so with both listed ``probjax_mosaic_bwd`` has no ``fwd`` row.
The default, cuDNN (probjax's FFI route), the Mosaic forward with either backward, the Triton
kernel and jax.nn's padded cuDNN at B2 H16 T4096 causal and not, 192/128 (the issue "MLA at
FlashMLA speed on Hopper": forward + backward within 1.10x cuDNN's):

  python -m bench.interleaved --lengths 4096 --head-dims 192 --v-head-dim 128 --causal both \
      --batch 2 --heads 16 --modes fwd,fwd_bwd \
      --impls probjax_default,probjax_cudnn,probjax_mosaic_bwd,probjax_mosaic,probjax_triton,jaxnn_cudnn_padded_v

Every JAX row carries the compiled program's memory (``temp_bytes``, ``argument_bytes``,
``output_bytes``, ``compiled_total_bytes``: XLA's analysis of the executable the calls ran; a
custom call's workspace outside XLA's buffers is not in it) and, on a GPU,
``device_peak_bytes``, the device's ``peak_bytes_in_use`` so far in the process (a high-water
mark over every earlier case). ``probjax_default`` rows carry ``dispatch``, the default's
decision. ``--cpu-smoke``: the same command at tiny sizes on CPU (B1 H2 T64, head_dim 16,
values 8 wide with ``--v-head-dim``; float32, quick timing): every row, the GPU kernels'
statuses unsupported or error.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

from bench import harness, impls

IMPLS = ("probjax_default", "jaxnn_cudnn", "torch_sdpa_cudnn")
CAUSAL = {"both": (False, True), "false": (False,), "true": (True,)}
MASK_IS_CAUSAL = ("window512", "docs4_causal", "softcap30")


def cases(args) -> list[harness.Case]:
  timing = harness.timing_kwargs(args)
  ints = lambda s: tuple(int(x) for x in str(s).split(",") if x)
  dv = args.v_head_dim
  if args.quick:
    dtype, shapes, names = "float32", [(1, 2, 64, 16, False, "fwd")], ("probjax_default", "jaxnn_xla")
    dv = None
  else:
    dtype, names = "bfloat16", tuple(x for x in args.impls.split(",") if x)
    shapes = [(args.batch, args.heads, t, d, c, mode) for t in ints(args.lengths) for d in ints(args.head_dims)
              for c in CAUSAL[args.causal] for mode in args.modes.split(",") if mode]
    if args.cpu_smoke:   # the command's implementations, causal flags and modes at tiny sizes
      dtype, dv = "float32", (min(dv, 8) if dv else None)
      shapes = list(dict.fromkeys((1, 2, 64, 16, c, mode) for *_, c, mode in shapes))
  if dv and dv > min(d for *_, d, _, _ in shapes):
    raise SystemExit(f"--v-head-dim {dv}: the values are the inputs' first columns, at most --head-dims' smallest")
  # probjax_mosaic_bwd's forward is probjax_mosaic's kernel: timed once where both are listed
  same_forward = lambda impl, s: impl == "probjax_mosaic_bwd" and s["mode"] == "fwd" and "probjax_mosaic" in names
  table = impls.timed_cases("interleaved", names, [
      impls.shape(dtype, b, h, h, t, t, d, causal or args.mask in MASK_IS_CAUSAL, mode, mask=args.mask)
      for b, h, t, d, causal, mode in shapes], timing, skip=same_forward)
  return [value_width(c, dv, timing) for c in table]


PADDED_V = "jaxnn_cudnn_padded_v"


def padded_v_jaxnn(arrays, dtype, causal, mode, mask):
  """jax.nn's cuDNN attention with v zero-padded to the keys' width and the output sliced back
  (inside the timed call): what jax.nn offers for values narrower than the keys."""
  if mask != "none":
    raise impls.Unsupported(f"{PADDED_V} is run without a mask")
  if dtype == "float32":
    raise impls.Unsupported(f"{PADDED_V} has no float32 path")
  impls.require_gpu("cuDNN")
  return impls._jax_fn(padded_v_attention(causal, arrays[0].shape[-1]), arrays, dtype, mode)


def padded_v_attention(causal: bool, width: int, implementation: str = "cudnn"):
  """``attn(q, k, v)``: jax.nn's attention on v zero-padded to ``width``, the output sliced to v's."""
  import jax
  import jax.numpy as jnp

  def attn(q, k, v):
    vp = jnp.pad(v, ((0, 0),) * 3 + ((0, width - v.shape[-1]),))
    return jax.nn.dot_product_attention(q, k, vp, is_causal=causal, implementation=implementation)[..., :v.shape[-1]]
  return attn


def memory_fields(impl: str, fn) -> dict:
  """:func:`bench.impls.program_memory` of the jitted ``fn`` (JAX rows; torch rows have none)."""
  return {} if impl.startswith("torch_") else impls.program_memory(fn.lower().compile())


def default_dispatch(case, dv: int) -> str:
  """The default's decision for the case (its rule), as text."""
  try:
    from probjax.ops.attention.api import explain_dispatch
    mobj, is_causal = impls.probjax_mask(case.mask, case.causal, case.batch, case.q_len, case.kv_len)
    d = explain_dispatch((case.batch, case.q_len, case.q_heads, case.head_dim),
                         (case.batch, case.kv_len, case.kv_heads, case.head_dim), impls.jnp_dtype(case.dtype),
                         mask=mobj, is_causal=is_causal, v_head_dim=dv)
    grad = getattr(d, "grad", None)
    return str(d) + (f"; under grad: {grad}" if grad is not None and grad != d else "")
  except Exception as e:  # noqa: BLE001
    return f"unknown ({type(e).__name__}: {e})"[:300]


def value_width(case, dv: int | None, timing: dict):
  """``case`` (:func:`bench.impls.timed_case`, inputs ``[B, T, H, head_dim]``) built here, its
  row with :func:`memory_fields` (and ``dispatch`` for ``probjax_default``). With ``dv`` the
  values are ``dv`` wide: v and dO are the shared inputs' first ``dv`` columns (the output is
  ``[B, T, H, dv]``); the row is keyed by the variant ``dv<dv>`` and its FLOPs are
  ``2 B H Tq Tkv (head_dim + dv)`` (halved for causal, x3.5 with the backward), the
  convention's ``4 B H Tq Tkv D`` with D their mean. A forward row also gets
  ``max_abs_err`` against the float64 reference slice, as :func:`bench.impls.timed_case`'s."""
  width = dv or case.head_dim

  def prepare():
    q, k, v, do = impls.inputs(case.batch, case.q_len, case.kv_len, case.q_heads, case.kv_heads, case.head_dim)
    arrays = (q, k, v[..., :width], do[..., :width])
    if case.impl == PADDED_V:
      fn, sync = padded_v_jaxnn(arrays, case.dtype, case.causal, case.mode, case.mask)
    else:
      fn, sync = impls.build(case.impl, arrays, case.dtype, case.causal, case.mode, case.mask)

    def finish(res):
      flops = harness.attention_flops(case.batch, case.q_heads, case.q_len, case.kv_len,
                                      (case.head_dim + width) / 2, case.causal, case.mode)
      if dv:   # else make_row counts them (head_dim wide values)
        res.update(flops=flops, tflops=harness.tflops(flops, res.get("ms")))
      res.update(memory_fields(case.impl, fn))
      if case.impl == "probjax_default":
        res["dispatch"] = default_dispatch(case, width)
      if case.mode == "fwd":
        try:
          import numpy as np
          ref = impls.reference_slice(arrays, case.dtype, case.causal, case.mask)
          res["max_abs_err"] = float(np.max(np.abs(impls.output_slice(case.impl, fn(), ref.shape[0]) - ref)))
        except Exception as e:  # noqa: BLE001
          res["check_error"] = f"{type(e).__name__}: {e}"[:300]
      return res
    return (lambda: harness.time_fn(fn, sync, **timing, backend=harness.backend_of(case.impl))), finish

  if not dv:   # keyed as impls.timed_case's rows; make_row counts the FLOPs
    return dataclasses.replace(case, run=impls.run_of(prepare), prepare=prepare)
  return dataclasses.replace(case, run=impls.run_of(prepare), prepare=prepare, variant=f"dv{dv}", flops=False,
                             extra=dict(case.extra, v_head_dim=dv))


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  harness.add_common_args(p)
  p.add_argument("--lengths", default="4096,3000")
  p.add_argument("--head-dims", default="64,128")
  p.add_argument("--causal", default="both", choices=sorted(CAUSAL))
  p.add_argument("--modes", default="fwd,fwd_bwd")
  p.add_argument("--impls", default=",".join(IMPLS))
  p.add_argument("--batch", type=int, default=4)
  p.add_argument("--heads", type=int, default=8)
  p.add_argument("--mask", default="none", help="a benchmark mask name (bench.impls.MASKS)")
  p.add_argument("--v-head-dim", type=int, default=None,
                 help="the values' head_dim, at most --head-dims' smallest (default: as wide as queries and keys)")
  p.add_argument("--cpu-smoke", action="store_true",
                 help="the command's implementations, causal flags and modes at tiny sizes on CPU (float32)")
  p.set_defaults(rounds=3)
  args = p.parse_args(argv)
  harness.run_cases(cases(args), args)
  return 0


if __name__ == "__main__":
  sys.exit(main())
