"""Helpers for the proxy and dashboard tests: tiny experiment configs on Markov-chain shards, and the
proxy run as a user runs it (a subprocess of microgpt/training_proxy.py) with ways to wait on it.

    d = ProxyFixtureDir(tmp_path)
    cfg = d.config(steps=10**6)
    p = Proxy.start(cfg, d.run_dir, engine_binary)
    p.wait_state(lambda s: s.get("step", 0) >= 20)
    p.proc.send_signal(signal.SIGTERM); assert p.wait() == 0
"""
import functools
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

from engine_util import REPO, python_env, write_shard

PROXY = REPO / "microgpt" / "training_proxy.py"
ARTIFACTS = REPO / "test-artifacts"

VOCAB = 64  # GPT-2 ids below 64 are single printable characters: prompts "A" (32), "B" (33) fit
NAME = "tiny"


@functools.lru_cache(maxsize=None)
def markov_tokens(n, seed):
    """A first-order Markov chain with 4 successors per token: learnable (loss falls from ln 64 to
    about 1.2 nats) but never to zero, so the curve looks like real training."""
    rng = np.random.default_rng(1234)  # the chain itself is fixed; seed picks the walk
    succ = rng.integers(0, VOCAB, size=(VOCAB, 4))
    prob = rng.dirichlet(np.ones(4), size=VOCAB)
    cum = np.cumsum(prob, axis=1)
    u = np.random.default_rng(seed).random(n)
    out = np.empty(n, dtype=np.uint16)
    t = 0
    for i in range(n):
        t = succ[t, min(3, int(np.searchsorted(cum[t], u[i])))]
        out[i] = t
    return out


def proxy_command(config, run_dir, engine_binary, *extra):
    """The command line of the proxy on `config` with the given engine and run directory."""
    return [sys.executable, str(PROXY), str(config), "--engine-binary", str(engine_binary), "--run-dir", str(run_dir),
            *map(str, extra)]


class ProxyFixtureDir:
    """A temporary experiment: shards, a config file, a run directory."""

    def __init__(self, root):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.run_dir = self.root / "run"
        self.train = self.root / "markov_train.bin"
        self.val = self.root / "markov_val.bin"
        if not self.train.exists():
            write_shard(self.train, markov_tokens(20000, seed=1))
            write_shard(self.val, markov_tokens(4000, seed=2))

    def config(self, steps, name=NAME, file="cfg.json", **sections):
        """Write a tiny config (2 layers, d 32, 2 heads, seq 32, batch 2); sections override/extend."""
        cfg = {"name": name,
               "model": {"n_layer": 2, "d_model": 32, "n_head": 2, "seq_len": 32, "vocab_size": VOCAB},
               "train": {"batch_size": 2, "steps": steps, "lr": 3e-3, "min_lr": 3e-4,
                         "warmup_steps": 10, "seed": 1, "schedule": "constant"},
               "data": {"train": str(self.train), "val": str(self.val)},
               "eval": {"every": 10, "batches": 2},
               "checkpoint": {"every": 10}}
        for key, value in sections.items():
            if value is None:
                cfg.pop(key, None)
            elif isinstance(value, dict) and isinstance(cfg.get(key), dict):
                cfg[key] = {**cfg[key], **value}
            else:
                cfg[key] = value
        path = self.root / file
        path.write_text(json.dumps(cfg, indent=1))
        return path

    def path(self, suffix, name=NAME):
        return self.run_dir / f"{name}{suffix}"

    def state(self, name=NAME):
        return json.loads(self.path(".state.json", name).read_text())

    def loss(self, name=NAME):
        with open(self.path(".loss.json", name)) as f:
            return json.load(f)


def live_train(records):
    return [r for r in records if r["live"] and "loss" in r]


def live_val(records):
    return [r for r in records if r["live"] and "val_loss" in r]


def proxy_env():
    # One OpenMP thread: the tiny model gains nothing from two, and a shared 2-core machine makes
    # spinning OpenMP threads very slow.
    return python_env(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")


class Proxy:
    """microgpt/training_proxy.py as a subprocess; its stdout is collected line by line."""

    def __init__(self, proc, run_dir):
        self.proc, self.run_dir = proc, Path(run_dir)
        self.out, self.err = [], []
        self._threads = [threading.Thread(target=self._read, args=(proc.stdout, self.out), daemon=True),
                         threading.Thread(target=self._read, args=(proc.stderr, self.err), daemon=True)]
        for t in self._threads:
            t.start()

    @classmethod
    def start(cls, config, run_dir, engine_binary, *extra):
        cmd = proxy_command(config, run_dir, engine_binary, "--port", "0", *extra)
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env=proxy_env())
        return cls(proc, run_dir)

    @staticmethod
    def _read(stream, sink):
        for line in stream:
            sink.append(line)

    def describe(self):
        return (f"rc={self.proc.poll()}\n--- proxy stdout ---\n{''.join(self.out)[-3000:]}"
                f"\n--- stderr ---\n{''.join(self.err)[-3000:]}")

    def wait_output(self, pattern, timeout=30):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in list(self.out):
                m = re.search(pattern, line)
                if m:
                    return m
            if self.proc.poll() is not None and not any(t.is_alive() for t in self._threads):
                break
            time.sleep(0.02)
        raise AssertionError(f"no output matching {pattern!r}\n{self.describe()}")

    def url_and_token(self):
        m = self.wait_output(r"dashboard: (http://\S+/)\?token=(\S+)")
        return m.group(1), m.group(2)

    def state(self):
        for name in os.listdir(self.run_dir):
            if name.endswith(".state.json"):
                try:
                    return json.loads((self.run_dir / name).read_text())
                except ValueError:
                    return {}
        return {}

    def wait_state(self, pred, timeout=60):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            st = self.state() if self.run_dir.exists() else {}
            if st and pred(st):
                return st
            if self.proc.poll() is not None:
                st = self.state()
                if st and pred(st):
                    return st
                raise AssertionError(f"proxy exited before the state was reached\n{self.describe()}")
            time.sleep(0.05)
        raise AssertionError(f"state not reached in {timeout}s: {self.state()}\n{self.describe()}")

    def wait(self, timeout=60):
        try:
            rc = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise AssertionError(f"proxy did not exit within {timeout}s\n{self.describe()}")
        for t in self._threads:
            t.join(timeout=5)
        return rc

    def stop(self, timeout=60):
        """SIGTERM, as a user's kill would; returns the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.wait(timeout)

    def kill(self):
        if self.proc.poll() is None:
            st = self.state()
            self.proc.kill()
            if st.get("pid"):  # never leave an engine behind
                try:
                    os.kill(st["pid"], signal.SIGKILL)
                except ProcessLookupError:
                    pass
        self.wait()


def run_to_end(config, run_dir, engine_binary, *extra, timeout=120):
    p = Proxy.start(config, run_dir, engine_binary, *extra)
    return p, p.wait(timeout)
