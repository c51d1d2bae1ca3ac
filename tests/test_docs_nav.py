"""Every page under docs/ is in mkdocs.yml's nav (``mkdocs build --strict`` refuses a page left
out, and that build runs only in the slow stage): a fast check of the same rule, without mkdocs.
Pages that bench/ops_pages.py writes once their suite is measured are in the nav before then."""

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(not (ROOT / "mkdocs.yml").is_file(), reason="no mkdocs.yml (not a checkout)")


def _nav_pages() -> set[str]:
  text = (ROOT / "mkdocs.yml").read_text()
  nav = text[text.index("\nnav:"):]
  return set(re.findall(r"[\s:-]([\w./-]+\.md)\s*$", nav, flags=re.M))


def test_every_page_is_in_the_nav():
  pages = {p.relative_to(ROOT / "docs").as_posix() for p in (ROOT / "docs").rglob("*.md")}
  assert pages, "no pages found"
  assert not pages - _nav_pages(), f"pages missing from mkdocs.yml's nav: {sorted(pages - _nav_pages())}"


def test_measured_only_pages_are_in_the_nav():
  from bench import ops_pages
  names = {f"dev/{page.page}" for page in ops_pages.MEASURED_ONLY}
  assert names and not names - _nav_pages(), sorted(names - _nav_pages())
