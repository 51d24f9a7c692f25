#!/usr/bin/env python3
"""Chat with a trained model in the terminal, in ChatML (docs/DESIGN.md §5a).

    python microgpt/chat.py runs/ANDREA-12M [--system TEXT] [--engine cuda|cpu]
        [--temperature 0.8] [--top-k 40] [--top-p 0.95] [--seed 0] [--max-tokens 256]
    python microgpt/chat.py runs/ANDREA-12M --prompt "Hello!" [--json]     # answer once, exit

The conversation is kept as tokens, rendered as the training data renders it
(<|im_start|>role\\n...<|im_end|>\\n per turn, microgpt/tokenizer.py), and each reply is generated
after <|im_start|>assistant\\n until the model writes <|im_end|>. The reply is printed as its tokens
arrive (on a terminal with its control characters, but newline and tab, shown as \\xNN: a reply is
data, not commands for the terminal; --json and piped output give the text as it is; a character
the output's encoding lacks is written as \\uXXXX). One engine process serves the whole
conversation; the first prompt shows once it has loaded the model (a damaged checkpoint is one
error line before it). When the next prompt would leave less than the reply's room (--max-tokens,
at most half of seq_len) in the model's context, the oldest exchanges are dropped and a line on
stderr says so. A piped line too long for any message to fit (`< /dev/zero`) is read in pieces
and dropped, never held whole, and a line on stderr says so. Typing /reset starts over (the system
prompt stays), /exit or end of input (Ctrl-D) quits, Ctrl-C (or SIGTERM) quits at any time.

Turn n of a session samples with seed --seed + n, so a session replays exactly with the same inputs.
"""
import codecs
import json
import sys

from microgpt import tokenizer
from microgpt.cli import (IO_ERROR, USAGE_ERROR, ArgumentParser, error, interrupted, no_stderr_to_devnull,
                          no_stdout, output_failed, say, shown_on_terminal, stdout_closed, stop_on_sigterm)
from microgpt.engines import ENGINE_INT_MAX
from microgpt.inference import (Generator, InferenceError, pick_engine, read_model_shape,
                                resolve_checkpoint)

COMMANDS = "/reset clears the conversation, /exit quits"

# The generation protocol's limits (docs/DESIGN.md §16), checked here so that an error names chat's
# flag, not the engine's request field.
TEMPERATURE_MAX = 1e30
SEED_MAX = 2**52  # turn n samples with seed + n; the engine takes seeds below 2^53
# r50k_base's longest token, in bytes; a character is one byte or more, so a message of more than
# this many characters per position of the context takes more tokens than the context holds
LONGEST_TOKEN_BYTES = 128


def turn_tokens(role, content):
    """One finished turn exactly as the data pipeline renders it: encode_conversation's tokens
    without the <|endoftext|> that closes a whole conversation."""
    return tokenizer.encode_conversation([(role, content)])[:-1]


def reply_header():
    """<|im_start|>assistant\\n: the prompt's end, after which the model writes its turn."""
    return [tokenizer.IM_START] + tokenizer.encode("assistant\n")


