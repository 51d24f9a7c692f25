"""A run and its engine process (docs/DESIGN.md §5): launch the engine, follow its output to the
end, forward signals, and say how it ended.

With --ranks N (docs/DESIGN.md §17) the engine is N processes, ranks 0..N-1 of one data-parallel
run: rank 0's stdout is the run's, the others' messages are prefixed "rank R: ", every signal goes
to all of them, and a rank that dies is a crashed run.

Signals: SIGTERM/SIGINT are forwarded to the engine, which checkpoints and exits; the proxy then
marks the run stopped and exits 0. SIGHUP (the terminal closed: an ssh session dropped) stops the
same way, forwarded as SIGTERM. SIGUSR1 is forwarded (checkpoint, keep training). An engine that
dies any other way leaves the run crashed and the proxy exits non-zero; re-running resumes. If the
proxy itself fails while the engine runs, failure.py stops the engine and marks the run crashed.
"""
import collections
import os
import queue
import signal
import socket
import subprocess
import threading
import time

from microgpt.checkpoint import CheckpointError, read_header, sidecar_step, whole_checkpoint_step
from microgpt.config import engine_args
from microgpt.events import Clock, EventHandler
from microgpt.failure import abort
from microgpt.terminal import progress_line, say, summary, terminal
from microgpt.loss_log import LossBuffer, LossLog
from microgpt.run_dir import (RunBusyError, RunFiles, RunState, lock_run, roll_back_checkpoint,
                              undo_a_cut_checkpoint_write)

POLL_SECONDS = LossBuffer.FLUSH_SECONDS  # the main loop wakes at least this often to flush
ENGINE_SIGNALS = {signal.SIGTERM, signal.SIGINT, signal.SIGUSR1}  # the ones the proxy forwards
PEER_GRACE_SECONDS = 30  # after rank 0 ends, how long the other ranks get to end by themselves
RANK_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")  # torchrun's names
# NVLink multicast stays off in every process of a multi-GPU run (NCCL, PyTorch, NVSHMEM)
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def engine_signal(sig):
    """The signal the engine gets for the proxy's `sig`. SIGHUP is a stop: the engine runs in a
    session of its own, out of the terminal's reach, and the proxy, whose default on SIGHUP was to
    die, left it to die at its next write to the proxy, unsaved."""
    return signal.SIGTERM if sig == signal.SIGHUP else sig


