"""bench/lt_table.py: the fixed cuBLASLt table from bench/lt_algos.cu's output (no GPU needed)."""
import os
import re
import shutil
import subprocess

import pytest

from lt_table import main, parse, savings, why_left_out

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CUDA_DIR = os.path.join(ROOT, "microgpt", "cuda")

ENV = ('LTPROBE-ENV gpu="NVIDIA H200" cc=9.0 sms=132 driver=580.95.05 cublaslt=130100 cudart=13000 '
       'date=2026-12-01T18:55:00Z workspace=33554432 offers=64 reps=25 rounds=3')


def probe_line(key, rule_us, best_us, rule="66:20:16:1:0:0:0:0:2", best="66:33:16:1:0:1:0:0:2", repeat=1,
               diff=0.0021, ws=0, product="classifier", model="120M", prec="bf16", calls=1):
    """lt_algos.cu's printf format for one product."""
    return (f"LTPROBE model={model} prec={prec} product={product} key={key} calls={calls} offers=37 "
            f"rule_us={rule_us:.2f} "
            f"best_us={best_us:.2f} gain_pct={100 * (rule_us - best_us) / rule_us:.1f} repeat={repeat} "
            f"diff={diff:.3g} ws={ws} rule={rule} best={best}")


LOGITS = "bf16.bf16.bf16.plain.nt.5248x50304x768.ld768.768.50304"
DW1_12M = "bf16.bf16.fp32.plain.tn.192x768x4096.ld192.768.768"
QKV = "bf16.bf16.bf16.plain.nn.8192x768x768.ld768.768.768.b3.s0.589824.6291456"
SAMPLE = "\n".join([
    "# 120M bf16: N 8192, C 768, F 3072, logits chunks of 5248 rows, Vp 50304",
    ENV,
    "# " + LOGITS + " offer  0 66:209:16:1:0:0:0:0:2 520.61 us",
    probe_line(LOGITS, 520.6, 438.1),
    probe_line(DW1_12M, 15.7, 10.0, rule="66:20:16:3:2:0:0:0:2", best="66:20:16:1:0:0:0:0:2", model="12M",
               product="mlp_bwd", calls=6),
    probe_line(QKV, 16.5, 16.2),                                                # 1.8 %: noise
    probe_line("bf16.bf16.bf16.gelu_aux.nn.8192x3072x768.ld768.3072.3072", 60.3, 60.3,
               best="66:20:16:1:0:0:0:0:2"),                                     # the rule's own
    probe_line("bf16.bf16.bf16.dgelu.nt.8192x3072x768.ld768.768.3072", 79.0, 70.0, repeat=0),
    probe_line("bf16.bf16.fp32.plain.tn.768x768x8192.ld768.768.768", 18.3, 12.0, best="66:20:16:4:8:0:0:0:2"),
    probe_line("bf16.bf16.bf16.residual.nn.8192x768x3072.ld3072.768.768", 48.9, 40.0, ws=1 << 26),
    probe_line("e4m3.e4m3.bf16.fp8.nt.8192x768x768.ld768.768.768", 12.0, 9.0, diff=0.5, prec="fp8"),
])


def test_parse_reads_the_env_and_every_product_line_and_nothing_else():
    env, products = parse(SAMPLE)
    assert env["gpu"] == "NVIDIA H200" and env["sms"] == 132 and env["cublaslt"] == 130100
    assert env["workspace"] == 32 << 20 and env["driver"] == "580.95.05"
    assert [p["key"] for p in products][:3] == [LOGITS, DW1_12M, QKV]
    assert len(products) == 8
    logits = products[0]
    assert logits["rule_us"] == 520.6 and logits["best_us"] == 438.1 and logits["repeat"] == 1
    assert logits["best"] == (66, 33, 16, 1, 0, 1, 0, 0, 2) and logits["rule"] == (66, 20, 16, 1, 0, 0, 0, 0, 2)


