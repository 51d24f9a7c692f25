"""bench.py's bookkeeping without a GPU or torch: flags, medians, the FLOP count, loss check, targets,
the results file, and a whole run against a stand-in engine (where torch is missing its PyTorch side
fails, and the report must say so).

    pytest bench/test_bench.py
"""
import json
import math
import os
import subprocess
import sys

import pytest

import bench
import results
from bench_common import BenchError, lr_at, repo_path
from engine_util import python_env

HERE = os.path.dirname(os.path.abspath(__file__))

CFG = {"name": "ANDREA-12M",
       "model": {"n_layer": 6, "d_model": 192, "n_head": 6, "seq_len": 512},
       "train": {"batch_size": 8, "steps": 20000, "precision": "bf16", "lr": 6e-4, "warmup_steps": 200},
       "data": {"train": "data/x_train_*.bin", "val": "data/x_val_*.bin"},
       "eval": {"every": 250, "batches": 20},
       "sample": {"every": 500, "prompts": ["hi"]}, "checkpoint": {"every": 1000}}


def step_records(ms, losses):
    return [{"step": i + 1, "loss": l, "ms": m} for i, (m, l) in enumerate(zip(ms, losses))]


class Args:
    steps, warmup, last = 200, 10, 20


def test_engine_command_is_the_config_as_dotted_flags_with_the_run_overrides():
    data = {"train": "t.bin", "val": "v.bin", "real": True}
    cmd = bench.engine_command(CFG, bench.run_overrides(CFG, Args, "fp16", data), "eng")
    flags = dict(zip(cmd[1::2], cmd[2::2]))
    assert cmd[0] == "eng" and len(cmd) % 2 == 1
    assert flags["--model.d_model"] == "192" and flags["--train.lr"] == "0.0006"
    assert flags["--train.steps"] == "200" and flags["--train.precision"] == "fp16"
    assert flags["--train.warmup_steps"] == "20"            # min(200, steps/10)
    # paths resolved against the repository, as the proxy passes them (microgpt/config.py)
    assert flags["--data.train"] == repo_path("t.bin") and flags["--data.val"] == repo_path("v.bin")
    assert flags["--eval.every"] == "200" and flags["--eval.batches"] == "20"
    assert flags["--sample.every"] == "0" and flags["--checkpoint.every"] == "0"
    assert not any(f.startswith("--sample.prompts") or f == "--checkpoint" for f in flags)


def test_each_pytorch_mode_is_its_compile_flag_and_a_cpu_dry_run_stays_eager():
    overrides = bench.run_overrides(CFG, Args, "bf16", {"train": "t.bin", "val": "v.bin", "real": True})

    def flags(mode, device):
        cmd = bench.torch_command("c.json", overrides, "bf16", mode, device)
        return dict(zip(cmd[3::2], cmd[4::2]))

    for mode, flag in (("eager", "none"), ("compile", "default"), ("reduce-overhead", "reduce-overhead"),
                       ("max-autotune", "max-autotune")):
        assert flags(mode, "cuda")["--compile"] == flag and flags(mode, "cpu")["--compile"] == "none"
    f = flags("compile", "cuda")
    assert f["--precision"] == "bf16" and f["--val"] == "v.bin" and f["--train.steps"] == "200"
    assert "--train.precision" not in f and "--eval.every" not in f


def test_unknown_modes_and_precisions_are_refused():
    for argv in (["--torch-modes", "compile,turbo"], ["--precisions", "bf17"], ["--torch-modes", ""],
                 ["--torch-fp8-modes", "turbo"], ["--torch-fp8-modes", ""]):
        with pytest.raises(BenchError):
            bench.parse_args(argv)
    args = bench.parse_args([])
    assert args.precisions == ["bf16"] and args.torch_modes == ["eager", "compile", "reduce-overhead"]
    assert args.torch_fp8_modes == ["reduce-overhead"]
    assert args.results == results.RESULTS_FILE and bench.parse_args(["--device", "cpu"]).results is None
    assert bench.parse_args(["--no-record"]).results is None


@pytest.mark.parametrize("argv, message", [
    (["--precisions", "fp8,bf16,fp8"], "--precisions names 'fp8' twice"),
    (["--models", "12M,12M"], "--models names '12M' twice"),
    (["--torch-fp8-modes", "eager,eager"], "--torch-fp8-modes names 'eager' twice"),
    (["--tol", "nan"], "--tol must be a positive number"), (["--tol", "-1"], "--tol must be a positive number"),
    (["--tol", "inf"], "--tol must be a positive number"), (["--timeout", "0"], "--timeout, --autotune-timeout"),
    (["--matmul-reps", "0"], "--timeout, --autotune-timeout")])
