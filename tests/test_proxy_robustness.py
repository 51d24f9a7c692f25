"""The proxy under damage and faults: a damaged loss log anywhere, a proxy killed with SIGKILL, a full
disk, stale or damaged run files, hostile inputs (docs/PROXY.md, "When things go wrong")."""
import contextlib
import errno
import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest

from proxy_util import REPO, Proxy, ProxyFixtureDir, live_train, proxy_command, proxy_env, run_to_end

from microgpt import engines, loss_log, supervisor, terminal
from microgpt.checkpoint import checkpoint_step


@pytest.fixture
def exp(tmp_path):
    return ProxyFixtureDir(tmp_path)


def error_lines(p):
    return [line for line in p.err if line.startswith("error")]


def assert_no_train_step_missing(records):
    steps = [r["step"] for r in live_train(records)]
    assert steps == list(range(1, len(steps) + 1)), steps


# ---------------------------------------------------------------------------------------------------
# .loss.json: every record checked at start


def test_a_damaged_record_far_from_the_end_is_refused(tmp_path):
    """A crash only tears the end; damage in the body (here 5000 records before it) is someone
    else's doing and must be refused, not appended to."""
    path = tmp_path / "x.loss.json"
    log = loss_log.LossLog(str(path))
    log.append([{"step": i, "loss": 1.0 / i} for i in range(1, 5001)])
    log.close()
    data = path.read_bytes()
    damaged = data.replace(b'{"live":1,"step":10,"loss":0.1}', b'{"live":1,"step":10,"loss":0.1#')
    assert damaged != data and len(damaged) == len(data)
    path.write_bytes(damaged)
    with pytest.raises(loss_log.LossLogError, match=r"line 11 is not a complete record.*not at the end"):
        loss_log.LossLog(str(path))
    assert path.read_bytes() == damaged


@pytest.mark.parametrize("damage", [
    lambda line: line[:-2] + b',"x":}' + line[-1:],                  # invalid JSON, layout intact
    lambda line: line[:-1] + b'{"live":1,"step":0},',                  # two records on one line
    lambda line: line[:-2] + b'\0' + line[-1:],                       # a NUL byte
], ids=["json", "two-records", "nul"])
def test_every_kind_of_body_damage_is_found(tmp_path, damage):
    path = tmp_path / "x.loss.json"
    log = loss_log.LossLog(str(path))
    log.append([{"step": i, "loss": 1.0} for i in range(1, 20001)])
    log.close()
    lines = path.read_bytes().split(b"\n")
    lines[3] = damage(lines[3])  # record 3, far before the last batch
    path.write_bytes(b"\n".join(lines))
    with pytest.raises(loss_log.LossLogError, match="line 4 is not a complete record"):
        loss_log.LossLog(str(path))


def test_a_hand_edited_flag_is_rewritten_and_said(tmp_path):
    """Valid JSON outside the layout (here a "live" flag of 7) is a hand edit: rewritten, reported."""
    path = tmp_path / "x.loss.json"
    log = loss_log.LossLog(str(path))
    log.append([{"step": i, "loss": 1.0} for i in range(1, 20001)])
    log.close()
    path.write_bytes(path.read_bytes().replace(b'{"live":1,"step":3,', b'{"live":7,"step":3,'))
    log = loss_log.LossLog(str(path))
    assert "rewrote" in log.message and log.record(2) == {"live": 1, "step": 3, "loss": 1.0}
    log.close()


def test_the_proxy_refuses_a_damaged_log_with_one_line(exp, cpu_binary):
    cfg = exp.config(steps=20)
    p, rc = run_to_end(cfg, exp.run_dir, cpu_binary, "--no-server")
    assert rc == 0, p.describe()
    path = exp.path(".loss.json")
    damaged = path.read_bytes().replace(b'"step":3,', b'"step":3#', 1)
    path.write_bytes(damaged)
    p, rc = run_to_end(exp.config(steps=40), exp.run_dir, cpu_binary, "--no-server")
    assert rc == 2 and len(error_lines(p)) == 1 and "not at the end" in error_lines(p)[0], p.describe()
    assert "Traceback" not in "".join(p.err)
    assert path.read_bytes() == damaged and checkpoint_step(exp.path(".ckpt")) == 20


@pytest.mark.parametrize("field, value", [("seg", b"null"), ("step", b'"20"'), ("elapsed", b'"x"')])
def test_a_record_whose_numbers_are_not_numbers_is_refused_with_one_line(exp, cpu_binary, field, value):
    """A hand-edited last record of valid JSON whose seg, step or elapsed is no number: "seg":null
    was a TypeError traceback at start, a string step a proxy failure after the engine had trained
    (and checkpointed) steps whose records superseded nothing."""
    p, rc = run_to_end(exp.config(steps=20), exp.run_dir, cpu_binary, "--no-server")
    assert rc == 0, p.describe()
    path = exp.path(".loss.json")
    data = path.read_bytes()
    last = data.rindex(b'{"live":1,')
    damaged = data[:last] + re.sub(b'"%s":[^,}]+' % field.encode(), b'"%s":%s' % (field.encode(), value),
                                   data[last:], count=1)
    assert damaged != data
    path.write_bytes(damaged)
    p, rc = run_to_end(exp.config(steps=40), exp.run_dir, cpu_binary, "--no-server")
    assert rc == 2 and len(error_lines(p)) == 1, p.describe()
    assert "is no number" in error_lines(p)[0] and "Traceback" not in "".join(p.err), p.describe()
    assert path.read_bytes() == damaged and checkpoint_step(exp.path(".ckpt")) == 20


# ---------------------------------------------------------------------------------------------------
# records reach the disk before a checkpoint gets past them


def test_records_are_on_disk_when_the_checkpoint_is_announced(exp, cpu_binary):
    """The state says checkpoint_step s only once the records up to s are on disk: a proxy killed
    with SIGKILL right then (its engine too) loses nothing the next run does not repeat."""
    cfg = exp.config(steps=10**6, checkpoint={"every": 25}, eval={"every": 0})
    for kill in range(3):
        p = Proxy.start(cfg, exp.run_dir, cpu_binary, "--no-server")
        seen = None
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # poll fast: the proxy's own flush timer is 0.25 s
            st = p.state() if exp.path(".state.json").exists() else {}
            if st.get("status") == "running" and (st.get("checkpoint_step") or 0) >= 25 * (kill + 2):
                seen = st["checkpoint_step"]
                break
            time.sleep(0.002)
        assert seen, p.describe()
        p.kill()
        steps = [r["step"] for r in live_train(exp.loss())]
        assert steps[-1] >= seen, (seen, steps[-5:])
    p = Proxy.start(exp.config(steps=200, checkpoint={"every": 25}, eval={"every": 0}), exp.run_dir,
                    cpu_binary, "--no-server")
    assert p.wait(120) == 0, p.describe()
    assert any("previous launch ended without recording it" in line for line in p.out), p.describe()
    assert_no_train_step_missing(exp.loss())


