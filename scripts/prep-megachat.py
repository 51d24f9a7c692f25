#!/usr/bin/env python3
"""Render conversations in ChatML, tokenize them in parallel and write train/val token shards (SPEC §7).

    python scripts/prep-megachat.py --chat data/raw/hermes3/hermes3.jsonl \\
        --text data/raw/shakespeare:0.5 --out-dir data/megachat --name megachat

Sources, mixed in command-line order (repeatable):
  --chat PATH[:WEIGHT]   JSON-lines conversations (ShareGPT or OpenAI records, e.g. the output of
                         pull-hermes3.py), a file or a folder of *.jsonl. Each conversation becomes
                         <|im_start|>role\\n...<|im_end|>\\n per turn, then <|endoftext|>.
  --text PATH[:WEIGHT]   plain text, a file or a folder of *.txt, cut into chunks of about
                         --text-chunk-chars at blank lines; <|endoftext|> after each file.
WEIGHT (default 1) scales a source: 2 repeats each document twice in train, 0.5 keeps a
hash-chosen half. Validation documents are never repeated.

Split: a document goes to val when blake2b(its text) mod 1000 < --val-permille, so its split depends
on its own content only. Output: OUT_DIR/NAME_{train,val}_NNNNNN.bin (llm.c format, via
microgpt/shards.py) and OUT_DIR/NAME.manifest.json (inputs, options, counts). Re-running with
unchanged inputs and options only prints the summary; the bytes written are a pure function of them.
Input is streamed and at most a few batches plus one shard are held in memory.
"""
import argparse
import collections
import functools
import glob
import hashlib
import json
import math
import multiprocessing
import os
import shutil
import sys

import numpy as np

from microgpt import tokenizer
from microgpt.atomic import write_json_atomic
from microgpt.shards import HEADER_BYTES, write_shard

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

FORMAT = 1          # bump when the rendering or splitting changes, so old manifests go stale
BATCH_DOCS = 256    # documents per task sent to a worker
SPLITS = ("train", "val")


# ---------------------------------------------------------------- sources

def die(msg):
    print(f"error: {msg}", file=sys.stderr)
    sys.exit(2)


class Source:
    def __init__(self, kind, spec):
        self.kind, self.spec = kind, spec
        path, self.weight = spec, 1.0
        head, sep, tail = spec.rpartition(":")
        if sep and head:
            try:
                path, self.weight = head, float(tail)
            except ValueError:
                pass  # a ':' that belongs to the path
        if not math.isfinite(self.weight) or self.weight < 0:
            die(f"--{kind} {spec}: weight must be a finite number >= 0")
        ext = ".jsonl" if kind == "chat" else ".txt"
        if os.path.isdir(path):
            self.files = sorted(glob.glob(os.path.join(path, "*" + ext)))
        elif os.path.isfile(path):
            self.files = [path]
        else:
            die(f"--{kind} {path}: no such file or folder")
        if not self.files:
            die(f"--{kind} {path}: no *{ext} files")
        if kind == "chat" and any(not f.endswith((".jsonl", ".ndjson")) for f in self.files):
            die(f"--chat {path}: expected JSON lines (.jsonl); convert json/parquet "
                             "copies with scripts/pull-hermes3.py --from-file")
        self.path = os.path.relpath(path) if not os.path.relpath(path).startswith("..") else path

    def fingerprint(self):
        files = [[os.path.abspath(f), os.path.getsize(f), os.stat(f).st_mtime_ns] for f in self.files]
        return {"kind": self.kind, "weight": self.weight, "files": files}

    def units(self, chunk_chars):
        """Yield the source's documents as (payload, ends_file) without reading whole files."""
        for path in self.files:
            if self.kind == "chat":
                with open(path, encoding="utf-8", errors="replace") as f:
                    for line in f:
                        if line.strip():
                            yield line, False
            else:
                yield from with_last_flag(text_chunks(path, chunk_chars))


def text_chunks(path, chunk_chars):
    """Chunks of about chunk_chars characters, cut at blank lines (hard cut at 4x for texts without)."""
    buf, size = [], 0
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            buf.append(line)
            size += len(line)
            if size >= chunk_chars and (not line.strip() or size >= 4 * chunk_chars):
                yield "".join(buf)
                buf, size = [], 0
    if buf:
        yield "".join(buf)


def with_last_flag(items):
    """(item, is_last) pairs: one item of lookahead."""
    it = iter(items)
    prev = next(it, None)
    for item in it:
        yield prev, False
        prev = item
    if prev is not None:
        yield prev, True


# ---------------------------------------------------------------- per-document work (runs in workers)

def assign(text, val_permille, weight):
    """(split, copies) of a document, from a hash of its own text only."""
    digest = hashlib.blake2b(text.encode("utf-8"), digest_size=16).digest()
    is_val = int.from_bytes(digest[:8], "little") % 1000 < val_permille
    frac = int.from_bytes(digest[8:], "little") / 2.0 ** 64
    copies = int(weight) + (frac < weight - int(weight))
    return ("val", min(copies, 1)) if is_val else ("train", copies)


