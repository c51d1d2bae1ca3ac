"""bench/lm_step.py: a training peer named ``<peer>_unrolled`` runs the same model unrolled, with
the same first loss, in the CPU smoke configuration."""

import json

from bench import lm_step


def test_unrolled_peer_runs_the_same_model_with_scan_layers_off(tmp_path):
  out = tmp_path / "lm.json"
  lm_step.main(["--cpu-smoke", "--quick", "--sections", "train,decode", "--repeats", "1", "--iters", "1",
                "--impls", "probjax,probjax_unrolled", "--output", str(out)])
  rows = {(r["section"], r["impl"]): r for r in map(json.loads, out.read_text().splitlines())}
  assert set(rows) == {("train", "probjax"), ("train", "probjax_unrolled"), ("decode", "probjax")}
  assert rows["train", "probjax_unrolled"]["check_rel_loss_diff"] < 1e-3  # the same first-step loss
  model = lm_step.make_lm(lm_step.SMOKE, lm_step.SMOKE.heads, "float32")
  graphdef, params = lm_step.nnx.split(model)
  unrolled = lm_step.nnx.merge(lm_step.with_attention(graphdef, params, None, scan_layers=False), params)
  assert unrolled.transformer.scan_layers is False and model.transformer.scan_layers is True
