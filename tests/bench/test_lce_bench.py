"""bench/linear_cross_entropy.py runs end to end on a tiny case (memory and times; the Triton
kernels in interpret mode)."""

import json

import pytest

from bench import linear_cross_entropy as lce


def test_smoke(tmp_path):
  out = tmp_path / "lce.json"
  assert lce.main(["--smoke", "--repeats", "2", "--output", str(out)]) == 0
  rows = [json.loads(l) for l in out.read_text().splitlines()]
  assert {r["impl"] for r in rows} == {"fused", "triton", "unfused"}  # triton in interpret mode
  assert all(r["temp_bytes"] is not None and r["ms"] > 0 and r["commit"] for r in rows)


def test_tiles_add_rows(tmp_path):
  out = tmp_path / "lce.json"
  assert lce.main(["--smoke", "--memory-only", "--tiles", "64x256,128xall,32x4096", "--output", str(out)]) == 0
  rows = {r["impl"]: r for r in map(json.loads, out.read_text().splitlines())}
  assert {"fused", "fused_64x256", "fused_128xall", "fused_32xall", "unfused"} <= set(rows)
  # a vocabulary part covering the vocabulary (all, or 4096 >= 1000) runs the gradients in the
  # forward sweep, and the row says so; a smaller one the per-token scheme
  assert rows["fused_128xall"]["grad_in_forward"] and rows["fused_32xall"]["grad_in_forward"]
  assert rows["fused_64x256"]["grad_in_forward"] is False and rows["unfused"]["grad_in_forward"] is None
  # each fused row names its tile: the smoke case (256 tokens, vocabulary 1000) by default takes all of both
  assert (rows["fused_64x256"]["chunk_tokens"], rows["fused_64x256"]["chunk_vocab"]) == (64, 256)
  assert (rows["fused"]["chunk_tokens"], rows["fused"]["chunk_vocab"], rows["fused"]["grad_in_forward"]) == (
      256, 1000, True)
  # a smaller tile needs less temporary memory than the whole-vocabulary one
  assert rows["fused_64x256"]["temp_bytes"] < rows["fused_128xall"]["temp_bytes"]
  skipped = tmp_path / "skip.json"
  assert lce.main(["--smoke", "--memory-only", "--tiles", "64xall", "--skip", "fused,triton",
                   "--output", str(skipped)]) == 0
  assert {json.loads(l)["impl"] for l in skipped.read_text().splitlines()} == {"fused_64xall", "unfused"}
  assert lce.parse_tiles("1024xall, 64x256") == [(1024, None), (64, 256)]
  assert lce.parse_cases("64x8x300, 5x3x2") == {"64x8x300": (64, 8, 300), "5x3x2": (5, 3, 2)}
  for bad in ("64x8", "0x8x300", "ax8x300"):
    with pytest.raises(ValueError, match="--cases"):
      lce.parse_cases(bad)
  for bad in ("4096", "allx64", "0xall"):
    with pytest.raises(ValueError, match="--tiles"):
      lce.parse_tiles(bad)


def test_drawn_cases_are_deterministic_and_in_range():
  a, b = lce.draw_cases(1234, 6), lce.draw_cases(1234, 9)
  assert list(a) == [f"s1234#{i}" for i in range(6)]
  assert all(b[k] == a[k] for k in a)  # case i does not depend on the sample's size
  assert lce.draw_cases(1235, 6) != a
  for n, d, v in b.values():
    assert lce.SAMPLE_TOKENS[0] <= n <= lce.SAMPLE_TOKENS[1] and d in lce.SAMPLE_D
    assert lce.SAMPLE_VOCAB[0] <= v <= lce.SAMPLE_VOCAB[1]


def test_sample_records_its_seed_resumes_and_leaves_out_large_logits(tmp_path, capsys):
  out = tmp_path / "lce_sample.json"
  argv = lambda n: ["--smoke", "--memory-only", "--sample", str(n), "--seed", "7", "--tiles", "64xall",
                    "--output", str(out)]
  assert lce.main(argv(2)) == 0
  rows = [json.loads(l) for l in out.read_text().splitlines()]
  assert {r["case"] for r in rows} == {"s7#0", "s7#1"}
  assert all(r["seed"] == 7 and r["sampler"] == lce.SAMPLER for r in rows)
  # a third case appended; the two measured are skipped; its logits (1 MB) pass a 0.0005 GiB cap
  assert lce.main(argv(3) + ["--append", "--max-logits-gib", "0.0005"]) == 0
  assert "s7#0: in" in capsys.readouterr().out
  rows = [json.loads(l) for l in out.read_text().splitlines()]
  assert [r["case"] for r in rows].count("s7#2") == 3  # fused, fused_64xall, triton
  assert not any(r["case"] == "s7#2" and r["impl"] == "unfused" for r in rows)
  with pytest.raises(SystemExit, match="--sample"):
    lce.main(["--smoke", "--sample", "0", "--output", str(out)])


def test_rule_scoring():
  from bench import lce_rule
  assert lce_rule.proposed_tile(16384, 768, 32768) == "fused_1024xall"  # 128 MiB of logits
  assert lce_rule.proposed_tile(26742, 1024, 65852) == "fused_2048xall"  # within a tenth
  assert lce_rule.proposed_tile(2250, 768, 150003) == "fused_512xall"  # 2048 and 1024 round up too far
  assert lce_rule.proposed_tile(20000, 3072, 50000) == "fused_1024x4096"
  row = lambda impl, ms: dict(case="c", impl=impl, ms=ms, tokens=16384, d=768, vocab=32768)
  s = lce_rule.score([row("fused_1024xall", 3.0), row("fused_2048xall", 2.0), row("unfused", 1.0)])
  assert s["cases"]["c"]["regret"] == 1.5 and s["geo_mean"] == 1.5  # the fastest fused tile, not unfused
  assert lce_rule.score([row("fused_2048xall", 2.0)])["missing"] == ["c: fused_1024xall not measured"]
  fixed = lce_rule.score([row("fused_1024xall", 3.0), row("fused_2048xall", 2.0)], lambda *_: "fused_2048xall")
  assert fixed["geo_mean"] == 1.0 and fixed["cases"]["c"]["tile"] == "fused_2048xall"
