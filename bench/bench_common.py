"""What the benchmark driver (bench.py) and the PyTorch baseline (torch_gpt.py) share: experiment
config loading, the engine's settings for a config, the learning-rate schedule, shard globs.

No torch here: bench.py imports this on machines where torch may be missing.
The settings come from the engine itself (`build/microgpt_cpu --print-config`), so the defaults
live only in microgpt/host/config.h; the schedule follows docs/DESIGN.md §13 and microgpt/host/schedule.h.
"""
import functools
import glob
import json
import math
import os
import subprocess
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


CONFIG_ENGINE = os.path.join(REPO, "build", "microgpt_cpu")


def config_flags(cfg, sections=("model", "train", "data", "eval")):
    """The config's keys as engine flags {dotted key: value} (DESIGN.md: flags are the config keys)."""
    flags = {"name": cfg.get("name", "bench")}
    for section in sections:
        for key, value in cfg.get(section, {}).items():
            flags[f"{section}.{key}"] = value
    return flags


def flag_args(flags):
    """{dotted key: value} -> ["--key", "value", ...] (floats by repr, so no digits are lost)."""
    args = []
    for key, value in flags.items():
        args += [f"--{key}", repr(value) if isinstance(value, float) else str(value)]
    return args


def run_config_engine(args):
    try:
        res = subprocess.run([CONFIG_ENGINE] + args, capture_output=True, text=True, timeout=60)
    except OSError as e:
        raise BenchError(f"cannot run {CONFIG_ENGINE} ({e.strerror}): build it with make")
    if res.returncode != 0:
        last = [line for line in res.stderr.splitlines() if line.strip()][-1:] or ["(no message)"]
        raise BenchError(f"config: {last[0].removeprefix('error: ')}")
    return json.loads(res.stdout)


@functools.lru_cache(maxsize=None)
def required_flags():
    """The flags the engine's table marks required (`--flags-json`)."""
    return frozenset(f["name"] for f in run_config_engine(["--flags-json"])["flags"] if f["required"] is True)


def engine_settings(cfg, section):
    """One section of the config as the engine resolves it, defaults applied ({"d_ff": 3072, ...};
    floats as the engine holds them); a required key of the section that the config lacks is an
    error, as it is for the engine."""
    missing = sorted(k for k in required_flags() if k.startswith(section + ".") and k not in config_flags(cfg))
    if missing:
        raise BenchError(f"config: {missing[0]} is required")
    resolved = run_config_engine(flag_args(config_flags(cfg)) + ["--print-config"])
    return {k.split(".", 1)[1]: v for k, v in resolved.items() if k.startswith(section + ".")}


def model_shape(cfg):
    """The model section as the engine resolves it; the baseline's model needs whole heads and an
    embedding with a row for every token."""
    m = engine_settings(cfg, "model")
    if m["d_model"] % m["n_head"]:
        raise BenchError(f"config: model.n_head {m['n_head']} does not divide model.d_model {m['d_model']}")
    if m["padded_vocab_size"] < m["vocab_size"]:
        raise BenchError("config: model.padded_vocab_size is smaller than model.vocab_size")
    return m


def train_settings(cfg):
    """The train section as the engine resolves it."""
    return engine_settings(cfg, "train")


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
