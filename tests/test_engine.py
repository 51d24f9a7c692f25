"""Engine behaviour (docs/DESIGN.md §3, §8; flags/output/sidecar in docs/DESIGN.md), run on every engine the
`engine` fixture provides: the CPU engine always, the CUDA engine where a GPU and its binary exist.

Fast tests use the TINY model on random-token shards; one test trains on real Shakespeare shards.
"""
import errno
import fcntl
import json
import math
import glob
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import engine_util as eu
from engine_util import TINY, tiny_args

from microgpt.checkpoint import read_checkpoint, read_sidecar, write_checkpoint
from microgpt.shards import header_bytes

# Signals are sent when the record of step SIGNAL_STEP appears; RESUME has eval and sampling on, so
# their records (and random draws) are part of what must match exactly.
SIGNAL_STEP = 3
RESUME = {"train.steps": 30, "train.lr": 3e-3, "train.warmup_steps": 3,
          "eval.every": 5, "eval.batches": 2,
          "sample.every": 10, "sample.tokens": 6, "sample.prompt": ["1,2,3", "7"]}


def resume_settings(engine):
    """RESUME with enough steps that the signal lands well before the end: a TINY step takes a few ms
    on the CPU but far less on a GPU, so the GPU run is longer."""
    return {**RESUME, "train.steps": 30 if engine.name == "cpu" else 400}


def files_beside(path):
    """Names in a checkpoint's directory, to spot leftover temporary files."""
    return sorted(os.listdir(os.path.dirname(path)))


# ---------------------------------------------------------------------------------------------------
# 1, 2: exact resume after SIGTERM / SIGINT, SIGUSR1

@pytest.mark.parametrize("sig,accum", [(signal.SIGTERM, 1), (signal.SIGTERM, 2), (signal.SIGINT, 1)],
                         ids=["sigterm", "sigterm-accum2", "sigint"])
def test_exact_resume_after_signal(engine, random_shards, tmp_path, sig, accum):
    settings = {**resume_settings(engine), "train.grad_accum": accum}
    args = tiny_args(random_shards.train, random_shards.val, **settings)
    steps = settings["train.steps"]
    ref_ckpt, ckpt = tmp_path / "ref.ckpt", tmp_path / "run.ckpt"
    ref = eu.run_ok(engine.binary, args + ["--checkpoint", ref_ckpt])

    first = eu.run_with_signal(engine.binary, args + ["--checkpoint", ckpt], sig, SIGNAL_STEP)
    assert first.rc == 0, first.describe()
    stop = first.exit_event
    assert stop and stop["reason"] == "signal", first.describe()
    k = stop["step"]
    assert SIGNAL_STEP <= k < steps, f"signal landed at step {k}; the run must stop before its end {steps}"
    assert [r["step"] for r in first.steps] == list(range(1, k + 1)), "after the signal the engine finishes only the current step"
    assert any(c["step"] == k and c["reason"] == "signal" for c in first.events("checkpoint")), first.describe()
    assert read_checkpoint(ckpt).step == k
    assert read_sidecar(ckpt)["step"] == k

    second = eu.run_ok(engine.binary, args + ["--checkpoint", ckpt, "--resume"])
    assert second.events("start")[0]["step"] == k
    assert [r["step"] for r in second.steps] == list(range(k + 1, steps + 1))

    # Bit-exact: the float texts of every loss, lr, grad norm, val loss and every sampled token.
    assert eu.merged_exact_records(first, second) == eu.exact_records(ref)
    assert ckpt.read_bytes() == ref_ckpt.read_bytes(), "final checkpoints differ"


def test_resume_of_finished_run_does_nothing(engine, random_shards, tmp_path):
    ckpt = tmp_path / "done.ckpt"
    args = tiny_args(random_shards.train, **{"train.steps": 3, "checkpoint": ckpt})
    eu.run_ok(engine.binary, args)
    before = ckpt.read_bytes()
    again = eu.run_ok(engine.binary, args + ["--resume"])
    assert again.exit_event == {"event": "exit", "step": 3, "reason": "already_finished"}, again.describe()
    assert again.steps == []
    assert ckpt.read_bytes() == before


def test_resume_in_another_precision_starts_from_the_default_loss_scale(engine, random_shards, tmp_path):
    """A checkpoint's loss scale belongs to the precision that wrote it (fp32 runs record 1): resuming
    such a checkpoint in fp16 must start from the engine's default scale, not from 1."""
    ckpt = tmp_path / "run.ckpt"
    eu.run_ok(engine.binary, tiny_args(random_shards.train, **{"train.steps": 3, "checkpoint": ckpt}))
    same = eu.run_ok(engine.binary, tiny_args(random_shards.train, **{"train.steps": 4, "checkpoint": ckpt, "resume": True}))
    assert "loss scale starts from its default" not in same.stderr
    fp16 = eu.run_ok(engine.binary, tiny_args(random_shards.train, **{"train.steps": 6, "train.precision": "fp16",
                                                            "checkpoint": ckpt, "resume": True}))
    assert "written in fp32; the loss scale starts from its default" in fp16.stderr, fp16.stderr
    if engine.name == "cuda":  # the CPU engine computes in fp32 and reports no scale
        assert fp16.steps[0]["loss_scale"] >= 32768, fp16.steps[0]  # default 65536, at most one overflow


def test_a_resume_on_other_training_data_says_so(engine, random_shards, tmp_path):
    """`make data` run again between a run and its resume, or a glob that now matches another
    shard: the resume drew other batches than the run it continues, and said nothing. The sidecar
    now keeps the training data's fingerprint; a resume on the same data is silent, one on other
    data (a shard added; the same shards re-tokenized, equal in length) warns once and goes on."""
    ckpt = tmp_path / "run.ckpt"
    eu.run_ok(engine.binary, tiny_args(random_shards.train, **{"train.steps": 3, "checkpoint": ckpt}))
    assert isinstance(read_sidecar(ckpt)["data_crc32c"], int)
    saved = {p: Path(p).read_bytes() for p in (ckpt, f"{ckpt}.json")}
    shards = sorted(Path(random_shards.dir).glob("rand_train_*.bin"))
    added, retokenized = tmp_path / "added", tmp_path / "retokenized"
    for d in (added, retokenized):
        d.mkdir()
        for s in shards:
            shutil.copy(s, d / s.name)
    eu.write_random_shards(added, "rand_train_x", 1, 4096, eu.TINY_VOCAB, seed=9)
    tokens = np.fromfile(retokenized / shards[1].name, dtype="<u2", offset=1024)
    eu.write_shard(retokenized / shards[1].name, (tokens[::-1] + 1) % eu.TINY_VOCAB)
    for data, changed in ((random_shards.train, False), (added / "rand_train_*.bin", True),
                          (retokenized / "rand_train_*.bin", True)):
        for p, b in saved.items():
            Path(p).write_bytes(b)
        res = eu.run_ok(engine.binary, tiny_args(data, **{"train.steps": 4, "checkpoint": ckpt, "resume": True}))
        warnings = [l for l in res.stderr.splitlines() if "training data differ" in l]
        assert len(warnings) == int(changed), (data, res.stderr)
        assert [r["step"] for r in res.steps] == [4]


@pytest.mark.parametrize("value", [None, "1422946530", [1]], ids=["null", "text", "list"])
def test_a_data_fingerprint_that_is_no_number_says_so(engine, random_shards, tmp_path, value):
    """data_crc32c has no checksum (DESIGN.md §3: damage there gives the data warning, nothing
    worse), but one that is no number read as absent, as in a sidecar written before the member:
    the resume said nothing of whether its data were the run's. It says it cannot tell, once, and
    goes on."""
    ckpt = tmp_path / "run.ckpt"
    eu.run_ok(engine.binary, tiny_args(random_shards.train, **{"train.steps": 3, "checkpoint": ckpt}))
    side = read_sidecar(ckpt)
    side["data_crc32c"] = value
    Path(f"{ckpt}.json").write_text(json.dumps(side))
    res = eu.run_ok(engine.binary, tiny_args(random_shards.train, **{"train.steps": 4, "checkpoint": ckpt,
                                                                      "resume": True}))
    warnings = [l for l in res.stderr.splitlines() if "data_crc32c" in l]
    assert len(warnings) == 1 and warnings[0].startswith("warning: "), res.stderr
    assert [r["step"] for r in res.steps] == [4]


def test_sigusr1_checkpoints_and_training_continues(engine, random_shards, tmp_path):
    settings = resume_settings(engine)
    args = tiny_args(random_shards.train, random_shards.val, **settings)
    steps = settings["train.steps"]
    ref_ckpt, ckpt, snapshot = tmp_path / "ref.ckpt", tmp_path / "run.ckpt", tmp_path / "usr1.ckpt"
    ref = eu.run_ok(engine.binary, args + ["--checkpoint", ref_ckpt])

    proc = eu.start_engine(engine.binary, args + ["--checkpoint", ckpt])
    proc.wait_for(eu.is_step_record(SIGNAL_STEP))
    proc.send_signal(signal.SIGUSR1)
    event = proc.wait_for(lambda r: r.get("event") == "checkpoint")
    # Copy it before the final checkpoint replaces it (the run has many steps left to go).
    shutil.copyfile(ckpt, snapshot)
    shutil.copyfile(f"{ckpt}.json", f"{snapshot}.json")
    res = proc.finish()
    assert res.rc == 0, res.describe()

    k = event["step"]
    assert event["reason"] == "usr1" and SIGNAL_STEP <= k < steps, event
    assert read_checkpoint(snapshot).step == k
    assert res.exit_event["reason"] == "finished" and res.exit_event["step"] == steps
    assert [r["step"] for r in res.steps] == list(range(1, steps + 1))
    assert eu.exact_records(res) == eu.exact_records(ref), "SIGUSR1 changed the training"
    assert ckpt.read_bytes() == ref_ckpt.read_bytes()

    # The mid-run checkpoint is a real one: resuming from it reproduces the same end.
    resumed = eu.exact_records(eu.run_ok(engine.binary, args + ["--checkpoint", snapshot, "--resume"]))
    expected = eu.exact_records(ref)
    assert all(expected.get(key) == text for key, text in resumed.items())
    assert all(key in resumed for key in expected if key[1] > k)
    assert snapshot.read_bytes() == ref_ckpt.read_bytes()


# ---------------------------------------------------------------------------------------------------
# 3: checkpoint bytes, sidecar, and the first AdamW step against the dumped gradient

def test_checkpoint_layout_and_first_adamw_step(engine, random_shards, tmp_path):
    lr, beta1, beta2, eps = 1e-2, 0.9, 0.95, 1e-8
    # No clipping, no decay, constant LR: after one step m = (1-β1)·g, v = (1-β2)·g², and every
    # parameter moves by lr·g/(|g|+eps) (bias correction cancels the (1-β) factors).
    settings = {"train.steps": 1, "train.lr": lr, "train.warmup_steps": 0, "train.schedule": "constant",
                "train.grad_clip": 0, "train.weight_decay": 0, "train.beta1": beta1, "train.beta2": beta2,
                "train.eps": eps}
    ckpt, grads_path = tmp_path / "one.ckpt", tmp_path / "grads.bin"
    eu.run_ok(engine.binary, tiny_args(random_shards.train, **settings, checkpoint=ckpt))
    eu.run_ok(engine.binary, tiny_args(random_shards.train, **settings, dump_grads=grads_path))

    layout = eu.layout_for(TINY)
    n = layout["n_params"]
    assert ckpt.stat().st_size == 8 + 12 * n
    assert grads_path.stat().st_size == 4 + 4 * n
    c = read_checkpoint(ckpt)
    assert (c.step, c.n_params) == (1, n)
    loss, g = eu.read_grad_dump(grads_path)

    # Untrained logits are near zero, so the loss is near ln(real vocab), not ln(padded vocab). Derived:
    # the final LayerNorm (gamma 1, beta 0) gives |h|^2 ~ d, so logit z = h.wte[v] ~ N(0, d*0.02^2 = 0.0128)
    # and loss - ln V ~ E[lse] - ln V = sigma_z^2/2 = 0.0064 on average, varying as sigma_z/sqrt(B*T) = 0.014
    # over seeds. Measured on the CPU: 0.0150 for this test's seeds (data 1, train 1337); over 200 other
    # seed pairs mean 0.0076, sd 0.0154, range -0.042..0.047. The error it guards against, the padded
    # rows in the softmax, adds ln(64/60) = 0.0645 (0.0787 at these seeds, measured). 0.03 is about half
    # that gap: pass margin 0.015 (one seed sd) here, 0.049 to the padded value. Not tightened, since
    # anything nearer 0.0150 would rest on this one seed's draw rather than on the spread above.
    assert abs(loss - math.log(TINY["model.vocab_size"])) < 0.03, loss
    assert np.all(np.isfinite(g)) and np.count_nonzero(g) > 0.9 * (n - 4 * TINY["model.d_model"])

    # Bound, against float64 references: 1.0f - beta (exact in fp32) is 0.100000024 and 0.050000012,
    # each 2.384e-7 relative above 0.1 and 0.05; m = (1-beta1)*g adds one fp32 rounding (2^-24), v =
    # (1-beta2)*g*g two (the GPU's FMA fewer): m within 2.98e-7, v within 3.58e-7 relative, about three
    # fp32 ulps (2^-23). Measured on the CPU: 2.95e-7 and 3.36e-7. rtol 5e-7 and 6e-7: 1.7x margin.
    # atol is the smallest normal fp32, below which fp32 has no relative precision (measured: |m| >= 8e-10,
    # v >= 3e-18, so it covers only an underflowed moment; g = 0 gives exactly 0).
    tiny, g64 = float(np.finfo(np.float32).tiny), g.astype(np.float64)
    np.testing.assert_allclose(c.m, (1 - beta1) * g64, rtol=5e-7, atol=tiny)
    np.testing.assert_allclose(c.v, (1 - beta2) * g64 ** 2, rtol=6e-7, atol=tiny)
    assert np.all(c.v >= 0)

    # Padded embedding rows never get a target: zero gradient and zero moments.
    slices = eu.tensor_slices(layout)
    d, V = TINY["model.d_model"], TINY["model.vocab_size"]
    wte = slices["wte"][0]
    padded = slice(wte.start + V * d, wte.stop)
    assert not g[padded].any() and not c.m[padded].any() and not c.v[padded].any()

    # LayerNorms start at gamma = 1, beta = 0, so their values after one step are known exactly.
    # Bound, against this float64 reference: the engine's fp32 step lr*(m/c1)/(sqrt(v/c2)+eps) carries
    # about 8.5 roundings of 2^-24 (lr; m and m/c1; v's two, v/c2 and the square root's half of them plus
    # its own; + eps; the division; * lr): 5.1e-7 relative, 5.1e-9 on a step of 0.01. The new weight's
    # own rounding adds half an fp32 ulp of it: 2^-24 = 6.0e-8 for a gamma in [1, 1.01], 2^-31 = 4.7e-10
    # for a beta near +-0.01. So gamma within 6.5e-8, beta within 5.6e-9; measured on the CPU 5.9e-8 and
    # 1.7e-9. atol 1e-7 and 1e-8: 1.5x and 1.8x margin (rtol 0: the bound is absolute).
    step = lr * g64 / (np.abs(g64) + eps)
    for name, (sl, _) in slices.items():
        if ".gamma" in name or ".beta" in name:
            start, atol = (1.0, 1e-7) if name.endswith("gamma") else (0.0, 1e-8)
            np.testing.assert_allclose(c.params[sl], start - step[sl], rtol=0, atol=atol, err_msg=name)

    side = read_sidecar(ckpt)
    assert side["step"] == 1 and side["n_params"] == n and "loss_scale" in side and isinstance(side["fingerprint"], dict)
    assert files_beside(ckpt) == sorted(["one.ckpt", "one.ckpt.json", "one.ckpt.lock", "grads.bin"]), \
        "temporary files left behind"


