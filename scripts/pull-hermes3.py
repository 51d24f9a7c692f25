#!/usr/bin/env python3
"""Fetch NousResearch/Hermes-3-Dataset (Apache-2.0) into a local JSON-lines file, resumably (docs/DESIGN.md §7).

    python scripts/pull-hermes3.py [--max-records N]            # stream from the Hugging Face hub
    python scripts/pull-hermes3.py --from-file copy.parquet      # a local json / jsonl / parquet copy

Input records are ShareGPT ({"conversations": [{"from": system|human|gpt, "value"}]}) or OpenAI
({"messages": [{"role", "content"}]}). Every usable record is written as one ShareGPT line to
--out (default data/raw/hermes3/hermes3.jsonl), which is what scripts/prep-megachat.py reads.
Malformed records are counted by reason and skipped, never fatal.

Lines and .json files are read as UTF-8 (a byte-order mark is dropped); a file that begins with a
UTF-16 or UTF-32 byte-order mark is refused.

Resuming: progress (records read, bytes written) is saved beside the output in OUT.progress.json;
an interrupted pull (network error, Ctrl-C, a smaller --max-records) continues where it stopped when
re-run with the same source (a changed --from-file starts over, cutting the output back only once the
new source has given its first usable conversation). A finished pull is not repeated. A pull holds
OUT.lock: a second pull into the same output waits for the first.

Exit status: 0 done; 1 the hub is unreachable / the download failed (re-run to resume); 2 bad usage;
3 the output cannot be written (a full disk: no other source of conversations helps); 4 every record
read was malformed (no usable conversations).
"""
import collections
import contextlib
import errno
import fcntl
import itertools
import json
import os
import sys

from microgpt.atomic import write_json_atomic
from microgpt.cli import ArgumentParser, interrupted
from microgpt.files import (MAX_RECORD_BYTES, RECORD_TOO_LONG, file_kind, open_lock_file, read_json, record_lines,
                            unique_keys)
from microgpt.tokenizer import UTF16_32_BOMS, json_fault, parse_conversation, parse_json_line

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

REPO_ID = "NousResearch/Hermes-3-Dataset"
SHAREGPT_NAMES = {"system": "system", "user": "human", "assistant": "gpt", "tool": "tool"}
SAVE_EVERY = 1000  # records between progress saves
LOCAL_EXTENSIONS = (".json", ".jsonl", ".ndjson", ".parquet")


class PullError(RuntimeError):
    pass


class OutputError(PullError):
    """The output or its progress file cannot be written."""


@contextlib.contextmanager
def writing(path):
    """OSErrors of writing `path` as an OutputError: told apart from those of reading the records
    (requests' network errors are OSErrors too)."""
    try:
        yield
    except OSError as e:  # io.UnsupportedOperation (a stream that cannot seek) has no strerror
        culprit = f" ({e.filename})" if e.filename and os.path.abspath(e.filename) != os.path.abspath(path) else ""
        raise OutputError(f"cannot write {path}: {e.strerror or e}{culprit}") from None


# ---------------------------------------------------------------- reading records

def iter_json_lines(path):
    """Yield parsed records of a JSON-lines file; a line that holds none yields its error instead,
    for the reasons prep-megachat.py counts (tokenizer.parse_json_line: invalid UTF-8 too, and JSON
    nested too deeply, which was a RecursionError that ended the pull, and every re-run of it); a
    line over MAX_RECORD_BYTES bytes is not read whole (memory stays bounded)."""
    with open(path, "rb") as f:
        for line, _ in record_lines(f):
            if line is None:
                yield ValueError(RECORD_TOO_LONG)
            else:
                try:
                    yield parse_json_line(line)
                except ValueError as e:
                    yield e


def iter_local_file(path):
    """Records of a local copy: .jsonl/.ndjson (streamed), .json (an array, streamed element by
    element; or records, one or more, each over several lines; or JSON lines under a .json name),
    .parquet (by batches)."""
    ext = os.path.splitext(path)[1].lower()
    if ext in (".json", ".jsonl", ".ndjson"):
        with open(path, "rb") as f:
            if f.read(4).startswith(UTF16_32_BOMS):
                raise PullError(f"{path}: not UTF-8 (a UTF-16 or UTF-32 byte-order mark); convert it, "
                                "e.g. iconv -f UTF-16 -t UTF-8")
    if ext in (".jsonl", ".ndjson"):
        yield from iter_json_lines(path)
    elif ext == ".json":
        with open(path, encoding="utf-8-sig", errors="surrogateescape") as f:  # -sig: a byte-order mark
            head = f.read(1 << 16).lstrip()
        if head[:1] == "[":
            yield from iter_json_array(path)
        elif head.partition("\n")[0].strip() == "{":  # a record over several lines: json.dump(indent=...)
            yield from iter_json_array(path, bare=True)
        else:  # one record on one line, or (as many ".json" downloads are) JSON lines
            yield from iter_json_lines(path)
    elif ext == ".parquet":
        import pyarrow.parquet as pq  # comes with `datasets`
        for batch in pq.ParquetFile(path).iter_batches(batch_size=1024):
            yield from batch.to_pylist()
    else:
        raise PullError(f"{path}: unknown extension {ext!r} (expected .json, .jsonl or .parquet)")


