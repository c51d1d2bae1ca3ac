#!/usr/bin/env bash
# The GPU suite on a device machine (one NVIDIA GPU): `pytest --gpu -m "$MARK"` over xdist
# workers that share the GPU. Run it whenever a kernel, tuning data or a dispatch rule changes:
#
#   bash tools/gpu_tests.sh                      # every gpu test (MARK=gpu)
#   MARK="gpu and quick" bash tools/gpu_tests.sh # the few-minute selection
#   WORKERS=1 bash tools/gpu_tests.sh -k mosaic  # extra arguments go to pytest
#
# WORKERS is capped by the card's memory (GPU_GIB_PER_WORKER, default 10 GiB a worker).
#
# Workers compile kernels in parallel (the suite is mostly compilation) and allocate GPU memory
# as they need it and free it after (XLA's platform allocator: no preallocated pools that
# grow per worker until the GPU runs out). The benchmark tests (tests/bench/) time
# the GPU and need it alone: they run after, in one process. Without pytest-xdist (or with
# WORKERS=1) everything runs in one process. Wheels in .gpu_wheels/ (pytest, pytest-xdist,
# pytest-timeout and their pure-Python dependencies, e.g. `pip download --no-deps -d
# .gpu_wheels pytest-xdist execnet pytest-timeout`) are installed into a scratch directory
# first for machines that lack them. Results: $OUT/gpu_junit*.xml when OUT is set.
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
export XLA_PYTHON_CLIENT_PREALLOCATE=false XLA_PYTHON_CLIENT_ALLOCATOR=platform
workers=${WORKERS:-4}
# Each worker holds its own compiled kernels and arrays (the largest tests allocate a few GiB):
# at most one worker per GPU_GIB_PER_WORKER of the card's memory, e.g. 14 workers share a 139 GiB
# H200 but an 80 GB H100 takes 7.
per=${GPU_GIB_PER_WORKER:-10}
mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2>/dev/null | head -n 1 || true)
if [ -n "$mib" ] && [ "$mib" -eq "$mib" ] 2>/dev/null; then
  cap=$(( mib / 1024 / per )); [ "$cap" -ge 1 ] || cap=1
  if [ "$workers" -gt "$cap" ]; then
    echo "gpu_tests.sh: $workers workers asked, $cap fit ${mib} MiB at ${per} GiB each: running $cap" >&2
    workers=$cap
  fi
fi
xdist=()
if [ "$workers" -gt 1 ] && python -c "import xdist" 2>/dev/null; then xdist=(-n "$workers"); fi
junit() { if [ -n "${OUT:-}" ]; then echo "--junitxml=$OUT/gpu_junit_$1.xml"; fi; }
common=(--gpu -m "${MARK:-gpu}" -q -rfE --durations=15)
rc=0
python -m pytest "${common[@]}" "${xdist[@]}" --ignore=tests/bench $(junit kernels) "$@" || rc=$?
python -m pytest "${common[@]}" $(junit bench) tests/bench "$@" || { r=$?; [ $r -eq 5 ] || rc=$r; }
exit $rc
