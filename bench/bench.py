"""Side-by-side benchmark: the CUDA engine against PyTorch on the same GPU, same model, same run
(docs/DESIGN.md §9).

    python3 bench/bench.py [--models 12M,120M] [--precisions bf16] [--torch-modes eager,compile,reduce-overhead]
                           [--torch-fp8-modes reduce-overhead] [--steps 200] [--warmup 10] [--out DIR]
                           [--results FILE]
    python3 bench/bench.py --loss-check [--data GLOB --val GLOB]

First one large bf16 product measures the GPU's matmul rate (bench/matmul_peak.py), the ceiling
of the MFU column. Then, for each model and engine precision, it runs build/microgpt_cuda and the
PyTorch baselines of that precision (bench/torch_gpt.py), each in its own process: for 16-bit
engine rows bf16 autocast in every --torch-modes mode (torch.compile's default mode, with CUDA
graphs, max-autotune, or eager), for fp8 rows torchao's float8 training in every --torch-fp8-modes
mode and the bf16 runs, for tf32/fp32 rows fp32 eager with TF32. It reports median ms/step after
warm-up, tokens/s, MFU, device memory, the engine's throughput over the FASTEST PyTorch run of its
precision (and, for fp8 rows, over the fastest bf16 one), the targets, and whether they reached
the same loss. The table is printed last; the run is appended as one JSON line to
bench/results.jsonl. Method and columns: docs/BENCHMARKS.md. A failing run is reported in its row;
the others still run. Exit status: 0 when every run finished and every loss check passed, 1
otherwise, 2 for bad input.
"""
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

from bench_common import (REPO, BenchError, config_flags, experiment_path, flag_args, load_config, model_shape,
                          repo_path, shard_paths, train_settings)
from microgpt.cli import ArgumentParser
from microgpt.shards import ShardError, glob_tokens, write_shard
from results import RESULTS_FILE, append_record, environment, smi_query

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
TORCH_SCRIPT = os.path.join(BENCH_DIR, "torch_gpt.py")
MATMUL_SCRIPT = os.path.join(BENCH_DIR, "matmul_peak.py")

# Real text the loss check may use when neither --data nor the config's data.train has shards.
FALLBACK_DATA = [("data/megachat/megachat_train_*.bin", "data/megachat/megachat_val_*.bin"),
                 ("data/shakespeare/shakespeare_train_*.bin", "data/shakespeare/shakespeare_val_*.bin")]

PRECISIONS = ("fp32", "tf32", "bf16", "fp16", "fp8")
# PyTorch baselines of 16-bit engine rows: bf16 autocast in one of these modes (bench/torch_gpt.py's
# --compile value for each). tf32 and fp32 rows have one baseline: fp32 eager with TF32 products.
TORCH_MODES = {"eager": "none", "compile": "default", "reduce-overhead": "reduce-overhead",
               "max-autotune": "max-autotune"}
FP32_BASELINE = ("fp32", "eager")

# Targets per (model, engine precision): step time; throughput ratio and MFU against the fastest
# PyTorch run of the row's own precision; step time no longer than the engine's row of another
# precision in the same run (max_ms_of_engine). tf32 rows (the engine's fp32 storage with TF32
# products, as PyTorch's fp32 baseline): ratio >= 1.0. Strict fp32 rows have no target.
TARGETS = {("120M", "bf16"): {"max_ms": 14.0, "min_ratio": 1.3, "min_mfu": 0.60},
           ("12M", "bf16"): {"max_ms": 1.4, "min_ratio": 2.3},
           ("120M", "fp8"): {"max_ms": 12.5},
           ("12M", "fp8"): {"max_ms_of_engine": "bf16"}}
TF32_TARGET = {"min_ratio": 1.0}
MEMORY_TARGET_MODELS = {"120M"}   # engine device memory <= the fastest PyTorch's, constant over the run


def baselines(precision, torch_modes, fp8_modes=()):
    """The PyTorch runs an engine precision is compared against: [(torch precision, mode)], those of
    the row's own precision first (fp8 rows: torchao's float8 runs, then the bf16 runs)."""
    if precision in ("fp32", "tf32"):
        return [FP32_BASELINE]
    bf16 = [("bf16", mode) for mode in torch_modes]
    return [("fp8", mode) for mode in fp8_modes] + bf16 if precision == "fp8" else bf16


# -----------------------------------------------------------------------------
# model FLOPs and MFU


