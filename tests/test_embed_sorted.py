"""The compile-time candidate -DEMBED_SORTED_LISTS=1 (docs/BENCHMARKS.md #93): the token embedding's
backward from a stable sort of (token, position) pairs instead of each token's scan of the later
positions, which must leave every bit as the default build's. Its build (build/microgpt_cuda_embsort,
build/kernel_check_embsort) must pass kernel_check, whose `sorted=scan` lines compare its dwte with
the scanning kernel's bit for bit (one token everywhere over several segments, two tokens, a GPT-2
vocabulary), and give the default build's records and checkpoints byte for byte, in bf16 and fp8,
with gradient accumulation, graphs and launch by launch alike. GPU only (skipped without one);
bench/engine-ab.sh times it.
"""
import subprocess

import pytest

import engine_util as eu
from engine_util import run_ok, tiny_args
from test_fp8_delayed import gpu_settings
from test_gpu import OVERRIDE_ENGINE, build_variant, cuda_binary  # noqa: F401 (cuda_binary: a fixture)


@pytest.fixture(scope="module")
def sorted_build(cuda_binary):
    """build/microgpt_cuda_embsort and build/kernel_check_embsort, built with -DEMBED_SORTED_LISTS=1."""
    if OVERRIDE_ENGINE:
        pytest.skip("ANDREA_CUDA_ENGINE names one prebuilt engine; the candidate's build is made from source")
    engine, check = eu.BUILD / "microgpt_cuda_embsort", eu.BUILD / "kernel_check_embsort"
    build_variant("_embsort", "-DEMBED_SORTED_LISTS=1", engine, check)
    return engine, check


@pytest.mark.gpu
def test_gpu_sorted_lists_build_passes_kernel_check(sorted_build):
    """Every check of the build's kernel_check, its dwte equal to the scanning kernel's at every
    embedding shape and precision, and its banner names the switch."""
    res = subprocess.run([str(sorted_build[1])], capture_output=True, text=True, timeout=600)
    lines = res.stdout.splitlines()
    failed = [l for l in lines if l.startswith("FAIL")]
    assert res.returncode == 0 and not failed, "\n".join(failed[:40]) + "\n" + res.stdout[-2000:] + res.stderr[-2000:]
    assert "checks, 0 failed" in lines[-1]
    assert "(EMBED_SORTED_LISTS)" in lines[0], lines[0]
    same = [l for l in lines if " sorted=scan " in l]
    assert any("one token" in l for l in same) and any("V=50304" in l for l in same), "\n".join(same)


RUNS = {"bf16": {**gpu_settings("fallback"), "train.precision": "bf16"}, "fp8": gpu_settings("fallback")}


@pytest.mark.gpu
@pytest.mark.parametrize("run", sorted(RUNS))
@pytest.mark.parametrize("graphs", [True, False], ids=["graphs", "launch_by_launch"])
def test_gpu_sorted_lists_give_the_default_builds_bits(run, graphs, sorted_build, cuda_binary, random_shards,
                                                        tmp_path):
    """Records (losses, gradient norms, validation) and checkpoint of the candidate's build equal the
    default build's, byte for byte: two micro-batches a step (the second's embedding backward adds
    into the first's dwte), validation between steps."""
    args = tiny_args(random_shards.train, random_shards.val, **{**RUNS[run], "train.steps": 6,
                                                                "train.grad_accum": 2, "eval.every": 3,
                                                                "eval.batches": 2})
    env = None if graphs else {"ANDREA_NO_GRAPH": "1"}
    got = {}
    for name, binary in (("default", cuda_binary), ("embsort", sorted_build[0])):
        ckpt = tmp_path / f"{name}.ckpt"
        res = run_ok(binary, args + ["--checkpoint", ckpt], env=env)
        got[name] = (eu.exact_records(res), ckpt.read_bytes())
    assert len([k for k in got["embsort"][0] if k[0] == "train"]) == 6
    assert got["embsort"][0] == got["default"][0], "the candidate's records differ from the default build's"
    assert got["embsort"][1] == got["default"][1], "the candidate's checkpoint differs from the default build's"
