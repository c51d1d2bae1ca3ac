"""The rooms import in one direction, with no allow-list: core <- ops <- nn (<- the report and
test helpers at the top). core imports neither ops nor nn, ops never import nn, and an op
built on another (mla on attention) imports only that op's face (``probjax.ops.<op>``, whose
names its ``api`` module defines), never its internals. Within an op, no module of a backend
(``ops/<op>/backends/<name>/...``) imports another backend's: a forward of one pairs with the
backward of another by name, through the op's registry (``ops/attention/registry.py``, which
may import both). No two modules import each other, even inside functions. JAX internals
(``jax._src``) are imported by one module only."""

import ast
import importlib
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1] / "probjax"
RANK = {"core": 0, "kernels": 1, "ops": 2, "nn": 3}
TOP = 4  # probjax/*.py: the report, test helpers, the top-level API

# Backend-to-backend imports that stand for now, each with its reason: (importing module, imported
# module) -> why. None today: the one pairing of two backends (the Mosaic GPU forward with the
# Triton backward) goes through ops/attention/registry.py by the backward's name.
KNOWN_CROSS_BACKEND: dict[tuple[str, str], str] = {}


def _room(parts: tuple[str, ...]) -> int:
  return RANK.get(parts[0], TOP) if len(parts) > 1 else TOP


def _backend(parts: tuple[str, ...]) -> tuple[str, str] | None:
  """``(op, backend)`` of a module in a backend's package, or None (a shared module of an op,
  or outside ops/): ``ops/<op>/backends/<backend>/...``."""
  if len(parts) > 3 and parts[0] == "ops" and parts[2] == "backends":
    return parts[1], parts[3]
  return None


def _is_module(parts: tuple[str, ...]) -> bool:
  """Whether ``probjax/<parts>`` is a module or package (not a name a package exports)."""
  path = ROOT.joinpath(*parts)
  return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def _through_face(dst: tuple[str, ...]) -> bool:
  """``dst`` (``ops/<op>/...``) is the op's face: the package itself, a name it exports, or its
  ``api`` module."""
  rest = dst[2:]
  return not rest or rest[0] == "api" or (len(rest) == 1 and not _is_module(dst))


def _names(node: ast.AST, pkg: tuple[str, ...]):
  """The absolute ``probjax.*`` names an import statement imports (``module`` or
  ``module.name``; relative imports resolved against the package ``pkg``)."""
  if isinstance(node, ast.Import):
    yield from (a.name for a in node.names if a.name.split(".")[0] == "probjax")
  elif isinstance(node, ast.ImportFrom):
    base = node.module or ""
    if node.level:
      base = ".".join(pkg[:len(pkg) - node.level + 1] + ((base,) if base else ()))
    if base.split(".")[0] == "probjax":
      yield from (f"{base}.{a.name}" for a in node.names)


def _imports(path: pathlib.Path):
  """Absolute ``probjax.*`` modules (or ``module.name``) that ``path`` imports, anywhere in it
  (function bodies included; relative imports resolved; ``importlib.import_module("...")``
  with a literal name counted too)."""
  pkg = path.relative_to(ROOT.parent).with_suffix("").parts[:-1] if path.is_relative_to(ROOT) else ()
  for node in ast.walk(ast.parse(path.read_text())):
    yield from _names(node, pkg)
    if (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
          and isinstance(node.args[0].value, str) and node.args[0].value.split(".")[0] == "probjax"
          and getattr(node.func, "attr", getattr(node.func, "id", None)) in ("import_module", "__import__")):
      yield node.args[0].value


def _violations():
  for path in sorted(ROOT.rglob("*.py")):
    src = path.relative_to(ROOT).with_suffix("").parts
    for name in _imports(path):
      dst = tuple(name.split(".")[1:])
      if not dst:
        continue
      where = "/".join(src)
      if _room(dst) > _room(src):
        yield f"{where} imports {name} (a higher room)"
      # probjax/ops/<op>/...: another op only through its face.
      if (src[0] == "ops" and len(src) > 2 and len(dst) > 1 and dst[0] == "ops" and dst[1] != src[1]
          and not _through_face(dst)):
        yield f"{where} imports {name} (another op's internals: import it from probjax.ops.{dst[1]})"
      a, b = _backend(src), _backend(dst)
      if a and b and a[0] == b[0] and a != b and (where, name) not in KNOWN_CROSS_BACKEND:
        yield f"{where} imports {name} (another backend)"


def _module_of(name: str) -> tuple[str, ...] | None:
  """The ``probjax/<parts>`` module a ``probjax.*`` import loads (``module.name``: the module)."""
  parts = tuple(name.split(".")[1:])
  while parts and not _is_module(parts):
    parts = parts[:-1]
  return parts or None


