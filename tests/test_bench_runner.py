"""bench/'s structure and the runner's pieces that `make run` shows (CPU, fast)."""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
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
