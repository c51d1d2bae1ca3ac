"""linear_cross_entropy against its float64 reference: values and every gradient for each
option, at odd sizes that reach the moved-back last tile of both axes, bf16, ignored and
out-of-range labels, bad inputs, and the memory promise (no [tokens, vocab] array); the same for
the XLA backend's gradients in the forward sweep (a reduced loss, the vocabulary in one tile),
with its products counted in the jaxpr."""

import itertools

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

from probjax.core.device import Device
from probjax.core.tolerances import tolerance
from probjax.ops.linear_cross_entropy import (LinearCrossEntropyCall, available_implementations, explain_dispatch,
                                              linear_cross_entropy)
from probjax.ops.linear_cross_entropy.reference import linear_cross_entropy64, linear_cross_entropy_grads64


def _inputs(seed, lead, d, vocab, dtype=jnp.float32, layout="d_vocab", bias=False, ignore_share=0.2):
  r = np.random.default_rng(seed)
  x = jnp.asarray(r.standard_normal((*lead, d)), dtype)
  w = r.standard_normal((d, vocab) if layout == "d_vocab" else (vocab, d)) / np.sqrt(d)
  labels = r.integers(0, vocab, lead)
  labels = np.where(r.random(lead) < ignore_share, -100, labels)
  b = jnp.asarray(r.standard_normal(vocab) * 0.5, dtype) if bias else None
  return x, jnp.asarray(w, dtype), jnp.asarray(labels, jnp.int32), b


def _close(got, want, dtype, what):
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  scale = max(1.0, float(np.max(np.abs(want))))
  err = float(np.max(np.abs(got - want))) / scale
  assert err <= tolerance(dtype, grad=True), f"{what}: {err}"


OPTIONS = [dict(), dict(z_loss=1e-3), dict(label_smoothing=0.1), dict(reduction="sum"), dict(reduction="none"),
           dict(ignore_index=None), dict(z_loss=2e-4, label_smoothing=0.05, reduction="sum")]


@pytest.mark.parametrize("opts", OPTIONS, ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()) or "plain")
@pytest.mark.parametrize("layout,bias", [("d_vocab", False), ("vocab_d", True)])
def test_values_and_gradients(opts, layout, bias):
  # 2 x 11 tokens in tiles of 8, vocab 37 in tiles of 16: both axes' last tiles move back.
  share = 0.0 if "ignore_index" in opts else 0.2  # ignore_index=None: every label counts
  x, w, labels, b = _inputs(0, (2, 11), 12, 37, layout=layout, bias=bias, ignore_share=share)
  kw = dict(bias=b, w_layout=layout, **opts)
  ref_kw = dict(kw)
  f = lambda x, w, b: linear_cross_entropy(x, w, labels, **{**kw, "bias": b}, chunk_tokens=8, chunk_vocab=16)
  out, pull = jax.vjp(f, x, w, b)
  ct = np.random.default_rng(1).standard_normal(np.shape(out)) if opts.get("reduction") == "none" else 1.0
  _close(out, linear_cross_entropy64(x, w, labels, **ref_kw), jnp.float32, "loss")
  got = pull(jnp.asarray(ct, out.dtype))
  want = linear_cross_entropy_grads64(x, w, labels, **ref_kw, cotangent=ct)
  for name, g, r in zip(("dx", "dw", "dbias"), got, want):
    if r is not None:
      _close(g, r, jnp.float32, name)


def test_default_tiles_jit_and_bfloat16():
  x, w, labels, _ = _inputs(2, (3, 50), 16, 70, dtype=jnp.bfloat16)
  got = jax.jit(jax.value_and_grad(lambda x, w: linear_cross_entropy(x, w, labels), argnums=(0, 1)))(x, w)
  (loss, (dx, dw)) = got
  assert loss.dtype == jnp.float32 and dx.dtype == jnp.bfloat16 and dw.dtype == jnp.bfloat16
  _close(loss, linear_cross_entropy64(x, w, labels), jnp.bfloat16, "loss")
  for g, r, n in zip((dx, dw), linear_cross_entropy_grads64(x, w, labels), ("dx", "dw")):
    _close(g, r, jnp.bfloat16, n)


