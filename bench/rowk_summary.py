"""Compares runs of bench/rowk_bench.cu (one log per build, e.g. one per commit): prints, per model
and kernel, every run's time and rate, its change against the first run (the base), in % of a
launch and in µs of a training step, and whether its outputs are the base's bits.

    python3 bench/rowk_summary.py before=before.log after=after.log ...
"""
import math
import re
import sys

from microgpt.cli import ArgumentParser

RUN_NAME = re.compile(r"[A-Za-z0-9._+-]+")    # a table column's heading: no '|' or markup


def parse_log(text):
    """{(model, kernel): (us, gb_per_s, bits, step_us)} from the `rowk` lines of one rowk_bench log;
    a line whose figures are not positive finite numbers (a damaged log) is left out."""
    rows = {}
    for line in text.splitlines():
        f = line.split()
        # rowk MODEL KERNEL US us GBS GB/s bits HASH step STEP_US us
        if len(f) == 12 and f[0] == "rowk" and (f[4], f[6], f[7], f[9]) == ("us", "GB/s", "bits", "step"):
            try:
                us, gbs, step = float(f[3]), float(f[5]), float(f[10])
            except ValueError:
                continue
            if 0 < us < math.inf and 0 <= gbs < math.inf and 0 <= step < math.inf:
                rows[(f[1], f[2])] = (us, gbs, f[8], step)
    return rows


def table(logs):
    """Markdown table of {run name: parsed log} (insertion order: columns; the first is the base)."""
    names = list(logs)
    keys = []
    for rows in logs.values():
        keys += [k for k in rows if k not in keys]
    base = logs[names[0]]
    out = ["| model | kernel | " + " | ".join(names) + " |", "|---|---|" + "---|" * len(names)]
    for key in keys:
        cells = []
        for name in names:
            if key not in logs[name]:
                cells.append("-")
                continue
            us, gbs, bits, step = logs[name][key]
            cell = f"{us:.1f} µs, {gbs / 1000:.2f} TB/s"
            if name != names[0] and key in base:
                b_us, _, b_bits, b_step = base[key]
                cell += f", {100.0 * (us - b_us) / b_us:+.1f}%"
                if step or b_step:
                    cell += f" ({step - b_step:+.0f} µs a step)"
                if bits != b_bits:
                    cell += ", other bits"
            cells.append(cell)
        out.append(f"| {key[0]} | {key[1]} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def main(argv):
    ap = ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", metavar="NAME=LOG", help="a rowk_bench log and its column's name; the first is the base")
    runs = [a.partition("=") for a in ap.parse_args(argv[1:]).runs]
    if len(runs) < 2 or any(not name or not path for name, _, path in runs):
        ap.error("give two or more NAME=LOG runs (the first is the base)")
    names = [name for name, _, _ in runs]
    bad = [n for n in names if not RUN_NAME.fullmatch(n)] + [n for i, n in enumerate(names) if n in names[:i]]
    if bad:
        print(f"error: run name '{bad[0]}' given twice or not of letters, digits and ._+-", file=sys.stderr)
        return 2
    logs = {}
    for name, _, path in runs:
        try:
            with open(path) as f:
                logs[name] = parse_log(f.read())
        except OSError as e:
            print(f"error: cannot read {path}: {e.strerror}", file=sys.stderr)
            return 1
        if not logs[name]:
            print(f"error: no rowk_bench results in {path}", file=sys.stderr)
            return 1
    print(table(logs))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
