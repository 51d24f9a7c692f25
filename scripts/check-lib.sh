# check-lib.sh: what the GPU check and A/B scripts share (scripts/gpu-check.sh, fp8-check.sh,
# multi-gpu-check.sh; bench/engine-ab.sh, attn-variants.sh); sourced,
# never run. A script calls check_init, defines its stage_* functions, then run_stages.
# shellcheck shell=bash

# check_init NAME DEFAULT_OUT: run from the repository root; $OUT (default DEFAULT_OUT) for the logs,
# $DATA a scratch directory removed on exit, $PY the Python, nvcc on PATH.
check_init() {
    cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1
    OUT=${OUT:-$2}
    mkdir -p "$OUT"
    OUT=$(cd "$OUT" && pwd)
    DATA=$(mktemp -d "/tmp/andrea-$1.XXXXXX")
    trap 'rm -rf "$DATA"' EXIT
    command -v nvcc >/dev/null 2>&1 || export PATH="/usr/local/cuda/bin:$PATH"
    PY=${PYTHON:-python3}
    CHECK_NAME=$1
    RESULTS=()
    FAILED=0
}

# run_stage NAME FUNCTION: runs the function with its output teed to $OUT/NAME.log, records the result.
run_stage() {
    local name=$1 fn=$2 t0 rc
    t0=$(date +%s)
    echo "=== stage $name ($(date -u +%H:%M:%S) UTC)" | tee "$OUT/$name.log"
    "$fn" 2>&1 | tee -a "$OUT/$name.log"
    rc=${PIPESTATUS[0]}
    local secs=$(( $(date +%s) - t0 ))
    if [ "$rc" -eq 0 ]; then RESULTS+=("PASS  $name  (${secs}s)"); else RESULTS+=("FAIL  $name  (${secs}s, status $rc, see $OUT/$name.log)"); FAILED=1; fi
    echo "=== stage $name: status $rc after ${secs}s" | tee -a "$OUT/$name.log"
}

# run_cmd LIMIT_SECONDS CMD...: one command with a time limit; prints the command and its status.
run_cmd() {
    local limit=$1 rc
    shift
    echo "+ $*"
    timeout -k 10 "$limit" "$@"
    rc=$?
    [ "$rc" -eq 124 ] && echo "!! timed out after ${limit}s: $*"
    [ "$rc" -ne 0 ] && echo "!! status $rc: $*"
    return "$rc"
}

# The shapes of ANDREA-12M and ANDREA-120M (experiments/), for timing runs on random tokens.
# shellcheck disable=SC2034  # used by the scripts that source this file
M12=(--model.n_layer 6 --model.d_model 192 --model.n_head 6 --model.d_ff 768 --model.seq_len 512)
# shellcheck disable=SC2034
M120=(--model.n_layer 12 --model.d_model 768 --model.n_head 12 --model.d_ff 3072 --model.seq_len 1024)

# timing_run STEPS NAME PRECISION SHAPE-ARGS...: STEPS training steps of the CUDA engine ($ENGINE_BIN,
# default build/microgpt_cuda) on the random tokens of make_shard's "big" shard (or the shards of the
# glob $TIMING_SHARDS), at the shape given with ANDREA's vocabulary and batch 8, a sixth of them
# warmup; the step records go to $DATA/NAME.jsonl.
timing_run() {
    local steps=$1 name=$2 prec=$3
    shift 3
    run_cmd 240 "${ENGINE_BIN:-build/microgpt_cuda}" --name "$name" "$@" --model.vocab_size 50259 --model.padded_vocab_size 50304 \
        --train.batch_size 8 --train.steps "$steps" --train.warmup_steps $((steps / 6)) --train.precision "$prec" \
        --data.train "${TIMING_SHARDS:-$DATA/big_*.bin}" > "$DATA/$name.jsonl"
}

# Median ms/step (after 10 warm-up steps) and the loss of the runs NAME... ($DATA/NAME.jsonl) into $1.
summarise() {
    "$PY" - "$DATA" "$@" <<'EOF'
import json, math, statistics, sys
from pathlib import Path
data, out, names = Path(sys.argv[1]), sys.argv[2], sys.argv[3:]
rows, bad = [], []
for name in names:
    recs = [json.loads(l) for l in (data / f"{name}.jsonl").read_text().splitlines() if l.startswith("{")]
    steps = [r for r in recs if "loss" in r and "event" not in r]
    vals = [{"step": r["step"], "val_loss": r["val_loss"]} for r in recs if "val_loss" in r]
    ms = [r["ms"] for r in steps[10:]]
    row = {"run": name, "steps": len(steps), "ms_per_step_median": round(statistics.median(ms), 3) if ms else None,
           "first_loss": steps[0]["loss"] if steps else None, "last_loss": steps[-1]["loss"] if steps else None,
           "val": vals}
    rows.append(row)
    if not steps or not all(math.isfinite(r["loss"]) for r in steps):
        bad.append(name)
    print(f"{name:14s} {row['steps']:4d} steps  {row['ms_per_step_median']} ms/step  loss {row['first_loss']} -> "
          f"{row['last_loss']}  val {[v['val_loss'] for v in vals]}")
Path(out).write_text(json.dumps(rows, indent=1))
sys.exit(1 if bad else 0)
EOF
}