def test_repeated_entries_and_values_that_cannot_work_are_refused(argv, message):
    with pytest.raises(BenchError, match=message):
        bench.parse_args(argv)


def test_run_all_refuses_an_unknown_stage(tmp_path):
    out = subprocess.run(["bash", os.path.join(HERE, "run-all.sh"), "nosuch"], capture_output=True, text=True,
                         timeout=60, env=dict(os.environ, OUT=str(tmp_path), ANDREA_COMMIT="x"))
    assert out.returncode == 2 and "unknown stage 'nosuch'" in out.stdout


def test_without_validation_data_the_engine_does_not_evaluate():
    cmd = bench.engine_command(CFG, bench.run_overrides(CFG, Args, "bf16", {"train": "t", "val": None}), "eng")
    flags = dict(zip(cmd[1::2], cmd[2::2]))
    assert "--data.val" not in flags and flags["--eval.every"] == "0"


def test_summary_takes_the_median_after_warmup_and_the_mean_of_the_last_losses():
    ms = [500.0] * 10 + [10.0, 12.0, 11.0, 1000.0, 11.0]      # compile steps, then one slow outlier
    losses = [9.0] * 10 + [5.0, 4.0, 3.0, 2.0, 1.0]
    records = [{"event": "start", "tokens_per_step": 4096}] + step_records(ms, losses) + [
        {"step": 15, "val_loss": 2.5}, {"event": "device_memory", "step": 1, "bytes": 7},
        {"event": "device_memory", "step": 15, "bytes": 7}, {"event": "memory", "total_bytes": 6}]
    s = bench.summarize(records, warmup=10, last=2, tokens_per_step=1)
    assert s["ms_per_step"] == 11.0
    assert s["tokens_per_s"] == pytest.approx(4096 / 0.011)
    assert s["loss_last"] == 1.5 and s["val_loss"] == 2.5
    assert s["device_memory"] == 7 and s["memory_constant"] is True and s["plan_bytes"] == 6


def test_memory_that_grows_is_not_constant():
    records = step_records([1.0] * 3, [1.0] * 3) + [{"event": "device_memory", "bytes": b} for b in (7, 9)]
    assert bench.summarize(records, 1, 1, 8)["memory_constant"] is False


def test_nvidia_smi_samples_are_parsed_or_refused():
    assert bench.parse_smi_sample("61234, 1830, 690.52, 100") == (61234, 1830.0, 690.52, 100)
    for bad in (None, "", "[N/A], 1830, 690, 100", "61234, 1830, 690", "61234, [Not Supported], 690, 99"):
        assert bench.parse_smi_sample(bad) is None


def test_too_few_steps_is_an_error():
    with pytest.raises(BenchError):
        bench.summarize(step_records([1.0] * 10, [1.0] * 10), warmup=10, last=5, tokens_per_step=1)


def side(loss, val=None, tok=1000.0, smi=None, constant=None, error=None, ms=None, mfu=None):
    return {"loss_last": loss, "val_loss": val, "tokens_per_s": tok, "smi_bytes": smi,
            "memory_constant": constant, "error": error, "ms_per_step": ms, "mfu": mfu}


def test_loss_check_passes_within_tolerance_and_fails_outside_or_on_nan():
    assert bench.loss_check(side(5.09, 5.2), side(5.0, 5.1), 0.02, True)[0] == "PASS"
    assert bench.loss_check(side(5.11), side(5.0), 0.02, True)[0] == "FAIL"
    assert bench.loss_check(side(5.0, 5.3), side(5.0, 5.1), 0.02, True)[0] == "FAIL"   # val decides too
    assert bench.loss_check(side(math.nan), side(5.0), 0.02, True)[0] == "FAIL"
    assert bench.loss_check(side(5.0), side(5.0), 0.02, False)[0].startswith("SKIP")
    assert bench.loss_check(side(5.0, error="x"), side(5.0), 0.02, True)[0].startswith("SKIP")


