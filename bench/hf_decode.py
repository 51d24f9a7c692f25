"""transformers' side of the decode benchmark (bench/decode_bench.py): greedy `generate` with the KV
cache, bf16, on a model directory written by scripts/export-hf.py.

    python3 bench/hf_decode.py MODEL_DIR --prompts FILE [--new-tokens 256] [--reps 3] [--device cuda]

FILE: {"batch size": [[prompt ids], ...]} (every prompt of a batch the same length, so no padding).
For each batch size: one warm-up `generate`, then --reps timed ones, each exactly --new-tokens long
(no end-of-sequence stop, as the engine's requests with no stop tokens). Prints one JSON line per
batch size: {"batch", "tokens_per_s" (median), "tokens_per_s_reps", "tokens" (the first sequence's
new tokens)}.
"""
import json
import statistics
import sys
import time

import torch
from transformers import AutoModelForCausalLM

from microgpt.cli import ArgumentParser


def timed_generate(model, ids, new_tokens):
    """(seconds, new token ids [batch, new_tokens]) of one greedy generate that runs to new_tokens."""
    if ids.device.type == "cuda":
        torch.cuda.synchronize(ids.device)
    t0 = time.perf_counter()
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False,
                         use_cache=True, pad_token_id=0)
    if ids.device.type == "cuda":
        torch.cuda.synchronize(ids.device)
    seconds = time.perf_counter() - t0
    new = out[:, ids.shape[1]:]
    if new.shape[1] != new_tokens:
        raise SystemExit(f"error: generate returned {new.shape[1]} new tokens, {new_tokens} asked")
    return seconds, new


def main(argv):
    p = ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("model_dir")
    p.add_argument("--prompts", required=True)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--device", default="cuda")
    args = p.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("error: no CUDA device visible to torch", file=sys.stderr)
        return 2
    with open(args.prompts) as f:
        batches = {int(b): prompts for b, prompts in json.load(f).items()}
    model = AutoModelForCausalLM.from_pretrained(args.model_dir).to(device=args.device, dtype=torch.bfloat16).eval()
    model.generation_config.eos_token_id = None   # run to max_new_tokens, never stop early
    with torch.inference_mode():
        for batch, prompts in sorted(batches.items()):
            ids = torch.tensor(prompts, dtype=torch.long, device=args.device)
            timed_generate(model, ids, min(8, args.new_tokens))
            runs = [timed_generate(model, ids, args.new_tokens) for _ in range(args.reps)]
            rates = [batch * args.new_tokens / seconds for seconds, _ in runs]
            print(json.dumps({"batch": batch, "tokens_per_s": statistics.median(rates), "tokens_per_s_reps": rates,
                              "tokens": runs[0][1][0].tolist()}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
