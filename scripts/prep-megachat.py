#!/usr/bin/env python3
"""Render conversations in ChatML, tokenize them and texts in parallel, write train/val token shards
(docs/DESIGN.md §7).

    python scripts/prep-megachat.py --chat data/raw/hermes3/hermes3.jsonl \\
        --text data/raw/shakespeare:0.5 --out-dir data/megachat --name megachat

Sources, mixed in command-line order (repeatable), each [NAME=]PATH[:WEIGHT]:
  --chat   JSON-lines conversations (ShareGPT or OpenAI records, e.g. the output of pull-hermes3.py),
           a file or a folder of *.jsonl. Each conversation is one document:
           <|im_start|>role\\n...<|im_end|>\\n per turn, then <|endoftext|>.
  --text   plain text, a file or a folder of *.txt; each file is one document (a work), read in
           chunks of about --text-chunk-chars cut at blank lines, then <|endoftext|>.
NAME (default: the file or folder name without extension) names the source in the summary and its
own shard folder (letters, digits, '-', '_' and '.', not first). WEIGHT (default 1) scales a source:
2 repeats each train document twice (the source is read twice, so a repeat is a whole document), 0.5
keeps a hash-chosen half; at most 1000. Validation documents are never repeated.

Split: a document goes to val when blake2b(its text) mod 1000 < --val-permille (a text file: the
text of its first chunk), so its split depends on its own content only; every document, train or
val, ends with <|endoftext|> and lies within one source.

Output, a complete set or nothing (a killed or failed build leaves the previous set as it was):
    OUT_DIR/NAME_{train,val}_NNNNNN.bin                   all sources mixed (the training set)
    OUT_DIR/sources/SRC/SRC_{train,val}_NNNNNN.bin        each source alone
    OUT_DIR/NAME.manifest.json                            inputs, options, counts per source
OUT_DIR is a symbolic link to a hidden sibling folder holding one complete set; a build writes a new
folder and swaps the link in one rename. Every shard holds at least --min-shard-tokens tokens (what
llm.c's loader needs: B*T+1), a short tail going into the previous shard; a split too small for one
shard is refused (the mixed set: an error, nothing written; one source's: left out and said so).
Re-running with unchanged inputs and options only prints the summary, while the set is as built (the
shards its manifest lists, no other, with the headers and modification times it records); the bytes
written are a pure function of inputs and options, whatever the number of workers. Memory stays bounded (a few batches of input in
flight; shards are streamed to disk).
"""
import argparse
import codecs
import collections
import concurrent.futures
import contextlib
import errno
import glob
import hashlib
import io
import json
import math
import os
import re
import shutil
import stat
import sys
import time

import numpy as np

from microgpt import tokenizer
from microgpt.atomic import fsync_dir, write_json_atomic
from microgpt.cli import ArgumentParser, answer_on_stdout, fail, interrupted
from microgpt.files import RECORD_TOO_LONG, hold_lock, open_regular, read_json, record_lines
from microgpt.progress import Progress
from microgpt.shards import MAX_TOKENS, ShardError, ShardStream, read_header, read_shard, shard_size

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

FORMAT = 4                   # bump when the rendering or splitting changes, so old manifests go stale
BATCH_DOCS = 256             # documents per task handed to a worker ...
BATCH_BYTES = 1 << 20        # ... or fewer, once they hold this many bytes of input
MAX_WORKERS = 256            # 2 tasks a worker in flight: at most 512 MiB of input held at once
SPLITS = ("train", "val")
# B*T+1 of the largest shipped run (ANDREA-120M: 8 x 1024): a window of T+1 tokens for every row.
DEFAULT_MIN_SHARD_TOKENS = 8 * 1024 + 1
# A source's weight is how many times its files are read (ceil(weight) passes): past this a build
# never ends (1e308 passed the finite check, then overflowed the progress line in a traceback).
MAX_WEIGHT = 1000


class BuildError(RuntimeError):
    """A build that cannot produce a usable set; nothing is installed."""


def valid_name(name):
    """A source's or a set's name names files and a folder: letters, digits, '-', '_' and '.', not
    first ('.' and '..' would put a source's own set outside sources/, a leading '.' hide the shards
    from a glob's '*')."""
    return bool(name) and not name.startswith(".") and all(c.isalnum() or c in "-_." for c in name)


# ---------------------------------------------------------------- sources