def step_flops(shape, t):
    """Model FLOPs of one optimizer step (forward and backward, each multiply-add 2 FLOPs):

        6 * tokens * (n_layer * (4 d^2 + 2 d d_ff) + d * padded_vocab)      the products with weights
      + 6 * sequences * n_layer * d * T (T + 1)                             causal attention

    tokens = batch_size * seq_len * grad_accum, sequences = batch_size * grad_accum. A product with a
    weight costs 2 FLOPs per weight per token forward and twice that backward (the input's gradient
    and the weight's), hence 6. Attention's two products (Q K^T and P V) cost 2 d FLOPs per
    (query, key) pair each, over the T (T + 1) / 2 pairs a causal mask keeps (each counted once, not
    the full T^2 square), forward 4 d pairs, backward twice that. The classifier is counted at the
    padded vocabulary the product computes. Not counted: LayerNorm, GELU, softmax, the loss,
    embeddings, AdamW, and the work flash attention recomputes in its backward."""
    d, n_layer, T = shape["d_model"], shape["n_layer"], shape["seq_len"]
    sequences = t["batch_size"] * t["grad_accum"]
    weight_products = n_layer * (4 * d * d + 2 * d * shape["d_ff"]) + d * shape["padded_vocab_size"]
    return 6 * sequences * T * weight_products + 6 * sequences * n_layer * d * T * (T + 1)


def mfu(flops_per_step, ms_per_step, matmul_tflops):
    """Model FLOPs per second over the measured bf16 matmul rate; None when either is unknown."""
    if ms_per_step is None or not matmul_tflops:
        return None
    return flops_per_step / (ms_per_step / 1000.0) / (matmul_tflops * 1e12)


def measure_matmul(args):
    """bench/matmul_peak.py's JSON ({"tflops": ...}), or {"error": why} when it could not run."""
    if not args.device.startswith("cuda"):
        return {"error": f"not measured (--device {args.device})"}
    cmd = [sys.executable, MATMUL_SCRIPT, "--n", str(args.matmul_n), "--reps", str(args.matmul_reps)]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=REPO)
    except subprocess.TimeoutExpired:
        return {"error": "timed out after 300 s"}
    records = parse_records(out.stdout)
    if out.returncode != 0 or not records or "tflops" not in records[-1]:
        last = [line for line in out.stderr.splitlines() if line.strip()][-1:] or ["(no stderr)"]
        return {"error": f"exit {out.returncode}: {last[0][:200]}"}
    return records[-1]


# -----------------------------------------------------------------------------
# device memory, clock and power as nvidia-smi sees them: the same measure for every process


SMI_FIELDS = "memory.used,clocks.sm,power.draw,utilization.gpu"
BUSY_PERCENT = 50  # clock and power are taken from samples where the GPU was at least this busy


def median_or_none(xs):
    return statistics.median(xs) if xs else None


def parse_smi_sample(text):
    """'61234, 1830, 690.52, 100' (MiB, MHz, W, % busy) -> (61234, 1830.0, 690.52, 100); None if it is
    not that."""
    try:
        mib, mhz, watts, busy = (field.strip() for field in (text or "").split(","))
        return int(mib), float(mhz), float(watts), int(busy)
    except ValueError:
        return None


class GpuPoller(threading.Thread):
    """Polls the GPU while a child runs: its used memory (peak minus the idle level before it
    started), SM clock and power draw. A step's time depends on the clock, which the GPU lowers
    under sustained load, so each run reports the clock and power it actually ran at: the medians
    over the samples where the GPU was busy (not over torch.compile or set-up, when it is idle)."""

    def __init__(self, period_s=0.2):
        super().__init__(daemon=True)
        self.period_s = period_s
        self.stop_flag = threading.Event()
        base = parse_smi_sample(smi_query(SMI_FIELDS))
        self.base_mib = base[0] if base else None
        self.peak_mib = self.base_mib
        self.clocks, self.watts = [], []

    def run(self):
        while self.base_mib is not None and not self.stop_flag.wait(self.period_s):
            sample = parse_smi_sample(smi_query(SMI_FIELDS))
            if sample:
                self.peak_mib = max(self.peak_mib, sample[0])
                if sample[3] >= BUSY_PERCENT:
                    self.clocks.append(sample[1])
                    self.watts.append(sample[2])

    def finish(self):
        """Stop polling; (bytes the child added at its peak, median SM MHz and W while busy), None
        for what nvidia-smi could not give."""
        self.stop_flag.set()
        self.join()
        added = None if self.base_mib is None else (self.peak_mib - self.base_mib) << 20
        return added, median_or_none(self.clocks), median_or_none(self.watts)


