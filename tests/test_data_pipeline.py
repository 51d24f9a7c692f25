"""The data pipeline on real data (SPEC §7, §10): chitchat-dataset conversations converted to Hermes
(ShareGPT) records, run through scripts/pull-hermes3.py and scripts/prep-megachat.py as subprocesses,
as a user would; Shakespeare as a plain-text source; the shards read back, split, mixed and fed to
the CPU engine."""
import collections
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from microgpt import tokenizer as tok  # noqa: E402
from microgpt.shards import HEADER_BYTES, ShardError, read_shard, write_shard  # noqa: E402

N_CONVERSATIONS = 600  # a slice of chitchat keeps every run of the scripts well under a second or two
EOT_TEXT = "<|endoftext|>"


def load_script(name):
    spec = importlib.util.spec_from_file_location(name.replace("-", "_"), REPO / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_script(name, *args, env=None):
    return subprocess.run([sys.executable, str(REPO / "scripts" / f"{name}.py"), *map(str, args)],
                          capture_output=True, text=True, timeout=300, env={**os.environ, **(env or {})})


def ok(res):
    assert res.returncode == 0, f"exit {res.returncode}\nstdout:\n{res.stdout[-2000:]}\nstderr:\n{res.stderr[-2000:]}"
    return res


def prep(out_dir, *sources, name="megachat", extra=()):
    return ok(run_script("prep-megachat", *sources, "--out-dir", out_dir, "--name", name, "--workers", 2, *extra))


def shard_tokens(out_dir, name, split):
    paths = sorted(Path(out_dir).glob(f"{name}_{split}_*.bin"))
    assert paths, f"no {name}_{split} shards in {out_dir}"
    return np.concatenate([read_shard(p) for p in paths])


def decoded_docs(out_dir, name, split):
    """The documents of a split, decoded, each with its <|endoftext|>."""
    text = tok.decode(shard_tokens(out_dir, name, split))
    assert text.endswith(EOT_TEXT)
    return [d + EOT_TEXT for d in text.split(EOT_TEXT)[:-1]]


def shard_bytes(out_dir):
    return {p.name: p.read_bytes() for p in sorted(Path(out_dir).glob("*.bin"))}


# ---------------------------------------------------------------- fixtures: real conversations

@pytest.fixture(scope="module")
def chitchat(assets, tmp_path_factory):
    """The first N_CONVERSATIONS chitchat conversations (with a reply) as Hermes records: jsonl and parquet."""
    d = tmp_path_factory.mktemp("chitchat")
    full = d / "all.jsonl"
    written, skipped = load_script("prepare-data").convert_chitchat(assets / "raw" / "chitchat" / "dataset.json", full)
    assert written + skipped == 7168 and written > 4000  # SPEC §10: 7,168 conversations
    lines = full.read_text().splitlines()[:N_CONVERSATIONS]
    jsonl = d / "hermes.jsonl"
    jsonl.write_text("\n".join(lines) + "\n")
    records = [json.loads(line) for line in lines]
    files = {"jsonl": jsonl, "records": records}
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
        pq.write_table(pa.Table.from_pylist(records), d / "hermes.parquet")
        files["parquet"] = d / "hermes.parquet"
    except ImportError:
        pass
    return files


@pytest.fixture(scope="module")
def pulled(chitchat, tmp_path_factory):
    out = tmp_path_factory.mktemp("pulled") / "hermes3.jsonl"
    ok(run_script("pull-hermes3", "--from-file", chitchat["jsonl"], "--out", out))
    return out


@pytest.fixture(scope="module")
def megachat(pulled, tmp_path_factory):
    out = tmp_path_factory.mktemp("megachat")
    res = prep(out, "--chat", pulled, extra=("--val-permille", 100))
    return out, res


def rendered(records):
    return [tok.render_chatml(tok.parse_conversation(r)[0]) + EOT_TEXT for r in records]


# ---------------------------------------------------------------- pull-hermes3

def test_pull_jsonl_and_parquet_give_the_same_records(chitchat, pulled, tmp_path):
    lines = pulled.read_text().splitlines()
    assert len(lines) == N_CONVERSATIONS
    assert [tok.parse_conversation(json.loads(x)) for x in lines] == \
           [tok.parse_conversation(r) for r in chitchat["records"]]
    out = tmp_path / "from_array.jsonl"  # a .json array: streamed element by element
    array = tmp_path / "array.json"
    array.write_text(json.dumps(chitchat["records"], indent=1))
    ok(run_script("pull-hermes3", "--from-file", array, "--out", out))
    assert out.read_bytes() == pulled.read_bytes()
    if "parquet" not in chitchat:
        pytest.skip("pyarrow not installed: parquet input not tested")
    out = tmp_path / "from_parquet.jsonl"
    ok(run_script("pull-hermes3", "--from-file", chitchat["parquet"], "--out", out))
    assert out.read_bytes() == pulled.read_bytes()


BAD_LINES = [
    "{not json",
    json.dumps([1, 2]),
    json.dumps({"conversations": [{"from": "alien", "value": "x"}, {"from": "gpt", "value": "y"}]}),
    json.dumps({"conversations": [{"from": "human", "value": 3}, {"from": "gpt", "value": "y"}]}),
    json.dumps({"conversations": [{"from": "human", "value": "no reply"}]}),
]


@pytest.fixture
def with_bad_records(chitchat, tmp_path):
    """50 real records, the five malformed ones interleaved, and one OpenAI-style record."""
    good = chitchat["jsonl"].read_text().splitlines()[:50]
    openai = json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]})
    lines = good[:10] + BAD_LINES[:3] + good[10:] + [openai] + BAD_LINES[3:]
    (tmp_path / "in").mkdir()
    path = tmp_path / "in" / "mixed.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_pull_counts_malformed_records_and_goes_on(with_bad_records, tmp_path):
    out = tmp_path / "out.jsonl"
    res = ok(run_script("pull-hermes3", "--from-file", with_bad_records, "--out", out))
    assert "56 records read, 51 conversations written" in res.stderr
    assert "5 malformed" in res.stderr and "1 invalid JSON" in res.stderr and "1 unknown role" in res.stderr
    assert len(out.read_text().splitlines()) == 51


