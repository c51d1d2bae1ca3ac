"""``"xla"``: the loss in tiles of ``chunk_tokens x chunk_vocab`` logits, never the whole
``[tokens, vocab]`` array, forward and backward. Two schemes:

- Per token (:func:`per_token_loss`, every call the next scheme does not take). The forward
  runs, for each tile of tokens, an online log-sum-exp over the vocabulary's tiles (with the
  label's logit and, for label smoothing, the logits' sum); it keeps each token's log-sum-exp.
  The backward recomputes each tile's logits from it, forms the logits' gradient ``p (1 + 2 z
  lse) - (1 - eps) onehot - eps / V`` (times the token's cotangent) and accumulates ``dx``,
  ``dw`` and ``db`` tile by tile: four products per tile (``x @ w`` twice, ``dz @ w^T``, ``x^T @
  dz``) against the unfused loss's three.
- Gradients in the forward sweep (:func:`reduced_loss`: a ``"mean"`` or ``"sum"`` loss whose
  vocabulary tile is the whole vocabulary, as dispatch's ``grad_in_forward`` decides). A scalar
  loss's gradient is the same for every cotangent up to that one factor, so the forward sweep
  forms each token tile's logits once, takes its loss and ``dz`` (times the token's weight: the
  mean's ``1 / count``, or 1), and accumulates ``dx``, ``dw`` and ``db`` there: three products per
  tile and no backward sweep; the backward multiplies the saved gradients by the cotangent.
  Its residuals are those gradients (``dx`` and ``dw`` in the inputs' dtypes, held from the
  forward to the backward) where the per-token scheme keeps each token's log-sum-exp; its tile
  is ``chunk_tokens x vocab``. Undifferentiated, it computes the loss only.

The last tile of an axis starts earlier rather than padding (its rows or columns already seen
are masked), so no array of the head is copied. Logits and sums are float32 (float64 for
float64 inputs); gradients return in the inputs' dtypes. Exact for every call on every device.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from probjax.core.backend import Backend
from probjax.ops.linear_cross_entropy.call import LinearCrossEntropyCall

CHUNK_TOKENS = 1024
CHUNK_VOCAB = 4096


def chunks(call: LinearCrossEntropyCall) -> tuple[int, int]:
  """The tile ``(tokens, vocab)``: the call's, else :data:`CHUNK_TOKENS` tokens by the whole
  vocabulary for a reduced loss (``"mean"``/``"sum"``) and by :data:`CHUNK_VOCAB` for per-token
  losses, at most the whole axis.

  Why the whole vocabulary for a reduced loss: its gradients are then formed in the forward
  sweep, three products per tile instead of four, and each token tile reads and writes the
  ``[d, vocab]`` float32 head gradient once rather than once per vocabulary tile. At the LM
  step's 16384 tokens x 32768 vocabulary, the 1024 x 32768 float32 tile is 128 MiB, 1/16 of the
  materialised logits. A per-token loss cannot take that scheme (its cotangents arrive only in
  the backward), so it keeps the 16 MB 1024 x 4096 tile whatever the vocabulary."""
  vocab = call.vocab if call.reduction != "none" else CHUNK_VOCAB
  return (min(call.chunk_tokens or CHUNK_TOKENS, max(call.tokens, 1)),
          min(call.chunk_vocab or vocab, call.vocab))


def _head_tile(w, start, size, layout):
  """Columns ``[start, start + size)`` of the head as ``[d, size]``."""
  if layout == "d_vocab":
    return jax.lax.dynamic_slice_in_dim(w, start, size, axis=1)
  return jax.lax.dynamic_slice_in_dim(w, start, size, axis=0).T


def _tile_logits(x, w, b, start, size, layout, acc):
  z = jnp.dot(x, _head_tile(w, start, size, layout), preferred_element_type=acc).astype(acc)
  if b is not None:
    z = z + jax.lax.dynamic_slice_in_dim(b, start, size).astype(acc)
  return z


def _starts(i, size, total):
  """Tile ``i``'s start (the last tile moved back to end at ``total``) and which of its entries
  are new (not in an earlier tile)."""
  start = jnp.minimum(i * size, total - size)
  return start, start + jnp.arange(size) >= i * size


def _valid(labels, call):
  ok = (labels >= 0) & (labels < call.vocab)
  if call.ignore_index is not None:
    ok &= labels != call.ignore_index
  return ok


def _forward(x, w, b, labels, call):
  """Per-token loss ``[N]`` and log-sum-exp ``[N]``."""
  acc = jnp.promote_types(x.dtype, jnp.float32)
  tc, vc = chunks(call)
  n, v = call.tokens, call.vocab
  eps, zl = call.label_smoothing, call.z_loss

  def token_tile(carry, t):
    loss, lse_all = carry
    t0, _ = _starts(t, tc, n)
    xc = jax.lax.dynamic_slice_in_dim(x, t0, tc)
    yc = jax.lax.dynamic_slice_in_dim(labels, t0, tc)

    def vocab_tile(state, j):
      m, s, lab, tot = state
      v0, new = _starts(j, vc, v)
      z = _tile_logits(xc, w, b, v0, vc, call.w_layout, acc)
      zm = jnp.where(new, z, -jnp.inf)
      m_new = jnp.maximum(m, jnp.max(zm, axis=1))
      s = s * jnp.exp(m - m_new) + jnp.sum(jnp.exp(zm - m_new[:, None]), axis=1)
      hit = (yc[:, None] == v0 + jnp.arange(vc)) & new
      lab = lab + jnp.sum(jnp.where(hit, z, 0.0), axis=1)
      tot = tot + jnp.sum(jnp.where(new, z, 0.0), axis=1)
      return (m_new, s, lab, tot), None

    init = (jnp.full((tc,), -jnp.inf, acc), jnp.zeros((tc,), acc), jnp.zeros((tc,), acc), jnp.zeros((tc,), acc))
    (m, s, lab, tot), _ = jax.lax.scan(vocab_tile, init, jnp.arange(-(-v // vc)))
    lse = m + jnp.log(s)
    per = lse - (1 - eps) * lab - eps * tot / v + zl * lse ** 2
    per = jnp.where(_valid(yc, call), per, 0.0)
    return (jax.lax.dynamic_update_slice_in_dim(loss, per, t0, 0),
            jax.lax.dynamic_update_slice_in_dim(lse_all, lse, t0, 0)), None

  init = (jnp.zeros((n,), acc), jnp.zeros((n,), acc))
  (loss, lse), _ = jax.lax.scan(token_tile, init, jnp.arange(-(-n // tc)))
  return loss, lse


def _backward(x, w, b, labels, lse, g, call):
  acc = jnp.promote_types(x.dtype, jnp.float32)
  tc, vc = chunks(call)
  n, v = call.tokens, call.vocab
  eps, zl = call.label_smoothing, call.z_loss
  g = jnp.where(_valid(labels, call), g.astype(acc), 0.0)

  def token_tile(carry, t):
    dx, dw, db = carry
    t0, new_rows = _starts(t, tc, n)
    xc = jax.lax.dynamic_slice_in_dim(x, t0, tc)
    yc = jax.lax.dynamic_slice_in_dim(labels, t0, tc)
    gc = jax.lax.dynamic_slice_in_dim(g, t0, tc)
    lc = jax.lax.dynamic_slice_in_dim(lse, t0, tc)
    coef = 1 + 2 * zl * lc

    def vocab_tile(state, j):
      dxc, dw, db = state
      v0, new = _starts(j, vc, v)
      z = _tile_logits(xc, w, b, v0, vc, call.w_layout, acc)
      p = jnp.exp(z - lc[:, None])
      hit = (yc[:, None] == v0 + jnp.arange(vc))
      dz = gc[:, None] * (p * coef[:, None] - (1 - eps) * hit - eps / v)
      dz = jnp.where(new, dz, 0.0)
      wt = _head_tile(w, v0, vc, call.w_layout)
      dxc = dxc + jnp.dot(dz.astype(wt.dtype), wt.T, preferred_element_type=acc)
      dzw = jnp.where(new_rows[:, None], dz, 0.0)  # rows of an earlier tile count once
      part = jnp.dot(xc.T, dzw.astype(xc.dtype), preferred_element_type=acc)
      if call.w_layout == "d_vocab":
        dw = jax.lax.dynamic_update_slice_in_dim(dw, jax.lax.dynamic_slice_in_dim(dw, v0, vc, 1) + part, v0, 1)
      else:
        dw = jax.lax.dynamic_update_slice_in_dim(dw, jax.lax.dynamic_slice_in_dim(dw, v0, vc, 0) + part.T, v0, 0)
      if db is not None:
        db = jax.lax.dynamic_update_slice_in_dim(db, jax.lax.dynamic_slice_in_dim(db, v0, vc) + jnp.sum(dzw, 0), v0, 0)
      return (dxc, dw, db), None

    (dxc, dw, db), _ = jax.lax.scan(vocab_tile, (jnp.zeros((tc, x.shape[1]), acc), dw, db), jnp.arange(-(-v // vc)))
    return (jax.lax.dynamic_update_slice_in_dim(dx, dxc, t0, 0), dw, db), None

  init = (jnp.zeros(x.shape, acc), jnp.zeros(w.shape, acc), None if b is None else jnp.zeros(b.shape, acc))
  (dx, dw, db), _ = jax.lax.scan(token_tile, init, jnp.arange(-(-n // tc)))
  return dx.astype(x.dtype), dw.astype(w.dtype), None if db is None else db.astype(b.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def per_token_loss(x, w, b, labels, call: LinearCrossEntropyCall):
  """Per-token loss ``[N]`` of ``x [N, d]``, the head ``w`` (``call.w_layout``), ``b [vocab]`` or
  None and ``labels [N]``; 0 for ignored or out-of-range labels."""
  return _forward(x, w, b, labels, call)[0]


def _fwd(x, w, b, labels, call):
  loss, lse = _forward(x, w, b, labels, call)
  return loss, (x, w, b, labels, lse)


def _bwd(call, res, g):
  x, w, b, labels, lse = res
  dx, dw, db = _backward(x, w, b, labels, lse, g, call)
  return dx, dw, db, np.zeros(labels.shape, jax.dtypes.float0)


per_token_loss.defvjp(_fwd, _bwd)


def _whole_vocab_tile(xc, yc, w, b, call, acc):
  """One token tile against the whole vocabulary: logits ``[T, V]``, log-sum-exp ``[T]``, the
  label's one-hot ``[T, V]`` (bool) and the per-token loss ``[T]`` (0 for a label not counted)."""
  v, eps, zl = call.vocab, call.label_smoothing, call.z_loss
  z = _tile_logits(xc, w, b, 0, v, call.w_layout, acc)
  m = jnp.max(z, axis=1)
  lse = m + jnp.log(jnp.sum(jnp.exp(z - m[:, None]), axis=1))
  hit = yc[:, None] == jnp.arange(v)
  per = lse - (1 - eps) * jnp.sum(jnp.where(hit, z, 0.0), axis=1) + zl * lse ** 2
  if eps:  # the logits' sum is one more pass over the tile, needed only for label smoothing
    per = per - eps * jnp.sum(z, axis=1) / v
  return z, lse, hit, jnp.where(_valid(yc, call), per, 0.0)


