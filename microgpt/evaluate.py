#!/usr/bin/env python3
"""Loss and perplexity of a trained model on text, as JSON (docs/DESIGN.md §5a).

    python microgpt/evaluate.py RUN_DIR_OR_CHECKPOINT FILE_OR_GLOB [--batches N] [--engine cuda|cpu]

FILE_OR_GLOB is
  * a glob over token shards (llm.c format, e.g. 'data/megachat/megachat_val_*.bin'), or
  * a .jsonl file of conversations (ShareGPT or OpenAI records), each rendered in ChatML and closed
    with <|endoftext|> exactly as the data pipeline renders it (microgpt/tokenizer.py); malformed
    records are skipped and counted, as the pipeline does, or
  * a .txt file, one document: its text, then <|endoftext|>; UTF-8, read as the data pipeline
    reads a text (a byte-order mark is no text, a file in UTF-16 or UTF-32 is refused).
A file is tokenized into a temporary shard (in memory first: one too large for the memory left is
one error, score it in parts). The engine's `--evaluate` mode scores it: the same code
and the same windows as the training loop's validation, so `--batches N` on a run's validation
shards reproduces the val_loss the run reported with eval.batches N. Without --batches every full
window of seq_len + 1 tokens is scored once.

Output, one JSON object on stdout:
    {"loss": 4.19, "perplexity": 66.0, "tokens": 81920, "batches": 20, "checkpoint": ..., "step": ...,
     "data": ..., "engine": "cpu"|"cuda"[, "documents": n, "skipped": {reason: n}]}
perplexity is null where e^loss is past the largest double; a loss that is no finite number is an
error.
"""
import glob
import json
import math
import os
import subprocess
import sys
import tempfile

import numpy as np

from microgpt import tokenizer
from microgpt.cli import (USAGE_ERROR, ArgumentParser, answer_on_stdout, error, interrupted, no_stdout, say,
                          stop_on_sigterm)
from microgpt.engines import ENGINE_INT_MAX, ENGINE_TEXT
from microgpt.files import RECORD_TOO_LONG, open_regular, record_lines
from microgpt.inference import (STDERR_TAIL_LINES, InferenceError, engine_failure, engine_name, engine_warnings,
                                pick_engine, read_model_shape, resolve_checkpoint)
from microgpt.shards import ShardError, write_shard

TEXT_SUFFIXES = (".txt", ".jsonl")  # compared lower-cased: notes.TXT is text too


def is_text_file(path):
    return path.lower().endswith(TEXT_SUFFIXES)


def tokenize_file(path):
    """A .txt or .jsonl file -> (token ids, a uint16 array: 2 bytes a token, where a list of Python
    ints takes about 36; documents; {malformed reason: count}). A .jsonl file's lines are read as the
    data pipeline reads them (files.record_lines: bytes, cut at newlines only) and skipped for the
    same reasons (an invalid UTF-8 byte among them)."""
    eot = np.array([tokenizer.EOT], dtype=np.uint16)
    try:
        if path.lower().endswith(".txt"):
            # as the data pipeline reads a text (prep-megachat.py): UTF-16 or UTF-32 refused, a
            # UTF-8 byte-order mark no text, the file's own line ends
            with open(open_regular(path), "rb") as f:
                if tokenizer.is_utf16_or_32(f.read(tokenizer.TEXT_HEAD_BYTES), plain_text=True):
                    raise InferenceError(f"{path}: {tokenizer.NOT_UTF8}")
                f.seek(0)
                text = f.read().decode("utf-8-sig", errors="replace")
            return np.concatenate([tokenizer.encode_array(text), eot]), 1, {}
        with open(open_regular(path), "rb") as f:
            conversations, skipped = [], {}
            for line, _ in record_lines(f):
                try:
                    if line is None:
                        raise ValueError(RECORD_TOO_LONG)
                    turns = tokenizer.parse_conversation_line(line)
                except ValueError as e:
                    skipped[str(e)] = skipped.get(str(e), 0) + 1
                    continue
                conversations.append(np.array(tokenizer.encode_conversation(turns), dtype=np.uint16))
            return np.concatenate(conversations or [eot[:0]]), len(conversations), skipped
    except FileNotFoundError as e:
        hint = " (a .txt or .jsonl file is read as one file, not as a glob)" if glob.has_magic(path) else ""
        raise InferenceError(f"{path}: {e.strerror}{hint}") from None
    except OSError as e:
        raise InferenceError(f"{path}: {e.strerror}") from None
    except MemoryError:  # a text larger than the memory left: its bytes, its text and its tokens are held
        raise InferenceError(f"{path}: out of memory while reading and tokenizing it; score it in parts") from None


