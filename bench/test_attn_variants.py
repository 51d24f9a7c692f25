"""bench/attn-variants.sh, the A/B of flash-attention builds: without a GPU, its refusal of malformed
arguments before it builds anything (the builds, checks and timings run on the GPU machine)."""
import os
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent / "attn-variants.sh"


@pytest.mark.parametrize("args, message", [
    (["-DFA_X=1"], "error: expected NAME=FLAGS"),
    (["a b=-DX"], "error: expected NAME=FLAGS"),
    (["default=-DX"], "error: expected NAME=FLAGS"),
    (["x=-DA", "x=-DB"], "error: build name 'x' given twice"),
])
def test_script_refuses_malformed_builds_before_building(tmp_path, args, message):
    out = tmp_path / "out"
    res = subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=60,
                         env={"OUT": str(out), "PATH": "/usr/bin:/bin"})
    assert res.returncode == 2
    assert res.stderr.startswith(message), res.stderr
    assert not out.exists() and res.stdout == ""


@pytest.mark.parametrize("flags", ["-DX=1; touch {pwn}", "-DX=1\n; touch {pwn}", "$(shell touch {pwn})",
                                   "-DX=`touch {pwn}`", "-DX='a b'", "-DX=1 -o {pwn}", "-D*", "-UX=1"])
def test_flags_other_than_macro_words_never_reach_make(tmp_path, flags):
    pwn = tmp_path / "pwn"
    res = subprocess.run(["bash", str(SCRIPT), "x=" + flags.format(pwn=pwn)], capture_output=True, text=True,
                         timeout=60, env={"OUT": str(tmp_path / "out"), "PATH": "/usr/bin:/bin"})
    assert res.returncode == 2 and res.stderr.startswith("error: FLAGS of 'x' must be -DMACRO"), res.stderr
    assert not pwn.exists() and not (tmp_path / "out").exists()


def test_macro_words_reach_make_as_one_variable(tmp_path):
    """A stand-in make records its arguments and fails: every build is then NOT BUILT (exit 1)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "make").write_text(f'#!/bin/bash\nprintf "%s\\n" "$@" >> {tmp_path}/make.args\nexit 1\n')
    (bin_dir / "make").chmod(0o755)
    res = subprocess.run(["bash", str(SCRIPT), "two=-DFA_A=1  -UFA_B\t-DFA_C=v1.5+x"], capture_output=True,
                         text=True, timeout=60, env={"OUT": str(tmp_path / "out"), "PATH": f"{bin_dir}:/usr/bin:/bin"})
    assert res.returncode == 1, res.stderr
    made = (tmp_path / "make.args").read_text().splitlines()
    assert "KERNEL_VARIANTS=-DFA_A=1  -UFA_B\t-DFA_C=v1.5+x" in made and "KERNEL_VARIANTS=" in made
    assert "NOT BUILT" in (tmp_path / "out" / "summary.txt").read_text()


def test_a_failed_build_is_not_stood_in_for_by_an_earlier_runs_binaries(tmp_path):
    """Binaries of this name left by an earlier run (other flags) must not be checked and timed as
    this build: a stand-in make that fails leaves the build NOT BUILT, and the old binaries unrun."""
    build = SCRIPT.parent.parent / "build"
    build.mkdir(exist_ok=True)
    name = f"stale{os.getpid()}"
    stale = [build / f"kernel_check_{name}", build / f"attn_bench_{name}"]
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "make").write_text("#!/bin/bash\nexit 1\n")
    (bin_dir / "make").chmod(0o755)
    try:
        for b in stale:
            b.write_text(f"#!/bin/bash\ntouch {tmp_path}/ran\n")
            b.chmod(0o755)
        res = subprocess.run(["bash", str(SCRIPT), f"{name}=-DFA_A=1"], capture_output=True, text=True, timeout=60,
                             env={"OUT": str(tmp_path / "out"), "PATH": f"{bin_dir}:/usr/bin:/bin"})
    finally:
        for b in stale:
            b.unlink(missing_ok=True)
    assert res.returncode == 1, res.stderr
    assert not (tmp_path / "ran").exists()
    row = [l for l in (tmp_path / "out" / "summary.txt").read_text().splitlines() if l.startswith(name)]
    assert row and row[0].endswith("NOT BUILT"), row
