"""The timeline of a training step from bench/timeline.c's CSV: how long the step's kernels ran
on each stream, how much of them ran side by side, and where the GPU ran nothing at all.

    python3 bench/timeline.py kernels.csv [--steps 5] [--list step.txt]

A step is the stretch from the end of one AdamW launch (k_adamw, a step's last kernel) to the end
of the next; the summary is over the last --steps whole steps before the run's last one (the
warm-up and the final checkpoint's work left out). The main stream is the one with the most
records, every other one a side stream: in a replayed CUDA graph the driver runs the nodes on
streams of its own, so "side" says only that a record ran on another one than most. --list writes the last of those steps kernel by
kernel (start from the step's beginning, duration, stream, blocks, name) for reading. "by part" sums
the last step's exclusive times over the parts that docs/BENCHMARKS.md's "Where the time goes"
tables use (PARTS: the first rule a kernel's name matches)."""

import csv
import shutil
import statistics
import subprocess
import sys

from microgpt.cli import ArgumentParser, stdout_closed


def read_kernels(path):
    """bench/timeline.c's records, by start; ValueError names a line it cannot read."""
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    kernels = []
    for line, r in enumerate(rows, 2):
        try:
            kernels.append({"start": int(r["start_ns"]), "end": int(r["end_ns"]), "stream": int(r["stream"]),
                            "blocks": int(r["blocks"]), "name": r["name"]})
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"line {line} is not a record of bench/timeline.c") from None
        if kernels[-1]["end"] < kernels[-1]["start"]:
            raise ValueError(f"line {line} ends before it starts")
    kernels.sort(key=lambda k: k["start"])
    return kernels


def short_names(names):
    """Demangled names without their argument lists (c++filt where the machine has it)."""
    unique = sorted(set(names))
    if shutil.which("c++filt"):
        out = subprocess.run(["c++filt"], input="\n".join(unique), capture_output=True, text=True).stdout
        demangled = out.splitlines()
    else:
        demangled = unique
    table = {}
    for raw, full in zip(unique, demangled):
        name = full.split("(")[0]
        table[raw] = name[:90]
    return [table[n] for n in names]


# A step's parts, by the first substring of a kernel's name (lower case) that matches; "other" for none.
PARTS = [
    ("attention", ("k_attn_",)),
    ("layernorm", ("layernorm",)),
    ("loss_rows", ("k_loss_",)),
    ("adamw_norm", ("adamw", "grad_norm")),
    ("embedding", ("k_embed",)),
    ("gelu", ("k_gelu",)),
    ("fp8_casts", ("k_fp8_",)),
    ("products", ("nvjet", "xmma", "gemm", "cutlass", "splitkreduce")),
    ("memsets_copies", ("[memset", "[memcpy", "k_copy_words")),
]


def part_of(name):
    low = name.lower()
    for part, keys in PARTS:
        if any(k in low for k in keys):
            return part
    return "other"


def step_windows(kernels):
    ends = [k["end"] for k in kernels if "adamw" in k["name"]]
    return list(zip(ends, ends[1:]))


def union_length(intervals):
    total, cur_s, cur_e = 0, None, None
    for s, e in sorted(intervals):
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None:
        total += cur_e - cur_s
    return total


def overlap_with(intervals, others):
    """How long the intervals run while at least one of `others` runs."""
    merged = []
    for s, e in sorted(others):
        if merged and s <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], e)
        else:
            merged.append([s, e])
    total = 0
    for s, e in intervals:
        for ms, me in merged:
            if me <= s:
                continue
            if ms >= e:
                break
            total += min(e, me) - max(s, ms)
    return total


def exclusive_times(ks):
    """Each kernel's time (µs) after everything that started before it had ended: what it adds to
    the step. A kernel launched programmatically (PDL) starts while its predecessor still runs and
    waits inside, so its own duration overstates its cost."""
    out, horizon = [], None
    for k in ks:
        begin = k["start"] if horizon is None else max(k["start"], horizon)
        out.append(max(0, k["end"] - begin) / 1e3)
        horizon = k["end"] if horizon is None else max(horizon, k["end"])
    return out


