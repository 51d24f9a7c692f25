"""A run and its engine process (docs/DESIGN.md §5): launch the engine, follow its output to the
end, forward signals, and say how it ended.

Signals: SIGTERM/SIGINT are forwarded to the engine, which checkpoints and exits; the proxy then
marks the run stopped and exits 0. SIGUSR1 is forwarded (checkpoint, keep training). An engine that
dies any other way leaves the run crashed and the proxy exits non-zero; re-running resumes. If the
proxy itself fails while the engine runs, it stops the engine (SIGTERM, then SIGKILL after
ABORT_WAIT_SECONDS), marks the run crashed and exits 1.
"""
import collections
import os
import queue
import secrets
import signal
import subprocess
import sys
import threading
import time
import traceback

from microgpt.checkpoint import CheckpointError, checkpoint_step
from microgpt.config import engine_args
from microgpt.events import Clock, EventHandler, say
from microgpt.loss_log import LossBuffer, LossLog
from microgpt.run_dir import RunFiles, RunState, lock_run

ABORT_WAIT_SECONDS = 30  # after a proxy failure: how long the engine gets to checkpoint on SIGTERM
POLL_SECONDS = LossBuffer.FLUSH_SECONDS  # the main loop wakes at least this often to flush


class Run:
    """One run directory: its config, lock, loss log, state and samples. What the dashboard server
    reads (state, samples, log, token, dir and the version counters) is here."""

    def __init__(self, cfg, flags, config_path, run_dir, engine_path, prompt_ids):
        self.cfg, self.flags, self.config_path, self.engine_path = cfg, flags, config_path, engine_path
        self.prompt_ids, self.prompt_texts = prompt_ids, cfg.get("sample", {}).get("prompts", [])
        self.name = cfg["name"]
        self.files = RunFiles(run_dir, self.name)
        self.dir = self.files.dir
        os.makedirs(self.dir, exist_ok=True)
        self.lock = lock_run(self.files.lock)  # before the log is opened (and maybe repaired)
        self.log = LossLog(self.files.loss)
        if self.log.message:
            say(self.log.message)
        self.buffer = LossBuffer(self.log)
        self.store = RunState(self.files)
        self.token = secrets.token_urlsafe(18)  # authorises requests that change the run
        self.steps = cfg["train"]["steps"]
        self.clock = Clock(1 + (self.log.record(len(self.log) - 1).get("seg", 0) if len(self.log) else 0))

    # the server's view
    state = property(lambda self: self.store.state)
    samples = property(lambda self: self.store.samples)
    state_version = property(lambda self: self.store.state_version)
    samples_version = property(lambda self: self.store.samples_version)

    def flush(self, force=False):
        self.buffer.flush(force)
        self.store.write_state(due_only=not force)

    def base_state(self, pid):
        return {"name": self.name, "status": "running", "phase": "pretrain", "step": 0,
                "steps": self.steps, "checkpoint": None, "checkpoint_step": None, "pid": pid,
                "tokens": 0, "tokens_per_s": None, "eta_s": None, "elapsed_s": 0.0,
                "seg": self.clock.seg, "run_dir": self.dir, "engine": self.engine_path,
                "config_path": os.path.abspath(self.config_path), "config": self.cfg,
                "message": None, "started_at": round(time.time(), 3)}


class Supervisor:
    """The engine process of a run: launched, followed, signalled, and its end reported."""

    def __init__(self, run):
        self.run = run
        self.proc = None
        self.events = EventHandler(run, self.signal_engine)
        self.stderr_tail = collections.deque(maxlen=8)
        self.stop_signal = None  # SIGTERM/SIGINT received: the engine was asked to stop
        self.stop_announced = False

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
        run = self.run
        resume = os.path.exists(run.files.ckpt)
        cmd = [run.engine_path] + engine_args(run.cfg, run.flags, run.prompt_ids, run.files.ckpt, resume)
        # A process group of its own: a terminal's Ctrl-C reaches only the proxy, which forwards it
        # once, so the engine sees exactly the signals the proxy decided to send.
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     start_new_session=True)
        kept = {k: run.state[k] for k in ("checkpoint", "checkpoint_step", "archive") if k in run.state}
        run.store.state = {**run.base_state(self.proc.pid), **kept}
        run.store.set_state(force=True, step=checkpoint_step(run.files.ckpt) or 0)
        if self.stop_signal is not None:  # a signal that arrived before the engine existed
            self.signal_engine(self.stop_signal)

    def run_engine(self):
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
                line = lines.get(timeout=POLL_SECONDS)
            except queue.Empty:
                line = ""
            if line is None:
                break
            if line:
                self.events.handle_line(line)
            self.announce_stop()
            self.run.flush()
        rc = self.proc.wait()
        err.join(timeout=5)
        self.run.flush(force=True)
        return self.finish(rc)

    def abort(self, exc):
        """SIGTERM the engine (it checkpoints and exits), SIGKILL it if it takes too long, mark the
        run crashed (not stopped: nobody asked it to stop, and the log may lack the steps between
        the failure and the checkpoint), and return 1 after one error line."""
        run = self.run
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
        try:
            step = checkpoint_step(run.files.ckpt)
        except CheckpointError:
            step = None
        if self.proc:
            why += "; last checkpoint: " + (f"step {step}" if step is not None else "none")
        try:
            kept = {"checkpoint": run.files.ckpt, "checkpoint_step": step} if step is not None else {}
            run.store.set_state(force=True, status="crashed", pid=None, eta_s=None, message=why, **kept)
        except OSError as e:  # the failure may be the full disk itself: still say what happened
            why += f"; could not record the crash in {run.files.state}: {e.strerror or e}"
        print(f"error: {run.name}: {why}", file=sys.stderr, flush=True)
        return 1

    def finish(self, rc):
        run, reason = self.run, self.events.exit_reason
        step = run.state.get("step")
        if rc == 0 and reason in ("finished", "already_finished"):
            run.store.set_state(force=True, status="finished", pid=None, eta_s=0, message=None)
            say(f"{run.name} finished at step {step}; checkpoint {run.files.ckpt}")
            return 0
        if rc == 0 and reason == "signal":
            run.store.set_state(force=True, status="stopped", pid=None, eta_s=None, message=None)
            say(f"{run.name} stopped at step {step} with checkpoint {run.state.get('checkpoint')}; "
                "run the same command to resume")
            return 0
        if rc < 0:
            why = f"engine killed by {signal_name(-rc)}"
        elif rc == 0:
            why = "engine exited without saying why"
        else:
            last = next((ln for ln in reversed(self.stderr_tail) if ln.startswith("error")), None)
            why = f"engine exited with code {rc}" + (f": {last}" if last else "")
        run.store.set_state(force=True, status="crashed", pid=None, eta_s=None, message=why)
        say(f"{run.name} crashed at step {step}: {why}; run the same command to resume from the "
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