class Source:
    def __init__(self, kind, spec):
        self.kind, self.spec = kind, spec
        name, eq, rest = spec.partition("=")
        if not eq or os.sep in name:
            name, rest = "", spec
        path, self.weight = rest, 1.0
        head, sep, tail = rest.rpartition(":")
        if sep and head:
            try:
                path, self.weight = head, float(tail)
            except ValueError:
                pass  # a ':' that belongs to the path
        if not math.isfinite(self.weight) or self.weight < 0:
            fail(f"--{kind} {spec}: weight must be a finite number >= 0")
        if self.weight > MAX_WEIGHT:
            fail(f"--{kind} {spec}: weight must be at most {MAX_WEIGHT} (the source is read that many times)")
        self.name = name or os.path.splitext(os.path.basename(os.path.normpath(path)))[0]
        if not valid_name(self.name):
            fail(f"--{kind} {spec}: source name {self.name!r} may hold letters, digits, '-', '_' and '.' "
                "only, and not start with '.' (write NAME=PATH)")
        exts = (".jsonl", ".ndjson") if kind == "chat" else (".txt",)
        if os.path.isdir(path):  # escaped: a folder named "works[1]" would list works1/'s files
            self.files = sorted(f for f in glob.glob(os.path.join(glob.escape(path), "*")) if f.endswith(exts))
        elif os.path.exists(path):  # a FIFO or device too: refused below, by name
            self.files = [path]
        else:
            fail(f"--{kind} {path}: no such file or folder")
        if not self.files:
            fail(f"--{kind} {path}: no *{exts[0]} files")
        for f in self.files:  # before anything is written: a FIFO would hang the build, a folder fail it
            try:
                with open(open_regular(f), "rb") as opened:
                    head = opened.read(tokenizer.TEXT_HEAD_BYTES)
            except OSError as e:
                fail(f"--{kind} {f}: cannot read it ({e.strerror})")
            if tokenizer.is_utf16_or_32(head, plain_text=kind == "text"):  # read as UTF-8: noise
                fail(f"--{kind} {f}: {tokenizer.NOT_UTF8}")
        if kind == "chat" and any(not f.endswith(exts) for f in self.files):
            fail(f"--chat {path}: expected JSON lines (.jsonl); convert json/parquet "
                "copies with scripts/pull-hermes3.py --from-file")
        self.path = os.path.relpath(path) if not os.path.relpath(path).startswith("..") else path
        self.bytes = sum(os.path.getsize(f) for f in self.files)
        # weight 2.5: passes 0, 1 and 2; a train document with c copies is written in passes 0..c-1
        self.passes = max(1, math.ceil(self.weight))

    def fingerprint(self):
        """What the output depends on: a digest of every file's path, size and mtime (a folder can
        hold thousands of files; the manifest stays small)."""
        files = [[os.path.abspath(f), os.path.getsize(f), os.stat(f).st_mtime_ns] for f in self.files]
        digest = hashlib.sha256(json.dumps(files).encode()).hexdigest()
        return {"name": self.name, "kind": self.kind, "weight": self.weight, "files": len(files),
                "bytes": self.bytes, "digest": digest}

    def units(self, chunk_chars):
        """Yield (payload, position, nbytes): position is "doc" for a whole document, else "first",
        "middle" or "last" chunk of a text file ("doc" for one that fits in one chunk). Files are
        read in bytes (the only way to count progress exactly); nothing holds a whole file. An input
        that cannot be read (removed since it was listed, an I/O error) is a BuildError naming it:
        main's OSError handler would blame the write of the shards."""
        for path in self.files:
            try:
                with open(open_regular(path), "rb") as f:
                    if self.kind == "chat":
                        yield from json_lines(f)
                    else:
                        yield from positioned(text_chunks(f, chunk_chars))
            except OSError as e:
                raise BuildError(f"--{self.kind} {path}: cannot read it ({e.strerror or e})") from None


def json_lines(f):
    """The records of a JSON-lines file as (line, "doc", nbytes); a line too long to read whole is
    None (files.record_lines), counted as too long."""
    for line, nbytes in record_lines(f):
        yield line, "doc", nbytes


def text_chunks(f, chunk_chars):
    """(text, nbytes) chunks of about chunk_chars bytes, cut at blank lines (hard cut at 4x for texts
    without; a line longer than that is cut too). Invalid UTF-8 becomes U+FFFD; the chunks are
    decoded as one stream, so a character that a hard cut splits is kept whole in the next chunk. A
    UTF-8 byte-order mark that begins the file is no text: dropped (utf-8-sig)."""
    decoder = codecs.getincrementaldecoder("utf-8-sig")(errors="replace")
    buf, size = [], 0
    while True:
        line = f.readline(4 * chunk_chars)
        if line:
            buf.append(line)
            size += len(line)
        if buf and (not line or (size >= chunk_chars and (not line.strip() or size >= 4 * chunk_chars))):
            data = b"".join(buf)
            yield decoder.decode(data, final=not line), len(data)
            buf, size = [], 0
        if not line:
            return


