"""docs/dev/adding-a-backend.md, followed: a toy attention backend in its folder plus the one
registry line the page gives, on a copy of the package, runs through the registry with no other
file edited."""

from __future__ import annotations

import os
import pathlib
import re
import shutil
import subprocess
import sys
import textwrap

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[3]
PAGE = ROOT / "docs" / "dev" / "adding-a-backend.md"
pytestmark = pytest.mark.skipif(not PAGE.is_file(), reason="needs the source tree (docs/dev)")

TOY_BACKEND = '''
"""A toy backend: attention by three einsums, unmasked calls only."""

import jax
import jax.numpy as jnp

from probjax.ops.attention.backend import AttentionBackend


class Toy(AttentionBackend):
  name = "toy"

  def supports(self, call, device):
    if call.mask is not None or call.not_for_kernels():
      return "the toy backend takes unmasked calls only"
    if call.heads != call.kv_heads:
      return "the toy backend takes as many key/value heads as query heads"
    return None

  def __call__(self, q, k, v, mask, *, call, backward_pass_impl=None):
    scale = q.shape[-1] ** -0.5 if call.scale is None else call.scale
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32) * scale
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v.astype(jnp.float32)).astype(q.dtype)
'''

CHECK = '''
import jax, jax.numpy as jnp, numpy as np
from probjax.ops.attention import (CausalMask, available_implementations, dot_product_attention,
                                   explain_dispatch)
from probjax.ops.attention import registry
import probjax.ops.attention.backends.toy.backend as toy_module
from probjax.ops.attention.reference import reference_attention

assert "toy" in available_implementations(), available_implementations()
q, k, v = (jax.random.normal(jax.random.key(i), (2, 7, 3, 8), jnp.float32) for i in range(3))
d = explain_dispatch(q.shape, k.shape, q.dtype, implementation="toy")
assert (d.implementation, d.rule) == ("toy", "requested"), d
out = dot_product_attention(q, k, v, implementation="toy")
want = reference_attention(q, k, v)
np.testing.assert_allclose(np.asarray(out), want, rtol=1e-5, atol=1e-5)
g = jax.grad(lambda q: dot_product_attention(q, k, v, implementation="toy").sum())(q)
assert g.shape == q.shape and bool(jnp.isfinite(g).all())
try:
  dot_product_attention(q, k, v, mask=CausalMask(), implementation="toy")
except ValueError as e:
  assert "unmasked calls only" in str(e), e
else:
  raise AssertionError("a call the toy refuses ran")
assert isinstance(registry.REGISTRY.get("toy"), toy_module.Toy)
print("ok")
'''


def _registry_line(name: str, cls: str) -> str:
  """The registry line as the page gives it, for this backend."""
  text = PAGE.read_text()
  m = re.search(r'^\s*(REGISTRY\.add\("<name>", "[\w.]*<name>\.backend:<Class>"\))\s*$', text, re.M)
  assert m, "docs/dev/adding-a-backend.md no longer shows the registry line"
  return m.group(1).replace("<name>", name).replace("<Class>", cls)


def _files(root: pathlib.Path) -> dict[str, bytes]:
  return {p.relative_to(root).as_posix(): p.read_bytes() for p in root.rglob("*.py")}


@pytest.mark.slow  # reason: a subprocess importing JAX and compiling the toy's call
def test_a_toy_backend_is_its_folder_and_one_registry_line(tmp_path):
  pkg = tmp_path / "probjax"
  shutil.copytree(ROOT / "probjax", pkg, ignore=shutil.ignore_patterns("__pycache__", "_build", "*.so"))
  before = _files(pkg)
  # Step 1: the folder.
  folder = pkg / "ops" / "attention" / "backends" / "toy"
  folder.mkdir()
  (folder / "__init__.py").write_text('"""The toy backend."""\n')
  (folder / "backend.py").write_text(textwrap.dedent(TOY_BACKEND))
  # Step 2: the registry line, after the last one there.
  registry = pkg / "ops" / "attention" / "registry.py"
  lines = registry.read_text().splitlines(keepends=True)
  last = max(i for i, l in enumerate(lines) if l.startswith("REGISTRY.add("))
  lines.insert(last + 1, _registry_line("toy", "Toy") + "\n")
  registry.write_text("".join(lines))

  after = _files(pkg)
  changed = sorted(p for p in after if before.get(p) != after[p])
  assert changed == ["ops/attention/backends/toy/__init__.py", "ops/attention/backends/toy/backend.py",
                     "ops/attention/registry.py"], changed
  env = dict(os.environ, PYTHONPATH=str(tmp_path), JAX_PLATFORMS="cpu")
  run = subprocess.run([sys.executable, "-c", CHECK], env=env, cwd=tmp_path, capture_output=True, text=True,
                       timeout=300)
  assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stdout + run.stderr


def test_the_page_gives_the_registry_line():
  assert _registry_line("toy", "Toy") == 'REGISTRY.add("toy", "probjax.ops.attention.backends.toy.backend:Toy")'
