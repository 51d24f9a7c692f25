"""The step of models small enough to run the side stream (ANDREA-12M's case) against a baseline
build, byte for byte: ANDREA_CUDA_BASELINE names a second engine build (tests/test_gpu.py), e.g. one
of the commit before a change that must not move a bit (docs/BENCHMARKS.md #88–#90 were landed that
way). Records, checkpoints and delayed-scaling histories must be the baseline's in fp8 (both
attention paths) and bf16, with gradient accumulation (the second micro-batch adds into the
gradients the LayerNorm backward's final sums wrote on the side stream) and validation between
steps, graphs and launch by launch alike. GPU only; skipped without ANDREA_CUDA_BASELINE
(bench/engine-ab.sh's SAME_BITS=1 sets it for each variant against the default build).
"""
import pytest

import engine_util as eu
from engine_util import run_ok, tiny_args
from test_fp8_delayed import GPU_HEADS, gpu_settings, sidecar_history
from test_gpu import BASELINE_ENGINE, cuda_binary  # noqa: F401 (cuda_binary: a fixture)

RUNS = {"fp8_" + heads: gpu_settings(heads) for heads in sorted(GPU_HEADS)}
RUNS["bf16"] = {**gpu_settings("fallback"), "train.precision": "bf16"}


@pytest.mark.gpu
@pytest.mark.parametrize("run", sorted(RUNS))
@pytest.mark.parametrize("graphs", [True, False], ids=["graphs", "launch_by_launch"])
def test_gpu_small_step_gives_the_baseline_builds_bits(run, graphs, cuda_binary, random_shards, tmp_path):
    """Records (losses, gradient norms, validation), checkpoint and histories equal the baseline
    build's, byte for byte, on the side stream: two micro-batches a step, validation between steps."""
    if not BASELINE_ENGINE:
        pytest.skip("ANDREA_CUDA_BASELINE not set: no second build to compare with")
    args = tiny_args(random_shards.train, random_shards.val, **{**RUNS[run], "train.steps": 8,
                                                                "train.grad_accum": 2, "eval.every": 4,
                                                                "eval.batches": 2})
    env = None if graphs else {"ANDREA_NO_GRAPH": "1"}
    got = {}
    for name, binary in (("baseline", BASELINE_ENGINE), ("tested", cuda_binary)):
        ckpt = tmp_path / f"{name}.ckpt"
        res = run_ok(binary, args + ["--checkpoint", ckpt], env=env)
        # the side stream is what is under test; a baseline without one gives the same bits
        assert name == "baseline" or "backward: weight gradients on a side stream" in res.stderr, res.stderr[-2000:]
        hist = sidecar_history(ckpt) if RUNS[run]["train.precision"] == "fp8" else None
        got[name] = (eu.exact_records(res), ckpt.read_bytes(), hist)
    assert len([k for k in got["tested"][0] if k[0] == "train"]) == 8
    assert got["tested"][0] == got["baseline"][0], "records differ from the baseline build's"
    assert got["tested"][1] == got["baseline"][1], "checkpoint differs from the baseline build's"
    assert got["tested"][2] == got["baseline"][2], "histories differ from the baseline build's"
