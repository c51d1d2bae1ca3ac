"""The rooms import in one direction: core <- kernels <- ops <- nn (<- the report and test
helpers at the top), within an op no backend imports another backend, and JAX internals
(``jax._src``) are imported by one module only."""

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1] / "probjax"
RANK = {"core": 0, "kernels": 1, "ops": 2, "nn": 3}
TOP = 4  # probjax/*.py: the report, test helpers, the top-level API
# An op built on attention calls attention's public function, which lives in nn/layers/attention
# (it and the masks it re-exports are the whole dependency): so its kernels, masks and dispatch
# are reused, and none of attention's backends is imported.
ATTENTION_API = "probjax.nn.layers.attention"
ON_ATTENTION = {("ops", "mla")}


def _room(parts: tuple[str, ...]) -> int:
  return RANK.get(parts[0], TOP) if len(parts) > 1 else TOP


def _backend(parts: tuple[str, ...]) -> tuple[str, str] | None:
  """``(op, backend)`` of a module in a backend's package, or None (a shared module of an op,
  or outside ops/): ``ops/<op>/backends/<backend>/...``."""
  if len(parts) > 3 and parts[0] == "ops" and parts[2] == "backends":
    return parts[1], parts[3]
  return None


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
      uses_api = tuple(src[:2]) in ON_ATTENTION and name.rsplit(".", 1)[0] == ATTENTION_API
      if _room(dst) > _room(src) and not uses_api:
        yield f"{'/'.join(src)} imports {name} (a higher room)"
      # probjax/ops/<op>/...: another op room only through its public function.
      if (tuple(src[:2]) in ON_ATTENTION and len(dst) > 1 and dst[0] == "ops" and dst[1] != src[1]
          and not uses_api):
        yield f"{'/'.join(src)} imports {name} (another op's internals)"
      a, b = _backend(src), _backend(dst)
      if a and b and a[0] == b[0] and a != b:
        yield f"{'/'.join(src)} imports {name} (another backend)"


# JAX internals: probjax/core/compat.py names each one; the test helpers patch Pallas's lowering.
JAX_INTERNALS_ALLOWED = {"core/compat.py", "testing.py"}


def _jax_internals(path: pathlib.Path):
  """``jax._src`` modules that ``path`` imports (anywhere in it, function bodies included)."""
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.Import):
      yield from (a.name for a in node.names if a.name == "jax._src" or a.name.startswith("jax._src."))
    elif isinstance(node, ast.ImportFrom) and not node.level:
      base = node.module or ""
      if base == "jax._src" or base.startswith("jax._src."):
        yield base
      elif base == "jax":
        yield from (f"jax.{a.name}" for a in node.names if a.name == "_src")


def test_jax_internals_only_in_compat():
  bad = sorted(f"{path.relative_to(ROOT).as_posix()} imports {name}"
               for path in ROOT.rglob("*.py") if path.relative_to(ROOT).as_posix() not in JAX_INTERNALS_ALLOWED
               for name in _jax_internals(path))
  assert not bad, "\n".join(bad) + "\n(import it from probjax.core.compat, with a line saying why)"


def test_rooms_import_downwards_only():
  bad = sorted(set(_violations()))
  assert not bad, "\n".join(bad)


@pytest.mark.parametrize("src, name, room", [(("ops", "attention", "dispatch"), "probjax.nn.layers.attention_device", 3)])
def test_a_violation_is_seen(src, name, room):
  assert _room(tuple(name.split(".")[1:])) == room > _room(src)


@pytest.mark.parametrize("src, name, other", [
    (("ops", "attention", "backends", "mosaic_gpu", "forward"), "probjax.ops.attention.backends.triton.config.smem_limit", True),
    (("ops", "grouped_matmul", "backends", "mosaic_gpu"), "probjax.ops.grouped_matmul.backends.triton.config", True),
    (("ops", "attention", "compose"), "probjax.ops.attention.backends.triton.backward", False),  # a shared module
    (("ops", "attention", "backends", "triton", "forward"), "probjax.ops.attention.gpu.kernel_device", False),
    (("ops", "attention", "backends", "triton", "forward"), "probjax.ops.attention.backends.triton.tiles", False),
])
def test_a_cross_backend_import_is_seen(src, name, other):
  a, b = _backend(src), _backend(tuple(name.split(".")[1:]))
  assert bool(a and b and a[0] == b[0] and a != b) == other


def test_a_jax_internal_import_is_seen(tmp_path):
  f = tmp_path / "m.py"
  f.write_text("def g():\n  from jax._src.pallas.triton import lowering\nfrom jax import _src\nimport jax._src.core\n")
  assert sorted(_jax_internals(f)) == ["jax._src", "jax._src.core", "jax._src.pallas.triton"]


def test_mla_uses_only_attention_s_public_function():
  names = [n for p in sorted((ROOT / "ops" / "mla").rglob("*.py")) for n in _imports(p)]
  assert f"{ATTENTION_API}.dot_product_attention" in names
  assert not [n for n in names if n.startswith("probjax.ops.attention")]
