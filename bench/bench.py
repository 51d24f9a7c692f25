"""Side-by-side benchmark: the CUDA engine against PyTorch on the same GPU, same model, same run (SPEC §9).

    python3 bench/bench.py [--models 12M,120M] [--precisions bf16,fp32] [--steps 200] [--out DIR]
    python3 bench/bench.py --loss-check [--data GLOB --val GLOB]

For each model and engine precision it runs build/microgpt_cuda, then the PyTorch baseline
(bench/torch_gpt.py: bf16 autocast + torch.compile for bf16/fp16/fp8 rows, fp32 eager with TF32 for
fp32 rows), each in its own process, and reports median ms/step after warm-up, tokens/s, device
memory, the engine/PyTorch throughput ratio, the targets, and whether both reached the same loss.
Method and column meanings: docs/BENCHMARKS.md. A failing engine is reported in its row; the
PyTorch side still runs. Exit status: 0 when every run finished and every loss check passed.
"""
import argparse
import datetime
import json
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
from microgpt.shards import write_shard

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
TORCH_SCRIPT = os.path.join(BENCH_DIR, "torch_gpt.py")

# Real text the loss check may use when neither --data nor the config's data.train has shards.
FALLBACK_DATA = [("data/megachat/megachat_train_*.bin", "data/megachat/megachat_val_*.bin"),
                 ("data/shakespeare/shakespeare_train_*.bin", "data/shakespeare/shakespeare_val_*.bin")]

# Issue targets: (model, precisions) -> minimum engine/PyTorch tokens/s ratio; tf32 rows (the engine's
# fp32 storage with TF32 products, as PyTorch's fp32 baseline): >= 1.0. Strict fp32 rows have no target.
SPEED_TARGETS = {("120M", "bf16"): 1.25, ("120M", "fp16"): 1.25, ("12M", "bf16"): 5.0, ("12M", "fp16"): 5.0}
MEMORY_TARGET_MODELS = {"120M"}   # engine device memory <= PyTorch-compiled peak, constant over the run


def torch_mode(precision):
    """The PyTorch baseline an engine precision is compared against."""
    return "fp32" if precision in ("fp32", "tf32") else "bf16"


# -----------------------------------------------------------------------------
# device memory as nvidia-smi sees it: the same measure for both processes


def smi_query(fields):
    try:
        out = subprocess.run(["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader,nounits",
                              "-i", os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]],
                             capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


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
    return {"version": start.get("torch"), "compiled": start.get("compiled"), "steps": len(steps), "ms_per_step": ms, "tokens_per_s": tokens_per_step / (ms / 1000.0),
            "loss_last": statistics.fmean(r["loss"] for r in steps[-last:]), "val_loss": val[-1] if val else None,
            "device_memory": max(dev) if dev else None, "memory_constant": len(set(dev)) == 1 if dev else None,
            "plan_bytes": plan, "peak_allocated": tmem.get("peak_allocated"),
            "peak_reserved": tmem.get("peak_reserved"),
            "skipped_steps": sum(1 for r in steps if r.get("skipped"))}


def run_side(name, cmd, args, tokens_per_step):
    status, records, (smi_bytes, sm_mhz, power_w) = run_logged(cmd, os.path.join(args.out, name), args.timeout)
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
    """The config as engine flags (DESIGN.md: flags are the dotted config keys). Sampling, polish and
    periodic checkpoints are left out: they are not what is being measured."""
    flags = config_flags(cfg)
    flags.pop("data.val", None)
    flags.update(overrides)
    flags.update({"sample.every": 0, "checkpoint.every": 0})
    return [engine] + flag_args(flags)


def torch_command(config_path, overrides, mode, device):
    cmd = [sys.executable, TORCH_SCRIPT, config_path, "--precision", mode, "--device", device,
           "--val", overrides.get("data.val", "")]
    if device == "cpu":
        cmd.append("--no-compile")   # a CPU dry run checks the plumbing, not PyTorch's compiler
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
    """Real text when any can be found (--data, the config's data, known fallbacks), else synthetic."""
    if args.data:
        if not shard_paths(args.data):
            raise BenchError(f"no shards match --data {args.data}")
        return {"train": args.data, "val": args.val or None, "real": True}
    candidates = [(cfg.get("data", {}).get("train"), cfg.get("data", {}).get("val"))] + FALLBACK_DATA
    for train, val in candidates:
        if train and shard_paths(train):
            return {"train": train, "val": val if val and shard_paths(val) else None, "real": True}
    if args.loss_check:
        raise BenchError("the loss check needs real text shards: none found, give --data GLOB")
    return synthetic_data(shape["vocab_size"])