def step_figures(kernels, t0, t1, main):
    ks = [k for k in kernels if k["start"] >= t0 and k["end"] <= t1]
    main_iv = [(k["start"], k["end"]) for k in ks if k["stream"] == main]
    side_iv = [(k["start"], k["end"]) for k in ks if k["stream"] != main]
    busy = union_length(main_iv + side_iv)
    main_busy = union_length(main_iv)
    return {
        "step_us": (t1 - t0) / 1e3,
        "kernels": len(ks),
        "main_kernels": len(main_iv),
        "side_kernels": len(side_iv),
        "main_sum_us": sum(e - s for s, e in main_iv) / 1e3,
        "side_sum_us": sum(e - s for s, e in side_iv) / 1e3,
        "main_busy_us": main_busy / 1e3,
        "side_hidden_us": overlap_with(side_iv, main_iv) / 1e3,
        "side_alone_us": (busy - main_busy) / 1e3,
        "idle_us": (t1 - t0 - busy) / 1e3,
    }


def main(argv):
    ap = ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("csv")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--list", help="write the last summarised step kernel by kernel to this file")
    args = ap.parse_args(argv)
    if args.steps < 1:
        ap.error("--steps must be at least 1")
    try:
        kernels = read_kernels(args.csv)
    except (OSError, ValueError) as e:
        print(f"error: {args.csv}: {e}", file=sys.stderr)
        return 1
    windows = step_windows(kernels)[:-1][-args.steps:]
    if not windows:
        print(f"error: {args.csv}: fewer than three k_adamw launches, no whole step to summarise", file=sys.stderr)
        return 1
    try:
        summarise(args, kernels, windows)
    except BrokenPipeError:
        return stdout_closed()
    return 0


def summarise(args, kernels, windows):
    streams = {}
    for k in kernels:
        streams[k["stream"]] = streams.get(k["stream"], 0) + 1
    main_stream = max(streams, key=streams.get)
    figs = [step_figures(kernels, t0, t1, main_stream) for t0, t1 in windows]
    print(f"{args.csv}: {len(windows)} steps, main stream {main_stream}; medians, µs a step:")
    for key in figs[0]:
        print(f"  {key:15s} {statistics.median(f[key] for f in figs):10.1f}")
    t0, t1 = windows[-1]
    last = [k for k in kernels if k["start"] >= t0 and k["end"] <= t1]
    names = short_names([k["name"] for k in last])
    exclusive = exclusive_times(last)
    per_name = {}
    for k, n, excl in zip(last, names, exclusive):
        per_name.setdefault((n, k["stream"] == main_stream), []).append(((k["end"] - k["start"]) / 1e3, excl))
    print("  by kernel (last step): count, sum µs, exclusive µs, stream")
    for (n, on_main), ds in sorted(per_name.items(), key=lambda kv: -sum(d[1] for d in kv[1])):
        print(f"    {len(ds):4d} {sum(d[0] for d in ds):9.1f} {sum(d[1] for d in ds):9.1f}  "
              f"{'main' if on_main else 'side'}  {n}")
    parts = {}
    for n, excl in zip(names, exclusive):
        part = part_of(n)
        total, count = parts.get(part, (0.0, 0))
        parts[part] = (total + excl, count + 1)
    print("  by part (last step): exclusive µs, launches")
    for part, (total, count) in sorted(parts.items(), key=lambda kv: -kv[1][0]):
        print(f"  part {part:16s} {total:9.1f} {count:5d}")
    if args.list:
        with open(args.list, "w") as f:
            f.write("start_us,dur_us,gap_us,stream,blocks,name\n")
            prev_end = {}
            for k, n in zip(last, names):
                gap = (k["start"] - prev_end.get(k["stream"], k["start"])) / 1e3
                prev_end[k["stream"]] = k["end"]
                f.write(f"{(k['start'] - t0) / 1e3:.2f},{(k['end'] - k['start']) / 1e3:.2f},{gap:.2f},"
                        f"{'main' if k['stream'] == main_stream else k['stream']},{k['blocks']},{n}\n")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
