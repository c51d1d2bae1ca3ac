#!/usr/bin/env bash
# What a type checker sees of probjax's public names (through the lazy `import probjax`,
# probjax.nn and probjax.nn.layers): mypy on tests/typing/user_script.py and the README's quick
# start, which must pass, and on tests/typing/user_errors.py, which must fail with exactly the
# errors its `# error: CODE` comments name (tests/typing/test_mypy.py holds the check; mypy's
# settings are tests/typing/mypy.ini).
#
# Python: $PYTHON, else the checkout's .venv (made by `make test`). Installs mypy there from the
# package index when it is missing (the test extra has it).
set -euo pipefail
cd "$(dirname "$0")/.."
py="${PYTHON:-.venv/bin/python}"
if ! "$py" -c 'import mypy' 2>/dev/null; then
  echo "typecheck: installing mypy into $("$py" -c 'import sys; print(sys.prefix)')"
  "$py" -m pip install -q "mypy>=1.10"
fi
echo "typecheck: $("$py" -m mypy --version)"
"$py" -m mypy --config-file tests/typing/mypy.ini --cache-dir "${TMPDIR:-/tmp}/probjax-mypy-cache/typecheck" \
  tests/typing/user_script.py tests/typing/user_errors.py || true   # the three expected errors, for the log
"$py" -m pytest -q -n 0 -rs tests/typing/test_mypy.py
echo "typecheck: ok"