class Run:
    """One run directory: its config, lock, loss log, state and samples. What the dashboard server
    reads (state, samples, log, dir and the version counters) is here."""

    def __init__(self, cfg, flags, config_path, run_dir, engine_path, prompt_ids):
        self.cfg, self.flags, self.config_path, self.engine_path = cfg, flags, config_path, engine_path
        self.prompt_ids, self.prompt_texts = prompt_ids, cfg.get("sample", {}).get("prompts", [])
        self.name = cfg["name"]
        self.files = RunFiles(run_dir, self.name)
        self.files.refuse_special_files()
        self.dir = self.files.dir
        self.existed = self.files.existing()  # what a launch the engine refuses must leave as it was
        os.makedirs(self.dir, exist_ok=True)
        self.lock = lock_run(self.files.lock)  # before the log is opened (and maybe repaired)
        self.files.remove_stale_temps()
        self.log = LossLog(self.files.loss)
        if self.log.message:
            say(self.log.message)
        self.buffer = LossBuffer(self.log)
        self.store = RunState(self.files)
        for message in self.store.messages:
            say(message)
        self.previous_config = self.store.state.get("config")  # the last launch's, to tell changes
        self.note_an_unrecorded_end()
        self.finish_a_cut_checkpoint_write()
        self.replay_unlogged_steps()
        self.steps = cfg["train"]["steps"]
        self.clock = Clock(1 + (self.log.record(len(self.log) - 1).get("seg", 0) if len(self.log) else 0))

    # the server's view
    state = property(lambda self: self.store.state)
    samples = property(lambda self: self.store.samples)
    state_version = property(lambda self: self.store.state_version)
    samples_version = property(lambda self: self.store.samples_version)

    def note_an_unrecorded_end(self):
        """A state still "running" was left by a proxy that died (this one holds the lock now): mark
        that launch crashed. Its engine may outlive it for a moment; training beside it would race
        it for the checkpoint, so that is refused."""
        state = self.store.state
        if state.get("status") != "running":
            return
        pid = state.get("pid")
        if engine_alive(pid, state.get("engine")):
            raise RunBusyError(f"the engine of an earlier launch of this run (pid {pid}) is still "
                               f"running without its proxy; stop it first (kill {pid})")
        self.store.set_state(force=True, status="crashed", pid=None, eta_s=None,
                             message="the previous launch ended without recording it (its proxy "
                                     "was killed)")
        say("the previous launch ended without recording it (its proxy was killed): marked crashed")

    def finish_a_cut_checkpoint_write(self):
        undone = undo_a_cut_checkpoint_write(self.files.ckpt)
        if undone:
            say(f"the engine was killed while it renamed its checkpoint of step {undone[0]} into place: "
                f"resuming from the checkpoint before it, step {undone[1]}")

    def replay_unlogged_steps(self):
        """The engine does not wait for the proxy: a proxy killed while it lagged behind the engine
        leaves a checkpoint whose event it never handled, so the records before it (a step's,
        its evaluation's) may never have reached the log, and resuming there would lose them for
        good. .state.json's checkpoint_step is the last checkpoint whose records were all on disk
        (EventHandler.on_checkpoint flushes, then records it); where the state names none (it was
        removed, damaged, or its launch handled no checkpoint), the log itself says how far its
        records reach (steps_logged_whole). Past that, the previous checkpoint becomes the newest
        (roll_back_checkpoint), and the engine trains, and the proxy logs, the steps after it again
        (bit-exact: the same steps; the records they replace superseded)."""
        ckpt = self.files.ckpt
        if not os.path.exists(ckpt + ".ahead"):  # else a rollback was cut short: finish it
            if not (os.path.exists(ckpt) and os.path.exists(ckpt + ".prev")):
                return
            try:
                (newest, n_newest), (previous, n_previous) = read_header(ckpt), read_header(ckpt + ".prev")
            except CheckpointError:  # a damaged slot: the engine refuses it, with what to do
                return
            if sidecar_step(ckpt) != newest or sidecar_step(ckpt + ".prev") != previous:
                return  # a header its sidecar contradicts (a flipped bit): the engine's to refuse too
            logged = self.store.state.get("checkpoint_step")
            from_state = isinstance(logged, int) and not isinstance(logged, bool)
            if not from_state:
                logged = self.steps_logged_whole()
            if newest <= logged or previous >= newest or n_previous != n_newest:  # not this run's
                return
            unsure = (f"; records of steps {logged + 1}..{previous} may be missing"
                      if previous > logged else "")
            again = (f"resuming from the previous checkpoint, step {previous}, to train and log steps "
                     f"{previous + 1}..{newest} again{unsure}")
            if from_state:
                say(f"the checkpoint of step {newest} was written after the proxy last logged one (step "
                    f"{logged}; it was killed): {again}")
            else:
                why = {"missing": "was missing", "damaged": "was damaged"}.get(
                    self.store.unread.get(self.files.state), "named no checkpoint")
                say(f"{os.path.basename(self.files.state)} {why}, so the loss log tells which steps "
                    f"were logged: every record up to step {logged}, short of the checkpoint of step "
                    f"{newest}: {again}")
        roll_back_checkpoint(ckpt)

    def steps_logged_whole(self):
        """The last step whose records the loss log holds all of: its last live record's step (a
        record is appended only after every record before it), but one less where that record is
        the step's train (or bandit) record and the step's evaluation, printed after it, is due
        (the config's eval.every, and the last step) and may not have been logged; 0 for a log
        with no record."""
        last = self.log.last_live(lambda r: "step" in r)
        if last is None:
            return 0
        step = last["step"]
        every = self.cfg.get("eval", {}).get("every", self.flags.get("eval.every", {}).get("default") or 0)
        due = every > 0 and (step % every == 0 or step == self.cfg["train"]["steps"])
        return step - 1 if due and last.get("event") in (None, "bandit") and "val_loss" not in last else step

    def discard_launch(self):
        """The engine refused to start: remove what this launch created; returns what to say. The
        lock is let go only after that: a second proxy that took it in between would have its run
        directory removed under it."""
        self.log.close()
        try:
            return self.files.remove_all_but(self.existed)
        finally:
            self.lock.close()

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

    def __init__(self, run, ranks=1):
        self.run = run
        self.ranks = ranks
        self.proc = None  # rank 0
        self.peers = []   # ranks 1..N-1
        self.lines = None  # the engine's stdout lines, as the reader thread queues them
        self.events = EventHandler(run)
        self.stderr_tail = collections.deque(maxlen=8)
        self.stop_signal = None  # a stop signal received: the engine was asked to stop
        self.stop_announced = False
        self.peer_failed = False  # a rank > 0 ended with an error: the others were asked to stop

    # -- signals ----------------------------------------------------------------------------------

    def signal_engine(self, sig):
        # rank 0 last: before the first step a rank that sees it gone ends cleanly only if its
        # own stop signal came first (docs/DESIGN.md §17). A stop is followed by SIGCONT, as a
        # shell's kill does for a stopped job: a process stopped by SIGSTOP (a debugger, kill
        # -STOP) holds the stop pending, and with several ranks every other one waited for it in
        # the step's agreement until ANDREA_DIST_TIMEOUT_S, and the run ended crashed.
        for proc in self.peers + [self.proc]:
            if proc and proc.poll() is None:
                try:
                    os.kill(proc.pid, sig)
                    if sig in (signal.SIGTERM, signal.SIGINT):
                        os.kill(proc.pid, signal.SIGCONT)
                except ProcessLookupError:
                    pass

    def on_signal(self, sig, _frame):
        """Signals only forward and take note; the main loop reports and reacts. (No printing
        here: the handler may interrupt a print of the main thread, and buffered I/O is not
        reentrant.)"""
        if sig != signal.SIGUSR1 and self.stop_signal is None:  # SIGTERM, SIGINT, SIGHUP: a stop
            self.stop_signal = sig
        self.events.checkpoint_asked = True  # each of these signals makes the engine checkpoint
        self.signal_engine(engine_signal(sig))

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
        # once, so the engine sees exactly the signals the proxy decided to send. It starts with
        # them blocked (the mask survives exec) and unblocks them once its handlers are installed
        # (host/signals.h): a SIGTERM forwarded right after the launch waits for the handler.
        mask = signal.pthread_sigmask(signal.SIG_BLOCK, ENGINE_SIGNALS)
        envs = rank_environments(self.ranks, run.engine_path)
        try:
            self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                         start_new_session=True, env=envs[0])
            self.peers = [subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                           start_new_session=True, env=env) for env in envs[1:]]
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        self.launched_at = time.monotonic()
        kept = {k: run.state[k] for k in ("checkpoint", "checkpoint_step", "archive") if k in run.state}
        run.store.held = True  # written once the engine has started (EventHandler.on_start)
        run.store.state = {**run.base_state(self.proc.pid), **kept}
        run.store.set_state(step=whole_checkpoint_step(run.files.ckpt) or 0)
        if self.stop_signal is not None:  # a signal that arrived before the engine existed
            self.signal_engine(engine_signal(self.stop_signal))

    def run_engine(self):
        """Launch the engine, follow it to its end, return the proxy's exit code. If the proxy
        itself fails (a bug in a handler, a full disk), the engine must not train on unobserved:
        it is stopped with a checkpoint and the run is marked crashed."""
        try:
            return self.follow()
        except Exception as e:  # noqa: BLE001  (any failure: the engine must not outlive the proxy)
            return abort(self, e)

    def follow(self):
        self.lines = lines = queue.Queue()
        self.launch()
        threading.Thread(target=_pump, args=(self.proc.stdout, lines), daemon=True).start()
        err = threading.Thread(target=_tee_stderr, args=(self.proc.stderr, self.stderr_tail),
                               daemon=True)
        err.start()
        self.peer_tails = [collections.deque(maxlen=8) for _ in self.peers]
        for rank, (peer, tail) in enumerate(zip(self.peers, self.peer_tails), start=1):
            threading.Thread(target=_tee_stderr, args=(peer.stderr, tail, f"rank {rank}: "),
                             daemon=True).start()
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
            self.stop_after_a_failed_peer()
            self.run.flush()
            if self.run.state.get("loss") is not None:  # from the first step record on
                terminal.progress(progress_line(self.run.state))
        rc = self.proc.wait()
        err.join(timeout=5)
        rc = self.wait_for_peers(rc)
        terminal.end_progress()
        if not self.events.started and rc > 0:
            return self.refused(rc)
        self.run.flush(force=True)
        code = self.finish(rc)
        self.summarize()
        return code

    def stop_after_a_failed_peer(self):
        """A rank > 0 that failed is seen by the others through its socket once they are
        connected, but rank 0 would wait for one that never connected until ANDREA_DIST_TIMEOUT_S
        (600 s by default): asked to stop, the ranks end now (docs/DESIGN.md §17)."""
        if self.peer_failed:
            return
        for rank, peer in enumerate(self.peers, start=1):
            if peer.poll() not in (None, 0):
                self.peer_failed = True
                say(f"rank {rank} ended before rank 0: asking the other ranks to stop")
                self.signal_engine(signal.SIGTERM)
                return

    def wait_for_peers(self, rc):
        """Rank 0 has ended: the others end with it (they would wait for it until their timeout
        otherwise). The run's exit code is rank 0's, unless it ended well and another rank did
        not. A rank that failed first is named in the messages (rank 0 then says it lost it)."""
        deadline = time.monotonic() + (PEER_GRACE_SECONDS if rc == 0 else 2)
        stopped_here = set()
        for peer in self.peers:
            try:
                peer.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                peer.kill()  # rank 0 holds and writes the state: nothing of the others' is lost
                peer.wait()
                stopped_here.add(peer)
        for rank, peer in enumerate(self.peers, start=1):
            if peer.returncode != 0 and peer not in stopped_here:
                how = (f"killed by {signal_name(-peer.returncode)}" if peer.returncode < 0
                       else f"exit code {peer.returncode}")
                say(f"rank {rank} of {self.ranks} ended with {how}")
                if rc == 0:
                    self.stderr_tail.append(f"error: rank {rank} ended with {how}")
                    rc = peer.returncode if peer.returncode > 0 else 1
        return rc

    def refused(self, rc):
        """The engine said why it will not start (its `error:` line went to stderr as it came) and
        nothing ran: nothing is recorded either, and the proxy exits with the engine's code."""
        where = self.run.discard_launch()
        say(f"the engine refused to start (exit code {rc}), so nothing was trained; {where}")
        return rc

    def summarize(self):
        summarize(self.run, time.monotonic() - self.launched_at)

    def finish(self, rc):
        run, reason = self.run, self.events.exit_reason
        run.store.held = False  # an engine that dies before its start event: that is recorded
        step = run.state.get("step")
        if rc == 0 and reason in ("finished", "already_finished"):
            run.store.set_state(force=True, status="finished", pid=None, eta_s=0, message=None)
            say(f"{run.name} finished at step {step}; checkpoint {run.files.ckpt}")
            return 0
        if rc == 0 and reason == "signal":
            run.store.set_state(force=True, status="stopped", pid=None, eta_s=None, message=None)
            # stopped before its first step, a new run has nothing to save (host/signals.h)
            ckpt = run.state.get("checkpoint") or (run.files.ckpt if os.path.exists(run.files.ckpt) else None)
            kept = (f"with checkpoint {ckpt}; run the same command to resume" if ckpt else
                    "before any checkpoint; run the same command to start again")
            say(f"{run.name} stopped at step {step} {kept}")
            return 0
        if rc < 0:
            why = f"engine killed by {signal_name(-rc)}"
        elif rc == 0:
            why = "engine exited without saying why"
        else:
            last = next((ln for ln in reversed(self.stderr_tail) if ln.startswith("error")), None)
            why = f"engine exited with code {rc}" + (f": {last}" if last else "")
        run.store.set_state(force=True, status="crashed", pid=None, eta_s=None, message=why)
        again = ("resume from the last checkpoint" if os.path.exists(run.files.ckpt)
                 else "start again (there is no checkpoint yet)")
        say(f"{run.name} crashed at step {step}: {why}; run the same command to {again}")
        return rc if rc > 0 else 1


