#!/usr/bin/env bash
# One device command: runs benchmark suites in priority order until a deadline,
# resuming from the JSON already in docs/benchmarks/ and writing to $OUT.
#
#   bash docs/scripts/gpu_batch.sh [PLAN] [MINUTES]
#
# PLAN: all (default; priority order below), or a comma list of steps:
#   tests dispatch grid_core peak residuals ext masked tiles tiles_1024 grid_bf16 grid_fp32 tiles_fp32
#   tiles:LENGTHS:DTYPE[:HEAD_DIMS[:MODES]] (the Triton tile sweep at other lengths, '+'-joined lists)
#   tiles_mbwd:LENGTHS[:HEAD_DIMS] (the Mosaic GPU backward's sweep, bf16)
#   tiles_mosaic (the Mosaic GPU forward's tile sweep, bf16 T4096), tiles_mosaic_1024 (T1024,
#     where one compute warpgroup's 64-row CTAs may fill the SMs better)
#   probe (docs/scripts/probe_cudnn.py: jax.nn's cuDNN route against torch's, layouts and versions)
#   probe_odd (docs/scripts/probe_odd_lengths.py: the Triton kernel at odd lengths, pads vs kernel)
#   probe_gap (docs/scripts/probe_dispatch_gap.py: JAX's wall clock beyond kernel time, per setting;
#     GAP_SETTINGS=suites: only the suites' setting)
#   probe_sched (docs/scripts/probe_mosaic_persistent.py: the Mosaic forward's schedules)
#   probe_cluster (docs/scripts/probe_mosaic_cluster.py: the Mosaic forward in CTA pairs, K/V multicast)
#   probe_bwd (docs/scripts/probe_mosaic_backward.py: the Mosaic backward with dQ fused, against two kernels)
#   probe_layout (docs/scripts/probe_layout.py: Triton kernel and torch flex, each in both layouts)
#   probe_interleaved (docs/scripts/probe_interleaved.py: the cuDNN routes timed in one process)
#   probe_sharding (docs/scripts/probe_sharding.py: the default on two GPUs, batch and heads sharded)
#   probe_ffi_overhead (docs/scripts/probe_ffi_overhead.py: one cuDNN call per program against eight)
#   interleaved:LENGTHS:HEAD_DIMS:CAUSAL:MODES:IMPLS[:MASK[:BATCH+HEADS]] (the same probe for any
#     implementations, e.g. interleaved:16384:64+128:false:fwd+fwd_bwd:probjax_triton+torch_flex, or
#     the masked suite's interleaved:16384:128:false:fwd_bwd:probjax_default+torch_flex:docs4:1+16)
#   probe_ptx (docs/scripts/probe_ptx.py: the Triton forward's PTX against torch flex's)
#   grid:LENGTHS:DTYPE[:HEAD_DIMS[:MODES]]  (lists joined by '+', as the plan splits on commas;
#     e.g. grid:4096:bf16, grid:1024+16384:bf16:64+128:fwd): the grid with the core implementations only ($CORE_JAX, $CORE_TORCH; set GRID_ALL=1 for all)
#   gridall:LENGTHS:DTYPE[:HEAD_DIMS[:MODES]]  the same with every implementation
#   gridr:LENGTHS:DTYPE[:HEAD_DIMS[:MODES]]  the core implementations, JAX and torch, in one process, each
#     shape's timed in $ROUNDS (3) rotating rounds (harness --rounds); replaces those shapes' grid rows
#   gqar  the GQA suite's rows of $GQA_IMPLS the same way (kernel_attn_ext_gpu.json)
# DEVICE_TIME=1: every suite also records device_ms (kernel time from a profile).
# DIFFERENCED=1: suites and interleaved probes time each repeat as (2n calls - n calls) / n.
# The SM clock, temperature and power are sampled every 0.5 s into $OUT/gpu_clocks.csv.
# (tests: pytest --gpu on the gpu-marked tests (tests:EXPR: only those matching -k EXPR), failures printed as they happen, log in
# $OUT/gpu_tests.log; it gets at most a third of the remaining time, or TESTS_MAX_S seconds)
# (grid_core: bf16 at T = 1024, 4096, 16384; grid_bf16 fills the other lengths)
# Each step writes $OUT/<file>.json, first copying docs/benchmarks/<file>.json
# there so that --append skips rows already measured. After the run, copy the
# returned files into docs/benchmarks/ and run the same command again to
# continue. Output: a short log per step (no progress bar), $OUT/batch.log.
set -u
PLAN="${1:-all}"
MINUTES="${2:-8.5}"
OUT="${OUT:-/tmp/bench_out}"
mkdir -p "$OUT"
source docs/scripts/gpu_env.sh
# The device gets the working tree without .git: pass the commit in, e.g.
#   PROBJAX_COMMIT=$(git rev-parse --short HEAD) bash docs/scripts/gpu_batch.sh ...
echo "[batch] probjax commit: ${PROBJAX_COMMIT:-unknown}" | tee -a "$OUT/batch.log"
start=$(date +%s)
deadline=$(python3 -c "print($start + int(60*$MINUTES))")
[ "$PLAN" = all ] && PLAN="dispatch,grid_core,peak,residuals,ext,masked,tiles,grid_bf16,grid_fp32,tiles_fp32"

