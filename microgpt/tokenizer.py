"""The one tokenizer of ANDREA: tiktoken r50k_base (GPT-2 BPE) plus the two ChatML specials (docs/DESIGN.md §2).

    ids 0..50255   GPT-2 byte-pair tokens
    50256          <|endoftext|>  (separates documents / conversations)
    50257          <|im_start|>
    50258          <|im_end|>     -> vocab_size 50259

The BPE ranks come from data/assets/r50k_base.tiktoken when it is there (written by
`python scripts/fetch-assets.py`, works offline), else from tiktoken's own download.

The ChatML format lives here too, so the data pipeline and the proxy render and tokenize it the same way:

    <|im_start|>system\n...<|im_end|>\n<|im_start|>user\n...<|im_end|>\n<|im_start|>assistant\n...<|im_end|>\n

Command line (used to check a prompt or to decode a shard):
    python microgpt/tokenizer.py encode "text"        ordinary text (UTF-8) -> ids
    python microgpt/tokenizer.py encode-chat "text"   text whose ChatML specials are real specials -> ids
    python microgpt/tokenizer.py decode 1 2 3         ids -> text (on a terminal its control
                                                      characters but newline and tab shown as \\xNN,
                                                      not acted on; piped, the exact text; a
                                                      character stdout's encoding lacks as \\uXXXX)
"""
import base64
import hashlib
import json
import os
import sys

import numpy as np
import tiktoken

from microgpt.cli import (USAGE_ERROR, error, interrupted, no_stdout, output_failed, shown_on_terminal,
                          stdout_closed)
