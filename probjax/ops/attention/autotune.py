"""Autotuning attention (opt-in): which backend a call runs, decided by measuring it.

With autotuning on (:func:`probjax.autotune`, ``PROBJAX_AUTOTUNE=1``) and no
``implementation=`` (nor kernel arguments) given, :func:`probjax.ops.attention.dispatch.explain_dispatch`
asks :func:`decide` before its rules. The call's key (:func:`key`: device kind, op, shapes,
dtype, mask, differentiated) is looked up in the cache (:mod:`probjax.core.autotune`); on a miss
on the device the call runs on, every candidate (:func:`candidates`: each registry backend that
is available and computes the call exactly, XLA's dense and flash formulations, and under grad
each backward pass the Triton and Mosaic forwards pair with) is timed on fresh random inputs of
the call's shapes, eagerly, even while the caller's function is being traced (the caller's arrays
are never touched), and the times are stored. The Decision then says
``measured: <candidate> fastest of <n> candidates (<ms> ms vs next <ms>)``, config
``autotuned=True``. A kernel's forward pairs with a kernel's backward: where the forward's
fastest is a kernel, the differentiated key is measured too and decides what ``jax.grad`` runs
(``Decision.grad``).

Calls with arguments the measurement cannot reproduce (bias, dense mask, dropout, precision,
``module``, ``score_mod``, a ``mask_mod``) and interpret mode are left to the rules, as are keys
missing from the cache on a device other than the one JAX runs on (``explain_dispatch(...,
device=...)`` of another GPU reads the cache only).

Pre-tuning, a cache to ship::

  python -m probjax.ops.attention.autotune --shapes shapes.json --out autotune.json

``shapes.json``: a list of ``{"q_shape": [b, t, h, d], "kv_shape": [b, s, hkv, d], "dtype":
"bfloat16", "mask": "causal", "differentiated": true}`` (``mask`` as :func:`mask_spec` writes
it; ``v_head_dim`` optional), e.g. what :func:`recording` collected while a model's jitted step
was traced.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import dataclasses
import functools
import json
import os
import sys
import warnings
from collections.abc import Iterator, Mapping
from typing import Any, Callable

import jax
import jax.numpy as jnp

from probjax.core import autotune as core
from probjax.core.device import Device
from probjax.core.dispatch import Decision
from probjax.ops.attention.call import AttentionCall
from probjax.ops.attention.masks import Mask
from probjax.ops.attention.registry import REGISTRY

OP = "attention"
# The mask predicates a measurement rebuilds with arrays of its own (full lengths, one segment).
MEASURABLE_MASK_KINDS = ("band", "q_lengths", "kv_lengths", "segments", "prefix_lm")
# Replaces core.time_candidates's timer (tests inject a fake one).
TIMER: Callable[..., dict] | None = None
# Threads that compile a measurement's candidates side by side (XLA compiles outside the GIL).
COMPILE_WORKERS = min(8, os.cpu_count() or 1)
# XLA's dense formulation is a candidate while its float32 scores take at most this (off GPUs,
# where dispatch knows the device memory, a quarter of it).
DENSE_CANDIDATE_MAX_BYTES = 1 << 30


# ---------------------------------------------------------------------------
# keys
# ---------------------------------------------------------------------------
def mask_spec(mask: Mask | None) -> str:
  """The mask as a key and the pre-tune file name it: its predicate kinds (``Mask.kinds``)
  joined by ``&``, the band by its bounds (``causal``, ``band:-128:0``), ``none`` for no mask."""
  if mask is None or not mask.kinds:
    return "none"
  parts = []
  for kind in mask.kinds:
    if kind == "band":
      lower, upper = mask.band_bounds
      parts.append("causal" if lower is None and upper == 0 else
                   f"band:{'' if lower is None else lower}:{'' if upper is None else upper}")
    else:
      parts.append(kind)
  return "&".join(parts)


def mask_from_spec(spec: str | None, batch: int, q_len: int, kv_len: int) -> Mask | None:
  """The mask :func:`mask_spec` names, its arrays those a measurement uses (every length full,
  one segment)."""
  if spec in (None, "", "none"):
    return None
  masks = []
  for part in spec.split("&"):
    kind, _, rest = part.partition(":")
    if kind == "causal":
      masks.append(Mask(upper=0))
    elif kind == "band":
      lower, _, upper = rest.partition(":")
      masks.append(Mask(lower=int(lower) if lower else None, upper=int(upper) if upper else None))
    elif kind == "q_lengths":
      masks.append(Mask(q_lengths=jnp.full((batch,), q_len, jnp.int32)))
    elif kind == "kv_lengths":
      masks.append(Mask(kv_lengths=jnp.full((batch,), kv_len, jnp.int32)))
    elif kind == "segments":
      masks.append(Mask(q_segment_ids=jnp.zeros((batch, q_len), jnp.int32),
                        kv_segment_ids=jnp.zeros((batch, kv_len), jnp.int32)))
    elif kind == "prefix_lm":
      masks.append(Mask(prefix_lengths=jnp.full((batch,), kv_len, jnp.int32)))
    else:
      raise ValueError(f"mask {spec!r}: {part!r} is not one of causal, band:<lower>:<upper>, "
                       f"{', '.join(MEASURABLE_MASK_KINDS[1:])}")
  return functools.reduce(lambda a, b: a & b, masks)


def key(call: AttentionCall, device: Device, differentiated: bool) -> str:
  """The cache key of ``call`` on ``device`` (:func:`probjax.core.autotune.make_key`)."""
  v_shape = call.kv_shape[:3] + (call.value_head_dim,)
  return core.make_key(OP, device.kind, (call.q_shape, call.kv_shape, v_shape), (call.dtype,),
                       mask_spec(call.mask), differentiated)


def measurable(call: AttentionCall, device: Device) -> str | None:
  """Why autotuning leaves ``call`` to the rules, or None."""
  if device.interpret:
    return "interpret mode"
  for present, what in ((call.bias, "additive bias"), (call.dense_mask, "dense boolean mask"),
                        (call.dropout, "dropout"), (call.precision is not None, "non-default precision"),
                        (call.module, "attention weights requested (module)"),
                        (call.score_mod is not None, "a score_mod")):
    if present:
      return what
  if call.mask is not None and (call.mask.refusal(MEASURABLE_MASK_KINDS, "autotuning") or call.mask.heads):
    return "a mask autotuning cannot rebuild"
  if call.split_kv is not None or not call.kernel_args_default:
    return "kernel arguments given"
  return None


# ---------------------------------------------------------------------------
# candidates and their measurement
# ---------------------------------------------------------------------------
def candidates(call: AttentionCall, device: Device, differentiated: bool) -> list[str]:
  """The exact candidates of ``call`` on ``device``: ``xla:dense`` (while its scores fit),
  ``xla:flash``, then each other backend that is available and supports the call, under grad
  once per backward pass it takes for the call (``triton:triton_fused``, ``mosaic:mosaic``, ...;
  not ``mosaic:mosaic`` at head_dim 192, whose widths that backward refuses)."""
  out = []
  for name in REGISTRY.names():
    backend = REGISTRY.get(name)
    if backend.available(device) is not None or backend.supports(call, device) is not None:
      continue
    if name == "xla":
      scores = call.batch * call.heads * call.q_len * call.kv_len * 16
      limit = DENSE_CANDIDATE_MAX_BYTES if device.memory_bytes is None else device.memory_bytes // 4
      out += (["xla:dense"] if scores <= limit else []) + ["xla:flash"]
    elif differentiated and backend.backward_pass_impls:
      # a backward the backend refuses for this call (the Mosaic backward past its widths) is no
      # candidate: timing it would only record its refusal
      out += [f"{name}:{b}" for b in backend.backward_pass_impls
              if b != "auto" and backend.supports(dataclasses.replace(call, backward_pass_impl=b), device) is None]
    else:
      out.append(name)
  return out


def _concrete_mask(mask: Mask | None, call: AttentionCall) -> Mask | None:
  """``mask`` with arrays of the same shapes that a measurement owns (every length full, one
  segment): the caller's arrays, maybe tracers, are only asked their shape."""
  if mask is None or not mask.has_arrays:
    return mask
  full = max(call.q_len, call.kv_len)
  arrays = [jnp.full(jnp.shape(a), full, jnp.int32) if role == "b" else jnp.zeros(jnp.shape(a), jnp.int32)
            for role, a in mask.arrays()]
  return mask.with_arrays(arrays).clamped(call.q_len, call.kv_len)


