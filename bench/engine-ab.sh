#!/usr/bin/env bash
# engine-ab.sh: whole training steps of the engine built with other -D flags, checked and timed beside
# the default build, for the GPU machine: an A/B of a step-level idea put behind a compile-time macro
# (docs/BENCHMARKS.md, optimisation log; attn-variants.sh does the same for the attention kernels).
#
#   OUT=/some/dir bench/engine-ab.sh NAME=FLAGS...     (OUT defaults to ./engine-ab-out)
#   e.g. bench/engine-ab.sh "side=-DSIDE_STREAM_WGRAD=1"
#
# Per build NAME (and `default`, no flags): build/microgpt_cuda_NAME and build/kernel_check_NAME
# (the Makefile's KERNEL_VARIANTS; build/microgpt_cuda and build/kernel_check are left as the
# default build). Per variant: its full kernel_check, then tests/test_gpu.py's bit-equality tests
# against it (graphs = launch by launch, and the same records and checkpoints as the default build:
# ANDREA_CUDA_ENGINE / ANDREA_CUDA_BASELINE). Then ANDREA-12M and ANDREA-120M in bf16 and fp8, 60
# steps each on random tokens (scripts/check-lib.sh's timing_run), the builds one after the other
# per model and precision; at the end a table of median ms per step (steps 11-60), each variant's
# change against the default and whether its losses equal the default's bit for bit (also in
# $OUT/summary.txt, step records in $OUT/NAME-MODEL-PRECISION.jsonl). Logs: $OUT/build-NAME.log,
# $OUT/check-NAME.log, $OUT/pytest-NAME.log. FLAGS are -DMACRO[=VALUE] and -UMACRO words only.
# Exit status 1 if a build, check, test or run failed or a variant's losses differ, 2 on bad
# arguments. About 3 minutes per build on an H200 host.
set -u -o pipefail
# shellcheck source=scripts/check-lib.sh
. "$(dirname "$0")/../scripts/check-lib.sh"

parse_builds "$@"
NAMES=("${BUILD_NAMES[@]}") FLAGS=("${BUILD_FLAGS[@]}")
[ ${#NAMES[@]} -gt 0 ] || { echo "error: no variant given (NAME=FLAGS...)" >&2; exit 2; }
check_init engine-ab ./engine-ab-out
ARCH=$(gpu_arch)
rc=0

# build_as NAME FLAGS: both binaries with FLAGS, copied to their _NAME names
build_as() {
    make -B -j2 GPU_ARCH="$ARCH" KERNEL_VARIANTS="$2" build/microgpt_cuda build/kernel_check >"$OUT/build-$1.log" 2>&1 &&
        cp build/microgpt_cuda "build/microgpt_cuda_$1" && cp build/kernel_check "build/kernel_check_$1"
}

# the variants first, the default last: build/microgpt_cuda and build/kernel_check end as the default
for i in "${!NAMES[@]}"; do
    echo "== build ${NAMES[$i]} (${FLAGS[$i]})"
    build_as "${NAMES[$i]}" "${FLAGS[$i]}" || { echo "!! build of ${NAMES[$i]} failed: $OUT/build-${NAMES[$i]}.log"; rc=1; }
done
echo "== build default"
build_as default "" || { echo "!! default build failed: $OUT/build-default.log"; exit 1; }

declare -A checked
for name in "${NAMES[@]}"; do
    checked[$name]="NOT BUILT"
    [ -x "build/microgpt_cuda_$name" ] || continue
    checked[$name]=ok
    echo "== $name: kernel_check, bit-equality tests"
    run_cmd 400 "build/kernel_check_$name" >"$OUT/check-$name.log" 2>&1 || { checked[$name]="kernel_check FAILED"; rc=1; }
    tail -1 "$OUT/check-$name.log"
    ANDREA_CUDA_ENGINE="build/microgpt_cuda_$name" ANDREA_CUDA_BASELINE="build/microgpt_cuda_default" \
        run_cmd 600 "$PY" -m pytest -m gpu -q -rA tests/test_gpu.py -k "baseline_build or graphs_give" \
        >"$OUT/pytest-$name.log" 2>&1 || { checked[$name]="${checked[$name]/ok/} tests FAILED"; rc=1; }
    tail -1 "$OUT/pytest-$name.log"
done

make_shard big 50257 3000000 || exit 1
for model in 12M 120M; do
    if [ "$model" = 12M ]; then shape=("${M12[@]}"); else shape=("${M120[@]}"); fi
    for prec in bf16 fp8; do
        for name in default "${NAMES[@]}"; do
            [ -x "build/microgpt_cuda_$name" ] || continue
            echo "== $name $model $prec"
            ENGINE="build/microgpt_cuda_$name" timing_run 60 "$name-$model-$prec" "$prec" "${shape[@]}" || rc=1
            cp "$DATA/$name-$model-$prec.jsonl" "$OUT/"
        done
    done
done

for name in "${NAMES[@]}"; do echo "$name ${checked[$name]}"; done >"$DATA/checked.txt"
"$PY" - "$OUT" "$DATA/checked.txt" default "${NAMES[@]}" <<'EOF' | tee "$OUT/summary.txt" || rc=1
import json, statistics, sys
from pathlib import Path
out, checked, names = Path(sys.argv[1]), sys.argv[2], sys.argv[3:]
status = dict(line.rstrip("\n").split(" ", 1) for line in open(checked))
runs = [f"{m}-{p}" for m in ("12M", "120M") for p in ("bf16", "fp8")]

def steps(name, run):
    path = out / f"{name}-{run}.jsonl"
    if not path.exists():
        return None
    recs = [json.loads(l) for l in path.read_text().splitlines() if l.startswith("{")]
    return [r for r in recs if "loss" in r and "event" not in r]

bad = False
print(f"median ms/step (steps 11-60); a variant: its change against default, '=' its losses equal default's")
print(f"{'build':12s}" + "".join(f" {r:>22s}" for r in runs) + "  checks")
base = {r: steps("default", r) for r in runs}
for name in names:
    cells = []
    for r in runs:
        s = steps(name, r)
        if not s or len(s) <= 10:
            cells.append("-")
            bad = True
            continue
        ms = statistics.median(x["ms"] for x in s[10:])
        cell = f"{ms:.3f}"
        if name != "default" and base[r] and len(base[r]) > 10:
            ms0 = statistics.median(x["ms"] for x in base[r][10:])
            same = [x["loss"] for x in s] == [x["loss"] for x in base[r]]
            bad |= not same
            cell += f" {100 * (ms / ms0 - 1):+.1f}% {'=' if same else 'DIFF'}"
        cells.append(cell)
    print(f"{name:12s}" + "".join(f" {c:>22s}" for c in cells) + f"  {status.get(name, '')}")
sys.exit(1 if bad else 0)
EOF
exit $rc