left_min() { python3 -c "import time; print(max(0.0, ($deadline - time.time())/60 - 0.7))"; }

run_step() {  # file module args...
  local file="$1"; shift
  local mins; mins=$(left_min)
  if python3 -c "import sys; sys.exit(0 if $mins > 0.3 else 1)"; then :; else
    echo "[batch] no time left for $file $*" | tee -a "$OUT/batch.log"; return; fi
  [ -f "docs/benchmarks/$file" ] && [ ! -f "$OUT/$file" ] && cp "docs/benchmarks/$file" "$OUT/$file"
  echo "[batch] $(date +%T) $file: $* (max ${mins} min)" | tee -a "$OUT/batch.log"
  $PY -m "$@" --output "$OUT/$file" --append --no-progress --max-minutes "$mins" \
    ${DEVICE_TIME:+--device-time} ${DIFFERENCED:+--differenced} 2>&1 \
    | grep -E "^\[harness\] (done|--max|[0-9]+ case)|^Traceback|^[A-Za-z.]*Error" | tail -5 | tee -a "$OUT/batch.log"
}

run_probe() {  # file module: a GPU probe writing its own JSON (one run, not resumed)
  echo "[batch] $(date +%T) $2" | tee -a "$OUT/batch.log"
  timeout "$(python3 -c "print(int(60 * $(left_min)))")" $PY -m "$2" --output "$OUT/$1" 2>&1 | tail -40 \
    | tee -a "$OUT/batch.log"
}

remeasure() {  # file drop_rows-filters...: drops those rows of $OUT/file (copied from docs/benchmarks
  # first) so that a --rounds step measures them again in one process
  local file="$1"; shift
  [ -f "docs/benchmarks/$file" ] && [ ! -f "$OUT/$file" ] && cp "docs/benchmarks/$file" "$OUT/$file"
  [ -f "$OUT/$file" ] && $PY -m docs.scripts.drop_rows "$OUT/$file" "$@" | tee -a "$OUT/batch.log"
}

# torch runs in its own process after the JAX side of a step (JAX's allocator keeps
# the memory it grew to, which would starve torch in the same process).
split() {  # file module args...: JAX-side process, then torch-side process
  run_step "$@" --skip-impl 'torch_*'
  run_step "$@" --impl 'torch_*'
}
# The peers the issues' targets name, and every probjax implementation that times a kernel.
# CORE_JAX / CORE_TORCH set in the environment narrow a short run to the rows it needs.
CORE_JAX="${CORE_JAX:-probjax_default,probjax_triton*,probjax_mosaic*,jaxnn_cudnn,tokamax_triton,tokamax_mosaic}"
CORE_TORCH="${CORE_TORCH:-torch_sdpa_flash,torch_sdpa_cudnn,torch_flex}"
# Issue 4's GQA rows: the default against the peers of the GQA suite that take GQA natively.
GQA_IMPLS="${GQA_IMPLS:-probjax_default,probjax_triton,jaxnn_cudnn,torch_sdpa_flash,torch_flex}"
# fp32: the XLA paths (the fp32 rule's comparison) and the torch backends that take fp32.
CORE_JAX_FP32='probjax_default,probjax_triton,probjax_xla,jaxnn_xla,jaxnn_cudnn,tokamax_triton'
CORE_TORCH_FP32='torch_sdpa_efficient,torch_sdpa_math,torch_flex'
core() {  # dtype file module args...: core implementations, JAX side then torch side
  local dt="$1"; shift
  if [ "${GRID_ALL:-0}" = 1 ]; then split "$@"; return; fi
  if [ "$dt" = fp32 ]; then
    run_step "$@" --impl "$CORE_JAX_FP32"; run_step "$@" --impl "$CORE_TORCH_FP32"
  else
    run_step "$@" --impl "$CORE_JAX"; run_step "$@" --impl "$CORE_TORCH"
  fi
}