class Conversation:
    """The system turn and the exchanges so far, as token lists, cut to fit the context."""

    def __init__(self, system, seq_len, reply_room):
        self.system = turn_tokens("system", system) if system else []
        self.seq_len, self.reply_room = seq_len, reply_room
        self.exchanges = []  # [user turn tokens + assistant turn tokens]
        # the shortest message's turn (an empty one's) too: without room for it every message would be
        # refused as too long, "say it shorter", whatever its length
        least = len(turn_tokens("user", "")) + len(reply_header())
        if len(self.system) + least + self.reply_room > seq_len:
            if not self.system:  # the model's context is too short for any conversation
                raise InferenceError(f"the model's {seq_len}-token context has no room for a message and a reply "
                                     f"(the shortest message's turn and the reply's header take {least} tokens, "
                                     f"the reply's room {reply_room}); chat needs a model with a longer seq_len")
            raise InferenceError(f"the system prompt takes {len(self.system)} tokens; with a message and the "
                                 f"reply's room ({reply_room}) it does not fit the model's {seq_len}-token context")

    def prompt(self, user_text):
        """Prompt tokens for the next reply and how many old exchanges had to go to fit it.
        Raises InferenceError (the conversation unchanged) if the message alone is too long."""
        user = turn_tokens("user", user_text)
        fixed = len(self.system) + len(user) + len(reply_header())
        if fixed + self.reply_room > self.seq_len:
            raise InferenceError(f"the message takes {len(user)} tokens; it does not fit the model's "
                                 f"{self.seq_len}-token context with room for a reply; say it shorter")
        dropped = 0
        while fixed + sum(map(len, self.exchanges[dropped:])) + self.reply_room > self.seq_len:
            dropped += 1
        del self.exchanges[:dropped]
        history = [t for exchange in self.exchanges for t in exchange]
        return self.system + history + user + reply_header(), dropped

    def add(self, user_text, reply_ids):
        """Keep the exchange; the reply's tokens as the model made them, closed with <|im_end|>\\n
        whether it stopped there or was cut off."""
        closing = [tokenizer.IM_END] + tokenizer.encode("\n")
        self.exchanges.append(turn_tokens("user", user_text) + reply_header() + reply_ids + closing)

    def reset(self):
        self.exchanges = []


class TextStream:
    """Token ids -> text as they arrive. A character's UTF-8 bytes may be split over tokens; the
    incremental decoder holds an incomplete tail back until the rest comes. Special tokens print
    nothing."""

    def __init__(self):
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, token):
        if token >= tokenizer.EOT:  # <|endoftext|>, ChatML specials (padded ids are never sampled)
            return ""
        return self.decoder.decode(tokenizer.encoding().decode_single_token_bytes(token))

    def finish(self):
        return self.decoder.decode(b"", final=True)


def reply(gen, prompt_ids, args, turn, out):
    """Generate one reply, writing its text to `out` as it comes (None: silent; on a terminal its
    control characters shown, shown_on_terminal). Returns (reply token ids without the stop token,
    text, done record)."""
    show = shown_on_terminal if out and out.isatty() else str
    request = {"prompt": prompt_ids, "max_tokens": args.max_tokens, "temperature": args.temperature,
               "top_k": args.top_k, "top_p": args.top_p, "seed": args.seed + turn,
               "stop": [tokenizer.IM_END, tokenizer.EOT]}
    text, ids, stream = [], [], TextStream()
    try:
        for record in gen.stream(request):
            if "token" in record:
                token = record["token"]
                if token in request["stop"]:  # streamed like any token; never printed or kept
                    continue
                ids.append(token)
                piece = stream.feed(token)
                text.append(piece)
                if out and piece:
                    out.write(show(piece))
                    out.flush()
            if record.get("done"):
                tail = stream.finish()
                text.append(tail)
                if out and tail:
                    out.write(show(tail))
                return ids, "".join(text), record
    except InferenceError:  # the engine died mid-reply: the error line goes on a line of its own
        if out and "".join(text):
            out.write("\n")
            out.flush()
        raise


def cut_notice(record):
    """A line for a reply that did not end with <|im_end|>, or None."""
    if record["reason"] == "length":
        return "[reply cut at --max-tokens]"
    if record["reason"] == "context":
        return "[reply cut: the model's context is full]"
    return None


def one_shot(gen, conv, args):
    prompt_ids, _ = conv.prompt(args.prompt)
    ids, text, done = reply(gen, prompt_ids, args, 0, None if args.json else sys.stdout)
    if args.json:
        ms = done.get("ms")
        print(json.dumps({"reply": text, "tokens": ids, "reason": done["reason"],
                          "prompt_tokens": len(prompt_ids), "ms": ms,
                          "tokens_per_s": len(ids) / (ms / 1000) if ms else None}))
    else:
        print()
        notice = cut_notice(done)
        if notice:
            print(notice, file=sys.stderr)
    return 0


