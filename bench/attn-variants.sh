#!/usr/bin/env bash
# attn-variants.sh: the flash-attention kernels (microgpt/cuda/attention.cuh) built with other -D
# flags, checked and timed beside the default build, for the GPU machine: an A/B of a new idea put
# behind a compile-time macro (docs/BENCHMARKS.md, log #40 on):
#
#   OUT=/some/dir bench/attn-variants.sh NAME=FLAGS...    (OUT defaults to ./attn-out)
#   e.g. bench/attn-variants.sh "wide=-DFA_NEW_IDEA=1" "wide2=-DFA_NEW_IDEA=2 -DFA_OTHER=1"
#
# The build `default` (no flags) always comes first. Per build NAME: build/kernel_check_NAME and
# build/attn_bench_NAME (built in parallel, the Makefile's KERNEL_VARIANTS / VARIANT_SUFFIX), then
# `kernel_check_NAME --only attn` (the attention pair at every checked shape, fp32/bf16/fp16, one
# fixed seed for all builds) and attn_bench_NAME. Logs in $OUT/build-NAME.log, $OUT/check-NAME.log,
# $OUT/bench-NAME.log; at the end a table, one row per build: µs per kernel launch (one layer) of
# each model, the flash kernels' µs per training step, and the build's check result (also in
# $OUT/summary.txt). A build whose check fails is timed all the same and marked FAILED.
# FLAGS are -DMACRO[=VALUE] and -UMACRO words only. Exit status 1 if any build or check failed, 2 on
# bad arguments. About a minute per build on an H200 host (16 cores).
set -u -o pipefail
cd "$(dirname "$0")/.." || exit 1

# shellcheck source=scripts/check-lib.sh
. scripts/check-lib.sh
parse_builds "$@"
BUILDS=("default|")
for i in "${!BUILD_NAMES[@]}"; do BUILDS+=("${BUILD_NAMES[$i]}|${BUILD_FLAGS[$i]}"); done
OUT=${OUT:-./attn-out}
mkdir -p "$OUT"

rc=0
build_variants kernel_check attn_bench || rc=1

declare -A check
for b in "${BUILDS[@]}"; do
    name=${b%%|*}
    if [ ! -x "build/attn_bench_$name" ] || [ ! -x "build/kernel_check_$name" ]; then
        check[$name]="NOT BUILT"
        continue
    fi
    echo "== $name (${b#*|})"
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
    printf '%-20s' build
    for model in 120M 12M; do printf ' %8s' "$model:fwd" delta dk_dv dq bwd step; done
    printf '  %s\n' "kernel_check --only attn"
    for b in "${BUILDS[@]}"; do
        name=${b%%|*}
        printf '%-20s' "$name"
        for model in 120M 12M; do
            for kernel in forward delta dk_dv dq backward; do
                us=$(awk -v m="$model" -v k="$kernel" '$2 == m && $3 == k { print $4 }' \
                    "$OUT/bench-$name.log" 2>/dev/null)
                printf ' %8s' "${us:--}"
            done
            step=$(awk -v m="$model" '$2 == m && ($3 == "forward" || $3 == "backward") { s += $8; n++ }
                                      END { if (n) printf "%.0f", s }' "$OUT/bench-$name.log" 2>/dev/null)
            printf ' %8s' "${step:--}"
        done
        printf '  %s\n' "${check[$name]}"
    done
} | tee "$OUT/summary.txt"
exit $rc
