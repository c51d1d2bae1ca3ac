"""bench/dit_step.py runs end to end on CPU (``--cpu-smoke``: tiny sizes) and resumes."""

import pytest

from bench import dit_step
from bench.harness import load_rows


def test_flops_convention():
  c = dit_step.CASES["S"]
  n_tok, n_ex = dit_step.matmul_params(c)
  assert c.tokens == 256 and n_tok == 12 * 12 * 384 ** 2 + 2 * 16 * 384
  f = dit_step.train_flops(c)
  assert f["attention_flops"] == 12 * 12 * 64 * 256 ** 2 * 384
  assert f["flops"] == f["dense_flops"] + f["attention_flops"] == 6 * (n_tok * 256 * 64 + n_ex * 64) + f["attention_flops"]


@pytest.mark.slow  # about a minute on a shared 2-core CPU, most of it compiling
@pytest.mark.timeout(600)
def test_cpu_smoke_and_resume(tmp_path):
  out = str(tmp_path / "dit.json")
  argv = ["--cpu-smoke", "--quick", "--output", out]
  dit_step.main(argv)
  rows = load_rows(out)
  by = {(r["section"], r["impl"]): r for r in rows}
  for key in [("matmul", "jnp.dot"), ("train", "probjax"), ("train", "flax")]:
    r = by[key]
    assert r["status"] == "ok" and r["ms"] > 0 and len(r["ms_all"]) == 3, r
    assert r["device"] and r["versions"]["jax"] and "dit_step" in r["command"] and r["commit"]
  assert by[("train", "flax")]["check"] == "ok" and by[("train", "probjax")]["flops"] > 0
  dit_step.main(argv)
  assert len(load_rows(out)) == len(rows)  # every group already measured: nothing re-run
