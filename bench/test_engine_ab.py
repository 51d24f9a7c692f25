"""bench/engine-ab.sh, the A/B of whole-engine builds: without a GPU, its refusal of malformed arguments
before it builds anything, and its flags reaching make as one variable (the builds, checks and
timings run on the GPU machine)."""
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent / "engine-ab.sh"


def run(args, tmp_path, path="/usr/bin:/bin"):
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=60,
                          env={"OUT": str(tmp_path / "out"), "PATH": path})


@pytest.mark.parametrize("args, message", [
    ([], "error: no variant given"),
    (["-DX=1"], "error: expected NAME=FLAGS"),
    (["default=-DX"], "error: expected NAME=FLAGS"),
    (["x=-DA", "x=-DB"], "error: build name 'x' given twice"),
    (["x=-DX=1; touch pwn"], "error: FLAGS of 'x' must be -DMACRO"),
])
def test_script_refuses_malformed_builds_before_building(tmp_path, args, message):
    res = run(args, tmp_path)
    assert res.returncode == 2
    assert res.stderr.startswith(message), res.stderr
    assert not (tmp_path / "out").exists() and res.stdout == ""


def test_variant_then_default_reach_make(tmp_path):
    """A stand-in make records its arguments and fails: the variant is built first and the default
    last (so build/microgpt_cuda ends as the default), and a failed default build stops the script."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "make").write_text(f'#!/bin/bash\nprintf "%s\\n" "$@" >> {tmp_path}/make.args\nexit 1\n')
    (bin_dir / "make").chmod(0o755)
    res = run(["side=-DSIDE_STREAM_WGRAD=1 -UX"], tmp_path, path=f"{bin_dir}:/usr/bin:/bin")
    assert res.returncode == 1, res.stderr
    made = [a for a in (tmp_path / "make.args").read_text().splitlines() if a.startswith("KERNEL_VARIANTS=")]
    assert made == ["KERNEL_VARIANTS=-DSIDE_STREAM_WGRAD=1 -UX", "KERNEL_VARIANTS="]
    assert "default build failed" in res.stdout
