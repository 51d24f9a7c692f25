"""The command lines of the Python tools (chat, evaluate, export, the proxy, the data and bench
scripts): bad input is one `error: ...` line on stderr and a non-zero exit, as the engines do.

Exit status 2 is a usage error: a flag argparse cannot parse, or a value a tool refuses (argparse's
own status for the same); --help still prints the full usage, exit 0. Exit status 141, with no
message, is a tool whose stdout's reader went away (stdout_closed); 130 (INTERRUPTED), with one
"interrupted" line, is a tool stopped by Ctrl-C."""
import argparse
import os
import re
import signal
import sys

USAGE_ERROR = 2
STDOUT_CLOSED = 128 + signal.SIGPIPE  # 141: a shell's status for a program that SIGPIPE ended
INTERRUPTED = 128 + signal.SIGINT  # 130: a shell's status for a program that Ctrl-C (SIGINT) ended
CONTROL_CHARACTERS = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f]")  # C0 but tab and newline, DEL, C1


def fail(message, code=USAGE_ERROR):
    """One `error: message` line on stderr, then exit with `code`."""
    print(f"error: {message}", file=sys.stderr, flush=True)
    sys.exit(code)


def stdout_closed():
    """For a tool whose stdout lost its reader mid-output (`chat.py ... | head`, BrokenPipeError):
    nothing more can be said there, and it is no fault of the input, so no message. Points stdout
    at /dev/null, so that Python's flush at exit does not fail again; returns the exit status, that
    of a program SIGPIPE ended (Python ignores the signal and raises instead)."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return STDOUT_CLOSED


def interrupted(tool, what):
    """For a tool stopped by Ctrl-C (KeyboardInterrupt): one line, "TOOL: interrupted; WHAT" (what
    was kept, how to go on), no traceback; returns the exit status of a program SIGINT ended."""
    print(f"\n{tool}: interrupted; {what}", file=sys.stderr)
    return INTERRUPTED


def shown_on_terminal(text):
    """Decoded text (a model's words, a tokenizer's output) as a terminal should show it: data, not
    commands. Its control characters (C0 but tab and newline, DEL, C1) are written as \\xNN escapes:
    a terminal acts on them (ESC starts sequences that move the cursor, rewrite the screen or
    retitle the window; CR returns over the line). For a terminal only: a pipe gets the text."""
    return CONTROL_CHARACTERS.sub(lambda m: f"\\x{ord(m.group()):02x}", text)


class ArgumentParser(argparse.ArgumentParser):
    """argparse.ArgumentParser whose errors (its own and every parser.error(...) a tool calls) are
    one `error:` line, exit 2, instead of the usage block and `prog: error: ...`."""

    def error(self, message):
        fail(f"{message} (see --help)")
