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


def test_prebuilt_binaries_must_all_be_there_before_anything_runs(tmp_path):
    """AB_PREBUILT=1 builds nothing, so a build whose binaries are missing would be found out only as
    NOT BUILT after the others' minutes of checks and runs: it is refused first, as is a value other
    than 0 or 1 (a typo must not quietly rebuild everything on the GPU's time)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "make").write_text(f"#!/bin/bash\ntouch {tmp_path}/made\nexit 1\n")
    (bin_dir / "make").chmod(0o755)
    path = f"{bin_dir}:/usr/bin:/bin"
    res = run(["nosuchbuild=-DX=1"], tmp_path, path=path, AB_PREBUILT="1")
    assert res.returncode == 2, res.stdout + res.stderr
    assert res.stderr.startswith("error: AB_PREBUILT=1 but build/microgpt_cuda_") and "is not there" in res.stderr
    res = run(["x=-DX=1"], tmp_path, path=path, AB_PREBUILT="yes")
    assert res.returncode == 2 and res.stderr.startswith("error: AB_PREBUILT must be 0 or 1"), res.stderr
    assert not (tmp_path / "made").exists() and not (tmp_path / "out").exists()


def test_prebuilt_binaries_are_checked_and_timed_without_a_build(tmp_path):
    """With AB_PREBUILT=1 and every binary there (in a copy of the scripts beside stand-in binaries),
    make is never called and each build's own kernel_check runs; the stand-in engines fail, so the
    script fails."""
    root = tmp_path / "repo"
    for rel in ("bench/engine-ab.sh", "scripts/check-lib.sh"):
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text((SCRIPT.parent.parent / rel).read_text())
    (root / "build").mkdir()
    for b in ("default", "cand"):
        (root / "build" / f"kernel_check_{b}").write_text(f"#!/bin/bash\ntouch {tmp_path}/checked-{b}\necho ok\n")
        (root / "build" / f"microgpt_cuda_{b}").write_text("#!/bin/bash\nexit 1\n")
        for tool in ("kernel_check", "microgpt_cuda"):
            (root / "build" / f"{tool}_{b}").chmod(0o755)
    (root / "shard.bin").write_bytes(b"")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "make").write_text(f"#!/bin/bash\ntouch {tmp_path}/made\nexit 1\n")
    (bin_dir / "make").chmod(0o755)
    res = subprocess.run(["bash", str(root / "bench/engine-ab.sh"), "cand=-DX=1"], capture_output=True, text=True,
                         timeout=120, env={"OUT": str(tmp_path / "out"), "PATH": f"{bin_dir}:/usr/bin:/bin",
                                           "AB_PREBUILT": "1", "AB_SHARDS": "shard.bin", "AB_MODELS": "12M",
                                           "AB_PRECS": "bf16", "ROUNDS": "1"})
    assert res.returncode == 1, res.stdout + res.stderr
    assert not (tmp_path / "made").exists()
    assert (tmp_path / "checked-default").exists() and (tmp_path / "checked-cand").exists()
    assert "kernel_check: default ok, cand ok" in (tmp_path / "out" / "summary.txt").read_text()
