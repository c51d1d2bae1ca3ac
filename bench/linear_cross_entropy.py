"""linear_cross_entropy against the unfused head (logits, then the softmax cross-entropy):
compiled memory of the loss's gradient, and time, in one process.

  python -m bench.linear_cross_entropy --memory-only --output bench/results/cpu/lce_memory.json
  python -m bench.linear_cross_entropy --output bench/results/h200/lce.json      # a GPU: times too

Cases (tokens x d x vocab, bf16 inputs): the LM step's head (16384 x 768 x 32768, batch 8 x
2048 tokens) and a larger vocabulary (8192 x 1024 x 131072). Per case and implementation (``fused``:
``linear_cross_entropy``'s XLA backend, default tiles; ``triton``: its Pallas-Triton kernels, on a
GPU, or in interpret mode with ``--smoke``; ``unfused``: ``x @ w`` in float32, logsumexp, the
label's logit), one row: ``temp_bytes`` (XLA's compiled temporary memory of the value-and-grad
program, ``compiled.memory_analysis()``: what the loss needs beyond its inputs and outputs,
the same convention on every device) and, without ``--memory-only``, ``ms`` (median of
``--repeats`` rotating rounds) and ``peak_bytes`` (``device.memory_stats()``'s peak after the
implementation's first run, where the device reports one; the implementations run first in the
order fused, triton, unfused, so the unfused head's larger peak comes last and does not mask the
others). ``--tiles 4096x8192,2048x16384`` adds one ``fused_<tokens>x<vocab>`` row per tile
(the XLA backend with ``chunk_tokens``/``chunk_vocab``): the tile that the default's
``CHUNK_TOKENS x CHUNK_VOCAB`` should be is read from these rows. A vocabulary part of ``all``
(or one at least the case's vocabulary) is the whole vocabulary, a row ``fused_<tokens>xall``:
the loss being a mean, the XLA backend then computes the gradients in its forward sweep (three
products per tile instead of four); every fused row's ``grad_in_forward`` says which scheme ran
and its ``chunk_tokens``/``chunk_vocab`` which tile (``explain_dispatch``'s). Rows are JSON lines
keyed by (case, impl) with the device, versions, commit and command.

  python -m bench.linear_cross_entropy --tiles 2048x8192,4096x8192,4096x16384 --output bench/results/h200/lce.json
  python -m bench.linear_cross_entropy --tiles 1024xall,2048xall,4096x8192 --output bench/results/h200/lce.json

``--cases 2048x256x32768,...`` replaces the two cases with these (smaller ones for a CPU).
``--sample N`` replaces the two cases with N drawn ones (:func:`draw_cases`), to validate a tile
rule fitted on other cases: the seed is ``--seed`` or, without it, drawn from the OS's entropy
and printed; each row records it (``seed``, ``sampler``), and case ``i`` of a seed does not
depend on N. ``--append`` keeps the output's rows and skips the cases it already has, so a run
cut short resumes. The materialised logits (``unfused``) are left out of a case whose float32
logits would pass ``--max-logits-gib``.

  python -m bench.linear_cross_entropy --sample 12 --tiles 1024xall,2048xall --append --output lce_sample.json
"""

from __future__ import annotations

import argparse
import json
import math
import secrets
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from bench.harness import command_line, load_rows
from probjax.core.timing import device_info
from probjax.ops.linear_cross_entropy import LinearCrossEntropyCall, explain_dispatch, linear_cross_entropy

CASES = {"lm_head": (16384, 768, 32768), "big_vocab": (8192, 1024, 131072)}
SMOKE = {"smoke": (256, 32, 1000)}
SAMPLER = "lce_sample/1"
# The drawn cases' ranges: what LM heads train with (batch x sequence tokens per step and
# device, model widths, vocabularies from a byte-level 8k to a multilingual 256k).
SAMPLE_TOKENS = (2048, 65536)
SAMPLE_D = (512, 768, 1024, 1536, 2048, 3072, 4096)
SAMPLE_VOCAB = (8000, 262144)


def _log_uniform(rng, lo: int, hi: int) -> int:
  return int(round(math.exp(rng.uniform(math.log(lo), math.log(hi)))))


def draw_cases(seed: int, n: int) -> dict[str, tuple[int, int, int]]:
  """``n`` cases ``{"s<seed>#<i>": (tokens, d, vocab)}``: tokens and vocabulary log-uniform
  integers over :data:`SAMPLE_TOKENS` and :data:`SAMPLE_VOCAB` (odd sizes included), ``d``
  uniform over :data:`SAMPLE_D`; case ``i`` from its own generator ``default_rng([seed, i])``."""
  out = {}
  for i in range(n):
    rng = np.random.default_rng([seed, i])
    out[f"s{seed}#{i}"] = (_log_uniform(rng, *SAMPLE_TOKENS), int(rng.choice(SAMPLE_D)),
                           _log_uniform(rng, *SAMPLE_VOCAB))
  return out


