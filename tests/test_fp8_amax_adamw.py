"""The candidates -DFP8_AMAX_IN_ADAMW=1 and, with it, -DFP8_LAZY_LOWP_WEIGHTS=1 (docs/DESIGN.md §18):
precision fp8's update takes the fp8 weights' amax inside AdamW, from the new fp32 masters it holds,
instead of a separate amax launch before their cast; the second also leaves the fp8 weights' 16-bit
copy, which only generation reads in fp8 training, to be converted before generation. The cast reads
the same values at the same amax, and generation the same 16-bit values, so each build must give
the default build's bits: its fp8 training records (train, validation and sample records, the
samples generated after updates), checkpoint and delayed-scaling histories equal the default
build's byte for byte, with the layers' weights alone (the fallback attention and the fused one)
and with the FP8 classifier's wte among them; it resumes exactly after SIGTERM and its graphs give
the bits of launch by launch. Its kernel_check (which checks AdamW's amax against the standalone
amax in every build) passes. GPU only (skipped without one).
"""
import subprocess

import pytest

import engine_util as eu
from engine_util import run_ok, tiny_args
from test_fp8_delayed import sidecar_history
from test_gpu import FP8_SHAPES, OVERRIDE_ENGINE, build_variant, cuda_binary  # noqa: F401 (a fixture)

# suffix: the -D macros set to 1 (the last one named in kernel_check's banner)
VARIANTS = {"_adamamax": ["FP8_AMAX_IN_ADAMW"], "_lazy": ["FP8_AMAX_IN_ADAMW", "FP8_LAZY_LOWP_WEIGHTS"]}

# the weights' list as the engine has it: 3 layers with the fallback attention (head size 16, d_ff
# 112) or the fused one (head size 32); one layer of d_model 512, whose FP8 classifier puts wte
# (the parameters' first tensor) in the list too
MODELS = {"fallback": FP8_SHAPES["odd"],
          "fused_attention": {**FP8_SHAPES["odd"], "model.d_model": 64, "model.n_head": 2},
          "fp8_classifier": {"model.n_layer": 1, "model.d_model": 512, "model.n_head": 8, "model.d_ff": 512,
                             "model.seq_len": 48, "model.vocab_size": 100, "model.padded_vocab_size": 128,
                             "train.batch_size": 3}}


def run_settings(model, steps):
    return {**MODELS[model], "train.precision": "fp8", "train.lr": 3e-3, "train.warmup_steps": 2,
            "train.steps": steps, "train.grad_accum": 2, "eval.every": 4, "eval.batches": 2}


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def amax_build(request, cuda_binary):
    """build/microgpt_cuda<suffix> and build/kernel_check<suffix>, built with the variant's macros,
    and the macros."""
    suffix, macros = request.param, VARIANTS[request.param]
    if OVERRIDE_ENGINE:
        pytest.skip(f"ANDREA_CUDA_ENGINE names one prebuilt engine; the {macros} variant is built from source")
    engine, check = eu.BUILD / f"microgpt_cuda{suffix}", eu.BUILD / f"kernel_check{suffix}"
    build_variant(suffix, " ".join(f"-D{m}=1" for m in macros), engine, check)
    return engine, check, macros


@pytest.mark.gpu
def test_gpu_amax_in_adamw_build_passes_kernel_check(amax_build):
    res = subprocess.run([str(amax_build[1])], capture_output=True, text=True, timeout=600)
    lines = res.stdout.splitlines()
    failed = [l for l in lines if l.startswith("FAIL")]
    assert res.returncode == 0 and not failed, "\n".join(failed[:40]) + "\n" + res.stdout[-2000:] + res.stderr[-2000:]
    assert "checks, 0 failed" in lines[-1]
    assert all(f"({m})" in lines[0] for m in amax_build[2]), lines[0]
    assert any(l.startswith("PASS") and "adamw amax" in l for l in lines), "no adamw amax check ran"


@pytest.mark.gpu
@pytest.mark.parametrize("model", sorted(MODELS))
def test_gpu_amax_in_adamw_gives_the_default_builds_bits(model, amax_build, cuda_binary, random_shards, tmp_path):
    args = tiny_args(random_shards.train, random_shards.val, **{
        **run_settings(model, 8), "sample.every": 4, "sample.tokens": 5, "sample.prompt": ["1,2"]})
    runs = {}
    for name, binary in (("default", cuda_binary), ("amax", amax_build[0])):
        ckpt = tmp_path / f"{name}.ckpt"
        res = run_ok(binary, args + ["--checkpoint", ckpt])
        runs[name] = (eu.exact_records(res), ckpt.read_bytes(), sidecar_history(ckpt))
    records = runs["amax"][0]
    assert len([k for k in records if k[0] == "train"]) == 8
    assert [k for k in records if k[0] == "sample"], "no sample records: generation was not compared"
    assert runs["amax"][0] == runs["default"][0], "the switch build's records differ from the default build's"
    assert runs["amax"][1] == runs["default"][1], "the switch build's checkpoint differs from the default build's"
    assert runs["amax"][2] == runs["default"][2], "the switch build's histories differ from the default build's"


@pytest.mark.gpu
@pytest.mark.parametrize("model", ["fp8_classifier", "fused_attention"])
def test_gpu_amax_in_adamw_resumes_exactly_and_graphs_equal_eager(model, amax_build, random_shards, tmp_path):
    args = tiny_args(random_shards.train, random_shards.val, **run_settings(model, 30))
    eu.check_exact_resume_after_sigterm(amax_build[0], args, 30, tmp_path)
    eager_ckpt = tmp_path / "eager.ckpt"
    run_ok(amax_build[0], args + ["--checkpoint", eager_ckpt], env={"ANDREA_NO_GRAPH": "1"})
    assert eager_ckpt.read_bytes() == (tmp_path / "ref.ckpt").read_bytes()
    assert sidecar_history(eager_ckpt) == sidecar_history(tmp_path / "ref.ckpt")