# -----------------------------------------------------------------------------
# running one side and reading its JSON lines


def run_logged(cmd, log_prefix, timeout_s):
    """Run cmd with stdout/stderr saved beside the results; returns (returncode or error, records,
    GpuPoller.finish()'s (bytes, MHz, W))."""
    poller = GpuPoller()
    poller.start()
    t0 = time.time()
    try:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
    except OSError as e:
        poller.finish()
        return f"cannot start {cmd[0]}: {e.strerror}", [], (None, None, None)
    try:
        out, err = proc.communicate(timeout=timeout_s)
        status = proc.returncode
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        status = f"timed out after {timeout_s} s"
    gpu = poller.finish()
    for suffix, text in ((".stdout", out), (".stderr", err)):
        with open(log_prefix + suffix, "w") as f:
            f.write(text)
    if status != 0 and not isinstance(status, str):
        last = [line for line in err.splitlines() if line.strip()][-1:] or ["(no stderr)"]
        status = f"exit {status}: {last[0][:200]}"
    print(f"  {os.path.basename(log_prefix)}: {time.time() - t0:.0f} s", file=sys.stderr, flush=True)
    return status, parse_records(out), gpu


def parse_records(text):
    records = []
    for line in text.splitlines():
        try:
            r = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(r, dict):
            records.append(r)
    return records


def summarize(records, warmup, last, tokens_per_step):
    """Timing, loss and memory figures of one run's records."""
    steps = [r for r in records if "loss" in r and "ms" in r]
    if len(steps) <= warmup:
        raise BenchError(f"only {len(steps)} step records, need more than the {warmup} warm-up steps")
    start = next((r for r in records if r.get("event") == "start"), {})
    tokens_per_step = start.get("tokens_per_step", tokens_per_step)
    ms = statistics.median(r["ms"] for r in steps[warmup:])
    val = [r["val_loss"] for r in records if "val_loss" in r]
    dev = [r["bytes"] for r in records if r.get("event") == "device_memory"]
    plan = next((r["total_bytes"] for r in records if r.get("event") == "memory"), None)
    tmem = next((r for r in records if r.get("event") == "torch_memory"), {})
    return {"torch_version": start.get("torch"), "torch_cuda": start.get("torch_cuda"),
            "torchao_version": start.get("torchao"), "steps": len(steps), "ms_per_step": ms, "tokens_per_s": tokens_per_step / (ms / 1000.0),
            "loss_last": statistics.fmean(r["loss"] for r in steps[-last:]), "val_loss": val[-1] if val else None,
            "device_memory": max(dev) if dev else None, "memory_constant": len(set(dev)) == 1 if dev else None,
            "plan_bytes": plan, "peak_allocated": tmem.get("peak_allocated"),
            "peak_reserved": tmem.get("peak_reserved"),
            "skipped_steps": sum(1 for r in steps if r.get("skipped"))}


def run_side(name, cmd, args, tokens_per_step, timeout_s):
    status, records, (smi_bytes, sm_mhz, power_w) = run_logged(cmd, os.path.join(args.out, name), timeout_s)
    result = {"command": " ".join(cmd), "error": None if status == 0 else status, "smi_bytes": smi_bytes,
              "sm_mhz": sm_mhz, "power_w": power_w}
    try:
        result.update(summarize(records, args.warmup, args.last, tokens_per_step))
    except BenchError as e:
        result["error"] = result["error"] or str(e)
    return result


# -----------------------------------------------------------------------------
# commands