def unfused(x, w, labels):
  logits = jnp.dot(x, w, preferred_element_type=jnp.float32)
  lse = jax.nn.logsumexp(logits, -1)
  return jnp.mean(lse - jnp.take_along_axis(logits, labels[:, None], -1)[:, 0])


def parse_tiles(text: str | None) -> list[tuple[int, int | None]]:
  """``"4096x8192,2048xall"`` -> ``[(4096, 8192), (2048, None)]`` (None: the whole vocabulary)."""
  tiles = []
  for part in (text or "").split(","):
    if not part.strip():
      continue
    try:
      t, v = part.strip().lower().split("x")
      t, v = int(t), None if v == "all" else int(v)
    except ValueError:
      raise ValueError(f"--tiles: {part!r} is not <tokens>x<vocab> or <tokens>xall (e.g. 4096x8192)") from None
    if t < 1 or (v is not None and v < 1):
      raise ValueError(f"--tiles: {part!r} must be positive")
    tiles.append((t, v))
  return tiles


def parse_cases(text: str) -> dict[str, tuple[int, int, int]]:
  """``"2048x256x32768,..."`` -> ``{"2048x256x32768": (2048, 256, 32768), ...}``."""
  out = {}
  for part in text.split(","):
    try:
      n, d, v = (int(p) for p in part.strip().lower().split("x"))
    except ValueError:
      raise ValueError(f"--cases: {part!r} is not <tokens>x<d>x<vocab> (e.g. 2048x256x32768)") from None
    if min(n, d, v) < 1:
      raise ValueError(f"--cases: {part!r} must be positive")
    out[f"{n}x{d}x{v}"] = (n, d, v)
  return out


def fused_tiles(tiles: list[tuple[int, int | None]], vocab: int) -> dict[str, tuple[int | None, int | None]]:
  """The fused rows' names and ``(chunk_tokens, chunk_vocab)``: ``fused`` (the default's tile)
  and one per tile; a vocabulary part that covers ``vocab`` (None, or at least ``vocab``) is
  named ``all`` (``fused_<tokens>xall``), the scheme with the gradients in the forward sweep."""
  out = {"fused": (None, None)}
  for t, v in tiles:
    whole = v is None or v >= vocab
    out[f"fused_{t}x{'all' if whole else v}"] = (t, vocab if whole else v)
  return out


def impls(interpret: bool, tiles: list[tuple[int, int | None]] = (), vocab: int | None = None) -> dict:
  """The implementations compared, in the order of their first runs (see the module doc);
  ``vocab`` (the case's) names the tiles' rows (:func:`fused_tiles`)."""
  out = {}
  for name, (t, v) in fused_tiles(tiles, vocab or 0).items():
    out[name] = (lambda t, v: lambda x, w, labels: linear_cross_entropy(
        x, w, labels, implementation="xla", chunk_tokens=t, chunk_vocab=v))(t, v)
  if interpret or jax.default_backend() == "gpu":
    out["triton"] = lambda x, w, labels: linear_cross_entropy(x, w, labels, implementation="triton",
                                                              interpret=interpret)
  out["unfused"] = unfused
  return out