def test_prep_counts_malformed_records_and_goes_on(with_bad_records, tmp_path):
    res = prep(tmp_path / "out", "--chat", with_bad_records, extra=("--min-shard-tokens", 100, "--val-permille", 200))
    manifest = json.loads((tmp_path / "out" / "megachat.manifest.json").read_text())
    src = manifest["sources"][0]
    assert sum(src["skipped"].values()) == 5 and src["skipped"]["invalid JSON"] == 1
    assert src["docs"]["train"] + src["docs"]["val"] == 51
    assert "skipped: 1 x unknown role" in res.stdout


def test_pull_resumes_where_it_stopped(chitchat, tmp_path):
    """A pull cut short (here by --max-records) continues from its saved progress and ends with the
    same file as one uninterrupted pull, even when lines were written after the last save (a crash):
    those are cut off, not kept or duplicated."""
    once, twice = tmp_path / "once.jsonl", tmp_path / "twice.jsonl"
    ok(run_script("pull-hermes3", "--from-file", chitchat["jsonl"], "--out", once))
    ok(run_script("pull-hermes3", "--from-file", chitchat["jsonl"], "--out", twice, "--max-records", 250))
    assert len(twice.read_text().splitlines()) == 250
    unsaved = twice.read_text().splitlines()[0] + "\n"
    with open(twice, "a") as f:
        f.write(unsaved * 2000 + '{"conversations": [{"from": "hu')
    res = ok(run_script("pull-hermes3", "--from-file", chitchat["jsonl"], "--out", twice))
    assert "resuming after record 250" in res.stderr
    assert twice.read_bytes() == once.read_bytes()
    res = ok(run_script("pull-hermes3", "--from-file", chitchat["jsonl"], "--out", twice))
    assert "already has 600 conversations" in res.stderr
    twice.unlink()  # a finished pull whose output is gone is pulled again
    res = ok(run_script("pull-hermes3", "--from-file", chitchat["jsonl"], "--out", twice))
    assert "already has" not in res.stderr and twice.read_bytes() == once.read_bytes()


def test_pull_from_unreachable_hub_fails_fast_and_clearly(tmp_path):
    # Port 9 (discard) on localhost: refused at once, no traffic leaves the machine.
    res = run_script("pull-hermes3", "--out", tmp_path / "h.jsonl", "--timeout", 3,
                     env={"HF_ENDPOINT": "http://127.0.0.1:9"})
    assert res.returncode == 1
    assert "cannot reach http://127.0.0.1:9" in res.stderr and "--from-file" in res.stderr


@pytest.mark.parametrize("args, message", [
    (["--from-file", "/nonexistent/x.parquet"], "no such file"),
    (["--from-file", __file__], "unknown extension"),
    (["--max-records", "0"], "--max-records must be positive"),
])
def test_pull_bad_usage(args, message, tmp_path):
    res = run_script("pull-hermes3", *args, "--out", tmp_path / "o.jsonl")
    assert res.returncode == 2 and message in res.stderr


# ---------------------------------------------------------------- prep-megachat

