#!/usr/bin/env python3
"""fp8 against bf16 on real text: the quality runs of docs/ANDREA.md ("fp8 against bf16").

    python3 bench/fp8_quality.py run MODEL [--out DIR] [--steps 2000] [--engine build/microgpt_cuda]
                                           [--precision bf16|fp8] [--engine-arg=ARG ...]
    python3 bench/fp8_quality.py summary DIR... [--out DIR]
    python3 bench/fp8_quality.py markdown SUMMARY_JSON [--chart PATH]

run: trains MODEL (12M, 120M or a config path) with the CUDA engine twice, in bf16 and in fp8, from
the experiment's config with the same seed and data (data/megachat train and validation shards),
for --steps steps, validating every --eval-every steps on --eval-batches fixed batches. The
schedule is the shipped one compressed to the shorter run: warmup takes the same fraction of the
steps as in the config (ANDREA-12M 200 of 20000 -> 20 of 2000; ANDREA-120M 500 of 13000 -> 77),
then cosine to min_lr at the last step; no polish phase, no samples, no checkpoints. Each run's
engine records go to DIR/<model>-<precision>.jsonl (<model> the config's name, e.g. ANDREA-12M),
after a first line {"event": "environment", ...}: commit, date, GPU, driver of the run. The name
must be a plain file name (letters, digits, ._-), else the run is refused before it starts.
--precision runs one of the two: an fp8 candidate's run against the bf16 records of an earlier
invocation of the same commit's bf16 path (the summary joins the two folders). --engine-arg ARG
(repeatable) adds ARG to each run's engine command, after the config's flags: a runtime setting of a
candidate, e.g. --engine-arg=--train.fp8_classifier=logits (one word with `=`: argparse takes an ARG
that starts with -- for an option of its own).

summary: reads every such record file in the DIRs (the two models may come from two invocations)
and writes DIR/fp8-quality.json (per model: each precision's validation curve, final validation
loss and median ms/step; the relative difference (fp8 - bf16) / bf16 of the final validation
losses; pass when its magnitude is at most 1% and the two runs are a comparison: each scheduled for
--steps steps (the engine's start record), one model on batches of one size, validated at the
same steps) and DIR/fp8-quality.svg (the validation curves, one
panel per model), with the runs' environment (a field they disagree on, as a commit when fp8 ran
apart from bf16, gives each run's value, named by its run). Records that are not JSON objects or whose step is not an integer are left out, a
step time that is not a finite number is left out of the median, a validation loss that is not one
stays in the curve as null (the line leaves it out); a step recorded twice counts once; one file
name in two DIRs is refused (one DIR named twice counts once), as is a record file that is not a
regular file (a pipe would block the read); a file whose model is not printable text (bytes that
are no UTF-8, a line break) is no record and is passed over. Exit status 1 unless every model present passes, 2 on bad input.

markdown: the summary as the table and chart reference docs/ANDREA.md shows, names escaped; a
summary that `summary` would not write (a figure that is no finite number, steps no integer) is
refused.
"""
import json
import math
import os
import re
import statistics
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from bench import engine_command, parse_records      # bench/, this file's folder
from bench_common import (BenchError, experiment_path, load_config, repo_path, shard_paths,
                          train_settings)
from results import environment
from microgpt.atomic import atomic_open
from microgpt.cli import ArgumentParser
from microgpt.svg_chart import svg_figure

PRECISIONS = ("bf16", "fp8")
TOLERANCE = 0.01          # fp8's final validation loss within 1% of bf16's
TRAIN = "data/megachat/megachat_train_*.bin"
VAL = "data/megachat/megachat_val_*.bin"
SUMMARY = "fp8-quality.json"
CHART = "fp8-quality.svg"
MODEL_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")    # a record file's stem: never a path or markup


# -----------------------------------------------------------------------------
# the runs


def scaled_warmup(t, steps):
    """The config's warmup at the same fraction of a run of `steps` steps, at least 1."""
    return max(1, round(steps * t["warmup_steps"] / t["steps"]))