# -----------------------------------------------------------------------------
# one row: engine vs PyTorch for one model and precision


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


def targets(model, precision, engine, torch_res):
    """Each issue target that applies to the row: {name: (met, detail)}."""
    out = {}
    if engine.get("error") or torch_res.get("error"):
        return out
    ratio = engine["tokens_per_s"] / torch_res["tokens_per_s"]
    need = 1.0 if precision == "tf32" else SPEED_TARGETS.get((model, precision))
    if need is not None:
        out[f"tokens/s >= {need}x"] = (ratio >= need, f"{ratio:.2f}x")
    if model in MEMORY_TARGET_MODELS and precision not in ("fp32", "tf32"):
        e_mem, t_mem = engine["smi_bytes"], torch_res["smi_bytes"]
        if e_mem is not None and t_mem is not None:
            out["memory <= PyTorch"] = (e_mem <= t_mem, f"{gib(e_mem)} vs {gib(t_mem)} GiB")
        if engine["memory_constant"] is not None:
            out["memory constant"] = (engine["memory_constant"], "device_memory first == last")
    return out


def run_model(model, args, torch_cache):
    """model: a shipped name (12M -> experiments/ANDREA-12M-TRAIN.json) or a config path."""
    config_path = experiment_path(model)
    cfg = load_config(config_path)
    model = cfg.get("name", model) if model.endswith(".json") else model
    shape, t = model_shape(cfg), train_settings(cfg)
    tokens_per_step = t["batch_size"] * shape["seq_len"] * t["grad_accum"]
    data = choose_data(cfg, args, shape)
    print(f"{model}: data {data['train']} ({'real' if data['real'] else 'synthetic'})", file=sys.stderr)
    rows = []
    for precision in args.precisions:
        overrides = run_overrides(cfg, args, precision, data)
        engine = run_side(f"engine-{model}-{precision}", engine_command(cfg, overrides, args.engine),
                          args, tokens_per_step)
        mode = torch_mode(precision)
        if (model, mode) not in torch_cache:
            torch_cache[(model, mode)] = run_side(f"torch-{model}-{mode}",
                                                  torch_command(config_path, overrides, mode, args.device),
                                                  args, tokens_per_step)
        torch_res = torch_cache[(model, mode)]
        check, diffs = loss_check(engine, torch_res, args.tol, data["real"])
        rows.append({"model": model, "precision": precision, "torch_mode": mode, "data": data,
                     "engine": engine, "torch": torch_res, "loss_check": check, "loss_diffs": diffs,
                     "targets": targets(model, precision, engine, torch_res)})
    return rows


# -----------------------------------------------------------------------------
# report


def gib(n):
    return "-" if n is None else f"{n / 2**30:.2f}"


def fmt(x, spec):
    return "-" if x is None else format(x, spec)


COLUMNS = ["model", "prec", "engine ms", "engine tok/s", "engine GiB", "torch", "torch ms", "torch tok/s",
           "torch GiB", "torch peak alloc/resv GiB", "ratio", "SM MHz e/t", "W e/t", "loss e/t", "loss check",
           "targets"]


def table_row(r):
    e, t = r["engine"], r["torch"]
    ratio = None if e.get("error") or t.get("error") else e["tokens_per_s"] / t["tokens_per_s"]
    torch_name = {"bf16": "bf16 autocast", "fp32": "fp32/tf32"}[r["torch_mode"]]
    torch_name += {True: ", compiled", False: ", eager"}.get(t.get("compiled"), "")
    goals = "; ".join(f"{k}: {'met' if ok else 'MISSED'} ({d})" for k, (ok, d) in r["targets"].items())

    def side(res, key, spec):
        return f"error: {res['error']}" if res.get("error") and key == "ms_per_step" else fmt(res.get(key), spec)

    return [r["model"], r["precision"], side(e, "ms_per_step", ".2f"), fmt(e.get("tokens_per_s"), ",.0f"),
            gib(e.get("smi_bytes")), torch_name, side(t, "ms_per_step", ".2f"), fmt(t.get("tokens_per_s"), ",.0f"),
            gib(t.get("smi_bytes")), f"{gib(t.get('peak_allocated'))}/{gib(t.get('peak_reserved'))}",
            fmt(ratio, ".2f"), f"{fmt(e.get('sm_mhz'), '.0f')}/{fmt(t.get('sm_mhz'), '.0f')}",
            f"{fmt(e.get('power_w'), '.0f')}/{fmt(t.get('power_w'), '.0f')}",
            f"{fmt(e.get('loss_last'), '.3f')}/{fmt(t.get('loss_last'), '.3f')}",
            check_cell(r), goals or "-"]


