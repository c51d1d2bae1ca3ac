#!/usr/bin/env bash
# One device command: runs benchmark suites in priority order until a deadline, resuming
# from the rows already in bench/results/ and writing to $OUT/results/<device>/<suite>.json.
#
#   PROBJAX_COMMIT=$(git rev-parse --short HEAD) bash bench/gpu_batch.sh [PLAN] [MINUTES]
#
# PLAN: all (default; priority order below), or a comma list of steps:
#   tests dispatch grid_core peak residuals ext masked tiles tiles_1024 grid_bf16 grid_fp32 tiles_fp32
#   tiles:LENGTHS:DTYPE[:HEAD_DIMS[:MODES]] (the Triton tile sweep at other lengths, '+'-joined lists)
#   tiles_mbwd:LENGTHS[:HEAD_DIMS] (the Mosaic GPU backward's sweep, bf16)
#   tiles_mosaic (the Mosaic GPU forward's tile sweep, bf16 T4096), tiles_mosaic_1024 (T1024)
#   interleaved:LENGTHS:HEAD_DIMS:CAUSAL:MODES:IMPLS[:MASK[:BATCH+HEADS]] (bench/interleaved.py: chosen
#     implementations in one process, rotating rounds; replaces those rows of interleaved.json), e.g.
#     interleaved:4096:64+128:both:fwd+fwd_bwd:probjax_default+probjax_cudnn+jaxnn_cudnn+torch_sdpa_cudnn,
#     or the masked suite's interleaved:16384:128:false:fwd_bwd:probjax_default+torch_flex:docs4:1+16
#   grid:LENGTHS:DTYPE[:HEAD_DIMS[:MODES]]  (lists joined by '+', as the plan splits on commas;
#     e.g. grid:4096:bf16, grid:1024+16384:bf16:64+128:fwd): the grid with the core implementations
#     only ($CORE_JAX, $CORE_TORCH; set GRID_ALL=1 for all)
#   gridall:LENGTHS:DTYPE[:HEAD_DIMS[:MODES]]  the same with every implementation
#   gridr:LENGTHS:DTYPE[:HEAD_DIMS[:MODES]]  the core implementations, JAX and torch, in one process, each
#     shape's timed in $ROUNDS (3) rotating rounds (harness --rounds); replaces those shapes' grid rows
#   gqar  the GQA suite's rows of $GQA_IMPLS the same way
# DEVICE_TIME=1: every suite also records device_ms (kernel time from a profile).
# DIFFERENCED=1: every step times each repeat as (2n calls - n calls) / n; for device-bound calls
#   only (host-bound ones, e.g. T1024, scatter under it: docs/dev/decisions.md, "Timing").
# The SM clock, temperature, power and throttle reasons are sampled every 0.5 s into
# $OUT/gpu_clocks.csv (to read a run's noise; not committed).
# newops_tests: the grouped-matmul, scan and MoE tests with their kernels compiled (not interpreted).
# moe[:SUITES[:TOKENS]], scan[:MODES], lm[:SECTIONS], dit[:CASES[:VARIANTS]], mla[:SUITES] ('+'-joined lists;
#   dit's VARIANTS default bench/dit_step.py's, e.g. dit:S+B:baseline+scanned+xla_cmdbuf_off, dit::scanned.flat_adamw):
#   bench/moe.py, bench/scan.py, bench/lm_step.py, bench/dit_step.py, bench/mla.py into
#   $RES/<device>/{moe,scan,lm_step,dit_step,mla}.json, resumed.
# lce: bench/linear_cross_entropy.py (the fused loss against the unfused head: memory and ms) into
#   $RES/<device>/lce.json.
# isab[:SIZES] ('+'-joined set sizes): bench/isab.py (the ISAB block, head_dim 32, against jax.nn
#   and torch flex_attention; about 4 minutes on an H200) into $RES/<device>/isab.json, resumed.
# (tests: pytest --gpu on the gpu-marked tests (tests:EXPR: only those matching -k EXPR), failures
# printed as they happen, log in $OUT/gpu_tests.log; it gets at most a third of the remaining
# time, or TESTS_MAX_S seconds)
# (grid_core: bf16 at T = 1024, 4096, 16384; grid_bf16 fills the other lengths)
# The suites write into $RES (default: a fresh copy of bench/results under /tmp), so that --append
# skips rows already measured; at the end the files that changed go to $OUT/results.tar.gz (one
# file: a device call returns at most 8). Here, afterwards:
#   mkdir -p /tmp/r && tar xzf FILES_AT/results.tar.gz -C /tmp/r && python -m bench.merge_rows bench/results /tmp/r
# and the same command again continues. Output: a short log per step, $OUT/batch.log.
# DRY_RUN=1: print each step's command ("[dry] ..."), run and copy nothing, no peers installed
# (tests/bench/test_bench_runner.py checks that every step names a suite and options it has).
set -u
PLAN="${1:-all}"
MINUTES="${2:-8.5}"
OUT="${OUT:-/tmp/bench_out}"
DRY_RUN="${DRY_RUN:-}"
mkdir -p "$OUT"
if [ -n "$DRY_RUN" ]; then PY="${PY:-python3}"; else source bench/gpu_env.sh; fi
echo "[batch] probjax commit: ${PROBJAX_COMMIT:-unknown}" | tee -a "$OUT/batch.log"
if [ -n "$DRY_RUN" ]; then RES="${RES:-/tmp/bench_results.dry}"; else RES="${RES:-$(mktemp -d /tmp/bench_results.XXXXXX)}"; fi
[ -n "$DRY_RUN" ] || [ -n "$(ls -A "$RES" 2>/dev/null)" ] || cp -r bench/results/. "$RES"/
if [ -n "$DRY_RUN" ]; then DEV=dry; else DEV=$($PY -c "from bench import harness; print(harness.device_slug())"); fi
echo "[batch] rows go to $RES/$DEV/" | tee -a "$OUT/batch.log"
start=$(date +%s)
deadline=$(python3 -c "print($start + int(60*$MINUTES))")
[ "$PLAN" = all ] && PLAN="dispatch,grid_core,peak,residuals,ext,masked,tiles,grid_bf16,grid_fp32,tiles_fp32"

