"""microgpt/chat.py end to end with the CPU engine (docs/DESIGN.md §5a): the replies are the float64
reference's greedy continuations of the ChatML prompts the conversation should produce, the
conversation keeps its history, drops its oldest exchanges when the context is full, stops at
<|im_end|>, and /reset, /exit, end of input and bad input behave.

The chat tests use a random model with the real tokenizer (weights N(0, 0.3), so that every prompt
leads somewhere else and a wrong history shows as a wrong reply; the tiny trained model answers
newlines whatever it is asked), and a copy of it whose <|im_end|> embedding is made to win the
argmax a few tokens into a reply.
"""
import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import engine_util as eu
import reference as ref
from microgpt import tokenizer as tk
from microgpt.checkpoint import read_sidecar, write_checkpoint
from microgpt.inference import Generator, InferenceError
from tools_util import reference_greedy, reference_model

CHAT = eu.REPO / "microgpt" / "chat.py"
STOPS = (tk.IM_END, tk.EOT)
MAX_TOKENS = 8


def turn(role, content):
    return [tk.IM_START] + tk.encode(f"{role}\n{content}") + [tk.IM_END] + tk.encode("\n")


HEADER = [tk.IM_START] + tk.encode("assistant\n")


def write_model(run_dir, cfg, flat, sidecar):
    """A run directory holding flat as its checkpoint (step 0, zero Adam moments), with the trained
    model's sidecar less its checksum: a hand-made checkpoint, loaded with an "unverified" warning."""
    run_dir.mkdir()
    ckpt = run_dir / f"{run_dir.name}.ckpt"
    write_checkpoint(ckpt, 0, flat, np.zeros_like(flat), np.zeros_like(flat))
    side = {k: v for k, v in sidecar.items() if k != "crc32c"}
    (run_dir / f"{ckpt.name}.json").write_text(json.dumps({**side, "step": 0}))
    return run_dir


@pytest.fixture(scope="module")
def random_model(trained_model, tmp_path_factory):
    cfg, _ = reference_model(trained_model.ckpt)
    flat = ref.init_params(cfg, np.random.default_rng(7), std=0.3).astype(np.float32).astype(np.float64)
    run_dir = write_model(tmp_path_factory.mktemp("chat") / "random", cfg, flat, read_sidecar(trained_model.ckpt))
    return run_dir, cfg, flat


@pytest.fixture(scope="module")
def stopping_model(random_model, tmp_path_factory):
    """The random model with <|im_end|>'s embedding a scaled copy of another token's, so <|im_end|>
    wins wherever that token would; the token is searched for among the tokens of the replies seen
    so that the first reply to PROMPT ends with <|im_end|> after at least two tokens."""
    run_dir, cfg, flat = random_model
    flat = flat.copy()
    wte = ref.unflatten(flat, cfg)["wte"]
    original = wte[tk.IM_END].copy()
    candidates, tried = list(reference_greedy(cfg, flat, PROMPT, MAX_TOKENS, STOPS)), set()
    while candidates and len(tried) < 50:
        v = candidates.pop(0)
        if v in tried:
            continue
        tried.add(v)
        wte[tk.IM_END] = 1.05 * wte[v]
        reply = reference_greedy(cfg, flat, PROMPT, MAX_TOKENS, STOPS)
        if reply[-1] == tk.IM_END and len(reply) >= 3:
            sidecar = json.loads((run_dir / f"{run_dir.name}.ckpt.json").read_text())
            return write_model(tmp_path_factory.mktemp("chat") / "stopping", cfg, flat, sidecar), cfg, flat
        candidates += reply
        wte[tk.IM_END] = original
    pytest.fail(f"no token among {len(tried)} tried makes <|im_end|> end the reply; the search needs a look")


PROMPT = turn("user", "Hi there! How are you?") + HEADER


def chat(model, *args, stdin=None):
    return subprocess.run([sys.executable, str(CHAT), str(model), "--engine", "cpu", "--temperature", "0",
                           "--max-tokens", str(MAX_TOKENS), *args],
                          input=stdin, capture_output=True, text=True, timeout=300, env=eu.python_env())


def test_a_checkpoint_path_that_is_no_utf8_chats(random_model, cpu_binary, tmp_path):
    """The engine's start-up line on stderr names the checkpoint by its bytes; the chat's reader of
    that stream decoded it strictly, and a directory name that is no UTF-8 (legal on Linux) killed
    it with a UnicodeDecodeError traceback."""
    run_dir, _, _ = random_model
    odd = tmp_path / os.fsdecode(b"m\xff")
    shutil.copytree(run_dir, odd)
    ckpt = f"{run_dir.name}.ckpt"
    replies = [chat(d / ckpt, "--prompt", "Hi", "--json") for d in (run_dir, odd)]
    assert replies[1].returncode == 0 and "Traceback" not in replies[1].stderr, replies[1].stderr
    assert json.loads(replies[1].stdout)["tokens"] == json.loads(replies[0].stdout)["tokens"]