# ---------------------------------------------------------------------------------------------------
# 4: bad checkpoints are refused and left alone; a full disk keeps the previous checkpoint

def _truncate(path):
    data = path.read_bytes()
    path.write_bytes(data[:-4])


def _wrong_n_params(path):
    c = read_checkpoint(path)
    raw = bytearray(path.read_bytes())
    raw[4:8] = np.array([c.n_params + 1], dtype="<i4").tobytes()  # size still that of the real shape
    path.write_bytes(bytes(raw))


def _other_shape(engine, shards, path):
    """A genuine checkpoint (with sidecar) of a model with a different d_model."""
    eu.run_ok(engine.binary, tiny_args(shards.train, **{"train.steps": 1, "model.d_model": 16, "checkpoint": path}))


# Genuine checkpoints of models whose shape differs from TINY's but whose parameter count is the
# same, so that only the sidecar tells them apart: one layer with an MLP of 322 for TINY's two of 128
# (4C² + 2CF + 4C per layer at C = 32), and TINY with 2 heads for 4 (no tensor's size shows n_head).
SAME_SIZE_SHAPES = {"one_wide_layer": {"model.n_layer": 1, "model.d_ff": 322}, "other_n_head": {"model.n_head": 2}}
DAMAGE = {"truncated": _truncate, "wrong_n_params": _wrong_n_params}


@pytest.mark.parametrize("damage", ["truncated", "wrong_n_params", "other_shape", *SAME_SIZE_SHAPES, "missing",
                                    "exists_without_resume"])
def test_bad_checkpoint_is_refused_and_left_alone(engine, random_shards, tmp_path, damage):
    """A checkpoint of another shape with TINY's parameter count passed the n_params check and was
    resumed with a warning: its tensors read as others (a layer norm's gains as weights), the run
    trained on and replaced it."""
    ckpt = tmp_path / "bad.ckpt"
    args = tiny_args(random_shards.train, **{"train.steps": 4, "checkpoint": ckpt})
    if damage == "other_shape":
        _other_shape(engine, random_shards, ckpt)
    elif damage in SAME_SIZE_SHAPES:
        eu.run_ok(engine.binary, tiny_args(random_shards.train, **{"train.steps": 2, "checkpoint": ckpt,
                                                                   **SAME_SIZE_SHAPES[damage]}))
        assert read_checkpoint(ckpt).n_params == eu.layout_for()["n_params"]
    elif damage != "missing":
        eu.run_ok(engine.binary, tiny_args(random_shards.train, **{"train.steps": 2, "checkpoint": ckpt}))
        DAMAGE.get(damage, lambda path: None)(ckpt)
    before = {name: (tmp_path / name).read_bytes() for name in files_beside(ckpt)}

    # exists_without_resume: a fresh run must not clobber a good checkpoint someone forgot to resume.
    res = eu.run_engine(engine.binary, args if damage == "exists_without_resume" else args + ["--resume"])
    assert res.rc == 2, res.describe()
    assert len(res.errors) == 1 and ("checkpoint" in res.errors[0] or "bad.ckpt" in res.errors[0]), res.describe()
    assert res.steps == [] and not res.events("memory"), "a refused checkpoint must stop the engine before training"
    after = {name: (tmp_path / name).read_bytes() for name in files_beside(ckpt)}
    assert after == before, "the refused checkpoint (or its directory) was modified"


def _limit_file_size(limit):
    def apply():
        # With SIGXFSZ ignored, a write past RLIMIT_FSIZE fails with EFBIG instead of killing the engine:
        # what a full disk looks like to the program (ENOSPC), without needing root to mount a tiny fs.
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return apply