if command -v nvidia-smi >/dev/null; then
  nvidia-smi --query-gpu=timestamp,index,clocks.sm,clocks.mem,temperature.gpu,power.draw,clocks_throttle_reasons.active \
    --format=csv -lms 500 > "$OUT/gpu_clocks.csv" 2>/dev/null &
  clock_pid=$!
  trap 'kill $clock_pid 2>/dev/null' EXIT
fi
IFS=',' read -ra steps <<< "$PLAN"
for s in "${steps[@]}"; do
  case "$s" in
    tests|tests:*) t=${TESTS_MAX_S:-$(python3 -c "print(int(60 * $(left_min) / 3))")}
               sel="${s#tests}"; sel="${sel#:}"
               echo "[batch] $(date +%T) tests ${sel:+-k $sel }(max ${t} s)" | tee -a "$OUT/batch.log"
               timeout "$t" $PY -m pytest tests --gpu -m gpu -q -p no:cacheprovider -n 4 --durations=8 \
                 ${sel:+-k "$sel"} > "$OUT/gpu_tests.log" 2>&1
               grep -E "^\[FAILED\]|passed|failed" "$OUT/gpu_tests.log" | tail -20 | tee -a "$OUT/batch.log" ;;
    dispatch)  run_step kernel_attn_gpu_dispatch.json docs.scripts.benchmark_kernel_attn_gpu --device gpu --suite dispatch ;;
    grid_core) split gpu_attention.json docs.scripts.benchmark_gpu_attention --suite grid --dtypes bf16 --lengths 1024,4096,16384 ;;
    peak)      run_step kernel_attn_gpu_memory.json docs.scripts.benchmark_kernel_attn_gpu --device gpu --suite peak --child-timeout 100 ;;
    residuals) run_step kernel_attn_gpu_residuals.json docs.scripts.benchmark_kernel_attn_gpu --device gpu --suite residuals ;;
    ext)       split kernel_attn_ext_gpu.json docs.scripts.benchmark_kernel_attn_ext --device gpu --suite gqa,decode ;;
    masked)    split gpu_attention.json docs.scripts.benchmark_gpu_attention --suite masked ;;
    probe)     run_step cudnn_probe.json docs.scripts.probe_cudnn ;;
    probe_odd) run_step odd_probe.json docs.scripts.probe_odd_lengths ;;
    probe_sched) run_probe mosaic_schedule.json docs.scripts.probe_mosaic_persistent ;;
    probe_cluster) run_probe mosaic_cluster.json docs.scripts.probe_mosaic_cluster ;;
    probe_bwd) run_probe mosaic_backward.json docs.scripts.probe_mosaic_backward ;;
    probe_layout) run_probe layout_probe.json docs.scripts.probe_layout ;;
    probe_interleaved) run_probe interleaved_probe.json docs.scripts.probe_interleaved ;;
    probe_sharding) run_probe sharding_probe.json docs.scripts.probe_sharding ;;
    probe_ffi_overhead) run_probe ffi_overhead_probe.json docs.scripts.probe_ffi_overhead ;;
    interleaved:*) IFS=':' read -r _ lens dims causal modes impls mask bh <<< "$s"   # one process, rotating rounds
               bh="${bh:-4+8}"; mask="${mask:-none}"
               echo "[batch] $(date +%T) $s" | tee -a "$OUT/batch.log"
               timeout "$(python3 -c "print(int(60 * $(left_min)))")" $PY -m docs.scripts.probe_interleaved \
                 --output "$OUT/interleaved_${lens//+/_}_d${dims//+/_}_${mask}.json" --lengths "${lens//+/,}" \
                 --head-dims "${dims//+/,}" --causal "$causal" --modes "${modes//+/,}" --impls "${impls//+/,}" \
                 --mask "$mask" --batch "${bh%+*}" --heads "${bh#*+}" ${DIFFERENCED:+--differenced} 2>&1 | tail -40 | tee -a "$OUT/batch.log" ;;
    probe_ptx) (export PROBJAX_XLA_DUMP=/tmp/xla_dump_ptx
                export XLA_FLAGS="${XLA_FLAGS:-} --xla_dump_to=/tmp/xla_dump_ptx --xla_gpu_dump_llvmir --xla_dump_emitter_re=triton"
                run_probe ptx_probe.json docs.scripts.probe_ptx) ;;
    probe_gap) echo "[batch] $(date +%T) probe_gap" | tee -a "$OUT/batch.log"
               $PY -m docs.scripts.probe_dispatch_gap --output "$OUT/dispatch_gap.json" \
                 ${GAP_SETTINGS:+--settings "$GAP_SETTINGS"} 2>&1 | tail -40 \
                 | tee -a "$OUT/batch.log" ;;
    tiles)     run_step gpu_attention_tiles.json docs.scripts.benchmark_gpu_attention_tiles --dtypes bf16 ;;
    tiles_1024) run_step gpu_attention_tiles.json docs.scripts.benchmark_gpu_attention_tiles --dtypes bf16 --lengths 1024 ;;
    tiles:*)   IFS=':' read -r _ lens dt dims modes <<< "$s"   # tiles:LENGTHS:DTYPE[:HEAD_DIMS[:MODES]]
               run_step gpu_attention_tiles.json docs.scripts.benchmark_gpu_attention_tiles --dtypes "$dt" \
                 --lengths "${lens//+/,}" --head-dims "$(d=${dims:-64+128}; echo "${d//+/,}")" \
                 --modes "$(m=${modes:-fwd+fwd_bwd}; echo "${m//+/,}")" ;;
    tiles_mbwd:*) IFS=':' read -r _ lens dims <<< "$s"   # tiles_mbwd:LENGTHS[:HEAD_DIMS]: the Mosaic backward
               run_step gpu_attention_tiles.json docs.scripts.benchmark_gpu_attention_tiles --kernel mosaic_bwd \
                 --dtypes bf16 --lengths "${lens//+/,}" --head-dims "$(d=${dims:-64+128}; echo "${d//+/,}")" ;;
    tiles_fp32) run_step gpu_attention_tiles.json docs.scripts.benchmark_gpu_attention_tiles --dtypes fp32 ;;
    tiles_mosaic) run_step gpu_attention_tiles.json docs.scripts.benchmark_gpu_attention_tiles --kernel mosaic --dtypes bf16 ;;
    tiles_mosaic_1024) run_step gpu_attention_tiles.json docs.scripts.benchmark_gpu_attention_tiles --kernel mosaic --dtypes bf16 --lengths 1024 ;;
    grid_bf16) split gpu_attention.json docs.scripts.benchmark_gpu_attention --suite grid --dtypes bf16 ;;
    grid_fp32) split gpu_attention.json docs.scripts.benchmark_gpu_attention --suite grid --dtypes fp32 ;;
    gridr:*)   IFS=':' read -r _ lens dt dims modes <<< "$s"   # the grid in one process, rotating rounds
               dims="${dims:-64+128}"; modes="${modes:-fwd+fwd_bwd}"
               dtname=$(python3 -c "print({'bf16': 'bfloat16', 'fp16': 'float16', 'fp32': 'float32'}['$dt'])")
               remeasure gpu_attention.json --suite grid --impl "$CORE_JAX,$CORE_TORCH" --dtype "$dtname" \
                 --q_len "${lens//+/,}" --head_dim "${dims//+/,}" --mode "${modes//+/,}"
               run_step gpu_attention.json docs.scripts.benchmark_gpu_attention --suite grid --dtypes "$dt" \
                 --lengths "${lens//+/,}" --head-dims "${dims//+/,}" --modes "${modes//+/,}" \
                 --impl "$CORE_JAX,$CORE_TORCH" --rounds "${ROUNDS:-3}" ;;
    gqar)      remeasure kernel_attn_ext_gpu.json --suite gqa --impl "$GQA_IMPLS"   # the GQA suite in one process
               run_step kernel_attn_ext_gpu.json docs.scripts.benchmark_kernel_attn_ext --device gpu --suite gqa \
                 --impl "$GQA_IMPLS" --rounds "${ROUNDS:-3}" ;;
    grid:*|gridall:*) IFS=':' read -r kind lens dt dims modes <<< "$s"
               all=$([ "$kind" = gridall ] && echo 1 || echo "${GRID_ALL:-0}")
               GRID_ALL=$all core "$dt" gpu_attention.json docs.scripts.benchmark_gpu_attention --suite grid --dtypes "$dt" \
                 --lengths "${lens//+/,}" --head-dims "$(d=${dims:-64+128}; echo "${d//+/,}")" \
                 --modes "$(m=${modes:-fwd+fwd_bwd}; echo "${m//+/,}")" ;;
    *) echo "[batch] unknown step $s" ;;
  esac
done
for f in "$OUT"/*.json; do [ -f "$f" ] && echo "$(basename "$f"): $(wc -l < "$f") rows, $(grep -c '"status": "ok"' "$f") ok"; done
echo "[batch] finished in $(( $(date +%s) - start )) s"
