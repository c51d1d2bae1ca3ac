"""Mamba blocks (Flax NNX): :class:`Mamba` (Mamba-1, the selective scan) and :class:`Mamba2`
(the SSD scan), on ``[batch, length, d_model]``.

Decoding carries a state pytree (:class:`MambaState`): the causal convolution's last
``d_conv - 1`` inputs and the scan's state. ``__call__(x, state, return_state=True)`` runs a
whole segment from a state (prefill, or a continuation); :meth:`Mamba.step` runs one token by
the recurrence itself. Both equal the full pass over the concatenated sequence.

>>> import jax.numpy as jnp
>>> from flax import nnx
>>> m = Mamba(d_model=16, d_state=4, rngs=nnx.Rngs(0))
>>> y1, state = m.step(jnp.ones((2, 16)), m.init_state(2))
>>> y1.shape, state.ssm.shape
((2, 16), (2, 32, 4))

mamba_ssm's spellings are accepted too: ``d_model`` positionally, ``dt_rank="auto"``, and

| mamba_ssm | probjax | notes |
| --- | --- | --- |
| ``bias`` | ``use_bias`` | both blocks |
| ``headdim`` | ``head_dim`` | :class:`Mamba2` |
| ``ngroups`` | ``n_groups`` | :class:`Mamba2` |
| ``dt_rank="auto"`` | ``dt_rank=None`` (``"auto"`` accepted) | :class:`Mamba`: ``ceil(d_model / 16)`` |
| ``use_fast_path``, ``use_mem_eff_path``, ``layer_idx``, ``device``, ``sequence_parallel`` | ignored | ``implementation`` picks the scan; decoding state is passed explicitly |
| ``rmsnorm=True``, ``norm_before_gate=False``, ``D_has_hdim=False``, ``d_ssm=None``, ``conv_init=None``, ``dt_limit=(0.0, inf)``, ``process_group=None`` | the only variant | :class:`Mamba2`; other values raise ValueError naming the argument |

The other names (``d_state``, ``d_conv``, ``expand``, ``dt_min``, ``dt_max``,
``dt_init_floor``, ``conv_bias``, ``A_init_range``, ``chunk_size``) are the same in both.
``dtype`` keeps probjax's meaning, the compute dtype (mamba_ssm's ``dtype`` is the parameters':
``param_dtype`` here). Giving both spellings of one argument raises TypeError naming both.

>>> m2 = Mamba2(16, d_state=8, headdim=8, ngroups=2, bias=False, rngs=nnx.Rngs(0))
>>> m2.head_dim, m2.n_groups
(8, 2)
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from probjax.nn.layers._checks import check_array, check_instance
from probjax.nn.layers import _sharding as shd
from probjax.ops.scan import mamba_scan, ssd_scan

__all__ = ["Mamba", "Mamba2", "MambaState"]


@dataclasses.dataclass(frozen=True)
class MambaState:
  """conv ``[batch, d_conv - 1, conv_channels]``: the convolution's last inputs (oldest first);
  ssm: the scan's state (``[batch, d_inner, d_state]`` for Mamba-1, ``[batch, heads, head_dim,
  d_state]`` for Mamba-2), float32."""

  conv: Any
  ssm: Any


jax.tree_util.register_dataclass(MambaState, data_fields=["conv", "ssm"], meta_fields=[])


def _positive(**kw):
  for name, v in kw.items():
    if not isinstance(v, int) or v < 1:
      raise ValueError(f"{name} must be an int >= 1, got {v!r}")


# mamba_ssm's spellings: alias -> probjax name; accepted and ignored; accepted at one value only.
_ALIASES = {"Mamba": {"bias": "use_bias"},
            "Mamba2": {"bias": "use_bias", "headdim": "head_dim", "ngroups": "n_groups"}}
_IGNORED = ("use_fast_path", "use_mem_eff_path", "layer_idx", "device", "sequence_parallel")
_FIXED = {"Mamba": {},
          "Mamba2": {"rmsnorm": True, "norm_before_gate": False, "D_has_hdim": False, "d_ssm": None,
                     "conv_init": None, "dt_limit": (0.0, float("inf")), "process_group": None}}


def _mamba_ssm_kwargs(cls: str, given: dict, extra: dict) -> dict:
  """The probjax arguments that mamba_ssm spellings in ``extra`` stand for (``given``: the
  probjax arguments as passed, None where not). TypeError for an unknown name or an argument
  given under both spellings; ValueError for a mamba_ssm variant probjax does not implement."""
  out = {}
  for name, value in extra.items():
    if name in _ALIASES[cls]:
      target = _ALIASES[cls][name]
      if given[target] is not None:
        raise TypeError(f"{cls}() got both {target}={given[target]!r} and its mamba_ssm spelling "
                        f"{name}={value!r}; pass one of them")
      out[target] = value
    elif name in _FIXED[cls]:
      if value != _FIXED[cls][name]:
        raise ValueError(f"{name}={value!r} is not implemented: {cls} supports mamba_ssm's "
                         f"{name}={_FIXED[cls][name]!r} only")
    elif name not in _IGNORED:
      raise TypeError(f"{cls}() got an unexpected keyword argument {name!r}")
  return out


def _dt_bias(rngs, n, dt_min, dt_max, dt_init_floor):
  """Mamba's dt initialisation: ``softplus(dt_bias)`` log-uniform in ``[dt_min, dt_max]``."""
  if not 0 < dt_min <= dt_max:
    raise ValueError(f"need 0 < dt_min <= dt_max, got dt_min={dt_min}, dt_max={dt_max}")
  u = jax.random.uniform(rngs.params(), (n,))
  dt = jnp.maximum(jnp.exp(u * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min)), dt_init_floor)
  return dt + jnp.log(-jnp.expm1(-dt))  # the inverse of softplus


