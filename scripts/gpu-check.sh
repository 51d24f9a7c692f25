#!/usr/bin/env bash
# gpu-check.sh: the whole GPU verification in one unattended command, for the GPU machine.
#
#   OUT=/some/dir scripts/gpu-check.sh [STAGE...]     (OUT defaults to ./gpu-out)
#
# With no STAGE, all of them in this order; a command limited to 10 minutes should split them, e.g.
#   scripts/gpu-check.sh build kernel_check pytest_gpu timing   then   scripts/gpu-check.sh pytest_engine sanitizer
#
# Stages, each logged to $OUT/<stage>.log (stdout and stderr together):
#   build        nvcc/driver versions, `make` (CPU + CUDA engines for this GPU), kernel_check, ptxas
#                register/spill report of the engine
#   kernel_check every kernel pair vs its CPU layer, fp32/bf16/fp16, fresh seed (printed)
#   pytest_gpu   tests/test_gpu.py: whole model vs the CPU engine, exact resume, fp16 overflow, ...
#   timing       ~30 steps of the ANDREA-12M and ANDREA-120M shapes on random tokens: ms/step,
#                tokens/s, device memory; summary in $OUT/timing.json, step records in $OUT/*.jsonl
#   pytest_engine the CUDA half of tests/test_engine.py (resume, signals, memory, bad input, ...)
#   sanitizer    compute-sanitizer memcheck / racecheck / initcheck / synccheck on a tiny config,
#                memcheck over kernel_check's odd shapes, and memcheck / racecheck / synccheck over
#                its classifier shapes (--only classifier: the fused backward's TMA and mbarriers)
#                and racecheck / synccheck over its GELU-backward product's (--only mlp)
#   profile      (not in the default set) Nsight Compute's duration of every kernel of one training
#                step, ANDREA-12M and ANDREA-120M in bf16, uncaptured; $OUT/profile-*.csv, summed per
#                kernel by bench/kernel_profile.py into $OUT/profile.log (ANDREA-120M also on the real
#                text of data/megachat when it is there); and the stall and occupancy
#                sections of the flash-attention kernels in $OUT/profile-k_attn_*.log, and where
#                their warps wait (per-instruction stall samples of build/attn_bench's, summarised
#                by bench/stall_profile.py) in $OUT/stalls-k_attn_*.log
# The last lines (also appended to $OUT/summary.log) say which stages passed; exit status 1 if any
# failed, 2 for an unknown stage. Estimated on an H200: build 1-2 min, kernel_check < 1, pytest_gpu
# 1-2, timing 1-2, pytest_engine 1-3, sanitizer 5-8 (each tool run has its own time limit).
# shellcheck disable=SC2317  # stage functions are called indirectly, through run_stage
set -u -o pipefail
# shellcheck source=scripts/check-lib.sh
. "$(dirname "$0")/check-lib.sh"
check_init gpu-check ./gpu-out

stage_build() {
    local rc=0 arch
    nvcc --version
    nvidia-smi || rc=1
    arch=$(gpu_arch)
    echo "GPU compute capability: ${arch:-unknown}; git: $(git rev-parse --short HEAD 2>/dev/null || echo none)"
    run_cmd 600 make -j4 || return 1
    test -x build/microgpt_cuda || { echo "!! make did not produce build/microgpt_cuda"; return 1; }
    run_cmd 600 make kernel-check || rc=1
    # registers and spills of every kernel, for the optimisation pass (not a pass/fail criterion)
    # the Makefile's target for this GPU: Hopper as sm_90a, whose code has the wgmma kernels
    [ "$arch" = 90 ] && arch=90a
    nvcc -O3 -std=c++17 ${arch:+-gencode arch=compute_$arch,code=sm_$arch} -Xcompiler -fopenmp -Xptxas -v -c -o "$DATA/engine.o" \
        microgpt/microgpt_cuda.cu > "$OUT/ptxas.log" 2>&1
    echo "ptxas report: $OUT/ptxas.log ($(grep -c 'spill stores' "$OUT/ptxas.log") kernels;" \
        "$(grep 'spill stores' "$OUT/ptxas.log" | grep -vc ' 0 bytes spill stores') with spills)"
    return "$rc"
}