def _reduced_sum(x, w, b, labels, call):
  """The sum over tokens of the per-token loss (a scalar): the loss only, no gradient work."""
  acc = jnp.promote_types(x.dtype, jnp.float32)
  tc, _ = chunks(call)
  n = call.tokens

  def token_tile(total, t):
    t0, new_rows = _starts(t, tc, n)
    xc = jax.lax.dynamic_slice_in_dim(x, t0, tc)
    yc = jax.lax.dynamic_slice_in_dim(labels, t0, tc)
    per = _whole_vocab_tile(xc, yc, w, b, call, acc)[3]
    return total + jnp.sum(jnp.where(new_rows, per, 0.0)), None  # rows of an earlier tile count once

  total, _ = jax.lax.scan(token_tile, jnp.zeros((), acc), jnp.arange(-(-n // tc)))
  return total


def _reduced_sum_and_grads(x, w, b, labels, scale, call):
  """The sum over tokens of the per-token loss (a scalar) and ``scale`` times its gradients
  ``(dx [N, d], dw, db [vocab] or None)`` in the inputs' dtypes, in one sweep over token tiles."""
  acc = jnp.promote_types(x.dtype, jnp.float32)
  tc, _ = chunks(call)
  n, v = call.tokens, call.vocab
  eps, zl = call.label_smoothing, call.z_loss
  weight = jnp.where(_valid(labels, call), scale.astype(acc), 0.0)
  head = _head_tile(w, 0, v, call.w_layout)  # [d, vocab]

  def token_tile(carry, t):
    total, dx, dw, db = carry
    t0, new_rows = _starts(t, tc, n)
    xc = jax.lax.dynamic_slice_in_dim(x, t0, tc)
    yc = jax.lax.dynamic_slice_in_dim(labels, t0, tc)
    wc = jax.lax.dynamic_slice_in_dim(weight, t0, tc)
    z, lse, hit, per = _whole_vocab_tile(xc, yc, w, b, call, acc)
    total = total + jnp.sum(jnp.where(new_rows, per, 0.0))
    p = jnp.exp(z - lse[:, None])
    dz = wc[:, None] * (p * (1 + 2 * zl * lse)[:, None] - (1 - eps) * hit - eps / v)
    # Each row's dx is whole after its one tile, so it is kept in x's dtype; rows of the moved-back
    # last tile are rewritten with the same values.
    dxc = jnp.dot(dz.astype(head.dtype), head.T, preferred_element_type=acc)
    dx = jax.lax.dynamic_update_slice_in_dim(dx, dxc.astype(dx.dtype), t0, 0)
    dzw = jnp.where(new_rows[:, None], dz, 0.0)  # rows of an earlier tile count once in dw, db
    if call.w_layout == "d_vocab":
      dw = dw + jnp.dot(xc.T, dzw.astype(xc.dtype), preferred_element_type=acc)
    else:
      dw = dw + jnp.dot(dzw.T.astype(xc.dtype), xc, preferred_element_type=acc)
    if db is not None:
      db = db + jnp.sum(dzw, axis=0)
    return (total, dx, dw, db), None

  init = (jnp.zeros((), acc), jnp.zeros(x.shape, x.dtype), jnp.zeros(w.shape, acc),
          None if b is None else jnp.zeros(b.shape, acc))
  (total, dx, dw, db), _ = jax.lax.scan(token_tile, init, jnp.arange(-(-n // tc)))
  return total, dx, dw.astype(w.dtype), None if db is None else db.astype(b.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def reduced_loss(x, w, b, labels, scale, call: LinearCrossEntropyCall):
  """``scale`` times the sum of the per-token losses of ``x [N, d]``, the head ``w``
  (``call.w_layout``), ``b [vocab]`` or None and ``labels [N]`` (0 for ignored or out-of-range
  labels): a scalar in the accumulation dtype, ``scale`` a scalar of that dtype (``1 / count``
  for the mean, 1 for the sum). The call's vocabulary tile must be the whole vocabulary.
  Differentiated, the forward sweep computes the gradients too (see the module doc)."""
  return scale * _reduced_sum(x, w, b, labels, call)


def _reduced_fwd(x, w, b, labels, scale, call):
  total, dx, dw, db = _reduced_sum_and_grads(x, w, b, labels, scale, call)
  return scale * total, (dx, dw, db, total, labels, scale)


def _reduced_bwd(call, res, g):
  dx, dw, db, total, labels, scale = res
  times = lambda d: None if d is None else (g * d.astype(g.dtype)).astype(d.dtype)
  return (times(dx), times(dw), times(db), np.zeros(labels.shape, jax.dtypes.float0),
          (g * total).astype(scale.dtype))


reduced_loss.defvjp(_reduced_fwd, _reduced_bwd)


class Xla(Backend[LinearCrossEntropyCall]):
  name = "xla"

  def supports(self, call, device):
    return None

  def tile(self, call: LinearCrossEntropyCall) -> tuple[int, int]:
    """The tile ``(chunk_tokens, chunk_vocab)``: :func:`chunks`."""
    return chunks(call)

  def __call__(self, x, w, b, labels, *, call: LinearCrossEntropyCall, scale=None):
    """The per-token losses ``[N]`` (:func:`per_token_loss`); with ``scale`` (a scalar), the
    reduced loss ``scale * sum`` with its gradients computed in the forward sweep
    (:func:`reduced_loss`), which needs the call's vocabulary tile to be the whole vocabulary."""
    if scale is None:
      return per_token_loss(x, w, b, labels, call)
    if chunks(call)[1] < call.vocab:
      raise ValueError(f"linear_cross_entropy: gradients in the forward sweep need the whole vocabulary "
                       f"({call.vocab}) in one tile, got chunk_vocab={chunks(call)[1]}")
    return reduced_loss(x, w, b, labels, scale, call)