def process_doc(kind, payload, ends_file, val_permille, weight):
    """-> (malformed_reason or None, split, copies, uint16 tokens)."""
    if kind == "chat":
        try:
            turns = tokenizer.parse_conversation(json.loads(payload))
        except json.JSONDecodeError:
            return "invalid JSON", None, 0, None
        except ValueError as e:
            return str(e), None, 0, None
        text, ids = tokenizer.render_chatml(turns), tokenizer.encode_conversation(turns)
    else:
        text, ids = payload, tokenizer.encode(payload)
        if ends_file:
            ids.append(tokenizer.EOT)
    split, copies = assign(text, val_permille, weight)
    return None, split, copies, np.asarray(ids, dtype=np.uint16)


def process_batch(task, val_permille):
    source_index, kind, weight, docs = task
    return source_index, [process_doc(kind, p, last, val_permille, weight) for p, last in docs]


def batches(sources, chunk_chars):
    for i, src in enumerate(sources):
        docs = []
        for doc in src.units(chunk_chars):
            docs.append(doc)
            if len(docs) == BATCH_DOCS:
                yield i, src.kind, src.weight, docs
                docs = []
        if docs:
            yield i, src.kind, src.weight, docs


def run_ordered(fn, tasks, workers):
    """fn over tasks in order, in `workers` processes, with a bounded number of tasks in flight
    (Pool.imap would read the whole input ahead and grow memory with the dataset)."""
    if workers <= 1:
        yield from map(fn, tasks)
        return
    with multiprocessing.get_context("fork").Pool(workers) as pool:
        pending = collections.deque()
        for task in tasks:
            pending.append(pool.apply_async(fn, (task,)))
            if len(pending) >= 4 * workers:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()


# ---------------------------------------------------------------- output

class ShardWriter:
    """Collects one split's tokens and writes NAME_SPLIT_NNNNNN.bin files of shard_tokens tokens each."""

    def __init__(self, out_dir, name, split, shard_tokens):
        self.out_dir, self.prefix, self.shard_tokens = out_dir, f"{name}_{split}", shard_tokens
        self.parts, self.count, self.paths = [], 0, []

    def add(self, tokens):
        self.parts.append(tokens)
        self.count += len(tokens)
        while self.count >= self.shard_tokens:
            self._write(self.shard_tokens)

    def _write(self, n):
        buf = np.concatenate(self.parts) if self.parts else np.zeros(0, np.uint16)
        path = os.path.join(self.out_dir, f"{self.prefix}_{len(self.paths):06d}.bin")
        write_shard(path, buf[:n])
        self.paths.append(path)
        self.parts, self.count = [buf[n:]], self.count - n

    def close(self):
        if self.count or not self.paths:
            self._write(self.count)
        return self.paths


def new_stats(sources):
    return [{"docs": dict.fromkeys(SPLITS, 0), "tokens": dict.fromkeys(SPLITS, 0), "malformed": {}}
            for _ in sources]


def build(sources, args, tmp_dir):
    """Tokenize every source into shards under tmp_dir; return (per-source stats, shard paths)."""
    tokenizer.encoding()  # load once in the parent; forked workers share it
    writers = {s: ShardWriter(tmp_dir, args.name, s, args.shard_tokens) for s in SPLITS}
    stats = new_stats(sources)
    fn = functools.partial(process_batch, val_permille=args.val_permille)
    for source_index, results in run_ordered(fn, batches(sources, args.text_chunk_chars), args.workers):
        st = stats[source_index]
        for reason, split, copies, ids in results:
            if reason is not None:
                st["malformed"][reason] = st["malformed"].get(reason, 0) + 1
                continue
            if copies:
                st["docs"][split] += 1
                st["tokens"][split] += copies * len(ids)
            for _ in range(copies):
                writers[split].add(ids)
    return stats, [p for s in SPLITS for p in writers[s].close()]


def install(tmp_dir, out_dir, name, paths):
    """Replace the old NAME_{train,val}_*.bin in out_dir with the new shards; return final paths."""
    for split in SPLITS:
        for old in glob.glob(os.path.join(out_dir, f"{name}_{split}_*.bin")):
            os.remove(old)
    final = []
    for p in paths:
        dst = os.path.join(out_dir, os.path.basename(p))
        os.replace(p, dst)
        final.append(dst)
    shutil.rmtree(tmp_dir)
    return final


def up_to_date(manifest_path, fingerprint):
    try:
        with open(manifest_path) as f:
            manifest = json.load(f)
    except (OSError, json.JSONDecodeError):
        return None
    if manifest.get("fingerprint") != fingerprint:
        return None
    for shard in manifest["shards"]:
        path = os.path.join(os.path.dirname(manifest_path), shard["file"])
        if not os.path.exists(path) or os.path.getsize(path) != HEADER_BYTES + 2 * shard["tokens"]:
            return None
    return manifest


