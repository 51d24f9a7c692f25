#!/usr/bin/env python3
"""The training proxy (SPEC §5): launches an engine on an experiment config, records what it reports
in the run directory, and serves the live dashboard.

    python microgpt/training_proxy.py experiments/ANDREA-12M-TRAIN.json [--engine cuda|cpu]
        [--run-dir DIR] [--host 127.0.0.1] [--port 8765] [--keep-serving]

The run directory (default runs/<name>/ under the repository root) holds
    <name>.ckpt, <name>.ckpt.json   the engine's checkpoint and sidecar; if present, the run resumes
    <name>.loss.json                every train/val record of every launch (see microgpt/loss_log.py)
    <name>.samples.json             [{step, prompt, text}]: decoded samples of the current phase
    <name>.state.json               status, step, phase, checkpoint, pid, tokens, throughput, ETA, config
    <name>.lock                     held by the one proxy running the run (its pid inside)
    archive/step_<s>/               at polish step s: the checkpoint, samples and state of pretraining

Signals: SIGTERM/SIGINT are forwarded to the engine, which checkpoints and exits; the proxy then
marks the run stopped and exits 0. SIGUSR1 is forwarded (checkpoint, keep training). An engine that
dies any other way leaves the run crashed and the proxy exits non-zero; re-running resumes. If the
proxy itself fails while the engine runs, it stops the engine (SIGTERM, then SIGKILL after
ABORT_WAIT_SECONDS), marks the run crashed and exits 1.
See docs/PROXY.md for the user's view and the server's endpoints.
"""
import argparse
import collections
import fcntl
import json
import os
import shutil
import signal
import struct
import subprocess
import sys
import threading
import time
import traceback
import queue

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:  # run as a script: import the sibling modules
    sys.path.insert(0, HERE)

from atomic import atomic_open, write_json_atomic  # noqa: E402
from loss_log import LossLog, LossLogError  # noqa: E402

ROOT = os.path.dirname(HERE)
ENGINES = {"cuda": os.path.join(ROOT, "build", "microgpt_cuda"),
           "cpu": os.path.join(ROOT, "build", "microgpt_cpu")}
DEFAULT_PORT = 8765
FLUSH_SECONDS = 0.25  # how stale the loss log on disk may get; one fsync per flush
FLUSH_RECORDS = 512
STATE_SECONDS = 0.5  # .state.json is rewritten at most this often (and at every event)
LINGER_SECONDS = 0.6  # a few live-stream polls (proxy_server.POLL_SECONDS) after the run ends
ABORT_WAIT_SECONDS = 30  # after a proxy failure: how long the engine gets to checkpoint on SIGTERM

# ---------------------------------------------------------------------------------------------------
# Choosing the engine (SPEC §5: the GPU engine by default)


class EngineChoiceError(RuntimeError):
    pass


def gpu_visible():
    """True if `nvidia-smi -L` runs and lists a GPU (the driver sees one)."""
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return out.returncode == 0 and "GPU" in out.stdout


def _built(path):
    return os.path.isfile(path) and os.access(path, os.X_OK)


def choose_engine(requested, gpu, engines=ENGINES):
    """The engine binary for --engine `requested` (None: not given) -> (path, warning or None).
    Not given: the CUDA engine if it is built and a GPU is visible, else the CPU engine with a
    warning. Asked for by name: that engine or an EngineChoiceError, never a silent substitute."""
    cuda, cpu = engines["cuda"], engines["cpu"]
    warning = None
    if requested == "cuda" or (requested is None and gpu and _built(cuda)):
        if not _built(cuda):
            raise EngineChoiceError(f"--engine cuda: {cuda} is not built; run `make` (it needs nvcc)")
        if not gpu:
            raise EngineChoiceError("--engine cuda: no GPU visible (`nvidia-smi -L` lists none); "
                                    "use --engine cpu")
        return cuda, None
    if requested is None:
        why = "no GPU visible (`nvidia-smi -L` lists none)" if not gpu else f"{cuda} is not built"
        warning = (f"{why}: running the CPU engine {cpu} (slow); --engine cuda forces the GPU "
                   "engine")
    if not _built(cpu):
        raise EngineChoiceError(f"{cpu} is not built; run `make`")
    return cpu, warning


