#!/usr/bin/env bash
# gpu-real-runs.sh: the real-data runs on the GPU machine, through the proxy as a user runs them.
#   OUT=DIR scripts/gpu-real-runs.sh [CHAT_STEPS]
# 1. ANDREA-12M on the megachat shards for CHAT_STEPS steps (default 4000): the model card's run.
# 2. ANDREA-120M for 200 steps in bf16 and in fp16: no divergence.
# Needs: build/microgpt_cuda (make), data/megachat + data/assets (make data), flask and tiktoken.
# Each run's .loss.json, .samples.json and .state.json are packed into $OUT/real-runs.tgz.
set -u -o pipefail
cd "$(dirname "$0")/.." || exit 1
OUT=${OUT:-./gpu-out}; mkdir -p "$OUT"
CHAT_STEPS=${1:-4000}
WORK=$(mktemp -d /tmp/andrea-real.XXXXXX)

# derive CONFIG NAME JSON-OVERRIDES: a copy of an experiment with some keys replaced
derive() {
    python3 - "$1" "$2" "$3" "$WORK/$2.json" <<'PY'
import json, sys
cfg = json.load(open(sys.argv[1]))
cfg["name"] = sys.argv[2]
for dotted, value in json.loads(sys.argv[3]).items():
    section, key = dotted.split(".")
    cfg.setdefault(section, {})[key] = value
json.dump(cfg, open(sys.argv[4], "w"), indent=1)
PY
}

run() { # NAME: train it through the proxy, keep its records
    echo "=== $1 ($(date -u +%H:%M:%S) UTC)"
    python3 microgpt/training_proxy.py "$WORK/$1.json" --engine cuda --no-server --run-dir "$WORK/runs/$1" \
        > "$WORK/$1.proxy.log" 2>&1
    local rc=$?
    echo "proxy exit status $rc"; tail -n 3 "$WORK/$1.proxy.log"
    python3 - "$WORK/runs/$1/$1.loss.json" <<'PY'
import json, sys
recs = [r for r in json.load(open(sys.argv[1])) if r.get("live", 1)]
steps = [r for r in recs if "loss" in r]
vals = [r for r in recs if "val_loss" in r]
ms = sorted(r["ms"] for r in steps[10:]) or [0]
print(f"steps {len(steps)}  first loss {steps[0]['loss']:.4f}  last loss {steps[-1]['loss']:.4f}  "
      f"median {ms[len(ms)//2]:.3f} ms/step")
print("val_loss by step: " + "  ".join(f"{r['step']}:{r['val_loss']:.4f}" for r in vals))
PY
}

derive experiments/ANDREA-12M-TRAIN.json ANDREA-12M-chat \
    "{\"train.steps\": $CHAT_STEPS, \"eval.every\": 250, \"sample.every\": 1000, \"checkpoint.every\": 1000}"
run ANDREA-12M-chat
for p in bf16 fp16; do
    derive experiments/ANDREA-120M-TRAIN.json "ANDREA-120M-$p" \
        "{\"train.steps\": 200, \"train.precision\": \"$p\", \"train.warmup_steps\": 20, \"eval.every\": 50, \"sample.every\": 200, \"checkpoint.every\": 0}"
    run "ANDREA-120M-$p"
done
echo "=== last samples of the chat run"
python3 -c "
import json,sys
s=json.load(open('$WORK/runs/ANDREA-12M-chat/ANDREA-12M-chat.samples.json'))
for r in s[-3:]: print('--- step', r['step']); print(r['prompt'] + r['text'])
"
(cd "$WORK" && tar czf "$OUT/real-runs.tgz" --exclude='*.ckpt' --exclude='*.ckpt.json' --exclude='*.ckpt.prev' --exclude='*.ckpt.prev.json' runs *.proxy.log *.json)
rm -rf "$WORK"
