#!/usr/bin/env bash
# rowk_variants.sh: the compile-time variants of the row and element-wise kernels
# (microgpt/cuda/layernorm.cuh, loss.cuh, optimizer.cuh: each header's comment lists its variants),
# side by side on this GPU, in one command:
#   1. builds tests/kernel_check.cu and bench/rowk_bench.cu once per variant (in parallel), each
#      into build/rowk/<variant>/;
#   2. runs every variant's kernel_check (in parallel: values only, no timing), which must pass;
#   3. runs every variant's rowk_bench, one after the other on a quiet GPU;
#   4. prints a summary table (bench/rowk_summary.py): per model and kernel, each variant's time
#      against the default's, and whether its results are the default's bits.
# Exit status 1 if a build or a kernel_check fails (the benches still run for the variants that
# built). Logs: build/rowk/<variant>/{build_*.log,kernel_check.log,bench.log}.
#
#   bench/rowk_variants.sh                 all variants (about 3 minutes on an H200)
#   bench/rowk_variants.sh base ln_fwd1    only those
#   bench/rowk_variants.sh --check-only    steps 1 and 2 (bench/test_rowk.py, on a GPU)
set -uo pipefail
cd "$(dirname "$0")/.."

# name|-D flags (base: the default code)
VARIANTS=(
    "base|"
    "ln_fwd1|-DLN_FWD_VARIANT=1"
    "ln_bwd1|-DLN_BWD_VARIANT=1"
    "ln_bwd2|-DLN_BWD_VARIANT=2"
    "ln_bwd3|-DLN_BWD_VARIANT=3"
    "ln_bwd4|-DLN_BWD_VARIANT=4"
    "ln_final8|-DLN_FINAL_COLS=8"
    "loss1|-DLOSS_ROWS_VARIANT=1"
    "loss2|-DLOSS_ROWS_VARIANT=2"
    "norm1|-DNORM_VARIANT=1"
)
# The macros are independent (each selects kernels of one header), so a combination of variants is
# timed kernel by kernel by the single variants; combinations are for the engine's A/B runs
# (make KERNEL_VARIANTS="...", docs/BENCHMARKS.md).

NVCC=${NVCC:-nvcc}
ARCH=${GPU_ARCH:-$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -n1 | tr -d ' .')}
if [ -z "$ARCH" ]; then
    echo "error: no GPU found by nvidia-smi; set GPU_ARCH (e.g. 90) to build only" >&2
    exit 1
fi
# the Makefile's NVCCFLAGS for kernel_check, for this GPU's architecture
FLAGS="-O3 -std=c++17 -Xcompiler -fopenmp,-ffp-contract=off,-Wall -gencode arch=compute_$ARCH,code=sm_$ARCH"
LIBS="-lcublas -lcublasLt -lgomp -lm"
OUT=build/rowk

check_only=0
if [ "${1:-}" = "--check-only" ]; then
    check_only=1
    shift
fi
selected=() names=()
for v in "${VARIANTS[@]}"; do
    name=${v%%|*}
    if [ $# -eq 0 ] || [[ " $* " == *" $name "* ]]; then
        selected+=("$v")
        names+=("$name")
    fi
done
if [ ${#selected[@]} -eq 0 ]; then
    echo "error: no variant named $*; known: $(for v in "${VARIANTS[@]}"; do printf '%s ' "${v%%|*}"; done)" >&2
    exit 1
fi

status=0
start=$(date +%s)
echo "== build (${#selected[@]} variants, sm_$ARCH)"
pids=()
for v in "${selected[@]}"; do
    name=${v%%|*} defs=${v#*|}
    mkdir -p "$OUT/$name"
    for src in tests/kernel_check.cu bench/rowk_bench.cu; do
        bin=$(basename "$src" .cu)
        # shellcheck disable=SC2086
        $NVCC $FLAGS $defs -o "$OUT/$name/$bin" "$src" $LIBS >"$OUT/$name/build_$bin.log" 2>&1 &
        pids+=("$!:$name:$bin")
    done
done
for p in "${pids[@]}"; do
    IFS=: read -r pid name bin <<<"$p"
    if ! wait "$pid"; then
        echo "FAIL build $OUT/$name/$bin (log: $OUT/$name/build_$bin.log)"
        rm -f "$OUT/$name/$bin"
        status=1
    fi
done
echo "   $(($(date +%s) - start)) s"

echo "== kernel_check"
threads=$(( $(nproc) / ${#selected[@]} ))
[ "$threads" -lt 1 ] && threads=1
pids=()
for v in "${selected[@]}"; do
    name=${v%%|*}
    [ -x "$OUT/$name/kernel_check" ] || continue
    OMP_NUM_THREADS=$threads "$OUT/$name/kernel_check" >"$OUT/$name/kernel_check.log" 2>&1 &
    pids+=("$!:$name")
done
for p in "${pids[@]}"; do
    name=${p#*:}
    if wait "${p%%:*}"; then
        echo "   $name: $(tail -n1 "$OUT/$name/kernel_check.log")"
    else
        echo "FAIL kernel_check $name (log: $OUT/$name/kernel_check.log):"
        log="$OUT/$name/kernel_check.log"
        { grep '^FAIL' "$log" | head -n 5; tail -n 1 "$log"; } | sed 's/^/   /'
        status=1
    fi
done
echo "   $(($(date +%s) - start)) s"

if [ $check_only = 1 ]; then
    echo "== $(($(date +%s) - start)) s; status $status"
    exit $status
fi

echo "== rowk_bench"
for v in "${selected[@]}"; do
    name=${v%%|*}
    [ -x "$OUT/$name/rowk_bench" ] || continue
    if ! "$OUT/$name/rowk_bench" >"$OUT/$name/bench.log" 2>&1; then
        echo "FAIL rowk_bench $name: $(tail -n1 "$OUT/$name/bench.log")"
        status=1
    fi
    sed "s/^/   [$name] /" "$OUT/$name/bench.log"
done
echo "   $(($(date +%s) - start)) s"

echo "== summary (median of 20 launches; change against base; \"other bits\": results differ from base's)"
python3 bench/rowk_summary.py "$OUT" "${names[@]}" || status=1
echo "== $(($(date +%s) - start)) s; status $status"
exit $status