stage_kernel_check() { run_cmd 600 build/kernel_check; }

stage_pytest_gpu() { run_cmd 900 "$PY" -m pytest -m gpu -v -rA tests/test_gpu.py; }

# The Shakespeare test needs prepared data the GPU machine may not have; everything else runs.
stage_pytest_engine() { run_cmd 900 "$PY" -m pytest -m gpu -v -rA tests/test_engine.py -k "not shakespeare"; }

TINY_ARGS=(--model.n_layer 2 --model.d_model 32 --model.n_head 4 --model.seq_len 19 --model.vocab_size 61
           --model.padded_vocab_size 64 --model.d_ff 72 --train.batch_size 3 --train.seed 5)

# racecheck_ours NAME SANITIZER CMD...: racecheck over CMD (log: $OUT/racecheck-NAME.log), passing
# when the tool ran to its summary and no hazard names one of this repository's kernels (k_*, also
# as a "[clone k_...]" of a device function it calls): racecheck also reports hazards inside
# cuBLAS's own Hopper kernels (nvjet_*), whose barrier protocol it does not follow and which are
# not ours to change. (Its --kernel-name filter would say the same more directly, but CUDA 13.0's
# sanitizer fails inside kernel_check with it.)
racecheck_ours() {
    local name=$1 cs=$2 ours status
    local log="$OUT/racecheck-$name.log"
    shift 2
    run_cmd 300 "$cs" --tool racecheck --print-limit 0 "$@" > "$log" 2>&1
    status=$?
    grep -E "RACECHECK SUMMARY|checks,|Internal Sanitizer Error" "$log"
    ours=$(grep -A1 "Race reported" "$log" | grep -c -E "access at (\[clone )?(void )?k_")
    echo "racecheck: status $status, $ours hazard lines in this repository's kernels (log: $log)"
    # racecheck's own status is 0 with hazards unless --error-exitcode is given; the command's failure counts
    if ! grep -q "RACECHECK SUMMARY" "$log" || grep -q "Internal Sanitizer Error" "$log"; then
        echo "!! racecheck did not finish its checks"
        return 1
    fi
    [ "$status" -eq 0 ] && [ "$ours" -eq 0 ]
}

stage_sanitizer() {
    local cs rc=0
    cs=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
    [ -x "$cs" ] || { echo "!! compute-sanitizer not found: nothing checked"; return 1; }
    "$cs" --version | head -n 3
    make_shard tiny 61 20000 || return 1
    local data=(--data.train "$DATA/tiny_*.bin" --data.val "$DATA/tiny_*.bin")
    local extra=(--eval.every 2 --eval.batches 1 --sample.every 2 --sample.tokens 22 --sample.prompt "1,2,3")
    export ANDREA_CUDA_SYNC=1 # report a fault at the launch that made it
    # each tool run has a time limit (together ~30 minutes should every tool be slow); a timeout fails
    for prec in fp32 bf16; do
        run_cmd 180 "$cs" --tool memcheck --leak-check full --error-exitcode 1 build/microgpt_cuda "${TINY_ARGS[@]}" \
            "${data[@]}" "${extra[@]}" --train.steps 2 --train.grad_accum 2 --train.precision "$prec" || rc=1
    done
    run_cmd 150 "$cs" --tool racecheck --error-exitcode 1 build/microgpt_cuda "${TINY_ARGS[@]}" "${data[@]}" \
        --train.steps 1 --train.precision bf16 || rc=1
    run_cmd 90 "$cs" --tool synccheck --error-exitcode 1 build/microgpt_cuda "${TINY_ARGS[@]}" "${data[@]}" \
        --train.steps 1 || rc=1
    # every device buffer is zeroed at setup, so initcheck reports only real reads of unwritten data
    run_cmd 240 "$cs" --tool initcheck --error-exitcode 1 build/microgpt_cuda "${TINY_ARGS[@]}" "${data[@]}" \
        "${extra[@]}" --train.steps 2 --train.precision fp16 || rc=1
    run_cmd 240 "$cs" --tool memcheck --error-exitcode 1 build/kernel_check --prec bf16 --seed 11 || rc=1
    # the fused classifier backward (TMA, mbarriers, wgmma; Hopper) at all its checked shapes (the
    # memcheck above covers them: --prec bf16 runs them too)
    run_cmd 240 "$cs" --tool synccheck --error-exitcode 1 build/kernel_check --only classifier --seed 11 || rc=1
    racecheck_ours classifier "$cs" build/kernel_check --only classifier --seed 11 || rc=1
    # the GELU-backward product (TMA, mbarriers, wgmma; Hopper) at its two checked shapes
    run_cmd 120 "$cs" --tool synccheck --error-exitcode 1 build/kernel_check --only mlp --seed 11 || rc=1
    racecheck_ours mlp "$cs" build/kernel_check --only mlp --seed 11 || rc=1
    unset ANDREA_CUDA_SYNC
    # the runs above are uncaptured (ANDREA_CUDA_SYNC turns the CUDA graphs off): once more with them
    run_cmd 180 "$cs" --tool memcheck --error-exitcode 1 build/microgpt_cuda "${TINY_ARGS[@]}" "${data[@]}" \
        "${extra[@]}" --train.steps 2 --train.grad_accum 2 --train.precision bf16 || rc=1
    return "$rc"
}