def print_summary(manifest, out=sys.stdout):
    head = f"{'source':<44} {'kind':<4} {'weight':>6} {'docs train':>10} {'docs val':>8} " \
           f"{'tokens train':>12} {'tokens val':>10} {'malformed':>9}"
    print(f"prep-megachat: {manifest['name']} -> {manifest['out_dir']} (val {manifest['val_permille']}/1000)",
          file=out)
    print(head, file=out)
    total = new_stats([None])[0]
    for src in manifest["sources"]:
        bad = sum(src["malformed"].values())
        print(f"{src['path'][-44:]:<44} {src['kind']:<4} {src['weight']:>6g} {src['docs']['train']:>10} "
              f"{src['docs']['val']:>8} {src['tokens']['train']:>12} {src['tokens']['val']:>10} {bad:>9}",
              file=out)
        for key in ("docs", "tokens"):
            for s in SPLITS:
                total[key][s] += src[key][s]
        for reason, n in sorted(src["malformed"].items()):
            print(f"    malformed: {n} x {reason}", file=out)
    print(f"{'total':<44} {'':<4} {'':>6} {total['docs']['train']:>10} {total['docs']['val']:>8} "
          f"{total['tokens']['train']:>12} {total['tokens']['val']:>10}", file=out)
    for shard in manifest["shards"]:
        print(f"  {shard['file']}: {shard['tokens']} tokens", file=out)


class AddSource(argparse.Action):
    """--chat and --text both append (kind, spec) to args.sources, keeping command-line order."""

    def __call__(self, parser, namespace, value, option_string=None):
        namespace.sources = (getattr(namespace, "sources", None) or []) + [(self.dest, value)]


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.set_defaults(sources=None)
    ap.add_argument("--chat", action=AddSource, metavar="PATH[:WEIGHT]", help="conversation source")
    ap.add_argument("--text", action=AddSource, metavar="PATH[:WEIGHT]", help="plain-text source")
    ap.add_argument("--out-dir", default=os.path.join(ROOT, "data", "megachat"))
    ap.add_argument("--name", default="megachat", help="shard name prefix (default megachat)")
    ap.add_argument("--val-permille", type=int, default=20, help="documents per 1000 that go to val (default 20)")
    ap.add_argument("--shard-tokens", type=int, default=100_000_000, help="tokens per shard (default 100M)")
    ap.add_argument("--text-chunk-chars", type=int, default=4000, help="plain-text chunk size (default 4000)")
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="tokenizer processes")
    ap.add_argument("--force", action="store_true", help="rebuild even if the manifest says up to date")
    args = ap.parse_args(argv)
    if not args.sources:
        ap.error("give at least one --chat or --text source")
    if not 0 <= args.val_permille <= 1000:
        ap.error("--val-permille must be in [0, 1000]")
    if args.shard_tokens < 1 or args.text_chunk_chars < 1 or args.workers < 1:
        ap.error("--shard-tokens, --text-chunk-chars and --workers must be positive")
    if not all(c.isalnum() or c in "-_." for c in args.name):
        ap.error("--name may hold letters, digits, '-', '_' and '.' only")
    return args


def main(argv):
    args = parse_args(argv)
    sources = [Source(kind, spec) for kind, spec in args.sources]
    out_dir = os.path.abspath(args.out_dir)
    fingerprint = {"format": FORMAT, "sources": [s.fingerprint() for s in sources],
                   "val_permille": args.val_permille, "shard_tokens": args.shard_tokens,
                   "text_chunk_chars": args.text_chunk_chars}
    manifest_path = os.path.join(out_dir, f"{args.name}.manifest.json")
    manifest = None if args.force else up_to_date(manifest_path, fingerprint)
    if manifest is not None:
        print(f"prep-megachat: {args.name} shards are up to date ({manifest_path})", file=sys.stderr)
        print_summary(manifest)
        return 0

    os.makedirs(out_dir, exist_ok=True)
    if os.path.exists(manifest_path):
        os.remove(manifest_path)  # the old shards are about to be replaced
    tmp_dir = os.path.join(out_dir, f".{args.name}.tmp{os.getpid()}")
    os.makedirs(tmp_dir)
    try:
        stats, paths = build(sources, args, tmp_dir)
    except BaseException:
        shutil.rmtree(tmp_dir, ignore_errors=True)
        raise
    paths = install(tmp_dir, out_dir, args.name, paths)
    manifest = {"name": args.name, "out_dir": out_dir, "val_permille": args.val_permille,
                "fingerprint": fingerprint,
                "sources": [{"path": s.path, "kind": s.kind, "weight": s.weight, **st}
                            for s, st in zip(sources, stats)],
                "shards": [{"file": os.path.basename(p), "tokens": (os.path.getsize(p) - HEADER_BYTES) // 2}
                           for p in paths]}
    write_json_atomic(manifest_path, manifest)
    print_summary(manifest)

    tokens = {s: sum(st["tokens"][s] for st in stats) for s in SPLITS}
    if tokens["train"] == 0:
        print("error: no training tokens were produced (all inputs empty or malformed?)", file=sys.stderr)
        return 1
    if tokens["val"] == 0:
        print("warning: the val split is empty; raise --val-permille or add data", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
