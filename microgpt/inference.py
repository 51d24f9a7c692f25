"""Running a trained model: the checkpoint a run directory names, the model's shape and weights, the
engine to use, and the one client of the engines' `--generate` protocol (docs/DESIGN.md §5a, the
protocol itself in §16). chat.py, evaluate.py, export-hf.py and the export checks use it.

    engine = pick_engine(None)                      # the proxy's choice: GPU when built and visible
    with Generator(engine, resolve_checkpoint("runs/ANDREA-12M")) as gen:
        for record in gen.stream({"prompt": ids, "max_tokens": 64, "temperature": 0}):
            ...                                     # {"token": t} ... then {"done": true, ...}
"""
import collections
import json
import os
import signal
import subprocess
import threading

from microgpt.checkpoint import (CheckpointError, SidecarError, load_sidecar, read_params, sidecar_name_twice,
                                 sidecar_values_intact, split_params)
from microgpt.engines import ENGINE_TEXT, ENGINES, EngineChoiceError, EngineQueryError, param_layout, select_engine
from microgpt.files import NotRegularFile, open_regular
from microgpt.run_dir import RunFiles

STDERR_TAIL_LINES = 20  # the engine's last messages, shown when it fails
# The engines' `--generate` start line, their last on stderr before the first request is read
# (host/generate.h): the warnings about the checkpoint come before it.
GENERATE_START = "; reading requests on stdin"
START_WAIT_S = 5  # how long ready() waits for that line once the engine has answered
# The engines' memory plan, a line on stderr in every mode once the checkpoint is checked (the only
# one of `--evaluate` before it scores): set-up, as is all before it, never why an engine failed.
MEMORY_PLAN = "memory plan ("
MODEL_FLAGS = ("n_layer", "d_model", "n_head", "d_ff", "seq_len", "vocab_size", "padded_vocab_size")


class InferenceError(RuntimeError):
    """A checkpoint, engine or request problem, worded for a one-line `error:` message."""


def resolve_checkpoint(path):
    """A checkpoint file as given, or a run directory's checkpoint (runs/<name>/<name>.ckpt, named
    after the directory as the proxy names it). Raises InferenceError when there is none, when it
    is no regular file (a FIFO: the engine would refuse it too), or when it cannot be read (its
    mode, or its directory's: said so, where the sidecar or the engine would say less)."""
    ckpt, files = path, None
    if os.path.isdir(path):
        files = RunFiles.named_after(path)
        ckpt = os.path.join(path, files.name + ".ckpt")  # as given (relative stays relative), as shown
    try:
        os.close(open_regular(ckpt))
        return ckpt
    except NotRegularFile as e:
        raise InferenceError(f"{ckpt}: {e.strerror}") from None
    except (FileNotFoundError, NotADirectoryError):
        if files and not os.path.islink(ckpt):  # a link to nothing is a checkpoint file that is missing
            raise InferenceError(f"{path} is a directory without a checkpoint {files.name}.ckpt; give a run "
                                 "directory (runs/<name>/) or a checkpoint file") from None
        raise InferenceError(f"{ckpt}: no such checkpoint file or run directory") from None
    except OSError as e:
        raise InferenceError(f"cannot read checkpoint {ckpt}: {e.strerror or e}") from None


def read_model_shape(ckpt):
    """The model's shape ({n_layer, d_model, ...} and the checkpoint's "step") from the sidecar's
    fingerprint: the engines read the model flags from there too."""
    try:
        sidecar = load_sidecar(ckpt)
    except SidecarError as e:  # the model's shape is read from it, so it cannot be done without
        raise InferenceError(f"{ckpt}.json: the checkpoint's sidecar (which gives the model's shape) {e}") from None
    fingerprint = sidecar.get("fingerprint")
    if not isinstance(fingerprint, dict):
        raise InferenceError(f"{ckpt}.json: the checkpoint's sidecar does not give the model's shape "
                             "(its \"fingerprint\")")
    twice = sidecar_name_twice(sidecar)
    if twice:  # which one is meant is ambiguous: the engines refuse it, and so do the values' checks
        raise InferenceError(f"{ckpt}.json: the sidecar names the member \"{twice}\" twice (edited or damaged; "
                             "which one is meant is ambiguous)")
    shape = {}
    for key in MODEL_FLAGS:
        value = fingerprint.get(key)
        # what the engine takes (it prints the number with %.0f): a whole number, positive; json
        # reads 1e400 as infinity, and the sidecar's values may have no checksum of their own
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 1 <= value < 2 ** 31 \
                or value != int(value):
            raise InferenceError(f"{ckpt}.json: the model's {key} in the sidecar's fingerprint is {value!r}, "
                                 "not a positive integer (damaged or edited)")
        shape[key] = int(value)
    if sidecar_values_intact(sidecar) is False:  # an edited vocab_size or n_head leaves the file's size as it is
        raise InferenceError(f"{ckpt}.json: the sidecar's values (model shape, settings) fail their own check, "
                             "values_crc32c (damaged or edited)")
    return {**shape, "step": sidecar.get("step")}