stage_timing() {
    local rc=0
    make_shard big 50257 3000000 || return 1
    timing_run 30 12M-bf16 bf16 "${M12[@]}" || rc=1
    timing_run 30 12M-fp32 fp32 "${M12[@]}" || rc=1
    timing_run 30 120M-bf16 bf16 "${M120[@]}" || rc=1
    timing_run 30 120M-fp16 fp16 "${M120[@]}" || rc=1
    timing_run 30 120M-fp32 fp32 "${M120[@]}" || rc=1
    timing_run 30 12M-tf32 tf32 "${M12[@]}" || rc=1
    timing_run 30 120M-tf32 tf32 "${M120[@]}" || rc=1
    cp "$DATA"/*.jsonl "$OUT/" 2>/dev/null
    "$PY" - "$DATA" "$OUT/timing.json" <<'EOF' || rc=1
import json, statistics, sys
from pathlib import Path
data, out = Path(sys.argv[1]), sys.argv[2]
rows = []
for name in ["12M-bf16", "12M-fp32", "12M-tf32", "120M-bf16", "120M-fp16", "120M-fp32", "120M-tf32"]:
    recs = []
    for line in (data / f"{name}.jsonl").read_text().splitlines() if (data / f"{name}.jsonl").exists() else []:
        try:
            recs.append(json.loads(line))
        except ValueError:
            pass
    steps = [r for r in recs if "loss" in r and "event" not in r]
    mem = [r for r in recs if r.get("event") == "memory"]
    dev = [r for r in recs if r.get("event") == "device_memory"]
    timed = [r["ms"] for r in steps[5:]] or [r["ms"] for r in steps]  # skip the first steps (warm-up)
    row = {"run": name, "steps": len(steps),
           "ms_per_step_median": round(statistics.median(timed), 3) if timed else None,
           "tokens_per_s_median": round(statistics.median([r["tokens_per_s"] for r in steps[5:]] or [0])),
           "first_loss": steps[0]["loss"] if steps else None, "last_loss": steps[-1]["loss"] if steps else None,
           "skipped_steps": sum(1 for r in steps if r.get("skipped")),
           "plan_bytes": mem[0]["total_bytes"] if mem else None,
           "device_bytes": [d["bytes"] for d in dev]}
    rows.append(row)
    print(f"{name:10s} steps {row['steps']:3d}  {row['ms_per_step_median']} ms/step  {row['tokens_per_s_median']} tok/s  "
          f"loss {row['first_loss']} -> {row['last_loss']}  skipped {row['skipped_steps']}  "
          f"plan {row['plan_bytes']} B  device {row['device_bytes']} B")
Path(out).write_text(json.dumps(rows, indent=1))
bad = [r["run"] for r in rows if r["steps"] != 30]
if bad:
    sys.exit(f"runs without 30 steps: {bad}")
EOF
    return "$rc"
}

# profile_run NAME PRECISION DATA SHAPE-ARGS...: every kernel of the warm-up and one training step
# on the shards DATA under ncu (duration only, clocks and caches left alone), as CSV in
# $OUT/profile-NAME.csv.
profile_run() {
    local name=$1 prec=$2 data=$3 ncu
    shift 3
    ncu=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
    ANDREA_NO_GRAPH=1 run_cmd 300 "$ncu" --clock-control none --cache-control none --metrics gpu__time_duration.sum \
        --csv --print-units base --print-kernel-base function --log-file "$OUT/profile-$name.csv" build/microgpt_cuda --name "$name" "$@" \
        --model.vocab_size 50259 --model.padded_vocab_size 50304 --train.batch_size 8 --train.steps 1 \
        --train.precision "$prec" --eval.every 0 --sample.every 0 --data.train "$data" > /dev/null
}

# profile_sections KERNEL: Nsight Compute's speed-of-light, occupancy, warp-stall and instruction
# sections for the first launch of KERNEL in the ANDREA-120M bf16 training step.
profile_sections() {
    local ncu
    ncu=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
    ANDREA_NO_GRAPH=1 run_cmd 200 "$ncu" --clock-control none -k "regex:$1" -s 24 -c 1 --section SpeedOfLight \
        --section Occupancy --section WarpStateStats --section ComputeWorkloadAnalysis --section SchedulerStats \
        --section InstructionStats --section LaunchStats build/microgpt_cuda "${M120[@]}" --model.vocab_size 50259 \
        --model.padded_vocab_size 50304 --train.batch_size 8 --train.steps 1 --train.precision bf16 \
        --data.train "$DATA/big_*.bin" | grep -v '^{'
}

# profile_stalls KERNEL: Nsight Compute's full set over one launch of KERNEL in build/attn_bench
# (its ANDREA-120M shapes run first), the source page's per-instruction stall samples summarised by
# bench/stall_profile.py (where the warps wait: stall reasons, the copies' mbarrier waits, the
# instructions with most samples); the report and the page stay as $OUT/stalls-KERNEL.*
profile_stalls() {
    local ncu rep="$OUT/stalls-$1"
    ncu=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
    run_cmd 240 "$ncu" --set full --import-source no -k "regex:$1" -s 2 -c 1 -f -o "$rep" build/attn_bench \
        > /dev/null || return 1
    "$ncu" -i "$rep.ncu-rep" --page source --csv --print-source sass > "$rep.csv" || return 1
    "$PY" bench/stall_profile.py "$rep.csv"
}

stage_profile() {
    local rc=0 k
    make_shard big 50257 3000000 || return 1
    profile_run 12M-bf16 bf16 "$DATA/big_*.bin" "${M12[@]}" || rc=1
    profile_run 120M-bf16 bf16 "$DATA/big_*.bin" "${M120[@]}" || rc=1
    # real text, where frequent tokens make the embedding backward's work uneven (random tokens
    # above are nearly all distinct)
    if compgen -G "data/megachat/megachat_train_*.bin" > /dev/null; then
        profile_run 120M-bf16-text bf16 "data/megachat/megachat_train_*.bin" "${M120[@]}" || rc=1
    fi
    "$PY" bench/kernel_profile.py "$OUT"/profile-*.csv || rc=1
    for k in k_attn_fwd k_attn_bwd_dq k_attn_bwd_dkv; do
        profile_sections "$k" > "$OUT/profile-$k.log" 2>&1 || rc=1
    done
    make build/attn_bench || return 1
    for k in k_attn_fwd_wgmma k_attn_bwd_dkv_wgmma k_attn_bwd_dq; do
        profile_stalls "$k" > "$OUT/stalls-$k.log" 2>&1 || rc=1
    done
    return "$rc"
}

run_stages "build kernel_check pytest_gpu timing pytest_engine sanitizer" "profile" "$@"
