"""Where a kernel's warps wait, from Nsight Compute's per-instruction stall samples.

    python bench/stall_profile.py SOURCE.csv [more.csv ...] [--top N]

Input: the source page of one profiled launch, as CSV with the SASS:
    ncu --set full --import-source no -k regex:KERNEL -c 1 -o REPORT PROGRAM
    ncu -i REPORT.ncu-rep --page source --csv --print-source sass > SOURCE.csv
(`scripts/gpu-check.sh profile` does both for the flash-attention kernels of build/attn_bench.)

Prints, per file: the kernel, its samples, the share of each stall reason, the share at the
mbarrier waits of its bulk copies (each `SYNCS.PHASECHK...TRYWAIT`, the branch after it that
retries, and the out-of-line retry loop that branch jumps to), split into waits executed once a
warp (a block's first or last copies) and waits inside a loop, and the N instructions with the
most samples. docs/BENCHMARKS.md #182 came from this view: the dK/dV kernel's warps waited at
its copies for ~30 % of their samples.
"""
import argparse
import csv
import re
import sys
from collections import Counter

from microgpt.cli import ArgumentParser, fail

SAMPLES = "Warp Stall Sampling (All Samples)"
EXECUTED = "Instructions Executed"
BRANCH_TARGET = re.compile(r"\bBRA\b.*?(0x[0-9a-fA-F]+)")



class ProfileError(Exception):
    """A page this tool cannot read: main says it in one error line, exit 1."""

def count(text):
    """A count as ncu writes it ("" for none, maybe with thousands separators)."""
    return int(text.replace(",", "") or 0)


class Instruction:
    def __init__(self, rec, stall_columns):
        self.address = int(rec["Address"], 16)
        self.sass = rec["Source"].strip()
        self.samples = count(rec[SAMPLES])
        self.executed = count(rec[EXECUTED])
        self.stalls = {c[len("stall_"):]: count(rec[c]) for c in stall_columns}

    def branch_target(self):
        m = BRANCH_TARGET.search(self.sass)
        return int(m.group(1), 16) if m else None


def read_source_page(path):
    """(kernel name, [Instruction] in address order) of one exported source page."""
    try:
        with open(path, newline="") as f:
            lines = [ln for ln in f if ln.startswith('"')]  # skip ==PROF== and program output
    except (OSError, UnicodeDecodeError) as e:
        raise ProfileError(f"{path}: cannot read it: {e}")
    if len(lines) < 3 or not lines[0].startswith('"Kernel Name"'):
        raise ProfileError(f"{path}: not ncu's source page as CSV (--page source --csv --print-source sass)")
    kernel = next(csv.reader(lines[:1]))[1]
    reader = csv.DictReader(lines[1:])
    missing = {"Address", "Source", SAMPLES, EXECUTED} - set(reader.fieldnames)
    if missing:
        raise ProfileError(f"{path}: no column {sorted(missing)[0]!r}: profile with --set full")
    stall_columns = [c for c in reader.fieldnames if c.startswith("stall_") and "Not Issued" not in c]
    instructions = []
    for row, rec in enumerate(reader, 1):
        try:
            instructions.append(Instruction(rec, stall_columns))
        except (ValueError, TypeError, AttributeError) as e:  # a short row gives None, a bad one text
            raise ProfileError(f"{path}: instruction row {row} is not one of ncu's ({e})")
    return kernel, sorted(instructions, key=lambda i: i.address)


TRYWAIT_PREDICATE = re.compile(r"TRYWAIT\s+(P\d)\b")


def retry_branch(instructions, n):
    """Index of the branch that retries the TRYWAIT at n (`@!P BRA` on its predicate, which the
    compiler may schedule a few instructions later), or None."""
    m = TRYWAIT_PREDICATE.search(instructions[n].sass)
    if not m:
        return None
    for k in range(n + 1, min(n + 17, len(instructions))):
        sass = instructions[k].sass
        if sass.startswith(f"@!{m.group(1)}") and instructions[k].branch_target() is not None:
            return k
    return None


def copy_waits(instructions):
    """[(executed, samples, address)] for each inline mbarrier wait: its TRYWAIT, the branch that
    retries it and the out-of-line loop that branch jumps to (a TRYWAIT and its branch back)."""
    at = {ins.address: n for n, ins in enumerate(instructions)}
    waits = []
    for n, ins in enumerate(instructions):
        if "TRYWAIT" not in ins.sass or ins.executed == 0:  # out-of-line loops execute only on retries
            continue
        samples, where = ins.samples, ins.address
        k = retry_branch(instructions, n)
        if k is not None:
            samples += instructions[k].samples
            where = instructions[k].address
            target = at.get(instructions[k].branch_target())
            if target is not None and target > k and "TRYWAIT" in instructions[target].sass:
                samples += sum(i.samples for i in instructions[target:target + 2])
        waits.append((ins.executed, samples, where))
    return waits


def report(path, top):
    kernel, instructions = read_source_page(path)
    total = sum(i.samples for i in instructions)
    if total == 0:
        raise ProfileError(f"{path}: no stall samples (was the source page exported from a --set full report?)")
    base = instructions[0].address
    once = instructions[0].executed  # a kernel's first instruction runs once a warp
    pct = lambda x: f"{100.0 * x / total:.1f} %"
    print(f"{path}: {kernel}")
    reasons = Counter()
    for i in instructions:
        reasons.update(i.stalls)
    print(f"  {total} samples; stall reasons: "
          + ", ".join(f"{r} {pct(v)}" for r, v in reasons.most_common() if v * 100 >= total))
    waits = copy_waits(instructions)
    first = [w for w in waits if w[0] <= once]
    looped = [w for w in waits if w[0] > once]
    describe = lambda ws: ", ".join(f"{w[2] - base:#06x} {pct(w[1])}" for w in ws) or "none"
    print(f"  at the copies' mbarrier waits: {pct(sum(w[1] for w in waits))}; once a warp {pct(sum(w[1] for w in first))}"
          f" ({describe(first)}), in a loop {pct(sum(w[1] for w in looped))} ({describe(looped)})")
    print(f"  the {top} instructions with the most samples (offset, samples, executed, SASS, main reasons):")
    for i in sorted(instructions, key=lambda i: -i.samples)[:top]:
        main = ", ".join(f"{r} {v}" for r, v in sorted(i.stalls.items(), key=lambda rv: -rv[1])[:2] if v)
        print(f"    {i.address - base:#06x} {pct(i.samples):>7} {i.executed:>9}  {i.sass[:60]:60s} {main}")


def positive(text):
    n = int(text)
    if n < 1:
        raise argparse.ArgumentTypeError(f"{text} is not a positive number")
    return n


def main(argv=None):
    ap = ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("source_csv", nargs="+")
    ap.add_argument("--top", type=positive, default=12, help="instructions to list (default 12)")
    args = ap.parse_args(argv)
    for path in args.source_csv:
        try:
            report(path, args.top)
        except ProfileError as e:
            fail(str(e), 1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
