"""Reading an engine's checkpoint (docs/DESIGN.md §3): the one Python reader, for the proxy, the
tests, the benchmark and the tools that evaluate or export a trained model.

    ckpt = read_checkpoint("runs/x/x.ckpt")        # arrays memory-mapped, nothing copied
    ckpt.step, ckpt.n_params, ckpt.params, ckpt.m, ckpt.v, ckpt.sidecar
    tensors = split_params(ckpt.params, layout)     # layout: `ENGINE --layout-json` (engines.py)
    tensors["h0.W_Q"].shape == (d_model, d_model)

The file is [int32 step][int32 n_params][n_params f32 weights][m][v], little-endian, nothing else;
the sidecar PATH.json holds what the engine needs beyond that (loss scale, fingerprint).
"""
import os
from dataclasses import dataclass

import numpy as np

from microgpt.atomic import atomic_open
from microgpt.files import NotRegularFile, loads_json, open_regular

HEADER_BYTES = 8
# The longest sidecar an engine reads (docs/DESIGN.md §15: 16 × its 64 KB writer buffer); a longer
# file is no sidecar of ours, and reading it whole could take all memory.
SIDECAR_READ_MAX = 16 * 65536


class CheckpointError(ValueError):
    """A checkpoint that cannot be read: the message names the file and what is wrong."""


@dataclass
class Checkpoint:
    path: str
    step: int
    n_params: int
    params: np.ndarray  # float32 [n_params], read-only views of the file
    m: np.ndarray       # AdamW first moment
    v: np.ndarray       # AdamW second moment
    sidecar: dict       # PATH.json, or None where it is missing or unreadable


def read_header(path):
    """(step, n_params) of a checkpoint; CheckpointError if it is not a whole checkpoint file."""
    try:
        with os.fdopen(open_regular(path), "rb") as f:
            head = f.read(HEADER_BYTES)
            size = os.fstat(f.fileno()).st_size
    except NotRegularFile as e:
        raise CheckpointError(f"checkpoint {path} is {e.strerror}") from None
    except OSError as e:
        raise CheckpointError(f"cannot read checkpoint {path}: {e.strerror or e}") from None
    if len(head) < HEADER_BYTES:
        raise CheckpointError(f"checkpoint {path} has {size} bytes, shorter than its header")
    step, n = (int(x) for x in np.frombuffer(head, dtype="<i4"))
    if n < 0 or step < 0 or size != HEADER_BYTES + 12 * n:
        raise CheckpointError(f"checkpoint {path}: {size} bytes, but its header (step {step}, "
                              f"{n} parameters) needs {HEADER_BYTES + 12 * max(n, 0)}")
    return step, n


def checkpoint_step(path):
    """The step of the checkpoint at path, or None if there is none."""
    if not os.path.lexists(path):
        return None
    return read_header(path)[0]


def read_sidecar(path):
    """The sidecar PATH.json as a dict, or None where it is missing, no regular file, longer than
    SIDECAR_READ_MAX or not a JSON object (one naming a key twice is none either)."""
    try:
        with os.fdopen(open_regular(f"{path}.json"), "rb") as f:
            text = f.read(SIDECAR_READ_MAX + 1)
        if len(text) > SIDECAR_READ_MAX:
            return None
        side = loads_json(text)
    except (OSError, ValueError):
        return None
    return side if isinstance(side, dict) else None


def read_checkpoint(path):
    """The whole checkpoint, its three vectors memory-mapped read-only."""
    step, n = read_header(path)
    body = np.memmap(path, dtype="<f4", mode="r", offset=HEADER_BYTES, shape=(3 * n,)) if n else \
        np.zeros(0, dtype="<f4")
    return Checkpoint(str(path), step, n, body[:n], body[n:2 * n], body[2 * n:], read_sidecar(path))


def write_checkpoint(path, step, params, m, v):
    """A checkpoint in the engine's format (for tests and tools that make one from other weights)."""
    params, m, v = (np.asarray(a, dtype="<f4").ravel() for a in (params, m, v))
    if not params.size == m.size == v.size:
        raise ValueError("params, m and v must have the same number of values")
    with atomic_open(path) as f:
        f.write(np.array([step, params.size], dtype="<i4").tobytes())
        for a in (params, m, v):
            f.write(a.tobytes())


def split_params(flat, layout):
    """A flat vector (weights, m, v or gradients) -> {name: view shaped as the layout says}.
    layout is `ENGINE --layout-json` as parsed JSON (engines.param_layout gives it)."""
    if len(flat) != layout["n_params"]:
        raise CheckpointError(f"{len(flat)} values, but the layout has {layout['n_params']}")
    return {t["name"]: flat[t["offset"]:t["offset"] + int(np.prod(t["shape"]))].reshape(t["shape"])
            for t in layout["tensors"]}
