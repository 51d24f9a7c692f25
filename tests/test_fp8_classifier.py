"""The FP8 classifier (docs/DESIGN.md §18): in precision fp8, from model.d_model 512 up (cpu/fp8.h's
fp8_classifier_pays), all three of the tied classifier's products run in FP8 (train.fp8_classifier
all, the default: wte and LNf's output E4M3 at their current scales, dlogits FP8_GRAD_FMT at the
static scale of their bound 1/(B·T), rounded stochastically, written by the GPU's loss rows), or its
logits product alone (logits: dlogits, dx and dwte in the activation type, fp32 on the CPU), in both
engines; below 512, or with off, the classifier stays in the activation type. A one-layer model of
d_model 512 (small vocabulary and sequence, so the CPU runs it in seconds) on each side of the rule:
each engine says which classifier it runs, the padded vocabulary the FP8 products run over is
refused only where they run, the CPU engine trains near fp32 and resumes exactly in both modes,
which share their forward and not their backward, and with all rounds dlogits stochastically with
the bits of its micro-batch's targets and rows (its dwte from a crafted start, predicted). On a GPU
(skipped without one) the GPU engine must track the CPU emulation, resume exactly, and give the
bits of synchronised launches with its graphs and unsynchronised launches, also over several logits
chunks (each chunk's dwte on the side stream), in both modes. Its kernels are checked by
tests/kernel_check.cu ("classifier bf16", "loss rows fp8 fused" and "transpose codes" under --prec
fp8).
"""
import ctypes
import json
import re

import numpy as np
import pytest

import engine_util as eu
import reference as R
from engine_util import run_ok, tiny_args
from test_fp8 import E4M3, code_values, reference_cast, reference_scale, worst_loss_gap
from test_fp8 import fp8lib  # noqa: F401 (a fixture: cpu/fp8.h through ctypes)
from test_fp8_delayed import DELAYED_TRACK_TOL, RUN
from test_generate import pattern_shards  # noqa: F401 (a fixture: a learnable token stream)
from test_gpu import check_side_stream_over_chunks
from test_gpu import cuda_binary, small_chunks_build  # noqa: F401 (fixtures)

from microgpt.checkpoint import split_params, write_checkpoint

# cpu/fp8.h's FP8_CLASSIFIER_MIN_D_MODEL: the FP8 classifier at 512, not at 496 (both multiples of
# 16, as FP8 products need; 8 heads of 64, and 31 of 16)
WIDTHS = {"fp8 classifier": {"model.d_model": 512, "model.n_head": 8},
          "bf16 classifier": {"model.d_model": 496, "model.n_head": 31}}
# one layer, a small vocabulary (the pattern shards' 60 in 64) and 64 positions (4 x 16)
CLS_SHAPE = {"model.n_layer": 1, "model.d_ff": 512, "model.seq_len": 16, "model.padded_vocab_size": 64,
             "train.batch_size": 4}
CLS_RUN = {**RUN, **CLS_SHAPE, **WIDTHS["fp8 classifier"]}  # train.fp8_classifier: the default, all
MODES = ["logits", "all"]  # the values of train.fp8_classifier that run FP8 products
SHORT = {"train.steps": 2, "train.warmup_steps": 0, "eval.every": 0}  # a run that only starts
CLASSIFIER_LINE = re.compile(r"classifier: (FP8|bf16|fp32) products")


def classifier_named(res):
    """The classifier the engine says it runs (its one startup info line), None if it says none."""
    found = CLASSIFIER_LINE.findall(res.stderr)
    assert len(found) <= 1, res.stderr[-2000:]
    return found[0] if found else None


def in_mode(mode, **extra):
    """CLS_RUN with train.fp8_classifier `mode` and `extra`."""
    return {**CLS_RUN, "train.fp8_classifier": mode, **extra}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("width", sorted(WIDTHS))