STUB_ENGINE = """#!{python}
# A stand-in engine: records as fast as it can; SIGTERM writes "checkpointed" (as the real engine's
# checkpoint would), prints the step's validation and bandit records (a probe step's) and exits.
# The handler only raises a flag: a write it interrupts (EINTR) would run it mid-line.
import json, os, signal, sys
if sys.argv[1:] == ["--flags-json"]:
    os.execv({cpu!r}, [{cpu!r}, "--flags-json"])
stopping = []
signal.signal(signal.SIGTERM, lambda *_: stopping.append(1))
signal.pthread_sigmask(signal.SIG_UNBLOCK, {{signal.SIGTERM, signal.SIGINT, signal.SIGUSR1}})  # as the engine does
step = 0
print(json.dumps({{"event": "start", "step": 0, "steps": 10**9, "tokens_per_step": 64}}), flush=True)
while not stopping:
    step += 1
    print(json.dumps({{"step": step, "loss": 1.0, "tokens": 64 * step}}), flush=True)
open({marker!r}, "w").write("checkpointed")
print(json.dumps({{"step": step, "val_loss": 2.0}}), flush=True)
print(json.dumps({{"event": "bandit", "step": step, "arm": 0, "reward": [0.5], "p": [1.0]}}), flush=True)
print(json.dumps({{"event": "exit", "step": step, "reason": "signal"}}), flush=True)
"""


def stub_engine(tmp_path, cpu_binary):
    marker = tmp_path / "checkpointed"
    engine = tmp_path / "engine.py"
    engine.write_text(STUB_ENGINE.format(python=sys.executable, cpu=str(cpu_binary), marker=str(marker)))
    engine.chmod(0o755)
    return engine, marker


def test_a_full_disk_loses_nothing_silently(exp, cpu_binary, tmp_path, monkeypatch, capsys):
    """When the loss log cannot be written, the engine must not checkpoint past the records that
    are not on disk: it is killed without a checkpoint, and the one error line says so."""
    engine, marker = stub_engine(tmp_path, cpu_binary)
    flags = engines.engine_flags(str(cpu_binary))
    cfg = json.loads(exp.config(steps=10**6).read_text())
    run = supervisor.Run(cfg, flags, str(exp.root / "cfg.json"), str(exp.run_dir), str(engine), [])
    real_append, appends = loss_log.LossLog.append, []

    def append(log, records):
        appends.append(len(records))
        if len(appends) > 3:
            raise OSError(errno.ENOSPC, "No space left on device")
        real_append(log, records)
    monkeypatch.setattr(loss_log.LossLog, "append", append)
    sup = supervisor.Supervisor(run)
    assert sup.run_engine() == 1
    assert sup.proc.returncode == -signal.SIGKILL and not marker.exists()
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and "No space left on device" in err[0], err
    assert "could not be written to the loss log, so the engine was killed without a checkpoint" in err[0]
    st = json.loads(exp.path(".state.json").read_text())
    assert st["status"] == "crashed" and "could not be written" in st["message"]


def test_a_checkpoint_past_records_that_could_not_be_logged_is_not_taken_as_logged(exp, cpu_binary, monkeypatch,
                                                                                   capsys):
    """The engine does not wait for the proxy: where a flush fails (a full disk) once the engine has
    checkpointed past the records in it, the state's checkpoint_step must stay the last checkpoint
    whose records are on disk. The proxy failure wrote the newest checkpoint's step there instead,
    so the next start took every step up to it as logged and resumed from it: the records that
    could not be written were missing for good (here the run was finished: it did nothing more)."""
    cfg = json.loads(exp.config(steps=60, checkpoint={"every": 20}).read_text())
    run = supervisor.Run(cfg, engines.engine_flags(str(cpu_binary)), str(exp.root / "cfg.json"),
                         str(exp.run_dir), str(cpu_binary), [])
    sup = supervisor.Supervisor(run)
    real_append = loss_log.LossLog.append

    def append(log, records):
        if any(r.get("step", 0) > 40 for r in records):  # the disk is full from here on
            sup.proc.wait()  # the engine has checkpointed step 60, past these records, and ended
            raise OSError(errno.ENOSPC, "No space left on device")
        real_append(log, records)
    monkeypatch.setattr(loss_log.LossLog, "append", append)
    assert sup.run_engine() == 1
    run.log.close()
    run.lock.close()  # as the proxy's exit would
    monkeypatch.setattr(loss_log.LossLog, "append", real_append)
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and "could not be written to the loss log" in err[0], err
    assert checkpoint_step(str(exp.path(".ckpt"))) == 60 and exp.state()["checkpoint_step"] == 40
    p, rc = run_to_end(exp.root / "cfg.json", exp.run_dir, cpu_binary, "--no-server")
    assert rc == 0, p.describe()
    assert any("resuming from the previous checkpoint, step 40" in line for line in p.out), p.describe()
    assert_no_train_step_missing(exp.loss())
    assert live_train(exp.loss())[-1]["step"] == 60


def run_on_a_full_disk(cfg, run_dir, cpu_binary):
    """The proxy, in a process where the run directory's JSON files cannot be written (ENOSPC)."""
    full_disk = ("import errno, sys\n"
                 "from microgpt import run_dir, training_proxy\n"
                 "def full(*_): raise OSError(errno.ENOSPC, 'No space left on device')\n"
                 "run_dir.write_json_atomic = full\n"
                 "sys.exit(training_proxy.main(sys.argv[1:]))\n")
    return subprocess.run([sys.executable, "-c", full_disk, str(cfg), "--engine-binary", str(cpu_binary),
                           "--run-dir", str(run_dir), "--no-server"],
                          capture_output=True, text=True, env=proxy_env(), timeout=60)


def test_a_finished_run_on_a_full_disk_is_one_error(exp, cpu_binary):
    """Run again, a finished run rewrites its state ("finished", the checkpoint's step) before its
    summary, outside the engine's supervision: on a full disk that was an OSError traceback."""
    cfg = exp.config(steps=12)
    p, rc = run_to_end(cfg, exp.run_dir, cpu_binary, "--no-server")
    assert rc == 0, p.describe()
    proc = run_on_a_full_disk(cfg, exp.run_dir, cpu_binary)
    assert proc.returncode == 1 and proc.stderr.splitlines() == [
        f"error: {exp.path('.state.json')}: cannot record that the run is finished: No space left on device"], proc
    assert exp.state()["status"] == "finished"


def test_a_new_run_on_a_full_disk_is_one_error_naming_the_run(exp, cpu_binary):
    """A write's OSError names no file: a new run on a full disk was "error: [Errno 28] No space
    left on device", not saying which run or directory, and exit 2, the status of bad input; it is
    exit 1, a failed write's, as for a finished run's state."""
    proc = run_on_a_full_disk(exp.config(steps=12), exp.run_dir, cpu_binary)
    assert proc.returncode == 1 and proc.stderr.splitlines() == [
        f"error: cannot prepare the run in {exp.run_dir}: No space left on device"], proc


