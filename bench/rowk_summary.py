"""The comparison table of bench/rowk_variants.sh: reads each variant's rowk_bench log
(build/rowk/<variant>/bench.log) and prints, per model and kernel, every variant's time and rate,
its change against the variant `base` (the default code), in % of a launch and in µs of a training
step, and whether its outputs are base's bits.

    python3 bench/rowk_summary.py build/rowk base ln_fwd1 ...
"""
import os
import sys


def parse_log(text):
    """{(model, kernel): (us, gb_per_s, bits, step_us)} from the `rowk` lines of one rowk_bench log."""
    rows = {}
    for line in text.splitlines():
        f = line.split()
        # rowk MODEL KERNEL VARIANT US us GBS GB/s bits HASH step STEP_US us
        if len(f) == 13 and f[0] == "rowk" and (f[5], f[7], f[8], f[10]) == ("us", "GB/s", "bits", "step"):
            rows[(f[1], f[2])] = (float(f[4]), float(f[6]), f[9], float(f[11]))
    return rows


def table(logs):
    """Markdown table of {variant: parsed log} (insertion order: columns; base first if present)."""
    names = list(logs)
    keys = []
    for rows in logs.values():
        keys += [k for k in rows if k not in keys]
    base = logs.get("base", {})
    out = ["| model | kernel | " + " | ".join(names) + " |", "|---|---|" + "---|" * len(names)]
    for key in keys:
        cells = []
        for name in names:
            if key not in logs[name]:
                cells.append("-")
                continue
            us, gbs, bits, step = logs[name][key]
            cell = f"{us:.1f} µs, {gbs / 1000:.2f} TB/s"
            if name != "base" and key in base:
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
    if len(argv) < 3:
        print("usage: rowk_summary.py OUT_DIR VARIANT...", file=sys.stderr)
        return 2
    logs = {}
    for name in argv[2:]:
        path = os.path.join(argv[1], name, "bench.log")
        if os.path.exists(path):
            with open(path) as f:
                logs[name] = parse_log(f.read())
    if not any(logs.values()):
        print(f"error: no rowk_bench results under {argv[1]} for {' '.join(argv[2:])}", file=sys.stderr)
        return 1
    print(table(logs))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
