"""The candidate -DFP8_CLASSIFIER=1 (docs/DESIGN.md §18): the tied classifier's three products in FP8
(wte and LNf's output E4M3, dlogits FP8_GRAD_FMT, each at its current scale), in both engines; level 2
(-DFP8_CLASSIFIER=2) takes dlogits' static scale instead, its codes written by the GPU's loss rows.
Both levels' builds are made here, as test_gpu's build_variant does. Either level's CPU engine must train, stay
near the default build's losses but not give its weights (the switch does something), give the
default build's bits in every other precision (the switch touches fp8 only), resume exactly, and
refuse a padded vocabulary its products cannot contract over. On a GPU (skipped without one) the GPU
engine must track the CPU emulation, resume exactly, and give the bits of synchronised launches with
its graphs and unsynchronised launches, also over several logits chunks (each chunk's dwte on the
side stream). While some row's target probability is below 1/8 the static scale is the current one,
so early in training level 2 gives level 1's bits, in each engine. Its kernels are checked by
tests/kernel_check.cu ("classifier bf16" and "loss rows fp8 fused" under --prec fp8).
"""
import numpy as np
import pytest

import engine_util as eu
from engine_util import run_ok, tiny_args
from test_fp8_delayed import RUN, gpu_settings
from test_generate import pattern_shards  # noqa: F401 (a fixture: a learnable token stream)
from test_gpu import build_variant, check_side_stream_over_chunks, cuda_binary  # noqa: F401 (a fixture)

# the builds' suffixes by level (the Makefile's VARIANT_SUFFIX)
SUFFIX = {1: "_cls", 2: "_cls2"}
# logits chunks of 16 KiB (test_gpu's SMALL_CHUNKS_FLAGS): the odd shape's 144 positions in 3 chunks
SMALL_CHUNKS_FLAGS = "-DLOGITS_CHUNK_BYTES=16384"


def cls_build(engine, level, extra_flags="", extra_suffix=""):
    """build/microgpt_<engine><suffix>: the engine at FP8_CLASSIFIER=level, built here."""
    suffix = SUFFIX[level] + extra_suffix
    binary = eu.BUILD / f"microgpt_{engine}{suffix}"
    build_variant(suffix, f"-DFP8_CLASSIFIER={level} {extra_flags}".strip(), binary)
    return binary


@pytest.fixture(scope="module", params=[1, 2], ids=["level1", "level2"])
def level(request):
    return request.param


@pytest.fixture(scope="module")
def cpu_cls_binary(cpu_binary, level):
    return cls_build("cpu", level)


@pytest.fixture(scope="module")
def cuda_cls_binary(cuda_binary, level):
    return cls_build("cuda", level)


@pytest.fixture(scope="module")
def cuda_cls_chunks_binary(cuda_binary, level):
    return cls_build("cuda", level, SMALL_CHUNKS_FLAGS, "chunks")


def test_cls_cpu_trains_near_the_default_build_but_not_to_its_weights(cpu_binary, cpu_cls_binary, pattern_shards,
                                                                      tmp_path):
    """Losses finite and falling, within 5 % of the default build's a step (the layers' FP8 tolerance
    of test_fp8_delayed); the weights differ (the classifier's casts are in effect)."""
    ckpt, default_ckpt = tmp_path / "cls.ckpt", tmp_path / "default.ckpt"
    args = tiny_args(*pattern_shards, **{**RUN, "train.steps": 12})
    cls = run_ok(cpu_cls_binary, args + ["--checkpoint", ckpt])
    default = run_ok(cpu_binary, args + ["--checkpoint", default_ckpt])
    losses = [r["loss"] for r in cls.steps]
    assert all(np.isfinite(losses)) and len(losses) == 12
    assert np.mean(losses[-3:]) < np.mean(losses[:3]), losses
    assert all(abs(a - r["loss"]) <= 0.05 * r["loss"] for a, r in zip(losses, default.steps))
    assert [r["loss"] for r in default.steps] != losses, "the FP8 classifier changed no loss"
    assert ckpt.read_bytes() != default_ckpt.read_bytes(), "the FP8 classifier changed nothing"
    vals = [r["val_loss"] for r in cls.vals]
    assert vals and all(np.isfinite(vals)), cls.records


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_cls_cpu_leaves_other_precisions_bit_identical(cpu_binary, cpu_cls_binary, pattern_shards, tmp_path,
                                                       precision):
    args = tiny_args(*pattern_shards, **{**RUN, "train.steps": 4, "train.precision": precision})
    for name, binary in (("cls", cpu_cls_binary), ("default", cpu_binary)):
        run_ok(binary, args + ["--checkpoint", tmp_path / f"{name}.ckpt"])
    assert (tmp_path / "cls.ckpt").read_bytes() == (tmp_path / "default.ckpt").read_bytes()


