#!/usr/bin/env python3
"""Draws the FIREHOSE bandit experiment (scripts/bandit-experiment.py) for docs/FIREHOSE-BANDIT.md:

    bandit-val-loss.{png,svg}        overall validation loss against step, one line per run
    bandit-val-by-source.{png,svg}   validation loss of each source, one panel per source
    bandit-mixture.{png,svg}         the bandit's probabilities over time, stacked

    python scripts/plot-bandit.py DIR [--svg]

DIR holds bandit-experiment.json; the figures go beside it. PNG through matplotlib where it is
installed, else (or with --svg) plain SVG written here, so the figures need nothing beyond Python.
"""
import argparse
import html
import json
import math
import os
import sys

COLOURS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
           "#bcbd22", "#17becf", "#393b79", "#637939", "#8c6d31", "#843c39", "#7b4173", "#3182bd"]


def colour(i):
    return COLOURS[i % len(COLOURS)]


def figures(doc):
    """What to draw, independent of the backend: [(file stem, title, panels)], a panel being
    (title, kind "lines"|"stack", [(label, xs, ys)])."""
    runs = doc["runs"]
    overall = [(run, [v["step"] for v in r["val"]], [v["val_loss"] for v in r["val"]]) for run, r in runs.items()]
    by_source = []
    for name in doc["sources"]:
        series = [(run, [v["step"] for v in r["val"] if name in v["by_source"]],
                   [v["by_source"][name] for v in r["val"] if name in v["by_source"]]) for run, r in runs.items()]
        if any(xs for _, xs, _ in series):
            by_source.append((name, "lines", series))
    out = [("bandit-val-loss", "Validation loss (the mixed validation set)", [("val_loss", "lines", overall)]),
           ("bandit-val-by-source", "Validation loss per source", by_source)]
    bandit = runs.get("bandit")
    if bandit and bandit["p"]:
        steps = [e["step"] for e in bandit["p"]]
        stack = [(name, steps, [e["p"][i] for e in bandit["p"]]) for i, name in enumerate(bandit["sources"])]
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
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written


def svg_panel(x0, y0, w, h, name, kind, series):
    """One panel as SVG elements: axes box, title, min/max labels, the series."""
    xs_all = [x for _, xs, _ in series for x in xs] or [0, 1]
    ys_all = [y for _, _, ys in series for y in ys if y is not None] or [0, 1]
    lo_x, hi_x = min(xs_all), max(xs_all) if max(xs_all) > min(xs_all) else min(xs_all) + 1
    lo_y, hi_y = (0.0, 1.0) if kind == "stack" else (min(ys_all), max(ys_all))
    if hi_y <= lo_y:
        hi_y = lo_y + 1e-9

    def px(x):
        return x0 + (x - lo_x) / (hi_x - lo_x) * w

    def py(y):
        return y0 + h - (y - lo_y) / (hi_y - lo_y) * h

    parts = [f'<rect x="{x0}" y="{y0}" width="{w}" height="{h}" fill="none" stroke="#999"/>',
             f'<text x="{x0}" y="{y0 - 6}" font-size="12">{html.escape(name)}</text>',
             f'<text x="{x0 - 4}" y="{y0 + 10}" font-size="9" text-anchor="end">{hi_y:.3g}</text>',
             f'<text x="{x0 - 4}" y="{y0 + h}" font-size="9" text-anchor="end">{lo_y:.3g}</text>',
             f'<text x="{x0 + w}" y="{y0 + h + 12}" font-size="9" text-anchor="end">step {hi_x:g}</text>']
    base = [0.0] * len(series[0][1]) if kind == "stack" and series else []
    for i, (label, xs, ys) in enumerate(series):
        if not xs:
            continue
        if kind == "stack":
            top = [b + y for b, y in zip(base, ys)]
            pts = [(px(x), py(t)) for x, t in zip(xs, top)] + [(px(x), py(b)) for x, b in reversed(list(zip(xs, base)))]
            parts.append(f'<polygon fill="{colour(i)}" points="' + " ".join(f"{a:.1f},{b:.1f}" for a, b in pts) + '"/>')
            base = top
        else:
            pts = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in zip(xs, ys))
            parts.append(f'<polyline fill="none" stroke="{colour(i)}" stroke-width="1.5" points="{pts}"/>')
        parts.append(f'<text x="{x0 + w + 6}" y="{y0 + 12 + 12 * i}" font-size="9" fill="{colour(i)}">'
                     f'{html.escape(label)}</text>')
    return parts


def plot_svg(figs, out_dir):
    written = []
    for stem, title, panels in figs:
        cols = min(3, len(panels))
        rows = math.ceil(len(panels) / cols)
        pw, ph, gap_x, gap_y = 300, 170, 190, 60
        width, height = 60 + cols * (pw + gap_x), 60 + rows * (ph + gap_y)
        parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
                 f'font-family="sans-serif"><rect width="100%" height="100%" fill="white"/>',
                 f'<text x="20" y="24" font-size="15">{html.escape(title)}</text>']
        for k, (name, kind, series) in enumerate(panels):
            x0, y0 = 60 + (k % cols) * (pw + gap_x), 60 + (k // cols) * (ph + gap_y)
            parts += svg_panel(x0, y0, pw, ph, name, kind, series)
        parts.append("</svg>")
        path = os.path.join(out_dir, stem + ".svg")
        with open(path, "w") as f:
            f.write("\n".join(parts) + "\n")
        written.append(path)
    return written


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("dir", help="folder with bandit-experiment.json")
    ap.add_argument("--svg", action="store_true", help="SVG even where matplotlib is installed")
    args = ap.parse_args()
    with open(os.path.join(args.dir, "bandit-experiment.json")) as f:
        figs = figures(json.load(f))
    try:
        if args.svg:
            raise ImportError
        written = plot_matplotlib(figs, args.dir)
    except ImportError:
        written = plot_svg(figs, args.dir)
    print("\n".join(f"wrote {p}" for p in written))
    return 0


if __name__ == "__main__":
    sys.exit(main())
