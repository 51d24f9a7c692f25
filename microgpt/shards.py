"""Token shards in the llm.c format (docs/DESIGN.md §7), the one place that reads and writes them.

Layout: 256 little-endian int32 header words [MAGIC, VERSION, ntok, 0, ...], then ntok uint16 tokens.
A valid file is exactly HEADER_BYTES + 2 * ntok bytes long.
"""
import glob
import os

import numpy as np

from microgpt.atomic import atomic_open
from microgpt.cli import one_line
from microgpt.files import open_regular

MAGIC = 20240520
VERSION = 1
HEADER_WORDS = 256
HEADER_BYTES = HEADER_WORDS * 4
MAX_TOKENS = 2**31 - 1  # the header's int32 count


class ShardError(ValueError):
    pass


def header_bytes(ntok):
    if ntok > MAX_TOKENS:
        raise ShardError(f"a shard holds at most {MAX_TOKENS} tokens (its header's int32 count), not {ntok}")
    header = np.zeros(HEADER_WORDS, dtype="<i4")
    header[:3] = (MAGIC, VERSION, ntok)
    return header.tobytes()


def shard_size(ntok):
    """The bytes of a valid shard of ntok tokens."""
    return HEADER_BYTES + 2 * ntok


def check_ids(path, tokens):
    """Integer ids in [0, 65535]: astype("<u2") would cut 1.7 to 1 and 65536 to 0 without a word."""
    if tokens.size and tokens.dtype.kind not in "iu":
        raise ShardError(f"{path}: token ids must be integers, not {tokens.dtype}")
    if tokens.size and (tokens.min() < 0 or tokens.max() >= 1 << 16):
        raise ShardError(f"{path}: token ids must lie in [0, 65535]")


def write_shard(path, tokens):
    """Write tokens (any int iterable/array, each < 65536) atomically: tmp file, fsync, rename."""
    tokens = np.asarray(tokens)
    check_ids(path, tokens)
    with atomic_open(path, "wb") as f:
        f.write(header_bytes(tokens.size))
        f.write(tokens.astype("<u2").tobytes())


class ShardStream:
    """A shard written as its tokens come, so no shard is ever held in memory: a placeholder header,
    the tokens appended, the real header written by close(). Not atomic by itself: the data pipeline
    builds whole shard sets in a folder of their own and swaps the set in (scripts/prep-megachat.py).
    `ShardStream(path, append=True)` extends a finished shard."""

    def __init__(self, path, append=False):
        self.path = path
        if append:
            self.ntok = read_header(path)
            self.f = open(path, "r+b")
            self.f.seek(0, os.SEEK_END)
        else:
            self.ntok = 0
            self.f = open(path, "wb")
            self.f.write(header_bytes(0))

    def write(self, tokens):
        tokens = np.asarray(tokens)
        if tokens.dtype != np.dtype("<u2"):  # uint16 tokens (the pipeline's) go out without a copy
            check_ids(self.path, tokens)
            tokens = tokens.astype("<u2")
        self.f.write(memoryview(np.ascontiguousarray(tokens)))
        self.ntok += tokens.size

    def close(self):
        """Write the header, flush and fsync; return the token count."""
        self.f.seek(0)
        self.f.write(header_bytes(self.ntok))
        self.f.flush()
        os.fsync(self.f.fileno())
        self.f.close()
        return self.ntok


def read_header(path):
    """The token count a shard's header promises, after checking magic, version and file size."""
    return read_checked(path, tokens=False)


def read_shard(path):
    """Return the tokens of a shard as a uint16 array; ShardError if the file is malformed."""
    return read_checked(path, tokens=True)