def test_a_proxy_failure_logs_the_records_up_to_the_engine_checkpoint(exp, cpu_binary, tmp_path, capsys):
    """The proxy fails (a handler trips on a record) but can still write: the engine gets SIGTERM,
    and what it prints on its way out is logged, so no step before its checkpoint is missing."""
    engine, marker = stub_engine(tmp_path, cpu_binary)
    flags = engines.engine_flags(str(cpu_binary))
    cfg = json.loads(exp.config(steps=10**6).read_text())
    run = supervisor.Run(cfg, flags, str(exp.root / "cfg.json"), str(exp.run_dir), str(engine), [])
    sup = supervisor.Supervisor(run)
    calls = []
    real = sup.events.on_train

    def on_train(rec):
        calls.append(rec["step"])
        if len(calls) == 200:
            raise RuntimeError("a bug in a handler")
        real(rec)
    sup.events.on_train = on_train
    assert sup.run_engine() == 1
    assert sup.proc.returncode == 0 and marker.exists()
    run.log.close()
    recs = json.loads(exp.path(".loss.json").read_text())
    steps = [r["step"] for r in live_train(recs)]
    # step 200 itself tripped the handler: it is the one record the failure cost
    assert steps[:199] == list(range(1, 200)) and steps[199:] == list(range(201, steps[-1] + 1))
    assert steps[-1] > 200
    # the validation and bandit records printed on the way out too, placed on their tokens as
    # while the proxy works (the bandit record was dropped: its probe's p lost from the history)
    out = [r for r in recs if "val_loss" in r or r.get("event") == "bandit"]
    assert [(r.get("event"), r.get("tokens")) for r in out] == [(None, 64 * out[0]["step"]), ("bandit", 64 * out[0]["step"])]
    assert out[0]["step"] == out[1]["step"] == steps[-1]
    assert "proxy failed: RuntimeError: a bug in a handler" in capsys.readouterr().err


class JumpingClock:
    """The time module as events.py sees it, with a wall clock that jumps by `offset` when told."""

    def __init__(self):
        self.offset = 0.0

    def time(self):
        return time.time() + self.offset

    def __getattr__(self, name):
        return getattr(time, name)


@pytest.mark.parametrize("jump", [-86400.0, 86400.0])
def test_a_wall_clock_jump_is_no_training_time(exp, cpu_binary, monkeypatch, jump):
    """The clock set back or forward while a run trains (NTP stepping it, a VM restored): `elapsed`,
    the training time summed over launches, was taken from the wall clock, so every record after a
    jump back said a negative training time (and the next launch counted on from it), and a jump
    forward added a day of training that never happened. Only the records' `time` follows the
    wall clock."""
    from microgpt import events
    cfg = json.loads(exp.config(steps=300).read_text())
    run = supervisor.Run(cfg, engines.engine_flags(str(cpu_binary)), str(exp.root / "cfg.json"),
                         str(exp.run_dir), str(cpu_binary), [])
    sup = supervisor.Supervisor(run)
    clock = JumpingClock()
    monkeypatch.setattr(events, "time", clock)
    real = sup.events.on_train

    def on_train(rec):
        if rec["step"] == 100:
            clock.offset = jump
        real(rec)
    sup.events.on_train = on_train
    t0 = time.monotonic()
    assert sup.run_engine() == 0
    took = time.monotonic() - t0
    run.log.close()
    recs = exp.loss()
    elapsed = [r["elapsed"] for r in recs]
    assert elapsed == sorted(elapsed) and 0 <= elapsed[0] and elapsed[-1] <= took, elapsed
    assert 0 <= exp.state()["elapsed_s"] <= took
    assert recs[-1]["time"] - recs[0]["time"] > abs(jump) / 2 if jump > 0 else recs[-1]["time"] < recs[0]["time"]


@pytest.mark.parametrize("how", ["replaced", "removed"])
def test_a_loss_log_replaced_while_running_is_a_proxy_failure(exp, cpu_binary, how):
    """An editor saving the log (a copy renamed over it), or its removal, while the run writes it:
    the proxy went on appending to the file no name leads to any more, and the run ended "stopped",
    exit 0, with every later step missing from the log for good. Now the next append finds it out:
    the engine is killed before a checkpoint gets past the log, with one error line."""
    cfg = exp.config(steps=10**6, checkpoint={"every": 50})
    p = Proxy.start(cfg, exp.run_dir, cpu_binary, "--no-server")
    p.wait_state(lambda s: (s.get("checkpoint_step") or 0) >= 50)
    log = exp.path(".loss.json")
    if how == "replaced":
        shutil.copy(log, exp.root / "copy.json")
        os.replace(exp.root / "copy.json", log)
    else:
        log.unlink()
    rc = p.wait(60)
    assert rc == 1 and len(error_lines(p)) == 1, p.describe()
    assert f"{log} was {how}" in error_lines(p)[0] and "killed without a checkpoint" in error_lines(p)[0]
    st = exp.state()
    assert st["status"] == "crashed" and f"was {how}" in st["message"]
    if how == "replaced":  # the same command resumes where the copy ends: no step is missing
        p = Proxy.start(cfg, exp.run_dir, cpu_binary, "--no-server")
        last = p.wait_state(lambda s: s.get("status") == "running" and s.get("seg") == 2)["step"]
        p.wait_state(lambda s: s.get("step", 0) > last + 50)
        assert p.stop() == 0, p.describe()
        assert_no_train_step_missing(exp.loss())


@pytest.mark.parametrize("keep", [0, 300])
def test_a_loss_log_truncated_while_running_is_a_proxy_failure(exp, cpu_binary, keep):
    """Someone truncating the log in place (`: > log`, `truncate -s`) while the run writes it: the
    same file, so the replaced-file check passed, and the proxy went on writing at its old end,
    past a hole of NUL bytes. The run ended "stopped" with a log no JSON reader takes, which the
    next start refused as damaged. Now the next append finds it out, as for a replaced log, and
    the same command resumes with a log that json.load takes."""
    cfg = exp.config(steps=10**6, checkpoint={"every": 50})
    p = Proxy.start(cfg, exp.run_dir, cpu_binary, "--no-server")
    p.wait_state(lambda s: (s.get("checkpoint_step") or 0) >= 50)
    log = exp.path(".loss.json")
    with open(log, "r+b") as f:
        f.truncate(keep)
    rc = p.wait(60)
    assert rc == 1 and len(error_lines(p)) == 1, p.describe()
    assert f"{log} was truncated" in error_lines(p)[0] and "killed without a checkpoint" in error_lines(p)[0]
    assert b"\0" not in log.read_bytes()
    assert exp.state()["status"] == "crashed"
    p = Proxy.start(cfg, exp.run_dir, cpu_binary, "--no-server")
    last = p.wait_state(lambda s: s.get("status") == "running")["step"]  # it was "crashed"
    p.wait_state(lambda s: s.get("step", 0) > last + 20)
    assert p.stop() == 0, p.describe()
    assert [r["step"] for r in live_train(exp.loss())][-1] > last + 20


