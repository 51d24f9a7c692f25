#!/usr/bin/env bash
# attn-variants.sh: every flash-attention variant of microgpt/cuda/attention.cuh (its -D macros,
# docs/BENCHMARKS.md log #40 on) built side by side, checked and timed, for the GPU machine:
#
#   OUT=/some/dir bench/attn-variants.sh [NAME...]     (OUT defaults to ./attn-out; no NAME: all)
#
# Per variant NAME: build/kernel_check_NAME and build/attn_bench_NAME (built in parallel, the
# Makefile's KERNEL_VARIANTS / ATTN_SUFFIX), then `kernel_check_NAME --only attn` (the attention pair
# at every checked shape, fp32/bf16/fp16, one fixed seed for all variants) and attn_bench_NAME.
# Logs in $OUT/build-NAME.log, $OUT/check-NAME.log, $OUT/bench-NAME.log; at the end a table, one
# row per variant: µs per kernel launch (one layer) of each model, the flash kernels' µs per training
# step, and the variant's check result (also in $OUT/summary.txt). A variant whose check fails is
# timed all the same and marked FAILED.
# Exit status 1 if any build or check failed. About 2-3 minutes on an H200 host (16 cores).
set -u -o pipefail
cd "$(dirname "$0")/.." || exit 1
OUT=${OUT:-./attn-out}
mkdir -p "$OUT"

# name|nvcc flags (the first is the default kernels)
ALL_VARIANTS=(
    "default|"
    "fwd_warps8|-DFA_FWD_WARPS=8"
    "fwd_warps2|-DFA_FWD_WARPS=2"
    "fwd_pipeline|-DFA_FWD_PIPELINE=1 -DFA_FWD_SM_WARPS=12"
    "grid_lpt|-DFA_GRID_LPT=1"
    "dkv_warps2|-DFA_DKV_WARPS=2"
    "dkv_blocks4|-DFA_MIN_BLOCKS_DKV=4"
    "dkv_cols16|-DFA_DKV_COLS64=16"
    "dkv_blocks4_cols16|-DFA_MIN_BLOCKS_DKV=4 -DFA_DKV_COLS64=16"
    "dkv_pipeline|-DFA_DKV_PIPELINE=1 -DFA_DKV_COLS64=16"
    "ds_fragments|-DFA_DS_FRAGMENTS=1"
    "combined_12m|-DFA_FWD_WARPS=2 -DFA_DKV_WARPS=2 -DFA_GRID_LPT=1"
    "combined|-DFA_FWD_PIPELINE=1 -DFA_FWD_SM_WARPS=12 -DFA_GRID_LPT=1 -DFA_MIN_BLOCKS_DKV=4 -DFA_DKV_COLS64=16 -DFA_DS_FRAGMENTS=1"
)
VARIANTS=()
for v in "${ALL_VARIANTS[@]}"; do
    if [ $# -eq 0 ]; then VARIANTS+=("$v"); continue; fi
    for want in "$@"; do [ "${v%%|*}" = "$want" ] && VARIANTS+=("$v"); done
done
if [ ${#VARIANTS[@]} -eq 0 ]; then
    echo "error: no variant named $* (known: $(printf '%s ' "${ALL_VARIANTS[@]%%|*}"))" >&2
    exit 2
fi

rc=0
pids=()
for v in "${VARIANTS[@]}"; do
    name=${v%%|*} flags=${v#*|}
    # -B: a variant's binaries are rebuilt even when an older build of other flags is newer than the sources
    make -B ATTN_SUFFIX="_$name" KERNEL_VARIANTS="$flags" "build/kernel_check_$name" "build/attn_bench_$name" \
        >"$OUT/build-$name.log" 2>&1 &
    pids+=($!)
done
for i in "${!pids[@]}"; do
    name=${VARIANTS[$i]%%|*}
    if ! wait "${pids[$i]}"; then
        echo "!! build of $name failed: $OUT/build-$name.log"
        tail -5 "$OUT/build-$name.log"
        rc=1
    fi
done

declare -A check
for v in "${VARIANTS[@]}"; do
    name=${v%%|*}
    if [ ! -x "build/attn_bench_$name" ] || [ ! -x "build/kernel_check_$name" ]; then
        check[$name]="NOT BUILT"
        continue
    fi
    echo "== $name (${v#*|})"
    if timeout 120 "build/kernel_check_$name" --only attn --seed 12345 >"$OUT/check-$name.log" 2>&1; then
        check[$name]=ok
    else
        check[$name]=FAILED
        rc=1
    fi
    tail -1 "$OUT/check-$name.log"
    timeout 120 "build/attn_bench_$name" >"$OUT/bench-$name.log" 2>&1 || { echo "!! attn_bench_$name failed"; rc=1; }
    cat "$OUT/bench-$name.log"
done

{
    printf '\nµs per launch (one layer); step = (forward + backward) x layers (12 at 120M, 6 at 12M)\n'
    printf '%-20s' variant
    for model in 120M 12M; do printf ' %8s' "$model:fwd" delta dk_dv dq bwd step; done
    printf '  %s\n' "kernel_check --only attn"
    for v in "${VARIANTS[@]}"; do
        name=${v%%|*}
        printf '%-20s' "$name"
        for model in 120M 12M; do
            for kernel in forward delta dk_dv dq backward; do
                us=$(awk -v m="$model" -v k="$kernel" '$3 == m && $4 == k { print $5 }' \
                    "$OUT/bench-$name.log" 2>/dev/null)
                printf ' %8s' "${us:--}"
            done
            step=$(awk -v m="$model" '$3 == m && ($4 == "forward" || $4 == "backward") { s += $9; n++ }
                                      END { if (n) printf "%.0f", s }' "$OUT/bench-$name.log" 2>/dev/null)
            printf ' %8s' "${step:--}"
        done
        printf '  %s\n' "${check[$name]}"
    done
} | tee "$OUT/summary.txt"
exit $rc