def _runner(name: str, call: AttentionCall, mask: Mask | None) -> Callable:
  impl, _, variant = name.partition(":")
  backend = REGISTRY.get(impl)
  if impl == "xla":
    return lambda q, k, v: backend(q, k, v, mask, call=call, formulation=variant or "auto")
  return lambda q, k, v: backend(q, k, v, mask, call=call, backward_pass_impl=variant or None)


def _timed(fn: Callable, differentiated: bool) -> Callable:
  if not differentiated:
    return jax.jit(fn)

  def forward_backward(q, k, v):
    out, vjp = jax.vjp(fn, q, k, v)
    return vjp(out)

  return jax.jit(forward_backward)


def measure(call: AttentionCall, names: list[str], differentiated: bool) -> tuple[dict, dict]:
  """``(ms, errors)`` of the candidates ``names`` (:func:`probjax.core.autotune.time_candidates`)
  on random inputs of the call's shapes; forward, or forward and backward (``jax.vjp``) where
  ``differentiated``. Runs eagerly, also inside a trace: in a thread of its own (JAX's trace
  state is per thread), so that each candidate is compiled and run as a program. Evaluating
  under ``jax.ensure_compile_time_eval`` instead would fold a kernel body's primitives that take
  no operands (``program_id``) one by one, and every Pallas candidate would fail.

  The candidates are compiled side by side (:data:`COMPILE_WORKERS` threads: compilation is
  most of a first measurement, e.g. ten kernels under grad), then timed one at a time; one that
  fails to compile has its error and no time."""
  with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="probjax-autotune") as pool:
    return pool.submit(_measure_here, call, names, differentiated).result()