def test_every_label_ignored_is_zero_never_nan():
  x, w, _, _ = _inputs(3, (4,), 8, 20)
  labels = jnp.full((4,), -100, jnp.int32)
  loss, (dx, dw) = jax.value_and_grad(lambda x, w: linear_cross_entropy(x, w, labels), argnums=(0, 1))(x, w)
  assert float(loss) == 0.0 and not np.any(dx) and not np.any(dw)


def test_out_of_range_labels():
  x, w, labels, _ = _inputs(4, (6,), 8, 20, ignore_share=0.0)
  with pytest.raises(ValueError, match="labels must lie in"):
    linear_cross_entropy(x, w, labels.at[2].set(20))
  # Traced: counted as ignored (no read outside the head), the same as ignore_index there.
  bad = labels.at[2].set(99)
  got = jax.jit(lambda l: linear_cross_entropy(x, w, l, reduction="none"))(bad)
  want = linear_cross_entropy(x, w, labels.at[2].set(-100), reduction="none")
  np.testing.assert_allclose(got, want, rtol=1e-6)
  assert float(got[2]) == 0.0


def test_never_holds_the_logits():
  # tokens x vocab = 96 x 200: no array of the jitted gradient's program has that many entries.
  x, w, labels, _ = _inputs(5, (96,), 8, 200)
  f = jax.grad(lambda x, w: linear_cross_entropy(x, w, labels, chunk_tokens=32, chunk_vocab=64), argnums=(0, 1))
  text = jax.jit(f).lower(x, w).as_text()
  assert "96x200" not in text and "200x96" not in text
  assert "32x64" in text  # the tile is what it computes in


@pytest.mark.parametrize("kwargs,err,match", [
    (dict(x=np.ones((3,), np.float32)), ValueError, "w .* does not match"),
    (dict(x=np.ones((3, 8), np.int32)), TypeError, "x must be floating"),
    (dict(w=np.ones((8,), np.float32)), ValueError, "w must be a 2-D head"),
    (dict(labels=np.zeros((4,), np.int32)), ValueError, "labels must have x's leading shape"),
    (dict(labels=np.zeros((3,), np.float32)), TypeError, "labels must be integers"),
    (dict(bias=np.zeros((5,), np.float32)), ValueError, "bias must be"),
    (dict(reduction="avg"), ValueError, "reduction must be"),
    (dict(label_smoothing=1.5), ValueError, "label_smoothing must lie"),
    (dict(z_loss=-1.0), ValueError, "z_loss must be"),
    (dict(w_layout="dv"), ValueError, "w_layout must be"),
    (dict(chunk_vocab=0), ValueError, "chunk_vocab must be"),
    (dict(implementation="triton"), ValueError, "implementation"),
])
def test_bad_inputs(kwargs, err, match):
  args = dict(x=np.ones((3, 8), np.float32), w=np.ones((8, 20), np.float32), labels=np.zeros((3,), np.int32))
  args.update(kwargs)
  x, w, labels = args.pop("x"), args.pop("w"), args.pop("labels")
  with pytest.raises(err, match=match):
    linear_cross_entropy(jnp.asarray(x), jnp.asarray(w), jnp.asarray(labels), **args)


def test_explain_and_implementations():
  s = jax.ShapeDtypeStruct
  call = LinearCrossEntropyCall.of(s((4, 100, 16), jnp.float32), s((50, 16), jnp.float32), s((4, 100), jnp.int32),
                                   w_layout="vocab_d", chunk_tokens=64)
  d = explain_dispatch(call, device=Device("cpu"))
  assert d.implementation == "xla" and d.get("chunk_tokens") == 64 and d.get("chunk_vocab") == 50
  assert available_implementations(Device("cpu")) == ["xla"]


# Gradients in the forward sweep: a "mean"/"sum" loss whose vocabulary tile is the whole
# vocabulary (chunk_vocab None covers these small vocabularies, as chunk_vocab >= vocab does).

def _with_out_of_range(labels, vocab):
  """Two labels outside [0, vocab) that are not ignore_index (counted as ignored when traced)."""
  return labels.at[1].set(vocab + 3).at[4].set(-7)


