"""Using a trained model (docs/DESIGN.md §5a): `--generate` (JSON request lines in, token lines out,
KV cache), `--evaluate`, and training samples that stop at <|im_end|>.

The CPU engine is checked against the float64 reference (tests/reference.py): its greedy
continuation and its logits. KV-cache decoding is checked against recomputing the whole prefix
(bit for bit on the CPU: both run the same per-row layer functions). The GPU engine (tests marked
`gpu`) is checked against the CPU engine: the same greedy tokens in fp32, logits within tolerance in
fp32 and bf16, the same tokens whatever a request is batched with, and --evaluate equal to its own
training loop's val_loss.
"""
import fcntl
import json
import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

import engine_util as eu
import reference as ref
from engine_util import TINY, tiny_args
from microgpt.checkpoint import read_checkpoint, write_checkpoint
from microgpt.tokenizer import IM_END, IM_START, VOCAB_SIZE
from test_gpu import FP8_SHAPES, cuda_binary  # noqa: F401  (cuda_binary: the fixture; skips without a GPU)

V, T = TINY["model.vocab_size"], TINY["model.seq_len"]
TRAIN = {"train.steps": 150, "train.lr": 1e-2, "eval.every": 150, "eval.batches": 3}
MAX_BATCH = 4

# A float32 engine and the float64 reference may rank two logits differently when they are this
# close; greedy tokens are compared up to the first such near-tie (none occurs in these runs: the
# tests also require a minimum number of compared tokens).
NEAR_TIE = 1e-4
# |logit - reference| in fp32 (the CPU engine against the float64 reference): sums of a few hundred
# products of numbers of order 1, ~1e-6 measured.
LOGIT_TOL_FP32 = 1e-4
# GPU logits against the CPU engine's, normwise relative error ||gpu - cpu|| / ||cpu||: fp32 as
# tests/test_gpu.py's fp32 gradients (summation order only, ~1e-6); bf16 as its bf16 gradients
# (16-bit weights and activations: ~2^-9 per rounding, a few dozen roundings deep).
GPU_LOGIT_TOL = {"fp32": 1e-5, "bf16": 5e-2}


def write_pattern_shard(path, n, seed):
    """Tokens that mostly follow x -> (7x + 3) mod V (one in ten random): a model learns a
    continuation with many distinct tokens, so greedy decoding has something to get right."""
    rng = np.random.default_rng(seed)
    tokens = np.empty(n, dtype=np.int64)
    tokens[0] = 1
    for i in range(1, n):
        tokens[i] = rng.integers(0, V) if rng.random() < 0.1 else (7 * tokens[i - 1] + 3) % V
    eu.write_shard(path, tokens)


@pytest.fixture(scope="module")
def pattern_shards(tmp_path_factory):
    d = tmp_path_factory.mktemp("pattern")
    write_pattern_shard(d / "pattern_train_000000.bin", 8192, seed=1)
    write_pattern_shard(d / "pattern_val_000000.bin", 2048, seed=2)
    return d / "pattern_train_*.bin", d / "pattern_val_*.bin"


@pytest.fixture(scope="module")
def trained(cpu_binary, pattern_shards, tmp_path_factory):
    """A TINY model trained for 150 steps on the CPU, its checkpoint and its reported val_loss."""
    ckpt = tmp_path_factory.mktemp("generate") / "tiny.ckpt"
    res = eu.run_engine(cpu_binary, tiny_args(pattern_shards[0], pattern_shards[1], **TRAIN, checkpoint=ckpt))
    assert res.rc == 0, res.describe()
    val_line = next(line for line in res.lines if '"val_loss"' in line)
    return {"ckpt": ckpt, "val_loss_text": json.loads(val_line, parse_float=str)["val_loss"],
            "params": np.array(read_checkpoint(ckpt).params, dtype=np.float64)}


def model_config():
    return ref.ModelConfig(vocab_size=V, padded_vocab_size=TINY["model.padded_vocab_size"],
                           n_layer=TINY["model.n_layer"], d_model=TINY["model.d_model"],
                           n_head=TINY["model.n_head"], seq_len=T)


def reference_logits(params, tokens):
    """float64 logits [len(tokens), V] of the reference model over one sequence."""
    tokens = np.asarray(tokens)[None, :]
    _, cache = ref.forward(params, model_config(), tokens, np.zeros_like(tokens))
    return cache["xf"][0] @ cache["p"]["wte"][:V].T


class Served:
    """Everything one --generate run printed, grouped by request id."""

    def __init__(self, proc):
        self.rc, self.stderr = proc.returncode, proc.stderr
        self.lines = proc.stdout.splitlines()
        self.records = [json.loads(line) for line in self.lines]
        self.exact = [json.loads(line, parse_float=str) for line in self.lines]

    def of(self, rid):
        return [r for r in self.records if r.get("id") == rid]

    def done(self, rid):
        ends = [r for r in self.of(rid) if r.get("done")]
        assert len(ends) == 1, (rid, self.of(rid), self.stderr)
        return ends[0]

    def tokens(self, rid):
        return self.done(rid)["tokens"]

    def logits_text(self, rid):
        """The logits lines of a request, as the engine printed the numbers."""
        return [r["logits"] for r in self.exact if r.get("id") == rid and "logits" in r]

    def errors(self):
        return [r for r in self.records if "error" in r]


def serve(binary, ckpt, requests, *flags, timeout=120):
    """Runs --generate on the given lines (dicts/lists are JSON-encoded, strings sent as they are)."""
    text = "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in requests)
    proc = subprocess.run([str(binary), "--generate", "--checkpoint", str(ckpt), "--generate.max_batch",
                           str(MAX_BATCH), *map(str, flags)], input=text, capture_output=True, text=True,
                          timeout=timeout)
    served = Served(proc)
    assert served.rc == 0, f"rc={served.rc}\n{proc.stdout[-2000:]}\n{served.stderr[-2000:]}"
    return served


def greedy(rid, prompt, max_tokens=T, **extra):
    return {"id": rid, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **extra}


PROMPTS = [[1, 2, 3], [7], [5, 9, 11, 13, 17, 19, 23]]


# ---------------------------------------------------------------------------------------------------
# the CPU engine against the reference

def test_greedy_tokens_equal_the_float64_reference(cpu_binary, trained):
    served = serve(cpu_binary, trained["ckpt"], [greedy(i, p, logits=True) for i, p in enumerate(PROMPTS)])
    compared = 0
    for i, prompt in enumerate(PROMPTS):
        got = served.tokens(i)
        assert len(got) == T - len(prompt) and served.done(i)["reason"] == "context"
        seq = list(prompt)
        for tok in got:
            logits = reference_logits(trained["params"], seq)[-1]
            top2 = np.sort(logits)[-2:]
            if top2[1] - top2[0] < NEAR_TIE:
                break
            assert tok == int(np.argmax(logits)), (i, seq, tok)
            seq.append(tok)
            compared += 1
        want = reference_logits(trained["params"], prompt)[-1]
        assert np.abs(np.array(served.of(i)[0]["logits"]) - want).max() <= LOGIT_TOL_FP32
    assert compared >= 30, f"only {compared} greedy tokens compared before a near-tie"


