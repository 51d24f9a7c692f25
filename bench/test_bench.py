"""bench.py's bookkeeping without a GPU or torch: flags, medians, loss check, targets, and a whole run
against a stand-in engine (where torch is missing its PyTorch side fails, and the report must say so).

    pytest bench/test_bench.py
"""
import json
import math
import os
import subprocess
import sys

import pytest

import bench
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


def side(loss, val=None, tok=1000.0, smi=None, constant=None, error=None):
    return {"loss_last": loss, "val_loss": val, "tokens_per_s": tok, "smi_bytes": smi,
            "memory_constant": constant, "error": error}


def test_loss_check_passes_within_tolerance_and_fails_outside_or_on_nan():
    assert bench.loss_check(side(5.09, 5.2), side(5.0, 5.1), 0.02, True)[0] == "PASS"
    assert bench.loss_check(side(5.11), side(5.0), 0.02, True)[0] == "FAIL"
    assert bench.loss_check(side(5.0, 5.3), side(5.0, 5.1), 0.02, True)[0] == "FAIL"   # val decides too
    assert bench.loss_check(side(math.nan), side(5.0), 0.02, True)[0] == "FAIL"
    assert bench.loss_check(side(5.0), side(5.0), 0.02, False)[0].startswith("SKIP")
    assert bench.loss_check(side(5.0, error="x"), side(5.0), 0.02, True)[0].startswith("SKIP")


def test_targets_follow_the_issue():
    t = bench.targets("120M", "bf16", side(0, tok=1300, smi=4, constant=True), side(0, tok=1000, smi=5))
    assert t["tokens/s >= 1.25x"][0] and t["memory <= PyTorch"][0] and t["memory constant"][0]
    t = bench.targets("120M", "fp16", side(0, tok=1200, smi=6, constant=False), side(0, tok=1000, smi=5))
    assert not t["tokens/s >= 1.25x"][0] and not t["memory <= PyTorch"][0] and not t["memory constant"][0]
    assert not bench.targets("12M", "bf16", side(0, tok=4900), side(0, tok=1000))["tokens/s >= 5.0x"][0]
    assert bench.targets("12M", "tf32", side(0, tok=1000), side(0, tok=1000))["tokens/s >= 1.0x"][0]
    assert not bench.targets("120M", "tf32", side(0, tok=999), side(0, tok=1000))["tokens/s >= 1.0x"][0]
    assert bench.targets("12M", "fp32", side(0, tok=1000), side(0, tok=1000)) == {}  # strict fp32: no target
    assert bench.targets("12M", "bf16", side(0, error="boom"), side(0)) == {}


def test_wsd_schedule_holds_then_decays_to_min_at_the_last_step():
    t = {"steps": 100, "warmup_steps": 0, "lr": 1.0, "min_lr": 0.1, "schedule": "wsd", "decay_frac": 0.2}
    assert lr_at(79, t) == 1.0 and lr_at(99, t) == pytest.approx(0.1)
    assert 0.1 < lr_at(90, t) < 1.0


STANDIN = """#!/usr/bin/env python3
import json, sys
args = dict(zip(sys.argv[1::2], sys.argv[2::2]))
steps = int(args["--train.steps"])
print(json.dumps({"event": "start", "tokens_per_step": 8 * 16}))
for s in range(steps):
    print(json.dumps({"step": s + 1, "loss": 4.0 - s / steps, "ms": 2.0}))
print(json.dumps({"step": steps, "val_loss": 3.5}))
"""


def test_a_whole_run_reports_every_row_even_when_a_side_fails(tmp_path):
    engine = tmp_path / "engine"
    engine.write_text(STANDIN)
    engine.chmod(0o755)
    from microgpt.shards import write_shard
    write_shard(str(tmp_path / "train.bin"), list(range(100)) * 10)
    cfg = dict(CFG, name="tiny", model={"n_layer": 1, "d_model": 8, "n_head": 2, "seq_len": 16, "vocab_size": 100},
               data={"train": str(tmp_path / "train.bin")})
    (tmp_path / "tiny.json").write_text(json.dumps(cfg))
    out = subprocess.run([sys.executable, os.path.join(HERE, "bench.py"), "--models", str(tmp_path / "tiny.json"),
                          "--steps", "30", "--engine", str(engine), "--device", "cpu", "--out", str(tmp_path / "out")],
                         capture_output=True, text=True, timeout=300, env=python_env())
    # the PyTorch side fails where torch is missing; where it runs, the stand-in's loss is not its loss
    assert out.returncode == 1, out.stderr
    report = json.loads((tmp_path / "out" / "bench.json").read_text())
    rows = {r["precision"]: r for r in report["rows"]}
    assert set(rows) == {"bf16", "tf32", "fp32"}
    for r in rows.values():
        assert r["engine"]["error"] is None and r["engine"]["ms_per_step"] == 2.0
        assert r["engine"]["tokens_per_s"] == pytest.approx(128 / 0.002)
        assert r["engine"]["loss_last"] == pytest.approx(4.0 - sum(range(10, 30)) / 20 / 30)
        assert r["loss_check"] == ("SKIP (a run failed)" if r["torch"]["error"] else "FAIL")
    md = (tmp_path / "out" / "bench.md").read_text()
    assert md.count("\n| tiny |") == 3
