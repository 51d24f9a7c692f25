"""Delayed fp8 scaling (docs/DESIGN.md §18) of ln1, ln2, the GELU output and the attention output att
(the forward's histories), MLP up's output gradient dh, the residual gradients that are W_2's and
W_O's output gradients and QKV's output gradient dqkv (the backward's). The history's scale rule
(microgpt/cpu/fp8.h) is checked against a float64 reference of "the current rule applied to the
largest amax of the last 16 training forwards". The CPU engine training fp8 must train, keep its
histories in the checkpoint sidecar, resume bit-exactly, warn when resuming a checkpoint without
them, and on two processes share one set of histories that resumes both exactly (§17). On a GPU
(skipped without one), the GPU engine must track the CPU one (whose GELU keeps glibc's tanhf where
the GPU's fp8 GELU takes the hardware's approximation) and resume exactly, its graphs giving the
bits of launch by launch, with the fused attention kernels (head size 32) and with the fallback
that casts at the delayed scale (head size 16). The fused kernels are checked by
tests/kernel_check.cu; two GPUs by tests/test_distributed.py.
"""
import ctypes
import json
import signal
import subprocess

import numpy as np
import pytest

import engine_util as eu
from engine_util import run_ok, tiny_args
from test_distributed import Ranks
from test_engine import alloc_counter  # noqa: F401 (a fixture: the LD_PRELOAD allocation counter)
from test_fp8 import E4M3, FP8_LOSS_RTOL, reference_scale, worst_loss_gap
from test_generate import pattern_shards  # noqa: F401 (a fixture: a learnable token stream)
from test_gpu import FP8_SHAPES, cuda_binary  # noqa: F401 (cuda_binary: a fixture)

HISTORY_LEN = 16
# the histories a layer: the forward's ln1, ln2, GELU, att, then the backward's dh, W_2's and W_O's
# output gradients, dqkv (cpu/fp8.h's DELAYED_*)
PER_LAYER = 8
FORWARD_PER_LAYER = 4

WRAPPER = r"""
#include <stddef.h>
#include "%s/microgpt/cpu/fp8.h"
/* Pushes the n amaxes one by one into a fresh history; scales[i] = the delayed scale after i pushes
 * (0: no entry constrains it). Returns the final count. */
int run_history(const float* amax, size_t n, float* scales, signed char* last) {
    Fp8History h = {{0}, 0};
    for (size_t i = 0; i < n; i++) {
        scales[i] = fp8_history_scale(&h);
        fp8_history_push(&h, amax[i], FP8_E4M3);
    }
    scales[n] = fp8_history_scale(&h);
    for (int i = 0; i < h.count; i++) last[i] = h.exp[i];
    return h.count;
}
"""


@pytest.fixture(scope="module")
def historylib(tmp_path_factory):
    d = tmp_path_factory.mktemp("fp8hist")
    (d / "wrapper.c").write_text(WRAPPER % eu.REPO)
    lib = d / "libhist.so"
    subprocess.run(["gcc", "-std=c99", "-O2", "-ffp-contract=off", "-shared", "-fPIC", "-o", str(lib),
                    str(d / "wrapper.c"), "-lm"], check=True)
    return ctypes.CDLL(str(lib))


def run_history(lib, amaxes):
    a = np.ascontiguousarray(amaxes, dtype=np.float32)
    scales = np.empty(a.size + 1, dtype=np.float32)
    last = np.zeros(HISTORY_LEN, dtype=np.int8)
    count = lib.run_history(a.ctypes.data_as(ctypes.c_void_p), ctypes.c_size_t(a.size),
                            scales.ctypes.data_as(ctypes.c_void_p), last.ctypes.data_as(ctypes.c_void_p))
    return scales, last[:count]


def reference_delayed_scale(window):
    """The current rule on the largest amax of the window (float64): 1 (a zero amax's scale) when all
    are zero, 0 (no delayed scale: current scaling) when the window is empty."""
    return reference_scale(float(max(window)), E4M3) if len(window) else 0.0


