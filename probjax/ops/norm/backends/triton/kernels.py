"""Pallas-Triton row kernels: one program per block of rows, the whole (power-of-two padded,
masked) width ``d`` in registers. The forward stores ``y``, ``h = x + residual`` and the rows'
mean and inverse deviation (float32); the backward stores ``dh`` and the per-element
``dy * xhat`` whose sums over rows (``dscale``, in XLA, in a fixed order) are deterministic."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

NUM_WARPS = 4
# Elements a program holds per operand: rows per block = this / the padded width.
BLOCK_ELEMENTS = 4096


def block(n: int) -> int:
  """The power of two covering ``n``."""
  return 1 << (int(n) - 1).bit_length()


def _rows(n_rows, d):
  bd = block(d)
  return bd, max(1, min(BLOCK_ELEMENTS // bd, block(n_rows)))


def _io(ref, br, bd, n_rows, d, per_row=True):
  """``(load, store)`` of this program's ``[br, bd]`` block of ``ref`` (``[rows, d]``, or
  ``[1, d]`` read by every program when ``per_row`` is False), masked at the edges."""
  pid = pl.program_id(0)
  r0 = pid * br if per_row else pid * 0
  br = br if per_row else 1
  rows = r0 + jax.lax.broadcasted_iota(jnp.int32, (br, bd), 0)
  cols = jax.lax.broadcasted_iota(jnp.int32, (br, bd), 1)
  mask = (rows < (n_rows if per_row else 1)) & (cols < d)
  # A start computed at run time: JAX rejects a static window running past the axis's end.
  window = ref.at[pl.ds(r0, br), pl.ds(pid * 0, bd)]
  load = lambda: plgpu.load(window, mask=mask, other=0).astype(jnp.float32)
  store = lambda v: plgpu.store(window, v.astype(ref.dtype), mask=mask)
  return load, store, mask


def _stat_io(ref, br, n_rows):
  pid = pl.program_id(0)
  rows = pid * br + jax.lax.broadcasted_iota(jnp.int32, (br,), 0)
  window = ref.at[pl.ds(pid * br, br)]
  return (lambda: plgpu.load(window, mask=rows < n_rows, other=0),
          lambda v: plgpu.store(window, v, mask=rows < n_rows))


def _forward_kernel(*refs, kind, eps, residual, mul, add, per_row, n_rows, d, br, bd):
  refs = list(refs)
  x_ref = refs.pop(0)
  r_ref = refs.pop(0) if residual else None
  m_ref = refs.pop(0) if mul else None
  a_ref = refs.pop(0) if add else None
  y_ref, h_ref, mu_ref, rstd_ref = refs
  load_x, _, mask = _io(x_ref, br, bd, n_rows, d)
  h = load_x()
  if residual:
    h = h + _io(r_ref, br, bd, n_rows, d)[0]()
    # h is returned in x's dtype and the norm reads that rounded value, as the unfused form.
    h = h.astype(h_ref.dtype).astype(jnp.float32)
  _io(h_ref, br, bd, n_rows, d)[1](h)
  mu = jnp.sum(h, axis=1) / d if kind == "layer" else jnp.zeros((br,), jnp.float32)
  c = jnp.where(mask, h - mu[:, None], 0.0)
  rstd = jax.lax.rsqrt(jnp.sum(c * c, axis=1) / d + eps)
  y = c * rstd[:, None]
  if mul:
    y = y * _io(m_ref, br, bd, n_rows, d, per_row)[0]()
  if add:
    y = y + _io(a_ref, br, bd, n_rows, d, per_row)[0]()
  _io(y_ref, br, bd, n_rows, d)[1](y)
  _stat_io(mu_ref, br, n_rows)[1](mu)
  _stat_io(rstd_ref, br, n_rows)[1](rstd)


def forward(x, residual, mul, add, *, kind, eps, interpret):
  """``(y, h, mean, rstd)``: ``x``/``residual`` ``[rows, d]``, ``mul``/``add`` ``[1, d]`` or
  ``[rows, d]`` (or None); ``y``/``h`` in x's dtype, ``mean``/``rstd`` ``[rows]`` float32."""
  n_rows, d = x.shape
  bd, br = _rows(n_rows, d)
  per_row = (mul if mul is not None else add) is not None and (mul if mul is not None else add).shape[0] > 1
  ops = [a for a in (x, residual, mul, add) if a is not None]
  f32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.float32)
  kernel = functools.partial(_forward_kernel, kind=kind, eps=eps, residual=residual is not None,
                             mul=mul is not None, add=add is not None, per_row=per_row, n_rows=n_rows, d=d,
                             br=br, bd=bd)
  return pl.pallas_call(
      kernel, grid=(pl.cdiv(n_rows, br),), compiler_params=plgpu.CompilerParams(num_warps=NUM_WARPS),
      out_shape=(jax.ShapeDtypeStruct(x.shape, x.dtype), jax.ShapeDtypeStruct(x.shape, x.dtype),
                 f32(n_rows), f32(n_rows)),
      interpret=interpret, name="probjax_norm_fwd")(*ops)