# ---------------------------------------------------------------------------------------------------
# Experiment configuration (SPEC §4). The engine owns the list of keys: every config key
# `section.key` is the engine flag --section.key, and `ENGINE --flags-json` publishes the flags
# (type, default, choices, range, required). Flags without a dot (--checkpoint, --resume, ...) are
# the command line's own, not config keys. The proxy adds a few keys that are its own:

OWN_KEYS = {  # key: (type, required)
    "name": ("str", True),          # names the run directory and files; passed as --name
    "description": ("str", False),  # free text for people; not passed to the engine
    "sample.prompts": ("prompts", False),  # strings, tokenized into repeated --sample.prompt ids
}
TYPE_WORDS = {"int": "an integer", "float": "a number", "str": "a string", "path": "a path",
              "glob": "a glob pattern", "bool": "true or false", "prompts": "a list of strings"}


class ConfigError(ValueError):
    pass


def engine_flags(engine):
    """`ENGINE --flags-json` -> {name: flag}. Raises EngineChoiceError if the engine can't say."""
    try:
        res = subprocess.run([engine, "--flags-json"], capture_output=True, text=True, timeout=60)
        if res.returncode != 0:
            raise ValueError((res.stderr.strip().splitlines() or [f"exit code {res.returncode}"])[-1])
        return {f["name"]: f for f in json.loads(res.stdout)["flags"]}
    except (OSError, subprocess.TimeoutExpired, ValueError, KeyError, TypeError) as e:
        raise EngineChoiceError(f"{engine} --flags-json did not give its flag table ({e}); "
                                "rebuild it with `make`") from None


def config_keys(flags):
    """The keys a config may hold -> what each must be: the engine's dotted flags (but the
    token-id prompts, which the proxy makes from sample.prompts) and the proxy's own keys."""
    keys = {name: f["type"] for name, f in flags.items() if "." in name and f["type"] != "prompt"}
    keys.update({key: kind for key, (kind, _) in OWN_KEYS.items()})
    return keys


def _type_ok(kind, value):
    if kind == "bool":
        return isinstance(value, bool)
    if isinstance(value, bool):  # JSON true/false are ints to Python; never a number here
        return False
    if kind == "int":
        return isinstance(value, int)
    if kind == "float":
        return isinstance(value, (int, float))
    if kind == "prompts":
        return isinstance(value, list) and all(isinstance(p, str) and p for p in value)
    return isinstance(value, str) and value != ""  # str, path, glob


def _check_value(dotted, kind, value, flag):
    """One key's value against its type and, for engine flags, its choices and range."""
    if not _type_ok(kind, value):
        raise ConfigError(f'"{dotted}" must be {TYPE_WORDS[kind]}, not {json.dumps(value)}')
    if not flag:
        return
    if flag["choices"] and value not in flag["choices"]:
        raise ConfigError(f'"{dotted}" must be one of {", ".join(flag["choices"])}, '
                          f'not {json.dumps(value)}')
    if flag["min"] is not None and value < flag["min"]:
        raise ConfigError(f'"{dotted}" must be at least {flag["min"]}, not {json.dumps(value)}')
    if flag["max"] is not None and value > flag["max"]:
        raise ConfigError(f'"{dotted}" must be at most {flag["max"]}, not {json.dumps(value)}')


def _required_keys(cfg, flags):
    """Own required keys, required flags, and flags required once their section is there."""
    own = [key for key, (_, required) in OWN_KEYS.items() if required]
    return own + [name for name, f in flags.items() if "." in name and
                  (f["required"] is True or (f["required"] == "section" and name.split(".")[0] in cfg))]


def validate_config(cfg, flags):
    """Raise ConfigError naming the first unknown, mistyped, out-of-range or missing key."""
    if not isinstance(cfg, dict):
        raise ConfigError("the config must be a JSON object")
    keys = config_keys(flags)
    sections = {k.split(".")[0] for k in keys if "." in k}
    for key, value in cfg.items():
        if key in sections:
            if not isinstance(value, dict):
                raise ConfigError(f'"{key}" must be an object')
            for sub, subval in value.items():
                dotted = f"{key}.{sub}"
                if dotted not in keys:
                    raise ConfigError(f'unknown key "{dotted}"')
                _check_value(dotted, keys[dotted], subval, flags.get(dotted))
        elif key in keys:
            _check_value(key, keys[key], value, None)
        else:
            raise ConfigError(f'unknown key "{key}"')
    for dotted in _required_keys(cfg, flags):
        section, _, sub = dotted.partition(".")
        if section not in cfg or (sub and sub not in cfg[section]):
            raise ConfigError(f'missing key "{dotted}"')
    name = cfg["name"]
    if not all(c.isalnum() or c in "._-" for c in name) or name.startswith("."):
        raise ConfigError(f'"name" must be letters, digits, ".", "_" or "-" (it names files), '
                          f'not {json.dumps(name)}')


