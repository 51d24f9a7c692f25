"""Runs read from disk, for serving a directory of runs without training (`--serve DIR`).

DIR is a run directory (it holds <name>.loss.json) or a directory of them (runs/<name>/...). Each
run is followed as its files change, so runs that other proxies are training show up live: the
loss log is indexed as it grows (only complete lines), the state and samples are re-read when
their files change. Nothing is ever written, except the viewer token (proxy_server.load_token).
"""
import contextlib
import errno
import json
import os
import threading
import time
from array import array

from microgpt.cli import say
from microgpt.files import NotRegularFile, open_regular
from microgpt.loss_log import LossLog, parse_json

LOSS_SUFFIX = ".loss.json"
REFRESH_SECONDS = 0.2  # files are looked at no more often than this, whatever the clients ask
SCAN_SECONDS = 2.0  # new runs in the directory appear within this
SCAN_DEPTH = 2  # DIR/<name>.loss.json or DIR/<run>/<name>.loss.json
READ_BYTES = 1 << 22  # a log is indexed this much at a time (records are a few hundred bytes)
JSON_FILE_MAX = 1 << 24  # a longer state or samples file is none of ours (a 20000-step run's samples: ~100 KB)


class ServedDir:
    """A served directory, opened once (at the server's start) and held until close(): every listing
    and open under it starts from this descriptor, never from its name, so the directory renamed,
    or it or a directory above it swapped for a link to somewhere else after the start, leads
    nowhere else: what is served is the directory that was opened, wherever it is now, or nothing
    (removed)."""

    def __init__(self, path):
        self.path = os.path.realpath(path)  # its name at the start: for messages only
        self._fd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY)
        self._lock = threading.Lock()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self):
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None

    @contextlib.contextmanager
    def opened(self):
        """(descriptor, path) for one listing or open: a descriptor of the directory, which close()
        meanwhile leaves open (its number is not reused for another file under a request still
        under way), and the directory's real path now, which follows a rename (as /proc/self/fd
        names it; its name at the start where there is no /proc). FileNotFoundError once closed."""
        with self._lock:
            if self._fd is None:
                raise FileNotFoundError(errno.ENOENT, "no longer served", self.path)
            fd = os.dup(self._fd)
        try:
            try:
                now = os.readlink(f"/proc/self/fd/{fd}")
            except OSError:
                now = self.path
            yield fd, now
        finally:
            os.close(fd)

    def walk(self):
        """os.walk of the directory from its descriptor (os.fwalk, no link followed): (dir, dirs,
        names), dir relative to it ("" for itself); dirs may be pruned, as os.walk's."""
        with self.opened() as (fd, _):
            for d, dirs, names, _ in os.fwalk(dir_fd=fd):
                yield os.path.normpath(d) if d != os.curdir else "", dirs, names

    def stat(self, path):
        """os.stat of path under the directory (links followed: for a look at whether a file
        changed, never for what is served, which open opens)."""
        with self.opened() as (fd, _):
            return os.stat(path, dir_fd=fd)

    def open(self, path, suffix=""):
        """os.open(path) read-only, where path, links followed, stays under the directory and is a
        regular file whose own name ends with suffix: FileNotFoundError otherwise (a link out of the
        served directory, a FIFO, whose open would wait for a writer for ever, or a link x.json to
        the directory's dashboard.token, is served as no file). Links are resolved by
        name under where the directory is now, but what is opened is opened from its descriptor
        one name at a time with no link followed, so neither the file nor a directory on the way,
        nor the directory itself, swapped for a link after the check leads anywhere."""
        with self.opened() as (root_fd, base):
            real = inside(base, path)
            # inside resolves names, which lead elsewhere if the directory moves meanwhile: a path
            # not under base is no file, never a way up ("..") from the descriptor
            rel = os.path.relpath(real, base).split(os.sep) if real else [os.pardir]
            if rel[0] in (os.pardir, os.curdir):
                raise FileNotFoundError(path)
            *dirs, name = rel
            if not name.endswith(suffix):  # the file the links lead to, not the name asked for
                raise FileNotFoundError(path)
            dir_fd = os.dup(root_fd)
            try:
                for d in dirs:
                    next_fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=dir_fd)
                    os.close(dir_fd)
                    dir_fd = next_fd
                return open_regular(name, os.O_NOFOLLOW, dir_fd=dir_fd)
            except NotRegularFile:
                raise FileNotFoundError(path) from None
            except OSError as e:  # ELOOP, ENOTDIR: a name on the way became a link or a file after the check
                if e.errno in (errno.ELOOP, errno.ENOTDIR):
                    raise FileNotFoundError(path) from None
                raise
            finally:
                os.close(dir_fd)

    def name(self, path):
        """path under the directory as its name at the start says it: for messages."""
        return os.path.join(self.path, path)