def test_delayed_scale_is_the_current_rule_on_the_largest_amax_of_the_last_16(historylib):
    rng = np.random.default_rng(3)
    # slowly drifting amaxes with jumps, zeros, and the extremes of the scale range
    amaxes = (2.0 ** rng.integers(-20, 12, 300) * rng.random(300)).astype(np.float32)
    amaxes[rng.integers(0, 300, 40)] = 0.0
    amaxes[[50, 51, 120]] = [448.0, 2.0 ** -149, 3e38]
    scales, _ = run_history(historylib, amaxes)
    for i in range(amaxes.size + 1):
        want = reference_delayed_scale(amaxes[max(0, i - HISTORY_LEN):i])
        assert scales[i] == want, (i, amaxes[max(0, i - HISTORY_LEN):i], scales[i], want)


def test_an_empty_history_leaves_the_scale_to_the_current_rule_and_zeros_constrain_nothing(historylib):
    scales, last = run_history(historylib, np.zeros(20, np.float32))
    assert scales[0] == 0 and (scales[1:] == 1).all() and (last == 127).all() and last.size == HISTORY_LEN
    scales, _ = run_history(historylib, np.array([0, 0, 3.0, 0], np.float32))
    assert scales.tolist() == [0, 1, 1, 128.0, 128.0]  # 3 * 128 = 384 <= 448 < 768


def test_a_non_finite_amax_caps_the_scale_at_one_for_16_forwards(historylib):
    amaxes = np.array([1e-3] * 3 + [np.inf] + [1e-3] * HISTORY_LEN, np.float32)
    scales, _ = run_history(historylib, amaxes)
    assert scales[3] == reference_scale(1e-3, E4M3) and (scales[4:4 + HISTORY_LEN] == 1.0).all()
    assert scales[4 + HISTORY_LEN] == reference_scale(1e-3, E4M3)


# ---------------------------------------------------------------------------------------------------
# the CPU engine

# d_model 48: its LayerNorm outputs' amaxes straddle a power of two (3.5 = 448 / 2^7), so delayed
# scales differ from current ones at some steps (at d_model 32 they never do in 30 steps)
RUN = {"train.steps": 30, "train.lr": 3e-3, "train.warmup_steps": 3, "eval.every": 5, "eval.batches": 2,
       "train.precision": "fp8", "model.d_model": 48}


def sidecar_history(ckpt):
    return json.loads((ckpt.parent / (ckpt.name + ".json")).read_text())["fp8_history"]


def test_fp8_training_keeps_histories_of_training_forwards_only(cpu_binary, pattern_shards, tmp_path):
    ckpt = tmp_path / "run.ckpt"
    args = tiny_args(*pattern_shards, **{**RUN, "train.steps": 12})
    delayed = run_ok(cpu_binary, args + ["--checkpoint", ckpt])
    fp32 = run_ok(cpu_binary, tiny_args(*pattern_shards, **{**RUN, "train.steps": 12, "train.precision": "fp32"}))
    losses = [r["loss"] for r in delayed.steps]
    assert all(np.isfinite(losses)) and len(losses) == 12
    assert np.mean(losses[-3:]) < np.mean(losses[:3]), losses
    assert delayed.events("start")[0]["compute_precision"] == "fp8"
    assert worst_loss_gap(losses, [r["loss"] for r in fp32.steps]) <= FP8_LOSS_RTOL, (losses, fp32.steps)
    hist = sidecar_history(ckpt)
    n_layer = eu.TINY["model.n_layer"]
    assert hist["len"] == HISTORY_LEN and len(hist["exp"]) == PER_LAYER * n_layer
    # 12 training micro-batches (the gradients' entries from their backwards); the 2 x 2 validation
    # forwards read the scales but record nothing
    assert all(len(h) == 12 and all(-126 <= e <= 127 for e in h) for h in hist["exp"]), hist
    layers = [hist["exp"][PER_LAYER * l:PER_LAYER * (l + 1)] for l in range(n_layer)]
    grads = [e for h in layers for g in h[FORWARD_PER_LAYER:] for e in g]
    acts = [e for h in layers for a in h[:FORWARD_PER_LAYER] for e in a]
    assert min(grads) > max(acts), (grads, "gradients are far smaller than activations")