def run_overrides(cfg, args, precision):
    t = train_settings(cfg)
    return {"train.steps": args.steps, "train.warmup_steps": scaled_warmup(t, args.steps),
            "train.precision": precision, "data.train": args.data, "data.val": args.val,
            "eval.every": args.eval_every, "eval.batches": args.eval_batches}


def records_path(out, model, precision):
    return os.path.join(out, f"{model}-{precision}.jsonl")


def run(args):
    cfg = load_config(experiment_path(args.model))
    model = cfg.get("name", args.model)
    if not isinstance(model, str) or not MODEL_NAME.fullmatch(model):
        raise BenchError(f"the config's name {model!r} cannot name a record file "
                         "(letters, digits and ._- only, not first)")
    for pattern, what in ((args.data, "--data"), (args.val, "--val")):
        if not shard_paths(pattern):
            raise BenchError(f"no shards match {what} {pattern} (the quality runs need real text: make data)")
    os.makedirs(args.out, exist_ok=True)
    env = json.dumps({"event": "environment", **environment()})
    failed = []
    for precision in (args.precision,) if args.precision else PRECISIONS:
        cmd = engine_command(cfg, run_overrides(cfg, args, precision), repo_path(args.engine)) + args.engine_arg
        path = records_path(args.out, model, precision)
        print(f"{model} {precision}: {' '.join(cmd)}", flush=True)
        # the records replace the file when the run ends, even a failed one: they say how far it got
        with atomic_open(path, "w") as out, open(path + ".stderr", "w") as err:
            out.write(env + "\n")
            out.flush()
            try:
                rc = subprocess.run(cmd, stdout=out, stderr=err, cwd=REPO, timeout=args.timeout).returncode
                status = None if rc == 0 else f"exit status {rc}"
            except subprocess.TimeoutExpired:
                status = f"timed out after {args.timeout} s"
        if status:
            failed.append(f"{model} {precision}: engine {status} (see {path}.stderr)")
    for line in failed:
        print(f"error: {line}", file=sys.stderr)
    return 1 if failed else 0


# -----------------------------------------------------------------------------
# the summary


def finite(x):
    """x if it is a finite number, else None (the engine writes null for a NaN loss; a damaged file
    may hold anything)."""
    return x if isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) else None


def environment_fields(record):
    """The environment line's fields the summary carries: text, flags and nulls only, and none that
    would stand for the summary's own kind or source."""
    return {k: v for k, v in record.items()
            if k not in ("event", "kind", "source") and (v is None or isinstance(v, (str, bool)))}


def read_run(path):
    """One run's figures from its records: where it ran (the environment line), the precision its
    engine says it trained in (its start record), validation curve (a loss that is not finite as
    None), final validation loss (None if the run has none or it is not finite), median ms/step
    after 10 warm-up steps, steps done (distinct step numbers: a record repeated counts once).
    Records without an integer step are skipped. What the start record says of the run's schedule
    (train.steps) and shape (parameters, tokens a step) is kept for compare."""
    with open(path, errors="replace") as f:     # a damaged byte spoils its line only
        records = [r for r in parse_records(f.read()) if "step" not in r or type(r["step"]) is int]
    steps = [r for r in records if "step" in r and "loss" in r and "ms" in r]
    ms = [m for m in (finite(r["ms"]) for r in steps[10:]) if m is not None]
    val = [[r["step"], finite(r["val_loss"])] for r in records if "step" in r and "val_loss" in r]
    env = next((environment_fields(r) for r in records if r.get("event") == "environment"), {})
    start = next((r for r in records if r.get("event") == "start"), {})
    return {"environment": env, "precision": start.get("precision"), "steps": len({r["step"] for r in steps}),
            "scheduled_steps": start.get("steps"), "shape": [start.get("n_params"), start.get("tokens_per_step")],
            "val": val, "final_val_loss": val[-1][1] if val else None,
            "ms_per_step": statistics.median(ms) if ms else None}


