"""Data parallelism across processes (docs/DESIGN.md §17) on the CPU engine: ranks from torchrun's
environment variables, each rank's batches, the fixed-order reductions, the gathered checkpoint,
exact resume, signals reaching every rank, a dead rank, another rank count, the proxy's --ranks.

Tolerance. An N-rank run equals a 1-rank run with N x the accumulation except for the grouping of
the gradient sum ((g0+g1)+(g2+g3) against ((g0+g1)+g2)+g3, fp32): the first step's loss (same
weights, same windows, losses summed in the same global order) and its gradient norm are equal bit
for bit; after a few steps losses agree within REL_TOL and the state within STATE_TOL (measured:
about 1e-7 and 1e-6). Two runs on the same number of ranks are bit-identical.
"""
import contextlib
import json
import os
import selectors
import signal
import socket
import struct
import subprocess
import threading
import time

import numpy as np
import pytest

from engine_util import TIMING_KEYS, parse_stdout, rel_err, write_random_shards
from microgpt.checkpoint import read_checkpoint
from proxy_util import Proxy, ProxyFixtureDir, run_to_end

REL_TOL = 1e-5    # step losses and gradient norms, N ranks against 1 rank with N x accumulation
STATE_TOL = 1e-4  # weights and AdamW moments, same comparison, max |difference|
# d_model 64 makes about 103k parameters: two of the CPU engine's 65536-float norm chunks, so two
# ranks each own one and three ranks leave one rank an empty shard
MODEL = ["--model.n_layer", "2", "--model.d_model", "64", "--model.n_head", "4", "--model.seq_len", "16",
         "--model.vocab_size", "60", "--model.padded_vocab_size", "64"]


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    d = tmp_path_factory.mktemp("dist_shards")
    write_random_shards(d, "tr", 2, 20000, 60, seed=3)
    return str(d / "tr_*.bin")


def args(shards, ckpt, steps=6, accum=1, **extra):
    out = MODEL + ["--train.batch_size", "2", "--train.grad_accum", str(accum), "--train.steps", str(steps),
                   "--train.seed", "7", "--train.lr", "3e-3", "--train.warmup_steps", "0",
                   "--data.train", shards, "--checkpoint", str(ckpt)]
    for k, v in extra.items():
        out += [f"--{k.replace('_', '.', 1)}"] + ([] if v is True else [str(v)])
    return out


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stderr_of_all(procs, timeout=60):
    """Each process's stderr once it has ended; every one is killed if any does not end in time."""
    try:
        return [p.communicate(timeout=timeout)[1] for p in procs]
    finally:
        for p in procs:
            p.kill()


def connect_once_listening(port):
    """A connection to 127.0.0.1:port as soon as an engine listens there (within 20 s)."""
    deadline = time.monotonic() + 20
    while True:
        try:
            return socket.create_connection(("127.0.0.1", port))
        except ConnectionRefusedError:
            assert time.monotonic() < deadline
            time.sleep(0.05)


class Ranks:
    """N engine processes of one run, as a launcher starts them (ranks 0..started-1 of them: the
    others never come)."""

    def __init__(self, binary, argv, n, extra_env=None, started=None):
        port = str(free_port())
        self.procs = []
        for r in range(n if started is None else started):
            env = {**os.environ, "OMP_NUM_THREADS": "1", "WORLD_SIZE": str(n), "RANK": str(r),
                   "LOCAL_RANK": str(r), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, **(extra_env or {})}
            self.procs.append(subprocess.Popen([str(binary)] + argv, env=env, stdout=subprocess.PIPE,
                                               stderr=subprocess.PIPE, text=True))

    def finish(self, timeout=60):
        outs = [p.communicate(timeout=timeout) for p in self.procs]
        return [p.returncode for p in self.procs], parse_stdout(outs[0][0])[1], [e for _, e in outs]

    def wait_rank0_step(self, step, timeout=30):
        """Reads rank 0's stdout until the record of `step`; returns the lines read."""
        lines, deadline = [], time.monotonic() + timeout
        while time.monotonic() < deadline:
            line = self.procs[0].stdout.readline()
            assert line, "rank 0 ended early: " + self.procs[0].stderr.read()
            lines.append(line)
            if f'"step":{step},"loss"' in line:
                return lines
        raise AssertionError(f"no step {step} within {timeout}s")


def run_ranks(binary, argv, n):
    rcs, records, errs = Ranks(binary, argv, n).finish()
    assert rcs == [0] * n, errs
    return records


def run_single(binary, argv, env=None):
    p = subprocess.run([str(binary)] + argv, capture_output=True, text=True, timeout=60,
                       env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})
    assert p.returncode == 0, p.stderr
    return parse_stdout(p.stdout)[1]


def steps_of(records):
    return [r for r in records if "loss" in r]


def state(path):
    c = read_checkpoint(str(path))
    return c.step, np.array(c.params), np.array(c.m), np.array(c.v)


def test_world_size_one_is_the_single_process(cpu_binary, shards, tmp_path):
    run_single(cpu_binary, args(shards, tmp_path / "plain.ckpt", steps=3))
    run_single(cpu_binary, args(shards, tmp_path / "one.ckpt", steps=3), env={"WORLD_SIZE": "1", "RANK": "0"})
    assert (tmp_path / "plain.ckpt").read_bytes() == (tmp_path / "one.ckpt").read_bytes()


