"""The training proxy (docs/DESIGN.md §5), end to end with the real CPU engine: the proxy runs as a subprocess,
as a user runs it, on tiny configs (2 layers, d 32, seq 32, batch 2) that take a few seconds.
Plus unit tests of the loss log (torn tails, supersession) and of the config → flags mapping."""
import http.client
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import types

import pytest
import requests

from engine_util import build_shim
from proxy_util import (NAME, PROXY, REPO, Proxy, ProxyFixtureDir, live_train, live_val,
                        proxy_command, proxy_env, run_to_end)

from microgpt import config, engines, events, failure, loss_log, run_dir, run_view, supervisor
from microgpt.checkpoint import checkpoint_step

PROMPTS = ["A", "B"]  # GPT-2 ids 32 and 33: inside the tiny vocabulary


@pytest.fixture
def exp(tmp_path):
    return ProxyFixtureDir(tmp_path)


def assert_one_live_value_per_step(records):
    """docs/DESIGN.md §5: a step never shows two live values; and the live train steps are 1..N without a gap."""
    steps = [r["step"] for r in live_train(records)]
    assert steps == list(range(1, len(steps) + 1)), steps
    vsteps = [r["step"] for r in live_val(records)]
    assert len(vsteps) == len(set(vsteps)) and vsteps == sorted(vsteps), vsteps


# ---------------------------------------------------------------------------------------------------
# The loss log on its own


def write_log(path, n):
    log = loss_log.LossLog(str(path))
    log.append([{"step": i, "loss": 10.0 / i, "time": 1.5} for i in range(1, n + 1)])
    log.append([{"step": n, "val_loss": 3.25}])
    log.close()
    return path.read_bytes()


def test_loss_log_appends_without_rewriting(tmp_path):
    path = tmp_path / "x.loss.json"
    data = write_log(path, 3)
    log = loss_log.LossLog(str(path))
    log.append([{"step": 4, "loss": 1.0}])
    log.close()
    grown = path.read_bytes()
    # Everything before the old closing "\n]" is untouched: the file grew, it was not rewritten.
    assert grown.startswith(data[:-2]) and len(grown) > len(data)
    recs = json.loads(grown)
    assert [r["step"] for r in recs] == [1, 2, 3, 3, 4] and all(r["live"] == 1 for r in recs)


def test_loss_log_repairs_a_tail_torn_anywhere(tmp_path):
    """Cut the file at every byte: opening must always give valid JSON holding a prefix of the
    records, and appending must work afterwards."""
    path = tmp_path / "x.loss.json"
    data = write_log(path, 4)
    full = json.loads(data)
    for cut in range(len(data) + 1):
        path.write_bytes(data[:cut])
        log = loss_log.LossLog(str(path))
        recs = json.loads(path.read_bytes())
        assert recs == full[:len(recs)], cut
        # Only a torn record may be lost: every record whose closing "}" is before the cut survives.
        assert len(recs) == data[:cut].count(b"}"), cut
        log.append([{"step": 99, "loss": 0.5}])
        log.close()
        assert json.loads(path.read_bytes())[-1]["step"] == 99, cut


def test_loss_log_repairs_nul_bytes_left_by_a_crash(tmp_path):
    path = tmp_path / "x.loss.json"
    data = write_log(path, 3)
    path.write_bytes(data[:-2] + b",\n" + b"\0" * 300)
    loss_log.LossLog(str(path)).close()
    assert [r["step"] for r in json.loads(path.read_bytes())] == [1, 2, 3, 3]


def assert_refused_untouched(path, damaged, words):
    path.write_bytes(damaged)
    with pytest.raises(loss_log.LossLogError, match=words):
        loss_log.LossLog(str(path))
    assert path.read_bytes() == damaged  # nothing was cut


def test_loss_log_refuses_damage_that_is_not_a_torn_tail(tmp_path):
    path = tmp_path / "x.loss.json"
    data = write_log(path, 5)
    damaged = data.replace(b'"step":2,', b'"step":2#')  # corrupt the middle, keep the tail valid
    assert damaged != data
    assert_refused_untouched(path, damaged, "not at the end")


@pytest.mark.parametrize("constant", [b"NaN", b"Infinity", b"-Infinity"])
def test_loss_log_refuses_a_record_no_browser_can_parse(tmp_path, constant):
    """Python's json takes NaN and Infinity, JSON.parse does not: a hand-edited loss of NaN passed
    the full validation, and every dashboard answer holding that record failed to parse. (A NaN
    in a whole array went on to the layout rewrite and a ValueError traceback.)"""
    path = tmp_path / "x.loss.json"
    data = write_log(path, 5)
    for damaged in (data.replace(b'"loss":5.0', b'"loss":' + constant),  # in the log's own layout
                    b"[" + data[1:].replace(b'"loss":5.0', b'"loss":' + constant).replace(b"\n", b" ")):
        assert damaged != data
        assert_refused_untouched(path, damaged, None)


DEEP = b"[" * 100000 + b"]" * 100000  # deeper than Python's json can parse (RecursionError)
UNTORN = "line 7 is not a complete record.*no crash tore it"


@pytest.mark.parametrize("damage, words", [
    (lambda data: data.replace(b'"val_loss":3.25', b'"val_loss":NaN'), UNTORN),
    (lambda data: data.replace(b'"val_loss":3.25}', b'"val_loss":3.25#'), UNTORN),
    (lambda data: data.replace(b'"val_loss":3.25', b'"val_loss":3.25x') + b"\n", UNTORN),
    (lambda data: data.replace(b'"val_loss":3.25', b'"val_loss":' + DEEP), UNTORN),
    (lambda data: data.replace(b'"step":2,', b'"step":2,"x":' + DEEP + b","),
     "line 3 is not a complete record.*not at the end"),
], ids=["nan-last", "byte-last", "byte-last-newline", "deep-last", "deep-middle"])
def test_loss_log_refuses_damage_it_cut_as_torn_or_crashed_on(tmp_path, damage, words):
    """A torn append ends before the log's closing "]" (or holds a file system's NUL bytes): a last
    record damaged with the closing whole after it was edited, and was cut as torn, lost. A record
    nested too deeply for Python's json was a RecursionError, past every ValueError handler."""
    path = tmp_path / "x.loss.json"
    assert_refused_untouched(path, damage(write_log(path, 5)), words)


def test_json_nested_too_deeply_is_a_value_error_to_the_log_readers():
    """--serve's reader of a run's log (run_view) let the RecursionError through too."""
    with pytest.raises(ValueError, match="nested too deeply"):
        loss_log.parse_json(DEEP)
    assert run_view._whole_records([b'{"live":1}', b'{"live":1,"x":' + DEEP + b"}", b'{"live":1}']) == 1


@pytest.mark.parametrize("step", [2, 5])
def test_loss_log_refuses_a_record_naming_a_key_twice(tmp_path, step):
    """Python's json keeps the last of a key given twice, other readers may keep the first: a
    record that names one twice, in the middle or the last, is refused, never cut or taken."""
    path = tmp_path / "x.loss.json"
    data = write_log(path, 5)
    damaged = data.replace(b'"step":%d,' % step, b'"step":%d,"step":9,' % step)
    assert damaged != data
    assert_refused_untouched(path, damaged, 'the key "step" appears twice')


def test_a_loss_log_with_a_carriage_return_in_a_record_is_rewritten_into_the_layout(tmp_path):
    """JSON takes a "\r" as a blank, so the record was indexed whole, and served raw in the live
    event stream, where "\r" ends a line: the browser's parse of that event failed. Such a log is
    valid JSON in another layout, rewritten once into ours."""
    path = tmp_path / "x.loss.json"
    data = write_log(path, 5)
    path.write_bytes(data.replace(b'"step":3,', b'"step":3,\r'))
    log = loss_log.LossLog(str(path))
    assert log.message.endswith("rewrote into the one-record-per-line layout")
    assert path.read_bytes() == data and len(log) == 6  # five steps and a validation record
    log.close()


