"""bench.gpu_suite: JUnit files to a gpu_suite row."""

from bench import gpu_suite

JUNIT = """<?xml version="1.0"?><testsuites><testsuite name="pytest" time="2.75">
<testcase classname="tests.ops.a" name="test_ok" time="1.5"/>
<testcase classname="tests.ops.a" name="test_bad" time="2"><failure message="x"/></testcase>
<testcase classname="tests.ops.b" name="test_skip" time="0"><skipped message="y"/></testcase>
</testsuite></testsuites>"""


def test_row_counts_every_case(tmp_path):
  (tmp_path / "gpu_junit_kernels.xml").write_text(JUNIT)
  out = tmp_path / "gpu_suite.json"
  r = gpu_suite.main(["--junit", str(tmp_path), "--selection", "s", "--device", "NVIDIA H200", "--commit", "abc",
                      "--command", "c", "--output", str(out)])
  assert (r["passed"], r["failed"], r["skipped"]) == (1, 1, 1)
  assert [c["status"] for c in r["cases"]] == ["passed", "failed", "skipped"]
  assert (r["wall_s"], r["case_s_sum"]) == (2.75, 3.5)
  assert r["cases"][1]["id"] == "tests.ops.a::test_bad" and out.read_text().count("\n") == 1