def compare(runs, expected_steps):
    """PASS/FAIL of one model's two runs: each engine trained in the precision its file names and
    finished every step of a schedule of expected_steps, the two trained one model on batches of one
    size and validated at the same steps (they may come from two invocations: run --precision), and
    fp8's final validation loss is within TOLERANCE of bf16's (relative, either side)."""
    bf16, fp8 = runs.get("bf16"), runs.get("fp8")
    if bf16 is None or fp8 is None:
        return {"rel_diff": None, "pass": False, "why": "a run is missing"}
    wrong = [p for p, r in runs.items() if r["precision"] != p]
    if wrong:
        return {"rel_diff": None, "pass": False, "why": f"the {', '.join(wrong)} run's engine did not train in it"}
    short = [p for p, r in runs.items() if r["steps"] < expected_steps]
    if short:
        return {"rel_diff": None, "pass": False, "why": f"{', '.join(short)} stopped before step {expected_steps}"}
    for p, r in runs.items():
        if r["scheduled_steps"] != expected_steps:
            return {"rel_diff": None, "pass": False,
                    "why": f"the {p} run was scheduled for {r['scheduled_steps']} steps, not {expected_steps}"}
    if bf16["shape"] != fp8["shape"]:
        return {"rel_diff": None, "pass": False, "why": "the runs trained other models or batches"}
    if [s for s, _ in bf16["val"]] != [s for s, _ in fp8["val"]]:
        return {"rel_diff": None, "pass": False, "why": "the runs validated at other steps"}
    if bf16["final_val_loss"] is None or fp8["final_val_loss"] is None:
        return {"rel_diff": None, "pass": False, "why": "no finite final validation loss"}
    rel = (fp8["final_val_loss"] - bf16["final_val_loss"]) / bf16["final_val_loss"]
    ok = abs(rel) <= TOLERANCE
    return {"rel_diff": rel, "pass": ok,
            "why": f"|{100 * rel:+.2f}%| {'<=' if ok else '>'} {100 * TOLERANCE:g}%"}


def record_files(d):
    """(model, precision, path) of the record files in folder d: <model>-<precision>.jsonl, the model
    printable text (a name of bytes that are no UTF-8, or with a line break, is no record `run` wrote
    and could be neither printed nor drawn). One that is not a regular file (a folder, a pipe, a link
    to a device) is refused: reading it could block or never end."""
    for name in sorted(os.listdir(d)):
        stem, ext = os.path.splitext(name)
        model, _, precision = stem.rpartition("-")
        if ext == ".jsonl" and model and model.isprintable() and precision in PRECISIONS:
            path = os.path.join(d, name)
            if not os.path.isfile(path):
                raise BenchError(f"{path} is not a regular file")
            yield model, precision, path


def summarise(dirs, steps):
    """{model: {"runs": {precision: read_run}, compare's keys}} over every record file in dirs (a
    folder named twice, under any spelling, counts once)."""
    models, seen, folders = {}, {}, {}
    for d in dirs:
        folders.setdefault(os.path.realpath(d), d)
    for d in folders.values():
        for model, precision, path in record_files(d):
            name = os.path.basename(path)
            if name in seen:
                raise BenchError(f"{name} is in both {seen[name]} and {d}: which run counts?")
            seen[name] = d
            models.setdefault(model, {"runs": {}})["runs"][precision] = read_run(path)
    for m in models.values():
        m.update(compare(m["runs"], steps))
    return models


def chart(models, steps):
    """The SVG of the validation curves: one panel per model, bf16 and fp8 in each."""
    panels = [(f"{model}: validation loss", "lines",
               [(precision, [s for s, _ in r["val"]], [v for _, v in r["val"]]) for precision, r in m["runs"].items()])
              for model, m in sorted(models.items(), key=lambda kv: model_size(kv[0]))]
    return svg_figure(f"fp8 against bf16: validation loss over {steps} steps, same seed and data", panels)


def model_size(name):
    """'ANDREA-12M' -> 12e6, so panels and rows go small to large; other names after them."""
    size = name.rsplit("-", 1)[-1]
    try:
        return float(size[:-1]) * {"K": 1e3, "M": 1e6, "B": 1e9}[size[-1]]
    except (KeyError, ValueError, IndexError):
        return math.inf


