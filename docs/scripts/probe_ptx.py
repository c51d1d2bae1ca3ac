"""The PTX of the Triton forward against torch flex's at equal shapes (sm_90 only).

  python -m docs.scripts.probe_ptx --output docs/benchmarks/ptx_probe.json

Compiles probjax's Triton forward (``implementation="triton"``, its auto tiles) and torch's
compiled ``flex_attention`` for bf16 B4 H8 T4096 non-causal forwards at head_dim 64 and 128,
takes each kernel's PTX (XLA's dump for probjax, Triton's cache for torch) and counts the
instructions that tell the two code generators apart (tensor-core ops, copies, exponentials,
barriers, conversions), in the whole kernel and in its hottest loop (the longest basic-block
run between a loop label and its back edge). Each PTX is saved beside the JSON
(``<output stem>_<impl>_d<D>.ptx.txt``) for reading.

XLA writes no PTX of its Triton kernels: for probjax the probe reads XLA's Triton dump
(``--xla_dump_emitter_re=triton``, set by ``gpu_batch.sh``), keeps the TritonGPU IR before
its conversion to LLVM (``.ttgir.txt``: pipelining, copies, waits) and the final LLVM IR
(``.llvm.txt``), and counts the latter's operations (:data:`LLVM_OPS`).
"""

from __future__ import annotations

import glob
import os
import re
import sys
import tempfile

from docs.scripts import harness, impls

CASES = [(4096, 64), (4096, 128)]
# PTX opcode prefixes counted (a line counts for the first prefix it starts with).
OPS = ("wgmma.mma_async", "wgmma.fence", "wgmma.commit_group", "wgmma.wait_group", "mma.sync",
       "cp.async.bulk.tensor", "cp.async.bulk", "cp.async", "ldmatrix", "stmatrix", "ld.global",
       "ld.shared", "st.shared", "st.global", "ex2.approx", "fma.rn.f32", "mul.f32", "mul.rn.f32",
       "add.f32", "sub.f32", "max.f32", "max.nan.f32", "cvt.rn.bf16x2.f32", "cvt", "selp", "setp",
       "bar.sync", "barrier.sync", "bar.arrive", "mbarrier", "fence", "setmaxnreg", "shfl.sync", "bra")


# Operations counted in the LLVM IR of XLA's Triton dump (substrings; inline asm keeps PTX names).
LLVM_OPS = ("wgmma.mma_async", "ex2.approx", "fma.rn.f32", '"llvm.fmul"', '"llvm.fsub"', '"llvm.fadd"',
            '"llvm.intr.fma"', '"llvm.intr.maxnum"', '"llvm.fptrunc"', '"llvm.select"', "cp.async",
            "nvvm.cp.async.wait.group", "shfl")


def llvm_counts(ir: str) -> dict:
  return {op.strip('"'): n for op in LLVM_OPS if (n := ir.count(op))}


def ir_sections(dump: str) -> dict:
  """``{"ttgir": ..., "llvm": ...}`` of a Triton pass dump (``// -----// IR Dump ...`` sections):
  the TritonGPU IR right before its conversion to LLVM and the last section."""
  parts = re.split(r"(?m)^// -----// IR Dump ", dump)
  ttgir = next((p for p in parts if p.startswith("Before ConvertTritonGPUToLLVM")), "")
  return {"ttgir": ttgir, "llvm": parts[-1]}


def counts(ptx: str) -> dict:
  out = dict.fromkeys(OPS, 0)
  for line in ptx.splitlines():
    s = line.strip()
    if s.startswith("@"):  # predicated: "@%p1 bra ..."
      s = s.split(None, 1)[1] if " " in s else s
    for op in OPS:
      if s.startswith(op):
        out[op] += 1
        break
  return {k: v for k, v in out.items() if v}


def hottest_loop(ptx: str) -> str:
  """The longest span of lines from a label to a later branch back to it (a loop body)."""
  lines = ptx.splitlines()
  labels = {m.group(1): i for i, l in enumerate(lines) if (m := re.match(r"^\s*(\$?\w+):", l))}
  best = (0, 0)
  for i, l in enumerate(lines):
    m = re.search(r"\bbra(?:\.uni)?\s+(\$?\w+);", l)
    if m and m.group(1) in labels and labels[m.group(1)] < i and i - labels[m.group(1)] > best[1] - best[0]:
      best = (labels[m.group(1)], i)
  return "\n".join(lines[best[0]:best[1] + 1])


def header(ptx: str) -> dict:
  keys = (".maxnreg", ".reqntid", ".maxntid", ".target", ".version")
  return {k: m.group(1) for k in keys if (m := re.search(re.escape(k) + r"\s+([^\n]+)", ptx))}