def run_overrides(cfg, args, precision, data):
    """The config keys every benchmark run sets, whatever the experiment says."""
    t = train_settings(cfg)
    warmup = min(t["warmup_steps"], args.steps // 10)   # so a short run goes through warmup and decay
    o = {"train.steps": args.steps, "train.warmup_steps": warmup, "train.precision": precision,
         "data.train": data["train"], "eval.every": args.steps if data["val"] else 0}
    if data["val"]:
        o["data.val"] = data["val"]
    return o


def engine_command(cfg, overrides, engine):
    """The config as engine flags (docs/DESIGN.md §4.1: flags are the dotted config keys). Sampling,
    polish and periodic checkpoints are left out: they are not what is being measured."""
    flags = config_flags(cfg)
    flags.pop("data.val", None)
    flags.update(overrides)
    flags.update({"sample.every": 0, "checkpoint.every": 0})
    return [engine] + flag_args(flags)


def torch_command(config_path, overrides, precision, mode, device):
    compile_mode = TORCH_MODES[mode] if device.startswith("cuda") else "none"   # a CPU dry run checks plumbing
    cmd = [sys.executable, TORCH_SCRIPT, config_path, "--precision", precision, "--compile", compile_mode,
           "--device", device, "--val", overrides.get("data.val", "")]
    for key, value in overrides.items():
        if key not in ("train.precision", "data.val", "eval.every"):
            cmd += [f"--{key}", str(value)]
    return cmd


# -----------------------------------------------------------------------------
# data


def synthetic_data(vocab_size):
    """A shard of uniform random tokens: enough for timing, meaningless for the loss check. It goes to
    the temp dir, not --out, which holds only results."""
    path = os.path.join(tempfile.gettempdir(), f"andrea_bench_synthetic_{vocab_size}.bin")
    if not os.path.exists(path):
        write_shard(path, np.random.default_rng(0).integers(0, vocab_size, size=4 << 20))
    return {"train": path, "val": None, "real": False}


def choose_data(cfg, args, shape):
    """Real text when any can be found (--data, the config's data, known fallbacks), else synthetic;
    with its `text` (with_text), read before any run so that a damaged shard stops the benchmark at
    once rather than after its runs."""
    if args.data:
        if not shard_paths(args.data):
            raise BenchError(f"no shards match --data {args.data}")
        return with_text({"train": args.data, "val": args.val or None, "real": True})
    candidates = [(cfg.get("data", {}).get("train"), cfg.get("data", {}).get("val"))] + FALLBACK_DATA
    for train, val in candidates:
        if train and shard_paths(train):
            return with_text({"train": train, "val": val if val and shard_paths(val) else None, "real": True})
    if args.loss_check:
        raise BenchError("the loss check needs real text shards: none found, give --data GLOB")
    return with_text(synthetic_data(shape["vocab_size"]))


def with_text(data):
    """data with its `text`, what a model trained and validated on, for the record: the globs and
    their tokens (a run on part of a corpus, or on another build of it, is told apart from a run
    on the whole); BenchError for a shard whose header is damaged."""
    try:
        text = {"train": data["train"], "train_tokens": glob_tokens(data["train"]), "real": data["real"],
                "val": data["val"], "val_tokens": glob_tokens(data["val"]) if data["val"] else None}
    except (OSError, ShardError) as e:
        raise BenchError(f"cannot read the text's shards: {e}")
    return dict(data, text=text)


def loss_check(engine, torch_res, tol, real):
    """PASS when the last-steps mean train loss (and the val loss, when both have one) agree within tol."""
    if not real:
        return "SKIP (synthetic data)", None
    if engine.get("error") or torch_res.get("error"):
        return "SKIP (a run failed)", None
    pairs = [("train", engine["loss_last"], torch_res["loss_last"])]
    if engine["val_loss"] is not None and torch_res["val_loss"] is not None:
        pairs.append(("val", engine["val_loss"], torch_res["val_loss"]))
    diffs = {name: abs(a - b) / abs(b) if b else float("inf") for name, a, b in pairs}
    ok = all(d <= tol for d in diffs.values())   # NaN compares False: a NaN loss fails
    return ("PASS" if ok else "FAIL"), diffs


# -----------------------------------------------------------------------------
# one model: the engine in each precision against its PyTorch baselines


def loss_checks(engine, torch_runs, tol, real):
    """loss_check against every PyTorch run that finished: PASS when all pass, FAIL when any fails;
    the largest difference of each kind."""
    done = [r for r in torch_runs if not r.get("error")]
    if not done:
        return loss_check(engine, {"error": "none finished"}, tol, real)
    checks = [loss_check(engine, r, tol, real) for r in done]
    status = "FAIL" if any(s == "FAIL" for s, _ in checks) else checks[0][0]
    diffs = {}
    for _, d in checks:
        for key, value in (d or {}).items():
            diffs[key] = max(diffs.get(key, 0.0), value)
    return status, diffs or None


def fastest(runs, precision=None):
    """The fastest run that finished (of that PyTorch precision, when given), else None."""
    done = [r for r in runs if not r.get("error") and (precision is None or r["precision"] == precision)]
    return max(done, key=lambda r: r["tokens_per_s"]) if done else None


def ratio_to(engine, baseline):
    """Engine tokens/s over the baseline's; None when either did not finish."""
    if engine.get("error") or baseline is None:
        return None
    return engine["tokens_per_s"] / baseline["tokens_per_s"]


def targets(model, precision, engine, baseline, engine_rows=None):
    """Each target that applies to the row: {name: (met, detail)}, met None where it could not be
    measured in this run; baseline: the fastest PyTorch run of the row's precision (None: none
    finished, and the targets against PyTorch are left out); engine_rows: {precision: engine run}
    of the same model and run."""
    if engine.get("error"):
        return {}
    spec = TF32_TARGET if precision == "tf32" else TARGETS.get((model, precision), {})
    out = {}
    if "max_ms" in spec:
        out[f"ms/step <= {spec['max_ms']}"] = (engine["ms_per_step"] <= spec["max_ms"], f"{engine['ms_per_step']:.2f}")
    if "max_ms_of_engine" in spec:
        other = (engine_rows or {}).get(spec["max_ms_of_engine"])
        name = f"ms/step <= engine {spec['max_ms_of_engine']}"
        if other is None or other.get("error"):
            out[name] = (None, f"no engine {spec['max_ms_of_engine']} row finished in this run")
        else:
            out[name] = (engine["ms_per_step"] <= other["ms_per_step"],
                         f"{engine['ms_per_step']:.2f} vs {other['ms_per_step']:.2f}")
    if baseline is None:
        return out
    ratio = ratio_to(engine, baseline)
    if "min_ratio" in spec:
        out[f"tokens/s >= {spec['min_ratio']}x"] = (ratio >= spec["min_ratio"], f"{ratio:.2f}x")
    if "min_mfu" in spec and engine.get("mfu") is not None:
        out[f"MFU >= {spec['min_mfu']:.0%}"] = (engine["mfu"] >= spec["min_mfu"], f"{engine['mfu']:.1%}")
    if model in MEMORY_TARGET_MODELS and precision in ("bf16", "fp16"):
        e_mem, t_mem = engine["smi_bytes"], baseline["smi_bytes"]
        if e_mem is not None and t_mem is not None:
            out["memory <= PyTorch"] = (e_mem <= t_mem, f"{gib(e_mem)} vs {gib(t_mem)} GiB")
        if engine["memory_constant"] is not None:
            out["memory constant"] = (engine["memory_constant"], "device_memory first == last")
    return out


def run_label(r):
    """'engine bf16', 'torch bf16 reduce-overhead', 'torch fp8 reduce-overhead' (torchao), 'torch fp32 eager'."""
    return f"{r['side']} {r['precision']}" + (f" {r['mode']}" if r["side"] == "torch" else "")


def run_model(model, args, matmul_tflops):
    """model: a shipped name (12M -> experiments/ANDREA-12M-TRAIN.json) or a config path. Returns
    (runs, comparisons): every engine and PyTorch run, and one comparison per engine precision."""
    config_path = experiment_path(model)
    cfg = load_config(config_path)
    model = cfg.get("name", model) if model.endswith(".json") else model
    shape, t = model_shape(cfg), train_settings(cfg)
    tokens_per_step = t["batch_size"] * shape["seq_len"] * t["grad_accum"]
    flops = step_flops(shape, t)
    data = choose_data(cfg, args, shape)
    print(f"{model}: data {data['train']} ({'real' if data['real'] else 'synthetic'})", file=sys.stderr)
    runs, comparisons, torch_runs = [], [], {}

    def measured(run, **labels):
        run.update(labels, model=model, flops_per_step=flops,
                   mfu=mfu(flops, run.get("ms_per_step"), matmul_tflops))
        runs.append(run)
        return run

    engines = {}
    for precision in args.precisions:
        overrides = run_overrides(cfg, args, precision, data)
        engines[precision] = measured(run_side(f"engine-{model}-{precision}", engine_command(cfg, overrides, args.engine),
                                               args, tokens_per_step, args.timeout), side="engine", precision=precision)
        for key in baselines(precision, args.torch_modes, args.torch_fp8_modes):
            if key not in torch_runs:
                torch_prec, mode = key
                timeout = args.autotune_timeout if mode == "max-autotune" else args.timeout
                torch_runs[key] = measured(run_side(f"torch-{model}-{torch_prec}-{mode}",
                                                    torch_command(config_path, overrides, torch_prec, mode,
                                                                  args.device),
                                                    args, tokens_per_step, timeout),
                                           side="torch", precision=torch_prec, mode=mode)
    for precision, engine in engines.items():   # after every run: a target may compare two engine rows
        comparisons.append(compare(model, precision, engine, engines, torch_runs, args, data))
    return runs, comparisons


def compare(model, precision, engine, engines, torch_runs, args, data):
    """The comparison of one engine row: its ratio to the fastest PyTorch run of its own precision
    (fp8 rows: also to the fastest bf16 one), the loss check against every PyTorch run it is
    compared with, its targets, and the text both sides ran on."""
    keys = baselines(precision, args.torch_modes, args.torch_fp8_modes)
    family = [torch_runs[key] for key in keys]
    baseline = fastest(family, keys[0][0])
    check, diffs = loss_checks(engine, family, args.tol, data["real"])
    c = {"model": model, "precision": precision, "data": "real" if data["real"] else "synthetic", "text": data["text"],
         "baseline": baseline and run_label(baseline), "ratio": ratio_to(engine, baseline),
         "loss_check": check, "loss_diffs": diffs, "targets": targets(model, precision, engine, baseline, engines)}
    if precision == "fp8":
        bf16 = fastest(family, "bf16")
        c.update(bf16_baseline=bf16 and run_label(bf16), bf16_ratio=ratio_to(engine, bf16))
    return c


# -----------------------------------------------------------------------------
# report


def gib(n):
    return "-" if n is None else f"{n / 2**30:.2f}"


def fmt(x, spec):
    return "-" if x is None else format(x, spec)


COLUMNS = ["model", "run", "ms/step", "tok/s", "MFU", "GiB", "SM MHz", "W", "loss", "vs fastest PyTorch",
           "loss check", "targets"]


def table_rows(record):
    """One line per run of a results record; an engine run's line carries its comparison with the
    fastest PyTorch run."""
    by_engine = {(c["model"], c["precision"]): c for c in record["comparisons"]}
    rows = []
    for r in record["runs"]:
        c = by_engine.get((r["model"], r["precision"])) if r["side"] == "engine" else None
        ms = f"error: {r['error']}" if r.get("error") else fmt(r.get("ms_per_step"), ".2f")
        goals = "; ".join(f"{k}: {TARGET_WORDS[ok]} ({d})" for k, (ok, d) in c["targets"].items()) if c else ""
        rows.append([r["model"], run_label(r), ms, fmt(r.get("tokens_per_s"), ",.0f"), fmt(r.get("mfu"), ".1%"),
                     fmt(r.get("device_gib"), ".2f"), fmt(r.get("sm_mhz"), ".0f"), fmt(r.get("power_w"), ".0f"),
                     fmt(r.get("loss_last"), ".3f"), vs_cell(c) if c else "-", check_cell(c) if c else "-",
                     goals or "-"])
    return rows


TARGET_WORDS = {True: "met", False: "MISSED", None: "not measured"}


def vs_cell(c):
    """e.g. '1.98x (reduce-overhead)'; an fp8 row: '1.30x (torchao reduce-overhead); 1.10x (bf16 reduce-overhead)'."""
    def one(ratio, label, prefix):
        return None if ratio is None else f"{ratio:.2f}x ({prefix}{label.split(' ', 2)[-1]})"
    if c["precision"] != "fp8":
        return one(c["ratio"], c["baseline"], "") or "-"
    cells = [one(c["ratio"], c["baseline"], "torchao "), one(c.get("bf16_ratio"), c.get("bf16_baseline"), "bf16 ")]
    return "; ".join(x for x in cells if x) or "-"


def check_cell(c):
    """e.g. 'PASS (train 0.12%, val 0.30%)'"""
    diffs = ", ".join(f"{k} {100 * d:.2f}%" for k, d in (c["loss_diffs"] or {}).items())
    return f"{c['loss_check']} ({diffs})" if diffs else c["loss_check"]


def heading(record):
    matmul = record["matmul"]
    rate = f"{matmul['tflops']:.0f} TFLOP/s" if "tflops" in matmul else matmul.get("error", "-")
    dirty = {True: " + uncommitted changes", False: "", None: ""}[record["dirty"]]
    torchao = f" · torchao {record['torchao']}" if record.get("torchao") else ""
    return (f"{record['date']} · {record['gpu'] or 'no GPU visible'}, driver {record['driver'] or '-'} · "
            f"commit {record['commit'] or 'unknown'}{dirty} · torch {record['torch'] or '-'}{torchao} · bf16 matmul {rate} · "
            f"{record['steps']} steps, median after {record['warmup']} warm-up")


def markdown_table(rows, columns):
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows]) + "\n"