def positioned(chunks):
    """(text, position, nbytes) with one chunk of lookahead."""
    prev, index = None, 0
    for chunk in chunks:
        if prev is not None:
            yield prev[0], "first" if index == 1 else "middle", prev[1]
        prev, index = chunk, index + 1
    if prev is not None:
        yield prev[0], "doc" if index == 1 else "last", prev[1]


# ---------------------------------------------------------------- per-document work (worker threads)

def assign(text, val_permille, weight):
    """(split, copies) of a document, from a hash of its own text only."""
    digest = hashlib.blake2b(text.encode("utf-8", errors="surrogatepass"), digest_size=16).digest()
    is_val = int.from_bytes(digest[:8], "little") % 1000 < val_permille
    frac = int.from_bytes(digest[8:], "little") / 2.0 ** 64
    copies = int(weight) + (frac < weight - int(weight))
    return ("val", min(copies, 1)) if is_val else ("train", copies)


def chat_doc(payload):
    """-> (skip_reason, cut_reason, text, token ids) of one JSON line."""
    cuts = {}
    if payload is None:
        return RECORD_TOO_LONG, None, None, None
    try:
        turns = tokenizer.parse_conversation_line(payload, cuts)
    except ValueError as e:
        return str(e), None, None, None
    return None, next(iter(cuts), None), tokenizer.render_chatml(turns), tokenizer.encode_conversation(turns)


def process_batch(task, val_permille):
    """Tokenize one batch; tiktoken releases the GIL while it encodes, so threads run in parallel.
    Returns per document (skip_reason, cut_reason, (split, copies) or None, uint16 tokens)."""
    kind, weight, docs = task
    out = []
    for payload, position, _ in docs:
        if kind == "chat":
            skip, cut, text, ids = chat_doc(payload)
            if skip:
                out.append((skip, None, None, None))
                continue
            ids = np.asarray(ids, dtype=np.uint16)
        else:
            cut, text, ids = None, payload, tokenizer.encode_array(payload)
            if position in ("doc", "last"):
                ids = np.append(ids, np.uint16(tokenizer.EOT))
        split = assign(text, val_permille, weight) if position in ("doc", "first") else None
        out.append((None, cut, split, ids))
    return out


def batches(sources, chunk_chars):
    """(source index, pass, task, input bytes) in input order; a source is read once per pass."""
    for i, src in enumerate(sources):
        for pass_index in range(src.passes):
            docs, size = [], 0
            for unit in src.units(chunk_chars):
                docs.append(unit)
                size += unit[2]
                if len(docs) == BATCH_DOCS or size >= BATCH_BYTES:
                    yield i, pass_index, (src.kind, src.weight, docs), size
                    docs, size = [], 0
            if docs:
                yield i, pass_index, (src.kind, src.weight, docs), size


def run_ordered(fn, items, workers):
    """fn(task) over (key..., task, size) items in order, in `workers` threads, with a bounded number
    of tasks in flight; yields (item, result)."""
    if workers <= 1:
        for item in items:
            yield item, fn(item[2])
        return
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        pending = collections.deque()
        for item in items:
            pending.append((item, pool.submit(fn, item[2])))
            if len(pending) >= 2 * workers:
                done_item, fut = pending.popleft()
                yield done_item, fut.result()
        while pending:
            done_item, fut = pending.popleft()
            yield done_item, fut.result()


# ---------------------------------------------------------------- output

