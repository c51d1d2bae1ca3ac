"""The repository paths the developer pages and the README name exist, so that they cannot go
stale silently when a module moves.

Checked: every inline code span (`...`) of README.md, docs/dev/architecture.md and
docs/dev/adding-*.md. Each whitespace-separated word in it that looks like a path of the tree
(contains ``/`` and starts with ``probjax/``, ``tests/``, ``bench/``, ``docs/`` or ``.ci/``; in
the developer pages also ``core/``, ``ops/`` or ``nn/``, which they write relative to
``probjax/``) must match at least one file or folder. ``<name>`` placeholders and ``*`` match
any one path component, ``{a,b}`` expands to each alternative; a ``::test`` suffix (a pytest
node id) and trailing punctuation are dropped. A path git ignores (a build output such as the
cuDNN extension's ``_build/``) counts as present; outside a git checkout (an sdist) the pages
are not checked.
"""

import glob
import itertools
import pathlib
import re
import shutil
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PREFIXES = ("probjax/", "tests/", "bench/", "docs/", ".ci/")
PROBJAX_RELATIVE = ("core/", "ops/", "nn/")  # the developer pages' shorthand for probjax/<room>/
FENCE = re.compile(r"^ {0,3}(```|~~~).*?^ {0,3}\1", re.M | re.S)
SPAN = re.compile(r"(`+)(.+?)\1", re.S)


def _pages():
  pages = [ROOT / "README.md", ROOT / "docs" / "dev" / "architecture.md"]
  pages += sorted((ROOT / "docs" / "dev").glob("adding-*.md"))
  return pages


def _words(text: str):
  """Each word of each inline code span of ``text`` (fenced blocks left out)."""
  for span in SPAN.finditer(FENCE.sub("", text)):
    yield from span.group(2).split()


def paths_in(text: str, relative: bool) -> list[str]:
  """The words of ``text``'s code spans that name paths of the tree, relative to the root
  (``core/...``, ``ops/...``, ``nn/...`` made ``probjax/...`` where ``relative``)."""
  found = []
  for word in _words(text):
    word = word.split("::")[0].strip("'\"").rstrip(".,;:)]")
    if word.startswith(("./",)):
      word = word[2:]
    if relative and word.startswith(PROBJAX_RELATIVE):
      word = "probjax/" + word
    if "/" in word and word.startswith(PREFIXES) and "://" not in word:
      found.append(word)
  return found


def _expand(path: str) -> list[str]:
  """``{a,b}`` alternatives expanded, ``<placeholder>`` made ``*``."""
  path = re.sub(r"<[^<>/]+>", "*", path)
  parts = re.split(r"\{([^{}]*)\}", path)
  options = [p.split(",") if i % 2 else [p] for i, p in enumerate(parts)]
  return ["".join(c) for c in itertools.product(*options)]


CHECKOUT = (ROOT / ".git").exists() and shutil.which("git") is not None


def _git_ignored(path: str) -> bool:
  """A build output the checkout ignores (e.g. the cuDNN extension's ``_build/``): named by the
  pages, absent until built."""
  return subprocess.run(["git", "check-ignore", "-q", "--no-index", path], cwd=ROOT).returncode == 0


def exists(path: str) -> bool:
  return all(glob.glob(str(ROOT / p.rstrip("/"))) or _git_ignored(p) for p in _expand(path))


def test_the_checker_reads_spans_placeholders_and_braces():
  text = ("`probjax/ops/<op>/dispatch.py` and `bench/results/<device>/<suite>.json`, "
          "`ops/attention/{api,call}.py`, ``python -m bench.x --out docs/dev/h200.md``, "
          "`tests/test_api.py::test_x`, not `a/b` nor `https://x/y`\n"
          "```\nprobjax/nowhere.py\n```\n")
  assert paths_in(text, relative=True) == ["probjax/ops/<op>/dispatch.py", "bench/results/<device>/<suite>.json",
                                           "probjax/ops/attention/{api,call}.py", "docs/dev/h200.md",
                                           "tests/test_api.py"]
  assert paths_in("`ops/attention/api.py`", relative=False) == []
  assert all(exists(p) for p in paths_in(text, relative=True))
  assert not exists("probjax/kernels/") and not exists("probjax/ops/attention/<name>/forward.py")
  assert not exists("probjax/ops/{attention,nothing}/")
  if CHECKOUT:
    assert exists("probjax/ops/attention/backends/cudnn/_build/")  # git-ignored: a build output


@pytest.mark.skipif(not CHECKOUT, reason="not a git checkout (an sdist holds only part of the tree)")
@pytest.mark.parametrize("page", _pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_paths_named_in_the_page_exist(page):
  assert page.is_file(), page
  named = paths_in(page.read_text(), relative=page.name != "README.md")
  missing = sorted({p for p in named if not exists(p)})
  assert not missing, f"{page.relative_to(ROOT)} names paths that do not exist: {missing}"


def test_the_developer_pages_are_checked():
  names = {p.name for p in _pages()}
  assert {"architecture.md", "adding-an-op.md", "adding-a-backend.md", "adding-a-mask.md"} <= names
