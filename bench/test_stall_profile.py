"""bench/stall_profile.py on a synthetic source page of Nsight Compute: the copies' mbarrier waits
(their retry branch scheduled a few instructions later, and the out-of-line retry loop it jumps to)
are found and split into once-a-warp and loop waits; the shares are of all samples."""
import os
import subprocess
import sys

import pytest

import stall_profile
from engine_util import python_env

HERE = os.path.dirname(os.path.abspath(__file__))
STALLS = ["stall_barrier", "stall_long_sb", "stall_wait"]
HEADER = ['"Address"', '"Source"', f'"{stall_profile.SAMPLES}"', '"Warp Stall Sampling (Not-issued Samples)"',
          f'"{stall_profile.EXECUTED}"'] + [f'"{c}"' for c in STALLS] + [f'"{c} (Not Issued)"' for c in STALLS]
BASE = 0x7F0000001000

# (offset, SASS, executed, {reason: samples}); 8 warps: the first instruction runs 8 times
KERNEL = [
    (0x000, "LDC R1, c[0x0][0x28]", 8, {"wait": 2}),
    (0x010, "SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR4], R0", 8, {"long_sb": 10}),  # a block's first copies
    (0x020, "IMAD.MOV.U32 R2, RZ, RZ, R3", 8, {}),
    (0x030, f"@!P0  BRA {BASE + 0x0f0:#x}", 8, {"long_sb": 20}),
    (0x040, "SYNCS.PHASECHK.TRANS64.TRYWAIT P1, [UR4+0x8], R5", 64, {"long_sb": 4}),  # in the loop
    (0x050, f"@!P1  BRA {BASE + 0x120:#x}", 64, {"long_sb": 6}),
    (0x060, "BAR.SYNC.DEFER_BLOCKING 0x0", 64, {"barrier": 30}),
    (0x070, "FFMA R4, R4, R5, R6", 64, {"wait": 18}),
    (0x080, f"@P2  BRA {BASE + 0x040:#x}", 64, {}),
    (0x090, "EXIT", 8, {}),
    (0x0f0, "SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR4], R0", 0, {"long_sb": 5}),  # retry loop of 0x010
    (0x100, f"@!P0  BRA {BASE + 0x0f0:#x}", 0, {"long_sb": 5}),
    (0x110, f"BRA {BASE + 0x040:#x}", 0, {}),
    (0x120, "SYNCS.PHASECHK.TRANS64.TRYWAIT P1, [UR4+0x8], R5", 0, {}),  # retry loop of 0x040
    (0x130, f"@!P1  BRA {BASE + 0x120:#x}", 0, {}),
]  # 100 samples in all


def source_page(rows, kernel="void k_demo<float>(float *)"):
    lines = ["==PROF== Connected to process 1 (build/attn_bench)", f'"Kernel Name","{kernel}",', ",".join(HEADER)]
    for offset, sass, executed, stalls in rows:
        samples = sum(stalls.values())
        values = [f"{BASE + offset:#x}", f"      {sass}", str(samples), str(samples), str(executed)]
        values += [str(stalls.get(c[len("stall_"):], 0)) for c in STALLS] + ["0"] * len(STALLS)
        lines.append(",".join(f'"{v}"' for v in values))
    return "\n".join(lines) + "\n"


@pytest.fixture
def page(tmp_path):
    path = tmp_path / "src.csv"
    path.write_text(source_page(KERNEL))
    return path


def test_copy_waits_take_the_retry_branch_and_its_out_of_line_loop(page):
    _, instructions = stall_profile.read_source_page(page)
    waits = stall_profile.copy_waits(instructions)
    # first copies: 10 + the branch's 20 (two instructions on) + the retry loop's 5 + 5; loop: 4 + 6
    assert [(executed, samples, address - BASE) for executed, samples, address in waits] == [(8, 40, 0x030),
                                                                                           (64, 10, 0x050)]


def test_report_gives_the_shares_of_all_samples(page, capsys):
    stall_profile.report(str(page), top=2)
    out = capsys.readouterr().out
    assert "void k_demo<float>(float *)" in out
    assert "100 samples; stall reasons: long_sb 50.0 %, barrier 30.0 %, wait 20.0 %" in out
    assert ("at the copies' mbarrier waits: 50.0 %; once a warp 40.0 % (0x0030 40.0 %), "
            "in a loop 10.0 % (0x0050 10.0 %)") in out
    listed = [ln for ln in out.splitlines() if ln.startswith("    0x")]
    assert len(listed) == 2 and listed[0].split()[:2] == ["0x0060", "30.0"] and "barrier 30" in listed[0]


def test_a_file_that_is_not_a_source_page_is_refused(tmp_path):
    path = tmp_path / "raw.csv"
    path.write_text('"ID","Kernel Name","Metric Name"\n"0","k","gpu__time_duration.sum"\n')
    with pytest.raises(stall_profile.ProfileError, match="not ncu's source page"):
        stall_profile.read_source_page(path)


@pytest.mark.parametrize("damage", ["missing", "text", "short"])
def test_a_damaged_or_missing_page_is_one_clear_error(page, damage):
    if damage == "missing":
        page.unlink()
        expected = "cannot read it"
    elif damage == "text":
        page.write_text(page.read_text().replace('"30","30","64"', '"x","30","64"'))
        expected = "instruction row 7 is not one of ncu's"
    else:
        page.write_text(page.read_text()[:-40])  # the last row cut short
        expected = f"instruction row {len(KERNEL)} is not one of ncu's"
    res = subprocess.run([sys.executable, os.path.join(HERE, "stall_profile.py"), str(page)], env=python_env(),
                         capture_output=True, text=True)
    assert res.returncode == 1 and res.stderr.startswith("error: ") and expected in res.stderr, res.stderr
    assert len(res.stderr.splitlines()) == 1, res.stderr


def test_top_must_be_positive(page):
    res = subprocess.run([sys.executable, os.path.join(HERE, "stall_profile.py"), str(page), "--top", "0"],
                         env=python_env(), capture_output=True, text=True)
    assert res.returncode == 2 and "not a positive number" in res.stderr


def test_a_page_without_samples_is_refused(tmp_path):
    path = tmp_path / "src.csv"
    path.write_text(source_page([(offset, sass, executed, {}) for offset, sass, executed, _ in KERNEL]))
    with pytest.raises(stall_profile.ProfileError, match="no stall samples"):
        stall_profile.report(str(path), top=3)


def test_command_line(page):
    res = subprocess.run([sys.executable, os.path.join(HERE, "stall_profile.py"), str(page), "--top", "1"],
                         env=python_env(), capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    assert "in a loop 10.0 %" in res.stdout
