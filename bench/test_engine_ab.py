"""bench/engine-ab.sh, the A/B of whole-engine builds: without a GPU, its refusal of malformed arguments
before it builds anything, and the builds it asks make for (the builds, checks and timings run on the
GPU machine)."""
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent / "engine-ab.sh"


def run(args, tmp_path, path="/usr/bin:/bin", **env):
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=60,
                          env={"OUT": str(tmp_path / "out"), "PATH": path, **env})


@pytest.mark.parametrize("args, env, message", [
    ([], {}, "error: no build to compare with the default"),
    (["-DX=1"], {}, "error: expected NAME=FLAGS"),
    (["default=-DX"], {}, "error: expected NAME=FLAGS"),
    (["x=-DA", "x=-DB"], {}, "error: build name 'x' given twice"),
    (["x=-DX=1; touch pwn"], {}, "error: FLAGS of 'x' must be -DMACRO"),
    (["x=-DX=1"], {"ROUNDS": "0"}, "error: ROUNDS must be"),
    (["x=-DX=1"], {"AB_STEPS": "10"}, "error: AB_STEPS must be"),
    (["x=-DX=1"], {"AB_STEPS": "60; rm"}, "error: AB_STEPS must be"),
])
def test_script_refuses_malformed_builds_before_building(tmp_path, args, env, message):
    res = run(args, tmp_path, **env)
    assert res.returncode == 2
    assert res.stderr.startswith(message), res.stderr
    assert not (tmp_path / "out").exists() and res.stdout == ""


def test_a_same_bits_other_than_0_or_1_is_refused_before_building(tmp_path):
    """SAME_BITS=yes would otherwise skip the bit tests silently (a stand-in make that records its
    calls: none may come)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "make").write_text(f"#!/bin/bash\ntouch {tmp_path}/made\nexit 1\n")
    (bin_dir / "make").chmod(0o755)
    res = run(["x=-DX=1"], tmp_path, path=f"{bin_dir}:/usr/bin:/bin", SAME_BITS="yes")
    assert res.returncode == 2 and res.stderr.startswith("error: SAME_BITS must be 0 or 1"), res.stderr
    assert not (tmp_path / "made").exists() and not (tmp_path / "out").exists()


def test_an_ab_shards_glob_that_matches_nothing_is_refused_before_building(tmp_path):
    """AB_SHARDS naming no file (a typo, or data/ not made on the GPU machine) was found out only by
    the timing runs, after every build and kernel_check (minutes of GPU time), each run failing on
    its own. It is refused before anything is built; a glob that matches goes on (to the stand-in
    make, which records its call and fails)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "make").write_text(f"#!/bin/bash\ntouch {tmp_path}/made\nexit 1\n")
    (bin_dir / "make").chmod(0o755)
    path = f"{bin_dir}:/usr/bin:/bin"
    res = run(["x=-DX=1"], tmp_path, path=path, AB_SHARDS=str(tmp_path / "none" / "megachat_train_*.bin"))
    assert res.returncode == 2 and res.stderr.startswith("error: AB_SHARDS matches no file"), res.stderr
    assert not (tmp_path / "made").exists() and not (tmp_path / "out").exists()
    (tmp_path / "megachat_train_000000.bin").write_bytes(b"")
    res = run(["x=-DX=1"], tmp_path, path=path, AB_SHARDS=str(tmp_path / "megachat_train_*.bin"))
    assert res.returncode == 1 and (tmp_path / "made").exists(), res.stdout + res.stderr


def test_each_build_reaches_make_with_its_flags(tmp_path):
    """A stand-in make records its arguments (one file per call: the builds run in parallel) and fails:
    nothing is timed, and the table says so."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "make").write_text(f'#!/bin/bash\nprintf "%s\\n" "$@" > {tmp_path}/make.$$\nexit 1\n')
    (bin_dir / "make").chmod(0o755)
    res = run(["cand=-DMY_CANDIDATE=1  -UX"], tmp_path, path=f"{bin_dir}:/usr/bin:/bin", SAME_BITS="1")
    assert res.returncode == 1, res.stdout + res.stderr
    calls = sorted(p.read_text().splitlines() for p in tmp_path.glob("make.*"))
    flags = {"default": "", "cand": "-DMY_CANDIDATE=1  -UX"}
    assert calls == [["-B", f"VARIANT_SUFFIX=_{b}", f"KERNEL_VARIANTS={flags[b]}", f"build/microgpt_cuda_{b}",
                      f"build/kernel_check_{b}"] for b in sorted(flags)]
    assert "kernel_check: default NOT BUILT, cand NOT BUILT" in (tmp_path / "out" / "summary.txt").read_text()
    assert not (tmp_path / "out" / "timing.json").exists()
