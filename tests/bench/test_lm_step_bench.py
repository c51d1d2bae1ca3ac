"""bench/lm_step.py: a training peer named ``<peer>_scanned`` runs the same model with its layers
under ``nnx.scan`` (the model's default is the unrolled loop), with the same first loss, in the
CPU smoke configuration."""

import json

from bench import lm_step


def test_scanned_peer_runs_the_same_model_with_scan_layers_on(tmp_path):
  out = tmp_path / "lm.json"
  lm_step.main(["--cpu-smoke", "--quick", "--sections", "train,decode", "--repeats", "1", "--iters", "1",
                "--impls", "probjax,probjax_scanned", "--output", str(out)])
  rows = {(r["section"], r["impl"]): r for r in map(json.loads, out.read_text().splitlines())}
  assert set(rows) == {("train", "probjax"), ("train", "probjax_scanned"), ("decode", "probjax")}
  assert rows["train", "probjax_scanned"]["check_rel_loss_diff"] < 1e-3  # the same first-step loss
  assert rows["train", "probjax_scanned"]["scan_layers"] is True and rows["train", "probjax"]["scan_layers"] is False
  model = lm_step.make_lm(lm_step.SMOKE, lm_step.SMOKE.heads, "float32")
  graphdef, params = lm_step.nnx.split(model)
  scanned = lm_step.nnx.merge(lm_step.with_attention(graphdef, params, None, scan_layers=True), params)
  assert scanned.transformer.scan_layers is True and model.transformer.scan_layers is False


def test_a_tiled_fused_loss_peer_keeps_its_tile_scanned():
  assert lm_step.lce_tile("probjax_lce_1024x32768_scanned") == dict(chunk_tokens=1024, chunk_vocab=32768)
  assert lm_step.lce_tile("probjax_lce") == {} and lm_step.lce_tile("probjax_scanned") == {}
