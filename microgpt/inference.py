"""Running a trained model: the checkpoint a run directory names, the engine to use, and the client
of the engines' `--generate` mode (docs/DESIGN.md §5a). chat.py, evaluate.py and the export checks
use it; nothing else speaks the protocol.

    engine = pick_engine(None)                      # the proxy's choice: GPU when built and visible
    with Generator(engine, resolve_checkpoint("runs/ANDREA-12M")) as gen:
        for event in gen.stream({"prompt": ids, "max_tokens": 64, "temperature": 0}):
            ...                                     # {"token": t} ... then {"done": true, ...}

The protocol, one JSON object per line: a request on the engine's stdin
    {"id", "prompt": [ids], "max_tokens", "temperature" (0: greedy), "top_k", "top_p", "seed",
     "stop": [ids], "logits": bool}
and on its stdout, flushed per token, {"id", "logits": [...]} first when asked (the prompt's last
position, real vocabulary), then {"id", "token": t} per token, then
{"id", "done": true, "reason": "stop"|"length"|"context", "tokens", "prompt_tokens", "ms"};
{"id", "error": "..."} for a bad request. End of stdin ends the engine (exit 0).
"""
import collections
import json
import os
import subprocess
import sys
import threading

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:  # the proxy's modules import their siblings by plain name
    sys.path.insert(0, HERE)

import numpy as np  # noqa: E402

from training_proxy import ENGINES, EngineChoiceError, choose_engine, gpu_visible  # noqa: E402

STDERR_TAIL_LINES = 20  # the engine's last messages, shown when it fails


class InferenceError(RuntimeError):
    """A checkpoint, engine or request problem, worded for a one-line `error:` message."""


def resolve_checkpoint(path):
    """A checkpoint file as given, or a run directory's `<dir>/<name>.ckpt` (name = the directory's
    own name, as the proxy writes it). Raises InferenceError when there is none."""
    if os.path.isdir(path):
        name = os.path.basename(os.path.normpath(os.path.abspath(path)))
        ckpt = os.path.join(path, f"{name}.ckpt")
        if not os.path.isfile(ckpt):
            raise InferenceError(f"{path} is a directory without a checkpoint {name}.ckpt; give a run "
                                 "directory (runs/<name>/) or a checkpoint file")
        return ckpt
    if not os.path.isfile(path):
        raise InferenceError(f"{path}: no such checkpoint file or run directory")
    return path


def read_model_shape(ckpt):
    """The model's shape from the checkpoint's sidecar (CKPT.json, its "fingerprint")."""
    try:
        with open(f"{ckpt}.json") as f:
            sidecar = json.load(f)
        shape = sidecar["fingerprint"]
        for key in ("n_layer", "d_model", "n_head", "d_ff", "seq_len", "vocab_size", "padded_vocab_size"):
            int(shape[key])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise InferenceError(f"{ckpt}.json: cannot read the model's shape from the checkpoint's "
                             f"sidecar ({type(e).__name__}: {e})") from None
    return {**shape, "step": sidecar.get("step")}


MODEL_FLAGS = ("n_layer", "d_model", "n_head", "d_ff", "seq_len", "vocab_size", "padded_vocab_size")


def param_layout(shape):
    """[{"name", "shape", "offset"}] of the flat vector, as the engine itself lays it out
    (`ENGINE --layout-json`)."""
    cmd = [ENGINES["cpu"], "--layout-json"] + [a for k in MODEL_FLAGS for a in (f"--model.{k}", str(shape[k]))]
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
        if res.returncode != 0:
            raise ValueError(res.stderr.strip()[-300:])
        return json.loads(res.stdout)["tensors"]
    except (OSError, ValueError, KeyError, subprocess.TimeoutExpired) as e:
        raise InferenceError(f"{ENGINES['cpu']} --layout-json did not give the parameter layout ({e}); "
                             "run `make`") from None


def read_model_params(ckpt):
    """(model shape, {tensor name: float32 array}) of a checkpoint's weights (not its Adam moments)."""
    shape = read_model_shape(ckpt)
    layout = param_layout(shape)
    n_params = sum(int(np.prod(t["shape"])) for t in layout)
    with open(ckpt, "rb") as f:
        head = np.frombuffer(f.read(8), "<i4")
        if len(head) != 2 or head[1] != n_params or os.path.getsize(ckpt) != 8 + 12 * n_params:
            raise InferenceError(f"{ckpt}: not a checkpoint of the model its sidecar describes "
                                 f"({n_params} parameters)")
        flat = np.fromfile(f, "<f4", count=n_params)
    return shape, {t["name"]: flat[t["offset"]:t["offset"] + int(np.prod(t["shape"]))].reshape(t["shape"])
                   for t in layout}


def pick_engine(requested):
    """The engine binary for --engine `requested` (None: the proxy's default choice); its warning,
    if any (the CPU engine was chosen because no GPU is there), goes to stderr as one line."""
    try:
        engine, warning = choose_engine(requested, requested != "cpu" and gpu_visible())
    except EngineChoiceError as e:
        raise InferenceError(str(e)) from None
    if warning:
        print(f"warning: {warning}", file=sys.stderr, flush=True)
    return engine


def engine_name(engine):
    return "cuda" if os.path.basename(engine).endswith("cuda") else "cpu"


class Generator:
    """One engine process in `--generate` mode, kept alive across requests (the chat's turns).
    Requests run one at a time; stderr is drained in a thread so the engine never blocks on it."""

    def __init__(self, engine, ckpt, extra_args=()):
        self.args = [engine, "--generate", "--checkpoint", ckpt, *extra_args]
        try:
            self.proc = subprocess.Popen(self.args, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         stderr=subprocess.PIPE, text=True, encoding="utf-8", bufsize=1)
        except OSError as e:
            raise InferenceError(f"cannot start {engine}: {e.strerror or e}") from None
        self.stderr_tail = collections.deque(maxlen=STDERR_TAIL_LINES)
        self._drain = threading.Thread(target=self._drain_stderr, daemon=True)
        self._drain.start()
        self.next_id = 0

    def _drain_stderr(self):
        for line in self.proc.stderr:
            self.stderr_tail.append(line.rstrip("\n"))

    def _failure(self, what):
        self.proc.wait()
        self._drain.join(timeout=5)
        errors = [l for l in self.stderr_tail if l.startswith("error:")]
        detail = errors[-1][len("error:"):].strip() if errors else " | ".join(self.stderr_tail)
        return InferenceError(f"the engine {what} (exit code {self.proc.returncode}): {detail}")

    def stream(self, request):
        """Send one request (an "id" is added) and yield the engine's answers to it: an optional
        {"logits"} record, {"token"} records, and last the {"done"} record. A request the engine
        refuses raises InferenceError with its message."""
        rid = self.next_id
        self.next_id += 1
        try:
            self.proc.stdin.write(json.dumps({**request, "id": rid}) + "\n")
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
            if not isinstance(record, dict) or record.get("id") != rid:
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
