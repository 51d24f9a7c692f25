"""bench/kernel_profile.py on a synthetic Nsight Compute CSV: the training step is found from the end
of the log (warm-up and evaluation kernels before it are left out) and summed per kernel."""
import os
import subprocess
import sys

import pytest

import kernel_profile
from engine_util import python_env

HERE = os.path.dirname(os.path.abspath(__file__))

HEADER = ('"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size",'
          '"Grid Size","Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"')


def csv_text(kernels):
    lines = ["==PROF== Connected to process 1 (build/microgpt_cuda)", HEADER]
    for i, (name, ns) in enumerate(kernels):
        lines.append(f'"{i}","1","microgpt_cuda","h","{name}","1","13","(256, 1, 1)","(1, 1, 1)","0","9.0",'
                     f'"Command line profiler metrics","gpu__time_duration.sum","ns","{ns:,}"')
    lines.append("==PROF== Disconnected from process 1")
    return "\n".join(lines) + "\n"


# warm-up micro-batch and update, then the real step, then an evaluation forward; every graph's
# uploads and downloads are k_copy_words launches (the micro-batch's two uploads and its loss, the
# update's upload and its norm)
COPY = ("k_copy_words(unsigned int *, const unsigned int *, int)", 1_000)
STEP = [COPY, COPY, ("k_embed_fwd", 5_000), ("k_layernorm_fwd", 1_000), ("k_loss_rows", 2_000_000),
        ("k_layernorm_fwd", 1_500), COPY, COPY, ("k_grad_norm_partial", 3_000), ("k_adamw", 10_000),
        ("k_adamw", 20_000)]
LOG = ([COPY, COPY, ("k_embed_fwd", 9), ("k_loss_rows", 9), COPY, COPY, ("k_grad_norm_partial", 9),
        ("k_adamw", 9), COPY] + STEP + [COPY, COPY, COPY, ("k_embed_fwd", 7), ("k_layernorm_fwd", 7)])


def test_the_last_training_step_is_found_and_summed(tmp_path):
    path = tmp_path / "p.csv"
    path.write_text(csv_text(LOG))
    fb, update = kernel_profile.step_slices(kernel_profile.kernel_rows(str(path)))
    assert [n for n, _ in fb] == [n for n, _ in STEP[:7]]  # not the update's download before it
    assert [d for _, d in update] == [1_000, 3_000, 10_000, 20_000]  # "1,234" thousands separators parsed
    out = subprocess.run([sys.executable, os.path.join(HERE, "kernel_profile.py"), str(path)],
                         env=python_env(), capture_output=True, text=True, check=True).stdout
    assert "11 kernels, 2044.5 us of kernel time per step (micro-batch 2010.5 us, update 34.0 us)" in out
    first = out.splitlines()[1]
    assert "k_loss_rows" in first and "2000.0 us" in first  # biggest first
    assert "    2.5 us   0.1 %     2x  k_layernorm_fwd" in out  # grouped by name


def test_a_log_without_a_training_step_is_refused(tmp_path):
    path = tmp_path / "p.csv"
    path.write_text(csv_text([("k_embed_fwd", 5), ("k_loss_rows", 9)]))
    with pytest.raises(kernel_profile.ProfileError, match="k_adamw"):
        kernel_profile.step_slices(kernel_profile.kernel_rows(str(path)))


def test_a_missing_profile_is_one_error_line(tmp_path):
    res = subprocess.run([sys.executable, os.path.join(HERE, "kernel_profile.py"), str(tmp_path / "none.csv")],
                         env=python_env(), capture_output=True, text=True)
    assert res.returncode == 1 and res.stderr.startswith("error: ") and len(res.stderr.splitlines()) == 1, res.stderr


def test_a_profile_of_no_training_step_is_one_error_line(tmp_path):
    path = tmp_path / "p.csv"
    path.write_text(csv_text([("k_embed_fwd", 5), ("k_loss_rows", 9)]))
    res = subprocess.run([sys.executable, os.path.join(HERE, "kernel_profile.py"), str(path)],
                         env=python_env(), capture_output=True, text=True)
    assert res.returncode == 1 and res.stderr.startswith("error: no kernel named *k_adamw*"), res.stderr
    assert len(res.stderr.splitlines()) == 1, res.stderr
