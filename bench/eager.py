"""Eager against jitted calls of each op on the same inputs: what a notebook user pays per call
once the first call has compiled (``probjax.core.eager`` caches the jitted pieces by the static
call description).

  python -m bench.eager --output bench/results/cpu/eager.json [--cases attention_causal,...]
      [--rounds 7]

Per case both forms are warmed up twice, then timed in ``--rounds`` rotating rounds (eager, jit,
jit, eager, ...), one call each, synchronised with ``block_until_ready``. Rows (key: ``case``,
``impl``): ``impl`` "eager" or "jit", median and minimum ms over the rounds, the shapes, and on
the eager row ``ratio`` = eager median / jitted median against ``goal_ratio`` (1.5: the product
issue's bound for "an eager call after the first"). The machine's 1-minute load average is on
every row: other work on the host widens both.

Cases (``--cases``, default all; CPU-sized, float32):

  attention_causal   dot_product_attention, B2 T600 H8 D64, CausalMask (the case the eager
                     cache was built for: a new jit(scan) per call before it)
  attention_none     the same without a mask
  mla_absorbed       mla, B2 Tq1 S4096 H16, latent 128 + rope 32, KVLenMask, absorbed form
  grouped_matmul     grouped_matmul, 1024 x 256 rows into 8 groups of 256 -> 256
  mamba_scan         mamba_scan, B2 L1024 D256 N16
  rla                residual_linear_attention, B2 T1024 H4 D64, window 64
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

GOAL_RATIO = 1.5


def _normal(seed: int, shape):
  import jax
  return jax.random.normal(jax.random.key(seed), shape)


def _attention(mask_name: str):
  from probjax.ops.attention import CausalMask, dot_product_attention
  q, k, v = (_normal(i, (2, 600, 8, 64)) for i in range(3))
  mask = CausalMask() if mask_name == "causal" else None
  return (lambda q, k, v: dot_product_attention(q, k, v, mask=mask)), (q, k, v), "B2 T600 H8 D64"


def _mla():
  import jax.numpy as jnp
  from probjax.ops.attention import KVLenMask
  from probjax.ops.mla import mla
  b, s, h, dn, dr, dc, dv = 2, 4096, 16, 64, 32, 128, 64
  args = tuple(_normal(i, sh) for i, sh in enumerate([(b, 1, h, dn), (b, 1, h, dr), (b, s, dc), (b, s, dr),
                                                      (dc, h, dn), (dc, h, dv)]))
  mask = KVLenMask(jnp.asarray([s, s - 700], jnp.int32))
  return (lambda *a: mla(*a, mask=mask, form="absorbed")), args, "B2 Tq1 S4096 H16 latent 128+32"


def _grouped_matmul():
  import jax.numpy as jnp
  from probjax.ops.grouped_matmul import grouped_matmul
  lhs, rhs = _normal(0, (1024, 256)), _normal(1, (8, 256, 256))
  sizes = jnp.full((8,), 128, jnp.int32)
  return (lambda lhs, rhs: grouped_matmul(lhs, rhs, sizes)), (lhs, rhs), "M1024 K256 N256 G8"


def _mamba():
  import jax.numpy as jnp
  from probjax.ops.scan import mamba_scan
  x, dt = _normal(0, (2, 1024, 256)), 0.1 * jnp.abs(_normal(1, (2, 1024, 256)))
  a = -jnp.exp(_normal(2, (256, 16)))
  b, c = _normal(3, (2, 1024, 16)), _normal(4, (2, 1024, 16))
  return (lambda x, dt, b, c: mamba_scan(x, dt, a, b, c, jnp.ones(256))), (x, dt, b, c), "B2 L1024 D256 N16"


def _rla():
  from probjax.ops.scan import residual_linear_attention
  q, k, v = (_normal(i, (2, 1024, 4, 64)) for i in range(3))
  return (lambda q, k, v: residual_linear_attention(q, k, v, window_size=64)), (q, k, v), "B2 T1024 H4 D64 w64"


CASES = {
    "attention_causal": lambda: _attention("causal"),
    "attention_none": lambda: _attention("none"),
    "mla_absorbed": _mla,
    "grouped_matmul": _grouped_matmul,
    "mamba_scan": _mamba,
    "rla": _rla,
}


def measure(case: str, rounds: int) -> list[dict]:
  """The two rows (eager, jit) of ``case``."""
  import jax
  f, args, shape = CASES[case]()
  forms = {"eager": f, "jit": jax.jit(f)}
  for _ in range(2):
    for g in forms.values():
      jax.block_until_ready(g(*args))
  times: dict[str, list[float]] = {name: [] for name in forms}
  order = list(forms)
  for r in range(rounds):
    for name in (order if r % 2 == 0 else order[::-1]):
      t = time.perf_counter()
      jax.block_until_ready(forms[name](*args))
      times[name].append((time.perf_counter() - t) * 1e3)
  med = {name: statistics.median(ts) for name, ts in times.items()}
  rows = []
  for name, ts in times.items():
    row = {"case": case, "impl": name, "shape": shape, "ms": round(med[name], 3), "ms_min": round(min(ts), 3),
           "rounds": rounds}
    if name == "eager":
      row.update(ratio=round(med["eager"] / med["jit"], 3), goal_ratio=GOAL_RATIO)
    rows.append(row)
  return rows


def main(argv=None) -> list[dict]:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--cases", default=",".join(CASES))
  p.add_argument("--rounds", type=int, default=7)
  p.add_argument("--output", help="a JSON-lines file; rows of the same (case, impl) are replaced")
  a = p.parse_args(argv)
  cases = [c for c in a.cases.split(",") if c]
  unknown = [c for c in cases if c not in CASES]
  if unknown:
    p.error(f"--cases: unknown {unknown}; expected a comma-separated subset of {sorted(CASES)}")
  from probjax.core.timing import device_info
  info = {**device_info(), "command": "python -m bench.eager " + " ".join(sys.argv[1:] if argv is None else argv)}
  rows = []
  for i, case in enumerate(cases, 1):
    print(f"[eager {i}/{len(cases)}] {case}", flush=True)
    for row in measure(case, a.rounds):
      row.update(info, loadavg_1m=round(os.getloadavg()[0], 2), time=time.strftime("%Y-%m-%dT%H:%M:%S"))
      rows.append(row)
    e, j = rows[-2], rows[-1]
    print(f"  eager {e['ms']} ms, jit {j['ms']} ms: {e['ratio']}x (goal {GOAL_RATIO}x)", flush=True)
  if a.output:
    from bench import harness
    harness.replace_rows(a.output, rows)
  return rows


if __name__ == "__main__":
  main()