def _lce(**kw):
  """linear_cross_entropy jitted over its arrays: the labels are traced, so out-of-range ones count
  as ignored instead of raising."""
  return jax.jit(lambda x, w, b, labels: linear_cross_entropy(x, w, labels, bias=b, **kw))


def _dots_and_scans(jaxpr):
  """``(dot_general, scan)`` equation counts of a jaxpr and every jaxpr nested in it (scan bodies,
  custom_vjp's primal, jit)."""
  dots = scans = 0
  for eqn in jaxpr.eqns:
    dots += eqn.primitive.name == "dot_general"
    scans += eqn.primitive.name == "scan"
    for sub in _nested(eqn.params.values()):
      d, s = _dots_and_scans(sub)
      dots, scans = dots + d, scans + s
  return dots, scans


def _nested(values):
  """The jaxprs among an equation's parameters (each has ``eqns``)."""
  for v in values:
    if isinstance(v, (jax.extend.core.Jaxpr, jax.extend.core.ClosedJaxpr)):
      yield v
    elif isinstance(v, (tuple, list)):
      yield from _nested(v)


def _check_grad_in_forward(x, w, b, labels, dtype, cotangent, **kw):
  """The undifferentiated loss, then the loss and gradients of ``jax.vjp`` at ``cotangent``,
  against the float64 reference; and that the call ran gradients in the forward sweep."""
  call = LinearCrossEntropyCall.of(x, w, labels, bias=b, **kw)
  assert explain_dispatch(call, device=Device("cpu")).get("grad_in_forward") is True
  ref_kw = {k: v for k, v in kw.items() if k not in ("chunk_tokens", "chunk_vocab")}
  want = linear_cross_entropy64(x, w, labels, bias=b, **ref_kw)
  f = _lce(**kw)
  _close(f(x, w, b, labels), want, dtype, "loss (undifferentiated)")
  out, pull = jax.vjp(lambda x, w, b: f(x, w, b, labels), x, w, b)
  assert out.dtype == jnp.promote_types(dtype, jnp.float32)
  _close(out, want, dtype, "loss")
  got = pull(jnp.asarray(cotangent, out.dtype))
  ref = linear_cross_entropy_grads64(x, w, labels, bias=b, cotangent=cotangent, **ref_kw)
  for name, g, r, a in zip(("dx", "dw", "dbias"), got, ref, (x, w, b)):
    if r is None:
      assert g is None
    else:
      assert g.dtype == a.dtype and np.all(np.isfinite(np.asarray(g, np.float64))), name
      _close(g, r, dtype, name)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("layout", ["d_vocab", "vocab_d"])
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
def test_grad_in_forward_values_and_gradients(reduction, layout, bias):
  # 37 tokens in tiles of 16: the last tile starts at 21, its first 11 rows already seen.
  x, w, labels, b = _inputs(10, (37,), 12, 29, layout=layout, bias=bias)
  labels = _with_out_of_range(labels, 29)
  _check_grad_in_forward(x, w, b, labels, jnp.float32, 2.5, w_layout=layout, reduction=reduction,
                         z_loss=1e-3, label_smoothing=0.1, chunk_tokens=16, chunk_vocab=29)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_grad_in_forward_fewer_tokens_than_the_tile(reduction):
  # 2 x 3 tokens under the default 1024-token tile, chunk_vocab beyond the vocabulary, no options.
  x, w, labels, b = _inputs(11, (2, 3), 8, 23, bias=True, ignore_share=0.0)
  _check_grad_in_forward(x, w, b, labels, jnp.float32, 1.0, reduction=reduction, ignore_index=None,
                         chunk_vocab=1000)


def test_grad_in_forward_bfloat16():
  x, w, labels, b = _inputs(12, (37,), 16, 70, dtype=jnp.bfloat16, layout="vocab_d", bias=True)
  _check_grad_in_forward(x, w, b, _with_out_of_range(labels, 70), jnp.bfloat16, 1.0, w_layout="vocab_d",
                         z_loss=1e-3, label_smoothing=0.1, chunk_tokens=16)