def _backward_kernel(*refs, kind, mul, per_row, dh_in, n_rows, d, br, bd):
  refs = list(refs)
  h_ref, mu_ref, rstd_ref, g_ref = refs[:4]
  refs = refs[4:]
  m_ref = refs.pop(0) if mul else None
  gh_ref = refs.pop(0) if dh_in else None
  dh_ref, gx_ref = refs
  _, _, mask = _io(h_ref, br, bd, n_rows, d)
  h = _io(h_ref, br, bd, n_rows, d)[0]()
  mu = _stat_io(mu_ref, br, n_rows)[0]()
  rstd = _stat_io(rstd_ref, br, n_rows)[0]()
  xhat = jnp.where(mask, (h - mu[:, None]) * rstd[:, None], 0.0)
  g = _io(g_ref, br, bd, n_rows, d)[0]()
  dxhat = g * _io(m_ref, br, bd, n_rows, d, per_row)[0]() if mul else g
  proj = jnp.sum(dxhat * xhat, axis=1, keepdims=True) / d
  dh = dxhat - xhat * proj
  if kind == "layer":
    dh = dh - jnp.sum(dxhat, axis=1, keepdims=True) / d
  dh = jnp.where(mask, dh * rstd[:, None], 0.0)
  if dh_in:
    dh = dh + _io(gh_ref, br, bd, n_rows, d)[0]()
  _io(dh_ref, br, bd, n_rows, d)[1](dh)
  _io(gx_ref, br, bd, n_rows, d)[1](g * xhat)


def backward(h, mean, rstd, dy, mul, dh, *, kind, interpret):
  """``(dh [rows, d] float32, dy * xhat [rows, d] float32)`` for the cotangents ``dy`` of ``y``
  and ``dh`` (or None) of ``h``, from the forward's ``h``, ``mean`` and ``rstd``."""
  n_rows, d = h.shape
  bd, br = _rows(n_rows, d)
  per_row = mul is not None and mul.shape[0] > 1
  ops = [a for a in (h, mean, rstd, dy, mul, dh) if a is not None]
  f32 = jax.ShapeDtypeStruct(h.shape, jnp.float32)
  kernel = functools.partial(_backward_kernel, kind=kind, mul=mul is not None, per_row=per_row,
                             dh_in=dh is not None, n_rows=n_rows, d=d, br=br, bd=bd)
  return pl.pallas_call(
      kernel, grid=(pl.cdiv(n_rows, br),), compiler_params=plgpu.CompilerParams(num_warps=NUM_WARPS),
      out_shape=(f32, f32), interpret=interpret, name="probjax_norm_bwd")(*ops)


# -- attention's q/k RMS norm + RoPE ---------------------------------------------------------
# A row is one (batch, seq, head)'s head_dim features; with the rotation it is read as its two
# halves (rotate-half pairs feature i with i + head_dim / 2), each a masked power-of-two block.


