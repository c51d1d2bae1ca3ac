"""The documentation site (mkdocs.yml) builds with --strict: no broken link, no page left out of
the nav, no docstring mkdocstrings cannot read. Skipped without the docs extra
(pip install -e .[docs]) or outside a checkout (the sdist carries no mkdocs.yml)."""

import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.slow


@pytest.mark.skipif(not (ROOT / "mkdocs.yml").is_file(), reason="no mkdocs.yml (not a checkout)")
def test_site_builds_strictly(tmp_path):
  pytest.importorskip("mkdocs")
  pytest.importorskip("mkdocstrings")
  pytest.importorskip("material")
  env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
  run = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-d", str(tmp_path / "site")],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
  assert run.returncode == 0, run.stdout + run.stderr
  for page in ("index.html", "guide/quickstart.html", "api/attention.html", "api/layers/transformer.html",
               "performance.html", "dev/index.html", "dev/architecture.html", "dev/decisions.html"):
    assert (tmp_path / "site" / page).is_file(), page
  api = (tmp_path / "site" / "api" / "attention.html").read_text()
  assert "dot_product_attention" in api and "explain_dispatch" in api