def test_cpu_engine_runs_the_fp8_classifier_from_d_model_512(cpu_binary, random_shards, width, mode):
    """The rule at its edge: the engine names the FP8 classifier at 512 and its fp32 one at 496; a
    padded vocabulary of 72 (not a multiple of 16, a dimension of the FP8 products) is refused with
    one error line where the FP8 classifier runs and trained on where not."""
    fp8 = width == "fp8 classifier"
    args = tiny_args(random_shards.train, **in_mode(mode, **WIDTHS[width], **SHORT))
    assert classifier_named(run_ok(cpu_binary, args)) == ("FP8" if fp8 else "fp32")
    res = eu.run_engine(cpu_binary, args + ["--model.padded_vocab_size", "72"])
    if fp8:
        assert res.rc != 0 and len(res.errors) == 1 and "multiple of 16" in res.errors[0], res.stderr
    else:
        assert res.rc == 0 and len(res.steps) == 2, res.describe()


def test_the_fp8_classifier_runs_all_three_products_by_default(cpu_binary, random_shards):
    """Without train.fp8_classifier the engine runs all three of the classifier's products in FP8 and
    says so (as with all); with logits, the logits' alone; with off, d_model 512 keeps the classifier
    in the activation type and a padded vocabulary no FP8 product runs over is trained on; a value
    other than off, logits or all is one error line."""
    for extra in ({}, {"train.fp8_classifier": "all"}):
        res = run_ok(cpu_binary, tiny_args(random_shards.train, **{**CLS_RUN, **SHORT, **extra}))
        assert classifier_named(res) == "FP8" and "FP8 products, all three" in res.stderr, res.stderr
    res = run_ok(cpu_binary, tiny_args(random_shards.train, **in_mode("logits", **SHORT)))
    assert "FP8 products, the logits'" in res.stderr, res.stderr
    args = tiny_args(random_shards.train, **in_mode("off", **SHORT))
    assert classifier_named(run_ok(cpu_binary, args)) == "fp32"
    res = eu.run_engine(cpu_binary, args + ["--model.padded_vocab_size", "72"])
    assert res.rc == 0 and len(res.steps) == 2, res.describe()
    for bad in ("on", "auto"):
        res = eu.run_engine(cpu_binary, tiny_args(random_shards.train, **in_mode(bad, **SHORT)))
        assert res.rc == 2 and len(res.errors) == 1 and "fp8_classifier" in res.errors[0], res.stderr


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_other_precisions_name_no_classifier(cpu_binary, random_shards, precision):
    res = run_ok(cpu_binary, tiny_args(random_shards.train, **{**CLS_RUN, **SHORT, "train.precision": precision}))
    assert classifier_named(res) is None


@pytest.mark.parametrize("mode", MODES)
def test_cpu_fp8_classifier_trains_near_fp32(cpu_binary, pattern_shards, mode):
    """Losses finite and falling, within 5 % of the fp32 run's a step (the layers' FP8 tolerance of
    tests/test_fp8.py), and not equal to them; validation finite."""
    check_trains_near_fp32(cpu_binary, pattern_shards, mode)


def check_trains_near_fp32(cpu_engine, pattern_shards, mode):
    """The test above's body for one mode; its fp8 run."""
    args = tiny_args(*pattern_shards, **in_mode(mode, **{"train.steps": 12}))
    fp8 = run_ok(cpu_engine, args)
    fp32 = run_ok(cpu_engine, args + ["--train.precision", "fp32"])
    assert classifier_named(fp8) == "FP8"
    losses = [r["loss"] for r in fp8.steps]
    assert all(np.isfinite(losses)) and len(losses) == 12
    assert np.mean(losses[-3:]) < np.mean(losses[:3]), losses
    assert all(abs(a - r["loss"]) <= 0.05 * r["loss"] for a, r in zip(losses, fp32.steps))
    assert [r["loss"] for r in fp32.steps] != losses, "fp8 computed exactly what fp32 computes"
    vals = [r["val_loss"] for r in fp8.vals]
    assert vals and all(np.isfinite(vals)), fp8.records
    return fp8


def test_cpu_modes_share_the_forward_not_the_backward(cpu_binary, pattern_shards):
    """logits and all run the same FP8 logits: the first loss (the forward) is the same, the later
    ones not (the backward of the fp32 classifier against that of FP8 dlogits)."""
    losses = {mode: [r["loss"] for r in run_ok(cpu_binary, tiny_args(*pattern_shards, **in_mode(
        mode, **{"train.steps": 12}))).steps] for mode in MODES}
    assert losses["logits"][0] == losses["all"][0], losses
    assert losses["logits"][1:] != losses["all"][1:], "the two modes trained alike"