def tile_decisions(shapes, tiles: list[tuple[int, int | None]], vocab: int) -> dict[str, dict]:
  """Per fused row, the XLA backend's decision for the row's call (``explain_dispatch``): its
  tile (``chunk_tokens``, ``chunk_vocab``) and whether it computes the gradients in the forward
  sweep (``grad_in_forward``)."""
  out = {}
  for name, (t, v) in fused_tiles(tiles, vocab).items():
    d = explain_dispatch(LinearCrossEntropyCall.of(*shapes, chunk_tokens=t, chunk_vocab=v), implementation="xla")
    out[name] = {k: d.get(k) for k in ("chunk_tokens", "chunk_vocab", "grad_in_forward")}
  return out


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--output", required=True)
  p.add_argument("--memory-only", action="store_true", help="compile and read memory; time nothing")
  p.add_argument("--smoke", action="store_true", help="a tiny case (CPU, seconds)")
  p.add_argument("--repeats", type=int, default=7)
  p.add_argument("--tiles", default=None, help="also the XLA backend at these tiles: <tokens>x<vocab>,...")
  p.add_argument("--cases", default=None,
                 help="these cases instead of the fixed ones: <tokens>x<d>x<vocab>,... (e.g. for a CPU)")
  p.add_argument("--sample", type=int, default=None, help="N drawn cases instead of the fixed ones")
  p.add_argument("--seed", type=int, default=None, help="the sample's seed (default: drawn and printed)")
  p.add_argument("--append", action="store_true", help="keep the output's rows; skip the cases it has")
  p.add_argument("--skip", default="", help="leave out these rows: <impl>,... (e.g. triton,fused)")
  p.add_argument("--max-logits-gib", type=float, default=16.0,
                 help="leave out the materialised logits where their float32 bytes pass this")
  args = p.parse_args(argv)
  tiles = parse_tiles(args.tiles)
  skip = {s for s in args.skip.split(",") if s}
  info = device_info()
  seed = None
  if args.sample is not None:
    if args.sample < 1:
      raise SystemExit(f"--sample must be a positive count, got {args.sample}")
    seed = secrets.randbits(31) if args.seed is None else args.seed
    print(f"sample {SAMPLER}: seed {seed}, {args.sample} cases", flush=True)
    cases = draw_cases(seed, args.sample)
    if args.smoke:  # the drawn cases' names and order at the smoke case's size
      cases = {name: SMOKE["smoke"] for name in cases}
  elif args.cases:
    cases = parse_cases(args.cases)
  else:
    cases = SMOKE if args.smoke else CASES
  interpret = args.smoke and jax.default_backend() != "gpu"
  rows = load_rows(args.output) if args.append else []
  have = {r["case"] for r in rows}
  for i, (case, (n, d, v)) in enumerate(cases.items()):
    if case in have:
      print(f"[{i + 1}/{len(cases)}] {case}: in {args.output}, skipped", flush=True)
      continue
    print(f"[{i + 1}/{len(cases)}] {case}: {n} tokens x d {d} x vocab {v}", flush=True)
    shapes = (jax.ShapeDtypeStruct((n, d), jnp.bfloat16), jax.ShapeDtypeStruct((d, v), jnp.bfloat16),
              jax.ShapeDtypeStruct((n,), jnp.int32))
    fns = {}
    schemes = tile_decisions(shapes, tiles, v)
    for impl, f in impls(interpret, tiles, v).items():
      if impl in skip:
        continue
      if impl == "unfused" and 4 * n * v > args.max_logits_gib * 2**30:
        print(f"{case} unfused: left out, {4 * n * v / 2**30:.1f} GiB of logits > --max-logits-gib", flush=True)
        continue
      fn = jax.jit(jax.value_and_grad(f, argnums=(0, 1)))
      compiled = fn.lower(*shapes).compile()
      mem = compiled.memory_analysis()
      row = dict(suite="lce", case=case, impl=impl, tokens=n, d=d, vocab=v, dtype="bfloat16",
                 temp_bytes=getattr(mem, "temp_size_in_bytes", None), logits_bytes=4 * n * v,
                 **schemes.get(impl, dict(grad_in_forward=None)), **({} if seed is None else dict(seed=seed, sampler=SAMPLER)),
                 device=info["device"], platform=info["platform"], versions=info["versions"],
                 commit=info["commit"], command=command_line(), status="ok")
      rows.append(row)
      fns[impl] = (compiled, row)
      scheme = " (gradients in the forward sweep)" if row["grad_in_forward"] else ""
      print(f"{case} {impl}: temp {row['temp_bytes'] / 2**20:,.1f} MiB{scheme}", flush=True)
    if not args.memory_only:
      k = jax.random.split(jax.random.key(0), 3)
      x = jax.random.normal(k[0], (n, d), jnp.bfloat16)
      w = (jax.random.normal(k[1], (d, v), jnp.float32) * d ** -0.5).astype(jnp.bfloat16)
      labels = jax.random.randint(k[2], (n,), 0, v)
      times = {impl: [] for impl in fns}
      stats = getattr(jax.devices()[0], "memory_stats", lambda: None)
      for compiled, row in fns.values():
        jax.block_until_ready(compiled(x, w, labels))
        row.update(peak_bytes=(stats() or {}).get("peak_bytes_in_use"))
      order = list(fns)
      for r in range(args.repeats):
        for impl in order[r % len(order):] + order[:r % len(order)]:
          t0 = time.perf_counter()
          jax.block_until_ready(fns[impl][0](x, w, labels))
          times[impl].append((time.perf_counter() - t0) * 1e3)
      for impl, (_, row) in fns.items():
        row.update(ms=statistics.median(times[impl]), round_ms=times[impl])
    write_rows(args.output, rows)  # after each case: a run cut short keeps the cases it finished
  return 0


def write_rows(path: str, rows: list) -> None:
  with open(path, "w") as f:
    for r in rows:
      f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
  sys.exit(main())
