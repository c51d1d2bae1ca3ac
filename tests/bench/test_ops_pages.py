"""bench/ops_pages.py: the other ops' and layers' performance pages come from their results only,
and the committed pages are what the committed results generate."""

import json
import os

from bench import ops_pages
from bench.harness import RESULTS_DIR


def _write(path, rows):
  os.makedirs(os.path.dirname(path), exist_ok=True)
  with open(path, "w") as f:
    f.writelines(json.dumps(r) + "\n" for r in rows)


def test_page_from_synthetic_rows(tmp_path):
  base = dict(case="mamba1", shape="[1, 8, 2, 4]", mode="fwd", dtype="float32", device="Some GPU",
              command="python -m bench.scan", commit="abc1234")
  _write(str(tmp_path / "results" / "some_gpu" / "scan.json"), [
      dict(base, impl="default", status="ok", ms=2.0),
      dict(base, impl="triton", status="ok", ms=1.0),
      dict(base, impl="scan", status="oom"),
  ])
  page = next(p for p in ops_pages.PAGES if p.suite == "scan")
  text = ops_pages.page_text(page, str(tmp_path / "results"))
  assert "## Some GPU" in text and "### mamba1 · fwd · fp32" in text
  line = next(l for l in text.splitlines() if l.startswith("| [1, 8, 2, 4]"))
  # the default first, the failed row's status, and the default over the fastest other (2.0 / 1.0)
  assert line == "| [1, 8, 2, 4] | 2.00 | OOM | 1.00 | 2.00 |", line
  assert "`python -m bench.scan` at abc1234" in text


def test_a_suite_with_no_results_says_so(tmp_path):
  page = ops_pages.PAGES[0]
  assert "_Not measured yet._" in ops_pages.page_text(page, str(tmp_path))


def test_committed_pages_are_generated_from_the_committed_results():
  for page in ops_pages.PAGES:
    path = os.path.join(ops_pages.DOCS_DIR, page.page)
    with open(path) as f:
      assert f.read() == ops_pages.page_text(page, RESULTS_DIR), (
          f"{path} is stale: python -m bench.ops_pages")


def test_committed_dispatch_page_is_generated_from_the_committed_results():
  path = os.path.join(ops_pages.DOCS_DIR, ops_pages.DISPATCH_PAGE)
  with open(path) as f:
    assert f.read() == ops_pages.dispatch_page_text(RESULTS_DIR), f"{path} is stale: python -m bench.ops_pages"


def test_the_dispatch_page_reports_later_validation_samples(tmp_path):
  """A ``dispatch_<op>_validate2.json`` beside the fit and validation rows is reported as the
  second validation, against both earlier samples; without the first validation it is not."""
  import os
  import shutil
  from bench import ops_pages
  src = os.path.join(ops_pages.RESULTS_DIR, "h100_80gb_hbm3")
  dev = tmp_path / "h100"
  dev.mkdir()
  for part in ("fit", "validate", "validate2"):
    shutil.copy(os.path.join(src, f"dispatch_ssd_scan_{part}.json"), dev)
  text = ops_pages.dispatch_page_text(str(tmp_path))
  assert "### ssd_scan · NVIDIA H100 80GB HBM3 · second validation" in text
  assert "| validate | 956697113 |" in text and "third validation" not in text
  (dev / "dispatch_ssd_scan_validate.json").unlink()
  assert "second validation" not in ops_pages.dispatch_page_text(str(tmp_path))


def test_the_dispatch_page_reports_samples_of_a_device_without_a_fit(tmp_path):
  """A device folder holding only a later validation sample gets its own section, against the
  samples of the device that has the fit, without the rows of its own seed measured there."""
  import json
  import os
  import shutil
  from bench import ops_pages
  src = os.path.join(ops_pages.RESULTS_DIR, "h100_80gb_hbm3")
  fit_dev, other = tmp_path / "h100", tmp_path / "other"
  fit_dev.mkdir()
  other.mkdir()
  for part in ("fit", "validate"):
    shutil.copy(os.path.join(src, f"dispatch_ssd_scan_{part}.json"), fit_dev)
  rows = [json.loads(l) for l in open(os.path.join(src, "dispatch_ssd_scan_validate2.json"))]
  (other / "dispatch_ssd_scan_validate2.json").write_text(
      "".join(json.dumps(dict(r, device="Other GPU")) + "\n" for r in rows))
  text = ops_pages.dispatch_page_text(str(tmp_path))
  assert "## ssd_scan · Other GPU · validate2" in text and "share seeds" not in text
  shutil.copy(os.path.join(src, "dispatch_ssd_scan_validate2.json"), fit_dev)  # the same seed on the fit device
  text = ops_pages.dispatch_page_text(str(tmp_path))
  assert "## ssd_scan · Other GPU · validate2" in text and "share seeds" not in text
