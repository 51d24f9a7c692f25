#!/usr/bin/env python3
"""A stand-in engine for fast proxy tests: speaks the engine's stdout protocol (docs/DESIGN.md),
writes checkpoints in the SPEC format and obeys SIGTERM/SIGINT/SIGUSR1 like the real engines, but
trains nothing (the loss is a fixed curve). The end-to-end tests use build/microgpt_cpu instead.

FAKE_ENGINE_MS sets the time per step (default 20 ms)."""
import json
import os
import signal
import struct
import sys
import time

N_PARAMS = 16
flags = {"stop": False, "usr1": False}


def emit(obj):
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def parse(argv):
    args, prompts, i = {}, [], 0
    while i < len(argv):
        key = argv[i][2:]
        if key == "resume":
            args["resume"] = True
            i += 1
            continue
        if key == "sample.prompt":
            prompts.append([int(t) for t in argv[i + 1].split(",")])
        else:
            args[key] = argv[i + 1]
        i += 2
    return args, prompts


def write_checkpoint(path, step, reason):
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<ii", step, N_PARAMS) + bytes(12 * N_PARAMS))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    with open(path + ".json", "w") as f:
        json.dump({"step": step, "n_params": N_PARAMS, "loss_scale": 1.0}, f)
    emit({"event": "checkpoint", "step": step, "path": path, "reason": reason})


def main():
    args, prompts = parse(sys.argv[1:])
    if "bogus" in args:
        print("error: unknown flag --bogus", file=sys.stderr)
        return 2
    steps, ckpt = int(args["train.steps"]), args.get("checkpoint")
    step = 0
    if args.get("resume"):
        with open(ckpt, "rb") as f:
            step = struct.unpack("<i", f.read(4))[0]
    tps = int(args.get("train.batch_size", 8)) * int(args.get("model.seq_len", 64))
    every = {k: int(args.get(k, 0)) for k in ("eval.every", "sample.every", "checkpoint.every")}
    polish = int(args.get("polish.start_step", -1))
    delay = float(os.environ.get("FAKE_ENGINE_MS", "20")) / 1000
    signal.signal(signal.SIGTERM, lambda *_: flags.update(stop=True))
    signal.signal(signal.SIGINT, lambda *_: flags.update(stop=True))
    signal.signal(signal.SIGUSR1, lambda *_: flags.update(usr1=True))
    emit({"event": "start", "engine": "fake", "name": args.get("name", "run"), "n_params": N_PARAMS,
          "step": step, "steps": steps, "tokens_per_step": tps})
    if step >= steps:
        emit({"event": "exit", "step": step, "reason": "already_finished"})
        return 0
    while step < steps:
        if step == polish:
            emit({"event": "polish", "step": step})
        time.sleep(delay)
        step += 1
        emit({"step": step, "loss": 10.0 / (1 + 0.05 * step), "lr": 1e-3, "grad_norm": 1.0,
              "ms": delay * 1000, "tokens_per_s": tps / delay, "tokens": step * tps,
              "phase": "polish" if 0 <= polish < step else "pretrain"})
        if every["eval.every"] and step % every["eval.every"] == 0:
            emit({"step": step, "val_loss": 11.0 / (1 + 0.05 * step)})
        if every["sample.every"] and step % every["sample.every"] == 0:
            for i, p in enumerate(prompts):
                emit({"event": "sample", "step": step, "prompt": i, "prompt_tokens": p,
                      "tokens": [72, 105]})
        if flags["stop"]:
            write_checkpoint(ckpt, step, "signal")
            emit({"event": "exit", "step": step, "reason": "signal"})
            return 0
        if flags["usr1"]:
            flags["usr1"] = False
            write_checkpoint(ckpt, step, "usr1")
        elif every["checkpoint.every"] and step % every["checkpoint.every"] == 0:
            write_checkpoint(ckpt, step, "periodic")
    write_checkpoint(ckpt, step, "final")
    emit({"event": "exit", "step": step, "reason": "finished"})
    return 0


if __name__ == "__main__":
    sys.exit(main())
