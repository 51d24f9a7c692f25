"""A run's loss history, <name>.loss.json: one JSON array that only ever grows (docs/DESIGN.md §5).

On disk, one record per line:

    [
    {"live":1,"step":1,"loss":10.93,"lr":6e-05,...,"seg":1,"time":1718000000.123,"elapsed":0.41},
    {"live":1,"step":2,"loss":10.71,...}
    ]

Appending seeks back over the closing "\\n]" and writes ",\\n{record}...\\n]" with one pwrite, so the
file is never rewritten and is valid JSON after every complete write. A crash in the middle of a
write leaves a torn tail; opening the log checks every record (a million in about a second) and cuts
a torn tail back to the last complete record and closes the array again (repair()); damage anywhere
else is refused, never cut.

Superseded records. Every record starts with "live":1. When a run resumes from a checkpoint at step
k, every live record with step > k describes a future that no longer happens; its "1" is overwritten
in place by "0" (a single byte, so the file is valid JSON at every instant) before the resumed engine
writes anything, and a {"event":"resume","step":k} record is appended. So for a plain reader

    live = [r for r in json.load(open(path)) if r["live"]]

holds each step once, and a streaming reader (the dashboard) that only sees appended records applies
the same rule: a resume record at step k supersedes every earlier record with step > k. Live records
therefore appear in non-decreasing step order, which lets supersede_after() stop at the first live
record at or below k instead of scanning the whole file.
"""
import bisect
import json
import math
import os
import threading
import time
from array import array

import numpy as np

from microgpt.atomic import write_bytes_atomic
from microgpt.files import DuplicateKeyError, loads_json

LIVE_FLAG_OFFSET = len(b'{"live":')  # the byte that becomes "0" when the record is superseded
EMPTY = b"[\n]"
VALIDATE_LINES = 8192  # records parsed together when a log is opened (every record is checked)


class LossLogError(RuntimeError):
    pass


def _refuse_constant(name):
    raise ValueError(f"{name} is not JSON")


def _finite_float(text):
    """parse_float for parse_json: a number beyond a double's range (1e999) is refused. Python's
    json reads it as inf, the browser's JSON.parse as Infinity, which no chart axis can hold (one
    such step emptied every chart), and json.dumps writes it back as Infinity, which JSON.parse
    refuses (a state holding one was such an answer)."""
    value = float(text)
    if math.isinf(value):
        raise ValueError(f"{text[:20]}... is beyond a double's range")
    return value


def _finite_int(text):
    """parse_int for parse_json: an integer beyond a double's range (400 digits) is refused, as
    _finite_float refuses 1e999 (JSON.parse reads it as Infinity). Only long ones are looked at:
    this runs for every integer of every record."""
    if len(text) > 300:
        _finite_float(text)
    return int(text)


def parse_json(text):
    """JSON as a browser's JSON.parse reads it: Python's json also takes NaN and Infinity, which
    would make a record that the dashboard (and any JSON reader) cannot parse look whole; so is a
    number beyond a double's range (_finite_float). A key named twice in one object is refused
    too: the browser keeps the last, an engine the first. Every fault is a ValueError, JSON nested
    too deeply for Python's json too (a RecursionError otherwise, which the readers' ValueError
    handlers would let through as a traceback)."""
    return loads_json(text, parse_constant=_refuse_constant, parse_float=_finite_float,
                      parse_int=_finite_int)


def encode_record(rec):
    """One record as the bytes of its line: "live" first, so its flag sits at a fixed offset."""
    body = json.dumps({k: v for k, v in rec.items() if k != "live"}, separators=(",", ":"),
                      allow_nan=False)
    if body == "{}":
        raise LossLogError("refusing to log an empty record")
    live = 0 if rec.get("live", 1) == 0 else 1
    return b'{"live":%d,' % live + body[1:].encode()


def _is_record(rec):
    """A record the proxy can resume from: an object whose step, seg and elapsed, where present, are
    numbers (it compares the steps, counts launches on from the last seg and times on from an
    elapsed; a hand-edited "seg": null was a TypeError at start)."""
    return isinstance(rec, dict) and all(isinstance(rec.get(key, 0), (int, float))
                                         for key in ("step", "seg", "elapsed"))