def test_grad_in_forward_float64():
  with jax.enable_x64(True):
    x, w, labels, b = _inputs(13, (37,), 8, 19, dtype=jnp.float64, bias=True)
    _check_grad_in_forward(x, w, b, labels, jnp.float64, 2.5, z_loss=1e-3, label_smoothing=0.1,
                           chunk_tokens=16)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_grad_in_forward_every_label_ignored_is_zero_never_nan(reduction):
  x, w, _, b = _inputs(14, (20,), 8, 20, bias=True)
  labels = jnp.asarray(np.r_[np.full(10, -100), np.full(5, 20), np.full(5, -1)], jnp.int32)  # ignored, out of range
  f = _lce(reduction=reduction, chunk_tokens=8, z_loss=1e-3, label_smoothing=0.1)
  loss, grads = jax.value_and_grad(lambda x, w, b: f(x, w, b, labels), argnums=(0, 1, 2))(x, w, b)
  assert float(loss) == 0.0 and float(f(x, w, b, labels)) == 0.0
  for g in grads:
    assert np.all(np.asarray(g) == 0.0)  # zeros, so no NaN either


def test_grad_in_forward_jaxpr_has_no_gradient_work_undifferentiated_and_no_backward_sweep():
  x, w, labels, b = _inputs(15, (37,), 8, 20, bias=True)
  f = lambda x, w, b: linear_cross_entropy(x, w, labels, bias=b, chunk_tokens=16)
  # Undifferentiated: one token sweep, one product (the tile's logits) in its body.
  assert _dots_and_scans(jax.make_jaxpr(f)(x, w, b).jaxpr) == (1, 1)
  # Differentiated: still one sweep, the logits, dx and dw products in it; the backward only scales.
  assert _dots_and_scans(jax.make_jaxpr(jax.grad(f, argnums=(0, 1, 2)))(x, w, b).jaxpr) == (3, 1)
  # The per-token scheme (a vocabulary tile short of the vocabulary) recomputes the logits backward.
  g = lambda x, w, b: linear_cross_entropy(x, w, labels, bias=b, chunk_tokens=16, chunk_vocab=8)
  assert _dots_and_scans(jax.make_jaxpr(jax.grad(g, argnums=(0, 1, 2)))(x, w, b).jaxpr)[0] == 4


def test_grad_in_forward_scale_has_its_gradient():
  # The backend's scalar: d(scale * sum)/d(scale) is the unscaled sum, times the cotangent.
  from probjax.ops.linear_cross_entropy.backends import xla
  x, w, labels, b = _inputs(16, (13,), 8, 20, bias=True)
  call = LinearCrossEntropyCall.of(x, w, labels, bias=b, reduction="sum", chunk_tokens=8, chunk_vocab=20)
  out, pull = jax.vjp(lambda s: xla.reduced_loss(x, w, b, labels, s, call), jnp.float32(0.5))
  total = linear_cross_entropy64(x, w, labels, bias=b, reduction="sum")
  _close(out, 0.5 * total, jnp.float32, "loss")
  _close(pull(jnp.float32(2.5))[0], 2.5 * total, jnp.float32, "dscale")


def test_explain_reports_the_scheme():
  s = jax.ShapeDtypeStruct
  shapes = (s((4, 100, 16), jnp.float32), s((16, 5000), jnp.float32), s((4, 100), jnp.int32))
  explain = lambda **kw: explain_dispatch(LinearCrossEntropyCall.of(*shapes, **kw), device=Device("cpu"))
  assert explain(chunk_vocab=4096).get("grad_in_forward") is False  # a 4096-wide tile misses 5000 entries
  assert explain(reduction="none", chunk_vocab=5000).get("grad_in_forward") is False
  per_token = explain(reduction="none")  # per-token losses: the 4096-wide default tile
  assert per_token.get("grad_in_forward") is False and per_token.get("chunk_vocab") == 4096
  for kw in (dict(), dict(reduction="sum"), dict(chunk_vocab=5000), dict(chunk_vocab=8192, reduction="sum")):
    d = explain(**kw)
    assert d.get("grad_in_forward") is True and d.get("chunk_vocab") == 5000
    assert "grad_in_forward=True" in d.summary()