def test_loss_log_refuses_to_erase_a_torn_file_in_another_layout(tmp_path):
    path = tmp_path / "x.loss.json"
    pretty = json.dumps([{"step": i, "loss": 1.0 / i} for i in range(1, 4)], indent=2).encode()
    torn = pretty[:len(pretty) * 2 // 3]  # no line of it is a whole record
    path.write_bytes(torn)
    with pytest.raises(loss_log.LossLogError, match="no line of it is a complete record"):
        loss_log.LossLog(str(path))
    assert path.read_bytes() == torn  # nothing was erased


def test_loss_log_supersede_marks_in_place(tmp_path):
    path = tmp_path / "x.loss.json"
    write_log(path, 6)
    log = loss_log.LossLog(str(path))
    size = path.stat().st_size
    assert log.supersede_after(4) == 3  # steps 5, 6 and the val record at 6
    assert path.stat().st_size == size  # one byte per record changed, nothing rewritten
    log.append([{"event": "resume", "step": 4}, {"step": 5, "loss": 2.0}])
    assert log.supersede_after(5) == 0  # stops at the first live record at or below the step
    log.close()
    recs = json.loads(path.read_bytes())
    assert [(r["step"], r["live"]) for r in recs if "loss" in r] == [
        (1, 1), (2, 1), (3, 1), (4, 1), (5, 0), (6, 0), (5, 1)]
    assert_one_live_value_per_step(recs)


def test_loss_log_rewrites_a_hand_edited_array_into_its_layout(tmp_path):
    path = tmp_path / "x.loss.json"
    path.write_text(json.dumps([{"step": 1, "loss": 2.0}, {"step": 2, "loss": 1.0, "live": 0}], indent=2))
    log = loss_log.LossLog(str(path))
    assert "rewrote" in log.message
    log.append([{"step": 2, "loss": 1.5}])
    log.close()
    recs = json.loads(path.read_bytes())
    assert [(r["step"], r["live"]) for r in recs] == [(1, 1), (2, 0), (2, 1)]


def test_loss_log_serves_raw_ranges(tmp_path):
    path = tmp_path / "x.loss.json"
    write_log(path, 5)
    log = loss_log.LossLog(str(path))
    body, nxt = log.read_json(2, 2)
    assert nxt == 4 and [r["step"] for r in json.loads(body)] == [3, 4]
    body, nxt = log.read_json(4, 100)
    assert nxt == 6 and [r["step"] for r in json.loads(body)] == [5, 5]
    assert log.read_json(6, 10) == (b"[]", 6)
    log.close()


# ---------------------------------------------------------------------------------------------------
# Config validation and the config → flags mapping


@pytest.fixture(scope="module")
def flags(cpu_binary):
    """The engine's flag table, as the proxy reads it (`ENGINE --flags-json`)."""
    return engines.engine_flags(str(cpu_binary))


def test_engine_args_are_the_dotted_keys(flags):
    cfg = {"name": "x", "model": {"n_layer": 6, "d_model": 192, "n_head": 6, "seq_len": 512},
           "train": {"steps": 100, "lr": 6e-4, "precision": "bf16"},
           "data": {"train": "data/megachat/megachat_train_*.bin", "val": "/abs/val_*.bin"},
           "sample": {"every": 5, "prompts": ["a", "b"]}}
    config.validate_config(cfg, flags)
    args = config.engine_args(cfg, flags, [[64], [65, 66]], "/r/x.ckpt", resume=True)
    pairs = dict(zip(args[::2], args[1::2]))
    assert pairs["--name"] == "x" and pairs["--model.n_layer"] == "6"
    assert float(pairs["--train.lr"]) == 6e-4 and pairs["--train.precision"] == "bf16"
    assert pairs["--data.train"] == str(REPO / "data/megachat/megachat_train_*.bin")  # repo-relative
    assert pairs["--data.val"] == "/abs/val_*.bin"
    assert [args[i + 1] for i, a in enumerate(args) if a == "--sample.prompt"] == ["64", "65,66"]
    assert "--sample.prompts" not in args and pairs["--checkpoint"] == "/r/x.ckpt"
    assert args[-1] == "--resume"


def test_a_sample_prompt_holding_a_lone_surrogate_is_refused(flags):
    """Valid JSON ("\\ud83d") reads as a lone surrogate, which tiktoken encodes as U+FFFD without a
    word: with the full vocabulary the run sampled a continuation of a prompt no one wrote."""
    cfg = {"name": "x", "model": {"n_layer": 1, "d_model": 8, "n_head": 2, "seq_len": 64},
           "train": {"steps": 2}, "data": {"train": "a"}, "sample": {"every": 1, "prompts": ["A", "B\ud83d"]}}
    config.validate_config(cfg, flags)
    with pytest.raises(config.ConfigError, match=r'"sample.prompts\[1\]" holds a lone UTF-16 surrogate'):
        config.tokenize_prompts(cfg, flags)


@pytest.mark.parametrize("setting, shown, words", [
    ({"lr": [0] * 100_000}, "[0, 0, 0", "must be a number, not"),
    ({"schedule": "y" * 100_000}, '"yyy', "must be one of"),
    ({"beta1": 10**4000}, "1000", "must be at most 0.999999, not"),
    ({"seed": -(10**4000)}, "-1000", "must be at least 0, not"),
])
def test_a_long_wrong_value_is_cut_short_in_the_error(flags, setting, shown, words):
    """Quoted whole, a list pasted into the wrong key made the one error line megabytes long."""
    cfg = {"name": "x", "model": {"n_layer": 1, "d_model": 8, "n_head": 2, "seq_len": 64},
           "train": {"steps": 2, **setting}, "data": {"train": "a"}}
    with pytest.raises(config.ConfigError) as e:
        config.validate_config(cfg, flags)
    message = str(e.value)
    assert words in message and shown in message and len(message) < 200, message[:300]
    assert "characters" in message


def test_a_config_is_read_as_utf8_whatever_the_locale(tmp_path):
    """JSON is UTF-8 (RFC 8259): under an ASCII locale a config holding "é" was "not valid JSON",
    under a Latin-1 one its strings were read as other text."""
    path = tmp_path / "e.json"
    path.write_bytes('{"name": "x", "description": "café"}'.encode())
    env = {**proxy_env(), "LC_ALL": "C", "PYTHONCOERCECLOCALE": "0", "PYTHONUTF8": "0"}
    res = subprocess.run([sys.executable, "-c", "import sys; from microgpt.config import read_config; "
                          "print(ascii(read_config(sys.argv[1])['description']))", str(path)],
                         capture_output=True, text=True, env=env, timeout=60)
    assert res.returncode == 0 and res.stdout.strip() == ascii("café"), res.stderr


def test_every_dotted_engine_flag_is_a_config_key(flags):
    """The config's keys come from the engine's table, not a copy: a config that sets every dotted
    flag (but the token-id prompts) validates, and each becomes exactly its own flag."""
    def value(f):
        if f["choices"]:
            return f["choices"][-1]
        return {"int": f["min"], "float": f["min"], "bool": True}.get(f["type"], "x")
    dotted = {n: f for n, f in flags.items() if "." in n and f["type"] != "prompt"}
    assert len(dotted) > 30 and "train.decay_frac" in dotted
    # a list's fields ("data.sources.N.train") fill one item; data.sources excludes data.train (one_of)
    item_fields = [n for n, f in dotted.items() if f.get("items")]
    plain = [n for n, f in dotted.items() if not f.get("items") and not f.get("one_of")]
    assert "data.sources.N.train" in item_fields and flags["data.train"]["one_of"] == ["data.train", "data.sources"]
    cfg = {"name": "x"}
    for name in plain:
        section, key = name.split(".")
        cfg.setdefault(section, {})[key] = value(flags[name])
    for name in item_fields:
        (section, key), field = name.partition(".N.")[0].split("."), name.partition(".N.")[2]
        cfg.setdefault(section, {}).setdefault(key, [{}])[0][field] = value(flags[name])
    config.validate_config(cfg, flags)
    args = config.engine_args(cfg, flags, [], "/r/x.ckpt", resume=False)
    given = [a[2:] for a in args if a.startswith("--")]
    assert sorted(given) == sorted(plain + [n.replace(".N.", ".0.") for n in item_fields] + ["name", "checkpoint"])


@pytest.mark.parametrize("change, message", [
    ({"trian": {}}, 'unknown key "trian"'),
    ({"train": {"steps": 5, "lrr": 0.1}}, 'unknown key "train.lrr"'),
    ({"train": {"steps": 5, "lr": "fast"}}, '"train.lr" must be a number'),
    ({"train": {"steps": True}}, '"train.steps" must be an integer'),
    ({"train": {"steps": 2.5}}, '"train.steps" must be an integer'),
    ({"train": {"steps": 5, "schedule": "linear"}}, '"train.schedule" must be one of cosine, wsd'),
    ({"train": {"steps": 5, "beta1": 1.5}}, '"train.beta1" must be at most 0.999999, not 1.5'),
    # Python's json reads NaN, and every range check passes it: the engine refused it after launch
    ({"train": {"steps": 5, "lr": float("nan")}}, '"train.lr" must be a number, not NaN'),
    ({"data": {"sources": [{"train": "a", "weight": float("nan")}]}},
     '"data.sources[0].weight" must be a number, not NaN'),
    ({"train": {"steps": 5, "weight_decay": float("inf")}}, '"train.weight_decay" must be at most 1e+30, not Infinity'),
    ({"train": {"steps": 0}}, '"train.steps" must be at least 1, not 0'),
    ({"data": {"train": 7}}, '"data.train" must be a glob pattern, not 7'),
    ({"model": {"d_model": 32, "n_head": 2, "seq_len": 32}}, 'missing key "model.n_layer"'),
    ({"sample": {"prompts": "A"}}, '"sample.prompts" must be a list of strings'),
    ({"sample": {"prompt": "1,2"}}, 'unknown key "sample.prompt"'),  # the engine's ids: not a key
    ({"sample": {"prompts": ["A", "a"]}}, '"sample.prompts[1]" has token id 64'),
    ({"polish": {"start_step": 3, "lr": 0.1}}, 'missing key "polish.train"'),
    ({"resume": True}, 'unknown key "resume"'),  # a flag the proxy sets itself, not a config key
    # a dotted key written flat passed the checks and was never read: the run trained at the default lr
    ({"train.lr": 0.5}, 'unknown key "train.lr" at the top level (a dotted key is nested: "train": {"lr": ...})'),
    ({"sample.prompts": ["A"]}, 'unknown key "sample.prompts" at the top level'),
    ({"name": "../evil"}, '"name" must be letters'),
    ({"name": 3}, '"name" must be a non-empty string'),
    # "" is a string: "must be a string, not \"\"" said the opposite of what is wrong
    ({"train": {"steps": 5, "fp8_classifier": ""}}, '"train.fp8_classifier" must be a non-empty string, not ""'),
    # a NUL cannot be in a command-line argument: it was "proxy failed: ValueError" and exit 1
    ({"data": {"train": "a\u0000b"}}, '"data.train" must not contain a NUL character'),
    # valid JSON, but no text: launching the engine was "proxy failed: UnicodeEncodeError", the
    # run directory left behind
    ({"data": {"train": "a\ud800b"}}, '"data.train" holds a lone UTF-16 surrogate'),
])
def test_bad_config_is_one_clear_error_naming_the_key(exp, cpu_binary, change, message):
    """Validated before anything is launched or created: exit 2, one line, the key named."""
    cfg = exp.config(steps=5)
    data = json.loads(cfg.read_text())
    for key, value in change.items():
        data[key] = value
    cfg.write_text(json.dumps(data))
    res = subprocess.run([sys.executable, str(PROXY), str(cfg), "--engine-binary", str(cpu_binary),
                          "--run-dir", str(exp.run_dir)], capture_output=True, text=True,
                         env=proxy_env(), timeout=60)
    assert res.returncode == 2, res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], res.stderr
    assert not exp.run_dir.exists()


def test_missing_engine_is_a_clear_error(exp):
    res = subprocess.run([sys.executable, str(PROXY), str(exp.config(steps=5)), "--engine-binary",
                          str(exp.root / "nope")], capture_output=True, text=True, env=proxy_env(), timeout=60)
    assert res.returncode == 2 and "not found or not executable" in res.stderr


def test_engine_without_a_flag_table_is_a_clear_error(exp):
    """An engine that cannot answer --flags-json (an old build, a wrong binary): one line, rebuild."""
    res = subprocess.run([sys.executable, str(PROXY), str(exp.config(steps=5)), "--engine-binary",
                          "/bin/true"], capture_output=True, text=True, env=proxy_env(), timeout=60)
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2 and len(lines) == 1 and "--flags-json" in lines[0], res.stderr
    assert "make" in lines[0]


# ---------------------------------------------------------------------------------------------------
# Choosing the engine: the GPU engine when it can run, else the CPU engine with a warning


def fake_engines(tmp_path, cuda=True, cpu=True):
    engines = {"cuda": tmp_path / "microgpt_cuda", "cpu": tmp_path / "microgpt_cpu"}
    for kind, built in (("cuda", cuda), ("cpu", cpu)):
        if built:
            engines[kind].write_text("#!/bin/sh\n")
            engines[kind].chmod(0o755)
    return {k: str(v) for k, v in engines.items()}


