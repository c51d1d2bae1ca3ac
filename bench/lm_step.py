"""End-to-end LM benchmark: a training step and a decode loop of ``TransformerLM`` with probjax
attention against the same model with peer attention functions.

Sections (``--sections``, default all, in this order):

* ``matmul``: the measured bf16 matmul ceiling (an ``N x N x N`` ``jnp.dot``, timed like the
  steps), against which the training rows' ``frac_of_matmul`` is computed.
* ``train``: 12 layers, d_model 768, 12 heads (head_dim 64), SwiGLU, RMSNorm, RoPE, vocab
  32768, T=2048, batch 8, bf16 compute with fp32 parameters, causal; one optax AdamW step,
  jitted with the parameters and optimizer state donated. Peers (``attention_fn``):
  ``probjax`` (``dot_product_attention``), ``probjax_lce`` (the same, its loss through
  ``TransformerLM.loss``: the head inside ``linear_cross_entropy``, no logits; with
  ``--impls``, ``probjax_lce_<tokens>x<vocab>`` runs it at that loss tile, and any peer's name
  with ``_scanned`` appended runs that peer's model with ``scan_layers=True``: the 12 blocks as
  one ``nnx.scan`` body instead of the default's unrolled loop), ``flax``
  (``flax.nnx.dot_product_attention``) and
  ``jaxnn_cudnn`` (``jax.nn.dot_product_attention(implementation="cudnn")``).
* ``train_packed``: the same with 8 documents per row: probjax gets ``SegmentMask`` (and
  per-document positions), the peers the equivalent dense ``[batch, 1, T, T]`` document mask.
* ``decode``: the same model with 4 KV heads and bf16 weights, batch 8, prompt 1024, 256 new
  tokens (greedy) into a cache of 8192: ms per token of the on-device ``lax.scan`` decode loop
  (``decode_loop`` jitted with the cache donated) for ``probjax``, ``jaxnn_cudnn``
  (``key_value_seq_lengths``) and ``jaxnn_xla``; ``probjax_cmdbuf`` and
  ``jaxnn_cudnn_cmdbuf``, those loops compiled with command buffers over the loop too
  (:data:`CMDBUF_WHILE`); ``probjax_generate``, ``generate`` as a user calls it (greedy through
  its traced temperature: the time of 257 new tokens less that of 1, per token). Each row has
  the read floor, (weight bytes + valid K/V bytes per step) / 4.0e12 B/s, and ``x_floor``;
  probjax's rows ``speedup_vs_jaxnn_cudnn`` (over the cuDNN row compiled alike, named in
  ``speedup_vs``); on a GPU the loop rows the kernels of one loop per token (``device_ms``,
  ``kernels_per_step``, ...).

FLOP convention (model FLOPs, no recomputation counted), printed with the rows:
``N`` = parameters in matmuls per token = layers * (d*(H+2*Hkv)*hd + H*hd*d + 3*d*F) + d*V
(the output head; the embedding gather is not a matmul). Dense: ``6 * N * tokens``
(forward 2N, backward 4N). Attention per layer forward: ``QK^T`` and ``PV`` are
``2 * B * T^2 * H*hd`` each, so ``4*B*T^2*d``; forward + backward ``12*B*T^2*d``; causal
halves it: ``12 * layers * B * T^2 * d / 2``. Packed rows of ``n`` documents of ``T/n``
tokens: ``12 * layers * B * T^2 * d / (2 n)``. MFU = FLOPs / time / peak (989.4e12 bf16 dense
for H100/H200 SXM; None on other devices, where ``frac_of_matmul`` still says how close).

Training rows on a GPU also carry the kernel breakdown of ``--iters`` more steps from a
``jax.profiler`` trace (``bench.harness.kernel_summary``): ``device_ms``, ``kernel_ms_by_kind``
(attention / matmul / other, by kernel name), ``top_kernels`` and ``wall_over_device``;
elsewhere ``device_ms_error`` says why there is none.

Timing: compile + warm-up, then ``--repeats`` rounds; each round times every peer once (a
block of ``--iters`` steps, or one decode loop), in an order that rotates by one each round;
peers run in the same process on the same inputs. Medians are reported. Every peer is first
checked against probjax (first-step loss, or prefill logits): a row whose check fails says
so in ``check``. Rows are JSON lines in ``--output`` keyed by (section, case, impl); a rerun
with the same ``--output`` skips the groups already there (``--force`` re-measures), and
``--max-minutes`` stops cleanly between groups.

    python bench/lm_step.py --output bench/results/h200/lm_step.json          # H200, ~8 min
    python bench/lm_step.py --cpu-smoke --quick --output /tmp/x.json          # tiny, CPU
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import re
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
  sys.path.insert(0, ROOT)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

try:
  import optax  # noqa: E402
except ImportError:  # a device image without optax: the same AdamW written out below
  optax = None

from bench.harness import kernel_intervals, kernel_profile as harness_kernel_profile, kernel_summary  # noqa: E402
from probjax.core.timing import classify_error, device_info, summarize  # noqa: E402
from probjax.nn.layers.attention import dot_product_attention  # noqa: E402
from probjax.nn.layers.decoding import decode_loop, generate  # noqa: E402
from probjax.nn.layers.multi_head_attention import MultiHeadAttention  # noqa: E402
from probjax.nn.layers.transformer import Transformer, TransformerLM  # noqa: E402
from probjax.ops.attention.masks import Mask, SegmentMask  # noqa: E402

HBM_BYTES_PER_S = 4.0e12
PEAK_BF16 = {"H100": 989.4e12, "H200": 989.4e12}
SECTIONS = ("matmul", "train", "train_packed", "decode")
# The *_cmdbuf decode rows' compiler options: XLA's default command-buffer types plus
# WHILE and CONDITIONAL, so the decode loop's lax.scan runs as one CUDA graph (a conditional
# node repeats the body on the device) instead of the host launching the body's graphs once per
# step; graphs of any size. Read per compilation (jax.jit's compiler_options), so the row runs
# in this process beside the others.
CMDBUF_WHILE = {"xla_gpu_enable_command_buffer": "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,WHILE,CONDITIONAL",
                "xla_gpu_graph_min_graph_size": 1}
# Decode rows that are not attention peers of their own: the probjax and cuDNN loops with
# CMDBUF_WHILE (the attention of the name before "_cmdbuf"), and generate (prefill, then the
# loop) as a user calls it.
CMDBUF = "_cmdbuf"
DECODE_VARIANTS = ("probjax" + CMDBUF, "probjax_generate", "jaxnn_cudnn" + CMDBUF)
SCANNED = "_scanned"  # a training peer's model with its layer stack under nnx.scan (scan_layers=True)


@dataclasses.dataclass(frozen=True)
class Config:
  layers: int = 12
  d_model: int = 768
  heads: int = 12
  head_dim: int = 64
  vocab: int = 32768
  seq: int = 2048
  batch: int = 8
  docs_per_row: int = 8
  decode_kv_heads: int = 4
  decode_batch: int = 8
  prompt: int = 1024
  new_tokens: int = 256
  cache: int = 8192
  matmul_n: int = 8192

  @property
  def mlp_hidden(self) -> int:  # MLP's SwiGLU default: round_up(8/3 d, 64)
    return -(-(8 * self.d_model // 3) // 64) * 64


SMOKE = Config(layers=2, d_model=64, heads=4, head_dim=16, vocab=256, seq=64, batch=2,
               docs_per_row=4, decode_kv_heads=2, decode_batch=2, prompt=16, new_tokens=8,
               cache=64, matmul_n=256)


# -- optimizer ----------------------------------------------------------------------
class _AdamW:
  """optax.adamw(lr, b1=0.9, b2=0.999, eps=1e-8, weight_decay) written out, for images without
  optax (the rows say which ran)."""

  def __init__(self, lr, weight_decay):
    self.lr, self.wd, self.b1, self.b2, self.eps = lr, weight_decay, 0.9, 0.999, 1e-8

  def init(self, params):
    zeros = lambda: jax.tree.map(jnp.zeros_like, params)
    return dict(m=zeros(), v=zeros(), count=jnp.zeros((), jnp.int32))

  def update(self, grads, state, params):
    count = state["count"] + 1
    m = jax.tree.map(lambda m, g: self.b1 * m + (1 - self.b1) * g, state["m"], grads)
    v = jax.tree.map(lambda v, g: self.b2 * v + (1 - self.b2) * g * g, state["v"], grads)
    c1, c2 = 1 - self.b1 ** count, 1 - self.b2 ** count
    upd = jax.tree.map(lambda m, v, p: -self.lr * ((m / c1) / (jnp.sqrt(v / c2) + self.eps) + self.wd * p),
                       m, v, params)
    return upd, dict(m=m, v=v, count=count)


def adamw(lr, weight_decay):
  return (optax.adamw(lr, weight_decay=weight_decay) if optax is not None else _AdamW(lr, weight_decay))


def apply_updates(params, updates):
  return jax.tree.map(lambda p, u: (p + u).astype(p.dtype), params, updates)


def cross_entropy(logits, labels):
  logz = jax.nn.logsumexp(logits, axis=-1)
  return logz - jnp.take_along_axis(logits, labels[..., None], axis=-1)[..., 0]


# -- attention functions ----------------------------------------------------------
def _dense(mask, q, k):
  return mask.dense(q.shape[0], q.shape[1], k.shape[1]) if isinstance(mask, Mask) else mask


def flax_attention(query, key, value, *, mask=None, is_causal=False, dropout_rate=0.0, **_):
  """flax.nnx.dot_product_attention: probjax masks as dense arrays, K/V repeated for GQA."""
  assert dropout_rate == 0.0
  g = query.shape[2] // key.shape[2]
  if g > 1:
    key, value = jnp.repeat(key, g, axis=2), jnp.repeat(value, g, axis=2)
  return nnx.dot_product_attention(query, key, value, mask=_dense(mask, query, key), is_causal=is_causal)


def jaxnn_attention(implementation):
  """jax.nn.dot_product_attention: KVLenMask as key_value_seq_lengths, a causal-only Mask as
  is_causal, any other probjax Mask as a dense mask."""
  def fn(query, key, value, *, mask=None, is_causal=False, dropout_rate=0.0, **_):
    assert dropout_rate == 0.0
    kw = {}
    if isinstance(mask, Mask):
      if mask.is_kv_lengths_only():
        kw["key_value_seq_lengths"] = mask.kv_lengths
        mask = None
      elif mask.is_causal(0):
        is_causal, mask = True, None
      else:
        mask = _dense(mask, query, key)
    return jax.nn.dot_product_attention(query, key, value, mask=mask, is_causal=is_causal,
                                        implementation=implementation, **kw)
  fn.__name__ = f"jaxnn_{implementation}"
  return fn


def attention_fns(platform):
  fns = {"probjax": dot_product_attention, "probjax_lce": dot_product_attention, "flax": flax_attention,
         "jaxnn_cudnn": jaxnn_attention("cudnn"), "jaxnn_xla": jaxnn_attention("xla")}
  fns.update({v: fns[v.removesuffix(CMDBUF).removesuffix("_generate")] for v in DECODE_VARIANTS})
  return fns


def lce_tile(name) -> dict:
  """The loss tile of a ``probjax_lce_<tokens>x<vocab>`` peer as ``TransformerLM.loss``'s keywords
  (``{}`` for ``probjax_lce``, the default tile, and for every other name)."""
  m = re.fullmatch(rf"probjax_lce_(\d+)x(\d+)(?:{SCANNED})?", name) if isinstance(name, str) else None
  return dict(chunk_tokens=int(m[1]), chunk_vocab=int(m[2])) if m else {}


def with_attention(graphdef, state, fn, scan_layers=None):
  """The graphdef of the model with every MultiHeadAttention's ``attention_fn`` set to ``fn``
  (and, unless None, every Transformer stack's ``scan_layers``)."""
  model = nnx.merge(graphdef, state)
  for _, node in nnx.iter_graph(model):
    if isinstance(node, MultiHeadAttention):
      node.attention_fn = fn
    if scan_layers is not None and isinstance(node, Transformer):
      node.scan_layers = scan_layers
  return nnx.split(model)[0]


# -- FLOPs and bytes --------------------------------------------------------------
def matmul_params(c: Config, kv_heads: int) -> int:
  d, h, hd, f = c.d_model, c.heads, c.head_dim, c.mlp_hidden
  per_layer = d * (h + 2 * kv_heads) * hd + h * hd * d + 3 * d * f
  return c.layers * per_layer + d * c.vocab


def train_flops(c: Config, docs: int = 1) -> dict:
  tokens = c.batch * c.seq
  dense = 6.0 * matmul_params(c, c.heads) * tokens
  attn = 12.0 * c.layers * c.batch * c.seq ** 2 * (c.heads * c.head_dim) / (2 * docs)
  return {"dense_flops": dense, "attention_flops": attn, "flops": dense + attn}


def peak_flops(kind: str):
  return next((v for k, v in PEAK_BF16.items() if k in kind), None)


# -- rows ---------------------------------------------------------------------------
class Rows:
  """JSON-lines results keyed by (section, case, impl), rewritten after every group."""

  def __init__(self, path, force):
    self.path, self.rows = path, {}
    if path and os.path.exists(path) and not force:
      with open(path) as f:
        for line in f:
          if line.strip():
            r = json.loads(line)
            self.rows[self.key(r)] = r

  @staticmethod
  def key(r):
    return (r["section"], r["case"], r["impl"])

  def done(self, section, case, impls):
    return all((section, case, i) in self.rows for i in impls)

  def add(self, rows):
    for r in rows:
      self.rows[self.key(r)] = r
    if self.path:
      os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
      tmp = self.path + ".tmp"
      with open(tmp, "w") as f:
        for r in self.rows.values():
          f.write(json.dumps(r) + "\n")
      os.replace(tmp, self.path)


def rotated(items, r):
  r %= len(items)
  return items[r:] + items[:r]


def tree_copy(tree):
  return jax.tree.map(lambda x: x.copy(), tree)


# -- sections -----------------------------------------------------------------------
def run_matmul(c, args, bar):
  n = c.matmul_n
  a = jax.random.normal(jax.random.key(0), (n, n), jnp.bfloat16)
  b = jax.random.normal(jax.random.key(1), (n, n), jnp.bfloat16)
  f = jax.jit(jnp.dot)
  t0 = time.perf_counter()
  jax.block_until_ready(f(a, b))
  compile_s = time.perf_counter() - t0
  for _ in range(args.warmup):
    jax.block_until_ready(f(a, b))
  times = []
  for _ in range(args.repeats):
    t0 = time.perf_counter()
    out = None
    for _ in range(args.iters):
      out = f(a, b)
    jax.block_until_ready(out)
    times.append((time.perf_counter() - t0) / args.iters * 1e3)
    bar.update(1)
  s = summarize(times)
  flops = 2.0 * n ** 3
  return [dict(impl="jnp.dot", **s, ms_all=times, flops=flops, tflops=flops / (s["ms"] * 1e-3) / 1e12,
               first_call_s=compile_s, status="ok", check="n/a")]


def make_lm(c, kv_heads, param_dtype, seed=0):
  return nnx.jit(lambda: TransformerLM(
      vocab_size=c.vocab, features=c.d_model, num_layers=c.layers, num_heads=c.heads,
      num_kv_heads=kv_heads, head_dim=c.head_dim, mlp="swiglu", norm="rmsnorm", rotary=True,
      dtype=jnp.bfloat16, param_dtype=param_dtype, rngs=nnx.Rngs(seed)))()


def packed_inputs(c, docs, rng):
  """Tokens, segment ids (``docs`` equal documents per row) and per-document positions."""
  tokens = rng.integers(0, c.vocab, (c.batch, c.seq)).astype(np.int32)
  if docs == 1:
    return tokens, None, None
  size = c.seq // docs
  seg = np.minimum(np.arange(c.seq) // size, docs - 1)[None].repeat(c.batch, 0).astype(np.int32)
  starts = np.minimum(np.arange(c.seq) // size, docs - 1) * size
  pos = (np.arange(c.seq) - starts)[None].repeat(c.batch, 0).astype(np.int32)
  return tokens, seg, pos


def time_steps(make_step, impls, params, tx, batch, args, bar):
  """``(info, times)``: for each name in ``impls``, ``make_step(name)`` (a jitted
  ``step(params, opt_state, batch) -> (params, opt_state, loss)`` donating both) is compiled on
  copies of ``params`` and ``tx.init(params)`` (its first loss and compile time in ``info``; a
  failure is ``info``'s status, not the end of the run), warmed up, then timed: ``args.iters``
  steps per block, one block per name in each of ``args.repeats`` rounds, rotating; ``times``
  holds ms per step per round."""
  state, info = {}, {}
  for name in impls:
    try:
      step = make_step(name)
      p, o = tree_copy(params), tx.init(params)
      t0 = time.perf_counter()
      p, o, loss = step(p, o, batch)
      loss = float(loss)
      info[name] = dict(first_call_s=time.perf_counter() - t0, first_loss=loss, status="ok")
      for _ in range(args.warmup):
        p, o, _ = step(p, o, batch)
      jax.block_until_ready(p)
      state[name] = [step, p, o]
    except Exception as e:  # noqa: BLE001 (a failing peer is a row, not the end of the run)
      status, msg = classify_error(e)
      info[name] = dict(status=status, error=msg)
  times = step_times(state, batch, args.repeats, args.iters, bar)
  for name, st in state.items():
    info[name].update(kernel_profile(st, batch, args.iters))
  return info, times


def kernel_profile(st: list, batch, iters: int) -> dict:
  """The kernel breakdown of ``iters`` more steps of ``st = [step, params, opt_state]``
  (``bench.harness.kernel_summary``: ``device_ms``, ``kernel_ms_by_kind`` attention / matmul /
  other, ``top_kernels``), or ``device_ms_error`` saying why there is none (GPU only)."""
  def one():
    st[1], st[2], loss = st[0](st[1], st[2], batch)
    return loss
  return harness_kernel_profile(one, iters)


def step_times(state: dict, batch, repeats: int, iters: int, bar) -> dict:
  """ms per step of each ``state[name] = [step, params, opt_state]``: ``repeats`` rounds, the
  names in rotated order each round, ``iters`` steps per timing; the state advances in place."""
  times = {n: [] for n in state}
  for r in range(repeats):
    for name in rotated(list(state), r) if state else []:
      step, p, o = state[name]
      t0 = time.perf_counter()
      for _ in range(iters):
        p, o, loss = step(p, o, batch)
      jax.block_until_ready(loss)
      times[name].append((time.perf_counter() - t0) / iters * 1e3)
      state[name][1:] = [p, o]
    bar.update(1)
  return times


def run_train(c, args, bar, impls, fns, docs):
  model = make_lm(c, c.heads, jnp.float32)
  graphdef, params = nnx.split(model)
  del model
  tx = adamw(3e-4, weight_decay=0.1)
  rng = np.random.default_rng(0)
  tokens, seg, pos = packed_inputs(c, docs, rng)
  batch = dict(tokens=jnp.asarray(tokens))
  if docs > 1:
    batch.update(seg=jnp.asarray(seg), pos=jnp.asarray(pos))
    batch["valid"] = (batch["seg"][:, 1:] == batch["seg"][:, :-1]).astype(jnp.float32)
  else:
    batch["valid"] = jnp.ones((c.batch, c.seq - 1), jnp.float32)

  def make_step(gd, use_segment_mask, fused_loss=False):
    def loss_fn(p, batch):
      m = nnx.merge(gd, p)
      tokens = batch["tokens"]
      if fused_loss:  # the head inside linear_cross_entropy: no [B, T, vocab] logits
        labels = jnp.where(batch["valid"] > 0, tokens[:, 1:], -100)
        labels = jnp.concatenate([labels, jnp.full_like(tokens[:, :1], -100)], axis=1)
        kw = {} if docs == 1 else dict(positions=batch["pos"], mask=SegmentMask(batch["seg"]))
        return m.loss(tokens, labels, **kw, **lce_tile(fused_loss))
      if docs == 1:
        logits = m(tokens)
      else:
        seg = batch["seg"]
        # probjax: the SegmentMask; peers: the same documents as a dense [B, 1, T, T] mask
        # (the model adds the causal mask to either).
        mask = SegmentMask(seg) if use_segment_mask else (seg[:, :, None] == seg[:, None, :])[:, None]
        logits = m(tokens, positions=batch["pos"], mask=mask)
      ce = cross_entropy(logits[:, :-1], tokens[:, 1:])
      return jnp.sum(ce * batch["valid"]) / jnp.sum(batch["valid"])

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def step(p, o, batch):
      loss, g = jax.value_and_grad(loss_fn)(p, batch)
      updates, o = tx.update(g, o, p)
      return apply_updates(p, updates), o, loss
    return step

  info, times = time_steps(
      lambda name: make_step(with_attention(graphdef, params, fns[name], scan_layers=name.endswith(SCANNED)),
                             use_segment_mask=name.startswith("probjax"),
                             fused_loss=name if name.startswith("probjax_lce") else False),
      impls, params, tx, batch, args, bar)
  flops = train_flops(c, docs)
  peak = peak_flops(device_info()["device"])
  ref = info.get("probjax", {}).get("first_loss")
  rows = []
  for name in impls:
    row = dict(impl=name, **info[name], **flops, tokens_per_step=c.batch * c.seq,
               scan_layers=name.endswith(SCANNED),
               optimizer="optax.adamw" if optax is not None else "adamw (optax missing: bench/lm_step._AdamW)",
               matmul_params=matmul_params(c, c.heads),
               params=int(sum(x.size for x in jax.tree.leaves(params))))
    if name in times:
      s = summarize(times[name])
      if row.get("device_ms"):
        row["wall_over_device"] = s["ms"] / row["device_ms"]
      row.update(s, ms_all=times[name], tokens_per_s=c.batch * c.seq / (s["ms"] * 1e-3),
                 tflops=flops["flops"] / (s["ms"] * 1e-3) / 1e12,
                 mfu=None if peak is None else flops["flops"] / (s["ms"] * 1e-3) / peak)
      if ref is not None:
        rel = abs(row["first_loss"] - ref) / abs(ref)
        row["check_rel_loss_diff"] = rel
        row["check"] = "ok" if rel < 2e-2 else f"FAILED: first-step loss {row['first_loss']} vs probjax {ref}"
    rows.append(row)
  return rows


def run_decode(c, args, bar, impls, fns):
  """Decode rows: ms per token of ``impls``, the attention peers (each model through the same
  ``decode_loop`` jitted with its cache donated) and :data:`DECODE_VARIANTS`; each checked
  against probjax's prefill logits and tokens, with the read floor and, on a GPU, the kernels
  of one loop per token."""
  hk = c.decode_kv_heads
  model = make_lm(c, hk, jnp.bfloat16)
  graphdef, params = nnx.split(model)
  del model
  b = c.decode_batch
  rng = np.random.default_rng(1)
  prompts = jnp.asarray(rng.integers(0, c.vocab, (b, c.prompt)).astype(np.int32))
  lengths = jnp.full((b,), c.prompt, jnp.int32)

  def make(gd, compiler_options=None):
    @jax.jit
    def prefill(p, prompts, lengths):
      m = nnx.merge(gd, p)
      logits, cache = m.prefill(prompts, lengths, m.init_cache(b, c.cache, jnp.bfloat16))
      last = logits[:, -1]
      return last, jnp.argmax(last, -1).astype(jnp.int32), cache

    def loop(p, cache, tok):
      toks, _, cache, _ = decode_loop(nnx.merge(gd, p), cache, tok, jax.random.key(0),
                                      num_steps=c.new_tokens)
      return toks, cache
    return prefill, jax.jit(loop, donate_argnums=(1,), compiler_options=compiler_options)

  def make_generate(gd):
    # generate as a user calls it: temperature and top_k enter its program as values (greedy
    # here), the cache is made inside it. Its time per token is that of new_tokens + 1 tokens
    # less that of one (the prefill and the first token), over new_tokens.
    def gen(n):
      return generate(nnx.merge(gd, params), prompts, lengths, max_new_tokens=n, max_len=c.cache)[0]
    return gen

  state, info = {}, {}
  for name in impls:
    try:
      gd = with_attention(graphdef, params, fns[name])
      t0 = time.perf_counter()
      if name == "probjax_generate":
        gen = make_generate(gd)
        toks = np.asarray(gen(c.new_tokens + 1))
        jax.block_until_ready(gen(1))
        info[name] = dict(status="ok", first_call_s=time.perf_counter() - t0, loop="generate")
        state[name] = dict(gen=gen, toks=toks[:, 1:], first=toks[:, 0])
        continue
      opts = CMDBUF_WHILE if name.endswith(CMDBUF) else None
      prefill, loop = make(gd, opts)
      last, tok, cache = prefill(params, prompts, lengths)
      jax.block_until_ready(cache)
      prefill_s = time.perf_counter() - t0
      t0 = time.perf_counter()
      toks, _ = loop(params, tree_copy(cache), tok)
      toks = np.asarray(toks)
      info[name] = dict(status="ok", first_call_s=time.perf_counter() - t0, prefill_first_call_s=prefill_s,
                        loop="decode_loop (cache donated)", compiler_options=opts)
      state[name] = dict(loop=loop, cache=cache, tok=tok, last=np.asarray(last, np.float32), toks=toks,
                         first=np.asarray(tok))
    except Exception as e:  # noqa: BLE001
      status, msg = classify_error(e)
      info[name] = dict(status=status, error=msg)

  def run_loop(st):
    fresh = tree_copy(st["cache"])
    jax.block_until_ready(fresh)
    t0 = time.perf_counter()
    jax.block_until_ready(st["loop"](params, fresh, st["tok"]))
    return time.perf_counter() - t0

  def run_generate(st):
    t0 = time.perf_counter()
    jax.block_until_ready(st["gen"](c.new_tokens + 1))
    t_all = time.perf_counter() - t0
    t0 = time.perf_counter()
    jax.block_until_ready(st["gen"](1))
    return t_all - (time.perf_counter() - t0)

  times = {n: [] for n in state}
  for r in range(args.repeats):
    for name in rotated(list(state), r):
      st = state[name]
      secs = run_generate(st) if "gen" in st else run_loop(st)
      times[name].append(secs / c.new_tokens * 1e3)
    bar.update(1)
  # Under the profiler XLA runs the thunks op by op, not from command buffers: the kernels of a
  # *_cmdbuf row are its base row's, whose device_ms its wall_over_device divides by.
  for name, st in state.items():
    if "loop" in st and not name.endswith(CMDBUF):
      info[name].update(decode_profile(st, params, c.new_tokens))
  for name in state:
    base = name.removesuffix(CMDBUF)
    if name != base and info.get(base, {}).get("device_ms"):
      info[name].update(device_ms=info[base]["device_ms"], device_ms_of=base)
  weight_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))
  kv_per_pos = 2 * c.layers * b * hk * c.head_dim * 2            # k and v, bf16
  avg_len = c.prompt + (c.new_tokens + 1) / 2                      # keys attended per step, averaged
  floor_ms = (weight_bytes + kv_per_pos * avg_len) / HBM_BYTES_PER_S * 1e3
  full_cache_ms = (weight_bytes + kv_per_pos * c.cache) / HBM_BYTES_PER_S * 1e3
  ref = state.get("probjax")
  # probjax's rows against the cuDNN loop compiled alike (with or without CMDBUF_WHILE)
  cudnn_ms = {suffix: summarize(times["jaxnn_cudnn" + suffix])["ms"]
              for suffix in ("", CMDBUF) if times.get("jaxnn_cudnn" + suffix)}
  rows = []
  for name in impls:
    row = dict(impl=name, **info[name], weight_bytes=weight_bytes, kv_bytes_per_step=kv_per_pos * avg_len,
               floor_ms_per_token=floor_ms, full_cache_read_ms_per_token=full_cache_ms)
    if name in times:
      s = summarize(times[name])
      row.update(s, ms_all=times[name], ms_per_token=s["ms"], tokens_per_s=b / (s["ms"] * 1e-3),
                 x_floor=s["ms"] / floor_ms)
      if row.get("device_ms"):
        row["wall_over_device"] = s["ms"] / row["device_ms"]
      suffix = CMDBUF if name.endswith(CMDBUF) else ""
      if name.startswith("probjax") and suffix in cudnn_ms:
        row.update(speedup_vs_jaxnn_cudnn=cudnn_ms[suffix] / s["ms"], speedup_vs="jaxnn_cudnn" + suffix)
      if ref is not None:
        st = state[name]
        agree = float((st["toks"] == ref["toks"]).mean())
        row["check_token_agreement"] = agree
        if "last" in st:
          a, want = st["last"], ref["last"]
          rel = float(np.abs(a - want).max() / max(np.abs(want).max(), 1e-6))
          row.update(check_rel_logits_diff=rel,
                     check="ok" if rel < 5e-2 else f"FAILED: prefill logits differ by {rel:.3g} (relative)")
        else:  # generate: the same model and attention as probjax's loop, so the same tokens
          same_first = bool((st["first"] == ref["first"]).all())
          row["check"] = ("ok" if same_first and agree == 1.0 else
                          f"FAILED: {1 - agree:.1%} of the tokens differ from probjax's decode_loop"
                          f"{'' if same_first else ' (the first, from the prefill, too)'}")
    rows.append(row)
  return rows


def decode_profile(st: dict, params, steps: int) -> dict:
  """The kernel breakdown of one more decode loop of ``st`` (a :func:`run_decode` state) per
  token (``bench.harness.kernel_summary`` over ``steps``; the loop's kernels before and after
  its steps are spread over them), or ``device_ms_error`` saying why there is none (GPU only)."""
  if jax.devices()[0].platform != "gpu":
    return dict(device_ms_error=f"no kernel profile on platform {jax.devices()[0].platform}: GPU only")
  try:
    fresh = tree_copy(st["cache"])
    jax.block_until_ready(fresh)
    call = lambda: st["loop"](params, fresh, st["tok"])
    return kernel_summary(kernel_intervals(call, jax.block_until_ready, 1, "jax"), steps)
  except Exception as e:  # noqa: BLE001 (the wall-clock row stands without it)
    return dict(device_ms_error=f"{type(e).__name__}: {e}"[:300])


# -- main ---------------------------------------------------------------------------
def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--output", default=None, help="JSON-lines results (resumed by row key)")
  ap.add_argument("--sections", default=",".join(SECTIONS), help=f"comma list of {SECTIONS}")
  ap.add_argument("--impls", default=None, help="comma list of peers (default: all for the device)")
  ap.add_argument("--quick", action="store_true", help="fewer repeats and iterations")
  ap.add_argument("--cpu-smoke", action="store_true", help="tiny sizes (runs on CPU in seconds)")
  ap.add_argument("--repeats", type=int, default=None)
  ap.add_argument("--iters", type=int, default=None, help="training steps per timed block")
  ap.add_argument("--warmup", type=int, default=None)
  ap.add_argument("--max-minutes", type=float, default=5.0,
                  help="start no new section after this (a full-size section takes up to ~4 minutes)")
  ap.add_argument("--force", action="store_true", help="re-measure groups already in --output")
  args = ap.parse_args(argv)
  args.repeats = args.repeats or (3 if args.quick else 7)
  args.iters = args.iters or (2 if args.quick else 5)
  args.warmup = args.warmup if args.warmup is not None else (1 if args.quick else 2)
  c = SMOKE if args.cpu_smoke else Config()
  dev = device_info()
  platform = dev["platform"]
  sections = [s for s in args.sections.split(",") if s]
  for s in sections:
    if s not in SECTIONS:
      raise SystemExit(f"unknown section {s!r}; choose from {SECTIONS}")
  fns = attention_fns(platform)
  gpu = platform == "gpu"
  default = {"train": ["probjax", "probjax_lce", "flax", "jaxnn_cudnn"] if gpu else ["probjax", "probjax_lce", "flax"],
             "decode": ["probjax", *DECODE_VARIANTS, "jaxnn_cudnn", "jaxnn_xla"] if gpu
                       else ["probjax", *(v for v in DECODE_VARIANTS if "cudnn" not in v), "jaxnn_xla"]}
  default["train_packed"] = default["train"]
  if args.impls:
    want = [i for i in args.impls.split(",") if i]
    fns.update({i: fns["probjax_lce"] for i in want if lce_tile(i)})
    fns.update({i: fns[i.removesuffix(SCANNED)] for i in want
                if i.endswith(SCANNED) and i.removesuffix(SCANNED) in fns})
    unknown = [i for i in want if i not in fns]
    if unknown or "probjax" not in want:
      raise SystemExit(f"--impls: choose from {sorted(fns)}, probjax included (the reference); got {want}")
    default = {k: [i for i in want if (i not in DECODE_VARIANTS if k != "decode" else not i.endswith(SCANNED))]
               for k in default}
  if not gpu and not args.cpu_smoke:
    print("warning: not on a GPU and without --cpu-smoke: the full sizes will be slow", file=sys.stderr)

  meta = dict(device=dev["device"], platform=platform, compute_capability=dev["compute_capability"],
              versions=dev["versions"], commit=dev["commit"], command=" ".join([sys.executable] + sys.argv),
              quick=args.quick, cpu_smoke=args.cpu_smoke, config=dataclasses.asdict(c))
  rows = Rows(args.output, args.force)
  cases = {
      "matmul": f"N{c.matmul_n}_bf16",
      "train": f"L{c.layers}_d{c.d_model}_H{c.heads}_T{c.seq}_B{c.batch}_V{c.vocab}_swiglu_bf16_causal",
      "train_packed": f"L{c.layers}_d{c.d_model}_H{c.heads}_T{c.seq}_B{c.batch}_V{c.vocab}_swiglu_bf16_"
                      f"causal_docs{c.docs_per_row}",
      "decode": f"L{c.layers}_d{c.d_model}_H{c.heads}_Hkv{c.decode_kv_heads}_B{c.decode_batch}_"
                f"P{c.prompt}_new{c.new_tokens}_cache{c.cache}_bf16",
  }
  impls_of = lambda s: ["jnp.dot"] if s == "matmul" else default[s]
  todo = [s for s in sections if args.force or not rows.done(s, cases[s], impls_of(s))]
  for s in sections:
    if s not in todo:
      print(f"[skip] {s} {cases[s]}: already in {args.output}")
  print(f"device: {dev['device']}  jax {dev['versions'].get('jax')}  flax {dev['versions'].get('flax')}  "
        f"commit {dev['commit']}")
  tf = train_flops(c)
  print(f"FLOPs per training step: dense 6*N*tokens = 6*{matmul_params(c, c.heads):,}*{c.batch * c.seq:,} "
        f"= {tf['dense_flops']:.4g}; attention 12*L*B*T^2*d/2 = {tf['attention_flops']:.4g} (causal; "
        f"packed: /{c.docs_per_row} more); total {tf['flops']:.4g}")
  try:
    from tqdm.auto import tqdm
  except ImportError:
    tqdm = _Progress
  bar = tqdm(total=len(todo) * args.repeats, desc="lm_step", file=sys.stdout, mininterval=1.0)
  start = time.perf_counter()
  ceiling = next((r["tflops"] for r in rows.rows.values()
                  if r["section"] == "matmul" and r["case"] == cases["matmul"] and "tflops" in r), None)
  for s in todo:
    if (time.perf_counter() - start) / 60 > args.max_minutes:
      print(f"[stop] --max-minutes {args.max_minutes} spent; rerun the same command to resume at {s}")
      break
    bar.set_description(s)
    t0 = time.perf_counter()
    if s == "matmul":
      out = run_matmul(c, args, bar)
      ceiling = out[0]["tflops"]
    elif s == "decode":
      out = run_decode(c, args, bar, default[s], fns)
    else:
      out = run_train(c, args, bar, default[s], fns, c.docs_per_row if s == "train_packed" else 1)
    for r in out:
      if ceiling and r.get("tflops") and s != "matmul":
        r["frac_of_matmul"] = r["tflops"] / ceiling
      r.update(section=s, case=cases[s], section_s=time.perf_counter() - t0, time=time.time(), **meta)
    rows.add(out)
    for r in out:
      bar.write(_describe(r))
  bar.close()
  if args.output:
    print(f"rows in {args.output}: {len(rows.rows)}")
  return list(rows.rows.values())


class _Progress:
  """Minimal tqdm stand-in (update, set_description, write, close)."""

  def __init__(self, total, desc="", **_):
    self.total, self.n, self.desc = total, 0, desc

  def update(self, k):
    self.n += k
    print(f"[{self.desc}] {self.n}/{self.total}", flush=True)

  def set_description(self, desc):
    self.desc = desc

  def write(self, line):
    print(line, flush=True)

  def close(self):
    pass


def _describe(r):
  if r.get("status") != "ok":
    return f"  {r['section']:12s} {r['impl']:12s} {r['status']}: {r.get('error', '')[:200]}"
  bits = [f"{r['section']:12s} {r['impl']:12s} {r['ms']:9.3f} ms"]
  if "tokens_per_s" in r:
    bits.append(f"{r['tokens_per_s']:12,.0f} tok/s")
  if r.get("tflops"):
    bits.append(f"{r['tflops']:7.1f} TFLOP/s")
  if r.get("mfu") is not None:
    bits.append(f"MFU {r['mfu']:.1%}")
  if r.get("frac_of_matmul"):
    bits.append(f"{r['frac_of_matmul']:.1%} of matmul")
  if "x_floor" in r:
    bits.append(f"{r['x_floor']:.2f}x the read floor ({r['floor_ms_per_token']:.3f} ms/token)")
  if r.get("speedup_vs_jaxnn_cudnn"):
    bits.append(f"{r['speedup_vs_jaxnn_cudnn']:.2f}x {r['speedup_vs']}'s speed")
  if r.get("device_ms") and r["section"] == "decode":
    bits.append(f"device {r['device_ms']:.3f} ms, {r.get('kernels_per_step', 0):.0f} kernels per token")
  if "check" in r:
    bits.append(f"check {r['check']}")
  return "  " + "  ".join(bits)


if __name__ == "__main__":
  main()
