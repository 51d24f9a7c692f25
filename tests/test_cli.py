"""The Python tools' command lines (microgpt/cli.py): a flag they cannot parse, or a value they
refuse, is one `error: ...` line on stderr and exit status 2, never argparse's usage block;
--help still prints the usage, exit 0."""
import importlib.util
import os
import subprocess
import sys

import pytest

import engine_util as eu

# every tool with an argparse command line: the positional arguments it requires (argparse names a
# missing one before an unknown flag), and flags whose value it refuses after parsing (None: none)
TOOLS = {
    "microgpt/chat.py": (["x"], ["--top-p", "0"]),
    "microgpt/evaluate.py": (["x", "y"], ["--batches", "-1"]),
    "microgpt/training_proxy.py": (["x"], ["--ranks", "0"]),
    "scripts/export-hf.py": (["x", "y"], None),
    "scripts/gpu-export-check.py": (["x"], None),
    "scripts/plot-bandit.py": (["x"], None),
    "scripts/fetch-assets.py": ([], None),
    "scripts/bandit-experiment.py": ([], ["--out", "o", "--steps", "0"]),
    "scripts/pull-hermes3.py": ([], None),
    "scripts/prep-megachat.py": ([], ["--out-dir", "o", "--text", "x", "--val-permille", "2000"]),
    "scripts/prepare-data.py": ([], None),
    "bench/bench.py": ([], None),
    "bench/decode_bench.py": ([], None),
    "bench/fp8_quality.py": (["summary", "x"], None),
    "bench/results.py": ([], None),
    "bench/tokenize_speed.py": ([], None),
    "bench/torch_gpt.py": ([], None),
    "bench/lt_table.py": (["x"], None),
    "bench/hf_decode.py": (["x", "--prompts", "p"], None),
    "bench/matmul_peak.py": ([], None),
    "bench/timeline.py": (["x"], ["--steps", "0"]),
    "bench/kernel_profile.py": (["x"], None),
    "bench/stall_profile.py": (["x"], ["--top", "0"]),
    "bench/rowk_summary.py": (["a=x", "b=y"], None),
}
NEEDS_TORCH = {"bench/hf_decode.py", "bench/matmul_peak.py"}


def run_tool(tool, *args):
    return subprocess.run([sys.executable, str(eu.REPO / tool), *args], capture_output=True, text=True,
                          timeout=60, env=eu.python_env(), cwd=eu.REPO)


def skip_without_torch(tool):
    if tool in NEEDS_TORCH and importlib.util.find_spec("torch") is None:
        pytest.skip(f"{tool} imports torch, which is not installed")


def assert_one_error_line(res, words):
    assert res.returncode == 2 and res.stdout == "", res.stderr
    assert len(res.stderr.splitlines()) == 1 and res.stderr.startswith("error: ") and words in res.stderr, \
        res.stderr
    assert "usage:" not in res.stderr


@pytest.mark.parametrize("tool", TOOLS)
def test_an_unknown_flag_is_one_error_line(tool):
    skip_without_torch(tool)
    assert_one_error_line(run_tool(tool, *TOOLS[tool][0], "--no-such-flag"), "--no-such-flag")


@pytest.mark.parametrize("tool", TOOLS)
def test_help_still_prints_the_usage(tool):
    skip_without_torch(tool)
    res = run_tool(tool, *TOOLS[tool][0][:1], "--help")
    assert res.returncode == 0 and res.stdout.startswith("usage:"), res.stdout + res.stderr


@pytest.mark.parametrize("tool", [t for t, (_, refused) in TOOLS.items() if refused])
def test_a_value_the_tool_refuses_is_one_error_line(tool):
    """The tool's own parser.error(...) calls, after argparse has parsed the flags."""
    positional, refused = TOOLS[tool]
    assert_one_error_line(run_tool(tool, *positional, *refused), refused[-2])


def test_a_value_of_the_wrong_type_is_one_error_line():
    assert_one_error_line(run_tool("microgpt/chat.py", "x", "--top-k", "many"), "--top-k")


# Runs TOOL (argv[3:]) as a script with the permission error a non-root user gets: "file" makes
# opening PATH fail (its mode 000), "dir" makes looking up anything inside PATH fail (a directory of
# mode 000). Root reads through any mode, so the tests simulate there what chmod does elsewhere.
DENIED_AS_IF_BY_CHMOD = r"""
import builtins, errno, os, runpy, sys
how, locked, tool = sys.argv[1:4]

def denied(path):
    path = os.path.abspath(os.fsdecode(path))
    return path == locked if how == "file" else path.startswith(locked + os.sep)

def guarded(real):
    def call(path, *args, **kw):
        if isinstance(path, (str, bytes, os.PathLike)) and denied(path):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), os.fsdecode(path))
        return real(path, *args, **kw)
    return call

builtins.open, os.open = guarded(builtins.open), guarded(os.open)
if how == "dir":
    os.stat, os.lstat = guarded(os.stat), guarded(os.lstat)
sys.argv = [tool, *sys.argv[4:]]
runpy.run_path(tool, run_name="__main__")
"""


def run_denied(how, locked, tool, *args):
    """TOOL's run with `locked` unreadable (how="file") or unsearchable (how="dir")."""
    locked = os.path.abspath(locked)
    if os.geteuid() != 0:
        os.chmod(locked, 0)
        try:
            return run_tool(tool, *args)
        finally:
            os.chmod(locked, 0o700)
    return subprocess.run([sys.executable, "-c", DENIED_AS_IF_BY_CHMOD, how, locked, str(eu.REPO / tool), *args],
                          capture_output=True, text=True, timeout=60, env=eu.python_env(), cwd=eu.REPO)


@pytest.mark.parametrize("tool", ["microgpt/chat.py", "microgpt/evaluate.py", "scripts/export-hf.py"])
@pytest.mark.parametrize("how,given", [("file", "ckpt"), ("file", "run_dir"), ("dir", "ckpt"), ("dir", "run_dir")])
def test_a_checkpoint_that_cannot_be_read_is_named_so(tool, how, given, cpu_binary, tmp_path):
    """A checkpoint the user may not read (or whose directory they may not search) was reported as
    "no such checkpoint file or run directory": it is there. Each tool that loads a model now says
    what is wrong, in one error line, exit 2."""
    run_dir = tmp_path / "r"
    run_dir.mkdir()
    ckpt = run_dir / "r.ckpt"
    ckpt.write_bytes(b"\0" * 64)
    model = ckpt if given == "ckpt" else run_dir
    args = {"microgpt/chat.py": [str(model), "--prompt", "hi", "--engine", "cpu"],
            "microgpt/evaluate.py": [str(model), str(tmp_path / "data.txt"), "--engine", "cpu"],
            "scripts/export-hf.py": [str(model), str(tmp_path / "out")]}[tool]
    res = run_denied(how, ckpt if how == "file" else run_dir, tool, *args)
    errors = [l for l in res.stderr.splitlines() if l.startswith("error:")]
    assert res.returncode == 2 and errors == [f"error: cannot read checkpoint {ckpt}: Permission denied"], \
        res.stderr
    assert "Traceback" not in res.stderr and not (tmp_path / "out").exists()
