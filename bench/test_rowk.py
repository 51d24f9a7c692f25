"""bench/rowk_summary.py: the comparison of bench/rowk_bench.cu runs (no GPU needed)."""
import pytest

from rowk_summary import main, parse_log, table

# rowk_bench's report(): the same printf format


def line(kernel, us, gbs, bits, step):
    return "rowk  %-5s %-14s %9.1f us %8.0f GB/s  bits %016x  step %9.1f us" % ("120M", kernel, us, gbs, bits, step)


BASE_LOG = "\n".join(["rowk_bench: NVIDIA H200, median of 20 launches",
                      line("ln_fwd", 10.8, 2336, 0xaa, 270.0),
                      line("loss_rows", 500.0, 3297, 0xbb, 500.0)])
OTHER_LOG = "\n".join([line("ln_fwd", 8.1, 3115, 0xaa, 202.5),
                       line("loss_rows", 550.0, 2997, 0xcc, 550.0)])


def test_parse_log_reads_every_kernel_line_and_nothing_else():
    rows = parse_log(BASE_LOG)
    assert rows == {("120M", "ln_fwd"): (10.8, 2336.0, "00000000000000aa", 270.0),
                    ("120M", "loss_rows"): (500.0, 3297.0, "00000000000000bb", 500.0)}


def test_table_gives_the_change_against_the_first_run_and_flags_other_bits():
    out = table({"before": parse_log(BASE_LOG), "after": parse_log(OTHER_LOG)}).splitlines()
    assert out[0] == "| model | kernel | before | after |"
    ln = next(row for row in out if "ln_fwd" in row)
    assert "10.8 µs, 2.34 TB/s" in ln and "8.1 µs, 3.12 TB/s, -25.0% (-68 µs a step)" in ln
    assert "other bits" not in ln
    loss = next(row for row in out if "loss_rows" in row)
    assert "550.0 µs, 3.00 TB/s, +10.0% (+50 µs a step), other bits" in loss


def test_table_marks_a_kernel_a_run_did_not_report():
    out = table({"before": parse_log(BASE_LOG), "after": parse_log(OTHER_LOG.splitlines()[0])})
    assert "| 120M | loss_rows | 500.0 µs, 3.30 TB/s | - |" in out


def test_main_prints_the_table_of_two_logs(tmp_path, capsys):
    (tmp_path / "a.log").write_text(BASE_LOG)
    (tmp_path / "b.log").write_text(OTHER_LOG)
    assert main(["rowk_summary.py", f"before={tmp_path / 'a.log'}", f"after={tmp_path / 'b.log'}"]) == 0
    assert capsys.readouterr().out.startswith("| model | kernel | before | after |")


@pytest.mark.parametrize("argv", [["before=a.log"], ["a.log", "b.log"]])
def test_main_refuses_fewer_than_two_runs_or_a_run_without_a_name(argv, capsys):
    with pytest.raises(SystemExit) as e:
        main(["rowk_summary.py", *argv])
    assert e.value.code == 2
    assert capsys.readouterr().err == "error: give two or more NAME=LOG runs (the first is the base) (see --help)\n"


def test_main_fails_on_a_log_without_results(tmp_path, capsys):
    (tmp_path / "a.log").write_text(BASE_LOG)
    (tmp_path / "b.log").write_text("error: CUDA failure 'no device' in cudaStreamCreate\n")
    assert main(["rowk_summary.py", f"before={tmp_path / 'a.log'}", f"after={tmp_path / 'b.log'}"]) == 1
    assert capsys.readouterr().err == f"error: no rowk_bench results in {tmp_path / 'b.log'}\n"


def test_main_fails_on_a_missing_log(tmp_path, capsys):
    assert main(["rowk_summary.py", f"before={tmp_path / 'none.log'}", f"after={tmp_path / 'none.log'}"]) == 1
    assert capsys.readouterr().err.startswith(f"error: cannot read {tmp_path / 'none.log'}: ")


def test_parse_log_leaves_out_damaged_lines():
    damaged = ["rowk  120M  ln_fwd  abc us 1 GB/s  bits 00  step 1 us", line("ln_bwd", 0.0, 1, 1, 1),
               "rowk  120M  x  nan us 1 GB/s  bits 00  step 1 us", "rowk  120M  y  1 us inf GB/s  bits 00  step 1 us"]
    assert parse_log("\n".join(damaged + [line("loss_rows", 5.0, 1, 1, 1)])) == {
        ("120M", "loss_rows"): (5.0, 1.0, "0000000000000001", 1.0)}


def test_main_refuses_a_run_name_twice_or_with_markup(tmp_path, capsys):
    (tmp_path / "a.log").write_text(BASE_LOG)
    for names in (("a", "a"), ("a", "b|c"), ("<b>", "a")):
        args = [f"{n}={tmp_path / 'a.log'}" for n in names]
        assert main(["rowk_summary.py", *args]) == 2
        assert capsys.readouterr().err.startswith("error: run name '"), names