# ---------------------------------------------------------------------------------------------------
# run files of the wrong type, hostile configs: one message each, never a traceback


@pytest.mark.parametrize("suffix, content, what", [
    (".state.json", "null", "not a JSON object"),
    (".state.json", "[1, 2]", "not a JSON object"),
    (".samples.json", '{"step": 1}', "not a list of samples"),
    (".samples.json", "[1, 2]", "not a list of samples"),
    (".samples.json", "{", "not valid JSON"),
    # Python's json takes NaN and Infinity, JSON.parse does not: kept, they made the dashboard's
    # /api/state and /api/samples answers unreadable
    (".state.json", '{"name": "x", "eta_s": NaN}', "not valid JSON"),
    (".samples.json", '[{"step": Infinity, "prompt": "A", "text": "b"}]', "not valid JSON"),
    # a key twice: Python's json took the last, other readers may take the first
    (".state.json", '{"name": "x", "name": "y"}', 'ambiguous: the key "name" appears twice'),
])
def test_run_files_of_the_wrong_type_are_moved_aside(exp, cpu_binary, suffix, content, what):
    exp.run_dir.mkdir()
    exp.path(suffix).write_text(content)
    p, rc = run_to_end(exp.config(steps=12), exp.run_dir, cpu_binary, "--no-server")
    assert rc == 0 and "Traceback" not in "".join(p.err), p.describe()
    said = [line for line in p.out if "damaged" in line]
    assert len(said) == 1 and what in said[0], p.describe()
    assert exp.path(suffix + ".damaged").read_text() == content  # kept, not lost
    assert exp.state()["status"] == "finished"
    # damaged again: a second copy goes beside the first, which it replaced before
    exp.path(suffix).write_text(content + " ")
    p, rc = run_to_end(exp.config(steps=12), exp.run_dir, cpu_binary, "--no-server")
    assert rc == 0 and f"moved it to {exp.path(suffix)}.damaged.1 " in p.describe(), p.describe()
    assert exp.path(suffix + ".damaged").read_text() == content
    assert exp.path(suffix + ".damaged.1").read_text() == content + " "


@pytest.mark.parametrize("key, value", [("loss", "x"), ("val_loss", [1]), ("elapsed_s", "1m")])
def test_a_finished_run_whose_state_holds_a_mistyped_value_is_summarized(exp, cpu_binary, key, value):
    """A finished run's summary is made from .state.json as it was on disk: a loss that is no
    number was a ValueError traceback ("Unknown format code 'f'"), an elapsed_s a TypeError; exit 1."""
    cfg = exp.config(steps=12)
    p, rc = run_to_end(cfg, exp.run_dir, cpu_binary, "--no-server")
    assert rc == 0, p.describe()
    content = json.dumps({**exp.state(), key: value})
    exp.path(".state.json").write_text(content)
    p, rc = run_to_end(cfg, exp.run_dir, cpu_binary, "--no-server")
    assert rc == 0 and "Traceback" not in "".join(p.err), p.describe()
    said = [line for line in p.out if "damaged" in line]
    assert len(said) == 1 and "not a JSON object of a run's state" in said[0], p.describe()
    assert exp.path(".state.json.damaged").read_text() == content
    assert exp.state()["status"] == "finished"


def one_error(p, rc, words):
    errors = error_lines(p)
    assert rc == 2 and len(errors) == 1 and words in errors[0], p.describe()
    assert "Traceback" not in "".join(p.err), p.describe()
    return errors[0]


def test_a_config_nested_too_deeply_is_one_error(exp, cpu_binary):
    path = exp.root / "deep.json"
    path.write_text("[" * 100000 + "]" * 100000)
    p, rc = run_to_end(path, exp.run_dir, cpu_binary, "--no-server")
    one_error(p, rc, "nested too deeply")


def test_a_config_holding_an_integer_of_thousands_of_digits_is_one_error(exp, cpu_binary):
    """int() refuses over 4300 digits with advice to raise Python's limit, which was the error line."""
    path = exp.root / "long.json"
    path.write_text(exp.config(steps=5).read_text().replace('"train": {', '"train": {"steps": ' + "9" * 5001 + ", ", 1))
    p, rc = run_to_end(path, exp.run_dir, cpu_binary, "--no-server")
    line = one_error(p, rc, "an integer of more than 4300 digits")
    assert "set_int_max_str_digits" not in line


def test_an_empty_run_dir_is_one_error_not_the_default(exp, cpu_binary):
    """`--run-dir "$RUN_DIR"` with the variable unset trained, or resumed, runs/<name>/ unasked."""
    default = REPO / "runs" / "empty-run-dir-test"
    try:
        p, rc = run_to_end(exp.config(steps=2, name=default.name), "", cpu_binary, "--no-server")
        one_error(p, rc, "--run-dir is empty")
        assert not default.exists()
    finally:
        shutil.rmtree(default, ignore_errors=True)


@pytest.mark.parametrize("given, words", [
    # the default engine trained in the custom build's place
    (["CONFIG", "--engine-binary", ""], "--engine-binary is empty"),
    # taken as no --serve: a TypeError traceback on the missing config
    (["--serve", ""], "--serve is empty"),
    (["", "--engine-binary", "ENGINE"], "the experiment config is empty"),
    # bound to every interface, the dashboard reachable from the network
    (["--serve", "RUN_DIR", "--host", ""], "--host is empty"),
])
def test_an_empty_argument_is_one_error_not_ignored(exp, cpu_binary, given, words):
    """`"$VAR"` with the variable unset is an empty argument: one error line, nothing trained or served."""
    exp.run_dir.mkdir()
    argv = [{"CONFIG": str(exp.config(steps=2)), "ENGINE": str(cpu_binary), "RUN_DIR": str(exp.run_dir)}.get(a, a)
            for a in given]
    res = subprocess.run([sys.executable, str(REPO / "microgpt" / "training_proxy.py"), *argv, "--run-dir",
                          str(exp.run_dir), "--no-server"], capture_output=True, text=True, env=proxy_env(),
                         timeout=120)
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: ") and words in lines[0], res.stderr
    assert not any(exp.run_dir.iterdir())


def test_a_config_naming_a_key_twice_is_one_error(exp, cpu_binary):
    """docs/DESIGN.md §4: Python's json kept the last of a key given twice; which one the writer
    meant is unknown, so the config is refused and no run starts."""
    path = exp.root / "twice.json"
    path.write_text(exp.config(steps=5).read_text().replace('"train": {', '"train": {"steps": 7, ', 1))
    assert '"steps": 7' in path.read_text()
    p, rc = run_to_end(path, exp.run_dir, cpu_binary, "--no-server")
    one_error(p, rc, 'the key "steps" appears twice in one object')
    assert not exp.run_dir.exists()