def test_cls_cpu_resumes_exactly_through_sigterm(cpu_cls_binary, random_shards, tmp_path):
    args = tiny_args(random_shards.train, random_shards.val, **RUN)
    eu.check_exact_resume_after_sigterm(cpu_cls_binary, args, RUN["train.steps"], tmp_path)


def test_cls_level2_gives_level1s_bits_while_the_static_scale_is_the_current_one(cpu_binary, random_shards,
                                                                                  tmp_path):
    """Random tokens: no row is confident (every target probability far below 1/8), so dlogits' bound
    scale is its current one and level 2's CPU emulation gives level 1's checkpoint."""
    args = tiny_args(random_shards.train, random_shards.val, **{**RUN, "train.steps": 8})
    ckpts = []
    for level in (1, 2):
        ckpts.append(tmp_path / f"level{level}.ckpt")
        run_ok(cls_build("cpu", level), args + ["--checkpoint", ckpts[-1]])
    assert ckpts[0].read_bytes() == ckpts[1].read_bytes()


def test_cls_refuses_a_padded_vocabulary_its_products_cannot_contract_over(cpu_binary, cpu_cls_binary,
                                                                            random_shards):
    args = tiny_args(random_shards.train, **{**RUN, "train.steps": 2, "train.warmup_steps": 0, "eval.every": 0,
                                             "model.padded_vocab_size": 72})
    res = eu.run_engine(cpu_cls_binary, args)
    assert res.rc != 0 and len(res.errors) == 1 and "multiple of 16" in res.errors[0], res.stderr
    run_ok(cpu_binary, args)  # the default build's classifier contracts over d_model only


# ---------------------------------------------------------------------------------------------------
# the GPU engine (skipped without a GPU)

@pytest.mark.gpu
def test_gpu_cls_tracks_the_cpu_emulation(cpu_cls_binary, cuda_cls_binary, random_shards, tmp_path):
    """As test_fp8_delayed's tracking test: the loss within 3e-2 of the CPU emulation's a step (the
    GPU's logits are bf16, its dlogits cast from them; the CPU's fp32)."""
    args = tiny_args(random_shards.train, **{**gpu_settings(), "train.steps": 10})
    runs = {name: run_ok(b, args) for name, b in (("cpu", cpu_cls_binary), ("gpu", cuda_cls_binary))}
    assert len(runs["gpu"].steps) == 10
    for c, g in zip(runs["cpu"].steps, runs["gpu"].steps):
        assert abs(g["loss"] - c["loss"]) <= 3e-2 * abs(c["loss"]), (c, g)


@pytest.mark.gpu
def test_gpu_cls_resumes_exactly_and_graphs_equal_eager(cuda_cls_binary, random_shards, tmp_path):
    args = tiny_args(random_shards.train, random_shards.val, **{**gpu_settings(), "train.steps": 60,
                                                                "train.grad_accum": 2, "eval.every": 20,
                                                                "eval.batches": 2})
    eu.check_exact_resume_after_sigterm(cuda_cls_binary, args, 60, tmp_path)
    eager_ckpt = tmp_path / "eager.ckpt"
    run_ok(cuda_cls_binary, args + ["--checkpoint", eager_ckpt], env={"ANDREA_NO_GRAPH": "1"})
    assert eager_ckpt.read_bytes() == (tmp_path / "ref.ckpt").read_bytes()


@pytest.mark.gpu
def test_gpu_cls_level2_gives_level1s_bits_while_the_static_scale_is_the_current_one(cuda_binary, random_shards,
                                                                                      tmp_path):
    """As the CPU test: the fused loss rows' codes and transpose are level 1's loss rows + amax + cast
    whenever the scales agree, so the whole run's records and checkpoint match. 128 positions: with
    B·T a power of two the scales agree while some |dlogit| reaches 7/8 of the bound 1/(B·T) (the
    odd shape's 144 would need 0.98 of it)."""
    args = tiny_args(random_shards.train, random_shards.val, **{**gpu_settings(), "train.steps": 8,
                                                                "train.batch_size": 4, "model.seq_len": 32,
                                                                "eval.every": 4, "eval.batches": 2})
    runs = []
    for level in (1, 2):
        ckpt = tmp_path / f"level{level}.ckpt"
        runs.append((eu.exact_records(run_ok(cls_build("cuda", level), args + ["--checkpoint", ckpt])),
                     ckpt.read_bytes()))
    assert runs[0] == runs[1]


@pytest.mark.gpu
def test_gpu_cls_over_several_chunks_gives_the_bits_of_synchronised_launches(cuda_cls_chunks_binary, random_shards,
                                                                             tmp_path):
    """As test_gpu's side-stream test over several logits chunks, for the FP8 classifier: each chunk's
    dwte reads its dlogits' codes on the side stream, the next chunk's codes overwrite them after
    side_wait; a missing wait shows as records or a checkpoint that differ from ANDREA_CUDA_SYNC's."""
    check_side_stream_over_chunks(cuda_cls_chunks_binary, random_shards, tmp_path, "fp8")
