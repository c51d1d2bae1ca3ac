"""The documentation site (mkdocs.yml) builds with --strict: no broken link, no page left out of
the nav, no docstring mkdocstrings cannot read; docstring examples render as code, Sphinx roles
as code spans, and the attention reference starts with the function. Skipped without the docs extra
(pip install -e .[docs]) or outside a checkout (the sdist carries no mkdocs.yml)."""

import os
import re
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not (ROOT / "mkdocs.yml").is_file(), reason="no mkdocs.yml (not a checkout)")]


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> pathlib.Path:
  """The site built once for this module's tests."""
  tmp_path = tmp_path_factory.mktemp("docs")
  pytest.importorskip("mkdocs")
  pytest.importorskip("mkdocstrings")
  pytest.importorskip("material")
  env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
  run = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-d", str(tmp_path / "site")],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
  assert run.returncode == 0, run.stdout + run.stderr
  return tmp_path / "site"


def test_site_builds_strictly(site):
  for page in ("index.html", "guide/quickstart.html", "api/attention.html", "api/layers/transformer.html",
               "performance.html", "dev/index.html", "dev/architecture.html", "dev/decisions.html"):
    assert (site / page).is_file(), page
  api = (site / "api" / "attention.html").read_text()
  assert "dot_product_attention" in api and "explain_dispatch" in api


def _outside_code(html: str) -> str:
  return re.sub(r"<pre.*?</pre>|<code.*?</code>", "", html, flags=re.S)


def test_docstring_examples_render_as_code(site):
  """Every ``>>>`` of the API reference lies in a code block (tools/griffe_roles.py fences the
  doctests; Markdown alone renders them as nested block quotes), and no Sphinx role is left
  literal; the attention page's first entry is dot_product_attention."""
  pages = sorted((site / "api").rglob("*.html"))
  examples = 0
  for page in pages:
    html = page.read_text()
    examples += html.count("&gt;&gt;&gt;")
    rest = _outside_code(html)
    assert "&gt;&gt;&gt;" not in rest, f"{page.name}: a doctest line outside a code block"
    assert not re.search(r":(func|class|mod|meth|attr):", rest), f"{page.name}: a literal Sphinx role"
  assert examples > 50, examples  # the layers' and ops' doctests are there at all
  ids = re.findall(r'id="probjax\.ops\.attention\.api\.(\w+)"', (site / "api" / "attention.html").read_text())
  assert ids[0] == "dot_product_attention", ids[:3]
