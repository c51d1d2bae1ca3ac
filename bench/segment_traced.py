"""fwd+bwd of the XLA flash path on CPU: SegmentMask with constant ids vs traced ids vs a dense mask
(B4 H8 D64 float32, about 4 packed documents per row), the three interleaved per repeat.

  JAX_PLATFORMS=cpu taskset -c 0 python bench/segment_traced.py T REPEATS OUTPUT.json"""
import json, os, sys, time
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import jax, jax.numpy as jnp, numpy as np
from probjax.ops.attention import masks as M
from probjax.ops.attention.backends import xla

B, H, D = 4, 8, 64
T = int(sys.argv[1]) if len(sys.argv) > 1 else 512
reps = int(sys.argv[2]) if len(sys.argv) > 2 else 7
rng = np.random.default_rng(0)
ids = np.zeros((B, T), np.int32)
for b in range(B):  # ~4 packed documents per row, random cut points
  cuts = np.sort(rng.choice(np.arange(1, T), 3, replace=False))
  ids[b] = np.searchsorted(cuts, np.arange(T), side="right")
ks = jax.random.split(jax.random.key(0), 4)
q, k, v, do = (jax.random.normal(kk, (B, T, H, D), jnp.float32) for kk in ks)
sc = D ** -0.5

def loss(q, k, v, mask, dense):
  out = xla.attention(q, k, v, formulation="flash", mask=mask, dense_mask=dense, scale=sc)
  return jnp.sum(out * do)

g = jax.grad(loss, argnums=(0, 1, 2))
const = jax.jit(lambda q, k, v: g(q, k, v, M.SegmentMask(jnp.asarray(ids)), None))
traced = jax.jit(lambda q, k, v, i: g(q, k, v, M.SegmentMask(i), None))
dense_fn = jax.jit(lambda q, k, v, i: g(q, k, v, None, (i[:, None, :, None] == i[:, None, None, :])))
cases = [("const", const, (q, k, v)), ("traced", traced, (q, k, v, jnp.asarray(ids))),
         ("dense", dense_fn, (q, k, v, jnp.asarray(ids)))]
for name, f, args in cases:
  jax.block_until_ready(f(*args)); jax.block_until_ready(f(*args))
ts = {c[0]: [] for c in cases}
for _ in range(reps):  # interleaved: drifting contention hits every case alike
  for name, f, args in cases:
    t0 = time.perf_counter(); jax.block_until_ready(f(*args)); ts[name].append(time.perf_counter() - t0)
from probjax.core.timing import device_info  # noqa: E402
info = device_info()
rows = [dict(suite="segment_traced", case=f"B{B} H{H} T{T} D{D} float32 fwd_bwd", impl=name,
             ms=float(np.median(t) * 1e3), min_ms=float(np.min(t) * 1e3), n_repeats=reps, status="ok",
             device=info["device"], platform=info["platform"], versions=info["versions"], commit=info["commit"],
             command="taskset -c 0 python bench/segment_traced.py " + " ".join(sys.argv[1:]))
        for name, t in ts.items()]
for r in rows:
  print(f"{r['case']} {r['impl']:7s} median {r['ms']:7.1f} ms  min {r['min_ms']:7.1f} ms", flush=True)
if len(sys.argv) > 3:
  with open(sys.argv[3], "w") as f:
    f.writelines(json.dumps(r) + "\n" for r in rows)
