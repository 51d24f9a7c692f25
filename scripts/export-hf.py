#!/usr/bin/env python3
"""Export a trained model for other tools (docs/DESIGN.md §5a).

    python scripts/export-hf.py RUN_DIR_OR_CHECKPOINT OUT_DIR [--format hf|llmc]

--format hf (default): a Hugging Face transformers GPT-2 directory that loads offline with
AutoModelForCausalLM.from_pretrained(OUT_DIR) and AutoTokenizer.from_pretrained(OUT_DIR):
  config.json             GPT2LMHeadModel: n_embd, n_layer, n_head, n_inner = d_ff,
                          n_positions = seq_len, vocab_size = 50259 (the real vocabulary: the
                          engine's padded embedding rows are never trained or sampled, so they are
                          left out), layer_norm_epsilon = the engines' 1e-5, gelu_new (tanh GELU),
                          tied embeddings, no dropout
  model.safetensors       float32; GPT-2's Conv1D layout is [in, out], the engines' own, so weights
                          are copied as they are; c_attn is [W_Q | W_K | W_V] side by side; every
                          bias is zero (the model has none in its linear layers); lm_head is wte
  generation_config.json  eos = <|im_end|> (50258), pad = <|endoftext|> (50256)
  vocab.json, merges.txt, tokenizer.json
                          byte-level BPE made from the local r50k_base file (the same ids as
                          tiktoken's), with <|endoftext|>, <|im_start|>, <|im_end|> as special tokens
  tokenizer_config.json, special_tokens_map.json
                          with a ChatML chat template: tokenizer.apply_chat_template(messages,
                          add_generation_prompt=True) gives the prompt chat.py gives the engine,
                          except that transformers encodes the spelling of a special token inside
                          a message as that token, where chat.py keeps it as text (README)

--format llmc: OUT_DIR/model.bin, llm.c's GPT-2 model file (header of 256 int32: magic 20240326,
version 3 = float32, seq_len, vocab_size, n_layer, n_head, d_model, padded_vocab_size; then its
tensors in its order, nn.Linear [out, in] layout, zero biases, the padded wte rows zero as llm.c
pads them), and OUT_DIR/tokenizer.bin, llm.c's decoding table (magic 20240328, version 2) with the
ChatML specials. llm.c hard-codes a 4 x d_model MLP, so only models with d_ff = 4 d_model export.

The files are written as one change (microgpt/atomic.py: all written and synced before any replaces
its namesake), so a failure such as a full disk leaves OUT_DIR as it was, or absent where the export
created it; other files in it are left alone. config.json (llmc: model.bin) is removed before the
first rename and renamed last, so a crash between the renames leaves OUT_DIR without it, never a
directory that loads as a whole export with old or missing files; Ctrl-C or SIGTERM then is held
back until the last rename, so that the export is whole, and it says so. An export holds an exclusive
flock on OUT_DIR itself (no lock file is left in it): a second export into the same directory
waits for the first, saying so, and the two never leave a mix of their files.
"""
import contextlib
import fcntl
import os
import sys

import numpy as np
from safetensors.numpy import save as safetensors_bytes

from microgpt import tokenizer
from microgpt.atomic import InterruptedWhole, json_text, write_files_atomic
from microgpt.cli import ArgumentParser, error, interrupted, say, stop_on_sigterm
from microgpt.inference import InferenceError, read_model_params, resolve_checkpoint

# microgpt/cpu/layernorm.h and microgpt/cuda/layernorm.cuh: LayerNorm's epsilon (test_export checks
# that the engines still say so).
LAYERNORM_EPS = 1e-5
LLMC_MODEL_MAGIC, LLMC_MODEL_FP32 = 20240326, 3
LLMC_TOKENIZER_MAGIC, LLMC_TOKENIZER_VERSION = 20240328, 2
LLMC_HEADER_INTS = 256

