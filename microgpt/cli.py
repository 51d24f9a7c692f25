"""The command lines of the Python tools (chat, evaluate, export, the proxy, the data and bench
scripts): bad input is one `error: ...` line on stderr and a non-zero exit, as the engines do.

Exit status 2 is a usage error: a flag argparse cannot parse, or a value a tool refuses (argparse's
own status for the same); --help still prints the full usage, exit 0."""
import argparse
import sys

USAGE_ERROR = 2


def fail(message, code=USAGE_ERROR):
    """One `error: message` line on stderr, then exit with `code`."""
    print(f"error: {message}", file=sys.stderr, flush=True)
    sys.exit(code)


class ArgumentParser(argparse.ArgumentParser):
    """argparse.ArgumentParser whose errors (its own and every parser.error(...) a tool calls) are
    one `error:` line, exit 2, instead of the usage block and `prog: error: ...`."""

    def error(self, message):
        fail(f"{message} (see --help)")
