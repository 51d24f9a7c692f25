"""microgpt/checkpoint.py, the one Python reader of the engine's checkpoints (docs/DESIGN.md §3):
the bytes as the engine writes them, memory-mapped; the sidecar; named tensors by the engine's layout;
one clear error for anything that is not a whole checkpoint."""
import json
import os
import re
import shutil
import signal
import subprocess

import numpy as np
import pytest

import engine_util as eu
from engine_util import TINY, run_ok, tiny_args

from microgpt.checkpoint import (SIDECAR_READ_MAX, CheckpointError, checkpoint_step, read_checkpoint,
                                 read_header, read_sidecar, sidecar_values_crc32c, split_params, write_checkpoint)


def test_engine_checkpoint_reads_as_named_tensors(cpu_binary, random_shards, tmp_path):
    ckpt = tmp_path / "c.ckpt"
    eu.run_ok(cpu_binary, tiny_args(random_shards.train, **{"train.steps": 2}, checkpoint=ckpt))
    c = read_checkpoint(ckpt)
    layout = eu.layout_for(TINY)
    assert (c.step, c.n_params) == (2, layout["n_params"]) and checkpoint_step(ckpt) == 2
    raw = np.frombuffer(ckpt.read_bytes(), dtype="<f4", offset=8)
    n = c.n_params
    assert np.array_equal(c.params, raw[:n]) and np.array_equal(c.m, raw[n:2 * n])
    assert np.array_equal(c.v, raw[2 * n:])
    assert isinstance(c.params, np.memmap) and not c.params.flags.writeable
    assert c.sidecar == json.loads((tmp_path / "c.ckpt.json").read_text()) and c.sidecar["step"] == 2
    tensors = split_params(c.params, layout)
    d = TINY["model.d_model"]
    assert tensors["wte"].shape == (TINY["model.padded_vocab_size"], d)
    assert tensors["h1.ln2.gamma"].shape == (d,) and list(tensors)[-1] == "lnf.beta"
    assert np.shares_memory(tensors["h0.W_Q"], c.params)  # views, nothing copied


def test_write_then_read_round_trips(tmp_path):
    rng = np.random.default_rng(0)
    params, m, v = (rng.standard_normal(7).astype(np.float32) for _ in range(3))
    write_checkpoint(tmp_path / "w.ckpt", 5, params, m, v)
    c = read_checkpoint(tmp_path / "w.ckpt")
    assert (c.step, c.n_params, c.sidecar) == (5, 7, None)
    assert np.array_equal(c.params, params) and np.array_equal(c.m, m) and np.array_equal(c.v, v)


@pytest.mark.parametrize("make, words", [
    (lambda p: p.mkdir(), "is a directory"),
    (lambda p: os.mkfifo(p), "is a FIFO"),  # its open waited for a writer for ever
    (lambda p: p.write_bytes(b"\x01\x00"), "shorter than its header"),
    (lambda p: p.write_bytes(np.array([3, 2], "<i4").tobytes() + b"\0" * 23), "needs 32"),
    (lambda p: p.write_bytes(np.array([3, -1], "<i4").tobytes()), "-1 parameters"),
    # the sign bit of the step flipped: it said "32 bytes, but its header ... needs 32"
    (lambda p: p.write_bytes(np.array([-2**31 + 3, 2], "<i4").tobytes() + b"\0" * 24), "negative"),
], ids=["directory", "fifo", "short", "size", "negative", "negative_step"])
def test_what_is_not_a_checkpoint_is_one_clear_error(tmp_path, make, words):
    path = tmp_path / "bad.ckpt"
    make(path)
    for read in (read_header, read_checkpoint, checkpoint_step):
        with pytest.raises(CheckpointError, match=words):
            read(path)


def test_a_missing_checkpoint_has_no_step(tmp_path):
    assert checkpoint_step(tmp_path / "none.ckpt") is None


def test_split_params_refuses_a_vector_of_another_model():
    layout = {"n_params": 3, "tensors": [{"name": "a", "shape": [3], "offset": 0, "decay": False}]}
    assert split_params(np.arange(3.0), layout)["a"].tolist() == [0.0, 1.0, 2.0]
    with pytest.raises(CheckpointError, match="4 values, but the layout has 3"):
        split_params(np.arange(4.0), layout)


