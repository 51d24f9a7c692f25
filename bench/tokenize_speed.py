"""Tokenizing speed of the data pipeline against tiktoken's own multi-threaded rate (docs/ANDREA.md).

    python3 bench/tokenize_speed.py [--mb 40] [--workers 1,2,N] [--repeats 3] [--raw DIR]
    python3 bench/tokenize_speed.py --mb 15 --save-sample DIR    # a sample to take to another machine

Takes about --mb MB of the default corpus (data/raw, after `make data`: the first files of each
text source plus the chitchat conversations, copied to a temporary folder), then for each worker
count k, best of --repeats:
  tiktoken   encoding.encode_ordinary_batch(texts, num_threads=k) over exactly the texts the
             pipeline encodes (the same chunks, the conversations rendered), nothing else;
  joined     the same call on the same texts joined into ~64 kB strings: tiktoken without the cost
             of one thread-pool task per text (its best case; the token counts differ slightly);
  pipeline   scripts/prep-megachat.py's build() on the same files with --workers k: reading,
             JSON parsing, rendering, hashing, tokenizing, writing the mixed and per-source shards.
It prints tokens/s of each and the pipeline's ratio to both (its target: at least 0.90).
"""
import glob
import importlib.util
import json
import os
import shutil
import sys
import tempfile
import time

from microgpt import tokenizer
from microgpt.cli import ArgumentParser
from microgpt.progress import Progress

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load_prep():
    spec = importlib.util.spec_from_file_location("prep_megachat", os.path.join(ROOT, "scripts", "prep-megachat.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def sample_corpus(raw, dst, mb):
    """Copy about mb MB of the corpus in `raw` to dst, in the same layout: equal shares of each text
    source (SRC/*.txt, SRC/.complete) and of the chitchat conversations; return prep-megachat's
    source arguments for it."""
    sources = sorted(d for d in os.listdir(raw) if os.path.exists(os.path.join(raw, d, ".complete")))
    chat = os.path.join(raw, "chitchat", "chitchat_hermes.jsonl")
    if not sources or not os.path.exists(chat):
        sys.exit(f"error: no corpus in {raw}; run `make data` first")
    share = mb * 1e6 / (len(sources) + 1)
    specs = []
    for name in sources:
        os.makedirs(os.path.join(dst, name))
        size = 0
        for path in sorted(glob.glob(os.path.join(raw, name, "*.txt"))):
            if size >= share:
                break
            shutil.copy(path, os.path.join(dst, name))
            size += os.path.getsize(path)
        open(os.path.join(dst, name, ".complete"), "w").close()
        specs += ["--text", os.path.join(dst, name)]
    os.makedirs(os.path.join(dst, "chitchat"))
    with open(chat, "rb") as src, open(os.path.join(dst, "chitchat", "chitchat_hermes.jsonl"), "wb") as out:
        out.write(src.read(int(share)).rpartition(b"\n")[0] + b"\n")
    return specs + ["--chat", os.path.join(dst, "chitchat", "chitchat_hermes.jsonl")]


def pipeline_texts(sources, chunk_chars):
    """The texts the pipeline hands to the tokenizer, in order."""
    texts = []
    for src in sources:
        for payload, _, _ in src.units(chunk_chars):
            if src.kind == "chat":
                turns = tokenizer.parse_conversation(json.loads(payload))
                # tokenizer.encode_conversation: one call per turn, and "\n" once
                texts += [f"{role}\n{content}" for role, content in turns] + ["\n"]
            else:
                texts.append(payload)
    return texts


def joined(texts, size=64_000):
    out, buf, n = [], [], 0
    for text in texts:
        buf.append(text)
        n += len(text)
        if n >= size:
            out.append("".join(buf))
            buf, n = [], 0
    return out + ["".join(buf)] if buf else out


def best_times(repeats, fns):
    """The best time of each function over `repeats` rounds, the functions taking turns within a
    round, so a busy spell on a shared machine slows them alike; and each one's last result."""
    best, results = [float("inf")] * len(fns), [None] * len(fns)
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            t0 = time.perf_counter()
            results[i] = fn()
            best[i] = min(best[i], time.perf_counter() - t0)
    return best, results


def main():
    ap = ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mb", type=float, default=40)
    ap.add_argument("--workers", default=f"1,2,{os.cpu_count()}")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--raw", default=os.path.join(ROOT, "data", "raw"), help="the corpus (default data/raw)")
    ap.add_argument("--save-sample", metavar="DIR",
                    help="only write the sample to DIR (a --raw for a machine without the corpus)")
    args = ap.parse_args()
    if args.save_sample:
        sample_corpus(args.raw, args.save_sample, args.mb)
        return
    prep = load_prep()
    enc = tokenizer.encoding()
    with tempfile.TemporaryDirectory() as tmp:
        specs = sample_corpus(args.raw, os.path.join(tmp, "in"), args.mb)
        print(f"{'workers':>7} {'tiktoken tok/s':>15} {'joined tok/s':>13} {'pipeline tok/s':>15} "
              f"{'ratio':>6} {'to joined':>9}   (cores: {os.cpu_count()}, sample: {args.mb:g} MB)")
        for k in sorted({int(w) for w in args.workers.split(",")}):
            opts = prep.parse_args([*specs, "--workers", str(k), "--out-dir", os.path.join(tmp, "out")])
            sources = [prep.Source(kind, spec) for kind, spec in opts.sources]
            texts = pipeline_texts(sources, opts.text_chunk_chars)
            big = joined(texts)

            def pipeline():
                build_dir = tempfile.mkdtemp(dir=tmp)
                with open(os.devnull, "w") as quiet:
                    stats, _, _ = prep.build(sources, opts, build_dir, Progress("", None, out=quiet))
                shutil.rmtree(build_dir)
                return sum(st["tokens"][s] for st in stats for s in prep.SPLITS)
            (base_s, join_s, pipe_s), (ids, join_ids, pipe_tok) = best_times(args.repeats, [
                lambda: enc.encode_ordinary_batch(texts, num_threads=k),
                lambda: enc.encode_ordinary_batch(big, num_threads=k), pipeline])
            ntok = sum(map(len, ids))
            join_rate = sum(map(len, join_ids)) / join_s
            rate = pipe_tok / pipe_s
            print(f"{k:>7} {ntok / base_s:>15,.0f} {join_rate:>13,.0f} {rate:>15,.0f} "
                  f"{rate / (ntok / base_s):>6.2f} {rate / join_rate:>9.2f}")


if __name__ == "__main__":
    main()