class ShardWriter:
    """One split of one set: PREFIX_NNNNNN.bin files of shard_tokens tokens each, streamed to disk.
    close() merges a tail shorter than min_tokens into the previous shard."""

    def __init__(self, directory, prefix, shard_tokens, min_tokens):
        self.dir, self.prefix = directory, prefix
        self.shard_tokens, self.min_tokens = shard_tokens, min_tokens
        self.paths, self.current = [], None

    def add(self, tokens):
        while tokens.size:
            if self.current is None:
                os.makedirs(self.dir, exist_ok=True)
                path = os.path.join(self.dir, f"{self.prefix}_{len(self.paths):06d}.bin")
                self.current = ShardStream(path)
                self.paths.append(path)
            room = self.shard_tokens - self.current.ntok
            self.current.write(tokens[:room])
            tokens = tokens[room:]
            if self.current.ntok == self.shard_tokens:
                self.current.close()
                self.current = None

    def close(self):
        """Finish the shards; return [(path, ntok)] ([] when the split is shorter than one shard,
        whose file is then removed)."""
        if self.current is not None:
            self.current.close()
            self.current = None
        counts = [read_header(p) for p in self.paths]
        if counts and counts[-1] < self.min_tokens:
            tail = read_shard(self.paths[-1])
            os.remove(self.paths.pop())
            counts.pop()
            if self.paths:
                merged = ShardStream(self.paths[-1], append=True)
                merged.write(tail)
                counts[-1] = merged.close()
        return list(zip(self.paths, counts))


def new_stats():
    return {"docs": dict.fromkeys(SPLITS, 0), "tokens": dict.fromkeys(SPLITS, 0), "skipped": {}, "cut": {}}


def count(counter, key):
    counter[key] = counter.get(key, 0) + 1


class SetWriters:
    """The mixed set and each source's own set, train and val."""

    def __init__(self, build_dir, name, sources, args):
        def writer(directory, prefix, split):
            return ShardWriter(directory, f"{prefix}_{split}", args.shard_tokens, args.min_shard_tokens)
        self.mixed = {s: writer(build_dir, name, s) for s in SPLITS}
        self.own = [{s: writer(os.path.join(build_dir, "sources", src.name), src.name, s) for s in SPLITS}
                    for src in sources]

    def add(self, source_index, split, tokens):
        self.mixed[split].add(tokens)
        self.own[source_index][split].add(tokens)


def build(sources, args, build_dir, progress):
    """Tokenize every source into shards under build_dir; return (per-source stats, shard lists)."""
    tokenizer.encoding()  # load once, before the threads start
    writers = SetWriters(build_dir, args.name, sources, args)
    stats = [new_stats() for _ in sources]

    def fn(task):
        return process_batch(task, args.val_permille)
    split = copies = None  # of the text document being read
    for (i, pass_index, _, size), results in run_ordered(fn, batches(sources, args.text_chunk_chars),
                                                          args.workers):
        st = stats[i]
        for skip, cut, doc_split, ids in results:
            if skip:
                if pass_index == 0:
                    count(st["skipped"], skip)
                continue
            if cut and pass_index == 0:
                count(st["cut"], cut)
            if doc_split is not None:  # a document's first (or only) piece decides for the rest
                split, copies = doc_split
                if copies > pass_index:
                    st["docs"][split] += 1
            if copies > pass_index:
                st["tokens"][split] += len(ids)
                writers.add(i, split, ids)
        progress.update(size, sum(len(r[3]) for r in results if r[3] is not None))
    mixed = {s: writers.mixed[s].close() for s in SPLITS}
    own = [{s: w[s].close() for s in SPLITS} for w in writers.own]
    return stats, mixed, own


def check_mixed(mixed, min_tokens):
    for split in SPLITS:
        if not mixed[split]:
            raise BuildError(f"the {split} split has fewer than --min-shard-tokens {min_tokens} tokens "
                             "(inputs empty or malformed? raise --val-permille or add data); nothing written")


def shard_list(shards, base):
    """The manifest's entries; the modification time shows a rerun whether a shard was changed since."""
    return [{"file": os.path.relpath(p, base), "tokens": n, "mtime_ns": os.stat(p).st_mtime_ns} for p, n in shards]


# ---------------------------------------------------------------- the set: build folder, swap, cleanup