def utf8_bytes(text):
    """The bytes text took in its file (read as UTF-8 with errors="surrogateescape")."""
    return len(text.encode("utf-8", "surrogateescape"))


def iter_json_array(path, block=1 << 20, bare=False):
    """The elements of a JSON array file, one at a time, holding one element plus one block of text
    in memory (a .json download of a whole data set can be gigabytes); bare: the JSON values of a
    file that holds them one after another, no array around them (records over several lines
    each). An element of MAX_RECORD_BYTES UTF-8 bytes or more yields a ValueError(RECORD_TOO_LONG),
    as such a line does in a JSON-lines file (files.record_lines). An element that does not parse,
    names a key twice in one object, or is too long to have been read whole, yields a ValueError
    and the rest of the file is not read (its structure is lost)."""
    decoder = json.JSONDecoder(object_pairs_hook=unique_keys)
    with open(path, encoding="utf-8-sig", errors="surrogateescape") as f:  # -sig: a byte-order mark is no element
        buf, pos, started = "", 0, bare

        def refill():
            nonlocal buf, pos
            more = f.read(block)
            buf, pos = buf[pos:] + more, 0
            return bool(more)

        while True:
            if pos == len(buf) and not refill():
                return
            c = buf[pos]
            if c in " \t\r\n" or (started and c == ","):
                pos += 1
            elif c == "[" and not started:
                started = True
                pos += 1
            elif c == "]" and started:
                return
            else:
                try:
                    element, end = decoder.raw_decode(buf, pos)
                except (ValueError, RecursionError) as e:
                    # A JSONDecodeError may be the block end cutting the element: read on while it
                    # is under MAX_RECORD_BYTES. No other fault (a key twice, the digits limit of
                    # int(), nesting) is a block end's doing.
                    if not isinstance(e, json.JSONDecodeError):
                        yield ValueError(json_fault(e))
                    elif utf8_bytes(buf[pos:]) >= MAX_RECORD_BYTES:
                        yield ValueError(RECORD_TOO_LONG)
                    elif refill():
                        continue
                    else:
                        yield ValueError(json_fault(e))
                    return
                # a character is at most 4 bytes: a shorter element needs no encoding to be counted
                too_long = 4 * (end - pos) >= MAX_RECORD_BYTES and utf8_bytes(buf[pos:end]) >= MAX_RECORD_BYTES
                pos = end
                yield ValueError(RECORD_TOO_LONG) if too_long else element


def iter_hub(skip, timeout):
    """Stream the dataset's train split from the hub, skipping the first `skip` records."""
    import requests
    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co").rstrip("/")
    try:  # a quick probe, so an offline machine fails in seconds, not after datasets' retries
        requests.get(f"{endpoint}/api/datasets/{REPO_ID}", timeout=timeout).raise_for_status()
    except requests.RequestException as e:
        raise PullError(f"cannot reach {endpoint} ({type(e).__name__}); offline? "
                        "use --from-file with a local copy") from None
    os.environ.setdefault("HF_HUB_ETAG_TIMEOUT", str(timeout))
    os.environ.setdefault("HF_HUB_DOWNLOAD_TIMEOUT", str(timeout))
    import datasets
    ds = datasets.load_dataset(REPO_ID, split="train", streaming=True)
    return iter(ds.skip(skip) if skip else ds)


# ---------------------------------------------------------------- progress

def load_progress(path, source):
    """Saved progress for the same source, else a fresh start (also for a file edited by hand into
    something no pull writes: a count that is no integer >= 0 would be a traceback at the resume)."""
    saved = read_json(path, None)
    if not isinstance(saved, dict) or saved.get("source") != source:
        return fresh_progress(source)
    counts = [saved.get(k) for k in ("read", "written", "bytes")]
    malformed = saved.get("malformed")
    if (not all(type(n) is int and n >= 0 for n in counts) or not isinstance(saved.get("exhausted"), bool)
            or not isinstance(malformed, dict) or not all(type(n) is int for n in malformed.values())):
        return fresh_progress(source)
    return saved