CHAT_TEMPLATE = ("{% for message in messages %}"
                 "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
                 "{% endfor %}"
                 "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


# ---------------------------------------------------------------------------------------------------
# weights

def hf_tensors(shape, p):
    """The engine's tensors ({name: array}, engine names) -> transformers GPT2LMHeadModel's."""
    V, d, f = shape["vocab_size"], shape["d_model"], shape["d_ff"]
    out = {"transformer.wte.weight": p["wte"][:V], "transformer.wpe.weight": p["wpe"],
           "transformer.ln_f.weight": p["lnf.gamma"], "transformer.ln_f.bias": p["lnf.beta"]}
    for l in range(shape["n_layer"]):
        w = lambda name: p[f"h{l}.{name}"]  # noqa: E731
        h = f"transformer.h.{l}."
        out.update({
            h + "ln_1.weight": w("ln1.gamma"), h + "ln_1.bias": w("ln1.beta"),
            h + "attn.c_attn.weight": np.concatenate([w("W_Q"), w("W_K"), w("W_V")], axis=1),
            h + "attn.c_attn.bias": np.zeros(3 * d, np.float32),
            h + "attn.c_proj.weight": w("W_O"), h + "attn.c_proj.bias": np.zeros(d, np.float32),
            h + "ln_2.weight": w("ln2.gamma"), h + "ln_2.bias": w("ln2.beta"),
            h + "mlp.c_fc.weight": w("W_1"), h + "mlp.c_fc.bias": np.zeros(f, np.float32),
            h + "mlp.c_proj.weight": w("W_2"), h + "mlp.c_proj.bias": np.zeros(d, np.float32)})
    return {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in out.items()}


def hf_config(shape):
    return {
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
        "vocab_size": shape["vocab_size"], "n_positions": shape["seq_len"], "n_ctx": shape["seq_len"],
        "n_embd": shape["d_model"], "n_layer": shape["n_layer"], "n_head": shape["n_head"],
        "n_inner": shape["d_ff"], "activation_function": "gelu_new",
        "layer_norm_epsilon": LAYERNORM_EPS, "tie_word_embeddings": True,
        "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, "initializer_range": 0.02,
        "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False,
        "reorder_and_upcast_attn": False, "use_cache": True,
        "bos_token_id": tokenizer.EOT, "eos_token_id": tokenizer.IM_END, "torch_dtype": "float32"}


def llmc_model_bytes(shape, p):
    """llm.c's GPT-2 model file: its header, then its 16 tensors, each for all layers in turn."""
    L, d, V, Vp = shape["n_layer"], shape["d_model"], shape["vocab_size"], shape["padded_vocab_size"]
    if shape["d_ff"] != 4 * d:
        raise InferenceError(f"llm.c's GPT-2 has a 4 x d_model MLP; this model's d_ff is {shape['d_ff']}, "
                             f"not {4 * d}")
    header = np.zeros(LLMC_HEADER_INTS, "<i4")
    header[:8] = (LLMC_MODEL_MAGIC, LLMC_MODEL_FP32, shape["seq_len"], V, L, shape["n_head"], d, Vp)
    wte = np.zeros((Vp, d), np.float32)
    wte[:V] = p["wte"][:V]
    layers = lambda fn: [fn(l) for l in range(L)]  # noqa: E731
    w = lambda l, name: p[f"h{l}.{name}"]  # noqa: E731
    zeros = lambda n: layers(lambda l: np.zeros(n, np.float32))  # noqa: E731
    tensors = [[wte], [p["wpe"]],
               layers(lambda l: w(l, "ln1.gamma")), layers(lambda l: w(l, "ln1.beta")),
               layers(lambda l: np.concatenate([w(l, "W_Q"), w(l, "W_K"), w(l, "W_V")], axis=1).T),
               zeros(3 * d),
               layers(lambda l: w(l, "W_O").T), zeros(d),
               layers(lambda l: w(l, "ln2.gamma")), layers(lambda l: w(l, "ln2.beta")),
               layers(lambda l: w(l, "W_1").T), zeros(4 * d),
               layers(lambda l: w(l, "W_2").T), zeros(d),
               [p["lnf.gamma"]], [p["lnf.beta"]]]
    parts = [header.tobytes()] + [np.ascontiguousarray(t, "<f4").tobytes() for group in tensors for t in group]
    return b"".join(parts)


# ---------------------------------------------------------------------------------------------------
# tokenizer

def bytes_to_unicode():
    """GPT-2's byte-level alphabet: every byte as a printable character (printable Latin-1 bytes as
    themselves, the others shifted to U+0100 and up), so BPE tokens are strings in vocab.json."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def bpe_parts(ranks, token, below):
    """Byte-pair merging of `token` with only the merges ranked below `below`: for a token of rank r
    and below = r, the two tokens whose merge made it (how tiktoken's ranks encode the merge list)."""
    parts = [bytes([b]) for b in token]
    while len(parts) > 1:
        best = min(((ranks.get(parts[i] + parts[i + 1], below), i) for i in range(len(parts) - 1)))
        if best[0] >= below:
            break
        i = best[1]
        parts[i:i + 2] = [parts[i] + parts[i + 1]]
    return parts


def bpe_vocab_and_merges():
    """r50k_base's ranks -> (vocab {token string: id} with the specials, merges ["a b", ...] in order)."""
    ranks = tokenizer.encoding()._mergeable_ranks
    alphabet = bytes_to_unicode()
    text = lambda b: "".join(alphabet[x] for x in b)  # noqa: E731
    vocab, merges = {}, []
    for token, rank in sorted(ranks.items(), key=lambda item: item[1]):
        vocab[text(token)] = rank
        if len(token) > 1:
            parts = bpe_parts(ranks, token, rank)
            if len(parts) != 2:
                raise InferenceError(f"r50k_base token {rank} is not one merge of two tokens")
            merges.append(f"{text(parts[0])} {text(parts[1])}")
    for name, token_id in sorted(tokenizer.SPECIALS.items(), key=lambda item: item[1]):
        vocab[name] = token_id
    return vocab, merges


def added_tokens():
    return [{"id": token_id, "content": name, "single_word": False, "lstrip": False, "rstrip": False,
             "normalized": False, "special": True}
            for name, token_id in sorted(tokenizer.SPECIALS.items(), key=lambda item: item[1])]


def tokenizer_json(vocab, merges):
    """The `tokenizers` library's file: GPT-2's byte-level pipeline (its pre-tokenizer regex is the
    one r50k_base uses) with this vocabulary."""
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    return {"version": "1.0", "truncation": None, "padding": None, "added_tokens": added_tokens(),
            "normalizer": None, "pre_tokenizer": byte_level,
            "post_processor": {**byte_level, "trim_offsets": False}, "decoder": byte_level,
            "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": "",
                      "end_of_word_suffix": "", "fuse_unk": False, "byte_fallback": False,
                      "vocab": vocab, "merges": merges}}


def tokenizer_config(seq_len):
    specials = {"bos_token": "<|endoftext|>", "eos_token": "<|im_end|>", "unk_token": "<|endoftext|>",
                "pad_token": "<|endoftext|>"}
    config = {"tokenizer_class": "GPT2Tokenizer", "model_max_length": seq_len, "add_prefix_space": False,
              "add_bos_token": False, "clean_up_tokenization_spaces": False, "chat_template": CHAT_TEMPLATE,
              "added_tokens_decoder": {str(t["id"]): {k: v for k, v in t.items() if k != "id"}
                                       for t in added_tokens()},
              **specials}
    specials_map = {**specials, "additional_special_tokens": ["<|im_start|>", "<|im_end|>"]}
    return config, specials_map


def llmc_tokenizer_bytes(vocab_size):
    """llm.c's decoding table: header, then per token a length byte and the token's bytes."""
    enc = tokenizer.encoding()
    header = np.zeros(LLMC_HEADER_INTS, "<u4")
    header[:4] = (LLMC_TOKENIZER_MAGIC, LLMC_TOKENIZER_VERSION, vocab_size, tokenizer.EOT)
    parts = [header.tobytes()]
    for token_id in range(vocab_size):
        b = enc.decode_single_token_bytes(token_id)
        parts += [bytes([len(b)]), b]
    return b"".join(parts)


# ---------------------------------------------------------------------------------------------------

def hf_files(shape, params):
    """{file name: bytes} of the transformers GPT-2 directory."""
    vocab, merges = bpe_vocab_and_merges()
    config, specials_map = tokenizer_config(shape["seq_len"])
    jsons = {"config.json": hf_config(shape),
             "generation_config.json": {"bos_token_id": tokenizer.EOT, "eos_token_id": tokenizer.IM_END,
                                        "pad_token_id": tokenizer.EOT},
             "vocab.json": vocab, "tokenizer.json": tokenizer_json(vocab, merges),
             "tokenizer_config.json": config, "special_tokens_map.json": specials_map}
    return {"model.safetensors":  # "pt": what transformers accepts
            safetensors_bytes(hf_tensors(shape, params), metadata={"format": "pt"}),
            "merges.txt": ("#version: 0.2\n" + "\n".join(merges) + "\n").encode("utf-8"),
            **{name: json_text(obj).encode("utf-8") for name, obj in jsons.items()}}


def llmc_files(shape, params):
    """{file name: bytes} of llm.c's model and tokenizer files."""
    return {"model.bin": llmc_model_bytes(shape, params), "tokenizer.bin": llmc_tokenizer_bytes(shape["vocab_size"])}


def missing_directories(path):
    """path and those of its parents that do not exist yet, outermost first."""
    missing, path = [], os.path.abspath(path)
    while not os.path.lexists(path):
        missing.insert(0, path)
        path = os.path.dirname(path)
    return missing


def clobbered_input(out_dir, names, ckpt):
    """The export's file name in out_dir that is the checkpoint or its sidecar (the same file, a
    hard link too), or None: `export-hf.py run/model.bin run --format llmc` replaced the checkpoint
    it read with llm.c's model.bin and said it had exported."""
    inputs = []
    for path in (ckpt, f"{ckpt}.json"):
        with contextlib.suppress(OSError):
            inputs.append(os.stat(path))
    for name in names:
        with contextlib.suppress(OSError):
            st = os.stat(os.path.join(out_dir, name))
            if any(os.path.samestat(st, other) for other in inputs):
                return name
    return None


@contextlib.contextmanager
def export_lock(out_dir):
    """An exclusive flock on the directory out_dir for the with block: another export into it waits
    (two at once renamed their files by turns: one's config.json beside the other's weights)."""
    fd = os.open(out_dir, os.O_RDONLY | os.O_DIRECTORY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            say(f"waiting for another export into {out_dir} to end")
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def parse_args(argv):
    p = ArgumentParser(description="Export a trained model as a transformers GPT-2 directory "
                       "or an llm.c model file.")
    p.add_argument("model", metavar="RUN_DIR_OR_CHECKPOINT",
                   help="a run directory (runs/<name>/, its <name>.ckpt) or a checkpoint file")
    p.add_argument("out_dir", metavar="OUT_DIR", help="created if missing")
    p.add_argument("--format", choices=("hf", "llmc"), default="hf")
    args = p.parse_args(argv)
    if not args.out_dir:
        p.error("OUT_DIR is empty")
    return args


def main(argv):
    stop_on_sigterm()  # the temporary files and the directories the export made removed, as on Ctrl-C
    args = parse_args(argv)
    try:
        ckpt = resolve_checkpoint(args.model)
        shape, params = read_model_params(ckpt, warn=say)  # a checkpoint without checksums: the engine's warning
        if shape["vocab_size"] != tokenizer.VOCAB_SIZE:
            raise InferenceError(f"the model's vocabulary has {shape['vocab_size']} tokens, not the "
                                 f"{tokenizer.VOCAB_SIZE} of r50k_base + ChatML the tokenizer files describe")
        if os.path.lexists(args.out_dir) and not os.path.isdir(args.out_dir):  # makedirs: "File exists"
            raise InferenceError(f"{args.out_dir} exists and is no directory")
        files = (hf_files if args.format == "hf" else llmc_files)(shape, params)
        clobbered = clobbered_input(args.out_dir, files, ckpt)
        if clobbered:
            raise InferenceError(f"{os.path.join(args.out_dir, clobbered)} is the checkpoint being exported (or its "
                                 "sidecar); the export would replace it: give another OUT_DIR")
        created = missing_directories(args.out_dir)
        try:
            os.makedirs(args.out_dir, exist_ok=True)
            # the file a reader looks for first goes in last: a crash between the renames leaves
            # it missing, not a directory that loads as a whole export with old or missing files
            with export_lock(args.out_dir):
                write_files_atomic(args.out_dir, files, last="config.json" if args.format == "hf" else "model.bin")
        except BaseException:  # a failed export leaves nothing, not even the directories it made
            for directory in reversed(created):
                with contextlib.suppress(OSError):
                    os.rmdir(directory)
            raise
    except (InferenceError, tokenizer.TokenizerUnavailable) as e:
        error(e)
        return 2
    except OSError as e:
        error(f"{e.filename or args.out_dir}: {e.strerror or e}")
        return 2
    except InterruptedWhole:  # it came while the files went in place, and waited until they all were
        return interrupted("export-hf", f"the export to {args.out_dir} was already in place, whole")
    except KeyboardInterrupt:  # the temporary files and the directories the export made are removed
        return interrupted("export-hf", f"nothing was exported to {args.out_dir}")
    say(f"exported {ckpt} (step {shape['step']}) as {args.format} to {args.out_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