def load_config(path, flags):
    try:
        with open(path) as f:
            cfg = json.load(f)
    except OSError as e:
        raise ConfigError(f"cannot read it: {e.strerror}") from None
    except ValueError as e:
        raise ConfigError(f"not valid JSON: {e}") from None
    validate_config(cfg, flags)
    return cfg


def resolve_path(p):
    """Config paths (and globs) are relative to the repository root, wherever the proxy runs."""
    p = os.path.expanduser(p)
    return p if os.path.isabs(p) else os.path.join(ROOT, p)


def tokenize_prompts(cfg, flags):
    """sample.prompts -> token id lists (ChatML specials allowed), checked against the vocabulary."""
    prompts = cfg.get("sample", {}).get("prompts", [])
    if not prompts:
        return []
    import tokenizer
    vocab = cfg["model"].get("vocab_size", flags["model.vocab_size"]["default"])
    out = []
    for i, text in enumerate(prompts):
        try:
            ids = tokenizer.encode_chat(text)
        except tokenizer.TokenizerUnavailable as e:
            raise ConfigError(f'"sample.prompts" cannot be tokenized: {e}') from None
        too_big = [t for t in ids if t >= vocab]
        if too_big:
            raise ConfigError(f'"sample.prompts[{i}]" has token id {too_big[0]}, which is not below '
                              f'model.vocab_size {vocab}')
        out.append(ids)
    return out


def _flag_args(name, kind, value):
    if kind == "bool":
        return [f"--{name}"] if value else []
    if kind in ("path", "glob"):
        value = resolve_path(value)
    elif kind == "float":
        value = repr(float(value))  # repr round-trips a double exactly
    return [f"--{name}", str(value)]


def engine_args(cfg, flags, prompt_ids, ckpt_path, resume):
    """The engine's command-line flags for a validated config: the dotted keys, mechanically."""
    args = ["--name", cfg["name"]]
    for section, value in cfg.items():
        for key, subval in (value.items() if isinstance(value, dict) else ()):
            dotted = f"{section}.{key}"
            if dotted in flags:  # not the proxy's own sample.prompts
                args += _flag_args(dotted, flags[dotted]["type"], subval)
    for ids in prompt_ids:
        args += ["--sample.prompt", ",".join(str(t) for t in ids)]
    args += ["--checkpoint", ckpt_path]
    if resume:
        args.append("--resume")
    return args


def checkpoint_step(path):
    """The step stored in a checkpoint's first int32, or None if there is no checkpoint."""
    try:
        with open(path, "rb") as f:
            head = f.read(4)
    except FileNotFoundError:
        return None
    return struct.unpack("<i", head)[0] if len(head) == 4 else None


# ---------------------------------------------------------------------------------------------------
# Small file helpers


def read_json(path, default):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return default


def say(msg):
    print(f"[proxy] {msg}", flush=True)


def decode_tokens(ids):
    """Token ids -> text; if the tokenizer cannot load, the ids themselves (a sample is never lost)."""
    try:
        import tokenizer
        return tokenizer.decode(ids)
    except Exception as e:  # TokenizerUnavailable, or tiktoken missing entirely
        if not getattr(decode_tokens, "warned", False):
            say(f"warning: samples are kept as token ids, the tokenizer is unavailable ({e})")
            decode_tokens.warned = True
        return " ".join(str(i) for i in ids)


class RunBusyError(RuntimeError):
    pass


