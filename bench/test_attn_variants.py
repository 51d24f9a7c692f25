"""bench/attn-variants.sh, the A/B of flash-attention builds: without a GPU, its refusal of malformed
arguments before it builds anything (the builds, checks and timings run on the GPU machine)."""
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent / "attn-variants.sh"


@pytest.mark.parametrize("args, message", [
    (["-DFA_X=1"], "error: expected NAME=FLAGS"),
    (["a b=-DX"], "error: expected NAME=FLAGS"),
    (["default=-DX"], "error: expected NAME=FLAGS"),
    (["x=-DA", "x=-DB"], "error: build name 'x' given twice"),
])
def test_script_refuses_malformed_builds_before_building(tmp_path, args, message):
    out = tmp_path / "out"
    res = subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=60,
                         env={"OUT": str(out), "PATH": "/usr/bin:/bin"})
    assert res.returncode == 2
    assert res.stderr.startswith(message), res.stderr
    assert not out.exists() and res.stdout == ""