def test_one_shot_json_is_the_reference_greedy_reply(random_model, cpu_binary):
    run_dir, cfg, flat = random_model
    res = chat(run_dir, "--prompt", "Hi there! How are you?", "--json")
    assert res.returncode == 0, res.stderr
    answer = json.loads(res.stdout)
    expected = reference_greedy(cfg, flat, PROMPT, MAX_TOKENS, STOPS)
    assert tk.IM_END not in expected and len(expected) == MAX_TOKENS
    assert answer["tokens"] == expected and answer["reason"] == "length"
    assert answer["reply"] == tk.decode(expected) and answer["prompt_tokens"] == len(PROMPT)
    assert answer["ms"] > 0


def test_closed_standard_input_is_one_error_and_prompt_needs_none(random_model, cpu_binary):
    """With file descriptor 0 closed (not /dev/null: Python then has no sys.stdin at all) the chat
    ended in an AttributeError traceback. It is one error line naming --prompt, exit 2; --prompt,
    which reads no input, answers as it does with one."""
    run_dir, cfg, flat = random_model
    args = [sys.executable, str(CHAT), str(run_dir), "--engine", "cpu", "--temperature", "0",
            "--max-tokens", str(MAX_TOKENS)]

    def closed_stdin(*extra):
        return subprocess.run([*args, *extra], preexec_fn=lambda: os.close(0), capture_output=True, text=True,
                              timeout=300, env=eu.python_env())

    res = closed_stdin()
    assert res.returncode == 2 and res.stdout == "", res.stderr
    assert res.stderr.startswith("error: ") and len(res.stderr.splitlines()) == 1 and "--prompt" in res.stderr, \
        res.stderr
    res = closed_stdin("--prompt", "Hi there! How are you?", "--json")
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["tokens"] == reference_greedy(cfg, flat, PROMPT, MAX_TOKENS, STOPS)


def test_reply_stops_at_im_end(stopping_model, cpu_binary):
    run_dir, cfg, flat = stopping_model
    expected = reference_greedy(cfg, flat, PROMPT, MAX_TOKENS, STOPS)
    res = chat(run_dir, "--prompt", "Hi there! How are you?", "--json")
    assert res.returncode == 0, res.stderr
    answer = json.loads(res.stdout)
    assert answer["reason"] == "stop" and answer["tokens"] == expected[:-1]
    res = chat(run_dir, "--prompt", "Hi there! How are you?")  # plain: the text, never <|im_end|>
    assert res.returncode == 0 and res.stdout == tk.decode(expected[:-1]) + "\n", res.stderr
    assert "cut" not in res.stderr


def test_conversation_history_context_and_reset(random_model, cpu_binary):
    """Four messages fill the 64-token context, so the oldest exchanges go (and a line says so);
    /reset starts over with the system prompt; /exit ends. Each reply must be the reference's
    greedy reply to exactly the prompt the rule gives: system turn, the exchanges kept (replies as
    made, closed with <|im_end|>\\n), the new user turn, the assistant header."""
    run_dir, cfg, flat = random_model
    system = turn("system", "Be nice.")
    messages = ["Hello!", "What is your name?", "Do you like music?", "Tell me more.", "/reset", "Hello!", "/exit"]
    exchanges, stdout, drops = [], "", []
    for message in messages:
        stdout += "> "
        if message == "/reset":
            exchanges = []
            continue
        if message == "/exit":
            break
        user = turn("user", message)
        dropped = 0
        while len(system) + sum(map(len, exchanges[dropped:])) + len(user) + len(HEADER) + MAX_TOKENS > cfg.seq_len:
            dropped += 1
        exchanges = exchanges[dropped:]
        drops += [dropped] if dropped else []
        reply = reference_greedy(cfg, flat, system + sum(exchanges, []) + user + HEADER, MAX_TOKENS, STOPS)
        exchanges.append(user + HEADER + reply + [tk.IM_END] + tk.encode("\n"))
        stdout += tk.decode(reply) + "\n"
    assert drops, "the script must outgrow the context"

    res = chat(run_dir, "--system", "Be nice.", stdin="".join(m + "\n" for m in messages))
    assert res.returncode == 0, res.stderr
    assert res.stdout == stdout
    notices = [l for l in res.stderr.splitlines() if "dropped the oldest" in l]
    assert [int(l.split("oldest ")[1].split()[0]) for l in notices] == drops
    assert "[conversation cleared]" in res.stderr


def test_end_of_input_and_blank_lines(random_model, cpu_binary):
    run_dir, _, _ = random_model
    res = chat(run_dir, stdin="\n   \n")  # nothing asked: no reply, EOF quits cleanly
    assert res.returncode == 0 and res.stdout == "> > > \n", res.stderr
    assert "Traceback" not in res.stderr