def engine_warnings(stderr_text):
    """The `warning: ...` lines of an engine's stderr (a checkpoint loaded unverified, §15)."""
    return [l for l in stderr_text.splitlines() if l.startswith("warning:")]


def engine_failure(what, returncode, stderr_lines):
    """An error line's text for an engine that failed: `what` (what it did), how it ended ("exit
    code N", or "killed by SIGKILL" where a signal ended it: kill -9, the OOM killer), and why: its
    last `error:` line, else what it wrote after its set-up lines (its memory plan and the start
    line of `--generate`; those and its warnings before them are no reason), if anything."""
    errors = [l for l in stderr_lines if l.startswith("error:")]
    if errors:
        detail = errors[-1][len("error:"):].strip()
    else:
        starts = [i for i, l in enumerate(stderr_lines) if MEMORY_PLAN in l or GENERATE_START in l]
        after = stderr_lines[starts[-1] + 1:] if starts else stderr_lines
        detail = " | ".join(l for l in after if not l.startswith("warning:"))
    if returncode >= 0:
        how = f"exit code {returncode}"
    else:
        try:
            how = f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            how = f"killed by signal {-returncode}"
    return f"{what} ({how})" + (f": {detail}" if detail else "")


def verify_checkpoint(ckpt, warn=None):
    """The engines' own checks of a checkpoint (header, size, the sidecar's step, the CRC-32C of
    every byte, values that are no number: docs/DESIGN.md §15), made by the CPU engine, which every machine builds: set up
    for generation and given no request, it checks, loads and exits. Raises InferenceError with
    the engine's error line. warn (a function of one line), where given, gets each of the engine's
    warning lines: a checkpoint without checksums passes, unverified, and the engine says so."""
    try:
        res = subprocess.run([ENGINES["cpu"], "--generate", "--checkpoint", ckpt], stdin=subprocess.DEVNULL,
                             capture_output=True, **ENGINE_TEXT)
    except OSError as e:
        raise InferenceError(f"cannot start {ENGINES['cpu']}: {e.strerror or e}") from None
    if res.returncode != 0:
        lines = res.stderr.splitlines()[-STDERR_TAIL_LINES:]
        errors = [l for l in lines if l.startswith("error:")]
        if errors:  # what is wrong with the checkpoint, in the engine's words
            raise InferenceError(errors[-1][len("error:"):].strip())
        raise InferenceError(engine_failure(f"the CPU engine checking {ckpt} ended", res.returncode, lines))
    for line in engine_warnings(res.stderr) if warn else ():
        warn(line)


def file_identity(st):
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


def read_model_params(ckpt, warn=None):
    """(model shape, {tensor name: float32 array}) of a checkpoint's weights, laid out as the engine
    says (`--layout-json` of the CPU engine, which every machine builds), checked first as an
    engine checks a checkpoint it loads (verify_checkpoint; warn: its warnings). The weights read
    are those of the file checked: a checkpoint replaced meanwhile (a run still training writes a
    new one every checkpoint.every steps, by a rename; cp writes over it in place) is an error, not
    weights of another step exported under the checked one's step and shape; they are read into
    memory before that check, not mapped."""
    try:
        before = file_identity(os.stat(ckpt))
    except OSError as e:
        raise InferenceError(f"cannot read checkpoint {ckpt}: {e.strerror or e}") from None
    shape = read_model_shape(ckpt)
    verify_checkpoint(ckpt, warn)
    try:
        layout = param_layout(ENGINES["cpu"], [a for k in MODEL_FLAGS for a in (f"--model.{k}", str(shape[k]))])
        _, params = read_params(ckpt)  # in memory: a mapping would read the file when exported, seconds later
        try:
            after = file_identity(os.stat(ckpt))  # the same file from before the check to after its read
        except OSError:
            after = None
        if before != after:
            raise InferenceError(f"checkpoint {ckpt} changed while it was read (a run still writing checkpoints "
                                 "there?); try again, or stop the run first")
        return shape, split_params(params, layout)
    except (CheckpointError, EngineQueryError) as e:
        raise InferenceError(str(e)) from None