from microgpt.files import DuplicateKeyError, JsonTooDeep, has_lone_surrogate, loads_json, open_regular

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ASSET_PATH = os.path.join(ROOT, "data", "assets", "r50k_base.tiktoken")
ASSET_SHA256 = "306cd27f03c1a714eca7108e03d66b7dc042abe8c258b44c199a7ed9838dd930"
# The same regex tiktoken_ext/openai_public.py uses for r50k_base.
PAT_STR = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s"""

EOT = 50256
IM_START = 50257
IM_END = 50258
VOCAB_SIZE = 50259
SPECIALS = {"<|endoftext|>": EOT, "<|im_start|>": IM_START, "<|im_end|>": IM_END}

# Conversation roles as written in ChatML, and the names that record formats use for them; looked up
# lower-cased, so "Human" and "GPT" count. The assistant aliases are the model names that ShareGPT
# exports write in `from` (chatgpt, bing, bard) and the names other formats use (model, bot).
ROLE_NAMES = {"system": "system", "human": "user", "user": "user", "gpt": "assistant",
              "assistant": "assistant", "chatgpt": "assistant", "bing": "assistant", "bard": "assistant",
              "model": "assistant", "bot": "assistant", "tool": "tool", "function": "tool"}


class TokenizerUnavailable(RuntimeError):
    pass


def _load_ranks(path):
    """Parse a .tiktoken file ('<base64 token> <rank>' per line) after checking its sha256.

    tiktoken.load.load_tiktoken_bpe does the same parse but also copies local files into a cache
    directory; reading it here keeps loading free of side effects. A path that is no regular file (a
    FIFO would make the read wait forever) or cannot be read is TokenizerUnavailable, as a changed
    file is: the tools say so in one line, naming this file, not the input they were reading."""
    try:
        with open(open_regular(path), "rb") as f:
            data = f.read()
    except OSError as e:
        raise TokenizerUnavailable(f"{path}: cannot be read ({e.strerror or e}); delete it and run "
                                   "`python scripts/fetch-assets.py`") from None
    digest = hashlib.sha256(data).hexdigest()
    if digest != ASSET_SHA256:
        raise TokenizerUnavailable(f"{path}: sha256 {digest} is not r50k_base's {ASSET_SHA256}; "
                                   "delete it and run `python scripts/fetch-assets.py`")
    ranks = {}
    for line in data.splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    return ranks


def _build_encoding():
    if os.path.lexists(ASSET_PATH):  # a link whose file is gone is this asset, unusable: no download
        ranks = _load_ranks(ASSET_PATH)
    else:
        try:
            ranks = tiktoken.get_encoding("r50k_base")._mergeable_ranks
        except Exception as e:  # offline: requests raises one of several connection errors
            raise TokenizerUnavailable(
                f"r50k_base BPE file not found at {ASSET_PATH} and tiktoken could not download it "
                f"({type(e).__name__}); run `python scripts/fetch-assets.py`") from None
    return tiktoken.Encoding(name="r50k_base_chatml", pat_str=PAT_STR, mergeable_ranks=ranks,
                             special_tokens=SPECIALS, explicit_n_vocab=VOCAB_SIZE)


_encoding = None


def encoding():
    """The tiktoken Encoding, built once per process on first use."""
    global _encoding
    if _encoding is None:
        _encoding = _build_encoding()
    return _encoding


def encode(text):
    """Ordinary text -> ids. Special-token strings in the text stay plain text (never 50256..50258),
    so data can never smuggle a control token in."""
    return encoding().encode_ordinary(text)


def encode_array(text):
    """encode(text) as a uint16 array, built without one Python int per token: the data pipeline's
    hot path (tiktoken releases the GIL for the whole encoding). Same ids as encode()."""
    return encoding().encode_to_numpy(text, disallowed_special=()).astype(np.uint16)


def encode_chat(text):
    """Text written by a person (e.g. a sample prompt) in which <|im_start|>, <|im_end|> and
    <|endoftext|> mean the special tokens."""
    return encoding().encode(text, allowed_special=set(SPECIALS), disallowed_special=())


def decode(ids):
    """ids -> text. Ids outside the vocabulary (e.g. padded embedding rows) are dropped rather than
    raising, so a sample from a half-trained model always decodes; invalid UTF-8 becomes U+FFFD."""
    ids = [int(i) for i in ids]
    return encoding().decode([i for i in ids if 0 <= i < VOCAB_SIZE], errors="replace")


def render_chatml(turns):
    """[(role, content), ...] -> the ChatML text of one conversation (no <|endoftext|>)."""
    return "".join(f"<|im_start|>{role}\n{content}<|im_end|>\n" for role, content in turns)


def encode_conversation(turns):
    """Tokens of render_chatml(turns) + <|endoftext|>, built structurally: contents are encoded as
    ordinary text, so a literal "<|im_end|>" inside a message cannot end the turn.
    For contents without special strings this equals encode_chat(render_chatml(turns) + "<|endoftext|>")."""
    ids = []
    newline = encode("\n")
    for role, content in turns:
        ids.append(IM_START)
        ids.extend(encode(f"{role}\n{content}"))
        ids.append(IM_END)
        ids.extend(newline)
    ids.append(EOT)
    return ids


def parse_conversation(record, cuts=None):
    """A ShareGPT record ({"conversations": [{"from", "value"}]}) or an OpenAI record
    ({"messages": [{"role", "content"}]}) -> [(chatml_role, content), ...]. A bad turn (unknown role,
    content that is not a string or holds a lone UTF-16 surrogate) ends the conversation there: the
    turns before it are kept, and its reason is counted in the dict `cuts` when one is given. Raises
    ValueError with a short reason (used as a counter key) if nothing usable is left."""
    if not isinstance(record, dict):
        raise ValueError("record is not an object")
    if isinstance(record.get("conversations"), list):
        turns, role_key, text_key = record["conversations"], "from", "value"
    elif isinstance(record.get("messages"), list):
        turns, role_key, text_key = record["messages"], "role", "content"
    else:
        raise ValueError("no conversations/messages list")
    out, cut = [], None
    for turn in turns:
        cut = turn_problem(turn, role_key, text_key)
        if cut:
            break
        out.append((ROLE_NAMES[turn[role_key].lower()], turn[text_key]))
    roles = {role for role, _ in out}
    if "user" not in roles or "assistant" not in roles:
        raise ValueError(cut or "no user/assistant exchange")
    if cut and cuts is not None:
        cuts[cut] = cuts.get(cut, 0) + 1
    return out


def json_fault(e):
    """The short reason (a counter key) why one JSON record could not be read, from the ValueError
    or RecursionError that reading it raised: invalid UTF-8, a key named twice in one object, JSON
    nested too deeply for Python's json, and invalid JSON (also an integer of over 4300 digits,
    which Python's json refuses)."""
    if isinstance(e, UnicodeDecodeError):
        return "invalid UTF-8"
    if isinstance(e, DuplicateKeyError):
        return "a key twice in one object"
    if isinstance(e, (JsonTooDeep, RecursionError)):
        return "JSON nested too deeply"
    return "invalid JSON"  # json.JSONDecodeError, or the digits limit of int()