def lock_run(path):
    """One proxy per run: a second one would append to the same loss log, "repair" the first one's
    write in progress and launch a second engine on the same checkpoint. The flock lives as long as
    the returned file stays open (the kernel drops it when the process dies, however it dies)."""
    f = open(path, "a+")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        holder = f.read().strip() or "?"
        f.close()
        raise RunBusyError(f"another proxy (pid {holder}) is running this run ({path}); stop it "
                           "first, or give this one another --run-dir") from None
    f.truncate(0)
    f.write(f"{os.getpid()}\n")
    f.flush()
    return f


# ---------------------------------------------------------------------------------------------------
# The run


class Run:
    """One run directory and, while it trains, its engine process.

    The main thread owns every write; the server's threads only read self.state, self.samples and
    self.log (whose own lock guards it). state and samples are replaced, never mutated, so a reader
    always holds a consistent snapshot; the *_version counters tell the live stream what changed."""

    def __init__(self, cfg, flags, config_path, run_dir, engine_path, prompt_ids):
        self.cfg, self.flags, self.config_path, self.engine_path = cfg, flags, config_path, engine_path
        self.name = cfg["name"]
        self.dir = os.path.abspath(run_dir)
        os.makedirs(self.dir, exist_ok=True)
        base = os.path.join(self.dir, self.name)
        self.lock = lock_run(base + ".lock")  # before the log is opened (and maybe repaired)
        self.ckpt_path = base + ".ckpt"
        self.samples_path = base + ".samples.json"
        self.state_path = base + ".state.json"
        self.prompt_texts = cfg.get("sample", {}).get("prompts", [])
        self.prompt_ids = prompt_ids
        self.log = LossLog(base + ".loss.json")
        if self.log.message:
            say(self.log.message)
        self.samples = read_json(self.samples_path, [])
        if not os.path.exists(self.samples_path):
            write_json_atomic(self.samples_path, [])
        self.state = read_json(self.state_path, {})
        self.state_version = self.samples_version = 0
        self.proc = None
        self.pending = []  # loss records not yet on disk
        self.pending_since = 0.0
        self.state_written = 0.0
        self.state_dirty = False
        self.stop_signal = None  # SIGTERM/SIGINT received: the engine was asked to stop
        self.stop_announced = False
        self.exit_reason = None
        self.polish_step = None  # set from the polish event until its checkpoint is archived
        self.window = collections.deque(maxlen=64)  # (time, step, tokens) of recent train records
        self.stderr_tail = collections.deque(maxlen=8)
        self.steps = cfg["train"]["steps"]
        self.tokens_per_step = None
        # Launch number: every record says which launch wrote it, so resumes can be told apart.
        self.seg = 1 + (self.log.record(len(self.log) - 1).get("seg", 0) if len(self.log) else 0)
        self.seg_t0 = time.time()
        self.elapsed_base = 0.0

    # -- state ------------------------------------------------------------------------------------

    def set_state(self, force=False, **changes):
        self.state = {**self.state, **changes, "updated_at": round(time.time(), 3)}
        self.state_version += 1
        self.state_dirty = True
        if force:
            self.write_state()

    def write_state(self):
        if self.state_dirty:
            write_json_atomic(self.state_path, self.state)
            self.state_dirty = False
            self.state_written = time.monotonic()

    def base_state(self):
        return {"name": self.name, "status": "running", "phase": "pretrain", "step": 0,
                "steps": self.steps, "checkpoint": None, "checkpoint_step": None, "pid": None,
                "tokens": 0, "tokens_per_s": None, "eta_s": None, "elapsed_s": 0.0,
                "seg": self.seg, "run_dir": self.dir, "engine": self.engine_path,
                "config_path": os.path.abspath(self.config_path), "config": self.cfg,
                "message": None, "started_at": round(time.time(), 3)}

    def set_samples(self, samples):
        self.samples = samples
        self.samples_version += 1
        write_json_atomic(self.samples_path, samples)

    # -- the loss log -----------------------------------------------------------------------------

    def add_record(self, rec):
        now = time.time()
        rec.update(seg=self.seg, time=round(now, 3),
                   elapsed=round(self.elapsed_base + now - self.seg_t0, 3))
        if not self.pending:
            self.pending_since = time.monotonic()
        self.pending.append(rec)

    def flush(self, force=False):
        now = time.monotonic()
        if self.pending and (force or len(self.pending) >= FLUSH_RECORDS
                             or now - self.pending_since >= FLUSH_SECONDS):
            self.log.append(self.pending)
            self.pending = []
        if self.state_dirty and (force or now - self.state_written >= STATE_SECONDS):
            self.write_state()

    # -- engine events ----------------------------------------------------------------------------

    def handle_line(self, line):
        try:
            rec = json.loads(line)
        except ValueError:
            rec = None
        if not isinstance(rec, dict):  # not protocol: show it rather than lose it
            sys.stderr.write(line)
            return
        event = rec.get("event")
        handler = {None: self.on_record, "start": self.on_start, "sample": self.on_sample,
                   "polish": self.on_polish, "checkpoint": self.on_checkpoint,
                   "exit": self.on_exit, "memory": self.on_memory}.get(event)
        if handler:
            handler(rec)

    def on_start(self, rec):
        """The engine has loaded its checkpoint (or initialised) at step k: from here on, anything
        the log holds beyond k is a future that will not happen."""
        k = rec.get("step", 0)
        self.steps = rec.get("steps", self.steps)
        self.tokens_per_step = rec.get("tokens_per_step")
        self.flush(force=True)
        marked = self.log.supersede_after(k)
        before = self.log.last_live(lambda r: "elapsed" in r and r.get("step", 0) <= k)
        self.elapsed_base = before["elapsed"] if before else 0.0
        self.seg_t0 = time.time()
        tokens = before.get("tokens", 0) if before else 0
        kind = "resume" if len(self.log) else "start"
        self.log.append([{"event": kind, "step": k, "tokens": tokens, "seg": self.seg,
                          "time": round(self.seg_t0, 3), "elapsed": self.elapsed_base,
                          "superseded": marked}])
        if any(s.get("step", 0) > k and not s.get("superseded") for s in self.samples):
            self.set_samples([dict(s, superseded=True) if s.get("step", 0) > k else s
                              for s in self.samples])
        polish = self.cfg.get("polish")
        phase = "polish" if polish and k >= polish["start_step"] else "pretrain"
        self.set_state(force=True, status="running", step=k, steps=self.steps, phase=phase,
                       tokens=tokens, elapsed_s=self.elapsed_base, seg=self.seg)
        what = f"resuming at step {k}" if k else "starting at step 0"
        extra = f"; {marked} logged records beyond step {k} marked superseded" if marked else ""
        say(f"{self.name}: {what} of {self.steps} ({rec.get('engine', '?')} engine, "
            f"{rec.get('n_params', '?')} parameters){extra}")

    def on_memory(self, rec):
        self.set_state(memory_bytes=rec.get("total_bytes"))

    def on_record(self, rec):
        if "step" not in rec or ("loss" not in rec and "val_loss" not in rec):
            return
        if "loss" in rec:
            self.on_train(rec)
        elif self.tokens_per_step:
            rec.setdefault("tokens", rec["step"] * self.tokens_per_step)
        self.add_record(rec)

    def on_train(self, rec):
        now = time.time()
        self.window.append((now, rec["step"], rec.get("tokens", 0)))
        t0, s0, k0 = self.window[0]
        if len(self.window) >= 2 and rec["step"] > s0 and now > t0:
            sec_per_step = (now - t0) / (rec["step"] - s0)
            tokens_per_s = (rec.get("tokens", 0) - k0) / (now - t0)
        else:  # too early to measure: trust the engine's own timing
            sec_per_step = rec.get("ms", 0) / 1000
            tokens_per_s = rec.get("tokens_per_s")
        eta = max(0, self.steps - rec["step"]) * sec_per_step
        self.set_state(step=rec["step"], tokens=rec.get("tokens"), phase=rec.get("phase", "pretrain"),
                       tokens_per_s=round(tokens_per_s, 1) if tokens_per_s else None,
                       eta_s=round(eta, 1), loss=rec.get("loss"), lr=rec.get("lr"),
                       elapsed_s=round(self.elapsed_base + now - self.seg_t0, 3))

    def on_sample(self, rec):
        i = rec.get("prompt", 0)
        prompt = (self.prompt_texts[i] if isinstance(i, int) and 0 <= i < len(self.prompt_texts)
                  else decode_tokens(rec.get("prompt_tokens", [])))
        self.set_samples(self.samples + [{"step": rec.get("step"), "prompt": prompt,
                                          "text": decode_tokens(rec.get("tokens", []))}])

    def on_polish(self, rec):
        """Pretraining ends at step s (the engine switches data and LR itself, so resume stays
        exact). Its samples and state are archived right here, at the boundary; the engine is asked
        for a checkpoint (SIGUSR1, training continues), which joins the archive when it is written:
        the first checkpoint at or after step s. The loss log is never archived: it is one history."""
        s = rec.get("step", 0)
        self.add_record({"event": "polish", "step": s, "tokens": self.state.get("tokens")})
        self.flush(force=True)
        dest = self.archive_dir(s)
        if os.path.exists(dest):  # a resume that replays the boundary: the archive is already made
            say(f"polish at step {s}: {dest} exists, keeping its samples and state")
        else:
            self.set_state(step=s)
            self.archive_samples_and_state(dest)
        if not os.path.exists(os.path.join(dest, os.path.basename(self.ckpt_path))):
            self.polish_step = s
            self.signal_engine(signal.SIGUSR1)
            say(f"polish phase starts at step {s}: asked the engine for a checkpoint to keep")
        self.set_state(force=True, phase="polish", archive=os.path.relpath(dest, self.dir))

    def archive_dir(self, s):
        return os.path.join(self.dir, "archive", f"step_{s}")

    def archive_samples_and_state(self, dest):
        """Move .samples.json and .state.json aside (the directory appears whole or not at all) and
        start fresh samples for the polish phase."""
        tmp = dest + ".tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
        write_json_atomic(os.path.join(tmp, os.path.basename(self.samples_path)), self.samples)
        write_json_atomic(os.path.join(tmp, os.path.basename(self.state_path)), self.state)
        os.rename(tmp, dest)
        self.set_samples([])
        say(f"archived the pretraining samples and state in {dest}")

    def on_checkpoint(self, rec):
        ckpt = rec.get("path") or self.ckpt_path
        self.set_state(force=True, checkpoint=ckpt, checkpoint_step=rec.get("step"))
        if self.polish_step is not None:
            self.keep_checkpoint(self.archive_dir(self.polish_step), ckpt)
            self.polish_step = None

    def keep_checkpoint(self, dest, ckpt):
        """Copy the checkpoint (sidecar first: the checkpoint's presence means the copy is whole)."""
        for src in (ckpt + ".json", ckpt):
            if os.path.exists(src):
                target = os.path.join(dest, os.path.basename(src))
                with open(src, "rb") as fin, atomic_open(target) as fout:
                    shutil.copyfileobj(fin, fout)
        kept = os.path.join(dest, os.path.basename(ckpt))
        state_path = os.path.join(dest, os.path.basename(self.state_path))
        archived = read_json(state_path, {})
        write_json_atomic(state_path, {**archived, "checkpoint": kept,
                                       "checkpoint_step": checkpoint_step(kept)})
        say(f"kept the checkpoint of step {checkpoint_step(kept)} in {dest}")

    def on_exit(self, rec):
        self.exit_reason = rec.get("reason")
        self.set_state(step=rec.get("step", self.state.get("step")))

    # -- signals ----------------------------------------------------------------------------------

    def signal_engine(self, sig):
        if self.proc and self.proc.poll() is None:
            try:
                os.kill(self.proc.pid, sig)
            except ProcessLookupError:
                pass

    def on_signal(self, sig, _frame):
        """Signals only forward and take note; the main loop reports and reacts. (No printing
        here: the handler may interrupt a print of the main thread, and buffered I/O is not
        reentrant.)"""
        if sig in (signal.SIGTERM, signal.SIGINT) and self.stop_signal is None:
            self.stop_signal = sig
        self.signal_engine(sig)

    def announce_stop(self):
        if self.stop_signal is not None and not self.stop_announced:
            self.stop_announced = True
            say(f"{signal.Signals(self.stop_signal).name}: asked the engine to checkpoint and stop")

    # -- the engine process -----------------------------------------------------------------------

    def launch(self):
        resume = os.path.exists(self.ckpt_path)
        cmd = [self.engine_path] + engine_args(self.cfg, self.flags, self.prompt_ids, self.ckpt_path,
                                               resume)
        # A process group of its own: a terminal's Ctrl-C reaches only the proxy, which forwards it
        # once, so the engine sees exactly the signals the proxy decided to send.
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     start_new_session=True)
        kept = {k: self.state[k] for k in ("checkpoint", "checkpoint_step", "archive")
                if k in self.state}
        self.state = {**self.base_state(), **kept}
        self.set_state(force=True, pid=self.proc.pid, step=checkpoint_step(self.ckpt_path) or 0)
        if self.stop_signal is not None:  # a signal that arrived before the engine existed
            self.signal_engine(self.stop_signal)

    def run(self):
        """Launch the engine, follow it to its end, return the proxy's exit code. If the proxy
        itself fails (a bug in a handler, a full disk), the engine must not train on unobserved:
        it is stopped with a checkpoint and the run is marked crashed."""
        try:
            return self.follow()
        except Exception as e:  # noqa: BLE001  (any failure: the engine must not outlive the proxy)
            return self.abort(e)

    def follow(self):
        lines = queue.Queue()
        self.launch()
        threading.Thread(target=_pump, args=(self.proc.stdout, lines), daemon=True).start()
        err = threading.Thread(target=_tee_stderr, args=(self.proc.stderr, self.stderr_tail),
                               daemon=True)
        err.start()
        while True:
            try:
                line = lines.get(timeout=FLUSH_SECONDS)
            except queue.Empty:
                line = ""
            if line is None:
                break
            if line:
                self.handle_line(line)
            self.announce_stop()
            self.flush()
        rc = self.proc.wait()
        err.join(timeout=5)
        self.flush(force=True)
        return self.finish(rc)

    def abort(self, exc):
        """SIGTERM the engine (it checkpoints and exits), SIGKILL it if it takes too long, mark the
        run crashed (not stopped: nobody asked it to stop, and the log may lack the steps between
        the failure and the checkpoint), and return 1 after one error line."""
        where = traceback.extract_tb(exc.__traceback__)[-1]
        why = (f"proxy failed: {type(exc).__name__}: {exc} "
               f"({os.path.basename(where.filename)}:{where.lineno})")
        if self.proc and self.proc.poll() is None:
            self.signal_engine(signal.SIGTERM)
            try:
                self.proc.wait(timeout=ABORT_WAIT_SECONDS)
            except subprocess.TimeoutExpired:
                self.signal_engine(signal.SIGKILL)
                self.proc.wait()
                why += f"; engine did not stop within {ABORT_WAIT_SECONDS} s of SIGTERM, killed"
        step = checkpoint_step(self.ckpt_path)
        if self.proc:
            why += "; last checkpoint: " + (f"step {step}" if step is not None else "none")
        try:
            kept = {"checkpoint": self.ckpt_path, "checkpoint_step": step} if step is not None else {}
            self.set_state(force=True, status="crashed", pid=None, eta_s=None, message=why, **kept)
        except OSError as e:  # the failure may be the full disk itself: still say what happened
            why += f"; could not record the crash in {self.state_path}: {e.strerror or e}"
        print(f"error: {self.name}: {why}", file=sys.stderr, flush=True)
        return 1

    def finish(self, rc):
        step = self.state.get("step")
        if rc == 0 and self.exit_reason in ("finished", "already_finished"):
            self.set_state(force=True, status="finished", pid=None, eta_s=0, message=None)
            say(f"{self.name} finished at step {step}; checkpoint {self.ckpt_path}")
            return 0
        if rc == 0 and self.exit_reason == "signal":
            self.set_state(force=True, status="stopped", pid=None, eta_s=None, message=None)
            say(f"{self.name} stopped at step {step} with checkpoint {self.state.get('checkpoint')}; "
                "run the same command to resume")
            return 0
        if rc < 0:
            why = f"engine killed by {signal_name(-rc)}"
        elif rc == 0:
            why = "engine exited without saying why"
        else:
            last = next((ln for ln in reversed(self.stderr_tail) if ln.startswith("error")), None)
            why = f"engine exited with code {rc}" + (f": {last}" if last else "")
        self.set_state(force=True, status="crashed", pid=None, eta_s=None, message=why)
        say(f"{self.name} crashed at step {step}: {why}; run the same command to resume from the "
            "last checkpoint")
        return rc if rc > 0 else 1