# a model of many thin layers in fp8: its sidecar is mostly the per-layer fp8 scale histories
DEEP_FP8 = {"model.n_layer": 90, "model.d_model": 16, "model.n_head": 1, "train.batch_size": 1,
            "train.warmup_steps": 0, "eval.every": 0, "train.precision": "fp8", "train.schedule": "constant"}


def test_a_deep_fp8_sidecar_re_indented_resumes_exactly(cpu_binary, random_shards, tmp_path):
    """The readers' limit on a sidecar follows the model (docs/DESIGN.md §15): a 90-layer fp8 run's
    sidecar, re-indented by json.dump(indent=4) to several times the 64 KB the writer's buffer holds,
    resumes, and to the same losses and checkpoint as the untouched one."""
    args = tiny_args(random_shards.train, **{**DEEP_FP8, "train.steps": 16})  # histories full: 16 forwards
    for name in ("run", "pretty"):
        run_ok(cpu_binary, args + ["--checkpoint", tmp_path / f"{name}.ckpt"])
    side = tmp_path / "pretty.ckpt.json"
    with open(side) as f:
        meta = json.load(f)
    with open(side, "w") as f:
        json.dump(meta, f, indent=4)
    assert side.stat().st_size > 2 * 65536 and len(meta["fp8_history"]["exp"]) == 8 * 90
    more = tiny_args(random_shards.train, **{**DEEP_FP8, "train.steps": 18})
    runs = [run_ok(cpu_binary, more + ["--checkpoint", tmp_path / f"{name}.ckpt", "--resume"])
            for name in ("run", "pretty")]
    assert "fp8 scale history" not in runs[1].stderr, runs[1].describe()
    assert eu.exact_records(runs[0]) == eu.exact_records(runs[1]) and [r["step"] for r in runs[1].steps] == [17, 18]
    assert (tmp_path / "run.ckpt").read_bytes() == (tmp_path / "pretty.ckpt").read_bytes()


def test_a_sidecar_padded_past_what_the_model_can_have_is_refused(cpu_binary, random_shards, tmp_path):
    """Whitespace is taken up to a bound derived from the model, not without end: a deep model's
    sidecar padded to 4 MB is one error line, exit 2, the files left as they are."""
    ckpt = tmp_path / "run.ckpt"
    run_ok(cpu_binary, tiny_args(random_shards.train, **{**DEEP_FP8, "train.steps": 2}) + ["--checkpoint", ckpt])
    side = tmp_path / "run.ckpt.json"
    side.write_text(side.read_text().replace(",", "," + " " * 4096, 1000))
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    res = eu.run_engine(cpu_binary, tiny_args(random_shards.train, **{**DEEP_FP8, "train.steps": 4}) +
                        ["--checkpoint", ckpt, "--resume"])
    assert res.rc == 2 and len(res.errors) == 1 and "longer than any this program writes" in res.errors[0], \
        res.describe()
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before


def test_a_sidecar_nested_too_deeply_reads_as_none(tmp_path):
    """read_sidecar took a sidecar nested too deeply for Python's json as a RecursionError, a
    traceback in chat.py, evaluate.py and export-hf.py: it is a sidecar that is no JSON object."""
    ckpt = tmp_path / "c.ckpt"
    write_checkpoint(ckpt, 1, np.zeros(3), np.zeros(3), np.zeros(3))
    (tmp_path / "c.ckpt.json").write_text('{"a": ' + "[" * 100_000 + "]" * 100_000 + "}")
    assert read_checkpoint(ckpt).sidecar is None


