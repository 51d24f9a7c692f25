"""The engine's kernel launches, read from the source (docs/DESIGN.md §9): every engine kernel goes
through launch_kernel, and every kernel waits for its predecessor before anything else. On a 9.0+ GPU
the engine launches every kernel programmatically, so one kernel without the wait would race with the
kernel before it (and its successor's wait would not cover that kernel's writes); the GPU tests
would catch it only if the race happened to show."""
import re
from pathlib import Path

CUDA = Path(__file__).resolve().parent.parent / "microgpt"
SOURCES = sorted(CUDA.glob("cuda/*.cuh")) + [CUDA / "microgpt_cuda.cu"]


def kernels(text):
    """(name, body's first statement) of every __global__ function defined in `text`."""
    for m in re.finditer(r"^(?:template <[^\n]*>\s*)?__global__ [^;{]*?\b(k_\w+)\([^{;]*\)\s*\{\n\s*([^\n]*)", text,
                         re.M):
        yield m.group(1), m.group(2)


def test_every_kernel_waits_for_its_predecessor_first():
    texts = [path.read_text() for path in SOURCES]
    found = [kernel for text in texts for kernel in kernels(text)]
    declared = sum(len(re.findall(r"^[^*/\n]*__global__ ", text, re.M)) for text in texts)
    assert len(found) == declared > 0, (declared, sorted(found))  # every kernel read, none missed
    late = [(name, first) for name, first in found if first != "await_previous_kernel();"]
    assert not late, f"kernels whose first statement is not await_previous_kernel(): {late}"


def test_every_engine_launch_goes_through_launch_kernel():
    launches = [f"{p.name}:{n}" for p in SOURCES for n, line in enumerate(p.read_text().splitlines(), 1)
                if "<<<" in line and not line.lstrip().startswith(("/*", "*", "//"))]
    assert not launches, f"<<<>>> launches outside launch_kernel: {launches}"