@pytest.mark.parametrize("ranks,accum", [(2, 1), (2, 2), (3, 1)])
def test_n_ranks_match_one_rank_with_n_times_the_accumulation(cpu_binary, shards, tmp_path, ranks, accum):
    one = steps_of(run_single(cpu_binary, args(shards, tmp_path / "one.ckpt", accum=ranks * accum)))
    many_records = run_ranks(cpu_binary, args(shards, tmp_path / "many.ckpt", accum=accum), ranks)
    many = steps_of(many_records)
    assert [r["step"] for r in many] == [r["step"] for r in one] == list(range(1, 7))
    # sharding: rank r's micro-batch j is micro-batch r*accum+j of the 1-rank run, so the first
    # step (same weights) has the same mean loss and gradient norm, bit for bit
    assert many[0]["loss"] == one[0]["loss"] and many[0]["grad_norm"] == one[0]["grad_norm"]
    assert all(m["tokens"] == o["tokens"] for m, o in zip(many, one))  # global batch: ranks x B x accum
    for m, o in zip(many, one):
        assert rel_err(m["loss"], o["loss"]) <= REL_TOL and rel_err(m["grad_norm"], o["grad_norm"]) <= REL_TOL
    # gathering: rank 0 wrote every rank's shard of the AdamW moments in its place
    s1, p1, m1, v1 = state(tmp_path / "one.ckpt")
    sn, pn, mn, vn = state(tmp_path / "many.ckpt")
    assert s1 == sn == 6
    for a, b in ((p1, pn), (m1, mn), (v1, vn)):
        assert np.max(np.abs(a - b)) <= STATE_TOL
    assert np.count_nonzero(vn[len(vn) // 2:]) > 0.9 * (len(vn) - len(vn) // 2)  # the last rank's shard


def test_batches_depend_on_the_rank(cpu_binary, shards, tmp_path):
    """The negative control of the bit-exact first step above: had rank 1 taken rank 0's windows,
    the 2-rank loss would be micro-batch 0's alone (the 1-rank, accumulation-1 loss)."""
    one = steps_of(run_single(cpu_binary, args(shards, tmp_path / "one.ckpt", steps=1, accum=2)))
    single0 = steps_of(run_single(cpu_binary, args(shards, tmp_path / "s0.ckpt", steps=1, accum=1)))
    two = steps_of(run_ranks(cpu_binary, args(shards, tmp_path / "two.ckpt", steps=1), 2))
    assert two[0]["loss"] == one[0]["loss"] != single0[0]["loss"]


def test_two_runs_on_two_ranks_are_identical(cpu_binary, shards, tmp_path):
    a = run_ranks(cpu_binary, args(shards, tmp_path / "a.ckpt", steps=4), 2)
    b = run_ranks(cpu_binary, args(shards, tmp_path / "b.ckpt", steps=4), 2)
    assert [r["step"] for r in steps_of(a)] == [1, 2, 3, 4]
    assert without_timing(steps_of(a)) == without_timing(steps_of(b))
    assert (tmp_path / "a.ckpt").read_bytes() == (tmp_path / "b.ckpt").read_bytes()


def without_timing(records):
    return [{k: v for k, v in r.items() if k not in TIMING_KEYS} for r in records]


@pytest.mark.parametrize("signalled", ["all", "rank1"])
def test_sigterm_stops_every_rank_and_resume_is_exact(cpu_binary, shards, tmp_path, signalled):
    # 200 steps: at 10, the 7 steps after the one waited for took milliseconds, and on a loaded
    # machine they were sometimes all done before the signal came (a run that finished)
    steps = 200
    run_ranks(cpu_binary, args(shards, tmp_path / "full.ckpt", steps=steps), 2)
    ckpt = tmp_path / "stopped.ckpt"
    ranks = Ranks(cpu_binary, args(shards, ckpt, steps=steps), 2)
    ranks.wait_rank0_step(3)
    for p in (ranks.procs if signalled == "all" else ranks.procs[1:]):
        p.send_signal(signal.SIGTERM)
    rcs, records, errs = ranks.finish()
    assert rcs == [0, 0], errs
    stopped_at = [e for e in records if e.get("event") == "exit"][0]
    assert stopped_at["reason"] == "signal" and stopped_at["step"] < steps
    assert [e["reason"] for e in records if e.get("event") == "checkpoint"] == ["signal"]
    run_ranks(cpu_binary, args(shards, ckpt, steps=steps, resume=True), 2)
    assert ckpt.read_bytes() == (tmp_path / "full.ckpt").read_bytes()


def test_a_killed_rank_ends_the_run_with_a_message(cpu_binary, shards, tmp_path):
    ranks = Ranks(cpu_binary, args(shards, tmp_path / "k.ckpt", steps=10**6, checkpoint_every=2), 2)
    ranks.wait_rank0_step(3)
    ranks.procs[1].kill()
    rcs, _, errs = ranks.finish(timeout=20)  # bounded: the lost connection is seen at the next step
    assert rcs[0] == 1 and rcs[1] == -signal.SIGKILL
    assert "error: rank 0: lost rank 1 (it exited" in errs[0]
    assert read_checkpoint(str(tmp_path / "k.ckpt")).step >= 2  # the last checkpoint is kept


def test_a_silent_rank_times_out(cpu_binary, shards, tmp_path):
    ranks = Ranks(cpu_binary, args(shards, tmp_path / "t.ckpt", steps=10**6), 2,
                  extra_env={"ANDREA_DIST_TIMEOUT_S": "2"})
    ranks.wait_rank0_step(2)
    ranks.procs[1].send_signal(signal.SIGSTOP)
    try:
        rc0 = ranks.procs[0].wait(timeout=20)
        err0 = ranks.procs[0].stderr.read()
    finally:
        ranks.procs[1].kill()
        ranks.procs[1].wait()
    assert rc0 == 1 and "lost rank 1 (no answer within ANDREA_DIST_TIMEOUT_S)" in err0


@pytest.mark.parametrize("before,after", [(2, 1), (2, 3), (1, 2)])
def test_resume_on_another_number_of_ranks(cpu_binary, shards, tmp_path, before, after):
    ckpt = tmp_path / "x.ckpt"
    first = args(shards, ckpt, steps=3)
    run_ranks(cpu_binary, first, before) if before > 1 else run_single(cpu_binary, first)
    again = args(shards, ckpt, steps=6, resume=True)
    records = run_ranks(cpu_binary, again, after) if after > 1 else run_single(cpu_binary, again)
    assert [r["step"] for r in steps_of(records)] == [4, 5, 6]
    assert read_checkpoint(str(ckpt)).step == 6 and np.all(np.isfinite(read_checkpoint(str(ckpt)).v))


def test_rank_environment_errors(cpu_binary, shards, tmp_path):
    bad = subprocess.run([str(cpu_binary)] + args(shards, tmp_path / "e.ckpt", steps=1), capture_output=True,
                         text=True, timeout=30, env={**os.environ, "WORLD_SIZE": "2", "RANK": "0"})
    assert bad.returncode == 2 and "error: WORLD_SIZE > 1 needs MASTER_ADDR and MASTER_PORT" in bad.stderr
    bad = subprocess.run([str(cpu_binary)] + args(shards, tmp_path / "e.ckpt", steps=1), capture_output=True,
                         text=True, timeout=30, env={**os.environ, "WORLD_SIZE": "2", "RANK": "2"})
    assert bad.returncode == 2 and "error: RANK 2 is not below WORLD_SIZE 2" in bad.stderr
    for timeout in ("5x", "inf", "0", "nan"):  # a typo was read as far as atof went: 5 s
        bad = subprocess.run([str(cpu_binary)] + args(shards, tmp_path / "e.ckpt", steps=1), capture_output=True,
                             text=True, timeout=30, env={**os.environ, "WORLD_SIZE": "2", "RANK": "0",
                                                         "ANDREA_DIST_TIMEOUT_S": timeout})
        assert bad.returncode == 2 and f"error: ANDREA_DIST_TIMEOUT_S={timeout} is not a positive" in bad.stderr


def test_dump_grads_with_ranks_is_refused_before_waiting_for_them(cpu_binary, shards, tmp_path):
    """--dump-grads in a shell where WORLD_SIZE=2 is left set: the refusal came only once every rank
    had connected, so a lone process waited ANDREA_DIST_TIMEOUT_S (300 s here) for a rank 1 nobody
    starts, then said it lost it and that "the last checkpoint is kept", exit 1. Refused at once."""
    argv = args(shards, tmp_path / "d.ckpt", steps=1) + ["--dump-grads", str(tmp_path / "g.bin")]
    bad = subprocess.run([str(cpu_binary)] + argv, capture_output=True, text=True, timeout=60,
                         env={**os.environ, "WORLD_SIZE": "2", "RANK": "0", "MASTER_ADDR": "127.0.0.1",
                              "MASTER_PORT": str(free_port()), "ANDREA_DIST_TIMEOUT_S": "300"})
    assert bad.returncode == 2, bad.stderr
    assert [l for l in bad.stderr.splitlines() if l.startswith("error:")] == [
        "error: --dump-grads is one process: unset WORLD_SIZE"], bad.stderr
    assert not (tmp_path / "g.bin").exists()


def test_rank_0_alone_names_the_rank_it_waits_for(cpu_binary, shards, tmp_path):
    env = {**os.environ, "WORLD_SIZE": "2", "RANK": "0", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(free_port()), "ANDREA_DIST_TIMEOUT_S": "1"}
    alone = subprocess.run([str(cpu_binary)] + args(shards, tmp_path / "a.ckpt", steps=1), capture_output=True,
                           text=True, timeout=30, env=env)
    assert alone.returncode == 1 and "error: rank 0: lost rank 1 (no answer within" in alone.stderr
    for port in ("0", "70000"):
        bad = subprocess.run([str(cpu_binary)] + args(shards, tmp_path / "a.ckpt", steps=1), capture_output=True,
                             text=True, timeout=30, env={**env, "MASTER_PORT": port})
        assert bad.returncode == 2 and f"error: MASTER_PORT={port} is not a TCP port" in bad.stderr


def test_a_stop_signal_while_the_ranks_connect_ends_every_rank(cpu_binary, shards, tmp_path):
    """Rank 2 never starts (it crashed at launch): rank 0 waits for it, rank 1 waits for rank 0.
    A stop signal (the proxy forwards Ctrl-C to all) ends them now, not after ANDREA_DIST_TIMEOUT_S:
    exit 0, the signal's exit event, nothing saved (nothing was trained)."""
    ckpt = tmp_path / "c.ckpt"
    ranks = Ranks(cpu_binary, args(shards, ckpt, steps=3), 3, started=2)
    assert "rank 1 of 3" in ranks.procs[1].stderr.readline()  # rank 1 is connected
    for p in reversed(ranks.procs):  # as the proxy sends it: rank 0 last
        p.send_signal(signal.SIGTERM)
    try:
        outs = [p.communicate(timeout=20) for p in ranks.procs]
    finally:
        for p in ranks.procs:
            p.kill()
    assert [p.returncode for p in ranks.procs] == [0, 0], [e for _, e in outs]
    assert parse_stdout(outs[0][0])[1][-1] == {"event": "exit", "step": 0, "reason": "signal"}
    assert not ckpt.exists()
    alone = subprocess.Popen([str(cpu_binary)] + args(shards, ckpt, steps=3), stderr=subprocess.PIPE, text=True,
                             env={**os.environ, "WORLD_SIZE": "2", "RANK": "1", "MASTER_ADDR": "127.0.0.1",
                                  "MASTER_PORT": str(free_port())}, stdout=subprocess.DEVNULL)
    time.sleep(0.5)  # connecting, again and again, to a rank 0 that is not there
    alone.send_signal(signal.SIGTERM)
    try:
        assert alone.wait(timeout=20) == 0, alone.stderr.read()
    finally:
        alone.kill()


# poll() that raises SIGTERM just before its first wait (rank 0's for connections): the signal lands
# after the engine last read its stop flag and before it sleeps, the one moment no EINTR can wake it
POLL_SIGNAL_SHIM = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <poll.h>
#include <signal.h>
int poll(struct pollfd* fds, nfds_t n, int timeout_ms) {
    static int raised;
    int (*real)(struct pollfd*, nfds_t, int) = (int (*)(struct pollfd*, nfds_t, int))dlsym(RTLD_NEXT, "poll");
    if (!raised) {
        raised = 1;
        raise(SIGTERM);
    }
    return real(fds, n, timeout_ms);
}
"""


def test_a_stop_signal_just_before_rank_0_waits_is_not_missed(cpu_binary, shards, tmp_path):
    """Rank 0 waits for a rank 1 that never comes; SIGTERM arrives between its test of the stop flag
    and its poll(). The wait must still end at the signal, not ANDREA_DIST_TIMEOUT_S (60 s) later."""
    shim = tmp_path / "poll_signal.so"
    (tmp_path / "poll_signal.c").write_text(POLL_SIGNAL_SHIM)
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(shim), str(tmp_path / "poll_signal.c"), "-ldl"], check=True)
    rank0 = subprocess.run([str(cpu_binary)] + args(shards, tmp_path / "p.ckpt", steps=1), capture_output=True,
                           text=True, timeout=30,
                           env={**os.environ, "LD_PRELOAD": str(shim), "WORLD_SIZE": "2", "RANK": "0",
                                "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
                                "ANDREA_DIST_TIMEOUT_S": "60"})
    assert rank0.returncode == 0 and "stopped by signal 15 before the first step" in rank0.stderr, rank0.stderr
    assert parse_stdout(rank0.stdout)[1][-1] == {"event": "exit", "step": 0, "reason": "signal"}


# fsync() that fails as a full disk does: the checkpoint's write fails after its bytes were taken
FSYNC_ENOSPC_SHIM = r"""
#include <errno.h>
int fsync(int fd) {
    (void)fd;
    errno = ENOSPC;
    return -1;
}
"""


def test_a_failed_last_checkpoint_fails_every_rank(cpu_binary, shards, tmp_path):
    """Rank 0's disk fills at the run's last checkpoint: rank 1 had sent its shards and, with no
    step after it, ended with exit 0 as if the run had finished well."""
    shim = tmp_path / "fsync_enospc.so"
    (tmp_path / "fsync_enospc.c").write_text(FSYNC_ENOSPC_SHIM)
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(shim), str(tmp_path / "fsync_enospc.c")], check=True)
    port = str(free_port())
    procs = [subprocess.Popen([str(cpu_binary)] + args(shards, tmp_path / "f.ckpt", steps=2), stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True,
                              env={**os.environ, "OMP_NUM_THREADS": "1", "WORLD_SIZE": "2", "RANK": str(r),
                                   "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "ANDREA_DIST_TIMEOUT_S": "60",
                                   **({"LD_PRELOAD": str(shim)} if r == 0 else {})})
             for r in range(2)]
    errs = stderr_of_all(procs)
    assert procs[0].returncode == 1 and "error: writing checkpoint" in errs[0], errs[0]
    assert procs[1].returncode == 1 and "error: rank 1: lost rank 0 (it exited" in errs[1], errs[1]
    assert not (tmp_path / "f.ckpt").exists()


@contextlib.contextmanager
def rank_1_facing_the_test(binary, argv, timeout_s):
    """Rank 1 of two, started with argv, whose MASTER_PORT the test holds: (rank 1's process, the
    test's end of its connection). Rank 1 is killed on the way out."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        env = {**os.environ, "WORLD_SIZE": "2", "RANK": "1", "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(server.getsockname()[1]), "ANDREA_DIST_TIMEOUT_S": str(timeout_s)}
        rank1 = subprocess.Popen([str(binary)] + argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                 text=True)
        try:
            conn, _ = server.accept()
            with conn:
                conn.settimeout(30)
                yield rank1, conn
        finally:
            rank1.kill()


@pytest.mark.parametrize("answer", [b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n" * 8,
                                    struct.pack("<4I", 0x414E4452, 0, 2, 0)])
def test_a_rank_refuses_a_master_that_is_not_rank_0(cpu_binary, shards, tmp_path, answer):
    """Something else listening on MASTER_PORT (here a web server's answer, or the greeting of a
    rank 0 of another build, "ANDR"): its bytes are no signal flags, the rank must not take them
    for a stop and exit 0. (A rank 0 of this build closes a rank of another build, and that rank
    refuses itself the same way on reading its greeting.)"""
    with rank_1_facing_the_test(cpu_binary, args(shards, tmp_path / "w.ckpt", steps=1), 5) as (rank1, conn):
        conn.sendall(answer)
        err = rank1.communicate(timeout=30)[1]
    assert rank1.returncode == 2 and "error: rank 1: MASTER_ADDR:MASTER_PORT" in err and "is not rank 0" in err
    assert "another ANDREA build" in err, err
    assert not (tmp_path / "w.ckpt").exists()


def start_rank(binary, argv, rank, world, port, timeout_s, stdout=subprocess.DEVNULL):
    """Rank `rank` of `world` whose rank 0 listens on 127.0.0.1:port; its stderr piped."""
    return subprocess.Popen([str(binary)] + argv, stdout=stdout, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1", "WORLD_SIZE": str(world), "RANK": str(rank),
                                 "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                                 "ANDREA_DIST_TIMEOUT_S": str(timeout_s)})


def rank0_greeted_by(cpu_binary, shards, ckpt, greeting, timeout_s):
    """Rank 0 of two, and a connection to its port that sends `greeting` (b"": nothing) and stays
    open until rank 0 has ended: rank 0's exit status and stderr."""
    port = free_port()
    rank0 = start_rank(cpu_binary, args(shards, ckpt, steps=1), 0, 2, port, timeout_s)
    try:
        with connect_once_listening(port) as peer:
            peer.sendall(greeting)
            err = rank0.communicate(timeout=60)[1]
    finally:
        rank0.kill()
    return rank0.returncode, err


def test_rank_0_alone_with_a_connection_that_never_greets_waits_for_rank_1(cpu_binary, shards, tmp_path):
    """Something connects to MASTER_PORT and says nothing, and rank 1 never comes: rank 0 closes the
    connection with a warning and names the rank it waited for, not "rank 0", itself."""
    rc, err = rank0_greeted_by(cpu_binary, shards, tmp_path / "g.ckpt", b"", timeout_s=2)
    assert rc == 1 and "error: rank 0: lost rank 1 (no answer within ANDREA_DIST_TIMEOUT_S)" in err, err
    warnings = [l for l in err.splitlines() if l.startswith("warning:")]
    assert len(warnings) == 1 and warnings[0].startswith(
        "warning: rank 0: closed a connection to MASTER_PORT from 127.0.0.1:"), err
    # its greeting window (half the timeout: 1 s) ends before rank 0's wait (2 s)
    assert "not a rank of this run: no whole greeting within 1 s (0 of a greeting's 32 bytes came)" in warnings[0], err
    assert "lost rank 0" not in err


def recv_exactly(sock, n):
    got = b""
    while len(got) < n:
        chunk = sock.recv(n - len(got))
        assert chunk, f"closed after {len(got)} of {n} bytes"
        got += chunk
    return got


GREETING_BYTES = 32  # DistHello: magic, rank, world, three CRCs, the engine's name in 8 bytes
# what strangers on MASTER_PORT send once rank 0 has greeted them: a web client's request, nothing,
# or the start of a rank's greeting (the magic and a rank) and then nothing more
STRAYS = {"garbage": b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", "nothing": b"",
          "part of a greeting": struct.pack("<2I", 0x414E4434, 1)}
STRAY_WHY = {"garbage": "another magic number (another program on the port, or a rank of another ANDREA build",
             "nothing": "its greeting was not all in when rank 0 stopped waiting for ranks (0 of a greeting's",
             "part of a greeting": "its greeting was not all in when rank 0 stopped waiting for ranks (8 of a"}


def strays_then_rank_1(binary, argv, kinds, timeout_s=10):
    """Rank 0 of two; a connection to its port for each of `kinds` (STRAYS), each greeted by rank 0
    before it sends its bytes and left open; then rank 1. Returns (exit statuses, rank 0's records,
    the ranks' stderr). Before rank 1 starts, rank 0 has taken the first stray."""
    port = free_port()
    procs = [start_rank(binary, argv, 0, 2, port, timeout_s, stdout=subprocess.PIPE)]
    with contextlib.ExitStack() as stack:
        try:
            strays = [stack.enter_context(connect_once_listening(port)) for _ in kinds]
            for i, (sock, kind) in enumerate(zip(strays, kinds)):
                sock.settimeout(30)
                if i == 0:
                    recv_exactly(sock, GREETING_BYTES)  # rank 0 took it (one at a time before, all at once now)
                sock.sendall(STRAYS[kind])
            procs.append(start_rank(binary, argv, 1, 2, port, timeout_s, stdout=subprocess.PIPE))
            outs = [p.communicate(timeout=60) for p in procs]
        finally:
            for p in procs:
                p.kill()
    return [p.returncode for p in procs], parse_stdout(outs[0][0])[1], [e for _, e in outs]


@pytest.mark.parametrize("kind", list(STRAYS))
def test_a_stray_connection_does_not_stop_the_ranks(cpu_binary, shards, tmp_path, kind):
    """Something that is no rank connects to MASTER_PORT while rank 0 waits (a port scanner, a
    health check, another program): rank 0 ended the run on its bytes ("not a rank", exit 2), or
    waited for its greeting until ANDREA_DIST_TIMEOUT_S (10 s here) and then stopped, accepting no
    rank meanwhile. Now it is closed with one warning and the run trains to its end."""
    rcs, records, errs = strays_then_rank_1(cpu_binary, args(shards, tmp_path / "s.ckpt", steps=3), [kind])
    assert rcs == [0, 0], errs
    assert [r["step"] for r in steps_of(records)] == [1, 2, 3]
    warnings = [l for l in errs[0].splitlines() if l.startswith("warning:")]
    assert len(warnings) == 1 and warnings[0].startswith(
        "warning: rank 0: closed a connection to MASTER_PORT from 127.0.0.1:"), errs[0]
    assert "not a rank of this run: " + STRAY_WHY[kind] in warnings[0], warnings
    assert "warning:" not in errs[1] and "error:" not in errs[0] + errs[1], errs


def test_several_stray_connections_at_once_do_not_hold_a_rank(cpu_binary, shards, tmp_path):
    """Silent connections, part greetings and garbage all at once: rank 0 read one greeting at a
    time, so a silent one ahead of rank 1 held it (and the others) until the timeout. Greetings are
    read side by side: rank 1 joins at once, long before the greeting window (10 s) of any of them."""
    kinds = ["nothing", "part of a greeting", "garbage", "nothing", "part of a greeting", "nothing", "garbage"]
    rcs, records, errs = strays_then_rank_1(cpu_binary, args(shards, tmp_path / "m.ckpt", steps=2), kinds,
                                            timeout_s=60)
    assert rcs == [0, 0], errs
    # No clock: each silent or half-greeted stray's warning says it was still pending when rank 1
    # had joined (STRAY_WHY), not that its window ended, so rank 1 waited for no window.
    assert [r["step"] for r in steps_of(records)] == [1, 2]
    warnings = [l for l in errs[0].splitlines() if l.startswith("warning:")]
    assert len(warnings) == len(kinds), errs[0]
    for kind in set(kinds):
        assert sum(STRAY_WHY[kind] in w for w in warnings) == kinds.count(kind), warnings


@contextlib.contextmanager
def silent_flood(port, k):
    """k connections to 127.0.0.1:port that never greet, for as long as the block runs, kept up as a
    flood keeps them: each that rank 0 closes is replaced at once, and each whose SYN the kernel
    dropped (connect() still under way after 0.2 s) is tried afresh, so that a place that frees in
    rank 0's listen queue is taken again within milliseconds."""
    stop = threading.Event()

    def connect(sel):
        s = socket.socket()
        s.setblocking(False)
        s.connect_ex(("127.0.0.1", port))
        sel.register(s, selectors.EVENT_READ | selectors.EVENT_WRITE, time.monotonic())

    def replace(sel, s):
        sel.unregister(s)
        s.close()
        connect(sel)

    def flood():
        with selectors.DefaultSelector() as sel:
            for _ in range(k):
                connect(sel)
            while not stop.is_set():
                for key, events in sel.select(timeout=0.01):
                    s = key.fileobj
                    if events & selectors.EVENT_WRITE:  # connected (or failed): now only read
                        sel.modify(s, selectors.EVENT_READ, None)
                    if events & selectors.EVENT_READ:
                        try:
                            if s.recv(256):
                                continue  # rank 0's greeting: still open
                        except BlockingIOError:
                            continue
                        except OSError:
                            pass
                        replace(sel, s)
                now = time.monotonic()
                for key in list(sel.get_map().values()):
                    if key.data is not None and now - key.data > 0.2:
                        replace(sel, key.fileobj)
            for key in list(sel.get_map().values()):
                key.fileobj.close()

    thread = threading.Thread(target=flood)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def rank_1_behind_a_flood(binary, argv, flood, timeout_s, settle):
    """Rank 0 of two on a free port; a silent_flood of `flood` connections, kept up from `settle`
    seconds before rank 1 starts until both ranks end. Returns (exit statuses, (stdout, stderr) of
    each rank)."""
    port = free_port()
    procs = [start_rank(binary, argv, 0, 2, port, timeout_s, stdout=subprocess.PIPE)]
    try:
        connect_once_listening(port).close()
        with silent_flood(port, flood):
            time.sleep(settle)  # every place taken
            procs.append(start_rank(binary, argv, 1, 2, port, timeout_s, stdout=subprocess.PIPE))
            outs = [p.communicate(timeout=90) for p in procs]
    finally:
        for p in procs:
            p.kill()
    return [p.returncode for p in procs], outs


def test_a_flood_of_silent_connections_keeps_no_rank_out(cpu_binary, shards, tmp_path):
    """80 connections that never greet, kept up while rank 1 connects: 32 hold rank 0's places
    until their greeting window (10 s) ends, the rest wait in its listen queue. That queue held
    WORLD_SIZE + 32 connections, so it stayed full, the kernel dropped rank 1's SYNs, and each of
    rank 1's retries (1, 2, 4, 8, 16 s apart) found it refilled: rank 1 was kept out until
    ANDREA_DIST_TIMEOUT_S (40 s here) and the run ended (exit 1 on both; rank 0 said rank 1 never
    answered). In a queue of the kernel's length rank 1 waits its turn behind the flood's 48 and
    joins after two windows, as DESIGN §17 says: a window per 32 connections ahead of it."""
    # 1 s: every place taken, the queue holding the rest
    rcs, outs = rank_1_behind_a_flood(cpu_binary, args(shards, tmp_path / "f.ckpt", steps=2), 80, 40, 1)
    # both ended 0: rank 1 joined within rank 0's 40 s wait (no bound on when: that is the machine's)
    assert rcs == [0, 0], [e[-600:] for _, e in outs]
    assert [r["step"] for r in steps_of(parse_stdout(outs[0][0])[1])] == [1, 2]


def test_a_short_timeout_still_lets_a_rank_past_silent_connections(cpu_binary, shards, tmp_path):
    """ANDREA_DIST_TIMEOUT_S 6 s: the greeting window was the timeout itself where that was shorter
    than 10 s, so 32 silent connections held every place until rank 0 gave up, and it blamed rank
    1, which sat in its queue. The window is now at most half the timeout: the strays are closed
    at 3 s and rank 1, queued behind them, joins within rank 0's 6 s."""
    rcs, outs = rank_1_behind_a_flood(cpu_binary, args(shards, tmp_path / "h.ckpt", steps=2), 40, 6, 0.5)
    assert rcs == [0, 0], [e[-600:] for _, e in outs]
    assert "no whole greeting within 3 s" in outs[0][1], outs[0][1][-600:]


def cpu_seconds(pid):
    """User plus system CPU time of process pid so far (/proc/PID/stat, fields 14 and 15)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_rank_0_out_of_descriptors_waits_without_spinning(cpu_binary, shards, tmp_path):
    """With no file descriptor free, accept() fails (EMFILE) while the connection stays queued, so
    the listener stays readable: rank 0 polled and failed again at once, a core busy until a
    greeting window freed a place or the timeout. It now says so once and tries again every
    DIST_STOP_POLL_MS. Measured as CPU time over 3 s of wall time: a spinning loop takes most of
    it, the waiting one a few milliseconds (0.5 s leaves room for a loaded machine); then, with
    descriptors again, rank 1 joins and the run trains."""
    import resource
    argv, port = args(shards, tmp_path / "e.ckpt", steps=2), free_port()
    procs = [start_rank(cpu_binary, argv, 0, 2, port, 60, stdout=subprocess.PIPE)]
    try:
        with connect_once_listening(port) as probe:
            probe.settimeout(30)
            recv_exactly(probe, GREETING_BYTES)  # accepted: rank 0 polls its listener again
            pid = procs[0].pid
            in_use = len(os.listdir(f"/proc/{pid}/fd"))
            # the soft limit alone: raising a hard limit back needs CAP_SYS_RESOURCE
            limits = resource.prlimit(pid, resource.RLIMIT_NOFILE)
            resource.prlimit(pid, resource.RLIMIT_NOFILE, (in_use, limits[1]))
            with socket.create_connection(("127.0.0.1", port)):  # queued; accept() cannot take it
                before = cpu_seconds(pid)
                time.sleep(3)
                spent = cpu_seconds(pid) - before
                resource.prlimit(pid, resource.RLIMIT_NOFILE, limits)
            assert spent < 0.5, f"rank 0 used {spent:.2f} s of CPU in 3 s waiting for a descriptor"
            procs.append(start_rank(cpu_binary, argv, 1, 2, port, 60, stdout=subprocess.PIPE))
            outs = [p.communicate(timeout=60) for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [0, 0], [e for _, e in outs]
    assert outs[0][1].count("cannot take a connection to MASTER_PORT now (Too many open files)") == 1, outs[0][1]


def test_a_stray_is_closed_after_the_greeting_window(cpu_binary, shards, tmp_path):
    """A connection that sends part of a greeting and stalls is closed when its greeting window ends
    (the window is half of ANDREA_DIST_TIMEOUT_S, 16 s here, where that is shorter than 10 s), while rank 0
    goes on waiting: three ranks, rank 1 joins 5 s after the stray (which renews rank 0's wait for the
    next rank, to 21 s), and rank 2 starts once the stray is closed (8 s: 13 s of margin for a loaded
    machine; the upper bound on when the warning comes is the machine's, so none is asserted)."""
    argv, port = args(shards, tmp_path / "w.ckpt", steps=2), free_port()
    procs = [start_rank(cpu_binary, argv, 0, 3, port, 16, stdout=subprocess.PIPE)]
    try:
        with connect_once_listening(port) as stray:
            stray.settimeout(30)
            recv_exactly(stray, GREETING_BYTES)
            stray.sendall(STRAYS["part of a greeting"])
            opened = time.monotonic()
            time.sleep(5)
            procs.append(start_rank(cpu_binary, argv, 1, 3, port, 16, stdout=subprocess.PIPE))
            warning = procs[0].stderr.readline()
            closed = time.monotonic()
            assert warning.startswith("warning: rank 0: closed a connection to MASTER_PORT from 127.0.0.1:"), warning
            assert "not a rank of this run: no whole greeting within 8 s (8 of a greeting's 32 bytes came)" in warning
            assert closed - opened > 7  # not before its window ended
            assert stray.recv(1) == b""  # closed by rank 0
            procs.append(start_rank(cpu_binary, argv, 2, 3, port, 16, stdout=subprocess.PIPE))
            outs = [p.communicate(timeout=60) for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [0, 0, 0], [e for _, e in outs]
    assert [r["step"] for r in steps_of(parse_stdout(outs[0][0])[1])] == [1, 2]


def test_a_rank_connecting_to_a_port_that_drops_it_keeps_the_timeout(cpu_binary, shards, tmp_path):
    """MASTER_PORT held by a listener whose backlog is full (a stuck process, a firewall): the
    kernel drops the rank's SYNs and a blocking connect() would wait out its retries (about two
    minutes), past ANDREA_DIST_TIMEOUT_S and deaf to a stop signal."""
    with socket.socket() as server, socket.socket() as filler:
        server.bind(("127.0.0.1", 0))
        server.listen(0)  # one queued connection fills it
        port = server.getsockname()[1]
        filler.connect(("127.0.0.1", port))
        env = {**os.environ, "WORLD_SIZE": "2", "RANK": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        argv = [str(cpu_binary)] + args(shards, tmp_path / "d.ckpt", steps=1)
        late = subprocess.Popen(argv, env={**env, "ANDREA_DIST_TIMEOUT_S": "2"}, stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, text=True)
        stopped = subprocess.Popen(argv, env={**env, "ANDREA_DIST_TIMEOUT_S": "300"}, stdout=subprocess.DEVNULL,
                                   stderr=subprocess.PIPE, text=True)
        try:
            time.sleep(0.5)  # connecting (a signal before that ends it the same way)
            stopped.send_signal(signal.SIGTERM)
            late_err = late.communicate(timeout=60)[1]
            stopped_err = stopped.communicate(timeout=60)[1]
        finally:
            late.kill()
            stopped.kill()
    assert late.returncode == 1 and "error: rank 1: lost rank 0 (cannot connect to MASTER_ADDR" in late_err, late_err
    assert stopped.returncode == 0 and "stopped by signal 15 before the first step" in stopped_err, stopped_err


def test_rank_0_names_a_rank_that_connects_twice(cpu_binary, shards, tmp_path):
    """A second process with RANK=1 was reported as "rank 1 of world 3 (expected a new rank of 3)".
    (Another program's bytes, once reported as "rank 1414012975 of world 825184340", are closed with
    a warning: test_a_stray_connection_does_not_stop_the_ranks.)"""
    argv = [str(cpu_binary)] + args(shards, tmp_path / "n.ckpt", steps=1)
    base = {**os.environ, "WORLD_SIZE": "3", "MASTER_ADDR": "127.0.0.1", "ANDREA_DIST_TIMEOUT_S": "30"}
    port = str(free_port())
    procs = [subprocess.Popen(argv, env={**base, "RANK": r, "MASTER_PORT": port}, stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True) for r in ("0", "1")]
    try:
        assert "rank 1 of 3" in procs[1].stderr.readline()  # rank 1 is connected
        procs.append(subprocess.Popen(argv, env={**base, "RANK": "1", "MASTER_PORT": port},
                                      stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
        errs = stderr_of_all(procs)
    finally:
        for p in procs:
            p.kill()
    assert procs[0].returncode == 2 and "error: rank 0: rank 1 connected twice" in errs[0], errs[0]


def test_rank_0_closes_a_rank_of_another_build_at_once(cpu_binary, shards, tmp_path):
    """A rank of an older build greets with 16 bytes (no state CRC) and the old magic: rank 0 read
    its 20-byte greeting and waited for the rest until ANDREA_DIST_TIMEOUT_S (300 s here), then
    called it a rank that sent no greeting. The magic is read first and changes with the greeting:
    closed at once with a warning (rank 0 waits on for its own ranks), and the other rank has rank
    0's greeting, whose magic tells it to refuse itself."""
    old = struct.pack("<4I", 0x414E4452, 1, 2, 0)  # "ANDR", rank 1 of 2, an argv CRC
    port = free_port()
    rank0 = start_rank(cpu_binary, args(shards, tmp_path / "o.ckpt", steps=1), 0, 2, port, 300)
    try:
        with connect_once_listening(port) as peer:
            peer.settimeout(30)
            peer.sendall(old)  # as a rank does: its greeting first, then it reads rank 0's
            warning = rank0.stderr.readline()  # at once, not after 300 s (pytest's timeout aside: 60 s below)
            greeting = recv_exactly(peer, GREETING_BYTES)  # still there for it after the close
            assert peer.recv(1) == b""
        assert rank0.poll() is None  # still waiting for rank 1
        rank0.send_signal(signal.SIGTERM)
        err = rank0.communicate(timeout=60)[1]
    finally:
        rank0.kill()
    assert warning.startswith("warning: rank 0: closed a connection to MASTER_PORT from 127.0.0.1:"), warning
    assert "a rank of another ANDREA build" in warning and "(16 of a greeting's 32 bytes came)" in warning, warning
    assert struct.unpack("<I", greeting[:4])[0] != 0x414E4452  # another magic than its own: it refuses itself
    assert rank0.returncode == 0 and "stopped by signal 15 before the first step" in err, err


@pytest.mark.parametrize("rank", [0x80000000, 0xFFFFFFFF])
def test_rank_0_refuses_a_greeting_with_a_rank_past_int(cpu_binary, shards, tmp_path, rank):
    """A peer that answers rank 0's own greeting with a rank number of 2^31 or more: taken as an int
    it was negative, so not "at or above WORLD_SIZE", and rank 0 looked it up in its table of
    sockets far out of bounds and died of SIGSEGV without a word. Refused, named, exit 2."""
    port = free_port()
    rank0 = start_rank(cpu_binary, args(shards, tmp_path / "r.ckpt", steps=1), 0, 2, port, 30)
    try:
        with connect_once_listening(port) as peer:
            peer.settimeout(30)
            greeting = bytearray(peer.recv(256))  # rank 0's own, one small send on loopback: all of it
            greeting[4:8] = struct.pack("<I", rank)
            peer.sendall(bytes(greeting))
            err = rank0.communicate(timeout=60)[1]
    finally:
        rank0.kill()
    assert rank0.returncode == 2, err
    assert f"error: rank 0: a connection announced rank {rank} of world 2 (expected a new rank of 2)" in err, err


def test_a_stop_signal_ends_the_wait_for_a_greeting_that_never_comes(cpu_binary, shards, tmp_path):
    """Something on the port that says nothing (a port scanner, another program): rank 0 waiting
    for its greeting, or rank 1 for the listener's, still ends at once on a stop signal, as every
    wait before the first step does, not ANDREA_DIST_TIMEOUT_S (300 s here) later."""
    argv = [str(cpu_binary)] + args(shards, tmp_path / "s.ckpt", steps=1)
    base = {**os.environ, "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "ANDREA_DIST_TIMEOUT_S": "300"}
    port = free_port()
    rank0 = subprocess.Popen(argv, env={**base, "RANK": "0", "MASTER_PORT": str(port)}, stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, text=True)
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        rank1 = subprocess.Popen(argv, env={**base, "RANK": "1", "MASTER_PORT": str(server.getsockname()[1])},
                                 stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        try:
            silent = connect_once_listening(port)
            conn, _ = server.accept()
            with silent, conn:
                for sock in (silent, conn):  # each engine has sent its greeting: it now waits for one
                    recv_exactly(sock, GREETING_BYTES)
                for p in (rank0, rank1):
                    p.send_signal(signal.SIGTERM)
                errs = [p.communicate(timeout=30)[1] for p in (rank0, rank1)]
        finally:
            rank0.kill()
            rank1.kill()
    assert [rank0.returncode, rank1.returncode] == [0, 0], errs
    assert all("stopped by signal 15 before the first step" in e for e in errs), errs


def test_ranks_started_with_other_flags_are_refused(cpu_binary, shards, tmp_path):
    """Rank 1 with another model: rank 0 would read its gradients as its own (a wrong step, then
    garbage read as signal flags) and write that checkpoint. Both refuse instead, writing nothing."""
    ckpt = tmp_path / "o.ckpt"
    port = str(free_port())
    argv = [args(shards, ckpt, steps=3), args(shards, ckpt, steps=3, model_d_model=128)]
    procs = [subprocess.Popen([str(cpu_binary)] + argv[r], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env={**os.environ, "OMP_NUM_THREADS": "1", "WORLD_SIZE": "2", "RANK": str(r),
                                              "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port,
                                              "ANDREA_DIST_TIMEOUT_S": "10"})
             for r in range(2)]
    errs = stderr_of_all(procs)
    assert [p.returncode for p in procs] == [2, 2], errs
    assert "error: rank 0: rank 1 was started with other flags than rank 0" in errs[0]
    assert "error: rank 1: rank 0 was started with other flags than rank 1" in errs[1]
    assert not ckpt.exists()


def test_ranks_resuming_from_other_files_are_refused(cpu_binary, shards, tmp_path):
    """The same flags, a relative --checkpoint, each rank in its own directory (as each node of a
    multi-node run reads its own disk): rank 1's copy is a step behind rank 0's. Each rank took its
    own weights and moments and the run trained on, every rank apart, without a word. Both refuse
    instead, and each checkpoint is left as it was."""
    dirs = [tmp_path / "node0", tmp_path / "node1"]
    for d, steps in zip(dirs, (3, 2)):
        d.mkdir()
        subprocess.run([str(cpu_binary)] + args(shards, "x.ckpt", steps=steps), cwd=d, check=True,
                       capture_output=True, timeout=60, env={**os.environ, "OMP_NUM_THREADS": "1"})
    before = [(d / "x.ckpt").read_bytes() for d in dirs]
    assert errors_of_ranks_in(cpu_binary, dirs, args(shards, "x.ckpt", steps=6, resume=True)) == [
        [f"error: rank {r}: rank 1 resumed from another checkpoint or sidecar than rank 0 (every rank must read the "
         "same files: a stale copy on another node?)"] for r in range(2)]
    assert [(d / "x.ckpt").read_bytes() for d in dirs] == before


def errors_of_ranks_in(binary, dirs, argv):
    """Rank r of len(dirs) started in dirs[r], each with argv: their error lines, once each has
    exited 2 (a refusal)."""
    port = str(free_port())
    procs = [subprocess.Popen([str(binary)] + argv, cwd=d, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env={**os.environ, "OMP_NUM_THREADS": "1", "WORLD_SIZE": str(len(dirs)), "RANK": str(r),
                                   "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "ANDREA_DIST_TIMEOUT_S": "30"})
             for r, d in enumerate(dirs)]
    errs = stderr_of_all(procs)
    assert [p.returncode for p in procs] == [2] * len(dirs), errs
    return [[line for line in err.splitlines() if line.startswith("error:")] for err in errs]


def test_ranks_training_on_other_data_are_refused(cpu_binary, tmp_path):
    """The same flags, a relative --data.train, each rank in its own directory (as each node of a
    multi-node run reads its own disk): rank 1's shards are another copy (re-tokenized, a partial
    sync). The greeting compared the flags and the resumed state, not the data: rank 1 drew its
    micro-batches from its own shards, and the run went on, exit 0, its batches no run's on one
    rank. Both refuse instead, before training."""
    dirs = [tmp_path / "node0", tmp_path / "node1"]
    for seed, d in enumerate(dirs, start=3):
        write_random_shards(d / "data", "tr", 2, 20000, 60, seed=seed)
    assert errors_of_ranks_in(cpu_binary, dirs, args("data/tr_*.bin", "x.ckpt", steps=2)) == [
        [f"error: rank {r}: rank 1 trains on other data than rank 0 (the same data flags name other shards on its "
         "disk: a stale or partial copy on another node?)"] for r in range(2)]
    assert not any((d / "x.ckpt").exists() for d in dirs)


def test_a_rank_refuses_a_rank_0_of_the_other_engine(cpu_binary, shards, tmp_path):
    """Rank 0 runs the CUDA engine, rank 1 the CPU engine, with the same flags (a node without a
    GPU, a launcher that picks the engine per node). Here rank 0 is played by a socket: it echoes
    rank 1's greeting as rank 0's, naming the cuda engine where the greeting has an engine, then
    says what the CUDA engine says next: the stop flags, then its 128-byte NCCL id. The greeting
    named no engine, so rank 1 took it; it then read the id's bytes as a stop signal and exited 0,
    "stopped by signal ..." (the other way round, both ranks waited for each other until
    ANDREA_DIST_TIMEOUT_S, then called the other silent). Refused at the greeting instead."""
    with rank_1_facing_the_test(cpu_binary, args(shards, tmp_path / "m.ckpt", steps=1), 30) as (rank1, conn):
        reply = bytearray(conn.recv(256))  # one small send on loopback: the whole greeting
        reply[4:8] = struct.pack("<I", 0)
        if len(reply) > 24:  # the engine's name follows the data fingerprint
            reply[24:] = b"cuda".ljust(len(reply) - 24, b"\0")
        conn.sendall(bytes(reply))
        try:
            conn.recv(4)  # rank 1's stop flags
            conn.sendall(struct.pack("<i", 0) + bytes(range(7, 7 + 128)))  # none; the NCCL id
        except OSError:
            pass  # rank 1 has refused and gone
        err = rank1.communicate(timeout=60)[1]
    assert rank1.returncode == 2, err
    errors = [l for l in err.splitlines() if l.startswith("error:")]
    assert errors == ["error: rank 1: rank 0 runs the cuda engine, this rank the cpu engine (every rank must run "
                      "the same engine)"], err


# --------------------------------------------------------------------------------------------------
# the proxy's --ranks

def test_proxy_runs_two_ranks_and_stops_them_together(cpu_binary, tmp_path):
    d = ProxyFixtureDir(tmp_path)
    cfg = d.config(steps=10**6)
    p = Proxy.start(cfg, d.run_dir, cpu_binary, "--ranks", "2", "--no-server")
    p.wait_state(lambda s: s.get("step", 0) >= 3)
    assert p.stop(timeout=30) == 0, p.describe()
    state = d.state()
    assert state["status"] == "stopped" and state["checkpoint_step"] == state["step"]
    assert any(line.startswith("rank 1: ") for line in p.err)  # the other rank's messages, prefixed
    p2, rc = run_to_end(d.config(steps=state["step"] + 2), d.run_dir, cpu_binary, "--ranks", "2", "--no-server")
    assert rc == 0 and d.state()["status"] == "finished", p2.describe()


def test_proxy_marks_the_run_crashed_when_a_rank_dies(cpu_binary, tmp_path):
    d = ProxyFixtureDir(tmp_path)
    p = Proxy.start(d.config(steps=10**6), d.run_dir, cpu_binary, "--ranks", "2", "--no-server")
    p.wait_state(lambda s: s.get("step", 0) >= 2)
    rank0 = d.state()["pid"]
    peers = subprocess.run(["pgrep", "-P", str(p.proc.pid)], capture_output=True, text=True).stdout.split()
    victim = next(int(pid) for pid in peers if int(pid) != rank0)
    os.kill(victim, signal.SIGKILL)
    assert p.wait(timeout=30) != 0, p.describe()
    state = d.state()
    assert state["status"] == "crashed" and "lost rank 1" in state["message"]


def test_a_stop_reaches_a_rank_that_was_sigstopped(cpu_binary, tmp_path, monkeypatch):
    """A rank stopped by SIGSTOP (a debugger, an operator's kill -STOP) held the SIGTERM the proxy
    forwarded pending, and every other rank waited for it in the step's agreement until
    ANDREA_DIST_TIMEOUT_S (120 s here; 600 by default): the run ended crashed instead of stopped.
    The proxy follows a stop with SIGCONT, as a shell's kill does for a stopped job."""
    monkeypatch.setenv("ANDREA_DIST_TIMEOUT_S", "120")
    d = ProxyFixtureDir(tmp_path)
    p = Proxy.start(d.config(steps=10**6), d.run_dir, cpu_binary, "--ranks", "2", "--no-server")
    victim = None
    try:
        p.wait_state(lambda s: s.get("step", 0) >= 2)
        rank0 = d.state()["pid"]
        peers = subprocess.run(["pgrep", "-P", str(p.proc.pid)], capture_output=True, text=True).stdout.split()
        victim = next(int(pid) for pid in peers if int(pid) != rank0)
        os.kill(victim, signal.SIGSTOP)
        assert p.stop(timeout=30) == 0, p.describe()
        state = d.state()
        assert state["status"] == "stopped" and state["checkpoint_step"] == state["step"], state
    finally:
        p.kill()
        if victim is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(victim, signal.SIGKILL)


def test_proxy_ends_the_run_when_a_rank_dies_before_connecting(cpu_binary, tmp_path, monkeypatch):
    """Rank 1 fails at launch: rank 0 would wait for it until ANDREA_DIST_TIMEOUT_S (600 s by
    default; 120 s here, beyond the test's 60 s); the proxy sees the rank end and stops rank 0, and
    the run is crashed, naming rank 1."""
    monkeypatch.setenv("ANDREA_DIST_TIMEOUT_S", "120")
    engine = tmp_path / "engine.sh"
    engine.write_text(f'#!/bin/sh\nif [ "$RANK" = 1 ]; then echo "error: no GPU for rank 1" >&2; exit 1; fi\n'
                      f'exec {cpu_binary} "$@"\n')
    engine.chmod(0o755)
    d = ProxyFixtureDir(tmp_path)
    p, rc = run_to_end(d.config(steps=10**6), d.run_dir, engine, "--ranks", "2", "--no-server", timeout=60)
    assert rc == 1, p.describe()
    assert d.state()["status"] == "crashed" and "rank 1 ended with exit code 1" in d.state()["message"]


def test_proxy_with_one_rank_ignores_the_rank_variables_it_inherits(cpu_binary, tmp_path, monkeypatch):
    """WORLD_SIZE left in the shell (a manual 2-rank test, a job allocation): the proxy starts its
    ranks itself (--ranks, default 1), so its one engine must not wait for a rank 1 nobody starts."""
    for key, value in {"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(free_port()), "ANDREA_DIST_TIMEOUT_S": "5"}.items():
        monkeypatch.setenv(key, value)
    d = ProxyFixtureDir(tmp_path)
    p, rc = run_to_end(d.config(steps=12), d.run_dir, cpu_binary, "--no-server", timeout=60)
    assert rc == 0 and d.state()["status"] == "finished", p.describe()


# --------------------------------------------------------------------------------------------------
# GPUs (NCCL): marked gpu, skipped unless two GPUs and build/microgpt_cuda (scripts/multi-gpu-check.sh)

def gpu_count():
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return 0
    return sum(line.startswith("GPU ") for line in out.splitlines())


@pytest.fixture
def two_gpus():
    from engine_util import CUDA_BINARY
    if gpu_count() < 2:
        pytest.skip("needs two GPUs (nvidia-smi -L)")
    if not CUDA_BINARY.exists():
        pytest.skip(f"{CUDA_BINARY} not built (make cuda)")
    return CUDA_BINARY


GPU_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
GPU_REL_TOL = 1e-4  # fp32 on the GPU: the engine's own sums and NCCL's ring order differ from one rank's


@pytest.mark.gpu
def test_two_gpus_match_one_gpu_with_twice_the_accumulation(two_gpus, shards, tmp_path):
    one = steps_of(run_single(two_gpus, args(shards, tmp_path / "one.ckpt", accum=2)))
    rcs, records, errs = Ranks(two_gpus, args(shards, tmp_path / "two.ckpt"), 2, GPU_ENV).finish(timeout=300)
    assert rcs == [0, 0], errs
    two = steps_of(records)
    assert [r["step"] for r in two] == [r["step"] for r in one] == list(range(1, 7))
    for a, b in zip(two, one):
        assert rel_err(a["loss"], b["loss"]) <= GPU_REL_TOL and rel_err(a["grad_norm"], b["grad_norm"]) <= GPU_REL_TOL
    assert "NCCL_ALGO=Ring NCCL_PROTO=Simple NCCL_NVLS_ENABLE=0" in errs[0]


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["fp32", "fp8"])
def test_two_gpus_resume_exactly_after_sigterm(two_gpus, shards, tmp_path, precision):
    """fp8: the delayed-scaling histories are shared by the ranks after every step, so rank 0's
    sidecar resumes both (docs/DESIGN.md §18). 400 steps: the tiny model's steps take about a
    millisecond on a GPU and rank 0's stdout is read behind them, so the SIGTERM after step 3's
    record must still come before the last step (else the test compares two finished runs)."""
    steps = 400
    rcs, _, errs = Ranks(two_gpus, args(shards, tmp_path / "full.ckpt", steps=steps, train_precision=precision), 2,
                         GPU_ENV).finish(300)
    assert rcs == [0, 0], errs
    ckpt = tmp_path / "stopped.ckpt"
    ranks = Ranks(two_gpus, args(shards, ckpt, steps=steps, train_precision=precision), 2, GPU_ENV)
    ranks.wait_rank0_step(3, timeout=300)
    for p in ranks.procs:
        p.send_signal(signal.SIGTERM)
    rcs, records, errs = ranks.finish(timeout=300)
    assert rcs == [0, 0], errs
    stopped_at = [e for e in records if e.get("event") == "exit"][0]
    assert stopped_at["reason"] == "signal" and stopped_at["step"] < steps, stopped_at
    rcs, _, errs = Ranks(two_gpus, args(shards, ckpt, steps=steps, resume=True, train_precision=precision), 2,
                         GPU_ENV).finish(300)
    assert rcs == [0, 0], errs
    assert not any("no fp8 scale history" in e for e in errs), errs
    assert ckpt.read_bytes() == (tmp_path / "full.ckpt").read_bytes()
    sidecars = [json.loads((tmp_path / name).read_text()) for name in ("stopped.ckpt.json", "full.ckpt.json")]
    assert sidecars[0].get("fp8_history") == sidecars[1].get("fp8_history")
    assert ("fp8_history" in sidecars[0]) == (precision == "fp8")


@pytest.mark.gpu
def test_a_killed_gpu_rank_ends_the_run(two_gpus, shards, tmp_path):
    ranks = Ranks(two_gpus, args(shards, tmp_path / "k.ckpt", steps=10**6), 2,
                  {**GPU_ENV, "ANDREA_DIST_TIMEOUT_S": "30"})
    ranks.wait_rank0_step(3, timeout=300)
    ranks.procs[1].kill()
    rcs, _, errs = ranks.finish(timeout=120)
    assert rcs[0] != 0 and "error: rank 0:" in errs[0]


def test_rank_environments_of_the_proxy(monkeypatch):
    from microgpt.supervisor import rank_environments
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("NCCL_NVLS_ENABLE", raising=False)
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("ANDREA_DIST_TIMEOUT_S", "9")
    one = rank_environments(1, "build/microgpt_cuda")  # one rank: the environment less the rank variables
    assert len(one) == 1 and "WORLD_SIZE" not in one[0] and one[0]["ANDREA_DIST_TIMEOUT_S"] == "9"
    envs = rank_environments(4, "build/microgpt_cuda")
    assert [(e["RANK"], e["LOCAL_RANK"], e["WORLD_SIZE"]) for e in envs] == [(str(r), str(r), "4") for r in range(4)]
    assert len({e["MASTER_PORT"] for e in envs}) == 1 and envs[0]["MASTER_ADDR"] == "127.0.0.1"
    assert all(e["NCCL_NVLS_ENABLE"] == "0" and e["NVSHMEM_DISABLE_NVLS"] == "1"
               and e["TORCH_SYMM_MEM_DISABLE_MULTICAST"] == "1" for e in envs)
    assert "OMP_NUM_THREADS" not in envs[0]  # the GPU engine's host threads are left alone
    cpu = rank_environments(2, "build/microgpt_cpu")
    assert cpu[0]["OMP_NUM_THREADS"] == str(max(1, (os.cpu_count() or 1) // 2))
