"""Sums Nsight Compute's per-kernel durations over one training step of the engine.

    python bench/kernel_profile.py profile-12M-bf16.csv [more.csv ...]

Input: `ncu --metrics gpu__time_duration.sum --csv` of an uncaptured engine run of one training step
(scripts/gpu-check.sh profile). The step is located from the end of the log: its update starts at the
last k_grad_norm_partial (with the upload k_copy_words right before it) and ends with the last
k_adamw; its micro-batch is everything from the last k_embed_fwd before that update (with the
micro-batch's two uploads before it, its loss download at its end). Prints, per file, the kernels of the step grouped by
name, with launch count, total microseconds and share of the step, biggest first.
"""
import csv
import sys
from collections import defaultdict

from microgpt.cli import ArgumentParser, fail



class ProfileError(Exception):
    """A profile this tool cannot read: main says it in one error line, exit 1."""

def kernel_rows(path):
    """(name, duration in ns) for every profiled kernel, in launch order."""
    with open(path, newline="") as f:
        lines = [ln for ln in f if ln.startswith('"')]  # skip ==PROF== and program output
    rows = []
    for rec in csv.DictReader(lines):
        if rec.get("Metric Name") == "gpu__time_duration.sum":
            rows.append((rec["Kernel Name"], float(rec["Metric Value"].replace(",", ""))))
    return rows


def last_index(rows, needle, before=None):
    end = len(rows) if before is None else before
    for i in range(end - 1, -1, -1):
        if needle in rows[i][0]:
            return i
    raise ProfileError(f"no kernel named *{needle}* in the profile: not an engine training step")


COPY = "k_copy_words"  # the graphs' uploads and downloads (microgpt/cuda/common.cuh's copy_words)


def step_slices(rows):
    adamw = last_index(rows, "k_adamw")
    update = last_index(rows, "k_grad_norm_partial", adamw)
    if update > 0 and COPY in rows[update - 1][0]:  # the update's upload (the micro-batch's download before it)
        update -= 1
    fb = last_index(rows, "k_embed_fwd", update)
    for _ in range(2):  # the micro-batch's two uploads (tokens, step inputs), not the update's download before them
        if fb > 0 and COPY in rows[fb - 1][0]:
            fb -= 1
    return rows[fb:update], rows[update:adamw + 1]


def report(path):
    fb, update = step_slices(kernel_rows(path))
    step = fb + update
    total = sum(d for _, d in step)
    groups = defaultdict(lambda: [0, 0.0])
    for name, d in step:
        groups[name][0] += 1
        groups[name][1] += d
    print(f"== {path}: {len(step)} kernels, {total / 1e3:.1f} us of kernel time per step "
          f"(micro-batch {sum(d for _, d in fb) / 1e3:.1f} us, update {sum(d for _, d in update) / 1e3:.1f} us)")
    for name, (n, d) in sorted(groups.items(), key=lambda kv: -kv[1][1]):
        print(f"{d / 1e3:10.1f} us {100 * d / total:5.1f} % {n:5d}x  {name[:110]}")


def main(argv):
    ap = ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("profile_csv", nargs="+", help="ncu's per-kernel durations of one training step, as CSV")
    for path in ap.parse_args(argv).profile_csv:
        try:
            report(path)
        except OSError as e:
            fail(f"{path}: cannot read it: {e.strerror or e}", 1)
        except ProfileError as e:
            fail(str(e), 1)


if __name__ == "__main__":
    main(sys.argv[1:])
