"""Runs read from disk, for serving a directory of runs without training (`--serve DIR`).

DIR is a run directory (it holds <name>.loss.json) or a directory of them (runs/<name>/...). Each
run is followed as its files change, so runs that other proxies are training show up live: the
loss log is indexed as it grows (only complete lines), the state and samples are re-read when
their files change. Nothing is ever written, except the dashboard token (proxy_server.load_token).
"""
import json
import os
import threading
import time
from array import array

LOSS_SUFFIX = ".loss.json"
REFRESH_SECONDS = 0.2  # files are looked at no more often than this, whatever the clients ask
SCAN_SECONDS = 2.0  # new runs in the directory appear within this
SCAN_DEPTH = 2  # DIR/<name>.loss.json or DIR/<run>/<name>.loss.json
READ_BYTES = 1 << 22  # a log is indexed this much at a time (records are a few hundred bytes)


class LogFollower:
    """A loss log written by someone else (microgpt/loss_log.py's layout), indexed by complete
    lines as it grows; serves raw record bytes the way LossLog.read_json does."""

    def __init__(self, path):
        self.path = path
        self.lock = threading.Lock()
        self._reset(None)

    def _reset(self, ident):
        self.ident = ident  # (device, inode): a log replaced by a repair is indexed again
        self.starts, self.ends = array("q"), array("q")
        self.scanned = 0  # offset of the first byte not yet indexed

    def refresh(self):
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return
        with self.lock:
            if (st.st_dev, st.st_ino) != self.ident or st.st_size < self.scanned:
                self._reset((st.st_dev, st.st_ino))
            with open(self.path, "rb") as f:
                while self.scanned < st.st_size:  # in bounded pieces: a big log costs no big buffer
                    f.seek(self.scanned)
                    before = self.scanned
                    self._index(f.read(min(st.st_size - self.scanned, READ_BYTES)))
                    if self.scanned == before:  # a write under way: its line is looked at next time
                        break

    def _index(self, data):
        """Index the complete record lines of data (which starts at self.scanned). A record line is
        {"live":...} followed by ",\\n" or by "\\n]" (the last one); anything shorter is a write
        still under way, looked at again next time."""
        pos = 0
        while True:
            nl = data.find(b"\n", pos)
            if nl < 0:
                break
            line = data[pos:nl]
            if line.startswith(b'{"live":'):
                end = line.rstrip(b",")
                last = not line.endswith(b",")
                if not end.endswith(b"}") or (last and not data.startswith(b"]", nl + 1)):
                    break
                self.starts.append(self.scanned + pos)
                self.ends.append(self.scanned + pos + len(end))
            elif line not in (b"[", b""):  # "" where an append replaced the closing "\n]"
                break
            pos = nl + 1
        self.scanned += pos

    def __len__(self):
        return len(self.starts)

    def read_json(self, first, limit):
        with self.lock:
            n = len(self.starts)
            first = max(0, min(first, n))
            stop_i = min(n, first + max(0, limit))
            if stop_i == first:
                return b"[]", first
            start, stop = self.starts[first], self.ends[stop_i - 1]
        with open(self.path, "rb") as f:
            f.seek(start)
            chunk = f.read(stop - start)
        return b"[" + chunk + b"]", stop_i


def _read_json_file(path, kind):
    """A JSON file's value if it is of the expected kind (dict or list), else an empty one."""
    try:
        with open(path) as f:
            value = json.load(f)
    except (OSError, ValueError, RecursionError):
        return kind()
    return value if isinstance(value, kind) else kind()


class RunView:
    """One run on disk: state, samples and log, with the counters the live stream watches."""

    def __init__(self, loss_path):
        self.dir = os.path.dirname(loss_path)
        self.name = os.path.basename(loss_path)[:-len(LOSS_SUFFIX)]
        base = os.path.join(self.dir, self.name)
        self._log = LogFollower(loss_path)
        self._files = {"state": (base + ".state.json", dict), "samples": (base + ".samples.json", list)}
        self._seen = {}
        self._values = {"state": {}, "samples": []}
        self._versions = {"state": 0, "samples": 0}
        self._checked = 0.0
        self._lock = threading.Lock()

    def _refresh(self):
        with self._lock:
            now = time.monotonic()
            if now - self._checked < REFRESH_SECONDS:
                return
            self._checked = now
            for key, (path, kind) in self._files.items():
                try:
                    st = os.stat(path)
                    sig = (st.st_ino, st.st_size, st.st_mtime_ns)
                except OSError:
                    sig = None
                if sig != self._seen.get(key):
                    self._seen[key] = sig
                    self._values[key] = _read_json_file(path, kind)
                    self._versions[key] += 1
            self._log.refresh()

    @property
    def log(self):
        self._refresh()
        return self._log

    @property
    def state(self):
        self._refresh()
        return self._values["state"]

    @property
    def samples(self):
        self._refresh()
        return self._values["samples"]

    @property
    def state_version(self):
        self._refresh()
        return self._versions["state"]

    @property
    def samples_version(self):
        self._refresh()
        return self._versions["samples"]


class RunDirectory:
    """Every run under root, found again every SCAN_SECONDS; read-only."""

    controllable = False

    def __init__(self, root):
        self.root = os.path.realpath(root)
        self._runs = {}
        self._scanned = 0.0
        self._lock = threading.Lock()

    def _scan(self):
        with self._lock:
            if time.monotonic() - self._scanned < SCAN_SECONDS:
                return
            self._scanned = time.monotonic()
            for d, dirs, names in os.walk(self.root):
                depth = os.path.relpath(d, self.root).count(os.sep) + (d != self.root)
                dirs[:] = sorted(x for x in dirs if x != "archive" and depth + 1 < SCAN_DEPTH)
                for n in sorted(names):
                    if n.endswith(LOSS_SUFFIX) and len(n) > len(LOSS_SUFFIX):
                        path = os.path.join(d, n)
                        run_id = os.path.relpath(path, self.root)[:-len(LOSS_SUFFIX)]
                        if run_id not in self._runs:
                            self._runs[run_id] = RunView(path)

    def listing(self):
        self._scan()
        return [{"id": run_id, "name": run.name} for run_id, run in sorted(self._runs.items())]

    def get(self, run_id):
        self._scan()
        if run_id is None:
            return next(iter(self._runs.values())) if len(self._runs) == 1 else None
        return self._runs.get(run_id)
