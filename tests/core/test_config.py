"""probjax.core.config: every PROBJAX_* environment variable declared once, documented, read at
call time."""

import pathlib
import re

from probjax.core import config

ROOT = pathlib.Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs" / "guide" / "implementations.md"
NAME = re.compile(r"\bPROBJAX_[A-Z0-9_]+\b")


def _source_names() -> dict[str, list[str]]:
  """PROBJAX_* name -> the Python files of probjax/ that mention it (the C++ source's
  PROBJAX_* are macros, not variables)."""
  found = {}
  for path in sorted((ROOT / "probjax").rglob("*.py")):
    for name in set(NAME.findall(path.read_text())):
      found.setdefault(name, []).append(str(path.relative_to(ROOT)))
  return found


def test_every_probjax_variable_in_the_source_is_declared_and_documented():
  found = _source_names()
  assert found
  undeclared = {n: f for n, f in found.items() if n not in config.names()}
  assert not undeclared, f"declare these in probjax/core/config.py: {undeclared}"
  section = DOCS.read_text().split("## Settings and environment variables")[1].split("\n## ")[0]
  for s in config.SETTINGS:
    assert f"| `{s.name}` | " in section, f"{s.name}: add it to the table in {DOCS.name}"
  assert len(config.names()) == len(set(config.names()))
  assert set(config.names()) == set(found), "a declared setting nothing reads"


def test_settings_are_read_at_call_time(monkeypatch):
  s = config.ATTENTION_CUDNN
  monkeypatch.delenv(s.name, raising=False)
  assert s.enabled()
  for off in ("0", "false", " OFF ", "No"):
    monkeypatch.setenv(s.name, off)
    assert not s.enabled()
  for on in ("1", "", "yes"):
    monkeypatch.setenv(s.name, on)
    assert s.enabled()
  assert not s.enabled({s.name: "0"}) and s.enabled({})  # an explicit env, not the process's
  monkeypatch.setenv(config.CACHE_DIR.name, "")
  assert config.CACHE_DIR.value() is None
  monkeypatch.setenv(config.CACHE_DIR.name, "/tmp/x")
  assert config.CACHE_DIR.value() == "/tmp/x" and config.CACHE_DIR.value({}) is None
  assert config.snapshot({s.name: "0"})[s.name] is False
  assert config.setting(s.name) is s


def test_dispatch_switches_go_through_config():
  from probjax.ops.attention.dispatch import Device, defaults_in_effect
  h200 = Device("gpu", (9, 0), 140 << 30)
  assert defaults_in_effect(h200, {}).cudnn is not None
  assert defaults_in_effect(h200, {config.ATTENTION_CUDNN.name: "off"}).cudnn is None
  assert defaults_in_effect(h200, {config.ATTENTION_MOSAIC.name: "0"}).mosaic_long is None
  assert defaults_in_effect(h200, {config.ATTENTION_DEVICE_DEFAULTS.name: "false"}) is None
