#!/usr/bin/env bash
# The installed package, not the checkout: builds the sdist and from it the wheel, installs the
# wheel into a fresh venv outside the repository, and from there imports probjax, checks one
# attention call against the float64 reference and runs tests/test_api.py,
# tests/test_packaging.py and tests/typing/test_mypy.py (mypy on a user's script against the
# installed package) from a copy of tests/.
#
#   bash .ci/wheel_smoke.sh           # with the newest JAX and Flax the ranges allow
#   bash .ci/wheel_smoke.sh lowest    # with the ranges' lowest (.ci/lowest.txt as constraints)
#
# Python: $PYTHON, else the checkout's .venv (made by `make test`), else python3.
set -euo pipefail
cd "$(dirname "$0")/.."
repo="$PWD"
which="${1:-newest}"
case "$which" in
  newest) constraints=() ;;
  lowest) constraints=(-c "$repo/.ci/lowest.txt") ;;
  *) echo "usage: $0 [newest|lowest]" >&2; exit 2 ;;
esac
base="${PYTHON:-}"
if [ -z "$base" ]; then
  if [ -x "$repo/.venv/bin/python" ]; then base="$repo/.venv/bin/python"; else base="$(command -v python3)"; fi
fi
work="$(mktemp -d "${TMPDIR:-/tmp}/probjax-wheel.XXXXXX")"
trap 'rm -rf "$work"' EXIT

echo "wheel smoke ($which): fresh venv in $work ($("$base" -c 'import platform; print(platform.python_version())'))"
"$base" -m venv "$work/venv"
py="$work/venv/bin/python"
"$py" -m pip install -q build
# sdist first, then the wheel built from the unpacked sdist (python -m build's default), so a
# file the sdist misses fails here.
"$py" -m build -o "$work/dist" "$repo" >"$work/build.log" 2>&1 || { cat "$work/build.log"; exit 1; }
# The distribution is probjax-attention (probjax on PyPI is another project); installed as the
# README says, by a direct reference that names it, so pip checks the wheel is this project.
wheel="$(ls "$work"/dist/probjax_attention-*.whl)"
echo "built $(cd "$work/dist" && ls)"
"$py" -m pip install -q "${constraints[@]}" "probjax-attention[test] @ file://$wheel"

cd "$work"
export JAX_PLATFORMS=cpu
"$py" - "$work/venv" <<'PY'
import pathlib, sys

import jax
import jax.numpy as jnp

import probjax
from probjax.ops.attention.reference import reference_attention
from probjax.ops.attention.tolerances import max_error, tolerance

where = pathlib.Path(probjax.__file__).resolve()
assert where.is_relative_to(pathlib.Path(sys.argv[1]).resolve()), f"probjax imported from {where}"
print(f"probjax {probjax.__version__} from {where.parent}, jax {jax.__version__}")
kq, kk, kv = jax.random.split(jax.random.key(0), 3)
q = jax.random.normal(kq, (2, 100, 4, 32))
k = jax.random.normal(kk, (2, 100, 2, 32))
v = jax.random.normal(kv, (2, 100, 2, 32))
mask = probjax.CausalMask() & probjax.masks.KVLenMask(jnp.array([100, 61]))
err = max_error(probjax.dot_product_attention(q, k, v, mask=mask), reference_attention(q, k, v, mask=mask))
tol = tolerance(jnp.float32)
print(f"dot_product_attention vs float64 reference: max error {err:.2e} (tolerance {tol:.1e})")
assert err <= tol
PY

# The tests run against the installed package: a copy of tests/ with its own (empty) pytest
# configuration, outside the checkout, so neither the repository's pyproject.toml nor its
# probjax/ is seen.
cp -r "$repo/tests" "$work/tests"
rm -rf "$work/tests/__pycache__"
printf '[pytest]\naddopts = -p no:cacheprovider\n' >"$work/tests/pytest.ini"
"$py" -m pytest -q -n 0 -c "$work/tests/pytest.ini" --rootdir "$work/tests" --timeout 600 \
  "$work/tests/test_api.py" "$work/tests/test_packaging.py" "$work/tests/typing/test_mypy.py"
echo "wheel smoke: ok"