def test_cpu_fp8_classifier_rounds_dlogits_stochastically(cpu_binary, fp8lib, tmp_path):
    """With train.fp8_classifier all the CPU engine rounds dlogits stochastically with the bits of
    fp8_dlogits_salt of the micro-batch's targets and of each row's index in it (cpu/fp8.h), as the
    GPU's loss rows do: its dwte (--dump-grads) is the one that rounding predicts, not the one of
    rounding to nearest, another salt (that of the inputs, or a constant) or rows offset by one.
    The prediction is exact but for float32 sums: from a checkpoint with wte and every layer's
    weights zero, the logits are 0, so every probability is exactly 1/V, the layers pass the
    embedding through, LNf's output is LayerNorm(wpe), and dwte = fp8(dlogits)^T @ fp8(LNf output).
    One window of data makes the batch known.

    Tolerance: ||dwte - predicted|| / ||predicted|| <= 1e-6. Measured 8e-9: the engine sums 64
    products of fp8 values in float32, the prediction in float64 (LNf's output, float32 against
    float64 before its cast, gave the same codes). Every regression named above, and no rounding at
    all, measured 1.8e-2 or more, made in the engine or in the prediction alike; the test insists on
    100 times the tolerance against the latter, so that a shape or data that hid them would fail."""
    rtol = 1e-6
    B, T, Vp = CLS_RUN["train.batch_size"], CLS_RUN["model.seq_len"], CLS_RUN["model.padded_vocab_size"]
    N, V = B * T, eu.TINY_VOCAB
    rng = np.random.default_rng(5)
    window = rng.integers(0, V, T + 1)
    eu.write_shard(tmp_path / "win_000000.bin", window)  # T + 1 tokens: the only window
    layout = eu.layout_for(CLS_RUN)
    params = np.zeros(layout["n_params"], np.float32)
    p = split_params(params, layout)
    p["wpe"][...] = rng.standard_normal(p["wpe"].shape)
    for name in p:
        if name.endswith("gamma"):
            p[name][...] = 1.0
    ckpt, dump = tmp_path / "start.ckpt", tmp_path / "grads.bin"
    write_checkpoint(ckpt, 0, params, np.zeros_like(params), np.zeros_like(params))
    run_ok(cpu_binary, tiny_args(tmp_path / "win_*.bin", **in_mode("all", **SHORT), checkpoint=ckpt, resume=True,
                                 dump_grads=dump))
    loss, grads = eu.read_grad_dump(dump)
    dwte = split_params(grads, layout)["wte"]
    assert abs(loss - np.log(V)) < 1e-6, loss

    inputs, targets = (np.tile(w, B).astype(np.int32) for w in (window[:-1], window[1:]))
    dlogits = np.zeros((N, Vp), np.float32)  # (p - onehot) / N as cpu/classifier.h computes it
    dlogits[:, :V] = np.float32(1.0 / V)
    dlogits[np.arange(N), targets] -= np.float32(1.0)
    dlogits *= np.float32(1.0 / N)
    lnf = np.tile(R.layernorm_forward(p["wpe"][:T].astype(np.float64), 1.0, 0.0)[0], (B, 1)).astype(np.float32)
    lnf_q = np.empty_like(lnf)
    fp8lib.fake_quantize(lnf_q.ctypes.data_as(ctypes.c_void_p), lnf.ctypes.data_as(ctypes.c_void_p),
                         ctypes.c_size_t(lnf.size), E4M3)
    s = reference_scale(1.0 / N, E4M3)  # cpu/fp8.h's fp8_dlogits_scale

    def dwte_with(rounded):
        return rounded[:, :V].astype(np.float64).T @ lnf_q.astype(np.float64)

    def stochastic(row0, salt_of):
        out = np.empty_like(dlogits)
        salt = fp8lib.dlogits_salt(salt_of.ctypes.data, salt_of.size)
        fp8lib.fake_quantize_dlogits(out.ctypes.data, dlogits.ctypes.data, N, Vp, row0, salt, E4M3, s)
        return out

    err = eu.rel_err(dwte[:V], dwte_with(stochastic(0, targets)))
    assert err <= rtol, f"dwte differs from the stochastic rounding's by {err:.3g}"
    assert not dwte[V:].any()
    wrong = {"rounded to nearest": code_values(E4M3)[reference_cast(dlogits.astype(np.float64) * s, E4M3)] / s,
             "salted by the inputs": stochastic(0, inputs), "salted by a constant": stochastic(0, targets[:0]),
             "rows offset by one": stochastic(1, targets)}
    for what, rounded in wrong.items():
        err = eu.rel_err(dwte[:V], dwte_with(rounded))
        assert err > 100 * rtol, f"dwte is also that of dlogits {what} ({err:.3g}): the test sees no difference"


