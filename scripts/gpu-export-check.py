#!/usr/bin/env python3
"""Check an exported model against the engine on a GPU machine (docs/DESIGN.md §5a): export a run
with scripts/export-hf.py, load it with transformers, and compare.

    python scripts/gpu-export-check.py runs/ANDREA-120M [--out DIR] [--engine cuda|cpu] [--device cuda|cpu]

  1. logits: transformers in fp32 (TF32 off, eager attention) against the engine's `--generate`
     logits in fp32 (`--train.precision fp32`) at the last position of a few ChatML prompts and a
     window of real text; the largest absolute difference must be within --atol (default 2e-3: two
     fp32 computations of a 12-layer model, summed in different orders, on logits of size ~10-30);
  2. greedy decoding: transformers' generate (KV cache) against the engine's greedy tokens, both
     fp32; reported as the number of leading tokens that agree (a near-tie may part them later);
  3. generate works in bf16 too: transformers' generate with the model in bf16, and the text.
Prints one JSON object per check and a summary; exits 1 if the logits differ by more than --atol
or the tokenizer files do not give the engine's prompt ids, 0 otherwise. Needs torch and
transformers (and a GPU for --device cuda).
"""
import json
import os
import subprocess
import sys
import tempfile

import numpy as np

from microgpt import tokenizer
from microgpt.cli import ArgumentParser
from microgpt.inference import Generator, pick_engine, resolve_checkpoint

CONVERSATIONS = [
    [{"role": "user", "content": "Hello! How are you today?"}],
    [{"role": "system", "content": "You are a helpful assistant."},
     {"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a short poem about the sea."}],
]
TEXT = ("It was the best of times, it was the worst of times, it was the age of wisdom, it was the age "
        "of foolishness, it was the epoch of belief, it was the epoch of incredulity")
GREEDY_TOKENS = 32


def report(record):
    print(json.dumps(record), flush=True)


def main(argv):
    p = ArgumentParser(description="Export a run and compare transformers with the engine.")
    p.add_argument("model", metavar="RUN_DIR_OR_CHECKPOINT")
    p.add_argument("--out", help="export directory (default: a temporary one)")
    p.add_argument("--engine", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--atol", type=float, default=2e-3)
    args = p.parse_args(argv)

    import torch
    import transformers
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    os.environ["HF_HUB_OFFLINE"] = "1"

    ckpt = resolve_checkpoint(args.model)
    out = args.out or tempfile.mkdtemp(prefix="andrea-export-")
    subprocess.run([sys.executable, os.path.join(os.path.dirname(os.path.abspath(__file__)), "export-hf.py"), ckpt, out],
                   check=True)
    tok = transformers.AutoTokenizer.from_pretrained(out)
    model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32,
                                                              attn_implementation="eager")
    model = model.to(args.device).eval()

    prompts = []
    for messages in CONVERSATIONS:
        ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        turns = [(m["role"], m["content"]) for m in messages]
        expected = tokenizer.encode_conversation(turns)[:-1] + [tokenizer.IM_START] + tokenizer.encode("assistant\n")
        if ids != expected:
            report({"check": "chat template", "ok": False, "transformers": ids, "engine": expected})
            return 1
        prompts.append(ids)
    prompts.append(tokenizer.encode(TEXT))
    report({"check": "chat template", "ok": True, "prompts": len(prompts) - 1})

    worst, agreements, failed = 0.0, [], False
    engine = pick_engine(args.engine)
    with Generator(engine, ckpt, ["--train.precision", "fp32"]) as gen:
        for ids in prompts:
            n = min(GREEDY_TOKENS, model.config.n_positions - len(ids))  # both stay within the context
            done, logits = gen.run({"prompt": ids, "max_tokens": n, "temperature": 0, "logits": True})
            with torch.no_grad():
                x = torch.tensor([ids], device=args.device)
                hf_logits = model(x).logits[0, -1].double().cpu().numpy()
                hf_greedy = model.generate(x, max_new_tokens=n, do_sample=False, eos_token_id=None,
                                           pad_token_id=tokenizer.EOT)[0, len(ids):].tolist()
            diff = float(np.abs(hf_logits - np.array(logits)).max())
            agree = next((i for i, (a, b) in enumerate(zip(hf_greedy, done["tokens"])) if a != b),
                         min(len(hf_greedy), len(done["tokens"])))
            worst = max(worst, diff)
            agreements.append(agree)
            failed |= diff > args.atol
            report({"check": "logits", "prompt_tokens": len(ids), "max_abs_diff": diff,
                    "logit_range": [float(hf_logits.min()), float(hf_logits.max())], "ok": diff <= args.atol,
                    "greedy_tokens_agreeing": agree, "of": n,
                    "engine_text": tokenizer.decode(done["tokens"])})

    model = model.to(torch.bfloat16)
    with torch.no_grad():
        x = torch.tensor([prompts[0]], device=args.device)
        n = min(64, model.config.n_positions - len(prompts[0]))
        new = model.generate(x, max_new_tokens=n, do_sample=True, top_k=40, temperature=0.8)[0, len(prompts[0]):]
    text = tok.decode(new, skip_special_tokens=True)
    report({"check": "transformers generate bf16", "new_tokens": len(new), "text": text, "ok": len(new) > 0})
    report({"summary": "export check", "ok": not failed and len(new) > 0, "max_abs_diff": worst, "atol": args.atol,
            "greedy_tokens_agreeing": agreements, "export_dir": out})
    return 1 if failed or len(new) == 0 else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