def inside(root, rel):
    """The real path of rel under root (a path), or None if it leaves root (.., absolute, symlink) or
    cannot be a path at all (a NUL byte)."""
    if "\0" in rel:
        return None
    root = os.path.realpath(root)
    path = os.path.realpath(os.path.join(root, rel))
    return path if os.path.commonpath([root, path]) == root and path != root else None


class LogFollower:
    """A loss log written by someone else (microgpt/loss_log.py's layout), indexed by complete
    lines as it grows. It keeps what LossLog.read_json reads (starts, end, fd, lock), so records
    are served by the same code, as raw bytes."""

    read_json = LossLog.read_json

    def __init__(self, path, root):
        self.path, self.root = path, root  # path: under root (a ServedDir)
        self.lock = threading.Lock()
        self.fd = None
        self.unreadable = False  # said so once
        self._forget()

    def _forget(self):
        """No log indexed (none opened yet, or the one opened is gone or replaced)."""
        self.ident = None  # (device, inode): a log replaced by a repair is indexed again
        self.starts = array("q")  # byte offset where each record's line starts
        self.end = 0  # offset just after the last indexed record's "}"
        self.scanned = 0  # offset of the first byte not yet indexed
        self.damaged = None  # what is wrong with the record at self.scanned, if anything

    def close(self):
        """No log open: a removed one's disk space is given back, and nothing of it is served."""
        with self.lock:
            self._close()

    def _close(self):
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
        self._forget()

    def _reopen(self):
        self._close()
        self.fd = self.root.open(self.path)
        st = os.fstat(self.fd)
        self.ident = (st.st_dev, st.st_ino)

    def refresh(self):
        try:
            st = self.root.stat(self.path)
            with self.lock:
                if (st.st_dev, st.st_ino) != self.ident:
                    self._reopen()
                size = os.fstat(self.fd).st_size
                if size < self.scanned:  # cut back (a torn tail repaired in place)
                    self._reopen()
                while self.scanned < size and not self.damaged:  # in bounded pieces: no big buffer
                    before = self.scanned
                    self._index(os.pread(self.fd, min(size - self.scanned, READ_BYTES), self.scanned))
                    if self.scanned == before:  # a write under way: its line is looked at next time
                        break
        except FileNotFoundError:  # removed (or a link out put in its place): the open log was kept,
            self.close()           # its records served and its disk space held, for as long as served
            return
        except OSError as e:  # another user's run, owner-only: no records, rather than a 500 a time
            if not self.unreadable:
                say(f"warning: {self.root.name(self.path)}: cannot read it ({e.strerror or e}); shown without its records")
            self.unreadable = True

    def _index(self, data):
        """Index the complete record lines of data (which starts at self.scanned). A record line is
        {"live":...} followed by ",\n" or by "\n]" (the last one); anything shorter is a write
        still under way, looked at again next time. Records are served as raw bytes, cut where the
        next one starts less its ",\n" (LossLog.read_json), so each is checked to be a JSON object
        in exactly that layout first: one damaged record, or two commas, a blank line between
        records, a "\r" (a blank to JSON, the end of a line to an event stream), would make every
        answer holding it unparseable; so would a line of READ_BYTES or more (no record of ours)
        be awaited for ever as a write under way. The log is indexed up to the record before it,
        and no further, with one warning."""
        pos, found, layout_ok = 0, [], True  # found: (offset in data, record) of each complete record line
        while True:
            nl = data.find(b"\n", pos)
            if nl < 0:
                break
            line = data[pos:nl]
            if line.startswith(b'{"live":'):
                last = not line.endswith(b",")
                if last and nl + 1 == len(data):  # its "]" (or the append's ",") not there yet
                    break
                record = line if last else line[:-1]
                layout_ok = (record.endswith(b"}") and b"\r" not in record
                             and (not last or data.startswith(b"]", nl + 1)))
                if not layout_ok:
                    break
                found.append((pos, record))
            # "[" opens the file; "" is where an append replaced the "\n]" after the last record
            elif not (line == b"[" and self.scanned + pos == 0
                      or line == b"" and pos == 0 and self.scanned == self.end + 1):
                layout_ok = False
                break
            pos = nl + 1
        if pos == 0 and len(data) == READ_BYTES and data.find(b"\n") < 0:
            layout_ok = False  # a line longer than a read, which no record of ours is: else awaited for ever
        whole = _whole_records(record for _, record in found)
        for offset, record in found[:whole]:
            self.starts.append(self.scanned + offset)
            self.end = self.scanned + offset + len(record)
        if whole < len(found) or not layout_ok:
            self.damaged = f"{self.root.name(self.path)}: record {len(self.starts) + 1} is damaged; shown up to the one before it"
            say(f"warning: {self.damaged}")
            if whole < len(found):
                pos = found[whole][0]
        self.scanned += pos

    def __len__(self):
        return len(self.starts) if self.fd is not None else 0