class SetLocation:
    """OUT_DIR is a symbolic link to PARENT/.BASE.set-ID, a complete set; PARENT/.BASE.build-PID is
    a build in progress; PARENT/.BASE.lock serialises builds. Any other .BASE.{set,build,link,old}-*
    (a set the link no longer points to, a killed build's folder) is removed by the next build."""

    def __init__(self, out_dir, name):
        self.out_dir, self.name = out_dir, name
        self.parent, self.base = os.path.dirname(out_dir), os.path.basename(out_dir)
        self.build_dir = os.path.join(self.parent, f".{self.base}.build-{os.getpid()}")

    def hidden(self, tag):
        return os.path.join(self.parent, f".{self.base}.{tag}")

    @contextlib.contextmanager
    def locked(self):
        os.makedirs(self.parent, exist_ok=True)
        with hold_lock(self.hidden("lock")):
            yield

    def current_target(self):
        if os.path.islink(self.out_dir):
            return os.path.join(self.parent, os.readlink(self.out_dir))
        return None

    def clean_stale(self):
        """Remove leftovers of killed builds (call with the lock held: no other build is running).
        Only names this class makes (a set's hex ID, a PID): `.BASE.set-*` also matched the hidden
        folders of an OUT_DIR named BASE.set-x beside this one, and removed that set."""
        current = self.current_target()
        stale = re.compile(rf"\.{re.escape(self.base)}\.(set-[0-9a-f]+|(build|link|old)-[0-9]+)")
        for entry in os.listdir(self.parent):
            path = os.path.join(self.parent, entry)
            if stale.fullmatch(entry) and path != current:
                remove(path)

    def check_out_dir(self):
        """An OUT_DIR that is a real folder (an older layout, or a new empty folder) is taken over
        only when it holds nothing but this set's files (its shards: those its manifest lists, with
        the sizes it lists, where it has one); one that is a symbolic link only when the
        link is one a build made, its set has this name and its folder holds nothing else (install
        removes the set it points to: a file put there by hand would go with it)."""
        if os.path.islink(self.out_dir):
            target = os.readlink(self.out_dir)
            if os.sep in target or not target.startswith(f".{self.base}.set-"):
                raise BuildError(f"--out-dir {self.out_dir} is a symbolic link to {target}, not one this "
                                 "script made (a build replaces it and removes what it points to); remove "
                                 "the link, or link the folder above it instead")
            if not os.path.isdir(self.out_dir):  # its set is gone: nothing to lose
                return
            # a set of another --name there would be removed without a word, as a folder's files are not
            others = [entry for entry in sorted(os.listdir(self.out_dir)) if entry.endswith(".manifest.json")
                      and entry != f"{self.name}.manifest.json"]
            if others:
                raise BuildError(f"--out-dir {self.out_dir} holds a set not named {self.name} ({others[0]}); "
                                 "give another --out-dir, or remove it to replace that set")
        elif not os.path.exists(self.out_dir):
            return
        elif not os.path.isdir(self.out_dir):
            raise BuildError(f"--out-dir {self.out_dir} exists and is not a folder")
        others = foreign_entries(self.out_dir, self.name)
        if others:
            raise BuildError(f"--out-dir {self.out_dir} holds other files ({others[0]}, ...), which a build "
                             "would remove; move them out, or give a new or empty folder")

    def install(self):
        """Make the finished build folder the set OUT_DIR shows, in one rename of a link."""
        self.check_out_dir()  # again: a folder taken over is removed, and the build took a while
        old = self.current_target()
        final = self.hidden(f"set-{time.time_ns():x}")
        os.rename(self.build_dir, final)
        link = self.hidden(f"link-{os.getpid()}")
        os.symlink(os.path.basename(final), link)
        if os.path.isdir(self.out_dir) and not os.path.islink(self.out_dir):
            os.rename(self.out_dir, self.hidden(f"old-{os.getpid()}"))  # removed by clean_stale below
        os.replace(link, self.out_dir)
        fsync_dir(self.parent)
        if old:
            remove(old)
        self.clean_stale()


def shard_files(name):
    """A pattern of the names a set's files (or their temp files) have: NAME_{train,val}_N.bin."""
    return re.compile(rf"{re.escape(name)}_(train|val)_[0-9]+\.bin(\.tmp[0-9]+)?")


def foreign_entries(out_dir, name):
    """What a folder at OUT_DIR (a real one, or the one a build's link points to) holds besides a set
    of this name (an older layout's shards, manifest and temp folder; a copied set's sources/SRC/
    shards), a look-alike shard saying why: install removes the folder with all it holds, so a build
    takes over only one where this is empty."""
    ours = shard_files(name)
    manifest = re.compile(rf"{re.escape(name)}\.manifest\.json(\.tmp[0-9]+)?")
    sizes = listed_sizes(out_dir, name)
    others = []
    for entry in sorted(os.listdir(out_dir)):
        path = os.path.join(out_dir, entry)
        if entry == "sources" and os.path.isdir(path) and not os.path.islink(path):
            for src in sorted(os.listdir(path)):
                folder = os.path.join(path, src)
                if not os.path.isdir(folder) or os.path.islink(folder) or not valid_name(src):
                    others.append(os.path.join(entry, src))
                    continue
                own = shard_files(src)
                for f in sorted(os.listdir(folder)):
                    found = own.fullmatch(f)
                    if not found or holds_files(os.path.join(folder, f)):
                        others.append(os.path.join(entry, src, f))
                    else:
                        others += look_alike(out_dir, os.path.join(entry, src, f), found, sizes, name)
        elif (found := ours.fullmatch(entry)) and not holds_files(path):
            others += look_alike(out_dir, entry, found, sizes, name)
        elif not (manifest.fullmatch(entry) and not holds_files(path) or entry.startswith(f".{name}.tmp")):
            others.append(entry)
    return others


