"""The call objects of the scan room: one frozen description per call, built from the arrays.

A call holds everything but the arrays (shapes, dtype, flags, the chunk size asked for); the
constructors :meth:`MambaCall.of`, :meth:`SSDCall.of` and :meth:`RLACall.of` validate the
arrays and raise ValueError naming the argument. Dispatch and every backend's ``supports``
read only these objects, so tests build them directly for fake devices.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

FEATURE_MAPS = ("softmax", "relu")


def _int_at_least(v, minimum: int) -> bool:
  """Whether ``v`` is an int (not a bool) of at least ``minimum``."""
  return isinstance(v, (int, np.integer)) and not isinstance(v, bool) and v >= minimum


def _dims(call, names):
  for name in names:
    v = getattr(call, name)
    if not _int_at_least(v, 1):
      raise ValueError(f"{type(call).__name__}: {name} must be an int >= 1, got {v!r}")


def _chunk(call):
  c = call.chunk_size
  if c is not None and not _int_at_least(c, 1):
    raise ValueError(f"chunk_size must be None or an int >= 1, got {c!r}")


def _floating(op, name, a):
  if not jnp.issubdtype(a.dtype, jnp.floating):
    raise ValueError(f"{op}: {name} must be a floating array, got dtype {a.dtype}")


def _shape(op, name, a, shape, what):
  if a is None:
    return
  if tuple(a.shape) != tuple(shape):
    raise ValueError(f"{op}: {name} must have shape {what} = {tuple(shape)}, got {tuple(a.shape)}")
  _floating(op, name, a)


def _rank(op, name, a, rank, what):
  if a.ndim != rank:
    raise ValueError(f"{op}: {name} must be {what} (rank {rank}), got shape {tuple(a.shape)}")
  _floating(op, name, a)


@dataclasses.dataclass(frozen=True)
class MambaCall:
  """A Mamba-1 selective scan: x ``[batch, length, channels]``, state ``[channels, state]``."""

  batch: int
  length: int
  channels: int
  state: int
  dtype: str
  chunk_size: int | None = None
  interpret: bool = False

  def __post_init__(self):
    _dims(self, ("batch", "length", "channels", "state"))
    _chunk(self)

  @property
  def state_shape(self) -> tuple[int, ...]:
    """The scan state: ``[batch, channels, state]``."""
    return (self.batch, self.channels, self.state)

  @classmethod
  def of(cls, x, dt, A, B, C, D=None, *, z=None, dt_bias=None, initial_state=None,
         chunk_size=None, interpret=False) -> "MambaCall":
    op = "mamba_scan"
    _rank(op, "x", x, 3, "[batch, length, channels]")
    b, l, d = x.shape
    _rank(op, "A", A, 2, "[channels, state]")
    if A.shape[0] != d:
      raise ValueError(f"{op}: A must have shape [channels, state] with channels = {d} (x's last "
                       f"axis), got {tuple(A.shape)}")
    n = A.shape[1]
    _shape(op, "dt", dt, (b, l, d), "[batch, length, channels] like x")
    _shape(op, "B", B, (b, l, n), "[batch, length, state]")
    _shape(op, "C", C, (b, l, n), "[batch, length, state]")
    _shape(op, "D", D, (d,), "[channels]")
    _shape(op, "z", z, (b, l, d), "[batch, length, channels] like x")
    _shape(op, "dt_bias", dt_bias, (d,), "[channels]")
    _shape(op, "initial_state", initial_state, (b, d, n), "[batch, channels, state]")
    return cls(b, l, d, n, jnp.dtype(x.dtype).name, chunk_size, interpret)


@dataclasses.dataclass(frozen=True)
class SSDCall:
  """A Mamba-2 SSD scan: x ``[batch, length, heads, head_dim]``, B/C ``[batch, length, groups,
  state]``; head ``h`` reads group ``h // (heads // groups)``."""

  batch: int
  length: int
  heads: int
  head_dim: int
  groups: int
  state: int
  dtype: str
  chunk_size: int | None = None
  interpret: bool = False

  def __post_init__(self):
    _dims(self, ("batch", "length", "heads", "head_dim", "groups", "state"))
    if self.heads % self.groups:
      raise ValueError(f"SSDCall: groups ({self.groups}) must divide heads ({self.heads})")
    _chunk(self)

  @property
  def state_shape(self) -> tuple[int, ...]:
    """The scan state: ``[batch, heads, head_dim, state]``."""
    return (self.batch, self.heads, self.head_dim, self.state)

  @classmethod
  def of(cls, x, dt, A, B, C, D=None, *, z=None, dt_bias=None, initial_state=None,
         chunk_size=None, interpret=False) -> "SSDCall":
    op = "ssd_scan"
    _rank(op, "x", x, 4, "[batch, length, heads, head_dim]")
    b, l, h, p = x.shape
    _rank(op, "B", B, 4, "[batch, length, groups, state]")
    g, n = B.shape[2:]
    if tuple(B.shape[:2]) != (b, l) or h % g:
      raise ValueError(f"{op}: B must have shape [batch, length, groups, state] with (batch, length) "
                       f"= {(b, l)} and groups dividing heads = {h}, got {tuple(B.shape)}")
    _shape(op, "C", C, (b, l, g, n), "[batch, length, groups, state] like B")
    _shape(op, "dt", dt, (b, l, h), "[batch, length, heads]")
    _shape(op, "A", A, (h,), "[heads]")
    _shape(op, "D", D, (h,), "[heads]")
    _shape(op, "z", z, (b, l, h, p), "[batch, length, heads, head_dim] like x")
    _shape(op, "dt_bias", dt_bias, (h,), "[heads]")
    _shape(op, "initial_state", initial_state, (b, h, p, n), "[batch, heads, head_dim, state]")
    return cls(b, l, h, p, g, n, jnp.dtype(x.dtype).name, chunk_size, interpret)