def test_kv_cache_decoding_equals_recomputing_the_prefix(cpu_binary, trained):
    """"logits": "all" prints the logits each token is drawn from: from the KV cache after the first.
    Each must equal, bit for bit, the logits of a fresh request whose prompt is the whole prefix."""
    prompt = [4, 8, 15]
    sampled = {"id": "s", "prompt": prompt, "max_tokens": 9, "temperature": 0.8, "seed": 11, "logits": "all"}
    first = serve(cpu_binary, trained["ckpt"], [sampled])
    tokens, decoded = first.tokens("s"), first.logits_text("s")
    assert len(tokens) == len(decoded) == 9
    fresh = serve(cpu_binary, trained["ckpt"],
                  [{"id": i, "prompt": prompt + tokens[:i], "max_tokens": 0, "logits": True} for i in range(9)])
    for i in range(9):
        assert fresh.done(i)["tokens"] == [] and fresh.done(i)["reason"] == "length"
        assert fresh.logits_text(i) == [decoded[i]], f"token {i}: the KV cache and the full prefix differ"


def test_evaluate_equals_the_training_loops_val_loss(cpu_binary, trained, pattern_shards):
    res = eu.run_engine(cpu_binary, ["--evaluate", "--checkpoint", trained["ckpt"], "--data.val", pattern_shards[1],
                                     "--eval.batches", TRAIN["eval.batches"]])
    assert res.rc == 0 and len(res.lines) == 1, res.describe()
    got = json.loads(res.lines[0], parse_float=str)
    assert got["loss"] == trained["val_loss_text"], "not the training loop's val_loss, bit for bit"
    B = TINY["train.batch_size"]
    assert (got["batches"], got["tokens"]) == (3, 3 * B * T)


def test_evaluate_every_window_equals_the_reference(cpu_binary, trained, pattern_shards):
    res = eu.run_engine(cpu_binary, ["--evaluate", "--checkpoint", trained["ckpt"], "--data.val", pattern_shards[1],
                                     "--eval.batches", 0])
    assert res.rc == 0, res.describe()
    got = json.loads(res.lines[0])
    (path,) = pattern_shards[1].parent.glob(pattern_shards[1].name)
    tokens = np.fromfile(path, dtype="<u2", offset=1024).astype(np.int64)
    n = (len(tokens) - 1) // T
    inputs = tokens[:n * T].reshape(n, T)
    targets = tokens[1:n * T + 1].reshape(n, T)
    want, _ = ref.forward(trained["params"], model_config(), inputs, targets)
    assert (got["batches"], got["tokens"]) == (n, n * T)
    assert abs(got["loss"] - want) <= 1e-5 * want, (got, want)


# ---------------------------------------------------------------------------------------------------
# sampling

SAMPLED = {"prompt": [3, 1, 4], "max_tokens": 12, "temperature": 0.9, "top_k": 20, "top_p": 0.95, "seed": 7}


def test_seeded_sampling_is_deterministic_and_batch_independent(cpu_binary, trained):
    others = [{"id": "x", "prompt": [9, 9], "max_tokens": 5, "seed": 1},
              {"id": "y", "prompt": [2] * 10, "max_tokens": 3, "temperature": 0}]
    served = serve(cpu_binary, trained["ckpt"], [
        {"id": "alone", **SAMPLED}, {"id": "again", **SAMPLED},
        [others[0], {"id": "batched", **SAMPLED}, others[1]],
        {"id": "other seed", **SAMPLED, "seed": 8}])
    alone = served.tokens("alone")
    assert len(alone) == 12
    assert served.tokens("again") == alone and served.tokens("batched") == alone
    assert served.tokens("other seed") != alone
    # streamed token lines and the done line agree
    assert [r["token"] for r in served.of("batched") if "token" in r] == alone


@pytest.mark.parametrize("top_k", [5, 0])
def test_sampler_draws_from_the_top_k_softmax(cpu_binary, trained, top_k):
    """The first token of 2000 seeds: only the top-k logits' tokens (0: all), at the frequencies of
    softmax(logits / temperature) over them (bound: 5 standard deviations of a frequency at
    n = 2000). Temperature 3 with the whole vocabulary, so that many tokens are drawn."""
    prompt, n, temp = [6, 2, 8], 2000, 0.7 if top_k else 3.0
    lines = [{"id": "logits", "prompt": prompt, "max_tokens": 0, "logits": True}]
    lines += [{"id": s, "prompt": prompt, "max_tokens": 1, "temperature": temp, "top_k": top_k, "seed": s}
              for s in range(n)]
    served = serve(cpu_binary, trained["ckpt"], lines)
    logits = np.array(served.of("logits")[0]["logits"], dtype=np.float64)
    top = np.argsort(-logits, kind="stable")[:top_k or V]
    p = np.exp((logits[top] - logits[top].max()) / temp)
    p /= p.sum()
    drawn = np.array([served.tokens(s)[0] for s in range(n)])
    assert set(drawn) <= set(top.tolist())
    assert len(set(drawn)) >= min(len(top), 10)
    freq = np.array([(drawn == t).mean() for t in top])
    assert np.abs(freq - p).max() <= 5 * np.sqrt(0.25 / n), (freq, p)


def test_top_p_and_top_k_one_are_greedy_and_padded_rows_never_drawn(cpu_binary, trained):
    served = serve(cpu_binary, trained["ckpt"], [
        greedy("greedy", [1, 2]), {"id": "k1", "prompt": [1, 2], "max_tokens": T, "top_k": 1, "seed": 3},
        {"id": "p0", "prompt": [1, 2], "max_tokens": T, "top_p": 1e-9, "seed": 4},
        {"id": "hot", "prompt": [1], "max_tokens": T, "temperature": 50.0, "seed": 5}])
    assert served.tokens("k1") == served.tokens("greedy") == served.tokens("p0")
    hot = served.tokens("hot")
    assert len(hot) == T - 1 and all(0 <= t < V for t in hot)  # V = 60 real of 64 rows
    assert len(set(hot)) > 5, "temperature 50 should spread the draws"



def test_a_logit_that_overflowed_to_infinity_takes_the_softmax_whole(cpu_binary, tmp_path):
    """A diverged model whose logits overflow: tokens 5 and 7 at +inf hold all of the softmax, half
    each. inf - inf made their weights NaN: top-k sampling drew its k-th best token every time, and
    the full softmax the last infinite one (7), never 5."""
    layout = eu.layout_for()
    n = layout["n_params"]
    params = np.random.default_rng(0).normal(0, 0.02, n).astype(np.float32)
    tensors = {name: params[sl].reshape(sh) for name, (sl, sh) in eu.tensor_slices(layout).items()}
    tensors["lnf.gamma"][:], tensors["lnf.beta"][:] = 0.0, 1e30  # every position's final state 1e30
    tensors["wte"][[5, 7]] = 1e10  # their logits past the largest float: +inf
    ckpt = tmp_path / "inf.ckpt"
    write_checkpoint(ckpt, 0, params, np.zeros(n), np.zeros(n))
    model = [a for k, v in TINY.items() if k.startswith("model.") for a in (f"--{k}", v)]
    served = serve(cpu_binary, ckpt, [{"id": "k", "prompt": [1], "max_tokens": 12, "top_k": 40, "seed": 1},
                                      {"id": "all", "prompt": [1], "max_tokens": 12, "seed": 1}], *model)
    assert set(served.tokens("k")) == set(served.tokens("all")) == {5, 7}, served.records


# ---------------------------------------------------------------------------------------------------
# ending a request, bad requests