def listed_sizes(out_dir, name):
    """{path in the set: size in bytes} of each shard OUT_DIR/NAME.manifest.json lists (a shard is
    exactly its header and two bytes a token: shards.shard_size), or None where no manifest reads
    whole: missing (an older layout removed it before a build and wrote it last, so a killed build
    left none), damaged or edited by hand (a rebuild replaces it), no regular file."""
    manifest = read_json(os.path.join(out_dir, f"{name}.manifest.json"), None)
    sizes = {}
    try:
        for shard in listed_shards(manifest):
            file, tokens = shard["file"], shard["tokens"]
            if not isinstance(file, str) or type(tokens) is not int or not 0 <= tokens <= MAX_TOKENS:
                return None
            sizes[os.path.normpath(file)] = shard_size(tokens)
    except (LookupError, TypeError, AttributeError):
        return None
    return sizes


def look_alike(out_dir, entry, found, sizes, name):
    """[entry, saying why] where a file named like a set's shard (found: the name's match) is not the
    set's: a regular file its manifest does not list, or lists with another size; else [].

    Its size is what tells a shard the build wrote from a copy put in its place: a stat, no read of
    the shard. Not its modification time, which a copied set (cp -r) or a shard edited in place has
    changed (such a set is rebuilt, as before). Where no manifest reads whole (sizes None), every
    such name counts as the set's, as it did before manifests were read here: refusing them would
    leave a set whose manifest a killed build never wrote, or one damaged, to be removed by hand,
    and nothing there tells the set's shards from look-alikes. A killed build's temp file (.tmpN),
    a link or a FIFO is the set's too: removing it loses nothing the set did not hold."""
    if sizes is None or found.group(2):
        return []
    try:
        st = os.lstat(os.path.join(out_dir, entry))
    except FileNotFoundError:  # gone meanwhile: nothing to lose
        return []
    if not stat.S_ISREG(st.st_mode):
        return []
    if entry not in sizes:
        return [f"{entry}, a shard {name}.manifest.json does not list"]
    if st.st_size != sizes[entry]:
        return [f"{entry}, {st.st_size} bytes where {name}.manifest.json lists {sizes[entry]}"]
    return []


def listed_shards(manifest):
    """The shard entries of a manifest: the mixed set's, then each source's (an older layout's lists
    none of a source's)."""
    return manifest["shards"] + [s for src in manifest["sources"] for s in src.get("shards", [])]


def holds_files(path):
    """Whether removing path would remove more than its name: a real folder. A FIFO or a link where
    a set's file belongs (a damaged set) holds nothing, and a rebuild replaces it."""
    return os.path.isdir(path) and not os.path.islink(path)


def remove(path):
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    elif os.path.lexists(path):  # on a read-only file system, removing no file is EROFS, not ENOENT
        with contextlib.suppress(FileNotFoundError, NotADirectoryError):
            os.remove(path)


def fsync_tree(root):
    for directory, _, files in os.walk(root):
        fsync_dir(directory)


def up_to_date(manifest_path, fingerprint):
    """The manifest when it describes a set built from these inputs and options that is as it was
    built: it lists every shard there is, each with the header and modification time it recorded,
    and the summary can be printed from it. Else None (a rebuild), also for a manifest damaged or
    edited by hand."""
    manifest = read_json(manifest_path, None)
    if not isinstance(manifest, dict) or manifest.get("fingerprint") != fingerprint:
        return None
    base = os.path.dirname(manifest_path)
    try:
        listed = listed_shards(manifest)
        found = {os.path.relpath(os.path.join(d, f), base) for d, _, files in os.walk(base) for f in files
                 if f.endswith(".bin")}
        if found != {shard["file"] for shard in listed}:  # a shard added: a glob of the set reads it too
            return None
        for shard in listed:
            path = os.path.join(base, shard["file"])
            if read_header(path) != shard["tokens"] or os.stat(path).st_mtime_ns != shard["mtime_ns"]:
                return None
        print_summary(manifest, io.StringIO())
    except (OSError, ValueError, LookupError, TypeError, AttributeError):  # ShardError is a ValueError
        return None
    return manifest


