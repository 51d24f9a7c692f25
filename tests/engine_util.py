"""Helpers for tests that run an engine binary (build/microgpt_cpu or build/microgpt_cuda).

The one set of engine-running helpers for the suite; the contract they encode is docs/DESIGN.md
(flags, stdout JSON lines, checkpoint + sidecar) and docs/DESIGN.md §2/§3 (parameter layout, checkpoint bytes).

    res = run_engine(binary, tiny_args(train_glob, **{"train.steps": 5}))
    res.rc, res.records, res.steps, res.exit_event, res.errors

    proc = start_engine(binary, args)
    proc.wait_for(lambda r: r.get("step") == 3 and "loss" in r)
    proc.send_signal(signal.SIGTERM)
    res = proc.finish()
"""
import functools
import json
import os
import queue
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
BUILD = REPO / "build"
CPU_BINARY = BUILD / "microgpt_cpu"
CUDA_BINARY = BUILD / "microgpt_cuda"

from microgpt.checkpoint import crc32c, read_sidecar, sidecar_values_crc32c  # noqa: F401  (crc32c: the tests')
from microgpt.engines import param_layout
from microgpt.shards import write_shard  # noqa: F401  (re-exported for tests: the one shard writer)

# Sections of the experiment config; a flag is --SECTION.key (docs/DESIGN.md §4.1).
SECTIONS = ("model", "train", "data", "eval", "sample", "checkpoint", "polish")

# A model small enough that a step takes milliseconds on one CPU core. The vocabulary (60 real tokens,
# padded to 64 embedding rows) is covered by random-token shards (tokens in [0, TINY_VOCAB)), and the
# padding is exercised by every test.
TINY_VOCAB = 60
TINY = {
    "model.n_layer": 2,
    "model.d_model": 32,
    "model.n_head": 4,
    "model.seq_len": 16,
    "model.vocab_size": TINY_VOCAB,
    "model.padded_vocab_size": 64,
    "train.batch_size": 4,
    "train.steps": 10,
    "train.seed": 1337,
    "train.lr": 1e-3,
    "train.warmup_steps": 0,
}

# Keys of a step record that measure the machine, not the computation: excluded from exact comparisons.
TIMING_KEYS = ("ms", "tokens_per_s")


# ---------------------------------------------------------------------------------------------------
# command lines

def flag_name(key):
    """'train.lr' or 'train_lr' -> '--train.lr'; 'dump_grads' -> '--dump-grads'; 'resume' -> '--resume'."""
    if "." not in key:
        section, _, rest = key.partition("_")
        if section in SECTIONS and rest:
            key = f"{section}.{rest}"
        else:
            key = key.replace("_", "-")
    return "--" + key


def tiny_args(train_glob, val_glob=None, **overrides):
    """Flag list for the TINY model on the given shards. Overrides use dotted keys
    (**{"train.steps": 5}) or section_key names (train_steps=5); a value of None drops the flag,
    True gives a bare flag (resume=True), a list repeats the flag (sample_prompt=["1,2", "3"])."""
    settings = {flag_name(k): v for k, v in TINY.items()}
    settings["--data.train"] = str(train_glob)
    if val_glob is not None:
        settings["--data.val"] = str(val_glob)
    for key, value in overrides.items():
        settings[flag_name(key)] = value
    return flag_list(settings)


def flag_list(settings):
    """{"--flag" or dotted key: value} -> the command line (see tiny_args for the value rules)."""
    args = []
    for key, value in settings.items():
        flag = key if key.startswith("--") else flag_name(key)
        if value is None or value is False:
            continue
        if value is True:
            args.append(flag)
        elif isinstance(value, (list, tuple)):
            for item in value:
                args += [flag, str(item)]
        else:
            args += [flag, str(value)]
    return args


# ---------------------------------------------------------------------------------------------------
# the parameter layout (docs/DESIGN.md §2), as the engine publishes it (`--layout-json`)

