"""Measured dispatch (issue 41) for MLA, the grouped matmul and the scans: calls drawn at random,
the default and every exact path the op lists timed in one process.

The attention sampler's protocol (:mod:`bench.dispatch_sample`) for the other ops, one op at a
time (``--op``: :data:`OPS`), on the shared runner (:func:`bench.dispatch_core.run_calls`: each
batch's cases compiled on ``--compile-workers`` threads, then each call timed alone in rotating
rounds):

  python -m bench.dispatch_ops sample --op OP --seed S --n N
  python -m bench.dispatch_ops run --op OP --seed S --n N --out PATH [--budget-s SECONDS]
  python -m bench.dispatch_ops draw-seed --op OP --fit FIT.json --out SEED.json
  python -m bench.dispatch_ops report --op OP --fit FIT.json [--validate VAL.json] [--out PREFIX]

Protocol: each op's fit sample is its seed in :data:`FIT_SEEDS` (fixed here before any
measurement); its validation seed is drawn afterwards by ``draw-seed`` (the OS's entropy,
recorded with the time and the SHA-256 of the fit rows). Call ``i`` of a seed has its own
generator (``numpy.random.default_rng([seed, i])``), so a larger ``--n`` extends a sample and a
run cut by its budget measured the first calls of the same sample. A draw is kept where an H200
estimate of its time (:func:`bench.dispatch_core.roofline_ms` of its FLOPs and bytes) lies in
0.02-20 ms and its arrays in 8 GiB; otherwise the call is drawn again from the same generator.

Distributions (:data:`SAMPLER_VERSION` names them in every row):

* ``mla`` (:class:`MLASpec`): decode (0.45: 1-4 queries over a cache of log-uniform 256-32768
  positions, ``KVLenMask`` lengths uniform in [S/4, S], the first S; batch 1-128; ``fwd``),
  prefill (0.35: ``Tq = S`` log-uniform 128-16384, causal; batch 1-16) and a prefill chunk (0.20:
  64-4096 queries at the end of a 256-32768 cache, causal bottom-right; batch 1-16); prefill
  and chunks ``fwd`` or ``fwd_bwd`` (every input's gradient); heads 16/32/64/128; widths
  DeepSeek-V2/V3's (latent 512, nope 128, rope 64, v 128; 0.75) or MiniCPM3's (256, 64, 32, 64);
  bf16/fp16. Paths: each form (``expanded``, ``absorbed``) with attention's default, each with
  every attention implementation named (``expanded:cudnn``: ``implementation="cudnn"``), and the
  absorbed form with each of MLA's own kernels (``absorbed:triton``, ``absorbed:mosaic``).
* ``grouped_matmul`` (:class:`GroupedMatmulSpec`): an MoE layer's expert product: tokens
  log-uniform 16-32768, experts 8-256, top-k 1-8, d_model 1024-7168, expert d_ff 256-14336, the
  up (``[T k, d_model] x [E, d_model, d_ff]``) or down projection; group sizes a multinomial of
  the ``T k`` rows over Dirichlet(alpha) expert shares, alpha log-uniform in [0.05, 20] (small
  alpha: a few hot experts and empty groups); bf16/fp16; ``fwd`` or ``fwd_bwd`` (lhs and rhs).
  Paths: ``implementation=`` each of the op's ``available_implementations``.
* ``mamba_scan``, ``ssd_scan``, ``residual_linear_attention`` (:class:`ScanSpec`): batch
  log-uniform 1-64, length 128-16384; Mamba-1 channels 1536-5120 with state 16/32; SSD heads
  24-128 of width 64, 1 or 8 groups, state 64/128; RLA 8-32 heads, GQA 1/2/4, head_dim 64/128,
  window log-uniform 64-2048, feature map softmax/relu; bf16, fp16 or fp32; ``fwd`` or
  ``fwd_bwd`` (every floating input). Paths: each of the op's ``available_implementations``.

Rows (JSON lines, one per call x path): ``suite`` ("dispatch_<op>"), ``op``, ``sampler``, the
call's draw (``call_id`` ``s<seed>#<index>``, ``seed``, ``index``, ``kind``, ``dtype``, ``mode``,
its shape fields, ``est_ms``, ``draws``), ``impl`` ("default" or the path), ``ms`` (median of
the rounds' medians), ``round_ms``, ``compile_s``, ``probe_ms``, ``status`` (and ``error``),
``decision`` (what the op's ``explain_dispatch`` says the path runs), ``default_decision``,
``default_impl`` / ``default_grad_impl`` (the path the default runs, and under grad), and the
device, versions (jax's as ``jax_version``), commit, command and time.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from typing import Any, Callable, Iterable

import numpy as np

from bench import dispatch_core as core
from bench.dispatch_core import Refused

SAMPLER_VERSION = "dispatch_ops/1"
FIT_SEEDS = {"mla": 4111, "grouped_matmul": 4112, "mamba_scan": 4113, "ssd_scan": 4114,
             "residual_linear_attention": 4115}  # fixed before any measurement; validation: draw-seed
DTYPES16 = ("bfloat16", "float16")
SCAN_DTYPES = ("bfloat16", "float16", "float32")
MODES = ("fwd", "fwd_bwd")
SHORT_DTYPE = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}
ITEMSIZE = {"bfloat16": 2, "float16": 2, "float32": 4}
FWD_BWD_FLOPS = 3.5  # fwd_bwd / fwd: FLOPs (bench.harness' convention) and bytes
FWD_BWD_BYTES = 3.0


@dataclasses.dataclass(frozen=True)
class OpCall:
  """One drawn call of ``op``: its kind, dtype and mode, and its shape as ``(name, value)`` pairs
  (:attr:`p` as a dict)."""
  op: str
  seed: int
  index: int
  kind: str
  dtype: str
  mode: str
  shape: tuple[tuple[str, Any], ...]
  est_ms: float = 0.0
  draws: int = 1

  @property
  def call_id(self) -> str:
    return core.call_id(self.seed, self.index)

  @property
  def p(self) -> dict:
    return dict(self.shape)

  def as_dict(self) -> dict:
    d = {"op": self.op, "call_id": self.call_id, "seed": self.seed, "index": self.index, "kind": self.kind,
         "dtype": self.dtype, "mode": self.mode}
    d.update((k, list(v) if isinstance(v, tuple) else v) for k, v in self.shape)
    d.update(est_ms=self.est_ms, draws=self.draws)
    return d


def _normal(key, shape, dtype, scale=1.0):
  import jax
  import jax.numpy as jnp
  return (scale * jax.random.normal(key, shape, jnp.float32)).astype(dtype)


def _device(device):
  from probjax.core.device import Device
  return device or Device.current()


class OpSpec:
  """An op as :func:`bench.dispatch_core.run_calls` measures it (the spec's methods: that module's
  docstring); each op defines :meth:`draw_once`, :meth:`cost` (the forward's FLOPs and the bytes
  of its inputs and output: the budget), :meth:`paths`, :meth:`explain`, :meth:`pick`, :meth:`function`, :meth:`avals`,
  :meth:`inputs` and :meth:`group`."""
  op = ""
  fields: tuple[str, ...] = ()  # the shape's names, in the rows

  @property
  def suite(self) -> str:
    return f"dispatch_{self.op}"

  # --- sampling ---
  def draw_call(self, seed: int, index: int) -> OpCall:
    """Call ``index`` of sample ``seed``: draws until one lies in the budget (``draws`` counts them)."""
    rng = np.random.default_rng([seed, index])
    for n in range(1, core.MAX_DRAWS + 1):
      c = self.draw_once(rng, seed, index)
      est = self.estimate_ms(c)
      if core.in_budget(est, self.array_bytes(c)):
        return dataclasses.replace(c, est_ms=round(est, 6), draws=n)
    raise RuntimeError(f"no {self.op} call of sample {seed} index {index} within the budget in {core.MAX_DRAWS} draws")

  def sample(self, seed: int, n: int, shard: tuple[int, int] = (0, 1)) -> list[OpCall]:
    i, k = shard
    return [self.draw_call(seed, j) for j in range(n) if j % k == i]

  def array_bytes(self, c: OpCall) -> int:
    """Bytes of the call's inputs and output, and of their gradients under ``fwd_bwd``."""
    return self.cost(c)[1] * (2 if c.mode == "fwd_bwd" else 1)

  def estimate_ms(self, c: OpCall) -> float:
    """The call's H200 yardstick (ms): its FLOPs and the bytes of its arrays at the roofline rates;
    x3.5 FLOPs and x3 bytes for ``fwd_bwd``."""
    flops, nbytes = self.cost(c)
    if c.mode == "fwd_bwd":
      flops, nbytes = flops * FWD_BWD_FLOPS, nbytes * FWD_BWD_BYTES
    return core.roofline_ms(flops, nbytes)

  # --- the runner's spec ---
  def plan(self, c: OpCall, device) -> dict:
    out = {}
    for path in (None, *self.paths(c, device)):
      try:
        out[path] = self.explain(c, path, _device(device))
      except Exception as e:  # noqa: BLE001 (ValueError: refused; anything else is recorded, never raised)
        out[path] = core.refusal(e)
    return out

  def row_name(self, path: str | None) -> str:
    return "default" if path is None else path

  def row(self, c: OpCall, plan: dict, path: str | None, result, status: str, error) -> dict:
    d, own = plan.get(None), plan.get(path)
    row = {"suite": self.suite, "sampler": SAMPLER_VERSION, **c.as_dict(), "impl": self.row_name(path), "ms": None,
           "status": status}
    row.update(result or {})
    if status != "ok":
      row["ms"] = None
    if error:
      row["error"] = error
    row.update(decision=None if isinstance(own, Refused) else str(own),
               default_decision=None if isinstance(d, Refused) else str(d),
               default_impl=None if isinstance(d, Refused) else self.pick(d, c, grad=False),
               default_grad_impl=self.pick(d, c, grad=True) if c.mode == "fwd_bwd" and not isinstance(d, Refused) else None)
    row.update(core.environment())
    return row

  def check(self, c: OpCall, row: dict) -> None:
    want = c.as_dict()
    for f in ("kind", "dtype", "mode", *self.fields):
      if row.get(f) != want.get(f):
        raise SystemExit(f"{row.get('call_id')}: the stored row's {f} is {row.get(f)!r}, the sampler draws "
                         f"{want.get(f)!r} (sampler changed?): write to a new --out file")

  def describe(self, c: OpCall | dict) -> str:
    g = c.as_dict() if isinstance(c, OpCall) else c
    shape = " ".join(f"{k}={g[k]}" for k in self.fields if k not in self.quiet)
    return f"{g['call_id']} {g['kind']} {SHORT_DTYPE.get(g['dtype'], g['dtype'])} {shape} {g['mode']}"

  quiet: tuple[str, ...] = ()  # shape fields the progress line leaves out

  def summary_line(self, rows: list[dict]) -> str:
    return core.summary_line(rows, "default")

  # --- the report ---
  def calls_of(self, rows: Iterable[dict]) -> list[dict]:
    fields = ("call_id", "seed", "index", "kind", "dtype", "mode", *self.fields, "est_ms", "default_decision",
              "default_impl", "default_grad_impl", "device", "commit")
    return core.calls_of(rows, self.suite, fields, self.group)

  def pick(self, decision, c: OpCall, grad: bool) -> str | None:
    """The path the default's decision runs (under grad: what a differentiated call runs)."""
    return core.impl_of(decision, grad)