def test_a_fifo_as_config_is_refused_not_waited_on(exp, cpu_binary):
    path = exp.root / "fifo.json"
    os.mkfifo(path)
    p, rc = run_to_end(path, exp.run_dir, cpu_binary, "--no-server", timeout=30)
    one_error(p, rc, "not a regular file")


def test_a_checkpoint_path_that_is_a_directory_is_one_error(exp, cpu_binary):
    exp.path(".ckpt").mkdir(parents=True)
    p, rc = run_to_end(exp.config(steps=5), exp.run_dir, cpu_binary, "--no-server")
    one_error(p, rc, "is a directory")


@pytest.mark.parametrize("sections, words", [
    ({"description": "x" * 1_000_000}, '"description" has 1000000 characters; at most 10000'),
    ({"sample": {"every": 5, "prompts": ["A" * 200_000]}}, '"sample.prompts" has 200000 characters'),
    ({"sample": {"every": 5, "prompts": ["A B " * 20]}}, '"sample.prompts[0]" is 41 tokens; the model sees at most model.seq_len (32)'),
    ({"name": "n" * 101}, '"name" must be letters, digits, ".", "_" or "-" (it names files; at most 100 bytes'),
    # 80 characters, but 240 bytes: <name>.loss.json.tmp<pid> was "[Errno 36] File name too long",
    # with the new run directory and its lock file left behind
    ({"name": "\u4e2d" * 80}, '"name" must be letters, digits, ".", "_" or "-" (it names files; at most 100 bytes'),
], ids=["description", "prompt-chars", "prompt-tokens", "name", "name-bytes"])
def test_oversized_inputs_are_one_clear_error(exp, cpu_binary, sections, words):
    p, rc = run_to_end(exp.config(steps=5, **sections), exp.run_dir, cpu_binary, "--no-server")
    message = one_error(p, rc, words)
    assert len(message) < 300, message  # the value itself is not echoed back
    assert not exp.run_dir.exists()


def test_sigterm_before_the_engine_starts_stops_cleanly(exp, cpu_binary, tmp_path):
    """A stop that arrives while the proxy is still starting (here: while it asks the engine for its
    flag table) is honoured: exit 0, no engine launched."""
    asked, launched = tmp_path / "asked", tmp_path / "launched"
    engine = tmp_path / "engine.sh"
    engine.write_text(f'#!/bin/sh\nif [ "$1" = --flags-json ]; then touch {asked}; sleep 1; '
                      f'exec {cpu_binary} --flags-json; fi\ntouch {launched}\nexec {cpu_binary} "$@"\n')
    engine.chmod(0o755)
    p = Proxy.start(exp.config(steps=5), exp.run_dir, engine, "--no-server")
    deadline = time.monotonic() + 30
    while not asked.exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    p.proc.send_signal(signal.SIGTERM)
    assert p.wait() == 0, p.describe()
    assert any("SIGTERM before the engine started: nothing launched" in line for line in p.out)
    assert not launched.exists()


WAITING_ENGINE = """#!{python}
# A stand-in engine stopped before its first step: it says nothing to save, as the engine does
import json, os, signal, sys
if sys.argv[1:] == ["--flags-json"]:
    os.execv({cpu!r}, [{cpu!r}, "--flags-json"])
print(json.dumps({{"event": "start", "step": 0, "steps": 5}}), flush=True)
signal.sigwait({{signal.SIGTERM}})  # blocked since the launch
print(json.dumps({{"event": "exit", "step": 0, "reason": "signal"}}), flush=True)
"""


def test_a_new_run_stopped_before_its_first_step_says_so(exp, cpu_binary, tmp_path):
    """A new run stopped before its first step has no checkpoint: the proxy said "stopped at step 0
    with checkpoint None; run the same command to resume"."""
    engine = tmp_path / "engine.py"
    engine.write_text(WAITING_ENGINE.format(python=sys.executable, cpu=str(cpu_binary)))
    engine.chmod(0o755)
    p = Proxy.start(exp.config(steps=5), exp.run_dir, engine, "--no-server")
    p.wait_output("starting at step 0")
    p.proc.send_signal(signal.SIGTERM)
    assert p.wait() == 0, p.describe()
    assert any("tiny stopped at step 0 before any checkpoint; run the same command to start again" in line
               for line in p.out), p.describe()
    assert not any("None" in line for line in p.out), p.describe()
    assert exp.state()["status"] == "stopped"


def test_a_ctrl_c_during_the_engine_s_flag_query_stops_cleanly(exp, cpu_binary, tmp_path):
    """A terminal's Ctrl-C goes to its whole foreground process group: the engine answering
    --flags-json too, which it ends. That was "did not give its flag table (exit code -2);
    rebuild it with `make`", exit 2: it is the stop asked for, nothing launched, exit 0."""
    asked, launched = tmp_path / "asked", tmp_path / "launched"
    engine = tmp_path / "engine.sh"
    engine.write_text(f'#!/bin/sh\nif [ "$1" = --flags-json ]; then touch {asked}; sleep 30; '
                      f'exec {cpu_binary} --flags-json; fi\ntouch {launched}\nexec {cpu_binary} "$@"\n')
    engine.chmod(0o755)
    proc = subprocess.Popen(proxy_command(exp.config(steps=5), exp.run_dir, engine, "--no-server"),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=proxy_env(),
                            start_new_session=True)  # a process group of its own, as a shell's job
    deadline = time.monotonic() + 30
    while not asked.exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    os.killpg(proc.pid, signal.SIGINT)  # what the terminal does on Ctrl-C
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, (out, err)
    assert "SIGINT before the engine started: nothing launched" in out and "error" not in err, (out, err)
    assert not launched.exists() and not exp.run_dir.exists()


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_stop_while_the_proxy_imports_stops_cleanly(exp, cpu_binary, sig):
    """The stop handlers were installed in main(), after the imports (numpy and the rest take a
    tenth of a second): a Ctrl-C there was a KeyboardInterrupt traceback, a SIGTERM a silent death
    (rc -15). The signal is sent once numpy is mapped into the proxy, i.e. while it imports."""
    p = Proxy.start(exp.config(steps=5), exp.run_dir, cpu_binary, "--no-server")
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and p.proc.poll() is None:
        with open(f"/proc/{p.proc.pid}/maps") as f:
            if "numpy" in f.read():
                break
        time.sleep(0.001)
    p.proc.send_signal(sig)
    assert p.wait() == 0, p.describe()
    assert any(f"{sig.name} before the engine started: nothing launched" in line for line in p.out), p.describe()
    assert not any("Traceback" in line for line in p.err), p.describe()


