"""The benchmarks' history as data: every run of bench.py and decode_bench.py appends one JSON line to
bench/results.jsonl, saying what was measured (commit, uncommitted changes, date, GPU, driver,
CUDA, torch) beside its figures. docs/BENCHMARKS.md describes the record's fields.

    python3 bench/results.py [--file FILE] [COMMIT_OR_DATE_PREFIX]
    python3 bench/results.py --history [--file FILE] [COMMIT_OR_DATE_PREFIX]

prints, as the markdown docs/BENCHMARKS.md shows, the last training and decoding record (or the
last of each whose commit or date starts with the prefix); with --history, one line for each
training record from the first that matches on: the headline figures of every run so far.

No torch here: the drivers import this where torch may be missing.
"""
import datetime
import json
import os
import re
import subprocess
import sys

from bench_common import REPO
from microgpt.atomic import atomic_open
from microgpt.cli import ArgumentParser, stdout_closed

RESULTS_FILE = os.path.join(REPO, "bench", "results.jsonl")


def command_output(cmd, timeout=10):
    """stdout of cmd, or None when it cannot run or fails (a machine without nvidia-smi or git)."""
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=REPO)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout if out.returncode == 0 else None


def smi_query(fields):
    """nvidia-smi's values of fields ("name,driver_version") for the GPU the runs use, or None."""
    device = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]
    out = command_output(["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader,nounits", "-i", device])
    return out.strip() if out else None


def source_state():
    """(commit, dirty) of the tree measured. ANDREA_COMMIT (and ANDREA_DIRTY, 0 or 1) when set: a tree
    copied to a GPU machine has no git metadata, or stale metadata. Else git's; None where unknown."""
    if os.environ.get("ANDREA_COMMIT"):
        dirty = os.environ.get("ANDREA_DIRTY")
        return os.environ["ANDREA_COMMIT"], None if dirty not in ("0", "1") else dirty == "1"
    commit = command_output(["git", "rev-parse", "--short", "HEAD"])
    if commit is None:
        return None, None
    status = command_output(["git", "status", "--porcelain", "--untracked-files=no"])
    return commit.strip(), None if status is None else bool(status.strip())


def first_match(pattern, text):
    m = re.search(pattern, text or "")
    return m.group(1) if m else None


def environment():
    """What a result depends on besides the code: GPU, driver, the driver's CUDA version, nvcc's."""
    gpu = smi_query("name,driver_version")
    name, driver = [f.strip() for f in gpu.split(",", 1)] if gpu and "," in gpu else (None, None)
    commit, dirty = source_state()
    return {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "commit": commit, "dirty": dirty, "gpu": name, "driver": driver,
            "cuda_driver": first_match(r"CUDA Version:\s*([\d.]+)", command_output(["nvidia-smi"])),
            "nvcc": first_match(r"release ([\d.]+)", command_output(["nvcc", "--version"]))}


def append_record(path, record):
    """Add record as one line at the end of the JSON-lines file at path (created if missing). The
    whole file is rewritten atomically, so a crash leaves the old file or the new one, never half a
    line."""
    try:
        with open(path, "rb") as f:
            old = f.read()
    except FileNotFoundError:
        old = b""
    if old and not old.endswith(b"\n"):
        old += b"\n"
    with atomic_open(path, "wb") as f:
        f.write(old + json.dumps(record, separators=(",", ":")).encode() + b"\n")


def read_records(path):
    """Every record of a results file, in order; a line that is not a JSON object is an error."""
    records = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n}: not JSON ({e})")
            if not isinstance(record, dict):
                raise ValueError(f"{path}:{n}: not a JSON object")
            records.append(record)
    return records


HISTORY_MODELS = ("12M", "120M")
HISTORY_COLUMNS = ["date", "commit", "bf16 matmul TFLOP/s"] + [
    f"{m} {c}" for m in HISTORY_MODELS for c in ("engine bf16", "engine fp8", "fastest PyTorch bf16")] + [
    "120M bf16 MFU"]


