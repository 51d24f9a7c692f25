#!/usr/bin/env bash
# fp8-check.sh: the GPU verification of precision fp8 (docs/DESIGN.md §18) in one unattended command,
# for an sm_89/sm_90 machine; about 4 minutes on an H200.
#
#   OUT=/some/dir scripts/fp8-check.sh [STAGE...]     (OUT defaults to ./fp8-out)
#
# Stages (default: all, in this order), each logged to $OUT/<stage>.log:
#   build        `make` (CPU + CUDA engines for this GPU) and build/kernel_check
#   kernel_check every kernel check (fp32/bf16/fp16 as before, and fp8: the conversion on all 2^32
#                fp32 inputs against the hardware, the cast kernels byte for byte against the CPU
#                emulation, the FP8 products against fp32 products of the dequantised values)
#   pytest       tests/test_gpu.py (all of it: fp8 against the CPU engine's fp8 emulation, exact fp8
#                resume after SIGTERM, graphs = launch by launch, refusals; and every older GPU test)
#                and tests/test_fp8.py (the CPU emulation)
#   sanitizer    compute-sanitizer memcheck of a tiny fp8 run, uncaptured and as CUDA graphs, and racecheck;
#                both again at head size 64 and d_model 512 (fused attention, FP8 classifier)
#   timing       ANDREA-12M and ANDREA-120M, fp8 and bf16, 60 steps each on random tokens: median
#                ms/step in $OUT/timing.json
#   casts        bench/fp8_casts.cu: µs and GB/s of each cast, amax and amax-fused kernel at the
#                12M and 120M activation shapes (a measurement, it fails only if it cannot run)
#   quality      ANDREA-12M, 300 steps fp8 and bf16, same seed and data (data/megachat if present,
#                else a synthetic repeating text): validation losses side by side in $OUT/quality.json;
#                fails if fp8 is not finite or its last validation loss is more than 3% above bf16's
# Stages run only when named (the 2000-step quality runs of docs/ANDREA.md, real text required:
# data/megachat train and validation shards), each about 1 (12M) and 2 (120M) minutes on an H200:
#   quality2000_12M, quality2000_120M   bench/fp8_quality.py: the model trained 2000 steps in bf16
#                and in fp8, same seed and data, validation every 100 steps (20 batches), records in
#                $OUT/quality2000/; then the summary of every model there ($OUT/quality2000/
#                fp8-quality.json: final validation losses, relative difference, PASS when within 1%)
#                and the chart of the validation curves (fp8-quality.svg); fails unless every model
#                there passes
# The PyTorch/torchao bench rows are bench/run-all.sh's.
# The last lines (also in $OUT/summary.log) say which stages passed; exit status 1 if any failed.
# shellcheck disable=SC2317  # stage functions are called indirectly, through run_stage
set -u -o pipefail
# shellcheck source=scripts/check-lib.sh
. "$(dirname "$0")/check-lib.sh"
check_init fp8-check ./fp8-out

stage_build() {
    local arch
    nvcc --version | tail -n 2
    nvidia-smi --query-gpu=name,compute_cap,driver_version --format=csv
    arch=$(gpu_arch)
    if [ -z "$arch" ] || [ "$arch" -lt 89 ]; then
        echo "!! compute capability ${arch:-unknown}: fp8 needs 8.9+"
        return 1
    fi
    run_cmd 600 make -j4 GPU_ARCH="$arch" all build/kernel_check
}

stage_kernel_check() { run_cmd 400 build/kernel_check; }

stage_pytest() {
    local rc=0
    run_cmd 600 "$PY" -m pytest -m gpu -v -rA tests/test_gpu.py || rc=1
    run_cmd 300 "$PY" -m pytest -v tests/test_fp8.py || rc=1
    return "$rc"
}

# d_model, d_ff and B*T multiples of 16 (FP8 products contract over them); head size 8
FP8_TINY=(--model.n_layer 2 --model.d_model 32 --model.n_head 4 --model.seq_len 16 --model.vocab_size 61
          --model.padded_vocab_size 64 --model.d_ff 128 --train.batch_size 4 --train.seed 5 --train.precision fp8)

