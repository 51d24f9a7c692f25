"""Decode speed: the engine's --generate mode against transformers' generate, same GPU, same weights,
one run (docs/BENCHMARKS.md, "Decoding").

    python3 bench/decode_bench.py [--models 12M,120M] [--batches 1,8] [--prompt-tokens 128] [--new-tokens 256]
                                  [--reps 3] [--precision bf16] [--engine build/microgpt_cuda] [--no-hf]
                                  [--out DIR] [--results FILE]

For each model: a short training run of the engine writes a checkpoint (random but fixed weights;
decode speed does not depend on them); scripts/export-hf.py turns it into a transformers GPT-2
directory. Then, for each batch size, the same fixed random prompts are decoded greedily for
exactly --new-tokens tokens (no stop tokens) by

  * the engine: `ENGINE --generate --checkpoint PATH` (the model flags come from the checkpoint's
    sidecar), one process for all batch sizes, the requests of a batch sent as one JSON array
    (docs/DESIGN.md §5a);
  * transformers (bench/hf_decode.py, its own process): `generate` with its KV cache, bf16.

tokens/s = batch × new tokens / the wall time from sending the request to its last token (prefill
included), the median over --reps after one warm-up request of the same batch size. The table is
printed last; the run is appended as one JSON line to bench/results.jsonl. Exit status: 0 when
every run finished, 1 otherwise, 2 for bad input.
"""
import argparse
import json
import os
import queue
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

from bench import choose_data, engine_command, fmt, markdown_table, plain_table, run_overrides
from bench_common import REPO, BenchError, experiment_path, load_config, model_shape, repo_path
from microgpt.cli import ArgumentParser
from microgpt.inference import Generator, InferenceError
from results import RESULTS_FILE, append_record, environment

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
HF_SCRIPT = os.path.join(BENCH_DIR, "hf_decode.py")
EXPORT_SCRIPT = os.path.join(REPO, "scripts", "export-hf.py")
PROMPT_SEED = 2024   # the prompts are fixed: the same ids in every run and on both sides
# Target per (model, batch): engine tokens/s over transformers'.
TARGETS = {("120M", 1): 5.0}


class BatchGenerator(Generator):
    """The engine's --generate process (microgpt/inference.py's client) sent whole batches: the
    requests of a batch as one JSON array, every answer awaited, with a time limit, so a silent
    engine is an error rather than a hang."""

    def __init__(self, engine, ckpt):
        super().__init__(engine, ckpt)
        self.lines = queue.Queue()
        threading.Thread(target=self._read_stdout, daemon=True).start()

    def _read_stdout(self):
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put(None)   # end of output: the engine exited

    def generate(self, requests, timeout_s):
        """Send requests (one object on the line when there is one, else an array) and wait for every
        done record. Returns (seconds from sending to the last done, {id: done}, {id: [streamed
        tokens]})."""
        pending = {r["id"] for r in requests}
        done, streamed = {}, {r["id"]: [] for r in requests}
        t0 = time.perf_counter()
        try:
            self.proc.stdin.write(json.dumps(requests[0] if len(requests) == 1 else requests) + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            raise self._failure("stopped before taking the request") from None
        while pending:
            try:
                line = self.lines.get(timeout=max(0.0, t0 + timeout_s - time.perf_counter()))
            except queue.Empty:
                raise InferenceError(f"no answer within {timeout_s} s") from None
            if line is None:
                raise self._failure("stopped while answering")
            try:
                record = json.loads(line)
            except ValueError:
                continue   # not a protocol line
            rid = record.get("id") if isinstance(record, dict) else None
            if rid not in streamed:
                continue
            if "error" in record:
                raise InferenceError(f"the engine refused request {rid}: {record['error']}")
            if record.get("done"):
                done[rid] = record
                pending.discard(rid)
            elif "token" in record:
                streamed[rid].append(record["token"])
        return time.perf_counter() - t0, done, streamed


def prompts(batch, n_tokens, vocab_size):
    """batch fixed pseudo-random prompts of n_tokens ids each (the same for every run and side)."""
    rng = np.random.default_rng([PROMPT_SEED, batch])
    return rng.integers(0, vocab_size, size=(batch, n_tokens)).tolist()


def request(rid, prompt, max_tokens):
    """A greedy request that runs to max_tokens (no stop tokens)."""
    return {"id": rid, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "top_k": 0, "top_p": 1,
            "seed": 0, "stop": []}


def engine_decode(session, batch_prompts, args, batch):
    """Warm-up, then --reps timed requests of the whole batch: tokens/s per rep, the engine's own ms,
    and the tokens of the first rep's first sequence."""
    warm = [request(f"warm-{batch}-{i}", p, min(8, args.new_tokens)) for i, p in enumerate(batch_prompts)]
    session.generate(warm, args.timeout)
    rates, engine_ms, first = [], [], None
    for rep in range(args.reps):
        reqs = [request(f"b{batch}-r{rep}-{i}", p, args.new_tokens) for i, p in enumerate(batch_prompts)]
        seconds, done, streamed = session.generate(reqs, args.timeout)
        for r in reqs:
            tokens = done[r["id"]].get("tokens")
            if tokens != streamed[r["id"]] or len(tokens) != args.new_tokens:
                raise InferenceError(f"request {r['id']}: {len(streamed[r['id']])} tokens streamed, done "
                                     f"lists {len(tokens or [])}, {args.new_tokens} asked (reason "
                                     f"{done[r['id']].get('reason')})")
        rates.append(len(reqs) * args.new_tokens / seconds)
        engine_ms.append(max(d.get("ms", 0.0) for d in done.values()))
        first = first or done[reqs[0]["id"]]["tokens"]
    return {"tokens_per_s": statistics.median(rates), "tokens_per_s_reps": rates,
            "engine_ms": statistics.median(engine_ms), "tokens": first}


# -----------------------------------------------------------------------------
# the weights: a short training run of the engine, exported for transformers


def run_checked(cmd, what, log_prefix, timeout_s):
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, cwd=REPO)
    except OSError as e:
        raise BenchError(f"{what}: cannot start {cmd[0]}: {e.strerror}")
    except subprocess.TimeoutExpired:
        raise BenchError(f"{what}: timed out after {timeout_s} s")
    for suffix, text in ((".stdout", out.stdout), (".stderr", out.stderr)):
        with open(log_prefix + suffix, "w") as f:
            f.write(text)
    if out.returncode != 0:
        last = [line for line in out.stderr.splitlines() if line.strip()][-1:] or ["(no stderr)"]
        raise BenchError(f"{what}: exit {out.returncode}: {last[0][:200]}")
    return out.stdout