def _complete_record(line):
    """The record on a line of the log ("{...}" maybe followed by "," or "]"), or None if torn."""
    text = line.strip().rstrip(b",]").strip()
    if not text.startswith(b"{"):
        return None
    try:
        rec = parse_json(text)
    except ValueError:  # torn JSON, or NUL bytes left by a crash of the file system
        return None
    return rec if isinstance(rec, dict) else None


def _record_starts(data):
    """The offset of every record's line in a log in our layout, or None if any line is not one
    whole record. Every record is checked: the layout (each line '{"live":0|1,...}' and ',' but the
    last) with numpy, then the JSON itself in batches of VALIDATE_LINES lines parsed as one array
    (C-speed, memory bounded by the batch). A million records take seconds."""
    if not (data.startswith(b"[\n") and data.endswith(b"\n]")) or b"\r" in data:
        return None  # a "\r" is a blank to JSON but ends a line of the dashboard's event stream
    buf = np.frombuffer(data, dtype=np.uint8)
    newlines = np.flatnonzero(buf == ord("\n"))  # the first ends "[", the last precedes "]"
    starts, ends = newlines[:-1] + 1, newlines[1:]  # each record's line: [start, end)
    if len(starts) == 0:
        return starts
    ends_in = ends - 1 - (np.arange(len(ends)) < len(ends) - 1)  # the "}" (before "," but the last)
    if (ends_in - starts < LIVE_FLAG_OFFSET + 1).any():
        return None
    head = buf[starts[:, None] + np.arange(LIVE_FLAG_OFFSET)]
    if ((head != np.frombuffer(b'{"live":', dtype=np.uint8)).any()
            or ((buf[starts + LIVE_FLAG_OFFSET] | 1) != ord("1")).any()  # "0" or "1"
            or (buf[ends_in] != ord("}")).any() or (buf[ends[:-1] - 1] != ord(",")).any()):
        return None
    for i in range(0, len(starts), VALIDATE_LINES):
        last = min(i + VALIDATE_LINES, len(starts)) - 1
        batch = b"[" + data[starts[i]:ends_in[last] + 1] + b"]"
        try:
            recs = parse_json(batch)
        except ValueError:
            return None
        if len(recs) != last + 1 - i or not all(map(_is_record, recs)):
            return None
    return starts


def repair(path):
    """Make the file at path a valid log again; returns what was done, or None if it was fine.

    Only the tail can be torn (the writer never touches earlier bytes except single flag bytes), so
    walk back from the end to the last line that holds a complete record, cut the file right after
    that record's "}" and close the array; a last line that is no record with the log's closing
    after it whole was damaged, not torn (_written_whole), and is refused. A valid array in another layout (e.g. pretty-printed by
    hand) is rewritten once into ours. Anything else is refused rather than cut, because cutting it
    would destroy someone's data."""
    with open(path, "rb") as f:
        data = f.read()
    if data.strip() == b"":
        write_bytes_atomic(path, EMPTY)
        return f"{path}: empty file, started a new log"
    try:
        records = parse_json(data)
    except DuplicateKeyError as e:  # raised where the record closes, before any torn tail is reached
        raise LossLogError(f"{path}: {e}, so which one is meant is ambiguous; fix or move it") from None
    except ValueError:
        records = None
    if records is not None:
        if not isinstance(records, list) or not all(isinstance(r, dict) for r in records):
            raise LossLogError(f"{path}: not a JSON array of records; move it away")
        bad = next((i for i, r in enumerate(records) if not _is_record(r)), None)
        if bad is not None:
            raise LossLogError(f"{path}: record {bad + 1} has a step, seg or elapsed that is no number; "
                               "fix it or move the file away (the run then starts a new log)")
        lines = [encode_record(r) for r in records]
        write_bytes_atomic(path, b"[\n" + b",\n".join(lines) + b"\n]" if lines else EMPTY)
        return f"{path}: rewrote into the one-record-per-line layout"
    lines = data.split(b"\n")
    if lines[0].strip() != b"[":
        raise LossLogError(f"{path}: neither valid JSON nor a loss log with a torn tail; "
                           "fix or move it")
    pos = len(data)
    for line in reversed(lines[1:]):
        pos -= len(line)  # now the offset where this line starts
        if _complete_record(line) is not None:
            keep = pos + len(line.rstrip(b" \t\r,]"))  # through the record's closing "}"
            break
        pos -= 1  # the "\n" before this line
    else:
        # Our writer puts one record per line, so a log of ours with no complete record holds at most
        # one (torn) line after "[". More than that is someone else's data: refuse, don't erase it.
        if any(line.strip(b" \t\r\0") for line in lines[1:-1]):
            raise LossLogError(f"{path}: not valid JSON, and no line of it is a complete record; "
                               "fix or move it")
        write_bytes_atomic(path, EMPTY)
        return f"{path}: no complete record survived a torn write; started a new log"
    try:
        parse_json(data[:keep] + b"\n]")
    except ValueError:
        bad = next((n for n, line in enumerate(lines[1:], 2) if _complete_record(line) is None), "?")
        raise LossLogError(f"{path}: line {bad} is not a complete record, and a crash only tears "
                           "the end of the log: the damage is not at the end; fix the line or move "
                           "the file away (the run then starts a new log)") from None
    if _written_whole(data[keep:]):
        line_no = data.count(b"\n", 0, keep) + 2  # the line after the last complete record
        raise LossLogError(f"{path}: line {line_no} is not a complete record, but the log's closing "
                           "\"]\" follows it whole, so no crash tore it: it was damaged or edited; fix "
                           "the line or move the file away (the run then starts a new log)")
    _truncate_and_close(path, keep)
    return f"{path}: repaired a torn tail (cut {len(data) - keep} bytes)"


