"""Multi-head latent attention benchmark (GPU; ``--cpu-smoke`` runs tiny sizes on CPU).

Suites (``--suite``, default both):

* ``expanded``: B2 H16 T4096 and B1 H16 T16384, d_nope 128 + d_rope 64 (d_qk 192), d_v 128,
  latent 512, bf16, causal and not, ``fwd`` and ``fwd_bwd`` (the gradient of every input). Impls:
  ``mla_expanded`` (the op, latent projections included), ``attention_{default,triton,mosaic,cudnn,xla}``
  (``dot_product_attention`` alone on the formed q [.., 192], k [.., 192], v [.., 128];
  ``attention_mosaic`` is the Mosaic forward with the Triton backward, ``backward_pass_impl="auto"``),
  ``attention_mosaic_bwd`` (the Mosaic forward and the Mosaic backward, ``backward_pass_impl="mosaic"``),
  ``jaxnn_cudnn_padded_v`` (v zero-padded to 192 through jax.nn's cuDNN, output sliced: what jax.nn
  offers) and torch's SDPA (cuDNN, flash, efficient) and flex_attention in their own process
  (bench/torch_mla_worker.py; ``--no-torch`` skips them).
* ``decode``: the absorbed form decoding 1 and 2 queries per step with 128 query heads over
  B64 x 4096 and B8 x 32768 cached latent rows 576 wide (512 + 64), bf16, ``KVLenMask`` at full
  length. Impls: ``mla_absorbed`` (the default), ``mla_triton`` (the Triton decode kernel),
  ``triton_paged`` (the same over 64-row pages), ``mla_mosaic`` / ``mosaic_paged`` (the Mosaic GPU
  decode kernel, sm_90, contiguous and over 64-row pages), ``mla_absorbed_xla`` (the op with
  attention's XLA path), ``triton_kernel`` / ``mosaic_kernel`` (each decode kernel alone on the
  absorbed queries, split-KV combine included, no projections; ``mosaic_kernel_own_scores``: each
  compute warpgroup computing the score tile itself), ``attention_mqa_xla`` (the MQA call
  alone as XLA einsums, d_qk 576 / d_v 512) and, at B64 x 4096 with one query, ``mla_expanded``.
  torch's ``torch_bmm`` (bmm, float32 softmax, bmm) and ``torch_sdpa`` run the same MQA call with
  the query heads packed as query rows, in their own process (bench/torch_mla_worker.py; their
  ``call_peak_bytes`` is torch's peak allocation during the call beyond its inputs).
  ``--mosaic-splits 1,4,8`` adds ``mosaic_kernel_s<n>`` rows at fixed key splits. Rows carry the
  latent read floor ``bytes / 4.0e12 B/s`` and ``tb_per_s``, the bytes of latent and rope read once
  (``read_bytes = B S 576 x 2``, bf16) over the time.

FLOPs (printed as ``tflops``): attention ``2 B H Tq S (d_qk + d_v)`` (halved for causal),
forward + backward 3.5x the forward; the projections are not counted. Decoding counts the two
matmuls of the absorbed form per query head and cached row: scores over the 576-wide latent + rope
(``2 x 576``) and the output over the 512-wide latent (``2 x 512``), so ``2 B H Tq S (576 + 512)``
with ``H`` the 128 query heads and ``Tq`` the queries per sequence.

Memory (every JAX row, :func:`bench.impls.program_memory`): ``temp_bytes``, ``argument_bytes``,
``output_bytes`` of the compiled program (XLA's memory analysis; a custom call's own workspace
outside XLA's buffers is not in it), ``compiled_total_bytes`` = arguments + outputs +
temporaries - aliases (what the program holds on the device while it runs) and, on a GPU,
``device_peak_bytes``: the device's ``peak_bytes_in_use`` so far in the process (a high-water
mark over every earlier row, as bench/moe.py's).

The issue's numbers ("MLA at FlashMLA speed on Hopper"), decoding with 1, 2 and 4 queries at
B64 x 4096 and B128 x 8192, each decode kernel alone, the default op and the absorbed XLA form:

  python -m bench.mla --suite decode --decode-shapes 64x4096,128x8192 --decode-queries 1,2,4 \
      --impl mosaic_kernel,triton_kernel,attention_mqa_xla,mla_absorbed --output $OUT/mla.json

and the expanded 192/128 attention at B2 H16 T4096 (causal and not, forward and forward +
backward) with torch's SDPA in its own process: ``--suite expanded --expanded-shapes 2x4096``.

Rows are JSON lines in ``--output`` keyed by (suite, case, mode, impl), as bench/lm_step.py's:
device, versions, commit and command in every row; a rerun skips the keys already there
(``--force`` re-measures).

    python bench/mla.py --output bench/results/h200/mla.json        # H200
    python bench/mla.py --cpu-smoke --output /tmp/mla.json          # tiny, CPU
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
  sys.path.insert(0, ROOT)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from bench import harness  # noqa: E402
from bench.impls import program_memory  # noqa: E402
from probjax.core.timing import classify_error, device_info, time_fn  # noqa: E402
from probjax.nn.layers.attention import CausalMask, KVLenMask, dot_product_attention  # noqa: E402
from probjax.ops.attention.backends.xla import attention as xla_attention  # noqa: E402
from probjax.ops.mla import explain, mla  # noqa: E402
from probjax.ops.mla.backends.mosaic_gpu import decode as mosaic_decode  # noqa: E402
from probjax.ops.mla.backends.triton import decode as triton_decode  # noqa: E402

HBM_BYTES_PER_S = 4.0e12
SUITES = ("expanded", "decode")


@dataclasses.dataclass(frozen=True)
class Sizes:
  batch: int = 2
  heads: int = 16
  seq: int = 4096
  d_nope: int = 128
  d_rope: int = 64
  d_v: int = 128
  d_c: int = 512
  dec_heads: int = 128
  expanded_shapes: tuple = ((2, 4096), (1, 16384))   # (batch, seq)
  decode_shapes: tuple = ((64, 4096), (8, 32768))    # (batch, cache)
  decode_queries: tuple = (1, 2)


SMOKE = Sizes(heads=2, d_nope=8, d_rope=4, d_v=8, d_c=16, dec_heads=4, expanded_shapes=((1, 48),),
              decode_shapes=((2, 40),), decode_queries=(1,))


def _normal(key, shape, dtype):
  return jax.random.normal(key, shape, jnp.float32).astype(dtype)


def mla_inputs(seed, b, tq, s, h, z: Sizes, dtype):
  ks = jax.random.split(jax.random.key(seed), 6)
  shapes = [(b, tq, h, z.d_nope), (b, tq, h, z.d_rope), (b, s, z.d_c), (b, s, z.d_rope),
            (z.d_c, h, z.d_nope), (z.d_c, h, z.d_v)]
  args = [_normal(k, sh, dtype) for k, sh in zip(ks, shapes)]
  args[4], args[5] = args[4] * z.d_c ** -0.5, args[5] * z.d_c ** -0.5
  return args


def attention_flops(b, h, tq, s, d_qk, d_v, causal, mode):
  """``2 b h tq s (d_qk + d_v)``: the score and output matmuls (halved for causal; x3.5 with the backward)."""
  f = 2.0 * b * h * tq * s * (d_qk + d_v) * (0.5 if causal else 1.0)
  return f * (3.5 if mode == "fwd_bwd" else 1.0)


def _pad_v(v, width):
  return jnp.pad(v, ((0, 0),) * 3 + ((0, width - v.shape[-1]),))


def _jaxnn_cudnn(q, k, v, mask):
  return jax.nn.dot_product_attention(q, k, v, is_causal=mask is not None, implementation="cudnn")


def _case(b, h, t, d_qk, d_v, causal):
  return f"B{b} H{h} T{t} {d_qk}/{d_v} {'causal' if causal else 'none'}"


def expanded_cases(z: Sizes, dtype):
  h, d_qk = z.heads, z.d_nope + z.d_rope
  for b, t in z.expanded_shapes:
    args = mla_inputs(0, b, t, t, h, z, dtype)
    q = jnp.concatenate(args[:2], -1)
    k = jnp.concatenate([jnp.einsum("bsc,chd->bshd", args[2], args[4]),
                         jnp.broadcast_to(args[3][:, :, None], (b, t, h, z.d_rope))], -1)
    v = jnp.einsum("bsc,chd->bshd", args[2], args[5])
    for causal in (False, True):
      mask = CausalMask() if causal else None
      attn = lambda impl, bwd="auto", mask=mask: (
          lambda q, k, v: dot_product_attention(q, k, v, mask=mask, implementation=impl, backward_pass_impl=bwd))
      impls = {
          "mla_expanded": (lambda *a, mask=mask: mla(*a, mask=mask, form="expanded"), args),
          # the attention call alone on the formed q [.., 192], k [.., 192], v [.., 128]
          "attention_default": (attn(None), (q, k, v)),
          "attention_triton": (attn("triton"), (q, k, v)),
          "attention_mosaic": (attn("mosaic"), (q, k, v)),                  # Mosaic forward, Triton backward
          "attention_mosaic_bwd": (attn("mosaic", "mosaic"), (q, k, v)),    # Mosaic forward and backward
          "attention_cudnn": (attn("cudnn"), (q, k, v)),
          "attention_xla": (attn("xla"), (q, k, v)),
          # what a JAX user gets today: v padded to 192 through jax.nn's cuDNN, output sliced
          "jaxnn_cudnn_padded_v": (lambda q, k, v, mask=mask: _jaxnn_cudnn(q, k, _pad_v(v, d_qk), mask)[..., :z.d_v],
                                   (q, k, v)),
      }
      for mode in ("fwd", "fwd_bwd"):
        flops = attention_flops(b, h, t, t, d_qk, z.d_v, causal, mode)
        for name, (fn, xs) in impls.items():
          yield dict(suite="expanded", case=_case(b, h, t, d_qk, z.d_v, causal), mode=mode, impl=name,
                     flops=flops), fn, xs


def _decode_case(b, h, tq, s, width):
  return f"B{b} Hq{h} Tq{tq} cache{s} latent{width}"


def decode_cases(z: Sizes, dtype, mosaic_splits=()):
  h, width = z.dec_heads, z.d_c + z.d_rope
  scale = (z.d_nope + z.d_rope) ** -0.5
  for b, s in z.decode_shapes:
    for tq in z.decode_queries:
      args = mla_inputs(1, b, tq, s, h, z, dtype)
      mask = KVLenMask(jnp.full((b,), s, jnp.int32))
      q = jnp.concatenate([jnp.einsum("bthd,chd->bthc", args[0], args[4]), args[1]], -1)
      k = jnp.concatenate([args[2], args[3]], -1)[:, :, None]
      v = args[2][:, :, None]
      page = 64 if s % 64 == 0 else s
      pool = lambda x: x.reshape(b * (s // page), page, x.shape[-1])
      table = jnp.arange(b * (s // page), dtype=jnp.int32).reshape(b, s // page)
      lengths = jnp.full((b,), s, jnp.int32)
      kernel_args = (q[..., :z.d_c], q[..., z.d_c:], args[2], args[3], lengths)
      impls = {
          "mla_absorbed": (lambda *a, mask=mask: mla(*a, mask=mask, form="absorbed"), args),
          "mla_triton": (lambda *a, mask=mask: mla(*a, mask=mask, form="absorbed", implementation="triton"), args),
          # the op with attention's XLA path in place of the decode kernel (projections included)
          "mla_absorbed_xla": (lambda *a, mask=mask: mla(*a, mask=mask, form="absorbed", implementation="xla"), args),
          "triton_paged": (lambda *a, mask=mask, table=table: mla(*a, mask=mask, form="absorbed", implementation="triton",
                                                                  page_table=table),
                           (*args[:2], pool(args[2]), pool(args[3]), *args[4:])),
          "mla_mosaic": (lambda *a, mask=mask: mla(*a, mask=mask, form="absorbed", implementation="mosaic"), args),
          "mosaic_paged": (lambda *a, mask=mask, table=table: mla(*a, mask=mask, form="absorbed", implementation="mosaic",
                                                                  page_table=table),
                           (*args[:2], pool(args[2]), pool(args[3]), *args[4:])),
          # each decode kernel alone on the absorbed queries (its split-KV combine included)
          "triton_kernel": (lambda *a: triton_decode(*a, scale=scale)[0], kernel_args),
          "mosaic_kernel": (lambda *a: mosaic_decode(*a, scale=scale)[0], kernel_args),
          # both compute warpgroups computing the score tile (the default hands it from one to the other)
          "mosaic_kernel_own_scores": (lambda *a: mosaic_decode(*a, scale=scale, share_scores=False)[0], kernel_args),
          # the MQA call alone as XLA einsums (d_qk 576, d_v 512): the plain-matmul peer
          "attention_mqa_xla": (lambda q, k, v, mask=mask: dot_product_attention(q, k, v, mask=mask, implementation="xla"),
                                (q, k, v)),
      }
      # the same call as plain einsums (XLA's dense formulation: scores materialised)
      impls["attention_mqa_dense"] = (lambda q, k, v, mask=mask: xla_attention(q, k, v, formulation="dense", mask=mask,
                                                                                scale=(z.d_nope + z.d_rope) ** -0.5),
                                      (q, k, v))
      for n in mosaic_splits:
        impls[f"mosaic_kernel_s{n}"] = (lambda *a, n=n: mosaic_decode(*a, scale=scale, num_splits=n)[0], kernel_args)
      if s <= 4096 and tq == 1:   # forming K and V of the whole cache every step: once, for scale
        impls["mla_expanded"] = (lambda *a, mask=mask: mla(*a, mask=mask, form="expanded"), args)
      read_bytes = b * s * width * jnp.dtype(dtype).itemsize   # latent + rope, read once
      floor_ms = read_bytes / HBM_BYTES_PER_S * 1e3
      case = _decode_case(b, h, tq, s, width)
      flops = attention_flops(b, h, tq, s, width, z.d_c, False, "fwd")
      for name, (fn, xs) in impls.items():
        yield dict(suite="decode", case=case, mode="fwd", impl=name, flops=flops, read_floor_ms=floor_ms,
                   read_bytes=read_bytes), fn, xs


def torch_rows(z: Sizes, common: dict, repeats: int, suites=("expanded",)) -> list[dict]:
  """The torch peers of ``suites`` (bench/torch_mla_worker.py, a process of its own)."""
  import subprocess
  d_qk = z.d_nope + z.d_rope
  spec = dict(cases=[[b, z.heads, t, d_qk, z.d_v] for b, t in z.expanded_shapes] if "expanded" in suites else [],
              decode_cases=[[b, s, z.dec_heads, tq, z.d_c, z.d_rope] for b, s in z.decode_shapes
                            for tq in z.decode_queries] if "decode" in suites else [],
              decode_scale=d_qk ** -0.5, repeats=repeats)
  worker = os.path.join(os.path.dirname(os.path.abspath(__file__)), "torch_mla_worker.py")
  p = subprocess.run([sys.executable, worker, json.dumps(spec)], capture_output=True, text=True, timeout=900)
  rows = []
  for line in p.stdout.splitlines():
    if not line.startswith("{"):
      continue
    r = json.loads(line)
    if r.get("decode"):
      b, s, h, tq, d_c, d_rope = r["case"]
      read_bytes = b * s * (d_c + d_rope) * 2   # bf16 latent + rope, read once
      row = dict(common, suite="decode", case=_decode_case(b, h, tq, s, d_c + d_rope), mode="fwd", impl=r["impl"],
                 flops=attention_flops(b, h, tq, s, d_c + d_rope, d_c, False, "fwd"), read_bytes=read_bytes,
                 read_floor_ms=read_bytes / HBM_BYTES_PER_S * 1e3, status=r["status"],
                 peer_versions={"torch": r.get("torch")}, call_peak_bytes=r.get("peak_bytes"))
    else:
      b, h, t, d, dv = r["case"]
      row = dict(common, suite="expanded", case=_case(b, h, t, d, dv, r["causal"]), mode=r["mode"], impl=r["impl"],
                 flops=attention_flops(b, h, t, t, d, dv, r["causal"], r["mode"]), status=r["status"],
                 peer_versions={"torch": r.get("torch")})
    if r["status"] == "ok":
      row.update({k: r["timing"][k] for k in ("ms", "p10_ms", "p90_ms", "n_repeats", "first_call_s")})
      row["tflops"] = row["flops"] / (row["ms"] * 1e-3) / 1e12
      if "read_bytes" in row:
        row["tb_per_s"] = row["read_bytes"] / (row["ms"] * 1e-3) / 1e12
    else:
      row["error"] = r.get("error")
    rows.append(row)
  if p.returncode and not rows:
    raise RuntimeError(f"torch worker failed: {p.stderr[-500:]}")
  return rows


def measure(meta, fn, xs, mode, args):
  if mode == "fwd":
    run = jax.jit(fn)
  else:
    run = jax.jit(jax.grad(lambda *a: jnp.sum(fn(*a).astype(jnp.float32)), argnums=tuple(range(len(xs)))))
  res = time_fn(lambda: run(*xs), jax.block_until_ready, repeats=args.repeats, warmup=1)
  row = dict(meta, status="ok", **{k: res[k] for k in ("ms", "p10_ms", "p90_ms", "n_repeats", "first_call_s")})
  row["tflops"] = meta["flops"] / (res["ms"] * 1e-3) / 1e12
  if "read_bytes" in meta:
    row["tb_per_s"] = meta["read_bytes"] / (res["ms"] * 1e-3) / 1e12   # effective bandwidth of the cache read
  row.update(program_memory(run.lower(*xs).compile()))
  return row


def _shapes(text):
  """``"64x4096,128x8192"`` -> ``((64, 4096), (128, 8192))``."""
  return tuple(tuple(int(n) for n in c.split("x")) for c in text.split(",") if c)


def key_of(row):
  return (row["suite"], row["case"], row["mode"], row["impl"])


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--suite", default=",".join(SUITES))
  p.add_argument("--impl", default="", help="comma-separated impl names (default: all)")
  p.add_argument("--output", default="")
  p.add_argument("--repeats", type=int, default=7)
  p.add_argument("--cpu-smoke", action="store_true", help="tiny sizes in float32, for CPU")
  p.add_argument("--force", action="store_true", help="re-measure rows already in --output")
  p.add_argument("--no-torch", action="store_true", help="skip the torch peers")
  p.add_argument("--expanded-shapes", default="", help="expanded suite's BxT cases, e.g. 2x4096 "
                 "(default: 2x4096,1x16384); the torch peers run the same")
  p.add_argument("--decode-shapes", default="", help="decode suite's BxS cases, e.g. 128x8192,4x16384 "
                 "(default: 64x4096,8x32768)")
  p.add_argument("--decode-queries", default="", help="decode suite's queries per step, e.g. 1,2,4")
  p.add_argument("--mosaic-splits", default="", help="decode suite: also the Mosaic kernel at these key splits, e.g. 1,4,8")
  args = p.parse_args(argv)
  z = SMOKE if args.cpu_smoke else Sizes()
  if args.expanded_shapes:
    z = dataclasses.replace(z, expanded_shapes=_shapes(args.expanded_shapes))
  if args.decode_shapes:
    z = dataclasses.replace(z, decode_shapes=_shapes(args.decode_shapes))
  if args.decode_queries:
    z = dataclasses.replace(z, decode_queries=tuple(int(n) for n in args.decode_queries.split(",")))
  dtype = jnp.float32 if args.cpu_smoke else jnp.bfloat16
  if args.cpu_smoke:
    args.repeats = min(args.repeats, 2)
  info = device_info()
  common = dict(device=info["device"], platform=info["platform"], versions=info["versions"],
                commit=info["commit"], command="python -m bench.mla " + " ".join(argv if argv is not None else sys.argv[1:]),
                dtype=jnp.dtype(dtype).name)
  rows = harness.load_rows(args.output)
  done = {key_of(r) for r in rows}
  suites = [s for s in args.suite.split(",") if s]
  impls = {s for s in args.impl.split(",") if s}
  splits = tuple(int(n) for n in args.mosaic_splits.split(",") if n)
  builders = dict(expanded=expanded_cases, decode=lambda z, dtype: decode_cases(z, dtype, splits))
  for suite in suites:
    if suite not in builders:
      raise SystemExit(f"--suite: unknown suite {suite!r}; known: {SUITES}")
    for meta, fn, xs in builders[suite](z, dtype):
      meta = dict(meta, **common)
      if (impls and meta["impl"] not in impls) or (key_of(meta) in done and not args.force):
        continue
      if meta["impl"].startswith("mla"):
        meta["dispatch"] = str(explain(*xs))
      try:
        row = measure(meta, fn, xs, meta["mode"], args)
      except Exception as e:  # noqa: BLE001 (recorded in the row, the suite goes on)
        status, msg = classify_error(e)
        row = dict(meta, status=status, error=msg)
      rows = [r for r in rows if key_of(r) != key_of(row)] + [row]
      print(json.dumps({k: row.get(k) for k in ("suite", "case", "mode", "impl", "status", "ms", "tflops", "tb_per_s",
                                                "compiled_total_bytes", "device_peak_bytes", "first_call_s")}),
            flush=True)
      if args.output:
        os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
        with open(args.output, "w") as f:
          f.writelines(json.dumps(r) + "\n" for r in rows)
  torch_suites = [s for s in suites if s in ("expanded", "decode")]
  if torch_suites and not (args.cpu_smoke or args.no_torch) and (not impls or any(i.startswith("torch") for i in impls)):
    new = torch_rows(z, common, args.repeats, torch_suites)   # after the JAX side, which leaves the GPU memory free
    rows = [r for r in rows if key_of(r) not in {key_of(n) for n in new}] + new
    for row in new:
      print(json.dumps({k: row.get(k) for k in ("suite", "case", "mode", "impl", "status", "ms", "tflops")}), flush=True)
    if args.output:
      with open(args.output, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
  return rows


if __name__ == "__main__":
  main()