LINE_ENGINE = """#!{python}
# A stand-in engine that prints the line in {line_file} among its records, then finishes
import json, os, sys
if sys.argv[1:] == ["--flags-json"]:
    os.execv({cpu!r}, [{cpu!r}, "--flags-json"])
print(json.dumps({{"event": "start", "step": 0, "steps": 1}}), flush=True)
sys.stdout.buffer.write(open({line_file!r}, "rb").read())
print(json.dumps({{"step": 1, "loss": 1.5}}), flush=True)
print(json.dumps({{"event": "exit", "step": 1, "reason": "finished"}}), flush=True)
"""


def run_with_a_line(exp, cpu_binary, tmp_path, line):
    """The proxy run to its end on LINE_ENGINE printing `line`: it must end well."""
    line_file = tmp_path / "line"
    line_file.write_text(line + "\n")
    engine = tmp_path / "engine.py"
    engine.write_text(LINE_ENGINE.format(python=sys.executable, cpu=str(cpu_binary), line_file=str(line_file)))
    engine.chmod(0o755)
    p, rc = run_to_end(exp.config(steps=1), exp.run_dir, engine, "--no-server")
    assert rc == 0, p.describe()
    return p


@pytest.mark.parametrize("line", ['{"step":1e999,"loss":1}', '{"step":1,"loss":NaN}',
                                  '{"step":1,"loss":Infinity}', "[" * 100000])
def test_an_engine_line_that_is_no_strict_json_is_shown_not_logged(exp, cpu_binary, tmp_path, line):
    """Python's json.loads takes NaN, Infinity and 1e999 (as inf), none of which the log may hold:
    the record was a ValueError at its append, a proxy failure, and again in the failure's own
    flush of it, a traceback that left the run "running". Nested too deeply, a line was a
    RecursionError, a proxy failure. Such a line is no protocol: shown, and the run goes on."""
    p = run_with_a_line(exp, cpu_binary, tmp_path, line)
    assert exp.state()["status"] == "finished"
    assert any(l.strip() == line for l in p.err), p.describe()
    recs = loss_log.parse_json(exp.path(".loss.json").read_bytes())
    assert [(r["step"], r["loss"]) for r in recs if "loss" in r] == [(1, 1.5)]


@pytest.mark.parametrize("line, field", [
    ('{"step": 1, "loss": "abc"}', '"loss" is "abc", not a number or null'),
    ('{"step": "x", "loss": 1.25}', '"step" is "x", not a whole number >= 0'),
    ('{"step": 1, "loss": [1]}', '"loss" is [1], not a number or null'),
    ('{"step": 1, "val_loss": {"a": 1}}', '"val_loss" is {"a": 1}, not a number or null'),
    ('{"step": -1, "loss": 1.25}', '"step" is -1, not a whole number >= 0'),
    ('{"step": true, "loss": 1.25}', '"step" is true, not a whole number >= 0'),
    ('{"event": ["exit"], "step": 1}', '"event" is ["exit"], not a string'),
    ('{"event": "checkpoint", "step": 1, "path": 7, "reason": "usr1"}', '"path" is 7, not a string'),
    ('{"event": "exit", "step": "1", "reason": "finished"}', '"step" is "1", not a whole number >= 0'),
    ('{"event": "sample", "step": 1, "prompt": 0, "prompt_tokens": [32], "tokens": ["a"]}',
     '"tokens" is ["a"], not a list of token ids'),
    ('{"step": 1, "loss": 1.25, "arm": "x"}', '"arm" is "x", not a source index or a list of them'),
    ('{"step": 1, "loss": 1.25, "arm": [0, -1]}', '"arm" is [0, -1], not a source index or a list of them'),
    ('{"event": "bandit", "step": 1, "arm": 0, "p": [0.5, "x"]}', '"p" is [0.5, "x"], not a list of numbers or null'),
    ('{"event": "bandit", "step": 1, "arm": 0, "probe_loss": "x"}', '"probe_loss" is "x", not a number or null'),
    ('{"step": 1, "val_loss": 2.5, "val_loss_by_source": {"a": [1]}}',
     '"val_loss_by_source" is {"a": [1]}, not an object of numbers or null'),
    ('{"event": "start", "step": 0, "steps": 1, "sources": "ab"}', '"sources" is "ab", not a list of source names'),
])
def test_an_engine_record_of_the_wrong_types_is_one_warning_not_a_proxy_failure(exp, cpu_binary, tmp_path,
                                                                                  line, field):
    """A record whose fields are of other types than the engine prints (a damaged or foreign engine
    binary) went into the state and the handlers as it came: "loss": "abc" failed the progress
    line's format, "step": "x" the ETA's arithmetic, an "event" that is a list the dispatch, each a
    traceback-like "proxy failed" that stopped the run. Such a record is checked where the line
    becomes a record, said in one warning that names the field, and not logged: the run goes on.
    The mixture's fields too (a source index, names, numbers per source): the log keeps them for
    the dashboard and scripts/bandit-experiment.py, which indexed with "arm": "x" (a traceback)."""
    p = run_with_a_line(exp, cpu_binary, tmp_path, line)
    st = exp.state()
    assert st["status"] == "finished" and st["loss"] == 1.5 and st["checkpoint"] is None, st
    warnings = [l for l in p.out if "warning: the engine printed a record whose" in l]
    assert len(warnings) == 1 and field in warnings[0] and warnings[0].endswith("; not logged\n"), p.describe()
    assert not any("Traceback" in l or "proxy failed" in l for l in p.out + p.err), p.describe()
    recs = loss_log.parse_json(exp.path(".loss.json").read_bytes())
    assert [(r["step"], r["loss"]) for r in recs if "loss" in r] == [(1, 1.5)]
    assert json.loads(exp.path(".samples.json").read_text()) == []


def test_an_engine_record_whose_values_are_not_finite_is_logged_as_the_engine_prints_it(exp, cpu_binary,
                                                                                          tmp_path):
    """The engine prints a value that is no finite number as null (a diverged loss, a step's time
    under a broken clock). The first step's record is timed by its own "ms", and null there was a
    TypeError, a proxy failure; now it is a record like any other: logged, no warning."""
    line = ('{"step":1,"loss":null,"lr":null,"grad_norm":null,"ms":null,"tokens_per_s":null,"tokens":8,'
            '"phase":"train"}')
    p = run_with_a_line(exp, cpu_binary, tmp_path, line)
    assert exp.state()["status"] == "finished"
    assert not any("warning" in l or "Traceback" in l or "proxy failed" in l for l in p.out + p.err), p.describe()
    recs = loss_log.parse_json(exp.path(".loss.json").read_bytes())
    assert [r["loss"] for r in recs if "loss" in r] == [None, 1.5]


# ---------------------------------------------------------------------------------------------------
# the terminal: progress and summary