class StdinFailed(Exception):
    """A read of standard input that failed (an I/O error, a descriptor open for writing only): no
    end of input, an error."""


class LineTooLong(Exception):
    """A line of standard input longer than any message that fits the context: read and dropped."""


def read_line(prompt, limit):
    """input(prompt), its faults told apart: EOFError at end of input, StdinFailed where the read
    fails, an OSError (from writing the prompt) where stdout fails. On a terminal input() writes the
    prompt itself, so that line editing (readline) redraws it. Elsewhere the line is read at most
    `limit` characters at a time: a longer one (`< /dev/zero`, a binary file piped in) is read to
    its end and dropped, LineTooLong, where input() held it whole, memory without bound."""
    if sys.stdin.isatty() and sys.stdout.isatty():
        try:
            return input(prompt)
        except OSError as e:  # input() wrote the prompt: either side's fault
            raise StdinFailed(f"cannot read the terminal: {e.strerror or e}") from None
    sys.stdout.write(prompt)
    sys.stdout.flush()
    try:
        line = sys.stdin.readline(limit + 1)
        if len(line) > limit and not line.endswith("\n"):
            while line and not line.endswith("\n"):  # the rest in pieces of a MiB at least
                line = sys.stdin.readline(max(limit, 1 << 20))
            raise LineTooLong
    except OSError as e:
        raise StdinFailed(f"cannot read standard input: {e.strerror or e}") from None
    if not line:
        raise EOFError
    return line[:-1] if line.endswith("\n") else line  # as input() gives it


def interactive(gen, conv, args):
    # A byte that is no UTF-8 reads as U+FFFD (as it does in --prompt's argument, which the
    # tokenizer takes so): under most UTF-8 locales Python reads stdin strictly, and one such byte
    # would end the chat in a traceback.
    sys.stdin.reconfigure(errors="replace")
    if sys.stdin.isatty():
        import readline  # noqa: F401  (line editing and history for input(); only on a terminal)
    turn, limit = 0, LONGEST_TOKEN_BYTES * conv.seq_len
    while True:
        try:
            line = read_line("> ", limit)
        except EOFError:
            print()
            return 0
        except LineTooLong:
            print(f"[the message is longer than {limit} characters: it cannot fit the model's {conv.seq_len}-token "
                  "context; say it shorter]", file=sys.stderr)
            continue
        text = line.strip()
        if text == "/exit":
            return 0
        if text == "/reset":
            conv.reset()
            print("[conversation cleared]", file=sys.stderr)
            continue
        if not text:
            continue
        try:
            prompt_ids, dropped = conv.prompt(line)
        except InferenceError as e:
            print(f"[{e}]", file=sys.stderr)
            continue
        if dropped:
            print(f"[the conversation outgrew the {conv.seq_len}-token context: dropped the oldest "
                  f"{dropped} exchange{'s' if dropped > 1 else ''}]", file=sys.stderr)
        ids, _, done = reply(gen, prompt_ids, args, turn, sys.stdout)
        print()
        notice = cut_notice(done)
        if notice:
            print(notice, file=sys.stderr)
        conv.add(line, ids)
        turn += 1


