"""bench/pdl-ab.sh, the A/B of programmatic dependent launch: without a GPU, what it does before the
GPU work (its refusals, and the three builds it asks make for); the builds, checks and timings
themselves run on the GPU machine."""
import subprocess
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent / "pdl-ab.sh"


def stand_ins(tmp_path, compute_cap):
    """A bin directory with an nvidia-smi that reports `compute_cap` and a make that records its
    arguments (one file per call: the builds run in parallel) and fails."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "nvidia-smi").write_text(f"#!/bin/bash\necho {compute_cap}\n")
    (bin_dir / "make").write_text(f'#!/bin/bash\nprintf "%s\\n" "$@" > {tmp_path}/make.$$\nexit 1\n')
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    return {"OUT": str(tmp_path / "out"), "PATH": f"{bin_dir}:/usr/bin:/bin"}


def run(env):
    return subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, timeout=120, env=env)


def test_bad_rounds_are_refused_before_anything(tmp_path):
    env = stand_ins(tmp_path, "9.0")
    res = run({**env, "ROUNDS": "2x"})
    assert res.returncode == 2 and res.stderr.startswith("error: ROUNDS must be"), res.stderr
    assert not list(tmp_path.glob("make.*")) and not (tmp_path / "out").exists()


def test_a_gpu_below_hopper_is_refused_before_building(tmp_path):
    res = run(stand_ins(tmp_path, "8.9"))
    assert res.returncode == 1
    assert res.stderr.startswith("error: compute capability 89: programmatic dependent launch needs 9.0"), res.stderr
    assert not list(tmp_path.glob("make.*"))


def test_three_builds_with_their_flags_and_failed_builds_are_not_timed(tmp_path):
    res = run(stand_ins(tmp_path, "9.0"))
    assert res.returncode == 1, res.stdout + res.stderr
    calls = sorted(p.read_text().splitlines() for p in tmp_path.glob("make.*"))
    flags = {"default": "", "pdl": "-DUSE_PDL=1", "pdl_notrigger": "-DUSE_PDL=1 -DPDL_TRIGGER=0"}
    assert calls == [["-B", f"VARIANT_SUFFIX=_{b}", f"KERNEL_VARIANTS={flags[b]}", f"build/microgpt_cuda_{b}",
                      f"build/kernel_check_{b}"] for b in sorted(flags)]
    summary = (tmp_path / "out" / "summary.txt").read_text()
    assert "kernel_check: default NOT BUILT, pdl NOT BUILT, pdl_notrigger NOT BUILT" in summary
    assert not (tmp_path / "out" / "timing.json").exists()