def test_a_sidecar_longer_than_any_engine_reads_is_none(tmp_path):
    """read_sidecar read any length whole (a 10 GB file named like a sidecar took all memory in
    chat.py or export): past the engines' own limit it is no sidecar of ours."""
    ckpt = tmp_path / "c.ckpt"
    write_checkpoint(ckpt, 1, np.zeros(3), np.zeros(3), np.zeros(3))
    side = tmp_path / "c.ckpt.json"
    side.write_text('{"a": 1}' + " " * (SIDECAR_READ_MAX - 8))
    assert read_checkpoint(ckpt).sidecar == {"a": 1}   # at the limit: read
    side.write_text('{"a": 1}' + " " * (SIDECAR_READ_MAX - 7))
    assert read_checkpoint(ckpt).sidecar is None       # one byte past it: none


def test_a_sidecar_that_is_a_fifo_reads_as_none_without_waiting(tmp_path):
    """Opening a FIFO for reading waits for a writer: chat.py, evaluate.py and export waited for
    ever on a sidecar that was one."""
    ckpt = tmp_path / "c.ckpt"
    write_checkpoint(ckpt, 1, np.zeros(3), np.zeros(3), np.zeros(3))
    os.mkfifo(tmp_path / "c.ckpt.json")

    class Waited(Exception):  # no OSError: read_sidecar would take that for a missing file
        pass

    def waited(*_):
        raise Waited("read_sidecar waited on the FIFO")
    previous = signal.signal(signal.SIGALRM, waited)
    signal.alarm(10)
    try:
        assert read_checkpoint(ckpt).sidecar is None
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def sidecar_opens(binary, args, side, tmp_path):
    """How many times a run of the engine opens `side`, counted by strace; the run must succeed."""
    trace = tmp_path / "trace.txt"
    res = eu.run_engine("strace", ["-f", "-qq", "-e", "trace=open,openat", "-o", str(trace), str(binary)] + args)
    assert res.rc == 0, res.describe()
    return sum(f'"{side}"' in line and "ENOENT" not in line for line in trace.read_text().splitlines())


@pytest.mark.skipif(not shutil.which("strace"), reason="strace is not installed")
def test_the_sidecar_is_read_once_at_start_up(engine, random_shards, tmp_path):
    """docs/DESIGN.md §15: the integrity check, the loss scale and the fp8 histories of a resume, and
    the model flags and the integrity check of --evaluate, all take the one copy read at start-up,
    so every reader sees the bytes the check verified (the CPU engine read it 3 and 2 times)."""
    settings = {**DEEP_FP8, "model.n_layer": 2} if engine.name == "cpu" else {"train.precision": "bf16"}
    ckpt, side = tmp_path / "c.ckpt", tmp_path / "c.ckpt.json"
    run_ok(engine.binary, tiny_args(random_shards.train, **settings, **{"train.steps": 2}, checkpoint=ckpt))
    resume = tiny_args(random_shards.train, **settings, **{"train.steps": 3}, checkpoint=ckpt, resume=True)
    assert sidecar_opens(engine.binary, resume, side, tmp_path) == 1
    evaluate = ["--evaluate", "--checkpoint", str(ckpt), "--data.val", str(random_shards.train),
                "--eval.batches", "1"]
    assert sidecar_opens(engine.binary, evaluate, side, tmp_path) == 1


def _cut_after_the_fingerprint(side):
    return side[:side.index(b"}") + 1]  # ends in "}", the bandit and fp8 histories cut off


SIDECAR_DAMAGE = {
    "cut_after_the_fingerprint": _cut_after_the_fingerprint,
    "comma_flipped": lambda side: side.replace(b",", b"\xac", 1),  # one bit, 0x2c -> 0xac
    "one_brace_too_many": lambda side: side.rstrip() + b"}",
    "invalid_utf8": lambda side: side.replace(b'"precision":"', b'"precision":"\xff'),
    "nested_too_deeply": lambda side: side.replace(b'"step"', b'"x":' + b"[" * 65 + b"]" * 65 + b',"step"'),
    "step_with_a_leading_zero": lambda side: side.replace(b'"step":', b'"step":0'),
    # a bit flipped in a name: "crc33c" read as a sidecar written before checksums (loaded unverified,
    # a warning), "seee" as no seed (--evaluate took the default seed's batches)
    "checksum_name_flipped": lambda side: side.replace(b'"crc32c"', b'"crc33c"'),
    "seed_name_flipped": lambda side: side.replace(b'"seed"', b'"seee"'),
}


