#!/usr/bin/env python3
"""Does the FIREHOSE bandit help? Three ANDREA-12M runs on the default data's per-source shards, at
equal steps and tokens, through the proxy as a user runs them (docs/FIREHOSE-BANDIT.md, "Experiment"):

    bandit          the adaptive mixture (the bandit section of the experiment), uniform prior
    static-uniform  every source equally often, no bandit
    static-natural  each source by its share of the training tokens, no bandit: the proportions of
                    the mixed set (data.val), i.e. the mixture the validation set itself follows

    python scripts/bandit-experiment.py --out DIR [--steps 6000] [--engine cuda] [--only SRC,SRC,...]

The sources are the folders data/megachat/sources/SRC/ that `make data` writes (SRC_train_*.bin,
SRC_val_*.bin); data.val is the mixed validation set. Model, optimiser and bandit settings and
data.val come from experiments/ANDREA-12M-BANDIT.json (--experiment; checked against the engine's
flags with those folders as its data.sources, which it may leave empty); sampling, the polish phase
and periodic checkpoints are left out (they cost time and measure nothing here). For each run
DIR/bandit-RUN.json holds the validation loss overall and per source at every evaluation, the
bandit's p after every probe step, the share of micro-batches each source really got per window of
steps, the median ms/step (a step's time includes its probes) and the training time (evaluations
included); DIR/bandit-experiment.json holds all three and the final comparison.
scripts/plot-bandit.py draws them.
"""
import glob
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from microgpt.atomic import atomic_open
from microgpt.cli import ArgumentParser, interrupted
from microgpt.config import ConfigError, read_config, validate_config
from microgpt.engines import ENGINES, ROOT, EngineChoiceError, engine_flags
from microgpt.files import unique_keys
from microgpt.shards import ShardError, glob_tokens

EXPERIMENT = os.path.join(ROOT, "experiments", "ANDREA-12M-BANDIT.json")
SOURCES_DIR = os.path.join(ROOT, "data", "megachat", "sources")
RUNS = ("bandit", "static-uniform", "static-natural")
SHARE_WINDOWS = 60  # windows of steps over which the realised source shares are counted


def discover_sources(sources_dir):
    """[{name, train, val}] for every SRC/ folder with train shards, sorted by name."""
    # absolute: the proxy resolves a relative glob against the repository, not the working folder,
    # so the runs would train on other shards (or none) than the ones found and counted here
    sources_dir = os.path.abspath(sources_dir)
    out = []
    for d in sorted(glob.glob(os.path.join(sources_dir, "*", ""))):
        name = os.path.basename(os.path.dirname(d))
        train, val = os.path.join(d, f"{name}_train_*.bin"), os.path.join(d, f"{name}_val_*.bin")
        if glob.glob(train):
            out.append({"name": name, "train": train, **({"val": val} if glob.glob(val) else {})})
    return out


def read_experiment(path, engine, sources, bandit_run=True):
    """The experiment's config, checked against the engine's flags as every run gets it: its data
    the discovered sources and its data.val, the validation set every run is measured on; with the
    bandit run, its bandit section (without one that run is static-uniform under another name, and
    the comparison compares a static mixture with itself). A section that is no object or a
    mistyped key is one error line, not a traceback."""
    try:
        flags = engine_flags(ENGINES[engine])
    except EngineChoiceError as e:
        sys.exit(f"error: {e}")
    try:
        base = read_config(path)
        data = base.get("data", {}) if isinstance(base, dict) else None
        if isinstance(data, dict):  # as run_configs makes it
            validate_config({**base, "data": {"sources": sources, **{k: v for k, v in data.items() if k == "val"}}},
                            flags)
        else:
            validate_config(base, flags)  # it names what is no object
        if "val" not in data:
            raise ConfigError('missing key "data.val" (the validation set every run is measured on)')
        if bandit_run and "bandit" not in base:
            raise ConfigError('missing key "bandit.every" (the bandit run\'s settings)')
    except ConfigError as e:
        sys.exit(f"error: config {path}: {e}")
    return base


