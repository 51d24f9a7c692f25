"""The command lines of the Python tools (chat, evaluate, export, the proxy, the data and bench
scripts): bad input is one `error: ...` line on stderr and a non-zero exit, as the engines do.

Exit status 2 is a usage error: a flag argparse cannot parse, or a value a tool refuses (argparse's
own status for the same); --help still prints the full usage, exit 0. Exit status 1 (IO_ERROR), with
one error line, is a tool that could not read its standard input or write its result (a full disk,
an I/O error: output_failed); 141, with no message, is a tool whose stdout's reader went away
(stdout_closed); 130 (INTERRUPTED), with one "interrupted" line, is a tool stopped by Ctrl-C (or
by SIGTERM, where the tool takes it so: stop_on_sigterm).

Every line a tool writes on stderr is one line whatever it quotes (a path holding a newline or an
escape sequence, a byte that is no UTF-8): one_line writes those characters as \\xNN, as the
engines write theirs (docs/DESIGN.md §3.8)."""
import argparse
import os
import re
import signal
import sys

USAGE_ERROR = 2
IO_ERROR = 1  # as the engines' exit status for a read of stdin or a write of an answer that fails
STDOUT_CLOSED = 128 + signal.SIGPIPE  # 141: a shell's status for a program that SIGPIPE ended
INTERRUPTED = 128 + signal.SIGINT  # 130: a shell's status for a program that Ctrl-C (SIGINT) ended
# C0 but tab and newline, DEL, C1; and the bidirectional embeddings, overrides and isolates
# (U+202A..U+202E, U+2066..U+2069), which make a terminal show the rest of the line reordered
CONTROL_CHARACTERS = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")
# Every C0 character, DEL, C1, and a byte that is no UTF-8 as Python's surrogateescape holds it (a
# path's, an argument's: U+DC80..U+DCFF) or any other lone surrogate
NOT_ONE_LINE = re.compile("[\x00-\x1f\x7f-\x9f\ud800-\udfff]")


def _escaped(pattern, text):
    """text with each character pattern matches written as an escape: \\xNN, also for a byte that is
    no UTF-8 (surrogateescape's U+DC80..U+DCFF), and \\uXXXX for any other lone surrogate."""
    def escape(m):
        c = ord(m.group())
        return f"\\x{c - 0xDC00:02x}" if 0xDC80 <= c <= 0xDCFF else f"\\u{c:04x}" if c > 0xFF else f"\\x{c:02x}"
    return pattern.sub(escape, text)


def one_line(text):
    """text as one line of stderr: control characters (newline and tab too) and the bytes that are
    no UTF-8 escaped (_escaped), so a path or a message quoted in an error line can neither break it
    in two nor drive the terminal."""
    return _escaped(NOT_ONE_LINE, str(text))


def say(line):
    """One line on stderr (one_line), if there is a stderr to write it to."""
    if sys.stderr is not None:
        print(one_line(line), file=sys.stderr, flush=True)


def error(message):
    """One `error: message` line on stderr (one_line)."""
    say(f"error: {message}")


def fail(message, code=USAGE_ERROR):
    """One `error: message` line on stderr, then exit with `code`."""
    error(message)
    sys.exit(code)


def no_stdout():
    """For a tool started with file descriptor 1 closed (`TOOL >&-`), where Python has no sys.stdout
    and print() writes nothing without a word: the result would go nowhere and the exit status say
    it went well. Returns the usage error's status after one error line, or None where stdout is
    there."""
    if sys.stdout is not None:
        return None
    error("no standard output (file descriptor 1 is closed): the result would go nowhere")
    return USAGE_ERROR


def no_stderr_to_devnull():
    """For a tool started with file descriptor 2 closed (`TOOL 2>&-`), where Python has no
    sys.stderr: print(..., file=sys.stderr) writes to stdout instead (a notice inside the result)
    and input() fails ("lost sys.stderr"). Descriptor 2 and sys.stderr are opened on /dev/null: what
    the tool would say goes nowhere, as asked, and its result is as with stderr open."""
    if sys.stderr is None:
        sys.stderr = _devnull_stream(2)