def test_round_trip_shards_decode_to_the_rendered_conversations(chitchat, megachat):
    out, res = megachat
    expected = rendered(chitchat["records"])
    train, val = decoded_docs(out, "megachat", "train"), decoded_docs(out, "megachat", "val")
    assert collections.Counter(train + val) == collections.Counter(expected)
    # Each split keeps input order: it is a subsequence of the input.
    for docs in (train, val):
        it = iter(expected)
        assert all(doc in it for doc in docs)
    assert 30 <= len(val) <= 100  # --val-permille 100 of 600
    assert expected[0].startswith("<|im_start|>user\n") and "<|im_start|>assistant\n" in expected[0]
    # Tokens, not only text: every conversation is exactly encode_conversation of its turns.
    all_tokens = np.concatenate([shard_tokens(out, "megachat", s) for s in ("train", "val")])
    expected_tokens = sum(len(tok.encode_conversation(tok.parse_conversation(r)[0])) for r in chitchat["records"])
    assert len(all_tokens) == expected_tokens
    assert f"{len(train):>10} {len(val):>8}" in res.stdout  # the summary reports the counts


def test_split_is_deterministic_and_per_conversation(chitchat, pulled, megachat, tmp_path):
    out, _ = megachat
    again = tmp_path / "again"
    prep(again, "--chat", pulled, extra=("--val-permille", 100, "--workers", 1))
    assert shard_bytes(again) == shard_bytes(out)  # same bytes, whatever the number of workers
    # Reverse the input and drop every third conversation: each survivor keeps its split.
    lines = pulled.read_text().splitlines()
    subset = tmp_path / "subset.jsonl"
    subset.write_text("\n".join(x for i, x in enumerate(reversed(lines)) if i % 3) + "\n")
    prep(tmp_path / "subset", "--chat", subset, extra=("--val-permille", 100))
    for split in ("train", "val"):
        assert set(decoded_docs(tmp_path / "subset", "megachat", split)) <= set(decoded_docs(out, "megachat", split))


def test_rerun_is_idempotent(pulled, tmp_path):
    prep(tmp_path, "--chat", pulled)
    first = {p: p.stat().st_mtime_ns for p in tmp_path.glob("*.bin")}
    res = prep(tmp_path, "--chat", pulled)
    assert "up to date" in res.stderr and "megachat_train_000000.bin" in res.stdout
    assert {p: p.stat().st_mtime_ns for p in tmp_path.glob("*.bin")} == first
    # Other options are another data set: rebuilt, and no stale shards are left behind.
    before = shard_bytes(tmp_path)
    res = prep(tmp_path, "--chat", pulled, extra=("--shard-tokens", 50_000))
    assert "up to date" not in res.stderr and len(list(tmp_path.glob("megachat_train_*.bin"))) > 1
    prep(tmp_path, "--chat", pulled)
    assert shard_bytes(tmp_path) == before


def test_shards_are_cut_at_shard_tokens(pulled, megachat, tmp_path):
    out, _ = megachat
    prep(tmp_path, "--chat", pulled, extra=("--val-permille", 100, "--shard-tokens", 40_000))
    paths = sorted(tmp_path.glob("megachat_train_*.bin"))
    assert len(paths) >= 3
    assert [p.name for p in paths] == [f"megachat_train_{i:06d}.bin" for i in range(len(paths))]
    # every shard but the last is full; the last holds at least --min-shard-tokens (a short tail is
    # merged into it), so llm.c's loader can read B*T+1 tokens from each
    assert all(len(read_shard(p)) == 40_000 for p in paths[:-1])
    assert 8193 <= len(read_shard(paths[-1])) < 40_000 + 8193
    assert np.array_equal(shard_tokens(tmp_path, "megachat", "train"), shard_tokens(out, "megachat", "train"))


def test_mixing_with_weights_and_a_text_source(assets, pulled, tmp_path):
    plays = assets / "raw" / "shakespeare"
    n_plays = len(list(plays.glob("*.txt")))
    one, two = tmp_path / "one", tmp_path / "two"
    prep(one, "--chat", pulled, "--text", plays, extra=("--val-permille", 100))
    res = prep(two, "--chat", f"{pulled}:0.5", "--text", f"{plays}:2", extra=("--val-permille", 100))
    src1 = json.loads((one / "megachat.manifest.json").read_text())["sources"]
    src2 = json.loads((two / "megachat.manifest.json").read_text())["sources"]
    assert [s["kind"] for s in src2] == ["chat", "text"]  # command-line order
    # Weight 2: every train chunk twice, val chunks once; weight 0.5: about half the conversations.
    assert src2[1]["tokens"]["train"] == 2 * src1[1]["tokens"]["train"] > 0
    assert src2[1]["tokens"]["val"] == src1[1]["tokens"]["val"] > 0
    kept = src2[0]["docs"]["train"] / src1[0]["docs"]["train"]
    assert 0.4 < kept < 0.6, kept
    assert "text" in res.stdout and "chat" in res.stdout
    # The text source round-trips: each play, whole, across its train and val chunks.
    text = tok.decode(shard_tokens(one, "megachat", "train")) + tok.decode(shard_tokens(one, "megachat", "val"))
    assert text.count(EOT_TEXT) == N_CONVERSATIONS + n_plays  # conversations + one per play
    assert "To be, or not to be" in text and "Out, damned spot" in text


