"""Replace a file so that a reader, or the next run after a crash, sees either the old file or the
whole new one, never a part: write a temp file beside it, fsync, rename over the target, fsync the
directory (so the rename itself survives a power loss). The one place that does this; the proxy, the
loss log, the shard writer and the data scripts all use it.

    with atomic_open(path, "w") as f:
        json.dump(obj, f)
"""
import contextlib
import errno
import json
import os
import signal


@contextlib.contextmanager
def atomic_open(path, mode="wb"):
    """Yield a file open for writing (mode "w", UTF-8, or "wb") that replaces `path` when the block
    ends without an exception; on an exception the temp file is removed and `path` is left as it was."""
    path = os.fspath(path)
    tmp = f"{path}.tmp{os.getpid()}"  # the pid: two processes never share a temp file
    try:
        with open_new(tmp, mode) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:  # KeyboardInterrupt too: never leave a stray temp file behind
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp)
        raise
    fsync_dir(os.path.dirname(path) or ".")


def open_new(tmp, mode="wb", permissions=0o666):
    """A temp file created afresh (mode "w", UTF-8, or "wb"; permissions before the umask):
    whatever had its name before (one left by a killed process of the same pid, or a symbolic link
    planted to make the write go elsewhere) is removed, and O_EXCL refuses one put back meanwhile
    instead of following it."""
    with contextlib.suppress(FileNotFoundError):
        os.remove(tmp)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, permissions)
    return open(fd, mode, encoding=None if "b" in mode else "utf-8")


def fsync_dir(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_bytes_atomic(path, data):
    with atomic_open(path, "wb") as f:
        f.write(data)


def json_text(obj):
    """obj as indented JSON with a final newline (readable with cat, diffable)."""
    return json.dumps(obj, indent=1) + "\n"


def write_json_atomic(path, obj):
    with atomic_open(path, "w") as f:
        f.write(json_text(obj))


def remove_stale_temps(directory, names, locked=False):
    """The temp files (NAME.tmpPID) of the given names in `directory` that a process killed mid-write
    left (kill -9, a power loss): its cleanup never ran, and an export's are model-sized. Only those
    whose process is gone, as a live one's temp file is its own; `locked`: all of them, the caller
    holding the lock that every writer of these names takes (a pid may have been reused since)."""
    prefixes = {f"{name}.tmp" for name in names}
    for entry in os.listdir(directory):
        head, sep, pid = entry.rpartition(".tmp")
        if not sep or f"{head}.tmp" not in prefixes or not pid.isdigit() or pid != str(int(pid)):
            continue
        if not locked:
            try:
                os.kill(int(pid), 0)
                continue
            except ProcessLookupError:
                pass
            except (PermissionError, OverflowError):  # another user's process, or no pid at all
                continue
        with contextlib.suppress(FileNotFoundError, IsADirectoryError):
            os.remove(os.path.join(directory, entry))


class InterruptedWhole(KeyboardInterrupt):
    """Ctrl-C, or SIGTERM taken as Ctrl-C, that came while write_files_atomic put its files in place:
    held back until the last of them was, so the change is whole."""


@contextlib.contextmanager
def stop_signals_held():
    """SIGINT and SIGTERM held back for the with block, then raised again under their own handlers:
    where the block ended without an exception, the KeyboardInterrupt one raises is InterruptedWhole.
    Their handlers are swapped for the block, not the signals blocked: a thread of a library
    (numpy's BLAS) that does not block them would take them for the main thread."""
    came = []
    handlers = {sig: signal.signal(sig, lambda signum, frame: came.append(signum))
                for sig in (signal.SIGINT, signal.SIGTERM)}
    whole = False
    try:
        yield
        whole = True
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        try:
            for sig in dict.fromkeys(came):
                signal.raise_signal(sig)
        except KeyboardInterrupt:
            if whole:
                raise InterruptedWhole from None
            raise


def write_files_atomic(directory, files, last=None):
    """Several files {name: bytes} in `directory` as one change: every temp file is written and
    fsynced before the first rename, so a failure while writing (a full disk) leaves the directory as
    it was; only a crash between the renames can leave some files new and some old. `last`, where
    given, names the file a reader looks for first (an export's config.json): the old one is removed
    before the first rename and the new one renamed after every other, so that such a crash leaves
    it missing, never a set that looks whole with old or missing files in it. A directory where a
    file belongs, which no rename replaces, is refused before anything is written; the temp files
    of these names that a killed writer left are removed first (remove_stale_temps). Ctrl-C or
    SIGTERM (taken as Ctrl-C) during the renames is held back until they are done: a handled signal
    is no crash, and stopping there lost the old set for a part of the new one (InterruptedWhole)."""
    for name in files:
        target = os.path.join(directory, name)
        if os.path.isdir(target) and not os.path.islink(target):
            raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), target)
    remove_stale_temps(directory, files)
    temps = {}
    try:
        for name, data in files.items():
            tmp = os.path.join(directory, f"{name}.tmp{os.getpid()}")
            temps[name] = tmp
            with open_new(tmp) as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
        with stop_signals_held():  # once the first old file is gone, every new one goes in place
            if last is not None:
                with contextlib.suppress(FileNotFoundError):
                    os.remove(os.path.join(directory, last))
            for name in sorted(temps, key=lambda name: name == last):  # last at the end
                if name == last:
                    fsync_dir(directory)  # the others' renames reach the disk before it
                os.replace(temps[name], os.path.join(directory, name))
            fsync_dir(directory)
    except BaseException:
        for tmp in temps.values():
            with contextlib.suppress(FileNotFoundError):
                os.remove(tmp)
        raise
