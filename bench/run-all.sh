#!/usr/bin/env bash
# run-all.sh: the whole benchmark on the GPU machine in one unattended command.
#
#   ANDREA_COMMIT=<commit> OUT=/some/dir bash bench/run-all.sh [STAGE...]     (OUT defaults to bench/out)
#
# Stages, each logged to $OUT/<stage>.log (stdout and stderr together); with no STAGE, all three:
#   build   nvidia-smi, nvcc, `make` (CPU and CUDA engines for this GPU)
#   train   bench/bench.py: ANDREA-12M and ANDREA-120M, the engine in bf16 and fp8 against PyTorch
#           bf16 eager, compiled (default mode) and compiled with CUDA graphs (reduce-overhead), and
#           against torchao's float8 training compiled with CUDA graphs (the fp8 rows' baseline;
#           torchao imported from PYTHONPATH or site-packages, its row an error where it is missing),
#           200 steps, the bf16 matmul rate for the MFU column; real text when data/megachat is
#           there (loss check), else random tokens. BENCH_ARGS adds options (a repeated option
#           replaces the default), e.g. BENCH_ARGS="--precisions bf16" (no fp8 rows), or
#           BENCH_ARGS="--torch-modes eager,compile,reduce-overhead,max-autotune" (adds minutes)
#   decode  bench/decode_bench.py: both models, batch 1 and 8, 128 prompt + 256 new tokens, the
#           engine's --generate against transformers' generate (needs scripts/export-hf.py)
# Each benchmark appends its JSON line to bench/results.jsonl of this copy of the tree and writes
# it to $OUT/<stage>/record.jsonl too; $OUT/results-new.jsonl collects them, to be appended to
# bench/results.jsonl of the repository. The tables are at the end of $OUT/train.log and
# $OUT/decode.log. Exit status 1 if any stage failed, 2 for an unknown stage.
# Estimated on an H200: build 1-2 min, train 5-7 min (the two torchao runs compile for about a
# minute each), decode 1-3 min; a command limited to 10 minutes runs `build train`, then `decode`.
# shellcheck disable=SC2317  # stage functions are called indirectly, through run_stage
set -u -o pipefail
cd "$(dirname "$0")/.." || exit 1
OUT=${OUT:-bench/out}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
command -v nvcc >/dev/null 2>&1 || export PATH="/usr/local/cuda/bin:$PATH"
PY=${PYTHON:-python3}
# the microgpt package from this tree, whether or not `pip install -e .` ran on this machine (offline)
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
[ -n "${ANDREA_COMMIT:-}" ] || echo "note: ANDREA_COMMIT is not set: the commit recorded is git's, if this tree has git metadata"
FAILED=0
SUMMARY=()

stage_build() {
    nvidia-smi && nvcc --version && make -j8
}

stage_train() {
    # shellcheck disable=SC2086  # BENCH_ARGS is a list of options
    timeout -k 10 560 "$PY" bench/bench.py --out "$OUT/train" --precisions bf16,fp8 ${BENCH_ARGS:-}
}

stage_decode() {
    timeout -k 10 560 "$PY" bench/decode_bench.py --out "$OUT/decode"
}

run_stage() {
    local name=$1 t0 rc
    t0=$(date +%s)
    echo "=== stage $name ($(date -u +%H:%M:%S) UTC)" | tee "$OUT/$name.log"
    "stage_$name" 2>&1 | tee -a "$OUT/$name.log"
    rc=${PIPESTATUS[0]}
    [ -f "$OUT/$name/record.jsonl" ] && cat "$OUT/$name/record.jsonl" >> "$OUT/results-new.jsonl"
    SUMMARY+=("$([ "$rc" -eq 0 ] && echo PASS || echo FAIL)  $name  ($(( $(date +%s) - t0 )) s, status $rc)")
    [ "$rc" -eq 0 ] || FAILED=1
}

STAGES=("$@")
[ ${#STAGES[@]} -gt 0 ] || STAGES=(build train decode)
for stage in "${STAGES[@]}"; do
    case $stage in
        build|train|decode) run_stage "$stage" ;;
        *) echo "unknown stage '$stage' (build, train, decode)"; exit 2 ;;
    esac
done
printf '%s\n' "${SUMMARY[@]}" | tee -a "$OUT/summary.log"
exit $FAILED
