#!/usr/bin/env bash
# The suite on the newest JAX and Flax that pyproject.toml's ranges allow (make test's .venv
# keeps the versions it was made with): creates a fresh venv, installs `pip install -e .[test]`
# (pip picks the newest jax, jaxlib and flax in the ranges), prints what it got and runs the
# README's test selection, python -m pytest -q -n 2 -m "not slow" (arguments are passed on).
#
# Python: $PYTHON, else a python3.13/python3.12 on PATH or under pyenv. The venv goes to
# $NEWEST_JAX_VENV (default ${TMPDIR:-/tmp}/probjax-newest-jax), outside the checkout. Takes about
# 23 min on 2 busy CPU cores (install 1 min, the suite 22 min: jax 0.12.0.1, flax 0.12.12,
# Python 3.13).
set -euo pipefail
cd "$(dirname "$0")/.."
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
  echo "newest_jax: needs a Python >= 3.12 with venv and ensurepip (PYTHON=/path/to/python3.12)" >&2
  exit 1
fi
venv="${NEWEST_JAX_VENV:-${TMPDIR:-/tmp}/probjax-newest-jax}"
rm -rf "$venv"
"$base" -m venv "$venv"
py="$venv/bin/python"
echo "newest_jax: installing pip install -e .[test] into $venv ($("$py" -c 'import platform; print(platform.python_version())'))"
"$py" -m pip install -q -e '.[test]' >"$venv/install.log" 2>&1 || { cat "$venv/install.log"; exit 1; }
"$py" - <<'PY'
import importlib.metadata as md
print("newest_jax: " + ", ".join(f"{n} {md.version(n)}" for n in ("jax", "jaxlib", "flax", "probjax-attention")))
PY
echo "newest_jax: install took $((SECONDS - start)) s"
set +e
"$py" -m pytest -q -n 2 -m "not slow" "$@"
rc=$?
echo "newest_jax: pytest exit $rc; $((SECONDS - start)) s in all"
exit $rc
