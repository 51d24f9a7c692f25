"""When the proxy itself fails while the engine runs (a bug in a handler, a full disk): the engine
must not train on unobserved, and no checkpoint may get ahead of the loss log (docs/PROXY.md)."""
import os
import queue
import signal
import sys
import time
import traceback

from microgpt.checkpoint import whole_checkpoint_step
from microgpt.events import engine_record
from microgpt.loss_log import LossBuffer, LossLogError

ABORT_WAIT_SECONDS = 30  # how long the engine gets to checkpoint on SIGTERM



def abort(sup, exc):
    """The proxy failed while the engine runs: stop the engine and mark the run crashed (not
    stopped: nobody asked it to stop), then return 1 after one error line. If every record so
    far is on disk, the engine gets SIGTERM (it checkpoints and exits) and the records it prints
    on its way out are logged; if the log cannot be written (a full disk), it gets SIGKILL, so
    that no checkpoint gets ahead of the log: the next run trains and logs those steps again."""
    run = sup.run
    run.store.held = False
    where = traceback.extract_tb(exc.__traceback__)[-1]
    why = (f"proxy failed: {type(exc).__name__}: {exc} "
           f"({os.path.basename(where.filename)}:{where.lineno})")
    if sup.proc and sup.proc.poll() is None:
        why += _stop_engine(sup)
    elif sup.proc:  # it ended by itself: what it printed before its last checkpoint is still to log
        _log_plain_records(sup, timeout=1.0)
        unwritten = _unwritten_records(run)
        if unwritten:
            why += f"; {unwritten} could not be written to the loss log"
    step = whole_checkpoint_step(run.files.ckpt)
    if sup.proc:
        why += "; last checkpoint: " + (f"step {step}" if step is not None else "none")
    try:
        # checkpoint_step is the last checkpoint whose records are all on disk: with records left
        # unwritten, the engine (which does not wait for the proxy) may have checkpointed past them,
        # and the next start must roll back to the previous slot and log those steps again, not
        # take the newest checkpoint's step as logged.
        whole = step is not None and not run.buffer.pending
        kept = {"checkpoint": run.files.ckpt, "checkpoint_step": step} if whole else {}
        run.store.set_state(force=True, status="crashed", pid=None, eta_s=None, message=why, **kept)
    except OSError as e:  # the failure may be the full disk itself: still say what happened
        why += f"; could not record the crash in {run.files.state}: {e.strerror or e}"
    print(f"error: {run.name}: {why}", file=sys.stderr, flush=True)
    return 1


def _stop_engine(sup):
    """Stop the engine as abort() says; returns what happened, for its message."""
    unwritten = _unwritten_records(sup.run)
    if unwritten:
        sup.signal_engine(signal.SIGKILL)
        sup.proc.wait()
        return (f"; {unwritten} could not be written to the loss log, so the engine was killed "
                "without a checkpoint: the next run trains and logs those steps again")
    sup.signal_engine(signal.SIGTERM)
    deadline = time.monotonic() + ABORT_WAIT_SECONDS
    while sup.proc.poll() is None and time.monotonic() < deadline:
        _log_plain_records(sup, timeout=min(LossBuffer.FLUSH_SECONDS, max(0.0, deadline - time.monotonic())))
    said = ""
    if sup.proc.poll() is None:
        sup.signal_engine(signal.SIGKILL)
        said = f"; engine did not stop within {ABORT_WAIT_SECONDS} s of SIGTERM, killed"
    sup.proc.wait()
    _log_plain_records(sup, timeout=1.0)  # what the engine printed just before it exited
    unwritten = _unwritten_records(sup.run)
    return said + (f"; {unwritten} printed while the engine stopped could not be written to "
                   "the loss log" if unwritten else "")


def _unwritten_records(run):
    """Flush the loss buffer; None if that worked, else which records are not on disk."""
    pending = run.buffer.pending
    try:
        run.buffer.flush(force=True)
        return None
    except (OSError, LossLogError) as e:
        steps = [r.get("step") for r in pending]
        return f"{len(pending)} records (steps {steps[0]}..{steps[-1]}; {getattr(e, 'strerror', None) or e})"


def _log_plain_records(sup, timeout):
    """While the engine stops after a proxy failure: its step, validation and bandit records go to
    the loss log, placed on their tokens (and nothing else: the event handlers may be what failed)."""
    lines = sup.lines
    deadline = time.monotonic() + timeout
    while lines is not None:
        try:
            line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            return
        if line is None:
            return
        rec, _ = engine_record(line)
        if rec is None or not isinstance(rec.get("step"), int):
            continue
        if rec.get("event") == "bandit" or ("event" not in rec and ("loss" in rec or "val_loss" in rec)):
            sup.events.place_on_tokens(rec)
            sup.events.add_record(rec)
