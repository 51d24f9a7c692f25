"""The Python tools' command lines (microgpt/cli.py): a flag they cannot parse, or a value they
refuse, is one `error: ...` line on stderr and exit status 2, never argparse's usage block;
--help still prints the usage, exit 0."""
import importlib.util
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
    "scripts/bandit-experiment.py": ([], None),
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