def test_stop_ids_max_tokens_and_the_context_window(cpu_binary, trained):
    prompt = [1, 2, 3]
    base = serve(cpu_binary, trained["ckpt"], [greedy("g", prompt)]).tokens("g")
    assert len(base) == T - len(prompt)
    k = next(i for i in range(1, len(base)) if base[i] not in base[:i])
    served = serve(cpu_binary, trained["ckpt"], [
        greedy("stop", prompt, stop=[base[k], 59]), greedy("length", prompt, max_tokens=4),
        greedy("zero", prompt, max_tokens=0), greedy("full", [0] * T, max_tokens=5),
        greedy("last", [0] * (T - 1), max_tokens=5)])
    assert served.tokens("stop") == base[:k + 1] and served.done("stop")["reason"] == "stop"
    assert served.tokens("length") == base[:4] and served.done("length")["reason"] == "length"
    assert served.tokens("zero") == [] and served.done("zero")["reason"] == "length"
    # prompt and generated tokens together fill at most the window of T positions
    assert served.tokens("full") == [] and served.done("full")["reason"] == "context"
    assert len(served.tokens("last")) == 1 and served.done("last")["reason"] == "context"
    done = served.done("length")
    assert done["prompt_tokens"] == 3 and done["ms"] >= 0


BAD = [
    ("not json", "hello", None),
    ("not an object", "[1, 2]", None),
    ("trailing text", '{"id": 1, "prompt": [1]} x', 1),   # a syntax error after the id: the id is known
    ("hex number", '{"id": "h", "prompt": [0x1]}', "h"),
    ("nan", '{"id": "nan", "prompt": [1], "temperature": NaN}', "nan"),
    ("too big a batch", json.dumps([{"id": i, "prompt": [1]} for i in range(MAX_BATCH + 1)]), None),
    ("empty batch", "[]", None),
    ("token out of vocabulary", {"id": "v", "prompt": [1, V]}, "v"),
    ("negative token", {"id": "n", "prompt": [-1]}, "n"),
    ("empty prompt", {"id": "e", "prompt": []}, "e"),
    ("no prompt", {"id": "np"}, "np"),
    ("prompt longer than the window", {"id": "long", "prompt": [1] * (T + 1)}, "long"),
    ("misspelt key", {"id": "k", "prompt": [1], "max_token": 3}, "k"),
    ("key twice", '{"id": "d", "prompt": [1], "max_tokens": 2, "max_tokens": 3}', "d"),
    ("negative temperature", {"id": "t", "prompt": [1], "temperature": -1}, "t"),
    ("top_p of zero", {"id": "p", "prompt": [1], "top_p": 0}, "p"),
    ("fractional max_tokens", {"id": "m", "prompt": [1], "max_tokens": 2.5}, "m"),
    # Python's json reads 2^53 + 1 exactly, a double as 2^53: refused, not drawn with another seed
    ("seed past 2^53", {"id": "big seed", "prompt": [1], "seed": 2**53 + 1}, "big seed"),
    ("stop id out of vocabulary", {"id": "s", "prompt": [1], "stop": [V]}, "s"),
    ("object id", {"id": {"a": 1}, "prompt": [1]}, None),
]


def test_bad_requests_get_one_error_each_and_the_engine_carries_on(cpu_binary, trained):
    lines = [line for _, line, _ in BAD]
    lines.append([{"id": "bad in batch", "prompt": [V]}, greedy("good in batch", [1], max_tokens=2)])
    lines.append(greedy("last", [1], max_tokens=2))
    served = serve(cpu_binary, trained["ckpt"], lines)
    errors = served.errors()
    assert [e["id"] for e in errors] == [rid for _, _, rid in BAD] + ["bad in batch"], errors
    assert all(isinstance(e["error"], str) and e["error"] for e in errors)
    assert next(e["error"] for e in errors if e["id"] == "d") == 'the key "max_tokens" appears twice'
    assert len(served.tokens("good in batch")) == 2 and len(served.tokens("last")) == 2



def test_numbers_out_of_range_are_errors_without_undefined_behaviour(cpu_binary, trained, tmp_path):
    """A number past what its field's C type holds (inf, 1e300, 2^64) was converted to that type
    before the range check's error was acted on: undefined behaviour in C, which compilers may
    assume never happens. The engine built with -fsanitize=float-cast-overflow (a second's build at
    -O0) stops at the first such conversion; served here, every request gets its error."""
    exe = tmp_path / "microgpt_cpu_fco"
    build = subprocess.run(["gcc", "-std=c99", "-O0", "-fsanitize=float-cast-overflow", "-fno-sanitize-recover=all",
                            "-D_POSIX_C_SOURCE=200809L", "-o", str(exe), str(eu.REPO / "microgpt" / "microgpt_cpu.c"),
                            "-lm"], capture_output=True, text=True, timeout=120)
    if build.returncode != 0:
        pytest.skip(f"no float-cast-overflow sanitizer here: {build.stderr[-300:]}")
    requests = [{"id": "max_tokens", "prompt": [1], "max_tokens": 1e300},
                {"id": "top_k", "prompt": [1], "top_k": -1e300},
                {"id": "seed", "prompt": [1], "seed": 2.0**64}, {"id": "prompt", "prompt": [1e300]},
                '{"id": "stop", "prompt": [1], "stop": [-1e999]}']
    served = serve(exe, trained["ckpt"], requests + [greedy("good", [1], max_tokens=1)])
    assert "runtime error" not in served.stderr, served.stderr
    assert [e["id"] for e in served.errors()] == ["max_tokens", "top_k", "seed", "prompt", "stop"], served.errors()
    assert served.tokens("good")