def _whole_records(records):
    """How many of the record lines, from the first, are whole JSON objects: all of them checked
    as one array (C speed), one by one only to find the first damaged one."""
    records = list(records)
    try:
        parsed = parse_json(b"[" + b",".join(records) + b"]")
        if len(parsed) == len(records) and all(isinstance(r, dict) for r in parsed):
            return len(records)
    except ValueError:
        pass
    for i, record in enumerate(records):
        try:
            if not isinstance(parse_json(record), dict):
                return i
        except ValueError:
            return i
    return len(records)


def _read_json_file(root, path, kind):
    """A JSON file's value under root (a ServedDir) if it is JSON as a browser reads it (parse_json) and of the
    expected kind (dict or list), else an empty one; also (with a warning) where it is longer than
    JSON_FILE_MAX: read whole, a huge or sparse file took all memory, then a 500 a request."""
    try:
        with os.fdopen(root.open(path), "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size > JSON_FILE_MAX:
                say(f"warning: {root.name(path)}: {size} bytes, more than a run's state or samples take "
                    f"({JSON_FILE_MAX}); shown as empty")
                return kind()
            value = parse_json(f.read(JSON_FILE_MAX + 1))
    except (OSError, ValueError):
        return kind()
    return value if isinstance(value, kind) else kind()


def _checked(attr):
    """A RunView attribute read after a look at whether the run's files changed."""
    def get(view):
        view._refresh()
        return getattr(view, attr)
    return property(get)


class RunView:
    """One run on disk: state, samples and log, with the counters the live stream watches."""

    def __init__(self, loss_path, root):  # loss_path: under root (a ServedDir)
        self.dir, self.root = os.path.dirname(loss_path), root
        self.name = os.path.basename(loss_path)[:-len(LOSS_SUFFIX)]
        base = os.path.join(self.dir, self.name)
        self._log = LogFollower(loss_path, root)
        self._files = {"state": (base + ".state.json", dict), "samples": (base + ".samples.json", list)}
        self._seen = {}  # file -> (inode, size, mtime) when last read
        self._state, self._samples = {}, []
        self._state_version = self._samples_version = 0
        self._looked = 0.0
        self._lock = threading.Lock()

    def close(self):
        self._log.close()

    def _refresh(self):
        with self._lock:
            now = time.monotonic()
            if now - self._looked < REFRESH_SECONDS:
                return
            self._looked = now
            for key, (path, kind) in self._files.items():
                try:
                    st = self.root.stat(path)
                    sig = (st.st_ino, st.st_size, st.st_mtime_ns)
                except OSError:
                    sig = None
                if sig != self._seen.get(key):
                    self._seen[key] = sig
                    setattr(self, f"_{key}", _read_json_file(self.root, path, kind))
                    setattr(self, f"_{key}_version", getattr(self, f"_{key}_version") + 1)
            self._log.refresh()

    log = _checked("_log")
    state = _checked("_state")
    samples = _checked("_samples")
    state_version = _checked("_state_version")
    samples_version = _checked("_samples_version")


class RunDirectory:
    """Every run under root, found again every SCAN_SECONDS; read-only. root is opened here, and
    served from that descriptor until close() (ServedDir)."""

    controllable = False

    def __init__(self, root):
        self.root = ServedDir(root)
        self._runs = {}
        self._scanned = 0.0
        self._lock = threading.Lock()

    def close(self):
        """The directory and every run's log closed: nothing of them is served any more."""
        with self._lock:
            for run in self._runs.values():
                run.close()
            self._runs.clear()
            self._scanned = float("inf")  # no scan again
            self.root.close()

    def _scan(self):
        with self._lock:
            if time.monotonic() - self._scanned < SCAN_SECONDS:
                return
            self._scanned = time.monotonic()
            found = set()
            with self.root.opened() as (_, base):
                for d, dirs, names in self.root.walk():
                    depth = d.count(os.sep) + (d != "")
                    dirs[:] = sorted(x for x in dirs if x != "archive" and depth + 1 < SCAN_DEPTH)
                    for n in sorted(names):
                        path = os.path.join(d, n)
                        if n.endswith(LOSS_SUFFIX) and len(n) > len(LOSS_SUFFIX) and inside(base, path):
                            run_id = path[:-len(LOSS_SUFFIX)]
                            found.add(run_id)
                            if run_id not in self._runs:
                                self._runs[run_id] = RunView(path, self.root)
            # a run removed or renamed since is listed no more (renamed, it was listed twice), and
            # its log is closed: an open one held a removed log's disk space as long as served
            for run_id in set(self._runs) - found:
                self._runs.pop(run_id).close()

    def listing(self):
        self._scan()
        return [{"id": run_id, "name": run.name} for run_id, run in sorted(self._runs.items())]

    def get(self, run_id):
        self._scan()
        if run_id is None:
            return next(iter(self._runs.values())) if len(self._runs) == 1 else None
        return self._runs.get(run_id)