def _compile_all(jitted: Mapping[str, Callable], args) -> tuple[dict, dict]:
  """``(compiled, errors)``: each ``jitted[name]`` lowered and compiled for ``args`` on up to
  :data:`COMPILE_WORKERS` threads; a failure is its classified message."""
  from probjax.core import timing
  compiled, errors = {}, {}
  workers = max(1, min(len(jitted), COMPILE_WORKERS))
  with concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="probjax-autotune-compile") as pool:
    futures = {n: pool.submit(lambda f: f.lower(*args).compile(), f) for n, f in jitted.items()}
    for n, future in futures.items():
      try:
        compiled[n] = future.result()
      except Exception as e:  # noqa: BLE001 (a candidate that fails is recorded, never raised)
        errors[n] = "%s: %s" % timing.classify_error(e)
  return compiled, errors


def _measure_here(call: AttentionCall, names: list[str], differentiated: bool) -> tuple[dict, dict]:
  kq, kk, kv = jax.random.split(jax.random.key(0), 3)
  q = jax.random.normal(kq, call.q_shape, call.dtype)
  k = jax.random.normal(kk, call.kv_shape, call.dtype)
  v = jax.random.normal(kv, call.kv_shape[:3] + (call.value_head_dim,), call.dtype)
  mask = _concrete_mask(call.mask, call)
  scale = call.head_dim ** -0.5 if call.scale is None else call.scale
  measured = dataclasses.replace(call, mask=mask, scale=scale)
  compiled, failed = _compile_all({n: _timed(_runner(n, measured, mask), differentiated) for n in names}, (q, k, v))
  ms, errors = core.time_candidates({n: functools.partial(compiled[n], q, k, v) for n in names if n in compiled},
                                    timer=TIMER)
  return {n: ms.get(n) for n in names}, {**failed, **errors}