def summarize(run, launch_seconds):
    """Say the summary of the run as it stands (terminal.summary)."""
    step = run.state.get("checkpoint_step")
    ckpt = (run.state.get("checkpoint") or run.files.ckpt, step) if step is not None else None
    for line in summary(run.state, launch_seconds, run.dir, ckpt):
        say(line)


def engine_alive(pid, engine):
    """True if process pid runs the executable `engine` (a pid alone may have been reused)."""
    if not isinstance(pid, int) or not isinstance(engine, str):
        return False
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv0 = f.read().split(b"\0")[0].decode(errors="replace")
    except OSError:
        return False
    return os.path.realpath(argv0) == os.path.realpath(engine)


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


def _tee_stderr(stream, tail, prefix=""):
    """Pass the engine's messages through as they come, and keep the last few for the state."""
    for raw in iter(stream.readline, b""):
        text = prefix + raw.decode("utf-8", "replace")
        terminal.passthrough(text)
        tail.append(text.strip())


def rank_environments(ranks, engine_path):
    """The environment of each rank (docs/DESIGN.md §17): torchrun's variables, rank 0 listening
    on a free local port, NVLink multicast off, and the CPU engine's OpenMP threads split between
    the ranks. One rank: the proxy's own environment without torchrun's variables (the proxy
    starts the ranks, so one left in its shell must not make the engine wait for others)."""
    inherited = {k: v for k, v in os.environ.items() if k not in RANK_VARIABLES}
    if ranks == 1:
        return [inherited]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    common = {**inherited, "WORLD_SIZE": str(ranks), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    for key, value in NO_MULTICAST.items():
        common.setdefault(key, value)
    if "cuda" not in os.path.basename(engine_path) and "OMP_NUM_THREADS" not in os.environ:
        common["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // ranks))
    return [{**common, "RANK": str(r), "LOCAL_RANK": str(r)} for r in range(ranks)]