def train_checkpoint(cfg, shape, args, name, workdir):
    """A checkpoint from --train-steps steps of the engine (real text when there is some, else random
    tokens): the weights the two sides decode with."""
    data = dict(choose_data(cfg, argparse.Namespace(data=None, val=None, loss_check=False), shape), val=None)
    overrides = run_overrides(cfg, argparse.Namespace(steps=args.train_steps), args.precision, data)
    path = os.path.join(workdir, f"{name}.ckpt")
    run_checked(engine_command(cfg, overrides, args.engine) + ["--checkpoint", path], f"{name}: training",
                os.path.join(args.out, f"train-{name}"), args.timeout)
    if not os.path.exists(path):
        raise BenchError(f"{name}: the training run wrote no checkpoint at {path}")
    return path


# -----------------------------------------------------------------------------
# one model


def run_model(model, args, workdir):
    """One row per batch size: {"model", "batch", "engine": result or {"error"}, "hf": the same,
    "ratio", "greedy_agree", "targets"}."""
    cfg = load_config(experiment_path(model))
    model = cfg.get("name", model) if model.endswith(".json") else model
    shape = model_shape(cfg)
    if args.prompt_tokens + args.new_tokens > shape["seq_len"]:
        raise BenchError(f"{model}: --prompt-tokens + --new-tokens = {args.prompt_tokens + args.new_tokens} "
                         f"exceeds seq_len {shape['seq_len']}")
    batch_prompts = {b: prompts(b, args.prompt_tokens, shape["vocab_size"]) for b in args.batches}
    rows = {b: {"model": model, "batch": b, "engine": {}, "hf": {}} for b in args.batches}
    try:
        checkpoint = train_checkpoint(cfg, shape, args, model, workdir)
    except BenchError as e:
        checkpoint = None
        for row in rows.values():
            row["engine"] = row["hf"] = {"error": str(e)}
    if checkpoint:
        for b, result in engine_decode_all(checkpoint, batch_prompts, args).items():
            rows[b]["engine"] = result
        results = ({b: {"error": "not run (--no-hf)"} for b in rows} if args.no_hf
                   else hf_decode(checkpoint, batch_prompts, args, model, workdir))
        for b, result in results.items():
            rows[b]["hf"] = result
    for row in rows.values():
        compare(row)
    return list(rows.values())