def _on_this_device(device: Device) -> bool:
  current = Device.current()
  return device.platform == current.platform and device.compute_capability == current.compute_capability


# ---------------------------------------------------------------------------
# the decision
# ---------------------------------------------------------------------------
def _chosen(call: AttentionCall, device: Device, differentiated: bool, cache: core.Cache, can_measure: bool,
            allowed: Callable[[str], bool] | None = None) -> tuple[list[str], dict, str] | None:
  """``(names fastest first, entry, source)`` of the call's key, or None (a miss that cannot be
  measured here, or no cached candidate that computes the call)."""
  names = candidates(call, device, differentiated)
  if not names:
    return None
  k = key(call, device, differentiated)
  try:
    entry, source = core.lookup_or_measure(
        k, (lambda: measure(call, names, differentiated)) if can_measure else None, cache=cache)
  except core.AllFailed as e:
    warnings.warn(f"probjax.autotune: {k}: {e}; the dispatch rules decide", stacklevel=2)
    return None
  if entry is None:
    return None
  ok = lambda n: n in names and (allowed is None or allowed(n))
  order = core.fastest(entry.get("ms", {}), ok)
  return (order, entry, source) if order else None


def _rule(order: list[str], entry: dict, source: str) -> str:
  """The reason: the entry's times, the same whether measured now or read from the cache (so
  that eager calls before and after the measurement share their compiled computation)."""
  ms = entry["ms"]
  best = order[0]
  versus = f"{ms[best]:.4g} ms vs next {ms[order[1]]:.4g} ms" if len(order) > 1 else f"{ms[best]:.4g} ms, the only one"
  return f"measured: {best} fastest of {len(order)} candidates ({versus})"


def _decision(name: str, rule: str, call: AttentionCall, resolve_backward: Callable) -> Decision:
  impl, _, variant = name.partition(":")
  if impl == "xla":
    return Decision("xla", rule, config=(("formulation", variant), ("autotuned", True)))
  takes_variants = bool(REGISTRY.get(impl).backward_pass_impls)
  backward = (variant or resolve_backward(call)) if takes_variants else None
  return Decision(impl, rule, config=(("autotuned", True),), backward=backward)


def decide(call: AttentionCall, device: Device, env: Mapping[str, str] | None = None, *,
           resolve_backward: Callable[[AttentionCall], str] = lambda call: call.backward_pass_impl) -> Decision | None:
  """The measured Decision of ``call`` on ``device`` (cached, or measured now on the device JAX
  runs on), or None: the rules decide (autotuning off, a call it leaves to them, a miss it
  cannot measure here). Records the call where :func:`recording` is on. ``resolve_backward``:
  the backward variant a kernel that won without naming one runs (dispatch passes its rule)."""
  if measurable(call, device) is not None:
    return None
  _record(call)
  if not core.enabled(env):
    return None
  cache = core.get_cache(env=env)
  can_measure = _on_this_device(device)
  primal = _chosen(call, device, False, cache, can_measure)
  if primal is None:
    return None
  order, entry, source = primal
  decision = _decision(order[0], _rule(order, entry, source), call, resolve_backward)
  if decision.implementation == "xla":
    return decision  # XLA's forward runs under grad too (a kernel's backward needs its forward's residuals)
  is_kernel = lambda n: not n.startswith("xla")
  grad = _chosen(call, device, True, cache, can_measure, allowed=is_kernel)
  if grad is None:
    return decision
  g = _decision(grad[0][0], _rule(*grad), call, resolve_backward)
  if g.implementation == decision.implementation:
    return decision.replace(rule=f"{decision.rule}; under grad {g.rule}", backward=g.backward)
  return decision.replace(grad=g)