# ---------------------------------------------------------------- summary and command line

def print_summary(manifest, out=None):
    """The manifest as a table on out (None: sys.stdout as it is at the call, which print takes)."""
    print(f"prep-megachat: {manifest['name']} -> {manifest['out_dir']} (val {manifest['val_permille']}/1000)",
          file=out)
    print(f"{'source':<16} {'kind':<4} {'weight':>6} {'docs train':>10} {'docs val':>8} "
          f"{'tokens train':>12} {'tokens val':>10} {'skipped':>7} {'cut':>5}", file=out)
    total = new_stats()
    for src in manifest["sources"]:
        print(f"{src['name'][:16]:<16} {src['kind']:<4} {src['weight']:>6g} {src['docs']['train']:>10} "
              f"{src['docs']['val']:>8} {src['tokens']['train']:>12} {src['tokens']['val']:>10} "
              f"{sum(src['skipped'].values()):>7} {sum(src['cut'].values()):>5}", file=out)
        for key in ("docs", "tokens"):
            for s in SPLITS:
                total[key][s] += src[key][s]
        for what in ("skipped", "cut"):
            for reason, n in sorted(src[what].items()):
                print(f"    {what}: {n} x {reason}", file=out)
        for split in src.get("left_out", []):
            print(f"    own {split} set left out: fewer than {manifest['min_shard_tokens']} tokens", file=out)
    print(f"{'total':<16} {'':<4} {'':>6} {total['docs']['train']:>10} {total['docs']['val']:>8} "
          f"{total['tokens']['train']:>12} {total['tokens']['val']:>10}", file=out)
    for shard in manifest["shards"]:
        print(f"  {shard['file']}: {shard['tokens']} tokens", file=out)


def show_summary(manifest):
    """print_summary on stdout; the exit status. The set is built by then: a stdout that cannot take
    the table (a full disk, `> /dev/full`; a reader gone, `| head -1`) is said in one line or none
    (cli.answer_on_stdout), not a traceback, nor taken for a failed write of the shards."""
    return answer_on_stdout(lambda: print_summary(manifest))


class AddSource(argparse.Action):
    """--chat and --text both append (kind, spec) to args.sources, keeping command-line order."""

    def __call__(self, parser, namespace, value, option_string=None):
        namespace.sources = (getattr(namespace, "sources", None) or []) + [(self.dest, value)]


def parse_args(argv):
    ap = ArgumentParser(description=__doc__.split("\n")[0])
    ap.set_defaults(sources=None)
    ap.add_argument("--chat", action=AddSource, metavar="[NAME=]PATH[:WEIGHT]", help="conversation source")
    ap.add_argument("--text", action=AddSource, metavar="[NAME=]PATH[:WEIGHT]", help="plain-text source")
    ap.add_argument("--out-dir", default=os.path.join(ROOT, "data", "megachat"))
    ap.add_argument("--name", default="megachat", help="shard name prefix (default megachat)")
    ap.add_argument("--val-permille", type=int, default=20, help="documents per 1000 that go to val (default 20)")
    ap.add_argument("--shard-tokens", type=int, default=100_000_000, help="tokens per shard (default 100M)")
    ap.add_argument("--min-shard-tokens", type=int, default=DEFAULT_MIN_SHARD_TOKENS,
                    help=f"fewest tokens in a shard: B*T+1 of the runs that read it "
                         f"(default {DEFAULT_MIN_SHARD_TOKENS}, ANDREA-120M's 8 x 1024 + 1)")
    ap.add_argument("--text-chunk-chars", type=int, default=4000, help="plain-text chunk size (default 4000)")
    ap.add_argument("--workers", type=int, default=min(os.cpu_count() or 1, MAX_WORKERS),
                    help=f"tokenizer threads (default: the CPU count, at most {MAX_WORKERS})")
    ap.add_argument("--force", action="store_true", help="rebuild even if the manifest says up to date")
    args = ap.parse_args(argv)
    if not args.sources:
        ap.error("give at least one --chat or --text source")
    if not 0 <= args.val_permille <= 1000:
        ap.error("--val-permille must be in [0, 1000]")
    if min(args.shard_tokens, args.min_shard_tokens, args.text_chunk_chars, args.workers) < 1:
        ap.error("--shard-tokens, --min-shard-tokens, --text-chunk-chars and --workers must be positive")
    if args.workers > MAX_WORKERS:  # each worker keeps two batches of input in flight
        ap.error(f"--workers must be at most {MAX_WORKERS}")
    if args.min_shard_tokens > args.shard_tokens:
        ap.error("--min-shard-tokens must not exceed --shard-tokens")
    if args.shard_tokens + args.min_shard_tokens - 1 > MAX_TOKENS:  # the most a shard with a merged tail holds
        ap.error(f"a shard holds at most {MAX_TOKENS} tokens: --shard-tokens plus --min-shard-tokens - 1 "
                 "must not exceed that")
    if not valid_name(args.name):
        ap.error("--name may hold letters, digits, '-', '_' and '.' only, and not start with '.'")
    return args