# ---------------------------------------------------------------------------------------------
# MLA
# ---------------------------------------------------------------------------------------------
MLA_KINDS = (("decode", 0.45), ("prefill", 0.35), ("chunk", 0.20))
MLA_WIDTHS = (("deepseek", dict(d_c=512, d_nope=128, d_rope=64, d_v=128), 0.75),
              ("minicpm3", dict(d_c=256, d_nope=64, d_rope=32, d_v=64), 0.25))
MLA_HEADS = (16, 32, 64, 128)
MLA_DECODE_Q = (1, 4)
MLA_CACHE = (256, 32768)
MLA_PREFILL = (128, 16384)
MLA_CHUNK_Q = (64, 4096)
MLA_DECODE_BATCH = (1, 128)
MLA_PREFILL_BATCH = (1, 16)


class MLASpec(OpSpec):
  op = "mla"
  fields = ("batch", "q_len", "kv_len", "heads", "widths", "d_c", "d_nope", "d_rope", "d_v", "kv_lengths")
  quiet = ("d_c", "d_nope", "d_rope", "d_v", "kv_lengths")

  def draw_once(self, rng, seed, index) -> OpCall:
    kinds, probs = zip(*MLA_KINDS)
    kind = kinds[int(rng.choice(len(kinds), p=probs))]
    names, widths, wp = zip(*MLA_WIDTHS)
    w = int(rng.choice(len(names), p=wp))
    heads = core.choice(rng, MLA_HEADS)
    dtype = core.choice(rng, DTYPES16)
    mode = core.choice(rng, MODES)
    lengths = None
    if kind == "decode":
      batch = core.log_uniform_int(rng, *MLA_DECODE_BATCH)
      s = core.log_uniform_int(rng, *MLA_CACHE)
      q = int(rng.integers(MLA_DECODE_Q[0], MLA_DECODE_Q[1] + 1))
      lens = rng.integers(max(1, s // 4), s + 1, size=batch)
      lens[0] = s
      lengths, mode = tuple(int(x) for x in lens), "fwd"
    elif kind == "prefill":
      batch = core.log_uniform_int(rng, *MLA_PREFILL_BATCH)
      s = q = core.log_uniform_int(rng, *MLA_PREFILL)
    else:
      batch = core.log_uniform_int(rng, *MLA_PREFILL_BATCH)
      s = core.log_uniform_int(rng, *MLA_CACHE)
      q = core.log_uniform_int(rng, MLA_CHUNK_Q[0], max(MLA_CHUNK_Q[0], min(s, MLA_CHUNK_Q[1])))
      s = max(s, q)
    shape = dict(batch=batch, q_len=q, kv_len=s, heads=heads, widths=names[w], **widths[w], kv_lengths=lengths)
    return OpCall(self.op, seed, index, kind, dtype, mode, tuple(shape.items()))

  def cost(self, c: OpCall):
    """FLOPs of the cheaper form (:func:`probjax.ops.mla.dispatch.absorbed_is_cheaper`'s counts
    over the visible positions, 2 per multiply-add) and the bytes of the arrays (2 each)."""
    p = c.p
    b, tq, s, h = p["batch"], p["q_len"], p["kv_len"], p["heads"]
    dc, dn, dr, dv = p["d_c"], p["d_nope"], p["d_rope"], p["d_v"]
    vis = float(np.mean(p["kv_lengths"])) if p["kv_lengths"] else (s - tq / 2 if c.kind != "decode" else s)
    proj = dc * (dn + dv)
    expanded = s * proj + tq * vis * (dn + dr + dv)
    absorbed = tq * proj + tq * vis * (2 * dc + dr)
    flops = 2.0 * b * h * min(expanded, absorbed)
    elems = b * tq * h * (dn + dr + dv) + b * s * (dc + dr) + dc * h * (dn + dv)
    return flops, 2 * elems

  def paths(self, c: OpCall, device) -> list[str]:
    """Each form with attention's default, each form with every attention implementation named,
    and the absorbed form with each of MLA's kernels (under the absorbed form a name that is an
    MLA kernel's, "triton" or "mosaic", asks for that kernel, not attention's)."""
    from probjax.ops import attention, mla
    dev = _device(device)
    names = attention.available_implementations(dev)
    kernels = [n for n in mla.REGISTRY.available(dev) if n != "xla"]
    return (["expanded", *(f"expanded:{n}" for n in names), "absorbed",
             *(f"absorbed:{n}" for n in dict.fromkeys([*names, *kernels]))])

  @staticmethod
  def _form_impl(path: str | None) -> tuple[str, str | None]:
    if path is None:
      return "auto", None
    form, _, impl = path.partition(":")
    return form, impl or None

  def mask(self, c: OpCall):
    from probjax.ops.attention import CausalMask, KVLenMask
    p = c.p
    if p["kv_lengths"]:
      import jax.numpy as jnp
      return KVLenMask(jnp.asarray(p["kv_lengths"], jnp.int32))
    return CausalMask(offset=p["kv_len"] - p["q_len"])

  def avals(self, c: OpCall):
    import jax
    import jax.numpy as jnp
    p, dt = c.p, jnp.dtype(c.dtype)
    b, tq, s, h = p["batch"], p["q_len"], p["kv_len"], p["heads"]
    shapes = ((b, tq, h, p["d_nope"]), (b, tq, h, p["d_rope"]), (b, s, p["d_c"]), (b, s, p["d_rope"]),
              (p["d_c"], h, p["d_nope"]), (p["d_c"], h, p["d_v"]))
    return tuple(jax.ShapeDtypeStruct(x, dt) for x in shapes)

  def explain(self, c: OpCall, path, device):
    from probjax.ops.mla import explain_dispatch
    form, impl = self._form_impl(path)
    return explain_dispatch(*self.avals(c), form=form, implementation=impl, device=device, mask=self.mask(c))

  def pick(self, decision, c, grad):
    """``absorbed:<kernel>`` for an MLA kernel, else the form (attention's default) or
    ``<form>:<attention implementation>``."""
    form = decision.get("form")
    if decision.implementation != "xla":
      return f"absorbed:{decision.implementation}"
    attn = decision.get("attention")
    name = getattr(attn, "implementation", attn)
    return form if name in (None, "default") else f"{form}:{name}"

  def function(self, c: OpCall, path):
    from probjax.ops.mla import mla
    form, impl = self._form_impl(path)
    mask = self.mask(c)
    return (lambda *a: mla(*a, mask=mask, form=form, implementation=impl)), (0, 1, 2, 3, 4, 5)

  def inputs(self, c: OpCall):
    import jax
    ks = jax.random.split(jax.random.key(c.index), 6)
    return tuple(_normal(k, a.shape, a.dtype, 1.0 if i < 4 else a.shape[0] ** -0.5)
                 for i, (k, a) in enumerate(zip(ks, self.avals(c))))

  def group(self, rec: dict) -> str:
    return f"{rec['kind']} {rec['widths']} H{rec['heads']} {rec['mode']}"


# ---------------------------------------------------------------------------------------------
# the grouped matmul (MoE experts)
# ---------------------------------------------------------------------------------------------
GMM_TOKENS = (16, 32768)
GMM_EXPERTS = (8, 16, 32, 64, 128, 256)
GMM_TOP_K = (1, 2, 4, 6, 8)
GMM_D_MODEL = (1024, 2048, 2880, 4096, 5120, 7168)
GMM_D_FF = (256, 512, 768, 1024, 1408, 1536, 2048, 4096, 8192, 14336)
GMM_ALPHA = (0.05, 20.0)  # Dirichlet concentration of the experts' shares, log-uniform


class GroupedMatmulSpec(OpSpec):
  op = "grouped_matmul"
  fields = ("tokens", "experts", "top_k", "d_model", "d_ff", "projection", "m", "k", "n", "alpha",
            "empty_groups", "max_group", "group_sizes")
  quiet = ("d_model", "d_ff", "group_sizes", "alpha")

  def draw_once(self, rng, seed, index) -> OpCall:
    tokens = core.log_uniform_int(rng, *GMM_TOKENS)
    experts = core.choice(rng, GMM_EXPERTS)
    top_k = core.choice(rng, tuple(k for k in GMM_TOP_K if k <= experts))
    d_model, d_ff = core.choice(rng, GMM_D_MODEL), core.choice(rng, GMM_D_FF)
    projection = core.choice(rng, ("up", "down"))
    alpha = float(np.exp(rng.uniform(np.log(GMM_ALPHA[0]), np.log(GMM_ALPHA[1]))))
    m = tokens * top_k
    sizes = rng.multinomial(m, rng.dirichlet(np.full(experts, alpha)))
    k, n = (d_model, d_ff) if projection == "up" else (d_ff, d_model)
    shape = dict(tokens=tokens, experts=experts, top_k=top_k, d_model=d_model, d_ff=d_ff, projection=projection,
                 m=m, k=k, n=n, alpha=round(alpha, 4), empty_groups=int((sizes == 0).sum()), max_group=int(sizes.max()),
                 group_sizes=tuple(int(x) for x in sizes))
    return OpCall(self.op, seed, index, projection, core.choice(rng, DTYPES16), core.choice(rng, MODES),
                  tuple(shape.items()))

  def cost(self, c: OpCall):
    p = c.p
    elems = p["m"] * p["k"] + p["experts"] * p["k"] * p["n"] + p["m"] * p["n"]
    return 2.0 * p["m"] * p["k"] * p["n"], 2 * elems

  def paths(self, c, device) -> list[str]:
    from probjax.ops.grouped_matmul import available_implementations
    return available_implementations(_device(device))

  def avals(self, c: OpCall):
    import jax
    import jax.numpy as jnp
    p, dt = c.p, jnp.dtype(c.dtype)
    return (jax.ShapeDtypeStruct((p["m"], p["k"]), dt), jax.ShapeDtypeStruct((p["experts"], p["k"], p["n"]), dt),
            jax.ShapeDtypeStruct((p["experts"],), jnp.int32))

  def explain(self, c: OpCall, path, device):
    from probjax.ops.grouped_matmul import explain_dispatch
    return explain_dispatch(*self.avals(c), implementation=path, device=device)

  def function(self, c: OpCall, path):
    from probjax.ops.grouped_matmul import grouped_matmul
    return (lambda lhs, rhs, sizes: grouped_matmul(lhs, rhs, sizes, implementation=path)), (0, 1)

  def inputs(self, c: OpCall):
    import jax
    import jax.numpy as jnp
    lhs, rhs, _ = self.avals(c)
    k1, k2 = jax.random.split(jax.random.key(c.index))
    return (_normal(k1, lhs.shape, lhs.dtype), _normal(k2, rhs.shape, rhs.dtype, c.p["k"] ** -0.5),
            jnp.asarray(c.p["group_sizes"], jnp.int32))

  def group(self, rec: dict) -> str:
    return (f"{rec['projection']} {'M<4096' if rec['m'] < 4096 else 'M>=4096'} "
            f"{'empty groups' if rec['empty_groups'] else 'no empty group'} {rec['mode']}")


# ---------------------------------------------------------------------------------------------
# the scans
# ---------------------------------------------------------------------------------------------
SCAN_BATCH = (1, 64)
SCAN_LENGTH = (128, 16384)
MAMBA_CHANNELS = (1536, 2048, 3072, 4096, 5120)
MAMBA_STATE = (16, 32)
SSD_HEADS = (24, 32, 48, 64, 80, 128)
SSD_HEAD_DIM = 64
SSD_GROUPS = (1, 8)
SSD_STATE = (64, 128)
RLA_HEADS = (8, 16, 32)
RLA_GQA = (1, 2, 4)
RLA_HEAD_DIMS = (64, 128)
RLA_WINDOW = (64, 2048)
RLA_FEATURE_MAPS = ("softmax", "relu")
SCAN_CHUNK = 64  # the chunked forms' work per position, for the budget's FLOPs
# A Mamba-1 path whose float32 states pass this share of the device's memory is recorded as
# out of memory without compiling it: the sampler draws up to B64 x L16384 x D5120 x N16, where
# the associative form's states alone are about 1 TB and XLA's failed allocation takes the
# batch's time.
MAMBA_MEMORY_SHARE = 0.5


class ScanSpec(OpSpec):
  """One of the scan room's ops (``mamba_scan``, ``ssd_scan``, ``residual_linear_attention``)."""
  FIELDS = {"mamba_scan": ("batch", "length", "channels", "state"),
            "ssd_scan": ("batch", "length", "heads", "head_dim", "groups", "state"),
            "residual_linear_attention": ("batch", "length", "heads", "kv_heads", "head_dim", "v_head_dim",
                                          "window_size", "feature_map")}

  def __init__(self, op: str):
    self.op = op
    self.fields = self.FIELDS[op]

  def draw_once(self, rng, seed, index) -> OpCall:
    b, l = core.log_uniform_int(rng, *SCAN_BATCH), core.log_uniform_int(rng, *SCAN_LENGTH)
    if self.op == "mamba_scan":
      shape = dict(batch=b, length=l, channels=core.choice(rng, MAMBA_CHANNELS), state=core.choice(rng, MAMBA_STATE))
    elif self.op == "ssd_scan":
      shape = dict(batch=b, length=l, heads=core.choice(rng, SSD_HEADS), head_dim=SSD_HEAD_DIM,
                   groups=core.choice(rng, SSD_GROUPS), state=core.choice(rng, SSD_STATE))
    else:
      h = core.choice(rng, RLA_HEADS)
      d = core.choice(rng, RLA_HEAD_DIMS)
      shape = dict(batch=b, length=l, heads=h, kv_heads=h // core.choice(rng, RLA_GQA), head_dim=d, v_head_dim=d,
                   window_size=core.log_uniform_int(rng, *RLA_WINDOW), feature_map=core.choice(rng, RLA_FEATURE_MAPS))
    return OpCall(self.op, seed, index, self.op, core.choice(rng, SCAN_DTYPES), core.choice(rng, MODES),
                  tuple(shape.items()))

  def cost(self, c: OpCall):
    """FLOPs of the chunked form (chunks of :data:`SCAN_CHUNK`) and the bytes of the arrays."""
    p, size = c.p, ITEMSIZE[c.dtype]
    b, l = p["batch"], p["length"]
    if self.op == "mamba_scan":
      d, n = p["channels"], p["state"]
      flops, elems = 9.0 * b * l * d * n, b * l * (4 * d + 2 * n)
    elif self.op == "ssd_scan":
      h, dp, g, n = p["heads"], p["head_dim"], p["groups"], p["state"]
      flops = 2.0 * b * l * h * (3 * dp * n + SCAN_CHUNK * (n + dp))
      elems = b * l * (3 * h * dp + h + 2 * g * n)
    else:
      h, hk, d, dv = p["heads"], p["kv_heads"], p["head_dim"], p["v_head_dim"]
      f = 2 * d if p["feature_map"] == "softmax" else d
      flops = 2.0 * b * l * h * (2 * f * dv + SCAN_CHUNK * (f + dv))
      elems = b * l * (h * d + hk * (d + dv) + h * dv)
    return flops, size * elems

  def call_object(self, c: OpCall):
    from probjax.ops.scan import MambaCall, RLACall, SSDCall
    p = c.p
    if self.op == "mamba_scan":
      return MambaCall(p["batch"], p["length"], p["channels"], p["state"], c.dtype)
    if self.op == "ssd_scan":
      return SSDCall(p["batch"], p["length"], p["heads"], p["head_dim"], p["groups"], p["state"], c.dtype)
    return RLACall(p["batch"], p["length"], p["heads"], p["kv_heads"], p["head_dim"], p["v_head_dim"],
                   p["window_size"], p["feature_map"], c.dtype)

  def paths(self, c, device) -> list[str]:
    from probjax.ops.scan import available_implementations
    return available_implementations(self.call_object(c), _device(device))

  def explain(self, c: OpCall, path, device):
    from probjax.ops.scan import explain_dispatch
    decision = explain_dispatch(self.call_object(c), implementation=path, device=device)
    need = self.state_bytes(c, decision.implementation)
    memory = _device(device).memory_bytes
    if memory and need > MAMBA_MEMORY_SHARE * memory:
      raise MemoryError(f"out of memory (estimated): the {decision.implementation} form keeps {need / 2**30:.0f} GiB "
                        f"of float32 states, over {MAMBA_MEMORY_SHARE:.0%} of the device's {memory / 2**30:.0f} GiB")
    return decision

  def state_bytes(self, c: OpCall, implementation: str) -> int:
    """Mamba-1's XLA forms hold ``[batch, length, channels, state]`` float32 states (the
    associative form about three copies of them, the sequential and chunked forms one, kept for
    the backward); the kernels and the other ops' forms only chunk-boundary states (0 here)."""
    if self.op != "mamba_scan" or implementation == "triton":
      return 0
    p = c.p
    copies = 3 if implementation == "associative" else 1
    return copies * 4 * p["batch"] * p["length"] * p["channels"] * p["state"]

  def avals(self, c: OpCall):
    """The op's arrays: Mamba-1 and SSD x, dt, A, B, C, D, z, dt_bias (a Mamba layer's); RLA q, k, v."""
    import jax
    import jax.numpy as jnp
    p, dt = c.p, jnp.dtype(c.dtype)
    b, l = p["batch"], p["length"]
    if self.op == "mamba_scan":
      d, n = p["channels"], p["state"]
      shapes = ((b, l, d), (b, l, d), (d, n), (b, l, n), (b, l, n), (d,), (b, l, d), (d,))
    elif self.op == "ssd_scan":
      h, dp, g, n = p["heads"], p["head_dim"], p["groups"], p["state"]
      shapes = ((b, l, h, dp), (b, l, h), (h,), (b, l, g, n), (b, l, g, n), (h,), (b, l, h, dp), (h,))
    else:
      shapes = ((b, l, p["heads"], p["head_dim"]), (b, l, p["kv_heads"], p["head_dim"]),
                (b, l, p["kv_heads"], p["v_head_dim"]))
    return tuple(jax.ShapeDtypeStruct(s, dt) for s in shapes)

  def function(self, c: OpCall, path):
    from probjax.ops import scan
    if self.op == "residual_linear_attention":
      p = c.p
      return (lambda q, k, v: scan.residual_linear_attention(q, k, v, window_size=p["window_size"],
                                                            feature_map=p["feature_map"], implementation=path)), (0, 1, 2)
    op = getattr(scan, self.op)
    return (lambda x, dt, A, B, C, D, z, bias: op(x, dt, A, B, C, D, z=z, dt_bias=bias, implementation=path)), \
        tuple(range(8))

  def inputs(self, c: OpCall):
    """Standard normal arrays, but A negative (``-exp(N(0, 0.5))``) and dt centred at -2 (softplus
    about 0.13), as a trained layer's."""
    import jax
    import jax.numpy as jnp
    avals = self.avals(c)
    ks = jax.random.split(jax.random.key(c.index), len(avals))
    arrays = [_normal(k, a.shape, a.dtype) for k, a in zip(ks, avals)]
    if self.op != "residual_linear_attention":
      arrays[1] = (arrays[1].astype(jnp.float32) * 0.5 - 2.0).astype(avals[1].dtype)
      arrays[2] = (-jnp.exp(0.5 * arrays[2].astype(jnp.float32))).astype(avals[2].dtype)
    return tuple(arrays)

  def group(self, rec: dict) -> str:
    l = rec["length"]
    bucket = "L<=1024" if l <= 1024 else "L<=4096" if l <= 4096 else "L>4096"
    return f"{SHORT_DTYPE.get(rec['dtype'], rec['dtype'])} {bucket} {rec['mode']}"


SPECS = {s.op: s for s in (MLASpec(), GroupedMatmulSpec(), ScanSpec("mamba_scan"), ScanSpec("ssd_scan"),
                           ScanSpec("residual_linear_attention"))}
OPS = tuple(SPECS)


def load_rows(path: str, spec: OpSpec) -> list[dict]:
  from bench import harness
  return [r for r in harness.load_rows(path) if isinstance(r, dict) and r.get("suite") == spec.suite]


def build_report(spec: OpSpec, fit_rows: list[dict], val_rows: list[dict] | None = None, miss: float = core.MISS) -> dict:
  report = core.build_report({"fit": fit_rows, "validate": val_rows}, spec.calls_of, miss, spec.describe)
  report["op"] = spec.op
  return report


def markdown(spec: OpSpec, report: dict, top: int = 15) -> str:
  return core.markdown(report, spec.describe, f"Measured dispatch ({spec.op}): the default against the fastest exact path",
                       "group", top)


def main(argv=None, *, measure=None, clock: Callable[[], float] = time.monotonic, device=None) -> int:
  """The command line; ``measure``, ``clock`` and ``device`` are for tests (a fake measurer, clock and device)."""
  p = argparse.ArgumentParser(prog="python -m bench.dispatch_ops", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  sub = p.add_subparsers(dest="cmd", required=True)
  for name in ("sample", "run", "draw-seed", "report"):
    sub.add_parser(name).add_argument("--op", required=True, choices=OPS)
  for name in ("sample", "run"):
    core.add_sample_args(sub.choices[name], "see FIT_SEEDS")
  core.add_run_args(sub.choices["run"])
  d = sub.choices["draw-seed"]
  d.add_argument("--fit", required=True, nargs="+", help="the fit sample's rows, which the seed follows")
  d.add_argument("--out", required=True)
  rep = sub.choices["report"]
  rep.add_argument("--fit", required=True, nargs="+")
  rep.add_argument("--validate", nargs="+", default=None)
  rep.add_argument("--out", default=None, help="writes OUT.json and OUT.md (default: next to the first --fit file)")
  rep.add_argument("--miss", type=float, default=core.MISS, help="a miss: default/best above this (default %(default)s)")
  args = p.parse_args(argv)
  spec = SPECS[args.op]

  if args.cmd == "sample":
    for c in spec.sample(core.seed_of(args), args.n, args.shard):
      print(json.dumps(c.as_dict()))
    return 0
  if args.cmd == "run":
    start = clock()
    calls = spec.sample(core.seed_of(args), args.n, args.shard)
    if measure is None:
      from bench import harness
      harness.setup_environment(args)
    stats = core.run_calls(spec, calls, args.out, measure=measure or core.JaxMeasure(core.timing_kwargs(args)),
                           device=device, rounds=args.rounds, budget_s=args.budget_s, clock=clock, start=start,
                           workers=args.compile_workers, batch_calls=args.batch_calls)
    print(json.dumps(stats))
    return 0
  if args.cmd == "draw-seed":
    core.draw_seed(args.fit, args.out, FIT_SEEDS[spec.op], SAMPLER_VERSION, lambda f: load_rows(f, spec))
    return 0
  fit = [r for f in args.fit for r in load_rows(f, spec)]
  val = [r for f in args.validate for r in load_rows(f, spec)] if args.validate else None
  report = build_report(spec, fit, val, args.miss)
  core.write_report(report, args.out or os.path.splitext(args.fit[0])[0] + ".report", markdown(spec, report))
  return 0


if __name__ == "__main__":
  sys.exit(main())