# a member given twice: in its own object (Python's json took the last, the engines the first) and
# in another object (the engines look a name up anywhere in the text, so took the one nested first)
SIDECAR_TWICE = {
    "step_twice": lambda side: side.replace(b'"step":', b'"step":1,"step":', 1),
    "step_in_the_fingerprint": lambda side: side.replace(b'"fingerprint":{', b'"fingerprint":{"step":1,', 1),
}


def test_python_reads_a_sidecar_naming_a_member_twice_in_one_object_as_none(tmp_path):
    """Python's json reads by object: a name given twice in one object is ambiguous (no sidecar),
    the same name in two objects is not (the engines refuse both: test_a_damaged_sidecar_is_refused)."""
    ckpt = tmp_path / "c.ckpt"
    write_checkpoint(ckpt, 2, np.zeros(3), np.zeros(3), np.zeros(3))
    side = b'{"step":2,"fingerprint":{"seed":1}}'
    nested = {"step": 2, "fingerprint": {"step": 1, "seed": 1}}
    for twice, python_reads in (("step_twice", None), ("step_in_the_fingerprint", nested)):
        (tmp_path / "c.ckpt.json").write_bytes(SIDECAR_TWICE[twice](side))
        assert read_checkpoint(ckpt).sidecar == python_reads


@pytest.mark.parametrize("damage", sorted({**SIDECAR_DAMAGE, **SIDECAR_TWICE}))
def test_a_damaged_sidecar_is_refused(engine, random_shards, tmp_path, damage):
    """docs/DESIGN.md §15: the readers find the sidecar's members by name, so a sidecar cut short
    after a member that ends in "}" or with a bit flipped in its syntax read as far as the names were
    found: the members past the damage were lost with a warning at most (the fp8 histories), or
    without one; so was a member whose name had a bit flipped. A member named twice was read as its
    first occurrence anywhere, where Python's json takes an object's last. Resume and --evaluate
    refuse it, one error line, exit 2, files untouched."""
    settings = {**DEEP_FP8, "model.n_layer": 2} if engine.name == "cpu" else {"train.precision": "bf16"}
    ckpt, side = tmp_path / "c.ckpt", tmp_path / "c.ckpt.json"
    run_ok(engine.binary, tiny_args(random_shards.train, **settings, **{"train.steps": 2}, checkpoint=ckpt))
    side.write_bytes({**SIDECAR_DAMAGE, **SIDECAR_TWICE}[damage](side.read_bytes()))
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    resume = tiny_args(random_shards.train, **settings, **{"train.steps": 3}, checkpoint=ckpt, resume=True)
    evaluate = ["--evaluate", "--checkpoint", str(ckpt), "--data.val", str(random_shards.train),
                "--eval.batches", "1"]
    for args in (resume, evaluate):
        res = eu.run_engine(engine.binary, args)
        assert res.rc == 2 and len(res.errors) == 1, res.describe()
        words = 'names the member "step" twice' if damage in SIDECAR_TWICE else "no well-formed JSON object"
        assert words in res.errors[0] and res.steps == [], res.describe()
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before


def c_sidecar_names():
    """The list `sidecar_names` of microgpt/host/checkpoint.h, as its source spells it."""
    source = (eu.REPO / "microgpt" / "host" / "checkpoint.h").read_text()
    return re.findall(r'"([^"]*)"', re.search(r"sidecar_names\[\] = \{(.*?)\};", source, re.S).group(1))


def member_names(value):
    """Every member name of every object in a parsed JSON value."""
    if isinstance(value, dict):
        return set(value).union(*map(member_names, value.values()))
    if isinstance(value, list):
        return set().union(*map(member_names, value))
    return set()


