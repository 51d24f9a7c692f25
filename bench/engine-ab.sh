#!/usr/bin/env bash
# engine-ab.sh: whole training steps of the engine built with other -D flags, checked and timed beside
# the default build on the GPU machine, in one command: the A/B of a step-level candidate put behind
# a compile-time macro (docs/DESIGN.md §9; attn-variants.sh does the same for the attention kernels
# alone). About 3 minutes per build and round on an H200 host (16 cores).
#
#   OUT=/some/dir bench/engine-ab.sh NAME=FLAGS...     (OUT defaults to ./engine-ab-out)
#   e.g. SAME_BITS=1 bench/engine-ab.sh "cand=-DMY_CANDIDATE=1"   (MY_CANDIDATE: the macro under test)
#
# Builds the engine and kernel_check per NAME with FLAGS, and `default` without, side by side and in
# parallel (the Makefile's KERNEL_VARIANTS and VARIANT_SUFFIX): build/microgpt_cuda_NAME,
# build/kernel_check_NAME. Each build's kernel_check runs in full (a build that fails it is still
# timed, and marked FAILED). With SAME_BITS=1 (a candidate that must not change a bit), each
# variant also runs tests/test_gpu.py's and tests/test_fp8_small.py's bit-equality tests against it
# (graphs = launch by launch, and records, checkpoints and fp8 histories equal to the default
# build's, on the side stream too: ANDREA_CUDA_ENGINE, ANDREA_CUDA_BASELINE;
# log $OUT/pytest-NAME.log), and losses that differ from the default's below count as a failure.
# Then ANDREA-12M and ANDREA-120M (AB_MODELS), bf16 and fp8 (AB_PRECS), AB_STEPS steps each (default 60; scripts/check-lib.sh's
# timing_run and summarise) on random tokens, or on the shards of the glob AB_SHARDS, relative to the
# repository root (the benchmark's text: a frequent token's embedding backward and the power a step
# draws depend on the tokens), every build in turn, ROUNDS times (default 2): interleaved, so that a
# drift of the GPU's clocks hits every build alike. Logs in $OUT/build-NAME.log,
# $OUT/check-NAME.log, $OUT/timing.log; each run's median in $OUT/timing.json; at the end a table
# (also in $OUT/summary.txt): per model and precision, each build's median ms/step in each round,
# its change against default in µs per step (mean over the rounds), and whether its losses are
# the default's bit for bit ('=' or 'differ').
# FLAGS are -DMACRO[=VALUE] and -UMACRO words only. With AB_PREBUILT=1 nothing is built: each build's
# build/microgpt_cuda_NAME and build/kernel_check_NAME must be there already (made for this GPU
# elsewhere with the same make command, e.g. on a machine without one with GPU_ARCH=90, to spend the
# GPU's time on the checks and runs alone); a missing one is refused before anything runs. Exit
# status 1 if a build, check, test or run failed, 2 on bad arguments.
set -u -o pipefail
# shellcheck source=scripts/check-lib.sh
. "$(dirname "$0")/../scripts/check-lib.sh"

parse_builds "$@"
if [ ${#BUILD_NAMES[@]} -eq 0 ]; then
    echo "error: no build to compare with the default (NAME=FLAGS...)" >&2
    exit 2
fi
BUILDS=(default "${BUILD_NAMES[@]}")
ROUNDS=${ROUNDS:-2}
if ! [[ $ROUNDS =~ ^[1-9][0-9]?$ ]]; then
    echo "error: ROUNDS must be a whole number from 1 to 99, got '$ROUNDS'" >&2
    exit 2
fi
AB_STEPS=${AB_STEPS:-60}
if ! [[ $AB_STEPS =~ ^[1-9][0-9]{1,3}$ ]] || [ "$AB_STEPS" -le 10 ]; then # the median leaves out 10 steps
    echo "error: AB_STEPS must be a whole number from 11 to 9999, got '$AB_STEPS'" >&2
    exit 2
fi
AB_MODELS=${AB_MODELS:-12M 120M}
AB_PRECS=${AB_PRECS:-bf16 fp8}
# a candidate that touches one model or precision times only those
for word in $AB_MODELS; do
    case $word in 12M | 120M) ;; *) echo "error: AB_MODELS takes 12M and 120M, got '$word'" >&2; exit 2 ;; esac
done
for word in $AB_PRECS; do
    case $word in bf16 | fp8) ;; *) echo "error: AB_PRECS takes bf16 and fp8, got '$word'" >&2; exit 2 ;; esac
done
AB_PREBUILT=${AB_PREBUILT:-0}
if [ "$AB_PREBUILT" != 0 ] && [ "$AB_PREBUILT" != 1 ]; then
    echo "error: AB_PREBUILT must be 0 or 1, got '$AB_PREBUILT'" >&2
    exit 2