def parse_args(argv):
    p = ArgumentParser(description="Chat with a trained model (ChatML).")
    p.add_argument("model", metavar="RUN_DIR_OR_CHECKPOINT",
                   help="a run directory (runs/<name>/, its <name>.ckpt) or a checkpoint file")
    p.add_argument("--system", help="system prompt")
    p.add_argument("--prompt", help="answer this one message and exit")
    p.add_argument("--json", action="store_true",
                   help="with --prompt: print one JSON object: reply (text), tokens (its ids, without "
                        "<|im_end|>), reason (stop|length|context), prompt_tokens, ms, tokens_per_s")
    p.add_argument("--engine", choices=("cuda", "cpu"),
                   help="default: the GPU engine when built and a GPU is visible, else the CPU engine")
    p.add_argument("--temperature", type=float, default=0.8, help="0: greedy (default 0.8)")
    p.add_argument("--top-k", type=int, default=40, help="0: off (default 40)")
    p.add_argument("--top-p", type=float, default=0.95, help="1: off (default 0.95)")
    p.add_argument("--seed", type=int, default=0, help="turn n samples with seed+n (default 0)")
    p.add_argument("--max-tokens", type=int, default=256,
                   help="longest reply in tokens (default 256; at most the model's context)")
    args = p.parse_args(argv)
    if args.json and args.prompt is None:
        p.error("--json needs --prompt")
    if not 0 <= args.temperature <= TEMPERATURE_MAX:  # so also not NaN, for which every comparison is false
        p.error(f"--temperature must be a number in [0, {TEMPERATURE_MAX:g}]")
    if not 0 < args.top_p <= 1:
        p.error("--top-p must be in (0, 1]")
    if not 0 <= args.top_k <= ENGINE_INT_MAX:
        p.error(f"--top-k must be in [0, {ENGINE_INT_MAX}]")
    if not 1 <= args.max_tokens <= ENGINE_INT_MAX:
        p.error(f"--max-tokens must be in [1, {ENGINE_INT_MAX}]")
    if not 0 <= args.seed <= SEED_MAX:
        p.error("--seed must be in [0, 2^52]")
    return args


def main(argv):
    args = parse_args(argv)
    if no_stdout():  # file descriptor 1 closed: the reply would go nowhere, and exit 0 say it went well
        return USAGE_ERROR
    no_stderr_to_devnull()  # file descriptor 2 closed: the notices would go into the reply, input() fail
    sys.stdout.reconfigure(errors="backslashreplace")  # a model writes any character: one the locale's
    # encoding lacks shows as \uXXXX
    if args.prompt is None and sys.stdin is None:  # file descriptor 0 closed: no turns to read
        error("no standard input (file descriptor 0 is closed); give the message with --prompt")
        return USAGE_ERROR
    gen = None
    stop_on_sigterm()  # as Ctrl-C: readline gives the terminal back (echo on), the engine is stopped
    try:
        ckpt = resolve_checkpoint(args.model)
        shape = read_model_shape(ckpt)
        if shape["vocab_size"] < tokenizer.VOCAB_SIZE:  # else every prompt refused, after the greeting
            raise InferenceError(f"{ckpt}: the model's vocab_size {shape['vocab_size']} holds no ChatML tokens "
                                 f"(<|im_start|> {tokenizer.IM_START}, <|im_end|> {tokenizer.IM_END}); chat needs "
                                 f"a model trained with vocab_size {tokenizer.VOCAB_SIZE} or more")
        conv = Conversation(args.system, shape["seq_len"], min(args.max_tokens, shape["seq_len"] // 2))
        engine = pick_engine(args.engine)
        gen = Generator(engine, ckpt, warn=say)  # a checkpoint loaded unverified: the engine's warning
        if args.prompt is not None:
            return one_shot(gen, conv, args)
        gen.ready()
        say(f"chatting with {ckpt} (step {shape['step']}); {COMMANDS}")
        return interactive(gen, conv, args)
    except (InferenceError, tokenizer.TokenizerUnavailable) as e:
        error(e)
        return USAGE_ERROR
    except StdinFailed as e:
        error(e)
        return IO_ERROR
    except KeyboardInterrupt:  # at the prompt or mid-reply: stop the engine, no traceback
        if gen:
            gen.kill()
        return interrupted("chat", "the conversation is not kept")
    except BrokenPipeError:  # stdout's reader went away (| head): the engine's writes go nowhere
        if gen:
            gen.kill()
        return stdout_closed()
    except OSError as e:  # a write to stdout failed (a full disk: > /dev/full; an I/O error): every other
        # fault below main is an InferenceError, TokenizerUnavailable or StdinFailed by now
        if gen:
            gen.kill()
        return output_failed(e)
    finally:
        if gen:
            gen.close()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
