"""Test helpers shared by every backend's tests: inputs, masks and the reference check.

Every check compares against :mod:`probjax.ops.attention.reference` (float64)
with bounds from :mod:`probjax.ops.attention.tolerances`. For property tests: attention calls
as data (:class:`AttnCase`, :class:`MaskSpec`), hypothesis strategies that draw them
(:func:`attention_cases`, :func:`mask_specs`), the reference under any transform
(:func:`reference_apply`, :func:`reference_grads`, :func:`reference_jvp`, :func:`reference_valid`),
NaN/inf planting past lengths (:func:`poison`) and a one-message comparison (:func:`assert_matches`).
"""

from __future__ import annotations

import contextlib
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from probjax.ops.attention import masks as M
from probjax.ops.attention.reference import _attention64, reference_vjp
from probjax.ops.attention.tolerances import max_error, scaled_tolerance, tolerance


def interpret_kernels() -> bool:
  """Whether kernel tests run their Pallas kernels in interpret mode: everywhere but on an
  NVIDIA GPU, so that the same tests check the compiled kernels under ``pytest --gpu``."""
  return jax.default_backend() != "gpu"


def float32_is_tf32() -> bool:
  """Whether float32 matmuls run as TF32 here (JAX's and Triton's default precision on an
  NVIDIA GPU), which ``tolerance(..., tf32=True)`` bounds."""
  return jax.default_backend() == "gpu" and jax.config.jax_default_matmul_precision in (None, "default", "bfloat16_3x", "tensorfloat32")


def _gpu_info_modules() -> list:
  """The modules Pallas Triton's lowering reads the GPU's info from: ``jax._src.gpu_info`` from
  JAX 0.12.1, ``jax._src.pallas.triton.gpu_info`` before (both where both exist)."""
  import importlib
  found = []
  for name in ("jax._src.gpu_info", "jax._src.pallas.triton.gpu_info"):
    try:
      found.append(importlib.import_module(name))
    except ImportError:
      pass
  if not found:
    raise ImportError("this JAX has no GPU info module for Pallas Triton (jax._src.gpu_info)")
  return found


def h200_gpu_info():
  """The GPU info Pallas Triton's lowering would read on an H200."""
  m = _gpu_info_modules()[0]
  return m.get_gpu_info_from_version(m.GpuVersion.H200)


def pretend_h200(monkeypatch) -> None:
  """From here on Pallas Triton lowers as for an H200 (sm_90) on a machine without a GPU."""
  for m in _gpu_info_modules():
    info = m.get_gpu_info_from_version(m.GpuVersion.H200)
    monkeypatch.setattr(m, "get_gpu_info", lambda info=info: info)


def verify_triton_lowering(monkeypatch) -> None:
  """From here on every Pallas Triton module is checked by MLIR's verifier as it is lowered,
  so that a module the GPU's Triton compiler would refuse fails on CPU (lowering alone
  serialises it unchecked)."""
  from jax._src.pallas.triton import lowering

  lower = lowering.lower_jaxpr_to_triton_module

  def checked(*args, **kwargs):
    result = lower(*args, **kwargs)
    result.module.operation.verify()  # raises with the offending op
    return result

  monkeypatch.setattr(lowering, "lower_jaxpr_to_triton_module", checked)


@dataclasses.dataclass
class Inputs:
  q: jax.Array
  k: jax.Array
  v: jax.Array
  do: jax.Array


def make_inputs(seed: int, batch: int, q_len: int, kv_len: int, heads: int, kv_heads: int,
                head_dim: int, dtype=jnp.float32, *, v_head_dim: int | None = None) -> Inputs:
  """Fresh standard-normal q ``[B, Tq, H, D]``, k ``[B, Tkv, Hkv, D]``, v ``[B, Tkv, Hkv, Dv]``
  and output cotangent ``[B, Tq, H, Dv]`` (``Dv``: ``v_head_dim``, default ``D``)."""
  dv = head_dim if v_head_dim is None else v_head_dim
  ks = jax.random.split(jax.random.key(seed), 4)
  q = jax.random.normal(ks[0], (batch, q_len, heads, head_dim), jnp.float32).astype(dtype)
  k = jax.random.normal(ks[1], (batch, kv_len, kv_heads, head_dim), jnp.float32).astype(dtype)
  v = jax.random.normal(ks[2], (batch, kv_len, kv_heads, dv), jnp.float32).astype(dtype)
  do = jax.random.normal(ks[3], (batch, q_len, heads, dv), jnp.float32).astype(dtype)
  return Inputs(q, k, v, do)