def test_sidecar_names_are_the_names_the_writers_write(cpu_binary, random_shards, tmp_path):
    """docs/DESIGN.md §15: the readers refuse a sidecar naming a member that is not in the hand-kept
    list `sidecar_names`, so a writer's new member missing there would make every resume refuse
    its own checkpoint, and a name listed that no writer writes would let one added by hand pass.
    A sidecar with every member (fp8 histories and the bandit's state) names exactly the list,
    each name once in the list."""
    ckpt = tmp_path / "c.ckpt"
    one_source = {"data.train": None, "data.sources.0.name": "only", "data.sources.0.train": random_shards.train}
    settings = {**DEEP_FP8, **one_source, "model.n_layer": 2, "train.steps": 2, "bandit.every": 1}
    run_ok(cpu_binary, tiny_args("x", random_shards.val, **settings, checkpoint=ckpt))
    names = c_sidecar_names()
    assert len(set(names)) == len(names) and "fp8_history" in names, names
    side = read_checkpoint(ckpt).sidecar
    assert "bandit" in side and "fp8_history" in side, side
    assert member_names(side) == set(names)


@pytest.mark.parametrize("link", ["to_nothing", "to_itself"])
def test_a_sidecar_that_is_a_broken_link_is_refused(engine, random_shards, tmp_path, link):
    """A sidecar replaced by a symbolic link that leads nowhere (or round in a loop) read as no
    sidecar at all: the checkpoint was resumed, or evaluated, unverified, with a warning. Only a
    sidecar that is not there is missing; this one is refused, one error line, exit 2."""
    ckpt, side = tmp_path / "c.ckpt", tmp_path / "c.ckpt.json"
    run_ok(engine.binary, tiny_args(random_shards.train, **{"train.steps": 2}, checkpoint=ckpt))
    side.unlink()
    side.symlink_to(tmp_path / "nowhere.json" if link == "to_nothing" else side)
    resume = tiny_args(random_shards.train, **{"train.steps": 3}, checkpoint=ckpt, resume=True)
    evaluate = ["--evaluate", "--checkpoint", str(ckpt), "--data.val", str(random_shards.train),
                "--eval.batches", "1", *tiny_args(random_shards.train)]
    for args in (resume, evaluate):
        res = eu.run_engine(engine.binary, args)
        assert res.rc == 2 and len(res.errors) == 1, res.describe()
        assert str(side) in res.errors[0] and "unverified" not in res.stderr, res.describe()
    assert side.is_symlink() and ckpt.read_bytes() and not (tmp_path / "c.ckpt.prev").exists()


