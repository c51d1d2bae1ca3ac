"""Context parallelism: exact attention with the sequence sharded over one mesh axis.

:func:`context_parallel_attention` takes q ``[batch, seq, heads, head_dim]`` and k/v
``[batch, seq, kv_heads, head_dim]`` whose sequence axis (axis 1) is split into contiguous
shards over the mesh axis ``axis_name``, and runs one ``jax.shard_map`` body per device:

* ``"allgather"``: each device gathers the whole K/V (and the mask's key segment ids) and
  attends its queries to it, the mask's band shifted to the shard's global query offset.
* ``"ring"``: K/V blocks travel around the devices with ``lax.ppermute``; each step gives the
  local queries' output and log-sum-exp against the visiting block, combined by their
  log-sum-exp. A ``custom_vjp`` runs the backward as a second ring that carries the blocks'
  dK/dV partials with them back to their owners, so no device holds more than two K/V blocks.

Masks are the position masks of :mod:`probjax.ops.attention.masks` (band, lengths, segment ids,
and their ``&``): a band bound and the lengths are global positions, and each block's mask is
the global one seen from the block's query and key offsets. The band bounds are static, so every
(query chunk, key chunk) offset that can occur gets its own branch of a ``lax.switch``, decided
at trace time as empty, full or banded; blocks whose lengths or segment ids leave nothing valid
are skipped at run time. With ``load_balance="zigzag"`` device ``i`` holds chunks ``i`` and
``2n - 1 - i`` of ``2n``, so that under a causal mask every device has the same work; lay the
sequence out with :func:`to_zigzag` (and read the output back with :func:`from_zigzag`).
See docs/context-parallel.md.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

from probjax.core.device import Device
from probjax.ops.attention import registry, vjp
from probjax.ops.attention.backend import AttentionBackend
from probjax.ops.attention.backends import xla as xla_backend
from probjax.ops.attention.call import AttentionCall
from probjax.ops.attention.masks import CausalMask, Mask
from probjax.ops.attention.padding import zero_padding

SCHEDULES = ("auto", "ring", "allgather")
LOAD_BALANCES = (None, "zigzag")
# "auto" gathers K/V unless the gathered K and V of one device would pass this many bytes; a
# memory rule, not a measured crossover (no multi-device GPU timing exists yet).
AUTO_ALLGATHER_MAX_BYTES = 1 << 30
# The mask predicates a block can be given at its offset (lengths and a band shift, segment ids
# are sliced); a prefix-LM's "k <= q or k < prefix" has no static shifted form.
SUPPORTED_KINDS = frozenset({"band", "q_lengths", "kv_lengths", "segments"})
_LSE_TILE = 256  # query rows per step of the blocks' log-sum-exp (bounds its score tile)
_EMPTY = "empty"


# -- layout ---------------------------------------------------------------------------------
def _zigzag_order(num_devices: int) -> np.ndarray:
  """Natural chunk ids in zig-zag layout order: device i holds chunks i and 2n-1-i."""
  n = num_devices
  return np.stack([np.arange(n), 2 * n - 1 - np.arange(n)], axis=1).reshape(-1)


def _permute_chunks(x, order, axis):
  n_chunks = len(order)
  if x.shape[axis] % n_chunks:
    raise ValueError(f"x's axis {axis} (length {x.shape[axis]}) must be divisible into {n_chunks} "
                     f"chunks (2 per device)")
  shape = x.shape[:axis] + (n_chunks, x.shape[axis] // n_chunks) + x.shape[axis + 1:]
  return jnp.take(x.reshape(shape), jnp.asarray(order), axis=axis).reshape(x.shape)


def to_zigzag(x, num_devices: int, *, axis: int = 1):
  """``x`` (natural order along ``axis``) in the zig-zag layout of ``num_devices`` devices: the
  axis in ``2 * num_devices`` chunks, device ``i``'s contiguous shard holding chunks ``i`` and
  ``2 * num_devices - 1 - i``. For q, k, v ``[batch, seq, ...]`` and segment ids ``[batch, seq]``."""
  return _permute_chunks(x, _zigzag_order(num_devices), axis)


def from_zigzag(x, num_devices: int, *, axis: int = 1):
  """The inverse of :func:`to_zigzag`: the natural order of a zig-zag laid out ``x``."""
  return _permute_chunks(x, np.argsort(_zigzag_order(num_devices)), axis)


# -- static plan ----------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class _Kernels:
  """The attention backend whose kernels run the blocks (a registry name), the backward variant
  they pair with (found by name: :func:`probjax.ops.attention.registry.backward_kernel`), and
  interpret mode."""

  implementation: str
  backward_variant: str = "auto"
  interpret: bool = False

  def forward(self, q, k, v, mask, scale: float) -> vjp.Kernel:
    f = registry.REGISTRY.get(self.implementation).forward_kernel(
        q, k, v, mask, scale=scale, score_mod=None, config=None, interpret=self.interpret)
    return dataclasses.replace(f, partitioned=False)  # inside shard_map: each device its block

  def backward(self, q, k, v, scale: float) -> vjp.Kernel:
    b = registry.backward_kernel(self.backward_variant, q, k, v, scale=scale, interpret=self.interpret)
    return dataclasses.replace(b, partitioned=False)


@dataclasses.dataclass(frozen=True)
class _Plan:
  """What the shard_map body needs to know at trace time."""

  axis_name: str
  n: int  # devices on the axis
  per_device: int  # chunks per device: 1, or 2 (zig-zag)
  chunk: int  # positions per chunk
  lower: int | None  # the global band
  upper: int | None
  scale: float
  kernels: _Kernels | None = None  # None: the blocks run the XLA path

  def chunk_ids(self, device):
    """Natural (global) chunk ids of ``device``'s chunks, in its shard's order."""
    if self.per_device == 1:
      return [device]
    return [device, 2 * self.n - 1 - device]

  def band(self, offset: int, q_len: int, kv_len: int):
    """The band seen by ``q_len`` queries from global position ``p`` against ``kv_len`` keys
    from ``p - offset``: ``(lower, upper)`` (None: no bound inside the block), or ``_EMPTY``."""
    lo = None if self.lower is None else self.lower + offset
    hi = None if self.upper is None else self.upper + offset
    if (lo is not None and lo > kv_len - 1) or (hi is not None and hi < -(q_len - 1)) or (
        lo is not None and hi is not None and lo > hi):
      return _EMPTY
    lo = None if lo is not None and lo <= -(q_len - 1) else lo
    hi = None if hi is not None and hi >= kv_len - 1 else hi
    return lo, hi

  def branches(self, offsets, q_len: int, kv_len: int):
    """``(bands, index)``: the distinct bands of ``offsets`` (``_EMPTY`` first) and, per offset,
    its band's position, as a table for ``lax.switch``."""
    bands = [_EMPTY]
    index = []
    for off in offsets:
      b = self.band(off, q_len, kv_len)
      if b not in bands:
        bands.append(b)
      index.append(bands.index(b))
    return bands, jnp.asarray(index, jnp.int32)


