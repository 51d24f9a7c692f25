"""torch port of the engines' counter-based random numbers (microgpt/host/rng.h) and of the two draws
the benchmark needs from them: the initial weights (microgpt/host/params.h) and the training and
validation windows (microgpt/host/data.h). With it the PyTorch baseline starts from the engine's
exact weights and sees the engine's exact batches, so the loss comparison measures the
implementations, not two different random draws. Change it together with those headers.

uint64 words are held in int64 tensors: addition and multiplication wrap to the same bits, and
right shifts are made logical by masking off the sign extension. Everything runs on the CPU (torch
uses all cores): 124M normals for ANDREA-120M take seconds, where numpy takes a minute.
"""
import bisect
import math

import torch

STREAM_INIT, STREAM_TRAIN, STREAM_VAL = 1, 2, 3


def _bits(c):
    """A uint64 constant as the int64 with the same bits."""
    return c - (1 << 64) if c >= 1 << 63 else c


_GOLDEN, _MUL1, _MUL2 = _bits(0x9E3779B97F4A7C15), _bits(0xBF58476D1CE4E5B9), _bits(0x94D049BB133111EB)


def _shr(x, k):
    """Logical right shift of int64-held uint64 words."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def _mix(x):
    """splitmix64's finaliser (rng.h rng_mix)."""
    x = x + _GOLDEN
    x = (x ^ _shr(x, 30)) * _MUL1
    x = (x ^ _shr(x, 27)) * _MUL2
    return x ^ _shr(x, 31)


def rng_u64(seed, stream, counters):
    """rng_mix(rng_mix(rng_mix(seed) ^ stream) ^ counter) for an int64 tensor of counters."""
    head = _mix(_mix(torch.tensor([seed], dtype=torch.int64)) ^ stream)
    return _mix(head ^ counters)


def rng_below(seed, stream, counters, n):
    """rng_u64 % n with the word read as unsigned: x = 2·(x >>> 1) + (x & 1)."""
    x = rng_u64(seed, stream, counters)
    return ((_shr(x, 1) % n) * 2 + (x & 1)) % n


def rng_normal(seed, stream, counters):
    """Box-Muller, cosine branch, one counter per value (rng.h rng_normal), float64."""
    h1 = rng_u64(seed, stream, counters)
    h2 = _mix(h1)
    u1 = (_shr(h1, 11) + 1).double() * 2.0 ** -53     # (0, 1]: the log is finite
    u2 = _shr(h2, 11).double() * 2.0 ** -53
    return torch.sqrt(-2.0 * torch.log(u1)) * torch.cos(2.0 * math.pi * u2)


def init_params(shapes, n_layer, seed):
    """The engine's initial flat parameter vector (float32). shapes: [(name, shape)] in docs/DESIGN.md §2 order
    with the engine's base names (wte, wpe, W_Q ... W_2, gamma, beta): N(0, 0.02) for 2-D tensors,
    0.02/sqrt(2 n_layer) for W_O and W_2, counter = flat index; LayerNorm gamma 1, beta 0."""
    parts, offset = [], 0
    proj_std = 0.02 / math.sqrt(2.0 * n_layer)
    for name, shape in shapes:
        n = math.prod(shape)
        base = name.rsplit(".", 1)[-1]
        if len(shape) == 2:
            std = proj_std if base in ("W_O", "W_2") else 0.02
            counters = torch.arange(offset, offset + n, dtype=torch.int64)
            parts.append((std * rng_normal(seed, STREAM_INIT, counters)).float())
        else:
            parts.append(torch.full((n,), 1.0 if base == "gamma" else 0.0))
        offset += n
    return torch.cat(parts)


def window_starts(first_window, seed, stream, counter0, B):
    """[(shard index, start token)] of the B windows drawn from counters counter0 .. counter0+B-1.
    first_window: prefix sums of the windows per shard, n_shards + 1 Python ints (data.h)."""
    counters = torch.arange(counter0, counter0 + B, dtype=torch.int64)
    starts = []
    for w in rng_below(seed, stream, counters, first_window[-1]).tolist():
        shard = bisect.bisect_right(first_window, w) - 1   # the last shard whose first window is <= w
        starts.append((shard, w - first_window[shard]))
    return starts
