"""The attention report (python -m probjax.attention_report) on CPU, tiny shapes."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from probjax import attention_report as report

FIELDS = ("suite", "impl", "dtype", "batch", "q_heads", "kv_heads", "q_len", "kv_len", "head_dim",
          "causal", "mask", "mode", "ms", "status", "device", "max_error", "case", "vs_jaxnn", "vs_fastest",
          "fastest", "tolerance", "check", "error", "commit")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run_cli(*args, timeout=300):
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  return subprocess.run([sys.executable, "-m", "probjax.attention_report", *args],
                        capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)


def _check_row_fields(row):
  for f in FIELDS:
    assert f in row, f"row lacks field {f!r}: {row}"
  assert row["suite"] == "report"
  assert row["mode"] in ("fwd", "fwd_bwd")
  assert row["status"] in report.STATUSES
  assert isinstance(row["causal"], bool)
  assert row["causal"] == (row["mask"] == "causal")
  if row["status"] == "ok":
    assert isinstance(row["ms"], float) and row["ms"] > 0
    assert row["check"] in ("pass", "fail")
    assert 0 < row["p10_ms"] <= row["ms"] <= row["p90_ms"] and row["n_repeats"] >= 1
    if row["fastest"] is not None:
      assert row["vs_fastest"] > 0
  else:
    assert row["ms"] is None and row["max_error"] is None
    assert row["vs_fastest"] is None and row["vs_jaxnn"] is None
    assert row["error"], "a row that did not run must carry the error message"
  if row["impl"] == "probjax_default":
    assert "default_is_fastest" in row and "default_slower" in row


def test_help():
  r = _run_cli("--help", timeout=120)
  assert r.returncode == 0, r.stderr
  for opt in ("--batch", "--heads", "--kv-heads", "--seq", "--head-dim", "--dtype", "--mask",
              "--impl", "--repeats", "--output", "--no-figure", "--quick", "--quiet"):
    assert opt in r.stdout


@pytest.mark.slow  # the --quick report in a fresh interpreter: every implementation, fwd and fwd+bwd
def test_quick_cli_writes_rows(tmp_path):
  out = tmp_path / "report.json"
  r = _run_cli("--quick", "--output", str(out))
  assert r.returncode == 0, r.stdout + r.stderr
  assert "default ->" in r.stdout  # the table names the implementation the default picks
  rows = json.loads(out.read_text())
  # One table per case, each measurement printed once (no progress lines with times).
  cases = list(dict.fromkeys(row["case"] for row in rows))
  lines = (r.stdout + r.stderr).splitlines()
  assert sum(line.split()[:1] == ["probjax_default"] for line in lines) == len(cases)
  assert sum(line.startswith("  default -> ") for line in lines) == len(cases)
  assert not [line for line in r.stderr.splitlines() if " ms" in line], r.stderr
  for case in cases:
    fwd = [row for row in rows if row["case"] == case and row["mode"] == "fwd"]
    best = min((row for row in fwd if row["check"] == "pass"), key=lambda row: row["ms"])
    assert all(row["fastest"] == best["impl"] for row in fwd)
    assert best["vs_fastest"] == 1.0
    peer = next(row for row in fwd if row["impl"] == "jaxnn_xla")
    assert peer["vs_jaxnn"] == 1.0
    d = next(row for row in fwd if row["impl"] == "probjax_default")
    own = [row for row in fwd if row["impl"] in d["default_same_impl"] and row["check"] == "pass"]
    assert d["default_is_fastest"] == (min(row["ms"] for row in own) <= best["ms"])  # its own rows are one
    if not d["default_is_fastest"]:
      assert "the default is not the fastest" in r.stdout
  assert os.path.isfile(str(out)[:-len(".json")] + ".png")
  assert rows and isinstance(rows, list)
  for row in rows:
    _check_row_fields(row)
  impls = {row["impl"] for row in rows}
  assert {"probjax_default", "probjax_xla", "jaxnn_xla"} <= impls, impls
  # The default set: plain, causal-masked, GQA and an odd length.
  assert any(row["mask"] == "causal" for row in rows)
  assert any(row["kv_heads"] < row["q_heads"] for row in rows)
  assert any(row["q_len"] % 2 == 1 for row in rows)
  # Every implementation has a fwd and a fwd_bwd row per case.
  for case in {row["case"] for row in rows}:
    for impl in impls:
      modes = sorted(row["mode"] for row in rows if row["case"] == case and row["impl"] == impl)
      assert modes == ["fwd", "fwd_bwd"], (case, impl, modes)
  # On CPU in float32 all of these run and agree with the float64 reference.
  for row in rows:
    assert row["status"] == "ok", row
    assert row["check"] == "pass", row
    assert row["max_error"] <= row["tolerance"]
    assert row["device"].startswith("CPU") and row["commit"] == rows[0]["commit"]
  for row in rows:
    if row["impl"] == "probjax_default":
      assert row["default_impl"] and row["default_impl"] != "?", row
      assert row["default_rule"], row


def test_errors_are_reported_per_row(tmp_path):
  # jax.nn rejects the unknown backend name; the report records it and goes on.
  out = tmp_path / "r.json"
  rc = report.main(["--quick", "--impl", "jaxnn_xla,jaxnn_nosuchbackend", "--seq", "24",
                    "--repeats", "1", "--quiet", "--output", str(out)])
  assert rc == 0
  rows = json.loads(out.read_text())
  for row in rows:
    _check_row_fields(row)
  bad = [r for r in rows if r["impl"] == "jaxnn_nosuchbackend"]
  good = [r for r in rows if r["impl"] == "jaxnn_xla"]
  assert len(bad) == 2 and len(good) == 2
  assert all(r["status"] != "ok" and "nosuchbackend" in r["error"] for r in bad)
  assert all(r["status"] == "ok" and r["check"] == "pass" for r in good)


def test_runtime_failure_in_one_impl_does_not_abort(tmp_path, monkeypatch, capsys):
  real = report._jaxnn_fn

  def broken(backend, case, mask_kind, mask):
    if backend == "xla":
      def f(q, k, v):
        raise RuntimeError("boom from the test")
      return f
    return real(backend, case, mask_kind, mask)

  monkeypatch.setattr(report, "_jaxnn_fn", broken)
  out = tmp_path / "r.json"
  rc = report.main(["--quick", "--seq", "16,24", "--impl", "jaxnn_xla,default", "--repeats", "1",
                    "--quiet", "--output", str(out)])
  assert rc == 0
  rows = json.loads(out.read_text())
  assert len(rows) == 2 * 2 * 2  # 2 lengths x 2 impls x 2 modes
  broken_rows = [r for r in rows if r["impl"] == "jaxnn_xla"]
  assert all(r["status"] == "error" and "boom from the test" in r["error"] for r in broken_rows)
  assert "boom from the test" in capsys.readouterr().out  # shown in the table row
  assert all(r["status"] == "ok" for r in rows if r["impl"] == "probjax_default")


# Each report runs three implementations forward and backward (3-6 s of CPU): the kv_len one in
# make test, the other masks slow.
@pytest.mark.parametrize("mask", [pytest.param("window", marks=pytest.mark.slow), "kv_len",
                                  pytest.param("segments", marks=pytest.mark.slow)])
def test_masks_and_gqa_options(tmp_path, mask):
  out = tmp_path / "r.json"
  rc = report.main(["--quick", "--seq", "40", "--heads", "4", "--kv-heads", "2", "--mask", mask,
                    "--batch", "2", "--impl", "default,xla,jaxnn_xla", "--repeats", "1", "--quiet",
                    "--output", str(out)])
  assert rc == 0
  rows = json.loads(out.read_text())
  assert {r["impl"] for r in rows} == {"probjax_default", "probjax_xla", "jaxnn_xla"}
  for row in rows:
    _check_row_fields(row)
    assert (row["batch"], row["q_heads"], row["kv_heads"], row["q_len"], row["mask"]) == (2, 4, 2, 40, mask)
    assert row["status"] == "ok" and row["check"] == "pass", row


def _row(impl, mode, ms, p10=None, p90=None, n=5, check="pass", status="ok"):
  return dict(impl=impl, mode=mode, ms=ms if status == "ok" else None, p10_ms=p10 or ms, p90_ms=p90 or ms,
              n_repeats=n, check=check, status=status, max_error=1e-7, tolerance=2e-5, error=None,
              case="c", default_impl="xla", default_rule="rule")


def test_annotate_ratios_and_default_flags():
  rows = [_row("probjax_default", "fwd", 2.0, 1.9, 2.1), _row("probjax_xla", "fwd", 1.0, 0.9, 1.1),
          _row("probjax_triton", "fwd", 0.5, check="fail"), _row("jaxnn_xla", "fwd", 4.0),
          _row("jaxnn_cudnn", "fwd", 8.0, status="error"),
          _row("probjax_default", "fwd_bwd", 1.0, 0.8, 1.2), _row("probjax_xla", "fwd_bwd", 0.95, 0.9, 1.3),
          _row("jaxnn_xla", "fwd_bwd", 2.0)]
  report.annotate(rows)
  fwd = {r["impl"]: r for r in rows if r["mode"] == "fwd"}
  # A row outside tolerance does not count as the fastest; ratios to the fastest jax.nn row.
  assert {r["fastest"] for r in fwd.values()} == {"probjax_xla"}
  assert fwd["probjax_default"]["vs_fastest"] == 2.0 and fwd["probjax_default"]["vs_jaxnn"] == 0.5
  assert fwd["probjax_triton"]["vs_fastest"] == 0.5
  assert fwd["jaxnn_cudnn"]["vs_fastest"] is None and fwd["jaxnn_cudnn"]["vs_jaxnn"] is None
  # The default runs xla: probjax_xla's row is the same kernel, never a rival (its 2x is noise);
  # the fastest other implementation that passed its check is jaxnn_xla, slower.
  d = fwd["probjax_default"]
  assert d["default_is_fastest"] is True and d["default_slower"] is False
  assert (d["default_best"], d["fastest_other"], d["default_vs_other"]) == ("probjax_xla", "jaxnn_xla", 0.25)
  assert d["default_same_impl"] == ["probjax_default", "probjax_xla"]
  bwd = next(r for r in rows if r["mode"] == "fwd_bwd" and r["impl"] == "probjax_default")
  assert bwd["default_is_fastest"] is True and bwd["default_slower"] is False
  case = report.Case(name="c", batch=1, q_heads=1, kv_heads=1, q_len=8, kv_len=8, head_dim=8, dtype="float32")
  text = report.format_case(case, rows)
  assert "not the fastest" not in text
  assert "1.0e-07/2e-05" in text  # the error over its tolerance
  assert "FAIL" in text  # probjax_triton's check
  # Another implementation faster than the default's own best: flagged, beyond the spread or within.
  rows = [_row("probjax_default", "fwd", 2.0, 1.9, 2.1), _row("probjax_xla", "fwd", 1.8, 1.7, 1.9),
          _row("jaxnn_xla", "fwd", 1.0, 0.9, 1.1), _row("probjax_pallas", "fwd", 0.5, check="fail"),
          _row("probjax_default", "fwd_bwd", 1.0, 0.8, 1.2), _row("jaxnn_xla", "fwd_bwd", 0.95, 0.9, 1.3)]
  report.annotate(rows)
  d, _, _, _, b, _ = rows
  assert d["default_is_fastest"] is False and d["default_slower"] is True  # p10 1.7 above the rival's p90 1.1
  assert d["fastest_other"] == "jaxnn_xla" and d["default_vs_other"] == 1.8  # a failed check never counts
  assert b["default_is_fastest"] is False and b["default_slower"] is False  # spreads overlap
  flags = report.default_flags(rows)
  assert len(flags) == 2 and report.format_case(case, rows).count("the default is not the fastest") == 2
  assert "fwd:" in flags[0] and "jaxnn_xla is 1.80x faster than the default's xla (probjax_xla;" in flags[0] and "beyond" in flags[0]
  assert "fwd+bwd:" in flags[1] and "within the p10-p90 spread" in flags[1]
  few = [_row("probjax_default", "fwd", 2.0, n=2), _row("jaxnn_xla", "fwd", 1.0, n=2)]
  report.annotate(few)
  assert few[0]["default_is_fastest"] is False and few[0]["default_slower"] is None  # no spread to judge by
  assert "too few repeats" in report.default_flags(few)[0]


def test_the_triton_default_owns_its_backward_variant_under_grad():
  d = dict(impl="probjax_default", mode="fwd_bwd", default_impl="triton",
           default_backward_pass_impl="triton_onepass")
  assert report.same_impl_labels(d) == {"probjax_default", "probjax_triton", "probjax_triton_onepass"}
  assert report.same_impl_labels(dict(d, mode="fwd")) == {"probjax_default", "probjax_triton"}
  assert report.same_impl_labels(dict(d, default_impl="?")) == {"probjax_default"}
  rows = [dict(_row("probjax_default", "fwd_bwd", 2.0), **d), _row("probjax_triton_onepass", "fwd_bwd", 1.0),
          _row("probjax_triton_split", "fwd_bwd", 1.5)]
  report.annotate(rows)
  assert rows[0]["default_is_fastest"] is True and rows[0]["fastest_other"] == "probjax_triton_split"


def test_the_figure_is_a_png_beside_the_json(tmp_path):
  assert report.figure_path("reports/attention_report.json") == os.path.join("reports", "attention_report.png")
  rows = [dict(_row(i, m, ms), case=c) for c in ("a", "b") for m in ("fwd", "fwd_bwd")
          for i, ms in (("probjax_default", 1.0), ("jaxnn_xla", 2.0))]
  rows.append(dict(rows[0], impl="probjax_triton", status="unsupported", ms=None))
  rows.append(dict(rows[1], impl="probjax_pallas", check="fail"))
  out = report.write_figure(rows, str(tmp_path / "f.png"), title="t")
  assert out and (tmp_path / "f.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  assert report.write_figure([dict(rows[-2])], str(tmp_path / "none.png")) is None  # nothing ran


def test_main_shows_case_and_implementation_and_writes_the_figure(tmp_path, capsys):
  """One tiny case and one implementation in process (a few seconds: two compilations)."""
  out = tmp_path / "r" / "report.json"
  assert report.main(["--seq", "16", "--heads", "2", "--head-dim", "8", "--impl", "xla", "--repeats", "2",
                      "--output", str(out)]) == 0
  captured = capsys.readouterr()
  assert "T16-none: probjax_xla" in captured.err          # the bar names case and implementation
  assert "T16-none: B=1 H=2 T=16 D=8" in captured.out      # the report's table
  assert "not installed" not in captured.out
  rows = json.loads(out.read_text())
  assert {(r["impl"], r["mode"]) for r in rows} == {("probjax_xla", "fwd"), ("probjax_xla", "fwd_bwd")}
  assert rows[0]["command"].startswith("python -m probjax.attention_report --seq 16")
  assert (tmp_path / "r" / "report.png").read_bytes()[:4] == b"\x89PNG"
  assert f"wrote {tmp_path / 'r' / 'report.png'}" in captured.out


def test_without_the_bench_extra_one_line_says_so(tmp_path, capsys, monkeypatch):
  """No tqdm and no matplotlib (the bench extra): plain progress lines, no figure, one line."""
  for name in ("tqdm", "matplotlib"):
    monkeypatch.setitem(sys.modules, name, None)  # import raises ImportError
  out = tmp_path / "report.json"
  assert report.main(["--seq", "8", "--heads", "1", "--head-dim", "8", "--impl", "jaxnn_xla", "--repeats", "1",
                      "--output", str(out)]) == 0
  captured = capsys.readouterr()
  (line,) = [ln for ln in captured.out.splitlines() if "not installed" in ln]
  assert "tqdm and matplotlib" in line and "no progress bar" in line and "no figure" in line and "[bench]" in line
  assert "running T8-none ..." in captured.err
  assert out.is_file() and not (tmp_path / "report.png").exists()
  assert report.missing_extras_line(bar=False, figure=True).startswith("matplotlib not installed: no figure")
  assert report.missing_extras_line(bar=False, figure=False) is None


def test_no_figure_and_quiet(tmp_path, capsys):
  out = tmp_path / "report.json"
  assert report.main(["--seq", "8", "--heads", "1", "--head-dim", "8", "--impl", "jaxnn_xla", "--repeats", "1",
                      "--quiet", "--no-figure", "--output", str(out)]) == 0
  captured = capsys.readouterr()
  assert out.is_file() and not (tmp_path / "report.png").exists()
  assert "T8-none" not in captured.err and "running" not in captured.err and "png" not in captured.out


def test_make_run_runs_the_report():
  text = open(os.path.join(ROOT, "Makefile")).read()
  body = text.split("\nrun: venv\n", 1)[1].split("\n\n", 1)[0]
  assert body.strip() == "$(PY) -m probjax.attention_report $(ARGS)"


def test_default_output_is_not_the_repository_root():
  out = report.parse_args([]).output
  assert out == report.DEFAULT_OUTPUT and os.path.dirname(out)
  ignore = os.path.join(ROOT, ".gitignore")
  if os.path.isfile(ignore):  # the source tree: the default's folder is git-ignored
    assert f"/{out.split(os.sep)[0]}/" in open(ignore).read().split()


def test_build_cases_defaults_and_overrides():
  args = report.parse_args([])
  cpu, rep = report.build_cases(args, "cpu")
  assert [c.name for c in cpu] == ["plain", "causal", "gqa", "odd", "decode"]
  decode = next(c for c in cpu if c.name == "decode")
  assert (decode.q_len, decode.kv_len) == (1, 4096)
  assert rep >= 3
  gqa = next(c for c in cpu if c.name == "gqa")
  assert (gqa.q_heads, gqa.kv_heads) == (8, 2)
  assert any(c.q_len == 600 for c in cpu)
  gpu, _ = report.build_cases(args, "gpu")
  assert all(c.dtype == "bfloat16" for c in gpu)
  assert max(c.q_len for c in gpu) > max(c.q_len for c in cpu)
  custom, _ = report.build_cases(report.parse_args(["--seq", "8,16", "--seq", "32", "--mask", "causal",
                                                    "--dtype", "bfloat16"]), "cpu")
  assert [(c.q_len, c.mask, c.dtype) for c in custom] == [(8, "causal", "bfloat16"), (16, "causal", "bfloat16"),
                                                          (32, "causal", "bfloat16")]


def test_classify_error_is_the_shared_one():
  from probjax.core import timing
  assert report.classify_error is timing.classify_error and report.STATUSES == timing.STATUSES
  assert report.classify_error(RuntimeError("RESOURCE_EXHAUSTED: Out of memory"))[0] == "oom"
  assert report.classify_error(ValueError("implementation 'x' cannot"))[0] == "unsupported"
  assert report.classify_error(RuntimeError("NOT_FOUND: no autotuning config"))[0] == "fail"
  assert report.classify_error(RuntimeError("other")) == ("error", "RuntimeError: other")


def test_time_call_returns_the_compiling_calls_output():
  import jax.numpy as jnp
  calls = []

  def f(x):
    calls.append(1)
    return x + len(calls)
  t, out = report.time_call(f, (jnp.zeros(()),), repeats=3)
  assert 0 <= t["p10_ms"] <= t["ms"] <= t["p90_ms"] and t["n_repeats"] == 3 and float(out) == 1.0
  assert len(calls) == 1 + 1 + 3  # the compiling call, the estimate, 3 repeats


@pytest.mark.parametrize("mask", [pytest.param("none", marks=pytest.mark.slow), "causal",  # 2-5 s a mask
                                  pytest.param("kv_len", marks=pytest.mark.slow), "segments"])
def test_chunked_reference_matches_reference(mask):
  from probjax.ops.attention.reference import reference_vjp
  from probjax.ops.attention.tolerances import max_error
  case = report.Case(name="x", batch=3, q_heads=4, kv_heads=2, q_len=24, kv_len=24, head_dim=8,
                     dtype="float32", mask=mask)
  q, k, v, do = report.make_inputs(case)
  m = report.make_mask(mask, case)
  chunked = report.reference(q, k, v, do, m, max_chunk_scores=1)  # per (batch, kv head)
  whole = reference_vjp(q, k, v, do, mask=m)[:4]
  for a, b in zip(chunked, whole):
    assert max_error(a, b) < 1e-12