@pytest.mark.parametrize("requested, gpu, cuda, want, warning", [
    (None, True, True, "cuda", None),
    (None, False, True, "cpu", "no GPU visible"),
    (None, True, False, "cpu", "microgpt_cuda is not built"),
    ("cuda", True, True, "cuda", None),
    ("cpu", True, True, "cpu", None),
])
def test_engine_choice(tmp_path, requested, gpu, cuda, want, warning):
    binaries = fake_engines(tmp_path, cuda=cuda)
    path, said = engines.choose_engine(requested, gpu, binaries)
    assert path == binaries[want]
    if warning:
        assert warning in said and "--engine cuda forces" in said and binaries["cpu"] in said
    else:
        assert said is None


@pytest.mark.parametrize("requested, gpu, cuda, cpu, message", [
    ("cuda", False, True, True, "--engine cuda: no GPU visible"),
    ("cuda", True, False, True, "--engine cuda: " + "{cuda} is not built; run `make`"),
    ("cpu", False, True, False, "{cpu} is not built; run `make`"),
    (None, False, True, False, "{cpu} is not built; run `make`"),
])
def test_engine_choice_errors(tmp_path, requested, gpu, cuda, cpu, message):
    binaries = fake_engines(tmp_path, cuda=cuda, cpu=cpu)
    with pytest.raises(engines.EngineChoiceError) as e:
        engines.choose_engine(requested, gpu, binaries)
    assert message.format(**binaries) in str(e.value)


@pytest.fixture
def no_gpu_env(tmp_path):
    """The proxy's environment with an `nvidia-smi` that finds no GPU, as on CI (and even on the GPU
    machine, so this path is tested everywhere)."""
    bin_dir = tmp_path / "fake-bin"
    bin_dir.mkdir()
    smi = bin_dir / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho 'NVIDIA-SMI has failed' >&2\nexit 9\n")
    smi.chmod(0o755)
    env = proxy_env()
    env["PATH"] = f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"
    return env


def test_without_a_gpu_the_default_engine_falls_back_to_cpu(exp, cpu_binary, no_gpu_env):
    assert str(cpu_binary) == engines.ENGINES["cpu"], "needs the repository's build/microgpt_cpu"
    res = subprocess.run([sys.executable, str(PROXY), str(exp.config(steps=12)), "--run-dir",
                          str(exp.run_dir), "--no-server"], capture_output=True, text=True,
                         env=no_gpu_env, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    warnings = [ln for ln in res.stderr.splitlines() if ln.startswith("warning:")]
    assert len(warnings) == 1 and "no GPU visible" in warnings[0] and "--engine cuda" in warnings[0]
    st = exp.state()
    assert st["status"] == "finished" and st["engine"] == engines.ENGINES["cpu"]


def test_engine_cuda_without_a_usable_gpu_engine_is_an_error(exp, no_gpu_env):
    res = subprocess.run([sys.executable, str(PROXY), str(exp.config(steps=3)), "--engine", "cuda",
                          "--run-dir", str(exp.run_dir)], capture_output=True, text=True,
                         env=no_gpu_env, timeout=60)
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2 and len(lines) == 1, res.stderr
    assert lines[0].startswith("error: --engine cuda: ") and ("no GPU" in lines[0] or "make" in lines[0])
    assert not exp.run_dir.exists()


@pytest.mark.parametrize("number", ["1e-400", "-2.5e-330"])
def test_a_config_number_too_small_for_a_float_is_refused_not_taken_as_0(exp, cpu_binary, number):
    """Python's json reads 1e-400 as 0.0 without a word, and 0 means "off" to grad_clip: the run
    trained unclipped. A nonzero number that a float holds as 0 is one clear error."""
    cfg = exp.config(steps=5)
    cfg.write_text(cfg.read_text().replace('"train": {', '"train": {"grad_clip": ' + number + ", ", 1))
    res = subprocess.run([sys.executable, str(PROXY), str(cfg), "--engine-binary", str(cpu_binary),
                          "--run-dir", str(exp.run_dir)], capture_output=True, text=True,
                         env=proxy_env(), timeout=60)
    assert res.returncode == 2 and res.stderr.count("\n") == 1, res.stderr
    assert f"{number} is too small for a float" in res.stderr and not exp.run_dir.exists()


def test_a_config_the_engine_refuses_leaves_nothing_behind(exp, cpu_binary):
    """A config the proxy accepts but the engine refuses (n_head must divide d_model; a missing
    shard): the engine's own error line reaches the user once, the exit code is the engine's, and
    neither a new run directory nor a word about resuming is left behind."""
    # steps 20: at 5, below the config's 10 warmup steps, the engine refused that rule first, and
    # the missing shard was never looked for
    for sections, cause in (({"model": {"n_head": 3}}, "n_head"),
                            ({"data": {"train": str(exp.root / "missing_*.bin")}}, "missing_")):
        p, rc = run_to_end(exp.config(steps=20, **sections), exp.run_dir, cpu_binary)
        assert rc == 2, p.describe()
        errors = [line for line in p.err if line.startswith("error")]
        assert len(errors) == 1 and cause in errors[0], p.describe()
        assert not any("resume" in line for line in p.out + p.err), p.describe()
        assert any("the engine refused to start" in line for line in p.out), p.describe()
        assert not exp.run_dir.exists(), os.listdir(exp.run_dir)


def test_a_weight_decay_past_1_over_lr_is_the_engines_to_refuse(exp, cpu_binary):
    """The proxy checks each key against the engine's table and leaves rules between flags to the
    engine, which refuses at launch: train.lr 3e-3 with weight_decay 1000 (AdamW's decay factor
    1 - lr * weight_decay = -2) trained, every weight flipped each step. One error line, exit 2."""
    p, rc = run_to_end(exp.config(steps=5, train={"warmup_steps": 0, "weight_decay": 1000}), exp.run_dir, cpu_binary)
    errors = [line for line in p.err if line.startswith("error")]
    assert rc == 2 and len(errors) == 1 and "train.weight_decay" in errors[0], p.describe()
    assert not exp.run_dir.exists(), os.listdir(exp.run_dir)


def test_a_refused_relaunch_leaves_the_run_as_it_was(exp, cpu_binary):
    cfg = exp.config(steps=10, sample={"every": 5, "prompts": PROMPTS})
    p, rc = run_to_end(cfg, exp.run_dir, cpu_binary)
    assert rc == 0, p.describe()
    def contents():  # the lock file holds the pid of the last proxy to take it: not run data
        return {f: (exp.run_dir / f).read_bytes() for f in sorted(os.listdir(exp.run_dir)) if f != f"{NAME}.lock"}
    before = contents()
    p, rc = run_to_end(exp.config(steps=20, model={"n_head": 3}), exp.run_dir, cpu_binary)
    assert rc == 2 and f"{exp.run_dir} is as it was" in "".join(p.out), p.describe()
    assert contents() == before


def test_a_refused_relaunch_leaves_no_dashboard_token_behind(exp, cpu_binary):
    """A run trained without the dashboard, relaunched with it and a config the engine refuses:
    the token file the server made for that launch stayed in the run directory, which the proxy
    said was "as it was"."""
    p, rc = run_to_end(exp.config(steps=10), exp.run_dir, cpu_binary, "--no-server")
    assert rc == 0, p.describe()
    before = sorted(os.listdir(exp.run_dir))
    p, rc = run_to_end(exp.config(steps=20, model={"n_head": 3}), exp.run_dir, cpu_binary)
    assert rc == 2 and f"{exp.run_dir} is as it was" in "".join(p.out), p.describe()
    assert sorted(os.listdir(exp.run_dir)) == before


def test_resuming_with_a_changed_config_says_what_changed(exp, cpu_binary):
    p, rc = run_to_end(exp.config(steps=20), exp.run_dir, cpu_binary, "--no-server")
    assert rc == 0, p.describe()
    p, rc = run_to_end(exp.config(steps=30, train={"lr": 1e-3}, description="longer"), exp.run_dir,
                       cpu_binary, "--no-server")
    assert rc == 0, p.describe()
    said = [line for line in p.out if "config changed" in line]
    assert said == ["[proxy] the config changed since the last launch: description (none) -> "
                    '"longer", train.lr 0.003 -> 0.001, train.steps 20 -> 30\n'], p.describe()
    recs = exp.loss()
    change = [r for r in recs if r.get("event") == "config"]
    assert len(change) == 1 and change[0]["step"] == 20 and change[0]["seg"] == 2
    assert change[0]["changed"] == {"description": [None, "longer"], "train.lr": [0.003, 0.001],
                                    "train.steps": [20, 30]}
    resume = recs.index(change[0]) - 1
    assert recs[resume]["event"] == "resume" and recs[resume]["step"] == 20
    assert [r["step"] for r in live_train(recs)] == list(range(1, 31))
    p, rc = run_to_end(exp.config(steps=40, train={"lr": 1e-3}, description="longer"), exp.run_dir,
                       cpu_binary, "--no-server")
    assert rc == 0 and [r for r in exp.loss() if r.get("event") == "config"][-1]["changed"] == {
        "train.steps": [30, 40]}, p.describe()


# ---------------------------------------------------------------------------------------------------
# Runs end to end


def test_run_finishes_then_says_so(exp, cpu_binary):
    cfg = exp.config(steps=40, sample={"every": 20, "tokens": 8, "prompts": PROMPTS})
    p, rc = run_to_end(cfg, exp.run_dir, cpu_binary)
    assert rc == 0, p.describe()
    st = exp.state()
    assert st["status"] == "finished" and st["step"] == 40 and st["phase"] == "pretrain"
    assert st["checkpoint_step"] == 40 and st["pid"] is None and st["tokens"] == 40 * 2 * 32
    assert st["config"]["name"] == NAME
    recs = exp.loss()
    assert_one_live_value_per_step(recs)
    train = live_train(recs)
    assert len(train) == 40 and all({"loss", "lr", "grad_norm", "tokens", "time", "elapsed"} <= r.keys()
                                    for r in train)
    assert [r["step"] for r in live_val(recs)] == [10, 20, 30, 40]
    assert recs[0]["event"] == "start"
    samples = json.loads(exp.path(".samples.json").read_text())
    assert [(s["step"], s["prompt"]) for s in samples] == [(20, "A"), (20, "B"), (40, "A"), (40, "B")]
    # decoded text, not ids: tiny-vocabulary ids are single printable characters
    assert all(isinstance(s["text"], str) and len(s["text"]) == 8 and " " not in s["text"] for s in samples)

    p, rc = run_to_end(cfg, exp.run_dir, cpu_binary, "--no-server")
    assert rc == 0 and any("already finished" in line for line in p.out), p.describe()
    assert not any("dashboard:" in line for line in p.out)
    assert exp.loss() == recs  # nothing was launched, nothing logged

    # a flipped bit in the header's step (40 -> 104) is no finished run: the sidecar says 40, and
    # the engine, launched, refuses the checkpoint (the proxy had marked the run finished at 104)
    ckpt = exp.path(".ckpt")
    good = ckpt.read_bytes()
    ckpt.write_bytes(bytes([good[0] ^ 0x40]) + good[1:])
    p, rc = run_to_end(exp.config(steps=80, eval={"every": 10, "batches": 2}), exp.run_dir, cpu_binary, "--no-server")
    assert rc != 0 and not any("already finished" in line for line in p.out), p.describe()
    assert (exp.state()["step"], exp.state()["checkpoint_step"]) == (40, 40)  # the state as it was
    assert ckpt.read_bytes()[1:] == good[1:]  # refused, not rewritten
    ckpt.write_bytes(good)

    # --keep-serving: look at a finished run until Ctrl-C
    p = Proxy.start(cfg, exp.run_dir, cpu_binary, "--keep-serving")
    url, token = p.url_and_token()
    p.wait_output("still serving")
    assert requests.get(url + "api/state", params={"token": token}, timeout=10).json()["status"] == "finished"
    p.proc.send_signal(signal.SIGINT)
    assert p.wait() == 0


def test_sigterm_stops_with_a_checkpoint_and_rerun_resumes_exactly(tmp_path, cpu_binary):
    """Stop twice and resume; the live losses must equal an uninterrupted run's, bit for bit."""
    exp = ProxyFixtureDir(tmp_path / "interrupted")
    cfg = exp.config(steps=10**6, checkpoint={"every": 0})
    for round_ in range(3):
        p = Proxy.start(cfg, exp.run_dir, cpu_binary)
        target = 30 * (round_ + 1)
        p.wait_state(lambda s: s.get("status") == "running" and s.get("step", 0) >= target)
        assert p.stop() == 0, p.describe()
        st = exp.state()
        assert st["status"] == "stopped" and st["pid"] is None, st
        step = checkpoint_step(exp.path(".ckpt"))
        assert st["checkpoint_step"] == step == st["step"] == live_train(exp.loss())[-1]["step"]
        assert any("stopped at step" in line for line in p.out)
    recs = exp.loss()
    assert_one_live_value_per_step(recs)
    resumes = [r for r in recs if r.get("event") == "resume"]
    assert len(resumes) == 2 and [r["seg"] for r in resumes] == [2, 3]

    straight = ProxyFixtureDir(tmp_path / "straight")
    p = Proxy.start(straight.config(steps=10**6, checkpoint={"every": 0}), straight.run_dir, cpu_binary)
    p.wait_state(lambda s: s.get("step", 0) >= 40)
    assert p.stop() == 0
    a, b = live_train(recs), live_train(straight.loss())
    n = min(len(a), len(b))
    assert n >= 40
    assert [r["loss"] for r in a[:n]] == [r["loss"] for r in b[:n]]


def test_a_closed_terminal_stops_with_a_checkpoint(exp, cpu_binary):
    """SIGHUP (the terminal closed: an ssh session dropped, the window shut) killed the proxy on the
    spot; the engine, in a session of its own, trained on until its next write to the gone proxy
    failed, and ended without a checkpoint: the steps since the last one were lost and the run was
    left "running". SIGHUP is now a stop like SIGTERM: the engine checkpoints, the run is stopped."""
    p = Proxy.start(exp.config(steps=10**6, checkpoint={"every": 0}), exp.run_dir, cpu_binary)
    p.wait_state(lambda s: s.get("status") == "running" and s.get("step", 0) >= 10)
    assert not exp.path(".ckpt").exists()
    p.proc.send_signal(signal.SIGHUP)
    assert p.wait() == 0, p.describe()
    st = exp.state()
    assert st["status"] == "stopped" and st["pid"] is None, st
    assert st["checkpoint_step"] == checkpoint_step(exp.path(".ckpt")) == live_train(exp.loss())[-1]["step"] >= 10
    assert any("SIGHUP: asked the engine to checkpoint and stop" in line for line in p.out), p.describe()


def test_under_nohup_a_closed_terminal_leaves_the_run_training(exp, cpu_binary):
    """`nohup` starts a program with SIGHUP ignored so that it goes on when the terminal closes; the
    proxy's own handler took it as a stop all the same. Started so, it trains on until stopped."""
    cmd = proxy_command(exp.config(steps=10**6, checkpoint={"every": 0}), exp.run_dir, cpu_binary, "--no-server")
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=proxy_env(),
                            preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_IGN))
    try:
        deadline = time.monotonic() + 60
        while not exp.path(".state.json").exists() or exp.state().get("step", 0) < 10:
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.05)
        proc.send_signal(signal.SIGHUP)
        hup_step = exp.state()["step"]
        while exp.state().get("step", 0) < hup_step + 50:
            assert time.monotonic() < deadline and proc.poll() is None, exp.state()
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    assert exp.state()["status"] == "stopped"


