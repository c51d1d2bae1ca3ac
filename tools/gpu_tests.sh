#!/usr/bin/env bash
# The GPU suite on a device machine (one NVIDIA GPU): `pytest --gpu -m "$MARK"` over xdist
# workers that share the GPU. Run it whenever a kernel, tuning data or a dispatch rule changes:
#
#   bash tools/gpu_tests.sh                      # every gpu test (MARK=gpu)
#   MARK="gpu and quick" bash tools/gpu_tests.sh # the few-minute selection
#   WORKERS=1 bash tools/gpu_tests.sh -k mosaic  # extra arguments go to pytest
#
# Workers compile kernels in parallel (the suite is mostly compilation); each allocates GPU
# memory as it needs it (no preallocation), so they fit on one device. Without pytest-xdist
# (or with WORKERS=1) the suite runs in one process. Wheels in .gpu_wheels/ (pytest,
# pytest-xdist, pytest-timeout and their pure-Python dependencies, e.g. `pip download
# --no-deps -d .gpu_wheels pytest-xdist execnet pytest-timeout`) are installed into a scratch
# directory first for machines that lack them. Results: $OUT/gpu_junit.xml when OUT is set.
set -euo pipefail
cd "$(dirname "$0")/.."
site=${TMPDIR:-/tmp}/probjax_gpu_site
if [ -d .gpu_wheels ] && ! python -c "import pytest, xdist, pytest_timeout" 2>/dev/null; then
  for w in .gpu_wheels/*.whl; do
    mod=$(basename "$w" | cut -d- -f1 | tr 'A-Z' 'a-z'); mod=${mod/pytest_xdist/xdist}
    python -c "import $mod" 2>/dev/null || pip install -q --no-index --no-deps --target "$site" "$w"
  done
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}${site:+:$site}"
export XLA_PYTHON_CLIENT_PREALLOCATE=false
workers=${WORKERS:-4}
xdist=()
if [ "$workers" -gt 1 ] && python -c "import xdist" 2>/dev/null; then xdist=(-n "$workers"); fi
junit=()
if [ -n "${OUT:-}" ]; then junit=(--junitxml="$OUT/gpu_junit.xml"); fi
exec python -m pytest --gpu -m "${MARK:-gpu}" "${xdist[@]}" -q -rfE --durations=25 "${junit[@]}" "$@"