def test_fp8_resumes_exactly_through_the_sidecar(cpu_binary, random_shards, tmp_path):
    args = tiny_args(random_shards.train, random_shards.val, **RUN)
    _, ckpt = eu.check_exact_resume_after_sigterm(cpu_binary, args, RUN["train.steps"], tmp_path)
    assert all(len(h) == HISTORY_LEN for h in sidecar_history(ckpt)["exp"])


def test_resume_without_histories_warns_and_starts_them_afresh(cpu_binary, pattern_shards, tmp_path):
    """A checkpoint of fp8 from before delayed scaling (no histories) still resumes, with a warning.
    Its first forward is current scaling's and its histories are shorter afterwards, so the losses
    differ from an exact resume's: the negative control that the histories are in effect."""
    ckpt, exact = tmp_path / "run.ckpt", tmp_path / "exact.ckpt"
    args = tiny_args(*pattern_shards, **{**RUN, "train.steps": 4})
    run_ok(cpu_binary, args + ["--checkpoint", ckpt])
    for suffix in ("", ".json"):
        (tmp_path / ("exact.ckpt" + suffix)).write_bytes((tmp_path / ("run.ckpt" + suffix)).read_bytes())
    side = ckpt.parent / (ckpt.name + ".json")
    meta = json.loads(side.read_text())
    del meta["fp8_history"]
    side.write_text(json.dumps(meta))
    more = tiny_args(*pattern_shards, **{**RUN, "train.steps": 16})
    res = run_ok(cpu_binary, more + ["--checkpoint", ckpt, "--resume"])
    assert "no fp8 scale history" in res.stderr and len(res.steps) == 12
    assert all(len(h) == 12 for h in sidecar_history(ckpt)["exp"])
    kept = run_ok(cpu_binary, more + ["--checkpoint", exact, "--resume"])
    assert "no fp8 scale history" not in kept.stderr
    assert [r["loss"] for r in res.steps] != [r["loss"] for r in kept.steps], "the histories changed nothing"


def _member(**edit):
    def damage(meta):
        meta["fp8_history"].update(edit)
    return damage


def _entry(value):
    def damage(meta):
        meta["fp8_history"]["exp"][1][0] = value
    return damage


HISTORY_DAMAGE = {"exponent_out_of_range": _entry(500), "entry_not_a_number": _entry("x"),
                  "entry_a_fraction": _entry(1.5), "longer_than_its_len": _member(len=2),
                  "len_zero": _member(len=0), "len_not_a_number": _member(len="x"),
                  "exp_not_a_list": _member(exp=3)}


@pytest.mark.parametrize("damage", sorted(HISTORY_DAMAGE))
def test_a_damaged_history_member_refuses_the_resume(cpu_binary, random_shards, tmp_path, damage):
    """The checksum covers the checkpoint, not its sidecar: a history member that is there but not
    well-formed is damage, not age (as a crc32c that is no number). One error line naming the
    checkpoint and the member, exit status 2, no step run, nothing changed beside it; refused with
    the checkpoint's own checks, before the engine allocates anything (no start or memory event)."""
    ckpt = tmp_path / "run.ckpt"
    run_ok(cpu_binary, tiny_args(random_shards.train, random_shards.val, **{**RUN, "train.steps": 4}) + ["--checkpoint", ckpt])
    side = tmp_path / "run.ckpt.json"
    meta = json.loads(side.read_text())
    HISTORY_DAMAGE[damage](meta)
    side.write_text(json.dumps(meta, separators=(",", ":")))
    before = {f.name: f.read_bytes() for f in tmp_path.iterdir()}
    res = eu.run_engine(cpu_binary, tiny_args(random_shards.train, random_shards.val, **{**RUN, "train.steps": 8}) +
                        ["--checkpoint", ckpt, "--resume"])
    assert res.rc == 2, res.describe()
    assert len(res.errors) == 1 and str(ckpt) in res.errors[0] and "fp8_history" in res.errors[0], res.describe()
    assert res.steps == [] and res.events("start") == [] and res.events("memory") == [], res.describe()
    assert {f.name: f.read_bytes() for f in tmp_path.iterdir()} == before