def engine_decode_all(checkpoint, batch_prompts, args):
    """{batch: engine_decode's result, or {"error": why}}, all batch sizes in one engine process; once
    the engine has died, the batch sizes not yet run carry its error."""
    results = {}
    try:
        session = BatchGenerator(args.engine, checkpoint)   # the model flags come from the sidecar
    except InferenceError as e:
        return {b: {"error": str(e)} for b in batch_prompts}
    try:
        for b, batch in batch_prompts.items():
            try:
                results[b] = engine_decode(session, batch, args, b)
            except InferenceError as e:
                results[b] = {"error": str(e)}
                if session.proc.poll() is not None:
                    break
    finally:
        session.close()
    died = next((r["error"] for r in results.values() if "error" in r), None)
    return {b: results.get(b, {"error": died}) for b in batch_prompts}


def hf_decode(checkpoint, batch_prompts, args, model, workdir):
    """{batch: bench/hf_decode.py's result, or {"error": why}} for the exported checkpoint."""
    hf_dir = os.path.join(workdir, f"{model}-hf")
    prompt_file = os.path.join(workdir, f"{model}-prompts.json")
    with open(prompt_file, "w") as f:
        json.dump({str(b): p for b, p in batch_prompts.items()}, f)
    try:
        if not os.path.exists(EXPORT_SCRIPT):
            raise BenchError(f"{os.path.relpath(EXPORT_SCRIPT, REPO)} not found")
        run_checked([sys.executable, EXPORT_SCRIPT, checkpoint, hf_dir], f"{model}: export",
                    os.path.join(args.out, f"export-{model}"), args.timeout)
        stdout = run_checked([sys.executable, HF_SCRIPT, hf_dir, "--prompts", prompt_file, "--new-tokens",
                              str(args.new_tokens), "--reps", str(args.reps), "--device", args.device],
                             f"{model}: transformers", os.path.join(args.out, f"hf-{model}"), args.hf_timeout)
    except BenchError as e:
        return {b: {"error": str(e)} for b in batch_prompts}
    results = {}
    for line in stdout.splitlines():
        try:
            r = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(r, dict) and r.get("batch") in batch_prompts:
            results[r["batch"]] = r
    return {b: results.get(b, {"error": "no result from bench/hf_decode.py"}) for b in batch_prompts}


def common_prefix(a, b):
    n = 0
    for x, y in zip(a or [], b or []):
        if x != y:
            break
        n += 1
    return n


def compare(row):
    """The row's ratio, greedy agreement (how many leading tokens of the first sequence both sides
    chose alike: bf16 rounding may flip a near tie, after which the sequences differ) and target."""
    e, h = row["engine"], row["hf"]
    ok = "error" not in e and "error" not in h
    row["ratio"] = e["tokens_per_s"] / h["tokens_per_s"] if ok else None
    row["greedy_agree"] = common_prefix(e.get("tokens"), h.get("tokens")) if ok else None
    need = TARGETS.get((row["model"], row["batch"]))
    row["targets"] = {} if need is None or not ok else {f"tokens/s >= {need}x": (row["ratio"] >= need,
                                                                                 f"{row['ratio']:.2f}x")}


# -----------------------------------------------------------------------------
# report


COLUMNS = ["model", "batch", "engine tok/s", "transformers tok/s", "ratio", "greedy tokens alike", "targets"]


def heading(record):
    return (f"{record['date']} · {record['gpu'] or 'no GPU visible'}, driver {record['driver'] or '-'} · commit "
            f"{record['commit'] or 'unknown'} · transformers {record.get('transformers') or '-'} · "
            f"{record['precision']}, {record['prompt_tokens']} prompt + {record['new_tokens']} new tokens, greedy, "
            f"median of {record['reps']}")


def markdown(record):
    return f"### {heading(record)}\n\n" + markdown_table(table_rows(record), COLUMNS)


def table_rows(record):
    """One line per (model, batch) of a results record."""
    out = []
    new_tokens = record["new_tokens"]
    for r in record["rows"]:
        def side(res):
            return f"error: {res['error']}" if "error" in res else fmt(res.get("tokens_per_s"), ",.0f")
        goals = "; ".join(f"{k}: {'met' if ok else 'MISSED'} ({d})" for k, (ok, d) in r["targets"].items())
        agree = "-" if r["greedy_agree"] is None else f"{r['greedy_agree']}/{new_tokens}"
        out.append([r["model"], str(r["batch"]), side(r["engine"]), side(r["hf"]), fmt(r["ratio"], ".2f"), agree,
                    goals or "-"])
    return out