@dataclasses.dataclass(frozen=True)
class _Arrays:
  """A mask's per-batch arrays, each None or: lengths ``[batch]`` (global positions), segment
  ids ``[batch, local_len]`` (sharded like the sequence)."""

  q_lengths: object = None
  kv_lengths: object = None
  q_segment_ids: object = None
  kv_segment_ids: object = None


jax.tree_util.register_dataclass(_Arrays, data_fields=["q_lengths", "kv_lengths", "q_segment_ids",
                                                       "kv_segment_ids"], meta_fields=[])


def _block_arrays(arr: _Arrays, q_start, q_len: int, kv_start, kv_len: int, q_ids, kv_ids):
  """One block's arrays: lengths relative to the block's first query / key, clipped to it."""
  clip = lambda x, start, n: None if x is None else jnp.clip(x - start, 0, n).astype(jnp.int32)
  return _Arrays(clip(arr.q_lengths, q_start, q_len), clip(arr.kv_lengths, kv_start, kv_len), q_ids, kv_ids)


def _block_mask(band, a: _Arrays):
  lo, hi = band
  m = Mask(lower=lo, upper=hi, q_lengths=a.q_lengths, kv_lengths=a.kv_lengths,
           q_segment_ids=a.q_segment_ids, kv_segment_ids=a.kv_segment_ids)
  return m if m.has_band or m.has_arrays else None


def _live(a: _Arrays):
  """Whether any batch element of the block may have a valid (query, key) pair (conservative:
  segment ids by their min/max range)."""
  ok = jnp.asarray(True)
  if a.q_lengths is not None:
    ok = ok & (a.q_lengths > 0)
  if a.kv_lengths is not None:
    ok = ok & (a.kv_lengths > 0)
  if a.q_segment_ids is not None:
    qs, ks = a.q_segment_ids, a.kv_segment_ids
    ok = ok & (qs.min(1) <= ks.max(1)) & (ks.min(1) <= qs.max(1))
  return jnp.any(ok)