def test_a_bf16_resume_of_an_fp8_checkpoint_reads_no_histories(cpu_binary, random_shards, tmp_path):
    """Only a run that keeps histories reads them: resuming in bf16 takes no notice of the member,
    damaged or not (the next checkpoint, a bf16 one, writes none)."""
    ckpt = tmp_path / "run.ckpt"
    run_ok(cpu_binary, tiny_args(random_shards.train, random_shards.val, **{**RUN, "train.steps": 4}) + ["--checkpoint", ckpt])
    side = tmp_path / "run.ckpt.json"
    meta = json.loads(side.read_text())
    HISTORY_DAMAGE["exponent_out_of_range"](meta)
    side.write_text(json.dumps(meta, separators=(",", ":")))
    res = run_ok(cpu_binary, tiny_args(random_shards.train, random_shards.val, **{**RUN, "train.steps": 6,
                                                                                  "train.precision": "bf16"}) +
                 ["--checkpoint", ckpt, "--resume"])
    assert [r["step"] for r in res.steps] == [5, 6] and "history" not in res.stderr, res.describe()
    assert "fp8_history" not in json.loads(side.read_text())


def test_a_sidecar_rewritten_with_json_whitespace_resumes_exactly(cpu_binary, random_shards, tmp_path):
    """The sidecar is JSON: one a tool rewrote with indentation and spaces is read as the engine
    wrote it (the same histories, so the same losses as from the original)."""
    args = tiny_args(random_shards.train, random_shards.val, **{**RUN, "train.steps": 4})
    for name in ("run", "pretty"):
        run_ok(cpu_binary, args + ["--checkpoint", tmp_path / f"{name}.ckpt"])
    side = tmp_path / "pretty.ckpt.json"
    side.write_text(json.dumps(json.loads(side.read_text()), indent=1))
    assert '"exp": [' in side.read_text()
    more = tiny_args(random_shards.train, random_shards.val, **{**RUN, "train.steps": 8})
    runs = [run_ok(cpu_binary, more + ["--checkpoint", tmp_path / f"{name}.ckpt", "--resume"]) for name in ("run", "pretty")]
    assert all("fp8 scale history" not in r.stderr for r in runs), runs[1].describe()
    assert [r["loss"] for r in runs[0].steps] == [r["loss"] for r in runs[1].steps]
    assert sidecar_history(tmp_path / "run.ckpt") == sidecar_history(tmp_path / "pretty.ckpt")


def test_a_sidecar_rewritten_with_json_whitespace_keeps_its_precision(cpu_binary, random_shards, tmp_path):
    """The sidecar's precision, read as a string, takes JSON whitespace as its numbers do: --evaluate
    of an fp8 checkpoint whose sidecar a tool re-indented runs fp8 as from the original (the same
    loss, bit for bit), and a resume in another precision is told so."""
    args = tiny_args(random_shards.train, random_shards.val, **{**RUN, "train.steps": 4})
    for name in ("run", "pretty"):
        run_ok(cpu_binary, args + ["--checkpoint", tmp_path / f"{name}.ckpt"])
    side = tmp_path / "pretty.ckpt.json"
    side.write_text(json.dumps(json.loads(side.read_text()), indent=1, separators=(" ,", " : ")))
    assert '"precision" : "fp8"' in side.read_text()
    evals = [run_ok(cpu_binary, ["--evaluate", "--checkpoint", tmp_path / f"{name}.ckpt", "--data.val",
                                 random_shards.val, "--eval.batches", "2"]) for name in ("run", "pretty")]
    assert [e.lines for e in evals] == [evals[0].lines] * 2 and "classifier:" in evals[1].stderr, evals[1].describe()
    res = run_ok(cpu_binary, tiny_args(random_shards.train, random_shards.val,
                                       **{**RUN, "train.steps": 5, "train.precision": "fp32"}) +
                 ["--checkpoint", tmp_path / "pretty.ckpt", "--resume"])
    assert "resuming in precision fp32, the checkpoint was written in fp8" in res.stderr, res.describe()


# four a layer: a checkpoint's from before the histories of att and of the residual gradients and dqkv
OTHER_SHAPES = {"one_more": lambda exp: exp + [[1, 2]],
                "four_a_layer": lambda exp: [h for i, h in enumerate(exp) if i % PER_LAYER in (0, 1, 2, 4)]}