def _load_time_imports(parts: tuple[str, ...]):
  """What importing ``probjax/<parts>`` runs: its packages' ``__init__`` and its module-level
  imports (not those in function bodies, which run when called, nor ``if TYPE_CHECKING:``)."""
  path = ROOT.joinpath(*parts)
  path = path / "__init__.py" if (path / "__init__.py").is_file() else path.with_suffix(".py")
  pkg = ("probjax", *parts) if path.name == "__init__.py" else ("probjax", *parts[:-1])
  yield from (parts[:i] for i in range(1, len(parts)))

  def walk(body):
    for node in body:
      if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.dump(node.test):
        yield from walk(node.orelse)
      elif isinstance(node, (ast.If, ast.Try, ast.With)):
        yield from walk(getattr(node, "body", []) + getattr(node, "orelse", []) + getattr(node, "finalbody", [])
                        + [n for h in getattr(node, "handlers", []) for n in h.body])
      elif isinstance(node, ast.ClassDef):
        yield from walk(node.body)
      else:
        yield from _names(node, pkg)

  for name in walk(ast.parse(path.read_text()).body):
    module = _module_of(name)
    if module:
      yield module


def _loaded_with(parts: tuple[str, ...]) -> set[tuple[str, ...]]:
  """What importing ``probjax/<parts>`` loads, following module-level imports, less what an
  op's face (``ops/<op>/__init__``, which Python runs before any module of the op) loads: a
  face may register its backends as it loads; the rule is about the backends' own code."""
  seen, todo = set(), [parts]
  while todo:
    m = todo.pop()
    if m not in seen:
      seen.add(m)
      if not (len(m) == 2 and m[0] == "ops"):
        todo.extend(_load_time_imports(m))
  return seen


def test_importing_a_backend_loads_no_other_backend():
  # Transitively: a backend may use the op's shared modules (the registry included, which
  # imports backends only when asked), but importing it never loads another backend.
  bad = []
  for init in sorted(ROOT.glob("ops/*/backends/*/__init__.py")) + sorted(ROOT.glob("ops/*/backends/*.py")):
    parts = init.relative_to(ROOT).with_suffix("").parts
    parts = parts[:-1] if parts[-1] == "__init__" else parts
    if parts[-1] == "backends":
      continue
    mine = _backend(parts)
    for m in _loaded_with(parts):
      other = _backend(m)
      if other and other[0] == mine[0] and other != mine:
        bad.append(f"importing {'/'.join(parts)} loads {'/'.join(m)}")
  assert not bad, "\n".join(sorted(set(bad)))


def test_load_time_imports_follow_packages_and_skip_function_bodies():
  loaded = _loaded_with(("ops", "attention", "registry"))
  assert ("ops", "attention", "call") in loaded and ("ops", "attention") in loaded
  assert not any(_backend(m) for m in loaded)  # the registry imports its backends in functions
  assert ("ops", "attention", "backends", "triton", "forward") in _loaded_with(
      ("ops", "attention", "backends", "triton"))


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


def test_known_cross_backend_imports_still_exist():
  # An exception that no longer happens is dropped from the list, so it cannot hide a new one.
  seen = {("/".join(p.relative_to(ROOT).with_suffix("").parts), n) for p in ROOT.rglob("*.py") for n in _imports(p)}
  assert not set(KNOWN_CROSS_BACKEND) - seen


@pytest.mark.parametrize("src, name, room", [
    (("ops", "attention", "dispatch"), "probjax.nn.layers.attention_device", 3),
    (("ops", "mla", "forms"), "probjax.nn.layers.attention.dot_product_attention", 3),
    (("core", "eager"), "probjax.ops.attention.api", 2),
])
def test_a_violation_is_seen(src, name, room):
  assert _room(tuple(name.split(".")[1:])) == room > _room(src)


@pytest.mark.parametrize("src, name, other", [
    (("ops", "attention", "backends", "mosaic_gpu", "forward"), "probjax.ops.attention.backends.triton.config.smem_limit", True),
    (("ops", "grouped_matmul", "backends", "mosaic_gpu"), "probjax.ops.grouped_matmul.backends.triton.config", True),
    (("ops", "scan", "backends", "chunked"), "probjax.ops.scan.backends.triton", True),
    (("ops", "attention", "registry"), "probjax.ops.attention.backends.triton", False),  # a shared module
    (("ops", "attention", "backends", "triton", "forward"), "probjax.ops.attention.gpu.kernel_device", False),
    (("ops", "attention", "backends", "triton", "forward"), "probjax.ops.attention.backends.triton.tiles", False),
])
def test_a_cross_backend_import_is_seen(src, name, other):
  a, b = _backend(src), _backend(tuple(name.split(".")[1:]))
  assert bool(a and b and a[0] == b[0] and a != b) == other


@pytest.mark.parametrize("name, face", [
    ("probjax.ops.attention.dot_product_attention", True),
    ("probjax.ops.attention.Mask", True),
    ("probjax.ops.attention.api.explain_dispatch", True),
    ("probjax.ops.attention", True),
    ("probjax.ops.attention.base.check_scale", False),
    ("probjax.ops.attention.dispatch", False),
    ("probjax.ops.attention.masks", False),
    ("probjax.ops.attention.backends.xla", False),
])
def test_an_import_of_another_op_is_seen(name, face):
  assert _through_face(tuple(name.split(".")[1:])) == face