def fresh_progress(source):
    return {"source": source, "read": 0, "written": 0, "bytes": 0, "exhausted": False, "malformed": {}}


def progress_bar(total, initial):
    try:
        from tqdm import tqdm  # a dependency of datasets
        return tqdm(total=total, initial=initial, unit="rec", file=sys.stderr, mininterval=1.0)
    except ImportError:
        return None


# ---------------------------------------------------------------- the pull

def to_sharegpt(turns):
    return {"conversations": [{"from": SHAREGPT_NAMES[r], "value": v} for r, v in turns]}


def conversation_line(record):
    """(the ShareGPT line of a record, or None where it is malformed; the reasons it adds to the
    counts: why it is malformed, or where its conversation was cut)."""
    try:
        if isinstance(record, Exception):
            raise record
        cuts = {}
        turns = parse_conversation(record, cuts)
    except ValueError as e:
        return None, [str(e)]
    line = json.dumps(to_sharegpt(turns), ensure_ascii=False).encode("utf-8") + b"\n"
    return line, [f"cut: {reason}" for reason in cuts]


def cut_back(out_path, size):
    """The output open for appending after its first `size` bytes, a torn tail written after the
    last save dropped."""
    with writing(out_path):
        out = open(out_path, "r+b" if os.path.exists(out_path) else "wb")
        out.truncate(size)
        out.seek(size)
    return out


def pull(records, out_path, progress, progress_path, max_records):
    """Append normalized records to out_path until the source or max_records runs out. A resume
    cuts the output back to what the progress holds at once; a new source only once it has given
    its first usable conversation: a copy that cannot be read, one of malformed records only (a
    file of another format), or a hub that fails at once leaves the last pull and its progress
    whole."""
    malformed = collections.Counter(progress["malformed"])
    bar = progress_bar(max_records, progress["read"])
    out = None

    def save():
        progress["malformed"] = dict(malformed)  # the summary's counts, saved or not
        if out is None:  # none of this source's lines in the output: its progress would void the last pull
            return
        with writing(out_path):
            out.flush()
        progress["bytes"] = out.tell()
        with writing(progress_path):
            write_json_atomic(progress_path, progress)

    if progress["read"]:  # a resume: the output holds this source's lines up to progress["bytes"]
        out = cut_back(out_path, progress["bytes"])
        save()
    try:
        while max_records is None or progress["read"] < max_records:
            record = next(records, StopIteration)
            if record is StopIteration:
                progress["exhausted"] = True
                break
            line, reasons = conversation_line(record)
            if line is not None:
                if out is None:
                    # Saved before the first line: a pull from a new source killed (kill -9) before
                    # its first save left the last source's progress beside the new source's lines,
                    # and a rerun of the last source took them for its own finished pull ("already
                    # has N conversations").
                    out = cut_back(out_path, progress["bytes"])
                    save()
                with writing(out_path):
                    out.write(line)
                progress["written"] += 1
            progress["read"] += 1
            malformed.update(reasons)
            if bar is not None:
                bar.update(1)
            if progress["read"] % SAVE_EVERY == 0:
                save()
    finally:
        if bar is not None:
            bar.close()
        try:
            save()
        finally:
            # save() flushed what there was; after a failed write, close() would only fail again
            if out is not None:
                with contextlib.suppress(OSError):
                    out.close()