def test_message_too_long_for_the_context(random_model, cpu_binary):
    run_dir, _, _ = random_model
    long_message = "word " * 80
    res = chat(run_dir, "--prompt", long_message)
    errors = [l for l in res.stderr.splitlines() if l.startswith("error:")]
    assert res.returncode == 2 and len(errors) == 1 and "context" in errors[0], res.stderr
    res = chat(run_dir, stdin=long_message + "\n/exit\n")  # interactive: said, and the chat goes on
    assert res.returncode == 0 and "does not fit" in res.stderr and res.stdout == "> > ", res.stderr


def test_a_piped_line_of_no_end_is_refused_unread_not_held_whole(random_model, cpu_binary):
    """Standard input of one endless line (`chat.py RUN < /dev/zero`, a binary file piped in) was
    read whole by input() before the message was judged: memory without bound, then a MemoryError
    traceback (or the OOM killer). A line longer than any message that fits the context is read in
    pieces and dropped, said so, and the chat goes on; under a memory limit far below what reading
    the line whole takes."""
    import resource
    run_dir, _, _ = random_model
    limit = lambda: resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))  # noqa: E731
    endless = subprocess.Popen(["sh", "-c", "head -c 1100000000 /dev/zero; printf '\\n/exit\\n'"],
                               stdout=subprocess.PIPE)
    try:
        res = subprocess.run([sys.executable, str(CHAT), str(run_dir), "--engine", "cpu"], stdin=endless.stdout,
                             capture_output=True, text=True, timeout=600, env=eu.python_env(), preexec_fn=limit)
    finally:
        endless.stdout.close()
        endless.kill()
        endless.wait()
    assert res.returncode == 0 and "Traceback" not in res.stderr, res.stderr
    assert "cannot fit" in res.stderr and res.stdout == "> > ", res.stderr
    # the bound is sound: no token is longer than the chat assumes
    from microgpt import chat as chat_py
    assert max(map(len, tk.encoding()._mergeable_ranks)) <= chat_py.LONGEST_TOKEN_BYTES


def test_typed_bytes_that_are_no_utf8_are_read_as_the_replacement_character(random_model, cpu_binary):
    """Under a UTF-8 locale other than C's (en_US.UTF-8: Python reads stdin strictly there, as
    PYTHONIOENCODING=utf-8:strict does) a typed or piped line holding a byte that is no UTF-8 ended
    the chat in a UnicodeDecodeError traceback. It is read as U+FFFD, which is what an argument
    that is no UTF-8 (--prompt) becomes too: the same reply as to the line with U+FFFD typed."""
    run_dir, _, _ = random_model
    strict = {**eu.python_env(), "PYTHONIOENCODING": "utf-8:strict"}
    replies = [subprocess.run([sys.executable, str(CHAT), str(run_dir), "--engine", "cpu", "--temperature", "0",
                               "--max-tokens", str(MAX_TOKENS)], input=b"hi" + bad + b" there\n",
                              capture_output=True, timeout=300, env=strict)
               for bad in (b"\xff", "\ufffd".encode())]
    assert replies[0].returncode == 0 and b"Traceback" not in replies[0].stderr, replies[0].stderr.decode()
    assert replies[0].stdout == replies[1].stdout and len(replies[0].stdout) > len(b"> > ")


@pytest.mark.parametrize("target,message", [("missing.ckpt", "no such checkpoint"), (".", "without a checkpoint")])
def test_bad_checkpoint(tmp_path, target, message):
    res = subprocess.run([sys.executable, str(CHAT), str(tmp_path / target), "--prompt", "hi"],
                         capture_output=True, text=True, timeout=60, env=eu.python_env())
    errors = [l for l in res.stderr.splitlines() if l.startswith("error:")]
    assert res.returncode == 2 and len(errors) == 1 and message in errors[0], res.stderr
    assert "Traceback" not in res.stderr


@pytest.mark.parametrize("run_dir", [False, True])
def test_a_checkpoint_that_is_a_fifo_is_named_so(tmp_path, run_dir):
    """A checkpoint path that is a FIFO (or a run directory whose checkpoint is one) was reported as
    "no such checkpoint file" (or "a directory without a checkpoint"): it is there, and is no file."""
    (tmp_path / "r").mkdir()
    fifo = tmp_path / "r" / "r.ckpt"
    os.mkfifo(fifo)
    res = subprocess.run([sys.executable, str(CHAT), str(fifo.parent if run_dir else fifo), "--prompt", "hi"],
                         capture_output=True, text=True, timeout=60, env=eu.python_env())
    assert res.returncode == 2 and res.stderr == f"error: {fifo}: a FIFO, not a regular file\n", res.stderr




