"""Packaging: the top-level API, the version, py.typed, and the source tree's metadata.

The tests of the installed package also run from a wheel (.ci/wheel_smoke.sh); those that read
the source tree skip where it is absent."""

from __future__ import annotations

import ast
import importlib.metadata
import json
import pathlib
import re
import shlex
import subprocess
import sys
import tomllib

import pytest

import probjax

ROOT = pathlib.Path(__file__).resolve().parents[1]
PYPROJECT = ROOT / "pyproject.toml"
source_tree = pytest.mark.skipif(not PYPROJECT.is_file() or not (ROOT / "probjax").is_dir(),
                                 reason="needs the source tree (pyproject.toml)")


# The distribution's name (the import name is probjax): "probjax" on PyPI is another project.
DISTRIBUTION = "probjax-attention"


def _distribution() -> importlib.metadata.Distribution:
  try:
    return importlib.metadata.distribution(DISTRIBUTION)
  except importlib.metadata.PackageNotFoundError:
    pytest.skip(f"{DISTRIBUTION} is not installed (probjax imported from a path)")


def test_version_is_the_distributions():
  assert re.fullmatch(r"\d+\.\d+\.\d+([.-]?\w+)*", probjax.__version__)
  assert _distribution().version == probjax.__version__


def test_installed_metadata():
  dist = _distribution()
  meta = dist.metadata
  assert meta["Name"] == DISTRIBUTION
  assert meta["License-Expression"] == "Apache-2.0"
  assert "LICENSE" in (meta.get_all("License-File") or [])
  requires = dist.requires or []
  assert any(r.replace(" ", "").startswith("jax<0.13,>=0.11.2") or r.replace(" ", "").startswith("jax>=0.11.2,<0.13")
             for r in requires), requires
  assert "cuda13" in (meta.get_all("Provides-Extra") or [])


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
  assert project["name"] == DISTRIBUTION
  assert project["license"] == "Apache-2.0" and (ROOT / "LICENSE").is_file()
  assert "Apache License" in (ROOT / "LICENSE").read_text()[:200]
  assert "version" in project["dynamic"]
  assert meta["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "probjax.core.version.__version__"}
  assert "py.typed" in meta["tool"]["setuptools"]["package-data"]["probjax"]
  deps = {re.split(r"[<>=!~ ;\[]", d, maxsplit=1)[0]: d for d in project["dependencies"]}
  assert deps["jax"].startswith("jax>=") and deps["flax"].startswith("flax>=")
  # JAX internals: the next minor is excluded until tested (.ci/jax_env.sh runs the newest and the lowest)
  assert ",<0." in deps["jax"] and ",<0." in deps["flax"], deps
  extras = [d for ds in project["optional-dependencies"].values() for d in ds]
  exact = [d for d in project["dependencies"] + extras if "==" in d]
  assert not exact, f"exact pins: {exact}"
  assert (ROOT / "CHANGELOG.md").is_file()


@source_tree
def test_lowest_constraints_are_the_ranges_lower_bounds():
  """.ci/jax_env.sh lowest installs .ci/lowest.txt's pins: they must be the ranges' bounds."""
  deps = tomllib.loads(PYPROJECT.read_text())["project"]["dependencies"]
  lower = {re.split(r"[<>=!~ ;\[]", d, maxsplit=1)[0]: re.search(r">=([0-9.]+)", d).group(1)
           for d in deps if re.split(r"[<>=!~ ;\[]", d, maxsplit=1)[0] in ("jax", "flax")}
  pins = dict(l.split("==") for l in (ROOT / ".ci" / "lowest.txt").read_text().splitlines()
              if l.strip() and not l.startswith("#"))
  assert pins["jax"] == pins["jaxlib"] == lower["jax"] and pins["flax"] == lower["flax"], (pins, lower)


@source_tree
def test_ci_environments_install_make_tests_extras():
  """.ci/jax_env.sh runs make test's selection on other JAX versions: it needs the same extras
  (the benchmark page tests import matplotlib from the bench extra)."""
  extras = lambda text: {e for e in re.findall(r"pip install -q -e '\.\[([\w,]+)\]'", text)
                         if "test" in e.split(",")}
  make = extras((ROOT / "Makefile").read_text())
  assert make and extras((ROOT / ".ci" / "jax_env.sh").read_text()) == make


def _pip_installs(text: str):
  """The arguments of each ``pip install`` command in ``text`` (a shell comment or the end of
  an inline code span ends one)."""
  for m in re.finditer(r"pip3? install ([^`\n]*)", text):
    cmd = re.split(r"\s#\s", m.group(1))[0]
    try:
      yield shlex.split(cmd)
    except ValueError:  # an unbalanced quote: a command broken across lines of prose
      yield cmd.split()


def _bad_install(args: list[str]) -> str | None:
  """Why a ``pip install`` would fetch probjax by name from an index (or another project)."""
  for i, a in enumerate(args):
    name = re.fullmatch(r"(probjax[\w.-]*)(\[[\w,-]+\])?", a)
    if name and not (i + 1 < len(args) and args[i + 1] == "@"):
      return f"{a}: a name, installed from an index"
    ref = re.fullmatch(r"([\w.-]+)(\[[\w,-]+\])?\s*@\s*\S+", a)
    if ref and ref.group(1).startswith("probjax") and ref.group(1) != DISTRIBUTION:
      return f"{a}: a direct reference must name {DISTRIBUTION}"
  return None


@source_tree
def test_install_commands_install_this_project():
  # Every pip command the docs and messages give installs this project from a path, a file or a
  # URL, never `probjax` (another project) or this distribution by name from an index.
  files = [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").rglob("*.md")),
           *sorted((ROOT / "probjax").rglob("*.py")), *sorted((ROOT / ".ci").glob("*"))]
  seen, bad = 0, []
  for f in files:
    for args in _pip_installs(f.read_text()):
      seen += 1
      if why := _bad_install(args):
        bad.append(f"{f.relative_to(ROOT)}: pip install {' '.join(args)} ({why})")
  assert seen > 5 and not bad, bad
  assert _bad_install(["probjax[cuda13]"]) and _bad_install(["-U", "probjax"])
  assert _bad_install(["probjax[cuda13] @ file:///x.whl"]) and _bad_install([DISTRIBUTION])
  assert not _bad_install([".[cuda13]"]) and not _bad_install([f"{DISTRIBUTION}[cuda13] @ git+https://h/r"])


def test_the_cudnn_notice_names_this_installation(monkeypatch, tmp_path):
  # The cuDNN route's notice (no FFI headers) names the command that adds the cuda13 extra to
  # this copy, from where it was installed (PEP 610's direct_url.json).
  from probjax.ops.attention.backends.cudnn import extension
  assert extension.DISTRIBUTION == DISTRIBUTION
  assert not _bad_install(shlex.split(extension.INSTALL.removeprefix("pip install ")))

  def installed_from(info):
    class Dist:
      def read_text(self, name):
        return None if info is None else json.dumps(info)
    monkeypatch.setattr(importlib.metadata, "distributions", lambda name: [Dist()])
    return extension.install_command("cuda13")

  wheel = (tmp_path / "probjax_attention-0.1.0-py3-none-any.whl").as_uri()
  assert installed_from({"url": wheel, "archive_info": {}}) == f'pip install "{DISTRIBUTION}[cuda13] @ {wheel}"'
  assert installed_from({"url": tmp_path.as_uri(), "dir_info": {"editable": True}}) == f'pip install -e "{tmp_path}[cuda13]"'
  assert installed_from({"url": "https://example.org/r.git", "vcs_info": {"vcs": "git", "commit_id": "abc"}}) == \
      f'pip install "{DISTRIBUTION}[cuda13] @ git+https://example.org/r.git@abc"'
  assert "[cuda13]" in installed_from(None) and "probjax[" not in installed_from(None)


@source_tree
def test_sdist_carries_the_tests_inputs():
  # setuptools puts only tests/test*.py in an sdist by itself; MANIFEST.in adds the rest.
  manifest = (ROOT / "MANIFEST.in").read_text().split()
  for d in ("tests", "bench", "docs"):
    assert d in manifest, d
  for f in ("LICENSE", "CHANGELOG.md", "Makefile"):
    assert f in manifest, f


@source_tree
def test_every_ops_tuning_folder_ships_with_the_package():
  """Each op's tuning/*.json is package data (pyproject.toml), so an installed wheel decides as a
  checkout does."""
  import tomllib
  data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
  for folder in sorted((ROOT / "probjax" / "ops").glob("*/tuning")):
    if list(folder.glob("*.json")):
      package = "probjax.ops." + folder.parent.name
      assert "tuning/*.json" in data.get(package, []), f"{package}: tuning/*.json not in package-data"
