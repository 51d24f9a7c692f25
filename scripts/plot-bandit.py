#!/usr/bin/env python3
"""Draws the FIREHOSE bandit experiment (scripts/bandit-experiment.py) for docs/FIREHOSE-BANDIT.md:

    bandit-val-loss.{png,svg}        overall validation loss against step, one line per run
    bandit-val-by-source.{png,svg}   validation loss of each source, one panel per source
    bandit-mixture.{png,svg}         the bandit's probabilities over time, stacked

    python scripts/plot-bandit.py DIR [--svg]

DIR holds bandit-experiment.json; the figures go beside it. PNG through matplotlib where it is
installed, else (or with --svg) plain SVG written here, so the figures need nothing beyond Python.
"""
import math
import os
import sys

from microgpt.atomic import atomic_open
from microgpt.cli import IO_ERROR, ArgumentParser, fail
from microgpt.files import loads_json, open_regular
from microgpt.svg_chart import colour, svg_figure


def numbers(xs, missing_ok=False):
    """xs, if every one is a finite JSON number (or, where missing_ok, null or not finite: a loss that
    was no finite number, which the charts leave out); else ValueError: a garbled file must not reach
    the drawing, where it fails with a traceback or draws nonsense (Python's json reads NaN and
    Infinity, which the stack of p drew as "nan" coordinates)."""
    def ok(x):
        if x is None or isinstance(x, bool) or not isinstance(x, (int, float)):
            return missing_ok and x is None
        return missing_ok or math.isfinite(x)
    if not all(ok(x) for x in xs):
        raise ValueError("not numbers")
    return xs


def figures(doc):
    """What to draw, independent of the backend: [(file stem, title, panels)], a panel being
    (title, kind "lines"|"stack", [(label, xs, ys)])."""
    runs = doc["runs"]
    overall = [(run, numbers([v["step"] for v in r["val"]]), numbers([v["val_loss"] for v in r["val"]], True))
               for run, r in runs.items()]
    by_source = []
    for name in doc["sources"]:
        series = [(run, numbers([v["step"] for v in r["val"] if name in v["by_source"]]),
                   numbers([v["by_source"][name] for v in r["val"] if name in v["by_source"]], True))
                  for run, r in runs.items()]
        if any(xs for _, xs, _ in series):
            by_source.append((name, "lines", series))
    out = []  # a figure only where there is something to draw (runs with eval.every 0 have no evaluations)
    if any(xs for _, xs, _ in overall):
        out.append(("bandit-val-loss", "Validation loss (the mixed validation set)", [("val_loss", "lines", overall)]))
    if by_source:
        out.append(("bandit-val-by-source", "Validation loss per source", by_source))
    bandit = runs.get("bandit")
    if bandit and bandit["p"]:
        steps = numbers([e["step"] for e in bandit["p"]])
        if any(len(e["p"]) != len(bandit["sources"]) for e in bandit["p"]):
            raise ValueError("a p that is not one number per source")
        stack = [(name, steps, numbers([e["p"][i] for e in bandit["p"]])) for i, name in enumerate(bandit["sources"])]
        out.append(("bandit-mixture", "The bandit's source probabilities p", [("p", "stack", stack)]))
    return out


def plot_matplotlib(figs, out_dir):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    written = []
    for stem, title, panels in figs:
        cols = min(4, len(panels))
        rows = math.ceil(len(panels) / cols)
        fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols if cols > 1 else 9, 3.2 * rows if rows > 1 else 5),
                                 squeeze=False)
        for ax, (name, kind, series) in zip(axes.flat, panels):
            if kind == "stack":
                ax.stackplot(series[0][1], *[ys for _, _, ys in series], labels=[s[0] for s in series],
                             colors=[colour(i) for i in range(len(series))])
                ax.set_ylim(0, 1)
                ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=8)
            else:
                for i, (label, xs, ys) in enumerate(series):
                    ax.plot(xs, ys, label=label, color=colour(i))
                ax.set_yscale("log")
                ax.legend(fontsize=7)
            ax.set_title(name, fontsize=9)
            ax.set_xlabel("step")
        for ax in list(axes.flat)[len(panels):]:
            ax.axis("off")
        fig.suptitle(title)
        fig.tight_layout()
        path = os.path.join(out_dir, stem + ".png")
        with atomic_open(path) as f:
            fig.savefig(f, format="png", dpi=110)
        plt.close(fig)
        written.append(path)
    return written


def plot_svg(figs, out_dir):
    written = []
    for stem, title, panels in figs:
        path = os.path.join(out_dir, stem + ".svg")
        with atomic_open(path, "w") as f:  # a failed write (a full disk) leaves the figure that was there
            f.write(svg_figure(title, panels))
        written.append(path)
    return written


def main():
    ap = ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("dir", help="folder with bandit-experiment.json")
    ap.add_argument("--svg", action="store_true", help="SVG even where matplotlib is installed")
    args = ap.parse_args()
    path = os.path.join(args.dir, "bandit-experiment.json")
    try:
        with open(open_regular(path), encoding="utf-8") as f:
            figs = figures(loads_json(f.read()))
    except OSError as e:
        fail(f"cannot read {path}: {e.strerror or e} (scripts/bandit-experiment.py --out DIR writes it)")
    except (ValueError, KeyError, TypeError, AttributeError, IndexError):
        fail(f"{path} is not the results of scripts/bandit-experiment.py")
    if not figs:
        fail(f"{path} holds nothing to draw: no evaluations (--eval-every 0) and no bandit run")
    try:
        try:
            if args.svg:
                raise ImportError
            written = plot_matplotlib(figs, args.dir)
        except ImportError:
            written = plot_svg(figs, args.dir)
    except OSError as e:
        fail(f"cannot write a figure in {args.dir}: {e.strerror or e}", IO_ERROR)
    print("\n".join(f"wrote {p}" for p in written))
    return 0


if __name__ == "__main__":
    sys.exit(main())