@pytest.mark.parametrize("mode", MODES)
def test_cpu_fp8_classifier_resumes_exactly_through_sigterm(cpu_binary, random_shards, tmp_path, mode):
    args = tiny_args(random_shards.train, random_shards.val, **in_mode(mode))
    eu.check_exact_resume_after_sigterm(cpu_binary, args, CLS_RUN["train.steps"], tmp_path)


# ---------------------------------------------------------------------------------------------------
# the GPU engine (skipped without a GPU)

# the GPU's shape: as the CPU's, but a vocabulary of 100 in 128 and 144 positions (3 x 48)
GPU_RUN = {**CLS_RUN, "model.vocab_size": 100, "model.padded_vocab_size": 128, "model.seq_len": 48,
           "train.batch_size": 3, "train.warmup_steps": 2}


def gpu_run(mode, **extra):
    """GPU_RUN with train.fp8_classifier `mode` and `extra`."""
    return {**GPU_RUN, "train.fp8_classifier": mode, **extra}


@pytest.mark.gpu
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("width", sorted(WIDTHS))
def test_gpu_engine_runs_the_fp8_classifier_from_d_model_512(cuda_binary, random_shards, width, mode):
    """The GPU's rule is the CPU's (the CPU engine stays its reference)."""
    res = run_ok(cuda_binary, tiny_args(random_shards.train, **gpu_run(mode, **WIDTHS[width], **SHORT)))
    assert classifier_named(res) == ("FP8" if width == "fp8 classifier" else "bf16")


@pytest.mark.gpu
@pytest.mark.parametrize("mode", MODES)
def test_gpu_fp8_classifier_tracks_the_cpu_emulation(cpu_binary, cuda_binary, random_shards, mode):
    """As test_fp8_delayed's tracking test: the loss within its DELAYED_TRACK_TOL of the CPU
    emulation's a step (the GPU's logits are bf16, its dlogits bf16 or their codes from bf16 values;
    the CPU's fp32): the same underived 3e-2, printed gap and all."""
    args = tiny_args(random_shards.train, random_shards.val, **gpu_run(mode, **{"train.steps": 10}))
    runs = {name: run_ok(b, args) for name, b in (("cpu", cpu_binary), ("gpu", cuda_binary))}
    assert classifier_named(runs["gpu"]) == classifier_named(runs["cpu"]) == "FP8"
    assert len(runs["gpu"].steps) == 10
    gpu_losses, cpu_losses = ([r["loss"] for r in runs[n].steps] for n in ("gpu", "cpu"))
    gap = worst_loss_gap(gpu_losses, cpu_losses, f"fp8 classifier {mode}: GPU vs CPU emulation")
    assert gap <= DELAYED_TRACK_TOL, list(zip(gpu_losses, cpu_losses))


@pytest.mark.gpu
@pytest.mark.parametrize("mode", MODES)
def test_gpu_fp8_classifier_resumes_exactly_and_graphs_equal_eager(cuda_binary, random_shards, tmp_path, mode):
    """Resume after SIGTERM gives the uninterrupted run's checkpoint byte for byte (with logits, a
    stale 16-bit wte, which its backward reads, would show here: resume refreshes it), and so does
    a run launch by launch (ANDREA_NO_GRAPH)."""
    args = tiny_args(random_shards.train, random_shards.val, **gpu_run(mode, **{
        "train.steps": 60, "train.grad_accum": 2, "eval.every": 20, "eval.batches": 2}))
    eu.check_exact_resume_after_sigterm(cuda_binary, args, 60, tmp_path)
    eager_ckpt = tmp_path / "eager.ckpt"
    run_ok(cuda_binary, args + ["--checkpoint", eager_ckpt], env={"ANDREA_NO_GRAPH": "1"})
    assert eager_ckpt.read_bytes() == (tmp_path / "ref.ckpt").read_bytes()