gpu_arch() { nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -n1 | tr -d ' .'; }

# Random-token shard: $1 prefix, $2 vocabulary, $3 tokens.
make_shard() {
    PYTHONPATH=. "$PY" - "$DATA" "$1" "$2" "$3" <<'PYEOF'
import sys
import numpy as np
from microgpt.shards import write_shard
d, prefix, vocab, n = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
write_shard(f"{d}/{prefix}_000000.bin", np.random.default_rng(7).integers(0, vocab, n))
PYEOF
}

# run_stages "DEFAULT STAGES" "OTHER KNOWN STAGES" [STAGE...]: checks the names (exit 2 for an unknown
# one), runs each stage_NAME (after the build stage only when build/microgpt_cuda exists), prints
# the summary (also appended to $OUT/summary.log) and exits 1 if any stage failed.
run_stages() {
    local -a all known stages
    read -r -a all <<< "$1"
    read -r -a known <<< "$1 $2"
    shift 2
    stages=("$@")
    [ ${#stages[@]} -eq 0 ] && stages=("${all[@]}")
    local st k
    for st in "${stages[@]}"; do
        # a whole word of the list: 'timing casts' as one argument is no stage
        for k in "${known[@]}"; do [ "$k" = "$st" ] && continue 2; done
        echo "error: unknown stage '$st' (stages: ${known[*]})" >&2
        exit 2
    done
    for st in "${stages[@]}"; do
        if [ "$st" != build ] && [ ! -x build/microgpt_cuda ]; then
            RESULTS+=("FAIL  $st  (not run: build/microgpt_cuda is missing; run the build stage)")
            FAILED=1
            continue
        fi
        run_stage "$st" "stage_$st"
    done
    {
        echo "=== $CHECK_NAME summary ($(date -u +%Y-%m-%dT%H:%M:%SZ), $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n1))"
        printf '%s\n' "${RESULTS[@]}"
    } | tee -a "$OUT/summary.log"
    exit "$FAILED"
}

# parse_builds NAME=FLAGS...: the A/B scripts' builds (bench/attn-variants.sh, bench/engine-ab.sh) into
# the arrays BUILD_NAMES and BUILD_FLAGS; exits 2 with one error line on a malformed one. FLAGS reach
# make's command line and so a recipe's shell: only -DMACRO[=VALUE] and -UMACRO words pass, never a
# ';', '$(...)', quote or other compiler option. `default` is the name of the build without flags.
parse_builds() {
    local arg name flags word n
    local -a words
    BUILD_NAMES=() BUILD_FLAGS=()
    for arg in "$@"; do
        name=${arg%%=*} flags=${arg#*=}
        if [ "$name" = "$arg" ] || ! [[ $name =~ ^[A-Za-z0-9_]+$ ]] || [ "$name" = default ]; then
            echo "error: expected NAME=FLAGS (NAME of letters, digits, _; not 'default'), got '$arg'" >&2
            exit 2
        fi
        read -r -d "" -a words <<<"$flags"    # -d "": a newline splits words too, never ends them
        for word in "${words[@]}"; do
            if ! [[ $word =~ ^(-D[A-Za-z_][A-Za-z0-9_]*(=[A-Za-z0-9_.+-]*)?|-U[A-Za-z_][A-Za-z0-9_]*)$ ]]; then
                echo "error: FLAGS of '$name' must be -DMACRO[=VALUE] or -UMACRO words" \
                    "(VALUE of letters, digits, _.+-), got '$word'" >&2
                exit 2
            fi
        done
        for n in "${BUILD_NAMES[@]}"; do
            if [ "$n" = "$name" ]; then
                echo "error: build name '$name' given twice" >&2
                exit 2
            fi
        done
        BUILD_NAMES+=("$name") BUILD_FLAGS+=("$flags")
    done
}

# build_variants TOOL...: build/TOOL_NAME for the build `default` (no flags) and each build NAME of
# parse_builds with its FLAGS (the Makefile's VARIANT_SUFFIX and KERNEL_VARIANTS), all in parallel,
# each build's log in $OUT/build-NAME.log. A build's old binaries are removed first, so that none
# stands in for a failed build, and made with -B, so that an older build of other flags that is newer
# than the sources is remade. Returns 1 if any build failed (and says which).
build_variants() {
    local names=(default "${BUILD_NAMES[@]}") flags=("" "${BUILD_FLAGS[@]}") pids=() i tool rc=0
    local -a targets
    for i in "${!names[@]}"; do
        targets=()
        for tool in "$@"; do targets+=("build/${tool}_${names[$i]}"); done
        rm -f "${targets[@]}"
        make -B VARIANT_SUFFIX="_${names[$i]}" KERNEL_VARIANTS="${flags[$i]}" "${targets[@]}" \
            >"$OUT/build-${names[$i]}.log" 2>&1 &
        pids+=($!)
    done
    for i in "${!pids[@]}"; do
        if ! wait "${pids[$i]}"; then
            echo "!! build of ${names[$i]} failed: $OUT/build-${names[$i]}.log"
            tail -5 "$OUT/build-${names[$i]}.log"
            rc=1
        fi
    done
    return "$rc"
}
