"""Reading an engine's checkpoint (docs/DESIGN.md §3): the one Python reader, for the proxy, the
tests, the benchmark and the tools that evaluate or export a trained model.

    ckpt = read_checkpoint("runs/x/x.ckpt")        # arrays memory-mapped, nothing copied
    ckpt.step, ckpt.n_params, ckpt.params, ckpt.m, ckpt.v, ckpt.sidecar
    tensors = split_params(ckpt.params, layout)     # layout: `ENGINE --layout-json` (engines.py)
    tensors["h0.W_Q"].shape == (d_model, d_model)

The file is [int32 step][int32 n_params][n_params f32 weights][m][v], little-endian, nothing else;
the sidecar PATH.json holds what the engine needs beyond that (loss scale, fingerprint), the CRC-32C of
the file's bytes and that of its own values (sidecar_values_crc32c).
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


# The sidecar's values that nothing else checks, in the order of the canonical text its
# "values_crc32c" is taken of (docs/DESIGN.md §15; host/checkpoint.h: sidecar_value_names, the same).
SIDECAR_VALUE_NAMES = ("n_params", "loss_scale", "n_layer", "d_model", "n_head", "d_ff", "seq_len", "vocab_size",
                       "padded_vocab_size", "seed", "batch_size", "grad_accum", "steps", "precision",
                       "fp8_classifier")
SIDECAR_STRING_MAX = 31  # the bytes of a string value the engines read (a precision name)


def _crc32c_table():
    table = []
    for b in range(256):
        c = b
        for _ in range(8):
            c = (c >> 1) ^ (0x82F63B78 if c & 1 else 0)
        table.append(c)
    return table


CRC32C_TABLE = _crc32c_table()


def crc32c(data):
    """CRC-32C (Castagnoli), the checksum of a checkpoint's bytes and of its sidecar's values; written
    out bit by bit here, independently of the engines' slicing-by-8 code (host/crc32c.h)."""
    crc = 0xFFFFFFFF
    table = CRC32C_TABLE
    for byte in data:
        crc = table[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def _canonical_value(name, value):
    """The canonical text of one value (bytes), as host/checkpoint.h's sidecar_values_crc32c writes it
    from the sidecar's text."""
    if isinstance(value, bool) or value is None or isinstance(value, (dict, list)) or \
            (isinstance(value, str) and "\0" in value):  # the engines' string reader takes no U+0000
        return f"{name};".encode()  # no number and no string: missing to the engines' readers
    if isinstance(value, str):  # its first bytes of UTF-8, a lone surrogate's as the engines decode it
        return f'{name}="'.encode() + value.encode("utf-8", "surrogatepass")[:SIDECAR_STRING_MAX] + b'";'
    try:
        x = float(value) + 0.0  # -0.0 as 0, as json reads "-0": the int 0
    except OverflowError:  # an int past a double: the engines' strtod reads +-inf
        x = float("inf") if value > 0 else float("-inf")
    return f"{name}={x:.17g};".encode()  # as C's "%.17g": the same digits, "inf" and "nan" alike


def _sidecar_members(sidecar):
    """(name, value) of every member of the sidecar's objects, however deep: the engines look a name
    up anywhere in the sidecar's text (host/checkpoint.h: json_find_member). A stack, not recursion:
    json takes a sidecar nested deeper than a recursive walk would."""
    stack = [sidecar]
    while stack:
        node = stack.pop()
        items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
        for name, value in items:
            if isinstance(node, dict):
                yield name, value
            stack.append(value)


def sidecar_name_twice(sidecar):
    """A member name the sidecar (a dict) gives more than once, in any of its objects, or None. The
    engines refuse such a sidecar (each name once in the whole sidecar, docs/DESIGN.md §15): they
    would take one occurrence, a reader of the dict may take another."""
    seen = set()
    for name, _ in _sidecar_members(sidecar):
        if name in seen:
            return name
        seen.add(name)
    return None


def sidecar_values_crc32c(sidecar):
    """The "values_crc32c" of a sidecar (a dict): the CRC-32C of the canonical text of its values,
    each of SIDECAR_VALUE_NAMES wherever the sidecar holds it, as "NAME=%.17g;" for a number,
    'NAME="TEXT";' for a string, "NAME;" where missing or of another type (docs/DESIGN.md §15)."""
    values = {}
    for name, value in _sidecar_members(sidecar):
        values.setdefault(name, value)
    return crc32c(b"".join(_canonical_value(name, values.get(name)) for name in SIDECAR_VALUE_NAMES))


def sidecar_values_intact(sidecar):
    """Whether the sidecar's values agree with their own checksum: None where it has none (written
    before sidecars carried one), as the engines take it with a warning; False where a name is given
    twice (sidecar_name_twice), whose value is ambiguous."""
    if "values_crc32c" not in sidecar:
        return None
    return sidecar_name_twice(sidecar) is None and sidecar["values_crc32c"] == sidecar_values_crc32c(sidecar)


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
    if step < 0:
        raise CheckpointError(f"checkpoint {path}: its header's step is {step}, negative (a damaged header)")
    if n < 0 or size != HEADER_BYTES + 12 * n:
        raise CheckpointError(f"checkpoint {path}: {size} bytes, but its header (step {step}, "
                              f"{n} parameters) needs {HEADER_BYTES + 12 * max(n, 0)}")
    return step, n


def checkpoint_step(path):
    """The step of the checkpoint at path, or None if there is none."""
    if not os.path.lexists(path):
        return None
    return read_header(path)[0]


def whole_checkpoint_step(path):
    """checkpoint_step, or None where the file is no whole checkpoint either (truncated, say: the
    engine is the one to refuse it, with the way back to the previous slot)."""
    try:
        return checkpoint_step(path)
    except CheckpointError:
        return None


def sidecar_step(path):
    """The step the sidecar PATH.json names, or None where there is no readable sidecar."""
    side = read_sidecar(path)
    return side.get("step") if side is not None else None


class SidecarError(ValueError):
    """Why a checkpoint's sidecar could not be read, worded to follow its path: "is missing"."""


def load_sidecar(path):
    """The sidecar PATH.json as a dict; SidecarError saying why not where it is missing, no regular
    file, unreadable, longer than SIDECAR_READ_MAX or not a JSON object (one naming a key twice is
    none either)."""
    try:
        with os.fdopen(open_regular(f"{path}.json"), "rb") as f:
            text = f.read(SIDECAR_READ_MAX + 1)
    except FileNotFoundError:
        raise SidecarError("is missing") from None
    except NotRegularFile as e:
        raise SidecarError(f"is {e.strerror}") from None
    except OSError as e:
        raise SidecarError(f"cannot be read ({e.strerror or e})") from None
    if len(text) > SIDECAR_READ_MAX:
        raise SidecarError(f"is longer than the {SIDECAR_READ_MAX} bytes a sidecar can take") from None
    try:
        side = loads_json(text)
    except ValueError as e:
        raise SidecarError(f"is no JSON ({e})") from None
    if not isinstance(side, dict):
        raise SidecarError("is no JSON object")
    return side


def read_sidecar(path):
    """The sidecar PATH.json as a dict, or None where it is missing, no regular file, longer than
    SIDECAR_READ_MAX or not a JSON object (one naming a key twice is none either): load_sidecar's
    faults."""
    try:
        return load_sidecar(path)
    except SidecarError:
        return None


def read_checkpoint(path):
    """The whole checkpoint, its three vectors memory-mapped read-only."""
    step, n = read_header(path)
    body = np.memmap(path, dtype="<f4", mode="r", offset=HEADER_BYTES, shape=(3 * n,)) if n else \
        np.zeros(0, dtype="<f4")
    return Checkpoint(str(path), step, n, body[:n], body[n:2 * n], body[2 * n:], read_sidecar(path))


def read_params(path):
    """(step, weights) of a checkpoint, the weights read into memory, not mapped: a mapping reads the
    file only when its pages are touched, so a file rewritten in place before then (cp over it)
    would give another file's weights, in part, and one cut shorter a SIGBUS. CheckpointError where
    fewer weights than the header's count could be read (the file cut short meanwhile)."""
    step, n = read_header(path)
    try:
        with os.fdopen(open_regular(path), "rb") as f:
            f.seek(HEADER_BYTES)
            params = np.fromfile(f, dtype="<f4", count=n)
    except OSError as e:
        raise CheckpointError(f"cannot read checkpoint {path}: {e.strerror or e}") from None
    if len(params) != n:
        raise CheckpointError(f"checkpoint {path}: {len(params)} of its {n} weights could be read (cut short "
                              "while it was read?)")
    return step, params


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