def test_sigusr1_is_forwarded_and_training_continues(exp, cpu_binary):
    p = Proxy.start(exp.config(steps=10**6, checkpoint={"every": 0}), exp.run_dir, cpu_binary)
    p.wait_state(lambda s: s.get("step", 0) >= 10)
    assert not exp.path(".ckpt").exists()
    p.proc.send_signal(signal.SIGUSR1)
    st = p.wait_state(lambda s: s.get("checkpoint_step") is not None)
    taken = st["checkpoint_step"]
    assert checkpoint_step(exp.path(".ckpt")) == taken
    p.wait_state(lambda s: s.get("step", 0) > taken + 10 and s["status"] == "running")
    assert p.stop() == 0


def test_engine_killed_by_an_unnamed_signal_is_crashed(exp, cpu_binary, tmp_path):
    """Real-time signals between SIGRTMIN and SIGRTMAX have no name in Python's signal module."""
    engine = tmp_path / "engine.sh"
    engine.write_text(f'#!/bin/sh\n[ "$1" = --flags-json ] && exec {cpu_binary} --flags-json\nkill -40 $$\n')
    engine.chmod(0o755)
    p, rc = run_to_end(exp.config(steps=5), exp.run_dir, engine)
    assert rc == 1, p.describe()
    st = exp.state()
    assert st["status"] == "crashed" and st["message"] == "engine killed by signal 40", st


def test_proxy_failure_stops_the_engine_with_a_checkpoint(exp, cpu_binary, tmp_path):
    """A failure of the proxy (here: a polish event whose archive cannot be made, a file standing
    where its directory goes; a record of the wrong types, the failure this test used before, is a
    warning now) must not leave the engine training unobserved: the engine gets SIGTERM,
    checkpoints and exits; the run is marked crashed and the proxy exits 1 with one error line. The
    double wraps the real engine so the checkpoint on SIGTERM is the real one."""
    pidfile = tmp_path / "engine.pid"
    engine = tmp_path / "engine.py"
    engine.write_text(f"""#!{sys.executable}
import os, signal, subprocess, sys
cpu = {str(cpu_binary)!r}
if sys.argv[1:] == ["--flags-json"]:
    os.execv(cpu, [cpu, "--flags-json"])
child = subprocess.Popen([cpu] + sys.argv[1:], stdout=subprocess.PIPE)
open({str(pidfile)!r}, "w").write(str(child.pid))
signal.signal(signal.SIGTERM, lambda *_: child.send_signal(signal.SIGTERM))
signal.pthread_sigmask(signal.SIG_UNBLOCK, {{signal.SIGTERM}})  # the proxy launches engines with it blocked
trains = 0
for line in child.stdout:
    sys.stdout.buffer.write(line)
    trains += b'"loss"' in line
    if trains == 20:
        sys.stdout.buffer.write(b'{{"event": "polish", "step": 20}}\\n')
    sys.stdout.flush()
sys.exit(child.wait())
""")
    engine.chmod(0o755)
    exp.run_dir.mkdir()
    (exp.run_dir / "archive").write_text("not a directory")
    p, rc = run_to_end(exp.config(steps=10**6, checkpoint={"every": 0}), exp.run_dir, engine)
    assert rc == 1, p.describe()
    errors = [line for line in p.err if line.startswith("error")]
    assert len(errors) == 1 and "proxy failed: NotADirectoryError" in errors[0], p.describe()
    st = exp.state()
    step = checkpoint_step(exp.path(".ckpt"))  # checkpoint every 0: only SIGTERM makes one
    assert step >= 20 and st["checkpoint_step"] == step, (step, st)
    assert st["status"] == "crashed" and st["pid"] is None, st
    assert f"last checkpoint: step {step}" in st["message"], st
    with pytest.raises(ProcessLookupError):  # the engine itself is gone, not just the wrapper
        os.kill(int(pidfile.read_text()), 0)


def test_proxy_failure_kills_an_engine_that_ignores_sigterm(tmp_path, monkeypatch, capsys):
    """The SIGKILL fallback of failure.abort, in process: an "engine" that ignores SIGTERM."""
    monkeypatch.setattr(failure, "ABORT_WAIT_SECONDS", 0.5)
    files = run_dir.RunFiles(tmp_path, "t")
    sup = supervisor.Supervisor.__new__(supervisor.Supervisor)  # only what abort() touches
    sup.lines = None  # no output reader: the "engine" prints nothing after "ready"
    sup.peers = []  # one rank
    sup.run = types.SimpleNamespace(name="t", files=files, store=run_dir.RunState(files),
                                    buffer=loss_log.LossBuffer(loss_log.LossLog(files.loss)))
    sup.proc = subprocess.Popen(["sh", "-c", "trap '' TERM; echo ready; exec sleep 60"],
                                stdout=subprocess.PIPE)
    assert sup.proc.stdout.readline() == b"ready\n"  # SIGTERM is ignored from here on
    try:
        raise OSError(28, "No space left on device")
    except OSError as e:
        assert failure.abort(sup, e) == 1
    assert sup.proc.returncode == -signal.SIGKILL
    st = json.loads((tmp_path / "t.state.json").read_text())
    assert st["status"] == "crashed" and "did not stop within 0.5 s" in st["message"], st
    assert "last checkpoint: none" in st["message"], st
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("error: t: proxy failed: OSError"), err
    sup.proc.stdout.close()


def test_loss_log_completes_short_writes(tmp_path, monkeypatch):
    """pwrite may write only part of a batch; the rest must follow, never be silently dropped."""
    real_pwrite = os.pwrite
    monkeypatch.setattr(loss_log.os, "pwrite", lambda fd, data, off: real_pwrite(fd, data[:3], off))
    path = tmp_path / "x.loss.json"
    write_log(path, 5)
    recs = json.loads(path.read_bytes())
    assert [r["step"] for r in recs] == [1, 2, 3, 4, 5, 5]
    monkeypatch.setattr(loss_log.os, "pwrite", lambda fd, data, off: 0)
    log = loss_log.LossLog(str(path))
    with pytest.raises(loss_log.LossLogError, match="no progress"):
        log.append([{"step": 6, "loss": 1.0}])
    log.close()