@pytest.mark.parametrize("shape", sorted(OTHER_SHAPES))
def test_histories_of_another_shape_resume_with_the_warning(cpu_binary, random_shards, tmp_path, shape):
    """A well-formed member of another count (an older build's: one from before att's, the residual
    gradients' and dqkv's histories keeps four a layer) is not damage: the warning, then the run resumes with fresh histories."""
    ckpt = tmp_path / "run.ckpt"
    run_ok(cpu_binary, tiny_args(random_shards.train, random_shards.val, **{**RUN, "train.steps": 4}) + ["--checkpoint", ckpt])
    side = tmp_path / "run.ckpt.json"
    meta = json.loads(side.read_text())
    meta["fp8_history"]["exp"] = OTHER_SHAPES[shape](meta["fp8_history"]["exp"])
    side.write_text(json.dumps(meta, separators=(",", ":")))
    res = run_ok(cpu_binary, tiny_args(random_shards.train, random_shards.val, **{**RUN, "train.steps": 6}) + ["--checkpoint", ckpt, "--resume"])
    assert "no fp8 scale history" in res.stderr and [r["step"] for r in res.steps] == [5, 6], res.describe()


# a model of many thin layers: their histories, not the weights, are what grows
DEEP = {"model.d_model": 16, "model.n_head": 1, "train.batch_size": 1, "train.warmup_steps": 0, "eval.every": 0,
        "train.precision": "fp8"}


def test_more_layers_than_the_sidecar_holds_histories_for_are_refused_before_training(cpu_binary, random_shards, tmp_path):
    """The sidecar holds at most CKPT_SIDECAR_MAX bytes (checkpoint.h) and an fp8 run's histories grow
    with its layers: a run whose histories could outgrow it is refused at start (one error line
    naming the most layers, exit 2, nothing run or written), not at its first checkpoint after the
    training. That most is honest: its checkpoint, rewritten with every entry as long as an entry
    gets, resumes, and the checkpoint the resumed run writes from those histories is read again.
    Without a checkpoint, or in bf16, the deeper model trains."""
    def argv(layers, ckpt, **more):
        return tiny_args(random_shards.train, **{**DEEP, "model.n_layer": layers, "train.steps": 1, **more}) + \
            (["--checkpoint", ckpt] if ckpt else [])

    deep = tmp_path / "deep"
    deep.mkdir()
    res = eu.run_engine(cpu_binary, argv(1024, deep / "run.ckpt"))
    assert res.rc == 2 and len(res.errors) == 1 and "model.n_layer 1024" in res.errors[0], res.describe()
    assert res.steps == [] and res.events("memory") == [] and list(deep.iterdir()) == []
    most = int(res.errors[0].split("at most ")[1].split(" layers")[0])
    refused = eu.run_engine(cpu_binary, argv(most + 1, deep / "run.ckpt"))
    assert refused.rc == 2 and f"at most {most} layers" in refused.errors[0], refused.describe()
    assert [len(run_ok(cpu_binary, argv(most + 1, None, **extra)).steps) for extra in
            ({}, {"train.precision": "bf16", "checkpoint": deep / "bf16.ckpt"})] == [1, 1]

    ckpt = tmp_path / "most.ckpt"
    run_ok(cpu_binary, argv(most, ckpt))
    side = tmp_path / "most.ckpt.json"
    meta = json.loads(side.read_text())
    meta["fp8_history"]["exp"] = [[-126] * HISTORY_LEN for _ in meta["fp8_history"]["exp"]]
    side.write_text(json.dumps(meta, separators=(",", ":")))
    for steps in (2, 3):
        res = run_ok(cpu_binary, argv(most, ckpt, **{"train.steps": steps}) + ["--resume"])
        assert [r["step"] for r in res.steps] == [steps] and "fp8 scale history" not in res.stderr, res.describe()
    assert [h[:HISTORY_LEN - 2] for h in sidecar_history(ckpt)["exp"]] == [[-126] * (HISTORY_LEN - 2)] * (PER_LAYER * most)


