"""decode_bench.py's engine side without a GPU or torch: the protocol driven against a stand-in engine
(streaming, batches, an engine that stops short or dies), and against the CPU engine's --generate on
a tiny model (the CUDA engine's too, on a GPU). transformers' side (bench/hf_decode.py) on a tiny GPT-2 where torch and transformers are
installed.

    pytest bench/test_decode_bench.py
"""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

import decode_bench
import results
from bench_common import REPO
from engine_util import python_env
from microgpt.shards import write_shard
from test_gpu import cuda_binary  # noqa: F401  (the fixture: skips without a GPU or the binary)

HERE = os.path.dirname(os.path.abspath(__file__))

CPU_ENGINE = os.path.join(REPO, "build", "microgpt_cpu")

# A stand-in engine: a training run writes a checkpoint; --generate answers the protocol, each
# request's tokens a function of its prompt, a batch's tokens interleaved as a batched decoder sends
# them. STANDIN_MODE: short stops every request after 2 tokens; crash exits on the second request
# (the first timed one); crash-at-3 exits on the first batch of 3; notrain fails its training run.
STANDIN = r"""#!/usr/bin/env python3
import json, os, sys
argv = sys.argv[1:]
ckpt = argv[argv.index("--checkpoint") + 1]
mode = os.environ.get("STANDIN_MODE", "")
if "--generate" not in argv:
    if mode == "notrain":
        print("error: data.train: no shards match", file=sys.stderr)
        sys.exit(2)
    open(ckpt, "wb").write(b"weights")
    print(json.dumps({"step": 1, "loss": 4.0, "ms": 1.0}))
    sys.exit(0)
open(os.environ["STANDIN_ARGV"], "w").write(json.dumps(argv))
for n, line in enumerate(sys.stdin):
    reqs = json.loads(line)
    reqs = reqs if isinstance(reqs, list) else [reqs]
    if (mode == "crash" and n == 1) or (mode == "crash-at-3" and len(reqs) == 3):
        print("error: out of device memory", file=sys.stderr)
        sys.exit(3)
    made = {r["id"]: [] for r in reqs}
    steps = 2 if mode == "short" else max(r["max_tokens"] for r in reqs)
    for i in range(steps):
        for r in reqs:
            if i < r["max_tokens"]:
                t = (sum(r["prompt"]) + i) % 50
                made[r["id"]].append(t)
                print(json.dumps({"id": r["id"], "token": t}), flush=True)
    for r in reqs:
        print(json.dumps({"id": r["id"], "done": True, "reason": "length", "tokens": made[r["id"]],
                          "prompt_tokens": len(r["prompt"]), "ms": 1.5}), flush=True)
"""


@pytest.fixture
def tiny(tmp_path):
    """A tiny experiment config with a shard of random tokens, and the stand-in engine."""
    write_shard(str(tmp_path / "train.bin"), np.random.default_rng(0).integers(0, 100, size=4000))
    cfg = {"name": "tiny", "model": {"n_layer": 2, "d_model": 32, "n_head": 4, "seq_len": 16, "vocab_size": 100},
           "train": {"batch_size": 2, "steps": 100, "lr": 1e-3, "warmup_steps": 2},
           "data": {"train": str(tmp_path / "train.bin")}}
    (tmp_path / "tiny.json").write_text(json.dumps(cfg))
    engine = tmp_path / "standin"
    engine.write_text(STANDIN)
    engine.chmod(0o755)
    return tmp_path, str(engine)


def decode(tmp_path, engine, *extra, env=None):
    cmd = [sys.executable, os.path.join(HERE, "decode_bench.py"), "--models", str(tmp_path / "tiny.json"),
           "--engine", engine, "--no-hf", "--batches", "1,3", "--prompt-tokens", "4", "--new-tokens", "6",
           "--reps", "2", "--out", str(tmp_path / "out"), "--results", str(tmp_path / "results.jsonl"), *extra]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                         env=python_env(STANDIN_ARGV=str(tmp_path / "argv.json"), **(env or {})))
    return out, results.read_records(str(tmp_path / "results.jsonl")) if (tmp_path / "results.jsonl").exists() else []


def test_the_engine_side_is_measured_per_batch_and_recorded(tiny):
    tmp_path, engine = tiny
    out, [record] = decode(tmp_path, engine)
    assert out.returncode == 0, out.stderr
    assert record["kind"] == "decode" and record["new_tokens"] == 6 and record["prompt_tokens"] == 4
    assert [(r["model"], r["batch"]) for r in record["rows"]] == [("tiny", 1), ("tiny", 3)]
    for r in record["rows"]:
        assert "error" not in r["engine"] and r["engine"]["tokens_per_s"] > 0 and len(r["engine"]["tokens_per_s_reps"]) == 2
        assert r["engine"]["engine_ms"] == 1.5
        assert r["hf"] == {"error": "not run (--no-hf)"} and r["ratio"] is None
    argv = json.loads((tmp_path / "argv.json").read_text())
    assert argv[:2] == ["--generate", "--checkpoint"] and len(argv) == 3   # the model flags are in the sidecar
    lines = out.stdout.splitlines()
    assert lines[1].split()[:2] == ["model", "batch"] and len(lines) == 4   # the table is printed last


def test_an_engine_that_stops_short_is_an_error_not_a_speed(tiny):
    tmp_path, engine = tiny
    out, [record] = decode(tmp_path, engine, env={"STANDIN_MODE": "short"})
    assert out.returncode == 1
    for r in record["rows"]:
        assert "2 tokens streamed" in r["engine"]["error"] and "6 asked" in r["engine"]["error"]