def _jax_ptx(t: int, d: int, dump: str) -> tuple[str, str]:
  """(kernel name, PTX) of probjax's Triton forward, from XLA's dump of a fresh compile (its
  LLVM IR where the dump has no PTX: Triton's inline-asm wgmma and copies still read as PTX)."""
  import jax
  from probjax.nn.layers.attention import dot_product_attention
  arrays = impls.inputs(4, t, t, 8, 8, d)
  fn, _ = impls._jax_fn(lambda q, k, v: dot_product_attention(q, k, v, implementation="triton"),
                        arrays, "bfloat16", "fwd")
  jax.block_until_ready(fn())
  paths = sorted((p for p in glob.glob(os.path.join(dump, "**", "*"), recursive=True) if os.path.isfile(p)),
                 key=os.path.getmtime)
  for p in reversed(paths):  # .ptx files, or Triton's emitter dumps (--xla_dump_emitter_re)
    text = open(p, errors="replace").read()
    m = re.search(r"\.entry\s+(\w*probjax_attention_fwd\w*)", text)
    if m:
      return m.group(1), _entry(text, m.group(1))
  names = sorted(os.path.relpath(p, dump) for p in glob.glob(os.path.join(dump, "**", "*"), recursive=True))
  llvm = [p for p in paths if "probjax_attention_fwd" in p and "triton-to-llvm" in p]
  if llvm:  # XLA writes no PTX of its Triton kernels; the IR they lower to is the closest
    return "probjax_attention_fwd (Triton dump)", open(llvm[-1], errors="replace").read()
  raise RuntimeError(f"no PTX of probjax_attention_fwd among {len(names)} dumped files: "
                     f"{[n for n in names if 'convert_element_type' not in n][:20]}")


def _entry(text: str, name: str) -> str:
  """The module header and the one ``.entry`` named ``name`` of a PTX module."""
  start = text.index(".entry " + name)
  head = text[:text.find(".entry")] if text.find(".entry") >= 0 else ""
  nxt = text.find(".entry", start + 1)
  return head[:2000] + text[start:nxt if nxt > 0 else len(text)]


def _torch_ptx(t: int, d: int, cache: str) -> tuple[str, str, dict]:
  """(kernel name, PTX, launch metadata) of torch flex's forward for the shape."""
  import json
  fn, sync = impls.build_torch("torch_flex", impls.inputs(4, t, t, 8, 8, d), "bfloat16", False, "fwd")
  before = set(glob.glob(os.path.join(cache, "**", "*.ptx"), recursive=True))
  sync(fn())
  new = set(glob.glob(os.path.join(cache, "**", "*.ptx"), recursive=True)) - before
  cands = [p for p in new if "flex" in os.path.basename(p) or "tem" in os.path.basename(p)] or sorted(new)
  if not cands:
    raise RuntimeError("torch compiled no new Triton kernel for flex_attention")
  p = max(cands, key=lambda p: os.path.getsize(p))
  meta = {}
  mp = os.path.splitext(p)[0] + ".json"
  if os.path.exists(mp):
    raw = json.load(open(mp))
    meta = {k: raw.get(k) for k in ("name", "num_warps", "num_stages", "shared", "num_ctas", "maxnreg") if k in raw}
  text = open(p).read()
  name = re.search(r"\.entry\s+(\w+)", text).group(1)
  return name, _entry(text, name), meta


def main(argv=None):
  # XLA reads its flags once per process: gpu_batch.sh sets them with $PROBJAX_XLA_DUMP.
  dump = os.environ.get("PROBJAX_XLA_DUMP") or tempfile.mkdtemp(prefix="xla_dump_")
  if f"--xla_dump_to={dump}" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" --xla_dump_to={dump}").strip()
  cache = tempfile.mkdtemp(prefix="triton_cache_")
  os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
  os.environ["TRITON_CACHE_DIR"] = cache
  os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(cache, "inductor")
  args, out = harness.probe_start("probe_ptx", __doc__, argv)
  if out is None:
    return 0
  stem = os.path.splitext(args.output)[0]
  for t, d in CASES:
    sides = [("probjax_triton", lambda: (*_jax_ptx(t, d, dump), {})), ("torch_flex", lambda: _torch_ptx(t, d, cache))]
    for impl, get in sides:
      try:
        name, ptx, meta = get()
      except Exception as e:  # noqa: BLE001 (the other side's row stands)
        harness.probe_add(out, args.output, dict(impl=impl, t=t, d=d, error=f"{type(e).__name__}: {e}"[:400]))
        continue
      if name.endswith("(Triton dump)"):
        sections = ir_sections(ptx)
        for kind, text in sections.items():
          with open(f"{stem}_{impl}_d{d}.{kind}.txt", "w") as f:
            f.write(text)
        harness.probe_add(out, args.output, dict(impl=impl, t=t, d=d, kernel=name,
                                                 llvm_counts=llvm_counts(sections["llvm"])))
        continue
      with open(f"{stem}_{impl}_d{d}.ptx.txt", "w") as f:
        f.write(ptx)
      loop = hottest_loop(ptx)
      harness.probe_add(out, args.output, dict(
          impl=impl, t=t, d=d, kernel=name, meta=meta, header=header(ptx), lines=len(ptx.splitlines()),
          counts=counts(ptx), loop_lines=len(loop.splitlines()), loop_counts=counts(loop)))
  return 0


if __name__ == "__main__":
  sys.exit(main())
