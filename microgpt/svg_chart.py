"""Line and stacked-area charts as plain SVG, for the scripts that draw figures for the docs
(scripts/plot-bandit.py, bench/fp8_quality.py): nothing beyond Python is needed to draw them.

A figure is a title and panels; a panel is (title, kind "lines"|"stack", [(label, xs, ys)]), laid
out up to three a row, each with its series' labels beside it.
"""
import html
import math
import re

COLOURS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
           "#bcbd22", "#17becf", "#393b79", "#637939", "#8c6d31", "#843c39", "#7b4173", "#3182bd"]


def colour(i):
    return COLOURS[i % len(COLOURS)]


# What XML 1.0 forbids even escaped: the C0 controls but tab and the line ends, U+FFFE and U+FFFF
# (a parser stops at them), and lone surrogates (a str read from JSON's "\ud800", which no UTF-8
# writer takes: the figure's file failed to be written)
XML_FORBIDDEN = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\ud800-\udfff\ufffe\uffff]")


def svg_text(s):
    """s as SVG text: markup escaped, and the characters XML 1.0 forbids even escaped dropped."""
    return html.escape(XML_FORBIDDEN.sub("", str(s)))


def is_finite(y):
    return y is not None and math.isfinite(y)


def axis_range(values, least_span):
    """(lo, hi) of values with hi > lo: a constant series gets a span of least_span, or more where
    its magnitude would swallow that in float arithmetic (lo + 1e-9 == lo at 2e7)."""
    lo, hi = min(values), max(values)
    return lo, hi if hi > lo else lo + max(least_span, abs(lo) * 1e-9)


def fraction(v, lo, hi):
    """Where v lies from lo (0) to hi (1), in halves: hi - lo of two finite values can be beyond a
    double's range (-1e308 and 1e308), and (v - lo) / inf drew the point at hi at "nan"."""
    return (v / 2 - lo / 2) / (hi / 2 - lo / 2)


def svg_panel(x0, y0, w, h, name, kind, series):
    """One panel as SVG elements: axes box, title, min/max labels, the series. A line leaves out
    its points whose x or y is None or not finite (a diverged run's losses)."""
    xs_all = [x for _, xs, _ in series for x in xs if is_finite(x)] or [0, 1]
    ys_all = [y for _, _, ys in series for y in ys if is_finite(y)] or [0, 1]
    lo_x, hi_x = axis_range(xs_all, 1)
    lo_y, hi_y = (0.0, 1.0) if kind == "stack" else axis_range(ys_all, 1e-9)

    def px(x):
        return x0 + fraction(x, lo_x, hi_x) * w

    def py(y):
        return y0 + h - fraction(y, lo_y, hi_y) * h

    parts = [f'<rect x="{x0}" y="{y0}" width="{w}" height="{h}" fill="none" stroke="#999"/>',
             f'<text x="{x0}" y="{y0 - 6}" font-size="12">{svg_text(name)}</text>',
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
            pts = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in zip(xs, ys) if is_finite(x) and is_finite(y))
            parts.append(f'<polyline fill="none" stroke="{colour(i)}" stroke-width="1.5" points="{pts}"/>')
        parts.append(f'<text x="{x0 + w + 6}" y="{y0 + 12 + 12 * i}" font-size="9" fill="{colour(i)}">'
                     f'{svg_text(label)}</text>')
    return parts


def svg_figure(title, panels):
    """The whole figure as one SVG document (text)."""
    cols = min(3, len(panels))
    rows = math.ceil(len(panels) / cols)
    pw, ph, gap_x, gap_y = 300, 170, 190, 60
    width, height = 60 + cols * (pw + gap_x), 60 + rows * (ph + gap_y)
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
             f'font-family="sans-serif"><rect width="100%" height="100%" fill="white"/>',
             f'<text x="20" y="24" font-size="15">{svg_text(title)}</text>']
    for k, (name, kind, series) in enumerate(panels):
        x0, y0 = 60 + (k % cols) * (pw + gap_x), 60 + (k // cols) * (ph + gap_y)
        parts += svg_panel(x0, y0, pw, ph, name, kind, series)
    parts.append("</svg>")
    return "\n".join(parts) + "\n"
