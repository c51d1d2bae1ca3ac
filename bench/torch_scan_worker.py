"""The scan room's torch peers, in their own process: mamba_ssm's Triton SSD and
flash-linear-attention's chunk linear attention (bench/scan.py merges their rows beside its own).

Neither package is installed on the GPU machine: ``bash bench/stage_scan_peers.sh`` stages
their pure-Python Triton sources into the git-ignored ``.peers/scan/`` (commits in its
VERSIONS.json), a device run carries it (``run(..., carry=[".peers"])``), and this worker puts
it first on ``sys.path`` with empty stub parents in ``sys.modules`` (``mamba_ssm``, ``fla``,
``fla.ops``), so that their compiled-extension and model imports never run.

Impls (each at probjax's inputs, from bench/scan.py's ``make_inputs``: activations in the row's
dtype, parameters float32):

* ``mamba_ssm_triton`` (op ``ssd``, shape ``[B, L, H, P, G, N]``): ``mamba_chunk_scan_combined(x,
  dt, A, B, C, chunk_size=256, D=D, dt_bias=dt_bias, dt_softplus=True)``, x ``[B, L, H, P]``,
  dt ``[B, L, H]`` and B, C ``[B, L, G, N]`` in the row's dtype, A ``-linspace(1, 16, H)``, D
  ones and dt_bias -4 (``[H]``, float32): the same op as ``ssd_scan(x, dt, A, B, C, D,
  dt_bias=dt_bias)`` (softplus(dt + dt_bias), the D skip; mamba applies both inside its
  kernels). ``fwd_bwd``: the gradients of x, dt, A, B, C, D and dt_bias (every floating
  input, as bench/scan.py's rows) for a random cotangent. Mamba-2's default chunk of 256.
* ``fla_chunk`` (op ``rla``, shape ``[B, T, H, Hkv, D, window]``): RLA's linear branch, ``o_t =
  φ(q_t) Σ_{s <= t - window - 1} φ(k_s) v_sᵀ`` with ``φ(x) = [softmax(x), softmax(-x)]`` (2D
  features, unnormalised): φ and the shift of keys and values by ``window + 1`` positions (zeros
  in front) in torch, then fla's ``chunk_linear_attn(φ(q), φ(k)_shifted, v_shifted, scale=1.0,
  normalize=False)``, which is ``chunk_simple_gla`` with no decay: ``o_t = q_t Σ_{s <= t} k_s
  v_sᵀ`` by fla's chunk kernels (chunk 64; inter-chunk states, then the intra-chunk causal
  part). Key/value heads are repeated to the query heads when fewer (GQA; fla's kernel takes
  equal heads). What differs from probjax's RLA: only the linear branch is a peer (RLA's
  sliding-window attention over the other keys is not part of ``residual_linear_attention``
  either); φ and the shift are separate torch kernels (probjax fuses them into its
  kernels); fla keeps the chunk states in the input dtype. ``fwd_bwd``: the gradients of q, k,
  v through φ and the shift.
* ``fla_chunk_kernel`` (op ``rla``): the same fla call alone on precomputed φ(q), shifted φ(k)
  and v (``fwd_bwd``: the gradients of those three): what the torch glue around it costs.

Check (``"check": true``, default): before timing, each peer runs a small case (SSD ``[2, 512,
4, 32, 1, 32]``, RLA ``[2, 256, 4, 4, 32, 40]``) in each dtype against a float32 torch
evaluation of the definition (the quadratic form of SSD, masked ``φ(q) φ(k)ᵀ v`` for RLA),
printing ``{"check": true, "op", "impl", "dtype", "shape", "max_abs_err", "ref_max_abs",
"rel_err", "status": "ok" | "mismatch" | error status}``.

  python bench/torch_scan_worker.py '{"ssd": [[4, 4096, 32, 64, 1, 128]], "rla": [[4, 4096, 8, 8, 64, 512]],
      "modes": ["fwd", "fwd_bwd"], "dtypes": ["bfloat16"], "repeats": 7}'

Spec: ``ssd`` / ``rla`` cases times ``modes`` times ``dtypes`` times ``impls`` (default every
impl of the op), or an explicit ``jobs`` list of ``[op, shape, mode, dtype, impl]``;
``repeats``, ``warmup``, ``min_repeat_s`` (time_fn's), ``check``, ``peers`` (default
``<repo>/.peers/scan``), ``max_seconds`` (no job starts after it).

Prints one JSON line per job: ``{"op", "shape", "mode", "dtype", "impl", "status", "timing" |
"error", "torch", "triton", "peer": {package, version, commit}}``, timing from
:func:`probjax.core.timing.time_fn` (loaded without JAX, as bench/torch_cpu_worker.py does).
Status ``unavailable`` (with the reason) where torch, CUDA, the staged sources or a peer's
import are missing; ``ok``, ``oom``, ``unsupported`` or ``error`` otherwise.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
import traceback
import types

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
IMPLS = {"ssd": ("mamba_ssm_triton",), "rla": ("fla_chunk", "fla_chunk_kernel")}
PEER_OF = {"mamba_ssm_triton": "mamba_ssm", "fla_chunk": "fla", "fla_chunk_kernel": "fla"}
SSD_CHUNK = 256          # Mamba-2's default chunk_size
CHECK_SHAPES = {"ssd": [2, 512, 4, 32, 1, 32], "rla": [2, 256, 4, 4, 32, 40]}
CHECK_RTOL = {"float32": 2e-2, "bfloat16": 5e-2, "float16": 5e-2}


def _load_timing():
  """probjax.core.timing without JAX, through bench/torch_cpu_worker.py's ``_timing`` (imported
  here, not at module level, so that bench/scan.py imports this module's tables without
  putting bench/ on sys.path)."""
  if HERE not in sys.path:
    sys.path.insert(0, HERE)  # run as a script, beside its sibling
  from torch_cpu_worker import _timing
  return _timing()


def jobs_of(spec: dict) -> list:
  if "jobs" in spec:
    return [list(j) for j in spec["jobs"]]
  impls = spec.get("impls")
  return [[op, list(shape), mode, dtype, impl]
          for op in ("ssd", "rla") for shape in spec.get(op, ())
          for mode in spec.get("modes", ("fwd", "fwd_bwd")) for dtype in spec.get("dtypes", ("bfloat16",))
          for impl in IMPLS[op] if impls is None or impl in impls]


def _stub(name: str, path: str, **attrs):
  """An empty package ``name`` over the folder ``path``: its submodules import from there, its
  own ``__init__.py`` (absent from the staged folder) never runs."""
  mod = types.ModuleType(name)
  mod.__path__ = [path]
  mod.__package__ = name
  mod.__dict__.update(attrs)
  sys.modules[name] = mod
  if "." in name:
    parent, _, child = name.rpartition(".")
    setattr(sys.modules[parent], child, mod)
  return mod


def staged_versions(peers: str) -> dict:
  """``.peers/scan/VERSIONS.json`` (what bench/stage_scan_peers.sh staged), or {}."""
  try:
    with open(os.path.join(peers, "VERSIONS.json")) as f:
      return json.load(f)
  except (OSError, ValueError):
    return {}


def load_peers(peers: str, versions: dict) -> tuple[dict, dict]:
  """``(functions, unavailable)``: the peers' entry points by package, and the reason for
  each package that did not import."""
  fns, missing = {}, {}
  if not versions:
    why = (f"{os.path.join(peers, 'VERSIONS.json')} not found: run `bash bench/stage_scan_peers.sh` "
           "and carry .peers to the device (run(..., carry=['.peers']))")
    return fns, {"mamba_ssm": why, "fla": why}
  if peers not in sys.path:
    sys.path.insert(0, peers)
  fallback = os.path.join(peers, "fallback")        # einops, only where the device lacks it
  if os.path.isdir(fallback) and fallback not in sys.path:
    sys.path.append(fallback)
  os.environ.setdefault("FLA_TILELANG", "0")        # fla's TileLang kernels are not staged
  try:
    _stub("mamba_ssm", os.path.join(peers, "mamba_ssm"), __version__=versions["mamba_ssm"]["version"])
    from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined
    fns["mamba_ssm"] = mamba_chunk_scan_combined
  except Exception as e:  # noqa: BLE001 (the reason is the row)
    missing["mamba_ssm"] = f"{type(e).__name__}: {e} | {traceback.format_exc()[-600:]}"
  try:
    _stub("fla", os.path.join(peers, "fla"), __version__=versions["fla"]["version"])
    _stub("fla.ops", os.path.join(peers, "fla", "ops"))
    from fla.ops.linear_attn import chunk_linear_attn
    fns["fla"] = chunk_linear_attn
  except Exception as e:  # noqa: BLE001
    missing["fla"] = f"{type(e).__name__}: {e} | {traceback.format_exc()[-600:]}"
  return fns, missing


# ---------------------------------------------------------------------------
# inputs and calls
# ---------------------------------------------------------------------------
def ssd_inputs(torch, shape, dtype, seed=0):
  b, length, h, p, g, n = shape
  gen = torch.Generator(device="cuda").manual_seed(seed)
  act = lambda *s, scale=1.0: (scale * torch.randn(*s, device="cuda", generator=gen)).to(dtype)
  f32 = dict(device="cuda", dtype=torch.float32)
  return dict(x=act(b, length, h, p), dt=act(b, length, h, scale=0.5), A=-torch.linspace(1.0, 16.0, h, **f32),
              B=act(b, length, g, n), C=act(b, length, g, n), D=torch.ones(h, **f32),
              dt_bias=torch.full((h,), -4.0, **f32))


def rla_inputs(torch, shape, dtype, seed=0):
  b, t, h, hk, d, _ = shape
  gen = torch.Generator(device="cuda").manual_seed(seed)
  mk = lambda hh: torch.randn(b, t, hh, d, device="cuda", generator=gen).to(dtype)
  return dict(q=mk(h), k=mk(hk), v=mk(hk))


def phi(torch, x):
  """RLA's softmax feature map over head_dim, in x's dtype: ``[softmax(x), softmax(-x)]``."""
  return torch.cat([torch.softmax(x, -1), torch.softmax(-x, -1)], -1).to(x.dtype)


def rla_glue(torch, q, k, v, window, heads):
  """φ(q), and φ(k), v shifted by ``window + 1`` positions (zeros in front), their heads
  repeated to the query heads."""
  F = torch.nn.functional
  t = q.shape[1]
  shift = lambda x: F.pad(x, (0, 0, 0, 0, window + 1, 0))[:, :t]
  fk, vs = shift(phi(torch, k)), shift(v)
  if fk.shape[2] != heads:
    fk, vs = (x.repeat_interleave(heads // x.shape[2], dim=2) for x in (fk, vs))
  return phi(torch, q), fk, vs


def call_of(torch, impl, fns, shape, a):
  """``(run, inputs)``: ``run(*inputs)`` computes the impl's output."""
  if impl == "mamba_ssm_triton":
    f = fns["mamba_ssm"]
    names = ("x", "dt", "A", "B", "C", "D", "dt_bias")
    return (lambda x, dt, A, B, C, D, dt_bias: f(x, dt, A, B, C, chunk_size=SSD_CHUNK, D=D, dt_bias=dt_bias,
                                                   dt_softplus=True)), [a[n] for n in names]
  f, window, heads = fns["fla"], shape[-1], shape[2]
  lin = lambda fq, fk, vs: f(fq, fk, vs, scale=1.0, normalize=False)[0]
  if impl == "fla_chunk":
    return (lambda q, k, v: lin(*rla_glue(torch, q, k, v, window, heads))), [a["q"], a["k"], a["v"]]
  with torch.no_grad():
    feats = [x.contiguous() for x in rla_glue(torch, a["q"], a["k"], a["v"], window, heads)]
  return lin, feats