def _written_whole(tail):
    """Whether the bytes after the last complete record are no torn write: an append writes
    ',\n' + records + '\n]' over the old closing '\n]', so a torn one ends before its closing or
    holds the NUL bytes a file system leaves for blocks it never wrote. Records hold no newline."""
    return tail.rstrip(b" \t\r\n").endswith(b"\n]") and b"\0" not in tail


def _truncate_and_close(path, size):
    with open(path, "r+b") as f:
        f.truncate(size)
        f.seek(size)
        f.write(b"\n]")
        f.flush()
        os.fsync(f.fileno())


def _pwrite_all(fd, data, offset):
    """pwrite may write fewer bytes than asked (a nearly full disk, a signal); write the rest, so a
    batch is either all on disk or cut short at the tail, where repair() can mend it."""
    view = memoryview(data)
    while view:
        n = os.pwrite(fd, view, offset)
        if n <= 0:  # nothing written and no error: retrying would spin forever
            raise LossLogError(f"write to the loss log made no progress at byte {offset}")
        view, offset = view[n:], offset + n


class LossLog:
    """The open log of one run: appends from the proxy, reads from the server's threads.

    Keeps the byte offset of every record's line, so a reader can be served records i..j as raw
    bytes without parsing them, and a record's live flag can be found without scanning."""

    def __init__(self, path):
        self.path = path
        self.lock = threading.Lock()
        self.message = None  # what opening had to repair, for the proxy to report
        if not os.path.exists(path):
            write_bytes_atomic(path, EMPTY)
        self.starts = array("q")  # byte offset where each record's line starts
        self.end = self._index()  # offset of the final "\n]", where the next append goes
        if self.end is None:
            self.message = repair(path)
            self.end = self._index()
            if self.end is None:
                raise LossLogError(f"{path}: could not be brought into the loss-log layout")
        self.fd = os.open(path, os.O_RDWR)

    def _index(self):
        """Fill self.starts from the file; returns the offset of the closing "\\n]", or None if the
        file is not exactly in our layout (torn, damaged, or written by something else)."""
        with open(self.path, "rb") as f:
            data = f.read()
        starts = _record_starts(data)
        if starts is None:
            return None
        self.starts = array("q", starts.tolist())
        return len(data) - 2

    def __len__(self):
        return len(self.starts)

    def append(self, records):
        """Append records (dicts) with one write and one fsync: the batch is the unit of durability."""
        if not records:
            return
        with self.lock:
            self._check_still_the_file()
            blob = bytearray()
            starts = []
            pos = self.end
            for rec in records:
                sep = b",\n" if len(self.starts) + len(starts) else b"\n"
                line = encode_record(rec)
                starts.append(pos + len(sep))
                blob += sep + line
                pos += len(sep) + len(line)
            blob += b"\n]"
            _pwrite_all(self.fd, bytes(blob), self.end)
            os.fsync(self.fd)
            self.starts.extend(starts)
            self.end = pos

    def _check_still_the_file(self):
        """The log's path must still name the file open here, whole: one replaced meanwhile (an editor
        saving a copy over it, a `cp` and `mv`) or removed would take every later record into a file
        that no one can open, and the run would end "stopped" with a hole in its history; one
        truncated, past a hole of NUL bytes; a LossLogError
        instead (a proxy failure: the engine is stopped before a checkpoint gets ahead of the log)."""
        try:
            st = os.stat(self.path)
        except OSError as e:
            raise LossLogError(f"{self.path} was removed while the run was logging to it "
                               f"({e.strerror or e})") from None
        own = os.fstat(self.fd)
        if (st.st_dev, st.st_ino) != (own.st_dev, own.st_ino):
            raise LossLogError(f"{self.path} was replaced by another file while the run was logging "
                               "to it")
        # Truncated in place (`: > log`, `truncate -s`): the same file, but a write at the old end
        # would leave a hole of NUL bytes before it, a log no JSON reader takes. (Longer than the
        # end is no harm: a write cut short by a full disk leaves that, and the next one covers it.)
        if own.st_size < self.end + 2:
            raise LossLogError(f"{self.path} was truncated to {own.st_size} bytes by another process "
                               "while the run was logging to it")

    def _line(self, i):
        stop = self.starts[i + 1] - 2 if i + 1 < len(self.starts) else self.end
        return os.pread(self.fd, stop - self.starts[i], self.starts[i])

    def record(self, i):
        return json.loads(self._line(i))

    def supersede_after(self, step):
        """Mark every live record with step > `step` superseded; returns how many were marked."""
        marked = 0
        with self.lock:
            for i in range(len(self.starts) - 1, -1, -1):
                rec = json.loads(self._line(i))
                if not rec.get("live"):
                    continue
                if rec.get("step", 0) <= step:
                    break
                _pwrite_all(self.fd, b"0", self.starts[i] + LIVE_FLAG_OFFSET)
                marked += 1
            if marked:
                os.fsync(self.fd)
        return marked

    def last_live(self, predicate):
        """The newest live record for which predicate(record) is true, or None."""
        with self.lock:
            for i in range(len(self.starts) - 1, -1, -1):
                rec = json.loads(self._line(i))
                if rec.get("live") and predicate(rec):
                    return rec
        return None

    def read_json(self, first, limit, max_bytes=None):
        """Records first..first+limit-1 as the bytes of a JSON array (no parsing), and the index
        after the last one returned. With max_bytes, only those that start within max_bytes of the
        first (at least one): a count of records alone bounds nothing where records are large."""
        with self.lock:
            n = len(self.starts)
            first = max(0, min(first, n))
            stop_i = min(n, first + max(0, limit))
            if stop_i == first:
                return b"[]", first
            if max_bytes is not None:
                stop_i = bisect.bisect_right(self.starts, self.starts[first] + max_bytes, first + 1, stop_i)
            stop = self.starts[stop_i] - 2 if stop_i < n else self.end
            chunk = os.pread(self.fd, stop - self.starts[first], self.starts[first])
        return b"[" + chunk + b"]", stop_i

    def close(self):
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


class LossBuffer:
    """Records on their way to a LossLog: appended together (one pwrite, one fsync) every
    FLUSH_SECONDS or FLUSH_RECORDS, so a fast engine does not cost one fsync per step."""

    FLUSH_SECONDS = 0.25  # how stale the loss log on disk may get
    FLUSH_RECORDS = 512

    def __init__(self, log):
        self.log = log
        self.pending = []
        self.pending_since = 0.0

    def add(self, rec):
        if not self.pending:
            self.pending_since = time.monotonic()
        self.pending.append(rec)

    def flush(self, force=False):
        if self.pending and (force or len(self.pending) >= self.FLUSH_RECORDS
                             or time.monotonic() - self.pending_since >= self.FLUSH_SECONDS):
            self.log.append(self.pending)
            self.pending = []
