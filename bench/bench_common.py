"""What the benchmark driver (bench.py) and the PyTorch baseline (torch_gpt.py) share: experiment
config loading, the model shape with its defaults, the learning-rate schedule, shard globs.

No torch here: bench.py imports this on machines where torch may be missing.
The defaults and the schedule follow docs/DESIGN.md ("Flags are the config keys", "Steps, batches,
randomness"); when that file changes, change this one with it.
"""
import glob
import json
import math
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)


class BenchError(Exception):
    """A bad input the user can fix: printed as one `error:` line."""


def repo_path(path):
    """Relative paths in configs and on the command line resolve against the repository root (SPEC §4)."""
    return path if os.path.isabs(path) else os.path.join(REPO, path)


def experiment_path(model):
    """'12M' -> experiments/ANDREA-12M-TRAIN.json; a path ending in .json is taken as it is."""
    if model.endswith(".json"):
        return repo_path(model)
    return os.path.join(REPO, "experiments", f"ANDREA-{model}-TRAIN.json")


def load_config(path):
    try:
        with open(path) as f:
            cfg = json.load(f)
    except OSError as e:
        raise BenchError(f"cannot read config {path}: {e.strerror}")
    except json.JSONDecodeError as e:
        raise BenchError(f"config {path} is not valid JSON: {e}")
    for section in ("model", "train"):
        if not isinstance(cfg.get(section), dict):
            raise BenchError(f"config {path}: missing section '{section}'")
    return cfg


def model_shape(cfg):
    """The model section with DESIGN.md's defaults filled in."""
    m = dict(cfg["model"])
    for key in ("n_layer", "d_model", "n_head", "seq_len"):
        if key not in m:
            raise BenchError(f"config: model.{key} is required")
    m.setdefault("d_ff", 4 * m["d_model"])
    m.setdefault("vocab_size", 50259)
    m.setdefault("padded_vocab_size", (m["vocab_size"] + 63) // 64 * 64)
    if m["d_model"] % m["n_head"]:
        raise BenchError(f"config: model.n_head {m['n_head']} does not divide model.d_model {m['d_model']}")
    if m["padded_vocab_size"] < m["vocab_size"]:
        raise BenchError("config: model.padded_vocab_size is smaller than model.vocab_size")
    return m


def train_settings(cfg):
    """The train section with DESIGN.md's defaults filled in."""
    defaults = {"batch_size": 8, "grad_accum": 1, "seed": 1337, "warmup_steps": 0, "precision": "fp32",
                "lr": 6e-4, "min_lr": 0.0, "weight_decay": 0.1, "grad_clip": 1.0, "beta1": 0.9,
                "beta2": 0.95, "eps": 1e-8, "schedule": "cosine", "decay_frac": 0.2}
    t = dict(defaults)
    t.update(cfg["train"])
    return t


def lr_at(s, t):
    """Learning rate at step index s (0-based) for train settings t, as DESIGN.md defines it."""
    steps, warmup = t["steps"], t["warmup_steps"]
    lr, min_lr = t["lr"], t["min_lr"]
    if s < warmup:
        return lr * (s + 1) / warmup
    if t["schedule"] == "constant":
        return lr
    if t["schedule"] == "cosine":
        p = (s - warmup) / max(1, steps - warmup)
        return min_lr + 0.5 * (lr - min_lr) * (1.0 + math.cos(math.pi * p))
    if t["schedule"] == "wsd":  # as microgpt/host/schedule.h: the decay never starts inside warmup
        decay_start = max(warmup, int(steps * (1.0 - t["decay_frac"])))
        last = steps - 1
        if s < decay_start:
            return lr
        if last <= decay_start:
            return min_lr
        return lr + (min_lr - lr) * (s - decay_start) / (last - decay_start)
    raise BenchError(f"config: unknown train.schedule '{t['schedule']}'")


def shard_paths(pattern):
    """Sorted shard files matching a glob (relative to the repo root); [] when none match."""
    return sorted(glob.glob(repo_path(pattern)))