# ---------------------------------------------------------------------------
# recording the calls of a traced step, and pre-tuning them
# ---------------------------------------------------------------------------
@contextlib.contextmanager
def recording() -> Iterator[list[dict]]:
  """Collects the attention calls dispatched inside the block (e.g. while a model's step is
  traced by ``jax.jit(step).lower(...)``) as the pre-tune command's shape entries, each once
  (:func:`probjax.core.autotune.recording`).

  >>> import probjax
  >>> q = jnp.zeros((1, 48, 2, 8), jnp.bfloat16)
  >>> step = jax.jit(lambda q: probjax.dot_product_attention(q, q, q, mask=probjax.CausalMask()))
  >>> with recording() as shapes:
  ...   _ = step.lower(q)
  >>> shapes[0]["q_shape"], shapes[0]["dtype"], shapes[0]["mask"]
  ([1, 48, 2, 8], 'bfloat16', 'causal')
  """
  with core.recording() as shapes:
    yield shapes


def _record(call: AttentionCall) -> None:
  spec = {"op": OP, "q_shape": list(call.q_shape), "kv_shape": list(call.kv_shape), "dtype": call.dtype.name,
          "mask": mask_spec(call.mask), "differentiated": True}
  if call.v_head_dim is not None:
    spec["v_head_dim"] = int(call.v_head_dim)
  core.record(spec)


def call_of(spec: Mapping[str, Any]) -> AttentionCall:
  """The call a pre-tune shape entry describes."""
  q_shape, kv_shape = tuple(spec["q_shape"]), tuple(spec["kv_shape"])
  mask = mask_from_spec(spec.get("mask"), q_shape[0], q_shape[1], kv_shape[1])
  return AttentionCall(q_shape, kv_shape, spec.get("dtype", "bfloat16"), mask=mask,
                       v_head_dim=spec.get("v_head_dim"))


def pretune(shapes: list[Mapping[str, Any]], out: str, *, device: Device | None = None,
            log: Callable[[str], Any] = print) -> dict[str, dict]:
  """Measures each shape entry on ``device`` (default the current one; a differentiated entry
  also under grad) and adds the entries to the cache file ``out`` (merged with what it holds;
  existing keys are kept). Returns the entries of these shapes."""
  device = device or Device.current()
  cache = core.get_cache(out)
  done = {}
  for spec in shapes:
    call = call_of(spec)
    why = measurable(call, device)
    if why:
      raise ValueError(f"cannot pre-tune {dict(spec)}: {why}")
    for differentiated in (False, True) if spec.get("differentiated", False) else (False,):
      names = candidates(call, device, differentiated)
      k = key(call, device, differentiated)
      entry, source = core.lookup_or_measure(k, lambda: measure(call, names, differentiated), cache=cache)
      assert entry is not None  # a miss is measured
      done[k] = entry
      log(f"{k}: {entry['choice']} ({source}; " + ", ".join(
          f"{n} {'failed' if t is None else f'{t:.4g} ms'}" for n, t in entry["ms"].items()) + ")")
  return done


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(
      prog="python -m probjax.ops.attention.autotune",
      description="Measure attention calls on this device and write an autotuning cache to ship "
                  "(read with probjax.autotune(cache_path=...) or PROBJAX_AUTOTUNE_CACHE).")
  parser.add_argument("--shapes", required=True,
                      help='JSON list of {"q_shape", "kv_shape", "dtype", "mask", "differentiated"}')
  parser.add_argument("--out", required=True, help="the cache file to write (merged with an existing one)")
  args = parser.parse_args(argv)
  with open(args.shapes) as f:
    shapes = json.load(f)
  if not isinstance(shapes, list):
    parser.error("--shapes must hold a JSON list")
  pretune(shapes, args.out)
  return 0


if __name__ == "__main__":
  sys.exit(main())