def test_a_jax_internal_import_is_seen(tmp_path):
  f = tmp_path / "m.py"
  f.write_text("def g():\n  from jax._src.pallas.triton import lowering\nfrom jax import _src\nimport jax._src.core\n")
  assert sorted(_jax_internals(f)) == ["jax._src", "jax._src.core", "jax._src.pallas.triton"]


def test_a_dynamic_import_is_seen(tmp_path):
  f = tmp_path / "m.py"
  f.write_text('import importlib\ndef f():\n  return importlib.import_module("probjax.nn.layers.attention")\n')
  assert list(_imports(f)) == ["probjax.nn.layers.attention"]


def test_mla_uses_only_attention_s_face():
  names = [n for p in sorted((ROOT / "ops" / "mla").rglob("*.py")) for n in _imports(p)]
  assert "probjax.ops.attention.dot_product_attention" in names
  assert not [n for n in names if n.startswith("probjax.ops.attention.") and not _through_face(tuple(n.split(".")[1:]))]


def test_the_face_is_one_set_of_objects():
  # probjax.ops.attention exports the face's names (lazily), nn.layers.attention and probjax
  # re-export the same objects.
  api = importlib.import_module("probjax.ops.attention.api")
  op = importlib.import_module("probjax.ops.attention")
  layers = importlib.import_module("probjax.nn.layers.attention")
  import probjax
  assert sorted(op.__all__) == sorted(api.__all__) == sorted(layers.__all__)
  for name in api.__all__:
    assert getattr(op, name) is getattr(api, name) is getattr(layers, name), name
  for name in ("dot_product_attention", "flex_attention", "mha", "explain_dispatch", "available_implementations"):
    assert getattr(probjax, name) is getattr(api, name), name
  # What type checkers see of the lazy package: its TYPE_CHECKING imports, the same names.
  tree = ast.parse(pathlib.Path(op.__file__).read_text())
  typed = {a.asname or a.name for n in tree.body if isinstance(n, ast.If) and getattr(n.test, "id", None) == "TYPE_CHECKING"
           for i in n.body if isinstance(i, ast.ImportFrom) for a in i.names}
  assert typed == set(api.__all__)


def test_importing_an_op_module_does_not_load_the_face():
  import subprocess
  import sys
  code = ("import sys, probjax.ops.attention.masks, probjax.ops.attention.call; "
          "print('probjax.ops.attention.api' in sys.modules, 'probjax.ops.attention.dispatch' in sys.modules)")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
  assert out.returncode == 0, out.stderr
  assert out.stdout.split() == ["False", "False"]


def _import_graph() -> dict[tuple[str, ...], set[tuple[str, ...]]]:
  """Module -> the probjax modules it imports anywhere (function bodies included)."""
  graph = {}
  for path in ROOT.rglob("*.py"):
    parts = path.relative_to(ROOT).with_suffix("").parts
    parts = parts[:-1] if parts[-1] == "__init__" else parts
    graph[parts] = {m for m in map(_module_of, _imports(path)) if m and m != parts}
  return graph


def _circles(graph) -> list[list[tuple[str, ...]]]:
  """The strongly connected sets of more than one module (Tarjan, iteratively)."""
  index, low, on, stack, found, counter = {}, {}, set(), [], [], [0]
  for root in graph:
    if root in index:
      continue
    work = [(root, iter(sorted(graph.get(root, ()))))]
    index[root] = low[root] = counter[0]; counter[0] += 1; stack.append(root); on.add(root)
    while work:
      v, it = work[-1]
      w = next(it, None)
      if w is not None:
        if w not in index:
          index[w] = low[w] = counter[0]; counter[0] += 1; stack.append(w); on.add(w)
          work.append((w, iter(sorted(graph.get(w, ())))))
        elif w in on:
          low[v] = min(low[v], index[w])
        continue
      work.pop()
      if work:
        low[work[-1][0]] = min(low[work[-1][0]], low[v])
      if low[v] == index[v]:
        comp = []
        while True:
          w = stack.pop(); on.discard(w); comp.append(w)
          if w == v:
            break
        if len(comp) > 1:
          found.append(sorted(comp))
  return found


def test_no_import_circles():
  # Not even through imports inside functions: a circle there is two modules that cannot be
  # understood (or moved) one without the other. Lazy loading goes through names (the
  # registry's "module:Class", a face's __getattr__), not through a module importing back.
  circles = _circles(_import_graph())
  assert not circles, "\n".join(" <-> ".join("/".join(m) for m in c) for c in circles)


def test_a_circle_is_seen():
  assert _circles({("a",): {("b",)}, ("b",): {("c",)}, ("c",): {("a",)}, ("d",): {("a",)}}) == [
      [("a",), ("b",), ("c",)]]