def text_line(record):
    """'Text: 12M, 120M: `glob` (N tokens; validation `glob`, M tokens).' from the comparisons' text
    (records before it was kept have none: '')."""
    models = {}
    for c in record["comparisons"]:
        t = c.get("text")
        if t:
            what = (f"`{t['train']}` ({t['train_tokens']:,} tokens" if t["real"] else
                    f"random tokens ({t['train_tokens']:,}")
            what += f"; validation `{t['val']}`, {t['val_tokens']:,} tokens)" if t["val"] else ")"
            models.setdefault(what, []).append(c["model"])
    parts = [f"{', '.join(dict.fromkeys(m))}: {what}" for what, m in models.items()]
    return f"\nText: {'; '.join(parts)}.\n" if parts else ""


def markdown(record):
    return f"### {heading(record)}\n\n" + markdown_table(table_rows(record), COLUMNS) + text_line(record)


def plain_table(rows, columns=COLUMNS):
    cells = [columns] + rows
    widths = [max(len(row[i]) for row in cells) for i in range(len(columns))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in cells)


def gib_or_none(n):
    return None if n is None else round(n / 2**30, 3)


RECORD_RUN_KEYS = ("model", "side", "precision", "mode", "error", "steps", "ms_per_step", "tokens_per_s",
                   "flops_per_step", "mfu", "sm_mhz", "power_w", "memory_constant", "loss_last", "val_loss",
                   "skipped_steps")