def test_both_engines_refuse_the_deep_fp8_run_before_they_start(engine, random_shards, tmp_path):
    """The limit is the host's (train_loop.h), found before either engine sets up: the CUDA engine
    refuses as the CPU one, with the same line (on a GPU machine)."""
    res = eu.run_engine(engine.binary, tiny_args(random_shards.train, **{**DEEP, "model.n_layer": 1024,
                                                                          "train.steps": 1}) +
                        ["--checkpoint", tmp_path / "run.ckpt"])
    assert res.rc == 2 and len(res.errors) == 1 and "model.n_layer 1024" in res.errors[0], res.describe()
    assert res.records == [] and list(tmp_path.iterdir()) == []


def test_a_bf16_run_writes_no_histories(cpu_binary, random_shards, tmp_path):
    ckpt = tmp_path / "run.ckpt"
    run_ok(cpu_binary, tiny_args(random_shards.train, **{**RUN, "train.steps": 2, "train.warmup_steps": 0,
                                                         "eval.every": 0, "train.precision": "bf16"}) +
           ["--checkpoint", ckpt])
    assert "fp8_history" not in json.loads((tmp_path / "run.ckpt.json").read_text())


def test_two_ranks_agree_on_the_histories_without_allocating_in_the_loop(cpu_binary, random_shards, alloc_counter):
    """The agreement after every step (dist, §17) copies the histories through a buffer allocated at
    start, as every other buffer of the loop (tests/test_engine.py's shim and thread count)."""
    argv = tiny_args(random_shards.train, **{**RUN, "train.steps": 6, "eval.every": 0, "train.grad_accum": 2})
    ranks = Ranks(cpu_binary, argv, 2, extra_env={"LD_PRELOAD": str(alloc_counter), "OMP_NUM_THREADS": "2"})
    outs = [p.communicate(timeout=60) for p in ranks.procs]
    assert [p.returncode for p in ranks.procs] == [0, 0], [e for _, e in outs]
    lines = outs[0][0].splitlines()    # rank 0's: the other ranks' stdout is /dev/null
    assert any(l.startswith("ALLOC ") for l in lines), "the shim reported nothing: is it loaded?"
    first = next(i for i, l in enumerate(lines) if l.startswith('{"step"'))
    last = next(i for i, l in enumerate(lines) if l.startswith('{"event":"exit"'))
    in_loop = [l for l in lines[first:last] if "ALLOC" in l]
    assert not in_loop, f"{len(in_loop)} allocations inside the training loop, e.g. {in_loop[:5]}"


def test_two_ranks_hold_one_set_of_histories_and_resume_exactly(cpu_binary, random_shards, tmp_path):
    """dist (§17): after every step both ranks hold, entry by entry, the histories' largest amax over
    the ranks, so rank 0's sidecar resumes both. Rank 1 sees other windows than rank 0, so had it
    kept its own histories, resuming it from rank 0's would cast at other scales and the checkpoint
    would differ from the uninterrupted run's; the gradients' histories, pushed by the backward, too."""
    steps = 16

    def argv(ckpt):
        settings = {**RUN, "train.steps": steps, "train.grad_accum": 2, "eval.every": 0}
        return tiny_args(random_shards.train, **settings) + ["--checkpoint", str(ckpt)]

    full, ckpt = tmp_path / "full.ckpt", tmp_path / "stopped.ckpt"
    rcs, records, errs = Ranks(cpu_binary, argv(full), 2).finish()
    assert rcs == [0, 0], errs
    assert len([r for r in records if "loss" in r]) == steps
    ranks = Ranks(cpu_binary, argv(ckpt), 2)
    ranks.wait_rank0_step(3)
    for proc in ranks.procs:
        proc.send_signal(signal.SIGTERM)
    rcs, records, errs = ranks.finish()
    assert rcs == [0, 0], errs
    stopped_at = [e["step"] for e in records if e.get("event") == "exit"]
    assert len(stopped_at) == 1 and stopped_at[0] < steps, records
    # every rank pushed one entry a micro-batch: 2 a step, as many as one rank alone
    assert all(len(h) == min(HISTORY_LEN, 2 * stopped_at[0]) for h in sidecar_history(ckpt)["exp"])
    rcs, _, errs = Ranks(cpu_binary, argv(ckpt) + ["--resume"], 2).finish()
    assert rcs == [0, 0], errs
    assert not any("no fp8 scale history" in e for e in errs), errs
    assert ckpt.read_bytes() == full.read_bytes()
    assert sidecar_history(ckpt) == sidecar_history(full)