def test_a_link_planted_at_the_temp_names_is_not_written_through(cpu_binary, random_shards, tmp_path):
    """The engine writes PATH.tmpPID and PATH.json.tmpPID (docs/DESIGN.md §15), names anyone who
    may write to the directory can foresee: links planted there made the checkpoint's bytes land in
    the files they point to. (The shell's pid is the engine's: exec keeps it.)"""
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    ckpt = tmp_path / "c.ckpt"
    argv = " ".join(f"'{a}'" for a in [str(cpu_binary)] + tiny_args(random_shards.train, checkpoint=ckpt,
                                                                      **{"train.steps": 2}))
    res = subprocess.run(["sh", "-c", f'ln -s {victim} {ckpt}.tmp$$ && ln -s {victim} {ckpt}.json.tmp$$ && '
                          f'exec {argv}'], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert victim.read_bytes() == b"precious" and read_checkpoint(ckpt).step == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.ckpt", "c.ckpt.json", "c.ckpt.lock", "victim"]



def test_the_sidecars_values_carry_their_own_checksum(cpu_binary, random_shards, tmp_path):
    """The engine's "values_crc32c" is the checksum microgpt/checkpoint.py computes of the sidecar's
    values (docs/DESIGN.md §15): the C and Python canonical texts agree, also for the sidecar
    rewritten by Python's json (re-indented: a checksum of the values, not of the bytes)."""
    ckpt = tmp_path / "c.ckpt"
    eu.run_ok(cpu_binary, tiny_args(random_shards.train, **{"train.steps": 2}, checkpoint=ckpt))
    side = read_sidecar(ckpt)
    assert side["values_crc32c"] == sidecar_values_crc32c(side), side
    (tmp_path / "c.ckpt.json").write_text(json.dumps(side, indent=4))
    res = eu.run_ok(cpu_binary, ["--generate", "--checkpoint", ckpt])
    assert "warning" not in res.stderr, res.describe()


# Spellings of a value that JSON reads as one value (or as no string) where the engine's reader, taking
# the sidecar's text, and Python's, taking json's dict, once saw two: "-0" is json's int 0, a \u escape
# a character, a lone surrogate no text Python's UTF-8 encoder would take (a traceback), a
# string cut at 31 bytes or 31 characters.
ODD_SPELLINGS = [('"seed":1337', '"seed":-0'),
                 ('"precision":"fp32"', '"precision":"fp\\u00332"'),
                 ('"precision":"fp32"', '"precision":"fp32\\ud800"'),
                 ('"precision":"fp32"', '"precision":"\\ud83d\\ude00 \\"\\\\\\/\\b\\f\\n\\r\\t"'),
                 ('"precision":"fp32"', '"precision":"' + "x" * 30 + '\u00e9"'),
                 ('"precision":"fp32"', '"precision":"fp32\\u0000x"'),
                 # a string that spells a name, before that name's member: a value, no member
                 ('"n_layer":2', '"fp8_classifier":"seed","n_layer":2', ',"fp8_classifier":"all"', '')]


@pytest.mark.parametrize("edit", ODD_SPELLINGS, ids=["minus-zero", "escape", "lone-surrogate", "escapes",
                                                    "cut-in-a-character", "nul", "a-value-spelling-a-name"])
def test_c_and_python_take_the_same_canonical_text_of_any_spelling(cpu_binary, random_shards, tmp_path, edit):
    """The engine's values_crc32c of a sidecar is Python's for every JSON spelling of its values
    (docs/DESIGN.md §15): a sidecar that passes one reader's check passes the other's."""
    ckpt = tmp_path / "c.ckpt"
    args = tiny_args(random_shards.train, **{"train.steps": 2}, checkpoint=ckpt)
    eu.run_ok(cpu_binary, args)
    text = (tmp_path / "c.ckpt.json").read_text()
    for old, new in zip(edit[::2], edit[1::2]):  # (old, new, old, new, ...)
        assert old in text
        text = text.replace(old, new)
    text = re.sub(r'"values_crc32c":\d+', '"values_crc32c":0', text)
    (tmp_path / "c.ckpt.json").write_text(text, encoding="utf-8")
    res = eu.run_engine(cpu_binary, tiny_args(random_shards.train, **{"train.steps": 3, "resume": True},
                                              checkpoint=ckpt))
    engine_crc = re.search(r"CRC-32C (\d+), recorded 0", res.stderr)
    assert res.rc == 2 and engine_crc, res.describe()
    assert int(engine_crc.group(1)) == sidecar_values_crc32c(read_sidecar(ckpt))


def test_an_escaped_precision_reads_as_the_precision_it_spells(cpu_binary, random_shards, tmp_path):
    """JSON's "fp\\u00332" is "fp32": the engine reads a sidecar's strings as JSON does, so a
    sidecar written by a tool that escapes characters loads as the one the engine wrote."""
    ckpt = tmp_path / "c.ckpt"
    eu.run_ok(cpu_binary, tiny_args(random_shards.train, **{"train.steps": 2}, checkpoint=ckpt))
    text = (tmp_path / "c.ckpt.json").read_text().replace('"fp32"', '"fp\\u00332"')
    assert "u0033" in text
    (tmp_path / "c.ckpt.json").write_text(text)
    res = eu.run_ok(cpu_binary, ["--generate", "--checkpoint", ckpt])
    assert "fp32" in res.stderr and "warning" not in res.stderr, res.describe()


def test_python_refuses_a_sidecar_that_gives_a_value_twice(cpu_binary, random_shards, tmp_path):
    """A value given at the top level and in the fingerprint is one the engine refuses (it takes a
    name's first occurrence anywhere): Python's shape reader refuses it too, never checking the
    values against one and reading the model's shape from the other."""
    from microgpt.inference import InferenceError, read_model_shape
    ckpt = tmp_path / "c.ckpt"
    eu.run_ok(cpu_binary, tiny_args(random_shards.train, **{"train.steps": 2}, checkpoint=ckpt))
    side = read_sidecar(ckpt)
    vocab = side["fingerprint"]["vocab_size"]
    side = {"vocab_size": vocab, **side}
    side["fingerprint"]["vocab_size"] = vocab - 1
    (tmp_path / "c.ckpt.json").write_text(json.dumps(side))
    res = eu.run_engine(cpu_binary, ["--generate", "--checkpoint", ckpt])
    assert res.rc == 2 and "vocab_size\" twice" in res.stderr, res.describe()
    with pytest.raises(InferenceError, match="vocab_size.*twice"):
        read_model_shape(str(ckpt))


def _edit_value(side, key, value):
    (side["fingerprint"] if key in side["fingerprint"] else side)[key] = value
    return side


# Each changes nothing the checkpoint's size or CRC-32C sees: before values_crc32c, --generate ran a
# model of another vocabulary or head count, a resume took another loss scale, without a word.
VALUE_EDITS = [("vocab_size", TINY["model.vocab_size"] - 1), ("n_head", 8), ("seed", 1338),
               ("precision", "bf16"), ("loss_scale", 2.0), ("n_params", 12345)]


@pytest.mark.parametrize("key, value", VALUE_EDITS, ids=[k for k, _ in VALUE_EDITS])
def test_an_edited_sidecar_value_is_refused(engine, random_shards, tmp_path, key, value):
    """A sidecar value edited (by hand or damage) where the checkpoint's own checks cannot see it is
    refused by --generate and by --resume as damage: one error line, exit 2, naming the sidecar and
    the way back to the previous slot; Python's shape reader refuses it too."""
    from microgpt.inference import InferenceError, read_model_shape
    ckpt = tmp_path / "c.ckpt"
    eu.run_ok(engine.binary, tiny_args(random_shards.train, **{"train.steps": 2, "checkpoint.every": 1},
                                       checkpoint=ckpt))
    (tmp_path / "c.ckpt.json").write_text(json.dumps(_edit_value(read_sidecar(ckpt), key, value)))
    for args in (["--generate", "--checkpoint", ckpt],
                 tiny_args(random_shards.train, **{"train.steps": 3, "checkpoint": ckpt, "resume": True})):
        res = eu.run_engine(engine.binary, args)
        assert res.rc == 2 and len(res.errors) == 1, res.describe()
        assert f"{ckpt}.json" in res.errors[0] and "values" in res.errors[0] and f"mv {ckpt}.prev" in res.errors[0], \
            res.errors
    with pytest.raises(InferenceError, match="fail their own check"):
        read_model_shape(str(ckpt))


def test_a_sidecar_without_a_checksum_of_its_values_loads_unverified(engine, random_shards, tmp_path):
    """A sidecar written before sidecars carried values_crc32c is loaded with one warning saying its
    values are unverified, and resumes exactly as the same sidecar with it."""
    eu.run_ok(engine.binary, tiny_args(random_shards.train, **{"train.steps": 2}, checkpoint=tmp_path / "a.ckpt"))
    shutil.copyfile(tmp_path / "a.ckpt", tmp_path / "b.ckpt")
    side = read_sidecar(tmp_path / "a.ckpt")
    del side["values_crc32c"]
    (tmp_path / "b.ckpt.json").write_text(json.dumps(side))
    runs = [eu.run_ok(engine.binary, tiny_args(random_shards.train, **{"train.steps": 4, "resume": True},
                                               checkpoint=tmp_path / f"{name}.ckpt")) for name in ("a", "b")]
    warnings = [l for l in runs[1].stderr.splitlines() if l.startswith("warning:")]
    assert len(warnings) == 1 and "unverified" in warnings[0] and "values" in warnings[0], runs[1].describe()
    assert "warning:" not in runs[0].stderr, runs[0].describe()
    assert eu.exact_records(runs[0]) == eu.exact_records(runs[1])
    assert (tmp_path / "a.ckpt").read_bytes() == (tmp_path / "b.ckpt").read_bytes()
