"""Packaging: the top-level API, the version, py.typed, and the source tree's metadata.

The tests of the installed package also run from a wheel (.ci/wheel_smoke.sh); those that read
the source tree skip where it is absent."""

from __future__ import annotations

import ast
import importlib.metadata
import pathlib
import re
import subprocess
import sys
import tomllib

import pytest

import probjax

ROOT = pathlib.Path(__file__).resolve().parents[1]
PYPROJECT = ROOT / "pyproject.toml"
source_tree = pytest.mark.skipif(not PYPROJECT.is_file() or not (ROOT / "probjax").is_dir(),
                                 reason="needs the source tree (pyproject.toml)")


def test_version_is_the_distributions():
  assert re.fullmatch(r"\d+\.\d+\.\d+([.-]?\w+)*", probjax.__version__)
  try:
    installed = importlib.metadata.version("probjax")
  except importlib.metadata.PackageNotFoundError:
    pytest.skip("probjax is not installed (imported from a path)")
  assert installed == probjax.__version__


def test_py_typed_ships_with_the_package():
  assert (pathlib.Path(probjax.__file__).parent / "py.typed").is_file()


def test_top_level_exports():
  from probjax.nn.layers import attention
  from probjax.ops.attention import masks as op_masks
  for name in ("dot_product_attention", "flex_attention", "mha", "explain_dispatch",
               "available_implementations"):
    assert getattr(probjax, name) is getattr(attention, name)
  for name in ("Mask", "CausalMask", "LocalWindowMask", "KVLenMask", "LengthMask", "SegmentMask"):
    assert getattr(probjax, name) is getattr(op_masks, name) is getattr(probjax.masks, name)
  assert set(probjax.masks.__all__) <= set(dir(op_masks))
  assert probjax.nn.TransformerLM.__name__ == "TransformerLM"
  assert set(probjax.__all__) <= set(dir(probjax))
  with pytest.raises(AttributeError):
    probjax.no_such_name  # noqa: B018


def test_import_is_cheap():
  # The exports load on first use: importing the package imports neither JAX nor Flax.
  code = "import sys, probjax; print(sorted(m for m in ('jax', 'flax') if m in sys.modules))"
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
  assert out.returncode == 0, out.stderr
  assert out.stdout.strip() == "[]"


def _type_checking_names(module) -> set[str]:
  """The names a module binds in its ``if TYPE_CHECKING:`` block (what type checkers see)."""
  tree = ast.parse(pathlib.Path(module.__file__).read_text())
  blocks = [n for n in tree.body if isinstance(n, ast.If) and isinstance(n.test, ast.Name)
            and n.test.id == "TYPE_CHECKING"]
  assert len(blocks) == 1, module.__name__
  return {a.asname or a.name for n in blocks[0].body if isinstance(n, ast.ImportFrom) for a in n.names}


def test_lazy_names_are_typed():
  # Type checkers do not run the lazy module __getattr__: each lazy package imports its names
  # under TYPE_CHECKING (tests/typing/ checks what mypy makes of them); the lists must agree.
  import probjax.nn
  import probjax.nn.layers
  assert _type_checking_names(probjax) == set(probjax._EXPORTS) | set(probjax._SUBMODULES)
  assert _type_checking_names(probjax.nn.layers) == set(probjax.nn.layers._EXPORTS)
  assert _type_checking_names(probjax.nn) == set(probjax.nn.layers.__all__) | {"layers"}
  for module in (probjax, probjax.nn, probjax.nn.layers):
    assert "__getattr__" in vars(module) and "TYPE_CHECKING" in vars(module)


def test_layers_load_lazily():
  # Importing probjax.nn.layers (or probjax.nn) imports no layer module until a name is used.
  code = ("import sys, probjax.nn.layers, probjax.nn; "
          "print(sorted(m for m in sys.modules if m.startswith('probjax.nn.layers.')), 'flax' in sys.modules); "
          "probjax.nn.MLP; print('probjax.nn.layers.mlp' in sys.modules)")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
  assert out.returncode == 0, out.stderr
  assert out.stdout.split("\n")[:2] == ["[] False", "True"]


@source_tree
def test_metadata():
  meta = tomllib.loads(PYPROJECT.read_text())
  project = meta["project"]
  assert project["license"] == "Apache-2.0" and (ROOT / "LICENSE").is_file()
  assert "Apache License" in (ROOT / "LICENSE").read_text()[:200]
  assert "version" in project["dynamic"]
  assert meta["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "probjax.core.version.__version__"}
  assert "py.typed" in meta["tool"]["setuptools"]["package-data"]["probjax"]
  deps = {re.split(r"[<>=!~ ;\[]", d, maxsplit=1)[0]: d for d in project["dependencies"]}
  assert deps["jax"].startswith("jax>=") and deps["flax"].startswith("flax>=")
  extras = [d for ds in project["optional-dependencies"].values() for d in ds]
  exact = [d for d in project["dependencies"] + extras if "==" in d]
  assert not exact, f"exact pins: {exact}"
  assert (ROOT / "CHANGELOG.md").is_file()


@source_tree
def test_sdist_carries_the_tests_inputs():
  # setuptools puts only tests/test*.py in an sdist by itself; MANIFEST.in adds the rest.
  manifest = (ROOT / "MANIFEST.in").read_text().split()
  for d in ("tests", "bench", "docs"):
    assert d in manifest, d
  for f in ("LICENSE", "CHANGELOG.md", "Makefile"):
    assert f in manifest, f