left_min() {  # minutes left before the deadline, less 0.7 for the step's exit and the copy
  if [ -n "$DRY_RUN" ]; then echo "$MINUTES"; return; fi
  python3 -c "import time; print(max(0.0, ($deadline - time.time())/60 - 0.7))"
}
left_s() { python3 -c "print(int(60 * $(left_min)))"; }
commas() { echo "${1//+/,}"; }   # a step's '+'-joined list (the plan splits on commas)
log() { echo "[batch] $(date +%T) $*" | tee -a "$OUT/batch.log"; }

run_step() {  # module args...: one harness suite run, resumed (--append) into $RES
  local mins; mins=$(left_min)
  if [ -n "$DRY_RUN" ] || python3 -c "import sys; sys.exit(0 if $mins > 0.3 else 1)"; then :; else
    echo "[batch] no time left for $*" | tee -a "$OUT/batch.log"; return; fi
  log "$* (max ${mins} min)"
  set -- "$@" --results-dir "$RES" --append --no-progress --max-minutes "$mins" \
    ${DEVICE_TIME:+--device-time} ${DIFFERENCED:+--differenced}
  if [ -n "$DRY_RUN" ]; then echo "[dry] $PY -m $*"; return; fi
  $PY -m "$@" 2>&1 \
    | grep -E "^\[harness\] (done|--max|[0-9]+ case)|^Traceback|^[A-Za-z.]*Error" | tail -5 | tee -a "$OUT/batch.log"
}

own_step() {  # LINES python-args...: a suite with its own runner (moe, scan, lm, dit, mla, isab,
  # interleaved), cut at the deadline; the last LINES lines of its output go to the log
  local lines="$1"; shift
  log "$s"
  if [ -n "$DRY_RUN" ]; then echo "[dry] $PY $*"; return; fi
  timeout "$(left_s)" $PY "$@" 2>&1 | tail -"$lines" | tee -a "$OUT/batch.log"
}

tests_step() {  # LOG pytest-args...: GPU tests, at most a third of the remaining time (or TESTS_MAX_S)
  local logf="$OUT/$1" t; shift
  t=${TESTS_MAX_S:-$(python3 -c "print(int(60 * $(left_min) / 3))")}
  log "$s (max ${t} s)"
  if [ -n "$DRY_RUN" ]; then echo "[dry] $PY -m pytest --gpu -q -p no:cacheprovider $*"; return; fi
  timeout "$t" $PY -m pytest --gpu -q -p no:cacheprovider "$@" > "$logf" 2>&1
  grep -E "^\[FAILED\]|passed|failed" "$logf" | tail -20 | tee -a "$OUT/batch.log"
}

remeasure() {  # suite drop_rows-filters...: drops those rows of the suite's file, so that a
  # --rounds step measures them again in one process
  local file="$RES/$DEV/$1.json"; shift
  if [ -n "$DRY_RUN" ]; then echo "[dry] $PY -m bench.drop_rows $file $*"; return; fi
  [ -f "$file" ] && $PY -m bench.drop_rows "$file" "$@" | tee -a "$OUT/batch.log"
}

