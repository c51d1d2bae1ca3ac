"""probjax.core.autotune, the op-agnostic side (attention's: tests/ops/attention/test_autotune.py):
the switch, the cache path, the stable key, the timing of candidates, and the JSON cache (one
measurement per key; two processes writing at once lose nothing)."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

import probjax
from probjax.core import autotune as at
from probjax.core import config


@pytest.fixture(autouse=True)
def _isolated(monkeypatch, tmp_path):
  # Never the user's cache; every test starts from what the files say.
  monkeypatch.setenv(config.AUTOTUNE_CACHE.name, str(tmp_path / "default.json"))
  monkeypatch.delenv(config.AUTOTUNE.name, raising=False)
  at.clear_process_caches()
  yield
  at.clear_process_caches()


def test_switch_is_opt_in_and_the_context_manager_overrides_it():
  name = config.AUTOTUNE.name
  assert probjax.autotune is at.autotune
  assert not at.enabled({}) and not at.enabled({name: ""})
  assert at.enabled({name: "1"}) and at.enabled({name: "yes"})
  assert not at.enabled({name: " Off "}) and not at.enabled({name: "0"})
  with at.autotune():
    assert at.enabled({}) and at.enabled({name: "0"})
    with at.autotune(False):
      assert not at.enabled({name: "1"})
    assert at.enabled({})
  assert not at.enabled({}) and not at.active({})


def test_cache_path(tmp_path):
  cache_name = config.AUTOTUNE_CACHE.name
  assert at.cache_path({"XDG_CACHE_HOME": "/x"}) == at.pathlib.Path("/x/probjax/autotune.json")
  assert str(at.cache_path({})).endswith(os.path.join(".cache", "probjax", "autotune.json"))
  assert at.cache_path({cache_name: "/y/c.json", "XDG_CACHE_HOME": "/x"}) == at.pathlib.Path("/y/c.json")
  with at.autotune(cache_path=tmp_path / "mine.json"):
    assert at.cache_path({cache_name: "/y/c.json"}) == tmp_path / "mine.json"
  with at.autotune():  # no path: the environment's
    assert at.cache_path({cache_name: "/y/c.json"}) == at.pathlib.Path("/y/c.json")


def test_key_is_a_stable_string():
  import numpy as np
  k = at.make_key("attention", "sm_90", [(2, 64, 4, 16), (2, 64, 2, 16)], [np.dtype("float32")], "causal", True)
  assert k == "attention|sm_90|2x64x4x16,2x64x2x16|float32|causal|grad"
  assert at.make_key("attention", "sm_90", [[2, 64, 4, 16], [2, 64, 2, 16]], ["float32"], "causal", True) == k
  assert at.make_key("attention", "sm_90", [(2, 64, 4, 16)], ["float32"], "causal", False).endswith("|forward")


def _fake_timer(times):
  calls = []

  def timer(fn, sync, *, warmup, repeats, min_repeat_s):
    name = fn()
    calls.append((name, warmup))
    t = times[name]
    if isinstance(t, Exception):
      raise t
    return {"ms": t.pop(0) if isinstance(t, list) else t}

  return timer, calls


def test_time_candidates_rotates_and_takes_the_median():
  timer, calls = _fake_timer({"a": [1.0, 5.0, 2.0], "b": [3.0, 3.0, 3.0], "c": ValueError("no such shape")})
  ms, errors = at.time_candidates({n: (lambda n=n: n) for n in "abc"}, rounds=3, timer=timer)
  assert ms == {"a": 2.0, "b": 3.0, "c": None}
  assert errors == {"c": "unsupported: ValueError: no such shape"}
  # Round 1 warms each up, later rounds rotate the order; a failed candidate is not run again.
  assert calls == [("a", 2), ("b", 2), ("c", 2), ("b", 0), ("a", 0), ("a", 0), ("b", 0)]
  assert at.fastest(ms) == ["a", "b"] and at.fastest(ms, lambda n: n != "a") == ["b"]


def test_time_candidates_runs_the_real_timer():
  ms, errors = at.time_candidates({"sum": lambda: sum(range(100)), "sorted": lambda: sorted(range(200))},
                                  rounds=2, repeats=2, sync=lambda x: x, min_repeat_s=0.001)
  assert not errors and all(t > 0 for t in ms.values())


def test_a_miss_measures_once_and_a_second_lookup_hits(tmp_path):
  cache = at.get_cache(tmp_path / "c.json")
  measured = []

  def measure():
    measured.append(1)
    return {"x": 2.0, "y": 1.0}, {}

  entry, source = at.lookup_or_measure("k", measure, cache=cache)
  assert source == "measured" and entry["choice"] == "y" and entry["ms"] == {"x": 2.0, "y": 1.0}
  assert {"measured_at", "versions", "errors"} <= set(entry) and "jax" in entry["versions"]
  assert at.lookup_or_measure("k", measure, cache=cache) == (entry, "cached") and len(measured) == 1
  assert at.lookup_or_measure("other", None, cache=cache) == (None, "miss")
  # A later process (a new Cache on the file) reads it.
  at.clear_process_caches()
  assert at.get_cache(tmp_path / "c.json").get("k") == entry
  with pytest.raises(at.AllFailed):
    at.lookup_or_measure("bad", lambda: ({"x": None}, {"x": "error: boom"}), cache=cache)
  assert cache.get("bad") is None


def test_a_miss_rereads_a_file_another_process_changed(tmp_path):
  path = tmp_path / "c.json"
  mine = at.Cache(path)
  assert mine.get("a") is None
  at.Cache(path).put("a", {"choice": "x", "ms": {"x": 1.0}})  # another process's write
  assert mine.get("a")["choice"] == "x"
  mine.put("b", {"choice": "y", "ms": {"y": 1.0}})
  assert set(json.loads(path.read_text())["entries"]) == {"a", "b"}


def test_an_unreadable_cache_is_measured_again_and_replaced(tmp_path):
  path = tmp_path / "c.json"
  path.write_text("{not json")
  cache = at.Cache(path)
  assert cache.get("a") is None
  cache.put("a", {"choice": "x", "ms": {"x": 1.0}})
  assert json.loads(path.read_text()) == {"format": at.FORMAT, "entries": {"a": {"choice": "x", "ms": {"x": 1.0}}}}
  assert not [p for p in os.listdir(tmp_path) if p.endswith(".tmp")]  # no temporary file left


_WRITER = textwrap.dedent("""
    import os, sys, time
    from probjax.core import autotune as at
    path, who, go = sys.argv[1], sys.argv[2], sys.argv[3]
    while not os.path.exists(go):
      time.sleep(0.001)
    cache = at.Cache(path)
    for i in range(50):
      cache.put(f"{who}-{i}", {"choice": "x", "ms": {"x": float(i)}, "by": who})
""")


def test_the_cache_survives_two_processes_writing_at_once(tmp_path):
  path, go = tmp_path / "shared" / "autotune.json", tmp_path / "go"
  procs = [subprocess.Popen([sys.executable, "-c", _WRITER, str(path), who, str(go)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for who in ("a", "b")]
  go.touch()  # both start writing together
  for p in procs:
    _, err = p.communicate(timeout=60)
    assert p.returncode == 0, err
  data = json.loads(path.read_text())
  assert sorted(data["entries"]) == sorted(f"{w}-{i}" for w in "ab" for i in range(50))
  assert all(e["by"] == k[0] and e["ms"]["x"] == float(k.split("-")[1]) for k, e in data["entries"].items())
  assert not [p for p in os.listdir(path.parent) if p.endswith(".tmp")]


def test_recording_collects_each_item_once():
  at.record({"a": 1})  # no block: nothing
  with at.recording() as items:
    assert at.active({})
    at.record({"a": 1})
    at.record({"a": 1})
    at.record({"b": 2})
  assert items == [{"a": 1}, {"b": 2}] and not at.active({})
