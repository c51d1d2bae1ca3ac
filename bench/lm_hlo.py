"""The custom calls in the LM training step's compiled program (``bench/lm_step.py``'s model
and loss, ``jax.value_and_grad`` jitted): each call's target and the computation holding it,
and how often the attention kernels' names appear before and after XLA's optimisation; one
row per attention implementation asked (``default``: the default's choice).

  python -m bench.lm_hlo --output bench/results/<device>/lm_hlo.json [--small] [--hlo-dir DIR]
      [--implementation default,cudnn,...]

It tells a kernel that XLA's passes copied (two custom calls of one kernel in the forward
loop's computations) from one the program traces twice; the step's kernel profile
(``bench/lm_step.py``) counts the launches.
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import os
import re
import sys

import jax
import jax.numpy as jnp
from flax import nnx

from bench import lm_step
from bench.harness import command_line
from probjax.core.timing import device_info
from probjax.ops.attention import dot_product_attention

SMALL = dict(layers=2, d_model=128, heads=2, head_dim=64, vocab=256, seq=128, batch=1)


def custom_calls(hlo: str) -> list[dict]:
  """``{"computation", "target"}`` of every custom call in the HLO text ``hlo``."""
  comp, rows = None, []
  for line in hlo.splitlines():
    head = re.match(r"^\s*(?:ENTRY\s+)?%?([\w.\-]+)\s*\(.*\{\s*$", line)
    if head and "=" not in line.split("(")[0]:
      comp = head.group(1)
    target = re.search(r'custom_call_target="([^"]+)"', line)
    if target:
      rows.append(dict(computation=comp, target=target.group(1)))
  return rows


def step_row(c, graphdef, params, implementation: str | None, small: bool, hlo_dir: str | None) -> dict:
  """The row of one attention implementation (None: the default) in the step's program, for the
  model ``nnx.split`` into ``graphdef`` and ``params``."""
  if implementation is not None:
    graphdef = lm_step.with_attention(graphdef, params, functools.partial(dot_product_attention,
                                                                          implementation=implementation))
  tokens = jax.random.randint(jax.random.key(0), (c.batch, c.seq), 0, c.vocab)

  def loss_fn(p):
    logits = nnx.merge(graphdef, p)(tokens)
    return jnp.mean(lm_step.cross_entropy(logits[:, :-1], tokens[:, 1:]))

  lowered = jax.jit(jax.value_and_grad(loss_fn)).lower(params)
  pre, post = lowered.as_text(), lowered.compile().as_text()
  name = implementation or "default"
  if hlo_dir:
    for part, text in (("pre", pre), ("post", post)):
      with open(os.path.join(hlo_dir, f"lm_{name}_{part}.txt"), "w") as f:
        f.write(text)
  calls = custom_calls(post)
  return dict(_row_base(small, name), status="ok", pre_fwd_mentions=pre.count("probjax_attention_fwd"),
              post_fwd_mentions=post.count("probjax_attention_fwd"), post_custom_calls=len(calls),
              by_target_and_computation=collections.Counter(
                  f"{r['target']} @ {r['computation']}" for r in calls).most_common())


def _row_base(small: bool, impl: str) -> dict:
  """A row's key and provenance: suite, case, impl, device, versions, commit, command."""
  info = device_info()
  return dict(suite="lm_hlo", case="small" if small else "L12_d768_H12_T2048_B8_V32768_bf16_causal",
              impl=impl, device=info["device"], versions=info["versions"], commit=info["commit"],
              command=command_line())


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--output", required=True)
  p.add_argument("--small", action="store_true", help="a 2-layer model of width 128 (CPU, seconds)")
  p.add_argument("--hlo-dir", default=None, help="also write the HLO texts (lm_<impl>_{pre,post}.txt) here")
  p.add_argument("--implementation", default="default",
                 help="attention implementations, comma-separated (default: the default's choice)")
  args = p.parse_args(argv)
  c = lm_step.Config(**SMALL) if args.small else lm_step.Config()
  graphdef, params = nnx.split(lm_step.make_lm(c, c.heads, jnp.float32))  # one model for every row
  rows = []
  for impl in args.implementation.split(","):
    try:
      rows.append(step_row(c, graphdef, params, None if impl == "default" else impl, args.small, args.hlo_dir))
    except Exception as e:  # e.g. a backend that refuses the call on this device: the row says why
      rows.append(dict(_row_base(args.small, impl), status=f"failed: {type(e).__name__}: {str(e)[:300]}"))
    print(json.dumps({k: rows[-1].get(k) for k in ("impl", "status", "post_custom_calls",
                                                    "by_target_and_computation")})[:2000], flush=True)
  with open(args.output, "w") as f:
    f.writelines(json.dumps(r) + "\n" for r in rows)
  return 0


if __name__ == "__main__":
  sys.exit(main())
