"""bench/cpu_formulations.py: the sampler is deterministic under a seed, the fit finds the
thresholds that synthetic timings were built from, and a tiny run writes resumable rows."""

import json

from bench import cpu_formulations as cf


def test_sample_is_deterministic_and_independent_of_its_size():
  a, b = cf.sample(7, 12), cf.sample(7, 30)[:12]
  assert a == b
  assert cf.sample(8, 12) != a
  for c in a:
    assert cf.FLOP_RANGE[0] <= c.flops() <= cf.FLOP_RANGE[1]
    assert c.q_heads % c.kv_heads == 0
    assert c.kind != "decode" or c.mode == "fwd"
    assert (c.kv_lengths is not None) == (c.mask == "kv_lengths")


def _row(i, q_len, kv_len, dense, flash):
  base = dict(call_id=f"s1#{i}", seed=1, kind="self", batch=1, q_heads=1, kv_heads=1, q_len=q_len,
              kv_len=kv_len, head_dim=64, mask="none", mode="fwd", status="ok")
  return [dict(base, impl="dense", ms=dense), dict(base, impl="flash", ms=flash)]


def test_fit_recovers_the_crossover_and_validation_scores_it():
  # dense faster up to 512 x 512 scores, flash beyond (one head, no mask): the fit must put
  # max_scores at 2^18.
  rows = []
  for i, t in enumerate((64, 200, 300, 500, 512, 700, 1000, 2000)):
    rows += _row(i, t, t, 1.0, 1.5) if t <= 512 else _row(i, t, t, 1.5, 1.0)
  thresholds, ev = cf.fit(cf.calls_of(rows))
  assert thresholds["max_scores"] == 1 << 18 and ev["geomean"] == 1.0 and ev["max"] == 1.0
  rep = cf.report(rows, rows)
  assert rep["validate"]["fitted"]["max"] == 1.0
  assert rep["validate"]["before"]["n"] == 8 and rep["validate"]["shipped"]["n"] == 8
  assert "| validate" in cf.markdown(rep)


def test_run_writes_rows_and_resumes(tmp_path, monkeypatch):
  calls = [c for c in cf.sample(3, 40) if c.flops() < 2e6][:2]
  out = str(tmp_path / "rows.json")
  assert cf.run(calls, out, rounds=1) == 2
  rows = [json.loads(l) for l in open(out)]
  assert {r["impl"] for r in rows} == set(cf.FORMULATIONS)
  assert all(r["status"] == "ok" and r["ms"] > 0 and r["commit"] is not None for r in rows)
  assert cf.run(calls, out, rounds=1) == 0  # resumed: nothing left


def test_round_lengths_and_padding():
  assert [cf.round_length(n) for n in (1, 3, 100, 255, 256, 300, 553, 1000)] == [1, 4, 128, 256, 256, 256, 512, 1024]
  c = lambda tq, tk: dict(q_len=tq, kv_len=tk)
  assert cf.padding(c(512, 512)) == 1.0 and cf.padding(c(1024, 2048)) == 1.0
  assert abs(cf.padding(c(553, 553)) - (768 / 553) ** 2) < 1e-12


def test_padded_fit_separates_tiled_from_padded_calls():
  # Flash faster wherever its tiles fit the lengths (T512, T1024, T2048), dense faster at
  # lengths the 256-tiles pad by half or more (T600, T1100 and T2100 are all above 512): the
  # fit must find a padding bound that splits them, with no regret left.
  rows = []
  for i, t in enumerate((512, 1024, 2048)):
    rows += _row(i, t, t, 1.5, 1.0)
  for i, t in enumerate((600, 1100, 2100), start=3):
    rows += _row(i, t, t, 1.0, 1.5)
  params, ev = cf.fit_padded(cf.calls_of(rows))
  assert ev["geomean"] == 1.0 and ev["max"] == 1.0
  assert params["max_padding"] < min(cf.padding(dict(q_len=t, kv_len=t)) for t in (600, 1100, 2100))
  _, plain = cf.fit(cf.calls_of(rows))
  assert plain["max"] > 1.0  # the scores alone cannot split them