def run_evaluate(engine, ckpt, shard_glob, batches, warn=None):
    """ENGINE --evaluate -> its {"loss", "tokens", "batches", "checkpoint_step"} record. warn (a function
    of one line), where given, gets the engine's warning lines (a checkpoint loaded unverified, §15)."""
    cmd = [engine, "--evaluate", "--checkpoint", ckpt, "--data.val", shard_glob, "--eval.batches", str(batches)]
    try:
        res = subprocess.run(cmd, capture_output=True, **ENGINE_TEXT)
    except OSError as e:
        raise InferenceError(f"cannot start {engine}: {e.strerror or e}") from None
    if res.returncode != 0:
        raise InferenceError(engine_failure("the engine could not evaluate", res.returncode,
                                            res.stderr.splitlines()[-STDERR_TAIL_LINES:]))
    for line in engine_warnings(res.stderr) if warn else ():
        warn(line)
    for line in reversed(res.stdout.splitlines()):
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and "loss" in record:
            return record
    raise InferenceError(f"the engine printed no loss record; stdout: {res.stdout.strip()[-500:]}")


def perplexity(loss):
    """e^loss, or None past the largest double (a loss above about 709.78): JSON has no infinity."""
    try:
        return math.exp(loss)
    except OverflowError:
        return None


def evaluate(engine, model, data, batches, warn=None):
    """The JSON-ready result for RUN_DIR_OR_CHECKPOINT `model` on FILE_OR_GLOB `data` (warn: the
    engine's warnings, run_evaluate)."""
    ckpt = resolve_checkpoint(model)
    shape = read_model_shape(ckpt)
    extra = {}
    with tempfile.TemporaryDirectory(prefix="andrea-eval-") as tmp:
        if is_text_file(data):
            ids, documents, skipped = tokenize_file(data)
            window = shape["seq_len"] + 1
            if not documents and skipped:  # not "0 tokens": the file has records, none of them readable
                reasons = ", ".join(f"{reason}: {n}" for reason, n in sorted(skipped.items()))
                raise InferenceError(f"{data} holds no conversation to score: every record was skipped as "
                                     f"malformed ({reasons}); a record is a ShareGPT \"conversations\" or an "
                                     f"OpenAI \"messages\" object, one a line")
            if len(ids) < window:
                raise InferenceError(f"{data} has {len(ids)} tokens; scoring needs at least one window "
                                     f"of seq_len + 1 = {window}")
            shard_glob = os.path.join(tmp, "eval_000000.bin")
            try:
                write_shard(shard_glob, ids)
            except ShardError as e:  # more tokens than a shard's int32 count holds
                raise InferenceError(f"{data}: {e}; score it in parts") from None
            except OSError as e:  # a full temporary folder: one line, not a traceback
                raise InferenceError(f"cannot write the temporary shard of {data} in {tmp}: {e.strerror or e} "
                                     "(TMPDIR names a folder with more room)") from None
            extra = {"documents": documents, "skipped": skipped}
        else:
            if not glob.glob(data):
                raise InferenceError(f"{data}: no shard matches (give a shard glob, or a .txt/.jsonl file)")
            shard_glob = data
        record = run_evaluate(engine, ckpt, shard_glob, batches, warn)
    if record["loss"] is None:  # the engine prints a loss that is no finite number as null
        raise InferenceError(f"the model's loss on {data} is no finite number: its weights overflow the forward "
                             "pass (an untrained, diverged or edited checkpoint)")
    loss = float(record["loss"])
    # the step of the checkpoint the engine scored, not the sidecar's read above: a run still training
    # replaces the file every checkpoint.every steps, also while a large text is tokenized
    return {"loss": loss, "perplexity": perplexity(loss), "tokens": record["tokens"], "batches": record["batches"],
            "checkpoint": ckpt, "step": record.get("checkpoint_step", shape["step"]), "data": data,
            "engine": engine_name(engine), **extra}


def parse_args(argv):
    p = ArgumentParser(description="Loss and perplexity of a trained model, as JSON.")
    p.add_argument("model", metavar="RUN_DIR_OR_CHECKPOINT",
                   help="a run directory (runs/<name>/, its <name>.ckpt) or a checkpoint file")
    p.add_argument("data", metavar="FILE_OR_GLOB",
                   help="a glob over token shards, or a .txt / .jsonl (conversations) file")
    p.add_argument("--batches", type=int, default=0,
                   help="score the first N validation batches, as the training loop does with "
                        "eval.batches N (default 0: every full window once)")
    p.add_argument("--engine", choices=("cuda", "cpu"),
                   help="default: the GPU engine when built and a GPU is visible, else the CPU engine")
    args = p.parse_args(argv)
    if not 0 <= args.batches <= ENGINE_INT_MAX:
        p.error(f"--batches must be in [0, {ENGINE_INT_MAX}]")
    return args


def main(argv):
    stop_on_sigterm()  # the engine stopped and the temporary shard removed, as on Ctrl-C
    args = parse_args(argv)
    if no_stdout():  # file descriptor 1 closed: the result would go nowhere, and exit 0 say it went well
        return USAGE_ERROR
    try:
        engine = pick_engine(args.engine)
        result = evaluate(engine, args.model, args.data, args.batches, warn=say)
    except (InferenceError, tokenizer.TokenizerUnavailable) as e:
        error(e)
        return USAGE_ERROR
    except KeyboardInterrupt:  # the engine (subprocess.run's child) is killed, the temporary shard removed
        return interrupted("evaluate", "nothing was scored")
    return answer_on_stdout(lambda: print(json.dumps(result)))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