def results_record(args, matmul, runs, comparisons):
    """The run as one results-file record (docs/BENCHMARKS.md, "The results file")."""
    versions = [r for r in runs if r.get("torch_version")]
    torchao = [r["torchao_version"] for r in runs if r.get("torchao_version")]
    record = {"kind": "train", "source": "bench/bench.py", **environment(),
              "torch": versions[0]["torch_version"] if versions else None,
              "torch_cuda": versions[0].get("torch_cuda") if versions else None,
              "torchao": torchao[0] if torchao else None,
              "matmul": {k: matmul[k] for k in ("tflops", "tflops_max", "n", "reps", "error") if k in matmul},
              "steps": args.steps, "warmup": args.warmup, "runs": [], "comparisons": comparisons}
    for r in runs:
        entry = {k: r.get(k) for k in RECORD_RUN_KEYS if k in r}
        entry.update(device_gib=gib_or_none(r.get("smi_bytes")), peak_allocated_gib=gib_or_none(r.get("peak_allocated")),
                     peak_reserved_gib=gib_or_none(r.get("peak_reserved")))
        record["runs"].append(entry)
    return record


def parse_args(argv):
    p = ArgumentParser(description="engine vs PyTorch, same GPU, same run (docs/BENCHMARKS.md)")
    p.add_argument("--models", default="12M,120M",
                   help="comma-separated: 12M means experiments/ANDREA-12M-TRAIN.json; a .json path is a config")
    p.add_argument("--precisions", default="bf16", help="engine precisions, comma-separated (fp32, tf32, bf16, "
                   "fp16, fp8; default bf16)")
    p.add_argument("--torch-modes", default="eager,compile,reduce-overhead",
                   help="PyTorch bf16 baselines, comma-separated: " + ", ".join(TORCH_MODES) +
                   " (max-autotune compiles for minutes)")
    p.add_argument("--torch-fp8-modes", default="reduce-overhead",
                   help="PyTorch fp8 (torchao float8) baselines of fp8 rows, comma-separated, same modes")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--warmup", type=int, default=10, help="steps left out of the timing median")
    p.add_argument("--last", type=int, default=20, help="steps whose mean train loss is compared")
    p.add_argument("--tol", type=float, default=0.02, help="relative loss tolerance")
    p.add_argument("--engine", default="build/microgpt_cuda")
    p.add_argument("--data", help="train shard glob (default: the config's, else known real text, else synthetic)")
    p.add_argument("--val", help="val shard glob to go with --data")
    p.add_argument("--loss-check", action="store_true", help="require real text; exit 1 unless every check passes")
    p.add_argument("--device", default="cuda", help="PyTorch device; cpu: a dry run of the plumbing")
    p.add_argument("--timeout", type=int, default=300, help="seconds per engine or PyTorch run")
    p.add_argument("--autotune-timeout", type=int, default=540, help="seconds for a max-autotune run")
    p.add_argument("--matmul-n", type=int, default=8192, help="size of the product measuring the bf16 rate")
    p.add_argument("--matmul-reps", type=int, default=30, help="timed launches of that product")
    p.add_argument("--out", default=os.environ.get("OUT") or os.path.join(BENCH_DIR, "out"))
    p.add_argument("--results", help=f"results file the run is appended to (default {RESULTS_FILE} with "
                   "--device cuda; a CPU dry run is not recorded unless this is given)")
    p.add_argument("--no-record", action="store_true", help="do not append the run to a results file")
    args = p.parse_args(argv)
    args.models = [m for m in args.models.split(",") if m]
    args.precisions = [x for x in args.precisions.split(",") if x]
    args.torch_modes = [x for x in args.torch_modes.split(",") if x]
    args.torch_fp8_modes = [x for x in args.torch_fp8_modes.split(",") if x]
    for prec in args.precisions:
        if prec not in PRECISIONS:
            raise BenchError(f"unknown precision '{prec}' ({', '.join(PRECISIONS)})")
    for mode in args.torch_modes + args.torch_fp8_modes:
        if mode not in TORCH_MODES:
            raise BenchError(f"unknown PyTorch mode '{mode}' ({', '.join(TORCH_MODES)})")
    if not args.models or not args.precisions or not args.torch_modes or not args.torch_fp8_modes:
        raise BenchError("--models, --precisions, --torch-modes and --torch-fp8-modes need at least one entry each")
    for flag, values in (("--models", args.models), ("--precisions", args.precisions),
                         ("--torch-modes", args.torch_modes), ("--torch-fp8-modes", args.torch_fp8_modes)):
        twice = [v for i, v in enumerate(values) if v in values[:i]]
        if twice:   # an engine row twice would run twice and share one comparison
            raise BenchError(f"{flag} names '{twice[0]}' twice")
    if not (0 < args.tol < math.inf):
        raise BenchError(f"--tol must be a positive number, got {args.tol}")
    if min(args.timeout, args.autotune_timeout, args.matmul_n, args.matmul_reps) < 1:
        raise BenchError("--timeout, --autotune-timeout, --matmul-n and --matmul-reps must be >= 1")
    if args.warmup < 0 or args.last < 1 or args.steps <= max(args.warmup, args.last - 1):
        raise BenchError("need --steps > --warmup and >= --last")
    args.engine = repo_path(args.engine)
    if args.no_record:
        args.results = None
    elif args.results is None and args.device.startswith("cuda"):
        args.results = RESULTS_FILE
    return args