fi
if [ "$AB_PREBUILT" = 1 ]; then
    for b in "${BUILDS[@]}"; do
        for tool in microgpt_cuda kernel_check; do
            bin="$(dirname "$0")/../build/${tool}_$b"
            if [ ! -x "$bin" ]; then
                echo "error: AB_PREBUILT=1 but build/${tool}_$b is not there (make VARIANT_SUFFIX=_$b ...)" >&2
                exit 2
            fi
        done
    done
fi
SAME_BITS=${SAME_BITS:-0}
if [ "$SAME_BITS" != 0 ] && [ "$SAME_BITS" != 1 ]; then # a typo must not silently skip the bit tests
    echo "error: SAME_BITS must be 0 or 1, got '$SAME_BITS'" >&2
    exit 2
fi
# the timing runs' shards, checked now rather than by every run after the builds (from the repository
# root, where check_init runs them)
if [ -n "${AB_SHARDS:-}" ] && ! (cd "$(dirname "$0")/.." && compgen -G "$AB_SHARDS" >/dev/null); then
    echo "error: AB_SHARDS matches no file: '$AB_SHARDS' (a glob, relative to the repository root)" >&2
    exit 2
fi

check_init engine-ab ./engine-ab-out

rc=0
if [ "$AB_PREBUILT" = 0 ]; then build_variants microgpt_cuda kernel_check || rc=1; fi

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
    if [ "$SAME_BITS" = 1 ] && [ "$b" != default ] && [ -x build/microgpt_cuda_default ]; then
        if ANDREA_CUDA_ENGINE="build/microgpt_cuda_$b" ANDREA_CUDA_BASELINE=build/microgpt_cuda_default \
            run_cmd 600 "$PY" -m pytest -m gpu -q -rA tests/test_gpu.py tests/test_fp8_small.py \
            -k "baseline_build or graphs_give" \
            >"$OUT/pytest-$b.log" 2>&1; then
            check[$b]+=", bit tests ok"
        else
            check[$b]+=", bit tests FAILED"
            rc=1
        fi
        echo "$b: $(tail -1 "$OUT/pytest-$b.log")"
    fi
done

runs=()
if [ ${#timed[@]} -gt 0 ]; then
    if [ -n "${AB_SHARDS:-}" ]; then
        export TIMING_SHARDS=$AB_SHARDS
    else
        make_shard big 50257 3000000 || exit 1
    fi
    for round in $(seq 1 "$ROUNDS"); do
        for model in $AB_MODELS; do
            if [ "$model" = 12M ]; then shape=("${M12[@]}"); else shape=("${M120[@]}"); fi
            for prec in $AB_PRECS; do
                for b in "${timed[@]}"; do
                    name="$model-$prec-$b-r$round"
                    ENGINE_BIN="build/microgpt_cuda_$b" timing_run "$AB_STEPS" "$name" "$prec" "${shape[@]}" \
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
"$PY" - "$OUT/timing.json" "$DATA" "$SAME_BITS" "$AB_STEPS" "${checks[@]}" <<'EOF' | tee "$OUT/summary.txt" || rc=1
import json, statistics, sys
from pathlib import Path
path, data, same_bits, steps = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3] == "1", sys.argv[4]
checks = dict(a.split("=", 1) for a in sys.argv[5:])
builds = list(checks)
ms = {}  # (model, precision, build) -> [median ms/step of each round]
for row in json.loads(path.read_text()) if path.exists() else []:
    model, prec, build, _ = row["run"].rsplit("-", 3)
    if row["ms_per_step_median"] is not None:
        ms.setdefault((model, prec, build), []).append(row["ms_per_step_median"])

def losses(run):
    f = data / f"{run}.jsonl"
    recs = [json.loads(l) for l in f.read_text().splitlines() if l.startswith("{")] if f.exists() else []
    return [r["loss"] for r in recs if "loss" in r and "event" not in r]

differ = False
print(f"median ms/step of each round ({steps} steps, the first 10 left out); change: µs per step against default;")
print("losses: every round's step losses equal to default's ('=') or not ('differ')")
print(f"{'run':10s}" + "".join(f"  {b + ' ms':>22s}  {'change':>8s}  {'losses':>6s}" for b in builds))
for model in ("12M", "120M"):
    for prec in ("bf16", "fp8"):
        base = ms.get((model, prec, "default"))
        line = f"{model + ' ' + prec:10s}"
        for b in builds:
            got = ms.get((model, prec, b))
            rounds = " ".join(f"{v:.3f}" for v in got) if got else "-"
            change = f"{(statistics.mean(got) - statistics.mean(base)) * 1000:+.0f}" if got and base else "-"
            same = "-"
            if got and base and b != "default":
                pairs = [(losses(f"{model}-{prec}-{b}-r{r}"), losses(f"{model}-{prec}-default-r{r}"))
                         for r in range(1, len(got) + 1)]
                same = "=" if all(x and x == y for x, y in pairs) else "differ"
                differ |= same != "="
            line += f"  {rounds:>22s}  {change:>8s}  {same:>6s}"
        print(line)
print("kernel_check: " + ", ".join(f"{b} {c}" for b, c in checks.items()))
sys.exit(1 if same_bits and differ else 0)
EOF
exit $rc
