"""The engine binaries and what they publish about themselves (docs/DESIGN.md §3, §4): which one to
run, its flag table (`--flags-json`), a config's resolved settings (`--print-config`) and the
parameter layout (`--layout-json`). Python asks the engine instead of restating these facts."""
import json
import os
import subprocess
import sys

from microgpt.files import unique_keys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENGINES = {"cuda": os.path.join(ROOT, "build", "microgpt_cuda"),
           "cpu": os.path.join(ROOT, "build", "microgpt_cpu")}


class EngineChoiceError(RuntimeError):
    pass


class EngineQueryError(RuntimeError):
    """The engine refused the question (its last `error:` line is the message)."""


def gpu_visible():
    """True if `nvidia-smi -L` runs and lists a GPU (the driver sees one)."""
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return out.returncode == 0 and "GPU" in out.stdout


def is_built(path):
    return os.path.isfile(path) and os.access(path, os.X_OK)


def choose_engine(requested, gpu, engines=ENGINES):
    """The engine binary for --engine `requested` (None: not given) -> (path, warning or None).
    Not given: the CUDA engine if it is built and a GPU is visible, else the CPU engine with a
    warning. Asked for by name: that engine or an EngineChoiceError, never a silent substitute."""
    cuda, cpu = engines["cuda"], engines["cpu"]
    warning = None
    if requested == "cuda" or (requested is None and gpu and is_built(cuda)):
        if not is_built(cuda):
            raise EngineChoiceError(f"--engine cuda: {cuda} is not built; run `make` (it needs nvcc)")
        if not gpu:
            raise EngineChoiceError("--engine cuda: no GPU visible (`nvidia-smi -L` lists none); "
                                    "use --engine cpu")
        return cuda, None
    if requested is None:
        why = "no GPU visible (`nvidia-smi -L` lists none)" if not gpu else f"{cuda} is not built"
        warning = (f"{why}: running the CPU engine {cpu} (slow); --engine cuda forces the GPU "
                   "engine")
    if not is_built(cpu):
        raise EngineChoiceError(f"{cpu} is not built; run `make`")
    return cpu, warning


def select_engine(requested):
    """choose_engine for --engine `requested` with the GPU probed; its warning (the CPU engine was
    chosen because no GPU or GPU engine is there) printed as one line on stderr."""
    engine, warning = choose_engine(requested, requested != "cpu" and gpu_visible())
    if warning:
        print(f"warning: {warning}", file=sys.stderr, flush=True)
    return engine


# The largest integer an engine takes as a flag's value or a --generate request's field (BIG in
# microgpt/host/config.h, INT_MAX in generate.h).
ENGINE_INT_MAX = 2**31 - 1

# How the tools read an engine's stdout and stderr: as UTF-8, a byte that is none (a path's, as the
# file system spells it, in an error line) replaced, so it is never a UnicodeDecodeError traceback.
ENGINE_TEXT = {"text": True, "encoding": "utf-8", "errors": "replace"}


def query(engine, args):
    """Run `ENGINE ARGS` (a question answered with one JSON document on stdout) -> the document."""
    try:
        res = subprocess.run([engine, *args], capture_output=True, timeout=60, **ENGINE_TEXT)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise EngineQueryError(f"cannot run {engine} ({getattr(e, 'strerror', None) or e}); "
                               "build it with `make`") from None
    if res.returncode != 0:
        last = [ln for ln in res.stderr.splitlines() if ln.strip()][-1:] or [f"exit code {res.returncode}"]
        raise EngineQueryError(last[0].removeprefix("error: "))
    try:
        return json.loads(res.stdout, object_pairs_hook=unique_keys)
    except ValueError as e:
        raise EngineQueryError(f"{engine} {' '.join(args)} did not print JSON ({e})") from None


def engine_flags(engine):
    """`ENGINE --flags-json` -> {name: flag}. Raises EngineChoiceError if the engine can't say."""
    try:
        return {f["name"]: f for f in query(engine, ["--flags-json"])["flags"]}
    except (EngineQueryError, KeyError, TypeError) as e:
        raise EngineChoiceError(f"{engine} --flags-json did not give its flag table ({e}); "
                                "rebuild it with `make`") from None


def param_layout(engine, flag_args):
    """`ENGINE FLAGS --layout-json` -> {"n_params": N, "tensors": [{name, shape, offset, decay}]}:
    the flat parameter vector (which is also the checkpoint's order) for these model flags."""
    return query(engine, [*flag_args, "--layout-json"])


def resolved_settings(engine, flag_args):
    """`ENGINE FLAGS --print-config` -> {flag: value}, the engine's defaults applied."""
    return query(engine, [*flag_args, "--print-config"])