class _Conv(nnx.Module):
  """Causal depthwise convolution over the sequence, ``d_conv`` taps per channel."""

  def __init__(self, channels, d_conv, use_bias, param_dtype, rngs):
    bound = 1.0 / math.sqrt(d_conv)
    self.weight = nnx.Param(jax.random.uniform(rngs.params(), (d_conv, channels), param_dtype, -bound, bound),
                            **shd.names(None, "inner"))
    self.bias = nnx.Param(jnp.zeros((channels,), param_dtype), **shd.names("inner")) if use_bias else None
    self.d_conv = d_conv

  def __call__(self, x, history):
    """``x [b, L, c]`` after ``history [b, d_conv - 1, c]``; returns ``(y [b, L, c], the new
    history)``."""
    full = jnp.concatenate([history.astype(x.dtype), x], axis=1)
    w = self.weight[...].astype(x.dtype)
    length = x.shape[1]
    y = sum(full[:, k:k + length] * w[k] for k in range(self.d_conv))
    if self.bias is not None:
      y = y + self.bias[...].astype(x.dtype)
    return y, full[:, length:]


class _Block(nnx.Module):
  """What the two blocks share: projections, convolution, dt/A/D parameters, decoding state."""

  def _setup(self, *, d_model, d_inner, conv_channels, in_features, d_conv, use_bias, conv_bias,
             dt_shape, per_axis, dt_min, dt_max, dt_init_floor, dtype, param_dtype, rngs):
    _positive(d_model=d_model, d_conv=d_conv)
    self.d_model, self.d_inner, self.d_conv = d_model, d_inner, d_conv
    self.dtype, self.param_dtype = dtype, param_dtype
    kw = dict(use_bias=use_bias, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    self.in_proj = nnx.Linear(d_model, in_features, **kw, **shd.linear("embed", "inner"))
    self.conv = _Conv(conv_channels, d_conv, conv_bias, param_dtype, rngs)
    self.out_proj = nnx.Linear(d_inner, d_model, **kw, **shd.linear("inner", "embed"))
    per = shd.names(per_axis)
    self.dt_bias = nnx.Param(_dt_bias(rngs, dt_shape, dt_min, dt_max, dt_init_floor).astype(param_dtype), **per)
    self.D = nnx.Param(jnp.ones((dt_shape,), param_dtype), **per)

  def _history(self, x, state):
    if state is None:
      return jnp.zeros((x.shape[0], self.d_conv - 1, x.shape[-1]), x.dtype)
    return state.conv

  def A(self):
    """The negative decay rates, ``-exp(A_log)``."""
    return -jnp.exp(self.A_log[...].astype(jnp.float32))

  def _check(self, x, state, dims):
    """Static checks of ``x`` (floating, ``dims``) and ``state`` (None or a :class:`MambaState`
    of :meth:`init_state`'s shapes for x's batch), naming the argument."""
    s = check_array("x", x, dims)
    if state is None:
      return
    check_instance("state", state, MambaState, "a MambaState (from init_state or a previous call)")
    conv = ("batch", ("d_conv - 1", self.d_conv - 1), ("conv_channels", self.conv.weight.shape[1]))
    check_array("state.conv", state.conv, conv, sizes=s)
    check_array("state.ssm", state.ssm, ("batch", *self._ssm_dims()), sizes=s)

  def __call__(self, x, state: MambaState | None = None, *, return_state: bool = False):
    """``x [batch, length, d_model]`` after ``state`` (default: the start); returns y like x
    (and the state after it). Wrong shapes raise ValueError, wrong dtypes or types TypeError,
    naming ``x`` or ``state``."""
    self._check(x, state, ("batch", "length", ("d_model", self.d_model)))
    y, state = self._forward(x, state, recurrent=False)
    return (y, state) if return_state else y

  def step(self, x, state: MambaState):
    """One token ``x [batch, d_model]`` after ``state``, by the recurrence: ``(y [batch,
    d_model], state)``."""
    if state is None:
      raise TypeError("state must be a MambaState (from init_state or a previous call), got None")
    self._check(x, state, ("batch", ("d_model", self.d_model)))
    y, state = self._forward(x[:, None], state, recurrent=True)
    return y[:, 0], state


class Mamba(_Block):
  """The Mamba-1 block: in-projection to x and z, causal depthwise convolution and SiLU,
  x-projection to (dt, B, C), dt-projection, the selective scan (``A = -exp(A_log)``, skip D,
  gate SiLU(z)), out-projection.

  Args:
    d_model: features in and out (keyword, or the one positional argument as in mamba_ssm);
      ``d_inner = expand * d_model`` channels are scanned.
    d_state: state per channel.
    d_conv: convolution taps.
    expand: ``d_inner / d_model``.
    dt_rank: rank of dt's projection; None or "auto" (mamba_ssm's spelling): ``ceil(d_model
      / 16)``.
    dt_min: low end of the initial ``softplus(dt_bias)`` range.
    dt_max: high end of that range.
    dt_init_floor: the initial ``softplus(dt_bias)``'s floor.
    use_bias: biases of the in- and out-projections (None: False; mamba_ssm: ``bias``).
    conv_bias: the convolution's bias.
    implementation: passed to :func:`probjax.ops.scan.mamba_scan`.
    chunk_size: passed to :func:`probjax.ops.scan.mamba_scan`.
    dtype: compute dtype (None: from the inputs and params).
    param_dtype: parameter dtype.
    rngs: the parameters' random streams.
    **mamba_ssm: mamba_ssm's spellings (see the module docstring's table).

  >>> from flax import nnx
  >>> Mamba(32, dt_rank="auto", bias=False, use_fast_path=True, rngs=nnx.Rngs(0)).dt_rank
  2
  """

  def __init__(self, d_model: int | None = None, *, d_state: int = 16, d_conv: int = 4, expand: int = 2,
               dt_rank: int | str | None = None, dt_min: float = 0.001, dt_max: float = 0.1,
               dt_init_floor: float = 1e-4, use_bias: bool | None = None, conv_bias: bool = True,
               implementation: str | None = None, chunk_size: int | None = None, dtype=None,
               param_dtype=jnp.float32, rngs: nnx.Rngs, **mamba_ssm):
    if d_model is None:
      raise TypeError("Mamba() missing the argument d_model")
    use_bias = _mamba_ssm_kwargs("Mamba", dict(use_bias=use_bias), mamba_ssm).get("use_bias", use_bias)
    use_bias = bool(use_bias)
    _positive(d_model=d_model, d_state=d_state, expand=expand)
    d_inner = expand * d_model
    if isinstance(dt_rank, str) and dt_rank != "auto":
      raise ValueError(f"dt_rank must be an int >= 1, None or \"auto\", got {dt_rank!r}")
    self.dt_rank = math.ceil(d_model / 16) if dt_rank in (None, "auto") else dt_rank
    _positive(dt_rank=self.dt_rank)
    self.d_state, self.implementation, self.chunk_size = d_state, implementation, chunk_size
    self._setup(d_model=d_model, d_inner=d_inner, conv_channels=d_inner, in_features=2 * d_inner,
                d_conv=d_conv, use_bias=use_bias, conv_bias=conv_bias, dt_shape=d_inner, per_axis="inner",
                dt_min=dt_min, dt_max=dt_max, dt_init_floor=dt_init_floor, dtype=dtype,
                param_dtype=param_dtype, rngs=rngs)
    kw = dict(use_bias=False, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    self.x_proj = nnx.Linear(d_inner, self.dt_rank + 2 * d_state, **kw, **shd.linear("inner", None))
    # its bias is dt_bias, added by the scan
    self.dt_proj = nnx.Linear(self.dt_rank, d_inner, **kw, **shd.linear(None, "inner"))
    a = jnp.broadcast_to(jnp.arange(1, d_state + 1, dtype=jnp.float32), (d_inner, d_state))
    self.A_log = nnx.Param(jnp.log(a).astype(param_dtype), **shd.names("inner", None))

  def init_state(self, batch: int, dtype=None) -> MambaState:
    """The state before the first token: zeros."""
    dtype = dtype or self.dtype or self.param_dtype
    return MambaState(jnp.zeros((batch, self.d_conv - 1, self.d_inner), dtype),
                      jnp.zeros((batch, self.d_inner, self.d_state), jnp.float32))

  def _ssm_dims(self):
    return ("d_inner", self.d_inner), ("d_state", self.d_state)

  def _forward(self, x, state, recurrent):
    xs, z = jnp.split(self.in_proj(x), 2, axis=-1)
    xs, history = self.conv(xs, self._history(xs, state))
    xs = jax.nn.silu(xs)
    dt, B, C = jnp.split(self.x_proj(xs), [self.dt_rank, self.dt_rank + self.d_state], axis=-1)
    dt = self.dt_proj(dt)
    h0 = None if state is None else state.ssm
    if recurrent:
      y, h = _mamba_step(xs[:, 0], dt[:, 0], self.A(), B[:, 0], C[:, 0], self.D[...], z[:, 0],
                         self.dt_bias[...], h0)
      y = y[:, None]
    else:
      y, h = mamba_scan(xs, dt, self.A(), B, C, self.D[...], z=z, dt_bias=self.dt_bias[...],
                        initial_state=h0, return_final_state=True,
                        implementation=self.implementation, chunk_size=self.chunk_size)
    return self.out_proj(y), MambaState(history, h)


def _mamba_step(x, dt, A, B, C, D, z, dt_bias, h):
  """One step of the Mamba-1 recurrence: x, dt, z ``[b, d]``; B, C ``[b, n]``; h ``[b, d, n]``."""
  f32 = lambda t: t.astype(jnp.float32)
  dt = jax.nn.softplus(f32(dt) + f32(dt_bias))
  h = jnp.exp(dt[..., None] * A) * h + (dt * f32(x))[..., None] * f32(B)[:, None, :]
  y = (jnp.einsum("bdn,bn->bd", h, f32(C)) + f32(D) * f32(x)) * jax.nn.silu(f32(z))
  return y.astype(x.dtype), h


class Mamba2(_Block):
  """The Mamba-2 block: one in-projection to (z, x, B, C, dt), causal depthwise convolution and
  SiLU over (x, B, C), the SSD scan (scalar ``A = -exp(A_log)`` per head, skip D), RMS-norm of
  ``y * SiLU(z)``, out-projection.

  Args:
    d_model: features in and out (keyword, or the one positional argument as in mamba_ssm);
      ``d_inner = expand * d_model`` in ``d_inner / head_dim`` heads.
    d_state: state per head and head_dim entry.
    d_conv: convolution taps.
    expand: ``d_inner / d_model``.
    head_dim: features per head (None: 64; mamba_ssm: ``headdim``).
    n_groups: B/C groups, dividing the heads (None: 1; mamba_ssm: ``ngroups``).
    A_init_range: ``exp(A_log)`` starts uniform in it.
    dt_min: low end of the initial ``softplus(dt_bias)`` range.
    dt_max: high end of that range.
    dt_init_floor: the initial ``softplus(dt_bias)``'s floor.
    use_bias: biases of the in- and out-projections (None: False; mamba_ssm: ``bias``).
    conv_bias: the convolution's bias.
    implementation: passed to :func:`probjax.ops.scan.ssd_scan`.
    chunk_size: passed to :func:`probjax.ops.scan.ssd_scan`.
    dtype: compute dtype (None: from the inputs and params).
    param_dtype: parameter dtype.
    rngs: the parameters' random streams.
    **mamba_ssm: mamba_ssm's spellings (see the module docstring's table).
  """

  def __init__(self, d_model: int | None = None, *, d_state: int = 128, d_conv: int = 4, expand: int = 2,
               head_dim: int | None = None, n_groups: int | None = None, A_init_range=(1.0, 16.0),
               dt_min: float = 0.001, dt_max: float = 0.1, dt_init_floor: float = 1e-4,
               use_bias: bool | None = None, conv_bias: bool = True, implementation: str | None = None,
               chunk_size: int | None = None, dtype=None, param_dtype=jnp.float32, rngs: nnx.Rngs,
               **mamba_ssm):
    given = dict(use_bias=use_bias, head_dim=head_dim, n_groups=n_groups)
    if d_model is None:
      raise TypeError("Mamba2() missing the argument d_model")
    given.update(_mamba_ssm_kwargs("Mamba2", given, mamba_ssm))
    use_bias = bool(given["use_bias"])
    head_dim = 64 if given["head_dim"] is None else given["head_dim"]
    n_groups = 1 if given["n_groups"] is None else given["n_groups"]
    _positive(d_model=d_model, d_state=d_state, expand=expand, head_dim=head_dim, n_groups=n_groups)
    d_inner = expand * d_model
    if d_inner % head_dim:
      raise ValueError(f"head_dim ({head_dim}) must divide d_inner = expand * d_model ({d_inner})")
    heads = d_inner // head_dim
    if heads % n_groups:
      raise ValueError(f"n_groups ({n_groups}) must divide the heads ({heads})")
    lo, hi = A_init_range
    if not 0 < lo <= hi:
      raise ValueError(f"A_init_range must satisfy 0 < low <= high, got {A_init_range}")
    self.heads, self.head_dim, self.n_groups, self.d_state = heads, head_dim, n_groups, d_state
    self.implementation, self.chunk_size = implementation, chunk_size
    conv_channels = d_inner + 2 * n_groups * d_state
    self._setup(d_model=d_model, d_inner=d_inner, conv_channels=conv_channels,
                in_features=d_inner + conv_channels + heads, d_conv=d_conv, use_bias=use_bias,
                conv_bias=conv_bias, dt_shape=heads, per_axis="heads", dt_min=dt_min, dt_max=dt_max,
                dt_init_floor=dt_init_floor, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    a = jax.random.uniform(rngs.params(), (heads,), jnp.float32, lo, hi)
    self.A_log = nnx.Param(jnp.log(a).astype(param_dtype), **shd.names("heads"))
    self.norm = nnx.RMSNorm(d_inner, dtype=dtype, param_dtype=param_dtype, rngs=rngs, **shd.norm("inner"))

  def init_state(self, batch: int, dtype=None) -> MambaState:
    """The state before the first token: zeros."""
    dtype = dtype or self.dtype or self.param_dtype
    conv = self.conv.weight.shape[1]
    return MambaState(jnp.zeros((batch, self.d_conv - 1, conv), dtype),
                      jnp.zeros((batch, self.heads, self.head_dim, self.d_state), jnp.float32))

  def _ssm_dims(self):
    return ("heads", self.heads), ("head_dim", self.head_dim), ("d_state", self.d_state)

  def _forward(self, x, state, recurrent):
    b, length = x.shape[:2]
    gn = self.n_groups * self.d_state
    z, xbc, dt = jnp.split(self.in_proj(x), [self.d_inner, 2 * self.d_inner + 2 * gn], axis=-1)
    xbc, history = self.conv(xbc, self._history(xbc, state))
    xs, B, C = jnp.split(jax.nn.silu(xbc), [self.d_inner, self.d_inner + gn], axis=-1)
    xs = xs.reshape(b, length, self.heads, self.head_dim)
    B = B.reshape(b, length, self.n_groups, self.d_state)
    C = C.reshape(b, length, self.n_groups, self.d_state)
    h0 = None if state is None else state.ssm
    if recurrent:
      y, h = _ssd_step(xs[:, 0], dt[:, 0], self.A(), B[:, 0], C[:, 0], self.D[...],
                       self.dt_bias[...], h0)
      y = y[:, None]
    else:
      y, h = ssd_scan(xs, dt, self.A(), B, C, self.D[...], dt_bias=self.dt_bias[...],
                      initial_state=h0, return_final_state=True,
                      implementation=self.implementation, chunk_size=self.chunk_size)
    y = self.norm(y.reshape(b, length, self.d_inner) * jax.nn.silu(z))
    return self.out_proj(y), MambaState(history, h)


def _ssd_step(x, dt, A, B, C, D, dt_bias, h):
  """One step of the SSD recurrence: x ``[b, H, P]``; dt ``[b, H]``; B, C ``[b, G, N]``; h
  ``[b, H, P, N]``."""
  f32 = lambda t: t.astype(jnp.float32)
  group = jnp.arange(x.shape[1]) // (x.shape[1] // B.shape[1])
  B, C = f32(B)[:, group], f32(C)[:, group]
  dt = jax.nn.softplus(f32(dt) + f32(dt_bias))
  h = jnp.exp(dt * A)[..., None, None] * h + (dt[..., None] * f32(x))[..., None] * B[:, :, None]
  y = jnp.einsum("bhpn,bhn->bhp", h, C) + f32(D)[:, None] * f32(x)
  return y.astype(x.dtype), h