def pick_engine(requested):
    """The proxy's engine choice for --engine `requested` (None: GPU when built and visible, else
    the CPU engine, with one line saying so)."""
    try:
        return select_engine(requested)
    except EngineChoiceError as e:
        raise InferenceError(str(e)) from None


def engine_name(engine):
    return "cuda" if os.path.basename(engine).endswith("cuda") else "cpu"


class Generator:
    """One engine process in `--generate` mode, kept alive across requests (the chat's turns).
    Requests run one at a time; stderr is drained in a thread so the engine never blocks on it.
    warn (a function of one line), where given, gets each of the engine's warning lines as it
    comes (a checkpoint loaded unverified, docs/DESIGN.md §15), from the draining thread."""

    def __init__(self, engine, ckpt, extra_args=(), warn=None):
        self.args = [engine, "--generate", "--checkpoint", ckpt, *extra_args]
        self.warn = warn
        self.started = threading.Event()  # the engine's start line was read, or its stderr ended
        try:
            self.proc = subprocess.Popen(self.args, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         stderr=subprocess.PIPE, bufsize=1, **ENGINE_TEXT)
        except OSError as e:
            raise InferenceError(f"cannot start {engine}: {e.strerror or e}") from None
        self.stderr_tail = collections.deque(maxlen=STDERR_TAIL_LINES)
        self._drain = threading.Thread(target=self._drain_stderr, daemon=True)
        self._drain.start()
        self.next_id = 0

    def _drain_stderr(self):
        try:
            for line in self.proc.stderr:
                line = line.rstrip("\n")
                self.stderr_tail.append(line)
                if self.warn and line.startswith("warning:"):
                    try:
                        self.warn(line)
                    except Exception:  # stderr gone: the warning cannot be said, the engine goes on
                        pass
                if GENERATE_START in line:
                    self.started.set()
        finally:
            self.started.set()

    def _failure(self, what):
        self.proc.wait()
        self._drain.join(timeout=5)
        return InferenceError(engine_failure(f"the engine {what}", self.proc.returncode, list(self.stderr_tail)))

    def stream(self, request):
        """Send one request (an "id" is added) and yield the engine's answers to it: an optional
        {"logits"} record, {"token"} records, and last the {"done"} record. A request the engine
        refuses raises InferenceError with its message."""
        rid = self.next_id
        self.next_id += 1
        try:
            line = json.dumps({**request, "id": rid}, allow_nan=False)
        except ValueError:  # NaN or infinity: Python writes them as tokens no JSON reader takes
            raise InferenceError(f"the request is not JSON (a number in it is not finite): {request}") from None
        try:
            self.proc.stdin.write(line + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            raise self._failure("stopped before taking the request") from None
        while True:
            line = self.proc.stdout.readline()
            if not line:
                raise self._failure("stopped while answering")
            try:
                record = json.loads(line)
            except ValueError:
                continue  # not a protocol line
            # id null: the engine could not read a line, not even its id. Requests run one at a
            # time, so that line was this request's.
            if not isinstance(record, dict) or record.get("id", rid) not in (rid, None):
                continue
            if "error" in record:
                raise InferenceError(f"the engine refused the request: {record['error']}")
            yield record
            if record.get("done"):
                return

    def run(self, request):
        """The whole answer: (done record, logits or None)."""
        logits = None
        for record in self.stream(request):
            if "logits" in record:
                logits = record["logits"]
            if record.get("done"):
                return record, logits

    def ready(self):
        """Returns once the engine has checked and loaded the checkpoint (it answers a prefill of one
        token, drawing none); raises InferenceError with the engine's error when it could not: a
        damaged checkpoint is then said before a person types a message, not after. Its warnings
        (warn) have been passed on by then: the engine writes them before its start line, and that
        before it reads the first request. Returns whether the start line was seen."""
        self.run({"prompt": [0], "max_tokens": 0})
        return self.started.wait(START_WAIT_S)

    def close(self):
        """End of stdin ends the engine; it exits 0."""
        if self.proc.poll() is None:
            try:
                self.proc.stdin.close()
            except OSError:
                pass
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._drain.join(timeout=5)

    def kill(self):
        """Stop the engine now, mid-request (Ctrl-C)."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