def signal_name(num):
    """SIGKILL, ...; real-time signals other than SIGRTMIN/SIGRTMAX have no name in Python."""
    try:
        return signal.Signals(num).name
    except ValueError:
        return f"signal {num}"


def _pump(stream, lines):
    for raw in iter(stream.readline, b""):
        lines.put(raw.decode("utf-8", "replace"))
    lines.put(None)


def _tee_stderr(stream, tail):
    """Pass the engine's messages through as they come, and keep the last few for the state."""
    for raw in iter(stream.readline, b""):
        text = raw.decode("utf-8", "replace")
        sys.stderr.write(text)
        sys.stderr.flush()
        tail.append(text.strip())


# ---------------------------------------------------------------------------------------------------


def parse_args(argv):
    p = argparse.ArgumentParser(description="Train with an engine, log the run and serve its "
                                            "live dashboard (see docs/PROXY.md).")
    p.add_argument("config", help="experiment JSON, e.g. experiments/ANDREA-12M-TRAIN.json")
    p.add_argument("--engine", choices=sorted(ENGINES), default=None,
                   help="build/microgpt_cuda (default when built and a GPU is visible; else the "
                        "CPU engine, with a warning) or build/microgpt_cpu")
    p.add_argument("--engine-binary", metavar="PATH",
                   help="run this engine executable instead (a custom build, or a test double)")
    p.add_argument("--run-dir", help="run directory (default: runs/<name>/ in the repository)")
    p.add_argument("--host", default="127.0.0.1", help="address the dashboard binds (default "
                   "127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=None,
                   help=f"dashboard port (default {DEFAULT_PORT}, or a free one if that is taken; "
                        "0: any free port)")
    p.add_argument("--no-server", action="store_true", help="do not serve the dashboard")
    p.add_argument("--keep-serving", action="store_true",
                   help="keep the dashboard up after the engine exits (or for a finished run), "
                        "until Ctrl-C")
    return p.parse_args(argv)