def run_configs(base, sources, steps, eval_every):
    """The three configs: the same model, steps, tokens, seed and evaluation; only the mixture differs."""
    common = json.loads(json.dumps(base))
    common.pop("sample", None)
    common.pop("polish", None)  # the experiment is about the pretraining mixture
    common["train"]["steps"] = steps
    common["train"]["warmup_steps"] = min(common["train"].get("warmup_steps", 0), steps // 10)
    common["eval"] = {**common.get("eval", {}), "every": eval_every}
    common["checkpoint"] = {"every": 0}
    try:  # a damaged shard is one error line before any run, not a traceback
        tokens = [glob_tokens(s["train"]) for s in sources]
    except ShardError as e:
        sys.exit(f"error: {e}")
    empty = [s["name"] for s, t in zip(sources, tokens) if t == 0]
    if empty:  # no windows to train on (and static-natural's weights would divide by 0 if all were empty)
        sys.exit(f"error: the train shards of source {empty[0]} hold no tokens")
    weights = {"bandit": [1.0] * len(sources), "static-uniform": [1.0] * len(sources),
               "static-natural": [t / sum(tokens) for t in tokens]}
    configs = {}
    for run in RUNS:
        cfg = json.loads(json.dumps(common))
        cfg["name"] = f"bandit-experiment-{run}"
        cfg["data"] = {"sources": [{**s, "weight": w} for s, w in zip(sources, weights[run])],
                       "val": base["data"]["val"]}
        if run != "bandit":
            cfg.pop("bandit", None)
        configs[run] = cfg
    return configs, dict(zip((s["name"] for s in sources), tokens))


def train(cfg, work, engine):
    """Run one config through the proxy; return its live .loss.json records and the seconds it took."""
    path = os.path.join(work, cfg["name"] + ".json")
    with open(path, "w") as f:
        json.dump(cfg, f, indent=1)
    run_dir = os.path.join(work, "runs", cfg["name"])
    t0 = time.time()
    res = subprocess.run([sys.executable, os.path.join(ROOT, "microgpt", "training_proxy.py"), path,
                          "--engine", engine, "--no-server", "--run-dir", run_dir],
                         env={**os.environ, "PYTHONPATH": ROOT})
    if res.returncode != 0:
        sys.exit(f"error: the run {cfg['name']} failed (exit status {res.returncode}); see above")
    with open(os.path.join(run_dir, cfg["name"] + ".loss.json")) as f:
        records = [r for r in json.load(f, object_pairs_hook=unique_keys) if r.get("live", 1)]
    done = max((r["step"] for r in records if "loss" in r and "event" not in r), default=0)
    if done != cfg["train"]["steps"]:  # the proxy ends a run a signal stopped with exit status 0: compared
        # with runs that finished, its last evaluation would stand beside theirs as if at equal steps
        sys.exit(f"error: the run {cfg['name']} stopped at step {done} of {cfg['train']['steps']} (a signal "
                 "stopped it); the runs are compared only at equal steps")
    return records, time.time() - t0


def arm_shares(steps, n_sources, windows):
    """Per window of steps: the fraction of micro-batches drawn from each source."""
    size = max(1, len(steps) // windows)
    out = []
    for lo in range(0, len(steps), size):
        counts = [0] * n_sources
        for r in steps[lo:lo + size]:
            for a in (r["arm"] if isinstance(r["arm"], list) else [r["arm"]]):
                counts[a] += 1
        total = sum(counts)
        out.append({"step": steps[min(lo + size, len(steps)) - 1]["step"], "share": [c / total for c in counts]})
    return out


def summarise(run, cfg, records, seconds):
    steps = [r for r in records if "loss" in r and "event" not in r]
    vals = [r for r in records if "val_loss" in r]
    bandit = [r for r in records if r.get("event") == "bandit"]
    names = [s["name"] for s in cfg["data"]["sources"]]
    thin = max(1, len(bandit) // 600)
    return {"run": run, "sources": names, "prior": [s["weight"] for s in cfg["data"]["sources"]],
            "steps": len(steps), "tokens": steps[-1]["tokens"], "seconds": round(seconds, 1),
            "train_seconds": steps[-1].get("elapsed"),
            "ms_per_step_median": statistics.median(r["ms"] for r in steps[10:]) if len(steps) > 10 else None,
            "val": [{"step": r["step"], "val_loss": r["val_loss"], "by_source": r.get("val_loss_by_source", {})}
                    for r in vals],
            "p": [{"step": r["step"], "p": r["p"]} for r in bandit[::thin]] + (
                [{"step": bandit[-1]["step"], "p": bandit[-1]["p"]}] if bandit and (len(bandit) - 1) % thin else []),
            "arm_share": arm_shares(steps, len(names), SHARE_WINDOWS),
            "config": cfg}


def loss_text(loss, digits):
    """A loss for the summary; null where the engine wrote one (an evaluation that overflowed: no
    finite number), which no format code takes."""
    return "null" if loss is None else f"{loss:.{digits}f}"


def write_json(path, doc):
    try:
        with atomic_open(path, "w") as f:
            json.dump(doc, f, indent=1)
    except OSError as e:  # a full disk, a folder we may not write: one line (atomic_open left nothing behind)
        sys.exit(f"error: cannot write {path}: {e.strerror or e}")
    print(f"wrote {path}")


def main():
    ap = ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT"), help="folder for the JSON results (default $OUT)")
    ap.add_argument("--steps", type=int, default=6000, help="steps of every run (default 6000)")
    ap.add_argument("--eval-every", type=int, default=250, help="evaluate every N steps (default 250)")
    ap.add_argument("--engine", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--experiment", default=EXPERIMENT, help="model, optimiser and bandit settings")
    ap.add_argument("--sources-dir", default=SOURCES_DIR, help="per-source shard folders (default data/megachat/sources)")
    ap.add_argument("--runs", default=",".join(RUNS), help="which runs, comma-separated (default all three)")
    ap.add_argument("--only", help="these sources only, comma-separated (default every folder of --sources-dir)")
    args = ap.parse_args()
    if not args.out:
        ap.error("--out DIR (or $OUT) is required")
    if args.steps < 1 or args.eval_every < 0:  # refused before any run, as the proxy would refuse the first
        ap.error(f"--steps {args.steps}: at least 1" if args.steps < 1 else
                 f"--eval-every {args.eval_every}: at least 0")
    runs = args.runs.split(",")
    unknown = [run for run in runs if run not in RUNS]
    if unknown:  # refused before any run: found after the first, it would end hours of training in a traceback
        ap.error(f"--runs: no run called {unknown[0]!r}; the runs are {', '.join(RUNS)}")
    sources = discover_sources(args.sources_dir)
    if args.only:
        wanted = args.only.split(",")
        missing = sorted(set(wanted) - {s["name"] for s in sources})
        if missing:
            sys.exit(f"error: --only: no shards for {', '.join(missing)} in {args.sources_dir}")
        sources = [s for s in sources if s["name"] in wanted]
    if len(sources) < 2:
        sys.exit(f"error: {args.sources_dir} holds {len(sources)} source folder(s) with shards; the experiment needs "
                 "at least 2 (run `make data`)")
    base = read_experiment(args.experiment, args.engine, sources, "bandit" in runs)
    configs, tokens = run_configs(base, sources, args.steps, args.eval_every)
    try:  # before the first run, not after it
        os.makedirs(args.out, exist_ok=True)
    except OSError as e:
        sys.exit(f"error: --out {args.out}: {e.strerror or e}")
    print(f"{len(sources)} sources: " + ", ".join(f"{n} ({t:,} train tokens)" for n, t in tokens.items()))
    results = {}
    with tempfile.TemporaryDirectory(prefix="andrea-bandit-") as work:
        for run in runs:
            print(f"=== {run} ({time.strftime('%H:%M:%S', time.gmtime())} UTC)", flush=True)
            records, seconds = train(configs[run], work, args.engine)
            results[run] = summarise(run, configs[run], records, seconds)
            write_json(os.path.join(args.out, f"bandit-{run}.json"), results[run])
    final = {run: {"val_loss": r["val"][-1]["val_loss"], "by_source": r["val"][-1]["by_source"],
                   "steps": r["steps"], "tokens": r["tokens"], "ms_per_step_median": r["ms_per_step_median"],
                   "train_seconds": r["train_seconds"]}
             for run, r in results.items() if r["val"]}
    write_json(os.path.join(args.out, "bandit-experiment.json"),
               {"sources": [s["name"] for s in sources], "train_tokens": tokens, "steps": args.steps,
                "engine": args.engine, "final": final, "runs": results})
    for run, f in final.items():
        print(f"{run:15s} final val_loss {loss_text(f['val_loss'], 4)}  " +
              "  ".join(f"{k} {loss_text(v, 3)}" for k, v in f["by_source"].items()))
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:  # the running run has stopped (the proxy took the Ctrl-C too) and said so
        sys.exit(interrupted("bandit-experiment", "the runs that finished have their results in --out; "
                             "nothing was compared"))