def no_output_to_devnull():
    """For a tool whose stdout, like its stderr, carries only what it says (the training proxy: its
    result is the run directory), started with either closed: that descriptor and its sys stream
    are opened on /dev/null, and the tool runs as with them open (Python's None for a closed one
    was an AttributeError traceback at the first message)."""
    if sys.stdout is None:
        sys.stdout = _devnull_stream(1)
    no_stderr_to_devnull()


def _devnull_stream(fd):
    """/dev/null opened on the closed file descriptor fd, as a line-buffered text stream."""
    point_at_devnull(fd)
    return open(fd, "w", buffering=1, errors="backslashreplace", closefd=False)


def point_at_devnull(fd):
    """/dev/null on the output descriptor fd, closed or one whose reader is gone: what is written
    there from now on (and what is still buffered for it) goes nowhere, and no write fails again."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    if devnull != fd:
        os.dup2(devnull, fd)
        os.close(devnull)


def output_failed(e):
    """For a tool whose write to stdout failed (an OSError that is no lost reader: a full disk, an
    I/O error): one error line, and the exit status the engines give the same fault. stdout is
    pointed at /dev/null, so that Python's flush at exit does not fail again."""
    error(f"cannot write to standard output: {e.strerror or e}")
    stdout_closed()
    return IO_ERROR


def stdout_closed():
    """For a tool whose stdout lost its reader mid-output (`chat.py ... | head`, BrokenPipeError):
    nothing more can be said there, and it is no fault of the input, so no message. Points stdout
    at /dev/null, so that Python's flush at exit does not fail again; returns the exit status, that
    of a program SIGPIPE ended (Python ignores the signal and raises instead)."""
    point_at_devnull(sys.stdout.fileno())
    return STDOUT_CLOSED


def answer_on_stdout(write):
    """Runs write(), which prints a tool's answer on stdout, and flushes it; the exit status: 0, or
    stdout_closed's where the reader went away (| head), or output_failed's where the write failed
    (a full disk): a one-line answer to a lost reader is no traceback."""
    try:
        write()
        sys.stdout.flush()
    except BrokenPipeError:
        return stdout_closed()
    except OSError as e:
        return output_failed(e)
    return 0


def interrupted(tool, what):
    """For a tool stopped by Ctrl-C (KeyboardInterrupt): one line, "TOOL: interrupted; WHAT" (what
    was kept, how to go on), no traceback; returns the exit status of a program SIGINT ended."""
    if sys.stderr is not None:
        print(file=sys.stderr)
    say(f"{tool}: interrupted; {what}")
    return INTERRUPTED


def stop_on_sigterm():
    """SIGTERM (`kill PID`, a supervisor, `timeout`) taken as Ctrl-C is: a KeyboardInterrupt where
    it comes, so that the tool's own cleanup runs (the engine it started stopped, its temporary
    files removed) and it says "interrupted". Python's default ends the process on the spot: the
    engine ran on, orphaned, and the temporary files stayed."""
    signal.signal(signal.SIGTERM, signal.default_int_handler)


def shown_on_terminal(text):
    """Decoded text (a model's words, a tokenizer's output) as a terminal should show it: data, not
    commands. Its control characters (C0 but tab and newline, DEL, C1) are written as \\xNN escapes:
    a terminal acts on them (ESC starts sequences that move the cursor, rewrite the screen or
    retitle the window; CR returns over the line); its bidirectional overrides and isolates as
    \\uXXXX (an U+202E made the rest of a line, the next prompt's echo too, read backwards). For a
    terminal only: a pipe gets the text."""
    return _escaped(CONTROL_CHARACTERS, text)


class ArgumentParser(argparse.ArgumentParser):
    """argparse.ArgumentParser whose errors (its own and every parser.error(...) a tool calls) are
    one `error:` line, exit 2, instead of the usage block and `prog: error: ...`."""

    def error(self, message):
        fail(f"{message} (see --help)")