# -- one block ------------------------------------------------------------------------------
def _attend(q, k, v, mask, scale):
  """The exact XLA path (dense or flash by length), differentiable."""
  return xla_backend.attention(q, k, v, mask=mask, scale=scale)


def _lse(q, k, mask, scale):
  """Log-sum-exp over keys of the masked, scaled scores, ``[batch, q_len, heads]`` float32 (-inf
  for rows with no valid key), in tiles of query rows."""
  b, tq, h, d = q.shape
  tk, hkv = k.shape[1], k.shape[2]
  g = h // hkv
  tile = min(tq, _LSE_TILE)
  nt = -(-tq // tile)
  qg = jnp.pad(q.reshape(b, tq, hkv, g, d), ((0, 0), (0, nt * tile - tq), (0, 0), (0, 0), (0, 0)))
  kf = k.astype(jnp.float32)

  def rows(i):
    qb = lax.dynamic_slice_in_dim(qg, i * tile, tile, 1).astype(jnp.float32)
    s = jnp.einsum("bqhgd,bkhd->bhgqk", qb, kf) * scale
    if mask is not None:
      ok = mask.element(i * tile + jnp.arange(tile)[:, None], jnp.arange(tk)[None, :])
      s = jnp.where(ok.reshape((-1, 1, 1, tile, tk)) if ok.ndim == 3 else ok, s, -jnp.inf)
    return jax.nn.logsumexp(s, axis=-1)  # [b, hkv, g, tile]

  lse = lax.map(rows, jnp.arange(nt))  # [nt, b, hkv, g, tile]
  lse = jnp.transpose(lse, (1, 0, 4, 2, 3)).reshape(b, nt * tile, h)
  return lse[:, :tq]


def _no_rows(q, v):
  """The (out, lse) of queries that see no key. From q's zeros_like, so that the values vary over
  the manual mesh axes as the other branches' do (shard_map's check_vma)."""
  zero = jnp.zeros_like(q[..., :1], jnp.float32)
  return jnp.broadcast_to(zero, q.shape[:3] + v.shape[3:]), zero[..., 0] - jnp.inf


def _block_forward(band, q, k, v, a: _Arrays, *, scale):
  """``(out, lse)`` of queries against one K/V block: ``[b, tq, h, dv]`` and ``[b, tq, h]``, float32."""
  if band == _EMPTY:
    return _no_rows(q, v)
  mask = _block_mask(band, a)
  q, k, v, _ = zero_padding(mask, q, k, v)
  return _attend(q, k, v, mask, scale).astype(jnp.float32), _lse(q, k, mask, scale)


def _kernel_block_forward(kernels: _Kernels, band, q, k, v, a: _Arrays, *, scale):
  """:func:`_block_forward` by the backend's forward kernel (its lse's ``+inf`` for a row
  without a valid key is this module's ``-inf``)."""
  if band == _EMPTY:
    return _no_rows(q, v)
  mask = _block_mask(band, a)
  f = kernels.forward(q, k, v, mask, scale)
  out, lse = f.fn(f.static, q, k, v, mask)
  lse = jnp.swapaxes(lse, 1, 2)
  return out.astype(jnp.float32), jnp.where(lse == jnp.inf, -jnp.inf, lse)


def _kernel_block_backward(kernels: _Kernels, band, q, k, v, a: _Arrays, do, out, lse, *, scale):
  """:func:`_block_backward` by the backend's backward kernel: given the combined output and
  its log-sum-exp, a flash backward over one block computes exactly that block's share of dQ,
  dK and dV (its probabilities are ``exp(s - lse)`` with the combined ``lse``, and ``delta`` is
  the combined output's)."""
  if band == _EMPTY:
    return tuple(jnp.zeros_like(x, jnp.float32) for x in (q, k, v))
  mask = _block_mask(band, a)
  b = kernels.backward(q, k, v, scale)
  lse = jnp.swapaxes(jnp.where(lse == -jnp.inf, jnp.inf, lse), 1, 2)
  grads = b.fn(b.static, q, k, v, out.astype(q.dtype), lse, do.astype(q.dtype), mask)
  return tuple(g.astype(jnp.float32) for g in grads)


def _block_backward(band, q, k, v, a: _Arrays, do, delta, lse, lse_block, *, scale):
  """``(dq, dk, dv)`` float32 of one block's share of the gradient, given the combined output's
  ``lse`` and ``delta = rowsum(dO * O)`` (``[b, tq, h]``) and the block's own ``lse_block``.

  With ``w = exp(lse_block - lse)`` the block's probabilities are ``P = w * softmax_block``; its
  score gradient ``P * (dO V^T - delta)`` is the block attention's vjp at ``w * dO`` (which
  subtracts ``rowsum(dO * out_block)`` instead of ``delta``) plus ``softmax_block * g`` with
  ``g = w * (rowsum(dO * out_block) - delta)``: the lse's vjp, whose dQ is ``scale * g *
  softmax_block K`` and dK ``scale * softmax_block^T (g q)`` (attention with K as values, and
  its value-vjp)."""
  if band == _EMPTY:
    return tuple(jnp.zeros_like(x, jnp.float32) for x in (q, k, v))
  mask = _block_mask(band, a)
  q, k, v, _ = zero_padding(mask, q, k, v)
  live = lse_block > -jnp.inf
  w = jnp.where(live, jnp.exp(jnp.where(live, lse_block - lse, 0.0)), 0.0)[..., None]
  out, vjp = jax.vjp(lambda q, k, v: _attend(q, k, v, mask, scale), q, k, v)
  do = jnp.where(w > 0, do, 0.0)  # a row the block does not reach: its cotangent is not read
  g = w * (jnp.sum(do * out.astype(jnp.float32), -1, keepdims=True) - delta[..., None])
  dq, dk, dv = vjp((w * do).astype(out.dtype))
  k_avg, vjp_v = jax.vjp(lambda vv: _attend(q, k, vv, mask, scale), k)
  dq = dq.astype(jnp.float32) + scale * g * k_avg.astype(jnp.float32)
  dk = dk.astype(jnp.float32) + vjp_v((scale * g * q.astype(jnp.float32)).astype(k.dtype))[0].astype(jnp.float32)
  return dq, dk, dv.astype(jnp.float32)


def _chunks(x, parts: int):
  return [x] if parts == 1 else jnp.split(x, parts, axis=1)


def _switch(plan: _Plan, q_id, k_id, a: _Arrays, fn, *operands):
  """``fn(band, *operands)`` for the band of query chunk ``q_id`` against key chunk ``k_id``
  (traced ids), skipped (the empty branch) where the block's arrays leave nothing valid."""
  m = plan.n * plan.per_device
  bands, table = plan.branches([r * plan.chunk for r in range(-(m - 1), m)], plan.chunk, plan.chunk)
  idx = jnp.where(_live(a), table[q_id - k_id + m - 1], 0)
  return lax.switch(idx, [functools.partial(fn, b) for b in bands], *operands)


# -- ring -----------------------------------------------------------------------------------
def _rotate(plan: _Plan, x):
  """Each device's ``x`` to the next device on the axis (device i receives device i-1's)."""
  perm = [(i, (i + 1) % plan.n) for i in range(plan.n)]
  return jax.tree.map(lambda t: lax.ppermute(t, plan.axis_name, perm), x)


def _ring_blocks(plan: _Plan, device, step, arr: _Arrays, q_seg, kv_seg):
  """``{(t, u): (query chunk id, key chunk id, block arrays)}`` for local query chunk ``t``
  against chunk ``u`` of the block visiting at ``step``; ``q_seg``: the local query chunks'
  segment ids (a list) or None, ``kv_seg``: the visiting block's, or None."""
  nc, c = plan.per_device, plan.chunk
  q_ids, k_ids = plan.chunk_ids(device), plan.chunk_ids((device - step) % plan.n)
  q_seg = [None] * nc if q_seg is None else q_seg
  kv_seg = [None] * nc if kv_seg is None else _chunks(kv_seg, nc)
  return {(t, u): (q_ids[t], k_ids[u], _block_arrays(arr, q_ids[t] * c, c, k_ids[u] * c, c, q_seg[t], kv_seg[u]))
          for t in range(nc) for u in range(nc)}


def _ring_forward(plan: _Plan, q, k, v, arr: _Arrays):
  """Local ``(out float32, lse, block lses [n, chunks, chunks, b, c, h])``."""
  device = lax.axis_index(plan.axis_name)
  nc = plan.per_device
  qc = _chunks(q, nc)
  qseg = None if arr.q_segment_ids is None else _chunks(arr.q_segment_ids, nc)
  out0, lse0 = map(list, zip(*(_no_rows(x, v) for x in qc)))

  def step(carry, s):
    kv, out, lse = carry
    nxt = _rotate(plan, kv)  # independent of this step's compute, so the transfer can overlap it
    k_, v_, kseg = kv
    kc, vc = _chunks(k_, nc), _chunks(v_, nc)
    blocks = _ring_blocks(plan, device, s, arr, qseg, kseg)
    out, lse, lses = list(out), list(lse), []
    for (t, u), (qi, ki, a) in blocks.items():
      o_b, l_b = _switch(plan, qi, ki, a, _forward_block(plan), qc[t], kc[u], vc[u], a)
      out[t], lse[t] = _combine(out[t], lse[t], o_b, l_b)
      lses.append(l_b)
    return (nxt, out, lse), jnp.stack(lses).reshape((nc, nc) + lses[0].shape)

  (_, out, lse), lses = lax.scan(step, ((k, v, arr.kv_segment_ids), out0, lse0), jnp.arange(plan.n))
  return jnp.concatenate(out, 1), jnp.concatenate(lse, 1), lses


def _forward_block(plan: _Plan):
  """``fn(band, q, k, v, arrays) -> (out, lse)`` of one block, by the plan's kernels or XLA."""
  if plan.kernels is None:
    return functools.partial(_block_forward, scale=plan.scale)
  return functools.partial(_kernel_block_forward, plan.kernels, scale=plan.scale)


def _combine(out, lse, o_b, l_b):
  """Merges a block's (output, lse) into the running ones; rows with no valid key stay zero."""
  new = jnp.logaddexp(lse, l_b)
  ok = new > -jnp.inf
  wa = jnp.where(ok, jnp.exp(jnp.where(ok, lse - new, 0.0)), 0.0)[..., None]
  wb = jnp.where(ok, jnp.exp(jnp.where(ok, l_b - new, 0.0)), 0.0)[..., None]
  return out * wa + o_b * wb, new


def _ring_backward(plan: _Plan, q, k, v, arr: _Arrays, out, lse, lses, do):
  device = lax.axis_index(plan.axis_name)
  nc = plan.per_device
  do = do.astype(jnp.float32)
  delta = jnp.sum(do * out, -1)
  qc, doc, dc, lc, oc = (_chunks(x, nc) for x in (q, do, delta, lse, out))
  qseg = None if arr.q_segment_ids is None else _chunks(arr.q_segment_ids, nc)

  def step(carry, xs):
    (k_, v_, kseg, dk, dv), dq = carry
    s, lse_s = xs
    kc, vc = _chunks(k_, nc), _chunks(v_, nc)
    dkc, dvc, dq = _chunks(dk, nc), _chunks(dv, nc), list(dq)
    for (t, u), (qi, ki, a) in _ring_blocks(plan, device, s, arr, qseg, kseg).items():
      if plan.kernels is None:
        gq, gk, gv = _switch(plan, qi, ki, a, functools.partial(_block_backward, scale=plan.scale),
                             qc[t], kc[u], vc[u], a, doc[t], dc[t], lc[t], lse_s[t, u])
      else:
        gq, gk, gv = _switch(plan, qi, ki, a, functools.partial(_kernel_block_backward, plan.kernels, scale=plan.scale),
                             qc[t], kc[u], vc[u], a, doc[t], oc[t], lc[t])
      dq[t], dkc[u], dvc[u] = dq[t] + gq, dkc[u] + gk, dvc[u] + gv
    dk, dv = jnp.concatenate(dkc, 1), jnp.concatenate(dvc, 1)
    # The partials travel with their block: after n steps every block is back with its owner.
    return (_rotate(plan, (k_, v_, kseg, dk, dv)), dq), None

  zeros = lambda x: jnp.zeros_like(x, jnp.float32)
  init = ((k, v, arr.kv_segment_ids, zeros(k), zeros(v)), [zeros(x) for x in qc])
  ((_, _, _, dk, dv), dq), _ = lax.scan(step, init, (jnp.arange(plan.n), lses))
  return jnp.concatenate(dq, 1).astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _ring(plan: _Plan, q, k, v, arr: _Arrays):
  return _ring_forward(plan, q, k, v, arr)[0].astype(q.dtype)


def _ring_fwd(plan, q, k, v, arr):
  out, lse, lses = _ring_forward(plan, q, k, v, arr)
  return out.astype(q.dtype), (q, k, v, arr, out, lse, lses)


def _ring_bwd(plan, res, do):
  q, k, v, arr, out, lse, lses = res
  dq, dk, dv = _ring_backward(plan, q, k, v, arr, out, lse, lses, do)
  return dq, dk, dv, jax.tree.map(lambda _: None, arr)


_ring.defvjp(_ring_fwd, _ring_bwd)


# -- all-gather -----------------------------------------------------------------------------
def _allgather(plan: _Plan, q, k, v, arr: _Arrays):
  """Local queries against the gathered K/V (in natural order); differentiated by JAX (the
  gathers transpose to reduce-scatters)."""
  device = lax.axis_index(plan.axis_name)
  gather = lambda x: None if x is None else lax.all_gather(x, plan.axis_name, axis=1, tiled=True)
  k, v, kseg = gather(k), gather(v), gather(arr.kv_segment_ids)
  if plan.per_device == 2:
    k, v = from_zigzag(k, plan.n), from_zigzag(v, plan.n)
    kseg = None if kseg is None else from_zigzag(kseg, plan.n)
  kv_len = k.shape[1]
  m = plan.n * plan.per_device
  bands, table = plan.branches([a * plan.chunk for a in range(m)], plan.chunk, kv_len)
  qc = _chunks(q, plan.per_device)
  qseg = None if arr.q_segment_ids is None else _chunks(arr.q_segment_ids, plan.per_device)
  out = []
  for t, qi in enumerate(plan.chunk_ids(device)):
    a = _block_arrays(arr, qi * plan.chunk, plan.chunk, 0, kv_len, None if qseg is None else qseg[t], kseg)

    def block(band, q_, k_, v_, a_):
      if band == _EMPTY:
        return _no_rows(q_, v_)[0].astype(q_.dtype)
      mask = _block_mask(band, a_)
      if plan.kernels is None:
        return _attend(q_, k_, v_, mask, plan.scale)
      return vjp.attention(plan.kernels.forward(q_, k_, v_, mask, plan.scale),
                           plan.kernels.backward(q_, k_, v_, plan.scale), q_, k_, v_, mask)
    out.append(lax.switch(table[qi], [functools.partial(block, b) for b in bands], qc[t], k, v, a))
  return jnp.concatenate(out, 1)


# -- public ---------------------------------------------------------------------------------
def context_parallel_attention(query, key, value, mask=None, *, mesh, axis_name, schedule: str = "auto",
                               scale=None, implementation=None, load_balance=None, is_causal: bool = False,
                               dropout_rate: float = 0.0, deterministic: bool = True, dropout_rng=None,
                               broadcast_dropout: bool = True, backward_pass_impl: str = "auto",
                               interpret: bool = False):
  """Exact attention with the sequence axis sharded over the mesh axis ``axis_name``.

  Args:
    query: ``[batch, seq, heads, head_dim]``; key, value ``[batch, seq, kv_heads, head_dim]``
      (``heads % kv_heads == 0``), the same ``seq``, a multiple of the axis size (of twice it
      with zig-zag). Outside ``shard_map`` the global arrays (sharded or not: they are laid out
      as ``P(None, axis_name)``); inside a ``shard_map`` whose manual axes include
      ``axis_name``, the local shards.
    mask: None or a :class:`~probjax.ops.attention.masks.Mask` (CausalMask, LocalWindowMask,
      KVLenMask, LengthMask, SegmentMask and their ``&``); bands and lengths in global
      positions of the natural order, segment ids ``[batch, seq]`` laid out as the sequence.
    mesh: the ``jax.sharding.Mesh``; axis_name: its axis that shards the sequence.
    schedule: ``"allgather"``, ``"ring"`` or ``"auto"`` (all-gather unless one device's gathered
      K and V would pass ``AUTO_ALLGATHER_MAX_BYTES``).
    scale: softmax scale (a Python float), default ``head_dim ** -0.5``.
    implementation: what runs the blocks: None or ``"xla"``, probjax's exact XLA path; or an
      attention backend with a forward kernel that returns its log-sum-exp (``"triton"``,
      ``"mosaic"``): each block runs that forward, and the ring's backward a flash backward per
      block on the combined output and log-sum-exp (``backward_pass_impl``: the backward
      variant, found by name; ``"auto"`` the Triton one). A backend that cannot compute a
      block (its ``supports``) raises ValueError with the reason. The default stays XLA until
      the kernels' blocks are measured on GPUs.
    backward_pass_impl: the kernels' backward variant (``"auto"`` or a ``"triton_*"`` name).
    interpret: run the kernels in Pallas interpret mode (CPU tests).
  Inside a ``shard_map`` of your own, kernel blocks need it built with ``check_vma=False`` (Pallas
  kernels do not type their outputs' varying axes).
    load_balance: None (device ``i`` holds the ``i``-th contiguous shard) or ``"zigzag"``
      (inputs, segment ids and output in :func:`to_zigzag` layout).
    is_causal, dropout_rate, deterministic, dropout_rng, broadcast_dropout: what
      ``MultiHeadAttention`` passes to its ``attention_fn``; ``is_causal`` adds ``CausalMask()``,
      dropout is refused.
  Returns:
    ``[batch, seq, heads, head_dim]``, sharded (laid out) as the query.
  """
  del dropout_rng, broadcast_dropout  # only meaningful with dropout, which is refused below
  if dropout_rate and not deterministic:
    raise ValueError(f"dropout_rate={dropout_rate}: context_parallel_attention has no attention dropout")
  if schedule not in SCHEDULES:
    raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
  if load_balance not in LOAD_BALANCES:
    raise ValueError(f"load_balance must be one of {LOAD_BALANCES}, got {load_balance!r}")
  if not hasattr(mesh, "axis_names") or not hasattr(mesh, "shape"):
    raise ValueError(f"mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}")
  if axis_name not in mesh.axis_names:
    raise ValueError(f"axis_name {axis_name!r} is not an axis of the mesh (axes {tuple(mesh.axis_names)})")
  n = mesh.shape[axis_name]
  per_device = 2 if load_balance == "zigzag" else 1
  for name, x in (("query", query), ("key", key), ("value", value)):
    if not hasattr(x, "ndim") or x.ndim != 4:
      raise ValueError(f"{name} must have shape [batch, seq, heads, head_dim], got {tuple(getattr(x, 'shape', ()))}")
  if key.shape[:3] != value.shape[:3]:
    raise ValueError(f"key {tuple(key.shape)} and value {tuple(value.shape)} must agree in [batch, seq, kv_heads]")
  if key.shape[0] != query.shape[0] or key.shape[1] != query.shape[1]:
    raise ValueError(f"key's [batch, seq] {tuple(key.shape[:2])} must equal query's {tuple(query.shape[:2])} "
                     "(context parallelism splits one sequence of queries and keys)")
  if key.shape[3] != query.shape[3] or query.shape[2] % key.shape[2]:
    raise ValueError(f"key {tuple(key.shape)} must have query's head_dim and a number of heads dividing "
                     f"query's {tuple(query.shape)}")
  inside = axis_name in jax.sharding.get_abstract_mesh().manual_axes
  seq = query.shape[1] * (n if inside else 1)
  if seq % (n * per_device):
    raise ValueError(f"query's sequence length {seq} must be divisible by {n * per_device} (the {n} devices "
                     f"of axis {axis_name!r}{' times 2 chunks each for zigzag' if per_device == 2 else ''}); "
                     "pad the sequence and mask the padding with KVLenMask/LengthMask")
  if not inside:
    for name, x in (("query", query), ("key", key), ("value", value)):
      _check_sharding(name, x, mesh, axis_name)
  if is_causal:
    mask = CausalMask() if mask is None else mask & CausalMask()
  mask, arr = _split(mask, query.shape[0], seq, query.shape[1] if inside else seq)
  if scale is None:
    scale = query.shape[-1] ** -0.5
  try:
    scale = float(scale)
  except (TypeError, jax.errors.ConcretizationTypeError) as e:
    raise ValueError(f"scale must be a Python float (it is compiled into the blocks), got {scale!r}") from e
  if schedule == "auto":
    gathered = key.shape[0] * seq * key.shape[2] * (key.shape[3] + value.shape[3]) * key.dtype.itemsize
    schedule = "allgather" if gathered <= AUTO_ALLGATHER_MAX_BYTES else "ring"
  chunk = seq // (n * per_device)
  kernels = _block_kernels(implementation, backward_pass_impl, interpret, query, key, value, chunk, mask, arr, scale,
                           seq if schedule == "allgather" else chunk)
  plan = _Plan(axis_name, n, per_device, chunk, mask.lower, mask.upper, scale, kernels)
  body = functools.partial(_ring if schedule == "ring" else _allgather, plan)
  if inside:
    return body(query, key, value, arr)
  seq_spec, rep = P(None, axis_name), P()
  arr_specs = _Arrays(rep, rep, seq_spec, seq_spec)
  # Pallas kernels declare their outputs without shard_map's varying-axes types: their blocks
  # run with that check off (the XLA blocks keep it).
  return jax.shard_map(body, mesh=mesh, in_specs=(seq_spec, seq_spec, seq_spec, arr_specs),
                       out_specs=seq_spec, axis_names=frozenset({axis_name}),
                       check_vma=kernels is None)(query, key, value, arr)


def _block_kernels(implementation, backward_pass_impl: str, interpret: bool, query, key, value, chunk: int,
                   mask: Mask, arr: _Arrays, scale: float, kv_len: int) -> _Kernels | None:
  """The kernels that run the blocks (None: XLA), checked: the backend must run on this device,
  compute a block (``chunk`` queries against ``kv_len`` keys under the mask's kinds) and have a
  forward kernel with its log-sum-exp."""
  name = registry.REGISTRY.canonical(implementation)
  if name in (None, "xla"):
    if backward_pass_impl != "auto":
      raise ValueError(f"backward_pass_impl={backward_pass_impl!r} configures the kernels' backward; the XLA "
                       "blocks take 'auto' (pass implementation='triton' or 'mosaic')")
    return None
  backend = registry.REGISTRY.get(name)
  b, _, h, d = query.shape
  block_mask = Mask(lower=mask.lower, upper=mask.upper,
                    q_lengths=arr.q_lengths if arr.q_lengths is None else jnp.zeros((b,), jnp.int32),
                    kv_lengths=arr.kv_lengths if arr.kv_lengths is None else jnp.zeros((b,), jnp.int32),
                    q_segment_ids=None if arr.q_segment_ids is None else jnp.zeros((b, chunk), jnp.int32),
                    kv_segment_ids=None if arr.kv_segment_ids is None else jnp.zeros((b, kv_len), jnp.int32))
  call = AttentionCall((b, chunk, h, d), (b, kv_len, key.shape[2], d), query.dtype, scale=scale,
                       mask=block_mask if (block_mask.has_band or block_mask.has_arrays) else None,
                       v_head_dim=value.shape[3], interpret=interpret)
  why = backend.supports(call, Device.interpreter() if interpret else Device.current())
  if why is None and type(backend).forward_kernel is AttentionBackend.forward_kernel:
    why = "it has no forward kernel that returns its log-sum-exp"
  if why is None and backward_pass_impl not in backend.backward_pass_impls:
    why = f"backward_pass_impl={backward_pass_impl!r} is not one of its {backend.backward_pass_impls}"
  if why is None and backward_pass_impl == "mosaic":
    why = "the Mosaic backward is not offered to blocks combined by their log-sum-exp (pass 'auto' or 'triton_*')"
  if why:
    raise ValueError(f"implementation={implementation!r} cannot run context-parallel blocks: {why}")
  return _Kernels(name, backward_pass_impl, bool(interpret))


def _split(mask, batch: int, seq: int, local: int):
  """``(band-only Mask, _Arrays)`` of ``mask``, validated: lengths in ``[0, seq]``, segment ids
  ``[batch, local]`` (the positions given: the whole sequence outside shard_map)."""
  if mask is None:
    return Mask(), _Arrays()
  if not isinstance(mask, Mask):
    raise ValueError(f"mask must be a probjax Mask (CausalMask, LocalWindowMask, KVLenMask, LengthMask, "
                     f"SegmentMask or their &), got {type(mask).__name__}: a dense mask cannot be split "
                     "by sequence shard")
  other = sorted(set(getattr(mask, "kinds", ())) - SUPPORTED_KINDS)
  if other:
    raise ValueError(f"mask predicate {other[0]!r} cannot be shifted to a shard's offset; context "
                     f"parallelism takes {sorted(SUPPORTED_KINDS)}")
  lengths = Mask(q_lengths=mask.q_lengths, kv_lengths=mask.kv_lengths)
  lengths.validate(batch, seq, seq)
  lengths = lengths.clamped(seq, seq)
  Mask(q_segment_ids=mask.q_segment_ids, kv_segment_ids=mask.kv_segment_ids).validate(batch, local, local)
  arr = _Arrays(lengths.q_lengths, lengths.kv_lengths, mask.q_segment_ids, mask.kv_segment_ids)
  return Mask(lower=mask.lower, upper=mask.upper), arr


def _check_sharding(name, x, mesh, axis_name):
  """A committed array sharded over ``axis_name`` anywhere but its sequence axis is refused
  (shard_map would silently reshard it)."""
  sharding = getattr(x, "sharding", None)
  if not isinstance(x, jax.Array) or isinstance(x, jax.core.Tracer) or not isinstance(sharding, NamedSharding):
    return
  for dim, entry in enumerate(sharding.spec):
    axes = entry if isinstance(entry, tuple) else (entry,)
    if axis_name in axes and dim != 1:
      raise ValueError(f"{name} is sharded over {axis_name!r} on axis {dim} ({sharding.spec}); context "
                       f"parallelism needs {axis_name!r} on the sequence axis 1, e.g. P(None, {axis_name!r})")
  n = mesh.shape[axis_name]
  if sharding.mesh.shape.get(axis_name, n) != n:
    raise ValueError(f"{name}'s mesh has {sharding.mesh.shape[axis_name]} devices on {axis_name!r}, "
                     f"the mesh given has {n}")