def layout_for(settings=None, binary=CPU_BINARY):
    """{"n_params": N, "tensors": [{name, shape, offset, decay}]} for dotted model settings over
    TINY's, e.g. layout_for({"model.n_layer": 3}). Asked of the CPU engine (the conftest builds it)."""
    model = {k: v for k, v in {**TINY, **(settings or {})}.items() if k.startswith("model.") and v is not None}
    return _layout(str(binary), tuple(sorted(model.items())))


@functools.lru_cache(maxsize=None)
def _layout(binary, model_items):
    return param_layout(binary, flag_list(dict(model_items)))


def tensor_shapes(layout):
    """[(name, shape tuple)] in flat order."""
    return [(t["name"], tuple(t["shape"])) for t in layout["tensors"]]


def tensor_slices(layout):
    """{name: (slice of the flat vector, shape)}."""
    return {t["name"]: (slice(t["offset"], t["offset"] + int(np.prod(t["shape"]))), tuple(t["shape"]))
            for t in layout["tensors"]}


# ---------------------------------------------------------------------------------------------------
# running an engine

@dataclass
class Result:
    """What one engine run produced. `lines` is raw stdout, `records` the lines that parse as JSON."""
    rc: int
    stdout: str
    stderr: str
    lines: list = field(default_factory=list)
    records: list = field(default_factory=list)
    seconds: float = 0.0

    @property
    def steps(self):
        return [r for r in self.records if "loss" in r and "step" in r and "event" not in r]

    @property
    def vals(self):
        return [r for r in self.records if "val_loss" in r]

    def events(self, name):
        return [r for r in self.records if r.get("event") == name]

    @property
    def exit_event(self):
        exits = self.events("exit")
        return exits[-1] if exits else None

    @property
    def errors(self):
        return [l for l in self.stderr.splitlines() if l.startswith("error:")]

    def describe(self):
        """Everything a failing assertion should show."""
        return f"rc={self.rc}\n--- stdout (tail) ---\n{self.stdout[-3000:]}\n--- stderr ---\n{self.stderr[-3000:]}"


def build_shim(tmp_path_factory, name):
    """tests/NAME.c built as an LD_PRELOAD library; returns its path."""
    lib = tmp_path_factory.mktemp(name) / f"{name}.so"
    subprocess.run(["gcc", "-shared", "-fPIC", "-O2", "-o", str(lib), str(REPO / "tests" / f"{name}.c"), "-ldl"],
                   check=True)
    return lib


def run_ok(binary, args, **kw):
    """run_engine, asserting exit code 0."""
    res = run_engine(binary, args, **kw)
    assert res.rc == 0, res.describe()
    return res


def python_env(**extra):
    """The environment for a Python subprocess (a script, the proxy): it imports this checkout's
    microgpt package, whichever checkout `pip install -e .` installed (as pytest.ini's pythonpath
    does for the test process itself)."""
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "PYTHONPATH": path, **extra}


def parse_stdout(text):
    lines = text.splitlines()
    records = []
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict):
            records.append(record)
    return lines, records


def run_engine(binary, args, timeout=120, env=None, preexec_fn=None, cwd=None):
    """Run an engine to completion; env adds to (not replaces) os.environ."""
    full_env = {**os.environ, **(env or {})}
    t0 = time.monotonic()
    try:
        proc = subprocess.run([str(binary), *map(str, args)], capture_output=True, text=True, timeout=timeout,
                              env=full_env, preexec_fn=preexec_fn, cwd=cwd)
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        err = e.stderr.decode() if isinstance(e.stderr, bytes) else (e.stderr or "")
        raise AssertionError(f"{binary} did not finish within {timeout}s\nstdout tail:\n{out[-2000:]}\nstderr:\n{err[-2000:]}")
    lines, records = parse_stdout(proc.stdout)
    return Result(proc.returncode, proc.stdout, proc.stderr, lines, records, time.monotonic() - t0)