def test_progress_line_and_summary_say_what_a_user_needs():
    state = {"status": "running", "step": 1200, "steps": 20000, "loss": 4.12345, "val_loss": 4.35,
             "val_step": 1000, "tokens_per_s": 95200.0, "elapsed_s": 130.0, "eta_s": 1865.0,
             "phase": "pretrain"}
    assert terminal.progress_line(state) == ("step 1200/20000 6.0% | loss 4.1235 | val 4.3500 | "
                                             "95.2k tok/s | 2m10s | ETA 31m05s")
    assert terminal.duration(7384) == "2h03m04s" and terminal.duration(4.4) == "4s"
    lines = terminal.summary({**state, "status": "finished", "step": 20000}, 61.0, "/r/x",
                             ("/r/x/x.ckpt", 20000))
    assert lines == ["summary: step 20000 of 20000, 2m10s of training (this launch 1m01s)",
                     "train loss 4.1235, validation loss 4.3500 (step 1000)",
                     "checkpoint /r/x/x.ckpt (step 20000)",
                     "chat with it:  python microgpt/chat.py /r/x",
                     "export it:     python scripts/export-hf.py /r/x OUT_DIR"]
    assert not any("chat" in line for line in terminal.summary(state, 1.0, "/r/x", None))
    # --run-dir r1 for a run named x: chat.py r1 looked for r1/r1.ckpt and failed
    other = terminal.summary(state, 1.0, "/r/r1", ("/r/r1/x.ckpt", 1200))
    assert other[-2:] == ["chat with it:  python microgpt/chat.py /r/r1/x.ckpt",
                          "export it:     python scripts/export-hf.py /r/r1/x.ckpt OUT_DIR"]


@pytest.mark.parametrize("run_dir, word", [
    ("/r/my run", "'/r/my run'"),  # two arguments to the tool
    ("/r/$(touch x)", "'/r/$(touch x)'"),  # the copied command ran `touch x`
    ("-x", "./-x"),  # an option to the tool
])
def test_the_summary_s_commands_take_the_run_directory_as_one_argument(run_dir, word):
    """The summary's commands are to be copied into a shell: the run directory is one word there."""
    state = {"status": "finished", "step": 4, "steps": 4}
    ckpt = os.path.join(run_dir, os.path.basename(run_dir) + ".ckpt")
    lines = terminal.summary(state, 1.0, os.path.abspath(run_dir), (os.path.abspath(ckpt), 4))
    assert lines[-2:] == [f"chat with it:  python microgpt/chat.py {word}",
                          f"export it:     python scripts/export-hf.py {word} OUT_DIR"]


def test_a_plain_progress_line_is_not_repeated_word_for_word():
    """With steps slower than the interval (ANDREA-12M on the CPU engine: ~35 s a step against 30 s),
    the log showed each step's line twice, the same training time in both, as if written twice."""
    out = io.StringIO()
    term = terminal.Terminal(out=out, err=io.StringIO())
    term.interval = 1e-9
    for line in ["step 1/9", "step 1/9", "step 2/9", "step 2/9", "step 1/9"]:
        time.sleep(1e-3)
        term.progress(line)
    assert out.getvalue().splitlines() == ["[proxy] step 1/9", "[proxy] step 2/9", "[proxy] step 1/9"]


def test_a_terminal_of_unknown_width_shows_the_whole_progress_line(monkeypatch):
    """A pseudo-terminal whose size was never set (`script`, `docker run -t`, CI's tty) reports 0
    columns: the line was cut to its first 20 characters ("step 39/300 13.0% | "), every figure
    after the step lost."""
    class Tty(io.StringIO):
        def isatty(self):
            return True
    monkeypatch.setattr(terminal.os, "get_terminal_size", lambda *a: os.terminal_size((0, 0)))
    out = Tty()
    term = terminal.Terminal(out=out, err=io.StringIO())
    line = "step 39/300 13.0% | loss 7.4570 | 0.3k tok/s | 1m06s | ETA 3m21s"
    term.progress(line)
    assert out.getvalue() == "\r" + line + "\033[K"


def test_plain_progress_lines_then_a_summary(exp, cpu_binary):
    cfg = exp.config(steps=400, eval={"every": 50})
    p, rc = run_to_end(cfg, exp.run_dir, cpu_binary, "--no-server", "--progress-every", "0.2")
    assert rc == 0, p.describe()
    progress = [line for line in p.out if line.startswith("[proxy] step ")]
    assert len(progress) >= 2, p.describe()
    steps = [int(line.split()[2].split("/")[0]) for line in progress]
    assert steps == sorted(steps) and all(line.split()[2].endswith("/400") for line in progress)
    assert all(" | loss " in line and " tok/s | " in line and "ETA" in line for line in progress), progress
    out = "".join(p.out)
    assert "summary: step 400 of 400" in out and "validation loss" in out
    # the run directory is "run", the run "tiny": the tools are given the checkpoint file
    assert f"chat with it:  python microgpt/chat.py {exp.path('.ckpt')}" in out
    assert f"export it:     python scripts/export-hf.py {exp.path('.ckpt')} OUT_DIR" in out


CRASHING_ENGINE = """#!{python}
# A stand-in engine that starts, says why it fails on stderr and exits 1 (a machine failure)
import json, os, sys
if sys.argv[1:] == ["--flags-json"]:
    os.execv({cpu!r}, [{cpu!r}, "--flags-json"])
print(json.dumps({{"event": "start", "step": 0, "steps": 5}}), flush=True)
print("memory plan: a line before the error", file=sys.stderr, flush=True)
print("error: the machine failed", file=sys.stderr, flush=True)
sys.exit(1)
"""


@pytest.mark.parametrize("closed", ["stdout", "stderr"])
def test_a_proxy_started_with_its_output_closed_runs_as_usual(exp, cpu_binary, tmp_path, closed):
    """`proxy ... >&-` (or `2>&-`): Python has no sys.stdout (sys.stderr), so the terminal's first
    message was an AttributeError traceback at import, and the engine's stderr pass-through thread
    died at its first line, the engine's error line never reaching the crashed run's message."""
    engine = tmp_path / "engine.py"
    engine.write_text(CRASHING_ENGINE.format(python=sys.executable, cpu=str(cpu_binary)))
    engine.chmod(0o755)
    fd = {"stdout": 1, "stderr": 2}[closed]
    proc = subprocess.run(proxy_command(exp.config(steps=5), exp.run_dir, engine, "--no-server"),
                          stdout=subprocess.PIPE if fd == 2 else None,
                          stderr=subprocess.PIPE if fd == 1 else None, text=True, env=proxy_env(),
                          preexec_fn=lambda: os.close(fd), timeout=60)
    assert "Traceback" not in (proc.stdout or "") + (proc.stderr or ""), proc
    assert proc.returncode == 1, proc
    state = exp.state()
    assert state["status"] == "crashed", state
    assert state["message"] == "engine exited with code 1: error: the machine failed", state


