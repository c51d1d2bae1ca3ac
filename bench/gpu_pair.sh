#!/usr/bin/env bash
# Two gpu_batch.sh plans at once on a two-GPU host (device kind nvidia-h200-x2), one per
# GPU, each with its peers on its own GPU; then their rows are merged into $OUT/results.tar.gz.
#
#   PROBJAX_COMMIT=$(git rev-parse --short HEAD) bash bench/gpu_pair.sh PLAN0 PLAN1 [MINUTES]
#
# PLANs as in gpu_batch.sh. Logs (batch logs, test logs, stdout of both GPUs): $OUT/logs.txt.
# Rows of one suite measured on both GPUs are merged by key (bench/merge_rows.py).
set -u
OUT="${OUT:-/tmp/bench_out}"
MINUTES="${3:-8.5}"
mkdir -p "$OUT/gpu0" "$OUT/gpu1"
source bench/gpu_env.sh   # installs the peers once for both batches
n=$($PY -c "import jax; print(len(jax.devices('gpu')))" 2>/dev/null || echo 0)
if [ "$n" -lt 2 ]; then
  echo "[pair] $n GPU(s): running both plans one after the other on GPU 0" | tee -a "$OUT/pair.log"
  OUT="$OUT/gpu0" bash bench/gpu_batch.sh "$1,$2" "$MINUTES"
else
  export PROBJAX_CONCURRENT_SUITES=2   # recorded in every row (noise: two suites share the host)
  CUDA_VISIBLE_DEVICES=0 OUT="$OUT/gpu0" bash bench/gpu_batch.sh "$1" "$MINUTES" > "$OUT/gpu0.out" 2>&1 &
  CUDA_VISIBLE_DEVICES=1 OUT="$OUT/gpu1" bash bench/gpu_batch.sh "$2" "$MINUTES" > "$OUT/gpu1.out" 2>&1 &
  wait
fi
tmp=$(mktemp -d /tmp/bench_pair.XXXXXX)
mkdir -p "$tmp/merged"
for i in 0 1; do
  mkdir -p "$tmp/gpu$i"
  [ -f "$OUT/gpu$i/results.tar.gz" ] && tar xzf "$OUT/gpu$i/results.tar.gz" -C "$tmp/gpu$i"
done
$PY -m bench.merge_rows "$tmp/merged" "$tmp/gpu0" "$tmp/gpu1"
[ -n "$(ls -A "$tmp/merged")" ] && tar czf "$OUT/results.tar.gz" -C "$tmp/merged" .
# At most 8 files come back from a device call: every log goes into one file.
for i in 0 1; do
  for f in "$OUT/gpu$i.out" "$OUT/gpu$i"/*.log; do [ -f "$f" ] && { echo "===== GPU $i: $(basename "$f")"; cat "$f"; }; done
done > "$OUT/logs.txt"
rm -rf "$OUT"/gpu0 "$OUT"/gpu1 "$OUT"/gpu0.out "$OUT"/gpu1.out
grep -E "^=====|^\[batch\]|^\[harness\] done|passed|failed|^FAILED" "$OUT/logs.txt"