def _qk_layout(n_rows, d, rotary):
  w = d // 2 if rotary else d
  bw = block(w)
  return w, bw, max(1, min(BLOCK_ELEMENTS // (2 * bw if rotary else bw), block(n_rows)))


def _qk_parts(ref, br, bw, n_rows, w, rotary):
  """``[(load, store)]``: one per half (two with the rotation, else the whole row)."""
  pid = pl.program_id(0)
  rows = pid * br + jax.lax.broadcasted_iota(jnp.int32, (br, bw), 0)
  cols = jax.lax.broadcasted_iota(jnp.int32, (br, bw), 1)
  mask = (rows < n_rows) & (cols < w)
  parts = []
  for start in ((0, w) if rotary else (0,)):
    window = ref.at[pl.ds(pid * br, br), pl.ds(pid * 0 + start, bw)]
    parts.append((functools.partial(lambda win: plgpu.load(win, mask=mask, other=0).astype(jnp.float32), window),
                  functools.partial(lambda win, v: plgpu.store(win, v.astype(ref.dtype), mask=mask), window)))
  return parts, mask


def _qk_vector(ref, bw, w, rotary):
  """The ``[1, d]`` vector's halves (or whole), ``[1, bw]`` float32 each."""
  cols = jax.lax.broadcasted_iota(jnp.int32, (1, bw), 1)
  pid = pl.program_id(0)
  return [plgpu.load(ref.at[pl.ds(pid * 0, 1), pl.ds(pid * 0 + s, bw)], mask=cols < w, other=0).astype(jnp.float32)
          for s in ((0, w) if rotary else (0,))]


def _qk_trig(pos_ref, f_ref, br, bw, n_rows, w):
  pid = pl.program_id(0)
  rows = pid * br + jax.lax.broadcasted_iota(jnp.int32, (br,), 0)
  pos = plgpu.load(pos_ref.at[pl.ds(pid * br, br)], mask=rows < n_rows, other=0)
  cols = jax.lax.broadcasted_iota(jnp.int32, (1, bw), 1)
  freq = plgpu.load(f_ref.at[pl.ds(pid * 0, 1), pl.ds(pid * 0, bw)], mask=cols < w, other=0)
  angles = pos[:, None] * freq
  return jnp.cos(angles), jnp.sin(angles)


def _qk_rstd(parts, d, eps):
  """``[br, 1]``: the rows' inverse RMS over their ``d`` features, held as ``parts`` (halves)."""
  return jax.lax.rsqrt(sum(jnp.sum(v * v, axis=1, keepdims=True) for v in parts) / d + eps)


def _qk_forward_kernel(*refs, norm, rotary, eps, n_rows, d, w, br, bw):
  refs = list(refs)
  x_ref = refs.pop(0)
  s_ref = refs.pop(0) if norm else None
  pos_ref, f_ref = (refs.pop(0), refs.pop(0)) if rotary else (None, None)
  (y_ref,) = refs
  parts, _ = _qk_parts(x_ref, br, bw, n_rows, w, rotary)
  xs = [load() for load, _ in parts]
  if norm:
    rstd = _qk_rstd(xs, d, eps)
    xs = [v * (rstd * g) for v, g in zip(xs, _qk_vector(s_ref, bw, w, rotary))]
  if rotary:
    cos, sin = _qk_trig(pos_ref, f_ref, br, bw, n_rows, w)
    xs = [xs[0] * cos - xs[1] * sin, xs[1] * cos + xs[0] * sin]
  for (_, store), v in zip(_qk_parts(y_ref, br, bw, n_rows, w, rotary)[0], xs):
    store(v)


def qk_forward(x, scale, pos, freq, *, eps, interpret):
  """``y [rows, d]`` in x's dtype: ``x [rows, d]``, ``scale [1, d]`` (or None), ``pos [rows]``
  float32 and ``freq [1, d // 2]`` float32 (both None without the rotation)."""
  n_rows, d = x.shape
  rotary = pos is not None
  w, bw, br = _qk_layout(n_rows, d, rotary)
  kernel = functools.partial(_qk_forward_kernel, norm=scale is not None, rotary=rotary, eps=eps, n_rows=n_rows, d=d,
                             w=w, br=br, bw=bw)
  ops = [a for a in (x, scale, pos, freq) if a is not None]
  return pl.pallas_call(
      kernel, grid=(pl.cdiv(n_rows, br),), compiler_params=plgpu.CompilerParams(num_warps=NUM_WARPS),
      out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), interpret=interpret, name="probjax_qk_norm_rotary_fwd")(*ops)


def _qk_backward_kernel(*refs, norm, rotary, eps, n_rows, d, w, br, bw):
  refs = list(refs)
  x_ref, g_ref = refs.pop(0), refs.pop(0)
  s_ref = refs.pop(0) if norm else None
  pos_ref, f_ref = (refs.pop(0), refs.pop(0)) if rotary else (None, None)
  dx_ref = refs.pop(0)
  ds_ref = refs.pop(0) if norm else None
  dys = [load() for load, _ in _qk_parts(g_ref, br, bw, n_rows, w, rotary)[0]]
  if rotary:  # the rotation's transpose
    cos, sin = _qk_trig(pos_ref, f_ref, br, bw, n_rows, w)
    dys = [dys[0] * cos + dys[1] * sin, dys[1] * cos - dys[0] * sin]
  if norm:
    xs = [load() for load, _ in _qk_parts(x_ref, br, bw, n_rows, w, rotary)[0]]
    rstd = _qk_rstd(xs, d, eps)
    gs = _qk_vector(s_ref, bw, w, rotary)
    dn = [g * dy for g, dy in zip(gs, dys)]
    proj = sum(jnp.sum(a * v, axis=1, keepdims=True) for a, v in zip(dn, xs)) / d
    # This program's rows' share of dscale, one [1, d] row per program (summed in XLA).
    pid = pl.program_id(0)
    cols = jax.lax.broadcasted_iota(jnp.int32, (1, bw), 1)
    for s, u, v in zip((0, w) if rotary else (0,), dys, xs):
      plgpu.store(ds_ref.at[pl.ds(pid, 1), pl.ds(pid * 0 + s, bw)], jnp.sum(u * v * rstd, axis=0, keepdims=True),
                  mask=cols < w)
    dys = [rstd * a - v * (rstd * rstd * rstd) * proj for a, v in zip(dn, xs)]
  for (_, store), v in zip(_qk_parts(dx_ref, br, bw, n_rows, w, rotary)[0], dys):
    store(v)


def qk_backward(x, dy, scale, pos, freq, *, eps, interpret):
  """``(dx [rows, d] in x's dtype, dscale partials [programs, d] float32 or None)``, the forward
  recomputed from ``x``."""
  n_rows, d = x.shape
  rotary = pos is not None
  w, bw, br = _qk_layout(n_rows, d, rotary)
  grid = pl.cdiv(n_rows, br)
  kernel = functools.partial(_qk_backward_kernel, norm=scale is not None, rotary=rotary, eps=eps, n_rows=n_rows,
                             d=d, w=w, br=br, bw=bw)
  ops = [a for a in (x, dy, scale, pos, freq) if a is not None]
  out = [jax.ShapeDtypeStruct(x.shape, x.dtype)]
  if scale is not None:
    out.append(jax.ShapeDtypeStruct((grid, d), jnp.float32))
  res = pl.pallas_call(
      kernel, grid=(grid,), compiler_params=plgpu.CompilerParams(num_warps=NUM_WARPS), out_shape=tuple(out),
      interpret=interpret, name="probjax_qk_norm_rotary_bwd")(*ops)
  return (res[0], res[1]) if scale is not None else (res[0], None)