def test_a_damaged_checkpoint_is_reported_before_the_first_message(trained_model, cpu_binary, tmp_path):
    """A checkpoint that fails the engine's integrity check (one byte flipped) greeted the user with
    "chatting with ..." and a prompt, and said what was wrong only after a message had been typed
    (and lost). The chat now waits for the engine to have loaded the model: one error line at
    once, exit 2, no prompt."""
    ckpt = tmp_path / trained_model.ckpt.name
    shutil.copy(trained_model.ckpt, ckpt)
    shutil.copy(f"{trained_model.ckpt}.json", f"{ckpt}.json")
    eu.flip_bit(ckpt, 100)
    proc = subprocess.Popen([sys.executable, str(CHAT), str(ckpt), "--engine", "cpu"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=eu.python_env())
    try:
        rc = proc.wait(timeout=30)  # stdin stays open: no message is ever typed
    except subprocess.TimeoutExpired:
        rc = "waiting for a message"
    finally:
        proc.kill()
        proc.stdin.close()
        out, err = proc.stdout.read(), proc.stderr.read()
        proc.stdout.close()
        proc.stderr.close()
    errors = [l for l in err.splitlines() if l.startswith("error:")]
    assert rc == 2 and out == "" and len(errors) == 1 and "integrity" in errors[0], (rc, err)



def test_a_model_without_the_chatml_tokens_is_refused_at_start(random_model, tmp_path):
    """A model whose vocabulary stops short of <|im_start|> (50257), a GPT-2 sized or a test model,
    greeted the user and answered the first message with the engine's refusal of token 50257.
    It is one error line at start, naming the vocabulary."""
    run_dir = tmp_path / "small"
    shutil.copytree(random_model[0], run_dir)
    ckpt = run_dir / f"{random_model[0].name}.ckpt"
    ckpt.rename(run_dir / "small.ckpt")
    side = json.loads(Path(f"{ckpt}.json").read_text())
    side["fingerprint"]["vocab_size"] = tk.EOT + 1
    Path(f"{run_dir / 'small.ckpt'}.json").write_text(json.dumps(eu.reseal_values(side)))
    res = subprocess.run([sys.executable, str(CHAT), str(run_dir), "--engine", "cpu"], input="hi\n",
                         capture_output=True, text=True, timeout=60, env=eu.python_env())
    errors = [l for l in res.stderr.splitlines() if l.startswith("error:")]
    assert res.returncode == 2 and res.stdout == "" and res.stderr == errors[0] + "\n", res.stderr
    assert f"vocab_size {tk.EOT + 1}" in errors[0] and "<|im_start|>" in errors[0], errors


@pytest.mark.parametrize("damage", ["changed", "directory", "fifo"])
def test_a_damaged_tokenizer_file_is_one_error(random_model, cpu_binary, tmp_path, monkeypatch, capsys, damage):
    """The BPE file the chat encodes with (data/assets/r50k_base.tiktoken) changed on disk ended the
    chat in a traceback; one that is a directory too; a FIFO made it wait forever."""
    bad = tmp_path / "r50k_base.tiktoken"
    if damage == "changed":
        bad.write_bytes(b"garbage 0\n")
    elif damage == "directory":
        bad.mkdir()
    else:
        os.mkfifo(bad)
    monkeypatch.setattr(tk, "ASSET_PATH", str(bad))
    monkeypatch.setattr(tk, "_encoding", None)
    from microgpt import chat
    assert chat.main([str(random_model[0]), "--prompt", "hi", "--engine", "cpu"]) == 2
    errors = capsys.readouterr().err.splitlines()
    assert len(errors) == 1 and errors[0].startswith(f"error: {bad}") and "fetch-assets.py" in errors[0], errors


def test_streamed_text_holds_back_split_characters(assets):
    """A character whose UTF-8 bytes span tokens prints once whole, never as U+FFFD halves."""
    from microgpt import chat
    text = "日本語 and emoji 😀🙂 naïve"
    ids = tk.encode(text)
    assert any(not tk.encoding().decode_single_token_bytes(t).decode("utf-8", "ignore") for t in ids), \
        "the text must hold a token that is part of a character"
    stream = chat.TextStream()
    pieces = [stream.feed(t) for t in ids] + [stream.finish()]
    assert "".join(pieces) == text and not any("\ufffd" in p for p in pieces)
    assert stream.feed(tk.IM_END) == "" and stream.feed(tk.EOT) == ""


class FakeGenerator:
    """Answers every request with the given tokens, then {"done"}."""

    def __init__(self, tokens):
        self.tokens = tokens

    def stream(self, request):
        yield from ({"token": t} for t in self.tokens)
        yield {"done": True, "reason": "length", "tokens": self.tokens}


class TerminalOut(io.StringIO):
    def isatty(self):
        return True


def test_control_characters_of_a_reply_are_shown_not_acted_on_by_a_terminal(assets):
    """A model's reply is data, but the chat wrote it to the terminal as it came: an ESC the model
    wrote (here an OSC sequence that retitles the window) was acted on, and a right-to-left override
    showed the rest of the line backwards. On a terminal the control characters but newline and tab
    are shown as \\xNN, the bidirectional overrides and isolates as \\uXXXX; piped output and --json
    keep the text exact."""
    from microgpt import chat
    text = "a\x1b]0;pwned\x07b\r\tc\x7f\x9b\u202ed\u2067\n"
    args = chat.parse_args(["unused", "--temperature", "0"])
    for out, shown in ((TerminalOut(), "a\\x1b]0;pwned\\x07b\\x0d\tc\\x7f\\x9b\\u202ed\\u2067\n"),
                       (io.StringIO(), text)):
        ids, reply_text, _ = chat.reply(FakeGenerator(tk.encode(text)), [1], args, 0, out)
        assert out.getvalue() == shown and reply_text == text and ids == tk.encode(text)



class DyingGenerator(FakeGenerator):
    """Streams its tokens, then fails as a Generator whose engine died mid-answer does."""

    def stream(self, request):
        yield from ({"token": t} for t in self.tokens)
        raise InferenceError("the engine stopped while answering (exit code -9): ")


def test_an_engine_that_dies_mid_reply_leaves_the_reply_its_own_line(assets):
    """The engine killed mid-reply: the chat's error line followed the reply's last word on the
    same terminal line ("...glowerror: the engine stopped"). The cut reply ends its line first."""
    from microgpt import chat
    args = chat.parse_args(["unused", "--temperature", "0"])
    for out in (TerminalOut(), io.StringIO()):
        with pytest.raises(InferenceError):
            chat.reply(DyingGenerator(tk.encode("a few words")), [1], args, 0, out)
        assert out.getvalue() == "a few words\n"
    out = io.StringIO()
    with pytest.raises(InferenceError):  # nothing written: nothing to end
        chat.reply(DyingGenerator([]), [1], args, 0, out)
    assert out.getvalue() == ""


def test_a_reply_the_output_encoding_cannot_hold_is_escaped_not_a_traceback(random_model, cpu_binary):
    """Under a locale whose encoding lacks a character the model wrote (here ASCII: this reply holds
    U+00F1), writing the reply raised UnicodeEncodeError: a traceback mid-reply. Such a character is
    written as a backslash escape."""
    run_dir, _, _ = random_model
    res = subprocess.run([sys.executable, str(CHAT), str(run_dir), "--engine", "cpu", "--prompt", "Hello",
                          "--max-tokens", "60", "--seed", "4", "--temperature", "2", "--top-k", "0"],
                         capture_output=True, timeout=300, env={**eu.python_env(), "PYTHONIOENCODING": "ascii"})
    assert res.returncode == 0 and b"Traceback" not in res.stderr, res.stderr.decode()
    assert re.search(rb"\\(x[0-9a-f]{2}|u[0-9a-f]{4})", res.stdout) and res.stdout.isascii(), res.stdout


def test_a_reader_that_goes_away_ends_the_chat_quietly(random_model, cpu_binary):
    """`chat.py ... | head -c 100` closes the pipe while the reply streams: the next write was a
    BrokenPipeError traceback. The chat now ends as a program killed by SIGPIPE would (exit 141),
    with nothing on stderr; the engine is stopped with it. Here the pipe's reader is gone before
    the first write."""
    run_dir, _, _ = random_model
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        res = subprocess.run([sys.executable, str(CHAT), str(run_dir), "--engine", "cpu", "--prompt", "hi"],
                             stdout=write_end, stderr=subprocess.PIPE, text=True, timeout=300, env=eu.python_env())
    finally:
        os.close(write_end)
    said = [l for l in res.stderr.splitlines() if not l.startswith("warning:")]  # the model is loaded unverified
    assert res.returncode == 141 and said == [], res.stderr


def test_ctrl_c_quits_cleanly(random_model, cpu_binary):
    """Exit 130 and, as every tool says on Ctrl-C (docs/DESIGN.md §5a), one "interrupted" line,
    which the chat did not write."""
    run_dir, _, _ = random_model
    proc = subprocess.Popen([sys.executable, str(CHAT), str(run_dir), "--engine", "cpu"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=eu.python_env())
    line = proc.stderr.readline()
    while line.startswith("warning:"):  # the model is loaded unverified, and the engine says so first
        line = proc.stderr.readline()
    assert "chatting with" in line  # the engine is up, the chat waits for input
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130 and err == "\nchat: interrupted; the conversation is not kept\n", err


def wait_at_the_prompt(pid):
    """Returns once the process's main thread waits in the kernel for the terminal (readline's
    select), up to 30 s. The prompt is written just before that wait: a signal that came in between
    (the test's, sent as the prompt appeared, on a loaded machine) is handled before the wait starts,
    which no signal then interrupts, so the chat waited on at "> " (a race of Python's readline
    module; a person's `kill` comes while the chat waits)."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        with open(f"/proc/{pid}/wchan") as f:
            if any(word in f.read() for word in ("poll", "select")):
                return
        time.sleep(0.01)


def test_sigterm_at_the_prompt_of_a_terminal_restores_it(random_model, cpu_binary):
    """`kill PID` (SIGTERM) of a chat waiting at its prompt on a terminal ended Python on the spot,
    with readline's terminal settings in place: the terminal was left without echo and line
    editing (a shell that does not restore them showed nothing typed). SIGTERM is taken as Ctrl-C:
    readline gives the terminal back, the engine is stopped, one "interrupted" line, exit 130."""
    import select
    import termios
    run_dir, _, _ = random_model
    controller, terminal = os.openpty()
    try:
        settings = termios.tcgetattr(terminal)
        proc = subprocess.Popen([sys.executable, str(CHAT), str(run_dir), "--engine", "cpu"], stdin=terminal,
                                stdout=terminal, stderr=terminal, env=eu.python_env())
        shown = b""
        while not shown.endswith(b"> "):  # the prompt: readline holds the terminal
            assert select.select([controller], [], [], 60)[0], shown
            shown += os.read(controller, 4096)
        wait_at_the_prompt(proc.pid)
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=60)
        assert rc == 130 and termios.tcgetattr(terminal)[3] == settings[3], (rc, shown)
    finally:
        os.close(controller)
        os.close(terminal)


def test_an_engine_killed_is_said_so_not_quoted_from_its_start_lines(random_model, cpu_binary):
    """An engine killed between turns (kill -9, the OOM killer) was "the engine stopped ... (exit
    code -9): warning: ... | memory plan (cpu): ... | ...; reading requests on stdin": its start
    lines quoted as if they were why. It names the signal, and quotes only what the engine wrote
    after its start line (here nothing)."""
    run_dir, _, _ = random_model
    with Generator(str(cpu_binary), str(run_dir / f"{run_dir.name}.ckpt")) as gen:
        assert gen.ready()
        gen.proc.kill()
        gen.proc.wait()
        with pytest.raises(InferenceError) as e:
            gen.run({"prompt": PROMPT, "max_tokens": 3, "temperature": 0})
    message = str(e.value)
    assert "killed by SIGKILL" in message and "memory plan" not in message and "unverified" not in message, message


def test_a_refused_request_is_an_error_and_the_engine_carries_on(random_model, cpu_binary):
    run_dir, cfg, flat = random_model
    with Generator(str(cpu_binary), str(run_dir / f"{run_dir.name}.ckpt")) as gen:
        with pytest.raises(InferenceError, match="refused the request"):
            gen.run({"prompt": [cfg.vocab_size], "max_tokens": 1})
        done, _ = gen.run({"prompt": PROMPT, "max_tokens": 3, "temperature": 0})
    assert done["tokens"] == reference_greedy(cfg, flat, PROMPT, 3, STOPS)


@pytest.mark.parametrize("flag,value", [("--temperature", "nan"), ("--temperature", "inf"), ("--top-p", "nan"),
                                        ("--temperature", "1e31"), ("--seed", "-1"), ("--seed", str(2**52 + 1)),
                                        ("--top-k", str(2**31)), ("--max-tokens", str(2**31))])
def test_a_sampling_setting_out_of_range_is_one_error_naming_the_flag(random_model, cpu_binary, flag, value):
    """--temperature nan passed the range check (every comparison with NaN is false) and went to the
    engine as the non-JSON token NaN; the engine's answer to a line it cannot read has no id, which
    the client skipped: the chat waited for ever. A value the engine refuses (a temperature above
    1e30, a seed outside [0, 2^53 - 1], a top_k or max_tokens past 2^31 - 1) was the engine's message
    about its request's field ("temperature must be a number >= 0" for 1e31): chat names its flag."""
    run_dir, _, _ = random_model
    res = subprocess.run([sys.executable, str(CHAT), str(run_dir), "--engine", "cpu", "--prompt", "hi",
                          flag, value], capture_output=True, text=True, timeout=60, env=eu.python_env())
    assert res.returncode == 2 and res.stderr.startswith("error: ") and len(res.stderr.splitlines()) == 1, res.stderr
    assert flag in res.stderr and "engine" not in res.stderr


def test_a_request_the_engine_cannot_read_is_an_error_not_a_wait(random_model, cpu_binary):
    """The Generator sends only JSON (no NaN), and an answer without an id (the engine could not
    read the line, so not even its id) ends the request it was sent for: requests run one at a time."""
    run_dir, cfg, flat = random_model
    with Generator(str(cpu_binary), str(run_dir / f"{run_dir.name}.ckpt")) as gen:
        with pytest.raises(InferenceError, match="not JSON"):
            gen.run({"prompt": PROMPT, "max_tokens": 1, "temperature": float("nan")})
        gen.proc.stdin.write("{not json\n")  # as another client's garbage would arrive
        gen.proc.stdin.flush()
        with pytest.raises(InferenceError, match="not a request line"):
            gen.run({"prompt": PROMPT, "max_tokens": 1, "temperature": 0})
        done, _ = gen.run({"prompt": PROMPT, "max_tokens": 3, "temperature": 0})
    assert done["tokens"] == reference_greedy(cfg, flat, PROMPT, 3, STOPS)


@pytest.mark.parametrize("seq_len", ["1e400", "-4", "0", "1.5", "true", '"64"', "null"])
def test_a_sidecar_shape_that_is_no_positive_integer_is_one_error(random_model, tmp_path, seq_len):
    """The tools read the model's shape from the sidecar (which has no checksum): a seq_len of 1e400
    (infinity to Python's json) was an OverflowError traceback, 1.5 was read as 1 where the engine
    reads 2, -4 gave a message about a -4-token context. Each is one error naming the sidecar."""
    run_dir, _, _ = random_model
    ckpt = tmp_path / "m.ckpt"
    ckpt.write_bytes((run_dir / f"{run_dir.name}.ckpt").read_bytes())
    text = (run_dir / f"{run_dir.name}.ckpt.json").read_text()
    side = json.loads(text)
    side["fingerprint"]["seq_len"] = "SEQ_LEN"
    (tmp_path / "m.ckpt.json").write_text(json.dumps(side).replace('"SEQ_LEN"', seq_len))
    res = subprocess.run([sys.executable, str(CHAT), str(ckpt), "--engine", "cpu", "--prompt", "hi"],
                         capture_output=True, text=True, timeout=60, env=eu.python_env())
    errors = [l for l in res.stderr.splitlines() if l.startswith("error:")]
    assert res.returncode == 2 and len(errors) == 1 and "m.ckpt.json" in errors[0] and "seq_len" in errors[0], \
        res.stderr


@pytest.mark.parametrize("mode", [("--prompt", "hi"), ("--prompt", "hi", "--json"), ()],
                         ids=["prompt", "json", "interactive"])
def test_no_standard_output_or_a_full_one_is_an_error_not_a_quiet_success(random_model, cpu_binary, mode):
    """With file descriptor 1 closed (`chat.py ... >&-`) Python has no sys.stdout: --prompt answered
    into nothing and exited 0, the chat died in a RuntimeError traceback ("input(): lost
    sys.stdout"). A full disk (/dev/full) was an OSError traceback in every mode. Each is one error
    line: exit 2 (before the engine starts), exit 1 (as the engines give a failed write)."""
    run_dir, _, _ = random_model
    cmd = [sys.executable, str(CHAT), str(run_dir), "--engine", "cpu", "--max-tokens", "4", *mode]
    closed = subprocess.run(cmd, input="hi\n", preexec_fn=lambda: os.close(1), stderr=subprocess.PIPE, text=True,
                            timeout=300, env=eu.python_env())
    assert closed.returncode == 2 and closed.stderr.startswith("error: no standard output"), closed.stderr
    with open("/dev/full", "w") as full:
        res = subprocess.run(cmd, input="hi\n", stdout=full, stderr=subprocess.PIPE, text=True, timeout=300,
                             env=eu.python_env())
    errors = [l for l in res.stderr.splitlines() if l.startswith("error:")]
    assert res.returncode == 1 and errors == ["error: cannot write to standard output: No space left on device"], \
        res.stderr
    assert "Traceback" not in res.stderr


@pytest.mark.parametrize("mode", [("--prompt", "hi"), ()], ids=["prompt", "interactive"])
def test_no_standard_error_keeps_the_notices_out_of_the_reply(random_model, cpu_binary, mode):
    """With file descriptor 2 closed (`chat.py ... 2>&-`) Python has no sys.stderr: print(...,
    file=sys.stderr) wrote the notices ("[reply cut at --max-tokens]") into the reply on stdout,
    and the chat's input() failed at the first prompt ("lost sys.stderr"), a traceback that went
    nowhere, exit 1. What stderr would get now goes to /dev/null; stdout is as with stderr open."""
    run_dir, _, _ = random_model
    cmd = [sys.executable, str(CHAT), str(run_dir), "--engine", "cpu", "--temperature", "0",
           "--max-tokens", str(MAX_TOKENS), *mode]
    closed = subprocess.run(cmd, input="hi\n", preexec_fn=lambda: os.close(2), stdout=subprocess.PIPE, text=True,
                            timeout=300, env=eu.python_env())
    res = subprocess.run(cmd, input="hi\n", capture_output=True, text=True, timeout=300, env=eu.python_env())
    assert res.returncode == 0 and "[reply cut at --max-tokens]" in res.stderr, res.stderr
    assert closed.returncode == 0 and closed.stdout == res.stdout, closed.stdout


def test_standard_input_that_cannot_be_read_is_an_error(random_model, cpu_binary, tmp_path):
    """Standard input open for writing only (`chat.py ... 0>file`): the read failed with EBADF, an
    OSError traceback. It is one error line, exit 1, as the engines treat a failed read of stdin."""
    run_dir, _, _ = random_model
    with open(tmp_path / "wo", "w") as write_only:
        res = subprocess.run([sys.executable, str(CHAT), str(run_dir), "--engine", "cpu"], stdin=write_only,
                             capture_output=True, text=True, timeout=300, env=eu.python_env())
    errors = [l for l in res.stderr.splitlines() if l.startswith("error:")]
    assert res.returncode == 1 and errors == ["error: cannot read standard input: Bad file descriptor"], res.stderr
    assert "Traceback" not in res.stderr


def test_the_engines_warning_about_an_unverified_checkpoint_comes_first(random_model, cpu_binary):
    """The random model's sidecar holds no checksum: the engine loads it with a warning that it is
    unverified, which the chat drained with the rest of the engine's stderr and never showed. It
    is shown before the greeting (ready() waits for the engine's start line, which follows its
    warnings), and in one-shot mode too."""
    run_dir, _, _ = random_model
    res = chat(run_dir, stdin="")
    lines = res.stderr.splitlines()
    assert res.returncode == 0 and len(lines) == 2, res.stderr
    assert lines[0].startswith("warning: ") and "unverified" in lines[0] and lines[1].startswith("chatting with"), lines
    res = chat(run_dir, "--prompt", "hi")
    assert res.returncode == 0 and [l for l in res.stderr.splitlines() if "unverified" in l], res.stderr
    with Generator(str(cpu_binary), str(run_dir / f"{run_dir.name}.ckpt")) as gen:
        assert gen.ready()  # the start line it waits for is still the engines' (inference.GENERATE_START)


@pytest.mark.parametrize("sidecar,message", [(None, "is missing"), ("fifo", "is a FIFO, not a regular file"),
                                             ('{"step":', "is no JSON"), ("[1]", "is no JSON object")])
def test_a_sidecar_that_cannot_be_read_says_why(random_model, tmp_path, sidecar, message):
    """Every sidecar that could not be read was "missing or does not give the model's shape": a
    FIFO, a truncated file, one that is present but no JSON all read as missing."""
    run_dir, _, _ = random_model
    ckpt = tmp_path / "m.ckpt"
    ckpt.write_bytes((run_dir / f"{run_dir.name}.ckpt").read_bytes())
    side = tmp_path / "m.ckpt.json"
    if sidecar == "fifo":
        os.mkfifo(side)
    elif sidecar is not None:
        side.write_text(sidecar)
    res = chat(ckpt, "--prompt", "hi")
    assert res.returncode == 2 and len(res.stderr.splitlines()) == 1, res.stderr
    expected = f"error: {side}: the checkpoint's sidecar (which gives the model's shape) {message}"
    assert res.stderr.startswith(expected), res.stderr


def test_a_context_too_short_for_any_chat_is_said_so(random_model, tmp_path):
    """A model whose seq_len cannot hold a message and a reply was refused with "the system prompt
    takes 0 tokens", with no system prompt given."""
    run_dir = tmp_path / "short"
    shutil.copytree(random_model[0], run_dir)
    (run_dir / f"{random_model[0].name}.ckpt").rename(run_dir / "short.ckpt")
    side = json.loads((run_dir / f"{random_model[0].name}.ckpt.json").read_text())
    side["fingerprint"]["seq_len"] = 4
    (run_dir / "short.ckpt.json").write_text(json.dumps(eu.reseal_values(side)))
    res = subprocess.run([sys.executable, str(CHAT), str(run_dir), "--engine", "cpu", "--prompt", "hi"],
                         capture_output=True, text=True, timeout=60, env=eu.python_env())
    assert res.returncode == 2 and len(res.stderr.splitlines()) == 1, res.stderr
    assert "4-token context has no room for a message and a reply" in res.stderr and "system" not in res.stderr


def test_a_system_prompt_that_leaves_no_room_for_a_message_is_refused_at_start(random_model, cpu_binary):
    """A system prompt that left room for the reply's header and room but not for the shortest
    message passed the check at start: the chat greeted, then refused every message ("a" too) with
    "the message takes 6 tokens; ... say it shorter", and --prompt blamed the message."""
    run_dir, cfg, _ = random_model
    room = len(HEADER) + MAX_TOKENS
    system = next(s for s in ("x " * n for n in range(1, cfg.seq_len))
                  if cfg.seq_len - len(turn("user", "")) < len(turn("system", s)) + room <= cfg.seq_len)
    for args in (("--prompt", "a"), ()):
        res = chat(run_dir, "--system", system, *args, stdin="a\n")
        errors = [l for l in res.stderr.splitlines() if l.startswith("error:")]
        assert res.returncode == 2 and len(errors) == 1 and "the system prompt takes" in errors[0], res.stderr


def test_a_path_with_a_newline_is_quoted_on_one_line(tmp_path):
    """The error line quoted the path as given: a newline in it broke the line in two, an escape
    sequence drove the terminal."""
    res = chat(tmp_path / "no\nsuch\x1b[31m")
    assert res.returncode == 2 and res.stderr == \
        f"error: {tmp_path}/no\\x0asuch\\x1b[31m: no such checkpoint file or run directory\n", res.stderr
