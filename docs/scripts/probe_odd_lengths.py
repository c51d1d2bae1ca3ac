"""Why is the Triton kernel slow at lengths that are not a multiple of its tiles? (suite "odd_probe")

  python -m docs.scripts.probe_odd_lengths --output docs/benchmarks/odd_probe.json

bf16 forward, batch 4, 8 heads, per odd length T (600, 1500, 3000) and its padded length P
(the next multiple of the forward's block_q and block_k), three rows of ``probjax_triton``:
variant "odd" (the call at T: masked loads and stores of the partial tiles), "padded" (the
call at P: no partial tile) and "copies" (no kernel: the pads of q/k/v to P and the output
slice that the kernel ran between before it masked its partial tiles, i.e. what that change
removed). odd / padded against (T / P)^2 is what the partial tiles cost inside the kernel.

Two more "odd" rows change only the forward's loop over key tiles (the kernel's
``tiles._unmasked_loop``, patched while the row is traced): "odd_first" runs the partial key
tile's masked step before the unmasked loop instead of after it, "odd_one_loop" runs every key
tile through the masked body in one loop (no second loop body in the kernel).
"""

from __future__ import annotations

import sys

from docs.scripts import harness, impls


def _padded(t: int, d: int) -> int:
  import jax.numpy as jnp
  from probjax.ops.attention.triton import config as C
  from probjax.ops.attention.masks import round_up
  f = C.fit_forward_config(None, jnp.bfloat16, d, t, t, C.device_kind())
  return round_up(round_up(t, f.block_q), f.block_k)


def _copies_fn(arrays, pad_to: int):
  import jax
  import jax.numpy as jnp
  from probjax.ops.attention.masks import pad_axis
  q, k, v = (jnp.asarray(a, jnp.bfloat16) for a in arrays[:3])
  t = q.shape[1]

  @jax.jit
  def f(q, k, v):  # the pads and the slice around the kernel; the sum keeps them alive
    qp, kp, vp = (pad_axis(x, 1, pad_to) for x in (q, k, v))
    return (qp + kp + vp)[:, :t]
  return (lambda: f(q, k, v)), jax.block_until_ready


def _loop_variant(name: str):
  """A replacement of ``tiles._unmasked_loop`` for the forward (``by_q``) with the partial key
  tile first ("odd_first") or every tile masked in one loop ("odd_one_loop")."""
  import jax
  from probjax.ops.attention.masks import num_tiles
  from probjax.ops.attention.triton import tiles
  orig = tiles._unmasked_loop

  def loop(tm, tile, n_static, body, carry, *, by_q, block_outer, block_inner):
    if not by_q or tm.kv_len % block_inner == 0:
      return orig(tm, tile, n_static, body, carry, by_q=by_q, block_outer=block_outer, block_inner=block_inner)
    n_full, n_all = tm.kv_len // block_inner, min(n_static, num_tiles(tm.kv_len, block_inner))
    masked, unmasked = (lambda j, c: body(j, c, True)), (lambda j, c: body(j, c, False))
    if name == "odd_one_loop":
      return jax.lax.fori_loop(0, n_all, masked, carry)
    carry = jax.lax.fori_loop(n_full, n_all, masked, carry)
    return jax.lax.fori_loop(0, n_full, unmasked, carry)
  return loop


def cases(args):
  timing = harness.timing_kwargs(args)
  shapes = [(1, 2, 40, 16)] if args.quick else [(4, 8, t, d) for t in (600, 1500, 3000) for d in (64, 128)]
  out = []
  for b, h, t, d in shapes:
    for variant in ("odd", "padded", "copies", "odd_first", "odd_one_loop"):
      def run(b=b, h=h, t=t, d=d, variant=variant):
        harness.require_gpu("the Triton kernel")
        p = _padded(t, d)
        n = p if variant == "padded" else t
        arrays = impls.inputs(b, n, n, h, h, d)
        from probjax.ops.attention.triton import tiles
        loop = _loop_variant(variant) if variant.startswith("odd_") else None
        try:
          if variant == "copies":
            fn, sync = _copies_fn(arrays, p)
          else:
            fn, sync = impls.build("probjax_triton", arrays, "bfloat16", False, "fwd")
          with harness.patched(tiles, "_unmasked_loop", loop):  # traced on the first call
            res = harness.time_fn(fn, sync, **timing)
          res["padded_len"] = p
          return res
        finally:
          impls.free_memory()
      out.append(harness.Case(suite="odd_probe", impl="probjax_triton", dtype="bfloat16", batch=b,
                              q_heads=h, kv_heads=h, q_len=t, kv_len=t, head_dim=d, causal=False,
                              mode="fwd", run=run, variant=variant, extra={"probe": variant},
                              flops=False))
  return out


def main(argv=None):
  harness.main_for(__doc__, cases, argv)


if __name__ == "__main__":
  sys.exit(main())