stage_sanitizer() {
    local cs rc=0
    cs=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
    [ -x "$cs" ] || { echo "!! compute-sanitizer not found: nothing checked"; return 1; }
    make_shard tiny 61 20000 || return 1
    local args=("${FP8_TINY[@]}" --data.train "$DATA/tiny_*.bin" --data.val "$DATA/tiny_*.bin" --eval.every 2
                --eval.batches 1 --sample.every 2 --sample.tokens 10 --sample.prompt "1,2,3" --train.steps 2
                --train.grad_accum 2)
    ANDREA_CUDA_SYNC=1 run_cmd 180 "$cs" --tool memcheck --leak-check full --error-exitcode 1 build/microgpt_cuda \
        "${args[@]}" || rc=1
    run_cmd 180 "$cs" --tool memcheck --error-exitcode 1 build/microgpt_cuda "${args[@]}" || rc=1
    run_cmd 120 "$cs" --tool racecheck --error-exitcode 1 build/microgpt_cuda "${args[@]}" || rc=1
    # the tiny model's head size 8 and d_model 32 take attention's cuBLAS path and the bf16
    # classifier: once more at head size 64 and d_model 512, the fused flash kernels writing codes
    # and the FP8 classifier (its loss rows' codes and their transpose)
    local wide=("${args[@]}" --model.n_layer 1 --model.d_model 512 --model.n_head 8 --model.d_ff 1024
                --model.seq_len 64 --train.batch_size 2)
    ANDREA_CUDA_SYNC=1 run_cmd 240 "$cs" --tool memcheck --error-exitcode 1 build/microgpt_cuda "${wide[@]}" || rc=1
    run_cmd 180 "$cs" --tool racecheck --error-exitcode 1 build/microgpt_cuda "${wide[@]}" || rc=1
    return "$rc"
}

VOCAB=(--model.vocab_size 50259 --model.padded_vocab_size 50304 --train.batch_size 8)

stage_timing() {
    local rc=0
    make_shard big 50257 3000000 || return 1
    timing_run 60 12M-bf16 bf16 "${M12[@]}" || rc=1
    timing_run 60 12M-fp8 fp8 "${M12[@]}" || rc=1
    timing_run 60 120M-bf16 bf16 "${M120[@]}" || rc=1
    timing_run 60 120M-fp8 fp8 "${M120[@]}" || rc=1
    summarise "$OUT/timing.json" 12M-bf16 12M-fp8 120M-bf16 120M-fp8 || rc=1
    return "$rc"
}

stage_casts() {
    run_cmd 300 nvcc -O3 -std=c++17 -arch=native -o build/fp8_casts bench/fp8_casts.cu -lcublas -lcublasLt &&
        run_cmd 120 build/fp8_casts
}

stage_quality() {
    local rc=0 train val
    if [ -e data/megachat/megachat_train_000000.bin ] && [ -e data/megachat/megachat_val_000000.bin ]; then
        train="data/megachat/megachat_train_*.bin" val="data/megachat/megachat_val_*.bin"
        echo "data: data/megachat"
    else
        # no real text here: a fixed random "vocabulary" of 512 sentences of 24 tokens, drawn in random
        # order, so there is structure to learn and both runs see the same tokens
        PYTHONPATH=. "$PY" - "$DATA" <<'EOF' || return 1
import sys
import numpy as np
from microgpt.shards import write_shard
rng = np.random.default_rng(3)
sentences = rng.integers(0, 50257, (512, 24))
for name, n in (("syn_train", 60000), ("syn_val", 4000)):
    write_shard(f"{sys.argv[1]}/{name}_000000.bin", sentences[rng.integers(0, 512, n)].ravel())
EOF
        train="$DATA/syn_train_*.bin" val="$DATA/syn_val_*.bin"
        echo "data: synthetic (no data/megachat here)"
    fi
    for prec in bf16 fp8; do
        run_cmd 240 build/microgpt_cuda --name "q12M-$prec" "${M12[@]}" "${VOCAB[@]}" --train.steps 300 \
            --train.lr 6e-4 --train.warmup_steps 30 --train.seed 1337 --train.precision "$prec" \
            --data.train "$train" --data.val "$val" --eval.every 100 --eval.batches 20 > "$DATA/q12M-$prec.jsonl" || rc=1
    done
    summarise "$OUT/quality.json" q12M-bf16 q12M-fp8 || rc=1
    "$PY" - "$OUT/quality.json" <<'EOF' || rc=1
import json, sys
rows = {r["run"]: r for r in json.load(open(sys.argv[1]))}
b, f = rows["q12M-bf16"]["val"][-1]["val_loss"], rows["q12M-fp8"]["val"][-1]["val_loss"]
print(f"last validation loss: bf16 {b:.4f}  fp8 {f:.4f}  ({100 * (f - b) / b:+.2f}%)")
sys.exit(0 if f == f and f <= 1.03 * b else 1)
EOF
    return "$rc"
}

# quality2000 MODEL LIMIT_SECONDS: both runs of one model, then the summary of all models so far
quality2000() {
    PYTHONPATH=. run_cmd "$2" "$PY" bench/fp8_quality.py run "$1" --out "$OUT/quality2000" || return 1
    PYTHONPATH=. run_cmd 60 "$PY" bench/fp8_quality.py summary "$OUT/quality2000"
}

stage_quality2000_12M() { quality2000 12M 300; }
stage_quality2000_120M() { quality2000 120M 540; }

run_stages "build kernel_check pytest sanitizer timing casts quality" "quality2000_12M quality2000_120M" "$@"