@pytest.fixture
def finished_run(exp, cpu_binary):
    """A run of 4 steps, checkpointed every 2 (both checkpoint slots), and a config to go on to 8."""
    _, rc = run_to_end(exp.config(steps=4, checkpoint={"every": 2}, train={"warmup_steps": 0}), exp.run_dir,
                       cpu_binary, "--no-server")
    assert rc == 0
    return exp.config(steps=8, checkpoint={"every": 2}, train={"warmup_steps": 0}, file="cfg8.json")


@pytest.mark.parametrize("suffix, kind, words", [
    (".loss.json", "fifo", "is a FIFO"), (".state.json", "fifo", "is a FIFO"),  # open() waited for ever
    (".samples.json", "fifo", "is a FIFO"), (".ckpt", "fifo", "is a FIFO"),
    (".ckpt.json", "fifo", "is a FIFO"), (".ckpt.prev.json", "fifo", "is a FIFO"),  # the sidecars too
    (".loss.json", "devnull", "is a device"),  # every record went nowhere, exit 0
    (".ckpt.prev", "dir", "is a directory")])
def test_a_run_file_that_is_not_a_regular_file_is_refused(exp, cpu_binary, finished_run, suffix, kind, words):
    path = exp.path(suffix)
    path.unlink()
    {"fifo": os.mkfifo, "dir": os.mkdir, "devnull": lambda p: os.symlink("/dev/null", p)}[kind](path)
    res = subprocess.run([sys.executable, str(PROXY), str(finished_run), "--engine-binary", str(cpu_binary),
                          "--run-dir", str(exp.run_dir), "--no-server"], capture_output=True, text=True,
                         env=proxy_env(), timeout=60)
    assert res.returncode == 2, res.stderr
    assert res.stderr.splitlines() == [f"error: {path} {words}, not a regular file; move it away"], res.stderr


def test_samples_of_the_wrong_types_are_moved_aside(exp, cpu_binary, finished_run):
    """A sample whose step is a string was taken as a list of samples, and the first resume's
    comparison of steps failed: "proxy failed: TypeError", exit 1."""
    exp.path(".samples.json").write_text(json.dumps([{"step": "x", "prompt": 5, "text": None}]))
    p, rc = run_to_end(finished_run, exp.run_dir, cpu_binary, "--no-server")
    assert rc == 0, p.describe()
    assert "samples.json was not a list of samples; moved it to" in "".join(p.out), p.describe()
    assert json.loads(exp.path(".samples.json.damaged").read_text())[0]["step"] == "x"


def test_a_second_proxy_on_a_running_run_is_refused(exp, cpu_binary):
    cfg = exp.config(steps=10**6)
    p = Proxy.start(cfg, exp.run_dir, cpu_binary)
    st = p.wait_state(lambda s: s.get("step", 0) >= 10)
    log_before = exp.path(".loss.json").read_bytes()
    second = Proxy.start(cfg, exp.run_dir, cpu_binary)
    try:
        rc = second.wait(timeout=20)
    finally:  # without the lock the second one trains on: leave no proxy or engine behind
        second.kill()
        if second.proc.returncode != 2:
            p.kill()
    assert rc == 2, second.describe()
    assert f"another proxy (pid {p.proc.pid})" in "".join(second.err), second.describe()
    assert exp.path(".loss.json").read_bytes().startswith(log_before[:-2])  # only appended to
    assert p.proc.poll() is None and exp.state()["pid"] == st["pid"]
    assert p.stop() == 0
    p = Proxy.start(cfg, exp.run_dir, cpu_binary)  # the lock went with the first proxy
    p.wait_state(lambda s: s.get("status") == "running" and s.get("seg") == 2)
    assert p.stop() == 0, p.describe()