@pytest.mark.gpu
@pytest.mark.parametrize("mode", MODES)
def test_gpu_fp8_classifier_over_several_chunks_gives_the_bits_of_synchronised_launches(
        small_chunks_build, random_shards, tmp_path, mode):
    """As test_gpu's side-stream test over several logits chunks, for the FP8 classifier: each chunk's
    dwte reads its dlogits (all: their codes; logits: the bf16 logits buffer, as the bf16
    classifier's) on the side stream, the next chunk's overwrite them after side_wait; a missing wait
    shows as records or a checkpoint that differ from ANDREA_CUDA_SYNC's. The small-chunks build's
    16 KiB chunks: 64 rows of the 128-column bf16 logits, 3 for 144 positions (with all the chunk
    rounded to a multiple of 16 for dwte's FP8 product)."""
    check_side_stream_over_chunks(small_chunks_build, random_shards, tmp_path, "fp8",
                                  {k: v for k, v in gpu_run(mode).items()
                                   if k.startswith(("model.", "train.batch", "train.fp8"))})


def test_cpu_resume_says_when_the_classifier_mode_changes(cpu_binary, random_shards, tmp_path):
    """The sidecar records train.fp8_classifier: resuming an fp8 run in another mode warns once and
    goes on; in the same mode it says nothing; a sidecar written before the mode was recorded warns
    that it cannot tell (its run had off or all); below d_model 512, where no mode changes a bit,
    nothing is said."""
    def run(ckpt, mode, steps, width="fp8 classifier"):
        args = tiny_args(random_shards.train, checkpoint=ckpt, **in_mode(mode, **WIDTHS[width], **{
            "train.steps": steps, "train.warmup_steps": 0, "eval.every": 0}))
        res = run_ok(cpu_binary, args + (["--resume"] if ckpt.exists() else []))
        return [w for w in res.stderr.splitlines() if w.startswith("warning:") and "fp8_classifier" in w]

    ckpt = tmp_path / "c.ckpt"
    assert run(ckpt, "off", 2) == []
    changed = run(ckpt, "logits", 3)
    assert len(changed) == 1 and "logits" in changed[0] and "written with off" in changed[0], changed
    assert run(ckpt, "logits", 4) == []
    side = ckpt.with_name(ckpt.name + ".json")
    # as written before the mode was recorded: no values_crc32c either
    side.write_text(re.sub(r'"values_crc32c":\d+,', "", side.read_text().replace(',"fp8_classifier":"logits"', "")))
    old = run(ckpt, "logits", 5)
    assert len(old) == 1 and "does not say" in old[0], old
    narrow = tmp_path / "narrow.ckpt"
    assert run(narrow, "off", 2, width="bf16 classifier") == []
    assert run(narrow, "all", 3, width="bf16 classifier") == []


@pytest.mark.parametrize("recorded", [3, None, "bogus"], ids=["number", "null", "no-mode"])
def test_cpu_resume_says_a_recorded_classifier_mode_is_none(cpu_binary, random_shards, tmp_path, recorded):
    """A sidecar whose fp8_classifier is there but no mode (a number, null, a name no run writes;
    its values resealed, so only a crafted one) is said to be so: "written before that was
    recorded" was untrue of it, "written with bogus" took it for a mode."""
    def args(steps):
        return tiny_args(random_shards.train, checkpoint=tmp_path / "c.ckpt", **in_mode("off", **WIDTHS["fp8 classifier"], **{
            "train.steps": steps, "train.warmup_steps": 0, "eval.every": 0}))

    run_ok(cpu_binary, args(2))
    side = eu.read_sidecar(tmp_path / "c.ckpt")
    side["fingerprint"]["fp8_classifier"] = recorded
    (tmp_path / "c.ckpt.json").write_text(json.dumps(eu.reseal_values(side)))
    res = run_ok(cpu_binary, args(3) + ["--resume"])
    warnings = [w for w in res.stderr.splitlines() if w.startswith("warning:")]
    assert len(warnings) == 1 and "not one of off|logits|all" in warnings[0], res.describe()
    assert "written before" not in warnings[0] and "written with" not in warnings[0], warnings
