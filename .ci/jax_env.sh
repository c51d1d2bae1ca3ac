#!/usr/bin/env bash
# The suite on the newest or the lowest JAX and Flax that pyproject.toml's ranges allow, in a
# fresh venv outside the checkout:
#
#   bash .ci/jax_env.sh newest [PYTEST ARGS]   # pip picks the newest jax, jaxlib and flax in the ranges
#   bash .ci/jax_env.sh lowest [PYTEST ARGS]   # the ranges' lower bounds (.ci/lowest.txt as constraints)
#
# It installs `pip install -e .[test,bench]` (as make test's .venv), prints what it got and runs the README's test
# selection, python -m pytest -q -n 2 -m "not slow" (arguments are passed on). `make test`'s
# .venv is made the same way as `newest` on a fresh clone, so CI runs `lowest` beside it.
#
# Python: $PYTHON, else a python3.13/python3.12 on PATH or under pyenv. The venv goes to
# $JAX_ENV_VENV (default ${TMPDIR:-/tmp}/probjax-<which>-jax). On the 2-core CI machine the
# install takes about a minute and the suite about as long as make test's.
set -euo pipefail
cd "$(dirname "$0")/.."
which="${1:-newest}"
case "$which" in
  newest) constraints=() ;;
  lowest) constraints=(-c .ci/lowest.txt) ;;
  *) echo "jax_env: newest or lowest, got $which" >&2; exit 2 ;;
esac
shift || true
start=$SECONDS
ok() { "$1" -c 'import sys, venv, ensurepip; sys.exit(sys.version_info < (3, 12))' >/dev/null 2>&1; }
base="${PYTHON:-}"
if [ -z "$base" ]; then
  for p in $(command -v python3.13 python3.12 python3 2>/dev/null || true) \
           $(ls -d "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.1[2-9]*/bin/python3.1[2-9] 2>/dev/null | sort -rV); do
    if ok "$p"; then base="$p"; break; fi
  done
fi
if [ -z "$base" ] || ! ok "$base"; then
  echo "jax_env: needs a Python >= 3.12 with venv and ensurepip (PYTHON=/path/to/python3.12)" >&2
  exit 1
fi
venv="${JAX_ENV_VENV:-${TMPDIR:-/tmp}/probjax-$which-jax}"
rm -rf "$venv"
"$base" -m venv "$venv"
py="$venv/bin/python"
echo "jax_env $which: installing pip install -e .[test,bench] into $venv ($("$py" -c 'import platform; print(platform.python_version())'))"
"$py" -m pip install -q -e '.[test,bench]' "${constraints[@]}" >"$venv/install.log" 2>&1 || { cat "$venv/install.log"; exit 1; }
JAX_ENV_WHICH="$which" "$py" - <<'PY'
import importlib.metadata as md
import os
print(f"jax_env {os.environ['JAX_ENV_WHICH']}: " + ", ".join(f"{n} {md.version(n)}" for n in ("jax", "jaxlib", "flax", "probjax-attention")))
PY
echo "jax_env $which: install took $((SECONDS - start)) s"
set +e
"$py" -m pytest -q -n 2 -m "not slow" "$@"
rc=$?
echo "jax_env $which: pytest exit $rc; $((SECONDS - start)) s in all"
exit $rc