STOPPING_ENGINE = """#!{python}
# A stand-in engine that trains until SIGTERM, then says a lot on stderr (more than a pipe holds)
# and stops as the engine does: an exit record, exit code 0
import json, os, signal, sys
if sys.argv[1:] == ["--flags-json"]:
    os.execv({cpu!r}, [{cpu!r}, "--flags-json"])
stop = []
signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
signal.pthread_sigmask(signal.SIG_UNBLOCK, {{signal.SIGTERM, signal.SIGINT, signal.SIGUSR1}})
print(json.dumps({{"event": "start", "step": 0, "steps": 10**9}}), flush=True)
step = 0
while not stop:
    step += 1
    print(json.dumps({{"step": step, "loss": 1.0}}), flush=True)
for i in range(2000):
    print(f"stopping, line {{i}} of 2000 " + "." * 80, file=sys.stderr, flush=True)
print(json.dumps({{"event": "exit", "step": step, "reason": "signal"}}), flush=True)
"""


@contextlib.contextmanager
def stopped_at_the_end(proc):
    """Runs the block, then stops the proxy proc with SIGTERM, which must end it with exit 0; kills
    it where it is still running however the block ended."""
    try:
        yield
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()


def test_a_stop_after_the_output_s_reader_went_away_is_a_stop(exp, cpu_binary, tmp_path):
    """`proxy 2>&1 | tee log` and a Ctrl-C, which ends tee too: the proxy's "SIGINT: asked the
    engine to checkpoint and stop" was a BrokenPipeError, a proxy failure, and a clean stop was
    recorded as a crash (exit 1); the engine's stderr pass-through died on it too, and the engine
    then blocked on a full pipe. The run goes on to its stop, saying nothing more."""
    engine = tmp_path / "engine.py"
    engine.write_text(STOPPING_ENGINE.format(python=sys.executable, cpu=str(cpu_binary)))
    engine.chmod(0o755)
    proc = subprocess.Popen(proxy_command(exp.config(steps=10**6), exp.run_dir, engine, "--no-server"),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=proxy_env())
    with stopped_at_the_end(proc):
        for line in proc.stdout:
            if "starting at step 0" in line:
                break
        proc.stdout.close()  # the reader goes away
    state = exp.state()
    assert state["status"] == "stopped", state


def test_a_proxy_whose_terminal_closed_trains_on_to_its_stop(exp, cpu_binary):
    """A proxy started with `disown` or `setsid` gets no SIGHUP when its terminal closes (an ssh
    session that drops), but every write to that terminal then fails with EIO: the next progress
    line was a proxy failure, and the run was stopped and marked crashed. It trains on until
    stopped, saying nothing more."""
    import pty
    leader, follower = pty.openpty()
    proc = subprocess.Popen(proxy_command(exp.config(steps=10**6), exp.run_dir, cpu_binary, "--no-server",
                                          "--progress-every", "0.01"),
                            stdin=subprocess.DEVNULL, stdout=follower, stderr=follower, env=proxy_env(),
                            start_new_session=True)  # no controlling terminal: no SIGHUP
    os.close(follower)
    with stopped_at_the_end(proc):
        out = b""
        while b"starting at step 0" not in out:
            chunk = os.read(leader, 65536)
            assert chunk, out
            out += chunk
        os.close(leader)  # the terminal goes away
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and proc.poll() is None:  # progress lines meanwhile
            step = json.loads(exp.path(".state.json").read_text()).get("step", 0)
            if step >= 300:
                break
            time.sleep(0.05)
    state = exp.state()
    assert state["status"] == "stopped" and state["step"] >= 300, state


def test_on_a_terminal_the_progress_line_is_rewritten_in_place(exp, cpu_binary):
    import pty
    leader, follower = pty.openpty()
    cfg = exp.config(steps=300)
    proc = subprocess.Popen(proxy_command(cfg, exp.run_dir, cpu_binary, "--no-server", "--progress-every", "0.1"),
                            stdin=follower, stdout=follower, stderr=follower, env=proxy_env())
    os.close(follower)
    out = b""
    while True:
        try:
            chunk = os.read(leader, 65536)
        except OSError:  # the other end closed: the proxy is gone
            break
        if not chunk:
            break
        out += chunk
    os.close(leader)
    assert proc.wait(60) == 0, out.decode(errors="replace")[-3000:]
    text = out.decode()
    rewrites = text.count("\r[proxy] ") + text.count("\rstep ")
    assert rewrites >= 2, text[-3000:]
    assert "\r\x1b[K" in text  # cleared before the next message
    for chunk in text.split("\rstep ")[1:]:
        assert "\n" not in chunk.split("\x1b[K")[0], chunk  # the progress line never ends a line
    assert "summary: step 300 of 300" in text


def test_the_engine_starts_with_the_forwarded_signals_blocked(exp, cpu_binary, tmp_path):
    """A SIGTERM forwarded in the moment between the launch and the engine's handlers must wait for
    them (the engine unblocks the signals once they are installed), not kill the engine."""
    seen = tmp_path / "sigblk"
    engine = tmp_path / "engine.py"
    engine.write_text(f"#!{sys.executable}\nimport os, sys\n"
                      f"if sys.argv[1:] == ['--flags-json']:\n    os.execv({str(cpu_binary)!r}, sys.argv[:1] + sys.argv[1:])\n"
                      f"status = open('/proc/self/status').read()\n"
                      f"open({str(seen)!r}, 'w').write([l for l in status.splitlines() if l.startswith('SigBlk')][0])\n"
                      f"sys.exit(2)\n")
    engine.chmod(0o755)
    p, rc = run_to_end(exp.config(steps=5), exp.run_dir, engine, "--no-server")
    assert rc == 2, p.describe()
    blocked = int(seen.read_text().split()[1], 16)
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):
        assert blocked & (1 << (sig - 1)), (sig, hex(blocked))


def test_a_refused_launch_holds_the_run_lock_while_it_cleans_up(tmp_path):
    """discard_launch let go of the run's lock, then removed what the launch had made (the whole
    run directory where it was new): a second proxy that took the lock in between had its run
    directory removed under it. The lock is now held until the clean-up is done."""
    import fcntl
    import types
    from microgpt.run_dir import RunFiles, lock_run
    from microgpt.supervisor import Run
    files = RunFiles(tmp_path / "run", "r")
    os.makedirs(files.dir)
    held_during_cleanup = []

    def remove_all_but(existed):
        with open(files.lock) as other:  # a second proxy's try
            try:
                fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
                held_during_cleanup.append(False)
            except BlockingIOError:
                held_during_cleanup.append(True)
        return "cleaned"

    run = types.SimpleNamespace(files=types.SimpleNamespace(remove_all_but=remove_all_but), existed=set(),
                                log=open(os.devnull), lock=lock_run(files.lock))
    assert Run.discard_launch(run) == "cleaned" and held_during_cleanup == [True]
    assert run.lock.closed