def read_checked(path, tokens):
    """The header's token count, or with tokens=True the tokens, read from one open of path: a FIFO
    or directory matched by a glob is refused by name (open_regular), as the engine does. A path
    that cannot be opened (a dangling link a glob matched, a link loop, no permission) is a
    ShardError too: the readers that catch ShardError alone ended in a traceback."""
    try:
        fd = open_regular(path)
    except OSError as e:  # NotRegularFile's strerror says what the file is
        raise ShardError(f"{path}: {e.strerror}") from None
    with open(fd, "rb") as f:
        size = os.fstat(fd).st_size
        if size < HEADER_BYTES:
            raise ShardError(f"{path}: {size} bytes is shorter than the {HEADER_BYTES}-byte header")
        header = np.frombuffer(f.read(HEADER_BYTES), dtype="<i4")
        if header[0] != MAGIC:
            raise ShardError(f"{path}: bad magic {header[0]} (expected {MAGIC})")
        if header[1] != VERSION:
            raise ShardError(f"{path}: unsupported version {header[1]} (expected {VERSION})")
        ntok = int(header[2])
        if size != shard_size(ntok):
            raise ShardError(f"{path}: file is {size} bytes, header promises {shard_size(ntok)}")
        if not tokens:
            return ntok
        ids = np.fromfile(f, dtype="<u2", count=ntok)
        if len(ids) != ntok:  # fromfile returns what is there: a shard cut while it was read
            raise ShardError(f"{path}: {len(ids)} of the header's {ntok} tokens could be read (the file "
                             "changed while it was read)")
        return ids


def glob_tokens(pattern):
    """Total tokens of the shards a glob matches, from their headers only (fast on any size)."""
    return sum(read_header(p) for p in sorted(glob.glob(pattern)))


# More passes than this over the same tokens and a small model starts to memorise its data rather
# than learn the language (seen on ANDREA-12M: 16 passes, held-out loss rising after step 16000).
MAX_PASSES = 4


def passes_warning(what, pattern, tokens_read):
    """A one-line warning when reading tokens_read tokens from the shards of `pattern` passes over
    them more than MAX_PASSES times, else None. Shards that are missing or malformed are left to
    the engine, which names them."""
    try:
        total = glob_tokens(pattern)
    except (OSError, ShardError):
        return None
    if total == 0 or tokens_read <= MAX_PASSES * total:
        return None
    # one_line: a glob is the user's text, and a newline in it would forge a line of its own
    return (f"warning: {what} reads {tokens_read / 1e6:.1f}M tokens from {one_line(pattern)}, which holds "
            f"{total / 1e6:.1f}M: {tokens_read / total:.1f} passes over the same data (more than "
            f"{MAX_PASSES} and a model memorises its data); add data or shorten the run")


def run_passes_warnings(cfg, resolve=os.path.abspath, defaults=None):
    """passes_warning for an experiment config's pretraining data (each source of data.sources) and,
    if it has one, its polish phase (docs/DESIGN.md §4 keys); a list of warning lines, empty when
    the run is fine. `resolve`
    turns a config's glob into the one to read (the proxy's are relative to the repository);
    `defaults` gives the engine's value of a dotted key the config leaves out."""
    defaults = defaults or {}

    def get(dotted):
        section, key = dotted.split(".")
        return cfg.get(section, {}).get(key, defaults.get(dotted))
    tokens_per_step = get("train.batch_size") * (get("train.grad_accum") or 1) * get("model.seq_len")
    steps, polish = get("train.steps"), cfg.get("polish")
    pretraining = polish["start_step"] if polish else steps
    sources = cfg.get("data", {}).get("sources")
    if sources:  # a mixture: each source reads its share of the steps, by its prior weight
        weights = [s.get("weight", defaults.get("data.sources.N.weight", 1.0)) for s in sources]
        phases = [(f'pretraining on data.sources[{i}] ("{s["name"]}", at its prior weight)', s["train"],
                   pretraining * w / sum(weights)) for i, (s, w) in enumerate(zip(sources, weights)) if w > 0]
    else:
        phases = [("pretraining", get("data.train"), pretraining)]
    if polish:
        phases.append(("the polish phase", polish["train"], steps - polish["start_step"]))
    lines = [passes_warning(what, resolve(pattern), n * tokens_per_step) for what, pattern, n in phases]
    return [line for line in lines if line]