@pytest.mark.parametrize("args, message", [
    ([], "give at least one --chat or --text source"),
    (["--chat", "/nonexistent.jsonl"], "no such file or folder"),
    (["--chat", __file__], "expected JSON lines"),
    (["--text", __file__ + ":-1"], "weight must be a finite number >= 0"),
    (["--text", __file__, "--val-permille", "1001"], "--val-permille must be in [0, 1000]"),
])
def test_prep_bad_usage(args, message, tmp_path):
    res = run_script("prep-megachat", *args, "--out-dir", tmp_path)
    assert res.returncode == 2 and message in res.stderr


# ---------------------------------------------------------------- shard format

def test_read_shard_rejects_bad_headers(tmp_path):
    good = tmp_path / "good.bin"
    write_shard(good, np.arange(100) + 50000)
    assert np.array_equal(read_shard(good), np.arange(100) + 50000)
    assert good.stat().st_size == HEADER_BYTES + 200

    def corrupt(name, edit):
        data = bytearray(good.read_bytes())
        edit(data)
        path = tmp_path / name
        path.write_bytes(bytes(data))
        return path

    cases = {
        "bad magic": corrupt("magic.bin", lambda d: d.__setitem__(0, d[0] ^ 1)),
        "unsupported version": corrupt("version.bin", lambda d: d.__setitem__(4, 2)),
        "header promises": corrupt("short.bin", lambda d: d.__delitem__(slice(-2, None))),
        "shorter than": corrupt("tiny.bin", lambda d: d.__delitem__(slice(500, None))),
    }
    for message, path in cases.items():
        with pytest.raises(ShardError, match=message):
            read_shard(path)


# ---------------------------------------------------------------- the default set-up and the engine

def test_prepare_data_falls_back_to_chitchat_and_shakespeare(assets, tmp_path):
    res = ok(run_script("prepare-data", "--source", "chitchat", "--no-corpus", "--data-dir", tmp_path))
    assert "DATA: conversations = FALLBACK" in res.stderr and "chitchat-dataset" in res.stderr
    manifest = json.loads((tmp_path / "megachat" / "megachat.manifest.json").read_text())
    assert [(s["name"], s["kind"]) for s in manifest["sources"]] == [("shakespeare", "text"), ("chitchat", "chat")]
    assert manifest["sources"][1]["docs"]["train"] + manifest["sources"][1]["docs"]["val"] > 4000
    for name in ("megachat", "shakespeare", "polish"):
        for split in ("train", "val"):
            assert len(shard_tokens(tmp_path / name, name, split)) > 10_000
    # the polish set is the conversations alone: the chat source's own set, token for token
    for split in ("train", "val"):
        assert np.array_equal(shard_tokens(tmp_path / "polish", "polish", split),
                              shard_tokens(tmp_path / "megachat" / "sources" / "chitchat", "chitchat", split))
    res = ok(run_script("prepare-data", "--source", "chitchat", "--no-corpus", "--data-dir", tmp_path))
    assert res.stderr.count("up to date") == 3


def test_engine_trains_on_the_shards(megachat, request):
    if not (REPO / "microgpt" / "microgpt_cpu.c").exists():
        pytest.skip("microgpt/microgpt_cpu.c does not exist yet: no engine to feed")
    import engine_util as eu
    binary = request.getfixturevalue("cpu_binary")
    out, _ = megachat
    args = eu.tiny_args(out / "megachat_train_*.bin", out / "megachat_val_*.bin",
                        **{"model.vocab_size": tok.VOCAB_SIZE, "model.padded_vocab_size": 50304,
                           "train.steps": 2, "eval.every": 2, "eval.batches": 2})
    res = eu.run_engine(binary, args)
    assert res.rc == 0, res.describe()
    losses = [r["loss"] for r in res.steps]
    assert len(losses) == 2 and all(np.isfinite(losses))
    # A fresh model predicts about uniformly over the real vocabulary: loss near ln(50259).
    assert abs(losses[0] - np.log(tok.VOCAB_SIZE)) < 1.0
    assert res.vals and np.isfinite(res.vals[-1]["val_loss"])
