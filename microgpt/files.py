"""Opening input files so that nothing can hang a tool, as microgpt/host/files.h does for the
engines: a FIFO, device or directory given where a file belongs is refused at once, where a plain
open() of a FIFO would wait for a writer for ever; lock files likewise (hold_lock). Reading JSON lines
in bounded memory (record_lines).
And reading JSON so that every reader takes a file the same way: an object that names a key twice
is refused (unique_keys)."""
import contextlib
import errno
import fcntl
import json
import os
import stat
import sys


class NotRegularFile(OSError):
    """An OSError whose strerror says what the file is instead ("a FIFO, not a regular file")."""


def file_kind(mode):
    """What a file that is not a regular file is, for error messages."""
    return ("a directory" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode)
            else "a socket" if stat.S_ISSOCK(mode) else "a device")


def open_regular(path, flags=0, dir_fd=None):
    """os.open(path, O_RDONLY | flags, dir_fd=dir_fd) of a regular file, its reads blocking as
    usual; NotRegularFile for anything else. O_NONBLOCK makes opening a FIFO return at once; the
    kind is then read from the open descriptor, so a file swapped after a check is not what gets
    read."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | flags, 0o666, dir_fd=dir_fd)  # the permissions: for O_CREAT
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise NotRegularFile(errno.EINVAL, f"{file_kind(mode)}, not a regular file", path)
    os.set_blocking(fd, True)
    return fd


def open_lock_file(path, flags=0):
    """os.open of the regular file at path for a lock, made if missing (O_CREAT), with flags
    (O_RDWR to write in it): a FIFO is refused rather than waited on, a symbolic link rather than
    followed (NotRegularFile both)."""
    try:
        return open_regular(path, os.O_CREAT | os.O_NOFOLLOW | flags)
    except OSError as e:
        if e.errno != errno.ELOOP:
            raise
        raise NotRegularFile(errno.ELOOP, "a symbolic link, not a regular file", path) from None


@contextlib.contextmanager
def hold_lock(path):
    """An exclusive flock on the file at path, made if missing, held for the with block: a second
    process waits there. Anything else put in its place is refused, neither waited on (a FIFO) nor
    followed (a symbolic link, which would make or open a file elsewhere): NotRegularFile."""
    fd = open_lock_file(path)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


MAX_RECORD_BYTES = 32 << 20  # a longer JSON record is not read whole: memory stays bounded on any input
RECORD_TOO_LONG = f"record over {MAX_RECORD_BYTES >> 20} MB"  # its reason, as the data tools count it


def record_lines(f):
    """The non-blank lines of a JSON-lines file f (binary) as (line, nbytes), for the data tools
    (docs/DESIGN.md §7). A line over MAX_RECORD_BYTES is read in pieces, never whole, and yielded as
    (None, nbytes): one huge line (a whole JSON array saved as JSON lines) cannot take all memory."""
    while True:
        line = f.readline(MAX_RECORD_BYTES)
        if not line:
            return
        nbytes = len(line)
        if nbytes == MAX_RECORD_BYTES and not line.endswith(b"\n"):
            while line and not line.endswith(b"\n"):
                line = f.readline(MAX_RECORD_BYTES)
                nbytes += len(line)
            yield None, nbytes
        elif line.strip():
            yield line, nbytes


class DuplicateKeyError(ValueError):
    """A JSON object that names a key twice (unique_keys)."""


def unique_keys(pairs):
    """object_pairs_hook for json.load/json.loads: the object, or DuplicateKeyError where it names a
    key twice. Python's json keeps the last of them, the engines' readers the first; refused, a file
    edited by hand means one thing to every reader (docs/DESIGN.md §15)."""
    obj = dict(pairs)
    if len(obj) < len(pairs):
        seen = set()
        twice = next(key for key, _ in pairs if key in seen or seen.add(key))
        raise DuplicateKeyError(f"the key {json.dumps(twice)} appears twice in one object")
    return obj


class JsonTooDeep(ValueError):
    """JSON nested too deeply for Python's json (which raises RecursionError for it)."""


def loads_json(text, **kw):
    """json.loads (kw: its other hooks) with a key named twice refused (unique_keys), and every
    fault a ValueError: JSON nested too deeply is JsonTooDeep, where json raises a RecursionError
    that the readers' ValueError handlers would let through as a traceback; an integer too long for
    int() is said as such, not with Python's advice to raise its limit."""
    try:
        return json.loads(text, object_pairs_hook=unique_keys, **kw)
    except RecursionError:
        raise JsonTooDeep("JSON nested too deeply") from None
    except ValueError as e:
        if isinstance(e, json.JSONDecodeError) or "sys.set_int_max_str_digits" not in str(e):
            raise
        raise ValueError(f"an integer of more than {sys.get_int_max_str_digits()} digits") from None


def read_json(path, default):
    """The JSON document at path (UTF-8, as json writes it), or default where it cannot be read or is
    no JSON loads_json takes: for the files a program writes for itself and rebuilds when damaged
    (one that is no regular file too: a FIFO put there would hang a plain open())."""
    try:
        with open(open_regular(path), encoding="utf-8") as f:
            return loads_json(f.read())
    except (OSError, ValueError):
        return default


def has_lone_surrogate(text):
    """Whether a str holds a lone UTF-16 surrogate: valid JSON ("\\ud83d") reads as one, but it is
    no text; no UTF-8 writer takes it (an engine's argument, a shard's tokenizer)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False
