"""bench/rowk_variants.sh and bench/rowk_summary.py: the comparison of the row-kernel variants.

Without a GPU: the summary's parsing of rowk_bench lines and its table, and the script's refusal of
an unknown variant. On a GPU (marker `gpu`): every variant builds and passes its kernel_check
(`rowk_variants.sh --check-only`; the timing half of the script is for people, not tests)."""
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from conftest import gpu_present
from rowk_summary import parse_log, table

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "bench" / "rowk_variants.sh"

# rowk_bench's report(): the same printf format


def line(kernel, variant, us, gbs, bits, step):
    return "rowk  %-5s %-14s %-42s %9.1f us %8.0f GB/s  bits %016x  step %9.1f us" % (
        "120M", kernel, variant, us, gbs, bits, step)


BASE_LOG = "\n".join(["rowk_bench: NVIDIA H200, ln_fwd=0,ln_bwd=0,final=32,loss=0,norm=0, median of 20 launches",
                      line("ln_fwd", "ln_fwd=0,ln_bwd=0,final=32,loss=0,norm=0", 10.8, 2336, 0xaa, 270.0),
                      line("loss_rows", "ln_fwd=0,ln_bwd=0,final=32,loss=0,norm=0", 500.0, 3297, 0xbb, 500.0)])
VARIANT_LOG = "\n".join([line("ln_fwd", "ln_fwd=1,ln_bwd=0,final=32,loss=0,norm=0", 8.1, 3115, 0xaa, 202.5),
                         line("loss_rows", "ln_fwd=1,ln_bwd=0,final=32,loss=0,norm=0", 550.0, 2997, 0xcc, 550.0)])


def test_parse_log_reads_every_kernel_line_and_nothing_else():
    rows = parse_log(BASE_LOG)
    assert rows == {("120M", "ln_fwd"): (10.8, 2336.0, "00000000000000aa", 270.0),
                    ("120M", "loss_rows"): (500.0, 3297.0, "00000000000000bb", 500.0)}


def test_table_gives_the_change_against_base_and_flags_other_bits():
    out = table({"base": parse_log(BASE_LOG), "v1": parse_log(VARIANT_LOG)}).splitlines()
    assert out[0] == "| model | kernel | base | v1 |"
    ln = next(row for row in out if "ln_fwd" in row)
    assert "10.8 µs, 2.34 TB/s" in ln and "8.1 µs, 3.12 TB/s, -25.0% (-68 µs a step)" in ln
    assert "other bits" not in ln
    loss = next(row for row in out if "loss_rows" in row)
    assert "550.0 µs, 3.00 TB/s, +10.0% (+50 µs a step), other bits" in loss


def test_table_marks_a_kernel_a_variant_did_not_report():
    out = table({"base": parse_log(BASE_LOG), "v1": parse_log(VARIANT_LOG.splitlines()[0])})
    assert "| 120M | loss_rows | 500.0 µs, 3.30 TB/s | - |" in out


def test_script_refuses_an_unknown_variant_before_building():
    env = dict(os.environ, GPU_ARCH="90")
    res = subprocess.run(["bash", str(SCRIPT), "no_such_variant"], capture_output=True, text=True, env=env,
                         timeout=60)
    assert res.returncode == 1
    assert res.stderr.startswith("error: no variant named no_such_variant; known: base ")
    assert "== build" not in res.stdout


@pytest.mark.gpu
def test_every_variant_builds_and_passes_kernel_check():
    if not gpu_present() or not shutil.which("nvcc"):
        pytest.skip("needs an NVIDIA GPU and nvcc")
    res = subprocess.run(["bash", str(SCRIPT), "--check-only"], cwd=REPO, capture_output=True, text=True,
                         timeout=900)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-2000:]
    assert "FAIL" not in res.stdout


def test_summary_fails_without_any_result(tmp_path):
    from rowk_summary import main
    (tmp_path / "base").mkdir()
    (tmp_path / "base" / "bench.log").write_text("error: CUDA failure 'no device' in cudaStreamCreate\n")
    assert main(["rowk_summary.py", str(tmp_path), "base", "v1"]) == 1