class EngineProcess:
    """A running engine whose stdout records can be waited for, e.g. to send a signal at a given step.
    Reader threads drain stdout and stderr so the engine never blocks on a full pipe."""

    _EOF = object()

    def __init__(self, binary, args, env=None):
        self.proc = subprocess.Popen([str(binary), *map(str, args)], stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, env={**os.environ, **(env or {})})
        self.out_lines, self.err_lines = [], []
        self._queue = queue.Queue()
        self._threads = [threading.Thread(target=self._pump, args=(self.proc.stdout, self.out_lines, True), daemon=True),
                         threading.Thread(target=self._pump, args=(self.proc.stderr, self.err_lines, False), daemon=True)]
        for t in self._threads:
            t.start()
        self.t0 = time.monotonic()

    def _pump(self, stream, sink, to_queue):
        for line in stream:
            sink.append(line.rstrip("\n"))
            if to_queue:
                self._queue.put(line)
        if to_queue:
            self._queue.put(self._EOF)

    def wait_for(self, predicate, timeout=60):
        """Return the first stdout record (after those already consumed) for which predicate holds."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                self.kill()
                raise AssertionError(f"no matching record within {timeout}s; stdout so far:\n" + "\n".join(self.out_lines[-20:]))
            try:
                line = self._queue.get(timeout=left)
            except queue.Empty:
                continue
            if line is self._EOF:
                self.proc.wait()
                raise AssertionError("engine ended before the awaited record; rc=%s\nstdout:\n%s\nstderr:\n%s" % (
                    self.proc.returncode, "\n".join(self.out_lines[-20:]), "\n".join(self.err_lines[-20:])))
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict) and predicate(record):
                return record

    def send_signal(self, sig):
        self.proc.send_signal(sig)

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()

    def finish(self, timeout=120):
        """Wait for the engine to exit and return its whole output as a Result."""
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"engine did not exit within {timeout}s; stdout tail:\n" + "\n".join(self.out_lines[-20:]))
        for t in self._threads:
            t.join(timeout=10)
        stdout = "".join(l + "\n" for l in self.out_lines)
        stderr = "".join(l + "\n" for l in self.err_lines)
        lines, records = parse_stdout(stdout)
        return Result(self.proc.returncode, stdout, stderr, lines, records, time.monotonic() - self.t0)


def start_engine(binary, args, env=None):
    return EngineProcess(binary, args, env)


def is_step_record(step):
    """Predicate for wait_for: the training record of completed step `step` (or any later one)."""
    return lambda r: "loss" in r and "event" not in r and r.get("step", -1) >= step


def read_when_behind(fd, seconds):
    """Everything written to the pipe `fd` until its writers close it, read only after `seconds`:
    a reader a moment behind, whose writer meanwhile finds the pipe full."""
    time.sleep(seconds)
    out = b""
    while (chunk := os.read(fd, 1 << 20)):
        out += chunk
    return out


def run_with_signal(binary, args, sig, at_step, env=None, timeout=120):
    """Run an engine and send `sig` as soon as the record of step `at_step` appears; return the Result."""
    proc = start_engine(binary, args, env)
    proc.wait_for(is_step_record(at_step), timeout=timeout)
    proc.send_signal(sig)
    return proc.finish(timeout=timeout)


# ---------------------------------------------------------------------------------------------------
# exact comparison of outputs

def exact_records(result):
    """The computed content of a run, as exact text: {(kind, step, prompt): json text} for step, val and
    sample records, floats kept as the engine printed them and timing keys dropped.
    Raises AssertionError if one key appears twice with different content."""
    out = {}
    for line in result.lines:
        try:
            record = json.loads(line, parse_float=str)
        except ValueError:
            continue
        if not isinstance(record, dict) or "step" not in record:
            continue
        if record.get("event") == "sample":
            key = ("sample", record["step"], record.get("prompt"))
        elif "val_loss" in record:
            key = ("val", record["step"], None)
        elif "loss" in record and "event" not in record:
            key = ("train", record["step"], None)
        else:
            continue
        for k in TIMING_KEYS:
            record.pop(k, None)
        text = json.dumps(record, sort_keys=True)
        if key in out and out[key] != text:
            raise AssertionError(f"{key} reported twice with different content:\n{out[key]}\n{text}")
        out[key] = text
    return out


def merged_exact_records(*results):
    """exact_records of several runs that together make one run (e.g. stopped + resumed)."""
    merged = {}
    for result in results:
        for key, text in exact_records(result).items():
            if key in merged and merged[key] != text:
                raise AssertionError(f"{key} differs between the parts of a resumed run:\n{merged[key]}\n{text}")
            merged[key] = text
    return merged


def check_exact_resume_after_sigterm(binary, args, steps, tmp_path, at_step=3):
    """Runs `args` (a run of `steps` steps) whole, and again stopped by SIGTERM at step `at_step` or
    soon after and resumed: every record and the final checkpoint must be identical. Returns the
    (reference, resumed) checkpoint paths."""
    ref_ckpt, ckpt = tmp_path / "ref.ckpt", tmp_path / "run.ckpt"
    ref = run_ok(binary, args + ["--checkpoint", ref_ckpt])
    first = run_with_signal(binary, args + ["--checkpoint", ckpt], signal.SIGTERM, at_step)
    assert first.rc == 0 and first.exit_event["reason"] == "signal", first.describe()
    k = first.exit_event["step"]
    assert at_step <= k < steps, f"the signal landed at step {k}"
    second = run_ok(binary, args + ["--checkpoint", ckpt, "--resume"])
    assert [r["step"] for r in second.steps] == list(range(k + 1, steps + 1))
    assert merged_exact_records(first, second) == exact_records(ref)
    assert ckpt.read_bytes() == ref_ckpt.read_bytes(), "final checkpoints differ"
    return ref_ckpt, ckpt


# ---------------------------------------------------------------------------------------------------
# engine outputs other than checkpoints (those are read by microgpt/checkpoint.py)

def rel_err(got, want):
    """||got - want|| / ||want|| (the plain norm of the difference where want is all zeros)."""
    den = np.linalg.norm(want)
    return float(np.linalg.norm(np.asarray(got) - want) / (den if den > 0 else 1.0))


def reseal_checkpoint(ckpt_path):
    """Make the sidecar agree with the checkpoint's current bytes (step and checksum), as if the engine
    had written them: for tests that need a checkpoint that is intact but holds a crafted state."""
    raw = Path(ckpt_path).read_bytes()
    side = read_sidecar(ckpt_path)
    side["step"] = int(np.frombuffer(raw, dtype="<i4", count=1)[0])
    side["crc32c"] = crc32c(raw)
    Path(f"{ckpt_path}.json").write_text(json.dumps(reseal_values(side)))


def reseal_values(side):
    """side (a sidecar dict) with the checksum of its values made to agree with them, as if the
    engine had written them: for tests that need a sidecar whose values were crafted."""
    side["values_crc32c"] = sidecar_values_crc32c(side)
    return side


def read_grad_dump(path):
    """--dump-grads output: [f32 loss][n_params × f32 grads] -> (loss, grads)."""
    raw = np.fromfile(path, dtype="<f4")
    return float(raw[0]), raw[1:].copy()


# ---------------------------------------------------------------------------------------------------
# data

def write_random_shards(directory, prefix, n_shards, tokens_per_shard, vocab_size, seed):
    """Shards of uniformly random tokens in [0, vocab_size); returns the glob that matches them."""
    rng = np.random.default_rng(seed)
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    for i in range(n_shards):
        write_shard(directory / f"{prefix}_{i:06d}.bin", rng.integers(0, vocab_size, tokens_per_shard))
    return str(directory / f"{prefix}_*.bin")


def flip_bit(path, offset):
    """Damage the file at path as a bad disk or copy would: the lowest bit of the byte at offset."""
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ 1]))