def results_record(args, rows, hf_versions):
    record = {"kind": "decode", "source": "bench/decode_bench.py", **environment(), **hf_versions,
              "precision": args.precision, "prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens,
              "reps": args.reps, "rows": []}
    for r in rows:
        entry = {"model": r["model"], "batch": r["batch"], "ratio": r["ratio"], "greedy_agree": r["greedy_agree"],
                 "targets": r["targets"]}
        for side in ("engine", "hf"):
            res = r[side]
            entry[side] = {k: res[k] for k in ("tokens_per_s", "tokens_per_s_reps", "engine_ms", "error") if k in res}
        record["rows"].append(entry)
    return record


def parse_args(argv):
    p = ArgumentParser(description="engine --generate vs transformers generate (docs/BENCHMARKS.md)")
    p.add_argument("--models", default="12M,120M", help="12M, 120M (shipped experiments) or config paths")
    p.add_argument("--batches", default="1,8", help="batch sizes, comma-separated")
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--reps", type=int, default=3, help="timed requests per batch size (median)")
    p.add_argument("--precision", default="bf16", help="the engine's train.precision for training and decoding")
    p.add_argument("--train-steps", type=int, default=20, help="steps of the run that makes the weights")
    p.add_argument("--engine", default="build/microgpt_cuda")
    p.add_argument("--no-hf", action="store_true", help="engine side only (no transformers run)")
    p.add_argument("--device", default="cuda", help="transformers' device")
    p.add_argument("--timeout", type=int, default=300, help="seconds per engine run, export or request")
    p.add_argument("--hf-timeout", type=int, default=600, help="seconds for one model's transformers run")
    p.add_argument("--out", default=os.path.join(os.environ.get("OUT") or os.path.join(BENCH_DIR, "out"), "decode"))
    p.add_argument("--results", help=f"results file the run is appended to (default {RESULTS_FILE} with the "
                   "CUDA engine; other runs are not recorded unless this is given)")
    p.add_argument("--no-record", action="store_true", help="do not append the run to a results file")
    args = p.parse_args(argv)
    args.models = [m for m in args.models.split(",") if m]
    try:
        args.batches = sorted({int(b) for b in args.batches.split(",") if b})
    except ValueError:
        raise BenchError(f"--batches {args.batches}: not a list of integers")
    if not args.models or not args.batches or min(args.batches) < 1:
        raise BenchError("--models and --batches need at least one entry each, batches >= 1")
    if args.prompt_tokens < 1 or args.new_tokens < 1 or args.reps < 1 or args.train_steps < 1:
        raise BenchError("--prompt-tokens, --new-tokens, --reps and --train-steps must be >= 1")
    args.engine = repo_path(args.engine)
    if args.no_record:
        args.results = None
    elif args.results is None and os.path.basename(args.engine) == "microgpt_cuda":
        args.results = RESULTS_FILE
    return args


def hf_versions():
    """torch's and transformers' versions where they are installed (None otherwise), without importing
    torch here."""
    code = ("import json, torch, transformers; print(json.dumps({'torch': torch.__version__, "
            "'torch_cuda': torch.version.cuda, 'transformers': transformers.__version__}))")
    try:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
        return json.loads(out.stdout) if out.returncode == 0 else {}
    except (OSError, subprocess.TimeoutExpired, json.JSONDecodeError):
        return {}


def main(argv):
    try:
        args = parse_args(argv)
        os.makedirs(args.out, exist_ok=True)
        rows = []
        with tempfile.TemporaryDirectory(prefix="andrea-decode-") as workdir:
            for model in args.models:
                rows += run_model(model, args, workdir)
    except BenchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    versions = {"torch": None, "torch_cuda": None, "transformers": None}
    versions.update({} if args.no_hf else hf_versions())
    record = results_record(args, rows, versions)
    with open(os.path.join(args.out, "record.jsonl"), "w") as f:
        f.write(json.dumps(record, separators=(",", ":")) + "\n")
    if args.results:
        append_record(args.results, record)
        print(f"recorded in {args.results}", file=sys.stderr)
    failed = [(r, side) for r in rows for side in ("engine", "hf")
              if "error" in r[side] and not (side == "hf" and args.no_hf)]
    for r, side in failed:
        print(f"{r['model']} batch {r['batch']} {side}: {r[side]['error']}", file=sys.stderr)
    print(heading(record))
    print(plain_table(table_rows(record), COLUMNS))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
