"""Times the torch equivalent of probjax's ISAB (``bench/isab.py``'s peer) with a compiled
``flex_attention``, in its own process.

Same structure as :class:`probjax.nn.layers.conditioners.ISAB`: pre-norm MABs
``h = x + MHA(LN(x), LN(y))``, ``h + MLP(LN(h))`` (LayerNorm eps 1e-6, bias-free linears,
tanh-GELU MLP, fused k/v projection), ``ISAB(x) = MAB_out(x, MAB_in(I, x))``; the key padding
of ``MAB_in`` is a flex block mask ``k < lengths[b]``. The parameters are probjax's (loaded by
name), compute is bf16 under autocast, parameters fp32, and the whole module is
``torch.compile``d.

  python bench/torch_isab_worker.py DIR

DIR holds spec.json (heads, modes, rounds, warmup, repeats, min_repeat_s), params.npz (probjax's
flat parameter names -> fp32 arrays), x.npy ``[batch, n, features]``, lengths.npy ``[batch]``,
ct.npy (the cotangent of the output). Prints one JSON line ``{"torch": version, "rows": {mode:
timing}}`` (or ``{"status": ..., "error": ...}``, also per mode where one fails) and writes
out_fwd.npy and grads_fwd_bwd.npz (the gradients by parameter name, and ``x``) for the agreement
check. The worker needs only torch and numpy (the timing module is loaded by path).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # run as a script, beside its sibling
from torch_cpu_worker import _timing  # noqa: E402



def pool_rounds(results: list[dict]) -> dict:
  """One row's timing from ``time_fn`` results of several rounds: ``ms`` the median of the
  rounds' medians, ``p10_ms`` / ``p90_ms`` the medians of theirs, ``round_ms`` each round's."""
  med = lambda k: statistics.median(r[k] for r in results)
  return dict(ms=med("ms"), p10_ms=med("p10_ms"), p90_ms=med("p90_ms"), round_ms=[r["ms"] for r in results],
              rounds=len(results), n_repeats=sum(r["n_repeats"] for r in results),
              calls_per_repeat=results[-1]["calls_per_repeat"])


def build(torch, params: dict, heads: int, lengths, n: int):
  """The torch ISAB; its submodules mirror probjax's, so that a parameter's name is probjax's
  flat name (``mab_in.attn.q.kernel``) with ``weight`` for ``kernel`` / ``scale``."""
  from torch import nn
  from torch.nn.attention.flex_attention import create_block_mask, flex_attention

  features = params["inducing"].shape[-1]
  hidden = params["mab_in.mlp.up.kernel"].shape[-1]
  lin = lambda i, o: nn.Linear(i, o, bias=False)

  class MAB(nn.Module):
    def __init__(self):
      super().__init__()
      self.norm_x, self.norm_y, self.norm_h = (nn.LayerNorm(features, eps=1e-6) for _ in range(3))
      self.attn = nn.ModuleDict(dict(q=lin(features, features), kv=lin(features, 2 * features),
                                     out=lin(features, features)))
      self.mlp = nn.ModuleDict(dict(up=lin(features, hidden), down=lin(hidden, features)))

    def forward(self, x, y, block_mask=None):
      b, t, s = x.shape[0], x.shape[1], y.shape[1]
      def split(z, length):
        z = z.reshape(b, length, heads, -1).transpose(1, 2).to(torch.bfloat16)
        return z.contiguous() if z.device.type == "cpu" else z  # flex's CPU lowering refuses strided q/k/v
      q = split(self.attn["q"](self.norm_x(x)), t)
      k, v = (split(z, s) for z in self.attn["kv"](self.norm_y(y)).chunk(2, dim=-1))
      o = flex_attention(q, k, v, block_mask=block_mask).transpose(1, 2).reshape(b, t, features)
      h = x + self.attn["out"](o).to(x.dtype)
      u = nn.functional.gelu(self.mlp["up"](self.norm_h(h)), approximate="tanh")  # jax.nn.gelu's default
      return h + self.mlp["down"](u).to(h.dtype)

  class ISAB(nn.Module):
    def __init__(self):
      super().__init__()
      self.inducing = nn.Parameter(torch.empty(params["inducing"].shape))
      self.mab_in, self.mab_out = MAB(), MAB()
      self.block_mask = create_block_mask(lambda b, h, qi, ki: ki < lengths[b], B=lengths.shape[0], H=None,
                                          Q_LEN=self.inducing.shape[1], KV_LEN=n, device=lengths.device)

    def forward(self, x):
      i = self.inducing.expand(x.shape[0], -1, -1).to(x.dtype)
      return self.mab_out(x, self.mab_in(i, x, self.block_mask))

  model = ISAB()
  names = {}
  for name, p in model.named_parameters():
    kind = "scale" if ".norm_" in name else "kernel"
    names[name] = name.replace(".weight", f".{kind}")
    w = torch.from_numpy(params[names[name]])
    with torch.no_grad():
      p.copy_(w.T if w.ndim == 2 else w)  # flax kernels are [in, out], torch's [out, in]
  return model.to(lengths.device), names


def main():
  d, timing = sys.argv[1], _timing()
  try:
    import numpy as np
    import torch
    with open(os.path.join(d, "spec.json")) as f:
      spec = json.load(f)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    params = dict(np.load(os.path.join(d, "params.npz")))
    x = torch.from_numpy(np.load(os.path.join(d, "x.npy"))).to(dev, torch.bfloat16)
    ct = torch.from_numpy(np.load(os.path.join(d, "ct.npy"))).to(dev, torch.bfloat16)
    lengths = torch.from_numpy(np.load(os.path.join(d, "lengths.npy"))).to(dev, torch.int32)
    model, names = build(torch, params, spec["heads"], lengths, x.shape[1])
    run = torch.compile(model, dynamic=False)
    sync = (lambda _x: torch.cuda.synchronize()) if dev == "cuda" else (lambda _x: None)
    ps = list(model.parameters())

    def fwd():
      with torch.no_grad(), torch.autocast(dev, dtype=torch.bfloat16):
        return run(x)

    def fwd_bwd():
      xg = x.detach().requires_grad_(True)
      with torch.autocast(dev, dtype=torch.bfloat16):
        y = run(xg)
      return torch.autograd.grad(y, ps + [xg], ct)

    fns, rows = {"fwd": fwd, "fwd_bwd": fwd_bwd}, {}
    for mode in spec["modes"]:
      try:
        t0 = time.perf_counter()
        out = fns[mode]()
        sync(out)
        first_call_s = time.perf_counter() - t0
        if mode == "fwd":
          np.save(os.path.join(d, "out_fwd.npy"), out.float().cpu().numpy())
        else:
          grads = {names[n]: (g.T if g.ndim == 2 else g).float().cpu().numpy()   # as probjax's [in, out]
                   for (n, _), g in zip(model.named_parameters(), out)}
          grads["x"] = out[-1].float().cpu().numpy()
          np.savez(os.path.join(d, "grads_fwd_bwd.npz"), **grads)
        del out
        rounds = [timing.time_fn(fns[mode], sync, warmup=spec["warmup"], repeats=spec["repeats"],
                                 min_repeat_s=spec["min_repeat_s"]) for _ in range(spec["rounds"])]
        rows[mode] = dict(pool_rounds(rounds), first_call_s=first_call_s)
      except Exception as e:  # noqa: BLE001 (the other mode still runs)
        rows[mode] = dict(zip(("status", "error"), timing.classify_error(e)))
    print(json.dumps({"torch": torch.__version__, "device": dev, "rows": rows}))
  except Exception as e:  # noqa: BLE001
    print(json.dumps(dict(zip(("status", "error"), timing.classify_error(e)))))


if __name__ == "__main__":
  main()