def check_cell(r):
    """e.g. 'PASS (train 0.12%, val 0.30%)'"""
    diffs = ", ".join(f"{k} {100 * d:.2f}%" for k, d in (r["loss_diffs"] or {}).items())
    return f"{r['loss_check']} ({diffs})" if diffs else r["loss_check"]


def markdown(rows, meta):
    lines = [f"### {meta['date']} · {meta['gpu']} · commit {meta['commit']} · torch {meta['torch']} · "
             f"{meta['steps']} steps, median after {meta['warmup']} warm-up",
             "", "| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(table_row(r)) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def plain_table(rows):
    cells = [COLUMNS] + [table_row(r) for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(COLUMNS))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in cells)


def source_commit():
    """The commit measured: ANDREA_COMMIT when set (a tree copied to the GPU machine of this workplace
    has no git metadata, or stale metadata), else git's; "unknown" rather than a guess."""
    if os.environ.get("ANDREA_COMMIT"):
        return os.environ["ANDREA_COMMIT"]
    git = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
    return git.stdout.strip() if git.returncode == 0 else "unknown"


def run_meta(args, rows):
    versions = [r["torch"].get("version") for r in rows if r["torch"].get("version")]
    return {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "gpu": smi_query("name,driver_version") or "no GPU visible",
            "commit": source_commit(),
            "torch": versions[0] if versions else "unknown", "steps": args.steps, "warmup": args.warmup}


def parse_args(argv):
    p = argparse.ArgumentParser(description="engine vs PyTorch, same GPU, same run (docs/BENCHMARKS.md)")
    p.add_argument("--models", default="12M,120M",
                   help="comma-separated: 12M means experiments/ANDREA-12M-TRAIN.json; a .json path is a config")
    p.add_argument("--precisions", default=None, help="engine precisions, comma-separated (default bf16,fp32; "
                   "with --loss-check: bf16)")
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
    p.add_argument("--out", default=os.environ.get("OUT") or os.path.join(BENCH_DIR, "out"))
    args = p.parse_args(argv)
    args.models = [m for m in args.models.split(",") if m]
    args.precisions = (args.precisions or ("bf16" if args.loss_check else "bf16,tf32,fp32")).split(",")
    for prec in args.precisions:
        if prec not in ("fp32", "tf32", "bf16", "fp16", "fp8"):
            raise BenchError(f"unknown precision '{prec}' (fp32, tf32, bf16, fp16, fp8)")
    if args.warmup < 0 or args.last < 1 or args.steps <= max(args.warmup, args.last - 1):
        raise BenchError("need --steps > --warmup and >= --last")
    args.engine = repo_path(args.engine)
    return args


def main(argv):
    try:
        args = parse_args(argv)
        os.makedirs(args.out, exist_ok=True)
        rows, torch_cache = [], {}
        for model in args.models:
            rows += run_model(model, args, torch_cache)
    except BenchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    meta = run_meta(args, rows)
    md = markdown(rows, meta)
    with open(os.path.join(args.out, "bench.md"), "w") as f:
        f.write(md)
    with open(os.path.join(args.out, "bench.json"), "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    print(md.splitlines()[0][4:])
    print(plain_table(rows))
    failed = [r for r in rows if r["engine"]["error"] or r["torch"]["error"] or r["loss_check"] == "FAIL"]
    for r in failed:
        print(f"{r['model']} {r['precision']}: engine: {r['engine']['error'] or 'ok'}; "
              f"torch: {r['torch']['error'] or 'ok'}; loss check: {r['loss_check']}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
