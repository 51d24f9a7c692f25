"""Token shards in the llm.c format (SPEC §7), the one place that reads and writes them.

Layout: 256 little-endian int32 header words [MAGIC, VERSION, ntok, 0, ...], then ntok uint16 tokens.
A valid file is exactly HEADER_BYTES + 2 * ntok bytes long.
"""
import os

import numpy as np

from microgpt.atomic import atomic_open

MAGIC = 20240520
VERSION = 1
HEADER_WORDS = 256
HEADER_BYTES = HEADER_WORDS * 4


class ShardError(ValueError):
    pass


def write_shard(path, tokens):
    """Write tokens (any int iterable/array, each < 65536) atomically: tmp file, fsync, rename."""
    tokens = np.asarray(tokens)
    if tokens.size and (tokens.min() < 0 or tokens.max() >= 1 << 16):
        raise ShardError(f"{path}: token ids must lie in [0, 65535]")
    header = np.zeros(HEADER_WORDS, dtype="<i4")
    header[:3] = (MAGIC, VERSION, tokens.size)
    with atomic_open(path, "wb") as f:
        f.write(header.tobytes())
        f.write(tokens.astype("<u2").tobytes())


def read_shard(path):
    """Return the tokens of a shard as a uint16 array; ShardError if the file is malformed."""
    size = os.path.getsize(path)
    if size < HEADER_BYTES:
        raise ShardError(f"{path}: {size} bytes is shorter than the {HEADER_BYTES}-byte header")
    header = np.fromfile(path, dtype="<i4", count=HEADER_WORDS)
    if header[0] != MAGIC:
        raise ShardError(f"{path}: bad magic {header[0]} (expected {MAGIC})")
    if header[1] != VERSION:
        raise ShardError(f"{path}: unsupported version {header[1]} (expected {VERSION})")
    ntok = int(header[2])
    if size != HEADER_BYTES + 2 * ntok:
        raise ShardError(f"{path}: file is {size} bytes, header promises {HEADER_BYTES + 2 * ntok}")
    return np.fromfile(path, dtype="<u2", offset=HEADER_BYTES)