def joined_environment(models):
    """The summary's environment: each field as the runs recorded it; where they differ (the runs come
    from several invocations: run --precision, or one model at a time), every value named by its
    runs, so that a candidate's fp8 result is not credited to the commit of the bf16 run beside it."""
    values = {}
    for model, m in sorted(models.items(), key=lambda kv: model_size(kv[0])):
        for precision, r in m["runs"].items():
            for key, value in r["environment"].items():
                values.setdefault(key, {}).setdefault(value, []).append(f"{model} {precision}")
    return {key: next(iter(runs)) if len(runs) == 1 else
            ", ".join(f"{value} ({', '.join(names)})" for value, names in runs.items())
            for key, runs in values.items()}


def summary(args):
    models = summarise(args.dirs, args.steps)
    if not models:
        raise BenchError(f"no <model>-<precision>.jsonl records in {', '.join(args.dirs)}")
    env = joined_environment(models)
    doc = {"kind": "fp8_quality", "source": "bench/fp8_quality.py", **env, "steps": args.steps,
           "tolerance": TOLERANCE, "chart": CHART, "pass": all(m["pass"] for m in models.values()),
           "models": models}
    os.makedirs(args.out, exist_ok=True)
    with atomic_open(os.path.join(args.out, SUMMARY), "w") as f:
        json.dump(doc, f, indent=1, allow_nan=False)    # strict JSON: read_run keeps no NaN
    with atomic_open(os.path.join(args.out, CHART), "w") as f:
        f.write(chart(models, args.steps))
    for model, m in sorted(models.items(), key=lambda kv: model_size(kv[0])):
        finals = "  ".join(f"{p} {fmt(r['final_val_loss'], '.4f')} ({fmt(r['ms_per_step'], '.2f')} ms/step)"
                           for p, r in m["runs"].items())
        print(f"{model}: {finals}  {'PASS' if m['pass'] else 'FAIL'} ({m['why']})")
    print(f"wrote {os.path.join(args.out, SUMMARY)} and {os.path.join(args.out, CHART)}")
    return 0 if doc["pass"] else 1


# -----------------------------------------------------------------------------
# the markdown docs/ANDREA.md shows


def fmt(x, spec):
    return "-" if x is None else format(x, spec)


def md_text(text):
    """Text as a markdown table cell shows it: markup characters backslash-escaped (a '|' would
    end the cell, a '<' open HTML), line breaks as spaces."""
    return re.sub(r"([\\`*_\[\]<>&|!#])", r"\\\1", " ".join(str(text).splitlines()))


def md_link(path):
    """A link destination: as it is, or in <...> where a space or parenthesis would end it."""
    if any(c in path for c in "<>\n"):
        raise BenchError(f"--chart {path!r}: a link cannot hold '<', '>' or a line break")
    return f"<{path}>" if any(c in path for c in " ()") else path


def run_days(date):
    """The day of the summary's date, cut before escaping (a cut escape escapes the ","); the days of
    the runs where they ran on several (joined_environment named each run's date)."""
    days = list(dict.fromkeys(re.findall(r"\d{4}-\d{2}-\d{2}", date)))
    return ", ".join(days) if len(days) > 1 else date[:10]


def summary_figure(x, what):
    """x of a summary read back: None or a finite number, else the summary is not one `summary` wrote."""
    if x is not None and finite(x) is None:
        raise BenchError(f"the summary's {what} is {x!r}, not a finite number (not one bench/fp8_quality.py wrote)")
    return x


def summary_model(model, m):
    """One model's entry of a summary read back, checked: its runs (dicts by precision), rel_diff and
    pass; what `summary` would not write is refused."""
    if (not isinstance(m, dict) or not isinstance(m.get("runs"), dict) or
            not all(isinstance(r, dict) for r in m["runs"].values()) or not isinstance(m.get("pass"), bool)):
        raise BenchError(f"the summary's model {model!r} is not one bench/fp8_quality.py wrote")
    for p, r in m["runs"].items():
        for key in ("final_val_loss", "ms_per_step"):
            summary_figure(r.get(key), f"{model} {p} {key}")
    summary_figure(m.get("rel_diff"), f"{model} rel_diff")
    return m