# torch runs in its own process after the JAX side of a step (JAX's allocator keeps
# the memory it grew to, which would starve torch in the same process).
split() {  # module args...: JAX-side process, then torch-side process
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
core() {  # dtype module args...: core implementations, JAX side then torch side
  local dt="$1"; shift
  if [ "${GRID_ALL:-0}" = 1 ]; then split "$@"; return; fi
  if [ "$dt" = fp32 ]; then
    run_step "$@" --impl "$CORE_JAX_FP32"; run_step "$@" --impl "$CORE_TORCH_FP32"
  else
    run_step "$@" --impl "$CORE_JAX"; run_step "$@" --impl "$CORE_TORCH"
  fi
}

if [ -z "$DRY_RUN" ] && command -v nvidia-smi >/dev/null; then
  nvidia-smi --query-gpu=timestamp,index,clocks.sm,clocks.mem,temperature.gpu,power.draw,clocks_throttle_reasons.active \
    --format=csv -lms 500 > "$OUT/gpu_clocks.csv" 2>/dev/null &
  clock_pid=$!
  trap 'kill $clock_pid 2>/dev/null' EXIT
fi
IFS=',' read -ra steps <<< "$PLAN"
for s in "${steps[@]}"; do
  case "$s" in
    tests|tests:*) sel="${s#tests}"; sel="${sel#:}"
               tests_step gpu_tests.log tests -m gpu -n "${TEST_WORKERS:-2}" --durations=8 ${sel:+-k "$sel"} ;;
    newops_tests) tests_step newops_tests.log -n 6 -m "not slow" \
                 tests/ops/grouped_matmul/test_grouped_matmul.py tests/ops/scan/test_scan.py tests/nn/test_moe.py ;;
    moe|moe:*) suites="${s#moe}"; suites="${suites#:}"   # moe[:SUITES+...[:TOKENS+...]]
               IFS=':' read -r suites tokens <<< "${suites:-moe_train+moe_fwd+gmm}"
               own_step 5 -m bench.moe --suite "$(commas "$suites")" ${tokens:+--tokens "$(commas "$tokens")"} \
                 --output "$RES/$DEV/moe.json" --append --no-progress --max-minutes "$(left_min)" ;;
    scan|scan:*) modes="${s#scan}"; modes="${modes#:}"   # scan[:MODES+...]
               own_step 5 -m bench.scan --modes "$(commas "${modes:-fwd+fwd_bwd}")" \
                 --output "$RES/$DEV/scan.json" --append --max-minutes "$(left_min)" ;;
    lm|lm:*)   sections="${s#lm}"; sections="${sections#:}"   # lm[:SECTIONS+...]
               own_step 12 bench/lm_step.py --sections "$(commas "${sections:-matmul+train+train_packed+decode}")" \
                 --output "$RES/$DEV/lm_step.json" --max-minutes "$(left_min)" ;;
    dit|dit:*) IFS=':' read -r _ cases variants <<< "$s"   # dit[:CASES+...[:VARIANTS+...]]: bench/dit_step.py
               own_step 24 bench/dit_step.py ${cases:+--cases "$(commas "$cases")"} \
                 ${variants:+--variants "$(commas "$variants")"} --output "$RES/$DEV/dit_step.json" --max-minutes "$(left_min)" ;;
    mla|mla:*) suites="${s#mla}"; suites="${suites#:}"   # mla[:SUITES+...]: bench/mla.py
               own_step 8 -m bench.mla ${suites:+--suite "$(commas "$suites")"} --output "$RES/$DEV/mla.json" ;;
    isab|isab:*) sizes="${s#isab}"; sizes="${sizes#:}"   # isab[:SIZES+...]: bench/isab.py
               own_step 12 -m bench.isab ${sizes:+--sizes "$(commas "$sizes")"} \
                 --output "$RES/$DEV/isab.json" --append --no-progress --max-minutes "$(left_min)" ;;
    lce)       own_step 8 -m bench.linear_cross_entropy --output "$RES/$DEV/lce.json" ;;  # the fused loss vs the unfused head
    dispatch)  run_step bench.benchmark_kernel_attn_gpu --device gpu --suite dispatch ;;
    grid_core) split bench.benchmark_gpu_attention --suite grid --dtypes bf16 --lengths 1024,4096,16384 ;;
    peak)      run_step bench.benchmark_kernel_attn_gpu --device gpu --suite peak --child-timeout 100 ;;
    residuals) run_step bench.benchmark_kernel_attn_gpu --device gpu --suite residuals ;;
    ext)       split bench.benchmark_kernel_attn_ext --device gpu --suite gqa,decode ;;
    masked)    split bench.benchmark_gpu_attention --suite masked ;;
    interleaved:*) IFS=':' read -r _ lens dims causal modes impls mask bh <<< "$s"   # one process, rotating rounds
               bh="${bh:-4+8}"; mask="${mask:-none}"
               own_step 5 -m bench.interleaved --results-dir "$RES" --no-progress --lengths "$(commas "$lens")" \
                 --head-dims "$(commas "$dims")" --causal "$causal" --modes "$(commas "$modes")" \
                 --impls "$(commas "$impls")" --mask "$mask" --batch "${bh%+*}" --heads "${bh#*+}" \
                 ${DIFFERENCED:+--differenced} ;;
    tiles)     run_step bench.benchmark_gpu_attention_tiles --dtypes bf16 ;;
    tiles_1024) run_step bench.benchmark_gpu_attention_tiles --dtypes bf16 --lengths 1024 ;;
    tiles:*)   IFS=':' read -r _ lens dt dims modes <<< "$s"   # tiles:LENGTHS:DTYPE[:HEAD_DIMS[:MODES]]
               run_step bench.benchmark_gpu_attention_tiles --dtypes "$dt" \
                 --lengths "$(commas "$lens")" --head-dims "$(commas "${dims:-64+128}")" \
                 --modes "$(commas "${modes:-fwd+fwd_bwd}")" ;;
    tiles_mbwd:*) IFS=':' read -r _ lens dims <<< "$s"   # tiles_mbwd:LENGTHS[:HEAD_DIMS]: the Mosaic backward
               run_step bench.benchmark_gpu_attention_tiles --kernel mosaic_bwd \
                 --dtypes bf16 --lengths "$(commas "$lens")" --head-dims "$(commas "${dims:-64+128}")" ;;
    tiles_fp32) run_step bench.benchmark_gpu_attention_tiles --dtypes fp32 ;;
    tiles_mosaic) run_step bench.benchmark_gpu_attention_tiles --kernel mosaic --dtypes bf16 ;;
    tiles_mosaic_1024) run_step bench.benchmark_gpu_attention_tiles --kernel mosaic --dtypes bf16 --lengths 1024 ;;
    grid_bf16) split bench.benchmark_gpu_attention --suite grid --dtypes bf16 ;;
    grid_fp32) split bench.benchmark_gpu_attention --suite grid --dtypes fp32 ;;
    gridr:*)   IFS=':' read -r _ lens dt dims modes <<< "$s"   # the grid in one process, rotating rounds
               dims="${dims:-64+128}"; modes="${modes:-fwd+fwd_bwd}"
               dtname=$(python3 -c "print({'bf16': 'bfloat16', 'fp16': 'float16', 'fp32': 'float32'}['$dt'])")
               remeasure grid --suite grid --impl "$CORE_JAX,$CORE_TORCH" --dtype "$dtname" \
                 --q_len "$(commas "$lens")" --head_dim "$(commas "$dims")" --mode "$(commas "$modes")"
               run_step bench.benchmark_gpu_attention --suite grid --dtypes "$dt" \
                 --lengths "$(commas "$lens")" --head-dims "$(commas "$dims")" --modes "$(commas "$modes")" \
                 --impl "$CORE_JAX,$CORE_TORCH" --rounds "${ROUNDS:-3}" ;;
    gqar)      remeasure gqa --suite gqa --impl "$GQA_IMPLS"   # the GQA suite in one process
               run_step bench.benchmark_kernel_attn_ext --device gpu --suite gqa \
                 --impl "$GQA_IMPLS" --rounds "${ROUNDS:-3}" ;;
    grid:*|gridall:*) IFS=':' read -r kind lens dt dims modes <<< "$s"
               all=$([ "$kind" = gridall ] && echo 1 || echo "${GRID_ALL:-0}")
               GRID_ALL=$all core "$dt" bench.benchmark_gpu_attention --suite grid --dtypes "$dt" \
                 --lengths "$(commas "$lens")" --head-dims "$(commas "${dims:-64+128}")" \
                 --modes "$(commas "${modes:-fwd+fwd_bwd}")" ;;
    *) echo "[batch] unknown step $s" ;;
  esac
done
[ -n "$DRY_RUN" ] && exit 0
changed=()
while IFS= read -r f; do cmp -s "$RES/$f" "bench/results/$f" || changed+=("$f"); done < <(cd "$RES" && find . -name '*.json' | sort)
for f in "${changed[@]}"; do echo "$f: $(wc -l < "$RES/$f") rows, $(grep -c '"status": "ok"' "$RES/$f") ok"; done
[ ${#changed[@]} -gt 0 ] && tar czf "$OUT/results.tar.gz" -C "$RES" "${changed[@]}"
echo "[batch] finished in $(( $(date +%s) - start )) s"