def test_full_disk_keeps_previous_checkpoint(engine, random_shards, tmp_path):
    ckpt = tmp_path / "disk.ckpt"
    eu.run_ok(engine.binary, tiny_args(random_shards.train, train_steps=2, checkpoint=ckpt))
    before = {name: (tmp_path / name).read_bytes() for name in files_beside(ckpt)}
    size = ckpt.stat().st_size

    res = eu.run_engine(engine.binary, tiny_args(random_shards.train, train_steps=4, checkpoint=ckpt, resume=True), preexec_fn=_limit_file_size(size // 3))
    assert res.rc != 0, "a checkpoint that could not be written must not end in success\n" + res.describe()
    assert len(res.errors) == 1 and ("checkpoint" in res.errors[0] or "disk.ckpt" in res.errors[0]), res.describe()
    after = {name: (tmp_path / name).read_bytes() for name in files_beside(ckpt)}
    assert after == before, f"previous checkpoint damaged or temporary files left: {sorted(after)} vs {sorted(before)}"


def test_a_checkpoint_directory_that_cannot_take_one_is_refused_up_front(engine, random_shards):
    """/proc exists but takes no new file, as a read-only mount does: that was found at the first
    save, after every step up to it was trained (and lost)."""
    res = eu.run_engine(engine.binary, tiny_args(random_shards.train, **{"train.steps": 4, "checkpoint.every": 2,
                                                                       "checkpoint": "/proc/run.ckpt"}))
    assert res.rc == 2 and len(res.errors) == 1, res.describe()
    assert res.errors[0].startswith("error: cannot create files in checkpoint directory /proc "), res.errors
    assert res.steps == [] and not res.events("memory"), res.describe()


@pytest.mark.parametrize("length", [238, 246])
def test_a_checkpoint_name_too_long_for_its_temporary_files_is_refused_up_front(engine, random_shards, tmp_path,
                                                                                 length):
    """A name that fits the file system's 255 bytes but not with ".prev.json.tmpPID" added trained
    until the first (246) or second (238) save, then failed."""
    ckpt = tmp_path / ("c" * length)
    res = eu.run_engine(engine.binary, tiny_args(random_shards.train, **{"train.steps": 6, "checkpoint.every": 2,
                                                                       "checkpoint": ckpt}))
    assert res.rc == 2 and len(res.errors) == 1, res.describe()
    assert res.errors[0].startswith(f"error: checkpoint name {ckpt} is too long"), res.errors
    assert res.steps == [] and os.listdir(tmp_path) == [], res.describe()


def test_a_checkpoint_directory_without_room_for_one_is_refused_up_front(engine, random_shards, tiny_tmpfs):
    res = eu.run_engine(engine.binary, tiny_args(random_shards.train, **{"train.steps": 4, "checkpoint.every": 2,
                                                                       "checkpoint": tiny_tmpfs / "run.ckpt"}))
    assert res.rc == 2 and len(res.errors) == 1, res.describe()
    assert f"checkpoint directory {tiny_tmpfs} has 65536 bytes free" in res.errors[0], res.errors
    assert res.steps == [] and os.listdir(tiny_tmpfs) == [], res.describe()


def test_a_run_that_fits_its_disk_resumes_on_it(engine, random_shards, three_checkpoint_tmpfs):
    """The up-front check asked for a whole CKPT_SIDECAR_MAX (64 KiB) of room for the sidecar, whatever
    the model, where the test model's takes one block: a run that had saved both slots on this disk,
    and whose next save fits, was refused at its resume."""
    ckpt = three_checkpoint_tmpfs / "run.ckpt"
    settings = {**CONSTANT_LR, "checkpoint.every": 2}
    ref = eu.run_ok(engine.binary, tiny_args(random_shards.train, **settings, train_steps=6,
                                               checkpoint=three_checkpoint_tmpfs / "ref.ckpt"))
    assert [c["step"] for c in ref.events("checkpoint")] == [2, 4, 6], ref.describe()
    for name in os.listdir(three_checkpoint_tmpfs):
        os.unlink(three_checkpoint_tmpfs / name)
    eu.run_ok(engine.binary, tiny_args(random_shards.train, **settings, train_steps=4, checkpoint=ckpt))
    again = eu.run_ok(engine.binary, tiny_args(random_shards.train, **settings, train_steps=6, checkpoint=ckpt,
                                               resume=True))
    assert [c["step"] for c in again.events("checkpoint")] == [6], again.describe()
    assert read_checkpoint(ckpt).step == 6 and read_checkpoint(f"{ckpt}.prev").step == 4


def test_temporary_files_of_a_killed_writer_are_removed(engine, random_shards, tmp_path):
    """A writer killed mid-checkpoint leaves PATH.tmpPID behind; the next save removes it (its
    process is gone) and leaves a live process's temporary file alone."""
    ckpt = tmp_path / "run.ckpt"
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # a pid that certainly ran and is gone (pids are not reused this quickly)
    stale = [tmp_path / f"run.ckpt.tmp{dead.pid}", tmp_path / f"run.ckpt.json.tmp{dead.pid}"]
    live = tmp_path / f"run.ckpt.tmp{os.getpid()}"
    other = tmp_path / "run.ckpt.tmpnotapid"
    for p in stale + [live, other]:
        p.write_bytes(b"partial")
    res = eu.run_ok(engine.binary, tiny_args(random_shards.train, train_steps=2, checkpoint=ckpt))
    assert not any(p.exists() for p in stale), sorted(os.listdir(tmp_path))
    assert live.exists() and other.exists()
    assert sum("no longer runs" in line for line in res.stderr.splitlines()) == 2, res.describe()


# ---------------------------------------------------------------------------------------------------
# 5: bad input, one error line, exit 2, before any large allocation

# Valid but enormous (~1.3e9 parameters, >20 GB of state; n_params still fits the int32 header): an
# engine that allocated before validating would run into the address-space limit set below (CPU) or
# print its memory event (GPU) instead of the input error.
HUGE = {"model.d_model": 1024, "model.n_layer": 100, "model.n_head": 16}
ADDRESS_SPACE_LIMIT = 2 << 30


@pytest.fixture(scope="session")
def bad_shards(tmp_path_factory):
    d = tmp_path_factory.mktemp("bad_shards")
    good = np.arange(4096) % eu.TINY_VOCAB
    paths = {}

    def shard(name, tokens, patch=None):
        path = d / f"{name}.bin"
        eu.write_shard(path, tokens)
        if patch:
            raw = bytearray(path.read_bytes())
            patch(raw)
            path.write_bytes(bytes(raw))
        paths[name] = str(path)

    def set_word(i, value):
        def patch(raw):
            raw[4 * i:4 * i + 4] = np.array([value], dtype="<i4").tobytes()
        return patch

    shard("bad_magic", good, set_word(0, 20240521))
    shard("bad_version", good, set_word(1, 7))
    shard("wrong_size", good, set_word(2, 4097))  # header promises one more token than the file holds
    shard("token_too_big", np.where(good == 5, eu.TINY_VOCAB, good))  # one id == vocab_size (a padded row)
    shard("short", good[:12])  # fewer than seq_len + 1 tokens
    shard("negative_count", good, set_word(2, -1))
    return paths


# (id, overrides of tiny_args, extra args, words of which the error line must contain one)
BAD_INPUTS = [
    ("unknown_flag", {}, ["--model.n_layers", "2"], ["model.n_layers"]),
    ("malformed_int", {"model.n_layer": "2x"}, [], ["model.n_layer"]),
    ("malformed_float", {"train.lr": "1e-3e"}, [], ["train.lr"]),
    ("int_overflow", {"train.steps": "99999999999"}, [], ["train.steps"]),
    ("negative_steps", {"train.steps": "-1"}, [], ["train.steps"]),
    ("missing_value", {}, ["--train.lr"], ["train.lr"]),
    ("missing_required", {"train.steps": None}, [], ["train.steps"]),
    ("zero_layers", {"model.n_layer": 0}, [], ["n_layer"]),
    ("too_many_params", {"model.d_model": 65536, "model.n_layer": 1000}, [], ["parameters", "n_params"]),
    ("zero_batch", {"train.batch_size": 0}, [], ["batch_size"]),
    ("n_head_not_dividing", {"model.n_head": 5}, [], ["n_head"]),
    ("padded_below_vocab", {"model.padded_vocab_size": 32}, [], ["padded_vocab_size"]),
    ("bad_precision", {"train.precision": "fp64"}, [], ["precision"]),
    ("bad_schedule", {"train.schedule": "linear"}, [], ["schedule"]),
    ("missing_train_shard", {"data.train": "/nonexistent/dir/x_*.bin"}, [], ["/nonexistent/dir/x_*.bin"]),
    ("missing_val_shard", {"data.val": "/nonexistent/dir/v_*.bin"}, [], ["/nonexistent/dir/v_*.bin"]),
    ("bad_magic", {"data.train": "@bad_magic"}, [], ["magic"]),
    ("bad_version", {"data.train": "@bad_version"}, [], ["version"]),
    ("wrong_size", {"data.train": "@wrong_size"}, [], ["size", "bytes"]),
    ("token_too_big", {"data.train": "@token_too_big"}, [], ["vocab"]),
    ("val_token_too_big", {"data.val": "@token_too_big"}, [], ["vocab"]),
    ("seq_len_too_long", {"data.train": "@short"}, [], ["seq_len"]),
    ("prompt_token_too_big", {"sample.every": 1, "sample.prompt": "1,60"}, [], ["prompt"]),
    ("malformed_prompt", {"sample.every": 1, "sample.prompt": "1,x"}, [], ["prompt"]),
    ("resume_without_checkpoint", {}, ["--resume"], ["checkpoint"]),
    # strtoll and strtod take leading blanks and strtod hexadecimal, where "5 " and "0x10" were refused
    ("int_leading_blank", {"train.steps": " 5"}, [], ["train.steps"]),
    ("float_leading_blank", {"train.lr": " 1e-3"}, [], ["train.lr"]),
    ("hex_float", {"train.lr": "0x1p-10"}, [], ["train.lr"]),
    ("prompt_id_with_blank", {"sample.every": 1, "sample.prompt": "1, 2"}, [], ["prompt"]),
    ("prompt_id_with_sign", {"sample.every": 1, "sample.prompt": "1,+2"}, [], ["prompt"]),
    ("negative_token_count", {"data.train": "@negative_count"}, [], ["token count is -1"]),
    # a float holds it as 0, which to grad_clip means "off": a tiny clip turned clipping off
    ("float_underflow", {"train.grad_clip": "1e-50"}, [], ["train.grad_clip"]),
    # below a double too: strtod gives 0 with ERANGE, which was taken as the value 0
    ("double_underflow", {"train.grad_clip": "1e-400"}, [], ["train.grad_clip"]),
]


def _limit_address_space():
    resource.setrlimit(resource.RLIMIT_AS, (ADDRESS_SPACE_LIMIT, ADDRESS_SPACE_LIMIT))


def _bad_input_run(engine, args):
    # CUDA reserves a huge virtual address range at init, so only the CPU engine gets the limit.
    preexec = _limit_address_space if engine.name == "cpu" else None
    return eu.run_engine(engine.binary, args, timeout=60, preexec_fn=preexec)


@pytest.mark.parametrize("case_id,overrides,extra,words", BAD_INPUTS, ids=[c[0] for c in BAD_INPUTS])
def test_bad_input_is_one_clear_error(engine, random_shards, bad_shards, case_id, overrides, extra, words):
    overrides = {k: (bad_shards[v[1:]] if isinstance(v, str) and v.startswith("@") else v) for k, v in overrides.items()}
    args = tiny_args(random_shards.train, random_shards.val, **{**HUGE, **overrides}) + extra
    res = _bad_input_run(engine, args)
    assert res.rc == 2, res.describe()
    assert len(res.errors) == 1, res.describe()
    assert any(w.lower() in res.errors[0].lower() for w in words), f"error does not name the problem {words}: {res.errors[0]}"
    # Validation comes before the work: the engine reports its start (then allocates, and reports
    # the memory plan) only after every input was found good, so a refused run writes no record at
    # all (the CPU engine's address-space limit above catches an allocation made before the check).
    assert res.records == [] and res.stdout == "", "error came after start-up began\n" + res.describe()


@pytest.mark.parametrize("mode", ["--generate", "--evaluate"])
@pytest.mark.parametrize("flag", ["name", "data.sources.0.name"])
def test_a_flag_value_that_spells_a_mode_flag_trains(engine, random_shards, mode, flag):
    """The mode was picked by scanning the command line for "--generate" or "--evaluate" anywhere,
    a flag's value too: a run named "--generate", or a config's data source so named (a valid
    source name, which the proxy passes on), went to that mode and stopped with "checkpoint  does
    not exist"."""
    settings = {"name": mode} if flag == "name" else {
        "data.train": None, "data.sources.0.name": mode, "data.sources.0.train": random_shards.train}
    res = eu.run_ok(engine.binary, tiny_args(random_shards.train, train_steps=1, **settings))
    start = res.events("start")[0]
    assert res.exit_event["reason"] == "finished" and mode in (start["name"], *start.get("sources", [])), res.describe()


def test_a_model_beyond_the_machines_memory_is_one_error_line(cpu_binary, random_shards):
    """Each buffer alone may pass the kernel's overcommit check while all of them together do not
    fit: the run was then killed by the OOM killer without a word once the first step touched them.
    The CPU engine compares its memory plan with the machine's RAM and swap first (the GPU engine
    its device's free memory, §3.4)."""
    meminfo = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
    have = sum(int(meminfo[k].split()[0]) * 1024 for k in ("MemTotal", "SwapTotal"))
    # batch_size x seq_len rows of padded_vocab_size probabilities: twice the machine's RAM and swap
    vocab = 1 << 20
    batch = min(1 << 20, 2 * have // (4 * 16 * vocab) + 1)
    res = eu.run_engine(cpu_binary, tiny_args(random_shards.train, **{
        "model.n_layer": 1, "model.d_model": 16, "model.n_head": 1, "model.d_ff": 16, "model.seq_len": 16,
        "model.padded_vocab_size": vocab, "train.batch_size": batch}), preexec_fn=_limit_address_space)
    assert res.rc == 1 and len(res.errors) == 1, res.describe()
    assert "of host memory" in res.errors[0] and "the machine has" in res.errors[0], res.describe()
    assert res.steps == [], res.describe()


def test_a_shard_the_kernel_cannot_map_is_the_machines_limit(cpu_binary, tmp_path):
    """A valid shard that mmap refuses with ENOMEM (past the address-space limit here; the same
    error comes after vm.max_map_count shards, 65530 by default) was "cannot map shard X", exit 2:
    no reason given, and the shard blamed as bad input. Now the reason, the limits, and exit 1."""
    shard = tmp_path / "sparse_000000.bin"
    with open(shard, "wb") as f:  # 4 GB of token 0, sparse: valid, and more than the limit below
        f.write(header_bytes(2**31 - 1))
        f.truncate(1024 + 2 * (2**31 - 1))
    res = eu.run_engine(cpu_binary, tiny_args(str(shard)), timeout=60, preexec_fn=_limit_address_space)
    assert res.rc == 1 and len(res.errors) == 1, res.describe()
    assert f"cannot map shard {shard}" in res.errors[0] and os.strerror(errno.ENOMEM) in res.errors[0], res.describe()
    assert "vm.max_map_count" in res.errors[0], res.describe()


def test_huge_shape_is_really_too_big(engine, random_shards):
    """Control for the bad-input tests: with valid input, HUGE does fail (out of memory), so an input
    error that comes out instead shows validation ran before allocation."""
    if engine.name != "cpu":
        pytest.skip("the address-space limit only applies to the CPU engine")
    res = _bad_input_run(engine, tiny_args(random_shards.train, random_shards.val, **HUGE))
    assert res.rc != 0 and res.steps == [], res.describe()


# ---------------------------------------------------------------------------------------------------
# 6: nothing is allocated inside the training loop

@pytest.fixture(scope="session")
def alloc_counter(tmp_path_factory):
    return eu.build_shim(tmp_path_factory, "alloc_counter")


def test_no_allocation_in_training_loop(engine, random_shards, alloc_counter):
    if engine.name != "cpu":
        pytest.skip("host allocations of the CUDA runtime are not ours; test_device_memory_is_constant covers the GPU")
    # OMP_NUM_THREADS=2 (not 1): libgomp mallocs a new team for every parallel region that runs with a
    # single thread, but reuses its cached team when a region has several threads. Verified with a
    # small OpenMP program under this shim (1 thread: an ALLOC per region; 2 or 4 threads: none).
    args = tiny_args(random_shards.train, random_shards.val, **{
        "train.steps": 6, "eval.every": 2, "eval.batches": 2, "sample.every": 3, "sample.tokens": 4,
        "sample.prompt": ["1,2", "3"], "checkpoint.every": 0})
    res = eu.run_ok(engine.binary, args, env={"LD_PRELOAD": str(alloc_counter), "OMP_NUM_THREADS": "2"})
    lines = res.lines
    assert any(l.startswith("ALLOC ") for l in lines), "the shim reported nothing: is it loaded?"
    first = next(i for i, l in enumerate(lines) if l.startswith('{"step"'))
    last = next(i for i, l in enumerate(lines) if l.startswith('{"event":"exit"'))
    in_loop = [l for l in lines[first:last] if "ALLOC" in l]
    assert not in_loop, f"{len(in_loop)} allocations inside the training loop, e.g. {in_loop[:5]}"
    assert res.vals and res.events("sample"), "eval and sampling must have run inside the loop"


def test_device_memory_is_constant(engine, random_shards):
    if engine.name != "cuda":
        pytest.skip("device_memory events come from the GPU engine")
    res = eu.run_ok(engine.binary, tiny_args(random_shards.train, random_shards.val, **{
        "train.steps": 6, "eval.every": 2, "sample.every": 3, "sample.prompt": "1,2"}))
    mem = res.events("device_memory")
    assert len(mem) >= 2 and len({m["bytes"] for m in mem}) == 1, mem


# ---------------------------------------------------------------------------------------------------
# 7: training on real text lowers the loss

SHAKESPEARE = {"train": eu.REPO / "data/shakespeare/shakespeare_train_000000.bin",
               "val": eu.REPO / "data/shakespeare/shakespeare_val_000000.bin"}


@pytest.fixture(scope="session")
def shakespeare_shards():
    if not all(p.exists() for p in SHAKESPEARE.values()):
        script = eu.REPO / "scripts" / "prepare-data.py"
        assert script.exists(), f"{script} is missing: it prepares {SHAKESPEARE['train']}"
        # --source chitchat: the offline path; the Shakespeare shards don't depend on the source.
        prep = subprocess.run([sys.executable, str(script), "--source", "chitchat"], cwd=eu.REPO, capture_output=True, text=True,
                              timeout=900, env=eu.python_env())
        assert prep.returncode == 0, f"prepare-data.py failed:\n{prep.stdout[-2000:]}\n{prep.stderr[-2000:]}"
    return SHAKESPEARE


def test_training_on_shakespeare_lowers_val_loss(engine, shakespeare_shards):
    # The full GPT-2 vocabulary makes the classifier the whole cost; B·T = 64 tokens per step keeps
    # 80 steps within ~30 s on two busy cores. That is enough to go from ln(V) = 10.8 to below 7.8.
    vocab = 50259
    args = tiny_args(shakespeare_shards["train"], shakespeare_shards["val"], **{
        "model.vocab_size": vocab, "model.padded_vocab_size": 50304, "model.d_model": 64,
        "model.seq_len": 16, "train.batch_size": 4, "train.steps": 80, "train.lr": 1e-2,
        "train.warmup_steps": 5, "train.min_lr": 1e-3, "eval.every": 20, "eval.batches": 2})
    res = eu.run_ok(engine.binary, args, timeout=300)
    first_loss = res.steps[0]["loss"]
    vals = [v["val_loss"] for v in res.vals]
    assert abs(first_loss - math.log(vocab)) < 0.2, f"untrained loss {first_loss} should be near ln({vocab})"
    assert len(vals) == 4 and all(b < a for a, b in zip(vals, vals[1:])), f"val loss must fall at every eval: {vals}"
    assert vals[-1] < vals[0] - 0.4, vals
    assert vals[-1] < math.log(vocab) - 3.0, f"val loss {vals} did not fall well below ln(vocab) = {math.log(vocab):.2f}"


# ---------------------------------------------------------------------------------------------------
# 8: determinism, flag syntax, --help, the output contract

def test_identical_runs_are_identical(engine, random_shards, tmp_path):
    args = tiny_args(random_shards.train, random_shards.val, **{**RESUME, "train.steps": 8})
    a = eu.run_ok(engine.binary, args + ["--checkpoint", tmp_path / "a.ckpt"])
    b = eu.run_ok(engine.binary, args + ["--checkpoint", tmp_path / "b.ckpt"])
    assert eu.exact_records(a) == eu.exact_records(b)
    assert (tmp_path / "a.ckpt").read_bytes() == (tmp_path / "b.ckpt").read_bytes()
    # ... and the seed matters, so the comparison above is not vacuous.
    c = eu.run_ok(engine.binary, args + ["--train.seed", "7"])
    assert [r["loss"] for r in c.steps] != [r["loss"] for r in a.steps]


@pytest.mark.parametrize("train", [
    {"schedule": "cosine", "warmup_steps": 3, "min_lr": 1e-4},
    {"schedule": "wsd", "warmup_steps": 0, "min_lr": 1e-4, "decay_frac": 0.25},
    {"schedule": "wsd", "warmup_steps": 8, "min_lr": 1e-4, "decay_frac": 0.5},  # decay would start in warmup
    {"schedule": "wsd", "warmup_steps": 0, "min_lr": 1e-4, "decay_frac": 0.2, "steps": 1},  # one step: min_lr
    {"schedule": "constant", "warmup_steps": 4},
], ids=["cosine", "wsd", "wsd-short-after-warmup", "wsd-one-step", "constant"])
def test_lr_schedule_matches_the_python_statement_of_design(cpu_binary, random_shards, train):
    """The engine's lr per step equals bench_common.lr_at (DESIGN.md's schedule, which the PyTorch
    baseline trains with), including the edge cases the C code handles on its own."""
    from bench_common import lr_at, train_settings
    given = {"steps": 12, "lr": 1e-3, **train}
    res = eu.run_engine(cpu_binary, tiny_args(random_shards.train, **{f"train.{k}": v for k, v in given.items()}))
    t = train_settings({"train": given})  # the engine's defaults for what is not given
    assert res.rc == 0, res.describe()
    assert len(res.steps) == t["steps"]
    for r in res.steps:
        assert r["lr"] == pytest.approx(lr_at(r["step"] - 1, t), rel=1e-7), r


def test_equals_form_of_flags(engine, random_shards):
    spaced = tiny_args(random_shards.train, **{"train.steps": 3})
    joined = [f"{spaced[i]}={spaced[i + 1]}" for i in range(0, len(spaced), 2)]
    assert eu.exact_records(eu.run_ok(engine.binary, spaced)) == eu.exact_records(eu.run_ok(engine.binary, joined))


def design_flags():
    """Every flag in docs/DESIGN.md's flag table (the one list of flags)."""
    text = (eu.REPO / "docs" / "DESIGN.md").read_text()
    section = text.split("### 4.1 Flags are the config keys", 1)[1].split("\n## ", 1)[0]
    flags = set(re.findall(r"`(--[a-z][a-zA-Z0-9_.-]*)", section))  # N: a list item's index
    assert len(flags) > 30, flags
    return sorted(flags)


def test_help_lists_every_flag(engine):
    res = eu.run_engine(engine.binary, ["--help"], timeout=30)
    assert res.rc == 0, res.describe()
    text = res.stdout + res.stderr
    missing = [f for f in design_flags() if not re.search(re.escape(f) + r"(?![\w.-])", text)]
    assert not missing, f"--help does not mention {missing}"
    undocumented = sorted(set(help_lines(engine)) - {f[2:] for f in design_flags()})
    assert not undocumented, f"docs/DESIGN.md §4.1 does not list {undocumented}"


def help_lines(engine):
    """--help's flag lines by flag name: "--name METAVAR help [note]"."""
    res = eu.run_engine(engine.binary, ["--help"], timeout=30)
    assert res.rc == 0, res.describe()
    lines = [ln.strip() for ln in res.stdout.splitlines() if ln.startswith("  --")]
    return {ln.split()[0][2:]: ln for ln in lines}


def test_flags_json_agrees_with_help(engine):
    """--flags-json (for the proxy) and --help (for people) come from the one flag table: the same
    flags, each with the same type or choices, help text, required mark and default."""
    res = eu.run_engine(engine.binary, ["--flags-json"], timeout=30)
    assert res.rc == 0 and res.stderr == "", res.describe()
    flags = json.loads(res.stdout)["flags"]
    by_name = {f["name"]: f for f in flags}
    assert len(by_name) == len(flags) > 30
    lines = help_lines(engine)
    assert set(lines) == set(by_name) | {"help", "flags-json", "print-config", "layout-json"}
    types = {"int", "float", "str", "path", "glob", "prompt", "bool"}
    for f in flags:
        line, name = lines[f["name"]], f["name"]
        assert f["type"] in types, f
        metavar = "|".join(f["choices"]) if f["choices"] else f["type"]
        after = line[len(name) + 2:].lstrip()
        if f["type"] == "bool":
            assert after.startswith(f["help"]), (line, f)
        else:
            assert after.startswith(metavar + " ") and f["help"] in after, (line, f)
        assert ("[required]" in line) == (f["required"] is True), (line, f)
        assert ("[required with any" in line) == (f["required"] == "section"), (line, f)
        shown = re.search(r"\[default (\S+)\]$", line)
        if f["default"] is None or f["type"] == "bool":
            assert not shown, (line, f)
        else:
            parse = {"int": int, "float": float}.get(f["type"], str)
            assert shown and parse(shown.group(1)) == f["default"], (line, f)
        if f["type"] in ("int", "float"):
            assert f["min"] <= f["max"], f
            if f["default"] is not None:
                assert f["min"] <= f["default"] <= f["max"], f
    assert by_name["train.precision"]["choices"] == ["fp32", "tf32", "bf16", "fp16", "fp8"]
    assert by_name["data.train"]["type"] == "glob" and by_name["checkpoint"]["type"] == "path"
    assert by_name["model.vocab_size"]["default"] == 50259 and by_name["train.lr"]["default"] == 6e-4


def test_print_config_gives_every_flag_with_defaults_applied(engine):
    """--print-config: the value of every flag of the table once parsed, given ones as given, the rest
    at their defaults (derived ones derived), floats as the engine holds them; exit 0, nothing run."""
    table = json.loads(eu.run_engine(engine.binary, ["--flags-json"], timeout=30).stdout)["flags"]
    res = eu.run_engine(engine.binary, ["--model.n_layer", "2", "--model.d_model", "48", "--model.n_head", "4",
                                        "--model.seq_len", "16", "--model.vocab_size", "100", "--train.lr", "0.001",
                                        "--sample.prompt", "5,6", "--resume", "--print-config"], timeout=30)
    assert res.rc == 0 and res.stderr == "", res.describe()
    got = json.loads(res.stdout)
    assert set(got) == {f["name"] for f in table}
    assert got["model.d_model"] == 48 and got["model.d_ff"] == 4 * 48             # derived: 4 * d_model
    assert got["model.padded_vocab_size"] == 128                                   # 100 rounded up to 64
    assert got["train.lr"] == pytest.approx(0.001, rel=1e-7) and got["train.lr"] != 0.001  # float32, as held
    assert got["sample.prompt"] == [[5, 6]] and got["resume"] is True and got["checkpoint"] == ""
    for f in table:
        if f["default"] is not None and f["type"] in ("int", "str", "glob", "path") and f["name"] not in (
                "model.vocab_size",):
            assert got[f["name"]] == f["default"], f
    bad = eu.run_engine(engine.binary, ["--model.d_ff", "0", "--print-config"], timeout=30)
    assert bad.rc == 2 and "model.d_ff" in bad.stderr and bad.stdout == ""     # values are still range-checked


def test_layout_json_publishes_the_flat_vector_of_design(engine, random_shards, tmp_path):
    """--layout-json: the tensors of the flat vector in docs/DESIGN.md §2's order, with their shapes,
    contiguous offsets and the weight-decay mask (2-D tensors only); n_params is what the engine
    trains and checkpoints. Only the model flags are needed; a missing one is one error line."""
    shape = {"model.n_layer": 2, "model.d_model": 8, "model.n_head": 2, "model.seq_len": 5,
             "model.vocab_size": 60, "model.d_ff": 12}
    res = eu.run_engine(engine.binary, [*eu.flag_list(shape), "--layout-json"], timeout=30)
    assert res.rc == 0 and res.stderr == "", res.describe()
    layout = json.loads(res.stdout)
    d, f, Vp, T = 8, 12, 64, 5
    per_layer = [("W_Q", [d, d]), ("W_K", [d, d]), ("W_V", [d, d]), ("W_O", [d, d]), ("W_1", [d, f]),
                 ("W_2", [f, d]), ("ln1.gamma", [d]), ("ln1.beta", [d]), ("ln2.gamma", [d]), ("ln2.beta", [d])]
    want = ([("wte", [Vp, d]), ("wpe", [T, d])] + [(f"h{l}.{n}", s) for l in range(2) for n, s in per_layer]
            + [("lnf.gamma", [d]), ("lnf.beta", [d])])
    assert [(t["name"], t["shape"]) for t in layout["tensors"]] == want
    at = 0
    for t in layout["tensors"]:
        assert t["offset"] == at and t["decay"] == (len(t["shape"]) == 2), t
        at += int(np.prod(t["shape"]))
    assert layout["n_params"] == at

    ckpt = tmp_path / "x.ckpt"
    run = eu.run_ok(engine.binary, tiny_args(random_shards.train, **{**shape, "train.steps": 1}, checkpoint=ckpt))
    assert run.records[0]["n_params"] == layout["n_params"] == read_checkpoint(ckpt).n_params
    missing = eu.run_engine(engine.binary, ["--model.d_model", "8", "--layout-json"], timeout=30)
    assert missing.rc == 2 and missing.stdout == "" and len(missing.errors) == 1, missing.describe()
    assert "--model." in missing.errors[0]


@pytest.mark.parametrize("overrides,words", [
    ({"model.n_head": 5}, "must divide model.d_model"),
    ({"model.vocab_size": 100}, "smaller than model.vocab_size"),
    ({"model.d_model": 65536, "model.n_head": 1, "model.n_layer": 1000}, "checkpoint format holds at most"),
], ids=["n_head_not_dividing", "padded_below_vocab", "too_many_params"])
def test_layout_json_of_a_model_no_engine_runs_is_one_error(engine, overrides, words):
    """--layout-json checked only that the model flags were there: a model that training refuses
    (n_head not dividing d_model, fewer embedding rows than tokens, more parameters than a
    checkpoint holds) got a layout on stdout and exit 0, for programs to read as the engine's."""
    model = {k: v for k, v in TINY.items() if k.startswith("model.")}
    res = eu.run_engine(engine.binary, [*eu.flag_list({**model, **overrides}), "--layout-json"], timeout=30)
    assert res.rc == 2 and res.stdout == "" and len(res.errors) == 1, res.describe()
    assert words in res.errors[0], res.errors


def test_output_follows_contract(engine, random_shards, tmp_path):
    B, T, steps = TINY["train.batch_size"], TINY["model.seq_len"], 8
    prompts = [[1, 2, 3], [7]]
    ckpt = tmp_path / "c.ckpt"
    res = eu.run_ok(engine.binary, tiny_args(random_shards.train, random_shards.val, **{
        "train.steps": steps, "train.grad_accum": 2, "eval.every": 4, "eval.batches": 2,
        "sample.every": 1, "sample.tokens": 8, "sample.top_k": 64,
        "sample.prompt": [",".join(map(str, p)) for p in prompts],
        "checkpoint.every": 4, "checkpoint": ckpt}))
    assert len(res.records) == len(res.lines), "every stdout line must be one JSON object"
    tokens_per_step = B * T * 2

    start = res.records[0]
    assert start["event"] == "start" and start["engine"] == engine.name and start["step"] == 0
    assert start["steps"] == steps and start["tokens_per_step"] == tokens_per_step
    assert start["n_params"] == eu.layout_for(TINY)["n_params"]
    if engine.name == "cpu":
        assert start["compute_precision"] == "fp32"
    mem = res.events("memory")
    assert len(mem) == 1 and mem[0]["total_bytes"] == sum(mem[0]["groups"].values())

    want = {"step", "loss", "lr", "grad_norm", "ms", "tokens_per_s", "tokens", "phase"}
    assert [r["step"] for r in res.steps] == list(range(1, steps + 1))
    for r in res.steps:
        assert want <= set(r), r
        assert r["tokens"] == r["step"] * tokens_per_step and r["phase"] == "pretrain"
        assert all(math.isfinite(r[k]) for k in ("loss", "lr", "grad_norm")) and r["grad_norm"] > 0
    assert [v["step"] for v in res.vals] == [4, 8]

    samples = res.events("sample")
    assert len(samples) == steps * len(prompts)
    drawn = []
    for s in samples:
        assert s["prompt_tokens"] == prompts[s["prompt"]] and len(s["tokens"]) == 8
        drawn += s["tokens"]
    # 128 draws at top_k = padded vocab: a sampler that could pick the 4 padded rows almost surely would.
    assert max(drawn) < TINY["model.vocab_size"] and min(drawn) >= 0

    ckpts = res.events("checkpoint")
    assert any(c["step"] == 4 and c["reason"] == "periodic" for c in ckpts), ckpts
    assert ckpts[-1]["step"] == steps and ckpts[-1]["path"] == str(ckpt)
    assert res.records[-1] == {"event": "exit", "step": steps, "reason": "finished"}


def test_a_non_blocking_stdout_loses_no_line_to_a_slow_reader(cpu_binary, random_shards):
    """A stdout pipe whose open file is non-blocking (O_NONBLOCK, set by a launcher): once the
    reader fell behind and the pipe was full, each line's write failed with EAGAIN and was dropped
    without a word, the exit line too, and the run exited 0. The engine now waits for its reader."""
    steps = 300
    out_r, out_w = os.pipe()
    fcntl.fcntl(out_w, fcntl.F_SETPIPE_SZ, 4096)  # one page: some 20 lines fill it
    os.set_blocking(out_w, False)
    proc = subprocess.Popen([str(cpu_binary), *tiny_args(random_shards.train, **{"train.steps": steps,
                                                                                  "train.batch_size": 1})],
                            stdout=out_w, stderr=subprocess.PIPE)
    os.close(out_w)
    try:
        out = eu.read_when_behind(out_r, 1)  # the pipe is full long before
        rc = proc.wait(timeout=120)
    finally:
        proc.kill()
        os.close(out_r)
        proc.stderr.close()
    records = [json.loads(line) for line in out.splitlines()]
    assert rc == 0 and sum("loss" in r for r in records) == steps, (rc, len(records))
    assert records[-1] == {"event": "exit", "step": steps, "reason": "finished"}


@pytest.mark.parametrize("closed", [1, 2])
def test_a_closed_stdout_or_stderr_is_written_into_no_file(cpu_binary, random_shards, tmp_path, closed):
    """A launcher that closes stdout or stderr (`>&-`): the next file the engine opened took that
    descriptor, the checkpoint's lock file, and every progress line or message went into it."""
    ckpt = tmp_path / "c.ckpt"
    proc = subprocess.run([str(cpu_binary), *tiny_args(random_shards.train, **{"train.steps": 3, "checkpoint": ckpt})],
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, preexec_fn=lambda: os.close(closed),
                          timeout=60)
    assert proc.returncode == 0
    assert Path(f"{ckpt}.lock").read_bytes() == b""
    assert read_checkpoint(ckpt).step == 3


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="no /dev/full")
def test_records_stdout_cannot_take_are_one_error_not_exit_0(cpu_binary, random_shards, tmp_path):
    """A stdout that fails every write (a log file on a full disk; /dev/full here): training dropped
    every record, the exit line too, without a word, and exited 0. It still trains to the end and
    saves its checkpoints, then says what was lost: one error line and exit 1."""
    ckpt = tmp_path / "c.ckpt"
    with open("/dev/full", "w") as full:
        proc = subprocess.run([str(cpu_binary), *tiny_args(random_shards.train, **{"train.steps": 3,
                                                                                    "checkpoint": ckpt})],
                              stdout=full, stderr=subprocess.PIPE, text=True, timeout=60)
    errors = [l for l in proc.stderr.splitlines() if l.startswith("error:")]
    assert proc.returncode == 1 and len(errors) == 1, proc.stderr
    assert "standard output" in errors[0] and os.strerror(errno.ENOSPC) in errors[0], errors
    assert read_checkpoint(ckpt).step == 3


@pytest.mark.parametrize("flag", ["--help", "--flags-json", "--print-config", "--layout-json"])
def test_an_answer_stdout_cannot_take_is_one_error_not_exit_0(cpu_binary, random_shards, flag):
    """--help, --flags-json, --print-config and --layout-json print their whole answer on stdout and
    exit: to a stdout that fails every write (/dev/full) they exited 0 with nothing written, so a
    program reading the flag table or the layout took an empty file for an answer."""
    with open("/dev/full", "w") as full:
        proc = subprocess.run([str(cpu_binary), *tiny_args(random_shards.train), flag], stdout=full,
                              stderr=subprocess.PIPE, text=True, timeout=60)
    errors = [l for l in proc.stderr.splitlines() if l.startswith("error:")]
    assert proc.returncode == 1 and len(errors) == 1, proc.stderr
    assert "standard output" in errors[0] and os.strerror(errno.ENOSPC) in errors[0], errors


# ---------------------------------------------------------------------------------------------------
# 9: nothing silently corrupted, nothing lost: checksums, two slots, the divergence guard, special
# files, signals at start-up, the polish boundary (docs/DESIGN.md §15)

# A constant LR keeps every step the same whatever train.steps is, so a short run's checkpoint
# resumes into a longer run exactly.
CONSTANT_LR = {"train.schedule": "constant"}


def two_slots(engine, shards, ckpt, steps=4, every=2):
    """A run that leaves the newest checkpoint (step `steps`) and the previous one (PATH.prev)."""
    eu.run_ok(engine.binary, tiny_args(shards.train, **{**CONSTANT_LR, "train.steps": steps, "checkpoint.every": every,
                                              "checkpoint": ckpt}))
    return read_checkpoint(ckpt), read_checkpoint(f"{ckpt}.prev")


def test_sidecar_holds_the_crc32c_of_the_checkpoint_bytes(engine, random_shards, tmp_path):
    assert eu.crc32c(b"123456789") == 0xE3069283  # the standard check value: the test's CRC is CRC-32C
    ckpt = tmp_path / "run.ckpt"
    newest, prev = two_slots(engine, random_shards, ckpt)
    assert (newest.step, prev.step) == (4, 2)
    for path in (ckpt, tmp_path / "run.ckpt.prev"):
        side = read_sidecar(path)
        assert side["step"] == read_checkpoint(path).step
        assert side["crc32c"] == eu.crc32c(path.read_bytes()), path
    assert files_beside(ckpt) == ["run.ckpt", "run.ckpt.json", "run.ckpt.lock", "run.ckpt.prev", "run.ckpt.prev.json"]


def _flip_bit_in_v(path):
    raw = bytearray(path.read_bytes())
    n = read_checkpoint(path).n_params
    raw[8 + 8 * n + 4 * (n // 2) + 2] ^= 0x10  # one bit of an exponent in the middle of Adam's v
    path.write_bytes(bytes(raw))


def _garbage_weights(path):
    raw = bytearray(path.read_bytes())
    n = read_checkpoint(path).n_params
    raw[8:8 + 4 * n] = np.random.default_rng(0).bytes(4 * n)
    path.write_bytes(bytes(raw))


def _set_step(step):
    def damage(path):
        raw = bytearray(path.read_bytes())
        raw[0:4] = np.array([step], dtype="<i4").tobytes()
        path.write_bytes(bytes(raw))
    return damage


def _sidecar_of_another_step(path):
    side = read_sidecar(path)
    side["step"] = 3
    path.with_name(path.name + ".json").write_text(json.dumps(side))


def _sidecar_checksum_not_a_number(path):
    """A checksum that is there but unreadable is damage: it was loaded unverified, as if the
    checkpoint predated checksums."""
    side = read_sidecar(path)
    side["crc32c"] = "x"
    path.with_name(path.name + ".json").write_text(json.dumps(side))


def _sidecar_too_long(path):
    """A sidecar longer than any the engine writes for the model, re-indented or not (checkpoint.h's
    sidecar_read_max), was read in part: the members past the cut were lost without a word."""
    side = read_sidecar(path)
    side["note"] = "x" * (1 << 20)
    path.with_name(path.name + ".json").write_text(json.dumps(side))


def _nul_hides_the_checksum(path):
    """A NUL byte before "crc32c" hid it from the C readers: the flipped bit was loaded unverified,
    as a checkpoint written before checksums."""
    _flip_bit_in_v(path)
    side = path.with_name(path.name + ".json")
    side.write_bytes(side.read_bytes().replace(b'"crc32c"', b'\0"crc32c"'))


def _non_finite_resealed(value, vector):
    """An intact file (its checksum agrees) holding a value no run writes (the engine refuses to
    save one): NaN weights were loaded, and the run, or a chat, went on with them."""
    def damage(path):
        raw = bytearray(path.read_bytes())
        n = read_checkpoint(path).n_params
        at = 8 + 4 * (vector * n + n // 3)
        raw[at:at + 4] = np.array([value], dtype="<f4").tobytes()
        path.write_bytes(bytes(raw))
        eu.reseal_checkpoint(path)
    return damage


def _v_sign_flipped_without_sidecar(path):
    """A checkpoint without its sidecar is loaded unverified (no checksum): its values are the one
    check left. A sign bit flipped in v, AdamW's second moment (a mean of squares, never negative),
    was loaded, and the run went on to NaN and ended as diverged, exit 3, blaming train.lr."""
    raw = bytearray(path.read_bytes())
    ckpt = read_checkpoint(path)
    at = 8 + 4 * (2 * ckpt.n_params + int(np.flatnonzero(ckpt.v > 0)[0])) + 3  # the float's sign byte
    raw[at] |= 0x80
    path.write_bytes(bytes(raw))
    path.with_name(path.name + ".json").unlink()


def _sidecar_cut_before_the_checksum(path):
    """A sidecar cut short (it is no JSON object then) before "crc32c" read as one written before
    checksums: the flipped bit was loaded with a warning, unverified."""
    _flip_bit_in_v(path)
    side = path.with_name(path.name + ".json")
    text = side.read_text()
    side.write_text(text[:text.index('"crc32c"')])


def _flip_bit_in_n_params(path):
    """The header's n_params with a bit flipped: refused as "a different model shape", with no way
    back, though the file's size and its sidecar were those of this config's model."""
    raw = bytearray(path.read_bytes())
    raw[5] ^= 0x10
    path.write_bytes(bytes(raw))


INTEGRITY_DAMAGE = {"n_params_bit": _flip_bit_in_n_params,
                    "sidecar_cut": _sidecar_cut_before_the_checksum, "nan_weight": _non_finite_resealed(np.nan, 0), "inf_in_v": _non_finite_resealed(np.inf, 2),
                    "negative_v": _non_finite_resealed(-1.0, 2), "v_sign_without_sidecar": _v_sign_flipped_without_sidecar,
                    "bit_in_v": _flip_bit_in_v, "garbage_weights": _garbage_weights, "step_49": _set_step(49),
                    "step_1048881": _set_step(1048881), "sidecar_step": _sidecar_of_another_step,
                    "sidecar_checksum_not_a_number": _sidecar_checksum_not_a_number,
                    "sidecar_too_long": _sidecar_too_long, "nul_hides_the_checksum": _nul_hides_the_checksum}


@pytest.mark.parametrize("damage", sorted(INTEGRITY_DAMAGE))
def test_damaged_checkpoint_is_refused_and_the_previous_one_resumes(engine, random_shards, tmp_path, damage):
    """Damage that keeps the size right (a flipped bit, garbage, an edited step, a sidecar of another
    step) is refused at --resume with one error line that says how to resume from PATH.prev; nothing
    is changed; and doing what it says resumes the previous checkpoint exactly."""
    ckpt, ref_ckpt = tmp_path / "run.ckpt", tmp_path / "ref" / "ref.ckpt"
    args = tiny_args(random_shards.train, **{**CONSTANT_LR, "train.steps": 8, "checkpoint": ckpt, "resume": True})
    two_slots(engine, random_shards, ckpt)
    INTEGRITY_DAMAGE[damage](ckpt)
    before = {name: (tmp_path / name).read_bytes() for name in files_beside(ckpt)}

    res = eu.run_engine(engine.binary, args)
    assert res.rc == 2, res.describe()
    assert len(res.errors) == 1 and str(ckpt) in res.errors[0], res.describe()
    assert "run.ckpt.prev (step 2)" in res.errors[0], res.errors[0]
    assert res.steps == [] and not res.events("memory"), res.describe()
    assert {name: (tmp_path / name).read_bytes() for name in files_beside(ckpt)} == before

    ref_ckpt.parent.mkdir()
    ref = eu.run_ok(engine.binary, tiny_args(random_shards.train, **{**CONSTANT_LR, "train.steps": 8, "checkpoint": ref_ckpt}))
    os.replace(f"{ckpt}.prev", ckpt)  # what the error line says to do
    os.replace(f"{ckpt}.prev.json", f"{ckpt}.json")
    resumed = eu.run_ok(engine.binary, args)
    assert [r["step"] for r in resumed.steps] == list(range(3, 9))
    expected = eu.exact_records(ref)
    assert all(expected[key] == text for key, text in eu.exact_records(resumed).items())
    assert ckpt.read_bytes()[8:] == ref_ckpt.read_bytes()[8:]


@pytest.mark.parametrize("scale", ["Infinity", "NaN", "-1", "0", "1e39", '"x"'])
def test_a_loss_scale_that_is_no_scale_starts_from_the_default(engine, random_shards, tmp_path, scale):
    """A sidecar written before values_crc32c has no checksum of its values: a loss scale of inf in it
    was taken as it was, and an fp16 run would then skip every step (inf halved stays inf). Anything
    but a positive finite float is reported and replaced by the engine's default; the run resumes."""
    ckpt = tmp_path / "run.ckpt"
    precision = "fp16" if engine.name == "cuda" else "fp32"
    args = tiny_args(random_shards.train, **{"train.steps": 3, "train.precision": precision, "checkpoint": ckpt})
    eu.run_ok(engine.binary, args)
    side = re.sub(r'"values_crc32c":\d+,', "", (tmp_path / "run.ckpt.json").read_text())  # an older sidecar
    (tmp_path / "run.ckpt.json").write_text(re.sub(r'"loss_scale":[^,]*', f'"loss_scale":{scale}', side))
    resumed = eu.run_ok(engine.binary, tiny_args(random_shards.train, **{"train.steps": 6, "train.precision": precision,
                                                                       "checkpoint": ckpt, "resume": True}))
    assert "holds a loss_scale that is not a positive finite number" in resumed.stderr, resumed.describe()
    assert [r["step"] for r in resumed.steps] == [4, 5, 6]
    if engine.name == "cuda":  # the default scale, 65536, at most one overflow below it
        assert 32768 <= resumed.steps[0]["loss_scale"] <= 65536, resumed.steps[0]


@pytest.mark.parametrize("old", ["no_checksum", "no_sidecar"])
def test_checkpoint_without_checksum_resumes_with_a_warning(engine, random_shards, tmp_path, old):
    """Checkpoints written before sidecars held a checksum (or made by hand, without a sidecar) still
    resume, with a warning that they were not verified."""
    ckpt = tmp_path / "run.ckpt"
    eu.run_ok(engine.binary, tiny_args(random_shards.train, **{"train.steps": 2, "checkpoint": ckpt}))
    if old == "no_sidecar":
        os.remove(f"{ckpt}.json")
    else:
        side = read_sidecar(ckpt)
        del side["crc32c"]
        (tmp_path / "run.ckpt.json").write_text(json.dumps(side))
    res = eu.run_ok(engine.binary, tiny_args(random_shards.train, **{"train.steps": 3, "checkpoint": ckpt, "resume": True}))
    assert "unverified" in res.stderr and [r["step"] for r in res.steps] == [3], res.describe()


def test_a_warning_quoting_a_control_character_stays_one_printable_line(engine, random_shards, tmp_path):
    """Warnings and notes printed user text as it was: a checkpoint whose name holds a newline split
    the "unverified" warning in two (the second line forged, here as an "error:" the proxy would
    take for the engine's), and an escape in it reached the terminal. Every stderr line writes
    control bytes as \\xNN, as error lines do."""
    ckpt = tmp_path / "a\nerror: forged\x1b[2J.ckpt"
    eu.run_ok(engine.binary, tiny_args(random_shards.train, **{"train.steps": 2, "checkpoint": ckpt}))
    os.remove(f"{ckpt}.json")
    res = eu.run_ok(engine.binary, tiny_args(random_shards.train, **{"train.steps": 3, "checkpoint": ckpt,
                                                                     "resume": True}))
    lines = res.stderr.splitlines()
    warnings = [l for l in lines if l.startswith("warning:")]
    assert len(warnings) == 1 and "unverified" in warnings[0], res.describe()
    assert "\\x0a" in warnings[0] and "\\x1b" in warnings[0], warnings
    assert not res.errors and all(l.isprintable() for l in lines), res.describe()  # the note "resumed from" too
    assert [r["step"] for r in res.steps] == [3], res.describe()


@pytest.mark.parametrize("seed", [1e300, 7.5, -3])
def test_a_fingerprint_of_another_run_is_reported_as_it_is(engine, random_shards, tmp_path, seed):
    """A fingerprint number no int holds was converted to int (undefined for 1e300, a wrong figure for
    7.5) before it was compared and reported."""
    ckpt = tmp_path / "run.ckpt"
    eu.run_ok(engine.binary, tiny_args(random_shards.train, **{"train.steps": 2, "checkpoint": ckpt}))
    side = read_sidecar(ckpt)
    side["fingerprint"]["seed"] = seed  # another run's, its values' checksum with it
    (tmp_path / "run.ckpt.json").write_text(json.dumps(eu.reseal_values(side)))
    res = eu.run_ok(engine.binary, tiny_args(random_shards.train, **{"train.steps": 3, "checkpoint": ckpt, "resume": True}))
    assert f"the checkpoint was written with {seed:.12g}\n" in res.stderr, res.describe()


def test_previous_slot_is_the_checkpoint_before_the_newest(engine, random_shards, tmp_path):
    """Each checkpoint write keeps the one it replaces as PATH.prev, a whole checkpoint (with its own
    sidecar) that resumes exactly; a fresh run refuses to start over either slot."""
    settings = {"train.steps": 7, "checkpoint.every": 3}
    ckpt, ref_ckpt, prev_copy = tmp_path / "run.ckpt", tmp_path / "ref.ckpt", tmp_path / "prev.ckpt"
    ref = eu.run_ok(engine.binary, tiny_args(random_shards.train, **settings, checkpoint=ref_ckpt))
    res = eu.run_ok(engine.binary, tiny_args(random_shards.train, **settings, checkpoint=ckpt))
    assert [c["step"] for c in res.events("checkpoint")] == [3, 6, 7]
    assert (read_checkpoint(ckpt).step, read_checkpoint(f"{ckpt}.prev").step) == (7, 6)
    shutil.copyfile(f"{ckpt}.prev", prev_copy)
    shutil.copyfile(f"{ckpt}.prev.json", f"{prev_copy}.json")
    resumed = eu.run_ok(engine.binary, tiny_args(random_shards.train, **settings, checkpoint=prev_copy, resume=True))
    assert [r["step"] for r in resumed.steps] == [7]
    assert eu.exact_records(resumed)[("train", 7, None)] == eu.exact_records(ref)[("train", 7, None)]
    assert prev_copy.read_bytes() == ckpt.read_bytes()

    os.remove(ckpt)  # only PATH.prev left: still an earlier run that a fresh start must not clobber
    fresh = eu.run_engine(engine.binary, tiny_args(random_shards.train, **settings, checkpoint=ckpt))
    assert fresh.rc == 2 and len(fresh.errors) == 1 and "run.ckpt.prev" in fresh.errors[0], fresh.describe()
    # the way back it names (it said "pass --resume", which finds no checkpoint there) resumes
    assert f"mv {ckpt}.prev {ckpt} && mv {ckpt}.prev.json {ckpt}.json" in fresh.errors[0], fresh.errors[0]
    os.replace(f"{ckpt}.prev", ckpt)
    os.replace(f"{ckpt}.prev.json", f"{ckpt}.json")
    again = eu.run_ok(engine.binary, tiny_args(random_shards.train, **settings, checkpoint=ckpt, resume=True))
    assert [r["step"] for r in again.steps] == [7]


@pytest.fixture(scope="session")
def no_hard_links(tmp_path_factory):
    return eu.build_shim(tmp_path_factory, "no_hard_links")


def test_previous_slot_without_hard_links_is_a_copy(engine, random_shards, tmp_path, no_hard_links):
    """Where the file system has no hard links, the previous slot is made by a durable copy: the same
    bytes, the same sidecar, and no temporary file left behind."""
    linked, copied = tmp_path / "linked" / "run.ckpt", tmp_path / "copied" / "run.ckpt"
    for ckpt in (linked, copied):
        ckpt.parent.mkdir()
    args = tiny_args(random_shards.train, **{"train.steps": 4, "checkpoint.every": 2})
    eu.run_ok(engine.binary, args + ["--checkpoint", linked])
    res = eu.run_ok(engine.binary, args + ["--checkpoint", copied], env={"LD_PRELOAD": str(no_hard_links)})
    assert "no_hard_links: link refused" in res.stderr, "the shim was not loaded: " + res.describe()
    assert files_beside(copied) == files_beside(linked) == ["run.ckpt", "run.ckpt.json", "run.ckpt.lock",
                                                            "run.ckpt.prev", "run.ckpt.prev.json"]
    for name in files_beside(linked):
        assert (copied.parent / name).read_bytes() == (linked.parent / name).read_bytes(), name
    assert read_checkpoint(f"{copied}.prev").step == 2


@pytest.fixture(scope="session")
def kill_at_rename(tmp_path_factory):
    return eu.build_shim(tmp_path_factory, "kill_at_rename")


# Renames of a run that checkpoints at steps 2 and 4: the first write renames its sidecar and its
# checkpoint into place (1, 2); the second first gives the step-2 pair the PATH.prev names (3, 4),
# then renames its own sidecar and checkpoint (5, 6).
RENAMES_OF_TWO_WRITES = 6


def two_writes_beside_a_reference(engine, random_shards, tmp_path, env):
    """A 6-step run writing a checkpoint every 2 steps in tmp_path/run/, under `env` (a shim), and
    the same run untouched beside it: (settings, its checkpoint, the reference's, the reference's
    result, its result)."""
    settings = {**CONSTANT_LR, "train.steps": 6, "checkpoint.every": 2}
    ckpt, ref_ckpt = tmp_path / "run" / "run.ckpt", tmp_path / "ref.ckpt"
    ckpt.parent.mkdir()
    ref = eu.run_ok(engine.binary, tiny_args(random_shards.train, **settings, checkpoint=ref_ckpt))
    res = eu.run_engine(engine.binary, tiny_args(random_shards.train, **settings, checkpoint=ckpt), env=env)
    return settings, ckpt, ref_ckpt, ref, res


@pytest.mark.parametrize("kill_at", range(1, RENAMES_OF_TWO_WRITES + 1))
def test_a_crash_at_any_rename_leaves_a_whole_checkpoint(engine, random_shards, tmp_path, kill_at_rename, kill_at):
    """Killed just before any rename of a checkpoint write, a run leaves either no checkpoint (during
    its first write) or a slot that resumes exactly: never only a bad file, and never a checkpoint
    event for a write that did not complete. Where the newest slot is refused (its new sidecar beside
    its old checkpoint), the error line's advice resumes the previous slot."""
    settings, ckpt, ref_ckpt, ref, crashed = two_writes_beside_a_reference(
        engine, random_shards, tmp_path, {"LD_PRELOAD": str(kill_at_rename), "KILL_AT_RENAME": str(kill_at)})
    assert crashed.rc == -signal.SIGKILL, crashed.describe()
    assert [c["step"] for c in crashed.events("checkpoint")] == ([2] if kill_at > 2 else []), crashed.describe()

    args = tiny_args(random_shards.train, **settings, checkpoint=ckpt, resume=ckpt.exists())
    again = eu.run_engine(engine.binary, args)
    if kill_at == RENAMES_OF_TWO_WRITES:
        assert again.rc == 2 and len(again.errors) == 1 and "run.ckpt.prev (step 2)" in again.errors[0], \
            again.describe()
        os.replace(f"{ckpt}.prev", ckpt)
        os.replace(f"{ckpt}.prev.json", f"{ckpt}.json")
        again = eu.run_engine(engine.binary, args)
    assert again.rc == 0 and "unverified" not in again.stderr, again.describe()
    assert again.events("start")[0]["step"] == (2 if kill_at > 2 else 0)
    expected = eu.exact_records(ref)
    assert all(expected[key] == text for key, text in eu.exact_records(again).items())
    assert ckpt.read_bytes() == ref_ckpt.read_bytes()


@pytest.fixture(scope="session")
def fail_rename(tmp_path_factory):
    return eu.build_shim(tmp_path_factory, "fail_rename")


@pytest.mark.parametrize("fail_at", [2, 6], ids=["first_write", "second_write"])
def test_a_checkpoint_that_cannot_take_its_name_leaves_the_newest_slot_as_it_was(engine, random_shards, tmp_path,
                                                                                  fail_rename, fail_at):
    """The last rename of a write (the checkpoint's, after its sidecar's) failing with ENOSPC left the
    new sidecar beside the old checkpoint: the newest slot was refused at the next resume, with only
    the way back to the previous slot. The old sidecar now takes its name back (at the first write,
    the new one goes): the slot resumes as it was, exactly."""
    settings, ckpt, ref_ckpt, ref, failed = two_writes_beside_a_reference(
        engine, random_shards, tmp_path, {"LD_PRELOAD": str(fail_rename), "FAIL_RENAME": str(fail_at)})
    assert failed.rc == 1 and len(failed.errors) == 1, failed.describe()
    assert "left as it was" in failed.errors[0], failed.describe()
    kept = sorted(n for n in os.listdir(ckpt.parent) if n != "run.ckpt.lock")
    assert kept == ([] if fail_at == 2 else ["run.ckpt", "run.ckpt.json", "run.ckpt.prev", "run.ckpt.prev.json"])
    again = eu.run_ok(engine.binary, tiny_args(random_shards.train, **settings, checkpoint=ckpt,
                                               resume=ckpt.exists()))
    assert again.events("start")[0]["step"] == (0 if fail_at == 2 else 2), again.describe()
    expected = eu.exact_records(ref)
    assert all(expected[key] == text for key, text in eu.exact_records(again).items())
    assert ckpt.read_bytes() == ref_ckpt.read_bytes()


def test_a_resume_after_a_crash_between_the_slots_renames_leaves_no_temporary_file(engine, random_shards, tmp_path,
                                                                                     kill_at_rename):
    """Killed after the previous slot took the step-2 pair (rename 4) and before the new pair's
    renames, a run leaves PATH.prev a second name of PATH. The resumed run's save then renamed its
    PATH.prev.tmpPID link over PATH.prev, the same file, which rename(2) leaves in place: the
    temporary names stayed behind for good after a run that saved once."""
    settings = {**CONSTANT_LR, "train.steps": 6, "checkpoint.every": 2}
    ckpt = tmp_path / "run.ckpt"
    crashed = eu.run_engine(engine.binary, tiny_args(random_shards.train, **settings, checkpoint=ckpt),
                            env={"LD_PRELOAD": str(kill_at_rename), "KILL_AT_RENAME": "5"})
    assert crashed.rc == -signal.SIGKILL, crashed.describe()
    assert os.path.samefile(ckpt, f"{ckpt}.prev")
    for name in os.listdir(tmp_path):  # the killed writer's own temporary files: not this test's point
        if ".tmp" in name:
            os.unlink(tmp_path / name)
    again = eu.run_ok(engine.binary, tiny_args(random_shards.train, **{**settings, "train.steps": 4}, checkpoint=ckpt,
                                               resume=True))
    assert [c["step"] for c in again.events("checkpoint")] == [4], again.describe()
    assert sorted(os.listdir(tmp_path)) == ["run.ckpt", "run.ckpt.json", "run.ckpt.lock", "run.ckpt.prev",
                                            "run.ckpt.prev.json"]
    assert read_checkpoint(ckpt).step == 4 and read_checkpoint(f"{ckpt}.prev").step == 2


def _crafted_state(path, where, value):
    """Put `value` into every one of the checkpoint's weights ("params") or Adam's m ("m") and reseal
    it: an intact file holding a state that cannot train on."""
    c = read_checkpoint(path)
    state = {name: np.array(getattr(c, name)) for name in ("params", "m", "v")}  # writable copies
    state[where][:] = value
    write_checkpoint(path, c.step, state["params"], state["m"], state["v"])
    eu.reseal_checkpoint(path)


# the largest finite floats: a checkpoint holding a value that is no number is refused as damage
# (nan_weight, inf_in_v in INTEGRITY_DAMAGE), these load and then overflow
@pytest.mark.parametrize("where,value,words", [("params", 3e38, "loss "), ("m", 3e38, "weight")],
                         ids=["huge_weight", "huge_adam_m"])
def test_divergence_stops_the_run_and_keeps_the_last_good_checkpoint(engine, random_shards, tmp_path, where, value,
                                                                       words):
    """A non-finite loss (from a huge weight), or a non-finite state at checkpoint time (a huge m
    leaves the loss finite and overflows the weight it updates), ends the run: the step record, one error line, an exit event
    "diverged", exit code 3, and both checkpoint slots exactly as they were."""
    ckpt = tmp_path / "run.ckpt"
    two_slots(engine, random_shards, ckpt)
    _crafted_state(ckpt, where, value)
    before = {name: (tmp_path / name).read_bytes() for name in files_beside(ckpt)}
    res = eu.run_engine(engine.binary, tiny_args(random_shards.train, **{
        "train.steps": 10, "checkpoint.every": 1, "checkpoint": ckpt, "resume": True}))
    assert res.rc == 3, res.describe()
    assert len(res.errors) == 1 and "diverged at step 5" in res.errors[0] and words in res.errors[0], res.describe()
    assert "run.ckpt (step 4) is kept" in res.errors[0], res.errors[0]
    assert res.exit_event == {"event": "exit", "step": 5, "reason": "diverged"}, res.describe()
    assert [r["step"] for r in res.steps] == [5] and not res.events("checkpoint"), res.describe()
    assert {name: (tmp_path / name).read_bytes() for name in files_beside(ckpt)} == before


def test_divergence_before_any_checkpoint_says_so_plainly(engine, random_shards, tmp_path):
    """A run that diverges before any checkpoint: the message read "the last good no checkpoint was
    written". Adam at lr 1, unclipped, with beta2 0 and beta1 near 1 divides the mean of the past
    gradients by the last one alone, and a small last one throws a weight far: non-finite in a few
    steps (step 4 on the CPU)."""
    res = eu.run_engine(engine.binary, tiny_args(random_shards.train, **{
        "train.steps": 10, "train.lr": 1.0, "train.beta1": 0.999999, "train.beta2": 0, "train.eps": 1e-30,
        "train.grad_clip": 0, "train.weight_decay": 0, "checkpoint": tmp_path / "run.ckpt"}))
    assert res.rc == 3 and len(res.errors) == 1, res.describe()
    assert "training diverged at step " in res.errors[0] and "; stopped without saving this state, no checkpoint was " \
        "written (a lower train.lr" in res.errors[0], res.errors[0]


def test_a_beta2_that_a_float_holds_as_1_is_refused(engine, random_shards):
    """train.beta2 is held as a float: the published maximum 0.999999999 (and all from 0.99999997)
    rounded to 1.0f, whose bias correction 1 - beta2^t is 0, so the first update was 0/0 and the run
    "diverged" (exit 3, "a lower train.lr may help"). The largest accepted beta2 is below 1 as a float
    and trains."""
    flags = {f["name"]: f for f in json.loads(subprocess.run([str(engine.binary), "--flags-json"], capture_output=True,
                                                            text=True, check=True).stdout)["flags"]}
    top = flags["train.beta2"]["max"]
    assert np.float32(top) < 1.0
    ok = eu.run_ok(engine.binary, tiny_args(random_shards.train, **{"train.steps": 3, "train.beta2": repr(top)}))
    assert ok.exit_event["reason"] == "finished", ok.describe()
    res = eu.run_engine(engine.binary, tiny_args(random_shards.train, **{"train.beta2": 0.999999999}))
    assert res.rc == 2 and len(res.errors) == 1 and "train.beta2" in res.errors[0], res.describe()


@pytest.mark.parametrize("flag", ["train.lr", "train.min_lr", "polish.lr"])
def test_learning_rates_are_bounded(engine, random_shards, flag):
    """lr 1e30 trained NaN to the end; learning rates above 1 are refused (AdamW moves every weight
    by about lr per step)."""
    polish = {"polish.start_step": 2, "polish.train": random_shards.val, "polish.lr": 1e-4}
    ok = eu.run_ok(engine.binary, tiny_args(random_shards.train, **{**polish, "train.steps": 3, "train.lr": 1.0, flag: 1.0}))
    assert ok.exit_event["reason"] == "finished"
    res = eu.run_engine(engine.binary, tiny_args(random_shards.train, **{**polish, "train.steps": 3, flag: 1e30}))
    assert res.rc == 2 and len(res.errors) == 1 and flag in res.errors[0], res.describe()


POLISH_AT = {"polish.start_step": 2, "polish.train": "@val", "polish.lr": 1e-4}


@pytest.mark.parametrize("flags, rate", [
    ({"train.weight_decay": 1e30}, "train.lr"),  # at the default train.lr
    ({"train.lr": 1.0, "train.weight_decay": 1.0}, "train.lr"),
    ({"train.lr": 1e-3, "train.weight_decay": 1000}, "train.lr"),
    ({"train.lr": 1e-4, "train.weight_decay": 2.0, **POLISH_AT, "polish.lr": 0.5}, "polish.lr"),
    ({"train.lr": 1.0, "train.weight_decay": 0.99}, None),
    ({"train.lr": 1e-3, "train.weight_decay": 999}, None),
    ({"train.lr": 0.5, "train.weight_decay": 1.9, **POLISH_AT, "polish.lr": 0.1}, None),
], ids=["1e30", "lr_1_wd_1", "lr_1e-3_wd_1000", "polish_lr", "lr_1_wd_0.99", "lr_1e-3_wd_999", "polish_lower"])
def test_a_weight_decay_of_lr_times_wd_from_1_is_refused(engine, random_shards, flags, rate):
    """AdamW's decoupled decay multiplies each decayed weight by 1 - lr * weight_decay every step: from
    lr * weight_decay = 1 on every weight is zeroed or flipped each step, and up to 1e30 was taken
    (lr 1 with it diverged: test_divergence_before_any_checkpoint_says_so_plainly relied on it). lr
    is the highest rate the run steps at, train.lr or a higher polish.lr (`rate`, which the one error
    line names; exit 2); a product just below 1 trains (rate None)."""
    flags = {key: random_shards.val if value == "@val" else value for key, value in flags.items()}
    res = eu.run_engine(engine.binary, tiny_args(random_shards.train, **{"train.steps": 3, **flags}))
    if rate is None:
        assert res.rc == 0 and res.exit_event["reason"] == "finished", res.describe()
        return
    assert res.rc == 2 and len(res.errors) == 1, res.describe()
    assert "train.weight_decay" in res.errors[0] and f"{rate} " in res.errors[0], res.errors[0]


@pytest.fixture
def fifo(tmp_path):
    path = tmp_path / "fifo.bin"
    os.mkfifo(path)
    return path


SPECIAL_FILES = {
    # id: (overrides with "@fifo" / "@dir" for the special file, words the error must contain)
    "train_fifo": ({"data.train": "@fifo"}, "FIFO"),
    "val_fifo": ({"data.val": "@fifo", "eval.every": 1}, "FIFO"),
    "polish_fifo": ({"polish.start_step": 1, "polish.train": "@fifo", "polish.lr": 1e-4}, "FIFO"),
    "checkpoint_fifo": ({"checkpoint": "@fifo", "resume": True}, "FIFO"),
    "checkpoint_fifo_fresh": ({"checkpoint": "@fifo"}, "FIFO"),
    "sidecar_fifo": ({"checkpoint": "@fifo_base", "resume": True}, "FIFO"),
    "checkpoint_dir": ({"checkpoint": "@dir", "resume": True}, "directory"),
    "checkpoint_dir_fresh": ({"checkpoint": "@dir"}, "directory"),
    "checkpoint_in_missing_dir": ({"checkpoint": "@missing"}, "does not exist"),
    # found only after the forward and backward it used to be, and a FIFO blocked the write's open()
    "dump_grads_fifo": ({"dump_grads": "@fifo"}, "FIFO"),
    "dump_grads_dir": ({"dump_grads": "@dir"}, "directory"),
    "dump_grads_in_missing_dir": ({"dump_grads": "@missing"}, "does not exist"),
}


@pytest.mark.parametrize("case", sorted(SPECIAL_FILES))
def test_special_files_are_refused_up_front(engine, random_shards, tmp_path, fifo, case):
    """A FIFO where a shard or checkpoint file belongs used to hang the engine in open(), deaf to
    SIGTERM; a directory as the checkpoint said "truncated". Each is one clear error, at once."""
    overrides, word = SPECIAL_FILES[case]
    (tmp_path / "dir.ckpt").mkdir()
    os.mkfifo(tmp_path / "side.ckpt.json")
    (tmp_path / "side.ckpt").write_bytes(b"any regular file: its FIFO sidecar is refused first")
    special = {"@fifo": fifo, "@dir": tmp_path / "dir.ckpt", "@fifo_base": tmp_path / "side.ckpt",
               "@missing": tmp_path / "nowhere" / "run.ckpt"}
    overrides = {k: special.get(v, v) if isinstance(v, str) else v for k, v in overrides.items()}
    res = eu.run_engine(engine.binary, tiny_args(random_shards.train, random_shards.val, **overrides), timeout=20)
    assert res.rc == 2, res.describe()
    assert len(res.errors) == 1 and word in res.errors[0], res.describe()
    assert res.steps == [] and not res.events("memory"), res.describe()


@pytest.mark.parametrize("resume", [False, True], ids=["fresh", "resume"])
@pytest.mark.parametrize("kind", ["link", "dir", "fifo"])
def test_a_checkpoint_lock_that_is_no_regular_file_is_refused_up_front(engine, random_shards, tmp_path, kind, resume):
    """PATH.lock as a symbolic link (even to a regular file) or a directory failed the lock's open
    after start-up as an I/O error (exit 1, "Too many levels of symbolic links"); a FIFO was taken
    as the lock. Like the checkpoint's other files it is now bad input, one line at start."""
    ckpt = tmp_path / "run.ckpt"
    if resume:
        eu.run_ok(engine.binary, tiny_args(random_shards.train, **{"train.steps": 2}, checkpoint=ckpt))
        os.unlink(f"{ckpt}.lock")
    lock = tmp_path / "run.ckpt.lock"
    if kind == "link":
        (tmp_path / "elsewhere").write_bytes(b"")
        os.symlink(tmp_path / "elsewhere", lock)
    elif kind == "dir":
        lock.mkdir()
    else:
        os.mkfifo(lock)
    before = {name: (tmp_path / name).read_bytes() for name in os.listdir(tmp_path) if (tmp_path / name).is_file()
              and not (tmp_path / name).is_symlink() and name.startswith("run.ckpt") and name != "run.ckpt.lock"}
    res = eu.run_engine(engine.binary, tiny_args(random_shards.train, **{"train.steps": 4}, checkpoint=ckpt,
                                                 resume=resume), timeout=20)
    assert res.rc == 2 and len(res.errors) == 1, res.describe()
    assert res.errors[0].startswith(f"error: checkpoint lock {lock} is a "), res.errors
    assert res.steps == [] and not res.events("memory"), res.describe()
    assert {name: (tmp_path / name).read_bytes() for name in before} == before


def test_a_resume_on_a_checkpoint_in_use_is_refused_before_it_is_read(engine, random_shards, tmp_path):
    """The checkpoint of an engine that holds PATH.lock may be half replaced (between the renames of
    the checkpoint and its sidecar). A resume read it before taking the lock, called the pair
    damaged and offered to move the live run's files back to the previous slot; CI caught it once.
    The lock now comes first: with the pair out of step and the lock held, the answer is "in use"."""
    ckpt = tmp_path / "run.ckpt"
    eu.run_ok(engine.binary, tiny_args(random_shards.train, **{"train.steps": 2}, checkpoint=ckpt))
    data = bytearray(ckpt.read_bytes())
    data[-1] ^= 0xFF  # the checkpoint no longer matches its sidecar's CRC
    ckpt.write_bytes(bytes(data))
    args = tiny_args(random_shards.train, **{"train.steps": 4}, checkpoint=ckpt, resume=True)
    fd = os.open(f"{ckpt}.lock", os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # as a live engine holds it
        held = eu.run_engine(engine.binary, args, timeout=20)
    finally:
        os.close(fd)
    assert held.rc == 2 and len(held.errors) == 1, held.describe()
    assert f"checkpoint {ckpt} is in use: another engine holds {ckpt}.lock" in held.errors[0]
    free = eu.run_engine(engine.binary, args, timeout=20)  # the lock released: the damage is reported
    assert free.rc == 2 and len(free.errors) == 1 and "fails its integrity check" in free.errors[0], free.describe()


@pytest.mark.parametrize("resume", [False, True], ids=["fresh", "resume"])
def test_a_second_engine_on_a_checkpoint_in_use_is_refused(engine, random_shards, tmp_path, resume):
    """Two engines given one --checkpoint (without the proxy, whose run directory is locked) both
    trained, each replacing the other's checkpoints, and one run's work was lost without a word.
    The second is refused up front (PATH.lock, flock'ed); the first trains on undisturbed."""
    ckpt = tmp_path / "run.ckpt"
    if resume:
        eu.run_ok(engine.binary, tiny_args(random_shards.train, **{"train.steps": 2}, checkpoint=ckpt))
    # fresh: no checkpoint before the stop, so the second finds none there and only the lock tells
    args = tiny_args(random_shards.train, **{"train.steps": 10**6, "checkpoint.every": int(resume)}, checkpoint=ckpt,
                     resume=resume)
    first = eu.start_engine(engine.binary, args)
    first.wait_for(eu.is_step_record(4 if resume else 2))
    second = eu.run_engine(engine.binary, args, timeout=20)
    assert second.rc == 2 and len(second.errors) == 1, second.describe()
    assert f"checkpoint {ckpt} is in use: another engine holds {ckpt}.lock" in second.errors[0]
    first.proc.send_signal(signal.SIGTERM)
    res = first.finish()
    assert res.rc == 0 and res.exit_event["reason"] == "signal", res.describe()
    assert read_checkpoint(ckpt).step == res.exit_event["step"]
    again = eu.run_ok(engine.binary, tiny_args(random_shards.train, **{"train.steps": res.exit_event["step"] + 1},
                                               checkpoint=ckpt, resume=True))  # the lock went with the first
    assert [r["step"] for r in again.steps] == [res.exit_event["step"] + 1]


@pytest.mark.parametrize("target", ["checkpoint", "sidecar", "previous", "shard"])
def test_dump_grads_onto_one_of_the_runs_inputs_is_refused_and_leaves_it(engine, random_shards, tmp_path, target):
    """--dump-grads opens its path with O_TRUNC: given the checkpoint being resumed (or its sidecar,
    its previous slot, a shard), it replaced the run's only checkpoint with a gradient dump."""
    ckpt = tmp_path / "run.ckpt"
    eu.run_ok(engine.binary, tiny_args(random_shards.train, **{"train.steps": 2, "checkpoint.every": 1},
                                       checkpoint=ckpt))
    path = {"checkpoint": ckpt, "sidecar": tmp_path / "run.ckpt.json", "previous": tmp_path / "run.ckpt.prev",
            "shard": Path(glob.glob(random_shards.train)[0])}[target]
    os.link(path, tmp_path / "alias")  # another name of the same file is the same file
    before = path.read_bytes()
    for given in (path, tmp_path / "alias"):
        res = eu.run_engine(engine.binary, tiny_args(random_shards.train, **{"train.steps": 3}, checkpoint=ckpt,
                                                     resume=True, dump_grads=given), timeout=20)
        assert res.rc == 2 and len(res.errors) == 1 and "one of the run's inputs" in res.errors[0], res.describe()
    assert path.read_bytes() == before


def test_a_shard_truncated_while_training_is_one_error_line(engine, tmp_path):
    """Shards are memory-mapped: one truncated in place under a training engine (a data script
    rerun) made the next read of a vanished page raise SIGBUS, killing the engine without a word."""
    eu.write_random_shards(tmp_path, "big", 1, 2_000_000, eu.TINY_VOCAB, 5)
    shard = tmp_path / "big_000000.bin"
    assert shard.exists()
    proc = eu.start_engine(engine.binary, tiny_args(str(shard), **{"train.steps": 10**6}))
    proc.wait_for(lambda r: r.get("step") == 3 and "loss" in r)
    os.truncate(shard, 1024 + 2 * 100)  # 100 tokens left: every other window's pages are gone
    res = proc.finish()
    assert res.rc == 1, res.describe()
    assert len(res.errors) == 1 and "a data shard truncated or rewritten in place" in res.errors[0], res.describe()


@pytest.mark.parametrize("mode", ["training", "evaluating"])
def test_a_shard_rewritten_in_place_with_bad_ids_is_one_error_line(cpu_binary, random_shards, tmp_path, mode):
    """Token ids were checked only when a shard was opened; rewritten in place under the engine (its
    MAP_PRIVATE mapping shows the new bytes), an id past the vocabulary indexed past the embedding
    table: a segfault, or with ids just past vocab_size silently wrong rows."""
    eu.write_random_shards(tmp_path, "big", 1, 2_000_000, eu.TINY_VOCAB, 5)
    shard = tmp_path / "big_000000.bin"
    ckpt = tmp_path / "run.ckpt"
    if mode == "training":
        cmd = [str(cpu_binary), *tiny_args(str(shard), **{"train.steps": 10**6})]
    else:
        eu.run_ok(cpu_binary, tiny_args(random_shards.train, train_steps=1, checkpoint=ckpt))
        cmd = [str(cpu_binary), "--evaluate", "--checkpoint", str(ckpt), "--data.val", str(shard),
               "--eval.batches", "0"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        first = proc.stderr.readline()  # the memory plan: the shard is mapped and was checked
        assert first.startswith("memory plan"), first
        with open(shard, "r+b") as f:  # same size, so no SIGBUS: only the ids change
            f.seek(1024)
            f.write(np.full(2_000_000, 65535, dtype="<u2").tobytes())
        stdout, rest = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    errors = [l for l in rest.splitlines() if l.startswith("error:")]
    assert proc.returncode == 1, (proc.returncode, rest[-2000:])
    assert len(errors) == 1 and "token id 65535" in errors[0] and "rewritten in place" in errors[0], errors


def test_a_shard_truncated_while_evaluating_is_one_error_line(cpu_binary, random_shards, tmp_path):
    """--evaluate maps its validation shards too, but only training installed the SIGBUS handler:
    one truncated under it killed the engine without a word."""
    ckpt = tmp_path / "run.ckpt"
    eu.run_ok(cpu_binary, tiny_args(random_shards.train, train_steps=1, checkpoint=ckpt))
    eu.write_random_shards(tmp_path, "big", 1, 2_000_000, eu.TINY_VOCAB, 5)
    shard = tmp_path / "big_000000.bin"
    proc = subprocess.Popen([str(cpu_binary), "--evaluate", "--checkpoint", str(ckpt), "--data.val", str(shard),
                             "--eval.batches", "0"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        lines = [proc.stderr.readline()]  # the memory plan: the shard is mapped, the windows are being read
        assert lines[0].startswith("memory plan"), lines
        os.truncate(shard, 1024 + 2 * 100)
        stdout, rest = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    errors = [l for l in (lines[0] + rest).splitlines() if l.startswith("error:")]
    assert proc.returncode == 1 and stdout == "", (proc.returncode, stdout, lines, rest)
    assert len(errors) == 1 and "a data shard truncated or rewritten in place" in errors[0], errors


def _term_pending_at_exec():
    """In the child before exec: block SIGTERM and send it, so it is pending the moment the engine
    starts (what a launcher that blocks signals across exec, as the proxy may, hands over)."""
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    os.kill(os.getpid(), signal.SIGTERM)


@pytest.mark.parametrize("resume", [False, True], ids=["fresh", "resume"])
def test_sigterm_before_the_first_step(engine, random_shards, tmp_path, resume):
    """A SIGTERM that arrives before the handlers exist is not lost: it is handled as soon as they
    are installed. Before the first step it ends the run with exit 0 and an exit event "signal" at
    the start step, saving nothing (a resumed run's checkpoint already holds that state)."""
    ckpt = tmp_path / "run.ckpt"
    if resume:
        eu.run_ok(engine.binary, tiny_args(random_shards.train, **{"train.steps": 2, "checkpoint": ckpt}))
    before = {name: (tmp_path / name).read_bytes() for name in os.listdir(tmp_path)}
    res = eu.run_engine(engine.binary, tiny_args(random_shards.train, **{
        "train.steps": 200, "checkpoint": ckpt, "resume": resume}), preexec_fn=_term_pending_at_exec)
    start = 2 if resume else 0
    assert res.rc == 0, res.describe()
    assert res.exit_event == {"event": "exit", "step": start, "reason": "signal"}, res.describe()
    assert res.steps == [] and not res.events("checkpoint") and res.errors == [], res.describe()
    after = {name: (tmp_path / name).read_bytes() for name in os.listdir(tmp_path)}
    assert after == {**before, "run.ckpt.lock": b""}  # the checkpoint's lock (ckpt_lock), empty


def test_polish_boundary_checkpoint(engine, random_shards, tmp_path):
    """At polish.start_step the engine writes a checkpoint with reason "polish" before the first
    polish step: the exact state at the switch, which resumes bit-exactly."""
    settings = {"train.steps": 9, "polish.start_step": 5, "polish.train": random_shards.val, "polish.lr": 1e-4,
                "eval.every": 3, "eval.batches": 2}
    ckpt, ref_ckpt, boundary = tmp_path / "run.ckpt", tmp_path / "ref.ckpt", tmp_path / "boundary.ckpt"
    ref = eu.run_ok(engine.binary, tiny_args(random_shards.train, random_shards.val, **settings, checkpoint=ref_ckpt))
    polish_at = next(i for i, r in enumerate(ref.records) if r.get("event") == "polish")
    assert ref.records[polish_at] == {"event": "polish", "step": 5}
    assert ref.records[polish_at + 1] == {"event": "checkpoint", "step": 5, "path": str(ref_ckpt),
                                          "reason": "polish"}, ref.records[polish_at:polish_at + 3]
    assert [r["step"] for r in ref.steps if r["phase"] == "polish"] == [6, 7, 8, 9]
    assert all(r["step"] > 5 for r in ref.records[polish_at + 2:] if "loss" in r)
    assert read_checkpoint(f"{ref_ckpt}.prev").step == 5  # the final write kept it as the previous slot

    shutil.copyfile(f"{ref_ckpt}.prev", boundary)
    shutil.copyfile(f"{ref_ckpt}.prev.json", f"{boundary}.json")
    resumed = eu.run_ok(engine.binary, tiny_args(random_shards.train, random_shards.val, **settings, checkpoint=boundary,
                                       resume=True))
    assert [r["step"] for r in resumed.steps] == [6, 7, 8, 9]
    expected = eu.exact_records(ref)
    assert all(expected[key] == text for key, text in eu.exact_records(resumed).items())
    assert boundary.read_bytes() == ref_ckpt.read_bytes()


def test_every_json_line_is_utf8_whatever_bytes_a_name_holds(cpu_binary, random_shards):
    """--name (or a path in an event) is argv's bytes, which need not be UTF-8: the start event
    carried them raw, a JSON line no strict reader can decode. A byte that starts no well-formed
    UTF-8 sequence is written as \\ufffd; well-formed characters pass unchanged."""
    name = "é✓😀".encode() + b"\xff\xc0\xaf\xed\xa0\x80\xf4\x90\x80\x80x\xe2\x82"
    args = [os.fsencode(a) for a in tiny_args(random_shards.train, **{"train.steps": 1})]
    res = subprocess.run([os.fsencode(cpu_binary), *args, b"--name", name], capture_output=True, timeout=60)
    assert res.returncode == 0, res.stderr
    start = json.loads(res.stdout.splitlines()[0].decode("utf-8"))  # strict: raises on a stray byte
    assert start["event"] == "start" and start["name"] == "é✓😀" + "\ufffd" * 10 + "x" + "\ufffd" * 2
