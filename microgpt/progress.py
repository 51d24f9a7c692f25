"""A progress line on stderr for the data pipeline's long steps: done/total, rate, tokens/s, ETA.

On a terminal the line is redrawn in place (at most every 0.5 s); in a log it is printed once every
10 s, so a long step never stays silent and a log stays short.
"""
import sys
import time


def human(n):
    for unit in ("", "k", "M", "G", "T"):
        if abs(n) < 1000:
            return f"{n:.3g}{unit}"
        n /= 1000
    return f"{n:.3g}P"


def clock(seconds):
    seconds = int(seconds)
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


class Progress:
    def __init__(self, label, total, unit="B", out=None):
        # sys.stderr as it is now, not as it was when this module was imported (a stream since closed)
        out = sys.stderr if out is None else out
        self.label, self.total, self.unit, self.out = label, total, unit, out
        self.done = self.tokens = 0
        self.start = self.last = time.monotonic()
        self.tty = out.isatty()
        self.every = 0.5 if self.tty else 10.0

    def update(self, done=0, tokens=0):
        self.done += done
        self.tokens += tokens
        now = time.monotonic()
        if now - self.last >= self.every:
            self.last = now
            self.draw(now)

    def line(self, now):
        elapsed = max(now - self.start, 1e-9)
        rate = self.done / elapsed
        parts = [f"{self.label}: {human(self.done)}{self.unit}"]
        if self.total:
            parts[0] += f"/{human(self.total)}{self.unit} {100 * self.done / self.total:3.0f}%"
        parts.append(f"{human(rate)}{self.unit}/s")
        if self.tokens:
            parts.append(f"{human(self.tokens)} tokens, {human(self.tokens / elapsed)} tokens/s")
        if self.total and rate > 0:
            parts.append(f"ETA {clock(max(self.total - self.done, 0) / rate)}")
        parts.append(f"elapsed {clock(elapsed)}")
        return " | ".join(parts)

    def draw(self, now):
        if self.tty:
            self.out.write("\r\033[K" + self.line(now))
        else:
            self.out.write(self.line(now) + "\n")
        self.out.flush()

    def close(self):
        """The final line, always printed."""
        if self.tty:
            self.out.write("\r\033[K")
        self.out.write(self.line(time.monotonic()) + "\n")
        self.out.flush()