def test_the_loss_is_checked_against_every_pytorch_mode_that_finished():
    engine = side(5.0, 5.0)
    status, diffs = bench.loss_checks(engine, [side(5.05, 5.0), side(5.01, 5.08), side(9.0, error="boom")], 0.02, True)
    assert status == "PASS" and diffs["train"] == pytest.approx(0.05 / 5.05) and diffs["val"] == pytest.approx(0.08 / 5.08)
    assert bench.loss_checks(engine, [side(5.0, 5.0), side(5.5, 5.0)], 0.02, True)[0] == "FAIL"
    assert bench.loss_checks(engine, [side(5.0, error="boom")], 0.02, True)[0].startswith("SKIP")


def test_the_denominator_is_the_fastest_pytorch_run_that_finished():
    runs = [side(0, tok=900), side(0, tok=1200), side(0, tok=5000, error="crashed")]
    assert bench.fastest(runs) is runs[1]
    assert bench.fastest([side(0, error="x")]) is None
    assert bench.baselines("bf16", ["compile", "reduce-overhead"]) == [("bf16", "compile"), ("bf16", "reduce-overhead")]
    assert bench.baselines("fp16", ["eager"], ["reduce-overhead"]) == [("bf16", "eager")]
    # fp8 rows: torchao's float8 runs first (the ratio's denominator), then the bf16 runs
    assert bench.baselines("fp8", ["eager", "compile"], ["reduce-overhead"]) == [
        ("fp8", "reduce-overhead"), ("bf16", "eager"), ("bf16", "compile")]
    assert bench.baselines("tf32", ["compile"]) == bench.baselines("fp32", []) == [("fp32", "eager")]


def test_targets_follow_the_issue():
    met = bench.targets("120M", "bf16", side(0, tok=1300, smi=4, constant=True, ms=13.9, mfu=0.61),
                        side(0, tok=1000, smi=5))
    assert met == {"ms/step <= 14.0": (True, "13.90"), "tokens/s >= 1.3x": (True, "1.30x"),
                   "MFU >= 60%": (True, "61.0%"), "memory <= PyTorch": (True, "0.00 vs 0.00 GiB"),
                   "memory constant": (True, "device_memory first == last")}
    missed = bench.targets("120M", "bf16", side(0, tok=1290, smi=6, constant=False, ms=14.1, mfu=0.59),
                           side(0, tok=1000, smi=5))
    assert not any(ok for ok, _ in missed.values()) and len(missed) == 5
    small = bench.targets("12M", "bf16", side(0, tok=2300, ms=1.4), side(0, tok=1000))
    assert small == {"ms/step <= 1.4": (True, "1.40"), "tokens/s >= 2.3x": (True, "2.30x")}
    assert not bench.targets("12M", "bf16", side(0, tok=2299, ms=1.41), side(0, tok=1000))["tokens/s >= 2.3x"][0]
    assert bench.targets("12M", "tf32", side(0, tok=1000), side(0, tok=1000)) == {"tokens/s >= 1.0x": (True, "1.00x")}
    assert not bench.targets("120M", "tf32", side(0, tok=999), side(0, tok=1000))["tokens/s >= 1.0x"][0]
    assert bench.targets("12M", "fp32", side(0, tok=1000), side(0, tok=1000)) == {}  # strict fp32: no target
    assert bench.targets("12M", "bf16", side(0, error="boom"), side(0)) == {}
    # no PyTorch run finished: only the targets that do not depend on one
    assert bench.targets("12M", "bf16", side(0, ms=1.3), None) == {"ms/step <= 1.4": (True, "1.30")}


def test_the_fastest_run_of_a_precision_is_chosen_among_mixed_runs():
    runs = [dict(side(0, tok=900), precision="fp8"), dict(side(0, tok=1200), precision="bf16"),
            dict(side(0, tok=1000), precision="fp8"), dict(side(0, tok=2000, error="x"), precision="fp8")]
    assert bench.fastest(runs, "fp8") is runs[2] and bench.fastest(runs, "bf16") is runs[1]
    assert bench.fastest(runs) is runs[1] and bench.fastest(runs, "fp32") is None
    assert bench.ratio_to(side(0, tok=1500), runs[2]) == 1.5
    assert bench.ratio_to(side(0, error="x"), runs[2]) is None and bench.ratio_to(side(0), None) is None