# The byte-order marks of UTF-16 and UTF-32 (UTF-32-LE's begins with UTF-16-LE's): a file that
# begins with one is no UTF-8, and its lines, read as UTF-8, are noise; the data scripts refuse it.
UTF16_32_BOMS = (b"\xff\xfe", b"\xfe\xff", b"\0\0\xfe\xff")
TEXT_HEAD_BYTES = 1 << 16  # how much of a file is looked at to tell: is_utf16_or_32
NOT_UTF8 = "not UTF-8 text (NUL bytes or a UTF-16 or UTF-32 byte-order mark); convert it, e.g. iconv -f UTF-16 -t UTF-8"


def is_utf16_or_32(head, plain_text):
    """Whether a file whose first TEXT_HEAD_BYTES bytes are head is UTF-16 or UTF-32, not UTF-8: it
    begins with one of their byte-order marks, or (plain_text) holds a NUL byte, which UTF-16 makes
    of every other byte of ASCII. JSON lines hold no NUL either, but one damaged line is skipped and
    counted, not a reason to refuse the file: only the byte-order mark is."""
    return head.startswith(UTF16_32_BOMS) or (plain_text and b"\0" in head)


def parse_json_line(line):
    """One JSON line (str, or bytes as read from a file) -> its value. Raises ValueError with a
    short reason (json_fault) for a line that holds none. Bytes are UTF-8 (a leading byte-order mark
    is dropped): json.loads would take bytes that begin with a NUL byte, or hold one as the second,
    for UTF-16 or UTF-32, so the lines of a UTF-16 file after the first were read as text with
    every character beyond U+00FF garbled, and it passes UTF-8-encoded lone surrogates."""
    try:
        return loads_json(line.decode("utf-8-sig") if isinstance(line, (bytes, bytearray)) else line)
    except ValueError as e:
        raise ValueError(json_fault(e)) from None


def parse_conversation_line(line, cuts=None):
    """One JSON line (str, or bytes as read from a file) -> parse_conversation's turns. Raises
    ValueError with a short reason (a counter key) for a line that holds none: parse_json_line's
    and parse_conversation's."""
    return parse_conversation(parse_json_line(line), cuts)


def turn_problem(turn, role_key, text_key):
    """Why a turn cannot be rendered, or None."""
    if not isinstance(turn, dict):
        return "turn is not an object"
    role, content = turn.get(role_key), turn.get(text_key)
    if not isinstance(role, str) or role.lower() not in ROLE_NAMES:
        return "unknown role"
    if not isinstance(content, str):
        return "content is not a string"
    if has_lone_surrogate(content):
        return "lone UTF-16 surrogate"
    return None




def main(argv):
    usage = ("usage: tokenizer.py encode TEXT | encode-chat TEXT | decode ID...\n"
             "decode shows control characters but newline and tab as \\xNN on a terminal; a pipe gets the text")
    if argv in (["-h"], ["--help"]):
        print(usage)
        return 0
    if len(argv) < 2 or argv[0] not in ("encode", "encode-chat", "decode"):  # one error line, as the tools'
        error(f"{usage.splitlines()[0]} (see --help)")
        return USAGE_ERROR
    if no_stdout():  # file descriptor 1 closed: the answer would go nowhere, and exit 0 say it went well
        return USAGE_ERROR
    try:
        if argv[0] == "decode":
            try:
                ids = [int(a) for a in argv[1:]]
            except ValueError:
                print("error: decode takes integer token ids", file=sys.stderr)
                return 2
            text = decode(ids) + "\n"
            sys.stdout.reconfigure(errors="backslashreplace")  # a character the encoding lacks: \uXXXX
            sys.stdout.write(shown_on_terminal(text) if sys.stdout.isatty() else text)
        else:
            text = " ".join(argv[1:])
            if has_lone_surrogate(text):  # bytes that are no UTF-8: tiktoken would encode U+FFFD for them
                error("the text is not UTF-8 (bytes that are no UTF-8 would be encoded as U+FFFD, not as typed)")
                return USAGE_ERROR
            fn = encode if argv[0] == "encode" else encode_chat
            print(json.dumps(fn(text)))
        sys.stdout.flush()
    except TokenizerUnavailable as e:  # the tools' status for an asset they cannot use (chat, evaluate, export)
        error(e)
        return USAGE_ERROR
    except KeyboardInterrupt:  # Ctrl-C while the BPE file loads or a long text is worked on
        return interrupted("tokenizer", "the answer is not complete")
    except BrokenPipeError:  # `... | head -c 10`: its reader went away
        return stdout_closed()
    except OSError as e:  # a full disk (> /dev/full), an I/O error
        return output_failed(e)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
