#!/usr/bin/env bash
# pdl-ab.sh: the A/B of programmatic dependent launch (docs/DESIGN.md §9) on an sm_90 GPU machine, in
# one command; about 10 minutes on an H200 host (16 cores).
#
#   OUT=/some/dir bench/pdl-ab.sh          (OUT defaults to ./pdl-out; ROUNDS=2 rounds of runs)
#
# Builds the engine and kernel_check three ways, side by side and in parallel (the Makefile's
# KERNEL_VARIANTS and VARIANT_SUFFIX): build/microgpt_cuda_NAME, build/kernel_check_NAME for
#   default         ordinary launches (the current code)
#   pdl             -DUSE_PDL=1: programmatic launches; every kernel waits for its predecessor first
#                   thing, then lets its successor launch
#   pdl_notrigger   -DUSE_PDL=1 -DPDL_TRIGGER=0: the same without the early trigger (the successor
#                   launches when every block of this kernel has exited)
# Each build's kernel_check runs in full (a build that fails it is still timed, and marked FAILED).
# Then ANDREA-12M and ANDREA-120M, bf16 and fp8, 60 steps each on random tokens (scripts/check-lib.sh's
# timing_run and summarise), every build in turn, ROUNDS times: interleaved, so that a drift of the
# GPU's clocks hits every build alike. Logs in $OUT/build-NAME.log, $OUT/check-NAME.log,
# $OUT/timing.log; each run's median in $OUT/timing.json; at the end a table (also in
# $OUT/summary.txt): per model and precision, each build's median ms/step in each round and its
# change against default in µs per step (mean over the rounds).
# Exit status 1 if a build, check or run failed.
set -u -o pipefail
# shellcheck source=scripts/check-lib.sh
. "$(dirname "$0")/../scripts/check-lib.sh"

BUILDS=(default pdl pdl_notrigger)
declare -A FLAGS=([default]="" [pdl]="-DUSE_PDL=1" [pdl_notrigger]="-DUSE_PDL=1 -DPDL_TRIGGER=0")
ROUNDS=${ROUNDS:-2}
if ! [[ $ROUNDS =~ ^[1-9][0-9]?$ ]]; then
    echo "error: ROUNDS must be a whole number from 1 to 99, got '$ROUNDS'" >&2
    exit 2
fi

arch=$(gpu_arch)
if [ -z "$arch" ] || [ "$arch" -lt 90 ]; then
    echo "error: compute capability ${arch:-unknown}: programmatic dependent launch needs 9.0 (the builds would launch alike)" >&2
    exit 1
fi

check_init pdl-ab ./pdl-out

rc=0
pids=()
for b in "${BUILDS[@]}"; do
    # no binary of an earlier run may stand in for a failed build; -B: remade even when an older build
    # of other flags is newer than the sources
    rm -f "build/microgpt_cuda_$b" "build/kernel_check_$b"
    make -B VARIANT_SUFFIX="_$b" KERNEL_VARIANTS="${FLAGS[$b]}" "build/microgpt_cuda_$b" "build/kernel_check_$b" \
        >"$OUT/build-$b.log" 2>&1 &
    pids+=($!)
done
for i in "${!pids[@]}"; do
    if ! wait "${pids[$i]}"; then
        echo "!! build of ${BUILDS[$i]} failed: $OUT/build-${BUILDS[$i]}.log"
        tail -5 "$OUT/build-${BUILDS[$i]}.log"
        rc=1
    fi
done

declare -A check
timed=()
for b in "${BUILDS[@]}"; do
    if [ ! -x "build/microgpt_cuda_$b" ] || [ ! -x "build/kernel_check_$b" ]; then
        check[$b]="NOT BUILT"
        continue
    fi
    timed+=("$b")
    if run_cmd 600 "build/kernel_check_$b" >"$OUT/check-$b.log" 2>&1; then check[$b]=ok; else check[$b]=FAILED; rc=1; fi
    echo "$b: $(head -1 "$OUT/check-$b.log" | cut -c1-160) ... $(tail -1 "$OUT/check-$b.log")"
done

runs=()
if [ ${#timed[@]} -gt 0 ]; then
    make_shard big 50257 3000000 || exit 1
    for round in $(seq 1 "$ROUNDS"); do
        for model in 12M 120M; do
            if [ "$model" = 12M ]; then shape=("${M12[@]}"); else shape=("${M120[@]}"); fi
            for prec in bf16 fp8; do
                for b in "${timed[@]}"; do
                    name="$model-$prec-$b-r$round"
                    ENGINE_BIN="build/microgpt_cuda_$b" timing_run 60 "$name" "$prec" "${shape[@]}" \
                        >>"$OUT/timing.log" 2>&1 || { echo "!! run $name failed: $OUT/timing.log"; rc=1; }
                    runs+=("$name")
                done
            done
        done
    done
    summarise "$OUT/timing.json" "${runs[@]}" >>"$OUT/timing.log" || rc=1
fi

checks=()
for b in "${BUILDS[@]}"; do checks+=("$b=${check[$b]}"); done
"$PY" - "$OUT/timing.json" "${checks[@]}" <<'EOF' | tee "$OUT/summary.txt"
import json, statistics, sys
from pathlib import Path
path, checks = Path(sys.argv[1]), dict(a.split("=", 1) for a in sys.argv[2:])
builds = list(checks)
ms = {}  # (model, precision, build) -> [median ms/step of each round]
for row in json.loads(path.read_text()) if path.exists() else []:
    model, prec, build, _ = row["run"].split("-")
    if row["ms_per_step_median"] is not None:
        ms.setdefault((model, prec, build), []).append(row["ms_per_step_median"])
print("median ms/step of each round (60 steps, the first 10 left out); change: µs per step against default")
print(f"{'run':10s}" + "".join(f"  {b + ' ms':>22s}  {'change':>8s}" for b in builds))
for model in ("12M", "120M"):
    for prec in ("bf16", "fp8"):
        base = ms.get((model, prec, "default"))
        line = f"{model + ' ' + prec:10s}"
        for b in builds:
            got = ms.get((model, prec, b))
            rounds = " ".join(f"{v:.3f}" for v in got) if got else "-"
            change = f"{(statistics.mean(got) - statistics.mean(base)) * 1000:+.0f}" if got and base else "-"
            line += f"  {rounds:>22s}  {change:>8s}"
        print(line)
print("kernel_check: " + ", ".join(f"{b} {c}" for b, c in checks.items()))
EOF
exit $rc