@dataclasses.dataclass(frozen=True)
class RLACall:
  """The linear branch of residual linear attention: q ``[batch, length, heads, head_dim]``,
  k ``[batch, length, kv_heads, head_dim]``, v ``[batch, length, kv_heads, v_head_dim]``."""

  batch: int
  length: int
  heads: int
  kv_heads: int
  head_dim: int
  v_head_dim: int
  window_size: int
  feature_map: str
  dtype: str
  chunk_size: int | None = None
  interpret: bool = False

  def __post_init__(self):
    _dims(self, ("batch", "length", "heads", "kv_heads", "head_dim", "v_head_dim"))
    w = self.window_size
    if not _int_at_least(w, 0):
      raise ValueError(f"window_size must be an int >= 0, got {w!r}")
    if self.heads % self.kv_heads:
      raise ValueError(f"kv_heads ({self.kv_heads}) must divide heads ({self.heads})")
    if self.feature_map not in FEATURE_MAPS:
      raise ValueError(f"feature_map must be one of {FEATURE_MAPS}, got {self.feature_map!r}")
    _chunk(self)

  @property
  def features(self) -> int:
    """Width of the feature map: ``2 * head_dim`` for softmax ([softmax(x), softmax(-x)])."""
    return 2 * self.head_dim if self.feature_map == "softmax" else self.head_dim

  @property
  def state_shape(self) -> tuple[int, ...]:
    """The scan state: ``[batch, kv_heads, features, v_head_dim]``."""
    return (self.batch, self.kv_heads, self.features, self.v_head_dim)

  @classmethod
  def of(cls, q, k, v, *, window_size, feature_map="softmax", initial_state=None,
         chunk_size=None, interpret=False) -> "RLACall":
    op = "residual_linear_attention"
    _rank(op, "q", q, 4, "[batch, length, heads, head_dim]")
    _rank(op, "k", k, 4, "[batch, length, kv_heads, head_dim]")
    _rank(op, "v", v, 4, "[batch, length, kv_heads, v_head_dim]")
    b, l, h, d = q.shape
    hk = k.shape[2]
    if tuple(k.shape) != (b, l, hk, d) or h % hk:
      raise ValueError(f"{op}: k must have shape [batch, length, kv_heads, head_dim] with (batch, "
                       f"length, head_dim) = {(b, l, d)} like q and kv_heads dividing heads = {h}, "
                       f"got {tuple(k.shape)}")
    if tuple(v.shape[:3]) != (b, l, hk):
      raise ValueError(f"{op}: v must have shape [batch, length, kv_heads, v_head_dim] with (batch, "
                       f"length, kv_heads) = {(b, l, hk)} like k, got {tuple(v.shape)}")
    call = cls(b, l, h, hk, d, v.shape[3], window_size, feature_map, jnp.dtype(q.dtype).name,
               chunk_size, interpret)
    _shape(op, "initial_state", initial_state, call.state_shape,
           "[batch, kv_heads, features, v_head_dim]")
    return call
