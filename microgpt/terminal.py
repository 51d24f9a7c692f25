"""What the proxy prints (docs/PROXY.md, "The terminal"): its messages, the engine's messages passed
through, a progress line at a steady cadence and a summary at the end.

On a terminal the progress line is one line rewritten in place (every TTY_SECONDS), cleared before
any other message; otherwise (a log file, a pipe) it is a plain line every PLAIN_SECONDS, left out
while it would repeat the last one word for word (a step slower than the interval). The proxy's
--progress-every sets another interval (0: no progress line)."""
import os
import shlex
import sys
import threading
import time

from microgpt.cli import point_at_devnull
from microgpt.run_dir import RunFiles

TTY_SECONDS = 1.0
PLAIN_SECONDS = 30.0


class Terminal:
    def __init__(self, out=None, err=None):
        self.out, self.err = out or sys.stdout, err or sys.stderr
        self.tty = self.out.isatty()
        self.lock = threading.Lock()  # the stderr pass-through runs in its own thread
        self.shown = False  # a progress line is on screen (TTY only)
        self.last_progress = 0.0
        self.last_plain = None  # the last plain progress line written
        self.interval = TTY_SECONDS if self.tty else PLAIN_SECONDS

    def _clear(self):
        if self.shown:
            self._write(self.out, "\r\033[K")
            self.shown = False

    @staticmethod
    def _write(stream, text):
        """Write and flush. A reader of the proxy's output that went away (`proxy | tee log`, tee
        ended by the same Ctrl-C that stops the run; `| head`; the terminal of a proxy run with
        `disown` or `setsid` closed, where writes fail with EIO) is no failure of the run, which its
        directory records: the proxy goes on, what it says going to /dev/null from then on (the
        OSError here crashed the run, and killed its stderr pass-through thread)."""
        try:
            stream.write(text)
            stream.flush()
        except OSError:
            point_at_devnull(stream.fileno())  # the text still buffered is flushed there later

    def say(self, msg):
        with self.lock:
            self._clear()
            self._write(self.out, f"[proxy] {msg}\n")

    def passthrough(self, text):
        """A line of the engine's stderr, as it came."""
        with self.lock:
            self._clear()
            self._write(self.err, text)

    def progress(self, line):
        """Show the progress line if it is due (the caller may call this as often as it likes)."""
        now = time.monotonic()
        if self.interval <= 0 or now - self.last_progress < self.interval:
            return
        self.last_progress = now
        with self.lock:
            if self.tty:
                self._write(self.out, "\r" + line[:max(20, _columns() - 1)] + "\033[K")
                self.shown = True
            elif line != self.last_plain:
                self._write(self.out, f"[proxy] {line}\n")
                self.last_plain = line

    def end_progress(self):
        with self.lock:
            self._clear()


def _columns():
    """The terminal's width; 120 where it is unknown (no terminal, or a pseudo-terminal whose size
    was never set, which reports 0 columns)."""
    try:
        return os.get_terminal_size().columns or 120
    except OSError:
        return 120


terminal = Terminal()
say = terminal.say


def duration(seconds):
    """12.3 -> "12s", 754 -> "12m34s", 7384 -> "2h03m04s"."""
    s = int(round(seconds))
    h, m = divmod(s, 3600)
    m, s = divmod(m, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else f"{m}m{s:02d}s" if m else f"{s}s"


def progress_line(state):
    """step 1200/20000 6.0% | loss 4.1234 | val 4.3501 | 95.2k tok/s | 2m10s | ETA 31m05s"""
    step, steps = state.get("step") or 0, state.get("steps") or 0
    parts = [f"step {step}/{steps} {100.0 * step / steps:.1f}%" if steps else f"step {step}"]
    if state.get("loss") is not None:
        parts.append(f"loss {state['loss']:.4f}")
    if state.get("val_loss") is not None:
        parts.append(f"val {state['val_loss']:.4f}")
    if state.get("tokens_per_s"):
        parts.append(f"{state['tokens_per_s'] / 1000:.1f}k tok/s")
    if state.get("elapsed_s") is not None:
        parts.append(duration(state["elapsed_s"]))
    if state.get("eta_s") is not None:
        parts.append(f"ETA {duration(state['eta_s'])}")
    if state.get("phase") == "polish":
        parts.append("polish")
    return " | ".join(parts)


def shown_path(path):
    """A path as the user can type it from here: relative if below the working directory."""
    rel = os.path.relpath(path)
    return path if rel.startswith("..") else rel


def shell_word(path):
    """A path as one word of a command to copy: quoted where a shell would split or expand it (a
    run directory "my run" made two arguments of it, one holding $(...) ran that command), and
    ./ before a relative path that starts with "-", which the tool would take for an option."""
    return shlex.quote(os.path.join(".", path) if path.startswith("-") else path)


def summary(state, launch_seconds, run_dir, checkpoint):
    """The lines said when a launch ends: how it ended, the losses, the time, the checkpoint, and
    what to do next."""
    lines = [f"summary: step {state.get('step')} of {state.get('steps')}, "
             f"{duration(state.get('elapsed_s') or 0)} of training (this launch {duration(launch_seconds)})"]
    losses = []
    if state.get("loss") is not None:
        losses.append(f"train loss {state['loss']:.4f}")
    if state.get("val_loss") is not None:
        losses.append(f"validation loss {state['val_loss']:.4f} (step {state.get('val_step')})")
    if losses:
        lines.append(", ".join(losses))
    if checkpoint is not None:
        lines.append(f"checkpoint {shown_path(checkpoint[0])} (step {checkpoint[1]})")
        # a run directory where the tools find this checkpoint in it, else the checkpoint file
        found = RunFiles.named_after(run_dir).ckpt == os.path.abspath(checkpoint[0])
        run = shell_word(shown_path(run_dir if found else checkpoint[0]))
        lines.append(f"chat with it:  python microgpt/chat.py {run}")
        lines.append(f"export it:     python scripts/export-hf.py {run} OUT_DIR")
    return lines