@contextlib.contextmanager
def locked(path):
    """An exclusive lock on path (made if missing) for the pull: two pulls into one output would
    write over each other, each of them truncating it to its own progress. A second one waits, and
    says so; a FIFO or symbolic link planted there is refused (files.open_lock_file)."""
    with writing(path):
        fd = open_lock_file(path)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"pull-hermes3: waiting for another pull into {path.removesuffix('.lock')} to finish",
                  file=sys.stderr)
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def pull_locked(args):
    """The pull, with the output's lock held; returns the exit status."""
    if args.from_file:  # size and mtime in the key: a changed copy is pulled again
        st = os.stat(args.from_file)
        source = f"file:{os.path.abspath(args.from_file)}:{st.st_size}:{st.st_mtime_ns}"
    else:
        source = f"hub:{REPO_ID}"
    progress_path = args.out + ".progress.json"
    progress = load_progress(progress_path, source)
    out_size = os.path.getsize(args.out) if os.path.exists(args.out) else 0
    if out_size < progress["bytes"]:  # the output was removed or cut: its progress is void
        progress = fresh_progress(source)
    if progress["exhausted"] or (args.max_records is not None and progress["read"] >= args.max_records):
        # Lines after those the progress counts: written after the last save of a pull that was
        # killed, before this run's smaller --max-records; or by another writer. As a resume does.
        if out_size > progress["bytes"]:
            with writing(args.out), open(args.out, "r+b") as out:
                out.truncate(progress["bytes"])
        print(f"pull-hermes3: {args.out} already has {progress['written']} conversations from {source}",
              file=sys.stderr)
        return 0

    try:
        if progress["read"]:
            print(f"pull-hermes3: resuming after record {progress['read']}", file=sys.stderr)
        if args.from_file:
            records = itertools.islice(iter_local_file(args.from_file), progress["read"], None)
        else:
            records = iter_hub(progress["read"], args.timeout)
        pull(records, args.out, progress, progress_path, args.max_records)
    except OutputError:
        print(file=sys.stderr)
        raise
    except PullError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2 if args.from_file else 1
    except KeyboardInterrupt:
        return interrupted("pull-hermes3", f"{progress['read']} records read; re-run to resume")
    except Exception as e:  # network errors from datasets/requests/fsspec come in many types
        if args.from_file:
            print(f"error: {args.from_file}: {type(e).__name__}: {e}", file=sys.stderr)
            return 2
        print(f"error: download failed after {progress['read']} records ({type(e).__name__}: {e}); "
              "re-run to resume", file=sys.stderr)
        return 1

    bad = sum(n for r, n in progress["malformed"].items() if not r.startswith("cut: "))
    reasons = ", ".join(f"{n} {r}" for r, n in sorted(progress["malformed"].items()))
    print(f"pull-hermes3: {progress['read']} records read, {progress['written']} conversations written "
          f"to {args.out}, {bad} malformed" + (f" ({reasons})" if bad else ""), file=sys.stderr)
    if progress["written"] == 0:
        print("error: no usable conversations", file=sys.stderr)
        return 4
    return 0


def main():
    ap = ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--from-file", help="local .json/.jsonl/.parquet copy instead of the hub")
    ap.add_argument("--out", default=os.path.join(ROOT, "data", "raw", "hermes3", "hermes3.jsonl"),
                    help="output JSON-lines file (default: data/raw/hermes3/hermes3.jsonl)")
    ap.add_argument("--max-records", type=int, default=None, help="stop after reading this many records")
    ap.add_argument("--timeout", type=float, default=10.0, help="network timeout in seconds (default 10)")
    args = ap.parse_args()
    if args.max_records is not None and args.max_records <= 0:
        print("error: --max-records must be positive", file=sys.stderr)
        return 2
    if not args.timeout > 0:  # nan too; requests' ValueError would read as a failed download (exit 1)
        print("error: --timeout must be a positive number of seconds", file=sys.stderr)
        return 2
    if args.from_file and not os.path.isfile(args.from_file):
        why = f"{file_kind(os.stat(args.from_file).st_mode)}, not a file" if os.path.exists(args.from_file) \
            else "no such file"
        print(f"error: --from-file {args.from_file}: {why}", file=sys.stderr)
        return 2
    if args.from_file and os.path.splitext(args.from_file)[1].lower() not in LOCAL_EXTENSIONS:
        print(f"error: {args.from_file}: unknown extension {os.path.splitext(args.from_file)[1]!r} "
              "(expected .json, .jsonl or .parquet)", file=sys.stderr)
        return 2
    if args.from_file and os.path.exists(args.out) and os.path.samefile(args.from_file, args.out):
        print(f"error: --from-file {args.from_file} is the --out file: a pull would overwrite what it reads",
              file=sys.stderr)
        return 2
    try:
        with writing(args.out):
            os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
            if os.path.exists(args.out) and not os.path.isfile(args.out):
                mode = os.stat(args.out).st_mode
                raise OSError(errno.EINVAL, f"{file_kind(mode)}, not a regular file")
        with locked(args.out + ".lock"):
            return pull_locked(args)
    except OutputError as e:
        print(f"error: {e}", file=sys.stderr)
        return 3
    except KeyboardInterrupt:  # while waiting for the lock
        return interrupted("pull-hermes3", "nothing pulled")


if __name__ == "__main__":
    sys.exit(main())