def markdown(doc, chart_path):
    if not isinstance(doc, dict) or doc.get("kind") != "fp8_quality" or not isinstance(doc.get("models"), dict):
        raise BenchError("not an fp8 quality summary (bench/fp8_quality.py summary writes one)")
    if type(doc.get("steps")) is not int:
        raise BenchError(f"the summary's steps is {doc.get('steps')!r}, not an integer")
    models = {model: summary_model(model, m) for model, m in doc["models"].items()}
    gpu, commit = (md_text(doc.get(k) or "") for k in ("gpu", "commit"))
    date = md_text(run_days(str(doc.get("date") or "")))
    lines = [f"{doc['steps']} steps each, same seed and data; {gpu or 'GPU unknown'}, "
             f"commit {commit or 'unknown'}, {date or 'date unknown'}.", "",
             "| model | bf16 final val loss | fp8 final val loss | fp8 vs bf16 | within 1% | bf16 ms/step | fp8 ms/step |",
             "|---|---|---|---|---|---|---|"]
    for model, m in sorted(models.items(), key=lambda kv: model_size(kv[0])):
        b, f = m["runs"].get("bf16", {}), m["runs"].get("fp8", {})
        rel = "-" if m.get("rel_diff") is None else f"{100 * m['rel_diff']:+.2f}%"
        lines.append(f"| {md_text(model)} | {fmt(b.get('final_val_loss'), '.4f')} | {fmt(f.get('final_val_loss'), '.4f')} "
                     f"| {rel} | {'yes' if m['pass'] else 'NO (' + md_text(m.get('why', '')) + ')'} "
                     f"| {fmt(b.get('ms_per_step'), '.2f')} | {fmt(f.get('ms_per_step'), '.2f')} |")
    lines += ["", f"![validation loss, bf16 and fp8]({md_link(chart_path)})", ""]
    return "\n".join(lines)


# -----------------------------------------------------------------------------


def parse_args(argv):
    p = ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="train one model in bf16 and fp8")
    r.add_argument("model", help="12M, 120M (experiments/ANDREA-<model>-TRAIN.json) or a config path")
    r.add_argument("--out", default="fp8-quality-out")
    r.add_argument("--steps", type=int, default=2000)
    r.add_argument("--eval-every", type=int, default=100)
    r.add_argument("--eval-batches", type=int, default=20)
    r.add_argument("--data", default=TRAIN, help=f"train shard glob (default {TRAIN})")
    r.add_argument("--val", default=VAL, help=f"validation shard glob (default {VAL})")
    r.add_argument("--engine", default="build/microgpt_cuda")
    r.add_argument("--timeout", type=int, default=600, help="seconds per run")
    r.add_argument("--precision", choices=PRECISIONS, help="run only this one (default: both)")
    r.add_argument("--engine-arg", action="append", default=[], metavar="ARG",
                   help="one more engine argument for every run, e.g. --engine-arg=--train.fp8_classifier=logits")
    s = sub.add_parser("summary", help="the summary JSON and the chart of the runs in DIRs")
    s.add_argument("dirs", nargs="+")
    s.add_argument("--out", help="where the summary and chart go (default: the first DIR)")
    s.add_argument("--steps", type=int, default=2000, help="the steps each run must have finished")
    m = sub.add_parser("markdown", help="the summary as docs/ANDREA.md's table and chart reference")
    m.add_argument("summary")
    m.add_argument("--chart", default="fp8-quality.svg", help="the chart's path as the markdown links it")
    args = p.parse_args(argv)
    if args.command == "run" and min(args.steps, args.eval_every, args.eval_batches, args.timeout) < 1:
        raise BenchError("--steps, --eval-every, --eval-batches and --timeout must be >= 1")
    if args.command == "run" and args.eval_every > args.steps:
        raise BenchError(f"--eval-every {args.eval_every} > --steps {args.steps}: the runs would have no validation "
                         "loss to compare")
    if args.command == "summary":
        if args.steps < 1:
            raise BenchError("--steps must be >= 1")
        args.out = args.out or args.dirs[0]
    return args


def main(argv):
    try:
        args = parse_args(argv)
        if args.command == "run":
            return run(args)
        if args.command == "summary":
            return summary(args)
        with open(args.summary) as f:
            print(markdown(json.load(f), args.chart), end="")
        return 0
    except (BenchError, OSError, ValueError, KeyError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