@pytest.mark.parametrize("planted", ["symlink", "fifo"])
def test_a_lock_file_that_is_no_regular_file_is_refused(exp, cpu_binary, tmp_path, planted):
    """The run's lock file is opened, truncated and given the proxy's pid: a symbolic link planted
    there would have that written into a file outside the run directory, a FIFO would be waited
    on. Either is one error line, exit 2, with nothing written anywhere and no engine started."""
    cfg = exp.config(steps=20)
    exp.run_dir.mkdir(parents=True, exist_ok=True)
    outside = tmp_path / "outside.txt"
    outside.write_text("keep me\n")
    lock = exp.path(".lock")
    if planted == "symlink":
        lock.symlink_to(outside)
    else:
        os.mkfifo(lock)
    p, rc = run_to_end(cfg, exp.run_dir, cpu_binary, "--no-server", timeout=30)
    assert rc == 2, p.describe()
    errors = [line for line in "".join(p.err).splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and ".lock" in errors[0], p.describe()
    assert outside.read_text() == "keep me\n"
    assert not exp.path(".loss.json").exists() and not exp.path(".ckpt").exists()


def test_engine_killed_outright_is_crashed_and_rerun_resumes(exp, cpu_binary):
    cfg = exp.config(steps=10**6, checkpoint={"every": 0})
    p = Proxy.start(cfg, exp.run_dir, cpu_binary)
    p.wait_state(lambda s: s.get("step", 0) >= 20)
    p.proc.send_signal(signal.SIGUSR1)  # a checkpoint at a known point, then records beyond it
    k = p.wait_state(lambda s: s.get("checkpoint_step") is not None)["checkpoint_step"]
    st = p.wait_state(lambda s: s.get("step", 0) >= k + 20)
    os.kill(st["pid"], signal.SIGKILL)
    rc = p.wait()
    assert rc != 0, p.describe()
    st = exp.state()
    assert st["status"] == "crashed" and "SIGKILL" in st["message"], st
    before = exp.loss()  # still loads with json.load
    assert checkpoint_step(exp.path(".ckpt")) == k
    beyond = [r for r in before if r["live"] and r["step"] > k and "event" not in r]
    assert len(beyond) >= 20

    # A crash can also tear the log's last write: cut it mid-record, the proxy must repair it.
    data = exp.path(".loss.json").read_bytes()
    exp.path(".loss.json").write_bytes(data[:-25])
    p = Proxy.start(cfg, exp.run_dir, cpu_binary)
    p.wait_output(r"repaired a torn tail")
    p.wait_state(lambda s: s.get("status") == "running" and s.get("step", 0) >= k + 10)
    assert p.stop() == 0, p.describe()
    recs = exp.loss()
    assert_one_live_value_per_step(recs)
    resume = [r for r in recs if r.get("event") == "resume"][-1]
    assert resume["step"] == k and resume["superseded"] >= len(beyond) - 1  # the torn one is gone
    superseded = [r for r in recs if not r["live"]]
    assert superseded and all(r["step"] > k and r["seg"] == 1 for r in superseded)
    # the resumed run continues from the checkpoint: its first record is step k+1
    assert [r["step"] for r in recs if r.get("seg") == 2 and "loss" in r][0] == k + 1


LAGGING_ENGINE = """\
import os, subprocess, sys, time
# The real engine, whose output reaches the proxy only up to the line that holds every part of
# HOLD_AFTER: the rest is held back, as when a proxy lags behind a fast engine, until the engine
# has exited.
if sys.argv[1:] == ["--flags-json"]:
    os.execv(ENGINE, [ENGINE] + sys.argv[1:])
engine = subprocess.Popen([ENGINE] + sys.argv[1:], stdout=subprocess.PIPE)
passing = True
for line in engine.stdout:
    if passing:
        sys.stdout.buffer.write(line)
        sys.stdout.flush()
    if all(part in line for part in HOLD_AFTER):
        passing = False
engine.wait()
open(DONE, "w").close()
time.sleep(600)
"""


def test_a_proxy_killed_mid_write_leaves_no_temp_file_behind(exp, cpu_binary):
    """A proxy killed -9 while it rewrote .state.json (twice a second) left its temp file,
    <name>.state.json.tmpPID, in the run directory for good: 3 of 41 random kills did; one killed
    while it copied the polish checkpoint into the archive left a checkpoint-sized one there. The
    next start, holding the run's lock, removes those of its own files; others are left alone."""
    cfg = exp.config(steps=20)
    exp.run_dir.mkdir()
    archive = exp.run_dir / "archive" / "step_10"  # a polish checkpoint's copy is checkpoint-sized
    archive.mkdir(parents=True)
    left = [exp.path(".state.json.tmp4242"), exp.path(".samples.json.tmp17"), exp.path(".loss.json.tmp99"),
            archive / f"{exp.path('.ckpt').name}.tmp{os.getpid()}", archive / f"{exp.path('.ckpt').name}.json.tmp5"]
    kept = [exp.path(".state.json.tmpx"), exp.run_dir / "notes.tmp123", archive / "notes.tmp7"]
    for path in left + kept:
        path.write_text("{")
    p, rc = run_to_end(cfg, exp.run_dir, cpu_binary, "--no-server")
    assert rc == 0, p.describe()
    assert not any(path.exists() for path in left) and all(path.exists() for path in kept)


def test_the_temp_file_cleanup_does_not_follow_an_archive_link(exp, cpu_binary, tmp_path):
    """An `archive` that is a symbolic link leads out of the run directory: the files there, named
    as a checkpoint's temp files or not, are not the run's to remove."""
    elsewhere = tmp_path / "elsewhere" / "step_10"
    elsewhere.mkdir(parents=True)
    outside = elsewhere / f"{exp.path('.ckpt').name}.tmp5"
    outside.write_text("{")
    exp.run_dir.mkdir()
    (exp.run_dir / "archive").symlink_to(elsewhere.parent)
    p, rc = run_to_end(exp.config(steps=20), exp.run_dir, cpu_binary, "--no-server")
    assert rc == 0, p.describe()
    assert outside.exists()


AFTER_THE_PROXY_LOGGED = ("the checkpoint of step 20 was written after the proxy last logged one (step 15; it "
                          "was killed): ")
THE_LOG_TELLS = "tiny.state.json was missing, so the loss log tells which steps were logged: every record up to step "
AGAIN = "resuming from the previous checkpoint, step 15, to train and log steps 16..20 again"


@pytest.mark.parametrize("hold_after, held_at, state, said", [
    ((b'"event":"checkpoint"', b'"step":15,'), 15, "kept", AFTER_THE_PROXY_LOGGED + AGAIN),
    ((b'"event":"checkpoint"', b'"step":15,'), 15, "removed",
     THE_LOG_TELLS + "15, short of the checkpoint of step 20: " + AGAIN),
    # the log's last record is step 20's train record, but step 20's evaluation was never logged
    ((b'{"step":20,"loss":',), 20, "removed", THE_LOG_TELLS + "19, short of the checkpoint of step 20: " + AGAIN),
])
def test_a_proxy_killed_while_it_lags_loses_no_record(exp, cpu_binary, tmp_path, hold_after, held_at, state, said):
    """The engine never waits for the proxy: a proxy killed while it lagged behind left checkpoints
    past records it never wrote, and the next run resumed there: those records were lost for good
    (5 of 12 random kill -9s lost a checkpoint interval). The next run must train and log them again:
    every step's loss and validation loss as in a run never interrupted. (A lag of more than one
    checkpoint interval can still lose records: there are two checkpoint slots; the message says so.)
    Where .state.json is gone too, the log says how far its records reach (every record of a step
    whose evaluation is due only with that evaluation), and the message says why it was asked."""
    cfg = exp.config(steps=20, checkpoint={"every": 5}, eval={"every": 5, "batches": 2})
    ref = ProxyFixtureDir(tmp_path / "ref")
    _, rc = run_to_end(ref.config(steps=20, checkpoint={"every": 5}, eval={"every": 5, "batches": 2}),
                       ref.run_dir, cpu_binary, "--no-server")
    assert rc == 0
    done = tmp_path / "engine-done"
    wrapper = tmp_path / "lagging_engine.py"
    wrapper.write_text(f"#!{sys.executable}\nENGINE, DONE = {str(cpu_binary)!r}, {str(done)!r}\n"
                       f"HOLD_AFTER = {hold_after!r}\n" + LAGGING_ENGINE)
    wrapper.chmod(0o755)
    p = Proxy.start(cfg, exp.run_dir, wrapper, "--no-server")
    deadline = time.monotonic() + 120
    while not done.exists() and p.proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert done.exists(), p.describe()
    # the proxy has handled every line it was passed (the state is written at once after each)
    wrapper_pid = p.wait_state(lambda s: (s.get("step"), s.get("checkpoint_step")) == (held_at, 15))["pid"]
    p.proc.kill()  # kill -9 of the proxy: it had logged up to step 15 (or 20's train record), the engine checkpointed 20
    p.wait()
    os.kill(wrapper_pid, signal.SIGKILL)
    assert exp.state()["checkpoint_step"] == 15 and checkpoint_step(exp.path(".ckpt")) == 20
    if state == "removed":
        exp.path(".state.json").unlink()

    p, rc = run_to_end(cfg, exp.run_dir, cpu_binary, "--no-server")
    assert rc == 0, p.describe()
    assert said in "".join(p.out), p.describe()
    recs, want = exp.loss(), ref.loss()
    assert_one_live_value_per_step(recs)
    assert [(r["step"], r["loss"]) for r in live_train(recs)] == [(r["step"], r["loss"]) for r in live_train(want)]
    assert [(r["step"], r["val_loss"]) for r in live_val(recs)] == \
        [(r["step"], r["val_loss"]) for r in live_val(want)]
    assert exp.path(".ckpt").read_bytes() == ref.path(".ckpt").read_bytes()
    assert sorted(os.listdir(exp.run_dir)) == sorted(os.listdir(ref.run_dir))  # no .ahead left


def test_a_finished_run_relaunched_with_another_model_shape_is_refused(exp, cpu_binary):
    """A finished run was "already finished" whatever its config had become: a model of another
    shape, which the engine refuses for any resume, got exit 0 and the old model's summary."""
    p, rc = run_to_end(exp.config(steps=4, train={"warmup_steps": 0}), exp.run_dir, cpu_binary, "--no-server")
    assert rc == 0, p.describe()
    kept = [exp.path(suffix) for suffix in (".ckpt", ".ckpt.json", ".loss.json", ".state.json", ".samples.json")]
    before = [path.read_bytes() for path in kept]
    wider = exp.config(steps=4, train={"warmup_steps": 0}, model={"d_model": 64, "n_head": 4}, file="wider.json")
    p, rc = run_to_end(wider, exp.run_dir, cpu_binary, "--no-server")
    errors = [line for line in p.err if line.startswith("error")]
    assert rc == 2 and len(errors) == 1 and "different model shape" in errors[0], p.describe()
    assert not any("already finished" in line for line in p.out), p.describe()
    assert [path.read_bytes() for path in kept] == before


@pytest.mark.parametrize("state", ["removed", "emptied", "without checkpoint_step"])
def test_a_state_without_its_checkpoint_step_rolls_back_nothing_the_log_holds(exp, cpu_binary, state):
    """A .state.json removed, emptied, or naming no checkpoint was taken as "nothing logged": the
    next launch of a finished run rolled its checkpoint of step 20 back to the one of step 15,
    saying the proxy had been killed after logging step 0, and trained steps 16..20 again. The
    log holds every record up to step 20: nothing is rolled back or trained again."""
    cfg = exp.config(steps=20, checkpoint={"every": 5}, eval={"every": 5, "batches": 2})
    p, rc = run_to_end(cfg, exp.run_dir, cpu_binary, "--no-server")
    assert rc == 0, p.describe()
    log, ckpt = exp.path(".loss.json").read_bytes(), exp.path(".ckpt").read_bytes()
    if state == "removed":
        exp.path(".state.json").unlink()
    elif state == "emptied":
        exp.path(".state.json").write_bytes(b"")
    else:
        exp.path(".state.json").write_text(json.dumps({k: v for k, v in exp.state().items() if k != "checkpoint_step"}))

    p, rc = run_to_end(cfg, exp.run_dir, cpu_binary, "--no-server")
    assert rc == 0, p.describe()
    out = "".join(p.out)
    assert "tiny already finished: checkpoint" in out and "at step 20 of 20" in out, p.describe()
    assert "summary: step 20 of 20," in out, p.describe()  # the steps of the config, not of a state now gone
    assert "resuming from the previous checkpoint" not in out and "was killed" not in out, p.describe()
    assert exp.path(".loss.json").read_bytes() == log and exp.path(".ckpt").read_bytes() == ckpt
    assert checkpoint_step(exp.path(".ckpt.prev")) == 15 and exp.state()["checkpoint_step"] == 20


@pytest.mark.parametrize("cut_at", range(6))
def test_a_rollback_cut_short_at_any_rename_is_finished_by_the_next(tmp_path, monkeypatch, cut_at):
    """roll_back_checkpoint makes six renames; a crash after any number of them must leave what
    the next call (the next launch makes it: there is a .ahead, or the checkpoint is still past
    the logged one) finishes into the swapped slots, nothing lost on the way."""
    ckpt = str(tmp_path / "t.ckpt")
    files = {"": b"newest", ".json": b"newest sidecar", ".prev": b"older", ".prev.json": b"older sidecar"}
    for suffix, data in files.items():
        (tmp_path / f"t.ckpt{suffix}").write_bytes(data)
    real_replace, calls = os.replace, []

    def crashing_replace(src, dst):
        if len(calls) == cut_at:
            raise KeyboardInterrupt  # the process dies here
        calls.append(src)
        real_replace(src, dst)

    monkeypatch.setattr(run_dir.os, "replace", crashing_replace)
    with pytest.raises(KeyboardInterrupt):
        run_dir.roll_back_checkpoint(ckpt)
    monkeypatch.setattr(run_dir.os, "replace", real_replace)
    run_dir.roll_back_checkpoint(ckpt)
    got = {p.name[len("t.ckpt"):]: p.read_bytes() for p in tmp_path.iterdir()}
    assert got == {"": b"older", ".json": b"older sidecar", ".prev": b"newest", ".prev.json": b"newest sidecar"}


def _slot(path, step, sidecar_step=None):
    """A checkpoint slot at path: the header of `step`, a body, and a sidecar saying sidecar_step."""
    path.write_bytes(int(step).to_bytes(4, "little") + (1).to_bytes(4, "little") + b"\0" * 12)
    (path.parent / (path.name + ".json")).write_text(json.dumps({"step": step if sidecar_step is None
                                                                 else sidecar_step}))


@pytest.mark.parametrize("live, prev, kept_from", [
    ((30, None), (20, None), ""),       # the engine has not checkpointed again yet
    ((31, None), (30, None), ".prev"),  # it has, once: the boundary is the previous slot
    ((32, None), (31, None), None),     # twice: the boundary's checkpoint is gone
    ((31, 30), (29, None), None),       # mid-write: the new sidecar beside the old checkpoint
])
def test_the_polish_archive_keeps_the_boundary_checkpoint_or_none(tmp_path, live, prev, kept_from):
    """The proxy copies the boundary's checkpoint (step 30) while the engine trains on; with a
    checkpoint every step, the live slot had already moved on and the archive kept step 31's, or
    step 32's checkpoint beside step 31's sidecar. It keeps step 30's, from whichever slot holds it
    whole, or none (and says so)."""
    ckpt, dest = tmp_path / "t.ckpt", tmp_path / "archive"
    dest.mkdir()
    _slot(ckpt, *live)
    _slot(tmp_path / "t.ckpt.prev", *prev)
    assert run_dir.keep_checkpoint(str(dest), str(ckpt), 30, "t.state.json") == (kept_from is not None)
    if kept_from is None:
        assert sorted(os.listdir(dest)) == []
        return
    src = tmp_path / ("t.ckpt" + kept_from)
    assert (dest / "t.ckpt").read_bytes() == src.read_bytes() and checkpoint_step(dest / "t.ckpt") == 30
    assert json.loads((dest / "t.ckpt.json").read_text())["step"] == 30
    assert json.loads((dest / "t.state.json").read_text()) == {"checkpoint": str(dest / "t.ckpt"),
                                                               "checkpoint_step": 30}


@pytest.mark.parametrize("size", [0, 4, 1000])
def test_a_truncated_newest_checkpoint_is_refused_with_the_way_back(exp, cpu_binary, size):
    """The proxy read the checkpoint's header itself and refused a truncated one with its own line,
    without the way back to the previous slot that the engine's refusal gives (README: "The
    refusal's error line says exactly this"). It is the engine's to refuse now."""
    cfg = exp.config(steps=40, checkpoint={"every": 10})
    p, rc = run_to_end(cfg, exp.run_dir, cpu_binary, "--no-server")
    assert rc == 0, p.describe()
    ckpt = exp.path(".ckpt")
    with open(ckpt, "r+b") as f:
        f.truncate(size)
    before = {q.name: q.read_bytes() for q in exp.run_dir.iterdir() if ".ckpt" in q.name}
    p, rc = run_to_end(exp.config(steps=80, checkpoint={"every": 10}), exp.run_dir, cpu_binary, "--no-server")
    assert rc == 2, p.describe()
    assert f"run mv {ckpt}.prev {ckpt} && mv {ckpt}.prev.json {ckpt}.json" in p.describe()
    assert {q.name: q.read_bytes() for q in exp.run_dir.iterdir() if ".ckpt" in q.name} == before


@pytest.mark.parametrize("every", [0, 1])
def test_polish_archives_pretraining(exp, cpu_binary, every):
    """every 1: the engine checkpoints again right after the boundary, racing the proxy's copy,
    which keeps step 30's checkpoint (from whichever slot holds it) or none, never a later one."""
    cfg = exp.config(steps=300, checkpoint={"every": every},
                     sample={"every": 10, "tokens": 4, "prompts": PROMPTS},
                     polish={"start_step": 30, "train": str(exp.val), "lr": 1e-4})
    p, rc = run_to_end(cfg, exp.run_dir, cpu_binary)
    assert rc == 0, p.describe()
    arch = exp.run_dir / "archive" / "step_30"
    if every and not (arch / f"{NAME}.ckpt").exists():
        assert "the checkpoint of step 30 was replaced by later ones" in p.describe()
        assert sorted(os.listdir(arch)) == sorted(f"{NAME}{s}" for s in (".samples.json", ".state.json"))
        return
    assert sorted(os.listdir(arch)) == sorted(f"{NAME}{s}" for s in (".ckpt", ".ckpt.json",
                                                                     ".samples.json", ".state.json"))
    # The engine's checkpoint at the boundary (reason "polish", before the first polish step): the
    # state at the switch, kept while the live one moved on.
    kept = checkpoint_step(arch / f"{NAME}.ckpt")
    assert kept == 30 and checkpoint_step(exp.path(".ckpt")) == 300
    assert json.loads((arch / f"{NAME}.ckpt.json").read_text())["step"] == kept
    old = json.loads((arch / f"{NAME}.samples.json").read_text())
    new = json.loads(exp.path(".samples.json").read_text())
    assert {s["step"] for s in old} == {10, 20, 30}
    assert {s["step"] for s in new} == set(range(40, 301, 10))
    archived = json.loads((arch / f"{NAME}.state.json").read_text())
    assert archived["phase"] == "pretrain" and archived["step"] == 30
    assert archived["checkpoint_step"] == kept
    st = exp.state()
    assert st["phase"] == "polish" and st["status"] == "finished"
    recs = exp.loss()  # one history, never archived
    assert_one_live_value_per_step(recs)
    assert len(live_train(recs)) == 300
    assert [r["step"] for r in recs if r.get("event") == "polish"] == [30]
    assert {r["phase"] for r in live_train(recs) if r["step"] > 30} == {"polish"}
    assert {r["phase"] for r in live_train(recs) if r["step"] <= 30} == {"pretrain"}
    assert not any(n.endswith(".loss.json") for n in os.listdir(arch))


def test_two_runs_of_one_directory_each_archive_their_polish_step(exp, cpu_binary):
    """Two runs (two names) may share a run directory, and so archive/step_<s>/ where they polish at
    the same step: the second found the folder there, took it for its own archive made by an
    earlier launch, and its pretraining samples and state were never archived (its samples of
    steps up to s dropped). Each run's archive is its own files there now."""
    for name in (NAME, "other"):
        cfg = exp.config(steps=40, name=name, file=f"{name}.json", checkpoint={"every": 0},
                         sample={"every": 10, "tokens": 4, "prompts": PROMPTS},
                         polish={"start_step": 20, "train": str(exp.val), "lr": 1e-4})
        p, rc = run_to_end(cfg, exp.run_dir, cpu_binary, "--no-server")
        assert rc == 0, p.describe()
    arch = exp.run_dir / "archive" / "step_20"
    assert sorted(os.listdir(arch)) == sorted(f"{n}{s}" for n in (NAME, "other")
                                              for s in (".ckpt", ".ckpt.json", ".samples.json", ".state.json"))
    for name in (NAME, "other"):
        assert {x["step"] for x in json.loads((arch / f"{name}.samples.json").read_text())} == {10, 20}
        archived = json.loads((arch / f"{name}.state.json").read_text())
        assert archived["phase"] == "pretrain" and archived["checkpoint_step"] == 20, archived


def test_a_replayed_polish_points_the_archived_state_at_the_kept_checkpoint(exp, cpu_binary):
    """A proxy killed after it copied the boundary's checkpoint into the archive and before it
    pointed the archived state at it left that state naming the live checkpoint (long moved on)
    and an older step, for good: the resume that replays the boundary saw the kept checkpoint and
    did nothing more."""
    cfg = json.loads(exp.config(steps=40, polish={"start_step": 30, "train": str(exp.val)}).read_text())
    run = supervisor.Run(cfg, engines.engine_flags(str(cpu_binary)), str(exp.root / "cfg.json"),
                         str(exp.run_dir), str(cpu_binary), [])
    dest = exp.run_dir / "archive" / "step_30"
    dest.mkdir(parents=True)
    for suffix, text in ((".ckpt", "the kept checkpoint"), (".ckpt.json", '{"step": 30}'), (".samples.json", "[]"),
                         (".state.json", json.dumps({"step": 30, "checkpoint": str(exp.path(".ckpt")),
                                                     "checkpoint_step": 28}))):
        (dest / f"{NAME}{suffix}").write_text(text)
    events.EventHandler(run).on_polish({"event": "polish", "step": 30})
    archived = json.loads((dest / f"{NAME}.state.json").read_text())
    assert archived["checkpoint"] == str(dest / f"{NAME}.ckpt") and archived["checkpoint_step"] == 30
    assert archived["step"] == 30 and (dest / f"{NAME}.ckpt").read_text() == "the kept checkpoint"
    run.log.close()


@pytest.fixture(scope="session")
def kill_at_rename(tmp_path_factory):
    return build_shim(tmp_path_factory, "kill_at_rename")


def polish_run_outcome(exp):
    """What a run of POLISH_AT_30 leaves that must not depend on crashes: the live records, the
    samples (live and archived), the archived and the final checkpoint."""
    arch = exp.run_dir / "archive" / "step_30"
    samples = lambda path: [(s["step"], s["text"]) for s in json.loads(path.read_text()) if not s.get("superseded")]
    recs = exp.loss()
    return {"train": [(r["step"], r["loss"], r["lr"]) for r in live_train(recs)],
            "val": [(r["step"], r["val_loss"]) for r in live_val(recs)],
            "polish": [r["step"] for r in recs if r["live"] and r.get("event") == "polish"],
            "samples": samples(exp.path(".samples.json")), "archived": samples(arch / f"{NAME}.samples.json"),
            "archived_ckpt": (arch / f"{NAME}.ckpt").read_bytes(), "ckpt": exp.path(".ckpt").read_bytes()}


# Checkpoints at 7, 14, 21, 28 (every 7), 30 (the polish boundary), 35 and 40. The renames of the
# engine's writes (tests/kill_at_rename.c): 1-2 (step 7's sidecar and checkpoint), then 4 a write
# (the previous slot's two, the new sidecar, the new checkpoint): 15-18 the boundary's.
@pytest.mark.parametrize("kill_at", [6, 15, 18, 19],
                         ids=["between_renames", "boundary_archived_not_saved", "boundary_between_renames",
                              "right_after_boundary"])
def test_an_engine_killed_at_a_checkpoint_rename_resumes_as_if_never_killed(tmp_path, cpu_binary, kill_at_rename,
                                                                            kill_at):
    """kill -9 of the engine at any moment, then the same command: the run ends as one never killed.
    Killed at the polish boundary after the proxy archived it and before the checkpoint was saved,
    the resume replayed the boundary and its samples went into the polish phase's samples too;
    killed right after it, the resume started at the boundary, whose polish event was logged twice.
    Killed between the two renames of a write (the new sidecar beside the old checkpoint), the
    engine refused the newest slot, and the same command with it, until the slot was moved by hand."""
    # batches of 32 windows: steps long enough that the proxy keeps the boundary's checkpoint before
    # two later ones replace it (a proxy that lags that far keeps none, with a warning), also on a
    # machine busy with other work, where 2 windows a step lost it in 2 of 4 cases
    sections = dict(steps=40, train={"batch_size": 32}, checkpoint={"every": 7}, eval={"every": 5, "batches": 2},
                    sample={"every": 10, "tokens": 4, "prompts": PROMPTS},
                    polish={"start_step": 30, "train": str(tmp_path / "markov_val.bin"), "lr": 1e-4})
    exp, ref = ProxyFixtureDir(tmp_path), ProxyFixtureDir(tmp_path / "ref")
    _, rc = run_to_end(ref.config(**sections), ref.run_dir, cpu_binary, "--no-server")
    assert rc == 0
    cfg = exp.config(**sections)
    wrapper = tmp_path / "killed_engine.sh"
    wrapper.write_text(f'#!/bin/sh\n[ "$1" = --flags-json ] || export LD_PRELOAD={kill_at_rename} '
                       f'KILL_AT_RENAME={kill_at}\nexec {cpu_binary} "$@"\n')
    wrapper.chmod(0o755)
    p, rc = run_to_end(cfg, exp.run_dir, wrapper, "--no-server")
    assert rc == 1 and "engine killed by SIGKILL" in p.describe(), p.describe()
    p, rc = run_to_end(cfg, exp.run_dir, cpu_binary, "--no-server")
    assert rc == 0, p.describe()
    got, want = polish_run_outcome(exp), polish_run_outcome(ref)
    assert {k: v for k, v in got.items() if "ckpt" not in k} == {k: v for k, v in want.items() if "ckpt" not in k}
    assert got["archived_ckpt"] == want["archived_ckpt"] and got["ckpt"] == want["ckpt"]
    assert_one_live_value_per_step(exp.loss())


# ---------------------------------------------------------------------------------------------------
# The server


@pytest.fixture
def served(exp, cpu_binary):
    p = Proxy.start(exp.config(steps=10**6, checkpoint={"every": 0}), exp.run_dir, cpu_binary)
    url, token = p.url_and_token()
    p.wait_state(lambda s: s.get("step", 0) >= 5)
    yield p, url, token
    p.kill()


def listening_addresses(port):
    """Local addresses with a socket listening on port, from /proc/net/tcp{,6}."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        if not os.path.exists(table):
            continue
        for line in open(table).read().splitlines()[1:]:
            local, _remote, st = line.split()[1:4]
            addr, p = local.split(":")
            if int(p, 16) == port and st == "0A":
                found.append(addr)
    return found


def raw_get(url, path, host=None, redirects=3, token=None):
    """GET with the path sent exactly as given (no client-side normalisation of ../); redirects
    (werkzeug merges "//") are followed, also sent as given."""
    hostport = url.split("/")[2]
    conn = http.client.HTTPConnection(hostport, timeout=10)
    conn.putrequest("GET", path, skip_host=True)
    conn.putheader("Host", host or hostport)
    if token:
        conn.putheader("X-Run-Token", token)
    conn.endheaders()
    resp = conn.getresponse()
    body = resp.read()
    conn.close()
    location = resp.getheader("Location")
    if resp.status in (301, 302, 307, 308) and location and redirects:
        return raw_get(url, "/" + location.split("/", 3)[3] if "://" in location else location,
                       host, redirects - 1, token)
    return resp.status, body


def test_server_binds_loopback_and_prints_the_url(served):
    p, url, token = served
    assert url.startswith("http://127.0.0.1:")
    port = int(url.rstrip("/").rsplit(":", 1)[1])
    assert listening_addresses(port) == ["0100007F"]  # 127.0.0.1 only
    page = requests.get(url, timeout=10)
    assert page.status_code == 200 and "live-loss" not in page.url and "<canvas" in page.text


def test_server_reaches_nothing_outside_the_run_dir(served, tmp_path):
    p, url, token = served
    secret = tmp_path / "secret.json"
    secret.write_text('{"secret": "outside the run"}')
    (p.run_dir / "link.json").symlink_to(secret)
    bad = ["/files/../secret.json", "/files/..%2fsecret.json", "/files/%2e%2e/secret.json",
           "/files/%2e%2e%2fsecret.json", "/files//etc/passwd", "/files/%2fetc%2fpasswd",
           "/files/archive/../../secret.json", "/files/link.json", "/files/..", "/files/tiny.ckpt",
           "/files/../../../../../../etc/passwd", "/..%2f..%2fsecret.json"]
    for path in bad:
        status, body = raw_get(url, path, token=token)
        assert status in (400, 403, 404), (path, status)
        assert b"outside the run" not in body and b"root:" not in body, path
    status, body = raw_get(url, f"/files/{NAME}.loss.json", token=token)
    assert status == 200 and isinstance(json.loads(body), list)
    listing = requests.get(url + "files/", headers={"X-Run-Token": token}, timeout=10).json()
    assert f"{NAME}.loss.json" in listing and not any("secret" in f for f in listing)


def test_server_refuses_foreign_host_headers(served):
    _, url, token = served
    assert raw_get(url, "/api/state", host="evil.example:80", token=token)[0] == 403
    assert raw_get(url, "/api/state", token=token)[0] == 200


def test_changing_the_run_needs_the_token(served):
    p, url, token = served
    for headers in ({}, {"X-Run-Token": "wrong"}, {"X-Run-Token": token[:-1]}):
        for action in ("checkpoint", "stop"):
            assert requests.post(url + "api/" + action, headers=headers, timeout=10).status_code == 403
    assert requests.get(url + "api/checkpoint", headers={"X-Run-Token": token}, timeout=10).status_code == 405
    assert p.state().get("checkpoint_step") is None and p.proc.poll() is None
    r = requests.post(url + "api/checkpoint", headers={"X-Run-Token": token}, timeout=10)
    assert r.status_code == 202
    p.wait_state(lambda s: s.get("checkpoint_step") is not None)
    r = requests.post(url + "api/stop", headers={"X-Run-Token": token}, timeout=10)
    assert r.status_code == 202
    assert p.wait() == 0 and p.state()["status"] == "stopped"


def sse_events(resp):
    """(event, id, data) triples from a streaming SSE response."""
    event, eid, data = None, None, []
    for raw in resp.iter_lines():
        line = raw.decode()
        if line == "":
            if data:
                yield event, eid, "\n".join(data)
            event, data = None, []
        elif line.startswith("event: "):
            event = line[7:]
        elif line.startswith("id: "):
            eid = line[4:]
        elif line.startswith("data: "):
            data.append(line[6:])


def test_live_stream_sends_only_unseen_records(served):
    p, url, token = served
    auth = {"X-Run-Token": token}
    p.wait_state(lambda s: s.get("step", 0) >= 40)
    total = requests.get(url + "api/records?from=0&limit=1", headers=auth, timeout=10).json()["total"]
    start = total - 5
    got, ids = [], []
    with requests.get(url + f"api/stream?from={start}", headers=auth, stream=True, timeout=30) as resp:
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        kinds = set()
        for event, eid, data in sse_events(resp):
            kinds.add(event)
            if event == "records":
                msg = json.loads(data)
                got += msg["records"]
                ids.append(int(eid))
                assert int(eid) == msg["next"] == start + len(got)
            if len(ids) >= 3 and {"state", "samples"} <= kinds:
                break
    on_disk = p_loss(p)
    assert got == on_disk[start:start + len(got)]  # from the cursor on, no gap, no repeat
    assert len(got) > 5  # and new records arrived live
    # A reconnecting EventSource sends Last-Event-ID: the stream resumes right there.
    with requests.get(url + "api/stream?from=0", headers={**auth, "Last-Event-ID": str(ids[-1])},
                      stream=True, timeout=30) as resp:
        event, eid, data = next(e for e in sse_events(resp) if e[0] == "records")
        first = json.loads(data)["records"][0]
    assert first == p_loss(p)[ids[-1]]


def p_loss(p):
    with open(p.run_dir / f"{NAME}.loss.json") as f:
        return json.load(f)


def test_records_endpoint_pages_through_the_log(served):
    p, url, token = served
    auth = {"X-Run-Token": token}
    seen, cursor = [], 0
    while True:
        msg = requests.get(url + f"api/records?from={cursor}&limit=7", headers=auth, timeout=10).json()
        if not msg["records"]:
            break
        seen += msg["records"]
        assert msg["next"] == cursor + len(msg["records"])
        cursor = msg["next"]
    assert seen == p_loss(p)[:len(seen)] and len(seen) >= 6
    for bad in ("-1", "x", "%C2%B2", "%D9%A1"):  # "²" and Arabic-Indic "1" pass str.isdigit()
        assert requests.get(url + f"api/records?from={bad}", headers=auth, timeout=10).status_code == 400, bad
    with requests.get(url + "api/stream?from=0", headers={**auth, "Last-Event-ID": "\u00b2"}, stream=True,
                      timeout=30) as resp:  # not an index: ignored, the stream starts at "from"
        assert resp.status_code == 200


@pytest.mark.parametrize("make, words", [(os.mkfifo, "a FIFO"), (os.mkdir, "a directory")])
def test_a_config_that_is_no_regular_file_is_one_plain_error(tmp_path, cpu_binary, make, words):
    """The refusal of a FIFO or directory as the config read 'not valid JSON: cannot read it: ...',
    the reader's message wrapped in the parser's."""
    path = tmp_path / "exp.json"
    make(path)
    res = subprocess.run([sys.executable, str(PROXY), str(path), "--engine-binary", str(cpu_binary), "--no-server"],
                         capture_output=True, text=True, env=proxy_env(), timeout=60)
    assert res.returncode == 2 and res.stderr.splitlines() == [f"error: {path}: cannot read it: {words}, not a "
                                                               "regular file"], res.stderr


def test_a_config_file_too_large_to_be_one_is_refused_unread(tmp_path, cpu_binary):
    """The whole file was read before it was parsed: a multi-gigabyte file given as the config (a
    shard, a disk image, a sparse file) took all memory, or was a MemoryError traceback."""
    import resource
    path = tmp_path / "exp.json"
    with open(path, "wb") as f:
        f.write(b'{"name": "x"}')
        f.truncate(8 << 30)  # sparse: no disk space, 8 GiB to read
    limit = 2 << 30  # far above what the proxy needs; far below the file

    def limit_memory():
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    res = subprocess.run([sys.executable, str(PROXY), str(path), "--engine-binary", str(cpu_binary), "--no-server"],
                         capture_output=True, text=True, env=proxy_env(), timeout=60, preexec_fn=limit_memory)
    assert res.returncode == 2 and res.stderr.splitlines() == [
        f"error: {path}: it is longer than {config.CONFIG_MAX_BYTES} bytes, more than any config"], res.stderr


@pytest.mark.parametrize("flag, value", [("--port", "-1"), ("--port", "65536"), ("--progress-every", "nan"),
                                         ("--progress-every", "-1"), ("--progress-every", "inf")])
def test_a_proxy_flag_out_of_range_is_one_error_line(exp, cpu_binary, flag, value):
    """--port 65536 reached bind(), whose OverflowError was a traceback after the engine had been
    chosen; --progress-every nan or -1 was taken as an interval."""
    res = subprocess.run([sys.executable, str(PROXY), str(exp.config(steps=2, train={"warmup_steps": 0})), "--engine-binary", str(cpu_binary),
                          "--run-dir", str(exp.run_dir), flag, value], capture_output=True, text=True,
                         env=proxy_env(), timeout=60)
    assert res.returncode == 2 and len(res.stderr.splitlines()) == 1, res.stderr
    assert res.stderr.startswith(f"error: {flag} must be") and not exp.run_dir.exists(), res.stderr


@pytest.mark.parametrize("make", [lambda p: p.write_text("x"), os.mkfifo], ids=["file", "fifo"])
def test_a_run_dir_that_is_no_directory_is_one_clear_error(exp, cpu_binary, make):
    """A file or FIFO as --run-dir was the error line "[Errno 17] File exists: '...'"."""
    path = exp.root / "not-a-dir"
    make(path)
    res = subprocess.run([sys.executable, str(PROXY), str(exp.config(steps=2, train={"warmup_steps": 0})),
                          "--engine-binary", str(cpu_binary), "--run-dir", str(path), "--no-server"],
                         capture_output=True, text=True, env=proxy_env(), timeout=60)
    assert res.returncode == 2 and res.stderr == f"error: --run-dir {path} exists and is no directory\n", res.stderr


def test_more_ranks_than_the_proxy_starts_is_one_error_line(exp, cpu_binary):
    """--ranks 99999999 built an environment for every rank before starting any: the proxy took
    all the machine's memory and was killed (exit 137), a typo away."""
    res = subprocess.run([sys.executable, str(PROXY), str(exp.config(steps=2, train={"warmup_steps": 0})),
                          "--engine-binary", str(cpu_binary), "--run-dir", str(exp.run_dir), "--no-server",
                          "--ranks", "99999999"], capture_output=True, text=True, env=proxy_env(), timeout=60)
    assert res.returncode == 2 and res.stderr == "error: --ranks must be in [1, 1024] (see --help)\n", res.stderr
    assert not exp.run_dir.exists()


def test_a_proxy_of_another_checkout_refuses_the_installed_package(tmp_path):
    """A proxy script run from a checkout whose microgpt package is not the one Python imports (another
    checkout installed with pip install -e) would start that checkout's engine and write its runs
    there: one error line instead, nothing written."""
    other = tmp_path / "other-checkout"
    (other / "microgpt").mkdir(parents=True)
    shutil.copy(PROXY, other / "microgpt" / "training_proxy.py")
    res = subprocess.run([sys.executable, str(other / "microgpt" / "training_proxy.py"), "config.json"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    assert res.returncode == 2, res
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: this proxy is in ") and str(other) in lines[0], res.stderr
    assert not (other / "runs").exists() and not (tmp_path / "runs").exists()