def test_the_filter_keeps_real_gains_and_says_why_it_leaves_the_rest_out():
    env, products = parse(SAMPLE)
    why = {p["key"]: why_left_out(p, env, 3.0) for p in products}
    assert why[LOGITS] is None and why[DW1_12M] is None
    assert "noise" in why[QKV]
    assert "rule's choice is the fastest" in why["bf16.bf16.bf16.gelu_aux.nn.8192x3072x768.ld768.3072.3072"]
    assert "bitwise" in why["bf16.bf16.bf16.dgelu.nt.8192x3072x768.ld768.768.3072"]
    assert "reduction" in why["bf16.bf16.fp32.plain.tn.768x768x8192.ld768.768.768"]
    assert "workspace" in why["bf16.bf16.bf16.residual.nn.8192x768x3072.ld3072.768.768"]
    assert "differs" in why["e4m3.e4m3.bf16.fp8.nt.8192x768x768.ld768.768.768"]
    # the threshold is the option's: at 1 % the QKV product's 1.8 % is a gain
    assert why_left_out(products[2], env, 1.0) is None


@pytest.mark.parametrize("bad, message", [
    (SAMPLE.replace(ENV + "\n", ""), "no LTPROBE-ENV line"),
    (SAMPLE.replace("cc=9.0", "cc=8.0"), "compute capability 8.0"),
    (SAMPLE.replace("best=66:33:16:1:0:1:0:0:2", "best=66:33:16"), "not 9 integers"),
    (SAMPLE.replace("rule_us=520.60", "rule_us=fast"), "rule_us=fast is not a finite number"),
    # a nan or inf passes every comparison of the filter: it must not reach the table
    (SAMPLE.replace("diff=0.0021", "diff=nan", 1), "diff=nan is not a finite number"),
    (SAMPLE.replace("best_us=438.10", "best_us=-inf"), "best_us=-inf is not a finite number"),
    (SAMPLE.replace("rule_us=520.60", "rule_us=inf"), "rule_us=inf is not a finite number"),
    (SAMPLE + "\n" + probe_line(LOGITS, 1.0, 0.5), "a second time"),
    (SAMPLE.replace(LOGITS, "a*/b"), "key 'a*/b' has characters"),
    (SAMPLE.replace('gpu="NVIDIA H200"', 'gpu="H200\\" x"'), "H200\" x' has characters"),
])
def test_bad_input_is_one_error_line_and_no_table(tmp_path, capsys, bad, message):
    src, out = tmp_path / "lt.txt", tmp_path / "table.h"
    src.write_text(bad)
    assert main([str(src), "-o", str(out)]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and message in err and len(err.splitlines()) == 1
    assert not out.exists()


@pytest.mark.parametrize("gain", ["nan", "-1", "100"])
def test_a_minimum_gain_outside_0_to_100_is_one_error_line_and_no_table(tmp_path, capsys, gain):
    src, out = tmp_path / "lt.txt", tmp_path / "table.h"
    src.write_text(SAMPLE)
    assert main([str(src), "-o", str(out), "--min-gain-pct", gain]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: --min-gain-pct") and len(err.splitlines()) == 1
    assert not out.exists()


def test_an_output_that_cannot_be_written_is_one_error_line_and_no_file(tmp_path, capsys):
    src, out = tmp_path / "lt.txt", tmp_path / "missing" / "table.h"
    src.write_text(SAMPLE)
    assert main([str(src), "-o", str(out)]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: {out}: ") and len(err.splitlines()) == 1
    assert not out.parent.exists()


def generate(tmp_path, text=SAMPLE):
    src, out = tmp_path / "lt.txt", tmp_path / "table.h"
    src.write_text(text)
    assert main([str(src), "-o", str(out)]) == 0
    return out


def test_savings_sum_the_kept_gains_times_launches_a_step():
    env, products = parse(SAMPLE)
    got = savings(env, products, 3.0)
    assert got[("120M", "bf16")] == pytest.approx(520.6 - 438.1)  # the other 120M bf16 products are left out
    assert got[("12M", "bf16")] == pytest.approx((15.7 - 10.0) * 6)
    assert got[("120M", "fp8")] == pytest.approx(520.6 - 438.1)  # its classifier is the bf16 one


def test_the_header_says_where_it_was_measured_and_carries_each_probe_line(tmp_path, capsys):
    text = generate(tmp_path).read_text()
    printed = capsys.readouterr().out
    assert "2 of 8 products in the table" in printed and "12M bf16: 34 µs of product time a step saved" in printed
    assert " *   120M bf16: 82 µs" in text
    assert "NVIDIA H200 (132 multiprocessors), NVIDIA driver 580.95.05, cuBLASLt 130100" in text
    assert "2026-12-01T18:55:00Z" in text and "from lt.txt" in text
    assert "#define LT_TABLE_SM_COUNT 132" in text and "#define LT_TABLE_CUBLASLT_VERSION 130100" in text
    assert '#define LT_TABLE_GPU_NAME "NVIDIA H200"' in text  # an H100 has the same cc 9.0 and 132 SMs
    assert f"/* {probe_line(LOGITS, 520.6, 438.1)} */" in text
    assert f'{{"{LOGITS}", 66, 33, 16, 1, 0, 1, 0, 0, 2}},' in text
    assert f"{QKV}: within 3 % of the rule's choice (noise)" in text
    assert text.count('{"') == 2


DRIVER = r"""
#include <stdio.h>
#include TABLE
int main(int argc, char** argv) {
    for (int i = 1; i < argc; i++) {
        const LtTableEntry* e = lt_table_find(g_lt_table, argv[i]);
        if (!e) printf("none\n");
        else printf("%d %d %d %d %d %d %d %d %d\n", e->algo_id, e->tile, e->stages, e->splitk, e->reduction,
                    e->swizzle, e->custom, e->inner_shape, e->cluster_shape);
    }
    return 0;
}
"""


@pytest.mark.skipif(shutil.which("gcc") is None, reason="gcc not found")
def test_the_header_compiles_as_c99_and_its_lookup_finds_exactly_the_kept_entries(tmp_path):
    table = generate(tmp_path)
    (tmp_path / "driver.c").write_text(DRIVER)
    exe = tmp_path / "driver"
    subprocess.run(["gcc", "-std=c99", "-Wall", "-Wextra", "-Werror", f"-DTABLE=\"{table}\"", f"-I{CUDA_DIR}",
                    "-o", str(exe), str(tmp_path / "driver.c")], check=True)
    out = subprocess.run([str(exe), LOGITS, DW1_12M, QKV, "nothing"], check=True, capture_output=True,
                         text=True).stdout.splitlines()
    assert out == ["66 33 16 1 0 1 0 0 2", "66 20 16 1 0 0 0 0 2", "none", "none"]


def test_every_committed_entry_is_its_probe_lines_fastest_offer():
    """Each entry of the committed table passes the generator's rule on the probe line it carries, and
    holds that line's fastest configuration: nobody edited an entry by hand."""
    with open(os.path.join(CUDA_DIR, "lt_table_sm90.h")) as f:
        text = f.read()
    min_gain_pct = float(re.search(r"beat the rule's choice by at least ([0-9.]+) %", text).group(1))
    sms = re.search(r"#define LT_TABLE_SM_COUNT (\d+)", text).group(1)
    measured_on = re.search(r"measured on\n \* (.*?) \(\d+ multiprocessors\)", text).group(1)
    assert f'#define LT_TABLE_GPU_NAME "{measured_on}"' in text
    lt = re.search(r"#define LT_TABLE_CUBLASLT_VERSION (\d+)", text).group(1)
    probe_lines = re.findall(r"/\* (LTPROBE model=.*?) \*/", text)
    entries = re.findall(r'\{"([A-Za-z0-9_.]+)", ([0-9, ]+)\}', text)
    assert len(probe_lines) == len(entries)
    env_line = (f'LTPROBE-ENV gpu="committed" cc=9.0 sms={sms} driver=0 cublaslt={lt} cudart=0 date=0 '
                f"workspace=33554432 offers=0 reps=0 rounds=0")
    env, products = parse("\n".join([env_line] + probe_lines))
    for p, (key, config) in zip(products, entries):
        assert p["key"] == key
        assert why_left_out(p, env, min_gain_pct) is None, key
        assert tuple(int(v) for v in config.split(",")) == tuple(p["best"]), key


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not found")
def test_the_engine_rule_compiles_with_a_generated_table(tmp_path):
    """common.cuh's table path with a generated header in place of lt_table_sm90.h, compiled by nvcc."""
    table = generate(tmp_path)
    src = tmp_path / "uses_table.cu"
    src.write_text('#include "common.cuh"\n'
                   "int main() { LtPlan p = {}; cublasLtMatmulAlgo_t a; return lt_fixed_algo(&p, &a); }\n")
    subprocess.run(["nvcc", "-std=c++17", "-c", f"-DLT_TABLE_HEADER=\"{table}\"", f"-I{CUDA_DIR}",
                    "-o", str(tmp_path / "uses_table.o"), str(src)], check=True)