def history_row(record):
    """One training record's headline: ms/step of each model's engine bf16 and fp8 rows and of its
    fastest PyTorch bf16 run (mode in brackets), and ANDREA-120M bf16's MFU; "-" where not run."""
    finished = [r for r in record.get("runs", []) if r.get("ms_per_step")]

    def ms(run):
        return f"{run['ms_per_step']:.2f}" if run else "-"

    def engine(model, precision):
        return next((r for r in finished if (r.get("model"), r.get("side"), r.get("precision"))
                     == (model, "engine", precision)), None)

    commit = str(record.get("commit", "-"))
    if re.fullmatch(r"[0-9a-f]{40}", commit):  # ANDREA_COMMIT given in full: shown as git's short form
        commit = commit[:7]
    row = [str(record.get("date", "-"))[:16], commit,
           f"{record['matmul']['tflops']:.0f}" if (record.get("matmul") or {}).get("tflops") else "-"]
    for model in HISTORY_MODELS:
        torch = [r for r in finished if (r.get("model"), r.get("side"), r.get("precision")) == (model, "torch", "bf16")]
        fastest = min(torch, key=lambda r: r["ms_per_step"], default=None)
        row += [ms(engine(model, "bf16")), ms(engine(model, "fp8")),
                f"{ms(fastest)} ({fastest.get('mode')})" if fastest else "-"]
    mfu = (engine("120M", "bf16") or {}).get("mfu")
    return row + [f"{100 * mfu:.1f}%" if mfu else "-"]


def main(argv):
    p = ArgumentParser(description="show recorded benchmark runs as markdown")
    p.add_argument("prefix", nargs="?", default="", help="a commit or date prefix (default: the last runs)")
    p.add_argument("--file", default=RESULTS_FILE)
    p.add_argument("--history", action="store_true",
                   help="one line for each training run from the first that matches on")
    args = p.parse_args(argv)
    import bench          # here, not at the top: bench imports this module
    import decode_bench
    try:
        records = read_records(args.file)
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    def matches(r):
        return any(str(r.get(k)).startswith(args.prefix) for k in ("commit", "date"))

    if args.history:
        return show_history(records, matches, args)
    chosen = [r for r in records if matches(r)]
    shown = 0
    for kind, render in (("train", bench.markdown), ("decode", decode_bench.markdown)):
        last = [r for r in chosen if r.get("kind") == kind][-1:]
        for r in last:
            try:
                text = render(r)
            except (KeyError, TypeError, ValueError, AttributeError, IndexError) as e:   # a hand-edited line
                print(f"error: {args.file}: the chosen {kind} record cannot be shown ({type(e).__name__}: {e})",
                      file=sys.stderr)
                return 2
            try:
                print(text)
                if r.get("note"):
                    print(r["note"] + "\n")
                sys.stdout.flush()
            except BrokenPipeError:   # `results.py ... | head`: the reader has what it wanted
                return stdout_closed()
            shown += 1
    if not shown:
        print(f"error: no record in {args.file} matches '{args.prefix}'", file=sys.stderr)
        return 1
    return 0


def show_history(records, matches, args):
    train = [r for r in records if r.get("kind") == "train"]
    first = next((i for i, r in enumerate(train) if matches(r)), None)
    if first is None:
        print(f"error: no training record in {args.file} matches '{args.prefix}'", file=sys.stderr)
        return 1
    import bench
    try:
        rows = [history_row(r) for r in train[first:]]
    except (KeyError, TypeError, ValueError, AttributeError) as e:   # a hand-edited line
        print(f"error: {args.file}: a training record cannot be shown ({type(e).__name__}: {e})", file=sys.stderr)
        return 2
    try:
        print(bench.markdown_table(rows, HISTORY_COLUMNS), end="")
        sys.stdout.flush()
    except BrokenPipeError:
        return stdout_closed()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
