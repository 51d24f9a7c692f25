"""Three compile-time candidates for ANDREA-12M's fp8 step (docs/BENCHMARKS.md #88–#90), each of
which must leave every bit as the default build's: the fused LayerNorm forward at a row a warp
where its blocks stay one wave (-DFP8_LN_FWD_WARPS=16), the delayed-scaling histories pushed by one
launch after the backward (-DFP8_HISTORY_PUSH_ONCE=1), and the LayerNorm backward's final sums on
the side stream behind the next weight gradient (-DLN_FINAL_SIDE=1). One build with all three (build/microgpt_cuda_fp8small,
build/kernel_check_fp8small) must pass kernel_check and give the default build's records,
checkpoints and histories byte for byte, in fp8 (both attention paths) and bf16, with gradient
accumulation, on models small enough to run the side stream, graphs and launch by launch alike.
GPU only (skipped without one); bench/engine-ab.sh times the switches one by one.
"""
import subprocess

import pytest

import engine_util as eu
from engine_util import run_ok, tiny_args
from test_fp8_delayed import GPU_HEADS, gpu_settings, sidecar_history
from test_gpu import OVERRIDE_ENGINE, build_variant, cuda_binary  # noqa: F401 (cuda_binary: a fixture)

SWITCHES = "-DFP8_LN_FWD_WARPS=16 -DFP8_HISTORY_PUSH_ONCE=1 -DLN_FINAL_SIDE=1"


@pytest.fixture(scope="module")
def small_build(cuda_binary):
    """build/microgpt_cuda_fp8small and build/kernel_check_fp8small, built with SWITCHES."""
    if OVERRIDE_ENGINE:
        pytest.skip("ANDREA_CUDA_ENGINE names one prebuilt engine; the candidates' build is made from source")
    engine, check = eu.BUILD / "microgpt_cuda_fp8small", eu.BUILD / "kernel_check_fp8small"
    build_variant("_fp8small", SWITCHES, engine, check)
    return engine, check


@pytest.mark.gpu
def test_gpu_fp8small_build_passes_kernel_check(small_build):
    """Every check of the build's kernel_check (the fused LayerNorm forward bit for bit against
    layernorm_fwd + fp8_cast, at 16 warps a block at ANDREA-12M's shape and the small ones, at 8 at
    ANDREA-120M's; the LayerNorm backward's final sums, run at once there without a side stream),
    and its banner names the LayerNorm switches."""
    res = subprocess.run([str(small_build[1])], capture_output=True, text=True, timeout=600)
    failed = [l for l in res.stdout.splitlines() if l.startswith("FAIL")]
    assert res.returncode == 0 and not failed, "\n".join(failed[:40]) + "\n" + res.stdout[-2000:] + res.stderr[-2000:]
    assert "checks, 0 failed" in res.stdout.splitlines()[-1]
    banner = res.stdout.splitlines()[0]
    assert "(FP8_LN_FWD_WARPS)" in banner and "(LN_FINAL_SIDE)" in banner, banner


RUNS = {"fp8_" + heads: gpu_settings(heads) for heads in sorted(GPU_HEADS)}
RUNS["bf16"] = {**gpu_settings("fallback"), "train.precision": "bf16"}


@pytest.mark.gpu
@pytest.mark.parametrize("run", sorted(RUNS))
@pytest.mark.parametrize("graphs", [True, False], ids=["graphs", "launch_by_launch"])
def test_gpu_fp8small_gives_the_default_builds_bits(run, graphs, small_build, cuda_binary, random_shards, tmp_path):
    """Records (losses, gradient norms, validation), checkpoint and histories of the candidates'
    build equal the default build's, byte for byte: two micro-batches a step (the second adds into
    the gradients the final sums wrote), validation between steps, on the side stream."""
    args = tiny_args(random_shards.train, random_shards.val, **{**RUNS[run], "train.steps": 8,
                                                                "train.grad_accum": 2, "eval.every": 4,
                                                                "eval.batches": 2})
    env = None if graphs else {"ANDREA_NO_GRAPH": "1"}
    got = {}
    for name, binary in (("default", cuda_binary), ("fp8small", small_build[0])):
        ckpt = tmp_path / f"{name}.ckpt"
        res = run_ok(binary, args + ["--checkpoint", ckpt], env=env)
        assert "backward: weight gradients on a side stream" in res.stderr, res.stderr[-2000:]
        hist = sidecar_history(ckpt) if RUNS[run]["train.precision"] == "fp8" else None
        got[name] = (eu.exact_records(res), ckpt.read_bytes(), hist)
    assert len([k for k in got["fp8small"][0] if k[0] == "train"]) == 8
    assert got["fp8small"][0] == got["default"][0], "the candidates' records differ from the default build's"
    assert got["fp8small"][1] == got["default"][1], "the candidates' checkpoint differs from the default build's"
    assert got["fp8small"][2] == got["default"][2], "the candidates' histories differ from the default build's"