def main(argv):
    try:
        args = parse_args(argv)
        os.makedirs(args.out, exist_ok=True)
        matmul = measure_matmul(args)
        print(f"bf16 matmul: {json.dumps(matmul)}", file=sys.stderr, flush=True)
        runs, comparisons = [], []
        for model in args.models:
            model_runs, model_comparisons = run_model(model, args, matmul.get("tflops"))
            runs += model_runs
            comparisons += model_comparisons
    except BenchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    record = results_record(args, matmul, runs, comparisons)
    with open(os.path.join(args.out, "bench.md"), "w") as f:
        f.write(markdown(record))
    with open(os.path.join(args.out, "bench.json"), "w") as f:
        json.dump({"record": record, "runs": runs}, f, indent=1)
    with open(os.path.join(args.out, "record.jsonl"), "w") as f:
        f.write(json.dumps(record, separators=(",", ":")) + "\n")
    if args.results:
        append_record(args.results, record)
        print(f"recorded in {args.results}", file=sys.stderr)
    failed = [r for r in runs if r.get("error")] + [c for c in comparisons if c["loss_check"] == "FAIL"]
    for r in failed:
        what = f"{r['model']} {run_label(r)}: {r['error']}" if "side" in r else \
            f"{r['model']} engine {r['precision']}: loss check FAIL {check_cell(r)}"
        print(what, file=sys.stderr)
    print(heading(record))
    print(plain_table(table_rows(record)))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
