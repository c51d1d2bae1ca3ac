"""The rooms import in one direction: core <- kernels <- ops <- nn (<- the report and test
helpers at the top), and within an op no backend imports another backend."""

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1] / "probjax"
RANK = {"core": 0, "kernels": 1, "ops": 2, "nn": 3}
TOP = 4  # probjax/*.py: the report, test helpers, the top-level API


def _room(parts: tuple[str, ...]) -> int:
  return RANK.get(parts[0], TOP) if len(parts) > 1 else TOP


def _imports(path: pathlib.Path):
  """Absolute ``probjax.*`` modules that ``path`` imports (relative imports resolved)."""
  pkg = path.relative_to(ROOT.parent).with_suffix("").parts[:-1]
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.Import):
      yield from (a.name for a in node.names if a.name.split(".")[0] == "probjax")
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ""
      if node.level:
        base = ".".join(pkg[:len(pkg) - node.level + 1] + ((base,) if base else ()))
      if base.split(".")[0] == "probjax":
        yield from (f"{base}.{a.name}" for a in node.names)


def _violations():
  for path in sorted(ROOT.rglob("*.py")):
    src = path.relative_to(ROOT).with_suffix("").parts
    for name in _imports(path):
      dst = tuple(name.split(".")[1:])
      if not dst:
        continue
      if _room(dst) > _room(src):
        yield f"{'/'.join(src)} imports {name} (a higher room)"
      # probjax/ops/<op>/backends/<backend>/...: no backend imports a sibling backend.
      if (len(src) > 3 and len(dst) > 3 and src[0] == dst[0] == "ops" and src[1] == dst[1]
          and src[2] == dst[2] == "backends" and src[3] != dst[3]):
        yield f"{'/'.join(src)} imports {name} (another backend)"


def test_rooms_import_downwards_only():
  bad = sorted(set(_violations()))
  assert not bad, "\n".join(bad)


@pytest.mark.parametrize("src, name, room", [(("ops", "attention", "dispatch"), "probjax.nn.layers.attention_device", 3)])
def test_a_violation_is_seen(src, name, room):
  assert _room(tuple(name.split(".")[1:])) == room > _room(src)
