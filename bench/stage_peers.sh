#!/usr/bin/env bash
# Copies the peer wheels (tokamax 0.0.17 and the dependencies the GPU machine lacks)
# and tokamax's profiler stub from ../shared/wheels into the git-ignored .peers/,
# so that a device run can carry them (run(..., carry=[".peers"])).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
src="${1:-$root/../shared/wheels}"
[ -d "$src" ] || src=/work/shared/wheels
rm -rf "$root/.peers"
mkdir -p "$root/.peers/wheels"
cp "$src"/*.whl "$root/.peers/wheels/"
cp -r "$src/stubs" "$root/.peers/stubs"
du -sh "$root/.peers"