def make_mask(name: str, batch: int, q_len: int, kv_len: int, seed: int = 0) -> M.Mask | None:
  """Named masks used across tests and benchmarks.

  Names: none, causal, causal_offset, window, window_right, kv_len, kv_len_zero
  (one batch element has no keys), lengths, segments, causal&kv_len,
  window&segments.
  """
  rng = np.random.default_rng(seed)
  kv_lens = lambda: jnp.asarray(rng.integers(1, kv_len + 1, size=batch), jnp.int32)
  def segments(n):
    cuts = np.sort(rng.integers(0, 4, size=(batch, n)), axis=1)
    return jnp.asarray(cuts, jnp.int32)
  if name == "none":
    return None
  if name == "causal":
    return M.CausalMask()
  if name == "causal_offset":
    return M.CausalMask(offset=kv_len - q_len)
  if name == "window":
    return M.LocalWindowMask(left=max(1, kv_len // 5), right=0)
  if name == "window_right":
    return M.LocalWindowMask(left=max(1, kv_len // 7), right=max(1, kv_len // 9))
  if name == "kv_len":
    return M.KVLenMask(kv_lens())
  if name == "kv_len_zero":
    lens = np.array(kv_lens())
    lens[0] = 0
    return M.KVLenMask(jnp.asarray(lens))
  if name == "lengths":
    return M.LengthMask(jnp.asarray(rng.integers(0, q_len + 1, size=batch), jnp.int32), kv_lens())
  if name == "segments":
    qs = segments(q_len)
    return M.SegmentMask(qs, qs if q_len == kv_len else segments(kv_len))
  if name == "causal&kv_len":
    return M.CausalMask() & M.KVLenMask(kv_lens())
  if name == "window&segments":
    qs = segments(q_len)
    return M.LocalWindowMask(left=max(1, kv_len // 3), right=2) & M.SegmentMask(qs, qs if q_len == kv_len else segments(kv_len))
  raise ValueError(f"unknown mask name {name!r}")


MASK_NAMES = ("none", "causal", "causal_offset", "window", "window_right", "kv_len", "kv_len_zero",
              "lengths", "segments", "causal&kv_len", "window&segments")


def check_against_reference(attn, x: Inputs, *, mask=None, bias=None, score_mod=None, scale=None,
                            grads: bool = True, tf32: bool = False):
  """Runs ``attn(q, k, v, bias) -> out`` and its vjp; asserts values and gradients
  against the float64 reference. Returns the dict of errors."""
  dtype = x.q.dtype
  if bias is None:
    f = lambda q, k, v: attn(q, k, v, None)
    out, vjp = jax.vjp(f, x.q, x.k, x.v)
    got = (out,) + (vjp(x.do) if grads else ())
  else:
    out, vjp = jax.vjp(attn, x.q, x.k, x.v, bias)
    got = (out,) + (vjp(x.do) if grads else ())
  ref = reference_vjp(x.q, x.k, x.v, x.do, bias=bias, mask=mask, score_mod=score_mod, scale=scale)
  names = ("out", "dq", "dk", "dv", "dbias")
  errors = {}
  for name, g, r in zip(names, got, ref):
    if r is None:
      continue
    g = np.asarray(jnp.asarray(g, jnp.float32))
    assert np.all(np.isfinite(g)), f"{name} has NaN/inf"
    err = max_error(g, r)
    tol = tolerance(dtype, grad=name != "out", tf32=tf32)
    errors[name] = err
    assert err <= tol, f"{name}: max error {err:.3g} > {tol:.3g} ({jnp.dtype(dtype).name}); all: {errors}"
  return errors


def check_against_same_precision(attn, same_precision, x: Inputs, *, mask=None, factor: float = 2.0):
  """FlashAttention-style check: the output's and each gradient's error against the float64
  reference at most ``factor`` x that of ``same_precision`` (another exact implementation in
  the inputs' dtype, e.g. the XLA path). Tighter than the fixed per-dtype bound, which a wrong
  term of the backward can stay under. Both are ``f(q, k, v) -> out``. Returns the errors."""
  ref = reference_vjp(x.q, x.k, x.v, x.do, mask=mask)
  run = lambda f: (lambda out, vjp: (out, *vjp(x.do)))(*jax.vjp(f, x.q, x.k, x.v))
  errors = {}
  for name, got, same, r in zip(("out", "dq", "dk", "dv"), run(attn), run(same_precision), ref):
    err, bound = max_error(got, r), scaled_tolerance(max_error(same, r), x.q.dtype, factor=factor,
                                                      grad=name != "out")
    errors[name] = err
    assert err <= bound, f"{name}: error {err:.3g} > {bound:.3g} ({factor}x the same-precision one); {errors}"
  return errors


# -- property tests: attention calls as data ----------------------------------------------
# A hypothesis strategy draws an :class:`AttnCase` (plain ints, tuples and names, so a failing
# example prints as a reproducer); the case builds its arrays, its mask and the public-API call,
# and the float64 reference is applied to it under any transform (:func:`reference_apply`).

# Lengths that cross every XLA formulation boundary of the test regimes: dense up to 256 (and
# decoding, at most 16 queries), one flash tile up to 512 per axis, 256-tiles above.
LENGTHS = (1, 5, 16, 63, 64, 65, 200, 256, 257, 300, 513, 600)
REGIMES = ("dense", "decode", "flash", "tiled")


def regime(q_len: int, kv_len: int) -> str:
  """The XLA formulation a test at these lengths runs under :func:`length_formulations`:
  "dense", "decode" (dense, few queries), "flash" (one tile per axis) or "tiled"."""
  if max(q_len, kv_len) <= 256:
    return "dense"
  if q_len <= 16:
    return "decode"
  return "flash" if max(q_len, kv_len) <= 512 else "tiled"


@contextlib.contextmanager
def length_formulations():
  """Within it, ``formulation="auto"`` picks by :func:`regime` (dense for "dense" and "decode",
  flash otherwise) instead of the measured rule, which keeps test-sized calls dense: property
  tests at a few hundred positions reach the flash formulation's tiles through the public API.
  Both formulations are exact, so an eager computation compiled outside it (and shared by its
  call description) changes which one runs, never a value."""
  from probjax.ops.attention.backends import xla
  measured = xla.choose_formulation

  def by_length(q_shape, kv_shape, *, module: bool = False, band: bool = False) -> str:
    return "dense" if module or regime(q_shape[1], kv_shape[1]) in ("dense", "decode") else "flash"
  xla.choose_formulation = by_length
  try:
    yield
  finally:
    xla.choose_formulation = measured


def _compact_repr(obj) -> str:
  """``Type(field=value, ...)`` with only the fields that differ from their defaults: a
  failing hypothesis example prints as a short, runnable reproducer."""
  parts = []
  for f in dataclasses.fields(obj):
    v = getattr(obj, f.name)
    if f.default is dataclasses.MISSING or v != f.default:
      parts.append(f"{f.name}={v!r}")
  return f"{type(obj).__name__}({', '.join(parts)})"


def _pretty(obj, printer, cycle):  # hypothesis prints examples with IPython-style pretty printers
  printer.text(_compact_repr(obj))


@dataclasses.dataclass(frozen=True)
class MaskSpec:
  """A mask as plain data. Components combine with ``&``; ``dense`` (a seed) is a random dense
  boolean mask ``[batch, 1, q_len, kv_len]`` instead of a position mask (dot_product_attention
  only). Lengths may lie outside ``[0, len]`` (traced lengths are clamped to it)."""

  causal: int | None = None                  # CausalMask(offset)
  window: tuple | None = None                # LocalWindowMask(left, right, offset)
  kv_lengths: tuple[int, ...] | None = None  # KVLenMask
  q_lengths: tuple[int, ...] | None = None   # LengthMask (keys all valid unless kv_lengths)
  segments: tuple[int, int] | None = None    # SegmentMask: (documents, seed), sorted random ids
  dense: int | None = None

  __repr__ = _compact_repr
  _repr_pretty_ = _pretty

  def position_mask(self, batch: int, q_len: int, kv_len: int, *, clamp: bool = False) -> M.Mask | None:
    """The :class:`Mask` (None if no component); ``clamp``: lengths clipped to ``[0, len]``."""
    parts = []
    fix = (lambda x, n: np.clip(x, 0, n)) if clamp else (lambda x, n: x)
    if self.causal is not None:
      parts.append(M.CausalMask(self.causal))
    if self.window is not None:
      parts.append(M.LocalWindowMask(*self.window))
    if self.q_lengths is not None:
      kv = self.kv_lengths if self.kv_lengths is not None else (kv_len,) * batch
      parts.append(M.LengthMask(jnp.asarray(fix(np.array(self.q_lengths), q_len), jnp.int32),
                                jnp.asarray(fix(np.array(kv), kv_len), jnp.int32)))
    elif self.kv_lengths is not None:
      parts.append(M.KVLenMask(jnp.asarray(fix(np.array(self.kv_lengths), kv_len), jnp.int32)))
    if self.segments is not None:
      docs, seed = self.segments
      rng = np.random.default_rng(seed)
      ids = lambda n: jnp.asarray(np.sort(rng.integers(0, docs, (batch, n)), axis=1), jnp.int32)
      parts.append(M.SegmentMask(ids(q_len), ids(kv_len)))
    if not parts:
      return None
    out = parts[0]
    for p in parts[1:]:
      out = out & p
    return out

  def dense_mask(self, batch: int, q_len: int, kv_len: int):
    if self.dense is None:
      return None
    rng = np.random.default_rng(self.dense)
    return jnp.asarray(rng.random((batch, 1, q_len, kv_len)) < 0.7)

  @property
  def has_lengths(self) -> bool:
    return self.kv_lengths is not None or self.q_lengths is not None


def _softcap(case):
  return lambda s, b, h, qi, ki: 30.0 * jnp.tanh(s / 30.0)


def _alibi(case):
  """ALiBi with slopes closed over as an array (only the XLA path takes those)."""
  slopes = jnp.asarray(2.0 ** -(np.arange(case.heads) + 1.0), jnp.float32)
  return lambda s, b, h, qi, ki: s - slopes[h] * jnp.abs(qi - ki)


def _alibi_static(case):
  """ALiBi-like with slopes computed from the head index (traceable in the kernels)."""
  return lambda s, b, h, qi, ki: s - (0.125 * (h + 1)) * jnp.abs(qi - ki).astype(jnp.float32)


def _block_row(case):
  """Every score of query ``q_len // 2`` at -inf: a row with no valid key."""
  r = case.q_len // 2
  return lambda s, b, h, qi, ki: jnp.where(qi == r, -jnp.inf, s)


def _block_col(case):
  """Every score of key ``kv_len // 3`` at -inf: a key no query sees."""
  c = case.kv_len // 3
  return lambda s, b, h, qi, ki: jnp.where(ki == c, -jnp.inf, s)


SCORE_MODS = {"softcap": _softcap, "alibi": _alibi, "alibi_static": _alibi_static,
              "block_row": _block_row, "block_col": _block_col}
KERNEL_SCORE_MODS = ("softcap", "alibi_static", "block_row", "block_col")  # no closed-over arrays


@dataclasses.dataclass(frozen=True)
class AttnCase:
  """One attention call as data: shapes, dtype, mask, bias, score modifier, scale, seed.

  ``bias`` is the bias's shape (broadcast to ``[batch, heads, q_len, kv_len]``);
  ``bias_blocks_row``: its first query row is -inf for every key (a row with no valid key,
  every row where the bias has no query axis)."""

  batch: int
  q_len: int
  kv_len: int
  heads: int
  kv_heads: int
  head_dim: int
  dtype: str = "float32"
  mask: MaskSpec = MaskSpec()
  is_causal: bool = False
  bias: tuple[int, ...] | None = None
  bias_blocks_row: bool = False
  score_mod: str | None = None
  scale: float | None = None
  seed: int = 0

  __repr__ = _compact_repr
  _repr_pretty_ = _pretty

  @property
  def regime(self) -> str:
    return regime(self.q_len, self.kv_len)

  def inputs(self) -> Inputs:
    return make_inputs(self.seed, self.batch, self.q_len, self.kv_len, self.heads, self.kv_heads,
                       self.head_dim, jnp.dtype(self.dtype))

  def bias_array(self):
    if self.bias is None:
      return None
    b = jax.random.normal(jax.random.key(self.seed + 1), self.bias, jnp.float32)
    if self.bias_blocks_row:
      b = b.at[..., 0, :].set(-jnp.inf) if len(self.bias) >= 2 else jnp.full_like(b, -jnp.inf)
    return b.astype(jnp.dtype(self.dtype))

  def score_mod_fn(self):
    return None if self.score_mod is None else SCORE_MODS[self.score_mod](self)

  def mask_arg(self, *, clamp: bool = False):
    """The ``mask`` argument of the call: a :class:`Mask`, a dense boolean array or None."""
    if self.mask.dense is not None:
      return self.mask.dense_mask(self.batch, self.q_len, self.kv_len)
    return self.mask.position_mask(self.batch, self.q_len, self.kv_len, clamp=clamp)

  def reference_kwargs(self) -> dict:
    """``mask``, ``dense_mask``, ``score_mod``, ``scale`` of the float64 reference (lengths
    clamped, ``is_causal`` folded into the mask)."""
    pos = self.mask.position_mask(self.batch, self.q_len, self.kv_len, clamp=True)
    if self.is_causal:
      pos = M.CausalMask() if pos is None else pos & M.CausalMask()
    return dict(mask=pos, dense_mask=self.mask.dense_mask(self.batch, self.q_len, self.kv_len),
                score_mod=self.score_mod_fn(), scale=self.scale)

  def attention_fn(self, *, api: str = "dot_product_attention", **kw):
    """``f(q, k, v, bias, mask) -> out`` through the public API (``kw``: implementation,
    interpret, backward_pass_impl, ...); ``mask`` is :meth:`mask_arg` or a traced copy of it."""
    from probjax.nn.layers import attention as A
    score_mod = self.score_mod_fn()
    if api == "flex_attention":
      if self.bias is not None or self.is_causal or self.mask.dense is not None:
        raise ValueError(f"flex_attention takes no bias, is_causal or dense mask: {self}")
      return lambda q, k, v, bias, mask: A.flex_attention(q, k, v, mask=mask, score_mod=score_mod,
                                                          scale=self.scale, **kw)
    return lambda q, k, v, bias, mask: A.dot_product_attention(
        q, k, v, bias, mask, is_causal=self.is_causal, score_mod=score_mod, scale=self.scale, **kw)


def reference_apply(transform, *arrays, bias=None, mask=None, dense_mask=None, score_mod=None,
                    scale=None, jit: bool = True):
  """``transform(f, *arrays)`` in float64, ``f(q, k, v, bias) -> out`` the float64 reference.

  The arrays (any pytrees; None stays None) and bias are upcast to float64 under
  ``jax.enable_x64``, so the same ``transform`` (a jvp, a vjp, a second derivative, ...)
  applied to an implementation gives the value it should match. ``jit``: one compiled
  program (a few times faster than op-by-op at a new shape). Returns numpy float64."""
  up = lambda a: jnp.asarray(np.asarray(a, np.float64))
  with jax.enable_x64(True):
    arrays = jax.tree.map(up, arrays)
    bias64 = None if bias is None else up(bias)
    dense = None if dense_mask is None else jnp.asarray(np.asarray(dense_mask, bool))

    def f(q, k, v, b=bias64):
      s = 1.0 / np.sqrt(q.shape[-1]) if scale is None else float(scale)
      return _attention64(q, k, v, b, mask, dense, score_mod, s)
    run = lambda *a: transform(f, *a)
    out = (jax.jit(run) if jit else run)(*arrays)
    return jax.tree.map(lambda a: np.asarray(a, np.float64), out)


def reference_grads(q, k, v, do, *, bias=None, mask=None, dense_mask=None, score_mod=None, scale=None):
  """:func:`~probjax.ops.attention.reference.reference_vjp` as one compiled float64 program:
  ``(out, dq, dk, dv, dbias)``, dbias None without bias; zeros when there are no keys (the
  reference's softmax cannot reduce an empty axis)."""
  if k.shape[1] == 0:
    zeros = lambda a: None if a is None else np.zeros(a.shape)
    return zeros(q), zeros(q), zeros(k), zeros(v), zeros(bias)
  def transform(f, q, k, v, bias, do):
    out, pull = jax.vjp(f, q, k, v, bias)
    return (out, *pull(do))
  return tuple(reference_apply(transform, q, k, v, bias, do, mask=mask, dense_mask=dense_mask,
                               score_mod=score_mod, scale=scale))


def reference_jvp(q, k, v, tangents, *, bias=None, mask=None, dense_mask=None, score_mod=None,
                  scale=None):
  """float64 ``(out, out_tangent)``; ``tangents`` maps some of "q", "k", "v", "bias" to a
  tangent (the others are constants: zero tangents)."""
  names = ("q", "k", "v", "bias")
  primals = dict(q=q, k=k, v=v, bias=bias)
  active = [n for n in names if n in tangents]
  if "bias" in active and bias is None:
    raise ValueError("a bias tangent needs a bias")

  def transform(f, primal, tangent):
    def g(*xs):
      env = {**primal, **dict(zip(active, xs))}
      return f(env["q"], env["k"], env["v"], env["bias"])
    return jax.jvp(g, tuple(primal[n] for n in active), tuple(tangent[n] for n in active))
  return reference_apply(transform, primals, {n: tangents[n] for n in active}, bias=None, mask=mask,
                         dense_mask=dense_mask, score_mod=score_mod, scale=scale)


def reference_valid(q, k, *, bias=None, mask=None, dense_mask=None, score_mod=None, scale=None):
  """``[batch, heads, q_len, kv_len]`` bool: the positions the reference gives weight (allowed
  by the masks, score above -inf after bias and ``score_mod``)."""
  def transform(f, q, k, bias):
    b, tq, h, d = q.shape
    kk = jnp.repeat(k, h // k.shape[2], axis=2)
    s = jnp.einsum("bqhd,bkhd->bhqk", q, kk) * (1.0 / np.sqrt(d) if scale is None else float(scale))
    if bias is not None:
      s = s + bias
    if score_mod is not None:
      s = score_mod(s, jnp.arange(b)[:, None, None, None], jnp.arange(h)[None, :, None, None],
                    jnp.arange(tq)[None, None, :, None], jnp.arange(kk.shape[1])[None, None, None, :])
    ok = s > -jnp.inf
    if mask is not None:
      ok = ok & mask.dense(b, tq, kk.shape[1])
    if dense_mask is not None:
      ok = ok & jnp.asarray(np.asarray(dense_mask, bool))
    return ok.astype(jnp.float64)
  return reference_apply(transform, q, k, bias) > 0


def poison(x, lengths, *, axis: int = 1):
  """``x`` with every position ``t >= lengths[b]`` along ``axis`` (batch axis 0) replaced by
  NaN, +inf and -inf in turn along the last axis: a KV cache's (or padded queries') garbage."""
  n = x.shape[axis]
  lens = jnp.clip(jnp.asarray(lengths, jnp.int32), 0, n)
  pos = jnp.arange(n).reshape((1,) * axis + (n,) + (1,) * (x.ndim - axis - 1))
  bad = pos >= lens.reshape((-1,) + (1,) * (x.ndim - 1))
  junk = jnp.asarray([np.nan, np.inf, -np.inf], x.dtype)[jnp.arange(x.shape[-1]) % 3]
  return jnp.where(bad, junk, x)


def assert_matches(got: dict, want: dict, dtype, *, what: str = "", grad_names=None, finite: bool = True):
  """Asserts every ``got[name]`` (NaN-free with ``finite``) within the tolerance of ``dtype``
  of ``want[name]`` (a None reference is skipped); names other than "out" (or those in
  ``grad_names``) use the gradient bound. One message with every error. Returns the errors."""
  errors, bad = {}, []
  for name, r in want.items():
    if r is None:
      continue
    g = np.asarray(jnp.asarray(got[name], jnp.float32) if jnp.asarray(got[name]).dtype != jnp.float64
                   else got[name])
    grad = name != "out" if grad_names is None else name in grad_names
    tol = tolerance(dtype, grad=grad)
    if finite and not np.all(np.isfinite(g)):
      errors[name] = float("nan")
      bad.append(f"{name} has {int(np.sum(~np.isfinite(g)))} NaN/inf of {g.size}")
      continue
    err = max_error(np.nan_to_num(g), r)
    errors[name] = err
    if not err <= tol:
      bad.append(f"{name}: max error {err:.3g} > {tol:.3g}")
  assert not bad, f"{what}: {'; '.join(bad)} ({jnp.dtype(dtype).name}; all errors {errors})"
  return errors


# -- hypothesis strategies (hypothesis is imported when a strategy is built) --------------------
MASK_KINDS = ("none", "causal", "window", "kv_lengths", "lengths", "segments", "dense")
HEADS = ((1, 1), (2, 1), (2, 2), (4, 1), (4, 2), (4, 4))  # (heads, kv_heads): MHA, GQA, MQA
BIAS_SHAPES = ("full", "heads", "keys", "2d", "1d")


def _bias_shape(kind, b, h, tq, tk):
  return {"full": (b, h, tq, tk), "heads": (1, h, tq, tk), "keys": (b, 1, 1, tk), "2d": (tq, tk),
          "1d": (tk,)}[kind]


def lengths_pairs(regimes=REGIMES, lengths=LENGTHS):
  """``(q_len, kv_len)`` pairs from ``lengths`` whose regime is in ``regimes``, smallest first."""
  pairs = [(a, b) for a in lengths for b in lengths if regime(a, b) in regimes]
  return sorted(pairs, key=lambda p: (p[0] * p[1], p))


def mask_specs(batch: int, q_len: int, kv_len: int, *, kinds=MASK_KINDS, max_parts: int = 2,
               out_of_range: bool = False):
  """Strategy for a :class:`MaskSpec`: one kind, or up to ``max_parts`` position kinds
  combined with ``&``. Lengths lie in ``[0, len]`` (zeros included), with ``out_of_range`` in
  ``[-5, len + 5]`` (for traced lengths, which are clamped)."""
  from hypothesis import strategies as st
  position = [k for k in kinds if k not in ("none", "dense")]

  def lens(n):
    lo, hi = (-5, n + 5) if out_of_range else (0, n)
    return st.lists(st.integers(lo, hi), min_size=batch, max_size=batch).map(tuple)

  @st.composite
  def draw_spec(draw):
    first = draw(st.sampled_from(kinds))
    if first == "none":
      return MaskSpec()
    if first == "dense":
      return MaskSpec(dense=draw(st.integers(0, 2**16)))
    chosen = {first}
    if max_parts > 1 and len(position) > 1:
      chosen |= set(draw(st.lists(st.sampled_from(position), max_size=max_parts - 1)))
    spec = {}
    if "causal" in chosen:
      spec["causal"] = draw(st.sampled_from(sorted({0, kv_len - q_len, -3, 4})))
    if "window" in chosen:
      left = draw(st.sampled_from([1, 0, 17, 100, None]))
      right = draw(st.sampled_from([0, 3, None] if left is not None else [0, 3]))
      spec["window"] = (left, right, draw(st.sampled_from(sorted({0, kv_len - q_len}))))
    if "kv_lengths" in chosen or "lengths" in chosen:
      spec["kv_lengths"] = draw(lens(kv_len))
    if "lengths" in chosen:
      spec["q_lengths"] = draw(lens(q_len))
    if "segments" in chosen:
      spec["segments"] = (draw(st.sampled_from([2, 1, 3, 5])), draw(st.integers(0, 2**16)))
    return MaskSpec(**spec)
  return draw_spec()


def attention_cases(*, regimes=REGIMES, lengths=LENGTHS, batches=(1, 2), heads=HEADS,
                    head_dims=(8, 16, 32, 64), dtypes=("float32",), masks=MASK_KINDS,
                    max_mask_parts: int = 2, is_causal: bool = True, biases=BIAS_SHAPES,
                    bias_blocks_row: bool = True, score_mods=tuple(SCORE_MODS),
                    scales=(None, 0.3, -0.2, 1.0), max_work: int | None = None,
                    out_of_range: bool = False, pairs=None):
  """Strategy for an :class:`AttnCase`.

  The regime is drawn first, then lengths in it (``pairs``: explicit ``(q_len, kv_len)``
  pairs instead), so that few examples still cross every formulation boundary.
  ``max_work`` bounds ``batch * heads * q_len * kv_len * head_dim`` (the smallest batch, heads
  and head_dim always fit). Empty ``biases`` / ``score_mods`` / ``masks=("none",)`` turn those
  off; ``scales`` None is the default ``head_dim ** -0.5``."""
  from hypothesis import strategies as st
  all_pairs = lengths_pairs(regimes, lengths) if pairs is None else list(pairs)
  by_regime = {}
  for p in all_pairs:
    by_regime.setdefault(regime(*p), []).append(p)

  @st.composite
  def draw_case(draw):
    tq, tk = draw(st.sampled_from(by_regime[draw(st.sampled_from(sorted(by_regime, key=REGIMES.index)))]))
    shapes = [(b, h, hk, d) for b in batches for h, hk in heads for d in head_dims
              if max_work is None or b * h * max(tq, 1) * max(tk, 1) * d <= max_work]
    shapes = shapes or [(min(batches), *min(heads), min(head_dims))]
    b, h, hk, d = draw(st.sampled_from(shapes))
    mask = draw(mask_specs(b, tq, tk, kinds=masks, max_parts=max_mask_parts, out_of_range=out_of_range))
    bias = None
    if biases and draw(st.booleans()):
      bias = _bias_shape(draw(st.sampled_from(biases)), b, h, tq, tk)
    return AttnCase(
        b, tq, tk, h, hk, d, dtype=draw(st.sampled_from(dtypes)), mask=mask,
        is_causal=is_causal and draw(st.booleans()), bias=bias,
        bias_blocks_row=bias is not None and bias_blocks_row and draw(st.booleans()),
        score_mod=draw(st.sampled_from((None,) + tuple(score_mods))),
        scale=draw(st.sampled_from(scales)), seed=draw(st.integers(0, 2**16)))
  return draw_case()


def numpy_init(ctor, seed=0):
  """``ctor()``'s module with its parameters drawn in numpy (random init under jit compiles
  slowly on CPU): norm scales ``1 + 0.2 N(0, 1)``, other floats ``0.3 N(0, 1)``; RNG keys
  from ``seed``, counts 0."""
  from flax import nnx  # local: probjax.testing imports without Flax
  graphdef, state = nnx.split(nnx.eval_shape(ctor))
  rng = np.random.default_rng(seed)

  def fill(path, a):
    if jnp.issubdtype(a.dtype, jax.dtypes.prng_key):
      return jax.random.split(jax.random.key(seed), a.shape) if a.shape else jax.random.key(seed)
    if not jnp.issubdtype(a.dtype, jnp.floating):
      return jnp.zeros(a.shape, a.dtype)
    n = rng.standard_normal(a.shape)
    return jnp.asarray(1 + 0.2 * n if "scale" in jax.tree_util.keystr(path) else 0.3 * n, a.dtype)

  return nnx.merge(graphdef, jax.tree_util.tree_map_with_path(fill, state))


def decode_steps(layer, x, state, start: int):
  """``(outputs [batch, seq - start, ...], state)``: ``layer.step`` (jitted) over positions
  ``start..seq-1`` of ``x`` ``[batch, seq, features]`` from ``state``, the recurrent decode a
  layer test compares with the full pass."""
  from flax import nnx

  step = nnx.jit(lambda layer, x, state: layer.step(x, state))
  ys = []
  for t in range(start, x.shape[1]):
    y, state = step(layer, x[:, t], state)
    ys.append(y)
  return jnp.stack(ys, 1), state


def run_on_fake_devices(script: str, devices: int, *, timeout: float = 600):
  """Runs ``script`` (Python source that prints one JSON document as its last line) in a
  subprocess whose CPU backend has ``devices`` fake devices, and returns that document: a
  process's device count is fixed when JAX starts, so multi-device tests run apart."""
  import json
  import os
  import pathlib
  import subprocess
  import sys

  root = str(pathlib.Path(__file__).resolve().parents[1])
  env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}", JAX_PLATFORMS="cpu",
             PYTHONPATH=root)
  p = subprocess.run([sys.executable, "-c", script], cwd=root, env=env, capture_output=True, text=True,
                     timeout=timeout)
  assert p.returncode == 0, p.stderr[-3000:]
  return json.loads(p.stdout.strip().splitlines()[-1])