def test_a_request_line_that_is_no_json_text_gets_an_error_not_an_echo(cpu_binary, trained):
    """An id is echoed as written: a string with a bad escape or invalid UTF-8 made every reply to
    it no JSON line, and a NUL byte hid the rest of its line. Each is one error line; every line
    printed is UTF-8 JSON; the next request is served."""
    bad = [b'{"id": "\\q", "prompt": [1]}', b'{"id": "\\u12", "prompt": [1]}',
           b'{"id": "\xff\xfe", "prompt": [1]}', b'{"id": "\xed\xa0\x80", "prompt": [1]}',
           b'{"id": "a", "prompt": [1]}\0{"prompt": [2]}']
    good = [b'{"id": "\\u00e9\\n", "prompt": [1], "max_tokens": 1}', b'{"id": "\xc3\xa9", "prompt": [1], "max_tokens": 1}']
    proc = subprocess.run([str(cpu_binary), "--generate", "--checkpoint", str(trained["ckpt"])],
                          input=b"\n".join(bad + good) + b"\n", capture_output=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    records = [json.loads(line.decode("utf-8")) for line in proc.stdout.splitlines()]
    errors = [r for r in records if "error" in r]
    assert [e["id"] for e in errors] == [None] * len(bad), records
    assert all("malformed string" in e["error"] for e in errors[:-1])
    assert errors[-1]["error"] == "not a request line (a NUL byte at byte 26)"
    assert [r["id"] for r in records if r.get("done")] == ["\u00e9\n", "\u00e9"]


@pytest.mark.parametrize("line, byte", [('{"id"', 5), ('{"a"', 4), ("[", 1), ('[{"prompt":[1]},', 16)])
def test_a_line_that_ends_where_a_colon_or_brace_belongs_is_read_no_further(cpu_binary, trained, line, byte):
    """The reader stepped over the character it expected before checking it, so at a line's end it
    read on past the NUL: into the bytes a longer line left in the buffer (the error named a byte
    beyond the line), or one byte past the buffer itself (a line of 4095 bytes, AddressSanitizer's
    heap-buffer-overflow)."""
    longer = " " * 100  # a blank line: ignored, its spaces stay in the buffer
    served = serve(cpu_binary, trained["ckpt"], [longer, line, {"id": 1, "prompt": [1], "max_tokens": 1}])
    assert [e["error"] for e in served.errors()] == [f"not a request line (" + (
        "expected ':'" if line.startswith('{"') else "a request must be a JSON object") + f" at byte {byte})"]
    assert served.done(1)["reason"] == "length"


def test_model_flags_come_from_the_sidecar_and_bad_setups_are_refused(cpu_binary, trained, tmp_path):
    # the sidecar gave the shape: a contradicting flag is refused by the checkpoint's size
    res = eu.run_engine(cpu_binary, ["--generate", "--checkpoint", trained["ckpt"], "--model.d_model", "64"])
    assert res.rc == 2 and len(res.errors) == 1 and "n_params" in res.errors[0], res.describe()
    res = eu.run_engine(cpu_binary, ["--generate", "--checkpoint", tmp_path / "missing.ckpt"] +
                        [a for k, v in TINY.items() if k.startswith("model.") for a in (f"--{k}", v)])
    assert res.rc == 2 and "does not exist" in res.errors[0], res.describe()
    res = eu.run_engine(cpu_binary, ["--evaluate", "--checkpoint", trained["ckpt"]])
    assert res.rc == 2 and "--data.val" in res.errors[0], res.describe()
    res = eu.run_engine(cpu_binary, ["--generate"])
    assert res.rc == 2 and "--checkpoint" in res.errors[0], res.describe()



@pytest.mark.parametrize("mode", ["--generate", "--evaluate"])
def test_a_model_flag_of_another_shape_with_as_many_parameters_is_refused(cpu_binary, trained, pattern_shards, mode):
    """--model.n_head 2 for the sidecar's 4 (no tensor's size shows n_head) passed the size check,
    and the engine served answers, or a loss, of the weights read as another model's."""
    res = eu.run_engine(cpu_binary, [mode, "--checkpoint", trained["ckpt"], "--data.val", pattern_shards[1],
                                     "--model.n_head", "2"])
    assert res.rc == 2 and len(res.errors) == 1 and "model.n_head 4" in res.errors[0], res.describe()


def test_a_damaged_checkpoint_says_how_to_use_the_previous_one_here(cpu_binary, trained, tmp_path):
    """A damaged checkpoint with a previous slot is refused by --generate as by training, with the
    way back to the previous slot; that way ended "then run again with --resume", a flag --generate
    refuses. Doing what the line says now serves."""
    ckpt = tmp_path / "m.ckpt"
    for suffix in ("", ".json"):
        for slot in ("", ".prev"):
            shutil.copy(f"{trained['ckpt']}{suffix}", f"{ckpt}{slot}{suffix}")
    eu.flip_bit(ckpt, 100)
    args = ["--generate", "--checkpoint", ckpt]
    res = eu.run_engine(cpu_binary, args)
    assert res.rc == 2 and len(res.errors) == 1 and f"mv {ckpt}.prev {ckpt} &&" in res.errors[0], res.describe()
    assert "run again with --resume" not in res.errors[0], res.errors[0]
    os.replace(f"{ckpt}.prev", ckpt)  # what the error line says to do
    os.replace(f"{ckpt}.prev.json", f"{ckpt}.json")
    assert eu.run_engine(cpu_binary, args).rc == 0


@pytest.mark.parametrize("key, value", [("seed", "1337.5"), ("n_layer", "1e400"), ("batch_size", "NaN"),
                                        ("n_head", "4.5"), ("seed", '"1337"'), ("batch_size", "null"),
                                        ("precision", "5"), ("precision", '["fp32"]'), ("n_layer", '"2"'),
                                        ("precision", '"fp3r"'), ("precision", '"FP32"')])
def test_a_model_flag_in_the_sidecar_that_is_no_int_is_refused(cpu_binary, trained, pattern_shards, tmp_path,
                                                                key, value):
    """--evaluate took a sidecar's seed of 1337.5 as 1338 ("%.0f") and drew other batches without a
    word; 1e400 or NaN was refused as the flag "--model.n_layer: 'inf'", which the command line never
    gave. A seed, batch size or precision of another type (a string, null, a number, a list) read as
    missing, so the flag's default ran without a word, and a model flag of another type was refused
    as a missing flag; a precision that is no precision name ("fp3r": a flipped bit) was refused as
    the flag "--train.precision: 'fp3r'". A value no run writes is the sidecar's damage: one error line
    naming it, exit 2."""
    ckpt = tmp_path / "tiny.ckpt"
    ckpt.write_bytes(Path(trained["ckpt"]).read_bytes())
    side = Path(f"{trained['ckpt']}.json").read_text()
    old = f'"{key}":{json.dumps(json.loads(side)["fingerprint"][key])}'
    assert old in side
    Path(f"{ckpt}.json").write_text(side.replace(old, f'"{key}":{value}'))
    res = eu.run_engine(cpu_binary, ["--evaluate", "--checkpoint", ckpt, "--data.val", pattern_shards[1],
                                     "--eval.batches", "1"])
    assert res.rc == 2 and len(res.errors) == 1, res.describe()
    assert f"{ckpt}.json" in res.errors[0] and key in res.errors[0], res.errors
    assert "--model" not in res.errors[0] and "--train" not in res.errors[0], res.errors


@pytest.mark.parametrize("mode", ["--generate", "--evaluate"])
@pytest.mark.parametrize("key, value, sealed, word", [
    ("d_model", 33, True, "fail their own check"),  # each a valid flag, not together: the values' checksum
    ("n_layer", 0, True, "n_layer, 0, is outside"),
    ("n_layer", 0, False, "n_layer, 0, is outside"),  # a sidecar written before values_crc32c
    ("seed", -1, False, "seed, -1, is outside"),
    ("batch_size", 0, False, "batch_size, 0, is outside")])
def test_a_model_flag_in_the_sidecar_that_no_run_writes_is_the_sidecars_damage(cpu_binary, trained, pattern_shards,
                                                                               tmp_path, mode, key, value, sealed,
                                                                               word):
    """A sidecar's value is checked as a flag once it is one: an int out of the flag's range, or a
    d_model that n_head does not divide, was refused as "--model.n_layer: 0 is outside [1, 1024]" or
    "model.n_head (4) must divide model.d_model (33)", an error of a flag the command line never gave,
    without the way back to the previous slot, though the values fail their own checksum."""
    ckpt = tmp_path / "tiny.ckpt"
    ckpt.write_bytes(Path(trained["ckpt"]).read_bytes())
    side = eu.read_sidecar(trained["ckpt"])
    side["fingerprint"][key] = value
    if not sealed:
        del side["values_crc32c"]
    Path(f"{ckpt}.json").write_text(json.dumps(side))
    args = [mode, "--checkpoint", ckpt] + (["--data.val", pattern_shards[1]] if mode == "--evaluate" else [])
    res = eu.run_engine(cpu_binary, args)
    assert res.rc == 2 and len(res.errors) == 1, res.describe()
    assert f"{ckpt}.json" in res.errors[0] and word in res.errors[0], res.errors
    assert "--model" not in res.errors[0] and "--train" not in res.errors[0], res.errors


def test_an_error_quoting_bytes_that_are_no_utf8_is_utf8(cpu_binary, trained, tmp_path):
    """A sidecar's string is decoded as JSON decodes it, a lone surrogate ("\\ud800") to bytes that
    are no UTF-8, as is a flag's value of bytes no text holds: an error line quoting them was not
    UTF-8 either (a strict reader of stderr failed on it). They are written as \\xNN."""
    ckpt = tmp_path / "tiny.ckpt"
    ckpt.write_bytes(Path(trained["ckpt"]).read_bytes())
    side = eu.read_sidecar(trained["ckpt"])
    side["fingerprint"]["precision"] = "fp32\ud800"
    Path(f"{ckpt}.json").write_text(json.dumps(eu.reseal_values(side)))
    for args, shown in ((["--generate", "--checkpoint", str(ckpt)], "fp32\\xed\\xa0\\x80"),
                        (["--generate", "--checkpoint", str(trained["ckpt"]), "--train.precision", b"fp\xff"], "fp\\xff")):
        res = subprocess.run([str(cpu_binary)] + args, stdin=subprocess.DEVNULL, capture_output=True, timeout=60)
        stderr = res.stderr.decode("utf-8")  # strictly
        errors = [l for l in stderr.splitlines() if l.startswith("error:")]
        assert res.returncode == 2 and len(errors) == 1 and shown in errors[0], stderr


@pytest.mark.parametrize("mode", ["--generate", "--evaluate"])
def test_an_empty_checkpoint_path_is_the_flag_error_not_a_sidecar_one(cpu_binary, trained, tmp_path, mode):
    """--checkpoint '' named the sidecar ".json": a file of the working directory of that name was
    read as the checkpoint's sidecar, and its fault was the error line (here a damaged n_layer),
    not the missing --checkpoint."""
    side = eu.read_sidecar(trained["ckpt"])
    side["fingerprint"]["n_layer"] = "x"
    (tmp_path / ".json").write_text(json.dumps(side))
    proc = subprocess.run([str(cpu_binary), mode, "--checkpoint", "", "--data.val", "x"], cwd=tmp_path,
                          stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=60)
    errors = [l for l in proc.stderr.splitlines() if l.startswith("error:")]
    assert proc.returncode == 2 and errors == [f"error: {mode} needs --checkpoint PATH"], proc.stderr


@pytest.mark.parametrize("mode", ["--generate", "--evaluate"])
def test_a_flag_value_that_spells_checkpoint_is_no_checkpoint_flag(cpu_binary, trained, pattern_shards, mode):
    """The sidecar that supplies the model flags was found by scanning the command line for
    "--checkpoint" anywhere, a flag's value too: with a run named "--checkpoint" the sidecar read
    was that of the file "--checkpoint" (none), and the engine stopped with "missing required flag
    --model.n_layer" before the real --checkpoint was looked at. Its value is read where
    config_parse reads it, as the mode flags are."""
    proc = subprocess.run([str(cpu_binary), mode, "--name", "--checkpoint", "--checkpoint", str(trained["ckpt"]),
                           "--data.val", str(pattern_shards[1]), "--eval.batches", str(TRAIN["eval.batches"])],
                          input=json.dumps(greedy(1, [1, 2, 3], max_tokens=2)) + "\n", capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0 and "error" not in proc.stderr, proc.stderr
    answer = json.loads(proc.stdout.splitlines()[-1], parse_float=str)
    assert answer.get("done") if mode == "--generate" else answer["loss"] == trained["val_loss_text"], proc.stdout


@pytest.fixture(scope="module")
def swap_at_open(tmp_path_factory):
    return eu.build_shim(tmp_path_factory, "swap_at_open")


def test_a_checkpoint_replaced_after_its_check_is_not_what_is_loaded(cpu_binary, trained, pattern_shards, tmp_path,
                                                                    swap_at_open):
    """--evaluate and --generate take no lock: a run still writing checkpoints may rename a new file
    over the path between the integrity check and the read of the weights (here, with the shim, as
    --evaluate opens its data.val shard, in between). The weights were read by name from whatever
    file was there then, unverified: a file of NaN weights gave a loss of NaN (served every token as
    id 0). Now they come from the file that was checked: the trained model's loss, bit for bit."""
    ckpt = tmp_path / "m.ckpt"
    shutil.copy(trained["ckpt"], ckpt)
    shutil.copy(f"{trained['ckpt']}.json", f"{ckpt}.json")
    data = bytearray(ckpt.read_bytes())
    data[8:] = np.full((len(data) - 8) // 4, np.nan, dtype="<f4").tobytes()
    (tmp_path / "nan.ckpt").write_bytes(bytes(data))
    (shard,) = pattern_shards[1].parent.glob(pattern_shards[1].name)
    res = eu.run_engine(cpu_binary, ["--evaluate", "--checkpoint", ckpt, "--data.val", shard,
                                     "--eval.batches", TRAIN["eval.batches"]],
                        env={"LD_PRELOAD": str(swap_at_open), "SWAP_PATH": str(ckpt),
                             "SWAP_FROM": str(tmp_path / "nan.ckpt"), "SWAP_WHEN": str(shard), "SWAP_AT_OPEN": "1"})
    assert not (tmp_path / "nan.ckpt").exists(), "the shim swapped nothing"
    assert res.rc == 0 and len(res.lines) == 1, res.describe()
    assert json.loads(res.lines[0], parse_float=str)["loss"] == trained["val_loss_text"], res.describe()


@pytest.mark.parametrize("mode", ["--generate", "--evaluate"])
def test_a_pair_read_between_a_live_runs_renames_is_not_called_damage_to_undo(cpu_binary, trained, pattern_shards,
                                                                             tmp_path, mode):
    """--generate and --evaluate take no lock, so they may read a checkpoint and its sidecar between
    the two renames of an engine still writing there: of different steps, the pair was called
    damaged, with the advice to move the previous slot over it (mv PATH.prev PATH ...), under a run
    that goes on writing. Where another process holds PATH.lock the error says the path is being
    written instead; where none does, the way back is offered as before."""
    ckpt = tmp_path / "m.ckpt"
    for suffix in ("", ".prev"):
        shutil.copy(trained["ckpt"], f"{ckpt}{suffix}")
        side = eu.read_sidecar(trained["ckpt"])
        side["step"] += 10 if suffix == "" else 0  # the newer sidecar renamed in, its checkpoint not yet
        Path(f"{ckpt}{suffix}.json").write_text(json.dumps(side))
    cmd = [str(cpu_binary), mode, "--checkpoint", str(ckpt), "--data.val", str(pattern_shards[1])]
    with open(f"{ckpt}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        live = subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=60)
    errors = [l for l in live.stderr.splitlines() if l.startswith("error:")]
    assert live.returncode == 2 and len(errors) == 1, live.stderr
    assert "is writing checkpoints there" in errors[0] and "mv " not in errors[0], errors
    idle = subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=60)
    errors = [l for l in idle.stderr.splitlines() if l.startswith("error:")]
    assert idle.returncode == 2 and len(errors) == 1 and f"mv {ckpt}.prev {ckpt}" in errors[0], idle.stderr


def test_a_checkpoint_path_too_long_is_the_flag_error_not_a_sidecar_one(cpu_binary, tmp_path):
    """The sidecar is read before the flags are checked: a --checkpoint longer than a path may be
    was cut to the buffer, and the cut name (no PATH.json; another file, even) was opened. The
    flag's own error comes first, as for every other flag."""
    res = eu.run_engine(cpu_binary, ["--evaluate", "--checkpoint", f"{tmp_path}/{'a' * 5000}.ckpt",
                                     "--data.val", "x"])
    assert res.rc == 2 and len(res.errors) == 1, res.describe()
    assert res.errors[0].startswith("error: --checkpoint: value is longer than"), res.errors


@pytest.mark.parametrize("mode", ["--generate", "--evaluate"])
def test_layout_json_in_a_checkpoint_mode_prints_the_checkpoints_layout(cpu_binary, trained, pattern_shards, mode):
    """--layout-json beside --generate or --evaluate was dropped without a word: config_parse returned
    with the model flags alone validated, and the mode went on to serve requests or score the
    checkpoint with the rest of its flags never checked (the size of an activation, fp8's multiples
    of 16). It prints the layout of the checkpoint's model (its sidecar's, flags over it), as
    --print-config prints the settings, and exits 0 without reading a request; the mode still
    needs its --checkpoint."""
    request = json.dumps(greedy(1, [1, 2, 3], max_tokens=2)) + "\n"
    proc = subprocess.run([str(cpu_binary), mode, "--checkpoint", str(trained["ckpt"]), "--data.val",
                           str(pattern_shards[1]), "--layout-json"], input=request, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    assert json.loads(proc.stdout) == eu.layout_for(), proc.stdout
    model = [a for k, v in TINY.items() if k.startswith("model.") for a in (f"--{k}", str(v))]
    res = eu.run_engine(cpu_binary, [mode, *model, "--layout-json"])
    assert res.rc == 2 and res.stdout == "" and res.errors == [f"error: {mode} needs --checkpoint PATH"], res.describe()



def answer_to(binary, stdout, args, requests=b"", timeout=60):
    """An engine run whose stdout is `stdout` (a file object), its stderr's error lines."""
    proc = subprocess.run([str(binary), *map(str, args)], input=requests, stdout=stdout, stderr=subprocess.PIPE,
                          timeout=timeout)
    return proc.returncode, [l for l in proc.stderr.decode().splitlines() if l.startswith("error:")]


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
def test_an_answer_that_cannot_be_written_is_one_error_not_exit_0(cpu_binary, trained, pattern_shards):
    """--generate and --evaluate answer on stdout: one that cannot be written (a full disk) was
    lost without a word, and the engine exited 0 as if it had answered."""
    with open("/dev/full", "wb") as full:
        rc, errors = answer_to(cpu_binary, full, ["--generate", "--checkpoint", trained["ckpt"]],
                               json.dumps(greedy(1, [1], max_tokens=2)).encode() + b"\n")
        assert rc == 1 and len(errors) == 1 and "standard output" in errors[0], errors
        rc, errors = answer_to(cpu_binary, full, ["--evaluate", "--checkpoint", trained["ckpt"], "--data.val",
                                                  pattern_shards[1], "--eval.batches", "1"])
        assert rc == 1 and len(errors) == 1 and "standard output" in errors[0], errors


@pytest.mark.parametrize("restore_signals", [True, False])
def test_a_reader_gone_ends_generate_with_one_error(cpu_binary, trained, restore_signals):
    """A client that stops reading the answers (its stdout pipe closed) but keeps stdin open: the
    engine died of SIGPIPE without a word, or, where a launcher left SIGPIPE ignored
    (restore_signals=False), served every request into the closed pipe until stdin's end and exited
    0. Now: one error line, exit 1, at once."""
    proc = subprocess.Popen([str(cpu_binary), "--generate", "--checkpoint", str(trained["ckpt"])],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            restore_signals=restore_signals)
    proc.stdout.close()
    try:
        proc.stdin.write((json.dumps(greedy(1, [1], max_tokens=T)) + "\n").encode() * 4)
        proc.stdin.flush()
        rc = proc.wait(timeout=60)  # stdin still open: only the failed write may end it
    finally:
        proc.kill()
        proc.stdin.close()
        stderr = proc.stderr.read().decode()
        proc.stderr.close()
    errors = [l for l in stderr.splitlines() if l.startswith("error:")]
    assert rc == 1 and len(errors) == 1 and "standard output" in errors[0], (rc, stderr)


def test_sigusr1_does_not_stop_generate(cpu_binary, trained):
    """SIGUSR1 asks an engine for a checkpoint and never stops it (docs/DESIGN.md §3.6); --generate
    has none to write, but left the signal at its default action, so it died of it without a word,
    mid-session. It now goes on serving."""
    import signal
    import time
    proc = subprocess.Popen([str(cpu_binary), "--generate", "--checkpoint", str(trained["ckpt"])],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        proc.stdin.write((json.dumps(greedy(1, [1], max_tokens=1)) + "\n").encode())
        proc.stdin.flush()
        assert json.loads(proc.stdout.readline())["id"] == 1  # serving
        proc.send_signal(signal.SIGUSR1)
        time.sleep(0.5)
        out, err = proc.communicate((json.dumps(greedy(2, [1], max_tokens=1)) + "\n").encode(), timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 0, (proc.returncode, err.decode()[-1000:])
    last = json.loads(out.splitlines()[-1])
    assert last["id"] == 2 and last["done"] and len(last["tokens"]) == 1, out


def test_a_request_stream_that_cannot_be_read_is_one_error_not_its_end(cpu_binary, trained, tmp_path):
    """stdin that fails to read (here a directory: EISDIR) was taken for the end of the requests,
    exit 0."""
    fd = os.open(tmp_path, os.O_RDONLY)
    try:
        proc = subprocess.run([str(cpu_binary), "--generate", "--checkpoint", str(trained["ckpt"])], stdin=fd,
                              capture_output=True, text=True, timeout=60)
    finally:
        os.close(fd)
    errors = [l for l in proc.stderr.splitlines() if l.startswith("error:")]
    assert proc.returncode == 1 and len(errors) == 1 and "standard input" in errors[0], proc.stderr



def test_a_non_blocking_stdin_or_stdout_waits_for_requests_and_reader(cpu_binary, trained):
    """A launcher may hand over pipes whose open file is non-blocking (O_NONBLOCK, e.g. a Node.js
    parent): the engine's first read, before any request came, failed with EAGAIN and it exited 1
    ("cannot read the requests"), and an answer written while the reader was a moment behind (the
    pipe full) failed so too. The engine now waits for both, as with ordinary pipes."""
    import time
    in_r, in_w = os.pipe()
    out_r, out_w = os.pipe()
    os.set_blocking(in_r, False)
    os.set_blocking(out_w, False)
    proc = subprocess.Popen([str(cpu_binary), "--generate", "--checkpoint", str(trained["ckpt"])], stdin=in_r,
                            stdout=out_w, stderr=subprocess.PIPE)
    os.close(in_r)
    os.close(out_w)
    try:
        time.sleep(1)  # the engine is reading an empty stdin
        request = json.dumps({"id": 1, "prompt": [1], "max_tokens": T - 1, "logits": "all"}) + "\n"
        os.write(in_w, request.encode() * 200)  # some 1.5 MB of answers: far more than a pipe holds
        os.close(in_w)
        out = eu.read_when_behind(out_r, 1)  # the pipe is full meanwhile
        rc = proc.wait(timeout=60)
    finally:
        proc.kill()
        os.close(out_r)
        stderr = proc.stderr.read().decode()
        proc.stderr.close()
    assert rc == 0 and "error:" not in stderr, stderr[-2000:]
    assert sum(json.loads(line).get("done", False) for line in out.splitlines()) == 200


def test_a_request_line_longer_than_any_engine_reads_is_one_error_reply(cpu_binary, trained):
    """A request line was read whole (getline) before it was judged: a line longer than the memory
    left (here under a 256 MB address-space limit) ended the engine. A line longer than the most a
    request line may hold (1 MiB for this model, docs/DESIGN.md §16) is now one error reply, with
    the id read before the cut, its rest skipped unread into memory; the next line is served."""
    import resource

    def limit():
        resource.setrlimit(resource.RLIMIT_AS, (256 << 20, 256 << 20))
    # one thread: each OpenMP thread's stack and malloc arena would count against the limit
    proc = subprocess.Popen([str(cpu_binary), "--generate", "--checkpoint", str(trained["ckpt"])],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, preexec_fn=limit,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    chunk = b"1," * (4 << 20)
    try:
        proc.stdin.write(b'{"id": "long", "prompt": [')
        for _ in range(40):  # 320 MB: past the limit
            proc.stdin.write(chunk)
        proc.stdin.write(b"1]}\n" + json.dumps(greedy("next", [1], max_tokens=1)).encode() + b"\n")
        proc.stdin.close()
    except BrokenPipeError:  # the engine is gone: what it says is the test
        pass
    out, err = proc.stdout.read(), proc.stderr.read()
    proc.stdout.close()
    proc.stderr.close()
    assert proc.wait(timeout=60) == 0, err.decode()[-2000:]
    records = [json.loads(line) for line in out.decode().splitlines()]
    assert records[0] == {"id": "long", "error": "the request line is longer than 1048576 bytes, the most "
                          "a request line may hold here; the rest of it was skipped"}, records
    assert records[-1]["id"] == "next" and records[-1]["done"], records


def test_a_request_line_of_the_most_bytes_is_read_one_more_is_not(cpu_binary, trained):
    """The bound is exact: a line of 1 MiB (the '\\n' not counted) is a request, one byte more is
    an error reply, whatever the line holds past the cut (here a valid request padded with blanks)."""
    head = json.dumps(greedy("edge", [1], max_tokens=1))
    lines = [head + " " * ((1 << 20) - len(head)), head + " " * ((1 << 20) + 1 - len(head)),
             '["x"' + " " * (1 << 20) + "]"]
    served = serve(cpu_binary, trained["ckpt"], lines + [greedy("next", [1], max_tokens=1)])
    assert served.tokens("edge") and [e["id"] for e in served.errors()] == ["edge", None], served.errors()
    assert all("longer than 1048576 bytes" in e["error"] for e in served.errors())
    assert served.tokens("next")


@pytest.mark.parametrize("rid", ["\\ud800", "\\udfff", "a\\ud800b", "\\ud800\\u0041", "\\udc00\\ud800"])
def test_an_id_with_a_lone_surrogate_is_refused_not_echoed(cpu_binary, trained, rid):
    """An id holding a lone UTF-16 surrogate escape ("\\ud800") was echoed as written: JSON text
    that no UTF-8 reader can turn into a string it can write out (Python's json makes one that
    cannot be encoded). It names no Unicode text, so the request is refused: one error reply with id
    null (the id cannot be echoed); a pair, or an escaped backslash before "u", is an id as any."""
    lines = ['{"id": "%s", "prompt": [1], "max_tokens": 1}' % rid,
             '{"id": "\\ud83d\\ude00", "prompt": [1], "max_tokens": 1}',
             '{"id": "\\\\ud800", "prompt": [1], "max_tokens": 1}']
    served = serve(cpu_binary, trained["ckpt"], lines)
    assert [e["id"] for e in served.errors()] == [None], served.errors()
    assert "lone surrogate" in served.errors()[0]["error"], served.errors()
    assert served.tokens("\U0001F600") and served.tokens("\\ud800")


# Requests of one batch whose ids a JSON reader takes for one value (Python's json: escapes read, 1 ==
# 1.0, True == 1; no id is null, as is one refused); a request "_" keeps them company, last: every
# decode step's lines of the batch end with its line.
SAME_IDS = {
    "same text": ('"a"', '"a"'),
    "escapes": ('"a\\u00e9"', '"\\u0061\u00e9"'),
    "numbers": ("1", "1.0"),
    "exponent": ("-0", "0e5"),
    "true and 1": ("true", "1"),
    "false and 0": ("false", "0.0"),
    "no ids": (None, None),
    "null and none": ("null", None),
    "refused and none": ('"\\ud800"', None),
}


@pytest.mark.parametrize("first, second", SAME_IDS.values(), ids=SAME_IDS.keys())
def test_requests_of_one_batch_with_one_id_are_each_refused(cpu_binary, trained, first, second):
    """Two requests of one batch with the same id had their token lines interleaved under that id:
    answers no client could tell apart. Each request of the id gets one error line (naming the
    other's place in the batch, unless it has an error of its own) and no other line; the batch's
    other requests are served. Ids repeat freely across lines: a line's answers all come before the
    next line is read."""
    def request(rid, prompt):
        return "{" + ("" if rid is None else f'"id": {rid}, ') + f'"prompt": {prompt}, "max_tokens": 3}}'
    batch = "[" + ", ".join([request(first, [1, 2]), request(second, [3]), request('"_"', [4])]) + "]"
    served = serve(cpu_binary, trained["ckpt"], [batch, request(second, [1, 2]), request(second, [3])])
    refused = first == '"\\ud800"'  # an id no UTF-8 reader can take: the request's own error, id null
    echoed = None if refused else json.loads(first or "null")
    assert len(served.tokens("_")) == 3
    n_batch = served.records.index(served.done("_")) + 1
    others = [r for r in served.records[:n_batch] if r["id"] != "_"]
    same = ("request {} of this batch has this id too (as JSON readers read ids): the lines of requests decoded "
            "together are told apart by their ids alone, so no request with this id is served")
    own = "id holds a lone surrogate" if refused else same.format(1)
    assert [r["id"] for r in others] == [echoed, echoed] and "error" in others[0], others
    assert others[0]["error"].startswith(own) and others[1] == {"id": echoed, "error": same.format(0)}, others
    later = served.records[n_batch:]
    assert [r["done"] for r in later if "done" in r] == [True, True] and not [r for r in later if "error" in r]


def test_ids_that_only_look_alike_are_served_together(cpu_binary, trained):
    """The rule above is no wider than a reader's equality: a string and a number, a string that
    differs by a U+0000, two numbers a double tells apart, null and "null" are distinct ids."""
    pairs = [('"1"', "1"), ('"a\\u0000"', '"a"'), ("0.1", "0.2"), ("null", '"null"'), ("true", '"true"'),
             ("false", "null"), ("9007199254740990", "9007199254740991")]
    lines = ['[{"id": %s, "prompt": [1], "max_tokens": 2}, {"id": %s, "prompt": [2], "max_tokens": 2}]' % pair
             for pair in pairs]
    served = serve(cpu_binary, trained["ckpt"], lines)
    assert not served.errors() and len([r for r in served.records if r.get("done")]) == 2 * len(pairs), served.errors()
    assert [r["id"] for r in served.records if r.get("done")] == [json.loads(rid) for pair in pairs for rid in pair]


# ---------------------------------------------------------------------------------------------------
# training samples stop at <|im_end|>

CHATML_VOCAB = VOCAB_SIZE  # the engine's TOKEN_IM_START / TOKEN_IM_END must be the tokenizer's


def test_training_samples_stop_at_im_end_for_chatml_prompts(cpu_binary, random_shards, tmp_path):
    """A checkpoint whose every position predicts <|im_end|> (final LayerNorm gamma 0, beta along
    wte[<|im_end|>]) continued for one step at lr 0: the ChatML prompt's sample is <|im_end|> alone,
    the plain prompt's runs to sample.tokens, and --sample.stop overrides the default."""
    shape = {"model.vocab_size": CHATML_VOCAB, "model.padded_vocab_size": 50304}
    layout = eu.layout_for(shape)
    n = layout["n_params"]
    params = np.random.default_rng(0).normal(0, 0.02, n)
    tensors = {name: params[sl].reshape(sh) for name, (sl, sh) in eu.tensor_slices(layout).items()}
    tensors["wte"][IM_END] = 1.0
    tensors["lnf.gamma"][:], tensors["lnf.beta"][:] = 0.0, 1.0

    def run(*flags):
        ckpt = tmp_path / ("chat" + "".join(flags).replace(",", "_") + ".ckpt")  # a fresh one per run
        write_checkpoint(ckpt, 0, params, np.zeros(n), np.zeros(n))
        res = eu.run_engine(cpu_binary, tiny_args(random_shards.train, **shape, **{
            "train.steps": 1, "train.lr": 0, "sample.every": 1, "sample.tokens": 6,
            "sample.prompt": [f"{IM_START},1,2", "1,2"], "checkpoint": ckpt, "resume": True}) + list(flags))
        assert res.rc == 0, res.describe()
        return [s["tokens"] for s in res.events("sample")]

    assert run() == [[IM_END], [IM_END] * 6]
    assert run("--sample.stop", "none") == [[IM_END] * 6, [IM_END] * 6]
    assert run("--sample.stop", f"7,{IM_END}") == [[IM_END], [IM_END]]


def test_samples_end_when_the_window_is_full(cpu_binary, random_shards):
    res = eu.run_engine(cpu_binary, tiny_args(random_shards.train, **{
        "train.steps": 1, "sample.every": 1, "sample.tokens": 40, "sample.prompt": ["1,2,3", ",".join(["5"] * T)]}))
    assert res.rc == 0, res.describe()
    assert [len(s["tokens"]) for s in res.events("sample")] == [T - 3, 0]
    res = eu.run_engine(cpu_binary, tiny_args(random_shards.train, **{
        "train.steps": 1, "sample.every": 1, "sample.prompt": ",".join(["5"] * (T + 1))}))
    assert res.rc == 2 and "model.seq_len" in res.errors[0], res.describe()


# ---------------------------------------------------------------------------------------------------
# the GPU engine against the CPU engine

@pytest.mark.gpu
def test_gpu_greedy_tokens_equal_the_cpu_engine_in_fp32(cuda_binary, cpu_binary, trained):  # noqa: F811
    batch = [greedy(i, p, logits="all") for i, p in enumerate(PROMPTS)]
    cpu = serve(cpu_binary, trained["ckpt"], [batch], "--train.precision", "fp32")
    gpu = serve(cuda_binary, trained["ckpt"], [batch], "--train.precision", "fp32")
    for i in range(len(PROMPTS)):
        # both answers whole before they are zipped: two empty ones compared nothing and passed
        assert gpu.tokens(i) == cpu.tokens(i) and cpu.tokens(i), i
        assert len(gpu.of(i)) == len(cpu.of(i)) and any("logits" in c for c in cpu.of(i)), i
        for c, g in zip(cpu.of(i), gpu.of(i)):
            if "logits" in c:
                assert eu.rel_err(np.array(g["logits"]), np.array(c["logits"])) <= GPU_LOGIT_TOL["fp32"]


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_gpu_generation_is_batch_independent_and_tracks_the_cpu(cuda_binary, cpu_binary, trained,  # noqa: F811
                                                                precision):
    flags = ("--train.precision", precision)
    lines = [{"id": "alone", **SAMPLED, "logits": True},
             [{"id": "x", "prompt": [9, 9], "max_tokens": 5}, {"id": "batched", **SAMPLED, "logits": True}],
             [greedy(i, p) for i, p in enumerate(PROMPTS)]]
    gpu = serve(cuda_binary, trained["ckpt"], lines, *flags)
    cpu = serve(cpu_binary, trained["ckpt"], [{"id": "alone", **SAMPLED, "logits": True}])
    assert gpu.tokens("batched") == gpu.tokens("alone") and len(gpu.tokens("alone")) == 12
    assert gpu.logits_text("batched") == gpu.logits_text("alone")
    assert eu.rel_err(np.array(gpu.of("alone")[0]["logits"]),
                      np.array(cpu.of("alone")[0]["logits"])) <= GPU_LOGIT_TOL[precision]
    for i, p in enumerate(PROMPTS):
        assert len(gpu.tokens(i)) == T - len(p) and all(0 <= t < V for t in gpu.tokens(i))


def test_cpu_generation_in_fp8_is_the_fp32_engines(cpu_binary, trained):  # noqa: F811
    """As on the GPU (next test): the CPU engine generates an fp8 checkpoint in its own precision."""
    line = [{"id": "alone", **SAMPLED, "logits": True}]
    fp8, fp32 = (serve(cpu_binary, trained["ckpt"], line, "--train.precision", p) for p in ("fp8", "fp32"))
    assert fp8.tokens("alone") == fp32.tokens("alone") and len(fp8.tokens("alone")) == 12
    assert fp8.logits_text("alone") == fp32.logits_text("alone")


@pytest.mark.gpu
def test_gpu_generation_in_fp8_is_the_bf16_engines(cuda_binary, trained):  # noqa: F811
    """Generation multiplies in bf16 alone (docs/DESIGN.md §18): asked for fp8 it gives bf16's
    tokens and logits bit for bit, and so needs no FP8 tensor cores."""
    line = [{"id": "alone", **SAMPLED, "logits": True}]
    fp8, bf16 = (serve(cuda_binary, trained["ckpt"], line, "--train.precision", p) for p in ("fp8", "bf16"))
    assert fp8.tokens("alone") == bf16.tokens("alone") and len(fp8.tokens("alone")) == 12
    assert fp8.logits_text("alone") == bf16.logits_text("alone")


# the fp8 weights alone (3 layers), and with all three classifier products in FP8 (d_model 512) wte
# among them (with logits the update keeps wte's copy: its backward reads it)
FP8_SAMPLE_MODELS = {"layers": FP8_SHAPES["odd"],
                     "fp8_classifier": {"model.n_layer": 1, "model.d_model": 512, "model.n_head": 8,
                                        "model.d_ff": 512, "model.seq_len": 48, "model.vocab_size": 100,
                                        "model.padded_vocab_size": 128, "train.batch_size": 3,
                                        "train.fp8_classifier": "all"}}


@pytest.mark.gpu
@pytest.mark.parametrize("model", sorted(FP8_SAMPLE_MODELS))
def test_gpu_fp8_training_samples_read_the_updated_weights(model, cuda_binary, random_shards,  # noqa: F811
                                                           tmp_path):
    """In fp8 training the update leaves the bf16 copy of the fp8 weights, which only generation
    reads, and the engine converts it from the masters before it samples (docs/DESIGN.md §18). So
    the greedy sample after the last update is --generate's greedy continuation from the checkpoint
    of that step (which converts the copy at load); a copy left behind (the weights of step 0,
    8 updates at lr 3e-3 ago, or of any earlier step) gives other tokens."""
    steps, tokens, ckpt = 8, 24, tmp_path / "fp8.ckpt"
    res = eu.run_ok(cuda_binary, tiny_args(random_shards.train, random_shards.val, checkpoint=ckpt, **{
        **FP8_SAMPLE_MODELS[model], "train.precision": "fp8", "train.lr": 3e-3, "train.warmup_steps": 2,
        "train.steps": steps, "eval.every": steps, "eval.batches": 1, "sample.every": steps,
        "sample.tokens": tokens, "sample.temperature": 0, "sample.prompt": ["1,2"]}))
    samples = res.events("sample")
    assert [s["step"] for s in samples] == [steps] and len(samples[0]["tokens"]) == tokens, samples
    served = serve(cuda_binary, ckpt, [greedy("after", [1, 2], max_tokens=tokens)])
    assert served.tokens("after") == samples[0]["tokens"]


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_gpu_evaluate_equals_its_training_loops_val_loss(cuda_binary, random_shards, tmp_path,  # noqa: F811
                                                         precision):
    ckpt = tmp_path / "gpu.ckpt"
    res = eu.run_engine(cuda_binary, tiny_args(random_shards.train, random_shards.val, **TRAIN, checkpoint=ckpt,
                                               **{"train.precision": precision}))
    assert res.rc == 0, res.describe()
    val = json.loads(next(line for line in res.lines if '"val_loss"' in line), parse_float=str)["val_loss"]
    ev = eu.run_engine(cuda_binary, ["--evaluate", "--checkpoint", ckpt, "--data.val", random_shards.val,
                                     "--eval.batches", TRAIN["eval.batches"]])
    assert ev.rc == 0, ev.describe()
    assert json.loads(ev.lines[0], parse_float=str)["loss"] == val
