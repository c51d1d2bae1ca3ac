"""bench/'s structure, the device wrapper and the suites as data (CPU, fast)."""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench"


def _bench_imports(path: pathlib.Path) -> set[str]:
  """The bench modules ``path`` imports, at module level or inside a function."""
  out = set()
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "bench":
      out |= {a.name for a in node.names} if node.module == "bench" else {node.module.split(".")[1]}
    elif isinstance(node, ast.Import):
      out |= {a.name.split(".")[1] for a in node.names if a.name.startswith("bench.")}
  return out


def test_bench_has_no_import_circle():
  graph = {p.stem: _bench_imports(p) for p in BENCH.glob("*.py")}
  assert "impls" not in graph["harness"] and "harness" not in graph["peers"]
  state: dict[str, str] = {}

  def visit(m, path):
    if state.get(m) == "done":
      return
    assert state.get(m) != "open", f"import circle: {' -> '.join(path + [m])}"
    state[m] = "open"
    for d in sorted(graph.get(m, ())):
      visit(d, path + [m])
    state[m] = "done"
  for m in sorted(graph):
    visit(m, [])


def test_shared_pieces_live_in_one_module():
  from bench import harness, impls, peers
  for name in ("free_memory", "peers_present", "require_gpu"):
    assert getattr(harness, name) is getattr(peers, name)
  for name in ("free_memory", "probjax_api", "torch_mod", "tokamax_mod", "Unsupported"):
    assert getattr(impls, name) is getattr(peers, name)


# -----------------------------------------------------------------------------
# the device wrapper (bench/gpu_batch.sh) without a GPU: DRY_RUN=1 prints each step's command
# -----------------------------------------------------------------------------
EVERY_STEP = ("tests,tests:mosaic,newops_tests,moe,moe:gmm:1024+2048,scan:fwd,lm:train,dit:S+B:baseline,"
              "mla:decode,isab:64+128,lce,interleaved:4096:64+128:both:fwd+fwd_bwd:probjax_default+jaxnn_cudnn,"
              "dispatch,grid_core,peak,residuals,ext,masked,tiles,tiles_1024,tiles:1024:bf16,tiles_mbwd:4096,"
              "tiles_fp32,tiles_mosaic,tiles_mosaic_1024,grid_bf16,grid_fp32,gridr:4096+16384:bf16,gqar,"
              "grid:4096:bf16,gridall:1024:fp32")


def _dry_commands(tmp_path, plan: str) -> list[list[str]]:
  import os
  import shlex
  import subprocess
  env = dict(os.environ, DRY_RUN="1", OUT=str(tmp_path), RES=str(tmp_path / "res"), PY="python")
  p = subprocess.run(["bash", "bench/gpu_batch.sh", plan, "5"], cwd=ROOT, env=env, capture_output=True,
                     text=True, timeout=60)
  assert p.returncode == 0, p.stderr
  assert "unknown step" not in p.stdout and "no time left" not in p.stdout, p.stdout
  assert not (tmp_path / "res").exists() and not (tmp_path / "results.tar.gz").exists()  # nothing ran
  return [shlex.split(line[len("[dry] "):]) for line in p.stdout.splitlines() if line.startswith("[dry] ")]


def test_every_gpu_batch_step_names_a_suite_and_options_it_has(tmp_path):
  from bench import harness
  cmds = _dry_commands(tmp_path, EVERY_STEP)
  assert len(cmds) >= len(EVERY_STEP.split(","))
  common = (BENCH / "harness.py").read_text()
  for cmd in cmds:
    assert cmd[0] == "python", cmd
    if cmd[1:3] == ["-m", "pytest"]:
      files = [a for a in cmd if a.startswith("tests/") or a == "tests"]
      assert files and all((ROOT / f).exists() for f in files), cmd
      continue
    module = cmd[2] if cmd[1] == "-m" else cmd[1]
    path = ROOT / (module.replace(".", "/") + ".py" if cmd[1] == "-m" else module)
    assert path.exists(), cmd
    source = path.read_text()
    for opt in (a for a in cmd if a.startswith("--")):
      if module == "bench.drop_rows":
        assert opt[2:] in harness.KEY_FIELDS, (opt, cmd)
      else:
        assert f'"{opt}"' in source or f'"{opt}"' in common, (opt, cmd)


# -----------------------------------------------------------------------------
# suites as data: implementations x shapes
# -----------------------------------------------------------------------------
def test_timed_cases_are_implementations_by_shapes():
  from bench import harness, impls
  timing = dict(warmup=0, repeats=1)
  shapes = [impls.shape("float32", 1, 2, 2, t, t, 16, False, mode) for t in (64, 128) for mode in ("fwd", "fwd_bwd")]
  cases = impls.timed_cases("s", ("a", "b_bwd"), shapes, timing,
                            skip=lambda impl, s: s["mode"] == "fwd" and impl.endswith("_bwd"))
  assert all(isinstance(c, harness.Case) for c in cases)
  assert [(c.q_len, c.mode, c.impl) for c in cases] == [
      (64, "fwd", "a"), (64, "fwd_bwd", "a"), (64, "fwd_bwd", "b_bwd"),
      (128, "fwd", "a"), (128, "fwd_bwd", "a"), (128, "fwd_bwd", "b_bwd")]
  # a shape's implementations are adjacent: --rounds times them against each other
  assert [len(g) for g in harness.shape_groups(cases)] == [1, 2, 1, 2]
  masked = impls.timed_cases("m", ("a",), [impls.shape("float32", 1, 2, 2, 64, 64, 16, True, "fwd", mask="docs4")],
                             timing)
  assert masked[0].mask == "docs4" and masked[0].flops is False and masked[0].causal is True


def test_the_harness_suites_build_their_tables_with_timed_cases(monkeypatch):
  """Each harness suite's cases come from impls.timed_cases (the tables' sizes, --quick and full)."""
  from bench import benchmark_gpu_attention, benchmark_kernel_attn_ext, benchmark_kernel_attn_gpu, harness, impls
  calls, got = [], {}
  real = impls.timed_cases
  monkeypatch.setattr(impls, "timed_cases", lambda suite, *a, **k: calls.append(suite) or real(suite, *a, **k))
  monkeypatch.setattr(harness, "run_cases", lambda cases, args, **k: got.__setitem__("n", len(list(cases))))
  for main, argv, suites, n in (
      (benchmark_gpu_attention.main, ["--suite", "grid,masked"], {"grid", "masked"}, 2226),
      (benchmark_kernel_attn_ext.main, ["--device", "gpu"], {"gqa", "decode"}, 262),
      (benchmark_kernel_attn_gpu.main, ["--device", "gpu", "--suite", "dispatch"], {"dispatch"}, 80)):
    calls.clear()
    main(argv)
    assert set(calls) == suites and got["n"] == n, (argv, calls, got)
