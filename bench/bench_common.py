"""What the benchmark driver (bench.py) and the PyTorch baseline (torch_gpt.py) share: experiment
config loading, the engine's settings and parameter layout for a config, the learning-rate schedule,
shard globs.

No torch here: bench.py imports this on machines where torch may be missing.
Configs are read and mapped to engine flags by microgpt/config.py (as the proxy does); the settings
and the layout come from the engine itself (`build/microgpt_cpu --print-config`, `--layout-json`), so
the defaults live only in microgpt/host/config.h and the layout only in microgpt/host/params.h; the
schedule follows docs/DESIGN.md §13 and microgpt/host/schedule.h.
"""
import functools
import glob
import math
import os

from microgpt import config, engines

# The checkout this bench/ belongs to (not wherever `pip install -e` last pointed the package): its
# engines, configs and results file are the ones measured and recorded.
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG_ENGINE = engines.ENGINES["cpu"]


class BenchError(Exception):
    """A bad input the user can fix: printed as one `error:` line."""


def repo_path(path):
    """Relative paths in configs and on the command line resolve against the repository root (docs/DESIGN.md §4)."""
    return path if os.path.isabs(path) else os.path.join(REPO, path)


def experiment_path(model):
    """'12M' -> experiments/ANDREA-12M-TRAIN.json; a path ending in .json is taken as it is."""
    if model.endswith(".json"):
        return repo_path(model)
    return os.path.join(REPO, "experiments", f"ANDREA-{model}-TRAIN.json")


def load_config(path):
    try:
        cfg = config.read_config(path)
    except config.ConfigError as e:
        raise BenchError(f"config {path}: {e}") from None
    if not isinstance(cfg, dict):
        raise BenchError(f"config {path}: not a JSON object")
    for section in ("model", "train"):
        if not isinstance(cfg.get(section), dict):
            raise BenchError(f"config {path}: missing section '{section}'")
    return cfg


def _ask_engine(ask, *args):
    try:
        return ask(CONFIG_ENGINE, *args)
    except engines.EngineChoiceError as e:
        raise BenchError(str(e)) from None
    except engines.EngineQueryError as e:
        raise BenchError(f"config: {e}") from None


@functools.lru_cache(maxsize=None)
def flag_table():
    """The engine's flags (`--flags-json`): {name: flag}."""
    return _ask_engine(engines.engine_flags)


def config_flags(cfg, sections=("model", "train", "data", "eval")):
    """The config's keys as engine flags {dotted key: value} (DESIGN.md: flags are the config keys)."""
    values = config.config_values({s: cfg[s] for s in sections if isinstance(cfg.get(s), dict)}, flag_table())
    return {"name": cfg.get("name", "bench"), **values}


def flag_args(flags):
    """{dotted key: value} -> ["--key", "value", ...], as the proxy passes them to the engine."""
    return config.flag_args(flags, flag_table())


def engine_settings(cfg, section):
    """One section of the config as the engine resolves it, defaults applied ({"d_ff": 3072, ...};
    floats as the engine holds them); a required key of the section that the config lacks is an
    error, as it is for the engine."""
    given = config_flags(cfg)
    missing = sorted(k for k, f in flag_table().items()
                     if f["required"] is True and k.startswith(section + ".") and k not in given)
    if missing:
        raise BenchError(f"config: {missing[0]} is required")
    resolved = _ask_engine(engines.resolved_settings, flag_args(given))
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


def param_shapes(shape):
    """[(name, shape)] of the flat parameter vector for a model_shape, as the engine lays it out."""
    layout = _ask_engine(engines.param_layout, flag_args({f"model.{k}": v for k, v in shape.items()}))
    return [(t["name"], tuple(t["shape"])) for t in layout["tensors"]]


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