def timed_fn(torch, run, xs, mode, seed=1):
  if mode == "fwd":
    def fn():
      with torch.no_grad():
        return run(*xs)
    return fn
  leaves = [x.detach().requires_grad_(True) for x in xs]
  with torch.no_grad():
    out = run(*xs)
  gen = torch.Generator(device="cuda").manual_seed(seed)
  dy = torch.randn(out.shape, device="cuda", generator=gen).to(out.dtype)
  del out
  return lambda: torch.autograd.grad(run(*leaves), leaves, dy)


# ---------------------------------------------------------------------------
# the float32 definitions, for the check
# ---------------------------------------------------------------------------
def ssd_ref(torch, x, dt, A, B, C, D, dt_bias):
  """SSD's quadratic form in float32: ``y_t = Σ_{s<=t} exp(Σ_{s<r<=t} Δ_r A) (C_t·B_s) Δ_s x_s +
  D x_t`` with ``Δ = softplus(dt + dt_bias)``."""
  x, dt, B, C = (z.float() for z in (x, dt, B, C))
  h, g = x.shape[2], B.shape[2]
  delta = torch.nn.functional.softplus(dt + dt_bias)                 # [b, l, h]
  cs = torch.cumsum(delta * A, 1)
  seg = cs[:, :, None, :] - cs[:, None, :, :]                        # [b, t, s, h]
  t = x.shape[1]
  causal = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
  decay = torch.exp(seg.masked_fill(~causal[None, :, :, None], float("-inf")))
  Bh, Ch = (z.repeat_interleave(h // g, dim=2) for z in (B, C))
  cb = torch.einsum("bthn,bshn->btsh", Ch, Bh)
  return torch.einsum("btsh,bshp->bthp", cb * decay * delta[:, None], x) + D[:, None] * x


def rla_ref(torch, q, k, v, window):
  """RLA's linear branch in float32: ``o_t = Σ_{s <= t - window - 1} (φ(q_t)·φ(k_s)) v_s``."""
  h, hk, t = q.shape[2], k.shape[2], q.shape[1]
  fq, fk = phi(torch, q.float()), phi(torch, k.float()).repeat_interleave(h // hk, dim=2)
  vv = v.float().repeat_interleave(h // hk, dim=2)
  i = torch.arange(t, device=q.device)
  mask = i[None, :] <= i[:, None] - window - 1                       # [t, s]
  scores = torch.einsum("bthf,bshf->bhts", fq, fk) * mask
  return torch.einsum("bhts,bshd->bthd", scores, vv)


def check(torch, timing, impl, fns, dtype_name):
  op = "ssd" if impl == "mamba_ssm_triton" else "rla"
  shape = CHECK_SHAPES[op]
  row = dict(check=True, op=op, impl=impl, dtype=dtype_name, shape=shape)
  try:
    dtype = getattr(torch, dtype_name)
    a = (ssd_inputs if op == "ssd" else rla_inputs)(torch, shape, dtype, seed=2)
    run, xs = call_of(torch, impl, fns, shape, a)
    with torch.no_grad():
      out = run(*xs).float()
      ref = ssd_ref(torch, **a) if op == "ssd" else rla_ref(torch, a["q"], a["k"], a["v"], shape[-1])
    err, scale = (out - ref).abs().max().item(), ref.abs().max().item()
    rel = err / max(scale, 1e-30)
    row.update(max_abs_err=err, ref_max_abs=scale, rel_err=rel,
               status="ok" if math.isfinite(rel) and rel <= CHECK_RTOL.get(dtype_name, 5e-2) else "mismatch")
  except Exception as e:  # noqa: BLE001
    row.update(status=timing.classify_error(e)[0], error=f"{type(e).__name__}: {str(e)[:600]}")
  print(json.dumps(row), flush=True)


# ---------------------------------------------------------------------------
def main():
  spec = json.loads(sys.argv[1]) if len(sys.argv) > 1 else {}
  timing = _load_timing()
  jobs = jobs_of(spec)
  start = time.perf_counter()
  peers = spec.get("peers") or os.path.join(ROOT, ".peers", "scan")
  versions = staged_versions(peers)
  peer_of = lambda impl: {k: versions.get(PEER_OF[impl], {}).get(k) for k in ("version", "commit", "repo")}

  def emit(job, **kw):
    op, shape, mode, dtype, impl = job
    kw.setdefault("peer", peer_of(impl))
    print(json.dumps(dict(op=op, shape=list(shape), mode=mode, dtype=dtype, impl=impl, **kw)), flush=True)

  try:
    import torch
    import triton
  except Exception as e:  # noqa: BLE001 (the "if it cannot run, say why" path)
    for job in jobs:
      emit(job, status="unavailable", error=f"{type(e).__name__}: {e}")
    return
  meta = dict(torch=torch.__version__, triton=getattr(triton, "__version__", None))
  if not torch.cuda.is_available():
    for job in jobs:
      emit(job, status="unavailable", error="torch.cuda.is_available() is False: the peers' Triton kernels need a GPU",
           **meta)
    return
  meta["gpu"] = torch.cuda.get_device_name()
  fns, missing = load_peers(peers, versions)

  if spec.get("check", True):
    for impl in dict.fromkeys(j[4] for j in jobs):
      if impl != "fla_chunk_kernel" and PEER_OF[impl] in fns:
        for dtype in dict.fromkeys(j[3] for j in jobs if j[4] == impl):
          check(torch, timing, impl, fns, dtype)
          torch.cuda.empty_cache()

  sync = lambda _x: torch.cuda.synchronize()
  for job in jobs:
    op, shape, mode, dtype, impl = job
    if PEER_OF[impl] in missing:
      emit(job, status="unavailable", error=missing[PEER_OF[impl]], **meta)
      continue
    if spec.get("max_seconds") and time.perf_counter() - start > spec["max_seconds"]:
      emit(job, status="skipped", error=f"past max_seconds {spec['max_seconds']}", **meta)
      continue
    row = dict(meta)
    try:
      a = (ssd_inputs if op == "ssd" else rla_inputs)(torch, shape, getattr(torch, dtype))
      run, xs = call_of(torch, impl, fns, shape, a)
      fn = timed_fn(torch, run, xs, mode)
      row.update(status="ok", timing=timing.time_fn(fn, sync, warmup=spec.get("warmup", 2),
                                                    repeats=spec.get("repeats", 7),
                                                    min_repeat_s=spec.get("min_repeat_s", 0.05)))
    except Exception as e:  # noqa: BLE001 (one failure is one row)
      status, msg = timing.classify_error(e)
      row.update(status=status, error=msg[:1000])
      if status == "error":
        row["traceback"] = traceback.format_exc()[-1500:]
    a = run = xs = fn = None
    torch.cuda.empty_cache()
    emit(job, **row)


if __name__ == "__main__":
  main()