def test_an_engine_that_dies_fails_its_rows_with_its_message(tiny):
    tmp_path, engine = tiny
    out, [record] = decode(tmp_path, engine, env={"STANDIN_MODE": "crash"})
    assert out.returncode == 1
    errors = [r["engine"]["error"] for r in record["rows"]]
    assert all("exit code 3" in e and "out of device memory" in e for e in errors), errors


def test_results_before_the_engine_died_are_kept(tiny):
    tmp_path, engine = tiny
    out, [record] = decode(tmp_path, engine, env={"STANDIN_MODE": "crash-at-3"})
    assert out.returncode == 1
    first, second = record["rows"]
    assert "error" not in first["engine"] and first["engine"]["tokens_per_s"] > 0
    assert "exit code 3" in second["engine"]["error"]


def test_a_failed_training_run_is_reported_in_every_row(tiny):
    tmp_path, engine = tiny
    out, [record] = decode(tmp_path, engine, env={"STANDIN_MODE": "notrain"})
    assert out.returncode == 1
    for r in record["rows"]:
        assert "training: exit 2: error: data.train: no shards match" in r["engine"]["error"]
        assert r["ratio"] is None and r["targets"] == {}


def test_prompts_are_fixed_and_inside_the_vocabulary():
    a = decode_bench.prompts(8, 128, 50259)
    assert a == decode_bench.prompts(8, 128, 50259) and len(a) == 8 and {len(p) for p in a} == {128}
    assert max(max(p) for p in a) < 50259 and a[0] != a[1]
    assert decode_bench.prompts(1, 128, 50259) != a[:1]   # each batch size has its own prompts


def test_a_request_that_does_not_fit_the_context_is_refused(tiny):
    tmp_path, engine = tiny
    out, records = decode(tmp_path, engine, "--new-tokens", "13")   # 4 + 13 > seq_len 16
    assert out.returncode == 2 and "exceeds seq_len 16" in out.stderr and records == []


def test_greedy_agreement_counts_the_common_prefix():
    row = {"model": "120M", "batch": 1, "engine": {"tokens_per_s": 600.0, "tokens": [1, 2, 3, 4]},
           "hf": {"tokens_per_s": 100.0, "tokens": [1, 2, 9, 4]}}
    decode_bench.compare(row)
    assert row["ratio"] == 6.0 and row["greedy_agree"] == 2
    assert row["targets"] == {"tokens/s >= 5.0x": (True, "6.00x")}


def engine_generates():
    if not os.access(CPU_ENGINE, os.X_OK):
        return False
    return "--generate" in subprocess.run([CPU_ENGINE, "--help"], capture_output=True, text=True).stdout


@pytest.mark.skipif(not engine_generates(), reason="build/microgpt_cpu is not built or has no --generate mode "
                    "(make cpu)")
def test_the_cpu_engine_decodes_through_the_benchmark(tiny):
    tmp_path, _ = tiny
    out, [record] = decode(tmp_path, CPU_ENGINE, "--precision", "fp32", "--train-steps", "3")
    assert out.returncode == 0, out.stderr
    for r in record["rows"]:
        assert "error" not in r["engine"] and r["engine"]["tokens_per_s"] > 0


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_the_cuda_engine_decodes_through_the_benchmark(tiny, cuda_binary, precision):  # noqa: F811
    tmp_path, _ = tiny
    out, [record] = decode(tmp_path, str(cuda_binary), "--precision", precision, "--train-steps", "3")
    assert out.returncode == 0, out.stderr
    for r in record["rows"]:
        assert "error" not in r["engine"] and r["engine"]["tokens_per_s"] > 0


# ----------------------------------------------------------------------------- transformers' side


def hf_missing():
    for module in ("torch", "transformers"):
        try:
            __import__(module)
        except ImportError:
            return f"{module} is not installed (pip install torch transformers: a CPU build of torch is enough)"
    return None


@pytest.mark.skipif(hf_missing() is not None, reason=str(hf_missing()))
def test_hf_decode_runs_greedy_generate_to_the_requested_length(tmp_path):
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=100, n_positions=32, n_embd=32, n_layer=2, n_head=4))
    model = model.to(torch.bfloat16).eval()
    prompts = {"1": decode_bench.prompts(1, 5, 100), "2": decode_bench.prompts(2, 5, 100)}
    ids = torch.tensor(prompts["2"])
    want = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=9, do_sample=False,
                          pad_token_id=0)[:, 5:]   # the config's end-of-text id (50256) is outside this vocabulary
    model.generation_config.eos_token_id = int(want[0, 0])   # emitted first: hf_decode must not stop at it
    model.save_pretrained(tmp_path / "m")
    (tmp_path / "p.json").write_text(json.dumps(prompts))
    out = subprocess.run([sys.executable, os.path.join(HERE, "hf_decode.py"), str(tmp_path / "m"), "--prompts",
                          str(tmp_path / "p.json"), "--new-tokens", "9", "--reps", "2", "--device", "cpu"],
                         capture_output=True, text=True, timeout=300, env=python_env())
    assert out.returncode == 0, out.stderr
    got = {r["batch"]: r for r in map(json.loads, (ln for ln in out.stdout.splitlines() if ln.startswith("{")))}
    assert set(got) == {1, 2}
    assert got[2]["tokens"] == want[0].tolist() and len(got[1]["tokens"]) == 9
    assert got[2]["tokens_per_s"] > 0 and len(got[2]["tokens_per_s_reps"]) == 2
