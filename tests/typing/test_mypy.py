"""What a type checker sees through probjax's lazy packages: mypy on a user's scripts.

``user_script.py`` (the quick start through ``import probjax``, ``probjax.nn`` and
``probjax.nn.layers``, with ``assert_type`` on the names) and the README's quick start must
pass; ``user_errors.py`` must fail with exactly the errors its ``# error: CODE`` comments name.
Skips where mypy is not installed (the test extra installs it). Runs in the checkout and from
the installed wheel (.ci/wheel_smoke.sh); ``.ci/typecheck.sh`` runs the same check by hand."""

from __future__ import annotations

import hashlib
import importlib.util
import pathlib
import re
import subprocess
import sys
import tempfile

import pytest

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parents[1]  # the checkout (mypy finds probjax/ there), or the wheel smoke's folder
README = ROOT / "README.md"
LINE = re.compile(r"^(?P<path>[^:]+):(?P<line>\d+): error: (?P<msg>.*?)  \[(?P<code>[a-z-]+)\]$")


def readme_quick_start(readme: str) -> str:
  """The README's first python block under ``## Quick start``."""
  section = readme[readme.index("## Quick start"):]
  return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def mypy(*files: pathlib.Path) -> dict[str, list[tuple[int, str, str]]]:
  """mypy's errors per file name: (line, code, message)."""
  if importlib.util.find_spec("mypy") is None:
    pytest.skip("mypy is not installed (pip install -e .[test] installs it)")
  # one cache per environment (the checkout's venv, the wheel smoke's), kept between runs
  env = hashlib.sha256(sys.prefix.encode()).hexdigest()[:12]
  cache = pathlib.Path(tempfile.gettempdir()) / "probjax-mypy-cache" / env
  cmd = [sys.executable, "-m", "mypy", "--config-file", str(HERE / "mypy.ini"), "--cache-dir", str(cache),
         "--no-error-summary", "--no-pretty", *map(str, files)]
  out = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=ROOT)
  assert out.returncode in (0, 1), out.stdout + out.stderr  # 2: mypy itself failed
  errors: dict[str, list[tuple[int, str, str]]] = {}
  for line in out.stdout.splitlines():
    if m := LINE.match(line):
      errors.setdefault(pathlib.Path(m["path"]).name, []).append((int(m["line"]), m["code"], m["msg"]))
  assert out.returncode == 0 or errors, out.stdout + out.stderr
  return errors


def expected_errors(path: pathlib.Path) -> list[tuple[int, str]]:
  return [(i, m.group(1)) for i, text in enumerate(path.read_text().splitlines(), 1)
          if (m := re.search(r"# error: ([a-z-]+)$", text))]


def test_user_scripts_type_check(tmp_path):
  files = [HERE / "user_script.py", HERE / "user_errors.py"]
  if README.is_file():
    (tmp_path / "readme_quick_start.py").write_text(readme_quick_start(README.read_text()))
    files.append(tmp_path / "readme_quick_start.py")
  errors = mypy(*files)
  assert not errors.get("user_script.py"), errors["user_script.py"]
  assert not errors.get("readme_quick_start.py"), errors["readme_quick_start.py"]
  want = expected_errors(HERE / "user_errors.py")
  assert len(want) == 3
  assert sorted((line, code) for line, code, _ in errors.get("user_errors.py", [])) == want, errors
  assert set(errors) <= {"user_errors.py"}, errors