# ---------------------------------------------------------------------------------------------------
# the GPU engine (skipped without a GPU)

# head size 16 (FP8_SHAPES' odd model): the fallback, the flash kernels then the cast at the delayed
# scale; head size 32 (2 heads of d_model 64): Hopper's fused attention forward and backward, which
# write att's and dqkv's codes (seq_len 48: a partial tile)
GPU_HEADS = {"fallback": {}, "fused_attention": {"model.d_model": 64, "model.n_head": 2}}


# Not derived, and no GPU figure of the gaps is recorded: 3e-2 is the tolerance test_gpu's fp8
# tracking test had when these GPU tests landed and passed. test_gpu's derivation (LOSS_TOL["fp8"] +
# 1e-3) does not carry over: a scale one exponent apart puts a whole tensor on another grid, which no
# gradient test here bounds. worst_loss_gap prints the worst step's gap, so a GPU run under -s records
# the figure a derived bound needs.
DELAYED_TRACK_TOL = 3e-2


def gpu_settings(heads):
    return {**FP8_SHAPES["odd"], **GPU_HEADS[heads], "train.lr": 3e-3, "train.warmup_steps": 2,
            "train.precision": "fp8"}


@pytest.mark.gpu
@pytest.mark.parametrize("heads", sorted(GPU_HEADS))
def test_gpu_delayed_tracks_the_cpu_delayed_emulation(heads, cpu_binary, cuda_binary, random_shards, tmp_path):
    """As test_gpu's fp8 tracking test, within DELAYED_TRACK_TOL a step; both keep PER_LAYER x n_layer
    histories of the training micro-batches (their exponents may differ by one where a bf16 amax and
    an fp32 one fall on either side of a power of two)."""
    args = tiny_args(random_shards.train, **{**gpu_settings(heads), "train.steps": 10})
    runs = {name: run_ok(b, args + ["--checkpoint", tmp_path / f"{name}.ckpt"])
            for name, b in (("cpu", cpu_binary), ("gpu", cuda_binary))}
    gpu_losses, cpu_losses = ([r["loss"] for r in runs[n].steps] for n in ("gpu", "cpu"))
    gap = worst_loss_gap(gpu_losses, cpu_losses, f"delayed {heads}: GPU vs CPU emulation")
    assert gap <= DELAYED_TRACK_TOL, list(zip(gpu_losses, cpu_losses))
    hists = {name: sidecar_history(tmp_path / f"{name}.ckpt")["exp"] for name in runs}
    want = [10] * PER_LAYER * gpu_settings(heads)["model.n_layer"]
    assert [len(h) for h in hists["gpu"]] == want == [len(h) for h in hists["cpu"]]
    assert all(abs(a - b) <= 1 for hg, hc in zip(hists["gpu"], hists["cpu"]) for a, b in zip(hg, hc)), hists


@pytest.mark.gpu
@pytest.mark.parametrize("heads", sorted(GPU_HEADS))
def test_gpu_delayed_resumes_exactly_and_graphs_equal_eager(heads, cuda_binary, random_shards, tmp_path):
    args = tiny_args(random_shards.train, random_shards.val, **{**gpu_settings(heads), "train.steps": 60,
                                                                "train.grad_accum": 2, "eval.every": 20,
                                                                "eval.batches": 2})
    eu.check_exact_resume_after_sigterm(cuda_binary, args, 60, tmp_path)
    eager_ckpt = tmp_path / "eager.ckpt"
    eager = run_ok(cuda_binary, args + ["--checkpoint", eager_ckpt], env={"ANDREA_NO_GRAPH": "1"})
    assert eager_ckpt.read_bytes() == (tmp_path / "ref.ckpt").read_bytes()
    assert sidecar_history(eager_ckpt) == sidecar_history(tmp_path / "ref.ckpt")
    assert len(eager.steps) == 60