def fail(msg, code=2):
    print(f"error: {msg}", file=sys.stderr)
    sys.exit(code)


def pick_engine(args):
    """--engine-binary as given, or choose_engine's pick (its warning printed once, here)."""
    if args.engine_binary:
        engine = os.path.abspath(args.engine_binary)
        if not _built(engine):
            raise EngineChoiceError(f"engine {engine} not found or not executable")
        return engine
    engine, warning = choose_engine(args.engine, args.engine != "cpu" and gpu_visible())
    if warning:
        print(f"warning: {warning}", file=sys.stderr, flush=True)
    return engine


def main(argv):
    args = parse_args(argv)
    try:
        engine = pick_engine(args)
        flags = engine_flags(engine)  # the config's keys come from the engine itself
    except EngineChoiceError as e:
        fail(str(e))
    try:
        cfg = load_config(args.config, flags)
        prompt_ids = tokenize_prompts(cfg, flags)
    except ConfigError as e:
        fail(f"{args.config}: {e}")
    run_dir = args.run_dir or os.path.join(ROOT, "runs", cfg["name"])
    try:
        run = Run(cfg, flags, args.config, run_dir, engine, prompt_ids)
    except (RunBusyError, LossLogError, OSError) as e:
        fail(str(e))

    done = checkpoint_step(run.ckpt_path)
    finished = done is not None and done >= run.steps
    server = None
    if not args.no_server:
        import proxy_server
        try:
            server = proxy_server.start_for_run(run, args.host, args.port, DEFAULT_PORT)
        except OSError as e:
            fail(f"cannot serve the dashboard on {args.host}:{args.port}: {e.strerror or e}")
        say(f"dashboard: {server.url}?token={server.token}")

    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):
        signal.signal(sig, run.on_signal)
    if finished:
        run.set_state(force=True, status="finished", pid=None, step=done)
        say(f"{run.name} already finished: checkpoint {run.ckpt_path} is at step {done} of "
            f"{run.steps}; nothing to train")
        code = 0
    else:
        code = run.run()
    if server and not args.keep_serving:
        time.sleep(LINGER_SECONDS)  # let open dashboards receive the final status before we go
    if server and args.keep_serving:
        say("run over; still serving the dashboard, Ctrl-C to quit")
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: stop.set())
        while not stop.wait(0.5):
            pass
    run.log.close()
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