def test_fp8_targets_follow_the_issue():
    # ANDREA-120M fp8: at most 12.5 ms/step, whatever PyTorch did
    assert bench.targets("120M", "fp8", side(0, ms=12.5), None) == {"ms/step <= 12.5": (True, "12.50")}
    assert bench.targets("120M", "fp8", side(0, ms=12.6), side(0)) == {"ms/step <= 12.5": (False, "12.60")}
    # ANDREA-12M fp8: no slower than the engine's bf16 row of the same run
    bf16 = side(0, ms=1.86)
    assert bench.targets("12M", "fp8", side(0, ms=1.86), None, {"bf16": bf16}) == {
        "ms/step <= engine bf16": (True, "1.86 vs 1.86")}
    assert bench.targets("12M", "fp8", side(0, ms=2.91), side(0), {"bf16": bf16}) == {
        "ms/step <= engine bf16": (False, "2.91 vs 1.86")}
    for rows in ({}, {"bf16": side(0, error="boom")}):   # not measured: neither met nor missed
        assert bench.targets("12M", "fp8", side(0, ms=1.0), None, rows) == {
            "ms/step <= engine bf16": (None, "no engine bf16 row finished in this run")}


def test_fp8_rows_show_both_ratios_and_unmeasured_targets():
    record = {"runs": [{"model": "12M", "side": "engine", "precision": "fp8", "ms_per_step": 2.0}],
              "comparisons": [{"model": "12M", "precision": "fp8", "baseline": "torch fp8 reduce-overhead",
                               "ratio": 1.5, "bf16_baseline": "torch bf16 reduce-overhead", "bf16_ratio": 1.25,
                               "loss_check": "PASS", "loss_diffs": None,
                               "targets": {"ms/step <= engine bf16": (None, "no engine bf16 row finished")}}]}
    [row] = bench.table_rows(record)
    assert row[9] == "1.50x (torchao reduce-overhead); 1.25x (bf16 reduce-overhead)"
    assert row[11] == "ms/step <= engine bf16: not measured (no engine bf16 row finished)"
    record["comparisons"][0].update(ratio=None, baseline=None)           # torchao missing: bf16 only
    assert bench.table_rows(record)[0][9] == "1.25x (bf16 reduce-overhead)"


# ----------------------------------------------------------------------------- FLOPs and MFU


def test_step_flops_equal_a_hand_count():
    # d 2, 1 layer, T 2, d_ff 4, padded vocab 3, one sequence of 2 tokens. Per token forward, each
    # weight 2 FLOPs: W_Q, W_K, W_V, W_O 4*2*2 = 16 weights, W_1, W_2 2*2*4 = 16, classifier 2*3 = 6:
    # 38 weights, 76 FLOPs, 152 for the 2 tokens. Attention: query 0 sees 1 key, query 1 sees 2: 3
    # pairs, Q K^T and P V 2*d = 4 FLOPs each per pair: 24. Forward 176; backward twice that: 528.
    shape = {"d_model": 2, "n_layer": 1, "seq_len": 2, "d_ff": 4, "padded_vocab_size": 3}
    assert bench.step_flops(shape, {"batch_size": 1, "grad_accum": 1}) == 528
    assert bench.step_flops(shape, {"batch_size": 3, "grad_accum": 2}) == 6 * 528