def make_manifest(args, out_dir, fingerprint, sources, stats, mixed, own, build_dir):
    entries = []
    for src, st, shards in zip(sources, stats, own):
        entries.append({"name": src.name, "path": src.path, "kind": src.kind, "weight": src.weight, **st,
                        "shards": [s for split in SPLITS for s in shard_list(shards[split], build_dir)],
                        "left_out": [split for split in SPLITS if not shards[split]]})
    return {"name": args.name, "out_dir": out_dir, "val_permille": args.val_permille,
            "min_shard_tokens": args.min_shard_tokens, "fingerprint": fingerprint, "sources": entries,
            "shards": [s for split in SPLITS for s in shard_list(mixed[split], build_dir)]}


def main(argv):
    args = parse_args(argv)
    sources = [Source(kind, spec) for kind, spec in args.sources]
    names = [s.name for s in sources]
    if len(set(names)) != len(names):
        fail(f"two sources are named {max(names, key=names.count)!r}; name one with NAME=PATH")
    out_dir = os.path.abspath(args.out_dir)
    fingerprint = {"format": FORMAT, "sources": [s.fingerprint() for s in sources],
                   "val_permille": args.val_permille, "shard_tokens": args.shard_tokens,
                   "min_shard_tokens": args.min_shard_tokens, "text_chunk_chars": args.text_chunk_chars}
    manifest_path = os.path.join(out_dir, f"{args.name}.manifest.json")
    manifest = None if args.force else up_to_date(manifest_path, fingerprint)
    if manifest is not None:
        print(f"prep-megachat: {args.name} shards are up to date ({manifest_path})", file=sys.stderr)
        return show_summary(manifest)

    where = SetLocation(out_dir, args.name)
    progress = None
    try:
        with where.locked():
            # A build of the same set that held the lock while this one waited may have made it.
            manifest = None if args.force else up_to_date(manifest_path, fingerprint)
            if manifest is not None:
                print(f"prep-megachat: {args.name} shards are up to date ({manifest_path}; "
                      "built by another run meanwhile)", file=sys.stderr)
                return show_summary(manifest)
            where.check_out_dir()
            where.clean_stale()
            os.makedirs(where.build_dir)
            total = sum(s.bytes * s.passes for s in sources)
            progress = Progress(f"prep-megachat {args.name}: tokenizing", total)
            stats, mixed, own = build(sources, args, where.build_dir, progress)
            progress.close()
            progress = None
            check_mixed(mixed, args.min_shard_tokens)
            manifest = make_manifest(args, out_dir, fingerprint, sources, stats, mixed, own, where.build_dir)
            write_json_atomic(os.path.join(where.build_dir, f"{args.name}.manifest.json"), manifest)
            fsync_tree(where.build_dir)
            where.install()
    except (BuildError, ShardError, tokenizer.TokenizerUnavailable) as e:
        print(f"\nerror: {e}" if progress else f"error: {e}", file=sys.stderr)
        remove(where.build_dir)
        return 1
    except OSError as e:
        why = "the disk is full" if e.errno == errno.ENOSPC else e.strerror
        culprit = f" ({e.filename})" if e.filename else ""
        print(f"\nerror: cannot write the {args.name} shards in {os.path.dirname(out_dir)}: {why}{culprit}; "
              "the previous shards are kept", file=sys.stderr)
        remove(where.build_dir)
        return 1
    except BaseException:
        remove(where.build_dir)
        raise
    status = show_summary(manifest)
    if any(src["left_out"] for src in manifest["sources"]):
        print("prep-megachat: some sources' own sets were too small to write (see above); "
              "the mixed set holds all of them", file=sys.stderr)
    return status


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    except KeyboardInterrupt:  # main removed its build folder: OUT_DIR shows the set it showed
        sys.exit(interrupted("prep-megachat", "the previous shards are kept"))
