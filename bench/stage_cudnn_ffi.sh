#!/usr/bin/env bash
# Builds probjax's cuDNN FFI extension (probjax/ops/attention/backends/cudnn/_build/, git-ignored) on a
# machine without a GPU: fetches the pinned header packages into .cudnn_ffi/ (git-ignored;
# the GPU machine has cuDNN 9.19.0 and CUDA 13) and runs the build (no CUDA_HOME needed). A device run then
# carries the library: run(..., carry=["probjax/ops/attention/backends/cudnn/_build", ...]).
#
#   bash bench/stage_cudnn_ffi.sh [PYTHON]
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
py="${1:-$root/.venv/bin/python}"
dl="$root/.cudnn_ffi"
mkdir -p "$dl/wheels" "$dl/x"
"$py" -m pip download -q --no-deps -d "$dl/wheels" \
  "nvidia-cudnn-frontend==1.32.0" "nvidia-cudnn-cu13==9.19.0.56" "nvidia-cuda-nvrtc==13.0.88" \
  "nvidia-cuda-runtime==13.0.96" "nvidia-cuda-crt==13.0.88" "nvidia-cuda-cccl==13.0.85" \
  "jaxlib==0.11.2"   # XLA's FFI headers of the oldest supported jaxlib (the GPU machine's): newer ones do not register there
for w in "$dl"/wheels/*.whl; do   # headers only
  unzip -q -o "$w" 'include/*' 'nvidia/*/include/*' 'jaxlib/include/*' -d "$dl/x" 2>/dev/null || true
done
# --output: into _build/ (calls look there first), not the user cache the command defaults to
"$py" -m probjax.ops.attention.backends.cudnn.build --force \
  --output "$root/probjax/ops/attention/backends/cudnn/_build/libprobjax_cudnn_sdpa.so" \
  --frontend-include "$dl/x/include" --cudnn-include "$dl/x/nvidia/cudnn/include" --include "$dl/x/nvidia/cu13/include" \
  --ffi-include "$dl/x/jaxlib/include"