def product_by_product(shape, sequences):
    """The same count written out product by product, as a check of the closed form at real sizes."""
    d, f, v, T = shape["d_model"], shape["d_ff"], shape["padded_vocab_size"], shape["seq_len"]
    tokens = sequences * T
    products = [(tokens, d, 3 * d), (tokens, d, d), (tokens, d, f), (tokens, f, d)]   # (M, K, N) per layer
    forward = shape["n_layer"] * sum(2 * m * k * n for m, k, n in products) + 2 * tokens * d * v
    pairs = sum(t + 1 for t in range(T))
    forward += shape["n_layer"] * sequences * shape["n_head"] * 2 * (2 * pairs * (d // shape["n_head"]))
    return 3 * forward


def test_step_flops_of_the_shipped_shapes_match_the_product_by_product_count():
    for name in ("12M", "120M"):
        cfg = bench.load_config(bench.experiment_path(name))
        shape, t = bench.model_shape(cfg), bench.train_settings(cfg)
        assert bench.step_flops(shape, t) == product_by_product(shape, t["batch_size"] * t["grad_accum"])


def test_mfu_is_model_flops_per_second_over_the_measured_matmul_rate():
    assert bench.mfu(5e11, 1000.0, 1.0) == pytest.approx(0.5)   # 5e11 FLOPs in 1 s against 1 TFLOP/s
    assert bench.mfu(5e11, 1000.0, None) is None and bench.mfu(5e11, None, 1.0) is None


def test_a_cpu_dry_run_does_not_measure_the_matmul_rate():
    class A:
        device = "cpu"
    assert "error" in bench.measure_matmul(A)


# ----------------------------------------------------------------------------- the results file


def test_records_are_appended_one_line_each(tmp_path):
    path = tmp_path / "results.jsonl"
    results.append_record(str(path), {"kind": "train", "n": 1})
    results.append_record(str(path), {"kind": "decode", "n": 2})
    assert path.read_text().count("\n") == 2
    assert results.read_records(str(path)) == [{"kind": "train", "n": 1}, {"kind": "decode", "n": 2}]
    path.write_text('{"n": 1}')                      # a file whose last line lacks its newline
    results.append_record(str(path), {"n": 2})
    assert [r["n"] for r in results.read_records(str(path))] == [1, 2]
    assert not list(tmp_path.glob("*.tmp*"))          # written through a temp file, none left behind


def test_a_damaged_results_file_is_refused(tmp_path):
    for text in ('{"n": 1}\n{"n": 2\n', '[1, 2]\n'):
        (tmp_path / "r.jsonl").write_text(text)
        with pytest.raises(ValueError, match="r.jsonl:"):
            results.read_records(str(tmp_path / "r.jsonl"))


def test_the_history_shows_a_full_commit_hash_abbreviated(tmp_path, capsys):
    """Runs measured on a copied tree record ANDREA_COMMIT as given, two of them a full 40-digit
    hash: their history rows stood out twice as wide as the others' 7-digit commits."""
    full = "f52a90205dbdc9d9df93f2bd7e563014b3dd5d74"
    path = tmp_path / "r.jsonl"
    path.write_text(json.dumps({"kind": "train", "date": "2026-01-01T10:00:00Z", "commit": full, "runs": []}) + "\n")
    assert results.main(["--file", str(path), "--history", "f52a902"]) == 0
    assert capsys.readouterr().out.splitlines()[2].split(" | ")[1] == "f52a902"


def test_the_history_is_one_line_per_training_run_from_the_prefix_on(tmp_path, capsys):
    def run(model, side, precision, ms, mode=None, mfu=None):
        return {"model": model, "side": side, "precision": precision, "mode": mode, "ms_per_step": ms, "mfu": mfu}
    older = {"kind": "train", "date": "2026-01-01T10:00:00Z", "commit": "aaa1111", "runs": [
        run("12M", "engine", "bf16", 2.0), run("12M", "torch", "bf16", 9.0, "compile")]}
    newer = {"kind": "train", "date": "2026-01-02T10:00:00Z", "commit": "bbb2222", "matmul": {"tflops": 780.4},
             "runs": [run("120M", "engine", "bf16", 14.3, mfu=0.5731), run("120M", "engine", "fp8", 11.6),
                      run("120M", "torch", "bf16", 21.0, "compile"), run("120M", "torch", "bf16", 20.3, "reduce-overhead"),
                      run("120M", "torch", "fp8", 23.1, "reduce-overhead"),
                      {"model": "12M", "side": "engine", "precision": "bf16", "error": "out of memory"}]}
    path = tmp_path / "r.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in (older, {"kind": "decode", "commit": "ccc"}, newer)) + "\n")
    assert results.main(["--file", str(path), "--history"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "| " + " | ".join(results.HISTORY_COLUMNS) + " |" and len(lines) == 4
    assert lines[2] == "| 2026-01-01T10:00 | aaa1111 | - | 2.00 | - | 9.00 (compile) | - | - | - | - |"
    # the fastest PyTorch bf16 mode; a run that failed is not a figure
    assert lines[3] == ("| 2026-01-02T10:00 | bbb2222 | 780 | - | - | - | 14.30 | 11.60 | 20.30 (reduce-overhead)"
                        " | 57.3% |")
    assert results.main(["--file", str(path), "--history", "2026-01-02"]) == 0
    assert [l.split(" | ")[1] for l in capsys.readouterr().out.splitlines()[2:]] == ["bbb2222"]
    assert results.main(["--file", str(path), "--history", "ccc"]) == 1   # a decode record only
    assert capsys.readouterr().err.startswith("error: no training record in")
    path.write_text(json.dumps(dict(newer, runs=[run("12M", "engine", "bf16", "fast")])) + "\n")
    assert results.main(["--file", str(path), "--history"]) == 2
    assert capsys.readouterr().err.count("\n") == 1


def test_showing_a_malformed_record_is_one_error_line(tmp_path, capsys):
    good = results.read_records(results.RESULTS_FILE)
    last_train = [r for r in good if r["kind"] == "train"][-1]
    c = dict(last_train["comparisons"][0], targets={"ms/step <= 1": [True]})   # a target without its detail
    for bad in (dict(last_train, comparisons=[c]), dict(last_train, runs=[{"model": "12M"}]), {"kind": "train"}):
        (tmp_path / "r.jsonl").write_text(json.dumps(bad) + "\n")
        assert results.main(["--file", str(tmp_path / "r.jsonl")]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: {tmp_path / 'r.jsonl'}: the chosen train record cannot be shown (")
        assert err.count("\n") == 1
    assert results.main(["--file", str(tmp_path / "r.jsonl"), "20"]) == 1     # a record without a date
    assert capsys.readouterr().err.startswith("error: no record in")
    (tmp_path / "r.jsonl").write_text(json.dumps(dict(last_train, comparisons=[
        dict(last_train["comparisons"][0], targets={"ms/step <= engine bf16": [None, "no engine bf16 row"]})])))
    assert results.main(["--file", str(tmp_path / "r.jsonl")]) == 0
    assert "ms/step <= engine bf16: not measured (no engine bf16 row)" in capsys.readouterr().out


def test_the_commit_comes_from_the_environment_when_set(monkeypatch):
    monkeypatch.setenv("ANDREA_COMMIT", "abc1234")
    monkeypatch.delenv("ANDREA_DIRTY", raising=False)
    assert results.source_state() == ("abc1234", None)
    monkeypatch.setenv("ANDREA_DIRTY", "1")
    assert results.source_state() == ("abc1234", True)
    env = results.environment()
    assert env["commit"] == "abc1234" and env["dirty"] is True
    assert set(env) == {"date", "commit", "dirty", "gpu", "driver", "cuda_driver", "nvcc"}


REQUIRED = {"train": {"kind", "source", "date", "commit", "gpu", "steps", "runs", "comparisons"},
            "decode": {"kind", "source", "date", "commit", "gpu", "rows"},
            "real_run": {"kind", "source", "date", "commit", "gpu", "runs"}}


def test_the_recorded_history_is_well_formed():
    records = results.read_records(results.RESULTS_FILE)
    assert records, "bench/results.jsonl holds the recorded history"
    for r in records:
        assert REQUIRED[r["kind"]] <= set(r), r.get("date")
        for run in r["runs"] if r["kind"] == "train" else []:
            assert run["side"] in ("engine", "torch") and run["model"] and run["precision"] in bench.PRECISIONS
            assert run.get("error") or run["ms_per_step"] > 0
        for c in r["comparisons"] if r["kind"] == "train" else []:
            assert c["loss_check"].split(" ")[0] in ("PASS", "FAIL", "SKIP")
    dates = [r["date"] for r in records]
    assert dates == sorted(dates), "oldest first"


def test_wsd_schedule_holds_then_decays_to_min_at_the_last_step():
    t = {"steps": 100, "warmup_steps": 0, "lr": 1.0, "min_lr": 0.1, "schedule": "wsd", "decay_frac": 0.2}
    assert lr_at(79, t) == 1.0 and lr_at(99, t) == pytest.approx(0.1)
    assert 0.1 < lr_at(90, t) < 1.0


STANDIN = """#!/usr/bin/env python3
import json, sys
args = dict(zip(sys.argv[1::2], sys.argv[2::2]))
steps = int(args["--train.steps"])
ms = 1.5 if args["--train.precision"] == "fp8" else 2.0
print(json.dumps({"event": "start", "tokens_per_step": 8 * 16}))
for s in range(steps):
    print(json.dumps({"step": s + 1, "loss": 4.0 - s / steps, "ms": ms}))
print(json.dumps({"step": steps, "val_loss": 3.5}))
"""


def standin_run(tmp_path, name, d_model, *options):
    """bench.py, 30 steps on the CPU, with the stand-in engine and a tiny config named `name`:
    (its output, the one record it appended to the results file)."""
    engine = tmp_path / "engine"
    engine.write_text(STANDIN)
    engine.chmod(0o755)
    from microgpt.shards import write_shard
    write_shard(str(tmp_path / "train.bin"), list(range(100)) * 10)
    cfg = dict(CFG, name=name, model={"n_layer": 1, "d_model": d_model, "n_head": 2, "seq_len": 16, "vocab_size": 100},
               data={"train": str(tmp_path / "train.bin")})
    (tmp_path / f"{name}.json").write_text(json.dumps(cfg))
    record_file = tmp_path / "results.jsonl"
    out = subprocess.run([sys.executable, os.path.join(HERE, "bench.py"), "--models", str(tmp_path / f"{name}.json"),
                          *options, "--steps", "30", "--engine", str(engine), "--device", "cpu",
                          "--out", str(tmp_path / "out"), "--results", str(record_file)],
                         capture_output=True, text=True, timeout=300, env=python_env())
    [record] = results.read_records(str(record_file))
    return out, record


def test_a_whole_run_reports_every_row_even_when_a_side_fails(tmp_path):
    out, record = standin_run(tmp_path, "tiny", 8, "--precisions", "bf16,tf32", "--torch-modes", "eager,compile")
    # the PyTorch side fails where torch is missing; where it runs, the stand-in's loss is not its loss
    assert out.returncode == 1, out.stderr
    record_file = tmp_path / "results.jsonl"
    assert (tmp_path / "out" / "record.jsonl").read_text() == record_file.read_text()
    assert record["kind"] == "train" and record["steps"] == 30 and record["matmul"]["error"].startswith("not measured")
    labels = [bench.run_label(r) for r in record["runs"]]
    assert labels == ["engine bf16", "torch bf16 eager", "torch bf16 compile", "engine tf32", "torch fp32 eager"]
    for r in record["runs"]:
        assert r["flops_per_step"] == bench.step_flops({"d_model": 8, "n_layer": 1, "seq_len": 16, "d_ff": 32,
                                                        "padded_vocab_size": 128}, {"batch_size": 8, "grad_accum": 1})
        assert r["mfu"] is None                       # no matmul rate on a CPU dry run
    for r in record["runs"][::3]:
        assert r["error"] is None and r["ms_per_step"] == 2.0 and r["tokens_per_s"] == pytest.approx(128 / 0.002)
        assert r["loss_last"] == pytest.approx(4.0 - sum(range(10, 30)) / 20 / 30)
    torch_failed = all(r["error"] for r in record["runs"] if r["side"] == "torch")
    for c in record["comparisons"]:
        assert c["loss_check"] == ("SKIP (a run failed)" if torch_failed else "FAIL")
        assert (c["ratio"] is None) == torch_failed
    table = out.stdout.splitlines()
    assert table[1].split()[:3] == ["model", "run", "ms/step"] and len(table) == 2 + 5   # the table is last
    assert (tmp_path / "out" / "bench.md").read_text().count("\n| tiny |") == 5


def test_the_record_says_which_text_and_how_many_tokens_each_model_ran_on(tmp_path):
    """A run on part of a corpus (a prefix carried to a machine without network) and a run on the
    whole must be told apart in the history: each comparison keeps the globs and their tokens, and
    the table's markdown says them."""
    out, record = standin_run(tmp_path, "tiny", 8, "--precisions", "bf16", "--torch-modes", "eager")
    [c] = record["comparisons"]
    assert c["text"] == {"train": str(tmp_path / "train.bin"), "train_tokens": 1000, "real": True,
                         "val": None, "val_tokens": None}
    md = (tmp_path / "out" / "bench.md").read_text()
    assert md.endswith(f"\nText: tiny: `{tmp_path / 'train.bin'}` (1,000 tokens).\n"), md
    c["text"].update(val="v_*.bin", val_tokens=20000)
    record["comparisons"].append(dict(c, model="big", precision="fp8"))
    assert bench.text_line(record).endswith("Text: tiny, big: `%s` (1,000 tokens; validation `v_*.bin`, "
                                            "20,000 tokens).\n" % (tmp_path / "train.bin"))
    del record["comparisons"][0]["text"], record["comparisons"][1]["text"]   # records before the field
    assert bench.text_line(record) == ""


def test_a_damaged_shard_stops_the_benchmark_before_any_run(tmp_path):
    """The text's token count is read before the runs: a shard cut short is one error line and exit
    2 at once, not a traceback after minutes of measurement that leaves no record."""
    from microgpt.shards import write_shard
    bad = tmp_path / "bad.bin"
    write_shard(str(bad), list(range(100)))
    bad.write_bytes(bad.read_bytes()[:-2])
    engine, ran = tmp_path / "engine", tmp_path / "engine-ran"
    engine.write_text(f"#!/bin/sh\ntouch {ran}\n")
    engine.chmod(0o755)
    cfg = dict(CFG, name="tiny", model={"n_layer": 1, "d_model": 8, "n_head": 2, "seq_len": 16, "vocab_size": 100})
    (tmp_path / "tiny.json").write_text(json.dumps(cfg))
    out = subprocess.run([sys.executable, os.path.join(HERE, "bench.py"), "--models", str(tmp_path / "tiny.json"),
                          "--data", str(bad), "--precisions", "bf16", "--torch-modes", "eager", "--steps", "30",
                          "--engine", str(engine), "--device", "cpu", "--out", str(tmp_path / "out"),
                          "--results", str(tmp_path / "results.jsonl")],
                         capture_output=True, text=True, timeout=300, env=python_env())
    assert out.returncode == 2, out.stderr
    assert out.stderr.splitlines()[-1] == (f"error: cannot read the text's shards: {bad}: file is 1222 bytes, "
                                           "header promises 1224"), out.stderr
    assert "Traceback" not in out.stderr
    assert not ran.exists() and not (tmp_path / "results.jsonl").exists()


def test_recorded_runs_are_shown_as_the_docs_print_them(tmp_path):
    path = tmp_path / "r.jsonl"
    lines = [line for line in open(results.RESULTS_FILE) if '"kind":"train"' in line]
    path.write_text("".join(lines))
    show = [sys.executable, os.path.join(HERE, "results.py"), "--file", str(path)]
    out = subprocess.run(show + ["2026-11-29T22:29"], capture_output=True, text=True, timeout=60, env=python_env())
    assert out.returncode == 0, out.stderr
    assert "commit 2752352" in out.stdout and out.stdout.count("\n| 120M | engine ") == 3
    assert "| 120M | engine bf16 | 17.22 | 475,591 | - | 5.70 | 1815 | 690 | 4.987 | 1.24x (compile) |" in out.stdout
    missing = subprocess.run(show + ["1999"], capture_output=True, text=True, timeout=60, env=python_env())
    assert missing.returncode == 1 and "no record" in missing.stderr


def test_a_reader_gone_is_a_quiet_exit():
    """`results.py DATE | head -1`: the print to a pipe whose reader is gone was a BrokenPipeError
    traceback. It now ends as a program killed by SIGPIPE would: exit 141, nothing on stderr."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        res = subprocess.run([sys.executable, os.path.join(HERE, "results.py"), "2026-11-29T22:29"], stdout=write_end,
                             stderr=subprocess.PIPE, text=True, timeout=60, env=python_env())
    finally:
        os.close(write_end)
    assert res.returncode == 141 and res.stderr == "", res.stderr


def test_a_whole_run_with_fp8_rows_marks_the_fp8_targets(tmp_path):
    """The engine in bf16 and fp8 (the stand-in's fp8 is faster); torchao's row is a PyTorch run of
    its own (an error where torch or torchao is missing), and ANDREA-12M's fp8 target compares the
    two engine rows whatever PyTorch did."""
    out, record = standin_run(tmp_path, "12M", 16, "--precisions", "fp8,bf16", "--torch-modes", "eager")
    assert out.returncode == 1, out.stderr     # a PyTorch side fails (no torch, no torchao, or no CUDA for fp8)
    labels = [bench.run_label(r) for r in record["runs"]]
    assert labels == ["engine fp8", "torch fp8 reduce-overhead", "torch bf16 eager", "engine bf16"]
    torch_fp8 = record["runs"][1]
    assert torch_fp8["error"]                   # fp8 in PyTorch needs torchao and a CUDA device
    fp8, bf16 = record["comparisons"]
    assert fp8["precision"] == "fp8" and fp8["ratio"] is None and fp8["baseline"] is None
    assert fp8["targets"] == {"ms/step <= engine bf16": [True, "1.50 vs 2.00"]}
    assert bf16["targets"]["ms/step <= 1.4"] == [False, "2.00"]
    assert "bf16_ratio" in fp8 and "bf16_ratio" not in bf16
    table = out.stdout.splitlines()
    assert "ms/step <= engine bf16: met (1.50 vs 2.00)" in table[2]
    assert "torch fp8 reduce-overhead  error:" in out.stdout
    shown = subprocess.run([sys.executable, os.path.join(HERE, "results.py"), "--file", str(tmp_path / "results.jsonl")],
                           capture_output=True, text=True, timeout=60, env=python_env())
    assert shown.returncode == 0, shown.stderr
    assert "| 12M | engine fp8 | 1.50 |" in shown.stdout and "| 12M | torch fp8 reduce-overhead | error: " in shown.stdout
    assert "ms/step <= engine bf16: met (1.50 vs 2.00)" in shown.stdout
